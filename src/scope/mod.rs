//! Scopes with async finalizers, and `Scoped` futures that close their scope before resolving.
//!
//! Invariants:
//!
//! 1. A scope is closed once: the first status wins. Closing first finishes the closes of nested
//!    `Scoped` futures that its owner dropped as it unwound (invariant 4), then interrupts and
//!    awaits its children (forked fibers and background clean-ups), then runs its finalizers
//!    last-in-first-out, each to completion; anything of these added while it closes is taken by
//!    the same loop.
//! 2. The close work belongs to whoever started it. If that caller is dropped half-way, the rest
//!    goes to the spawner: a close is never abandoned.
//! 3. A `Scoped` checks its signals before every poll of its body. Once it sees one aborted it
//!    never polls the body again: it marks its scope as unwinding and *takes over* the nested
//!    `Scoped` futures running in its body, newest first, each the same way (what runs nested in
//!    it, then its body dropped, then its scope closed with `Interrupted(reason)`); only then does
//!    it drop its own body, close its scope, and resolve. So a nested clean-up finishes while the
//!    body that awaits it, and that body's locals (a lock guard, say), still live. A `Scoped`
//!    taken over never resolves (it *parks*): its parent's body is never polled again.
//! 4. Nesting: while a `Scoped` polls its body, its scope is the thread's *ambient parent*. A
//!    `Scoped` first polled there remembers it, and while its body runs, the parent's scope holds
//!    that body (`Running`) for taking it over. When such a child is dropped unfinished (it lost
//!    a `select!`, or its parent was dropped), its remaining close goes to the parent: if the
//!    parent is unwinding, to be finished first thing in the parent's close, while the parent's
//!    fibers still run (inner before outer); if not, as a tracked background child (so it runs
//!    now, and the parent's close still waits for it). Without a parent it goes to the spawner.
//! 5. A scope's spawner is fixed when the scope is made. A `Scoped` chooses it on its first poll:
//!    the one given with `with_spawner`, else its parent's, else the default (with the `tokio`
//!    feature, the runtime it is polled on; otherwise smol's). Fibers run on their scope's
//!    spawner, and so does every clean-up a scope hands off.
//! 6. A finalizer that panics does not stop the others. The first finalizer panic is kept and
//!    given back to whoever awaits the close it started ([`Scope::close`], or the `Scoped` that
//!    owns the scope), once every other finalizer has run: a `Scoped` whose body ended with a
//!    value, an error or an interruption resumes that panic instead (a body's own panic comes
//!    first), so a fiber ends `Exit::Panicked`. Panics that nobody can be given (later ones, or
//!    those of a close that was handed to the spawner) are logged with `tracing` at error.
//! 7. As in Effect's `forkIn`, a close started from inside one of the scope's own fibers neither
//!    interrupts nor awaits that fiber (it would otherwise wait for itself, or cut off the fiber
//!    that asked for the close): the fiber goes on once the close has finished, and keeps its
//!    value. The scope's other fibers are interrupted and awaited as usual.
//!
//! Lock order: a scope's `state` lock is never held across an await or a call into user code. A
//! running body's lock is held while the body is polled; a parent takes it only from its own
//! poll, which is never inside its child's (a child polled on another thread makes the parent
//! wait at most for that one poll).

mod scoped;

pub use self::scoped::{scoped, Scoped};

use std::any::Any;
use std::cell::RefCell;
use std::error::Error;
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::{BoxFuture, FusedFuture};
use futures::FutureExt;

use crate::abort::{AbortController, AbortSignal, Dropped, Interrupted};
use crate::clock::Clock;
use crate::exit::{AbortReason, ExitStatus};
use crate::runtime::{self, default_spawner, spawn_as, Observed};
use crate::spawn::Spawner;
// loom's (and the model's stand-in event) under `--cfg leasehold_loom`, for the model tests.
use crate::sync::{lock, wait_for, CompleteOnDrop, Completion, Event, EventListener, Mutex};

/// The reason given to a scope's fibers when it closes without being interrupted.
///
/// # Examples
///
/// ```
/// use leasehold::ScopeClosed;
///
/// assert_eq!(ScopeClosed.to_string(), "scope closed");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScopeClosed;

impl fmt::Display for ScopeClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("scope closed")
    }
}

