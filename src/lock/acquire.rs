//! Acquisition, from the request to the `Guard`: `LockManager`'s acquiring methods, validated
//! requests sent to the worker, the wait for a queued request's turn (and its heartbeat, forked
//! by the waiting caller when the worker says it is due), the grant taken with its `lost`
//! signal, and the clean-up that removes whatever an acquisition wrote unless it hands a guard
//! out: at once through the worker when dropped, and by a finalizer that waits for the removal
//! when interrupted.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::abort::AbortSignal;
use crate::exit::ExitStatus;
use crate::scope::{Scope, Scoped};
use crate::sync::lock;

use super::error::StorageError;
use super::guard::Guard;
use super::handle::Shared;
use super::heartbeat;
use super::state::Common;
use super::types::validate;
use super::worker::protocol::{Acquired, Command, Grant, Wait, Woken, Write};
use super::{LockError, LockManager, LockRequest};

enum Policy {
    /// Queue under one ticket (single key, or `many_queued`); `announce`d to every other
    /// manager of the store when granted at once and when removed, whoever waits (a
    /// leadership: see `Write::Acquire`).
    Queue { announce: bool },
    /// All or nothing, holding no queue position while waiting (`many`).
    NoQueue,
}

impl LockManager {
    /// Waits for a shared lock on `key`. See [`acquire`](LockManager::acquire).
    ///
    /// The key and operation may be borrowed or owned: `locks.shared(format!("repo/{id}"),
    /// "backup")` works as `locks.shared("repo/7", "backup")` does.
    pub fn shared(
        &self,
        key: impl AsRef<str>,
        operation: impl AsRef<str>,
    ) -> Scoped<Guard, LockError> {
        self.acquire(LockRequest::shared(key.as_ref(), operation.as_ref()))
    }

    /// Waits for an exclusive lock on `key`. See [`acquire`](LockManager::acquire).
    ///
    /// The key and operation may be borrowed or owned, as for [`shared`](LockManager::shared).
    pub fn exclusive(
        &self,
        key: impl AsRef<str>,
        operation: impl AsRef<str>,
    ) -> Scoped<Guard, LockError> {
        self.acquire(LockRequest::exclusive(key.as_ref(), operation.as_ref()))
    }

    /// Waits for `count` of the `limit` permits of `key`: at most `limit` permits of a key are
    /// held at once, across every owner of the store ([`LockRequest::permits`]). See
    /// [`acquire`](LockManager::acquire).
    ///
    /// Granted in the order asked for: a request that does not fit waits, and so does every
    /// request behind it on the key, however few permits it asks for, so that none waits for
    /// ever. A permit guard is a [`Guard`] like any other: a fencing token, heartbeats,
    /// [`lost`](Guard::lost), released by [`release`](Guard::release) or by drop.
    ///
    /// # Errors
    ///
    /// As [`acquire`](LockManager::acquire), and [`LockError::InvalidRequest`] for a `count` of
    /// 0 or above `limit`, a `limit` of 0, a limit other than the one the key's other requests
    /// name, or a key held or waited for in shared or exclusive mode.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::LockManager;
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// // At most three backups at once.
    /// let first = locks.permits("backups", "photos", 1, 3).await?;
    /// let second = locks.permits("backups", "music", 2, 3).await?;
    /// let full = locks.try_acquire(leasehold::LockRequest::permits("backups", "mail", 1, 3));
    /// assert!(full.await?.is_none(), "three of three are held");
    /// second.release().await?;
    /// first.release().await?;
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn permits(
        &self,
        key: impl AsRef<str>,
        operation: impl AsRef<str>,
        count: u32,
        limit: u32,
    ) -> Scoped<Guard, LockError> {
        self.acquire(LockRequest::permits(
            key.as_ref(),
            operation.as_ref(),
            count,
            limit,
        ))
    }

