//! `Guard`: a granted lock, released by `release`, by drop, or by a scope that adopted it.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::channel::oneshot;
use futures::future::BoxFuture;

use crate::abort::{AbortController, AbortReason, AbortSignal};
use crate::scope::Release;
use crate::sync::lock;

use super::handle::Shared;
use super::heartbeat;
use super::protocol::{Command, Grant, Removed, Write};
use super::{LeaseLost, LockError, LockRequest};

/// A granted lock. Released by [`release`](Guard::release), by dropping it, or by a [`Scope`](crate::Scope)
/// that [adopted](crate::Scope::adopt) it.
///
/// # Examples
///
/// ```
/// use leasehold::{LockManager, Scoped, LockError};
///
/// # futures::executor::block_on(async {
/// let locks = LockManager::open_in_memory()?;
/// let guard = locks.exclusive("repo", "prune").await?;
/// let token = guard.fencing_token();   // pass it to the resource you write to
/// // Interrupt the protected work if the lease is ever lost:
/// let work = Scoped::<(), LockError>::new(|_| async { Ok(()) }).with_signal(&guard.lost());
/// work.await?;
/// guard.release().await?;
/// # let _ = token;
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
#[must_use = "dropping a Guard releases the lock"]
pub struct Guard {
    shared: Arc<Shared>,
    request: u64,
    ticket: u64,
    requests: Vec<LockRequest>,
    lost: AbortSignal,
    acquired_at: Duration,
    released: bool,
}

impl Guard {
    pub(super) fn new(
        shared: &Arc<Shared>,
        request: u64,
        grant: Grant,
        requests: Vec<LockRequest>,
        started: Option<Duration>,
    ) -> Guard {
        let ticket = grant.ticket;
        let common = &shared.common;
        let now = common.clock.now();
        let lost = AbortController::new();
        let signal = lost.signal();
        let entry = GuardEntry {
            rows: requests.len(),
            keys: requests.iter().map(|r| r.key.clone()).collect(),
            lost,
            expires_at: grant.expires_at,
        };
        let born_lost = lock(&common.guards).insert(ticket, entry);
        match born_lost {
            // Granted in the batch that shut the manager down, whose deletion took it again:
            // the shutdown has already told the other guards, so tell this one here.
            Some(lost) => {
                lost.abort(AbortReason::new(LeaseLost::shutdown()));
            }
            None => heartbeat::ensure_daemon(shared, grant.expires_at),
        }
        for request in &requests {
            tracing::debug!(
                key = %request.key,
                mode = ?request.mode,
                operation = %request.operation,
                ticket,
                waited_us = started.map(|s| now.saturating_sub(s).as_micros() as u64),
                "lock acquired"
            );
        }
        Guard {
            shared: shared.clone(),
            request,
            ticket,
            requests,
            lost: signal,
            acquired_at: now,
            released: false,
        }
    }

    /// The request's ticket: strictly increasing across keys and owners of one database. A
    /// resource that remembers the largest token it has accepted can refuse writes from a holder
    /// whose lease ran out while it was paused.
    pub fn fencing_token(&self) -> u64 {
        self.ticket
    }

    /// What this guard holds, in the order requested.
    pub fn requests(&self) -> &[LockRequest] {
        &self.requests
    }

    /// Aborted with a [`LeaseLost`] reason if the lease is lost while held. Attach it to the
    /// protected work with [`Scoped::with_signal`](crate::Scoped::with_signal).
    pub fn lost(&self) -> AbortSignal {
        self.lost.clone()
    }

    /// Deletes this owner's rows and wakes local waiters. Dropping the guard releases it too
    /// (silently, whether or not the lease was lost).
    ///
    /// A guard from `many` releases all its keys in one transaction, so no other request ever
    /// sees part of the set released.
    ///
    /// # Errors
    ///
    /// [`LockError::LeaseLost`] if the lease had been lost before the release: the rows were
    /// gone or had run out (the [`lost`](Guard::lost) signal is then aborted too, if it was
    /// not already), so the work the guard protected may have overlapped with another
    /// holder's. [`LockError::Storage`] if the rows could not be deleted (they then expire
    /// with their lease); [`LockError::Shutdown`] if the manager was shut down (which released
    /// them).
    ///
    /// # Cancel safety
    ///
    /// The release is sent before the first await, so dropping this future still releases.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use leasehold::{LockError, LockManager, TestClock};
    ///
    /// # futures::executor::block_on(async {
    /// let clock = TestClock::new();
    /// let locks = LockManager::builder().clock(Arc::new(clock.clone())).open_in_memory()?;
    /// let guard = locks.exclusive("k", "paused too long").await?;
    /// clock.advance(Duration::from_secs(60)); // past the lease, with no heartbeat
    /// assert!(matches!(guard.release().await, Err(LockError::LeaseLost(_))));
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn release(mut self) -> Result<(), LockError> {
        self.released = true;
        let entry = self.forget();
        let (reply, response) = oneshot::channel();
        let sent = self.shared.send(Command::Write(Write::Remove {
            request: self.request,
            reply: Some(reply),
        }));
        self.trace_release();
        sent?;
        // The database decides: rows that were all live when deleted mean nobody else can have
        // held the lock meanwhile, even if a slow renewal made this process fear otherwise.
        // When it cannot tell (the answer to a try that may have deleted them was lost), the
        // lease as this process knows it does: still running, and not lost before, it held.
        let held = match self.shared.common.replies.wait(response).await? {
            Removed::AllLive => true,
            Removed::NotAllLive => false,
            Removed::GoneAfterLostAnswer => entry
                .as_ref()
                .is_some_and(|entry| heartbeat::lease_runs(&self.shared.common, entry.expires_at)),
        };
        if held {
            return Ok(());
        }
        let lost = self
            .lost
            .reason()
            .and_then(|reason| reason.downcast_ref::<LeaseLost>().copied())
            .unwrap_or_else(LeaseLost::expired);
        if let Some(entry) = entry {
            // Lost before any heartbeat could tell: tell the work it protected now.
            tracing::warn!(
                ticket = self.ticket,
                "released a lock whose lease had run out"
            );
            entry.lost.abort(AbortReason::new(lost));
        }
        Err(LockError::LeaseLost(lost))
    }