impl Error for ScopeClosed {}

/// Something with an async release that a scope can own.
///
/// A release cannot fail as the scope sees it: it resolves to `()`, as a finalizer does, and
/// neither [`Scope::close`] nor a [`Scoped`] has an error to give on (a `Scoped` resolves with
/// its body's result). A resource whose release can fail deals with its failure itself, and
/// says where it goes: a [`Guard`](crate::Guard)'s release error is logged with `tracing` at
/// warn (see [`Scope::adopt`]); a [`Permit`](crate::Permit)'s release cannot fail. A panic in
/// `release` is a finalizer's panic: the others still run, and the close resumes it.
///
/// # Examples
///
/// ```
/// use futures::future::BoxFuture;
/// use leasehold::{ExitStatus, Release, Scope};
///
/// struct Connection;
/// impl Release for Connection {
///     fn release(self) -> BoxFuture<'static, ()> {
///         Box::pin(async { /* say goodbye to the server */ })
///     }
/// }
///
/// # futures::executor::block_on(async {
/// let scope = Scope::new();
/// scope.adopt(Connection);
/// scope.close(ExitStatus::Success).await; // released here
/// # });
/// ```
pub trait Release: Send + 'static {
    /// Releases the resource.
    fn release(self) -> BoxFuture<'static, ()>;
}

type Finalizer = Box<dyn FnOnce(ExitStatus) -> BoxFuture<'static, ()> + Send>;

/// A panic's payload, as caught and resumed.
pub(crate) type Panic = Box<dyn Any + Send>;

/// A child that a closing scope interrupts (when it can be) and awaits.
struct Child {
    interrupt: Option<AbortController>,
    done: Arc<Completion>,
}

impl Child {
    /// Which child this is: for a fiber, the same number as [`crate::fiber::current`] gives
    /// inside it.
    fn id(&self) -> usize {
        Arc::as_ptr(&self.done) as usize
    }
}

struct ScopeState {
    /// Set when the close starts.
    status: Option<ExitStatus>,
    /// Set when the close has finished: nothing is left to run.
    done: bool,
    /// Set when the owning unit was interrupted or dropped and is dropping its body.
    unwinding: Option<AbortReason>,
    finalizers: Vec<Finalizer>,
    children: Vec<Child>,
    /// The closes of nested `Scoped` futures dropped while this scope's owner unwound: they run
    /// first, while this scope's fibers still live (invariant 1, "inner before outer").
    nested: Vec<BoxFuture<'static, Option<Panic>>>,
    /// Nested `Scoped` futures running in the owner's body: an owner that unwinds takes them
    /// over, in reverse order of their start, before it drops its body (invariant 3).
    running_nested: Vec<Arc<dyn Nested>>,
    /// Panics of finalizers of nested `Scoped` futures taken over here: this scope's close gives
    /// them on (invariant 6).
    handed_panics: Vec<Panic>,
}

struct ScopeInner {
    state: Mutex<ScopeState>,
    closed: Event,
    spawner: Arc<dyn Spawner>,
    /// The clock its work uses when given none (`Scoped::with_clock`, inherited).
    clock: Option<Arc<dyn Clock>>,
    /// Its id as the entered runtime was told of it (0: not observed).
    id: u64,
}

/// A region that owns finalizers and fibers; closing it interrupts and awaits the fibers, then
/// runs the finalizers last-in-first-out, each to completion. (Before the fibers, it finishes the
/// clean-up of any nested [`Scoped`] that was dropped as the scope's owner unwound.)
///
/// Clones share the scope. A scope whose last handle is dropped before it was closed is closed
/// in the background with an [`Interrupted`](ExitStatus::Interrupted) status ([`Dropped`]).
///
/// # Examples
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use leasehold::{ExitStatus, Scope};
///
/// # futures::executor::block_on(async {
/// let log = Arc::new(Mutex::new(Vec::new()));
/// let scope = Scope::new();
/// for name in ["database", "cache"] {
///     let log = log.clone();
///     scope.add_finalizer(move |_| async move { log.lock().unwrap().push(name) });
/// }
/// scope.close(ExitStatus::Success).await;
/// assert_eq!(*log.lock().unwrap(), ["cache", "database"]);
/// # });
/// ```
#[derive(Clone)]
pub struct Scope {
    inner: Arc<ScopeInner>,
}

