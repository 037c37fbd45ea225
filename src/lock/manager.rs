//! `LockManager`, the public handle: opening, reading (`is_locked`, `inspect`, `changes`,
//! `stats`), an operator's `remove`, and `shutdown`. Acquisition, from `exclusive()` to the
//! `Guard`, is in `acquire.rs`.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::grant;
use super::handle::Shared;
use super::worker::protocol::{Command, Write};
use super::{Changes, EntryState, LockEntry, LockError, LockManagerBuilder, Removal, StorageStats};
use crate::lock::time::from_micros;

/// Shared/exclusive lease locks keyed by strings, kept in one SQLite file so that several
/// processes on one machine coordinate through it ([`open`](LockManager::open)), in one
/// PostgreSQL schema for processes on several machines (feature `postgres`,
/// `LockManager::connect`), or in this process's memory
/// ([`open_in_memory`](LockManager::open_in_memory), [`MemoryStore`](crate::MemoryStore)).
///
/// One `LockManager` is one owner (normally one per process). Clones share the owner; two `open`
/// calls are two owners. Every acquisition is a [`Scoped`](crate::Scoped) future: attach an
/// [`AbortSignal`](crate::AbortSignal) with [`Scoped::with_signal`](crate::Scoped::with_signal) to
/// interrupt it, and it resolves with [`LockError::Interrupted`] only after its rows are deleted.
///
/// # Cancel safety
///
/// Every acquisition is cancel safe: interrupted, it deletes its waiting row (and any row a peer
/// promoted for it) before it returns; dropped, it does the same in the background (through the
/// storage worker, so a later call on this manager already sees it gone). A granted lock is never
/// lost: if it cannot be handed to the caller, it is released. `many` never holds part of its set;
/// `many_queued` deletes all its rows together. [`Guard::release`](crate::Guard::release) sends the
/// release before its first await, and dropping a guard releases it.
///
/// Dropping the last handle (clones, guards and pending acquisitions all hold one) deletes this
/// owner's remaining rows and closes the database, and waits for that: a single transaction,
/// usually well under a millisecond, and never more than half a heartbeat (a database that is
/// stuck gets the rest done in the background, or the rows expire with their lease).
/// [`shutdown`](LockManager::shutdown) does the same without blocking.
///
/// # Examples
///
/// ```
/// use leasehold::LockManager;
///
/// # futures::executor::block_on(async {
/// let locks = LockManager::open_in_memory()?;
/// let backup = locks.shared("repo", "backup").await?;
/// let restore = locks.shared("repo", "restore").await?;   // shared: held together
/// assert!(locks.is_locked("repo").await?);
/// backup.release().await?;
/// restore.release().await?;
/// let prune = locks.exclusive("repo", "prune").await?;   // alone
/// assert!(prune.fencing_token() > 0);
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
///
#[doc = include_str!("manager.md")]
#[derive(Clone)]
pub struct LockManager {
    pub(super) shared: Arc<Shared>,
}

impl fmt::Debug for LockManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManager")
            .field("owner", &self.shared.common.owner)
            .field("store", &self.shared.common.store)
            .finish()
    }
}

