//! The seam between the worker and a database: what the worker needs of storage, and the rows
//! it gets back. One implementation per backend (`sqlite.rs`); the worker, the grant rule, the
//! heartbeats and the guards are shared.
//!
//! Every method runs on the worker's own thread. Times are whole microseconds since the Unix
//! epoch, by the clock the backend judges leases with.

pub(crate) mod codec;
pub(crate) mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod siblings;
pub(crate) mod sqlite;

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::lock::grant::RowView;
use crate::lock::time::micros;
use crate::lock::{LockError, LockRequest, Mode, StorageError};
use crate::schedule::Schedule;

use self::siblings::Siblings;

pub(crate) type Result<T> = std::result::Result<T, LockError>;

/// What every backend opens itself with, on the storage thread (its own `serve`).
pub(crate) struct Opening {
    /// Open only a store that is there, with this build's schema: never create or migrate it.
    pub(crate) existing: bool,
    /// The owner the storage serves (its doorbell, say, is named after it).
    pub(crate) owner: String,
    /// PostgreSQL bounds its waits on the server by it.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) heartbeat: Duration,
    /// Waits while the database is busy, and between reconnections.
    pub(crate) busy: Schedule,
    /// The manager's clock: SQLite and the memory store judge leases by it.
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) poke: Arc<dyn Poke>,
    /// Its membership among the managers of this process on its store, whom its storage
    /// wakes after a commit (`Storage::wake_others`).
    pub(crate) siblings: Siblings,
    /// Counts the waits for another connection's write lock (`StorageStats::lock_waits`):
    /// SQLite's; the other backends have none.
    pub(crate) lock_waits: Arc<AtomicU64>,
}

/// What runs over a backend's storage once it is open, on the storage thread: the worker. A
/// backend's `serve` opens its storage, says whether it could, and hands it here, so that the
/// backend imports nothing of the worker.
pub(crate) trait Serve {
    fn serve<S: Storage>(self, storage: S);
}

/// How a backend wakes its manager's worker when another manager announced a change (a
/// notification heard, a doorbell rung). The worker's side gives it, so that storage knows
/// nothing of the worker.
pub(crate) trait Poke: Send + Sync + 'static {
    /// Asks the worker to look for changes now; false once the worker is gone.
    fn poke(&self) -> bool;
    /// Whether the worker is still there.
    fn alive(&self) -> bool;
}

/// What a backend stores and answers. A write transaction is `begin`, the changes, then
/// `commit` (or `rollback`); reads outside one see committed state.
///
/// Every decision is key-local: a transaction names the keys it decides on, reads the rows of
/// those keys only, and finds out what other connections changed by key. Nothing a lock
/// operation does reads every row of the database; what does (the heartbeat's renewal of this
/// owner's rows, and its `sweep` of lapsed rows) runs once per heartbeat, not per operation.
pub(crate) trait Storage {
    /// The time leases are judged by, now.
    fn now(&self) -> i64;

    /// How far that time is ahead of `clock`'s monotonic time: the worker keeps every deadline,
    /// and tells callers every time, on that line, which no step of a wall clock moves. Never
    /// less than it is: `clock` is read first, so a pause between the two readings makes a
    /// lease end earlier as the caller knows it, never later.
    fn ahead_of(&self, clock: &dyn Clock) -> i64 {
        let theirs = micros(clock.monotonic());
        self.now() - theirs
    }

    /// What this backend can do; fixed for it, asked once.
    fn capabilities(&self) -> Capabilities;

    /// What other connections changed since the last call: a cheap check, writing nothing.
    /// Also where a backend finds out that it no longer talks to the database it opened (an
    /// error).
    fn changes(&mut self) -> Result<Changes>;

