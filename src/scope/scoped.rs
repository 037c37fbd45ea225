//! `Scoped`: a future that owns a scope and closes it, every finalizer finished, before it
//! resolves; and its interruption (invariants 3 to 5 of `mod.rs`).

use super::*;

enum Phase<T, E> {
    Init(Body<T, E>),
    Running(Arc<Running<T, E>>),
    /// Interrupted: the nested `Scoped` futures running in the body are being taken over; the
    /// body is not polled again, and is dropped once they are done.
    Unwinding {
        running: Arc<Running<T, E>>,
        nested: BoxFuture<'static, Option<Panic>>,
        reason: AbortReason,
    },
    /// Taken over by its unwinding parent, which closed its scope: it never resolves (the
    /// parent's body, which awaits it, is not polled again, and drops it).
    Parked,
    Closing {
        close: BoxFuture<'static, Option<Panic>>,
        outcome: Outcome<T, E>,
    },
    Done,
}

enum Outcome<T, E> {
    Value(Result<T, E>),
    Interrupted(AbortReason),
    Panicked(Panic),
}

struct ScopedInner<T, E> {
    phase: Phase<T, E>,
    /// Every attached signal, combined with [`AbortSignal::any`] so that the first to abort gives
    /// the reason, whenever this future happens to be polled.
    signal: Option<AbortSignal>,
    listener: Option<EventListener>,
    /// When the signal may have aborted by itself (a timeout's or a lease's deadline may have
    /// come, a token's trigger fired): it is then looked at again, whether or not anything
    /// else wakes this future.
    look_again: Option<BoxFuture<'static, ()>>,
    /// Timeouts not yet started: each becomes an attached signal on the first poll, so that it
    /// counts from when the work starts, not from when it was built.
    timeouts: Vec<(Option<Arc<dyn Clock>>, Duration)>,
    /// `None`: the parent's clock, or the entered runtime's (`runtime::clock`).
    clock: Option<Arc<dyn Clock>>,
    interrupted: fn(Interrupted) -> E,
    /// `None`: the parent's spawner, or the default one.
    spawner: Option<Arc<dyn Spawner>>,
    /// Whether to take the ambient parent on the first poll (fibers do not).
    inherit: bool,
    parent: Option<Scope>,
    /// How the parent's scope knows this one, while it runs there.
    registered: Option<Arc<dyn Nested>>,
    scope: Option<Scope>,
}

/// A future with its own scope: closed, with every finalizer finished, before it resolves.
///
/// The body receives the [`Scope`]. However the body ends (a value, an error, a panic, or an
/// interruption from a signal attached with [`with_signal`](Scoped::with_signal)), the scope is
/// closed before the `Scoped` resolves. An interruption resolves with
/// `Err(E::from(Interrupted(reason)))` where `reason` is the caller's object.
///
/// # Cancel safety
///
/// Dropping an unfinished `Scoped` (for example when it loses a `select!`) drops its body and
/// hands the rest of its close to the spawner (or, when it runs inside another `Scoped`, to that
/// parent, whose own close then waits for it). This is best-effort in one sense only: it needs
/// the spawner to keep running. Prefer interrupting with a signal, which waits for the clean-up.
///
/// # Examples
///
/// ```
/// use leasehold::{AbortController, Interrupted, Scoped};
///
/// # futures::executor::block_on(async {
/// let controller = AbortController::new();
/// controller.abort("no longer needed");
/// let work = Scoped::<u32, Interrupted>::new(|scope| async move {
///     scope.add_finalizer(|_| async { /* never added: the body never runs */ });
///     Ok(1)
/// })
/// .with_signal(&controller.signal());
/// let error = work.await.unwrap_err();
/// assert_eq!(error.reason().to_string(), "no longer needed");
/// # });
/// ```
#[must_use = "a Scoped does nothing unless awaited"]
pub struct Scoped<T, E> {
    inner: Box<ScopedInner<T, E>>,
}

