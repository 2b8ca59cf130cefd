//! What keelctl prints: the jail table, ages, the one-line results of apply and
//! delete, and JSON/YAML encodings, all as pure functions of their inputs (the
//! current time is a parameter) so they are tested without a daemon.
//!
//! This file never writes to a stream, reads the clock or talks to a daemon;
//! `commands.rs` does that and hands the strings out.
//!
//! Conventions, borrowed from kubectl so its users feel at home: columns are
//! left-aligned and separated by three spaces, the last column is not padded,
//! ages use one unit (`45s`, `3m`, `2h`, `5d`), and an empty list prints no
//! table at all (the caller says "No jails found." on stderr, so a script
//! reading stdout sees nothing).

use serde::Serialize;

use crate::common::wire::JailStatus;

use super::args::OutputFormat;

/// Spaces between two columns.
const COLUMN_GAP: usize = 3;

/// Column headers of `get jails`.
pub const JAIL_COLUMNS: [&str; 6] = ["NAME", "STATE", "ADDRESS", "RESTARTS", "AGE", "LAST ERROR"];

/// Aligns `rows` (the first is the header) into columns. Widths count
/// characters, trailing spaces are trimmed, every line ends with `\n`.
pub fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut widths = vec![0; columns];
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            line.push_str(cell);
            if i + 1 < row.len() {
                let pad = widths[i] - cell.chars().count() + COLUMN_GAP;
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// How long ago `then_unix` was at `now_unix`, in the largest unit that fits:
/// under a minute in seconds, under an hour in minutes, under a day in hours,
/// then days. A time in the future (clock skew between hosts) is `0s`.
pub fn format_age(then_unix: u64, now_unix: u64) -> String {
    let secs = now_unix.saturating_sub(then_unix);
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// Text from a daemon made safe for one table cell or one line: every run of
/// whitespace or control characters (a multi-line stderr, a stray escape
/// sequence) becomes one space.
pub fn one_line(text: &str) -> String {
    text.split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `get jails` table, or `""` when there is no jail.
pub fn jail_table(jails: &[JailStatus], now_unix: u64) -> String {
    if jails.is_empty() {
        return String::new();
    }
    let mut rows = vec![JAIL_COLUMNS.iter().map(|h| h.to_string()).collect()];
    rows.extend(jails.iter().map(|j| {
        vec![
            one_line(&j.name),
            j.state.to_string(),
            j.address.to_string(),
            j.restarts.to_string(),
            format_age(j.created_unix, now_unix),
            j.last_error.as_deref().map(one_line).unwrap_or_default(),
        ]
    }));
    table(&rows)
}

/// The line `apply` prints for one applied jail:
/// `jail/web-1 applied (Running, 10.20.0.2)`, plus the last error when the
/// agent recorded one.
pub fn applied_line(status: &JailStatus) -> String {
    let mut line = format!(
        "jail/{} applied ({}, {})",
        one_line(&status.name),
        status.state,
        status.address
    );
    if let Some(e) = &status.last_error {
        line.push_str(&format!(": last error: {}", one_line(e)));
    }
    line
}

/// The line `delete` prints for one deleted jail.
pub fn deleted_line(name: &str) -> String {
    format!("jail/{} deleted", one_line(name))
}

/// The line `validate` prints: `1 document valid`, `3 documents valid`.
pub fn valid_line(documents: usize) -> String {
    let noun = if documents == 1 {
        "document"
    } else {
        "documents"
    };
    format!("{documents} {noun} valid")
}

/// `value` as pretty JSON or YAML, ending with a newline. `Table` is not an
/// encoding; asking for it is a bug in the caller and answers an error.
pub fn encode(format: OutputFormat, value: &impl Serialize) -> Result<String, String> {
    match format {
        OutputFormat::Json => serde_json::to_string_pretty(value)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        OutputFormat::Yaml => serde_yaml::to_string(value).map_err(|e| e.to_string()),
        OutputFormat::Table => Err("a table is not an encoding".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::wire::Phase;

    fn status(name: &str, state: Phase, addr: [u8; 4], restarts: u32, created: u64) -> JailStatus {
        JailStatus {
            name: name.into(),
            state,
            address: addr.into(),
            restarts,
            created_unix: created,
            last_error: None,
            retry_in_secs: None,
            epoch: None,
            cpu: None,
            memory: None,
        }
    }

    #[test]
    fn ages_use_the_largest_unit_that_fits() {
        let now = 100_000_000;
        let cases = [
            (0, "0s"),
            (45, "45s"),
            (59, "59s"),
            (60, "1m"),
            (3 * 60 + 59, "3m"),
            (3599, "59m"),
            (3600, "1h"),
            (2 * 3600 + 1, "2h"),
            (86_399, "23h"),
            (86_400, "1d"),
            (5 * 86_400 + 7, "5d"),
            (400 * 86_400, "400d"),
        ];
        for (ago, want) in cases {
            assert_eq!(format_age(now - ago, now), want, "{ago}s ago");
        }
    }

    #[test]
    fn a_creation_time_in_the_future_is_zero_seconds_old() {
        assert_eq!(format_age(2_000, 1_000), "0s");
    }

    #[test]
    fn the_jail_table_aligns_every_column_to_its_widest_cell() {
        let now = 10_000;
        let mut crashing = status(
            "database-primary",
            Phase::CrashLoop,
            [10, 20, 0, 12],
            12,
            now - 7200,
        );
        crashing.last_error = Some("jail -c failed:\n  exit 1\tbad".into());
        let jails = [
            status("web-1", Phase::Running, [10, 20, 0, 2], 0, now - 45),
            crashing,
        ];
        let got = jail_table(&jails, now);
        let want = "\
NAME               STATE       ADDRESS      RESTARTS   AGE   LAST ERROR
web-1              Running     10.20.0.2    0          45s
database-primary   CrashLoop   10.20.0.12   12         2h    jail -c failed: exit 1 bad
";
        assert_eq!(got, want);
    }

    #[test]
    fn columns_line_up_by_characters_not_bytes() {
        let got = table(&[
            vec!["A".into(), "B".into()],
            vec!["é".into(), "x".into()],
            vec!["ab".into(), "y".into()],
        ]);
        assert_eq!(got, "A    B\né    x\nab   y\n");
    }

    #[test]
    fn an_empty_list_prints_no_table() {
        assert_eq!(jail_table(&[], 0), "");
    }

    #[test]
    fn result_lines_name_kind_state_and_address() {
        let mut s = status("web-1", Phase::Running, [10, 20, 0, 2], 0, 0);
        assert_eq!(applied_line(&s), "jail/web-1 applied (Running, 10.20.0.2)");
        s.state = Phase::Failed;
        s.last_error = Some("zfs clone failed\n".into());
        assert_eq!(
            applied_line(&s),
            "jail/web-1 applied (Failed, 10.20.0.2): last error: zfs clone failed"
        );
        assert_eq!(deleted_line("web-1"), "jail/web-1 deleted");
        assert_eq!(valid_line(1), "1 document valid");
        assert_eq!(valid_line(3), "3 documents valid");
    }

    #[test]
    fn json_and_yaml_read_back_to_the_same_status() {
        let jails = vec![status("web-1", Phase::Running, [10, 20, 0, 2], 3, 77)];
        let json = encode(OutputFormat::Json, &jails).expect("json");
        assert!(json.ends_with("}\n]\n"), "{json}");
        let back: Vec<JailStatus> = serde_json::from_str(&json).expect("parses");
        assert_eq!(back, jails);
        let yaml = encode(OutputFormat::Yaml, &jails[0]).expect("yaml");
        let back: JailStatus = serde_yaml::from_str(&yaml).expect("parses");
        assert_eq!(back, jails[0]);
        assert!(encode(OutputFormat::Table, &jails).is_err());
    }
}
