//! Leader election: a leader is the holder of an exclusive lock on the election's key, its
//! value the lock's operation, its term the grant's fencing token. [`LockManager::campaign`]
//! queues for it (FIFO among campaigners), [`LockManager::lead`] runs a body while leading
//! (bound to the lease as `with_lock` binds any body: `bound.rs`), and
//! [`LockManager::leader`] and [`LockManager::observe`] read it, the latter from the same
//! change stream as [`LockManager::changes`], on the key alone.

use std::error::Error;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::{self, BoxFuture};
use futures::stream::{BoxStream, Stream, StreamExt};

use crate::abort::{AbortSignal, Interrupted};
use crate::scope::Scoped;
use crate::sync::lock;

use super::bound::{bound, Lease};
use super::changes::{self, Rows};
use super::types::check_text;
use super::{EntryState, Guard, LockEntry, LockError, LockManager, LockRequest, Mode};

/// This manager's leadership of an election's key, from [`LockManager::campaign`]: an exclusive
/// lock on the key whose operation is the leader's value. Resigned by
/// [`resign`](Leadership::resign) or by dropping it.
///
/// # Examples
///
/// ```
/// use leasehold::{LockManager, MemoryStore};
///
/// # futures::executor::block_on(async {
/// let store = MemoryStore::new();
/// let (a, b) = (LockManager::builder().open_in(&store)?, LockManager::builder().open_in(&store)?);
/// let first = a.campaign("scheduler", "a:8080").await?;
/// first.proclaim("a:8081").await?; // a new value, the same term
/// let leader = b.leader("scheduler").await?.expect("a leads");
/// assert_eq!((leader.value.as_str(), leader.term), ("a:8081", first.term()));
/// first.resign().await?;
/// let second = b.campaign("scheduler", "b:8080").await?;
/// assert!(second.term() > leader.term, "terms only grow");
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
#[must_use = "dropping a Leadership resigns it"]
pub struct Leadership {
    guard: Guard,
    key: String,
    /// The value, and which proclamation set it (a later one wins, whatever order their
    /// answers come back in).
    value: Mutex<(u64, String)>,
    proclaimed: AtomicU64,
}

impl Leadership {
    /// The election's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// This leadership's term: the grant's fencing token, larger than every earlier leader's
    /// term of this key. A resource that remembers the largest term it has accepted can refuse
    /// a deposed leader's writes.
    pub fn term(&self) -> u64 {
        self.guard.fencing_token()
    }

    /// The value this leader last proclaimed (at first, the one it campaigned with).
    pub fn value(&self) -> String {
        lock(&self.value).1.clone()
    }

    /// Aborted with a [`LeaseLost`](crate::LeaseLost) reason if the leadership is lost: see
    /// [`Guard::lost`].
    pub fn lost(&self) -> AbortSignal {
        self.guard.lost()
    }

    /// The lock that makes this manager the leader.
    pub fn guard(&self) -> &Guard {
        &self.guard
    }

    /// Sets a new value, seen by [`leader`](LockManager::leader) and
    /// [`observe`](LockManager::observe), without a new term.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidRequest`] for a value too long or with a NUL character,
    /// [`LockError::LeaseLost`] if this leadership's rows are gone or lapsed (it no longer
    /// leads), [`LockError::Storage`], [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// The new value is sent when this future is first polled, and then stored whether or
    /// not the future is awaited to the end.
    pub async fn proclaim(&self, value: &str) -> Result<(), LockError> {
        check_text("value", value)?;
        let order = self.proclaimed.fetch_add(1, Ordering::SeqCst) + 1;
        if self.guard.relabel(value.to_owned()).await? == 0 {
            return Err(LockError::LeaseLost(self.guard.lost_reason()));
        }
        let mut current = lock(&self.value);
        if current.0 < order {
            *current = (order, value.to_owned());
        }
        Ok(())
    }

    /// Steps down: releases the lock, so that the next campaigner leads at once.
    ///
    /// # Errors
    ///
    /// As [`Guard::release`]: [`LockError::LeaseLost`] if the leadership had been lost before
    /// (another may have led meanwhile).
    pub async fn resign(self) -> Result<(), LockError> {
        self.guard.release().await
    }
}

impl Lease for Leadership {
    fn guard(&self) -> &Guard {
        &self.guard
    }

    fn release(self) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(self.resign())
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("key", &self.key)
            .field("term", &self.term())
            .field("value", &self.value())
            .field("lost", &self.lost().is_aborted())
            .finish()
    }
}