impl<T: Send + 'static, E: From<Interrupted> + Send + 'static> Scoped<T, E> {
    /// A future that runs `body` with a fresh scope and closes it before resolving.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{Interrupted, Scoped};
    ///
    /// # futures::executor::block_on(async {
    /// let answer = Scoped::<_, Interrupted>::new(|scope| async move {
    ///     scope.add_finalizer(|_| async { /* runs before `answer` is available */ });
    ///     Ok(42)
    /// })
    /// .await;
    /// assert_eq!(answer.unwrap(), 42);
    /// # });
    /// ```
    pub fn new<F, Fut>(body: F) -> Self
    where
        F: FnOnce(Scope) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        Scoped {
            inner: Box::new(ScopedInner {
                phase: Phase::Init(Box::new(move |scope| Box::pin(body(scope)))),
                signal: None,
                listener: None,
                look_again: None,
                timeouts: Vec::new(),
                clock: None,
                interrupted: E::from,
                spawner: None,
                inherit: true,
                parent: None,
                registered: None,
                scope: None,
            }),
        }
    }

    /// Interrupt with the signal's reason when it aborts (several signals may be attached).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{AbortSignal, Interrupted, Scoped, TimedOut};
    ///
    /// # futures::executor::block_on(async {
    /// let slow = Scoped::<(), Interrupted>::new(|_| std::future::pending())
    ///     .with_signal(&AbortSignal::timeout(Duration::from_millis(10)));
    /// let error = slow.await.unwrap_err();
    /// assert!(error.reason().downcast_ref::<TimedOut>().is_some());
    /// # });
    /// ```
    pub fn with_signal(mut self, signal: &AbortSignal) -> Self {
        self.inner.attach(signal.clone());
        self
    }

    /// Ignores the ambient parent: for work that is spawned, not awaited by its creator.
    pub(crate) fn detached(mut self) -> Self {
        self.inner.inherit = false;
        self
    }
}

impl<T, E> Scoped<T, E> {
    /// Its scope's fibers and handed-off clean-ups run on `spawner`; nested `Scoped` futures and
    /// forked fibers inherit it.
    ///
    /// Without it, a `Scoped` takes its spawner when first polled: its parent's if it is first
    /// polled inside another `Scoped`, else the default (with the `tokio` feature, the tokio
    /// runtime it is polled on, if any; otherwise smol's global executor). Setting it once on the
    /// outermost `Scoped` of a request is therefore enough. It has no effect on a `Scoped` that
    /// has already been polled.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use leasehold::{Interrupted, Scoped, Spawner};
    ///
    /// // Any executor can be plugged in; here, one thread per piece of background work.
    /// let spawner: Arc<dyn Spawner> = Arc::new(|future| {
    ///     std::thread::spawn(move || futures::executor::block_on(future));
    /// });
    /// # futures::executor::block_on(async {
    /// let answer = Scoped::<_, Interrupted>::new(|scope| async move {
    ///     // Forked onto `spawner`, as are the fibers of any `Scoped` nested in this one.
    ///     Ok(scope.fork(async { 6 * 7 }).join().await.success())
    /// })
    /// .with_spawner(spawner)
    /// .await;
    /// assert_eq!(answer.unwrap(), Some(42));
    /// # });
    /// ```
    pub fn with_spawner(mut self, spawner: Arc<dyn Spawner>) -> Self {
        self.inner.spawner = Some(spawner);
        self
    }

