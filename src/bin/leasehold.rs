//! `leasehold`: run a program under a lock, and see, mend and check what a store holds.
//! Built with the `cli` feature; `leasehold --help` says how to use it.

fn main() -> std::process::ExitCode {
    leasehold::cli::main()
}
