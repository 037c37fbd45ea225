//! Resources whose clean-up always runs, even when work is cancelled.
//!
//! `leasehold` has two halves that grow from one idea.
//!
//! **Structured concurrency**, in the style of Effect and ZIO:
//!
//! - [`Scope`]: async finalizers that always run, last in first out, each told how the scope
//!   ended; fibers forked into it are interrupted and awaited when it closes.
//! - [`Scoped`]: a future that owns a scope and closes it, every finalizer finished, before it
//!   resolves. Attach an [`AbortSignal`] and it stops at its next await point, unwinds nested
//!   `Scoped` futures inner first, and resolves with [`Interrupted`] carrying *your* reason.
//! - [`Fiber`]: spawned work tied to a scope ([`Scope::fork`]) or to nothing ([`fork_daemon`]);
//!   [`Fiber::interrupt`] waits for its clean-up before it reports.
//! - [`race`], [`race_first`] and [`all`]: Effect's `raceAll`, `raceFirst` and `all` over
//!   `Scoped` futures (the first to succeed, the first to finish, every one); the losers are
//!   interrupted ([`RaceLost`]) and their clean-up has finished before any of them resolves.
//! - [`Schedule`]: retry and repeat policies as values (`spaced`, `fixed`, `exponential`,
//!   `recurs`, `jittered`, `capped`, `up_to`, `union`, `intersect`), driven by `retry` and
//!   `repeat` or stepped by hand ([`ScheduleRun`]); the lock manager's own timing is built from
//!   them.
//! - [`Semaphore`]: fair, strictly FIFO. [`Clock`]: [`SystemClock`], or [`TestClock`] whose time
//!   moves only when a test says so. Schedules, timeouts ([`Scoped::timeout`]) and sleeps run on
//!   the clock's monotonic time, so a step of the wall clock (NTP, a laptop waking up) changes
//!   none of them; leases are judged on a time that processes share: the machine's boot clock
//!   for SQLite, which no step moves, the server's clock for PostgreSQL.
//!
//! **A lease lock manager** built from those parts ([`LockManager`]): shared/exclusive locks keyed
//! by strings, and keyed permits (at most N of a key's permits held at once:
//! [`LockManager::permits`]), kept as rows in one SQLite file so that several processes on one
//! machine coordinate (or, with the `postgres` feature, in PostgreSQL for processes on several
//! machines, or in this process's memory: [`MemoryStore`]), with a FIFO queue and writer
//! preference, leases renewed by heartbeats, all-or-nothing acquisition of several keys, fencing
//! tokens, and cancellation that never leaves a row behind. On it: leader election
//! ([`LockManager::campaign`], [`LockManager::lead`], [`LockManager::observe`]), work bound to
//! a lease ([`LockManager::with_lock`]: interrupted a heartbeat before the lease could run out,
//! and cleaned up before anyone else is let in), and jobs that run once per recurrence across
//! a fleet ([`LockManager::every`]).
//!
//! Every future works under any executor (`futures::executor::block_on`, smol, tokio) with no
//! runtime feature switched on. Background work goes through a [`Spawner`]; see below for which.
//!
//! # Where background work runs
//!
//! Background work is whatever must go on after its caller is gone: fibers, the rest of a dropped
//! `Scoped`'s close, a lock manager's heartbeats. **It runs on the spawner given explicitly
//! ([`Scoped::with_spawner`], [`Scope::with_spawner`], [`LockManagerBuilder::spawner`]), else on
//! the enclosing scope's (a `Scoped` first polled inside another inherits it, a forked fiber uses
//! its scope's), else, with the `tokio` feature, on the tokio runtime the `Scoped` is first polled
//! on, else on smol's global executor.** ([`Scope::new`] and [`fork_daemon`] take the same
//! default where they are called. A lock manager built without a spawner follows the same rule:
//! an acquisition is a `Scoped`, and the owner's lock heartbeat starts where the guard that
//! needed it was taken.) A timeout, and a guard's [`lost`](Guard::lost) signal, need no task
//! at all: they abort by their clock, seen by whoever looks at them or awaits them.
//!
//! The library starts these threads:
//!
//! - one storage thread per [`LockManager`], which owns its connection to the store (and the
//!   whole store, for one in memory); beside it, on a SQLite file, a doorbell thread (on unix:
//!   other processes ring it to wake this manager's waiters), and on PostgreSQL a listener
//!   thread (its own connection, which `LISTEN`s);
//! - smol's global executor threads (one unless `SMOL_THREADS` says otherwise), only when some
//!   work falls to smol's executor: the default spawner without the `tokio` feature or outside a
//!   tokio runtime, or an explicit [`SmolSpawner`];
//! - async-io's timer driver thread, for [`SystemClock`] sleeps and timeouts; its wake-ups work
//!   under any executor.
//!
//! With the `tokio-util` feature, a tokio-util `CancellationToken` becomes an [`AbortSignal`]
//! (`AbortSignal::from(token)`, which starts no task) and a signal gives a token that it
//! cancels when it aborts (`AbortSignal::cancellation_token`), for services whose other parts
//! stop on tokens.
//!
//! To keep all background work on your own runtime: on tokio, switch on the `tokio` feature (or
//! set [`Scoped::with_spawner`] with a `TokioSpawner` on the outermost `Scoped` of each
//! request). On any other executor, pass a [`Spawner`] (a closure that spawns onto it) there,
//! and to [`LockManagerBuilder::spawner`] for a lock manager whose guards outlive the requests
//! that took them. Work on a runtime runs
//! only while the runtime does (a current-thread runtime, while something drives it) and stops
//! when it shuts down, clean-up included: keep the runtime running until the work you started on
//! it has finished.
//!
//! # Cancel safety
//!
//! Rust cancels a future by dropping it, and `Drop` cannot await. This crate therefore offers two
//! ways to stop work, and says for every async method what each does:
//!
//! - **Interruption** (an [`AbortSignal`] attached with [`Scoped::with_signal`], or
//!   [`Fiber::interrupt`]): the work stops at its next await point, its clean-up runs to the end,
//!   and only then does the future resolve with [`Interrupted`]. This is the dependable way.
//! - **Dropping** an unfinished future: its clean-up is handed to the spawner and runs in the
//!   background. Inside another `Scoped`, the parent's close waits for it, so nothing outlives
//!   the enclosing scope.
//!
//! # Testing your own code
//!
//! With the `testkit` feature, `leasehold::testkit` has a simulation kit for property tests of
//! abort ordering: a seeded executor on virtual time (`testkit::Sim`), the clean-up oracle
//! (`testkit::check_cleanup`), and the work stopped before each of its steps
//! (`testkit::every_await_point`) or before one that a proptest draws (`testkit::stop_at`):
//!
//! ```
//! use leasehold::{Interrupted, Scoped, Semaphore};
//!
//! /// The code under test: holds a permit, forks an upload, cleans up after itself.
//! fn upload(uploads: Semaphore) -> Scoped<u32, Interrupted> {
//!     Scoped::new(move |scope| async move {
//!         scope.adopt(uploads.acquire(1).await); // released when the scope closes
//!         scope.add_finalizer(|_| async { /* delete the partial file */ });
//!         let sent = scope.fork(async { 3 }); // interrupted and awaited by the close
//!         Ok(sent.join().await.success().unwrap_or(0))
//!     })
//! }
//!
//! # #[cfg(feature = "testkit")] {
//! use leasehold::testkit::{stop_at, strategy, SimConfig};
//! use proptest::prelude::*;
//!
//! proptest! {
//!     // In a test file: #[test]
//!     fn upload_cleans_up_wherever_it_stops(
//!         seed in strategy::seed(),
//!         stop in strategy::stop(),
//!         point in strategy::interrupt_at(),
//!     ) {
//!         let uploads = Semaphore::new(1);
//!         let mut config = SimConfig::default();
//!         config.seed = seed;
//!         let result = stop_at(config, stop, point, |_| upload(uploads.clone()));
//!         prop_assert!(result.is_ok(), "{}", result.unwrap_err());
//!         prop_assert_eq!(uploads.available(), 1, "the permit came back");
//!     }
//! }
//! # upload_cleans_up_wherever_it_stops();
//! # }
//! ```
//!
//! Code that takes locks is tested the same way, with the lock manager inside the simulation:
//! `testkit::SimStore`, managers opened on it by `LockManagerBuilder::open_simulated` with a
//! `testkit::FaultPlan` of storage faults, and `testkit::check_locks` over what the store saw.
//! The README has a complete example.
//!
//! # When not to use it
//!
//! If your tasks share memory in one process and need no async clean-up, `async-lock` or tokio's
//! `sync` module are simpler and faster. SQLite coordinates processes on one machine only; if
//! yours span several, switch the lock manager to PostgreSQL (feature `postgres`,
//! `LockManager::connect`), or use a lock service (etcd, ZooKeeper) if you run one already.
//!
//! # Examples
//!
//! ```
//! use std::time::Duration;
//! use leasehold::{AbortController, Interrupted, Scoped};
//!
//! # futures::executor::block_on(async {
//! let stop = AbortController::new();
//! let work = Scoped::<(), Interrupted>::new(|scope| async move {
//!     scope.add_finalizer(|status| async move {
//!         // async clean-up: runs to completion before `work` resolves
//!         println!("closing after {status:?}");
//!     });
//!     std::future::pending().await
//! })
//! .with_signal(&stop.signal());
//! stop.abort("user pressed stop");
//! let error = work.await.unwrap_err();
//! assert_eq!(error.to_string(), "interrupted: user pressed stop");
//! # });
//! ```