    /// Timeouts, sleeps and schedules in this `Scoped` and everything nested in it (inner
    /// `Scoped` futures, forked fibers) that were given no clock use `clock`, as they inherit
    /// the spawner. Which clock work given none uses: the enclosing scope's (this), else inside
    /// a simulation (feature `testkit`) the simulation's, else the system's. An explicit clock
    /// (`timeout_on`, `Schedule::with_clock`) always wins. It has no effect on a `Scoped` that
    /// has already been polled.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use futures::FutureExt;
    /// use leasehold::{AbortSignal, Interrupted, Scoped, TestClock, TimedOut};
    ///
    /// let clock = TestClock::new();
    /// let mut work = Scoped::<(), Interrupted>::new(|_| async {
    ///     // No clock given: the enclosing scope's, the test clock.
    ///     let reason = AbortSignal::timeout(Duration::from_secs(30)).aborted().await;
    ///     assert!(reason.downcast_ref::<TimedOut>().is_some());
    ///     Ok(())
    /// })
    /// .with_clock(Arc::new(clock.clone()));
    /// assert!((&mut work).now_or_never().is_none());
    /// clock.advance(Duration::from_secs(30));
    /// assert!(work.now_or_never().unwrap().is_ok());
    /// ```
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.inner.clock = Some(clock);
        self
    }

    /// Interrupts with a [`TimedOut`](crate::TimedOut) reason unless it has resolved once
    /// `after` has passed (real time; inside a simulation, feature `testkit`, the simulation's
    /// time), counted from its first poll.
    ///
    /// The clean-up runs as for any interruption, and the `Scoped` resolves only after it.
    /// Several timeouts and signals may be attached: the first to fire gives the reason.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{Interrupted, Scoped, TimedOut};
    ///
    /// # futures::executor::block_on(async {
    /// let slow = Scoped::<(), Interrupted>::new(|_| std::future::pending())
    ///     .timeout(Duration::from_millis(10));
    /// let error = slow.await.unwrap_err();
    /// assert!(error.reason().downcast_ref::<TimedOut>().is_some());
    /// # });
    /// ```
    pub fn timeout(mut self, after: Duration) -> Self {
        self.inner.timeouts.push((None, after));
        self
    }

    /// [`timeout`](Scoped::timeout) measured on `clock`'s monotonic time line: with a
    /// [`TestClock`](crate::TestClock), once the test has advanced it that far past the first
    /// poll.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use futures::FutureExt;
    /// use leasehold::{Interrupted, Scoped, TestClock, TimedOut};
    ///
    /// # futures::executor::block_on(async {
    /// let clock = TestClock::new();
    /// let mut slow = Scoped::<(), Interrupted>::new(|_| std::future::pending())
    ///     .timeout_on(Arc::new(clock.clone()), Duration::from_secs(60));
    /// assert!((&mut slow).now_or_never().is_none()); // started: the minute counts from here
    /// clock.advance(Duration::from_secs(60));
    /// let error = slow.await.unwrap_err();
    /// assert!(error.reason().downcast_ref::<TimedOut>().is_some());
    /// # });
    /// ```
    pub fn timeout_on(mut self, clock: Arc<dyn Clock>, after: Duration) -> Self {
        self.inner.timeouts.push((Some(clock), after));
        self
    }
}

impl<T, E> ScopedInner<T, E> {
    /// Adds `signal` to those that interrupt this unit.
    fn attach(&mut self, signal: AbortSignal) {
        let combined = match self.signal.take() {
            None => signal,
            Some(attached) => AbortSignal::any([attached, signal]),
        };
        self.signal = Some(combined);
        self.listener = None;
        self.look_again = None;
    }

    /// The reason of the first attached signal to abort; otherwise arranges to be woken when one
    /// does.
    /// Tells the entered runtime that an interruption reached this `Scoped`'s body.
    fn delivered(&self, reason: &AbortReason) {
        runtime::observe(|| Observed::InterruptDelivered {
            scope: self.scope.as_ref().map(Scope::id).filter(|&id| id != 0),
            reason: reason.clone(),
        });
    }

    fn check_signals(&mut self, cx: &mut Context<'_>) -> Option<AbortReason> {
        let signal = self.signal.as_ref()?;
        loop {
            // Listen first, then check: an abort in between would otherwise be missed.
            if self.listener.is_none() {
                self.listener = signal.listen();
                self.look_again = signal.look_again();
            }
            if let Some(reason) = signal.reason() {
                return Some(reason);
            }
            let fired = match self.listener.as_mut() {
                Some(listener) => Pin::new(listener).poll(cx).is_ready(),
                None => false,
            };
            let due = match self.look_again.as_mut() {
                Some(look_again) => look_again.as_mut().poll(cx).is_ready(),
                None => false,
            };
            if !fired && !due {
                return None;
            }
            self.listener = None;
            self.look_again = None;
        }
    }

    fn scope(&self) -> &Scope {
        self.scope
            .as_ref()
            .expect("a started Scoped always has a scope")
    }

    /// Stops the body for `reason`: the nested `Scoped` futures running in it are taken over
    /// first (`Unwinding`), then it is dropped.
    fn unwind(&mut self, reason: AbortReason) {
        let scope = self.scope().clone();
        scope.start_unwinding(&reason);
        let Phase::Running(running) = std::mem::replace(&mut self.phase, Phase::Done) else {
            unreachable!("only a running body unwinds")
        };
        self.phase = Phase::Unwinding {
            running,
            nested: scope.take_over_nested(&reason),
            reason,
        };
    }