/// An election's leader, as the store shows it: [`LockManager::leader`],
/// [`LockManager::observe`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    /// The election's key.
    pub key: String,
    /// The value it campaigned with, or last proclaimed.
    pub value: String,
    /// Its manager's [`owner_id`](LockManager::owner_id).
    pub owner: String,
    /// Its term: the fencing token of its grant.
    pub term: u64,
    /// When it began to lead, since the Unix epoch, by the store's clock. (Where the store
    /// keeps time on a monotonic line, as SQLite and the memory store do, it is told on the
    /// wall clock as each read finds it, so two reads may differ by a little.)
    pub since: Duration,
}

/// `KEY: VALUE (term T, OWNER)`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::Leader;
///
/// let leader = Leader {
///     key: "scheduler".into(),
///     value: "a:8080".into(),
///     owner: "host:42:1".into(),
///     term: 7,
///     since: Duration::ZERO,
/// };
/// assert_eq!(leader.to_string(), "scheduler: a:8080 (term 7, host:42:1)");
/// ```
impl fmt::Display for Leader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Leader {
            key,
            value,
            owner,
            term,
            ..
        } = self;
        write!(f, "{key}: {value} (term {term}, {owner})")
    }
}

/// The leader among `entries` (the rows of `key`): its exclusive holder.
fn leader_of(key: &str, entries: &[LockEntry]) -> Option<Leader> {
    let entry = entries.iter().find(|entry| {
        entry.key == key && entry.state == EntryState::Held && entry.mode == Mode::Exclusive
    })?;
    Some(Leader {
        key: entry.key.clone(),
        value: entry.operation.clone(),
        owner: entry.owner.clone(),
        term: entry.ticket,
        since: entry.since,
    })
}

/// How [`LockManager::lead`] failed: campaigning or holding the lease, or in the body.
#[derive(Debug)]
pub enum LeadError<E> {
    /// The campaign failed, the leadership was lost while the body ran
    /// ([`LockError::LeaseLost`]), or `lead` was interrupted ([`LockError::Interrupted`]).
    Lock(LockError),
    /// The body's own error.
    Body(E),
}

impl<E> From<LockError> for LeadError<E> {
    fn from(error: LockError) -> Self {
        LeadError::Lock(error)
    }
}

impl<E> From<Interrupted> for LeadError<E> {
    fn from(interrupted: Interrupted) -> Self {
        LeadError::Lock(LockError::Interrupted(interrupted))
    }
}

impl<E: fmt::Display> fmt::Display for LeadError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeadError::Lock(error) => write!(f, "leading: {error}"),
            LeadError::Body(error) => write!(f, "the leader's work failed: {error}"),
        }
    }
}

impl<E: Error + 'static> Error for LeadError<E> {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            LeadError::Lock(error) => Some(error),
            LeadError::Body(error) => Some(error),
        }
    }
}

/// Leader changes of one key, starting with the current leader (`None`: nobody leads): a
/// [`Stream`] made by [`LockManager::observe`]. Errors of a read are items too; after
/// [`LockError::Shutdown`] the stream ends.
#[must_use = "streams do nothing unless polled"]
pub struct Observe {
    leaders: BoxStream<'static, Result<Option<Leader>, LockError>>,
}

impl Stream for Observe {
    type Item = Result<Option<Leader>, LockError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.leaders.poll_next_unpin(cx)
    }
}

impl fmt::Debug for Observe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Observe").finish_non_exhaustive()
    }
}

impl LockManager {
    /// Campaigns to lead the election `key` with `value`: waits, in FIFO order among
    /// campaigners, for the exclusive lock on `key`, whose operation is `value`. The leader is
    /// whoever holds it; its term is the grant's fencing token.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire); [`LockError::InvalidRequest`] for a bad key or value
    /// (nothing is written).
    ///
    /// A leadership is announced to observers in other processes (by the doorbell, or a
    /// notification sent with the commit) when it is granted at once and when it ends by a
    /// resignation or a drop, so that they see it then rather than at their next poll; one
    /// granted from the queue was announced by the commit that freed the key.
    ///
    /// # Cancel safety
    ///
    /// As every acquisition's: an interrupted or dropped campaign leaves no row.
    ///
    /// # Examples
    ///
    /// See [`Leadership`].
    pub fn campaign(
        &self,
        key: impl AsRef<str>,
        value: impl AsRef<str>,
    ) -> Scoped<Leadership, LockError> {
        let (key, value) = (key.as_ref().to_owned(), value.as_ref().to_owned());
        let acquisition = self.acquire_announced(LockRequest::exclusive(&key, &value));
        Scoped::new(move |_| async move {
            check_text("value", &value)?;
            let guard = acquisition.await?;
            Ok(Leadership {
                guard,
                key,
                value: Mutex::new((0, value)),
                proclaimed: AtomicU64::new(0),
            })
        })
    }

