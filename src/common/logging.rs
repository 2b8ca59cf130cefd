//! Logging for the daemons: the `log` facade to stderr in the foreground, or
//! to syslog (facility daemon, ident = the program name) when detached.

use std::io::Write;
use std::sync::OnceLock;

use crate::common::config::LogLevel;

/// Writes `LEVEL message` lines to stderr.
struct StderrLogger {
    ident: &'static str,
}

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let _ = writeln!(
                std::io::stderr().lock(),
                "{}: {} {}",
                self.ident,
                record.level(),
                record.args()
            );
        }
    }

    fn flush(&self) {}
}

static STDERR: OnceLock<StderrLogger> = OnceLock::new();

/// The `log` filter for a configured level.
pub fn level_filter(level: LogLevel) -> log::LevelFilter {
    match level {
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Debug => log::LevelFilter::Debug,
    }
}

/// Logs to stderr. Calling it twice keeps the first logger.
pub fn to_stderr(ident: &'static str, level: LogLevel) {
    let logger = STDERR.get_or_init(|| StderrLogger { ident });
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level_filter(level));
    }
}

/// Logs to the local syslog with facility daemon; falls back to stderr when
/// syslogd cannot be reached (and says so there).
pub fn to_syslog(ident: &'static str, level: LogLevel) {
    let formatter = syslog::Formatter3164 {
        facility: syslog::Facility::LOG_DAEMON,
        hostname: None,
        process: ident.into(),
        pid: std::process::id(),
    };
    match syslog::unix(formatter) {
        Ok(writer) => {
            let logger = Box::new(syslog::BasicLogger::new(writer));
            if log::set_boxed_logger(logger).is_ok() {
                log::set_max_level(level_filter(level));
            }
        }
        Err(e) => {
            to_stderr(ident, level);
            log::warn!("cannot reach syslog ({e}); logging to stderr");
        }
    }
}
