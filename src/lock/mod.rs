//! The lease lock manager: shared/exclusive locks keyed by strings, kept as rows in SQLite (one
//! machine), PostgreSQL (several), or this process's memory.
//!
//! The layers, from the user's side down; each imports only from the layers below it (and the
//! vocabulary every layer speaks: `types.rs`, `error.rs`), so the storage imports nothing from
//! the worker, and neither imports the public face:
//!
//! - **the public face**: `manager.rs` (`LockManager`: opening, reading, an operator's removal,
//!   shutdown), `acquire.rs` (acquisition, from `exclusive()` to the `Guard`: the wait, the
//!   waiter's heartbeat, the grant taken with its `lost` signal, the clean-up of an
//!   interrupted or dropped acquisition), `guard.rs` (`Guard`), `builder.rs` (settings, and one
//!   line per backend), `types.rs` (requests, modes, what `inspect` shows), `error.rs`,
//!   `changes.rs` (a store's changes as a stream), `check.rs` (checks of a store as it is);
//!   `handle.rs` (the command sender, and the calls made through
//!   it), `heartbeat.rs` (lease renewal);
//! - **what a handle's parts share**, `state/`: the owner's settings and counters (`mod.rs`), its
//!   held leases with their deadlines (`held.rs`: one owner for them, the one place a lost lease
//!   is told), and the worker's replies as callers await them (`reply.rs`);
//! - **pure policy**: `grant.rs` (the grant rule, over rows), `time.rs` (microseconds and
//!   deadlines);
//! - **the worker**, `worker/`: its run loop and invariants (`mod.rs`), the commands handles send
//!   it (`protocol.rs`), a batch (`batch.rs`), a write transaction and what it decided
//!   (`transaction.rs`), decisions in one call (`at_once.rs`), work whose answer was lost and
//!   what it doubts (`recovery.rs`), looking for other managers' changes and the waiting marker
//!   (`look.rs`, with what an owner waits for in `watch.rs`), settling waits and leases after a
//!   commit or a renewal (`settle.rs`), and an operator's removal (`evict.rs`). Its state is
//!   grouped by concern into types that own their fields (`Waits`, `Looks`, `Marker`,
//!   `Decisions`, `Doubts`);
//! - **storage**, `backend/`: the seam (`mod.rs`: `Storage`, `Capabilities`, `Poke`, `Serve`, the
//!   rows it hands back; `codec.rs`: how fields are written), the managers of one process that
//!   share a store, woken by each other's commits (`siblings.rs`), and one folder per backend,
//!   each opened by its own `serve` and waking other managers its own way after a commit
//!   (`Storage::wake_others`): `sqlite/` (this process's siblings, and the doorbell between
//!   processes), `postgres/` (behind the `postgres` feature: connection string and TLS, schema
//!   and its SQL, decisions in one round trip, its siblings and the listener), and `memory/` (no
//!   thread, no time of its own: what the simulation steps; its managers are all siblings).
//!
//! The cycles left are those of one idea in two files: a backend's folder and its parts, the
//! worker's run loop and its parts (one `Worker`, its methods split by concern).

mod acquire;
pub(crate) mod backend;
mod bound;
pub(crate) mod builder;
mod changes;
mod check;
mod election;
mod error;
pub(crate) mod grant;
mod guard;
mod handle;
mod heartbeat;
mod manager;
mod state;
pub(crate) mod time;
mod types;
pub(crate) mod worker;

pub use self::backend::memory::MemoryStore;
pub use self::builder::LockManagerBuilder;
pub use self::changes::Changes;
pub use self::check::Finding;
pub use self::election::{LeadError, Leader, Leadership, Observe};
pub use self::error::{LeaseLost, LockError, StorageError};
pub use self::guard::Guard;
pub use self::manager::LockManager;
pub use self::types::{
    EntryState, LockEntry, LockRequest, Mode, Removal, StorageStats, MAX_NAME_BYTES,
};

pub(crate) use self::handle::Shared;
pub(crate) use self::state::Common;