    /// Starts a write transaction that decides on `keys` (sorted, without repeats), waiting
    /// while another transaction decides on any of them; returns the time read once it may go
    /// on (a time read before could be stale by however long it waited).
    fn begin(&mut self, keys: &[String]) -> Result<i64>;
    fn commit(&mut self) -> Result<()>;
    /// Called in a write transaction before its commit, with the keys whose rows it deleted
    /// and the keys on which it promoted waiters (or found waiters it may not promote: see
    /// `keys_locked`), so that other managers find out (`changes`); `owners` are those other
    /// owners, whose requests there were promoted (or must be looked at by them).
    fn announce(
        &mut self,
        freed: &[String],
        promoted: &[String],
        owners: &BTreeSet<String>,
    ) -> Result<()>;
    /// Rolls back if a transaction is open; a failure here leaves nothing to undo.
    fn rollback(&mut self);
    /// After a failed transaction: whether it failed for a passing reason (its connection
    /// ended, a statement or a lock wait timed out, a deadlock was broken), in which case this
    /// waits the next delay of the busy schedule, and the work is to be done again, whole.
    /// False for any other failure, and once the schedule gives up.
    fn again(&mut self) -> bool;
    /// After every commit, once this manager's own waiters are woken, off the path of the
    /// local handoff: wakes the other managers the commit concerns, in this process (its
    /// `Siblings`) and, where the backend does it directly, in others. `freed`: the other owners
    /// whose requests it promoted, if it freed or promoted anything (`None`: nothing).
    fn wake_others(&mut self, freed: Option<&BTreeSet<String>>);
    /// Outside a transaction, with nothing written: tells the other managers that watch every
    /// change (`waiting`) that `keys` changed, as a commit that freed them would (this
    /// process's by `Siblings`, others by the doorbell or a notification). For a change no
    /// commit announces: a new leader granted at once, whom observers elsewhere should see
    /// before their next poll. Best effort: a failure leaves them to their poll.
    fn ring(&mut self, keys: &[String]);
    /// Whether this owner has callers waiting without a row (`Wait::Unqueued`) or watchers of
    /// every change, whom any commit that frees rows may let through, so that other managers'
    /// commits should reach it at once. Said before the read or inside the transaction that
    /// refuses such a caller, and again once none waits. (A queued request is woken by name:
    /// its promoter announces its owner.)
    fn waiting(&mut self, waiting: bool);

    /// Called in a write transaction that refused a request on `keys` (sorted) without a queue
    /// position: its caller waits without a row, so later commits that free these keys must
    /// announce them, at least until `lease` after `now`. A backend that announces every
    /// commit does nothing.
    fn watching(&mut self, owner: &str, keys: &[String], now: i64, lease: i64) -> Result<()>;

    /// Appends the live rows on `keys`, in key and ticket order. A write transaction deletes the
    /// lapsed rows of a key (`delete_expired`) before it reads the key to decide: a row it
    /// judged lapsed is then gone, and no renewal by its owner, judged by an earlier time, can
    /// bring it back after the decision.
    fn rows_on_keys(&mut self, keys: &[String], now: i64, into: &mut Vec<RowView>) -> Result<()>;
    /// The next ticket of the one sequence every request takes from.
    fn next_ticket(&mut self) -> Result<u64>;
    /// Writes one row per request, all under `ticket`, held or waiting; a waiting request on
    /// several keys writes all of them in every row (see `RowView::keys`, and `stored_keys`).
    fn insert_request(
        &mut self,
        owner: &str,
        ticket: u64,
        requests: &[LockRequest],
        held: bool,
        now: i64,
        expires_at: i64,
    ) -> Result<()>;
    /// Turns the waiting rows of `ticket` on `keys` (sorted) into held rows, keeping the ticket,
    /// each with a whole lease (the row's own) from `now`.
    fn promote(&mut self, keys: &[String], ticket: u64, now: i64) -> Result<()>;
    /// Deletes `owner`'s rows of `ticket` on `keys`, held or waiting.
    fn delete_request(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        now: i64,
    ) -> Result<Deleted>;
    /// Sets the operation of `owner`'s live held rows of `ticket` on `keys` to `operation` (a
    /// leader's new value: `Leadership::proclaim`); returns how many it changed (0: the rows
    /// are gone or lapsed, or not held).
    fn relabel(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        operation: &str,
        now: i64,
    ) -> Result<usize>;
    /// Deletes every row of `owner`; returns how many there were.
    fn delete_owner(&mut self, owner: &str) -> Result<usize>;
    /// Deletes the lapsed rows on `keys`; returns how many.
    fn delete_expired(&mut self, keys: &[String], now: i64) -> Result<usize>;
    /// Housekeeping, once per heartbeat: deletes lapsed rows on every key (of owners that
    /// died, on keys no one touches since), the tombstones of removals kept past their time
    /// (`record_removal`), and whatever else the backend keeps that grows. Lapsed rows are
    /// invisible to every decision already, so nothing waits for this.
    fn sweep(&mut self, now: i64) -> Result<()>;
    /// In the write transaction of an operator's removal of `owner`'s request `ticket`, before
    /// its rows are deleted: records that `by` (the remover's owner id) removed it, if it has a
    /// waiting row (a tombstone). Its owner, finding its rows gone, tells so a removal, which
    /// ends its wait, from a lapse of its own rows, after which it queues again (`removals`).
    /// A holder's removal records nothing: its guard hears `lost()` either way.
    ///
    /// A tombstone is kept until the owner has heard of it (`forget_removals`), or, at the
    /// latest, until the removed row's lease would have run out and [`TOMBSTONE_KEPT`] (or the
    /// lease, if longer) after that (`sweep`): an owner that renews finds its rows gone before
    /// their lease runs out, and one stopped for hours (the waiter an operator removes, as
    /// like as not) still finds its tombstone when it resumes.
    fn record_removal(&mut self, owner: &str, ticket: u64, by: &str, now: i64) -> Result<()>;
    /// Of `owner`'s requests `tickets`, whose rows it found gone, those an operator removed
    /// (`record_removal`), each with who removed it. A read: the tombstones stay until
    /// `forget_removals`, so that an answer lost on the way is asked again.
    fn removals(&mut self, owner: &str, tickets: &[u64]) -> Result<Vec<(u64, String)>>;
    /// Deletes the tombstones of `owner`'s requests `tickets`, whose removal it has heard of;
    /// outside a write transaction, in a statement of its own.
    fn forget_removals(&mut self, owner: &str, tickets: &[u64]) -> Result<()>;
    /// Renews every live row of `owner` until `expires_at`; never touches an expired row.
    /// Returns what it renewed, by request: every live request of `owner`, as the storage
    /// judged "live" as it renewed.
    fn renew(&mut self, owner: &str, now: i64, expires_at: i64) -> Result<Vec<OwnedRequest>>;

