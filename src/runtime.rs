//! The runtime seam: what the core needs from whatever runs it, asked in one place.
//!
//! Work that was given no clock, spawner or randomness takes the *entered* runtime's, if this
//! thread has one, and the process's defaults otherwise (the system clock, the default spawner,
//! a per-thread generator). And the core tells the entered runtime what it did ([`Observed`]):
//! scopes opened and closed, finalizers added, started and ended, fibers forked and exited,
//! interruptions requested and delivered, tasks spawned and by what, what a lock guard's release
//! was told. The simulation kit enters one (`testkit::Sim`); nothing else does, and the code
//! that runs here is the code that ships.
//!
//! Invariants:
//!
//! 1. One thread-local stack of entered runtimes, innermost last. [`enter`] pushes one and its
//!    guard removes that one again, whichever order guards are dropped in.
//! 2. While no runtime is entered on any thread, every question and every observation here costs
//!    one relaxed load (of `ENTERED`) and touches no thread-local: the process's defaults
//!    answer, and nothing is built to be told. A stale count (a runtime entered on another
//!    thread) only sends this thread to its own, empty, stack.
//! 3. Ids come from the entered runtime, counted by it; 0 means "not observed", and nothing is
//!    told about a thing whose id is 0 (so a scope opened outside a runtime is never reported
//!    closed inside one).
//! 4. The thread-local is never borrowed while a runtime is called: a runtime may spawn, and
//!    spawning asks here again.

use std::cell::RefCell;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::clock::{Clock, SystemClock};
use crate::exit::{AbortReason, ExitStatus};
use crate::spawn::{process_spawner, Spawner};

/// What runs the core, as the core sees it: where work given none of its own gets a clock, a
/// spawner and randomness, and who is told what the core did. Each answer may be `None`: the
/// process's default then answers.
pub(crate) trait Runtime: Send + Sync {
    /// The clock of work given none.
    fn clock(&self) -> Option<Arc<dyn Clock>>;
    /// The spawner of work given none and inheriting none.
    fn spawner(&self) -> Option<Arc<dyn Spawner>>;
    /// A uniform draw in `[0, 1)` (the jitter of schedules).
    fn draw(&self) -> Option<f64>;
    /// A new id for something the core will tell of (0: it is not observed).
    fn next_id(&self) -> u64;
    /// Told what the core did, as it happens.
    fn observe(&self, event: Observed);
}

/// What the core tells the entered runtime.
#[derive(Clone, Debug)]
pub(crate) enum Observed {
    /// A scope was opened, nested in `parent` (if that one was observed).
    ScopeOpened { scope: u64, parent: Option<u64> },
    /// A finalizer was added to a scope.
    FinalizerAdded { scope: u64, finalizer: u64 },
    /// A finalizer began to run, told `status`.
    FinalizerStarted { finalizer: u64, status: ExitStatus },
    /// A finalizer ended (ran to its end, panicked, or was dropped).
    FinalizerEnded { finalizer: u64 },
    /// A scope's close finished: its last finalizer has ended.
    ScopeClosed { scope: u64 },
    /// A fiber was forked, into a scope or (`None`) as a daemon.
    FiberForked { fiber: u64, scope: Option<u64> },
    /// A fiber's work ended (with a value, interrupted, or panicked).
    FiberExited { fiber: u64 },
    /// An abort controller was aborted (its first abort).
    InterruptRequested { reason: AbortReason },
    /// A `Scoped` saw its signal aborted and began to unwind: in `scope`, or before its body
    /// ever ran (`None`).
    InterruptDelivered {
        scope: Option<u64>,
        reason: AbortReason,
    },
    /// A task is being handed to a spawner; it is this (`"fiber"`, `"handed-off close"`, ...).
    Spawning { what: &'static str },
    /// The hand-over told of by the last `Spawning` is over.
    Spawned,
    /// What the caller of a lock guard's `release` was told: whether the lease held, and
    /// whether the guard's own reckoning of it had run out by then.
    Released {
        owner: String,
        ticket: u64,
        held: bool,
        ran_out: bool,
    },
    /// Work bound to the lease of `owner`'s request `ticket` (`LockManager::with_lock`, `lead`,
    /// `every`) began.
    WorkBegan { owner: String, ticket: u64 },
    /// That work has ended, its scope closed (its clean-up finished); its lock is released next.
    WorkEnded { owner: String, ticket: u64 },
}

/// How many runtimes are entered, on all threads (invariant 2).
static ENTERED: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's entered runtimes, innermost last, each with the number its guard removes.
    static STACK: RefCell<Vec<(u64, Arc<dyn Runtime>)>> = const { RefCell::new(Vec::new()) };
}

/// Makes `runtime` this thread's entered runtime until the guard is dropped.
pub(crate) fn enter(runtime: Arc<dyn Runtime>) -> Entered {
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    let number = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
    STACK.with(|stack| stack.borrow_mut().push((number, runtime)));
    ENTERED.fetch_add(1, Ordering::Relaxed);
    Entered { number }
}

