//! One accepted connection: choose replicas, connect (bounded, retried on
//! the next replicas of its turn while a replica refuses, times out or resets
//! before its first byte), then relay bytes both ways until both sides closed.
//!
//! It owns the two sockets of that connection and nothing else; it never
//! looks at the service table (it got its [`Backends`] at accept time, and
//! only tells it how each replica it tried did) and never blocks its thread.
//! It counts itself in its service's counters while it relays, and the
//! bytes relayed (one relaxed atomic add per read while relaying, see
//! `super::stats`).
//! It decides what counts as a failed replica: a refused or timed-out
//! connect, a reset before the first byte. A replica that closes cleanly
//! before sending anything has answered (some protocols end that way).
//!
//! Memory is the constraint that shaped the relay loop: 10,000 idle relayed
//! connections must cost less than HAProxy's. A connection's state holds no
//! buffer. Bytes are read into one buffer per runtime thread and written
//! straight on; only what the destination does not take at once (it is
//! slower than the source) is copied into a per-direction backlog, which is
//! freed as soon as it drained. An idle connection is its task, its two
//! sockets and a few hundred bytes of state.
//!
//! Until the replica's first byte, what the client sends is also kept (at
//! most [`REPLAY_MAX`]) so that a replica resetting before it answered is
//! replaced by the next one without the client noticing; the copy is freed
//! as soon as the replica answers.
//!
//! Half-close: end of stream from one side becomes `shutdown(SHUT_WR)` on the
//! other, and the opposite direction keeps flowing. An error on either
//! direction (a reset, a broken pipe) ends both and closes both sockets.
//!
//! System calls per connection are what the rate of new connections
//! depends on, so the common path avoids the ones that tell nothing new:
//! no `getsockopt(SO_ERROR)` after a connect the poller reported as
//! established, no read that would return `EAGAIN` (see `pipe`).

