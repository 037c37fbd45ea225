//! The storage worker: one OS thread per manager that owns its storage (see `backend/`), or,
//! for a manager inside a simulation (`open_simulated`), one task of the simulation that runs
//! the same steps (`step`), awaiting the next command or deadline instead of blocking for it.
//!
//! Callers send `Command`s (see `protocol.rs`) and await a reply (see `reply.rs`); no storage call
//! happens on a caller's executor thread.
//!
//! Invariants:
//!
//! 1. Commands are handled in the order they were sent. Writes that are ready together run in one
//!    transaction; replies go out only after it commits. Reads in the same batch
//!    run after the writes, so a caller that released (even by dropping a guard) and then
//!    inspects sees its release.
//! 2. Every transaction that deletes rows (release, cancel, shutdown) also promotes, on the keys
//!    of those rows, every waiter the grant rule now allows, whoever owns it, with its ticket
//!    kept. Decisions are key-local: a transaction reads and changes the rows of the keys it
//!    decides on (and of the other keys of the waiters it judges), never the whole table.
//! 3. A request is known to the worker by the caller's request id from the moment its rows are
//!    written until they are deleted. The caller sends `Remove` by that id, so it is right
//!    whether the acquisition was granted, queued or promoted; and since commands are handled in
//!    order, a `Remove` sent after an `Acquire` whose reply was never read still finds its rows.
//! 4. While this owner has waiters (or watchers: `LockManager::changes`, told of every commit a
//!    look finds), the worker asks storage what other connections changed
//!    (`Storage::changes`, a cheap check) when the poll's schedule says (on the monotonic time of
//!    the manager's clock) or when poked, and remembers, per key it waits on, when the first
//!    other owner's row there runs out (`watch.rs`). It reads a key's rows only when the key
//!    changed or such a lease ran out, and writes only when a waiter is grantable. A lease that
//!    runs out frees its key without anyone writing: the waiting owners' own deadlines are how
//!    they find out. Every promotion pass notes them again from what it read by the storage's
//!    own time, since a look judges by an estimate of it that may run ahead (PostgreSQL's).
//! 5. `Shutdown` is the last command handled: commands behind it, even in its own batch, are
//!    dropped unanswered (their callers see `Shutdown`), so no row is written after it.
//! 6. A wait whose rows are found gone ends by what the store recorded, never by a guess: with
//!    `LockError::Removed` if an operator removed it (a tombstone written in the transaction
//!    that deleted its rows: `evict.rs`), else as lapsed, and its caller queues again. While
//!    the store cannot say which, the wait goes on, and the next look asks again (`settle.rs`).
//! 7. The worker makes nothing a caller holds and runs no caller's code. It keeps a granted
//!    lease's deadline as data (`Guards::granted`), from which the caller who takes the grant
//!    makes its `lost` signal (`Guards::signal`); it tells a queued request that has waited long
//!    enough that its heartbeat is due (`WaitSlot::beat_due`), and the waiting caller forks it.
//! 8. After every commit the worker wakes its own waiters, then has its storage wake the other
//!    managers the commit concerns (`Storage::wake_others`): each backend has its own way (this
//!    process's managers of the store, `backend::siblings`; a doorbell; notifications), and the
//!    worker knows none of them.

mod at_once;
mod batch;
mod evict;
mod look;
pub(crate) mod protocol;
mod recovery;
mod relabel;
mod settle;
mod transaction;
pub(crate) mod watch;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::lock::backend::{
    AtOnce, Capabilities, Changes, Deleted, Outcome, OwnedRequest, Serve, Storage,
};
use crate::lock::grant::{
    grantable_now, misfit, misfit_beside, other_keys, promotable_within, RowView,
};
use crate::lock::state::Counters;
use crate::lock::time::{from_micros, micros};
use crate::lock::worker::protocol::{
    Acquired, Command, Grant, Removed, SlotState, Wait, WaitSlot, Write,
};
use crate::lock::worker::watch::{first_expiries, others_rows, Look, Waits};

use self::look::{Looks, Marker};
use self::recovery::Doubts;
use self::transaction::Decisions;
use crate::lock::{Common, LockError, LockRequest, StorageError};
use crate::schedule::{Schedule, ScheduleRun};
use crate::sync::lock;

/// At most this many commands go into one transaction.
const MAX_BATCH: usize = 256;

/// How long this owner stays marked as waiting (`Storage::waiting`) once its last caller waiting
/// without a row stopped: a task that waits again soon (a busy lock, taken in turns) keeps the
/// marker, rather than putting it up and taking it down at every turn.
const MARKER_LINGER: Duration = Duration::from_secs(1);

