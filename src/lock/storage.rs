//! The seam between the worker and a database: what the worker needs of storage, and the rows
//! it gets back. One implementation per backend (`sqlite.rs`); the worker, the grant rule, the
//! heartbeats and the guards are shared.
//!
//! Every method runs on the worker's own thread. Times are whole microseconds since the Unix
//! epoch, by the clock the backend judges leases with.

use std::collections::BTreeSet;
use std::time::Duration;

use super::grant::RowView;
use super::protocol::Wait;
use super::{LockError, LockRequest, Mode};
use crate::clock::Clock;

pub(crate) type Result<T> = std::result::Result<T, LockError>;

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

    /// How far that time is ahead of `clock`'s: the worker tells callers, who judge by their
    /// own clock, of expiries in theirs. Never less than it is: `clock` is read first, so a
    /// pause between the two readings makes a lease end earlier as the caller knows it, never
    /// later.
    fn ahead_of(&self, clock: &dyn Clock) -> i64 {
        let theirs = micros(clock.now());
        self.now() - theirs
    }

    /// Whether transactions on different keys may run at once (PostgreSQL), so that a
    /// transaction may change rows only on the keys it named in `begin`. When not (SQLite: one
    /// writer at a time), a transaction may read and change any key.
    fn keys_locked(&self) -> bool {
        false
    }

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
    fn again(&mut self) -> bool {
        false
    }
    /// After a commit that announced something, once this process's own waiters are woken: a
    /// backend that wakes other processes' managers directly does it here, off the path of the
    /// local handoff.
    fn wake_others(&mut self) {}
    /// Whether this owner has callers waiting without a row (`Wait::Unqueued`), whom any
    /// commit that frees rows may let through, so that other managers' announcements should
    /// reach it at once. Said before the read or inside the transaction that refuses such a
    /// caller, and again once none waits. (A queued request is woken by name: its promoter
    /// announces its owner.) A backend that wakes managers some other way ignores it.
    fn waiting(&mut self, _waiting: bool) {}

    /// Called in a write transaction that refused a request on `keys` (sorted) without a queue
    /// position: its caller waits without a row, so later commits that free these keys must
    /// announce them, at least until `lease` after `now`. A backend that announces every
    /// commit ignores it.
    fn watching(&mut self, _owner: &str, _keys: &[String], _now: i64, _lease: i64) -> Result<()> {
        Ok(())
    }
    /// Whether a request without a queue position may be refused by a read alone, outside a
    /// write transaction (saving one while a caller retries). Not where a waiter must be noted
    /// under the locks of its keys for commits to announce themselves to it (`watching`).
    fn refuses_by_reads(&self) -> bool {
        true
    }

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
    /// Deletes every row of `owner`; returns how many there were.
    fn delete_owner(&mut self, owner: &str) -> Result<usize>;
    /// Deletes the lapsed rows on `keys`; returns how many.
    fn delete_expired(&mut self, keys: &[String], now: i64) -> Result<usize>;
    /// Housekeeping, once per heartbeat: deletes lapsed rows on every key (of owners that
    /// died, on keys no one touches since), and whatever else the backend keeps that grows.
    /// Lapsed rows are invisible to every decision already, so nothing waits for this.
    fn sweep(&mut self, now: i64) -> Result<()>;
    /// Renews every live row of `owner` until `expires_at`; never touches an expired row.
    /// Returns what it renewed, by request: every live request of `owner`, as the storage
    /// judged "live" as it renewed.
    fn renew(&mut self, owner: &str, now: i64, expires_at: i64) -> Result<Vec<OwnedRequest>>;

    /// Whether this backend decides acquisitions and removals in one call (`decide_at_once`);
    /// where it does not, the worker runs `begin`, the reads and writes, and `commit`.
    fn decides_at_once(&self) -> bool {
        false
    }
    /// Decides a batch of acquisitions and removals of `owner`'s (`ops`, in order) in one round
    /// trip and one transaction of its own; only called where `decides_at_once`. One outcome
    /// per operation, in order, each decided as that sequence would:
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
        _owner: &str,
        _ops: &[AtOnce<'_>],
        _lease: i64,
    ) -> Result<Vec<Outcome>> {
        Err(LockError::Storage(
            "deciding in one call is not supported by this backend".into(),
        ))
    }
    /// Every request of `owner` with a row, live or not: its ticket and keys, by ticket. How
    /// the worker finds a request written by a call whose reply was lost.
    fn requests_of(&mut self, owner: &str) -> Result<Vec<(u64, Vec<String>)>>;

    /// Live rows, of one key or all, ordered by key and ticket.
    fn live_rows(&mut self, key: Option<&str>, now: i64) -> Result<Vec<Row>>;
    /// Whether `key` has a live held row.
    fn is_held(&mut self, key: &str, now: i64) -> Result<bool>;
}

