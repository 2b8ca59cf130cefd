//! Running one probe of `spec.health` once: an HTTP GET or a TCP connect to
//! the jail's own address from the host (over keel0 on FreeBSD, over
//! loopback in simulate mode, where jails have 127.64.0.0/10 addresses), or an
//! argv inside the jail through the worker ([`ExecSeam`]). It owns the probe's
//! wire behaviour and its deadline; it never keeps state between probes and
//! never decides readiness (`state.rs` does).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

use crate::common::cmd::CmdOutput;
use crate::common::spec::Probe;
use crate::host::jail::JailError;

/// Most bytes of an answer read to find its status line.
const MAX_STATUS_LINE: usize = 1024;

/// Runs `argv` inside jail `name` and answers whether it exited 0, or why not,
/// within `timeout`. The agent's implementation posts to the worker, which
/// owns the jail runtime (jexec is a host command like any other).
pub trait ExecSeam: Send + Sync {
    /// See the trait docs.
    fn exec(&self, name: &str, argv: &[String], timeout: Duration) -> Result<(), String>;
}

/// An exec probe's verdict from what `jexec` (`JailRuntime::exec`) answered:
/// exit status 0 passes; otherwise the status and the command's stderr.
pub fn exec_outcome(ran: Result<CmdOutput, JailError>) -> Result<(), String> {
    match ran {
        Ok(out) if out.status == 0 => Ok(()),
        Ok(out) if out.stderr.trim().is_empty() => Err(format!("exited {}", out.status)),
        Ok(out) => Err(format!("exited {}: {}", out.status, out.stderr.trim())),
        Err(e) => Err(e.to_string()),
    }
}

/// Runs `probe` once against jail `name` at `address`, giving up after
/// `timeout`. `Err` carries why it failed, phrased for the jail's last error.
pub fn run(
    probe: &Probe<'_>,
    name: &str,
    address: Ipv4Addr,
    timeout: Duration,
    exec: &dyn ExecSeam,
) -> Result<(), String> {
    match probe {
        Probe::Tcp(t) => {
            let target = SocketAddrV4::new(address, t.port);
            connect(target, timeout).map(drop)
        }
        Probe::Http(h) => http_get(SocketAddrV4::new(address, h.port), &h.path, timeout),
        Probe::Exec(argv) => exec
            .exec(name, argv, timeout)
            .map_err(|e| format!("health check exec {argv:?} failed: {e}")),
    }
}

fn connect(target: SocketAddrV4, timeout: Duration) -> Result<TcpStream, String> {
    TcpStream::connect_timeout(&SocketAddr::V4(target), timeout)
        .map_err(|e| format!("health check could not connect to {target}: {e}"))
}

/// `GET path HTTP/1.0`; a 2xx or 3xx status line passes.
fn http_get(target: SocketAddrV4, path: &str, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    let fail = |what: String| format!("health check GET http://{target}{path}: {what}");
    let mut stream = connect(target, timeout)?;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    stream
        .set_write_timeout(Some(left()))
        .map_err(|e| fail(e.to_string()))?;
    let request =
        format!("GET {path} HTTP/1.0\r\nHost: {target}\r\nUser-Agent: keel-health\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .map_err(|e| fail(format!("could not send the request: {e}")))?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 256];
    while !answer.contains(&b'\n') && answer.len() < MAX_STATUS_LINE {
        stream
            .set_read_timeout(Some(left()))
            .map_err(|e| fail(e.to_string()))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if Instant::now() >= deadline => {
                return Err(fail(format!("no answer within {timeout:?} ({e})")));
            }
            Err(e) => return Err(fail(format!("could not read the answer: {e}"))),
        }
    }
    let line = String::from_utf8_lossy(&answer);
    let line = line.lines().next().unwrap_or("").trim();
    match status_of(line) {
        Some(code) if (200..400).contains(&code) => Ok(()),
        Some(code) => Err(fail(format!("answered {code}, not 2xx or 3xx"))),
        None => Err(fail(format!("not an HTTP answer: {line:?}"))),
    }
}

/// The status code of an HTTP/1.x status line.
fn status_of(line: &str) -> Option<u16> {
    let mut parts = line.split_ascii_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/1."))?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::spec::{HttpProbe, TcpProbe};
    use std::net::TcpListener;

    struct NoExec;
    impl ExecSeam for NoExec {
        fn exec(&self, _: &str, _: &[String], _: Duration) -> Result<(), String> {
            Err("exec refused".into())
        }
    }

    /// A server on loopback answering each connection with `answer`.
    fn serve(answer: &'static str) -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = [0u8; 512];
                let _ = conn.read(&mut buf);
                let _ = conn.write_all(answer.as_bytes());
            }
        });
        port
    }

    fn http(port: u16) -> Result<(), String> {
        let probe = HttpProbe {
            port,
            path: "/healthz".into(),
        };
        run(
            &Probe::Http(&probe),
            "web",
            Ipv4Addr::LOCALHOST,
            Duration::from_secs(5),
            &NoExec,
        )
    }

    #[test]
    fn http_passes_on_2xx_and_3xx_only() {
        assert_eq!(http(serve("HTTP/1.1 200 OK\r\n\r\nok")), Ok(()));
        assert_eq!(http(serve("HTTP/1.0 302 Found\r\n\r\n")), Ok(()));
        let err = http(serve("HTTP/1.1 503 Service Unavailable\r\n\r\n")).expect_err("503");
        assert!(
            err.contains("answered 503") && err.contains("/healthz"),
            "{err}"
        );
        let err = http(serve("SSH-2.0-OpenSSH\r\n")).expect_err("not http");
        assert!(err.contains("not an HTTP answer"), "{err}");
    }

    #[test]
    fn tcp_and_http_fail_on_a_refused_connect() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let err = http(port).expect_err("nothing listens");
        assert!(err.contains("could not connect"), "{err}");
        let tcp = TcpProbe { port };
        let probe = Probe::Tcp(&tcp);
        let timeout = Duration::from_secs(5);
        assert!(run(&probe, "web", Ipv4Addr::LOCALHOST, timeout, &NoExec).is_err());
        let open = serve("");
        let tcp = TcpProbe { port: open };
        assert_eq!(
            run(
                &Probe::Tcp(&tcp),
                "web",
                Ipv4Addr::LOCALHOST,
                timeout,
                &NoExec
            ),
            Ok(())
        );
    }

    #[test]
    fn exec_reports_why_through_its_seam() {
        let argv = vec!["/bin/test".to_string()];
        let err = run(
            &Probe::Exec(&argv),
            "web",
            Ipv4Addr::LOCALHOST,
            Duration::from_secs(1),
            &NoExec,
        )
        .expect_err("refused");
        assert!(err.contains("exec refused"), "{err}");
    }
}
