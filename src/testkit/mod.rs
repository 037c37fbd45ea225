//! Tools for testing code that uses this library (feature `testkit`).
//!
//! - [`Sim`]: a seeded, single-threaded executor on virtual time. It runs a future and all the
//!   background work it starts (fibers, handed-off clean-ups, timers) to the end, polls ready
//!   tasks in an order drawn from a seed, moves its clock straight to the next deadline when
//!   nothing is ready, and reports a deadlock or a leaked task, with the trace to replay the run.
//! - [`Sim::events`] and [`check_cleanup`]: what the structured core did in a run (scopes,
//!   finalizers, fibers, interruptions), and the oracle that checks the clean-up promises over
//!   it.
//! - [`every_await_point`]: the same work stopped before each of its await points in turn, by
//!   signal or by drop, each run checked for leaks and by `check_cleanup`.
//! - [`strategy`]: proptest strategies for a seed, a way to stop and a point to stop before,
//!   for property tests that check one case at a time with [`stop_at`].
//! - [`SimStore`], [`FaultPlan`] and [`check_locks`]: the lock manager inside the simulation
//!   ([`open_simulated`](crate::LockManagerBuilder::open_simulated)). Several managers share a
//!   simulated store as processes share a database, their workers stepped as tasks on virtual
//!   time; a test kills or stops them, their connections meet storage faults drawn from the
//!   seed or listed, and the oracle judges what the store saw by the grant rule.
//! - [`postgres`] (unix): a real, throwaway PostgreSQL server, started from the server programs
//!   on the machine (`pg_config --bindir`) for a test run and gone when it ends, as this
//!   library's own PostgreSQL tests use it.

mod events;
mod explore;
pub(crate) mod locks;
#[cfg(unix)]
pub mod postgres;
pub(crate) mod sim;
pub mod strategy;

pub use events::{check_cleanup, CleanupViolation, Event};
pub use explore::{every_await_point, stop_at, Explored, Explorer, Failure, Stop};
pub use locks::{check_locks, Fault, FaultPlan, LockEvent, LockHistory, SimStore};
pub use sim::{Sim, SimConfig, SimError};