impl Scope {
    /// An open scope whose background work runs on the default spawner: inside a `Scoped`'s
    /// body, that body's spawner; elsewhere, with the `tokio` feature, the tokio runtime this is
    /// called on, if any; otherwise smol's global executor.
    pub fn new() -> Self {
        Scope::with_spawner(current_spawner())
    }

    /// An open scope whose background work (fibers, handed-off clean-ups) runs on `spawner`.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use leasehold::{Scope, SmolSpawner};
    ///
    /// let scope = Scope::with_spawner(Arc::new(SmolSpawner));
    /// assert!(!scope.is_closed());
    /// ```
    pub fn with_spawner(spawner: Arc<dyn Spawner>) -> Self {
        Scope::open(spawner, None, None)
    }

    /// A new scope nested in `parent` (as the entered runtime is told), whose work uses
    /// `clock` when given none.
    pub(crate) fn open(
        spawner: Arc<dyn Spawner>,
        parent: Option<&Scope>,
        clock: Option<Arc<dyn Clock>>,
    ) -> Self {
        let id = runtime::next_id();
        if id != 0 {
            let parent = parent.map(Scope::id).filter(|&parent| parent != 0);
            runtime::observe(|| Observed::ScopeOpened { scope: id, parent });
        }
        Scope {
            inner: Arc::new(ScopeInner {
                state: Mutex::new(ScopeState {
                    status: None,
                    done: false,
                    unwinding: None,
                    finalizers: Vec::new(),
                    children: Vec::new(),
                    nested: Vec::new(),
                    running_nested: Vec::new(),
                    handed_panics: Vec::new(),
                }),
                closed: Event::new(),
                spawner,
                clock,
                id,
            }),
        }
    }

