//! Names that reach the host and the API: jail, service, volume and node names
//! are DNS labels. One definition, used by spec validation, by every daemon's
//! routes for names in paths, and by the control plane for node ids (which
//! never sees a spec). The names Keel derives from them (replicas
//! `{service}-{index}`, per-replica volumes `{replica}-{volume}`) are built
//! here too, so validation checks exactly the names the host later sees.
//!
//! Every such name becomes a jail name (jail(8), rctl `jail:NAME`), one
//! component of a ZFS dataset name and part of a path; what keeps it valid
//! for all three is [`validate_name`]: never empty, never all digits, at most
//! [`MAX_NAME_LEN`] bytes.

/// Longest name [`validate_name`] accepts: a DNS label's 63 bytes. Far
/// below jail(8)'s limit (MAXHOSTNAMELEN, 256 with the NUL, for a name and
/// for an rctl jail subject) and leaves room for the dataset prefix within
/// [`MAX_DATASET_NAME`].
pub const MAX_NAME_LEN: usize = 63;

/// Most replicas a Service may ask for. Replica names and VIP proxy tables stay
/// small, and a typo such as `replicas: 30000` is refused instead of scheduled.
pub const MAX_REPLICAS: u32 = 1000;

/// Longest ZFS dataset or snapshot name: OpenZFS `ZFS_MAX_DATASET_NAME_LEN`
/// is 256 including the terminating NUL.
pub const MAX_DATASET_NAME: usize = 255;

/// True for a DNS label: `[a-z0-9]([a-z0-9-]*[a-z0-9])?`, at most 63 bytes.
pub fn label_ok(s: &str) -> bool {
    let b = s.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && b.len() <= MAX_NAME_LEN
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
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "must be at most {MAX_NAME_LEN} characters, got {} ({name:?})",
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

/// The name of volume `volume` of replica `replica` (from
/// [`replica_name`]): `{replica}-{volume}`, so replicas never share data.
pub fn replica_volume_name(replica: &str, volume: &str) -> String {
    format!("{replica}-{volume}")
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

    /// Whatever valid service name and index, the replica name contains a
    /// `-`, so it is never all digits (jail(8) would read a jail id), even
    /// for an all-digit index and a service name that is mostly digits; it
    /// and its volumes' names are valid names as long as they fit
    /// [`MAX_NAME_LEN`], which spec validation checks on the longest one.
    #[test]
    fn derived_names_are_valid_names_whatever_the_digits() {
        for (service, index, volume) in [
            ("web", 0, "data"),
            ("0a", 7, "1a"),
            ("1-2", 999, "0-0"),
            ("a", u32::MAX, "9z"),
        ] {
            assert_eq!(validate_name(service), Ok(()), "{service}");
            assert_eq!(validate_name(volume), Ok(()), "{volume}");
            let replica = replica_name(service, index);
            assert_eq!(validate_name(&replica), Ok(()), "{replica}");
            assert!(replica.contains('-'), "{replica}");
            let vol = replica_volume_name(&replica, volume);
            assert_eq!(validate_name(&vol), Ok(()), "{vol}");
            assert_eq!(replica_of(&replica), Some((service, index)));
        }
        let long = "a".repeat(MAX_NAME_LEN - 2);
        assert_eq!(validate_name(&replica_name(&long, 9)), Ok(()));
        assert!(validate_name(&replica_name(&long, 10)).is_err(), "64 bytes");
    }

    #[test]
    fn all_digit_names_are_refused_as_jail_ids() {
        for digits in ["0", "1", "42", "0123"] {
            let err = validate_name(digits).expect_err(digits);
            assert!(err.contains("jail id"), "{err}");
        }
        assert_eq!(validate_name("4-2"), Ok(()));
    }

    #[test]
    fn keel_is_a_reserved_service_name() {
        assert!(reserved_for_replicas("keel").is_some_and(|m| m.contains("\"keel-0\"")));
        assert!(reserved_for_replicas("keeler").is_none());
        assert!(reserved_for_replicas("web").is_none());
    }
}
