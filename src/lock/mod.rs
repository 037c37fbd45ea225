//! The lease lock manager: shared/exclusive locks keyed by strings, kept as rows in SQLite (one
//! machine) or PostgreSQL (several).
//!
//! Layout, from the user's side down:
//!
//! - the public face: `manager.rs` (`LockManager` and acquisition as a `Scoped` future),
//!   `guard.rs` (`Guard`, and the bookkeeping of an owner's guards), `builder.rs`, `types.rs`
//!   (requests, modes, what `inspect` shows), `error.rs`;
//! - `handle.rs`: what a handle is made of (the command sender, and what the worker, the
//!   heartbeats and the guards share); `reply.rs`: awaiting the worker's replies;
//! - the worker and its policy: `protocol.rs` (the commands handles send it, and its replies),
//!   `worker.rs` (the storage thread that orders and batches commands), `watch.rs` (what an
//!   owner waits for, and when to look again), `grant.rs` (the grant rule, pure), `heartbeat.rs` (lease renewal),
//!   `siblings.rs` (wake-ups between managers of one process);
//! - storage: `storage.rs` (the trait the worker needs of a backend, and the rows it gets
//!   back), `sqlite.rs` (schema, migrations, one method per statement), `doorbell.rs` (wake-ups
//!   between processes on one SQLite file), `postgres.rs` (the same for PostgreSQL, behind the
//!   `postgres` feature).

mod backend;
mod builder;
mod error;
mod grant;
mod guard;
mod handle;
mod heartbeat;
mod manager;
mod state;
mod time;
mod types;
mod worker;

pub use self::backend::memory::MemoryStore;
pub use self::builder::LockManagerBuilder;
pub use self::error::{LeaseLost, LockError};
pub use self::guard::Guard;
pub use self::manager::LockManager;
pub use self::types::{EntryState, LockEntry, LockRequest, Mode, StorageStats, MAX_NAME_BYTES};

pub(crate) use self::handle::Shared;
pub(crate) use self::state::Common;
