//! `keel-agentd`: the node agent. Everything lives in [`keel::agentd`]; this
//! file only turns its result into the exit status.

fn main() {
    std::process::exit(keel::agentd::cli::main());
}
