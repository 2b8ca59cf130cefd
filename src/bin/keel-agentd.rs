//! `keel-agentd`.

fn main() {}