/// How long the worker keeps looking for the next command before it blocks.
const SPIN: Duration = Duration::from_micros(100);

/// How long a queued request waits before its caller is told to fork its heartbeat's fiber
/// (`WaitSlot::beat_due`): a
/// quarter of a heartbeat, well before its first renewal is due (a heartbeat after it was
/// sent). Most waits end sooner and never fork one.
fn beat_after(heartbeat: Duration) -> Duration {
    heartbeat / 4
}

/// When the worker looks for the next command again before it blocks: at once, for [`SPIN`].
fn spin_schedule() -> Schedule {
    Schedule::spaced(Duration::ZERO).up_to(SPIN)
}

/// What the worker remembers of a request whose rows it wrote.
struct Written {
    ticket: u64,
    keys: Vec<String>,
    /// Announced whenever granted at once or removed (`Write::Acquire`'s `announce`).
    announce: bool,
}

/// What a transaction freed, for waking waiters once it has committed.
struct Freed {
    /// Whether any row was deleted or promoted.
    any: bool,
    /// The promoted tickets, whoever owns them.
    promoted: Vec<u64>,
    /// When the promoted rows' leases began (clock micros).
    at: i64,
    /// The other owners whose requests were promoted: the managers of this process to wake,
    /// besides those with callers waiting without a row.
    owners: BTreeSet<String>,
}

/// The latest time (micros on the store's time line) at which leases can be kept: a lease of
/// the longest length the builder accepts (under `i64::MAX / 4` micros) still ends within an
/// `i64`. About 146,000 years from 1970 on a wall clock; a clock past it (a custom `Clock`,
/// `TestClock::set_wall_time`) is an error, not an overflow.
const LAST_TIME: i64 = i64::MAX / 2;

/// `now`, or an error if it is past [`LAST_TIME`].
fn within_time_line(now: i64) -> Result<i64, LockError> {
    if now > LAST_TIME {
        let why = format!(
            "the clock reads {now} µs, past the last time at which leases can be kept \
             ({LAST_TIME} µs)"
        );
        return Err(StorageError::new("reading the clock", why).into());
    }
    Ok(now)
}

/// What a write decided inside the transaction, delivered once it has committed.
enum Decided {
    /// Granted, with rows whose lease runs out at `expires_at` (the storage's time).
    Granted {
        ticket: u64,
        expires_at: i64,
    },
    Queued(u64),
    NotNow,
    /// The request may not be written beside the rows there (`grant::misfit`): why.
    Misfit(String),
    /// A removal: what it found of the request's rows.
    Removed(Removed),
    /// A renewal: this owner's live requests, all renewed.
    Renewed(Vec<OwnedRequest>),
    Done,
}

/// The worker that a backend hands its storage to once open (`Serve`): it runs there, on the
/// storage thread, until the manager is shut down or every handle is gone.
pub(crate) struct RunWorker {
    common: Arc<Common>,
    commands: Receiver<Command>,
}

impl RunWorker {
    pub(crate) fn new(common: Arc<Common>, commands: Receiver<Command>) -> Self {
        RunWorker { common, commands }
    }
}

impl Serve for RunWorker {
    fn serve<S: Storage>(self, storage: S) {
        Worker::new(storage, self.common, self.commands).run();
    }
}

pub(crate) struct Worker<S> {
    storage: S,
    /// What the storage can do (`Storage::capabilities`), asked once.
    caps: Capabilities,
    common: Arc<Common>,
    rx: Receiver<Command>,
    /// Request id -> its ticket and keys, for every request of this owner that has rows.
    /// In id order, so that what is done for several of them is done in the same order every
    /// run (a simulation replays it).
    requests: BTreeMap<u64, Written>,
    /// This owner's queued requests, and the keys it watches (see `watch.rs`).
    waits: Waits,
    /// When to look for other managers' changes, and what to read then (`look.rs`).
    looks: Looks,
    /// Whether storage is told that this owner waits (`look.rs`).
    marker: Marker,
    /// What the current transaction decided (`transaction.rs`).
    decisions: Decisions,
    /// Work whose answer was lost (`recovery.rs`).
    doubts: Doubts,
    /// When the last renewal renewed every live row of this owner, on the clock's monotonic
    /// time line: whether to renew again is judged on it alone, so that no step of a wall
    /// clock (nor of the store's) makes the worker skip renewals that are due.
    last_renewal: Option<Duration>,
    /// Whether a write was ever tried: until then this owner has no row, and closing it writes
    /// nothing (a manager that only read, as the command's `inspect`, leaves the store as it was).
    tried_writing: bool,
}

