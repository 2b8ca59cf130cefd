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

/// Names of jails Keel runs itself (the ingress jail, `keel-ingress`) start
/// with this; no Jail may, and no Service whose replicas would.
pub const RESERVED_PREFIX: &str = "keel-";

/// The name of replica `index` of service `service`: `{service}-{index}`.
pub fn replica_name(service: &str, index: u32) -> String {
    format!("{service}-{index}")
}

/// The service and index a jail name would be a replica of, for a name of
/// the form `{service}-{index}` with a canonical index (`web-01` is not
/// replica 1 of `web`). Any such name is taken by the service of that name
/// if one exists.
pub fn replica_of(name: &str) -> Option<(&str, u32)> {
    let (service, index) = name.rsplit_once('-')?;
    let n: u32 = index.parse().ok()?;
    (!service.is_empty() && n.to_string() == index).then_some((service, n))
}

/// Why service `name`'s replicas would take reserved names, if they would:
/// `keel` names its first replica `keel-0`.
pub fn reserved_for_replicas(name: &str) -> Option<String> {
    let first = replica_name(name, 0);
    first.starts_with(RESERVED_PREFIX).then(|| {
        format!(
            "a service named {name:?} would name its replicas {first:?} and so on, and {RESERVED_PREFIX:?} is reserved for the jails Keel runs itself (keel-ingress); choose another name"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_names_round_trip_and_only_canonical_indices_count() {
        assert_eq!(replica_of(&replica_name("web", 12)), Some(("web", 12)));
        assert_eq!(replica_of("my-web-0"), Some(("my-web", 0)));
        assert_eq!(replica_of("web-01"), None);
        assert_eq!(replica_of("web-x"), None);
        assert_eq!(replica_of("web"), None);
        assert_eq!(replica_of("-3"), None);
    }

    #[test]
    fn keel_is_a_reserved_service_name() {
        assert!(reserved_for_replicas("keel").is_some_and(|m| m.contains("\"keel-0\"")));
        assert!(reserved_for_replicas("keeler").is_none());
        assert!(reserved_for_replicas("web").is_none());
    }
}
