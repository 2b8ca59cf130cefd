//! A TCP link a test can cut: a relay on loopback to one target address.
//!
//! While the link is up every byte is relayed both ways; once cut, bytes
//! are read and dropped in both directions, and new connections are
//! accepted and never answered: a blackhole, as when a switch port fails,
//! not a refused connection. It stands between one daemon and a service
//! (a control plane and the etcd members) where a network namespace would
//! also cut everything else.
//!
//! Every thread polls a stop flag with short read timeouts, so dropping the
//! [`Link`] ends them all.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

/// How often a blocked relay thread looks at the flags.
const POLL: Duration = Duration::from_millis(50);

/// A relay to one target; see the module docs.
pub struct Link {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Link {
    /// A link up to `target`, listening on a free loopback port.
    pub fn start(target: SocketAddr) -> Link {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the link");
        listener.set_nonblocking(true).expect("nonblocking accept");
        let addr = listener.local_addr().expect("link address");
        let cut = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (Arc::clone(&cut), Arc::clone(&stop));
        thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let (c, s) = (Arc::clone(&c), Arc::clone(&s));
                        thread::spawn(move || connect(client, target, c, s));
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => thread::sleep(POLL),
                    Err(_) => thread::sleep(POLL),
                }
            }
        });
        Link { addr, cut, stop }
    }

    /// Where the daemon connects instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the link: nothing gets through any more.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn connect(client: TcpStream, target: SocketAddr, cut: Arc<AtomicBool>, stop: Arc<AtomicBool>) {
    if cut.load(Ordering::SeqCst) {
        // A blackhole: the connection is taken and never answered.
        drain(client, &stop);
        return;
    }
    let Ok(server) = TcpStream::connect(target) else {
        return;
    };
    let pairs = (
        client.try_clone().expect("clone"),
        server.try_clone().expect("clone"),
    );
    let (c, s) = (Arc::clone(&cut), Arc::clone(&stop));
    thread::spawn(move || pump(pairs.0, pairs.1, &c, &s));
    pump(server, client, &cut, &stop);
}

/// Copies `from` to `to` until either closes or the link stops; drops
/// what it reads while the link is cut.
fn pump(mut from: TcpStream, mut to: TcpStream, cut: &AtomicBool, stop: &AtomicBool) {
    let _ = from.set_read_timeout(Some(POLL));
    let mut buf = [0u8; 16 * 1024];
    while !stop.load(Ordering::SeqCst) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if !cut.load(Ordering::SeqCst) && to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// Reads and drops everything from `stream` until it closes or the link
/// stops.
fn drain(mut stream: TcpStream, stop: &AtomicBool) {
    let _ = stream.set_read_timeout(Some(POLL));
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
}