impl<S: Storage> Worker<S> {
    pub(crate) fn new(storage: S, common: Arc<Common>, rx: Receiver<Command>) -> Self {
        Worker {
            caps: storage.capabilities(),
            storage,
            rx,
            requests: BTreeMap::new(),
            waits: Waits::default(),
            looks: Looks::new(&common),
            marker: Marker::default(),
            decisions: Decisions::default(),
            doubts: Doubts::default(),
            last_renewal: None,
            tried_writing: false,
            common,
        }
    }

    fn now(&self) -> i64 {
        self.storage.now()
    }

    /// `at`, a time of the storage's clock, on the manager's clock's monotonic time line, where
    /// deadlines are kept and callers judge: never later than it is (`Storage::ahead_of`).
    fn monotonic_of(&self, at: i64) -> Duration {
        from_micros(at - self.storage.ahead_of(&*self.common.clock))
    }

    fn counters(&self) -> &Counters {
        &self.common.counters
    }

    fn has_waiters(&self) -> bool {
        !self.waits.is_empty() || self.unqueued_or_watched()
    }

    /// Whether callers wait without a row, or watch every change: what a release or promotion
    /// anywhere is announced to.
    fn unqueued_or_watched(&self) -> bool {
        self.common.unqueued.load(Ordering::SeqCst) > 0
            || self.common.watchers.load(Ordering::SeqCst) > 0
    }

    /// Serves commands on this thread until the manager is gone: spins a while for the next
    /// one (see `spin`), then blocks until it comes or the next look, beat or marker is due.
    pub(crate) fn run(mut self) {
        let mut spin = spin_schedule().start(Duration::ZERO);
        loop {
            let received = match self.spin(&mut spin) {
                Some(received) => received,
                None => {
                    self.common.replies.worker_sleeps();
                    // Blocks in real time for as long as the clock says is left, then reads the
                    // clock again: on the system clock that is the moment of the look, and a
                    // clock moved by hand (`TestClock`) is seen to move within one delay.
                    let received = match self.left() {
                        Some(left) => self.rx.recv_timeout(left),
                        None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                    };
                    self.common.replies.worker_wakes();
                    received
                }
            };
            if self.step(received) {
                return;
            }
        }
    }

    /// How long the worker may wait for a command before something of its own is due: the
    /// change poll's next look, a waiting request's heartbeat, the waiting marker's end.
    pub(crate) fn left(&mut self) -> Option<Duration> {
        let due = self
            .next_look()
            .into_iter()
            .chain(self.waits.next_beat())
            .min();
        let now = self.common.clock.monotonic();
        let left = due.map(|at| at.saturating_sub(now));
        left.into_iter().chain(self.marker.left(now)).min()
    }

