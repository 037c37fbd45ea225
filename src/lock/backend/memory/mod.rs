//! The memory backend: rows in ordered maps in this process's memory, tickets from a counter,
//! for tests and for owners of one process that want no file. It is what the simulation kit
//! steps, so it keeps no thread and reads no time of its own: it judges leases by the manager's
//! clock, on the time line SQLite would (`TimeLine`: its boot clock, which no step moves, or,
//! for a clock without one, its wall time).
//!
//! Several managers may share one store (`MemoryStore`), each an owner, as processes share a
//! SQLite file; the managers of one store wake each other as the managers of one file in one
//! process do (`backend::siblings`).
//!
//! Invariants:
//!
//! 1. One write transaction at a time: `begin` waits while another connection's transaction is
//!    open, and so does every read outside a transaction, which then reads with the `writer`
//!    lock held (no transaction can begin meanwhile), so nothing reads what a transaction has
//!    not committed. A transaction is a few map operations on the storage thread, never
//!    across a wait of its own, so the waits are short; a connection dropped inside one rolls
//!    it back, so no wait is for ever.
//! 2. A transaction's changes are made in place and undone, newest first, by a rollback.
//! 3. A commit that changed anything is counted (`version`); a connection's `changes` reports
//!    the commits of others since its last look, and the keys they promoted waiters on (the
//!    change log), as SQLite's `data_version` and change log do.
//!
//! 4. The store's time never goes back: it is the later of the reading connection's clock and
//!    the latest time any connection read. So a row judged lapsed stays lapsed for every
//!    connection, however a wall clock (where leases are judged by one) is stepped back (else
//!    another connection could find it live again and promote it beside the holder granted
//!    over it), and a connection whose clock is behind judges by the store's time (the worker
//!    converts it to its manager's clock for callers: `Storage::ahead_of`). The store is one
//!    process's: its managers share one time, as the processes of one machine share one clock.
//!
//! 5. A tombstone (`Tables::removed`) records an operator's removal of a waiting request, by
//!    owner and ticket, written in the transaction that deletes its rows; it goes when the
//!    owner has heard of it (`forget_removals`, outside a transaction, as a read is, with the
//!    `writer` lock held) or when the sweep finds it past its time.
//!
//! Lock order: `writer`, then `tables` (a read outside a transaction holds both); nothing takes
//! `writer` while it holds `tables`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::clock::Clock;
use crate::lock::backend::codec::{by_ticket, key_hash};
use crate::lock::backend::siblings::Siblings;
use crate::lock::backend::{
    Capabilities, Changes, DecidesAtOnce, Deleted, Opening, OwnedRequest, Result, Row, Serve,
    Storage, TOMBSTONE_KEPT,
};
use crate::lock::grant::RowView;
use crate::lock::time::TimeLine;
use crate::lock::{LockRequest, Mode, StorageError};
use crate::sync::lock;

/// Times past this (the worker's last keepable time) are not remembered as the store's.
const LAST_TIME: i64 = i64::MAX / 2;

/// How many of its newest entries the change log keeps; a connection that has not looked for
/// longer than that many promotions takes a full look instead.
const LOG_KEPT: usize = 4096;

