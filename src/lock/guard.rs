//! `Guard`: a granted lock, released by `release`, by drop, or by a scope that adopted it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::channel::oneshot;
use futures::future::BoxFuture;

use crate::abort::AbortSignal;
use crate::runtime::{self, Observed};
use crate::scope::Release;
use crate::sync::lock;

use super::handle::Shared;
use super::heartbeat;
use super::state::held::GuardEntry;
use super::worker::protocol::{Command, Grant, Removed};
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
    /// The guard of `grant`, whose lease the worker keeps already (see [`Guards::granted`]).
    pub(super) fn new(
        shared: &Arc<Shared>,
        request: u64,
        (grant, lost): (Grant, AbortSignal),
        requests: Vec<LockRequest>,
        started: Option<Duration>,
    ) -> Guard {
        let ticket = grant.ticket;
        let now = shared.common.clock.monotonic();
        if !lost.is_aborted() {
            heartbeat::ensure_daemon(shared, grant.began);
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
            lost,
            acquired_at: now,
            released: false,
        }
    }

    /// The request's ticket: strictly increasing across keys and owners of one database, and on
    /// each key larger than the tokens of the earlier grants this one conflicts with (shared
    /// holders, which exclude nobody, may be granted out of ticket order). A resource that
    /// remembers the largest token it has accepted from an exclusive holder can refuse writes
    /// from a holder whose lease ran out while it was paused.
    pub fn fencing_token(&self) -> u64 {
        self.ticket
    }

    /// What this guard holds, in the order requested.
    pub fn requests(&self) -> &[LockRequest] {
        &self.requests
    }

    /// Aborted with a [`LeaseLost`] reason if the lease is lost while held. Attach it to the
    /// protected work with [`Scoped::with_signal`](crate::Scoped::with_signal).
    ///
    /// It follows the lease as this process knows it: it aborts once the lease has run out
    /// since the last renewal that came back (reckoned from when that renewal was sent, so never
    /// after the store's own reckoning), whether or not anything runs then. A look at it
    /// ([`is_aborted`](AbortSignal::is_aborted)) finds it so at once, and whoever awaits it
    /// wakes then, even while the storage thread or the connection is stuck, or the heartbeat's
    /// executor has stopped. It also aborts as soon as a heartbeat finds the lock's rows gone.
    pub fn lost(&self) -> AbortSignal {
        self.lost.clone()
    }

    /// Aborted with a [`LeaseLost`] reason once the lease has `margin` or less left as this
    /// process knows it (no renewal came back in time: [`LeaseLost::before_expiry`]), or
    /// as soon as [`lost`](Guard::lost) aborts. Work bound to it is told `margin` before any
    /// other owner can be granted the lock, so that its clean-up can finish first;
    /// [`LockManager::with_lock`](crate::LockManager::with_lock) binds its body so, with
    /// [`LockManager::margin`](crate::LockManager::margin) (one heartbeat, unless the lease is
    /// short). A margin of the lease less a heartbeat, or more, tells work to stop before a
    /// renewal sent on time could come back. Each call makes a signal of its own, kept with the
    /// guard until it is released.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use leasehold::{LeaseLost, LockManager, TestClock};
    ///
    /// # futures::executor::block_on(async {
    /// let clock = TestClock::new();
    /// let locks = LockManager::builder()
    ///     .clock(Arc::new(clock.clone()))
    ///     .lease(Duration::from_secs(30))
    ///     .open_in_memory()?;
    /// let guard = locks.exclusive("k", "work").await?;
    /// let warned = guard.lost_within(Duration::from_secs(5));
    /// clock.advance(Duration::from_secs(25)); // no heartbeat has renewed it
    /// let reason = warned.reason().expect("warned 5 s before the lease runs out");
    /// assert!(reason.downcast_ref::<LeaseLost>().unwrap().before_expiry());
    /// assert!(!guard.lost().is_aborted(), "the lease itself has 5 s left");
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn lost_within(&self, margin: Duration) -> AbortSignal {
        lock(&self.shared.common.guards)
            .signal_within(self.ticket, margin)
            .unwrap_or_else(|| self.lost.clone())
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
        let sent = self.shared.send(Command::remove(self.request, Some(reply)));
        self.trace_release();
        sent?;
        // The database decides: rows that were all live when deleted mean nobody else can have
        // held the lock meanwhile, even if a slow renewal made this process fear otherwise.
        // When it cannot tell (the answer to a try that may have deleted them was lost), the
        // lease as this process knows it does: still running, and not lost before, it held.
        let answer = self.shared.common.replies.wait(response).await?;
        let now = self.shared.common.clock.monotonic();
        let held = match answer {
            Removed::AllLive => true,
            Removed::NotAllLive => false,
            Removed::GoneAfterLostAnswer { since } => entry
                .as_ref()
                .is_some_and(|entry| !entry.is_lost(now) && entry.expires_at() > since),
        };
        runtime::observe(|| Observed::Released {
            owner: self.shared.common.owner.clone(),
            ticket: self.ticket,
            held,
            ran_out: entry.as_ref().is_none_or(|entry| entry.is_lost(now)),
        });
        if held {
            return Ok(());
        }
        let lost = self.lost_reason();
        if let Some(entry) = entry {
            // Lost before any heartbeat could tell: tell the work it protected now.
            tracing::warn!(
                ticket = self.ticket,
                "released a lock whose lease had run out"
            );
            entry.lose(lost);
        }
        Err(LockError::LeaseLost(lost))
    }

    /// Sets the operation of this guard's rows to `operation` (a leader's new value); how many
    /// rows it changed (0: its rows are gone or lapsed).
    pub(super) async fn relabel(&self, operation: String) -> Result<usize, LockError> {
        let request = self.request;
        (self.shared)
            .call(|reply| Command::Relabel {
                request,
                operation,
                reply,
            })
            .await
    }

    /// Its owner's id.
    pub(super) fn owner(&self) -> &str {
        &self.shared.common.owner
    }

    /// Why this guard's lease was lost, as its `lost()` signal says (lost by its deadline, if
    /// it says nothing else).
    pub(super) fn lost_reason(&self) -> LeaseLost {
        (self.lost.reason())
            .and_then(|reason| reason.downcast_ref::<LeaseLost>().copied())
            .unwrap_or_else(LeaseLost::expired)
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
            .monotonic()
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
            let _ = self.shared.send(Command::remove(self.request, None));
        }
    }
}

/// For [`Scope::adopt`](crate::Scope::adopt): releases as [`Guard::release`] does, and logs its
/// error with `tracing` at warn, since a scope's close has none to give (see `adopt`'s
/// `# Errors`).
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