//!
//! Leader election among replicas (two managers here; one per process in real use, on a SQLite
//! file or PostgreSQL), the leader's work bound to its lease:
//!
//! ```
//! use futures::StreamExt;
//! use leasehold::{Interrupted, LockManager, MemoryStore, Scoped};
//!
//! # futures::executor::block_on(async {
//! let store = MemoryStore::new();
//! let (a, b) = (LockManager::builder().open_in(&store)?, LockManager::builder().open_in(&store)?);
//! let leading = a.campaign("scheduler", "a:8080").await?;
//! let mut leaders = b.observe("scheduler");
//! let seen = leaders.next().await.unwrap()?.expect("a leads");
//! assert_eq!((seen.value.as_str(), seen.term), ("a:8080", leading.term()));
//!
//! // b waits in line, then runs its body while it leads, and resigns when the body ends.
//! let b_leads = b.lead("scheduler", "b:8080", |leadership| {
//!     let term = leadership.term(); // a fencing token for the leader's writes
//!     Scoped::<_, Interrupted>::new(move |scope| async move {
//!         scope.add_finalizer(|status| async move { println!("b stepped down: {status}") });
//!         Ok(term)
//!     })
//! });
//! let first_term = leading.term();
//! let (resigned, led) = futures::join!(leading.resign(), b_leads);
//! resigned?;
//! assert!(led.expect("b led") > first_term, "terms only grow");
//! assert_eq!(b.leader("scheduler").await?, None);
//! # Ok::<(), leasehold::LockError>(())
//! # }).unwrap();
//! ```

