//! Running host commands: argv only, absolute paths, a timeout on every call.
//!
//! Everything Keel asks of FreeBSD goes through [`CommandRunner`]. The real
//! runner ([`SystemRunner`]) spawns the program directly with its arguments: there
//! is no shell anywhere, so nothing in a name or a spec can be reinterpreted as
//! shell syntax. A non-zero exit status is *not* an error at this level, because
//! several FreeBSD commands report idempotent outcomes through it (`route add` on
//! an existing route, `rctl -r` with no rules); callers decide, and use
//! [`CmdOutput::check`] when any failure is a failure.
//!
//! [`RecordingRunner`] is the test double: it answers from a script of expected
//! argv and canned output and records a mismatch on any unexpected command. Its
//! script format is the golden transcript format of `tests/golden/`, written and
//! read by [`Transcript`]:
//!
//! ```text
//! # comment lines and blank lines are ignored
//! $ /sbin/zfs clone -o mountpoint=/usr/local/jails/web zroot/keel/bases/14.5-RELEASE@keel zroot/keel/jails/web
//! < a line fed to the command's stdin
//! > a line the command printed on stdout
//! ! a line the command printed on stderr
//! = 0
//! ```
//!
//! `= N` is the exit status (omitted means 0). Arguments containing spaces,
//! quotes or nothing at all are written in single quotes, `'` inside them as
//! `'\''`, exactly as an admin would type them into sh(1).

use std::collections::VecDeque;
use std::fmt;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What a finished command left behind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CmdOutput {
    /// Exit status; a command killed by a signal reports 128 + signal number.
    pub status: i32,
    /// Everything written to stdout, lossily decoded as UTF-8.
    pub stdout: String,
    /// Everything written to stderr, lossily decoded as UTF-8.
    pub stderr: String,
}

impl CmdOutput {
    /// True when the command exited 0.
    pub fn success(&self) -> bool {
        self.status == 0
    }

    /// `Ok(self)` on exit 0, else [`CmdError::Failed`] carrying the argv, status
    /// and trimmed stderr (stdout when stderr is empty: `route` reports there).
    pub fn check(self, argv: &[String]) -> Result<CmdOutput, CmdError> {
        if self.success() {
            return Ok(self);
        }
        let detail = if self.stderr.trim().is_empty() {
            self.stdout.trim()
        } else {
            self.stderr.trim()
        };
        Err(CmdError::Failed {
            command: render_argv(argv),
            status: self.status,
            stderr: detail.to_string(),
        })
    }
}

/// A command that could not be run to completion, or that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmdError {
    /// The program could not be started (missing binary, permissions).
    Spawn {
        /// The command line, rendered for humans.
        command: String,
        /// The operating system's reason.
        reason: String,
    },
    /// The command ran past its deadline and was killed.
    Timeout {
        /// The command line, rendered for humans.
        command: String,
        /// The deadline that passed.
        after: Duration,
    },
    /// The command exited non-zero where the caller needed success.
    Failed {
        /// The command line, rendered for humans.
        command: String,
        /// Its exit status.
        status: i32,
        /// Its trimmed stderr (or stdout when stderr was empty).
        stderr: String,
    },
    /// A [`RecordingRunner`] was asked to run something its script did not expect.
    Unexpected {
        /// The command line that was run.
        command: String,
        /// What the script expected instead.
        expected: String,
    },
}

impl fmt::Display for CmdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CmdError::Spawn { command, reason } => {
                write!(f, "could not start `{command}`: {reason}")
            }
            CmdError::Timeout { command, after } => write!(
                f,
                "`{command}` did not finish within {}s and was killed",
                after.as_secs_f64()
            ),
            CmdError::Failed {
                command,
                status,
                stderr,
            } => {
                write!(f, "`{command}` exited with status {status}")?;
                if !stderr.is_empty() {
                    write!(f, ": {stderr}")?;
                }
                Ok(())
            }
            CmdError::Unexpected { command, expected } => {
                write!(f, "unexpected command `{command}` (expected {expected})")
            }
        }
    }
}

impl std::error::Error for CmdError {}