/// A lock store in this process's memory, for tests and for owners of one process that want no
/// file. Every manager opened on it ([`LockManagerBuilder::open_in`]) is an owner of its own,
/// and they coordinate through it as processes do through a SQLite file; nothing outlives the
/// process. Cheap to clone: clones are the same store.
///
/// [`LockManager::open_in_memory`] opens a private one.
///
/// [`LockManagerBuilder::open_in`]: crate::LockManagerBuilder::open_in
/// [`LockManager::open_in_memory`]: crate::LockManager::open_in_memory
///
/// # Examples
///
/// ```
/// use leasehold::{LockManager, LockRequest, MemoryStore};
///
/// # futures::executor::block_on(async {
/// let store = MemoryStore::new();
/// let a = LockManager::builder().open_in(&store)?;
/// let b = LockManager::builder().open_in(&store)?;
/// let held = a.exclusive("repo", "prune").await?;
/// assert!(b.try_acquire(LockRequest::shared("repo", "backup")).await?.is_none());
/// held.release().await?;
/// assert!(b.try_acquire(LockRequest::shared("repo", "backup")).await?.is_some());
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    shared: Arc<Store>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        MemoryStore::default()
    }

    /// A name the managers of this process that share the store know it by (`backend::siblings`).
    pub(crate) fn name(&self) -> String {
        format!("memory store {}", self.shared.id)
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tables = lock(&self.shared.tables);
        f.debug_struct("MemoryStore")
            .field("id", &self.shared.id)
            .field("rows", &tables.rows.len())
            .field("last_ticket", &tables.last_ticket)
            .finish()
    }
}

struct Store {
    id: u64,
    tables: Mutex<Tables>,
    /// Which connection has a write transaction open (invariant 1).
    writer: Mutex<Option<u64>>,
    /// Notified when a write transaction ends.
    ended: Condvar,
    /// The latest time any connection judged by (invariant 4).
    latest: AtomicI64,
    /// The time line of the first manager opened on it, which every other must share.
    line: Mutex<Option<TimeLine>>,
    next_connection: AtomicU64,
}

impl Default for Store {
    fn default() -> Self {
        static STORES: AtomicU64 = AtomicU64::new(0);
        Store {
            id: STORES.fetch_add(1, Ordering::Relaxed),
            tables: Mutex::new(Tables::default()),
            writer: Mutex::new(None),
            ended: Condvar::new(),
            latest: AtomicI64::new(i64::MIN),
            line: Mutex::new(None),
            next_connection: AtomicU64::new(0),
        }
    }
}

#[derive(Default)]
struct Tables {
    /// By key, then ticket: the order every decision reads in.
    rows: BTreeMap<(String, u64), Stored>,
    last_ticket: u64,
    /// Commits that changed something (invariant 3).
    version: u64,
    /// The change log: the digests of keys on which waiters were promoted, by sequence number.
    log: Vec<(u64, i64)>,
    next_seq: u64,
    /// Operators' removals of waiting requests, by owner and ticket (invariant 5).
    removed: BTreeMap<(String, u64), Tombstone>,
}

/// An operator's removal of a waiting request, until its owner hears of it.
#[derive(Clone, Debug)]
struct Tombstone {
    /// The remover's owner id.
    by: String,
    /// When the sweep deletes it (see `Storage::record_removal`).
    kept_until: i64,
}

/// A row as the store keeps it.
#[derive(Clone, Debug)]
struct Stored {
    mode: Mode,
    operation: String,
    owner: Arc<str>,
    held: bool,
    requested_at: i64,
    acquired_at: Option<i64>,
    expires_at: i64,
    heartbeat_at: i64,
    /// Every key of its request, while it waits on several (see `RowView::keys`).
    keys: Vec<String>,
}

impl Stored {
    fn view(&self, key: &str, ticket: u64) -> RowView {
        RowView {
            key: key.into(),
            mode: self.mode,
            ticket,
            held: self.held,
            owner: self.owner.clone(),
            expires_at: self.expires_at,
            keys: self.keys.clone(),
        }
    }
}

/// How to undo one change of an open transaction (invariant 2).
enum Undo {
    /// Put this row back as it was (or take it away, for `None`: it was inserted).
    Row((String, u64), Option<Stored>),
    Ticket(u64),
    LogLength(usize),
    /// Put this tombstone back as it was (or take it away, for `None`).
    Removal((String, u64), Option<Tombstone>),
}

