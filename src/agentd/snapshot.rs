//! A value one thread publishes and others read without waiting for it: the
//! worker publishes its jail statuses after every command and every pass
//! ([`crate::agentd::worker`]), and the cluster thread builds each heartbeat
//! from the last one, so a host command that takes 30 s never delays a
//! heartbeat.
//!
//! The [`Publisher`] is the only writer. A write swaps one `Arc` under a
//! lock held for that swap alone, so a reader waits at most for a pointer
//! assignment, never for the work the writer does between publishes; a
//! reader gets the `Arc` and reads it after the lock is released. When the
//! publisher is dropped (its thread returned, or unwound from a panic) the
//! snapshot is closed and readers get `None`: a heartbeat must stop when
//! the worker is gone, not go on reporting what the worker last saw.
//!
//! It never runs anything and never blocks on anything but that lock.

use std::sync::{Arc, RwLock};

/// The writing half; see the module docs.
pub struct Publisher<T> {
    shared: Arc<RwLock<Option<Arc<T>>>>,
}

/// The reading half, cheap to clone; see the module docs.
pub struct Snapshot<T> {
    shared: Arc<RwLock<Option<Arc<T>>>>,
}

impl<T> Clone for Snapshot<T> {
    fn clone(&self) -> Self {
        Snapshot {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// A publisher and a reader of it, starting at `initial`, so a reader never
/// sees "nothing yet".
pub fn channel<T>(initial: T) -> (Publisher<T>, Snapshot<T>) {
    let shared = Arc::new(RwLock::new(Some(Arc::new(initial))));
    (
        Publisher {
            shared: Arc::clone(&shared),
        },
        Snapshot { shared },
    )
}

impl<T> Publisher<T> {
    /// Makes `value` what readers get from now on.
    pub fn publish(&self, value: T) {
        let value = Arc::new(value);
        // A reader that panicked cannot have left the slot half-written: it
        // only clones the Arc. So a poisoned lock still holds a whole value.
        *self.shared.write().unwrap_or_else(|p| p.into_inner()) = Some(value);
    }
}

impl<T> Drop for Publisher<T> {
    fn drop(&mut self) {
        *self.shared.write().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl<T> Snapshot<T> {
    /// The last value published, or `None` once the publisher is gone.
    pub fn latest(&self) -> Option<Arc<T>> {
        self.shared
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_get_the_initial_value_then_each_newer_one() {
        let (publisher, snapshot) = channel(vec!["a"]);
        let other = snapshot.clone();
        assert_eq!(snapshot.latest().as_deref(), Some(&vec!["a"]));
        publisher.publish(vec!["a", "b"]);
        assert_eq!(snapshot.latest().as_deref(), Some(&vec!["a", "b"]));
        assert_eq!(other.latest().as_deref(), Some(&vec!["a", "b"]));
    }

    #[test]
    fn a_value_already_read_is_unchanged_by_a_later_publish() {
        let (publisher, snapshot) = channel(1);
        let held = snapshot.latest().expect("published");
        publisher.publish(2);
        assert_eq!((*held, snapshot.latest().as_deref()), (1, Some(&2)));
    }

    #[test]
    fn the_snapshot_closes_when_the_publisher_is_dropped() {
        let (publisher, snapshot) = channel(1);
        drop(publisher);
        assert_eq!(snapshot.latest(), None);
    }

    #[test]
    fn the_snapshot_closes_when_the_publishing_thread_panics() {
        let (publisher, snapshot) = channel(1);
        let thread = std::thread::spawn(move || {
            publisher.publish(2);
            panic!("the worker died");
        });
        assert!(thread.join().is_err(), "the thread panicked");
        assert_eq!(
            snapshot.latest(),
            None,
            "a dead worker's last value is not reported as current"
        );
    }
}