/// An operation of a batch decided in one call (`Storage::decide_at_once`). Only a backend that
/// decides so (PostgreSQL) reads these, and only it builds an `Outcome`.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum AtOnce<'a> {
    /// A new request on these keys.
    Acquire {
        requests: &'a [LockRequest],
        wait: Wait,
    },
    /// The removal of the request written under `ticket` on `keys`.
    Remove { keys: &'a [String], ticket: u64 },
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

/// (ticket, key) pairs in ticket order, grouped by ticket: what `Storage::requests_of` returns.
pub(crate) fn by_ticket(rows: Vec<(u64, String)>) -> Vec<(u64, Vec<String>)> {
    let mut requests: Vec<(u64, Vec<String>)> = Vec::new();
    for (ticket, key) in rows {
        match requests.last_mut() {
            Some((last, keys)) if *last == ticket => keys.push(key),
            _ => requests.push((ticket, vec![key])),
        }
    }
    requests
}

/// A stable digest of `bytes` (FNV-1a), the same in every process and version, unlike the
/// standard library's hasher: how a key is named in the change log and in notifications.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A key as the change log and notifications name it.
pub(crate) fn key_hash(key: &str) -> i64 {
    i64::from_ne_bytes(fnv1a(key.as_bytes()).to_ne_bytes())
}

/// The `keys` column of a request's rows: for a waiting request on several keys, every key,
/// which a decision on one of them needs in order to read the others; nothing for a held one,
/// whose other keys no decision reads (a `many` of 500 keys would otherwise store 500 × 500
/// names, and make every lookup near its rows read them). A promotion clears it.
pub(crate) fn stored_keys(requests: &[LockRequest], held: bool) -> Option<String> {
    encode_keys(requests).filter(|_| !held)
}

/// The keys of a request on several keys, as stored in its rows while it waits: each key
/// preceded by its length in bytes and `:` (keys may hold any character). `None` for one key.
pub(crate) fn encode_keys(requests: &[LockRequest]) -> Option<String> {
    (requests.len() > 1).then(|| {
        requests
            .iter()
            .map(|r| format!("{}:{}", r.key.len(), r.key))
            .collect()
    })
}

/// The keys `encode_keys` wrote; a text it did not write gives no keys.
pub(crate) fn decode_keys(mut text: &str) -> Vec<String> {
    let mut keys = Vec::new();
    while let Some((len, rest)) = text.split_once(':') {
        let Ok(len) = len.parse::<usize>() else { break };
        let (Some(key), Some(tail)) = (rest.get(..len), rest.get(len..)) else {
            break;
        };
        keys.push(key.to_owned());
        text = tail;
    }
    keys
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

pub(crate) fn micros(time: Duration) -> i64 {
    i64::try_from(time.as_micros()).unwrap_or(i64::MAX)
}

pub(crate) fn from_micros(micros: i64) -> Duration {
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// How a mode is stored: 0 shared, 1 exclusive.
pub(crate) fn mode_code(mode: Mode) -> i16 {
    match mode {
        Mode::Shared => 0,
        Mode::Exclusive => 1,
    }
}

/// The mode stored as `code`.
pub(crate) fn mode_of(code: i64) -> Mode {
    if code == 0 {
        Mode::Shared
    } else {
        Mode::Exclusive
    }
}

/// A ticket as stored (a signed 64-bit integer, which both databases have) and back.
pub(crate) fn ticket_of(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

pub(crate) fn sql_ticket(ticket: u64) -> i64 {
    i64::try_from(ticket).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_of_a_request_survive_being_stored_whatever_they_hold() {
        let keys = ["a", "", "b:c", "12:x", "ключ", "x,y\n"];
        let requests: Vec<LockRequest> = keys
            .iter()
            .map(|key| LockRequest::shared(*key, "op"))
            .collect();
        let stored = encode_keys(&requests).unwrap();
        assert_eq!(decode_keys(&stored), keys);
        assert_eq!(encode_keys(&requests[..1]), None);
        assert!(decode_keys("garbage").is_empty());
        assert!(decode_keys("5:ab").is_empty());
    }

    #[test]
    fn key_hashes_are_stable() {
        // FNV-1a of the empty input is its offset basis, whatever the version or process.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(key_hash("k"), key_hash("k"));
        assert_ne!(key_hash("k"), key_hash("j"));
    }
}