    /// Handles what waiting brought (a command, with whatever else is queued behind it, or
    /// nothing by the deadline), then whatever of the worker's own is due. True once the worker
    /// is done: shut down, or every handle gone.
    pub(crate) fn step(&mut self, received: Result<Command, RecvTimeoutError>) -> bool {
        match received {
            Ok(first) => {
                // Room for a busy moment's batch at once, rather than growing it command by
                // command.
                let mut batch = Vec::with_capacity(32);
                batch.push(first);
                while batch.len() < MAX_BATCH {
                    match self.next_now() {
                        Some(Ok(command)) => batch.push(command),
                        _ => break,
                    }
                }
                if self.handle(batch) {
                    return true;
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                self.close();
                return true;
            }
        }
        self.start_due_beats();
        if self.common.watchers.load(Ordering::SeqCst) > 0 {
            // Up before the look reads: a release committed after it is announced here.
            self.mark_waiting(true);
        }
        if self.look_due() {
            self.look_for_changes();
            self.looks.looked(self.common.clock.monotonic());
        }
        let now = self.common.clock.monotonic();
        if self.marker.lingered(self.unqueued_or_watched(), now) {
            self.mark_waiting(false);
        }
        false
    }

    /// Tells the queued requests that have waited long enough to start their heartbeats.
    fn start_due_beats(&mut self) {
        let now = self.common.clock.monotonic();
        while let Some((_, slot)) = self.waits.due_beat(now) {
            slot.beat_due();
        }
    }

    /// Right after a batch, callers often send again at once (release after acquire, the next
    /// request of a busy task). Waking a blocked thread costs tens of microseconds on small
    /// virtual machines, more than a transaction, so look for a while before blocking. This
    /// spends the worker's own time, never a caller's.
    fn spin(&mut self, spin: &mut ScheduleRun) -> Option<Result<Command, RecvTimeoutError>> {
        spin.reset(SystemClock.monotonic());
        loop {
            if let Some(received) = self.next_now() {
                return Some(received);
            }
            match spin.next(SystemClock.monotonic()) {
                Some(_) => std::thread::yield_now(),
                None => return None,
            }
        }
    }

    /// The next command if one is there, or the end of the channel (every handle gone); `None`
    /// when there is nothing yet. How a driver that must not block takes its next command.
    pub(crate) fn next_now(&mut self) -> Option<Result<Command, RecvTimeoutError>> {
        match self.rx.try_recv() {
            Ok(command) => Some(Ok(command)),
            Err(TryRecvError::Disconnected) => Some(Err(RecvTimeoutError::Disconnected)),
            Err(TryRecvError::Empty) => None,
        }
    }

    /// Deletes every row of this owner, and promotes whom that frees.
    fn delete_own_rows(&mut self, now: i64) -> Result<(), LockError> {
        let owner = self.common.owner.clone();
        self.decisions.deleted |= self.storage.delete_owner(&owner)? > 0;
        let keys = self.own_keys();
        self.decisions.pass.extend(keys);
        self.storage.sweep(now)
    }

    /// The manager is gone (every handle dropped): leave no row behind.
    fn close(&mut self) {
        if !self.tried_writing {
            return;
        }
        let keys = self.own_keys();
        loop {
            match self.transaction(&keys, |worker, now| worker.delete_own_rows(now)) {
                Ok(((), freed)) => return self.after_commit(&freed),
                // Busy for a moment, or a connection lost and found again: once more.
                Err(_) if self.storage.again() => {}
                Err(error) => {
                    return tracing::warn!(
                        %error,
                        "could not delete this owner's rows on close; they expire with their lease"
                    )
                }
            }
        }
    }
}

/// What a promotion pass found to announce: the keys of other owners' requests it promoted (or
/// must leave to their owners, or whose requests an operator removed), and those owners.
#[derive(Default)]
struct Announced {
    keys: BTreeSet<String>,
    owners: BTreeSet<String>,
}

impl Announced {
    fn note(&mut self, row: &RowView, keys: impl IntoIterator<Item = String>) {
        self.note_owner(&row.owner, keys);
    }

    fn note_owner(&mut self, owner: &str, keys: impl IntoIterator<Item = String>) {
        self.keys.extend(keys);
        self.owners.insert(owner.to_owned());
    }

    fn append(&mut self, other: &mut Announced) {
        self.keys.append(&mut other.keys);
        self.owners.append(&mut other.owners);
    }
}

/// The keys of `requests`, sorted, without repeats: the order in which every transaction
/// takes them.
fn keys_of(requests: &[LockRequest]) -> Vec<String> {
    let keys: BTreeSet<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    keys.into_iter().map(str::to_owned).collect()
}

impl<S> Drop for Worker<S> {
    /// However the worker stops (shutdown, every handle gone, or a panic), no waiter is left
    /// waiting for it.
    fn drop(&mut self) {
        for slot in self.waits.drain() {
            slot.set(SlotState::Shutdown);
        }
        self.common.changed.notify(usize::MAX);
    }
}

fn fail(write: Write, error: LockError, failed_removals: &mut Vec<u64>) {
    match write {
        Write::Acquire { reply, .. } => {
            let _ = reply.send(Err(error));
        }
        Write::Remove { request, reply } => {
            tracing::warn!(%error, "removing a lock's rows failed; retrying with every heartbeat");
            failed_removals.push(request);
            if let Some(reply) = reply {
                let _ = reply.send(Err(error));
            }
        }
        Write::Renew { replies } => send_all(replies, Err(error)),
        Write::Shutdown { reply } => {
            let _ = reply.send(Err(error));
        }
    }
}

/// Sends `result` to every one of `replies`; an error is repeated by its message.
fn send_all(
    replies: Vec<crate::lock::worker::protocol::Reply<i64>>,
    result: Result<i64, LockError>,
) {
    let again = |result: &Result<i64, LockError>| result.clone();
    let mut replies = replies.into_iter();
    let first = replies.next();
    for reply in replies {
        let _ = reply.send(again(&result));
    }
    if let Some(reply) = first {
        let _ = reply.send(result);
    }
}