/// Opens a connection to `store` and hands it to `worker`. Nothing can fail: `opened` is told so
/// at once.
pub(crate) fn serve(
    store: &MemoryStore,
    opening: Opening,
    opened: impl FnOnce(Result<()>),
    worker: impl Serve,
) {
    let connection = Memory::new(store, opening.clock).joined(opening.siblings);
    // Its managers judge leases on one time line: the first's.
    let first = *lock(&connection.store.line).get_or_insert(connection.line);
    if first != connection.line {
        let why = format!(
            "its managers judge leases on {}, and this manager's clock on {}: give them clocks \
             of one kind (the same boot time, or none)",
            first.stored(),
            connection.line.stored()
        );
        return opened(Err(StorageError::new("opening a memory store", why).into()));
    }
    opened(Ok(()));
    worker.serve(connection);
}

/// One manager's connection to a store.
pub(crate) struct Memory {
    store: Arc<Store>,
    id: u64,
    clock: Arc<dyn Clock>,
    /// The time line leases are judged by: the clock's.
    line: TimeLine,
    undo: Vec<Undo>,
    in_write: bool,
    /// The store's version and change log as this connection last saw them.
    seen_version: u64,
    seen_seq: u64,
    /// The store's other managers, woken after a commit that freed something.
    siblings: Siblings,
}

impl Memory {
    pub(crate) fn new(store: &MemoryStore, clock: Arc<dyn Clock>) -> Self {
        let shared = store.shared.clone();
        let id = shared.next_connection.fetch_add(1, Ordering::Relaxed);
        let (seen_version, seen_seq) = {
            let tables = lock(&shared.tables);
            (tables.version, tables.next_seq)
        };
        Memory {
            store: shared,
            id,
            line: TimeLine::of(&*clock),
            clock,
            undo: Vec::new(),
            in_write: false,
            seen_version,
            seen_seq,
            siblings: Siblings::alone(),
        }
    }

    /// The connection of a manager known to the store's other managers as `siblings` says.
    pub(crate) fn joined(mut self, siblings: Siblings) -> Self {
        self.siblings = siblings;
        self
    }

    /// Waits while another connection's write transaction is open, then opens this one's
    /// (invariant 1).
    fn take_writer(&self) {
        let mut writer = lock(&self.store.writer);
        while writer.is_some_and(|id| id != self.id) {
            writer = self
                .store
                .ended
                .wait(writer)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        *writer = Some(self.id);
    }

    /// Ends this connection's write transaction.
    fn end_write(&mut self) {
        self.in_write = false;
        self.undo.clear();
        *lock(&self.store.writer) = None;
        self.store.ended.notify_all();
    }

    /// Waits until no connection's write transaction is open; the lock it returns keeps one
    /// from beginning while it is held (invariant 1).
    fn between_transactions(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        let mut writer = lock(&self.store.writer);
        while writer.is_some() {
            writer = self
                .store
                .ended
                .wait(writer)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        writer
    }

    /// Runs `read` on the tables: in this connection's transaction, or once no other
    /// connection's is open, and with none beginning meanwhile (invariant 1).
    fn read<T>(&self, read: impl FnOnce(&Tables) -> T) -> T {
        if self.in_write {
            return read(&lock(&self.store.tables));
        }
        let writer = self.between_transactions();
        let tables = lock(&self.store.tables);
        let value = read(&tables);
        drop(tables);
        drop(writer);
        value
    }

    /// Runs `change` on the tables inside this connection's write transaction.
    fn change<T>(&mut self, change: impl FnOnce(&mut Tables, &mut Vec<Undo>) -> T) -> Result<T> {
        if !self.in_write {
            return Err(StorageError::new(
                "changing the memory store",
                "no write transaction is open",
            )
            .into());
        }
        Ok(change(&mut lock(&self.store.tables), &mut self.undo))
    }
}

impl Drop for Memory {
    /// A connection dropped inside a transaction (its worker panicked) rolls it back, so that
    /// no other connection waits for it (invariant 1).
    fn drop(&mut self) {
        if self.in_write {
            self.rollback();
        }
    }
}

/// The rows of `key`, in ticket order.
fn on_key<'a>(tables: &'a Tables, key: &'a str) -> impl Iterator<Item = (u64, &'a Stored)> + 'a {
    tables
        .rows
        .range((key.to_owned(), 0)..=(key.to_owned(), u64::MAX))
        .map(|((_, ticket), row)| (*ticket, row))
}

