//! What a handle's parts share: the owner's settings and counters, its held leases (`held.rs`),
//! and its replies (`reply.rs`). The worker, the heartbeats and the guards see the same
//! `Common`; none of them holds the command sender, so the worker stops when every handle is
//! gone.

pub(crate) mod held;
pub(crate) mod reply;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use event_listener::Event;

use crate::clock::Clock;
use crate::schedule::Schedule;
use crate::spawn::Spawner;

use self::held::Guards;
use self::reply::Replies;

/// What the storage worker and the heartbeats share with the handles (no command sender: the
/// worker stops when every handle is gone).
pub(crate) struct Common {
    pub(crate) owner: String,
    pub(crate) lease: Duration,
    pub(crate) heartbeat: Duration,
    /// The change poll's cadence (`LockManagerBuilder::poll_schedule`).
    pub(crate) poll: Schedule,
    /// Waits while the database is busy, and reconnects (`LockManagerBuilder::busy_schedule`).
    pub(crate) busy: Schedule,
    pub(crate) clock: Arc<dyn Clock>,
    /// Given to the builder; `None`: background work follows the caller.
    pub(crate) spawner: Option<Arc<dyn Spawner>>,
    pub(crate) counters: Counters,
    pub(crate) guards: Mutex<Guards>,
    /// Notified after every commit that freed or promoted something, and when other processes
    /// changed the file: waiters without a queue position try again.
    pub(crate) changed: Event,
    /// Waiters without a queue position (`many`), so the worker keeps looking for changes.
    pub(crate) unqueued: AtomicUsize,
    /// Watchers of every change (the command's `watch`): while there are any, the worker keeps
    /// looking for changes, has its storage announce every release and promotion to it (as to a
    /// waiter without a row), and notifies `changed` whenever a look finds a commit.
    pub(crate) watchers: AtomicUsize,
    /// What the rows are kept in, named so that the managers of this process that share it
    /// agree (the file's absolute path; PostgreSQL's host, database and schema), for waking each
    /// other; `None` for a private in-memory database. Never holds a password.
    pub(crate) store: Option<String>,
    /// The worker's replies, as awaited by callers.
    pub(crate) replies: Replies,
}

/// Counters since open; see `StorageStats`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) write_transactions: AtomicU64,
    pub(crate) change_checks: AtomicU64,
    pub(crate) heartbeats: AtomicU64,
    /// Shared with the storage, which counts as it waits.
    pub(crate) lock_waits: Arc<AtomicU64>,
}

impl Counters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
