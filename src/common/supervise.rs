//! Worker supervision for both daemons: the main thread's signal loop, which
//! also ends when the worker thread dies, and the `/healthz` answer, which
//! goes through the worker with a bounded wait.
//!
//! Why the daemon exits when its worker dies: every route needs the worker,
//! so a daemon without one answers 503 to everything while looking alive to
//! rc.d and monitoring. Exiting non-zero, with the panic message in the log,
//! lets `daemon -r`, rc or an operator restart it, and a restarted daemon
//! rebuilds its state from disk. A watcher thread joins the worker and, when
//! it ends, says so on the channel the main thread waits on, next to the
//! signals, so no signal needs to be raised and no polling is needed.
//!
//! This module never decides what a worker does; it only learns that it
//! stopped or that it answers.

use std::any::Any;
use std::fmt;
use std::io;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Serialize;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::common::http::Response;

/// How long `/healthz` waits for the worker. A worker busy longer than this
/// on one command (a host command that hangs until its timeout) fails the
/// check, which is what an operator's monitoring should see.
pub const HEALTH_WAIT: Duration = Duration::from_secs(2);

/// The worker thread ended by panicking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerDied {
    /// The thread's name.
    pub thread: String,
    /// The panic message.
    pub message: String,
}

impl fmt::Display for WorkerDied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the worker thread {} panicked: {}; the daemon exits so that its supervisor \
             (rc.d, daemon -r) restarts it; report the message with the log around it",
            self.thread, self.message
        )
    }
}

impl std::error::Error for WorkerDied {}

/// Why [`SignalLoop::run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM or SIGINT: an ordinary stop.
    Signal(i32),
    /// The worker thread ended on its own (see [`Watcher::join`]).
    WorkerEnded,
    /// A [`Waker`] asked: the daemon ends what it is doing for a reason
    /// of its own (a control plane that lost its leadership).
    Woken,
}

/// What reaches the main thread's wait.
enum Event {
    Signal(i32),
    /// The worker of [`SignalLoop::watch`] call number `.0` ended.
    WorkerEnded(u64),
    Woken,
}

/// The main thread's wait: SIGTERM and SIGINT stop, SIGHUP calls back, and
/// a watched worker's end or a [`Waker`] stops too.
///
/// Signals are read on a thread of their own and sent, with the watcher's
/// and the wakers' news, down one channel, so one wait sees them all and
/// the loop can be run again after a stop that was no signal (a control
/// plane leads, stands by, and leads again in one process).
pub struct SignalLoop {
    events: Receiver<Event>,
    sender: Sender<Event>,
    /// The number of the last [`SignalLoop::watch`]: the end of an earlier
    /// worker, already joined, stops nothing.
    watched: u64,
}

/// Wakes [`SignalLoop::run`] with [`Stop::Woken`]; cloneable, for any
/// thread.
#[derive(Clone)]
pub struct Waker(Sender<Event>);

impl Waker {
    /// Ends the current [`SignalLoop::run`] (or the next one, if none runs).
    pub fn wake(&self) {
        // The loop is gone only when the daemon is: nothing to wake then.
        let _ = self.0.send(Event::Woken);
    }
}

impl SignalLoop {
    /// Installs the handlers for SIGTERM, SIGINT and SIGHUP and starts the
    /// thread that forwards them. Do it before starting other threads, so
    /// no signal arrives unhandled, and after detaching (a fork keeps no
    /// thread).
    pub fn new() -> io::Result<SignalLoop> {
        let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
        let (sender, events) = mpsc::channel();
        let forward = sender.clone();
        std::thread::Builder::new()
            .name("keel-signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    if forward.send(Event::Signal(signal)).is_err() {
                        return;
                    }
                }
            })?;
        Ok(SignalLoop {
            events,
            sender,
            watched: 0,
        })
    }

    /// A [`Waker`] for this loop.
    pub fn waker(&self) -> Waker {
        Waker(self.sender.clone())
    }

    /// Starts a thread that joins `worker` and then wakes [`SignalLoop::run`].
    /// A panic is logged at error level as soon as it happens.
    pub fn watch(&mut self, worker: JoinHandle<()>) -> io::Result<Watcher> {
        self.watched += 1;
        let number = self.watched;
        let wake = self.sender.clone();
        let thread = std::thread::Builder::new()
            .name("keel-watcher".into())
            .spawn(move || {
                let thread = worker.thread().name().unwrap_or("worker").to_string();
                let outcome = worker.join().map_err(|payload| WorkerDied {
                    thread,
                    message: panic_message(payload.as_ref()),
                });
                if let Err(died) = &outcome {
                    log::error!("{died}");
                }
                let _ = wake.send(Event::WorkerEnded(number));
                outcome
            })?;
        Ok(Watcher { thread })
    }

    /// True when SIGTERM or SIGINT arrived since the last call, without
    /// waiting (a standby's campaign asks between its tries). Whatever else
    /// came meanwhile is dropped: a SIGHUP changes nothing a standby holds
    /// (keys are read again when it leads), and a waker or an old worker
    /// has nothing left to stop.
    pub fn stop_requested(&mut self) -> bool {
        self.events
            .try_iter()
            .any(|e| matches!(e, Event::Signal(s) if s != SIGHUP))
    }

    /// Blocks until SIGTERM or SIGINT arrives, the worker last watched
    /// ends, or a [`Waker`] wakes it; calls `on_hangup` for every SIGHUP
    /// meanwhile.
    pub fn run(&mut self, mut on_hangup: impl FnMut()) -> Stop {
        loop {
            // `self.sender` keeps the channel open: recv cannot fail.
            let Ok(event) = self.events.recv() else {
                return Stop::WorkerEnded;
            };
            match event {
                Event::Signal(SIGHUP) => on_hangup(),
                Event::Signal(signal) => return Stop::Signal(signal),
                Event::WorkerEnded(n) if n == self.watched => return Stop::WorkerEnded,
                Event::WorkerEnded(_) => {}
                Event::Woken => return Stop::Woken,
            }
        }
    }
}

