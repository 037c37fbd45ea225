//! `leasehold`: run a program under a lock, and see, mend and check what a store holds.
//! Built with the `cli` feature; `leasehold --help` says how to use it. Unix only: it lives by
//! signals and process groups.

#[cfg(unix)]
fn main() -> std::process::ExitCode {
    leasehold::cli::main()
}

#[cfg(not(unix))]
fn main() -> std::process::ExitCode {
    eprintln!("leasehold: the command runs on unix only");
    std::process::ExitCode::from(2)
}
