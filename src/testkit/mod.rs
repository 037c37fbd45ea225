//! Tools for testing code that uses this library (feature `testkit`).
//!
//! - [`Sim`]: a seeded, single-threaded executor on virtual time. It runs a future and all the
//!   background work it starts (fibers, handed-off clean-ups, timers) to the end, polls ready
//!   tasks in an order drawn from a seed, moves its clock straight to the next deadline when
//!   nothing is ready, and reports a deadlock or a leaked task, with the trace to replay the run.
//! - [`Sim::events`] and [`check_cleanup`]: what the structured core did in a run (scopes,
//!   finalizers, fibers, interruptions), and the oracle that checks the clean-up promises over
//!   it.
//! - [`postgres`] (unix): a real, throwaway PostgreSQL server, started from the server programs
//!   on the machine (`pg_config --bindir`) for a test run and gone when it ends, as this
//!   library's own PostgreSQL tests use it.

mod events;
#[cfg(unix)]
pub mod postgres;
pub(crate) mod sim;

pub use events::{check_cleanup, CleanupViolation, Event};
pub use sim::{Sim, SimConfig, SimError};