/// The thread started by [`SignalLoop::watch`].
pub struct Watcher {
    thread: JoinHandle<Result<(), WorkerDied>>,
}

impl Watcher {
    /// Waits for the worker to be over: `Err` when it panicked.
    pub fn join(self) -> Result<(), WorkerDied> {
        self.thread.join().unwrap_or_else(|payload| {
            Err(WorkerDied {
                thread: "keel-watcher".into(),
                message: panic_message(payload.as_ref()),
            })
        })
    }
}

/// The text of a panic payload (`panic!` with a literal or a format).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Whether the worker answered a health command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerHealth {
    /// It answered within the wait.
    Answered,
    /// It did not answer within the wait: busy with a long command, or stuck.
    Busy(Duration),
    /// Its channel is closed: the thread is gone.
    Gone,
}

/// Waits at most `wait` for the worker's answer on `rx`.
pub fn await_answer(rx: &Receiver<()>, wait: Duration) -> WorkerHealth {
    match rx.recv_timeout(wait) {
        Ok(()) => WorkerHealth::Answered,
        Err(RecvTimeoutError::Timeout) => WorkerHealth::Busy(wait),
        Err(RecvTimeoutError::Disconnected) => WorkerHealth::Gone,
    }
}

#[derive(Serialize)]
struct Healthy {
    status: &'static str,
}

/// `GET /healthz`: 200 `{"status": "ok"}` when `daemon`'s worker answered,
/// else 503 saying what is wrong.
pub fn healthz_response(health: WorkerHealth, daemon: &str) -> Response {
    match health {
        WorkerHealth::Answered => Response::json(200, &Healthy { status: "ok" }),
        WorkerHealth::Busy(wait) => Response::error(
            503,
            &format!(
                "{daemon}'s worker has not answered within {} s: a command is taking long \
                 (a slow or hung host command) or the worker is stuck; see the daemon's log",
                wait.as_secs_f64()
            ),
            None,
        ),
        WorkerHealth::Gone => Response::error(
            503,
            &format!(
                "{daemon}'s worker thread has stopped; the daemon is exiting, restart it \
                 and see the log for the panic"
            ),
            None,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn the_loop_ends_when_the_watched_worker_panics() {
        let mut signals = SignalLoop::new().expect("signal handlers");
        let worker = std::thread::Builder::new()
            .name("test-worker".into())
            .spawn(|| panic!("boom at {}", 42))
            .expect("spawn");
        let watcher = signals.watch(worker).expect("watch");
        assert_eq!(
            signals.run(|| panic!("no SIGHUP was sent")),
            Stop::WorkerEnded
        );
        assert_eq!(
            watcher.join(),
            Err(WorkerDied {
                thread: "test-worker".into(),
                message: "boom at 42".into(),
            })
        );
    }

    #[test]
    fn a_worker_that_returns_is_no_death() {
        let mut signals = SignalLoop::new().expect("signal handlers");
        let watcher = signals.watch(std::thread::spawn(|| {})).expect("watch");
        assert_eq!(signals.run(|| {}), Stop::WorkerEnded);
        assert_eq!(watcher.join(), Ok(()));
    }

    #[test]
    fn a_waker_ends_the_loop_and_the_loop_runs_again() {
        let mut signals = SignalLoop::new().expect("signal handlers");
        let waker = signals.waker();
        let first = signals
            .watch(std::thread::spawn(|| {}))
            .expect("watch the first worker");
        // The first worker's end is news only until a second is watched.
        first.join().expect("the first worker returns");
        let (release, wait) = mpsc::channel::<()>();
        let second = signals
            .watch(std::thread::spawn(move || {
                let _ = wait.recv();
            }))
            .expect("watch the second worker");
        std::thread::spawn(move || waker.wake());
        assert_eq!(signals.run(|| {}), Stop::Woken);
        drop(release);
        assert_eq!(signals.run(|| {}), Stop::WorkerEnded);
        assert_eq!(second.join(), Ok(()));
    }

    #[test]
    fn health_answers() {
        let (tx, rx) = mpsc::channel();
        tx.send(()).expect("send");
        assert_eq!(
            await_answer(&rx, Duration::from_millis(1)),
            WorkerHealth::Answered
        );
        let wait = Duration::from_millis(1);
        assert_eq!(await_answer(&rx, wait), WorkerHealth::Busy(wait));
        drop(tx);
        assert_eq!(await_answer(&rx, wait), WorkerHealth::Gone);
        assert_eq!(healthz_response(WorkerHealth::Answered, "d").status, 200);
        let busy = healthz_response(WorkerHealth::Busy(HEALTH_WAIT), "keel-agentd");
        assert_eq!(busy.status, 503);
        let body = String::from_utf8_lossy(&busy.body).into_owned();
        assert!(body.contains("not answered within 2 s"), "{body}");
        assert_eq!(healthz_response(WorkerHealth::Gone, "d").status, 503);
    }
}
