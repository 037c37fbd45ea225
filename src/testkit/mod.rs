//! Tools for testing code that uses this library (feature `testkit`).
//!
//! - [`postgres`] (unix): a real, throwaway PostgreSQL server, started from the server programs
//!   on the machine (`pg_config --bindir`) for a test run and gone when it ends, as this
//!   library's own PostgreSQL tests use it.

#[cfg(unix)]
pub mod postgres;