    /// Waits, in FIFO order, for the lock `request` describes.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidRequest`] for a bad key or operation (nothing is written),
    /// [`LockError::Interrupted`] when an attached signal aborts, [`LockError::Storage`],
    /// [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// Interrupting it deletes its waiting row, and any row promoted for it, before it returns;
    /// dropping it does the same in the background. No row is left behind.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{AbortSignal, LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let held = locks.exclusive("repo", "prune").await?;
    /// let error = locks
    ///     .acquire(LockRequest::shared("repo", "backup"))
    ///     .with_signal(&AbortSignal::timeout(Duration::from_millis(20)))
    ///     .await
    ///     .unwrap_err();
    /// assert!(error.abort_reason().is_some());
    /// assert_eq!(locks.inspect(Some("repo")).await?.len(), 1); // only the holder
    /// # drop(held);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn acquire(&self, request: LockRequest) -> Scoped<Guard, LockError> {
        self.start(vec![request], Policy::Queue { announce: false })
    }

    /// [`acquire`](Self::acquire), announced to every other manager of the store when granted
    /// at once and when released, whoever waits: a leadership, which observers watch.
    pub(super) fn acquire_announced(&self, request: LockRequest) -> Scoped<Guard, LockError> {
        self.start(vec![request], Policy::Queue { announce: true })
    }

    /// All or nothing; holds no queue position while it waits (never blocks others, but may
    /// starve behind a steady stream of other requests).
    ///
    /// While it waits it holds no row at all, so [`inspect`](LockManager::inspect) does not show
    /// it: the database records it only once it holds every key. Use
    /// [`many_queued`](LockManager::many_queued) for a request that waits visibly, in line.
    ///
    /// # Errors
    ///
    /// As [`acquire`](LockManager::acquire); also [`LockError::InvalidRequest`] for no keys or a
    /// key named twice.
    ///
    /// # Cancel safety
    ///
    /// It never holds part of its set, and writes nothing until it is granted everything at once.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// // A mirror copy: shared on the source, exclusive on the mirror.
    /// let copy = locks
    ///     .many([
    ///         LockRequest::shared("repo/main", "copy"),
    ///         LockRequest::exclusive("repo/mirror", "copy"),
    ///     ])
    ///     .await?;
    /// assert_eq!(copy.requests().len(), 2);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn many(
        &self,
        requests: impl IntoIterator<Item = LockRequest>,
    ) -> Scoped<Guard, LockError> {
        self.start(requests.into_iter().collect(), Policy::NoQueue)
    }

    /// All or nothing; queues every key under one ticket, in one transaction (never starves;
    /// one global ticket order makes it deadlock-free).
    ///
    /// # Errors
    ///
    /// As [`many`](LockManager::many).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](LockManager::acquire): every row of the request is deleted when it is
    /// interrupted or dropped.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let both = locks
    ///     .many_queued([LockRequest::exclusive("a", "swap"), LockRequest::exclusive("b", "swap")])
    ///     .await?;
    /// assert!(locks.is_locked("a").await? && locks.is_locked("b").await?);
    /// both.release().await?;
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn many_queued(
        &self,
        requests: impl IntoIterator<Item = LockRequest>,
    ) -> Scoped<Guard, LockError> {
        self.start(
            requests.into_iter().collect(),
            Policy::Queue { announce: false },
        )
    }

    /// Granted now or `None`; never queues.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidRequest`], [`LockError::Storage`], [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// Dropping this future before it completes releases the lock if it was granted.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let first = locks.try_acquire(LockRequest::exclusive("k", "a")).await?;
    /// assert!(first.is_some());
    /// assert!(locks.try_acquire(LockRequest::shared("k", "b")).await?.is_none());
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn try_acquire(&self, request: LockRequest) -> Result<Option<Guard>, LockError> {
        let requests = vec![request];
        validate(&requests)?;
        let shared = self.shared.clone();
        let id = shared.next_request.fetch_add(1, Ordering::Relaxed);
        let undo = RemoveOnDrop::new(&shared, id);
        let grant = loop {
            let grant = match shared.acquire(id, &requests, Wait::No, false).await? {
                Acquired::Granted(grant) => grant,
                Acquired::NotNow | Acquired::Queued(..) => break None,
            };
            if let Some(grant) = shared.deliverable(id, grant).await? {
                break Some(grant);
            }
        };
        undo.disarm();
        Ok(grant.map(|grant| Guard::new(&shared, id, grant, requests, None)))
    }

    fn start(&self, requests: Vec<LockRequest>, policy: Policy) -> Scoped<Guard, LockError> {
        let shared = self.shared.clone();
        let spawner = shared.common.spawner.clone();
        let span = tracing::debug_span!(
            "acquire",
            keys = ?requests.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
            modes = ?requests.iter().map(|r| r.mode).collect::<Vec<_>>(),
            operation = requests.first().map_or("", |r| r.operation.as_str()),
            owner = %shared.common.owner,
        );
        let acquisition = Scoped::new(move |scope| {
            tracing::Instrument::instrument(acquire_in_scope(shared, scope, requests, policy), span)
        });
        match spawner {
            Some(spawner) => acquisition.with_spawner(spawner),
            None => acquisition,
        }
    }
}

