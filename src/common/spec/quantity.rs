//! Byte quantities (`memory`, volume `size`): a plain byte count or a whole number
//! with a K, M, G or T suffix (powers of 1024). It owns parsing and the serde
//! glue; it never checks ranges other than overflow (zero is refused by
//! `validate.rs`, so the message can name the field like every other rule).

use std::fmt;

use serde::de::{self, Deserializer, Visitor};

const UNITS: [(char, u32); 4] = [('K', 10), ('M', 20), ('G', 30), ('T', 40)];

/// Parses `"512M"`, `"10G"`, `"1024"` into bytes. Units are powers of 1024;
/// anything else (`"512MB"`, `"512Mi"`, `"1.5G"`, `" 5G"`, `"-1"`) is refused with a
/// message saying what is accepted.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let (digits, shift) = match text.chars().last() {
        Some(c) if c.is_ascii_digit() => (text, 0),
        Some(c) => match UNITS.iter().find(|(u, _)| *u == c) {
            Some((_, shift)) => (&text[..text.len() - 1], *shift),
            None => return Err(bad_unit(text)),
        },
        None => return Err("must not be empty; give a byte count such as 512M".into()),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad_unit(text));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is too large (at most 2^64-1 bytes)"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large (at most 2^64-1 bytes)"))
}

fn bad_unit(text: &str) -> String {
    format!(
        "{text:?} is not a size: use a whole number of bytes, optionally followed by \
         K, M, G or T (powers of 1024), e.g. 512M or 10G"
    )
}

/// Renders bytes with the largest unit that divides them exactly (`512M`,
/// `1536K`, `7`). Used for human output; serialisation writes plain integers.
pub fn format_size(bytes: u64) -> String {
    for (unit, shift) in UNITS.iter().rev() {
        let scale = 1u64 << shift;
        if bytes != 0 && bytes % scale == 0 {
            return format!("{}{unit}", bytes / scale);
        }
    }
    bytes.to_string()
}

/// serde `deserialize_with` for `Option<u64>` sizes: null, an integer, or a
/// suffixed string. Errors are raised inside the visitor so serde_yaml pins them
/// to the scalar's own line and column.
pub(crate) fn deserialize_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct SizeVisitor;
    impl Visitor<'_> for SizeVisitor {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a byte count such as 1073741824 or 1G")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            u64::try_from(v)
                .map(Some)
                .map_err(|_| E::custom(format!("{v} is negative; a size must be positive")))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Err(E::custom(bad_unit(&v.to_string())))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            parse_size(v).map(Some).map_err(E::custom)
        }
    }
    d.deserialize_any(SizeVisitor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_bytes_and_binary_units() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
    }

    #[test]
    fn refuses_bad_units_and_forms() {
        for bad in [
            "", "M", "512MB", "512Mi", "512m", "1.5G", " 5G", "5G ", "-1", "+5", "5P", "0x10",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
        assert!(
            parse_size("512MB")
                .expect_err("refused")
                .contains("K, M, G or T")
        );
    }

    #[test]
    fn refuses_overflow() {
        assert!(
            parse_size("16777216T")
                .expect_err("refused")
                .contains("too large")
        );
        assert!(
            parse_size("99999999999999999999")
                .expect_err("refused")
                .contains("too large")
        );
        assert_eq!(parse_size("16777215T"), Ok(16_777_215u64 << 40));
    }

    #[test]
    fn format_round_trips_through_parse() {
        for bytes in [0, 1, 1023, 1024, 1536 * 1024, 512 << 20, 3 << 40, u64::MAX] {
            assert_eq!(parse_size(&format_size(bytes)), Ok(bytes));
        }
        assert_eq!(format_size(512 << 20), "512M");
    }
}