    /// The body has ended, or is to be dropped: the parent need not take it over any more.
    fn leave_parent(&mut self) {
        if let (Some(parent), Some(nested)) = (&self.parent, self.registered.take()) {
            parent.remove_nested(&nested);
        }
    }
}

impl<T: Send + 'static, E: Send + 'static> Future for Scoped<T, E> {
    type Output = Result<T, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T, E>> {
        let this = &mut *self.inner;
        loop {
            if matches!(this.phase, Phase::Running(_)) {
                if let Some(reason) = this.check_signals(cx) {
                    this.delivered(&reason);
                    this.unwind(reason);
                    continue;
                }
            }
            match &mut this.phase {
                Phase::Init(_) => {
                    if this.inherit {
                        this.parent = ambient();
                    }
                    if this.clock.is_none() {
                        this.clock = this.parent.as_ref().and_then(Scope::clock);
                    }
                    for (clock, after) in std::mem::take(&mut this.timeouts) {
                        let clock = clock
                            .or_else(|| this.clock.clone())
                            .unwrap_or_else(ambient_clock);
                        this.attach(AbortSignal::timeout_on(clock, after));
                    }
                    if let Some(reason) = this.check_signals(cx) {
                        runtime::observe(|| Observed::InterruptDelivered {
                            scope: None,
                            reason: reason.clone(),
                        });
                        this.phase = Phase::Done;
                        return Poll::Ready(Err((this.interrupted)(Interrupted::new(reason))));
                    }
                    let spawner = match (&this.spawner, &this.parent) {
                        (Some(spawner), _) => spawner.clone(),
                        (None, Some(parent)) => parent.spawner(),
                        (None, None) => default_spawner(),
                    };
                    let scope = Scope::open(spawner, this.parent.as_ref(), this.clock.clone());
                    this.scope = Some(scope.clone());
                    let Phase::Init(body) = std::mem::replace(&mut this.phase, Phase::Done) else {
                        unreachable!("matched Init above")
                    };
                    let running = Arc::new(Running {
                        body: Mutex::new(Some(body(scope.clone()))),
                        scope,
                    });
                    if let Some(parent) = &this.parent {
                        let nested: Arc<dyn Nested> = running.clone();
                        parent.add_nested(nested.clone());
                        this.registered = Some(nested);
                    }
                    this.phase = Phase::Running(running);
                }
                Phase::Running(running) => {
                    let scope = this.scope.as_ref().expect("a running Scoped has a scope");
                    let polled = {
                        let mut body = lock(&running.body);
                        let Some(future) = body.as_mut() else {
                            // Taken over by its parent, which closed its scope.
                            drop(body);
                            this.phase = Phase::Parked;
                            return Poll::Pending;
                        };
                        let polled = with_ambient(scope, || {
                            catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)))
                        });
                        if !matches!(polled, Ok(Poll::Pending)) {
                            *body = None;
                        }
                        polled
                    };
                    if !matches!(polled, Ok(Poll::Pending)) {
                        this.leave_parent();
                    }
                    let scope = this.scope().clone();
                    let (status, outcome) = match polled {
                        Ok(Poll::Pending) => return Poll::Pending,
                        Ok(Poll::Ready(Ok(value))) => {
                            (ExitStatus::Success, Outcome::Value(Ok(value)))
                        }
                        Ok(Poll::Ready(Err(error))) => {
                            (ExitStatus::Failure, Outcome::Value(Err(error)))
                        }
                        Err(payload) => (ExitStatus::Failure, Outcome::Panicked(payload)),
                    };
                    let close = scope.close_owned(status);
                    this.phase = Phase::Closing { close, outcome };
                }
                Phase::Unwinding { nested, .. } => {
                    let Poll::Ready(panic) = nested.as_mut().poll(cx) else {
                        return Poll::Pending;
                    };
                    let Phase::Unwinding {
                        running, reason, ..
                    } = std::mem::replace(&mut this.phase, Phase::Done)
                    else {
                        unreachable!("matched Unwinding above")
                    };
                    let scope = this.scope().clone();
                    if let Some(panic) = panic {
                        scope.hand_panic(panic);
                    }
                    this.leave_parent();
                    let body = lock(&running.body).take();
                    drop(body);
                    this.phase = Phase::Closing {
                        close: scope.close_owned(ExitStatus::Interrupted(reason.clone())),
                        outcome: Outcome::Interrupted(reason),
                    };
                }
                Phase::Parked => return Poll::Pending,
                Phase::Closing { close, .. } => {
                    let Poll::Ready(finalizer_panic) = close.as_mut().poll(cx) else {
                        return Poll::Pending;
                    };
                    let Phase::Closing { outcome, .. } =
                        std::mem::replace(&mut this.phase, Phase::Done)
                    else {
                        unreachable!("matched Closing above")
                    };
                    // Invariant 6: a finalizer's panic is not lost; the body's own came first.
                    return Poll::Ready(match (outcome, finalizer_panic) {
                        (Outcome::Panicked(payload), later) => {
                            if let Some(later) = later {
                                log_panic(&later, "a scope finalizer panicked after its body did");
                            }
                            resume_unwind(payload)
                        }
                        (_, Some(panic)) => resume_unwind(panic),
                        (Outcome::Value(result), None) => result,
                        (Outcome::Interrupted(reason), None) => {
                            Err((this.interrupted)(Interrupted::new(reason)))
                        }
                    });
                }
                Phase::Done => panic!("`Scoped` polled after it resolved"),
            }
        }
    }
}