/// The body of every acquisition. Whatever it writes is removed unless the body hands a `Guard`
/// out: at once, through the worker, if the body is dropped (the removal is queued behind the
/// acquisition, so it finds what that wrote); and by the finalizer registered before the first
/// write, which waits for the removal, so that an interrupted acquisition reports only after it.
async fn acquire_in_scope(
    shared: Arc<Shared>,
    scope: Scope,
    requests: Vec<LockRequest>,
    policy: Policy,
) -> Result<Guard, LockError> {
    validate(&requests)?;
    let started = shared.common.clock.monotonic();
    let id = shared.next_request.fetch_add(1, Ordering::Relaxed);
    let undo = shared.clone();
    scope.add_finalizer(move |status| async move {
        if !matches!(status, ExitStatus::Success) {
            match undo.remove(id).await {
                // A shut-down manager has deleted every row of its owner already.
                Ok(_) | Err(LockError::Shutdown) => {}
                Err(error) => tracing::warn!(
                    %error,
                    "removing an abandoned lock request failed; the worker retries it"
                ),
            }
        }
    });
    let removal = RemoveOnDrop::new(&shared, id);
    // Whether the waiter's heartbeat was forked: once, when a queued wait first lasts long
    // enough (see `WaitSlot::beat_due`), then it beats through every later wait of this call.
    let mut beating = false;
    // The caller still wants the lock whenever a grant or a wait runs out of lease: its place
    // is lost, its turn is not, so it asks again.
    let grant = loop {
        let grant = match policy {
            Policy::Queue { announce } => {
                // No later than the row's lease starts: the heartbeat counts from here.
                let sent_at = shared.common.clock.monotonic();
                match shared
                    .acquire(id, &requests, Wait::Queued, announce)
                    .await?
                {
                    Acquired::Granted(grant) => grant,
                    Acquired::Queued(ticket, slot) => {
                        let woken = loop {
                            match slot.woken_by().await? {
                                Woken::BeatDue if !beating => {
                                    beating = true;
                                    drop(scope.fork(heartbeat::waiter(shared.clone(), sent_at)));
                                }
                                Woken::BeatDue => {}
                                Woken::Granted(grant) => break Some(grant),
                                Woken::Lapsed => break None,
                            }
                        };
                        match woken {
                            Some(grant) => grant,
                            None => {
                                tracing::warn!(
                                    ticket,
                                    "a waiting request's lease ran out (was this process paused \
                                     or starved for longer than the lease?); queueing it again"
                                );
                                continue;
                            }
                        }
                    }
                    Acquired::NotNow => {
                        return Err(StorageError::new(
                            "acquiring",
                            "the storage refused a request that was to queue",
                        )
                        .into())
                    }
                }
            }
            Policy::NoQueue => {
                let _waiting = UnqueuedWaiter::new(&shared.common);
                loop {
                    // Listen before trying, so a change between the try and the wait is not
                    // missed.
                    let changed = shared.common.changed.listen();
                    match shared.acquire(id, &requests, Wait::Unqueued, false).await? {
                        Acquired::Granted(grant) => break grant,
                        Acquired::NotNow | Acquired::Queued(..) => changed.await,
                    }
                }
            }
        };
        if let Some(grant) = shared.deliverable(id, grant).await? {
            break grant;
        }
    };
    removal.disarm();
    Ok(Guard::new(&shared, id, grant, requests, Some(started)))
}

/// Counts a waiter without a queue position while it lives.
struct UnqueuedWaiter<'a>(&'a Common);

impl<'a> UnqueuedWaiter<'a> {
    fn new(common: &'a Common) -> Self {
        common.unqueued.fetch_add(1, Ordering::SeqCst);
        UnqueuedWaiter(common)
    }
}

impl Drop for UnqueuedWaiter<'_> {
    fn drop(&mut self) {
        self.0.unqueued.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Sends a `Remove` for a request if dropped before being disarmed: the synchronous half of
/// every acquisition's clean-up.
struct RemoveOnDrop<'a> {
    shared: &'a Shared,
    request: u64,
    armed: bool,
}

impl<'a> RemoveOnDrop<'a> {
    fn new(shared: &'a Shared, request: u64) -> Self {
        RemoveOnDrop {
            shared,
            request,
            armed: true,
        }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.shared.send(Command::remove(self.request, None));
        }
    }
}

/// What only acquisition sends through a handle.
impl Shared {
    async fn acquire(
        &self,
        request: u64,
        requests: &[LockRequest],
        wait: Wait,
        announce: bool,
    ) -> Result<Acquired, LockError> {
        self.call(|reply| {
            Command::Write(Write::Acquire {
                request,
                requests: requests.to_vec(),
                wait,
                announce,
                reply,
            })
        })
        .await
    }

    /// `grant`, with the signal that tells of its lease's loss, if its lease has not been lost
    /// by now: it ran out (as renewed since the grant, if a heartbeat renewed it), or its rows
    /// were found gone. Otherwise its rows are removed and `None` returned, for the caller to
    /// ask again: a grant is read late when the caller's executor (or its whole process) was
    /// stalled after the worker decided it, and a guard whose lease has already run out must
    /// never be handed out, since another owner may hold the lock.
    async fn deliverable(
        &self,
        request: u64,
        grant: Grant,
    ) -> Result<Option<(Grant, AbortSignal)>, LockError> {
        let lost = lock(&self.common.guards).signal(grant.ticket);
        if !lost.is_aborted() {
            return Ok(Some((grant, lost)));
        }
        tracing::warn!(
            ticket = grant.ticket,
            "a grant's lease ran out before it could be handed over (was this process paused or \
             starved for longer than the lease?); asking again"
        );
        self.remove(request).await?;
        Ok(None)
    }
}