// Denied everywhere but in `semaphore`, whose permits share its state without a reference count
// (see the memory invariants there), and which allows it for that alone; and in one function
// each for the system calls libc offers only as `unsafe` (`clock_gettime`, `geteuid`).
#![deny(unsafe_code)]
// On docs.rs (`--cfg docsrs`, a nightly rustdoc): each feature-gated item says what it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]

mod abort;
mod clock;
mod exit;
mod fiber;
mod lock;
mod race;
// Always compiled, its hooks always run; only the kit's `Sim` enters a runtime, so without the
// kit the parts that enter one and read what it is told go unused.
#[cfg_attr(not(feature = "testkit"), allow(dead_code))]
mod runtime;
mod schedule;
mod scope;
mod semaphore;
mod spawn;
mod sync;
#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub mod testkit;
#[cfg(feature = "tokio-util")]
mod token;

pub use abort::{AbortController, AbortSignal, Dropped, Interrupted, TimedOut};
pub use clock::{BootTime, Clock, SystemClock, TestClock};
pub use exit::{AbortReason, ExitStatus};
pub use fiber::{fork_daemon, Exit, Fiber};
pub use lock::{
    Changes, EntryState, Finding, Guard, LeadError, Leader, Leadership, LeaseLost, LockEntry,
    LockError, LockManager, LockManagerBuilder, LockRequest, MemoryStore, Mode, Observe, Removal,
    StorageError, StorageStats, MAX_NAME_BYTES,
};
pub use race::{all, race, race_first, RaceLost};
pub use schedule::{Schedule, ScheduleRun};
pub use scope::{scoped, Release, Scope, ScopeClosed, Scoped};
pub use semaphore::{Acquire, Permit, Semaphore};
#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub use spawn::TokioSpawner;
pub use spawn::{SmolSpawner, Spawner};
#[cfg(feature = "tokio-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio-util")))]
pub use token::TokenCancelled;

/// The README's examples, compiled and run as doc tests so that they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
