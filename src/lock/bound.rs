//! Work bound to a lease: [`LockManager::with_lock`], [`LockManager::lead`] (in
//! `election.rs`) and [`LockManager::every`] run a body only while its lock is held.
//!
//! Invariants:
//!
//! 1. The body runs with a signal attached that aborts a margin (`LockManager::margin`: one
//!    heartbeat, less at the shortest leases) before the lease runs out as this process knows
//!    it (`Guard::lost_within`), or as soon as it is lost: a body whose heartbeats stopped
//!    coming back is interrupted with a `LeaseLost` reason while the store still holds its
//!    rows, and its clean-up has that margin to finish before any other owner can be granted
//!    the lock.
//! 2. The lock is released after the body's scope has closed (its finalizers and fibers done)
//!    and before the bound `Scoped` resolves, however the body ended: by the body's own end, or
//!    by the scope's finalizer when the whole is interrupted or panics.
//! 3. A body stopped by the lease, or whose release found the lease lost, resolves with
//!    `LockError::LeaseLost`: the one error that says the work may have overlapped another
//!    holder's, wherever it came from. The exception: when the whole is interrupted from
//!    outside, it resolves with the caller's `Interrupted`, as every `Scoped` does, and a
//!    lost lease found by the release goes to the log only (found by the torture run's
//!    election workload; the caller who needs to know looks at the guard's `lost()`).

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;

use crate::abort::Interrupted;
use crate::runtime::{self, Observed};
use crate::schedule::Schedule;
use crate::scope::Scoped;
use crate::sync::lock;

use super::{Guard, LeaseLost, LockError, LockManager, LockRequest};

/// What a body can be bound to: a granted lock, or a leadership.
pub(super) trait Lease: Send + 'static {
    fn guard(&self) -> &Guard;
    fn release(self) -> BoxFuture<'static, Result<(), LockError>>;
}

impl Lease for Guard {
    fn guard(&self) -> &Guard {
        self
    }

    fn release(self) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(Guard::release(self))
    }
}

impl LockManager {
    /// Acquires `request`, runs `body` while the lock is held, and releases it: the whole as
    /// one [`Scoped`], which resolves only after the body's clean-up and the release.
    ///
    /// The body is bound to the lease: if no renewal comes back until a
    /// [`margin`](Self::margin) (one heartbeat, 5 s by default) before the lease runs out (30 s
    /// by default), or the lease is lost outright (its rows removed, the manager shut down),
    /// the body is interrupted with a [`LeaseLost`] reason, so that its finalizers and the
    /// fibers it forked have that margin to finish before any other owner can be granted the
    /// lock (see [`Guard::lost_within`]). Interrupting the returned `Scoped`
    /// interrupts the acquisition or the body, and releases the lock before it resolves.
    ///
    /// # Errors
    ///
    /// The acquisition's errors (see [`acquire`](Self::acquire)) and the body's own, through
    /// `E::from`; [`LockError::LeaseLost`] if the body was stopped by the lease, or if its
    /// release found the lease lost (its work may have overlapped another holder's). When the
    /// returned `Scoped` is itself interrupted, it resolves with your
    /// [`Interrupted`](crate::Interrupted), as every `Scoped` does, even if the lease was
    /// lost meanwhile: that release's error is only logged (`tracing`).
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockError, LockManager, LockRequest, Scoped};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let pruned = locks
    ///     .with_lock(LockRequest::exclusive("repo", "prune"), |guard| {
    ///         let token = guard.fencing_token();
    ///         Scoped::new(move |scope| async move {
    ///             // Forked work is bound too: it ends with the body, before the release.
    ///             scope.add_finalizer(|status| async move { println!("prune: {status}") });
    ///             Ok::<_, LockError>(token)
    ///         })
    ///     })
    ///     .await?;
    /// assert!(pruned > 0);
    /// assert!(!locks.is_locked("repo").await?, "released before it resolved");
    /// # Ok::<(), LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn with_lock<T, E, F>(&self, request: LockRequest, body: F) -> Scoped<T, E>
    where
        F: FnOnce(&Guard) -> Scoped<T, E> + Send + 'static,
        T: Send + 'static,
        E: From<LockError> + From<Interrupted> + Send + 'static,
    {
        bound(self.acquire(request), self.margin(), body)
    }

    /// Runs `job` once per recurrence of `schedule` across every manager of the store that
    /// runs it on `key`: at each recurrence it tries the lock without queueing
    /// ([`try_acquire`](Self::try_acquire)); the manager that gets it runs `job`, bound to the
    /// lease as in [`with_lock`](Self::with_lock), and holds the lock until at least
    /// `at_least` after the recurrence began, so that a manager whose recurrence comes a little
    /// later (its clock, or its start, apart from the others') finds it held and skips; the
    /// others skip that recurrence. Long jobs keep the lock by heartbeats, however long they
    /// run.
    ///
    /// Recurrences follow [`Schedule::repeat`] on the manager's clock (unless `schedule` has
    /// its own): the first at once, then as the schedule says after each (for a fleet, a
    /// [`fixed`](Schedule::fixed) grid, with `at_least` a little under its interval). It goes
    /// on until the schedule ends, or for ever; interrupt it to stop. An interrupted or dropped
    /// `every` releases the lock if it held it, so another manager may then run the job in the
    /// same recurrence.
    ///
    /// # Errors
    ///
    /// The first error of a `job`, or of trying the lock ([`LockError::Storage`],
    /// [`LockError::Shutdown`]), ends it with that error; [`LockError::LeaseLost`] if a job
    /// was stopped by its lease. Wrap the job to go on after its errors.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use leasehold::{LockError, LockManager, MemoryStore, Schedule, Scoped};
    ///
    /// # futures::executor::block_on(async {
    /// let store = MemoryStore::new();
    /// let runs = Arc::new(AtomicUsize::new(0));
    /// let every_50ms_three_times = || {
    ///     Schedule::fixed(Duration::from_millis(50)).intersect(Schedule::recurs(2))
    /// };
    /// let fleet: Vec<_> = (0..3)
    ///     .map(|_| {
    ///         let locks = LockManager::builder().open_in(&store)?;
    ///         let runs = runs.clone();
    ///         Ok(locks.every("compact", every_50ms_three_times(), Duration::from_millis(40), move || {
    ///             let runs = runs.clone();
    ///             Scoped::new(move |_| async move {
    ///                 runs.fetch_add(1, Ordering::SeqCst);
    ///                 Ok(())
    ///             })
    ///         }))
    ///     })
    ///     .collect::<Result<_, LockError>>()?;
    /// for done in futures::future::join_all(fleet).await {
    ///     done?;
    /// }
    /// // Once per recurrence across the three: three runs (more only if this machine stalled
    /// // one manager for 40 ms between the others' tries).
    /// assert!(runs.load(Ordering::SeqCst) >= 1);
    /// # Ok::<(), LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn every<F>(
        &self,
        key: impl AsRef<str>,
        schedule: Schedule,
        at_least: Duration,
        job: F,
    ) -> Scoped<(), LockError>
    where
        F: FnMut() -> Scoped<(), LockError> + Send + 'static,
    {
        let locks = self.clone();
        let key = key.as_ref().to_owned();
        let job = Arc::new(Mutex::new(job));
        Scoped::new(move |_| async move {
            let clock = locks.shared.common.clock.clone();
            let schedule = match schedule.clock {
                Some(_) => schedule,
                None => schedule.with_clock(clock.clone()),
            };
            let margin = locks.margin();
            schedule
                .repeat(|| {
                    let (locks, key, clock, job) =
                        (locks.clone(), key.clone(), clock.clone(), job.clone());
                    async move {
                        let began = clock.monotonic();
                        let request = LockRequest::exclusive(key.as_str(), "every");
                        let Some(guard) = locks.try_acquire(request).await? else {
                            tracing::debug!(%key, "held elsewhere: this recurrence is skipped");
                            return Ok(());
                        };
                        let run = (lock(&job))();
                        let and_hold = Scoped::new(move |_| async move {
                            run.await?;
                            let left = (began + at_least).saturating_sub(clock.monotonic());
                            clock.sleep(left).await;
                            Ok(())
                        });
                        bound(async { Ok(guard) }, margin, |_| and_hold).await
                    }
                })
                .await
        })
    }
}

