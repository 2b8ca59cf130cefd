//! Golden transcripts: `tests/golden/NAME.txt` holds the exact commands an
//! operation runs and the canned FreeBSD output each one answers with (format:
//! `keel::common::cmd` module docs). [`check`] runs the operation against a
//! [`RecordingRunner`] scripted from the file and fails when the code runs
//! anything else, in another order, or leaves a scripted command unrun.
//!
//! `KEEL_REGENERATE_GOLDEN=1 cargo test` rewrites every transcript from what the
//! code actually ran, keeping the canned outputs by position, for review with
//! `git diff tests/golden`.

use std::path::PathBuf;
use std::sync::Arc;

use keel::common::cmd::{RecordingRunner, Transcript};

/// Directory of the transcripts.
pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn regenerating() -> bool {
    std::env::var_os("KEEL_REGENERATE_GOLDEN").is_some_and(|v| v != "0")
}

/// Runs `operation` against the transcript `name` and checks the commands.
/// `operation` gets the runner to build the FreeBSD implementation on; it
/// asserts on the operation's result itself.
pub fn check<F>(name: &str, operation: F)
where
    F: FnOnce(Arc<RecordingRunner>),
{
    let path = dir().join(format!("{name}.txt"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        if regenerating() {
            String::new()
        } else {
            panic!(
                "golden transcript {} is missing ({e}); create it, or run with KEEL_REGENERATE_GOLDEN=1",
                path.display()
            )
        }
    });
    let transcript = Transcript::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if regenerating() {
        let runner = Arc::new(RecordingRunner::regenerating(&transcript));
        operation(runner.clone());
        let rewritten = Transcript {
            header: transcript.header.clone(),
            exchanges: runner.ran(),
        };
        std::fs::write(&path, rewritten.render())
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let runner = Arc::new(RecordingRunner::from_transcript(&transcript));
    operation(runner.clone());
    if let Err(diff) = runner.verify() {
        panic!(
            "{} and the code disagree: {diff}\n(after review, KEEL_REGENERATE_GOLDEN=1 rewrites it)",
            path.display()
        );
    }
}
