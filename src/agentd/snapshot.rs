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
//! A reader that must react to a change at once (the cluster thread sends
//! a heartbeat as soon as a placed jail's readiness flips) registers a
//! callback with [`Snapshot::on_publish`]; the publisher calls it after each
//! publish and when it closes, outside the value's lock. A callback must
//! only record that something was published and wake its thread, never do
//! the work: it runs on the publisher's (the worker's) thread.
//!
//! It never runs anything and never blocks on anything but that lock.

use std::sync::{Arc, Mutex, RwLock};

use crate::common::sync::lock;

/// Called after each publish and on close; see the module docs.
pub type OnPublish = Arc<dyn Fn() + Send + Sync>;

struct Shared<T> {
    value: RwLock<Option<Arc<T>>>,
    watchers: Mutex<Vec<OnPublish>>,
}

impl<T> Shared<T> {
    fn set(&self, value: Option<Arc<T>>) {
        // A reader that panicked cannot have left the slot half-written: it
        // only clones the Arc. So a poisoned lock still holds a whole value.
        *self.value.write().unwrap_or_else(|p| p.into_inner()) = value;
        let watchers = lock(&self.watchers).clone();
        for watcher in watchers {
            watcher();
        }
    }
}

/// The writing half; see the module docs.
pub struct Publisher<T> {
    shared: Arc<Shared<T>>,
}

/// The reading half, cheap to clone; see the module docs.
pub struct Snapshot<T> {
    shared: Arc<Shared<T>>,
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
    let shared = Arc::new(Shared {
        value: RwLock::new(Some(Arc::new(initial))),
        watchers: Mutex::new(Vec::new()),
    });
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
        self.shared.set(Some(Arc::new(value)));
    }
}

impl<T> Drop for Publisher<T> {
    fn drop(&mut self) {
        self.shared.set(None);
    }
}

impl<T> Snapshot<T> {
    /// The last value published, or `None` once the publisher is gone.
    pub fn latest(&self) -> Option<Arc<T>> {
        self.shared
            .value
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Calls `watcher` after every later publish, and once when the
    /// publisher is gone; see the module docs.
    pub fn on_publish(&self, watcher: OnPublish) {
        lock(&self.shared.watchers).push(watcher);
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
    fn watchers_hear_of_every_publish_and_of_the_close() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (publisher, snapshot) = channel(1);
        let heard = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&heard);
        snapshot.on_publish(Arc::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        publisher.publish(2);
        publisher.publish(3);
        assert_eq!(heard.load(Ordering::SeqCst), 2);
        drop(publisher);
        assert_eq!(heard.load(Ordering::SeqCst), 3, "the close is heard too");
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
