//! A fair (strictly FIFO) counting semaphore.
//!
//! Invariants:
//!
//! 1. `state` holds the free permits in its low 62 bits, whether the queue is non-empty in its
//!    top bit (`QUEUED`) and whether every [`Semaphore`] handle is gone in the next (`ORPHANED`).
//!    `QUEUED` changes only under the queue lock, and equals "the queue is non-empty" whenever the
//!    lock is free. Waiters in `queue` are served strictly in order: a request at the head that
//!    does not fit blocks everything behind it.
//! 2. The fast path takes permits with one compare-and-swap, and only while the queue flag is
//!    clear, so it never overtakes a queued request (except in the instant a waiter is enqueuing,
//!    a race the waiter could equally have lost).
//! 3. A waiter raises the queue flag and serves the queue under the queue lock. A return adds its
//!    permits with a compare-and-swap that fails if the flag went up meanwhile; seeing the flag,
//!    it adds them under the lock instead and serves the queue. All of this is one atomic word, so
//!    its modification order alone decides who sees whom, and no permit is stranded while someone
//!    waits.
//!
//! Memory. A [`Permit`] must be `'static` (a [`Scope`](crate::Scope) adopts it), but an `Arc`
//! clone and drop per permit would double the atomic operations of an acquire-release cycle
//! (two read-modify-writes: take, give). So the outstanding permits themselves keep `Inner`
//! alive, counted by the free count that a cycle updates anyway:
//!
//! 4. `Inner` is freed once no handle is left (`ORPHANED`) and every permit is back (free ==
//!    capacity). Only two changes can complete that: the last handle raising `ORPHANED`, and a
//!    return adding the last outstanding permits. Both are read-modify-writes of `state`, so
//!    exactly one of them sees the condition complete, and that one frees. Nothing undoes it:
//!    taking permits needs a handle, or a queued waiter whose `Acquire` borrows a handle. (Only
//!    a waiter whose `Acquire` was leaked with `mem::forget` can still be granted; its permits
//!    never come back, so the condition cannot complete a second time.)
//! 5. A return touches `Inner` only while its permits are out, with one exception. Seeing the
//!    queue flag, it takes the queue lock first (its permits, still out, keep `Inner` alive until
//!    then), then adds them, serves the queue and unlocks. Between its add and its unlock the
//!    condition can complete elsewhere: the waiter it just granted may resolve at once on another
//!    thread, and its task drop that permit on the fast path (the flag went down with the empty
//!    queue) and then the last handle. So the freer takes the queue lock once before freeing: a
//!    slow-path return still holding it has finished with `Inner` when it unlocks, and one that
//!    does not hold it yet still has permits out. (`Acquire`'s poll and drop serve the queue too,
//!    but they borrow a handle, so nothing is freed under them.)
//! 6. The free happens-after every other use of `Inner`. Returns and the last handle's drop are
//!    `Release` (`Arc` orders a handle's uses before the last drop) and the freer issues an
//!    `Acquire` fence; every write to `state` is a read-modify-write, so each earlier `Release`
//!    heads a release sequence that the freer reads from. The queue lock orders the rest (5).
//!
//! A leaked (`mem::forget`) `Permit` or queued `Acquire` may leak `Inner`; nothing frees it early.
//!
//! Lock order: only the queue lock exists; it is never held while waking a task.

// The memory protocol above needs raw pointers; every unsafe operation says why it is sound.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll};

use futures::future::BoxFuture;

use crate::scope::Release;
// loom's under `--cfg leasehold_loom`, for the model tests.
use crate::sync::{fence, lock, Arc, AtomicBool, AtomicUsize, AtomicWaker, Mutex, Ordering};

/// The top bit of `state`: the queue is not empty.
const QUEUED: usize = 1 << (usize::BITS - 1);
/// The next bit of `state`: every handle is gone; `Inner` is freed when the permits are back.
const ORPHANED: usize = 1 << (usize::BITS - 2);
/// The low bits of `state`: free permits.
const FREE: usize = ORPHANED - 1;

struct Inner {
    capacity: usize,
    state: AtomicUsize,
    queue: Mutex<VecDeque<Arc<Waiter>>>,
    /// Under loom, a value it watches for leaks: a model run in which `Inner` is never freed
    /// fails (invariant 4).
    #[cfg(leasehold_loom)]
    _leak_check: loom::alloc::Track<()>,
}

