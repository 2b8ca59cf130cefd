//! A client that keeps sending requests through one node's proxy for the
//! whole of a scenario and keeps every answer and every failure, so a process
//! test can assert that nothing failed while replicas were replaced, scaled,
//! killed or hung.
//!
//! It paces itself at [`PACE`] (25 requests a second, above the 20 the
//! service tests promise to sustain) and opens one connection per request,
//! as a browser that does not reuse connections would: every request is a
//! new pick of a replica by the proxy. It only records; the tests decide.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Time between the starts of two requests.
pub const PACE: Duration = Duration::from_millis(40);

/// Bound on one request, from connecting to the last byte: longer than any
/// answer of a healthy replica through the proxy, shorter than a hung one.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// What the client saw so far.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Bodies of the 200 answers, in order (`"web-0 v2"`).
    pub answers: Vec<String>,
    /// Every failure, in order.
    pub failures: Vec<Failure>,
}

/// One failed request.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Its number: requests are numbered from 0 as they start.
    pub seq: usize,
    /// What went wrong, and how long after the client started.
    pub what: String,
}

/// The running client; [`Traffic::stop`] ends it and returns what it saw.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    started: Arc<AtomicUsize>,
    seen: Arc<Mutex<Seen>>,
    thread: Option<JoinHandle<()>>,
}

impl Traffic {
    /// Starts sending `GET /` to `addr`.
    pub fn start(addr: SocketAddr) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let thread = {
            let (stop, started, seen) = (stop.clone(), started.clone(), seen.clone());
            std::thread::spawn(move || {
                let start = Instant::now();
                let mut next = Instant::now();
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                    next += PACE;
                    let seq = started.fetch_add(1, Ordering::SeqCst);
                    let answer = get(addr);
                    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                    match answer {
                        Ok(body) => seen.answers.push(body),
                        Err(e) => seen.failures.push(Failure {
                            seq,
                            what: format!("after {:?}: {e}", start.elapsed()),
                        }),
                    }
                }
            })
        };
        Traffic {
            stop,
            started,
            seen,
            thread: Some(thread),
        }
    }

    /// How many requests have started so far: the number the next one gets.
    pub fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    /// A copy of what it saw so far.
    pub fn seen(&self) -> Seen {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The last `n` answers, once there are that many.
    pub fn last(&self, n: usize) -> Option<Vec<String>> {
        let seen = self.seen();
        let len = seen.answers.len();
        (len >= n).then(|| seen.answers[len - n..].to_vec())
    }

    /// Stops the client and returns everything it saw.
    pub fn stop(mut self) -> Seen {
        self.halt();
        self.seen()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.halt();
    }
}

/// One `GET /` on a new connection: the body of a 200, else what failed.
pub fn get(addr: SocketAddr) -> Result<String, String> {
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut conn = TcpStream::connect_timeout(&addr, REQUEST_TIMEOUT)
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    conn.set_read_timeout(Some(left))
        .and_then(|()| conn.set_write_timeout(Some(left)))
        .map_err(|e| e.to_string())?;
    conn.write_all(b"GET / HTTP/1.0\r\n\r\n")
        .map_err(|e| format!("send: {e}"))?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)
        .map_err(|e| format!("read: {e}"))?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("answered {answer:?}"))?;
    if head.split_whitespace().nth(1) != Some("200") {
        return Err(format!("answered {head:?}"));
    }
    Ok(body.trim_end().to_string())
}
