//! Throwaway certificate authorities for tests that need TLS between real
//! processes (Pebble's own HTTPS listener, nginx in front of a backend).
//! Keys live only in memory and the test's temporary directory; nothing here
//! is ever trusted outside the test that made it.

use std::fs;
use std::path::{Path, PathBuf};

/// A self-signed CA that signs leaves for the names a test asks for.
pub struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// The CA certificate (PEM), for the client side to trust.
    pub pem: String,
}

/// A leaf certificate and its key, written as PEM files.
pub struct Leaf {
    /// The leaf certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA whose subject is `name`.
    pub fn new(name: &str) -> TestCa {
        let key = rcgen::KeyPair::generate().expect("ca key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).expect("ca cert");
        TestCa {
            issuer: rcgen::Issuer::new(params, key),
            pem: cert.pem(),
        }
    }

    /// A leaf for `names` (host names or IP addresses), written to
    /// `dir/{stem}.pem` and `dir/{stem}.key`.
    pub fn leaf(&self, names: &[&str], dir: &Path, stem: &str) -> Leaf {
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let cert = rcgen::CertificateParams::new(names)
            .expect("leaf params")
            .signed_by(&key, &self.issuer)
            .expect("leaf cert");
        let leaf = Leaf {
            cert: dir.join(format!("{stem}.pem")),
            key: dir.join(format!("{stem}.key")),
        };
        fs::write(&leaf.cert, cert.pem()).expect("write leaf");
        fs::write(&leaf.key, key.serialize_pem()).expect("write key");
        leaf
    }
}