/// Runs one program with its arguments. Implementations never use a shell.
pub trait CommandRunner: Send + Sync {
    /// Run `argv` (`argv[0]` an absolute path) with optional stdin, killing it
    /// after `timeout`. Non-zero exit is reported in [`CmdOutput::status`].
    fn run(
        &self,
        argv: &[String],
        stdin: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<CmdOutput, CmdError>;
}

impl<T: CommandRunner + ?Sized> CommandRunner for std::sync::Arc<T> {
    fn run(
        &self,
        argv: &[String],
        stdin: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<CmdOutput, CmdError> {
        (**self).run(argv, stdin, timeout)
    }
}

/// Builds an owned argv from string slices: `argv(&["/sbin/zfs", "list"])`.
pub fn argv<S: AsRef<str>>(parts: &[S]) -> Vec<String> {
    parts.iter().map(|p| p.as_ref().to_string()).collect()
}

/// The real runner: `std::process::Command` with the argv, nothing else.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemRunner;

/// How often a running child is polled for exit while waiting for its deadline.
const WAIT_POLL: Duration = Duration::from_millis(5);

impl CommandRunner for SystemRunner {
    fn run(
        &self,
        argv: &[String],
        stdin: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<CmdOutput, CmdError> {
        let command = render_argv(argv);
        let Some((program, args)) = argv.split_first() else {
            return Err(CmdError::Spawn {
                command,
                reason: "empty argv".into(),
            });
        };
        let mut child = Command::new(program)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| CmdError::Spawn {
                command: command.clone(),
                reason: e.to_string(),
            })?;

        // stdin, stdout and stderr each get their own thread so a command that
        // fills one pipe while we block on another cannot deadlock us.
        let feeder = match (stdin, child.stdin.take()) {
            (Some(bytes), Some(mut pipe)) => {
                let bytes = bytes.to_vec();
                Some(std::thread::spawn(move || {
                    // A command that exits without reading its stdin closes the
                    // pipe; that is its business, reported through its status.
                    let _ = pipe.write_all(&bytes);
                }))
            }
            _ => None,
        };
        let out_reader = child.stdout.take().map(drain);
        let err_reader = child.stderr.take().map(drain);

        let deadline = Instant::now() + timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(CmdError::Timeout {
                        command,
                        after: timeout,
                    });
                }
                Ok(None) => std::thread::sleep(WAIT_POLL),
                Err(e) => {
                    return Err(CmdError::Spawn {
                        command,
                        reason: e.to_string(),
                    });
                }
            }
        };
        if let Some(f) = feeder {
            let _ = f.join();
        }
        let stdout = out_reader.map(join_drain).unwrap_or_default();
        let stderr = err_reader.map(join_drain).unwrap_or_default();
        Ok(CmdOutput {
            status: exit_code(status),
            stdout,
            stderr,
        })
    }
}

fn drain<R: Read + Send + 'static>(mut pipe: R) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        buf
    })
}

fn join_drain(handle: std::thread::JoinHandle<Vec<u8>>) -> String {
    let bytes = handle.join().unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// Renders argv the way an admin would type it into sh(1): plain words as
/// they are, anything else in single quotes.
pub fn render_argv(argv: &[String]) -> String {
    argv.iter()
        .map(|a| quote_word(a))
        .collect::<Vec<_>>()
        .join(" ")
}

fn quote_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+^[]{}".contains(c) || !c.is_ascii());
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Splits a line rendered by [`render_argv`] back into argv.
pub fn parse_argv(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut current = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => {
                if in_word {
                    words.push(std::mem::take(&mut current));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(ch) => current.push(ch),
                        None => return Err(format!("unterminated quote in `{line}`")),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some(ch) => current.push(ch),
                    None => return Err(format!("trailing backslash in `{line}`")),
                }
            }
            other => {
                in_word = true;
                current.push(other);
            }
        }
    }
    if in_word {
        words.push(current);
    }
    Ok(words)
}

/// One command of a transcript: what ran and what it answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exchange {
    /// The exact argv.
    pub argv: Vec<String>,
    /// Bytes fed to stdin, if any.
    pub stdin: Option<String>,
    /// What the command answered.
    pub output: CmdOutput,
}

/// A golden transcript: a readable list of [`Exchange`]s (format in the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transcript {
    /// Comment lines at the top of the file, without the leading `# `.
    pub header: Vec<String>,
    /// The commands in the order they ran.
    pub exchanges: Vec<Exchange>,
}