    /// The one-call decisions (`DecidesAtOnce`), where this backend has them; where it has
    /// not, the worker runs `begin`, the reads and writes, and `commit`.
    fn at_once(&mut self) -> Option<&mut dyn DecidesAtOnce>;
    /// Every request of `owner` with a row, live or not: its ticket and keys, by ticket. How
    /// the worker finds a request written by a call whose reply was lost.
    fn requests_of(&mut self, owner: &str) -> Result<Vec<(u64, Vec<String>)>>;

    /// Live rows, of one key or all, ordered by key and ticket.
    fn live_rows(&mut self, key: Option<&str>, now: i64) -> Result<Vec<Row>>;
    /// Whether `key` has a live held row.
    fn is_held(&mut self, key: &str, now: i64) -> Result<bool>;
}

/// How long past the removed row's lease a tombstone of a removal is kept at the least (a day,
/// in microseconds): see `Storage::record_removal`.
pub(crate) const TOMBSTONE_KEPT: i64 = 24 * 3600 * 1_000_000;

/// What a request does when it cannot be granted at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Takes a place in the queue (waiting rows) until it is granted.
    Queued,
    /// Waits without a row (`many`): it is refused (`NotNow`), and asks again whenever its
    /// keys may have changed.
    Unqueued,
    /// Does not wait (`try_acquire`): it is refused.
    No,
}

/// An error unless `found`, the schema version of the store opened while `doing` (`None`: no
/// store there), is this build's `ours`: for a manager that opens a store as it is
/// (`Opening::existing`), which creates and migrates nothing.
pub(crate) fn schema_is_ours(doing: &str, found: Option<i64>, ours: i64) -> Result<()> {
    match found {
        None => Err(StorageError::new(doing, "there is no lock store there").into()),
        Some(found) if found > ours => Err(LockError::SchemaTooNew {
            found,
            supported: ours,
        }),
        Some(found) if found < ours => {
            let why = format!(
                "its schema is version {found}, older than this build's {ours}; a manager of \
                 this build (`leasehold run`, say) brings it up to date"
            );
            Err(StorageError::new(doing, why).into())
        }
        Some(_) => Ok(()),
    }
}

/// What a backend can do, fixed for it (`Storage::capabilities`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Capabilities {
    /// Whether transactions on different keys may run at once (PostgreSQL), so that a
    /// transaction may change rows only on the keys it named in `begin`, must delete a key's
    /// lapsed rows before it reads them (renewals run beside it), and leaves a waiter with a key
    /// outside them to its owner. When not (SQLite, memory: one writer at a time), a transaction
    /// may read and change any key.
    pub(crate) keys_locked: bool,
    /// Whether a request without a queue position may be refused by a read alone, outside a
    /// write transaction (saving one while a caller retries). Not where a waiter must be noted
    /// under the locks of its keys for commits to announce themselves to it (`watching`).
    pub(crate) refuses_by_reads: bool,
    /// Whether a look (`Storage::changes`) hears of every commit of other processes (SQLite's
    /// change log, the memory store's version). Not on PostgreSQL, whose commits announce only
    /// what may free a waiter: a request queued elsewhere is announced to nobody.
    pub(crate) hears_every_commit: bool,
}

