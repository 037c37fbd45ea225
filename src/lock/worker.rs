//! The storage worker: one OS thread per manager that owns its storage (see `storage.rs`).
//!
//! Callers send `Command`s (see `protocol.rs`) and await a reply (see `reply.rs`); no storage call happens on
//! a caller's executor thread.
//!
//! Invariants:
//!
//! 1. Commands are handled in the order they were sent. Writes that are ready together run in one
//!    `BEGIN IMMEDIATE` transaction; replies go out only after it commits. Reads in the same batch
//!    run after the writes, so a caller that released (even by dropping a guard) and then
//!    inspects sees its release.
//! 2. Every transaction that deletes rows (release, cancel, shutdown, expiry) also promotes every
//!    waiter the grant rule now allows, whoever owns it, with its ticket kept.
//! 3. A request is known to the worker by the caller's request id from the moment its rows are
//!    written until they are deleted. The caller sends `Remove` by that id, so it is right
//!    whether the acquisition was granted, queued or promoted; and since commands are handled in
//!    order, a `Remove` sent after an `Acquire` whose reply was never read still finds its rows.
//! 4. While this owner has waiters, the worker looks for other connections' commits every `poll`
//!    with `PRAGMA data_version` (a read). Only when something changed, or a foreign lease ran
//!    out, does it read the queues, and only when a waiter is grantable does it write.
//! 5. `Shutdown` is the last command handled: commands behind it, even in its own batch, are
//!    dropped unanswered (their callers see `Shutdown`), so no row is written after it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use super::grant::{grantable_now, promotable};
use super::handle::Counters;
use super::protocol::{Acquired, Command, Grant, SlotState, WaitSlot, Write};
use super::storage::{micros, Deleted, OwnedRequest, Storage};
use super::{Common, LockError, LockRequest};
use crate::sync::lock;

/// At most this many commands go into one transaction.
const MAX_BATCH: usize = 256;

/// How long the worker keeps looking for the next command before it blocks.
const SPIN: std::time::Duration = std::time::Duration::from_micros(100);

/// What the worker remembers of a request whose rows it wrote.
struct Written {
    ticket: u64,
    keys: Vec<String>,
}

/// What a transaction freed, for waking waiters once it has committed.
struct Freed {
    /// Whether any row was deleted or promoted.
    any: bool,
    /// The promoted tickets, whoever owns them.
    promoted: Vec<u64>,
    /// When the promoted rows' leases began (clock micros).
    at: i64,
}

/// What a write decided inside the transaction, delivered once it has committed.
enum Decided {
    Granted(Grant),
    Queued(u64),
    NotNow,
    /// A removal: whether every row it deleted was live.
    Removed(bool),
    Done,
}

pub(crate) struct Worker<S> {
    storage: S,
    common: Arc<Common>,
    rx: Receiver<Command>,
    /// Request id -> its ticket and keys, for every request of this owner that has rows.
    requests: HashMap<u64, Written>,
    /// Ticket -> slot, for this owner's queued requests.
    waits: HashMap<u64, Arc<WaitSlot>>,
    last_data_version: Option<i64>,
    next_deadline: Option<i64>,
    last_look: Instant,
    poked: bool,
    last_renewal: Option<i64>,
    /// Whether the current transaction deleted a row of this owner.
    deleted: bool,
    /// Take a full look at the next tick even if nothing changed (a wait started).
    look_soon: bool,
    /// Requests whose removal failed: retried with every heartbeat, so that their rows do not
    /// live on, renewed with this owner's others.
    failed_removals: Vec<u64>,
}

impl<S: Storage> Worker<S> {
    pub(crate) fn new(storage: S, common: Arc<Common>, rx: Receiver<Command>) -> Self {
        Worker {
            storage,
            common,
            rx,
            requests: HashMap::new(),
            waits: HashMap::new(),
            last_data_version: None,
            next_deadline: None,
            last_look: Instant::now(),
            poked: false,
            last_renewal: None,
            deleted: false,
            look_soon: false,
            failed_removals: Vec::new(),
        }
    }

    fn now(&self) -> i64 {
        self.storage.now()
    }

    /// `at`, a time of the storage's clock, in the manager's clock: what callers judge by.
    fn local(&self, at: i64) -> i64 {
        at - self.storage.ahead_of(&*self.common.clock)
    }

    fn counters(&self) -> &Counters {
        &self.common.counters
    }

