//! `keel-controlplane`: the control plane. Everything lives in
//! [`keel::controlplane`]; this file only turns its result into the exit status.

fn main() {
    std::process::exit(keel::controlplane::cli::main());
}
