//! `keelctl`: the command-line client. Everything lives in [`keel::ctl`]; this
//! file only turns its result into the exit status.

fn main() {
    std::process::exit(keel::ctl::main());
}