/// Takes the lease out of `slot` once the work bound to it has ended (its scope closed), to be
/// released: by the body's end, or by the scope's finalizer, whichever comes first.
fn ended<L: Lease>(slot: &Mutex<Option<L>>) -> Option<L> {
    let held = lock(slot).take()?;
    let guard = held.guard();
    runtime::observe(|| Observed::WorkEnded {
        owner: guard.owner().to_owned(),
        ticket: guard.fencing_token(),
    });
    Some(held)
}

/// `body`, run on the lease `acquire` gives and bound to it (invariants 1 to 3).
pub(super) fn bound<L, T, E, F>(
    acquire: impl Future<Output = Result<L, LockError>> + Send + 'static,
    margin: Duration,
    body: F,
) -> Scoped<T, E>
where
    L: Lease,
    F: FnOnce(&L) -> Scoped<T, E> + Send + 'static,
    T: Send + 'static,
    E: From<LockError> + From<Interrupted> + Send + 'static,
{
    Scoped::new(move |scope| async move {
        let held = acquire.await?;
        let lost = held.guard().lost_within(margin);
        let work = body(&held);
        // Released by the body's end below, or, if this is interrupted or panics, by the
        // scope's close: after the body's own scope has closed, before this resolves.
        let slot = Arc::new(Mutex::new(Some(held)));
        let left = slot.clone();
        scope.add_finalizer(move |_| async move {
            if let Some(held) = ended(&left) {
                if let Err(error) = held.release().await {
                    tracing::warn!(%error, "releasing the lock of interrupted work failed");
                }
            }
        });
        if let Some(held) = lock(&slot).as_ref() {
            let guard = held.guard();
            runtime::observe(|| Observed::WorkBegan {
                owner: guard.owner().to_owned(),
                ticket: guard.fencing_token(),
            });
        }
        let outcome = work.with_signal(&lost).await;
        let released = match ended(&slot) {
            Some(held) => held.release().await,
            None => Ok(()),
        };
        let stopped = || (lost.reason()).map(|reason| reason.downcast_ref::<LeaseLost>().copied());
        match (outcome, released) {
            (Ok(value), Ok(())) => Ok(value),
            (Ok(_), Err(error)) => Err(E::from(error)),
            (Err(error), released) => match (stopped(), released) {
                (Some(why), _) => Err(E::from(LockError::LeaseLost(why.unwrap_or_default()))),
                (None, Err(LockError::LeaseLost(why))) => Err(E::from(LockError::LeaseLost(why))),
                (None, Err(release)) => {
                    tracing::warn!(error = %release, "releasing the lock after a failed body failed");
                    Err(error)
                }
                (None, Ok(())) => Err(error),
            },
        }
    })
}