    /// Runs at close, last added first, to completion; told how the scope ended.
    ///
    /// A finalizer added while the scope is closing runs in that close; one added after the
    /// close has finished runs at once, in the background, with the recorded status.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{ExitStatus, Scope};
    ///
    /// # futures::executor::block_on(async {
    /// let scope = Scope::new();
    /// scope.add_finalizer(|status| async move { println!("closing: {status:?}") });
    /// scope.close(ExitStatus::Success).await;
    /// # });
    /// ```
    pub fn add_finalizer<F, Fut>(&self, finalizer: F)
    where
        F: FnOnce(ExitStatus) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.push_finalizer(Box::new(move |status| Box::pin(finalizer(status))));
    }

    fn push_finalizer(&self, finalizer: Finalizer) {
        let finalizer = observed_finalizer(self.inner.id, finalizer);
        let mut state = lock(&self.inner.state);
        if state.done {
            let status = state.status.clone().unwrap_or(ExitStatus::Success);
            drop(state);
            let run = run_finalizer(finalizer, status).map(Result::err);
            spawn_as(
                &*self.inner.spawner,
                "finalizer added after the close",
                unattended(Box::pin(run)),
            );
        } else {
            state.finalizers.push(finalizer);
        }
    }

    /// Hands a resource to the scope: it is released at close, in LIFO order with the finalizers.
    ///
    /// # Errors
    ///
    /// None reach you: a [`Release`] resolves to `()`, and the close has no error to give (a
    /// `Scoped` resolves with its body's result, whatever its finalizers met). A
    /// [`Guard`](crate::Guard) adopted here whose release fails (its lease was lost before
    /// it, [`LockError::LeaseLost`](crate::LockError::LeaseLost); or the store failed) has its
    /// error logged with `tracing` at warn, and nothing more: without a `tracing` subscriber, it
    /// is silent. A lease lost before the release has aborted the guard's
    /// [`lost`](crate::Guard::lost) signal by the time the close is done, so work bound to that
    /// signal was told. When you need the error, do not adopt the guard: release it yourself at
    /// the end of the body (`guard.release().await?`), or run the work with
    /// [`LockManager::with_lock`](crate::LockManager::with_lock), which resolves with
    /// `LockError::LeaseLost` when its release finds the lease lost.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{ExitStatus, Scope, Semaphore};
    ///
    /// # futures::executor::block_on(async {
    /// let semaphore = Semaphore::new(1);
    /// let scope = Scope::new();
    /// scope.adopt(semaphore.acquire(1).await);
    /// assert_eq!(semaphore.available(), 0);
    /// scope.close(ExitStatus::Success).await;
    /// assert_eq!(semaphore.available(), 1);
    /// # });
    /// ```
    pub fn adopt<R: Release>(&self, resource: R) {
        self.push_finalizer(Box::new(move |_| resource.release()));
    }

    /// Effect's `forkScoped`: a fiber that the scope interrupts and awaits when it closes.
    ///
    /// Forking on a scope that has finished closing gives a fiber that is interrupted at once
    /// (its future never runs), with the reason the scope closed with.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{ExitStatus, Scope};
    ///
    /// # futures::executor::block_on(async {
    /// let scope = Scope::new();
    /// let ticker = scope.fork(std::future::pending::<()>());
    /// scope.close(ExitStatus::Success).await;
    /// assert!(ticker.is_finished());
    /// assert!(ticker.join().await.is_interrupted());
    /// # });
    /// ```
    ///
    /// A fiber with finalizers of its own: fork a [`Scoped`]. Interrupted by the close, its
    /// finalizers run (told the interruption) before the close goes on to the scope's own.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use leasehold::{ExitStatus, Interrupted, Scope, Scoped};
    ///
    /// # futures::executor::block_on(async {
    /// let log = Arc::new(Mutex::new(Vec::new()));
    /// let scope = Scope::new();
    /// let (in_fiber, (started, running)) = (log.clone(), futures::channel::oneshot::channel());
    /// scope.fork(Scoped::<(), Interrupted>::new(move |fiber_scope| async move {
    ///     fiber_scope.add_finalizer(move |status| async move {
    ///         in_fiber.lock().unwrap().push(format!("fiber: {status}"));
    ///     });
    ///     let _ = started.send(());
    ///     std::future::pending().await
    /// }));
    /// running.await.unwrap(); // (a fiber interrupted before it starts never runs its body)
    /// let in_scope = log.clone();
    /// scope.add_finalizer(move |_| async move { in_scope.lock().unwrap().push("scope".into()) });
    /// scope.close(ExitStatus::Success).await;
    /// let log = log.lock().unwrap();
    /// assert!(log[0].starts_with("fiber: interrupted"), "{log:?}");
    /// assert_eq!(log[1], "scope");
    /// # });
    /// ```
    pub fn fork<T, Fut>(&self, future: Fut) -> crate::Fiber<T>
    where
        T: Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        let (fiber, controller, done) =
            crate::fiber::prepare(future, &self.inner.spawner, self.clock(), self.inner.id);
        let mut state = lock(&self.inner.state);
        if state.done {
            let reason = status_reason(state.status.as_ref());
            drop(state);
            controller.abort(reason);
        } else {
            state.children.retain(|child| !child.done.is_done());
            state.children.push(Child {
                interrupt: Some(controller.share()),
                done,
            });
            drop(state);
        }
        fiber.start(&self.inner.spawner, "fiber")
    }

    /// Runs `work` in the background now, and makes this scope's close wait for it.
    fn track(&self, work: BoxFuture<'static, ()>) {
        let done = Arc::new(Completion::default());
        let mut state = lock(&self.inner.state);
        if !state.done {
            state.children.retain(|child| !child.done.is_done());
            state.children.push(Child {
                interrupt: None,
                done: done.clone(),
            });
        }
        drop(state);
        let guard = CompleteOnDrop(done);
        spawn_as(
            &*self.inner.spawner,
            "tracked work",
            Box::pin(async move {
                work.await;
                drop(guard);
            }),
        );
    }

    /// Closes the scope: interrupts and awaits its fibers, then runs its finalizers LIFO.
    ///
    /// Idempotent: the first status wins; later calls wait for the first close to finish. Called
    /// from inside the close itself (by one of the scope's own finalizers), it returns at once,
    /// since waiting would wait for itself. Called from inside one of the scope's own fibers, it
    /// neither interrupts nor awaits that fiber (as Effect's `forkIn`): the fiber goes on, with
    /// its value, once the rest of the close has finished.
    ///
    /// # Panics
    ///
    /// If a finalizer panicked, the call that started the close resumes the first such panic,
    /// after every other finalizer has run. Later calls, which only wait, do not.
    ///
    /// # Cancel safety
    ///
    /// Dropping this future before it completes does not abandon the close: the rest of it runs
    /// in the background on the scope's spawner (a finalizer panic is then logged).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::panic::AssertUnwindSafe;
    /// use futures::FutureExt;
    /// use leasehold::{ExitStatus, Scope};
    ///
    /// # futures::executor::block_on(async {
    /// let scope = Scope::new();
    /// scope.add_finalizer(|_| async { /* still runs */ });
    /// scope.add_finalizer(|_| async { panic!("the finalizer died") });
    /// let close = AssertUnwindSafe(scope.close(ExitStatus::Success)).catch_unwind();
    /// let panic = close.await.unwrap_err();
    /// assert_eq!(panic.downcast_ref::<&str>(), Some(&"the finalizer died"));
    /// # });
    /// ```
    pub async fn close(&self, status: ExitStatus) {
        if let Some(panic) = self.close_owned(status).await {
            resume_unwind(panic)
        }
    }

    /// [`close`](Scope::close) as a `'static` future; gives back the first finalizer panic
    /// instead of resuming it.
    pub(crate) fn close_owned(&self, status: ExitStatus) -> BoxFuture<'static, Option<Panic>> {
        let started = {
            let mut state = lock(&self.inner.state);
            if state.status.is_none() {
                state.status = Some(status.clone());
                true
            } else {
                false
            }
        };
        if started {
            // A close started by one of this scope's own fibers must not wait for that fiber.
            let closer = crate::fiber::current();
            Box::pin(Closing {
                work: Some(Box::pin(run_close(self.inner.clone(), status, closer))),
                scope: self.clone(),
                handed_off: false,
            })
        } else if self.is_closing_here() {
            // Called from inside this scope's own close (say, by one of its finalizers): waiting
            // for the close to finish would wait for itself.
            Box::pin(std::future::ready(None))
        } else {
            let inner = self.inner.clone();
            Box::pin(async move {
                wait_closed(&inner).await;
                None
            })
        }
    }

    /// Whether the scope has started closing.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{ExitStatus, Scope};
    ///
    /// # futures::executor::block_on(async {
    /// let scope = Scope::new();
    /// assert!(!scope.is_closed());
    /// scope.close(ExitStatus::Success).await;
    /// assert!(scope.is_closed());
    /// # });
    /// ```
    pub fn is_closed(&self) -> bool {
        lock(&self.inner.state).status.is_some()
    }

    fn spawner(&self) -> Arc<dyn Spawner> {
        self.inner.spawner.clone()
    }

    /// Its id as the entered runtime was told of it (0: not observed).
    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    /// The clock its work uses when given none, if it was given one.
    pub(crate) fn clock(&self) -> Option<Arc<dyn Clock>> {
        self.inner.clock.clone()
    }

    fn address(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    fn is_closing_here(&self) -> bool {
        let address = self.address();
        CLOSING.with(|closing| closing.borrow().contains(&address))
    }

    fn start_unwinding(&self, reason: &AbortReason) {
        let mut state = lock(&self.inner.state);
        if state.unwinding.is_none() {
            state.unwinding = Some(reason.clone());
        }
    }

    fn unwinding(&self) -> Option<AbortReason> {
        lock(&self.inner.state).unwinding.clone()
    }

    fn add_nested(&self, nested: Arc<dyn Nested>) {
        lock(&self.inner.state).running_nested.push(nested);
    }

    fn remove_nested(&self, nested: &Arc<dyn Nested>) {
        lock(&self.inner.state)
            .running_nested
            .retain(|other| !std::ptr::addr_eq(Arc::as_ptr(other), Arc::as_ptr(nested)));
    }

    /// Takes over every nested `Scoped` running in the owner's body, newest first: each
    /// unwinds for `reason`, its clean-up finished, while the owner's body (and its locals)
    /// still live. Gives back the first finalizer panic among them; later ones are logged.
    fn take_over_nested(&self, reason: &AbortReason) -> BoxFuture<'static, Option<Panic>> {
        let nested = std::mem::take(&mut lock(&self.inner.state).running_nested);
        let reason = reason.clone();
        Box::pin(async move {
            let mut first = None;
            for nested in nested.into_iter().rev() {
                if let Some(panic) = nested.take_over(reason.clone()).await {
                    match first {
                        None => first = Some(panic),
                        Some(_) => log_panic(&panic, "a further scope finalizer panicked"),
                    }
                }
            }
            first
        })
    }

    /// A finalizer panic of a nested `Scoped` taken over: this scope's close gives it on.
    fn hand_panic(&self, panic: Panic) {
        lock(&self.inner.state).handed_panics.push(panic);
    }

    /// Takes over the unfinished close of a child that was dropped while first polled here.
    fn adopt_close(&self, close: BoxFuture<'static, Option<Panic>>) {
        if self.unwinding().is_some() {
            // The parent is unwinding and will close right after dropping its body. Its close
            // finishes the child's first, before it interrupts its own fibers: "inner before
            // outer". A finalizer panic of the child's becomes one of the parent's, surfaced by
            // its close.
            let mut state = lock(&self.inner.state);
            if state.done {
                drop(state);
                spawn_as(&*self.inner.spawner, "handed-off close", unattended(close));
            } else {
                state.nested.push(close);
            }
        } else {
            self.track(unattended(close));
        }
    }
}

