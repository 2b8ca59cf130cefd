//! Signed requests (`common::auth`): the documented test vector, every refusal,
//! key rotation, replay and clock-skew boundaries, tampering, key files (mode,
//! owner, generation), secrets kept out of Debug and error text, the HTTP glue
//! over a real server, and a property test of the header parser.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use keel::common::auth::{
    AuthError, AuthHeader, Key, KeyFilePolicy, Keyring, Role, SECRET_LEN, Signer, Verified,
    Verifier, canonical_string, generate_key, load_key, parse_authorization, refusal, sign_headers,
    verify_request, write_key_file,
};
use keel::common::http::{
    Client, Endpoint, Peer, Request, Response, Server, ServerLimits, ShutdownSignal,
};
use proptest::prelude::*;

const NOW: u64 = 1_767_225_600;
const SKEW: Duration = Duration::from_secs(300);

fn key(id: &str, fill: u8) -> Key {
    Key::new(id, [fill; SECRET_LEN]).expect("valid id")
}

/// Node key `node-a` (secret 0x01...), operator key `ops-a` (secret 0x02...).
fn verifier() -> Verifier {
    let ring = Keyring::new(vec![key("node-a", 1)], vec![key("ops-a", 2)]).expect("keyring");
    Verifier::new(ring, SKEW)
}

fn sign(k: &Key, method: &str, target: &str, body: &[u8], ts: u64) -> String {
    Signer::new(k.clone())
        .authorization(method, target, body, ts)
        .expect("signs")
}