/// Decisions in one round trip (PostgreSQL's function `decide`), for a backend that has them
/// (`Storage::at_once`).
pub(crate) trait DecidesAtOnce {
    /// Decides a batch of acquisitions and removals of `owner`'s (`ops`, in order) in one round
    /// trip and one transaction of its own. One outcome per operation, in order, each decided
    /// as that sequence would:
    ///
    /// - an acquisition: the lapsed rows of its keys deleted, the grant rule asked
    ///   (`grantable_now`), and rows written under a new ticket, held if granted, else waiting
    ///   if its wait is `Queued`; an `Unqueued` caller refused is noted as by `watching`;
    /// - a removal: `owner`'s rows of its ticket deleted, and the waiters on its keys that the
    ///   grant rule now lets through promoted, whoever owns them; the keys announced if another
    ///   owner may be waiting there. A waiting request on several keys is left to its owner:
    ///   another owner hears the announcement, and `owner` looks at its own.
    fn decide_at_once(
        &mut self,
        owner: &str,
        ops: &[AtOnce<'_>],
        lease: i64,
    ) -> Result<Vec<Outcome>>;

    /// A heartbeat in one round trip and one transaction of its own, as `begin`, `renew`,
    /// `sweep` and `commit` would do it: renews every row of `owner` live at the time it reads
    /// once it holds them, until `lease` after that time, and sweeps. Returns that time and
    /// what it renewed.
    fn renew_at_once(&mut self, owner: &str, lease: i64) -> Result<(i64, Vec<OwnedRequest>)>;
}

/// An operation of a batch decided in one call (`Storage::decide_at_once`). Only a backend that
/// decides so (PostgreSQL) reads these, and only it builds an `Outcome`.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum AtOnce<'a> {
    /// A new request on these keys; `announce`d to every listener if granted.
    Acquire {
        requests: &'a [LockRequest],
        wait: Wait,
        announce: bool,
    },
    /// The removal of the request written under `ticket` on `keys`; `announce`d to every
    /// listener if it deleted rows, whoever waits.
    Remove {
        keys: &'a [String],
        ticket: u64,
        announce: bool,
    },
}

/// What `Storage::decide_at_once` did with one operation.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
#[derive(Clone, Debug)]
pub(crate) enum Outcome {
    Acquired(Decision),
    Removed(Removal),
}

/// What `Storage::decide_at_once` decided for an acquisition.
#[derive(Clone, Debug)]
pub(crate) struct Decision {
    /// The time it decided at.
    pub(crate) now: i64,
    /// The ticket of the rows written, if any were.
    pub(crate) ticket: Option<u64>,
    pub(crate) granted: bool,
    /// When refused a caller who waits: the other owners' live rows on the request's keys, by
    /// key and expiry.
    pub(crate) others: Vec<(String, i64)>,
    /// When refused because a live row on one of its keys is of another kind (`grant::misfit`):
    /// that key, and the row's mode. Nothing was written.
    pub(crate) misfit: Option<(String, Mode)>,
}

/// What `Storage::decide_at_once` did for a removal.
#[derive(Clone, Debug)]
pub(crate) struct Removal {
    /// The time it decided at.
    pub(crate) now: i64,
    pub(crate) deleted: Deleted,
    /// Whether it deleted or promoted any row.
    pub(crate) freed: bool,
    /// The tickets it promoted, whoever owns them.
    pub(crate) promoted: Vec<u64>,
    /// The other owners whose requests it promoted.
    pub(crate) owners: BTreeSet<String>,
}

/// What other connections changed since the last look (`Storage::changes`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Changes {
    /// Nothing was committed.
    Nothing,
    /// Something was committed; on these keys (by `key_hash`) waiters were promoted or rows
    /// were freed. Waiters without a queue position, which have no rows, may have been freed by
    /// any commit.
    Keys(Vec<i64>),
    /// Something may have been committed, and what is not known (a log read too late, a
    /// notification channel that was down): every key waited for must be looked at.
    Unknown,
}

/// One live row, as `inspect` shows it.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) key: String,
    pub(crate) mode: Mode,
    pub(crate) operation: String,
    pub(crate) owner: String,
    pub(crate) ticket: u64,
    pub(crate) held: bool,
    pub(crate) since: i64,
    pub(crate) expires_at: i64,
}