impl<T, E> Drop for ScopedInner<T, E> {
    fn drop(&mut self) {
        self.leave_parent();
        let close = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Init(_) | Phase::Done | Phase::Parked => return,
            Phase::Running(running) | Phase::Unwinding { running, .. } => {
                let body = lock(&running.body).take();
                // Taken over by its parent, which closed its scope.
                let Some(body) = body else { return };
                let reason = self
                    .scope()
                    .unwinding()
                    .or_else(|| self.parent.as_ref().and_then(Scope::unwinding))
                    .unwrap_or_else(|| AbortReason::new(Dropped));
                let scope = self.scope().clone();
                scope.start_unwinding(&reason);
                drop(body);
                scope.close_owned(ExitStatus::Interrupted(reason))
            }
            Phase::Closing { close, outcome } => {
                // A value nobody will receive is dropped here; a `Guard` releases itself on drop.
                drop(outcome);
                close
            }
        };
        match &self.parent {
            Some(parent) => parent.adopt_close(close),
            None => runtime::spawn_as(
                &*self.scope().spawner(),
                "handed-off close of a dropped Scoped",
                unattended(close),
            ),
        }
    }
}

/// `select!` takes a `Scoped` without `.fuse()`: one that has resolved is never polled again.
impl<T: Send + 'static, E: Send + 'static> FusedFuture for Scoped<T, E> {
    fn is_terminated(&self) -> bool {
        // Between polls, `Done` means resolved: the other phases pass through it only inside
        // `poll` (or in `Drop`, after which nobody can ask).
        matches!(self.inner.phase, Phase::Done)
    }
}

impl<T, E> fmt::Debug for Scoped<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let phase = match self.inner.phase {
            Phase::Init(_) => "not started",
            Phase::Running(_) => "running",
            Phase::Unwinding { .. } => "unwinding",
            Phase::Parked => "parked",
            Phase::Closing { .. } => "closing",
            Phase::Done => "done",
        };
        f.debug_struct("Scoped")
            .field("phase", &phase)
            .field(
                "interruptible",
                &(self.inner.signal.is_some() || !self.inner.timeouts.is_empty()),
            )
            .finish()
    }
}

/// Shorthand for `Scoped::new(body).await`.
///
/// # Examples
///
/// ```
/// use leasehold::{scoped, Interrupted};
///
/// # futures::executor::block_on(async {
/// let value: Result<u8, Interrupted> = scoped(|_scope| async { Ok(7) }).await;
/// assert_eq!(value.unwrap(), 7);
/// # });
/// ```
pub async fn scoped<T, E, F, Fut>(body: F) -> Result<T, E>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
    F: FnOnce(Scope) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
{
    Scoped::new(body).await
}