impl Default for Scope {
    fn default() -> Self {
        Scope::new()
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.inner.state);
        f.debug_struct("Scope")
            .field("status", &state.status)
            .field("done", &state.done)
            .field("finalizers", &state.finalizers.len())
            .field("children", &state.children.len())
            .finish()
    }
}

impl Drop for ScopeInner {
    fn drop(&mut self) {
        let state = match self.state.get_mut() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        if state.status.is_some()
            || (state.finalizers.is_empty() && state.children.is_empty() && state.nested.is_empty())
        {
            return;
        }
        // Nobody can close this scope any more: close what it holds in the background.
        let orphan = Scope::with_spawner(self.spawner.clone());
        {
            let mut orphan_state = lock(&orphan.inner.state);
            orphan_state.finalizers = std::mem::take(&mut state.finalizers);
            orphan_state.children = std::mem::take(&mut state.children);
            orphan_state.nested = std::mem::take(&mut state.nested);
        }
        let close = orphan.close_owned(ExitStatus::Interrupted(AbortReason::new(Dropped)));
        spawn_as(
            &*self.spawner,
            "close of a dropped scope",
            unattended(close),
        );
    }
}

fn status_reason(status: Option<&ExitStatus>) -> AbortReason {
    match status {
        Some(ExitStatus::Interrupted(reason)) => reason.clone(),
        _ => AbortReason::new(ScopeClosed),
    }
}