    /// Campaigns, then runs `body` while leading, and resigns when it ends, so that the next
    /// campaigner leads at once: the whole as one [`Scoped`].
    ///
    /// The body is bound to the lease as [`with_lock`](Self::with_lock) binds it: if no
    /// renewal comes back until a [`margin`](Self::margin) (one heartbeat, 5 s by default)
    /// before the lease runs out (30 s), or the leadership is lost outright, the body is
    /// interrupted with a [`LeaseLost`](crate::LeaseLost) reason and its finalizers run, with
    /// that margin to finish in before the store could let another campaigner lead; `lead`
    /// resolves only after they have finished and the lock is released.
    ///
    /// # Errors
    ///
    /// [`LeadError::Body`] with the body's error; [`LeadError::Lock`] with the campaign's
    /// error, with [`LockError::LeaseLost`] if the body was stopped by a lost leadership (or
    /// the resignation found it lost), and with [`LockError::Interrupted`] if `lead` itself
    /// was interrupted (then whatever befell the lease meanwhile is only logged).
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{Interrupted, LockManager, Scoped};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let term = locks
    ///     .lead("compactor", "replica-1", |leadership| {
    ///         let term = leadership.term();
    ///         Scoped::<_, Interrupted>::new(move |scope| async move {
    ///             scope.add_finalizer(|status| async move { println!("stepping down: {status}") });
    ///             // ... the leader's work, checking `term` at the resources it writes ...
    ///             Ok(term)
    ///         })
    ///     })
    ///     .await
    ///     .expect("led");
    /// assert!(term > 0);
    /// assert_eq!(locks.leader("compactor").await?, None, "resigned when the body ended");
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn lead<T, E, F>(
        &self,
        key: impl AsRef<str>,
        value: impl AsRef<str>,
        body: F,
    ) -> Scoped<T, LeadError<E>>
    where
        F: FnOnce(&Leadership) -> Scoped<T, E> + Send + 'static,
        T: Send + 'static,
        E: Send + 'static,
    {
        bound(
            self.campaign(key, value),
            self.margin(),
            move |leadership| {
                let work = body(leadership);
                Scoped::new(move |_| async move { work.await.map_err(LeadError::Body) })
            },
        )
    }

    /// The current leader of the election `key`, or `None`.
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`], [`LockError::Shutdown`].
    pub async fn leader(&self, key: &str) -> Result<Option<Leader>, LockError> {
        Ok(leader_of(key, &self.inspect(Some(key)).await?))
    }

    /// The leader changes of the election `key`: first its leader now (`None`: nobody), then
    /// each new leader, new value, or end of a leadership, in order (several changes close
    /// together may come as one, never one out of order).
    ///
    /// Woken as [`changes`](Self::changes) is, reading `key`'s rows alone: at once for this
    /// manager's changes, at the next look of the change poll for other managers' and
    /// processes', woken by the doorbell (SQLite) or `NOTIFY` (PostgreSQL).
    ///
    /// # Examples
    ///
    /// ```
    /// use futures::StreamExt;
    /// use leasehold::{LockManager, MemoryStore};
    ///
    /// # futures::executor::block_on(async {
    /// let store = MemoryStore::new();
    /// let (watcher, replica) =
    ///     (LockManager::builder().open_in(&store)?, LockManager::builder().open_in(&store)?);
    /// let mut leaders = watcher.observe("scheduler");
    /// assert_eq!(leaders.next().await.unwrap()?, None);
    /// let leadership = replica.campaign("scheduler", "replica-1").await?;
    /// let leader = leaders.next().await.unwrap()?.expect("a leader");
    /// assert_eq!((leader.value.as_str(), leader.term), ("replica-1", leadership.term()));
    /// leadership.resign().await?;
    /// assert_eq!(leaders.next().await.unwrap()?, None);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn observe(&self, key: &str) -> Observe {
        let owned = key.to_owned();
        let leaders = changes::changes(self, Rows::Key(owned.clone()))
            .scan(None, move |shown: &mut Option<Option<Leader>>, rows| {
                let item = match rows {
                    Err(error) => Some(Err(error)),
                    Ok(rows) => {
                        let leader = leader_of(&owned, &rows);
                        // `since` is read anew each time, and may differ by a hair.
                        let who = |leader: &Option<Leader>| {
                            (leader.as_ref()).map(|l| (l.term, l.owner.clone(), l.value.clone()))
                        };
                        if shown.as_ref().map(who) == Some(who(&leader)) {
                            None
                        } else {
                            *shown = Some(leader.clone());
                            Some(Ok(leader))
                        }
                    }
                };
                future::ready(Some(item))
            })
            .filter_map(future::ready);
        Observe {
            leaders: leaders.boxed(),
        }
    }
}