impl Transcript {
    /// Parses the transcript text format.
    pub fn parse(text: &str) -> Result<Transcript, String> {
        let mut t = Transcript::default();
        let mut seen_command = false;
        for (no, raw) in text.lines().enumerate() {
            let line_no = no + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let (tag, rest) = raw.split_at(1);
            let rest = rest.strip_prefix(' ').unwrap_or(rest);
            let current = t.exchanges.last_mut();
            match (tag, current) {
                ("#", _) => {
                    if !seen_command {
                        t.header.push(rest.to_string());
                    }
                }
                ("$", _) => {
                    seen_command = true;
                    let argv = parse_argv(rest).map_err(|e| format!("line {line_no}: {e}"))?;
                    t.exchanges.push(Exchange {
                        argv,
                        ..Exchange::default()
                    });
                }
                ("<", Some(ex)) => push_line(ex.stdin.get_or_insert_with(String::new), rest),
                (">", Some(ex)) => push_line(&mut ex.output.stdout, rest),
                ("!", Some(ex)) => push_line(&mut ex.output.stderr, rest),
                ("=", Some(ex)) => {
                    ex.output.status = rest
                        .trim()
                        .parse()
                        .map_err(|_| format!("line {line_no}: bad exit status `{rest}`"))?;
                }
                _ => {
                    return Err(format!(
                        "line {line_no}: expected `$ command` or one of `# < > ! =` after a command, got `{raw}`"
                    ));
                }
            }
        }
        Ok(t)
    }

    /// Renders the transcript text format; `parse(render(t)) == t`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for h in &self.header {
            out.push_str(&format!("# {h}\n").replace("# \n", "#\n"));
        }
        for ex in &self.exchanges {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(&format!("$ {}\n", render_argv(&ex.argv)));
            if let Some(stdin) = &ex.stdin {
                for l in stdin.lines() {
                    out.push_str(&format!("< {l}\n"));
                }
            }
            for l in ex.output.stdout.lines() {
                out.push_str(&format!("> {l}\n"));
            }
            for l in ex.output.stderr.lines() {
                out.push_str(&format!("! {l}\n"));
            }
            if ex.output.status != 0 {
                out.push_str(&format!("= {}\n", ex.output.status));
            }
        }
        out
    }
}

fn push_line(buf: &mut String, line: &str) {
    buf.push_str(line);
    buf.push('\n');
}

/// Test double: answers from a script, records every call, and remembers the
/// first command that differed from the script.
///
/// In *regenerate* mode it accepts any command, answering with the canned
/// output of the script entry at the same position (or plain success past the
/// end), so a golden file can be rewritten from what the code actually ran.
#[derive(Debug, Default)]
pub struct RecordingRunner {
    state: Mutex<RecordingState>,
}

#[derive(Debug, Default)]
struct RecordingState {
    script: VecDeque<Exchange>,
    ran: Vec<Exchange>,
    mismatch: Option<String>,
    regenerate: bool,
}

impl RecordingRunner {
    /// A runner that expects exactly `script`, in order.
    pub fn new(script: Vec<Exchange>) -> RecordingRunner {
        RecordingRunner {
            state: Mutex::new(RecordingState {
                script: script.into(),
                ..RecordingState::default()
            }),
        }
    }

    /// A runner scripted from a transcript.
    pub fn from_transcript(t: &Transcript) -> RecordingRunner {
        RecordingRunner::new(t.exchanges.clone())
    }

    /// A runner that records whatever runs, answering with the script's canned
    /// outputs by position (see the type docs).
    pub fn regenerating(t: &Transcript) -> RecordingRunner {
        let r = RecordingRunner::from_transcript(t);
        r.lock().regenerate = true;
        r
    }

    /// A runner with no script that answers every command with exit 0 and no
    /// output, recording what ran. For counting and benchmarks.
    pub fn permissive() -> RecordingRunner {
        let r = RecordingRunner::default();
        r.lock().regenerate = true;
        r
    }

    /// Appends expectations to the script (for tests built in code).
    pub fn expect(&self, exchange: Exchange) {
        self.lock().script.push_back(exchange);
    }

    /// Everything that ran so far, with the answers given.
    pub fn ran(&self) -> Vec<Exchange> {
        self.lock().ran.clone()
    }

    /// Forgets what ran so far (keeps the remaining script).
    pub fn clear_ran(&self) {
        self.lock().ran.clear();
    }