/// Removes the row at `at`, to be put back by a rollback.
fn remove(tables: &mut Tables, undo: &mut Vec<Undo>, at: &(String, u64)) -> Option<Stored> {
    let row = tables.rows.remove(at)?;
    undo.push(Undo::Row(at.clone(), Some(row.clone())));
    Some(row)
}

/// Removes the rows that `gone` picks; returns how many.
fn remove_where(
    tables: &mut Tables,
    undo: &mut Vec<Undo>,
    mut gone: impl FnMut(&Stored) -> bool,
) -> usize {
    let doomed: Vec<(String, u64)> = tables
        .rows
        .iter()
        .filter(|(_, row)| gone(row))
        .map(|(at, _)| at.clone())
        .collect();
    for at in &doomed {
        remove(tables, undo, at);
    }
    doomed.len()
}

impl Storage for Memory {
    /// The manager's clock, or the latest time the store judged by, whichever is later
    /// (invariant 4): a wall clock stepped back must not make a row that was judged lapsed live
    /// again, after another owner was granted over it.
    fn now(&self) -> i64 {
        // A clock that stopped giving its boot (a `Clock` of the user's) judges by the time the
        // store last judged by: nothing lapses on the strength of it.
        let Some(now) = self.line.now(&*self.clock) else {
            return self.store.latest.load(Ordering::SeqCst);
        };
        if now > LAST_TIME {
            // Past the time line: the worker refuses it (and it must not stick).
            return now;
        }
        let before = self.store.latest.fetch_max(now, Ordering::SeqCst);
        before.max(now)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            keys_locked: false,
            refuses_by_reads: true,
            hears_every_commit: true,
        }
    }

    /// Reports the other connections' commits since the last look (invariant 3).
    fn changes(&mut self) -> Result<Changes> {
        let (version, log, next_seq) = self.read(|tables| {
            let first = tables.log.partition_point(|&(seq, _)| seq < self.seen_seq);
            // Entries from `seen_seq` on are new; any before the oldest kept were trimmed.
            let complete = match tables.log.first() {
                Some(&(oldest, _)) => oldest <= self.seen_seq,
                None => tables.next_seq <= self.seen_seq,
            };
            let hashes: Option<Vec<i64>> =
                complete.then(|| tables.log[first..].iter().map(|&(_, hash)| hash).collect());
            (tables.version, hashes, tables.next_seq)
        });
        if version == self.seen_version {
            return Ok(Changes::Nothing);
        }
        self.seen_version = version;
        self.seen_seq = next_seq;
        Ok(match log {
            Some(hashes) => Changes::Keys(hashes),
            None => Changes::Unknown,
        })
    }

    fn begin(&mut self, _keys: &[String]) -> Result<i64> {
        self.take_writer();
        self.in_write = true;
        Ok(self.now())
    }

    /// Counts the commit if it changed anything (invariant 3), and trims the change log to its
    /// last [`LOG_KEPT`] entries.
    fn commit(&mut self) -> Result<()> {
        if !self.undo.is_empty() {
            let mut tables = lock(&self.store.tables);
            // Its own commit is no news to this connection, unless others came before.
            let unseen = tables.version != self.seen_version;
            tables.version += 1;
            if !unseen {
                self.seen_version = tables.version;
                self.seen_seq = tables.next_seq;
            }
            if tables.log.len() > LOG_KEPT {
                let excess = tables.log.len() - LOG_KEPT;
                tables.log.drain(..excess);
            }
        }
        self.end_write();
        Ok(())
    }

    /// Promotions go into the change log, whose readers look at the keys it names; freed keys
    /// need no entry (as on SQLite: see its `announce`).
    fn announce(
        &mut self,
        _freed: &[String],
        promoted: &[String],
        _owners: &BTreeSet<String>,
    ) -> Result<()> {
        self.change(|tables, undo| {
            undo.push(Undo::LogLength(tables.log.len()));
            for key in promoted {
                let seq = tables.next_seq;
                tables.next_seq += 1;
                tables.log.push((seq, key_hash(key)));
            }
        })
    }

    fn rollback(&mut self) {
        if !self.in_write {
            return;
        }
        {
            let mut tables = lock(&self.store.tables);
            while let Some(undo) = self.undo.pop() {
                match undo {
                    Undo::Row(at, Some(row)) => {
                        tables.rows.insert(at, row);
                    }
                    Undo::Row(at, None) => {
                        tables.rows.remove(&at);
                    }
                    Undo::Ticket(last) => tables.last_ticket = last,
                    Undo::LogLength(length) => {
                        if let Some(&(seq, _)) = tables.log.get(length) {
                            tables.next_seq = seq;
                        }
                        tables.log.truncate(length);
                    }
                    Undo::Removal(at, Some(tombstone)) => {
                        tables.removed.insert(at, tombstone);
                    }
                    Undo::Removal(at, None) => {
                        tables.removed.remove(&at);
                    }
                }
            }
        }
        self.end_write();
    }

    /// Nothing fails for a passing reason in memory.
    fn again(&mut self) -> bool {
        false
    }

    /// The managers of a store are all in this process: they are woken as siblings are.
    fn wake_others(&mut self, freed: Option<&BTreeSet<String>>) {
        if let Some(owners) = freed {
            self.siblings.wake(owners);
        }
    }

    fn ring(&mut self, _keys: &[String]) {
        self.siblings.wake(&BTreeSet::new());
    }

    fn waiting(&mut self, waiting: bool) {
        self.siblings.waiting(waiting);
    }

    fn watching(&mut self, _owner: &str, _keys: &[String], _now: i64, _lease: i64) -> Result<()> {
        Ok(())
    }

    fn rows_on_keys(&mut self, keys: &[String], now: i64, into: &mut Vec<RowView>) -> Result<()> {
        self.read(|tables| {
            for key in keys {
                into.extend(
                    on_key(tables, key)
                        .filter(|(_, row)| row.expires_at > now)
                        .map(|(ticket, row)| row.view(key, ticket)),
                );
            }
        });
        Ok(())
    }

    fn next_ticket(&mut self) -> Result<u64> {
        self.change(|tables, undo| {
            undo.push(Undo::Ticket(tables.last_ticket));
            tables.last_ticket += 1;
            tables.last_ticket
        })
    }

    fn insert_request(
        &mut self,
        owner: &str,
        ticket: u64,
        requests: &[LockRequest],
        held: bool,
        now: i64,
        expires_at: i64,
    ) -> Result<()> {
        let owner: Arc<str> = owner.into();
        let keys: Vec<String> = if held || requests.len() < 2 {
            Vec::new()
        } else {
            requests.iter().map(|r| r.key.clone()).collect()
        };
        self.change(|tables, undo| {
            for request in requests {
                let at = (request.key.clone(), ticket);
                let row = Stored {
                    mode: request.mode,
                    operation: request.operation.clone(),
                    owner: owner.clone(),
                    held,
                    requested_at: now,
                    acquired_at: held.then_some(now),
                    expires_at,
                    heartbeat_at: now,
                    keys: keys.clone(),
                };
                let before = tables.rows.insert(at.clone(), row);
                undo.push(Undo::Row(at, before));
            }
        })
    }

    /// With a whole lease from `now`, the row's own (as SQLite's `promote` says).
    fn promote(&mut self, keys: &[String], ticket: u64, now: i64) -> Result<()> {
        self.change(|tables, undo| {
            for key in keys {
                let at = (key.clone(), ticket);
                let Some(row) = tables.rows.get_mut(&at).filter(|row| !row.held) else {
                    continue;
                };
                undo.push(Undo::Row(at, Some(row.clone())));
                let lease = row.expires_at - row.heartbeat_at;
                row.held = true;
                row.acquired_at = Some(now);
                row.expires_at = row.expires_at.max(now.saturating_add(lease));
                row.heartbeat_at = row.heartbeat_at.max(now);
                row.keys = Vec::new();
            }
        })
    }

    fn delete_request(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        now: i64,
    ) -> Result<Deleted> {
        self.change(|tables, undo| {
            let mut deleted = Deleted::default();
            for key in keys {
                let at = (key.clone(), ticket);
                if tables.rows.get(&at).is_some_and(|row| &*row.owner == owner) {
                    if let Some(row) = remove(tables, undo, &at) {
                        deleted.rows += 1;
                        deleted.live += usize::from(row.expires_at > now);
                    }
                }
            }
            deleted
        })
    }

    fn relabel(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        operation: &str,
        now: i64,
    ) -> Result<usize> {
        self.change(|tables, undo| {
            let mut changed = 0;
            for key in keys {
                let at = (key.clone(), ticket);
                let Some(row) = (tables.rows.get_mut(&at))
                    .filter(|row| &*row.owner == owner && row.held && row.expires_at > now)
                else {
                    continue;
                };
                undo.push(Undo::Row(at, Some(row.clone())));
                row.operation = operation.to_owned();
                changed += 1;
            }
            changed
        })
    }

    fn delete_owner(&mut self, owner: &str) -> Result<usize> {
        self.change(|tables, undo| remove_where(tables, undo, |row| &*row.owner == owner))
    }

    fn delete_expired(&mut self, keys: &[String], now: i64) -> Result<usize> {
        self.change(|tables, undo| {
            let mut deleted = 0;
            for key in keys {
                let lapsed: Vec<(String, u64)> = on_key(tables, key)
                    .filter(|(_, row)| row.expires_at <= now)
                    .map(|(ticket, _)| (key.clone(), ticket))
                    .collect();
                for at in &lapsed {
                    remove(tables, undo, at);
                }
                deleted += lapsed.len();
            }
            deleted
        })
    }

    /// Deletes every lapsed row, and the tombstones past their time (the change log is trimmed
    /// as commits go: `commit`).
    fn sweep(&mut self, now: i64) -> Result<()> {
        self.change(|tables, undo| {
            remove_where(tables, undo, |row| row.expires_at <= now);
            let past: Vec<(String, u64)> = (tables.removed.iter())
                .filter(|(_, tombstone)| tombstone.kept_until <= now)
                .map(|(at, _)| at.clone())
                .collect();
            for at in past {
                let tombstone = tables.removed.remove(&at);
                undo.push(Undo::Removal(at, tombstone));
            }
        })
    }

    fn record_removal(&mut self, owner: &str, ticket: u64, by: &str, now: i64) -> Result<()> {
        self.change(|tables, undo| {
            // Kept until the latest of its waiting rows' leases would have run out, and a day
            // (or a lease, if longer) after that.
            let kept_until = (tables.rows.iter())
                .filter(|((_, t), row)| *t == ticket && &*row.owner == owner && !row.held)
                .map(|(_, row)| {
                    let lease = row.expires_at - row.heartbeat_at;
                    (row.expires_at.max(now)).saturating_add(lease.max(TOMBSTONE_KEPT))
                })
                .max();
            if let Some(kept_until) = kept_until {
                let at = (owner.to_owned(), ticket);
                let tombstone = Tombstone {
                    by: by.to_owned(),
                    kept_until,
                };
                let before = tables.removed.insert(at.clone(), tombstone);
                undo.push(Undo::Removal(at, before));
            }
        })
    }

    fn removals(&mut self, owner: &str, tickets: &[u64]) -> Result<Vec<(u64, String)>> {
        Ok(self.read(|tables| {
            (tickets.iter())
                .filter_map(|&ticket| {
                    let tombstone = tables.removed.get(&(owner.to_owned(), ticket))?;
                    Some((ticket, tombstone.by.clone()))
                })
                .collect()
        }))
    }

    /// Outside a transaction, with the `writer` lock held as a read has it (invariant 5): no
    /// transaction is open to undo it, and no other connection needs to hear of it.
    fn forget_removals(&mut self, owner: &str, tickets: &[u64]) -> Result<()> {
        if self.in_write {
            return Err(
                StorageError::new("forgetting removals", "a write transaction is open").into(),
            );
        }
        let writer = self.between_transactions();
        let mut tables = lock(&self.store.tables);
        for &ticket in tickets {
            tables.removed.remove(&(owner.to_owned(), ticket));
        }
        drop(tables);
        drop(writer);
        Ok(())
    }

    fn renew(&mut self, owner: &str, now: i64, expires_at: i64) -> Result<Vec<OwnedRequest>> {
        self.change(|tables, undo| {
            let mut renewed = Vec::new();
            for (at, row) in tables.rows.iter_mut() {
                if &*row.owner == owner && row.expires_at > now {
                    undo.push(Undo::Row(at.clone(), Some(row.clone())));
                    row.expires_at = expires_at;
                    row.heartbeat_at = now;
                    renewed.push((at.1, row.held));
                }
            }
            OwnedRequest::group(renewed, expires_at)
        })
    }

    fn at_once(&mut self) -> Option<&mut dyn DecidesAtOnce> {
        None
    }

    fn requests_of(&mut self, owner: &str) -> Result<Vec<(u64, Vec<String>)>> {
        let mut rows: Vec<(u64, String)> = self.read(|tables| {
            tables
                .rows
                .iter()
                .filter(|(_, row)| &*row.owner == owner)
                .map(|((key, ticket), _)| (*ticket, key.clone()))
                .collect()
        });
        rows.sort();
        Ok(by_ticket(rows))
    }

    fn live_rows(&mut self, key: Option<&str>, now: i64) -> Result<Vec<Row>> {
        Ok(self.read(|tables| {
            let rows: Box<dyn Iterator<Item = (&(String, u64), &Stored)>> = match key {
                Some(key) => Box::new(
                    tables
                        .rows
                        .range((key.to_owned(), 0)..=(key.to_owned(), u64::MAX)),
                ),
                None => Box::new(tables.rows.iter()),
            };
            let wall = |at: i64| self.line.wall_time(&*self.clock, at, now);
            rows.filter(|(_, row)| row.expires_at > now)
                .map(|((key, ticket), row)| Row {
                    key: key.clone(),
                    mode: row.mode,
                    operation: row.operation.clone(),
                    owner: row.owner.to_string(),
                    ticket: *ticket,
                    held: row.held,
                    since: wall(if row.held {
                        row.acquired_at.unwrap_or(row.requested_at)
                    } else {
                        row.requested_at
                    }),
                    expires_at: wall(row.expires_at),
                })
                .collect()
        }))
    }

    fn is_held(&mut self, key: &str, now: i64) -> Result<bool> {
        Ok(
            self.read(|tables| {
                on_key(tables, key).any(|(_, row)| row.held && row.expires_at > now)
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::TestClock;

    fn connection(store: &MemoryStore) -> Memory {
        Memory::new(store, Arc::new(TestClock::new()))
    }

    fn exclusive(key: &str) -> LockRequest {
        LockRequest::exclusive(key, "op")
    }

    /// Every live row, as (key, ticket, held, expires_at).
    fn rows(connection: &mut Memory) -> Vec<(String, u64, bool, i64)> {
        let now = connection.now();
        let rows = connection.live_rows(None, now).unwrap();
        rows.into_iter()
            .map(|row| (row.key, row.ticket, row.held, row.expires_at))
            .collect()
    }

    #[test]
    fn tombstones_live_until_heard_or_swept() {
        crate::lock::backend::tombstones_live_until_heard_or_swept(&mut connection(
            &MemoryStore::new(),
        ));
    }

    #[test]
    fn a_rollback_undoes_every_change_of_its_transaction() {
        let store = MemoryStore::new();
        let mut a = connection(&store);
        let now = a.begin(&[]).unwrap();
        let ticket = a.next_ticket().unwrap();
        a.insert_request("a", ticket, &[exclusive("k")], true, now, now + 100)
            .unwrap();
        let waiting = a.next_ticket().unwrap();
        let many = [exclusive("k"), exclusive("j")];
        a.insert_request("a", waiting, &many, false, now, now + 100)
            .unwrap();
        a.commit().unwrap();
        let before = rows(&mut a);
        let now = a.begin(&[]).unwrap();
        let third = a.next_ticket().unwrap();
        a.insert_request("a", third, &[exclusive("x")], true, now, now + 100)
            .unwrap();
        a.delete_request("a", &["k".into()], ticket, now).unwrap();
        a.promote(&["j".into(), "k".into()], waiting, now).unwrap();
        a.renew("a", now, now + 500).unwrap();
        a.announce(&[], &["k".into()], &BTreeSet::new()).unwrap();
        a.rollback();
        assert_eq!(rows(&mut a), before);
        a.begin(&[]).unwrap();
        assert_eq!(
            a.next_ticket().unwrap(),
            third,
            "the ticket taken came back"
        );
        a.rollback();
        assert!(
            lock(&store.shared.tables).log.is_empty(),
            "the log entry stayed"
        );
    }

    #[test]
    fn changes_are_another_connections_commits_and_the_keys_they_promoted_on() {
        let store = MemoryStore::new();
        let (mut a, mut b) = (connection(&store), connection(&store));
        assert_eq!(b.changes().unwrap(), Changes::Nothing);
        let now = a.begin(&[]).unwrap();
        let ticket = a.next_ticket().unwrap();
        a.insert_request("a", ticket, &[exclusive("k")], false, now, now + 100)
            .unwrap();
        a.promote(&["k".into()], ticket, now).unwrap();
        a.announce(&[], &["k".into()], &BTreeSet::new()).unwrap();
        a.commit().unwrap();
        assert_eq!(a.changes().unwrap(), Changes::Nothing, "its own commit");
        assert_eq!(b.changes().unwrap(), Changes::Keys(vec![key_hash("k")]));
        assert_eq!(b.changes().unwrap(), Changes::Nothing);
        // A transaction that changed nothing is no news.
        a.begin(&[]).unwrap();
        a.commit().unwrap();
        assert_eq!(b.changes().unwrap(), Changes::Nothing);
        // More promotions than the log keeps, while `b` did not look: it must look at all.
        for _ in 0..=LOG_KEPT {
            a.begin(&[]).unwrap();
            a.announce(&[], &["k".into()], &BTreeSet::new()).unwrap();
            a.commit().unwrap();
        }
        assert_eq!(b.changes().unwrap(), Changes::Unknown);
    }

    #[test]
    fn a_read_waits_for_another_connections_transaction() {
        let store = MemoryStore::new();
        let mut a = connection(&store);
        let now = a.begin(&[]).unwrap();
        let ticket = a.next_ticket().unwrap();
        a.insert_request("a", ticket, &[exclusive("k")], true, now, now + 100)
            .unwrap();
        let reader = {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut b = connection(&store);
                let now = b.now();
                b.is_held("k", now).unwrap()
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!reader.is_finished(), "read what was not committed");
        a.rollback();
        assert!(!reader.join().unwrap(), "saw a row that was rolled back");
    }

    #[test]
    fn a_connection_dropped_inside_a_transaction_lets_the_others_go_on() {
        let store = MemoryStore::new();
        let mut a = connection(&store);
        let now = a.begin(&[]).unwrap();
        let ticket = a.next_ticket().unwrap();
        a.insert_request("a", ticket, &[exclusive("k")], true, now, now + 100)
            .unwrap();
        drop(a);
        let mut b = connection(&store);
        let now = b.begin(&[]).unwrap();
        assert!(!b.is_held("k", now).unwrap());
        b.commit().unwrap();
    }
}