    fn has_waiters(&self) -> bool {
        !self.waits.is_empty() || self.common.unqueued.load(Ordering::SeqCst) > 0
    }

    pub(crate) fn run(mut self) {
        loop {
            let received = match self.spin() {
                Some(received) => received,
                None => {
                    self.common.replies.worker_sleeps();
                    let received = if self.has_waiters() {
                        let left = self.common.poll.saturating_sub(self.last_look.elapsed());
                        self.rx.recv_timeout(left)
                    } else {
                        self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
                    };
                    self.common.replies.worker_wakes();
                    received
                }
            };
            match received {
                Ok(first) => {
                    let mut batch = vec![first];
                    while batch.len() < MAX_BATCH {
                        match self.rx.try_recv() {
                            Ok(command) => batch.push(command),
                            Err(_) => break,
                        }
                    }
                    if self.handle(batch) {
                        return;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    self.close();
                    return;
                }
            }
            if self.has_waiters() && (self.poked || self.last_look.elapsed() >= self.common.poll) {
                self.look_for_changes();
            }
        }
    }

    /// Right after a batch, callers often send again at once (release after acquire, the next
    /// request of a busy task). Waking a blocked thread costs tens of microseconds on small
    /// virtual machines, more than a transaction, so look for a while before blocking. This
    /// spends the worker's own time, never a caller's.
    fn spin(&self) -> Option<Result<Command, RecvTimeoutError>> {
        let until = Instant::now() + SPIN;
        loop {
            match self.rx.try_recv() {
                Ok(command) => return Some(Ok(command)),
                Err(TryRecvError::Disconnected) => {
                    return Some(Err(RecvTimeoutError::Disconnected))
                }
                Err(TryRecvError::Empty) if Instant::now() < until => std::thread::yield_now(),
                Err(TryRecvError::Empty) => return None,
            }
        }
    }

    /// Handles one batch; returns whether the worker should stop.
    fn handle(&mut self, batch: Vec<Command>) -> bool {
        let mut writes = Vec::new();
        let mut reads = Vec::new();
        // Requests acquired earlier in this batch: a `Remove` for one must run after it.
        let mut acquiring = Vec::new();
        let mut stop = false;
        for command in batch {
            if stop {
                // Nothing is done after a shutdown, not even what reached it in the same batch:
                // dropping the command's reply tells its caller `Shutdown`.
                continue;
            }
            match command {
                Command::Write(Write::Acquire {
                    request,
                    requests,
                    queue,
                    reply,
                }) => {
                    if !queue
                        && !writes.iter().any(Write::may_free)
                        && self.refused_by_a_read(&requests)
                    {
                        // A waiter without a queue position, still blocked: no need to take the
                        // write lock to tell it so. Only when nothing earlier in this batch may
                        // free rows: the read sees the database before the batch's writes, and
                        // a request must see every command sent before it.
                        self.remember_view();
                        let _ = reply.send(Ok(Acquired::NotNow));
                        continue;
                    }
                    acquiring.push(request);
                    writes.push(Write::Acquire {
                        request,
                        requests,
                        queue,
                        reply,
                    });
                }
                Command::Write(Write::Remove { request, reply }) => {
                    if self.requests.contains_key(&request) || acquiring.contains(&request) {
                        writes.push(Write::Remove { request, reply });
                    } else if let Some(reply) = reply {
                        // Nothing was ever written for it, or it is gone already.
                        let _ = reply.send(Ok(false));
                    }
                }
                Command::Write(Write::Renew { reply }) => {
                    let now = self.now();
                    let half_beat = micros(self.common.heartbeat / 2);
                    match self.last_renewal {
                        // Every live row got a full lease then (or since, when written). The
                        // caller is told when, and beats again one heartbeat after that, so the
                        // rows keep their whole margin; lost leases are looked for then.
                        Some(at) if now < at + half_beat => {
                            let _ = reply.send(Ok(self.local(at)));
                        }
                        _ => {
                            for request in std::mem::take(&mut self.failed_removals) {
                                writes.push(Write::Remove {
                                    request,
                                    reply: None,
                                });
                            }
                            writes.push(Write::Renew { reply });
                        }
                    }
                }
                Command::Write(Write::Shutdown { reply }) => {
                    writes.push(Write::Shutdown { reply });
                    stop = true;
                }
                Command::Poke => self.poked = true,
                read @ (Command::Inspect { .. } | Command::IsLocked { .. }) => reads.push(read),
            }
        }
        if !writes.is_empty() {
            self.write(writes);
        }
        for read in reads {
            self.read(read);
        }
        stop
    }

    /// Whether a read shows `requests` cannot be granted now. (An error answers "not known":
    /// the write transaction then decides.)
    fn refused_by_a_read(&mut self, requests: &[LockRequest]) -> bool {
        let now = self.now();
        let mut rows = Vec::new();
        for request in requests {
            if self
                .storage
                .rows_on_key(&request.key, now, &mut rows)
                .is_err()
            {
                return false;
            }
        }
        !grantable_now(requests.iter().map(|r| (r.key.as_str(), r.mode)), &rows)
    }

    fn read(&mut self, command: Command) {
        let now = self.now();
        match command {
            Command::Inspect { key, reply } => {
                let _ = reply.send(self.storage.live_rows(key.as_deref(), now));
            }
            Command::IsLocked { key, reply } => {
                let _ = reply.send(self.storage.is_held(&key, now));
            }
            _ => {}
        }
    }

    /// Runs `writes` in one transaction; if that fails, each alone, so one bad write does not
    /// fail the others.
    fn write(&mut self, writes: Vec<Write>) {
        let may_free = writes.iter().any(Write::may_free);
        let outcome = self.transaction(may_free, |worker, now| {
            let mut decided = Vec::with_capacity(writes.len());
            for write in &writes {
                decided.push(worker.apply(write, now)?);
            }
            Ok((decided, now))
        });
        match outcome {
            Ok(((decided, now), freed)) => {
                for (write, decided) in writes.into_iter().zip(decided) {
                    self.deliver(write, decided, now);
                }
                self.after_commit(&freed);
            }
            Err(error) => {
                // Rolled back: the ids recorded for this batch's acquisitions point at nothing.
                for write in &writes {
                    if let Write::Acquire { request, .. } = write {
                        self.requests.remove(request);
                    }
                }
                self.retry_alone(writes, error);
            }
        }
    }

    fn retry_alone(&mut self, writes: Vec<Write>, error: LockError) {
        match writes.len() {
            1 => {
                if let Some(write) = writes.into_iter().next() {
                    fail(write, error, &mut self.failed_removals);
                }
            }
            _ => {
                for write in writes {
                    self.write(vec![write]);
                }
            }
        }
    }

    /// `BEGIN IMMEDIATE`, `body`, then (if `may_free`: the body may delete rows, or time may have
    /// freed some) deletion of expired rows and promotion, `COMMIT`. Returns what `body`
    /// returned and what was freed. A transaction that only adds rows frees nothing, and expired
    /// rows are ignored by every decision, so it skips the queue pass.
    ///
    /// The clock is read once the write lock is held, and `body` is given that time: a time read
    /// before could be stale by however long another connection held the lock, and a renewal
    /// judged by it could revive a row that had run out, and been passed over, meanwhile.
    fn transaction<T>(
        &mut self,
        may_free: bool,
        body: impl FnOnce(&mut Self, i64) -> Result<T, LockError>,
    ) -> Result<(T, Freed), LockError> {
        let now = self.storage.begin()?;
        Counters::bump(&self.counters().write_transactions);
        self.deleted = false;
        let result = (|| {
            let value = body(self, now)?;
            let mut freed = Freed {
                any: self.deleted,
                promoted: Vec::new(),
                at: now,
            };
            if may_free {
                let expired = self.storage.delete_expired(now)?;
                let rows = self.storage.rows_on_waited_keys(now)?;
                freed.promoted = promotable(&rows);
                for row in rows.iter().filter(|row| !row.held) {
                    if freed.promoted.binary_search(&row.ticket).is_ok() {
                        self.storage.promote(&row.key, row.ticket, now)?;
                    }
                }
                freed.any |= expired > 0 || !freed.promoted.is_empty();
            }
            if freed.any {
                self.storage.announce()?;
            }
            self.storage.commit()?;
            Ok((value, freed))
        })();
        if result.is_err() {
            self.storage.rollback();
        }
        result
    }

    fn apply(&mut self, write: &Write, now: i64) -> Result<Decided, LockError> {
        let owner = self.common.owner.as_str();
        match write {
            Write::Acquire {
                request,
                requests,
                queue,
                ..
            } => {
                let mut rows = Vec::new();
                for request in requests {
                    self.storage.rows_on_key(&request.key, now, &mut rows)?;
                }
                let wanted = requests.iter().map(|r| (r.key.as_str(), r.mode));
                let granted = grantable_now(wanted, &rows);
                if !granted && !queue {
                    return Ok(Decided::NotNow);
                }
                let ticket = self.storage.next_ticket()?;
                let expires_at = now + micros(self.common.lease);
                self.storage
                    .insert_request(owner, ticket, requests, granted, now, expires_at)?;
                // Recorded now, not after the commit, so that a `Remove` later in this batch
                // finds it; `write` forgets it again if the transaction rolls back.
                let keys = requests.iter().map(|r| r.key.clone()).collect();
                self.requests.insert(*request, Written { ticket, keys });
                Ok(if granted {
                    Decided::Granted(Grant { ticket, expires_at })
                } else {
                    Decided::Queued(ticket)
                })
            }
            Write::Remove { request, .. } => {
                let mut live = true;
                if let Some(written) = self.requests.get(request) {
                    for key in &written.keys {
                        let deleted = self.storage.delete_row(owner, key, written.ticket, now)?;
                        self.deleted |= deleted != Deleted::Missing;
                        live &= deleted == Deleted::Live;
                    }
                }
                Ok(Decided::Removed(live))
            }
            Write::Renew { .. } => {
                let expires_at = now + micros(self.common.lease);
                self.storage.renew(owner, now, expires_at)?;
                Ok(Decided::Done)
            }
            Write::Shutdown { .. } => {
                self.deleted |= self.storage.delete_owner(owner)? > 0;
                Ok(Decided::Done)
            }
        }
    }

    fn deliver(&mut self, write: Write, decided: Decided, now: i64) {
        match (write, decided) {
            (Write::Acquire { reply, .. }, Decided::Granted(grant)) => {
                let expires_at = self.local(grant.expires_at);
                let _ = reply.send(Ok(Acquired::Granted(Grant {
                    expires_at,
                    ..grant
                })));
            }
            (Write::Acquire { reply, .. }, Decided::Queued(ticket)) => {
                let slot = Arc::new(WaitSlot::default());
                self.waits.insert(ticket, slot.clone());
                self.remember_view();
                let _ = reply.send(Ok(Acquired::Queued(ticket, slot)));
            }
            (Write::Acquire { reply, .. }, _) => {
                self.remember_view();
                let _ = reply.send(Ok(Acquired::NotNow));
            }
            (Write::Remove { request, reply }, decided) => {
                if let Some(Written { ticket, .. }) = self.requests.remove(&request) {
                    self.waits.remove(&ticket);
                }
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(matches!(decided, Decided::Removed(true))));
                }
            }
            (Write::Renew { reply }, _) => {
                self.last_renewal = Some(now);
                let local = self.local(now);
                self.common.last_renewal.store(
                    u64::try_from(local).unwrap_or(0),
                    std::sync::atomic::Ordering::SeqCst,
                );
                Counters::bump(&self.counters().heartbeats);
                let checked = self.check_own_rows(now);
                let _ = reply.send(checked.map(|()| local));
            }
            (Write::Shutdown { reply }, _) => {
                self.requests.clear();
                for (_, slot) in self.waits.drain() {
                    slot.set(SlotState::Shutdown);
                }
                lock(&self.common.guards).shut_down();
                // Waiters without a queue position wake, try again, and find the manager shut.
                self.common.changed.notify(usize::MAX);
                let _ = reply.send(Ok(()));
            }
        }
    }

    /// After a commit: wake the local waiters that were promoted, and if anything was freed,
    /// the waiters without a queue position and the other managers of this process.
    fn after_commit(&mut self, freed: &Freed) {
        // This owner's rows were promoted with this owner's lease (see `Db::promote`).
        let expires_at = self.local(freed.at + micros(self.common.lease));
        for ticket in &freed.promoted {
            if let Some(slot) = self.waits.remove(ticket) {
                slot.set(SlotState::Granted(expires_at));
            }
        }
        if freed.any {
            self.common.changed.notify(usize::MAX);
            super::siblings::poke(&self.common);
        }
    }

    /// Compares this owner's live rows with its guards and waits: a guard whose rows are gone
    /// or expired has lost its lease; a wait whose rows are gone can never be granted.
    fn check_own_rows(&mut self, now: i64) -> Result<(), LockError> {
        let owned = self.storage.owned_requests(&self.common.owner, now)?;
        let find_request = |ticket: u64, held: bool| {
            owned
                .iter()
                .find(|r: &&OwnedRequest| r.ticket == ticket && r.held == held)
        };
        let find = |ticket: u64, held: bool| find_request(ticket, held).map_or(0, |r| r.rows);
        lock(&self.common.guards).lose(
            |ticket, rows, _| find(ticket, true) < rows,
            "the lock's rows are gone or expired",
        );
        let ahead = self.storage.ahead_of(&*self.common.clock);
        let mut settled = Vec::new();
        for (&ticket, slot) in &self.waits {
            if let Some(held) = find_request(ticket, true) {
                // Promoted by another manager, with this owner's lease from its clock.
                slot.set(SlotState::Granted(held.expires_at - ahead));
                settled.push(ticket);
            } else if find(ticket, false) == 0 {
                slot.set(SlotState::Expired);
                settled.push(ticket);
            }
        }
        for ticket in settled {
            self.waits.remove(&ticket);
            if find(ticket, false) == 0 && find(ticket, true) == 0 {
                self.requests.retain(|_, written| written.ticket != ticket);
            }
        }
        Ok(())
    }

    /// The poll: a cheap read to see whether anyone else committed (or a foreign lease ran out),
    /// then, only if so, a look at the queues and a promotion if one is due.
    fn look_for_changes(&mut self) {
        self.last_look = Instant::now();
        let poked = std::mem::take(&mut self.poked);
        if let Err(error) = self.try_look(poked) {
            tracing::warn!(%error, "looking for other processes' changes failed; will retry");
            self.last_data_version = None;
        }
    }

    /// A new wait: take a full look at the next tick (to learn the foreign expiries that may
    /// free it), comparing with the version of the last full look, not with a version read now,
    /// which could silently include another process's promotion of one of our waiters.
    fn remember_view(&mut self) {
        self.look_soon = true;
    }

    fn try_look(&mut self, poked: bool) -> Result<(), LockError> {
        let version = self.storage.change_version()?;
        Counters::bump(&self.counters().change_checks);
        let now = self.now();
        let due = self.next_deadline.is_some_and(|deadline| now >= deadline);
        let changed = self.last_data_version != Some(version) || due || poked;
        if !changed && !std::mem::take(&mut self.look_soon) {
            return Ok(());
        }
        self.look_soon = false;
        self.last_data_version = Some(version);

        if !promotable(&self.storage.rows_on_waited_keys(now)?).is_empty() {
            let ((), freed) = self.transaction(true, |_, _| Ok(()))?;
            self.after_commit(&freed);
        } else if changed {
            // Others' changes may matter to waiters that hold no queue position. (Not on a look
            // taken only because a wait started: that would wake the refused `many` that
            // started it, which would try again, start a wait again: a loop of writes.)
            self.common.changed.notify(usize::MAX);
        }
        // Own rows are judged by the time now: a promotion above may have waited for the write
        // lock. The next deadline is looked for from the time the queues were judged by: a
        // foreign lease that ran out since was not seen to run out, and must make the next tick
        // look again. (Looked for from `now`, it would be skipped, and with no other commit to
        // see, the waiter it blocked would wait for ever.)
        let judged = now;
        let now = self.now();
        self.check_own_rows(now)?;
        self.next_deadline = self
            .storage
            .next_foreign_expiry(&self.common.owner, judged)?;
        Ok(())
    }

    /// The manager is gone (every handle dropped): leave no row behind.
    fn close(&mut self) {
        let owner = self.common.owner.clone();
        let deleted = self.transaction(true, |worker, _| {
            worker.deleted |= worker.storage.delete_owner(&owner)? > 0;
            Ok(())
        });
        match deleted {
            Ok(((), freed)) => self.after_commit(&freed),
            Err(error) => tracing::warn!(
                %error,
                "could not delete this owner's rows on close; they expire with their lease"
            ),
        }
    }
}

impl<S> Drop for Worker<S> {
    /// However the worker stops (shutdown, every handle gone, or a panic), no waiter is left
    /// waiting for it.
    fn drop(&mut self) {
        for (_, slot) in self.waits.drain() {
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
        Write::Renew { reply } => {
            let _ = reply.send(Err(error));
        }
        Write::Shutdown { reply } => {
            let _ = reply.send(Err(error));
        }
    }
}