use std::cell::RefCell;
use std::future::poll_fn;
use std::io;
use std::net::{Shutdown, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, Interest, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{ReadHalf, WriteHalf};

use super::balance::Backends;
use super::stats::ServiceCounters;

/// Size of the per-thread read buffer: large reads keep bulk transfers at a
/// few syscalls per 64 KiB, and since the buffer is shared by every
/// connection on the thread its size costs nothing per connection.
pub const RELAY_BUF: usize = 64 * 1024;

thread_local! {
    static BUF: RefCell<Box<[u8]>> = RefCell::new(vec![0; RELAY_BUF].into_boxed_slice());
}

/// Most client bytes kept for a replay while the replica has not answered:
/// a request larger than this is committed to its replica once sent.
pub const REPLAY_MAX: usize = 64 * 1024;

/// Serves one accepted client connection to the end: tries the replicas of
/// its turn in order (see [`Backends::pick`]) until one connects and does not
/// reset before its first byte, reporting each outcome to `backends`, then
/// relays, counted in the service's counters ([`Backends::counters`]).
pub async fn serve(mut client: TcpStream, backends: Arc<Backends>, connect_timeout: Duration) {
    let Some(attempts) = backends.pick() else {
        // No replica: the listener stays up, the client learns at once.
        return;
    };
    let mut replay = Replay::default();
    let mut failures = Vec::new();
    for replica in attempts.iter() {
        let addr = replica.addr();
        let mut backend = match connect(addr, connect_timeout).await {
            Ok(s) => s,
            Err(e) => {
                backends.failed(addr);
                log::debug!("proxy: replica {addr} unreachable ({e})");
                failures.push(format!("{addr} ({e})"));
                continue;
            }
        };
        let open = replica.open();
        let answered = match opening(&mut client, &mut backend, &mut replay, open.counters()).await
        {
            Ok(Opening::Answered(backlog)) => {
                backends.succeeded(addr);
                backlog
            }
            Ok(Opening::Committed) => Backlog::default(),
            Ok(Opening::Reset(e)) => {
                backends.failed(addr);
                log::debug!("proxy: replica {addr} reset before answering ({e})");
                failures.push(format!("{addr} (reset before answering: {e})"));
                continue;
            }
            Err(e) => {
                log::debug!("proxy: client left before replica {addr} answered ({e})");
                return;
            }
        };
        // Everything the client sent so far is in the replay copy and went
        // to this replica (once, however often it was replayed). Counted
        // here rather than per read so that the state of a connection still
        // choosing its replica, the largest one, holds nothing for it.
        backends
            .counters()
            .to_replica
            .fetch_add(replay.data.len() as u64, Ordering::Relaxed);
        // Answered or committed: nothing will be replayed, and an idle
        // relayed connection must hold no buffer.
        drop(replay);
        drop(backends);
        // TCP_NODELAY: the client socket inherited it from the listener, the
        // backend's was set before connecting.
        if let Err(e) = relay(client, backend, open.counters(), answered).await {
            log::debug!("proxy: connection ended with {e}");
        }
        drop(open);
        return;
    }
    log::warn!(
        "proxy: no replica answered: {}; closing the client connection",
        failures.join(", ")
    );
}

/// How the start of a connection to a replica went.
#[derive(Debug)]
enum Opening {
    /// The replica sent its first bytes (written on to the client, but for
    /// the backlog) or closed cleanly: it is serving.
    Answered(Backlog),
    /// The client sent more than [`REPLAY_MAX`] before any answer: the rest
    /// goes to this replica whatever happens.
    Committed,
    /// The replica reset (or its socket broke) before its first byte; the
    /// client's bytes are kept for the next replica.
    Reset(io::Error),
}

/// What the client sent before any replica answered, to send again to the
/// next replica when one resets.
#[derive(Debug, Default)]
struct Replay {
    data: Vec<u8>,
    client_ended: bool,
}

/// Forwards the client's bytes to `backend` (keeping a copy in `replay`) until
/// the replica answers, resets or the copy grows past [`REPLAY_MAX`]. The
/// replica's first bytes are read and written on to the client here, what
/// the client does not take at once kept in the answer's backlog for
/// [`relay`]; reading them rather than peeking saves a system call per
/// connection. Starts by sending what `replay` already holds (an earlier
/// replica reset). An `Err` is the client's: nothing is left to serve.
async fn opening(
    client: &mut TcpStream,
    backend: &mut TcpStream,
    replay: &mut Replay,
    counters: &ServiceCounters,
) -> io::Result<Opening> {
    let broke = |e: io::Error| match e.kind() {
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => Ok(Opening::Reset(e)),
        _ => Err(e),
    };
    if let Err(e) = send_all(backend, &replay.data).await {
        return broke(e);
    }
    if replay.client_ended
        && let Err(e) = SockRef::from(&*backend).shutdown(Shutdown::Write)
    {
        return broke(e);
    }
    loop {
        if replay.data.len() >= REPLAY_MAX {
            return Ok(Opening::Committed);
        }
        let before = replay.data.len();
        let (mut client_r, mut client_w) = client.split();
        let (mut backend_r, _) = backend.split();
        // One poll over both sides, the replica's answer first: it ends the
        // opening whatever the client sends meanwhile.
        let step = poll_fn(|cx| {
            if let Poll::Ready(answer) = first_answer(&mut backend_r, &mut client_w, counters, cx) {
                return Poll::Ready(Step::Answer(answer));
            }
            if !replay.client_ended
                && let Poll::Ready(read) = read_client(&mut client_r, &mut replay.data, cx)
            {
                return Poll::Ready(Step::Client(read));
            }
            Poll::Pending
        })
        .await;
        match step {
            Step::Answer(Answer::Got(backlog)) => return Ok(Opening::Answered(backlog)),
            Step::Answer(Answer::ReplicaFailed(e)) => return broke(e),
            Step::Answer(Answer::ClientFailed(e)) => return Err(e),
            Step::Client(Err(e)) => return Err(e),
            Step::Client(Ok(0)) => {
                replay.client_ended = true;
                if let Err(e) = SockRef::from(&*backend).shutdown(Shutdown::Write) {
                    return broke(e);
                }
            }
            Step::Client(Ok(_)) => {
                if let Err(e) = send_all(backend, &replay.data[before..]).await {
                    return broke(e);
                }
            }
        }
    }
}

/// What one poll of the opening found.
enum Step {
    /// The replica answered (or failed, or the client could not be written).
    Answer(Answer),
    /// The client sent this many bytes (0: it ended), now in the replay.
    Client(io::Result<usize>),
}

/// The replica's first read, and its forwarding to the client.
enum Answer {
    /// Bytes (none: a clean close) read and written on; what the client did
    /// not take yet.
    Got(Backlog),
    /// Reading the replica failed.
    ReplicaFailed(io::Error),
    /// Writing to the client failed.
    ClientFailed(io::Error),
}

/// Reads the replica's first bytes into the thread's buffer, counts them
/// and writes what the client takes now; the rest becomes the backlog.
fn first_answer(
    backend: &mut ReadHalf<'_>,
    client: &mut WriteHalf<'_>,
    counters: &ServiceCounters,
    cx: &mut Context<'_>,
) -> Poll<Answer> {
    BUF.with_borrow_mut(|buf| {
        let mut read = ReadBuf::new(buf);
        match Pin::new(&mut *backend).poll_read(cx, &mut read) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(e)) => return Poll::Ready(Answer::ReplicaFailed(e)),
            Poll::Ready(Ok(())) => {}
        }
        let data = read.filled();
        // Relaxed: a counter read by the metrics, ordering nothing else.
        counters
            .to_client
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        let mut backlog = Backlog::default();
        match write_some(client, data, cx) {
            Ok(written) => backlog.push(&data[written..]),
            Err(e) => return Poll::Ready(Answer::ClientFailed(e)),
        }
        Poll::Ready(Answer::Got(backlog))
    })
}