impl LockManager {
    /// Opens (creating if needed) the database file at `path` with default settings.
    ///
    /// # Errors
    ///
    /// See [`LockManagerBuilder::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LockError> {
        LockManager::builder().open(path)
    }

    /// Connects to a PostgreSQL database with default settings (feature `postgres`). See
    /// [`LockManagerBuilder::connect`].
    ///
    /// # Errors
    ///
    /// See [`LockManagerBuilder::connect`].
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        LockManager::builder().connect(url).await
    }

    /// Opens a private in-memory database with default settings.
    ///
    /// # Errors
    ///
    /// See [`LockManagerBuilder::open_in_memory`].
    pub fn open_in_memory() -> Result<Self, LockError> {
        LockManager::builder().open_in_memory()
    }

    /// Settings: lease 30 s, heartbeat 5 s, poll `Schedule::fixed(10 ms)`, a busy database
    /// retried with exponential back-off for up to 60 s (see
    /// [`LockManagerBuilder::busy_schedule`]), [`SystemClock`](crate::SystemClock), background work that
    /// follows the caller (see [`LockManagerBuilder::spawner`]), and on unix new database files
    /// readable and writable by their owner alone (`0o600`).
    pub fn builder() -> LockManagerBuilder {
        LockManagerBuilder::new()
    }

    /// This owner's id, as it appears in [`LockEntry::owner`]: `host:pid:…`, the machine and
    /// process that opened it, then what makes it unique among that process's owners. (Inside a
    /// simulation of the test kit, `sim:SEED:N`: drawn from the seed, so that a seed replays.)
    pub fn owner_id(&self) -> &str {
        &self.shared.common.owner
    }

    /// Whether `key` has a live holder.
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`], [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// A read: dropping it has no effect.
    pub async fn is_locked(&self, key: &str) -> Result<bool, LockError> {
        let key = key.to_owned();
        self.shared
            .call(|reply| Command::IsLocked { key, reply })
            .await
    }

    /// The live holders and waiters of `key`, or of every key, ordered by key and ticket.
    ///
    /// A waiting [`many`](LockManager::many) holds no row, so it is not listed until it is
    /// granted; every other waiting acquisition is. Each entry prints as one line (see
    /// [`LockEntry`]'s `Display`).
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`], [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// A read: dropping it has no effect.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{EntryState, LockManager};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let _guard = locks.exclusive("repo", "check").await?;
    /// let entries = locks.inspect(None).await?;
    /// assert_eq!(entries[0].operation, "check");
    /// assert_eq!(entries[0].state, EntryState::Held);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn inspect(&self, key: Option<&str>) -> Result<Vec<LockEntry>, LockError> {
        let key = key.map(str::to_owned);
        let rows = self
            .shared
            .call(|reply| Command::Inspect { key, reply })
            .await?;
        let mut positions: HashMap<&str, std::collections::BTreeMap<u64, usize>> = HashMap::new();
        Ok(rows
            .iter()
            .map(|row| {
                let state = if row.held {
                    EntryState::Held
                } else {
                    let on_key = positions.entry(row.key.as_str()).or_insert_with(|| {
                        grant::queue_positions(
                            &row.key,
                            rows.iter().map(|r| (r.key.as_str(), r.ticket, r.held)),
                        )
                    });
                    EntryState::Waiting {
                        position: on_key.get(&row.ticket).copied().unwrap_or(0),
                    }
                };
                LockEntry {
                    key: row.key.clone(),
                    mode: row.mode,
                    operation: row.operation.clone(),
                    owner: row.owner.clone(),
                    ticket: row.ticket,
                    state,
                    since: from_micros(row.since),
                    expires_at: from_micros(row.expires_at),
                }
            })
            .collect())
    }

    /// An operator's removal of another owner's rows: all of an owner's, or one request's by
    /// key and ticket, held or waiting, in one transaction that promotes the waiters it lets
    /// through, as a release by their owner would. Returns how many rows went (0 if there were
    /// none, or no live row on `key` has `ticket`).
    ///
    /// The removal is announced to the removed owner: a removed waiting request's acquisition fails
    /// at once with [`LockError::Removed`], naming this manager's [`owner_id`](Self::owner_id), and
    /// does not queue again. A removed holder's guard hears [`lost`](crate::Guard::lost) at its
    /// next heartbeat; until then it goes on as the holder, so a resource that must not see two
    /// holders checks [fencing tokens](crate::Guard::fencing_token). Meant for the rows of an owner
    /// whose process is gone, or stuck.
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`], [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// The removal is sent when this future is first polled (after the read of `key`'s rows,
    /// for a [`Removal::Request`]), and then happens whether or not the future is awaited to
    /// the end.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{Clock, LockError, LockManager, MemoryStore, Removal, SystemClock};
    ///
    /// # futures::executor::block_on(async {
    /// let store = MemoryStore::new();
    /// let (holder, waiter, operator) = (
    ///     LockManager::builder().open_in(&store)?,
    ///     LockManager::builder().open_in(&store)?,
    ///     LockManager::builder().open_in(&store)?,
    /// );
    /// let held = holder.exclusive("k", "work").await?;
    /// let waiting = waiter.exclusive("k", "more work");
    /// let remove = async {
    ///     // Once the waiter is queued behind the holder.
    ///     while operator.inspect(Some("k")).await?.len() < 2 {
    ///         SystemClock.sleep(Duration::from_millis(1)).await;
    ///     }
    ///     operator.remove(Removal::Owner(waiter.owner_id().into())).await
    /// };
    /// let (waited, removed) = futures::join!(waiting, remove);
    /// assert_eq!(removed?, 1);
    /// assert!(matches!(waited, Err(LockError::Removed { by }) if by == operator.owner_id()));
    /// held.release().await?;
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn remove(&self, target: Removal) -> Result<usize, LockError> {
        let (owner, tickets) = match target {
            Removal::Owner(owner) => (owner, None),
            Removal::Request { key, ticket } => {
                let rows = (self.shared)
                    .call(|reply| Command::Inspect {
                        key: Some(key),
                        reply,
                    })
                    .await?;
                match rows.into_iter().find(|row| row.ticket == ticket) {
                    Some(row) => (row.owner, Some(vec![ticket])),
                    None => return Ok(0),
                }
            }
        };
        (self.shared)
            .call(|reply| Command::Evict {
                owner,
                tickets,
                reply,
            })
            .await
    }

    /// Every change of the rows on the keys that start with `prefix` (`""`: every key): a
    /// stream of the live rows, as [`inspect`](Self::inspect) lists them, first as they are,
    /// then after each change (a grant, a release, a request queued, a removal, a lease run
    /// out). A heartbeat is not a change. Several changes close together may come as one.
    ///
    /// Changes of this manager are seen at once; those of other managers and processes at the
    /// next look of the change poll ([`poll`](crate::LockManagerBuilder::poll)), woken by the
    /// same doorbell (SQLite) or `NOTIFY` (PostgreSQL) that wakes waiters. On PostgreSQL, whose
    /// commits announce only what may free a waiter, every look reads the rows again (one
    /// read of every row per poll while a `Changes` lives: give a watching manager a slower
    /// [`poll`](crate::LockManagerBuilder::poll), as the command's `watch` does), so a request
    /// queued by another process is seen within a poll. A lease that runs out is seen
    /// when it does, by this manager's clock. While a `Changes` lives, this manager keeps
    /// looking, as it does while it has waiters.
    ///
    /// # Examples
    ///
    /// ```
    /// use futures::StreamExt;
    /// use leasehold::{LockManager, MemoryStore};
    ///
    /// # futures::executor::block_on(async {
    /// let store = MemoryStore::new();
    /// let (watcher, worker) = (
    ///     LockManager::builder().open_in(&store)?,
    ///     LockManager::builder().open_in(&store)?,
    /// );
    /// let mut changes = watcher.changes("repo/");
    /// assert!(changes.next().await.unwrap()?.is_empty());
    /// let guard = worker.exclusive("repo/photos", "prune").await?;
    /// let rows = changes.next().await.unwrap()?;
    /// assert_eq!((rows[0].key.as_str(), rows[0].ticket), ("repo/photos", guard.fencing_token()));
    /// guard.release().await?;
    /// assert!(changes.next().await.unwrap()?.is_empty());
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn changes(&self, prefix: &str) -> Changes {
        super::changes::changes(self, super::changes::Rows::Prefix(prefix.to_owned()))
    }

    /// Releases every row of this owner and stops its background work. Waiting acquisitions end
    /// with [`LockError::Shutdown`]; guards' [`lost`](crate::Guard::lost) signals abort. Calling it
    /// again does nothing.
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`] if the rows could not be deleted (they then expire with their
    /// lease).
    ///
    /// # Cancel safety
    ///
    /// The shutdown is sent when this future is first polled, and then happens whether or not
    /// the future is awaited to the end.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockError, LockManager};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let guard = locks.exclusive("k", "work").await?;
    /// locks.shutdown().await?;
    /// assert!(guard.lost().is_aborted());
    /// assert!(matches!(locks.exclusive("k", "more").await, Err(LockError::Shutdown)));
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn shutdown(&self) -> Result<(), LockError> {
        match self
            .shared
            .call(|reply| Command::Write(Write::Shutdown { reply }))
            .await
        {
            Err(LockError::Shutdown) => Ok(()),
            other => other,
        }
    }

    /// How long a row stays live without a renewal ([`LockManagerBuilder::lease`]).
    pub fn lease(&self) -> std::time::Duration {
        self.shared.common.lease
    }

    /// How often this owner renews its rows ([`LockManagerBuilder::heartbeat`]).
    pub fn heartbeat(&self) -> std::time::Duration {
        self.shared.common.heartbeat
    }

    /// How long before its lease runs out, as this process knows it, work bound to the lease
    /// ([`with_lock`](Self::with_lock), [`lead`](Self::lead), [`every`](Self::every)) is told
    /// to stop when renewals stop coming back
    /// ([`Guard::lost_within`](crate::Guard::lost_within) with this margin): one heartbeat,
    /// or, where that leaves a renewal less time to come back than it leaves the work, half of
    /// what a lease leaves after a heartbeat. So 5 s of the default 30 s lease;
    /// at the smallest lease the builder allows, twice the heartbeat, half a heartbeat. A
    /// renewal is sent a heartbeat after the last, and has until then to come back.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::LockManager;
    ///
    /// let locks = LockManager::open_in_memory()?;
    /// assert_eq!(locks.margin(), Duration::from_secs(5));
    /// let tight = LockManager::builder()
    ///     .lease(Duration::from_secs(2))
    ///     .heartbeat(Duration::from_secs(1))
    ///     .open_in_memory()?;
    /// assert_eq!(tight.margin(), Duration::from_millis(500));
    /// # Ok::<(), leasehold::LockError>(())
    /// ```
    pub fn margin(&self) -> std::time::Duration {
        let (lease, heartbeat) = (self.lease(), self.heartbeat());
        heartbeat.min(lease.saturating_sub(heartbeat) / 2)
    }

    /// Counters since open.
    pub fn stats(&self) -> StorageStats {
        let counters = &self.shared.common.counters;
        StorageStats {
            write_transactions: counters.write_transactions.load(Ordering::Relaxed),
            change_checks: counters.change_checks.load(Ordering::Relaxed),
            heartbeats: counters.heartbeats.load(Ordering::Relaxed),
            lock_waits: counters.lock_waits.load(Ordering::Relaxed),
        }
    }
}
