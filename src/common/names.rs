//! Names that reach the host and the API: jail, service, volume and node names
//! are DNS labels. One definition, used by spec validation, by every daemon's
//! routes for names in paths, and by the control plane for node ids (which
//! never sees a spec).

/// True for a DNS label: `[a-z0-9]([a-z0-9-]*[a-z0-9])?`, at most 63 bytes.
pub fn label_ok(s: &str) -> bool {
    let b = s.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= 63
        && b.first().is_some_and(inner)
        && b.last().is_some_and(inner)
        && b.iter().all(|c| inner(c) || *c == b'-')
}

/// Checks a name (jail, service, ingress, volume, node): a DNS label
/// `[a-z0-9]([a-z0-9-]*[a-z0-9])?` of at most 63 characters. Also used by the
/// HTTP routes for names in paths.
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > 63 {
        return Err(format!(
            "must be at most 63 characters, got {} ({name:?})",
            name.len()
        ));
    }
    if !label_ok(name) {
        return Err(format!(
            "must be a DNS label: lowercase letters a-z, digits and '-', starting and \
             ending with a letter or digit (got {name:?})"
        ));
    }
    // jail(8), jls -j and jexec read an all-digit name as a jail id.
    if name.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "must contain a letter or '-': jail(8) reads an all-digit name as a jail id (got {name:?})"
        ));
    }
    Ok(())
}