struct Waiter {
    permits: usize,
    granted: AtomicBool,
    waker: AtomicWaker,
}

// `Handle` and `Permit` share `Inner` between threads through raw pointers; that is sound only
// because `Inner` itself is `Send + Sync`. Checked here, so a change to `Inner` cannot break it
// silently.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Inner>()
};

/// The handles' share of `Inner`: counted by the `Arc` around it, it raises `ORPHANED` when the
/// last handle goes (invariant 4).
struct Handle {
    inner: NonNull<Inner>,
}

// SAFETY: a handle only reads `Inner` through shared references, and `Inner` is `Send + Sync`.
unsafe impl Send for Handle {}
// SAFETY: as for `Send`.
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: `Inner` is alive while a handle is (invariant 4); this is the last one, and the
        // reference is not used after the read-modify-write that may let a return free it.
        let inner = unsafe { self.inner.as_ref() };
        let capacity = inner.capacity;
        // Release: every use of `Inner` through a handle (ordered before this drop by `Arc`)
        // happens-before the free, whoever does it (invariant 6).
        let before = inner.state.fetch_or(ORPHANED, Ordering::Release);
        if before & FREE == capacity {
            // SAFETY: no handle is left and every permit was back: this drop completed the
            // condition of invariant 4, so it is the one that frees.
            unsafe { free(self.inner) }
        }
    }
}

/// Frees `Inner`.
///
/// # Safety
///
/// The caller's read-modify-write of `state` completed invariant 4's condition (no handle left,
/// every permit back), and the caller no longer uses `inner`.
#[cold]
#[inline(never)]
unsafe fn free(inner: NonNull<Inner>) {
    // Acquire: pairs with the `Release` of every earlier change to `state` (invariant 6).
    fence(Ordering::Acquire);
    // A slow-path return may still be serving the queue (invariant 5): wait until it unlocks.
    // Once we hold the lock it has, and no one else will take it, so it may be freed.
    // SAFETY: only this call frees `Inner` (invariant 4), so it is alive here.
    drop(lock(unsafe { &inner.as_ref().queue }));
    // SAFETY: leaked from a `Box` in `Semaphore::new`; freed only here, and only once.
    drop(unsafe { Box::from_raw(inner.as_ptr()) });
}