/// An entered runtime; dropping it leaves it (on the thread that entered it).
pub(crate) struct Entered {
    number: u64,
}

impl Drop for Entered {
    fn drop(&mut self) {
        // `try_with`: a guard dropped while its thread's locals are being torn down.
        let left = STACK.try_with(|stack| {
            let mut stack = stack.borrow_mut();
            let at = stack
                .iter()
                .position(|(number, _)| *number == self.number)?;
            Some(stack.remove(at))
        });
        if let Ok(Some(runtime)) = left {
            ENTERED.fetch_sub(1, Ordering::Relaxed);
            // Dropped outside the borrow (invariant 4).
            drop(runtime);
        }
    }
}

impl fmt::Debug for Entered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entered")
            .field("number", &self.number)
            .finish()
    }
}

/// The runtime entered on this thread, if any (invariant 2: one relaxed load when none is, on
/// any thread).
#[inline]
fn entered() -> Option<Arc<dyn Runtime>> {
    if ENTERED.load(Ordering::Relaxed) == 0 {
        return None;
    }
    STACK
        .try_with(|stack| stack.borrow().last().map(|(_, runtime)| runtime.clone()))
        .ok()
        .flatten()
}

/// The clock of work that was given none and inherits none: the entered runtime's, if it has
/// one, else the system's.
pub(crate) fn clock() -> Arc<dyn Clock> {
    entered()
        .and_then(|runtime| runtime.clock())
        .unwrap_or_else(|| Arc::new(SystemClock))
}

/// The spawner of work that was given none and inherits none: the entered runtime's, if it has
/// one, else the process's (`spawn::process_spawner`).
pub(crate) fn default_spawner() -> Arc<dyn Spawner> {
    entered()
        .and_then(|runtime| runtime.spawner())
        .unwrap_or_else(process_spawner)
}

/// Spawns `future` on `spawner`, telling the entered runtime what it is (`"fiber"`,
/// `"handed-off close"`, ...) while it is handed over, so that a simulation names a task it
/// reports as leaked.
pub(crate) fn spawn_as(spawner: &dyn Spawner, what: &'static str, future: BoxFuture<'static, ()>) {
    observe(|| Observed::Spawning { what });
    spawner.spawn(future);
    observe(|| Observed::Spawned);
}

/// A uniform draw in `[0, 1)` from the entered runtime, if it gives them.
pub(crate) fn draw() -> Option<f64> {
    entered()?.draw()
}

/// A new id from the entered runtime: 0 when none is entered (invariant 3).
#[inline]
pub(crate) fn next_id() -> u64 {
    entered().map_or(0, |runtime| runtime.next_id())
}

/// Whether a runtime is entered on this thread (to keep what an observation will need, only
/// when one will be made).
pub(crate) fn observing() -> bool {
    entered().is_some()
}

/// Tells the entered runtime, if any, what `event` builds; without one, builds nothing.
#[inline]
pub(crate) fn observe(event: impl FnOnce() -> Observed) {
    if let Some(runtime) = entered() {
        runtime.observe(event());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recording {
        seen: Mutex<Vec<String>>,
    }

    impl Runtime for Recording {
        fn clock(&self) -> Option<Arc<dyn Clock>> {
            None
        }
        fn spawner(&self) -> Option<Arc<dyn Spawner>> {
            None
        }
        fn draw(&self) -> Option<f64> {
            Some(0.25)
        }
        fn next_id(&self) -> u64 {
            7
        }
        fn observe(&self, event: Observed) {
            self.seen.lock().unwrap().push(format!("{event:?}"));
        }
    }

    #[test]
    fn only_the_innermost_entered_runtime_answers_and_leaving_in_any_order_restores_the_rest() {
        assert_eq!(next_id(), 0);
        assert_eq!(draw(), None);
        let outer = Arc::new(Recording::default());
        let inner = Arc::new(Recording::default());
        let outer_guard = enter(outer.clone());
        let inner_guard = enter(inner.clone());
        observe(|| Observed::ScopeClosed { scope: 1 });
        assert_eq!(inner.seen.lock().unwrap().len(), 1);
        assert!(outer.seen.lock().unwrap().is_empty());
        drop(outer_guard);
        observe(|| Observed::ScopeClosed { scope: 2 });
        assert_eq!(inner.seen.lock().unwrap().len(), 2);
        assert_eq!(draw(), Some(0.25));
        drop(inner_guard);
        let mut built = false;
        observe(|| {
            built = true;
            Observed::ScopeClosed { scope: 3 }
        });
        assert!(!built, "nothing is built when nothing is entered");
        assert_eq!(next_id(), 0);
    }

    #[test]
    fn a_runtime_entered_on_another_thread_is_not_this_threads() {
        let runtime = Arc::new(Recording::default());
        let guard = enter(runtime.clone());
        std::thread::spawn(|| {
            assert_eq!(next_id(), 0);
            observe(|| Observed::ScopeClosed { scope: 1 });
        })
        .join()
        .unwrap();
        assert!(runtime.seen.lock().unwrap().is_empty());
        assert_eq!(next_id(), 7);
        drop(guard);
    }
}
