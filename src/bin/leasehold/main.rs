//! `leasehold`: run a program under a lock, and see, mend and check what a store holds.
//! Built with the `cli` feature; `leasehold --help` says how to use it. Unix only: it lives by
//! signals and process groups. It is a client of the library's public API alone (the admin
//! API: `LockManager::changes`, `remove`, `LockManagerBuilder::open_existing`, `check`), as any
//! operator's tool could be.

#![deny(unsafe_code)]
#![warn(rust_2018_idioms, unreachable_pub)]

#[cfg(unix)]
mod cli;

#[cfg(unix)]
fn main() -> std::process::ExitCode {
    cli::main()
}

#[cfg(not(unix))]
fn main() -> std::process::ExitCode {
    eprintln!("leasehold: the command runs on unix only");
    std::process::ExitCode::from(2)
}
