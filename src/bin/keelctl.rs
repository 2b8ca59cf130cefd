//! `keelctl`.

fn main() {}
