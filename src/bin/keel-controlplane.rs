//! `keel-controlplane`.

fn main() {}