    /// Stops the heartbeat's bookkeeping of this guard; returns its entry, unless a lost lease
    /// or a shutdown took it already.
    fn forget(&self) -> Option<GuardEntry> {
        lock(&self.shared.common.guards).forget(self.ticket)
    }

    fn trace_release(&self) {
        let held_for = self
            .shared
            .common
            .clock
            .now()
            .saturating_sub(self.acquired_at);
        for request in &self.requests {
            tracing::debug!(
                key = %request.key,
                ticket = self.ticket,
                held_us = held_for.as_micros() as u64,
                "lock released"
            );
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.released {
            self.forget();
            self.trace_release();
            // Through the worker without waiting; it runs before any later command.
            let _ = self.shared.send(Command::Write(Write::Remove {
                request: self.request,
                reply: None,
            }));
        }
    }
}

impl Release for Guard {
    fn release(self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if let Err(error) = Guard::release(self).await {
                tracing::warn!(%error, "releasing a lock owned by a scope failed");
            }
        })
    }
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("fencing_token", &self.ticket)
            .field("requests", &self.requests)
            .field("lost", &self.lost.is_aborted())
            .finish()
    }
}

/// The guards an owner holds, as its heartbeat and its storage worker see them. Every change to
/// them is one of these methods, so that a lost lease is told in one place.
#[derive(Default)]
pub(super) struct Guards {
    entries: HashMap<u64, GuardEntry>,
    /// Whether the owner's lock heartbeat runs (see `heartbeat::ensure_daemon`).
    pub(super) daemon_running: bool,
    /// How many guards were granted until each time (micros): the earliest is where the storage
    /// worker watches for leases that no heartbeat renewed (`Worker::lose_unrenewed`).
    grant_ends: std::collections::BTreeMap<i64, usize>,
    /// Set (as the entries are drained) when the worker has shut down, so that a guard made
    /// afterwards is born lost instead of missing the drain.
    shut_down: bool,
}

pub(super) struct GuardEntry {
    rows: usize,
    keys: Vec<String>,
    lost: AbortController,
    /// When the rows' lease ran out as granted (clock micros), before any renewal.
    expires_at: i64,
}

impl Guards {
    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The earliest lease end as granted among the guards held (micros, clock time).
    pub(super) fn first_grant_end(&self) -> Option<i64> {
        self.grant_ends.keys().next().copied()
    }

    fn add_grant_end(&mut self, expires_at: i64) {
        *self.grant_ends.entry(expires_at).or_default() += 1;
    }

    fn remove_grant_end(&mut self, expires_at: i64) {
        if let std::collections::btree_map::Entry::Occupied(mut count) =
            self.grant_ends.entry(expires_at)
        {
            *count.get_mut() -= 1;
            if *count.get() == 0 {
                count.remove();
            }
        }
    }

    /// Records a new guard, unless the manager has shut down: then its controller is returned,
    /// for the caller to tell the guard it is lost.
    fn insert(&mut self, ticket: u64, entry: GuardEntry) -> Option<AbortController> {
        if self.shut_down {
            return Some(entry.lost);
        }
        self.add_grant_end(entry.expires_at);
        self.entries.insert(ticket, entry);
        None
    }

    /// The guard is released: its lease is no longer this owner's business.
    fn forget(&mut self, ticket: u64) -> Option<GuardEntry> {
        let entry = self.entries.remove(&ticket)?;
        self.remove_grant_end(entry.expires_at);
        Some(entry)
    }

    /// Tells every guard for which `is_lost(rows, expires_at)` holds that its lease is lost, and
    /// forgets it; `why` goes to the log. Returns how many were lost.
    pub(super) fn lose(
        &mut self,
        mut is_lost: impl FnMut(u64, usize, i64) -> bool,
        why: &str,
    ) -> usize {
        let lost: Vec<u64> = self
            .entries
            .iter()
            .filter(|(&ticket, entry)| is_lost(ticket, entry.rows, entry.expires_at))
            .map(|(&ticket, _)| ticket)
            .collect();
        for &ticket in &lost {
            if let Some(entry) = self.forget(ticket) {
                tracing::warn!(ticket, keys = ?entry.keys, "lease lost: {why}");
                entry.lost.abort(AbortReason::new(LeaseLost::expired()));
            }
        }
        lost.len()
    }

    /// The manager has shut down: every guard is lost, and any made later is born lost.
    pub(super) fn shut_down(&mut self) {
        self.shut_down = true;
        let reason = AbortReason::new(LeaseLost::shutdown());
        self.grant_ends.clear();
        for (_, entry) in self.entries.drain() {
            entry.lost.abort(reason.clone());
        }
    }
}