/// One read of what the client sent, appended to `replay`. Through
/// `poll_read`, which takes a short read as "drained", so the client is not
/// read again (`EAGAIN`) before it sends more.
fn read_client(
    client: &mut ReadHalf<'_>,
    replay: &mut Vec<u8>,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    BUF.with_borrow_mut(|buf| {
        let mut read = ReadBuf::new(buf);
        ready!(Pin::new(&mut *client).poll_read(cx, &mut read))?;
        replay.extend_from_slice(read.filled());
        Poll::Ready(Ok(read.filled().len()))
    })
}

/// Writes all of `data` to `dst` through a shared reference (the opening
/// phase holds both sockets by reference).
async fn send_all(dst: &TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        dst.writable().await?;
        match dst.try_write(data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => data = &data[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Connects to `addr` within `timeout` (`agent.proxy_connect_timeout`) instead
/// of the OS default (about two minutes against a silent address).
async fn connect(addr: SocketAddrV4, timeout: Duration) -> io::Result<TcpStream> {
    match tokio::time::timeout(timeout, connect_now(addr)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer within {} ms", timeout.as_millis()),
        )),
    }
}

/// A non-blocking connect, done when the socket turns writable.
///
/// Not tokio's `TcpSocket::connect`: that one asks the kernel for the
/// socket's error (`getsockopt(SO_ERROR)`) after every connect, one system
/// call per connection. The readiness the poller reports already tells a
/// failed connect (Linux: `EPOLLHUP`/`EPOLLERR`, FreeBSD: `EV_EOF`) from an
/// established one, so the error is asked for only when there is one.
async fn connect_now(addr: SocketAddrV4) -> io::Result<TcpStream> {
    let socket = Socket::new(
        Domain::IPV4,
        Type::STREAM.nonblocking(),
        Some(Protocol::TCP),
    )?;
    socket.set_tcp_nodelay(true)?;
    match socket.connect(&SocketAddr::V4(addr).into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from_std(std::net::TcpStream::from(socket))?;
    let ready = stream.ready(Interest::WRITABLE | Interest::ERROR).await?;
    if ready.is_write_closed() || ready.is_error() {
        return Err(stream.take_error()?.unwrap_or_else(|| {
            io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "connection closed while connecting",
            )
        }));
    }
    Ok(stream)
}

/// What both directions of one relayed connection share.
struct Ends<'a> {
    /// One direction reached its end.
    one_ended: AtomicBool,
    /// The service's counters.
    counters: &'a ServiceCounters,
}

/// The counter of the client-to-replica direction (a function item, so a
/// direction costs its pipe no state).
fn to_replica(c: &ServiceCounters) -> &AtomicU64 {
    &c.to_replica
}

/// The counter of the replica-to-client direction.
fn to_client(c: &ServiceCounters) -> &AtomicU64 {
    &c.to_client
}

/// Relays both directions until both reached end of stream, or either
/// failed, adding the bytes read from each side to its counter; the
/// replica's bytes the client has not taken yet (`answered`) go first.
async fn relay(
    mut client: TcpStream,
    mut backend: TcpStream,
    counters: &ServiceCounters,
    answered: Backlog,
) -> io::Result<()> {
    let (mut client_r, mut client_w) = client.split();
    let (mut backend_r, mut backend_w) = backend.split();
    let ends = Ends {
        one_ended: AtomicBool::new(false),
        counters,
    };
    tokio::try_join!(
        pipe(
            &mut client_r,
            &mut backend_w,
            &ends,
            to_replica,
            Backlog::default()
        ),
        pipe(&mut backend_r, &mut client_w, &ends, to_client, answered)
    )?;
    Ok(())
}

