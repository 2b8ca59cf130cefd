//! The ingress nginx configuration against the real `nginx -t`
//! (`/usr/sbin/nginx`): what `ingress::nginx::render` produces for no
//! Ingress, one, several, and a set holding sites that would break a
//! directive, with every path moved under the test's directory
//! (`NginxLayout::under`) and certificates from a throwaway CA. Also the
//! failure the reconciler must catch before any reload: a certificate file
//! that is not there.
//!
//! Without nginx the tests print why and pass, unless `CI` is set.

use std::fs;
use std::net::SocketAddrV4;
use std::path::Path;
use std::process::Output;

use keel::agentd::ingress::nginx::{NginxLayout, Site, render};

use crate::util::nginx::{self, free_port};
use crate::util::pki::TestCa;

/// A temporary directory nginx may use as its prefix, and its layout there.
fn prefix() -> (tempfile::TempDir, NginxLayout) {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::create_dir(dir.path().join("tmp")).expect("temp dir");
    let layout = NginxLayout::under(dir.path(), free_port(), free_port());
    (dir, layout)
}

/// A site for `host` with a real certificate and key under `dir`.
fn site(ca: &TestCa, dir: &Path, host: &str, last: u8) -> Site {
    let leaf = ca.leaf(&[host], dir, host);
    Site {
        host: host.into(),
        upstream: SocketAddrV4::new([10, 96, 0, last].into(), 8080),
        certificate: leaf.cert,
        key: leaf.key,
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// nginx -t passes, with neither warning nor error (a warning such as a
/// conflicting server name would mean the rendering is subtly wrong).
fn assert_valid(dir: &Path, conf: &str) {
    let out = nginx::check(dir, conf);
    let said = stderr(&out);
    assert!(
        out.status.success(),
        "nginx -t refused the rendered configuration:\n{said}\n{conf}"
    );
    assert!(said.contains("test is successful"), "{said}");
    for level in ["[warn]", "[emerg]", "[alert]", "[crit]", "[error]"] {
        assert!(!said.contains(level), "nginx -t said:\n{said}\n{conf}");
    }
}

#[test]
fn nginx_accepts_the_configuration_without_ingress() {
    if !nginx::present("nginx_accepts_the_configuration_without_ingress") {
        return;
    }
    let (dir, layout) = prefix();
    let (conf, refused) = render(&[], &layout);
    assert!(refused.is_empty());
    assert!(conf.contains("ssl_reject_handshake on;"), "{conf}");
    assert_valid(dir.path(), &conf);
}

#[test]
fn nginx_accepts_the_configuration_for_one_ingress() {
    if !nginx::present("nginx_accepts_the_configuration_for_one_ingress") {
        return;
    }
    let (dir, layout) = prefix();
    let ca = TestCa::new("keel nginx -t CA");
    let sites = [site(&ca, dir.path(), "www.example.org", 1)];
    let (conf, refused) = render(&sites, &layout);
    assert!(refused.is_empty(), "{refused:?}");
    assert!(conf.contains("server_name www.example.org;"), "{conf}");
    assert_valid(dir.path(), &conf);
}

#[test]
fn nginx_accepts_the_configuration_for_several_ingresses() {
    if !nginx::present("nginx_accepts_the_configuration_for_several_ingresses") {
        return;
    }
    let (dir, layout) = prefix();
    let ca = TestCa::new("keel nginx -t CA");
    let hosts = ["www.example.org", "api.example.org", "shop.example.com"];
    let sites: Vec<Site> = (1..)
        .zip(hosts)
        .map(|(n, h)| site(&ca, dir.path(), h, n))
        .collect();
    let (conf, refused) = render(&sites, &layout);
    assert!(refused.is_empty(), "{refused:?}");
    for host in hosts {
        assert!(conf.contains(&format!("server_name {host};")), "{conf}");
    }
    assert_valid(dir.path(), &conf);
}

#[test]
fn broken_sites_are_left_out_and_the_rest_passes_nginx_t() {
    if !nginx::present("broken_sites_are_left_out_and_the_rest_passes_nginx_t") {
        return;
    }
    let (dir, layout) = prefix();
    let ca = TestCa::new("keel nginx -t CA");
    let good = site(&ca, dir.path(), "www.example.org", 1);
    let also_good = site(&ca, dir.path(), "api.example.org", 2);
    let mut semicolon = site(&ca, dir.path(), "evil.example.org", 3);
    semicolon.host = "evil.example.org; include /etc/passwd".into();
    // A real directory with a brace in its name: the files exist, so only
    // the rendering, not nginx's file check, can keep this site out.
    let braced_dir = dir.path().join("certs}");
    fs::create_dir(&braced_dir).expect("braced dir");
    let braced = site(&ca, &braced_dir, "brace.example.org", 4);
    assert!(braced.key.exists());

    let (conf, refused) = render(&[good, semicolon, also_good, braced], &layout);
    let hosts: Vec<&str> = refused.iter().map(|r| r.host.as_str()).collect();
    assert_eq!(
        hosts,
        ["evil.example.org; include /etc/passwd", "brace.example.org"]
    );
    assert!(refused[0].reason.contains(';'), "{:?}", refused[0]);
    assert!(refused[1].reason.contains('}'), "{:?}", refused[1]);
    assert!(
        !conf.contains("evil") && !conf.contains("brace") && !conf.contains("/etc/passwd"),
        "{conf}"
    );
    for host in ["www.example.org", "api.example.org"] {
        assert!(conf.contains(&format!("server_name {host};")), "{conf}");
    }
    assert_valid(dir.path(), &conf);
}

#[test]
fn nginx_t_fails_when_a_certificate_file_is_missing() {
    if !nginx::present("nginx_t_fails_when_a_certificate_file_is_missing") {
        return;
    }
    let (dir, layout) = prefix();
    let ca = TestCa::new("keel nginx -t CA");
    let present = site(&ca, dir.path(), "www.example.org", 1);
    let gone = site(&ca, dir.path(), "gone.example.org", 2);
    fs::remove_file(&gone.certificate).expect("remove certificate");

    // render takes paths at their word (the caller checks the files): the
    // configuration names the missing file, and only nginx -t finds out.
    let (conf, refused) = render(&[present, gone.clone()], &layout);
    assert!(refused.is_empty(), "{refused:?}");
    let out = nginx::check(dir.path(), &conf);
    let said = stderr(&out);
    assert!(!out.status.success(), "nginx -t accepted:\n{said}\n{conf}");
    assert!(
        said.contains(&format!(
            "cannot load certificate \"{}\"",
            gone.certificate.display()
        )),
        "{said}"
    );
    assert!(said.contains("No such file or directory"), "{said}");
    assert!(said.contains("test failed"), "{said}");
}
