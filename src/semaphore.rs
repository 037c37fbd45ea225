//! A fair (strictly FIFO) counting semaphore.
//!
//! Invariants:
//!
//! 1. `state` holds the free permits in its low bits and, in its top bit, whether the queue is
//!    non-empty. Waiters in `queue` are served strictly in order: a request at the head that does
//!    not fit blocks everything behind it.
//! 2. The fast path takes permits with one compare-and-swap, and only while the queue flag is
//!    clear, so it never overtakes a queued request (except in the instant a waiter is enqueuing,
//!    a race the waiter could equally have lost).
//! 3. A waiter sets the queue flag (under the queue lock) and then serves the queue; a release
//!    adds permits and learns the flag from the same atomic add. So at least one of them sees the
//!    other, and no permit is stranded while someone waits.
//!
//! Lock order: only the queue lock exists; it is never held while waking a task.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::task::AtomicWaker;

use crate::scope::Release;
use crate::sync::lock;

/// The top bit of `state`: the queue is not empty.
const QUEUED: usize = 1 << (usize::BITS - 1);
/// The low bits of `state`: free permits.
const FREE: usize = !QUEUED;

struct Inner {
    capacity: usize,
    state: AtomicUsize,
    queue: Mutex<VecDeque<Arc<Waiter>>>,
}

struct Waiter {
    permits: usize,
    granted: AtomicBool,
    waker: AtomicWaker,
}

/// A fair counting semaphore: strictly FIFO, so a large request at the head is not overtaken.
///
/// Cheap to clone; clones share the permits.
///
/// # Examples
///
/// ```
/// use leasehold::Semaphore;
///
/// # futures::executor::block_on(async {
/// let connections = Semaphore::new(2);
/// let a = connections.acquire(1).await;
/// let b = connections.try_acquire(1).unwrap();
/// assert!(connections.try_acquire(1).is_none());
/// drop((a, b));
/// assert_eq!(connections.available(), 2);
/// # });
/// ```
#[derive(Clone)]
pub struct Semaphore {
    inner: Arc<Inner>,
}

impl Semaphore {
    /// A semaphore with `permits` permits.
    ///
    /// # Panics
    ///
    /// If `permits` does not fit in 63 bits.
    pub fn new(permits: usize) -> Self {
        assert!(permits <= FREE, "a semaphore holds at most {FREE} permits");
        Semaphore {
            inner: Arc::new(Inner {
                capacity: permits,
                state: AtomicUsize::new(permits),
                queue: Mutex::new(VecDeque::new()),
            }),
        }
    }

    /// Waits, in FIFO order, for `permits` permits.
    ///
    /// # Panics
    ///
    /// If `permits` is more than the semaphore was created with: it could never be granted.
    ///
    /// # Cancel safety
    ///
    /// Dropping this future before it completes removes the request from the queue (and returns
    /// the permits if they had just been granted); the requests behind it move up.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::Semaphore;
    ///
    /// # futures::executor::block_on(async {
    /// let semaphore = Semaphore::new(3);
    /// let permit = semaphore.acquire(3).await;
    /// assert_eq!(semaphore.available(), 0);
    /// drop(permit);
    /// # });
    /// ```
    pub fn acquire(&self, permits: usize) -> Acquire<'_> {
        assert!(
            permits <= self.inner.capacity,
            "requested {permits} permits from a semaphore of {}",
            self.inner.capacity
        );
        Acquire {
            semaphore: self,
            permits,
            waiter: None,
        }
    }

    /// Takes `permits` now if they are free and nobody is queued; never waits.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::Semaphore;
    ///
    /// let semaphore = Semaphore::new(1);
    /// let permit = semaphore.try_acquire(1);
    /// assert!(permit.is_some());
    /// assert!(semaphore.try_acquire(1).is_none());
    /// assert!(semaphore.try_acquire(2).is_none()); // more than it has: never
    /// ```
    pub fn try_acquire(&self, permits: usize) -> Option<Permit> {
        self.inner
            .take_unqueued(permits)
            .then(|| self.permit(permits))
    }

    /// Permits free right now.
    pub fn available(&self) -> usize {
        self.inner.state.load(SeqCst) & FREE
    }

    fn permit(&self, permits: usize) -> Permit {
        Permit {
            semaphore: self.clone(),
            permits,
        }
    }
}