fn verify(
    v: &Verifier,
    method: &str,
    target: &str,
    auth: &str,
    body: &[u8],
    now: u64,
    role: Role,
) -> Result<Verified, AuthError> {
    v.verify(method, target, Some(auth), body, now, role)
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn write_mode(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

fn key_text(id: &str, fill: u8) -> String {
    format!(
        "id = \"{id}\"\nsecret = \"{}\"\n",
        format!("{fill:02x}").repeat(SECRET_LEN)
    )
}

fn own_files() -> KeyFilePolicy {
    KeyFilePolicy {
        require_root_owner: false,
    }
}

#[test]
fn test_vector_from_docs_security_md() {
    let secret: [u8; 32] = std::array::from_fn(|i| i as u8);
    let nonce: [u8; 16] = std::array::from_fn(|i| i as u8);
    let body = b"kind: Jail\n";
    assert_eq!(
        canonical_string("PUT", "/jails/web-1?dry=1", NOW, &nonce, body),
        "PUT\n/jails/web-1?dry=1\n1767225600\n000102030405060708090a0b0c0d0e0f\n\
         03d51b3626eae1617ab8965d2a5a649fa6f89cfa1ffbc4679a4ac824731cb989"
    );
    let signer = Signer::new(Key::new("test-key", secret).expect("id"));
    let header = signer
        .authorization_with_nonce("PUT", "/jails/web-1?dry=1", body, NOW, nonce)
        .expect("signs");
    assert_eq!(
        header,
        "Keel-HMAC-SHA256 key=test-key, ts=1767225600, \
         nonce=000102030405060708090a0b0c0d0e0f, \
         sig=d8e1e320b2542d115dbd93b07875f68fbf39c16f27037d962822916a72d6eb28"
    );
}

#[test]
fn round_trip_for_both_roles() {
    let v = verifier();
    let auth = sign(&key("node-a", 1), "POST", "/nodes/register", b"{}", NOW);
    assert_eq!(
        verify(&v, "POST", "/nodes/register", &auth, b"{}", NOW, Role::Node).expect("ok"),
        Verified {
            key_id: "node-a".into(),
            role: Role::Node
        }
    );
    let auth = sign(&key("ops-a", 2), "GET", "/nodes", b"", NOW);
    assert_eq!(
        verify(&v, "GET", "/nodes", &auth, b"", NOW, Role::Operator)
            .expect("ok")
            .role,
        Role::Operator
    );
    assert_eq!(v.remembered_nonces(), 2);
}

#[test]
fn missing_header_is_refused() {
    let err = verifier()
        .verify("GET", "/nodes", None, b"", NOW, Role::Operator)
        .expect_err("refused");
    assert!(matches!(err, AuthError::Missing), "{err}");
    assert_eq!(err.status(), 401);
}

#[test]
fn malformed_headers_are_refused() {
    let good = parse_authorization(&sign(&key("node-a", 1), "GET", "/", b"", NOW)).expect("ok");
    let (n, s) = (
        "000102030405060708090a0b0c0d0e0f",
        "d8e1e320b2542d115dbd93b07875f68fbf39c16f27037d962822916a72d6eb28",
    );
    let cases = [
        String::new(),
        format!("Bearer key=a, ts=1, nonce={n}, sig={s}"),
        format!("keel-hmac-sha256 key=a, ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256key=a, ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=1, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=1, nonce={n}"),
        format!("Keel-HMAC-SHA256 key=a, key=a, ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=1, ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=1, nonce={n}, sig={s}, extra=1"),
        format!("Keel-HMAC-SHA256 key=a, ts=1, nonce={n}, sig={s},"),
        format!("Keel-HMAC-SHA256 key=a,, ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=\"a\", ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=, ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a b, ts=1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=-1, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=01, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=1.5, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=18446744073709551616, nonce={n}, sig={s}"),
        format!("Keel-HMAC-SHA256 key=a, ts=1, nonce={}, sig={s}", &n[2..]),
        format!("Keel-HMAC-SHA256 key=a, ts=1, nonce={n}00, sig={s}"),
        format!(
            "Keel-HMAC-SHA256 key=a, ts=1, nonce={}, sig={s}",
            n.to_uppercase()
        ),
        format!("Keel-HMAC-SHA256 key=a, ts=1, nonce={n}, sig={}", &s[1..]),
        format!("Keel-HMAC-SHA256 key=a, ts=1, nonce={n}, sig={}g", &s[1..]),
        format!(
            "Keel-HMAC-SHA256 key=a, ts=1, nonce={n}, sig={s}{}",
            " ".repeat(600)
        ),
    ];
    for case in &cases {
        let err = parse_authorization(case).expect_err(case);
        assert!(
            matches!(err, AuthError::Malformed { .. }),
            "{case:?}: {err}"
        );
        let err = verifier()
            .verify("GET", "/", Some(case), b"", NOW, Role::Node)
            .expect_err(case);
        assert!(
            matches!(err, AuthError::Malformed { .. }),
            "{case:?}: {err}"
        );
    }
    // Order, tabs and spaces around commas are free; ts=0 is a number.
    let relaxed = format!(
        "Keel-HMAC-SHA256\tsig={}\t,nonce={} ,ts=0,  key=node-a",
        good.to_string().rsplit("sig=").next().expect("sig"),
        n
    );
    let parsed = parse_authorization(&relaxed).expect("parses");
    assert_eq!((parsed.ts, parsed.sig), (0, good.sig));
}

#[test]
fn unknown_key_is_refused() {
    let auth = sign(&key("stranger", 9), "GET", "/nodes", b"", NOW);
    let err = verify(
        &verifier(),
        "GET",
        "/nodes",
        &auth,
        b"",
        NOW,
        Role::Operator,
    )
    .expect_err("refused");
    assert!(
        matches!(&err, AuthError::UnknownKey { key_id } if key_id == "stranger"),
        "{err}"
    );
}

#[test]
fn a_known_id_with_the_wrong_secret_is_a_bad_signature() {
    let auth = sign(&key("ops-a", 9), "GET", "/nodes", b"", NOW);
    let err = verify(
        &verifier(),
        "GET",
        "/nodes",
        &auth,
        b"",
        NOW,
        Role::Operator,
    )
    .expect_err("refused");
    assert!(matches!(err, AuthError::BadSignature { .. }), "{err}");
}

#[test]
fn roles_are_enforced_both_ways() {
    let v = verifier();
    let node = sign(&key("node-a", 1), "PUT", "/jails/web", b"spec", NOW);
    let err = verify(&v, "PUT", "/jails/web", &node, b"spec", NOW, Role::Operator)
        .expect_err("a node key cannot apply jails");
    assert!(
        matches!(
            err,
            AuthError::WrongRole {
                role: Role::Node,
                required: Role::Operator,
                ..
            }
        ),
        "{err}"
    );
    let ops = sign(&key("ops-a", 2), "POST", "/nodes/register", b"{}", NOW);
    let err = verify(&v, "POST", "/nodes/register", &ops, b"{}", NOW, Role::Node)
        .expect_err("an operator key cannot register");
    assert!(
        matches!(
            err,
            AuthError::WrongRole {
                role: Role::Operator,
                required: Role::Node,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(v.remembered_nonces(), 0, "refused requests leave no nonce");
}

#[test]
fn clock_skew_boundaries() {
    let k = key("node-a", 1);
    let v = verifier();
    for ts in [NOW - 300, NOW + 300, NOW] {
        let auth = sign(&k, "GET", "/", b"", ts);
        verify(&v, "GET", "/", &auth, b"", NOW, Role::Node).expect("within 300 s");
    }
    for ts in [NOW - 301, NOW + 301, 0, u64::MAX] {
        let auth = sign(&k, "GET", "/", b"", ts);
        let err = verify(&v, "GET", "/", &auth, b"", NOW, Role::Node).expect_err("stale");
        assert!(
            matches!(err, AuthError::Stale { ts: t, now: NOW, max_skew_secs: 300 } if t == ts),
            "{err}"
        );
    }
}

#[test]
fn replays_are_refused_and_expire_into_stale() {
    let v = verifier();
    let auth = sign(&key("node-a", 1), "POST", "/nodes/n1/heartbeat", b"{}", NOW);
    let send = |now| {
        verify(
            &v,
            "POST",
            "/nodes/n1/heartbeat",
            &auth,
            b"{}",
            now,
            Role::Node,
        )
    };
    send(NOW).expect("first time");
    let err = send(NOW).expect_err("replay");
    assert!(matches!(err, AuthError::Replayed { .. }), "{err}");
    let err = send(NOW + 300).expect_err("replay at the window's edge");
    assert!(matches!(err, AuthError::Replayed { .. }), "{err}");
    // A later request evicts the old nonce; the replay is then stale anyway.
    let later = sign(&key("node-a", 1), "GET", "/", b"", NOW + 301);
    verify(&v, "GET", "/", &later, b"", NOW + 301, Role::Node).expect("fresh");
    assert_eq!(v.remembered_nonces(), 1, "the old nonce was evicted");
    let err = send(NOW + 301).expect_err("stale");
    assert!(matches!(err, AuthError::Stale { .. }), "{err}");
}

#[test]
fn a_full_replay_cache_refuses_with_503() {
    let v = verifier().with_nonce_capacity(2);
    let k = key("node-a", 1);
    for _ in 0..2 {
        let auth = sign(&k, "GET", "/", b"", NOW);
        verify(&v, "GET", "/", &auth, b"", NOW, Role::Node).expect("room");
    }
    let auth = sign(&k, "GET", "/", b"", NOW);
    let err = verify(&v, "GET", "/", &auth, b"", NOW, Role::Node).expect_err("full");
    assert!(
        matches!(err, AuthError::ReplayCacheFull { capacity: 2 }),
        "{err}"
    );
    assert_eq!(err.status(), 503);
    // Once the window passes, the old entries go and requests are accepted again.
    let auth = sign(&k, "GET", "/", b"", NOW + 301);
    verify(&v, "GET", "/", &auth, b"", NOW + 301, Role::Node).expect("evicted");
}

#[test]
fn tampering_with_any_signed_part_breaks_the_signature() {
    let k = key("ops-a", 2);
    let (method, target, body) = ("PUT", "/jails/web?dry=1", &b"kind: Jail\n"[..]);
    let auth = sign(&k, method, target, body, NOW);
    let parsed = parse_authorization(&auth).expect("parses");
    let with = |f: &dyn Fn(&mut AuthHeader)| {
        let mut h = parsed.clone();
        f(&mut h);
        h.to_string()
    };
    let cases: Vec<(&str, &str, String, &[u8])> = vec![
        ("method", "POST", auth.clone(), body),
        ("path", "/jails/wex?dry=1", auth.clone(), body),
        ("query", "/jails/web?dry=0", auth.clone(), body),
        ("no query", "/jails/web", auth.clone(), body),
        ("body", target, auth.clone(), b"kind: Jail\n\n"),
        ("empty body", target, auth.clone(), b""),
        ("ts", target, with(&|h| h.ts += 1), body),
        ("nonce", target, with(&|h| h.nonce[15] ^= 1), body),
        ("sig", target, with(&|h| h.sig[0] ^= 0x80), body),
    ];
    for (what, m_or_t, auth, body) in cases {
        let (m, t) = if what == "method" {
            (m_or_t, target)
        } else {
            (method, m_or_t)
        };
        let err = verify(&verifier(), m, t, &auth, body, NOW, Role::Operator).expect_err(what);
        assert!(
            matches!(err, AuthError::BadSignature { .. }),
            "{what}: {err}"
        );
    }
    verify(
        &verifier(),
        method,
        target,
        &auth,
        body,
        NOW,
        Role::Operator,
    )
    .expect("untouched");
}

#[test]
fn rotation_accepts_both_keys_then_only_the_new_one() {
    let dir = tempdir();
    let old = dir.path().join("ops-old.key");
    let new = dir.path().join("ops-new.key");
    write_key_file(&old, &generate_key("ops-old").expect("key")).expect("write");
    write_key_file(&new, &generate_key("ops-new").expect("key")).expect("write");
    let old_signer = Signer::new(load_key(&old, own_files()).expect("old"));
    let new_signer = Signer::new(load_key(&new, own_files()).expect("new"));
    let call = |v: &Verifier, s: &Signer| {
        let auth = s.authorization("GET", "/nodes", b"", NOW).expect("signs");
        verify(v, "GET", "/nodes", &auth, b"", NOW, Role::Operator)
    };

    let v = Verifier::new(
        Keyring::load(&[], std::slice::from_ref(&old), own_files()).expect("load"),
        SKEW,
    );
    call(&v, &old_signer).expect("before rotation");
    // Step 1: the new key joins the accepted set; both sign successfully.
    let both = Keyring::load(&[], &[old.clone(), new.clone()], own_files()).expect("load");
    assert_eq!(both.ids(Role::Operator), ["ops-old", "ops-new"]);
    v.replace_keyring(both);
    call(&v, &old_signer).expect("old still accepted");
    call(&v, &new_signer).expect("new accepted");
    // Step 3: the old key leaves the set.
    v.replace_keyring(Keyring::load(&[], &[new], own_files()).expect("load"));
    call(&v, &new_signer).expect("new accepted");
    let err = call(&v, &old_signer).expect_err("old refused");
    assert!(matches!(err, AuthError::UnknownKey { .. }), "{err}");
}

#[test]
fn keyring_refuses_duplicate_ids_and_shared_secrets() {
    let dir = tempdir();
    let a = dir.path().join("a.key");
    let b = dir.path().join("b.key");
    write_mode(&a, &key_text("same", 1), 0o600);
    write_mode(&b, &key_text("same", 2), 0o600);
    let err = Keyring::load(
        std::slice::from_ref(&a),
        std::slice::from_ref(&b),
        own_files(),
    )
    .expect_err("duplicate id across roles");
    assert!(matches!(err, AuthError::DuplicateKeyId { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("a.key") && text.contains("b.key"), "{text}");

    let err =
        Keyring::load(&[a.clone(), a.clone()], &[], own_files()).expect_err("a file listed twice");
    assert!(matches!(err, AuthError::DuplicateKeyId { .. }), "{err}");

    let err = Keyring::new(vec![key("node-a", 7)], vec![key("ops-a", 7)])
        .expect_err("same secret under two ids");
    assert!(matches!(err, AuthError::SharedSecret { .. }), "{err}");
}

#[test]
fn key_files_with_group_or_other_access_are_refused() {
    let dir = tempdir();
    let path = dir.path().join("k.key");
    for mode in [0o644, 0o640, 0o604, 0o660, 0o601] {
        write_mode(&path, &key_text("k", 3), mode);
        let err = load_key(&path, own_files()).expect_err("open mode");
        assert!(
            matches!(err, AuthError::KeyFileMode { mode: m, .. } if m == mode),
            "{mode:o}: {err}"
        );
        assert!(err.to_string().contains("chmod 0600"), "{err}");
    }
    for mode in [0o600, 0o400] {
        write_mode(&path, &key_text("k", 3), mode);
        assert_eq!(load_key(&path, own_files()).expect("private").id(), "k");
    }
}

#[test]
fn key_files_owned_by_someone_else_are_refused() {
    let dir = tempdir();
    let path = dir.path().join("k.key");
    write_mode(&path, &key_text("k", 3), 0o600);
    let policy = KeyFilePolicy::for_current_process();
    load_key(&path, policy).expect("our own file");
    let err = if policy.require_root_owner {
        // Running as root: give the file to nobody.
        std::os::unix::fs::chown(&path, Some(65534), None).expect("chown");
        load_key(&path, policy).expect_err("not root's")
    } else {
        // Unprivileged: a daemon told to require root refuses our file.
        load_key(
            &path,
            KeyFilePolicy {
                require_root_owner: true,
            },
        )
        .expect_err("not root's")
    };
    assert!(
        matches!(err, AuthError::KeyFileOwner { expected: 0, .. }),
        "{err}"
    );
}

#[test]
fn key_file_contents_are_checked() {
    let dir = tempdir();
    let path = dir.path().join("k.key");
    let secret = "ab".repeat(SECRET_LEN);
    for text in [
        String::new(),
        format!("secret = \"{secret}\"\n"),
        "id = \"k\"\n".to_string(),
        format!("id = \"k\"\nsecret = \"{}\"\n", &secret[2..]),
        format!("id = \"k\"\nsecret = \"{secret}00\"\n"),
        format!("id = 1\nsecret = \"{secret}\"\n"),
        format!("id = \"a b\"\nsecret = \"{secret}\"\n"),
        format!("id = \"k\"\nsecret = \"{secret}\"\nrole = \"operator\"\n"),
        format!("keel-key v1 k {secret}\n"),
        format!(
            "id = \"k\"\nsecret = \"{secret}\"\n# {}\n",
            "x".repeat(5000)
        ),
    ] {
        write_mode(&path, &text, 0o600);
        let err = load_key(&path, own_files()).expect_err(&text);
        assert!(matches!(err, AuthError::KeyFileFormat { .. }), "{err}");
        assert!(!err.to_string().contains(&secret[..16]), "{err}");
    }
    // Uppercase hex (pasted from elsewhere) is fine.
    write_mode(
        &path,
        &format!("id = \"k\"\nsecret = \"{}\"\n", secret.to_uppercase()),
        0o600,
    );
    load_key(&path, own_files()).expect("uppercase hex");

    let err = load_key(dir.path(), own_files()).expect_err("a directory");
    assert!(matches!(err, AuthError::KeyFileNotRegular { .. }), "{err}");
    let err = load_key(&dir.path().join("absent.key"), own_files()).expect_err("absent");
    assert!(
        matches!(err, AuthError::KeyFileIo { action: "open", .. }),
        "{err}"
    );
}

#[test]
fn generate_writes_mode_0600_and_refuses_to_overwrite() {
    let dir = tempdir();
    let path = dir.path().join("ops.key");
    let k = generate_key("ops-2026-11").expect("key");
    write_key_file(&path, &k).expect("write");
    let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600);
    let before = std::fs::read(&path).expect("read");
    let err = write_key_file(&path, &generate_key("other").expect("key")).expect_err("exists");
    assert!(matches!(err, AuthError::KeyFileExists { .. }), "{err}");
    assert_eq!(std::fs::read(&path).expect("read"), before, "untouched");

    // A symlink at the path is not followed.
    let link = dir.path().join("link.key");
    std::os::unix::fs::symlink(dir.path().join("target.key"), &link).expect("symlink");
    let err = write_key_file(&link, &k).expect_err("symlink");
    assert!(matches!(err, AuthError::KeyFileExists { .. }), "{err}");
    assert!(!dir.path().join("target.key").exists());

    // What was written signs requests the loaded copy verifies.
    let loaded = load_key(&path, own_files()).expect("loads");
    assert_eq!(loaded.id(), "ops-2026-11");
    let v = Verifier::new(Keyring::new(vec![], vec![loaded]).expect("ring"), SKEW);
    let auth = sign(&k, "DELETE", "/jails/web", b"", NOW);
    verify(&v, "DELETE", "/jails/web", &auth, b"", NOW, Role::Operator).expect("verifies");

    let a = generate_key("a").expect("key");
    let b = generate_key("b").expect("key");
    Keyring::new(vec![a], vec![b]).expect("two generated keys never share a secret");
    assert!(matches!(
        generate_key("bad id"),
        Err(AuthError::InvalidKeyId { .. })
    ));
}

fn secret_hex(path: &Path) -> String {
    let text = std::fs::read_to_string(path).expect("read");
    let line = text
        .lines()
        .find(|l| l.starts_with("secret"))
        .expect("secret line");
    line.split('"').nth(1).expect("quoted").to_string()
}

#[test]
fn debug_and_errors_never_show_the_secret_or_the_expected_signature() {
    let dir = tempdir();
    let path: PathBuf = dir.path().join("ops.key");
    write_key_file(&path, &generate_key("ops-a").expect("key")).expect("write");
    let secret = secret_hex(&path);
    let k = load_key(&path, own_files()).expect("loads");

    let debug = format!("{k:?} {:?}", Signer::new(k.clone()));
    assert!(debug.contains("ops-a"), "{debug}");
    assert!(!debug.contains(&secret), "{debug}");
    let v = Verifier::new(Keyring::new(vec![], vec![k.clone()]).expect("ring"), SKEW);
    let debug = format!("{v:?}");
    assert!(!debug.contains(&secret), "{debug}");
    // Nor the secret field in any form (hex, or Debug's array of bytes).
    assert!(!debug.contains("secret"), "{debug}");

    // The signature the verifier expected for a tampered body.
    let good = sign(&k, "PUT", "/jails/web", b"real", NOW);
    let expected = good.rsplit("sig=").next().expect("sig").to_string();
    let err = verify(
        &v,
        "PUT",
        "/jails/web",
        &good,
        b"forged",
        NOW,
        Role::Operator,
    )
    .expect_err("bad signature");
    let texts = [
        err.to_string(),
        format!("{err:?}"),
        verify(
            &v,
            "PUT",
            "/jails/web",
            &good,
            b"real",
            NOW + 999,
            Role::Operator,
        )
        .expect_err("stale")
        .to_string(),
        verify(&v, "PUT", "/jails/web", &good, b"real", NOW, Role::Node)
            .expect_err("role")
            .to_string(),
    ];
    for text in &texts {
        assert!(!text.contains(&secret), "{text}");
    }
    // The expected signature for the forged body is not the one sent; it must
    // not appear either. Recompute it to be sure what to look for.
    let forged_sig = Signer::new(k.clone())
        .authorization_with_nonce(
            "PUT",
            "/jails/web",
            b"forged",
            NOW,
            parse_authorization(&good).expect("parses").nonce,
        )
        .expect("signs");
    let forged_sig = forged_sig.rsplit("sig=").next().expect("sig");
    assert_ne!(forged_sig, expected);
    for text in &texts {
        assert!(!text.contains(forged_sig), "{text}");
    }
}

fn request(method: &str, raw_path: &str, headers: Vec<(String, String)>, body: &[u8]) -> Request {
    let (path, query) = match raw_path.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (raw_path.to_string(), None),
    };
    Request {
        method: method.into(),
        path,
        raw_path: raw_path.into(),
        query,
        headers,
        body: body.to_vec(),
        peer: Peer::Tcp(SocketAddr::from(([192, 0, 2, 7], 40000))),
    }
}

#[test]
fn verify_request_signs_the_raw_target_and_wants_one_header() {
    let signer = Signer::new(key("ops-a", 2));
    let headers = sign_headers(&signer, "GET", "/jails?all=1", b"", NOW).expect("signs");
    assert_eq!(headers.len(), 1);
    assert_eq!(headers[0].0, "Authorization");
    let v = verifier();
    let req = request("GET", "/jails?all=1", headers.clone(), b"");
    verify_request(&v, &req, Role::Operator, NOW).expect("accepted");

    let other = sign_headers(&signer, "GET", "/jails?all=1", b"", NOW).expect("signs");
    let mut two = other.clone();
    two.push(("authorization".into(), other[0].1.clone()));
    let err = verify_request(
        &v,
        &request("GET", "/jails?all=1", two, b""),
        Role::Operator,
        NOW,
    )
    .expect_err("two headers");
    assert!(matches!(err, AuthError::Malformed { .. }), "{err}");

    let err = verify_request(
        &v,
        &request("GET", "/jails", vec![], b""),
        Role::Operator,
        NOW,
    )
    .expect_err("unsigned");
    assert!(matches!(err, AuthError::Missing), "{err}");
    let resp = refusal(&err);
    assert_eq!(resp.status, 401);
    assert_eq!(resp.header("WWW-Authenticate"), Some("Keel-HMAC-SHA256"));
}

#[test]
fn signed_requests_over_a_real_server() {
    let v = Arc::new(verifier());
    let handler_v = Arc::clone(&v);
    let handler = move |req: Request| match verify_request(
        &handler_v,
        &req,
        Role::Operator,
        keel::common::auth::unix_now(),
    ) {
        Ok(who) => Response::text(200, who.key_id),
        Err(e) => refusal(&e),
    };
    let shutdown = ShutdownSignal::new();
    let server = Server::new(Arc::new(handler), ServerLimits::default(), shutdown.clone());
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let accept = server.serve_tcp(listener).expect("serve");
    let client = Client::new(Endpoint::Tcp(addr.to_string())).with_timeout(Duration::from_secs(10));

    let signer = Signer::new(key("ops-a", 2));
    let target = "/jails/web?dry=1";
    let body = b"kind: Jail\n";
    let now = keel::common::auth::unix_now();
    let headers = sign_headers(&signer, "PUT", target, body, now).expect("signs");
    let ok = client
        .request("PUT", target, &headers, body)
        .expect("response");
    assert_eq!((ok.status, ok.body.as_slice()), (200, &b"ops-a"[..]));

    let replay = client
        .request("PUT", target, &headers, body)
        .expect("response");
    assert_eq!(replay.status, 401);
    assert!(String::from_utf8_lossy(&replay.body).contains("replayed"));

    let unsigned = client.request("PUT", target, &[], body).expect("response");
    assert_eq!(unsigned.status, 401);
    assert_eq!(
        unsigned.header("www-authenticate"),
        Some("Keel-HMAC-SHA256")
    );

    let node = Signer::new(key("node-a", 1));
    let headers = sign_headers(&node, "PUT", target, body, now).expect("signs");
    let wrong_role = client
        .request("PUT", target, &headers, body)
        .expect("response");
    assert_eq!(wrong_role.status, 401);

    shutdown.trigger();
    accept.join().expect("accept loop");
}

fn arb_header() -> impl Strategy<Value = AuthHeader> {
    (
        "[A-Za-z0-9._-]{1,64}",
        any::<u64>(),
        any::<[u8; 16]>(),
        any::<[u8; 32]>(),
    )
        .prop_map(|(key_id, ts, nonce, sig)| AuthHeader {
            key_id,
            ts,
            nonce,
            sig,
        })
}

proptest! {
    #[test]
    fn parse_authorization_never_panics(s in any::<String>()) {
        let _ = parse_authorization(&s);
    }

    #[test]
    fn parse_authorization_never_panics_near_valid_input(
        h in arb_header(),
        cut in 0usize..200,
        insert in "[ ,=\t\"a-f0-9]{0,4}",
    ) {
        let text = h.to_string();
        let mut cut = cut.min(text.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let mutated = format!("{}{insert}{}", &text[..cut], &text[cut..]);
        let _ = parse_authorization(&mutated);
        let _ = parse_authorization(&text[..cut]);
    }

    #[test]
    fn rendered_headers_parse_back(h in arb_header()) {
        prop_assert_eq!(parse_authorization(&h.to_string()).expect("parses"), h);
    }
}