/// Copies `src` to `dst` until `src` ends, then shuts down `dst`'s write half
/// unless the other direction ended first: then both sockets are about to be
/// closed, their read sides are drained, and the close sends the FIN.
///
/// The shutdown goes out at once. Waiting a turn of the event loop for
/// the other side's end, to close both instead, saved the `shutdown(2)`
/// for about half the connections of the connections-per-second bench but
/// cost the proxy more CPU per connection (bench/README.md, "proxy
/// accepting faster"): a peer that closes second leaves its TIME_WAIT to be
/// built inside the proxy's `close(2)`.
///
/// Reads and writes go through `poll_read`/`poll_write` rather than
/// `readable()` + `try_read`: tokio's poll functions treat a short read or
/// write as "drained" / "full" and wait for the next readiness event, which
/// saves one `EAGAIN` system call per message in request/response traffic.
async fn pipe(
    src: &mut ReadHalf<'_>,
    dst: &mut WriteHalf<'_>,
    ends: &Ends<'_>,
    counter: impl Fn(&ServiceCounters) -> &AtomicU64,
    mut backlog: Backlog,
) -> io::Result<()> {
    loop {
        if !backlog.is_empty() {
            poll_fn(|cx| backlog.flush(dst, cx)).await?;
            // Drained: give the memory back before possibly idling for hours.
            backlog = Backlog::default();
        }
        if poll_fn(|cx| forward(src, dst, &mut backlog, counter(ends.counters), cx)).await?
            == Flow::Ended
        {
            // Relaxed: both directions are polled by the same task.
            if !ends.one_ended.swap(true, Ordering::Relaxed) {
                // The other side may already be gone; the opposite direction
                // decides how the connection ends, not this shutdown.
                let _ = dst.shutdown().await;
            }
            return Ok(());
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Flow {
    More,
    Ended,
}

/// One read from `src` into the thread's buffer and as much of it written to
/// `dst` as it takes now; the rest goes to `backlog`. The shared buffer is
/// borrowed only inside this poll, never across an await.
fn forward(
    src: &mut ReadHalf<'_>,
    dst: &mut WriteHalf<'_>,
    backlog: &mut Backlog,
    relayed: &AtomicU64,
    cx: &mut Context<'_>,
) -> Poll<io::Result<Flow>> {
    BUF.with_borrow_mut(|buf| {
        let mut read = ReadBuf::new(buf);
        ready!(Pin::new(&mut *src).poll_read(cx, &mut read))?;
        let data = read.filled();
        if data.is_empty() {
            return Poll::Ready(Ok(Flow::Ended));
        }
        // Relaxed: a counter read by the metrics, ordering nothing else.
        relayed.fetch_add(data.len() as u64, Ordering::Relaxed);
        let written = write_some(dst, data, cx)?;
        backlog.push(&data[written..]);
        Poll::Ready(Ok(Flow::More))
    })
}

/// Writes as much of `data` as `dst` takes now; when it takes less, `cx` is
/// woken once it can take more.
fn write_some(dst: &mut WriteHalf<'_>, data: &[u8], cx: &mut Context<'_>) -> io::Result<usize> {
    let mut done = 0;
    while done < data.len() {
        match Pin::new(&mut *dst).poll_write(cx, &data[done..]) {
            Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(n)) => done += n,
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => break,
        }
    }
    Ok(done)
}

/// Bytes read but not yet written, only while the destination lags.
#[derive(Debug, Default)]
struct Backlog {
    data: Vec<u8>,
    sent: usize,
}

impl Backlog {
    fn is_empty(&self) -> bool {
        self.sent == self.data.len()
    }

    fn push(&mut self, bytes: &[u8]) {
        self.data.extend_from_slice(bytes);
    }

    /// Ready once everything is written.
    fn flush(&mut self, dst: &mut WriteHalf<'_>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.sent += write_some(dst, &self.data[self.sent..], cx)?;
        if self.is_empty() {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `connect` tells a refused connect from an established one by the
    /// readiness alone; the error must still be the kernel's.
    #[test]
    fn a_refused_connect_fails_with_the_kernels_error() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = match listener.local_addr().expect("addr") {
                SocketAddr::V4(a) => a,
                SocketAddr::V6(a) => panic!("bound {a}"),
            };
            let stream = connect(addr, Duration::from_secs(5))
                .await
                .expect("a listening port connects");
            assert_eq!(stream.peer_addr().expect("peer"), SocketAddr::V4(addr));
            drop(listener);
            let err = connect(addr, Duration::from_secs(5))
                .await
                .expect_err("a closed port refuses");
            assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused, "{err}");
        });
    }

    /// The state of a relayed connection must not hold a buffer (the whole
    /// point of the loop above); a regression would show here long before it
    /// shows in a 10,000-connection memory benchmark.
    #[test]
    fn a_connection_future_holds_no_buffer() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let client = TcpStream::connect(addr).await.expect("connect");
            let (accepted, _) = listener.accept().await.expect("accept");
            let counters = ServiceCounters::default();
            let serving = serve(
                accepted,
                Arc::new(Backends::new(&[])),
                Duration::from_secs(1),
            );
            let size = std::mem::size_of_val(&serving);
            assert!(size < 2048, "connection state is {size} bytes");
            let relaying = relay(
                client,
                TcpStream::connect(addr).await.expect("connect"),
                &counters,
                Backlog::default(),
            );
            let size = std::mem::size_of_val(&relaying);
            assert!(size < 2048, "relay state is {size} bytes");
        });
    }
}