/// The close itself (invariants 1, 6 and 7). `closer` is the fiber that started it, if it is
/// one: as a child of this scope it is neither interrupted nor awaited.
async fn run_close(
    inner: Arc<ScopeInner>,
    status: ExitStatus,
    closer: Option<usize>,
) -> Option<Panic> {
    let reason = status_reason(Some(&status));
    let mut first_panic = None;
    loop {
        enum Next {
            Handed(Panic),
            Nested(BoxFuture<'static, Option<Panic>>),
            Children(Vec<Child>),
            Finalizer(Finalizer),
            Done,
        }
        let next = {
            let mut state = lock(&inner.state);
            if let Some(panic) = state.handed_panics.pop() {
                Next::Handed(panic)
            } else if let Some(close) = state.nested.pop() {
                Next::Nested(close)
            } else if !state.children.is_empty() {
                Next::Children(std::mem::take(&mut state.children))
            } else if let Some(finalizer) = state.finalizers.pop() {
                Next::Finalizer(finalizer)
            } else {
                state.done = true;
                Next::Done
            }
        };
        let panicked = match next {
            Next::Handed(panic) => Some(panic),
            Next::Nested(close) => close.await,
            Next::Children(mut children) => {
                children.retain(|child| Some(child.id()) != closer);
                for child in &children {
                    if let Some(controller) = &child.interrupt {
                        controller.abort(reason.clone());
                    }
                }
                for child in &children {
                    child.done.wait().await;
                }
                None
            }
            Next::Finalizer(finalizer) => run_finalizer(finalizer, status.clone()).await.err(),
            Next::Done => {
                if inner.id != 0 {
                    runtime::observe(|| Observed::ScopeClosed { scope: inner.id });
                }
                inner.closed.notify(usize::MAX);
                return first_panic;
            }
        };
        match (panicked, &first_panic) {
            (Some(panic), None) => first_panic = Some(panic),
            (Some(panic), Some(_)) => log_panic(&panic, "a further scope finalizer panicked"),
            (None, _) => {}
        }
    }
}

/// `finalizer`, telling the entered runtime of its addition, start and end (as it is, when the
/// scope is not observed).
fn observed_finalizer(scope: u64, finalizer: Finalizer) -> Finalizer {
    if scope == 0 {
        return finalizer;
    }
    let id = runtime::next_id();
    if id == 0 {
        return finalizer;
    }
    runtime::observe(|| Observed::FinalizerAdded {
        scope,
        finalizer: id,
    });
    /// Records the end when dropped: after the finalizer's future ended, panicked or was
    /// dropped.
    struct Ends(u64);
    impl Drop for Ends {
        fn drop(&mut self) {
            runtime::observe(|| Observed::FinalizerEnded { finalizer: self.0 });
        }
    }
    Box::new(move |status: ExitStatus| {
        runtime::observe(|| Observed::FinalizerStarted {
            finalizer: id,
            status: status.clone(),
        });
        let ends = Ends(id);
        let run = finalizer(status);
        Box::pin(async move {
            let _ends = ends;
            run.await;
        })
    })
}

/// Runs one finalizer to completion; a panic is caught so that the others still run.
async fn run_finalizer(finalizer: Finalizer, status: ExitStatus) -> Result<(), Panic> {
    AssertUnwindSafe(async move { finalizer(status).await })
        .catch_unwind()
        .await
}

/// A close (or a finalizer) that runs in the background, where nobody can be given its panic:
/// the panic is logged instead. So is the loss of the clean-up itself, if its executor drops it
/// before it has finished (a runtime shutting down): nothing else would tell.
fn unattended(close: BoxFuture<'static, Option<Panic>>) -> BoxFuture<'static, ()> {
    struct Unfinished(bool);
    impl Unfinished {
        fn finished(mut self) {
            self.0 = false;
        }
    }
    impl Drop for Unfinished {
        fn drop(&mut self) {
            if self.0 {
                tracing::error!(
                    "a clean-up in the background was dropped by its executor before it \
                     finished (a runtime shutting down?): its remaining finalizers do not run"
                );
            }
        }
    }
    // Made before the future, so that a future dropped unpolled reports too.
    let unfinished = Unfinished(true);
    Box::pin(async move {
        let closed = close.await;
        unfinished.finished();
        if let Some(panic) = closed {
            log_panic(
                &panic,
                "a scope finalizer panicked in a close that nobody awaits",
            );
        }
    })
}

pub(crate) fn log_panic(panic: &Panic, what: &'static str) {
    tracing::error!(panic = %panic_message(&**panic), "{what}");
}

async fn wait_closed(inner: &ScopeInner) {
    wait_for(&inner.closed, || lock(&inner.state).done.then_some(())).await
}

/// The close work, owned by the caller that started it; handed to the spawner if dropped.
struct Closing {
    work: Option<BoxFuture<'static, Option<Panic>>>,
    scope: Scope,
    /// Already the spawner's: if the spawner drops it too, there is nowhere left to go.
    handed_off: bool,
}

impl Future for Closing {
    type Output = Option<Panic>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Panic>> {
        let this = &mut *self;
        let Some(work) = this.work.as_mut() else {
            return Poll::Ready(None);
        };
        // While the finalizers run, the closing scope is their ambient parent (so a `Scoped`
        // started by a finalizer belongs to it), and a `close` of it from inside returns at once.
        let poll = with_ambient(&this.scope, || {
            CLOSING.with(|closing| closing.borrow_mut().push(this.scope.address()));
            let poll = catch_unwind(AssertUnwindSafe(|| work.as_mut().poll(cx)));
            CLOSING.with(|closing| closing.borrow_mut().pop());
            poll
        });
        match poll {
            Ok(Poll::Ready(panic)) => {
                this.work = None;
                Poll::Ready(panic)
            }
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => resume_unwind(payload),
        }
    }
}

impl Drop for Closing {
    fn drop(&mut self) {
        if self.handed_off {
            if let Some(work) = self.work.take() {
                // Dropped unfinished by the spawner too (a runtime shutting down): there is
                // nowhere left to go, and `unattended` logs the loss. The scope counts as closed,
                // so that a later `close` (which waits for this one) returns instead of waiting
                // for ever.
                drop(work);
                lock(&self.scope.inner.state).done = true;
                self.scope.inner.closed.notify(usize::MAX);
            }
            return;
        }
        if let Some(work) = self.work.take() {
            // Still wrapped, so that the rest of the close keeps its ambient parent and its
            // "closing here" mark.
            spawn_as(
                &*self.scope.inner.spawner,
                "handed-off close",
                unattended(Box::pin(Closing {
                    work: Some(work),
                    scope: self.scope.clone(),
                    handed_off: true,
                })),
            );
        }
    }
}

pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(message) = payload.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = payload.downcast_ref::<String>() {
        message.clone()
    } else {
        "a panic with a non-string payload".to_owned()
    }
}

crate::sync::const_thread_local! {
    /// The scope of the `Scoped` whose body this thread is polling, if any.
    static AMBIENT: RefCell<Option<Scope>> = RefCell::new(None);
    /// The scopes whose close this thread is running, innermost last (by address).
    static CLOSING: RefCell<Vec<usize>> = RefCell::new(Vec::new());
}

/// Makes `scope` the ambient parent while `f` runs (restored even if `f` panics).
fn with_ambient<R>(scope: &Scope, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Scope>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            AMBIENT.with(|ambient| *ambient.borrow_mut() = previous);
        }
    }
    let previous = AMBIENT.with(|ambient| ambient.borrow_mut().replace(scope.clone()));
    let _restore = Restore(previous);
    f()
}

