//! Lock helper shared by everything that keeps state behind a `Mutex`.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poisoning: a thread that panicked while holding the lock
/// (a failed test, a bug in a handler) leaves data that is still a valid
/// record, and stopping every other user of it would turn one failure into many.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
