//! pf anchors under `keel/`: Keel loads and flushes its own anchors and never
//! touches the admin's main ruleset.

use std::fmt;

use crate::common::cmd::CmdError;

/// Whether pf.conf references Keel's anchors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnchorCheck {
    /// `rdr-anchor "keel/*"` is in the translation rules.
    pub rdr: bool,
    /// `anchor "keel/*"` is in the filter rules.
    pub filter: bool,
}

/// A pf operation that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PfError {
    /// A command failed or could not run (a rules syntax error lands here
    /// with pfctl's message).
    Command(CmdError),
}

impl fmt::Display for PfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PfError::Command(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for PfError {}

impl From<CmdError> for PfError {
    fn from(e: CmdError) -> Self {
        PfError::Command(e)
    }
}

/// Keel's pf anchors.
pub trait Firewall: Send {
    /// Replaces the rules of `anchor` (e.g. `keel/ingress`) with `rules`.
    fn load_anchor(&self, anchor: &str, rules: &str) -> Result<(), PfError>;
    /// Removes every rule of `anchor`.
    fn flush_anchor(&self, anchor: &str) -> Result<(), PfError>;
    /// Reports whether the main ruleset references `keel/*`.
    fn check_anchors(&self) -> Result<AnchorCheck, PfError>;
}
