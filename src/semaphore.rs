//! A fair (strictly FIFO) counting semaphore.
//!
//! Invariants:
//!
//! 1. `permits` counts the permits not handed out. Waiters in `queue` are served strictly in
//!    order: a request at the head that does not fit blocks everything behind it.
//! 2. The fast path (no queue) takes permits with a compare-and-swap; it is used only while
//!    `waiters` is zero, so it cannot overtake a queued request except in the instant a waiter is
//!    enqueuing, which is a race the waiter could equally have lost.
//! 3. A waiter increments `waiters` and then (under the queue lock) re-checks the permits; a
//!    release adds permits and then checks `waiters`. Both use `SeqCst`, so at least one of them
//!    sees the other and no permit is stranded while someone waits.
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

struct Inner {
    capacity: usize,
    permits: AtomicUsize,
    waiters: AtomicUsize,
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
    pub fn new(permits: usize) -> Self {
        Semaphore {
            inner: Arc::new(Inner {
                capacity: permits,
                permits: AtomicUsize::new(permits),
                waiters: AtomicUsize::new(0),
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
    pub fn acquire(&self, permits: usize) -> Acquire {
        assert!(
            permits <= self.inner.capacity,
            "requested {permits} permits from a semaphore of {}",
            self.inner.capacity
        );
        Acquire {
            semaphore: self.clone(),
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
        if self.inner.waiters.load(SeqCst) == 0 && self.inner.take(permits) {
            Some(self.permit(permits))
        } else {
            None
        }
    }

    /// Permits free right now.
    pub fn available(&self) -> usize {
        self.inner.permits.load(SeqCst)
    }

    fn permit(&self, permits: usize) -> Permit {
        Permit {
            semaphore: self.clone(),
            permits,
        }
    }
}

impl Inner {
    /// Takes `n` permits if that many are free.
    fn take(&self, n: usize) -> bool {
        self.permits
            .fetch_update(SeqCst, SeqCst, |free| free.checked_sub(n))
            .is_ok()
    }

    /// Returns `n` permits and serves the queue.
    fn give(&self, n: usize) {
        self.permits.fetch_add(n, SeqCst);
        if self.waiters.load(SeqCst) > 0 {
            self.serve();
        }
    }

    /// Grants waiters from the head of the queue while the head fits.
    fn serve(&self) {
        let mut woken: Vec<Arc<Waiter>> = Vec::new();
        {
            let mut queue = lock(&self.queue);
            while let Some(head) = queue.front() {
                if !self.take(head.permits) {
                    break;
                }
                let head = queue.pop_front().expect("front exists");
                self.waiters.fetch_sub(1, SeqCst);
                head.granted.store(true, SeqCst);
                woken.push(head);
            }
        }
        for waiter in woken {
            waiter.waker.wake();
        }
    }
}

/// The future of [`Semaphore::acquire`].
#[must_use = "futures do nothing unless awaited"]
pub struct Acquire {
    semaphore: Semaphore,
    permits: usize,
    waiter: Option<Arc<Waiter>>,
}

impl Future for Acquire {
    type Output = Permit;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Permit> {
        let this = &mut *self;
        let inner = &this.semaphore.inner;
        match &this.waiter {
            None => {
                if inner.waiters.load(SeqCst) == 0 && inner.take(this.permits) {
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
                    inner.waiters.fetch_add(1, SeqCst);
                    queue.push_back(waiter.clone());
                }
                // Permits may have been returned before `waiters` was raised (invariant 3).
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

impl Drop for Acquire {
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
                inner.waiters.fetch_sub(1, SeqCst);
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

impl fmt::Debug for Acquire {
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
            .field("waiters", &self.inner.waiters.load(SeqCst))
            .finish()
    }
}