    /// `Ok` when every scripted command ran, in order, and nothing else did;
    /// otherwise a description of the first difference.
    pub fn verify(&self) -> Result<(), String> {
        let st = self.lock();
        if let Some(m) = &st.mismatch {
            return Err(m.clone());
        }
        if !st.regenerate && !st.script.is_empty() {
            let missing: Vec<String> = st.script.iter().map(|e| render_argv(&e.argv)).collect();
            return Err(format!(
                "expected commands never ran:\n  {}",
                missing.join("\n  ")
            ));
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RecordingState> {
        // A panicking test thread poisons the lock; the data is still a valid
        // record of what ran, so keep using it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl CommandRunner for RecordingRunner {
    fn run(
        &self,
        argv: &[String],
        stdin: Option<&[u8]>,
        _timeout: Duration,
    ) -> Result<CmdOutput, CmdError> {
        let mut st = self.lock();
        let stdin = stdin.map(|b| String::from_utf8_lossy(b).into_owned());
        let next = st.script.pop_front();
        let output = if st.regenerate {
            next.map(|e| e.output).unwrap_or_default()
        } else {
            match next {
                Some(e) if e.argv == argv && stdin_matches(&e.stdin, &stdin) => e.output,
                other => {
                    let expected = other
                        .map(|e| format!("`{}`", render_argv(&e.argv)))
                        .unwrap_or_else(|| "no further command".into());
                    let command = render_argv(argv);
                    if st.mismatch.is_none() {
                        st.mismatch = Some(format!(
                            "command #{} was `{command}`, expected {expected}",
                            st.ran.len() + 1
                        ));
                    }
                    return Err(CmdError::Unexpected { command, expected });
                }
            }
        };
        st.ran.push(Exchange {
            argv: argv.to_vec(),
            stdin,
            output: output.clone(),
        });
        Ok(output)
    }
}

fn stdin_matches(expected: &Option<String>, got: &Option<String>) -> bool {
    // Transcripts store stdin line by line, so compare ignoring one trailing newline.
    let norm = |s: &Option<String>| s.as_deref().map(|s| s.trim_end_matches('\n').to_string());
    norm(expected) == norm(got)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argv_round_trips_through_rendering() {
        let cases = [
            vec!["/sbin/zfs", "list", "-H"],
            vec!["/usr/sbin/jail", "exec.start=/bin/sh /etc/rc", ""],
            vec!["it's", "a \"quote\"", "$HOME", "a;b"],
        ];
        for case in cases {
            let a = argv(&case);
            assert_eq!(parse_argv(&render_argv(&a)), Ok(a));
        }
    }

    #[test]
    fn transcript_round_trips() {
        let text = "# clone\n\n$ /sbin/zfs clone a@keel b\n> out\n! err\n= 1\n\n$ /sbin/pfctl -a keel/ingress -f -\n< rdr pass\n";
        let t = Transcript::parse(text).expect("parses");
        assert_eq!(t.exchanges.len(), 2);
        assert_eq!(t.exchanges[0].output.status, 1);
        assert_eq!(t.exchanges[1].stdin.as_deref(), Some("rdr pass\n"));
        assert_eq!(Transcript::parse(&t.render()), Ok(t));
    }

    #[test]
    fn recording_runner_flags_unexpected_commands() {
        let r = RecordingRunner::new(vec![Exchange {
            argv: argv(&["/bin/a"]),
            ..Exchange::default()
        }]);
        let err = r.run(&argv(&["/bin/b"]), None, Duration::from_secs(1));
        assert!(matches!(err, Err(CmdError::Unexpected { .. })));
        assert!(r.verify().is_err());
    }

    #[test]
    fn recording_runner_reports_commands_that_never_ran() {
        let r = RecordingRunner::new(vec![Exchange {
            argv: argv(&["/bin/a"]),
            ..Exchange::default()
        }]);
        assert!(r.verify().unwrap_err().contains("/bin/a"));
    }

    #[test]
    fn system_runner_captures_output_and_status() {
        let out = SystemRunner
            .run(
                &argv(&["/bin/cat"]),
                Some(b"hello\n"),
                Duration::from_secs(10),
            )
            .expect("cat runs");
        assert_eq!(out.stdout, "hello\n");
        assert!(out.success());
        let out = SystemRunner
            .run(&argv(&["/bin/false"]), None, Duration::from_secs(10))
            .expect("false runs");
        assert_eq!(out.status, 1);
        assert!(out.check(&argv(&["/bin/false"])).is_err());
    }

    #[test]
    fn system_runner_kills_at_the_deadline() {
        let err = SystemRunner
            .run(
                &argv(&["/bin/sleep", "30"]),
                None,
                Duration::from_millis(50),
            )
            .expect_err("times out");
        assert!(matches!(err, CmdError::Timeout { .. }), "{err}");
    }

    #[test]
    fn system_runner_reports_missing_programs() {
        let err = SystemRunner
            .run(&argv(&["/nonexistent/x"]), None, Duration::from_secs(1))
            .expect_err("spawn fails");
        assert!(err.to_string().contains("/nonexistent/x"));
    }
}