impl Inner {
    /// Takes `n` permits if that many are free and nobody is queued (the fast path).
    fn take_unqueued(&self, n: usize) -> bool {
        self.state
            .fetch_update(SeqCst, SeqCst, |state| {
                if state & QUEUED == 0 {
                    state.checked_sub(n)
                } else {
                    None
                }
            })
            .is_ok()
    }

    /// Takes `n` permits for the head of the queue if that many are free.
    fn take_queued(&self, n: usize) -> bool {
        self.state
            .fetch_update(SeqCst, SeqCst, |state| {
                (state & FREE >= n).then(|| state - n)
            })
            .is_ok()
    }

    /// Returns `n` permits and serves the queue if it is not empty.
    fn give(&self, n: usize) {
        if self.state.fetch_add(n, SeqCst) & QUEUED != 0 {
            self.serve();
        }
    }

    /// Grants waiters from the head of the queue while the head fits.
    fn serve(&self) {
        let mut woken: Vec<Arc<Waiter>> = Vec::new();
        {
            let mut queue = lock(&self.queue);
            while let Some(head) = queue.front() {
                if !self.take_queued(head.permits) {
                    break;
                }
                let head = queue.pop_front().expect("front exists");
                head.granted.store(true, SeqCst);
                woken.push(head);
            }
            if queue.is_empty() {
                self.state.fetch_and(FREE, SeqCst);
            }
        }
        for waiter in woken {
            waiter.waker.wake();
        }
    }
}

/// The future of [`Semaphore::acquire`].
#[must_use = "futures do nothing unless awaited"]
pub struct Acquire<'a> {
    semaphore: &'a Semaphore,
    permits: usize,
    waiter: Option<Arc<Waiter>>,
}

impl Future for Acquire<'_> {
    type Output = Permit;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Permit> {
        let this = &mut *self;
        let inner = &this.semaphore.inner;
        match &this.waiter {
            None => {
                if inner.take_unqueued(this.permits) {
                    return Poll::Ready(this.semaphore.permit(this.permits));
                }
                let waiter = Arc::new(Waiter {
                    permits: this.permits,
                    granted: AtomicBool::new(false),
                    waker: AtomicWaker::new(),
                });
                waiter.waker.register(cx.waker());
                {
                    let mut queue = lock(&inner.queue);
                    queue.push_back(waiter.clone());
                    inner.state.fetch_or(QUEUED, SeqCst);
                }
                // Permits may have been returned before the flag was raised (invariant 3).
                inner.serve();
                this.waiter = Some(waiter);
            }
            Some(waiter) => waiter.waker.register(cx.waker()),
        }
        let waiter = this.waiter.as_ref().expect("queued above");
        if waiter.granted.load(SeqCst) {
            // The permit now owns the permits; with no waiter left, Drop has nothing to undo.
            this.waiter = None;
            Poll::Ready(this.semaphore.permit(this.permits))
        } else {
            Poll::Pending
        }
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        let Some(waiter) = self.waiter.take() else {
            return;
        };
        let inner = &self.semaphore.inner;
        let removed = {
            let mut queue = lock(&inner.queue);
            let position = queue.iter().position(|w| Arc::ptr_eq(w, &waiter));
            position.map(|at| {
                queue.remove(at);
            })
        };
        match removed {
            // Still queued: the requests behind it may fit now.
            Some(()) => inner.serve(),
            // Granted but never handed over: give the permits back.
            None => inner.give(waiter.permits),
        }
    }
}

impl fmt::Debug for Acquire<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Acquire")
            .field("permits", &self.permits)
            .field("queued", &self.waiter.is_some())
            .finish()
    }
}

/// Permits taken from a [`Semaphore`]; returned when dropped (or released by a scope).
#[must_use = "dropping a Permit returns its permits at once"]
pub struct Permit {
    semaphore: Semaphore,
    permits: usize,
}

impl Permit {
    /// How many permits this holds.
    pub fn permits(&self) -> usize {
        self.permits
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.permits > 0 {
            self.semaphore.inner.give(self.permits);
        }
    }
}

impl Release for Permit {
    fn release(self) -> BoxFuture<'static, ()> {
        drop(self);
        Box::pin(std::future::ready(()))
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("permits", &self.permits)
            .finish()
    }
}

impl fmt::Debug for Semaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Semaphore")
            .field("capacity", &self.inner.capacity)
            .field("available", &self.available())
            .field("waiters", &lock(&self.inner.queue).len())
            .finish()
    }
}