/// Returns `n` permits to `inner`: serves its queue if a waiter is queued, and frees it if these
/// were the last permits out after the last handle went.
///
/// # Safety
///
/// The caller holds `n` permits of `inner` (which keep it alive, invariant 4), and this call
/// consumes them: the caller must not use `inner` afterwards.
#[inline]
unsafe fn give(inner: NonNull<Inner>, n: usize) {
    // SAFETY: our permits are out, so `Inner` is alive; neither the reference nor the field is
    // used after the compare-and-swap that returns them.
    let (state, capacity) = unsafe { (&inner.as_ref().state, inner.as_ref().capacity) };
    let mut now = state.load(Ordering::Relaxed);
    while now & QUEUED == 0 {
        // Release: the holder's writes happen-before the next taker's `Acquire` and the free.
        match state.compare_exchange_weak(now, now + n, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => {
                // `ORPHANED` set and every permit back (the flag bit is above any free count).
                if now + n == ORPHANED | capacity {
                    // SAFETY: this return completed the condition of invariant 4.
                    unsafe { free(inner) }
                }
                return;
            }
            Err(actual) => now = actual,
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { give_queued(inner, n) }
}

/// [`give`] when a waiter is (or was just) queued: adds the permits and serves the queue under
/// the queue lock.
///
/// # Safety
///
/// As for [`give`].
#[cold]
#[inline(never)]
unsafe fn give_queued(ptr: NonNull<Inner>, n: usize) {
    // SAFETY: our permits keep `Inner` alive until the add below; after it, whoever frees waits
    // for the queue lock we hold (invariant 5). Not used after the unlock.
    let inner = unsafe { ptr.as_ref() };
    let (woken, last) = {
        // Lock first, add second: adding first could let the permits complete invariant 4's
        // condition elsewhere before this thread reached the lock, and the lock would be freed.
        let mut queue = lock(&inner.queue);
        // Release: as in `give`. The flag may have been lowered since we saw it (the queue
        // emptied): then serving finds nobody, which costs nothing.
        let before = inner.state.fetch_add(n, Ordering::Release);
        (
            inner.grant(&mut queue),
            (before & !QUEUED) + n == ORPHANED | inner.capacity,
        )
    };
    wake(woken);
    if last {
        // SAFETY: this return completed the condition of invariant 4 (with `ORPHANED` set, no
        // live `Acquire` exists, so the grant above could only have served leaked ones).
        unsafe { free(ptr) }
    }
}

/// Wakes the waiters that [`Inner::grant`] granted, once the queue lock is released.
fn wake(woken: Vec<Arc<Waiter>>) {
    for waiter in woken {
        waiter.waker.wake();
    }
}

impl Inner {
    /// Takes `n` permits if that many are free and nobody is queued (the fast path). The caller
    /// holds a handle.
    #[inline]
    fn take_unqueued(&self, n: usize) -> bool {
        self.take(n, QUEUED)
    }

    /// Takes `n` permits for the head of the queue if that many are free.
    fn take_queued(&self, n: usize) -> bool {
        self.take(n, 0)
    }

    /// Takes `n` permits if that many are free and none of the `unless` flags is set.
    #[inline]
    fn take(&self, n: usize, unless: usize) -> bool {
        let mut now = self.state.load(Ordering::Relaxed);
        loop {
            if now & unless != 0 || now & FREE < n {
                return false;
            }
            // Acquire: the previous holders' writes happen-before ours (a queued grantee sees
            // them through `granted`).
            match self.state.compare_exchange_weak(
                now,
                now - n,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => now = actual,
            }
        }
    }

    /// Grants waiters from the head of `queue` (locked) while the head fits, and lowers the queue
    /// flag if the queue is left empty. Returns the waiters to [`wake`] after unlocking.
    fn grant(&self, queue: &mut VecDeque<Arc<Waiter>>) -> Vec<Arc<Waiter>> {
        let mut woken = Vec::new();
        while let Some(head) = queue.front() {
            if !self.take_queued(head.permits) {
                break;
            }
            let head = queue.pop_front().expect("front exists");
            // Release: pairs with the `Acquire` load in `poll`, which hands the permits over.
            head.granted.store(true, Ordering::Release);
            woken.push(head);
        }
        if queue.is_empty() {
            // Relaxed, as for every change to the flag: the lock orders the queue, and the flag's
            // meaning to returns is decided by the modification order of `state` (invariant 3).
            self.state.fetch_and(!QUEUED, Ordering::Relaxed);
        }
        woken
    }
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
    handle: Arc<Handle>,
}

impl Semaphore {
    /// A semaphore with `permits` permits.
    ///
    /// # Panics
    ///
    /// If `permits` does not fit in 62 bits.
    pub fn new(permits: usize) -> Self {
        assert!(permits <= FREE, "a semaphore holds at most {FREE} permits");
        let inner = Box::new(Inner {
            capacity: permits,
            state: AtomicUsize::new(permits),
            queue: Mutex::new(VecDeque::new()),
            #[cfg(leasehold_loom)]
            _leak_check: loom::alloc::Track::new(()),
        });
        Semaphore {
            handle: Arc::new(Handle {
                inner: NonNull::from(Box::leak(inner)),
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
    #[inline]
    pub fn acquire(&self, permits: usize) -> Acquire<'_> {
        let capacity = self.inner().capacity;
        assert!(
            permits <= capacity,
            "requested {permits} permits from a semaphore of {capacity}"
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
    #[inline]
    pub fn try_acquire(&self, permits: usize) -> Option<Permit> {
        self.inner()
            .take_unqueued(permits)
            .then(|| self.permit(permits))
    }

    /// Permits free right now.
    pub fn available(&self) -> usize {
        // Relaxed: a snapshot, which orders nothing.
        self.inner().state.load(Ordering::Relaxed) & FREE
    }

    #[inline]
    fn inner(&self) -> &Inner {
        // SAFETY: `Inner` outlives every handle (invariant 4).
        unsafe { self.handle.inner.as_ref() }
    }

    /// Wraps `permits` this handle's caller has just taken.
    #[inline]
    fn permit(&self, permits: usize) -> Permit {
        Permit {
            inner: self.handle.inner,
            permits,
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

impl Acquire<'_> {
    /// The first poll, when the fast path failed: joins the queue, serves it, and returns the
    /// new waiter.
    #[cold]
    #[inline(never)]
    fn enqueue(&mut self, cx: &mut Context<'_>) -> &Waiter {
        let waiter = Arc::new(Waiter {
            permits: self.permits,
            granted: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        waiter.waker.register(cx.waker());
        let inner = self.semaphore.inner();
        let woken = {
            let mut queue = lock(&inner.queue);
            queue.push_back(waiter.clone());
            // Relaxed: see `grant`.
            inner.state.fetch_or(QUEUED, Ordering::Relaxed);
            // Permits returned before the flag went up are for the queue to take (invariant 3).
            inner.grant(&mut queue)
        };
        wake(woken);
        self.waiter.insert(waiter)
    }

    /// [`Drop`] for a request that joined the queue.
    #[cold]
    #[inline(never)]
    fn leave(&mut self, waiter: Arc<Waiter>) {
        let inner = self.semaphore.inner();
        let woken = {
            let mut queue = lock(&inner.queue);
            let position = queue.iter().position(|w| Arc::ptr_eq(w, &waiter));
            position.map(|at| {
                queue.remove(at);
                // Still queued: the requests behind it may fit now.
                inner.grant(&mut queue)
            })
        };
        match woken {
            Some(woken) => wake(woken),
            // Granted but never handed over: give the permits back, as a permit would.
            // SAFETY: the grant took these permits for this waiter and nothing else returns
            // them; our handle keeps `Inner` alive anyway.
            None => unsafe { give(self.semaphore.handle.inner, waiter.permits) },
        }
    }
}

impl Future for Acquire<'_> {
    type Output = Permit;

    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Permit> {
        let this = &mut *self;
        let waiter = match &this.waiter {
            None => {
                if this.semaphore.inner().take_unqueued(this.permits) {
                    return Poll::Ready(this.semaphore.permit(this.permits));
                }
                this.enqueue(cx)
            }
            Some(waiter) => {
                waiter.waker.register(cx.waker());
                waiter
            }
        };
        // Acquire: pairs with the `Release` store in `grant`, after the permits were taken.
        if waiter.granted.load(Ordering::Acquire) {
            // The permit now owns the permits; with no waiter left, Drop has nothing to undo.
            this.waiter = None;
            Poll::Ready(this.semaphore.permit(this.permits))
        } else {
            Poll::Pending
        }
    }
}

impl Drop for Acquire<'_> {
    #[inline]
    fn drop(&mut self) {
        if let Some(waiter) = self.waiter.take() {
            self.leave(waiter);
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
///
/// A permit may outlive every handle to its semaphore: the semaphore's state is freed when the
/// last handle and the last permit are gone, whichever goes last.
#[must_use = "dropping a Permit returns its permits at once"]
pub struct Permit {
    /// Kept alive by this permit's permits while there are any (module invariant 4); never
    /// dereferenced by a permit of zero permits.
    inner: NonNull<Inner>,
    permits: usize,
}

// SAFETY: a permit only reads `Inner` through shared references (when it is dropped), and `Inner`
// is `Send + Sync`; the permits it holds keep `Inner` alive wherever it is dropped.
unsafe impl Send for Permit {}
// SAFETY: `&Permit` gives access to the permit count only.
unsafe impl Sync for Permit {}

impl Permit {
    /// How many permits this holds.
    pub fn permits(&self) -> usize {
        self.permits
    }
}

impl Drop for Permit {
    #[inline]
    fn drop(&mut self) {
        if self.permits > 0 {
            // SAFETY: this permit holds `self.permits` permits of `inner`, returned only here.
            unsafe { give(self.inner, self.permits) }
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
        let inner = self.inner();
        f.debug_struct("Semaphore")
            .field("capacity", &inner.capacity)
            .field("available", &self.available())
            .field("waiters", &lock(&inner.queue).len())
            .finish()
    }
}