fn ambient() -> Option<Scope> {
    AMBIENT.with(|ambient| ambient.borrow().clone())
}

/// The clock of the scope whose body this thread is running, if it was given one.
pub(crate) fn current_clock() -> Option<Arc<dyn Clock>> {
    ambient().and_then(|scope| scope.clock())
}

/// The clock for work that was given none: the one of the scope whose body is running here
/// (`Scoped::with_clock`), if any; else the entered runtime's (`runtime::clock`).
pub(crate) fn ambient_clock() -> Arc<dyn Clock> {
    current_clock().unwrap_or_else(runtime::clock)
}

/// Where background work started now belongs: on the spawner of the scope whose body this
/// thread is running, if any, otherwise on the default.
pub(crate) fn current_spawner() -> Arc<dyn Spawner> {
    ambient().map_or_else(default_spawner, |scope| scope.spawner())
}

type Body<T, E> = Box<dyn FnOnce(Scope) -> BoxFuture<'static, Result<T, E>> + Send>;

/// A running body, shared with the scope of the `Scoped` it is nested in, if any, so that an
/// unwinding parent can take it over without polling its own body (invariant 3). `None` once it
/// has ended, or was taken over.
struct Running<T, E> {
    body: Mutex<Option<BoxFuture<'static, Result<T, E>>>>,
    scope: Scope,
}

/// A nested `Scoped` as the scope of its parent knows it.
trait Nested: Send + Sync {
    /// Unwinds it for `reason`, its future not polled: first what runs nested in it, then its
    /// body is dropped, then its scope closed. Gives back a finalizer panic, if any.
    fn take_over(self: Arc<Self>, reason: AbortReason) -> BoxFuture<'static, Option<Panic>>;
}

impl<T: Send + 'static, E: Send + 'static> Nested for Running<T, E> {
    fn take_over(self: Arc<Self>, reason: AbortReason) -> BoxFuture<'static, Option<Panic>> {
        Box::pin(async move {
            if lock(&self.body).is_none() {
                return None;
            }
            self.scope.start_unwinding(&reason);
            let first = self.scope.take_over_nested(&reason).await;
            let body = lock(&self.body).take();
            drop(body);
            let later = self
                .scope
                .close_owned(ExitStatus::Interrupted(reason))
                .await;
            match (first, later) {
                (Some(first), later) => {
                    if let Some(later) = later {
                        log_panic(&later, "a further scope finalizer panicked");
                    }
                    Some(first)
                }
                (None, later) => later,
            }
        })
    }
}