/// The live rows of one owner's request, held or waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OwnedRequest {
    pub(crate) ticket: u64,
    pub(crate) held: bool,
    pub(crate) rows: usize,
    /// The earliest lease expiry among them.
    pub(crate) expires_at: i64,
}

impl OwnedRequest {
    /// `(ticket, held)` for each row renewed until `expires_at`, grouped by request.
    pub(crate) fn group(rows: impl IntoIterator<Item = (u64, bool)>, expires_at: i64) -> Vec<Self> {
        let mut requests: Vec<OwnedRequest> = Vec::new();
        for (ticket, held) in rows {
            match requests
                .iter_mut()
                .find(|r| r.ticket == ticket && r.held == held)
            {
                Some(request) => request.rows += 1,
                None => requests.push(OwnedRequest {
                    ticket,
                    held,
                    rows: 1,
                    expires_at,
                }),
            }
        }
        requests
    }
}

/// What deleting a request's rows found: how many rows there were, and how many of them had a
/// lease that had not run out (a lapsed row is invisible to every decision already).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Deleted {
    pub(crate) rows: usize,
    pub(crate) live: usize,
}

/// For a backend's tests: a manager without a worker, which says so, so that a backend's
/// listening thread (a doorbell's, a listener's) ends at once.
#[cfg(test)]
pub(crate) struct NoWorker;

#[cfg(test)]
impl Poke for NoWorker {
    fn poke(&self) -> bool {
        false
    }

    fn alive(&self) -> bool {
        false
    }
}

/// The life of a tombstone, on any store (`Storage::record_removal`): recorded for a waiting
/// request and not for a held one, answered by `removals` until its owner forgets it, and swept
/// once past its time (a lease after the removed row's own lease would have run out), never
/// before. Rolled back with the removal's transaction. `storage` is a fresh store.
#[cfg(test)]
pub(crate) fn tombstones_live_until_heard_or_swept(storage: &mut impl Storage) {
    // An hour: the removal comes well within the rows' lease, by any clock.
    let lease = 3_600_000_000;
    let request = |key: &str| [LockRequest::exclusive(key, "op")];
    let keys = ["k".to_owned()];
    let now = storage.begin(&keys).unwrap();
    let written_at = now;
    let held = storage.next_ticket().unwrap();
    storage
        .insert_request("holder", held, &request("k"), true, now, now + lease)
        .unwrap();
    let (heard, unheard, undone) = (
        storage.next_ticket().unwrap(),
        storage.next_ticket().unwrap(),
        storage.next_ticket().unwrap(),
    );
    for ticket in [heard, unheard, undone] {
        storage
            .insert_request("waiter", ticket, &request("k"), false, now, now + lease)
            .unwrap();
    }
    storage.commit().unwrap();

    let now = storage.begin(&keys).unwrap();
    for (owner, ticket) in [("holder", held), ("waiter", heard), ("waiter", unheard)] {
        storage
            .record_removal(owner, ticket, "operator", now)
            .unwrap();
        storage
            .delete_request(owner, &["k".into()], ticket, now)
            .unwrap();
    }
    storage.commit().unwrap();
    let now = storage.begin(&keys).unwrap();
    storage
        .record_removal("waiter", undone, "operator", now)
        .unwrap();
    storage.rollback();

    let operator = || "operator".to_owned();
    let all = [held, heard, unheard, undone];
    assert_eq!(storage.removals("holder", &all).unwrap(), []);
    assert_eq!(
        storage.removals("waiter", &all).unwrap(),
        [(heard, operator()), (unheard, operator())]
    );
    storage.forget_removals("waiter", &[heard]).unwrap();
    assert_eq!(
        storage.removals("waiter", &all).unwrap(),
        [(unheard, operator())]
    );

    // Kept until the row's lease would have run out, and a day (or a lease) after that.
    let kept_until = written_at + lease + lease.max(TOMBSTONE_KEPT);
    storage.begin(&keys).unwrap();
    storage.sweep(kept_until - 1).unwrap();
    storage.commit().unwrap();
    assert_eq!(
        storage.removals("waiter", &all).unwrap(),
        [(unheard, operator())]
    );
    storage.begin(&keys).unwrap();
    storage.sweep(kept_until).unwrap();
    storage.commit().unwrap();
    assert_eq!(storage.removals("waiter", &all).unwrap(), []);
}
