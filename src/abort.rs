//! Abort controllers, signals and reasons.
//!
//! Invariants:
//!
//! 1. A signal is aborted at most once; the first reason wins and is never replaced.
//! 2. The reason is stored before the event is notified, so a listener that wakes up always
//!    finds it (listen, re-check, then await).
//! 3. A signal made by [`AbortSignal::any`] is registered as a dependent of each source; a source
//!    that aborts passes its own reason object on, so `ptr_eq` holds across `any`.
//! 4. A dependent holds its sources strongly and a source holds its dependents weakly: a source
//!    that only the combined signal refers to (a `timeout`, or an inner `any`) lives as long as
//!    the combined signal, and there is no reference cycle.
//!
//! 5. A signal with a deadline (a timeout, or a lock's lease) is aborted by whoever looks at it
//!    (or at a signal made from it by `any`) once its time has come on its clock: what a look
//!    sees follows the clock, not when some task happens to run (a zero timeout is aborted at
//!    the first look; a `TestClock` advanced past it aborts it at the next). Whoever awaits it
//!    (`aborted`, a `Scoped` it is attached to) also sleeps on that clock until the deadline, so
//!    no task of any executor has to run for it to fire.
//! 6. A deadline only moves later, and only while it has not come: once a look could have seen
//!    it pass, the signal aborts (`AbortController::extend_deadline`).
//! 7. A signal with a trigger (something outside that fires by itself: a tokio-util
//!    `CancellationToken`) is looked at and awaited as one with a deadline is (invariant 5): a
//!    look once it has fired aborts the signal with the trigger's reason, and whoever awaits
//!    the signal also awaits the trigger.
//! 8. Hooks told of the abort run once, after the dependents have aborted, with no lock held;
//!    a hook added to an aborted signal runs at once. A hook that needs telling no more is
//!    dropped when the next one is added.
//!
//! Lock order: a signal's `state` lock is never held while another signal's lock is taken.

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::future::BoxFuture;

use crate::clock::Clock;
use crate::exit::AbortReason;
use crate::runtime::{self, Observed};
// loom's under `--cfg leasehold_loom`, for the model tests (`Arc` stays std's: loom's has no
// `Weak`).
use crate::sync::{lock, AtomicBool, AtomicU64, Event, EventListener, Mutex, Ordering};

/// The reason given by [`AbortSignal::timeout`].
///
/// # Examples
///
/// ```
/// use leasehold::TimedOut;
///
/// assert_eq!(TimedOut.to_string(), "timed out");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimedOut;

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("timed out")
    }
}

impl Error for TimedOut {}

/// The reason given to the finalizers of a [`Scoped`](crate::Scoped) that was dropped before it
/// finished (for example, it lost a `select!`).
///
/// # Examples
///
/// ```
/// use leasehold::Dropped;
///
/// assert_eq!(Dropped.to_string(), "dropped before completion");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dropped;

impl fmt::Display for Dropped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("dropped before completion")
    }
}

impl Error for Dropped {}

/// The error of an interrupted unit of work; carries the caller's reason unchanged.
///
/// # Examples
///
/// ```
/// use leasehold::{AbortReason, Interrupted};
///
/// let reason = AbortReason::from("shutting down");
/// let error = Interrupted::new(reason.clone());
/// assert!(error.reason().ptr_eq(&reason));
/// assert_eq!(error.to_string(), "interrupted: shutting down");
/// ```
#[derive(Clone, Debug)]
pub struct Interrupted(AbortReason);

impl Interrupted {
    /// An interruption for `reason`.
    pub fn new(reason: AbortReason) -> Self {
        Interrupted(reason)
    }

    /// The reason the caller gave, the same object.
    pub fn reason(&self) -> &AbortReason {
        &self.0
    }
}

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "interrupted: {}", self.0)
    }
}

impl Error for Interrupted {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(self.0.as_error())
    }
}

struct SignalInner {
    // Set (after `state.reason`) when aborted: lets the hot check skip the lock.
    aborted: AtomicBool,
    state: Mutex<SignalState>,
    event: Event,
    /// For a signal made by `any`: keeps sources alive that nobody else holds (invariant 4).
    sources: Vec<Arc<SignalInner>>,
    /// For a timeout or a lease: when it aborts by itself (invariant 5).
    deadline: Option<Deadline>,
    /// For a signal made from something outside that fires: what, and with what reason
    /// (invariant 7).
    trigger: Option<(Box<dyn Trigger>, AbortReason)>,
    /// For a signal made by `any`: the sources that abort by themselves (with a deadline or a
    /// trigger), theirs included.
    self_aborting: Vec<Arc<SignalInner>>,
}

/// Something outside this module that fires by itself, once (a tokio-util `CancellationToken`),
/// and aborts the signal made from it (invariant 7).
pub(crate) trait Trigger: Send + Sync + 'static {
    /// Whether it has fired.
    fn has_fired(&self) -> bool;
    /// Resolves once it has fired.
    fn fired(&self) -> BoxFuture<'static, ()>;
}

/// Told when a signal aborts (invariant 8).
pub(crate) trait OnAbort: Send + Sync + 'static {
    /// The signal aborted, for `reason`.
    fn aborted(&self, reason: &AbortReason);
    /// Whether there is nothing left to tell (it may be dropped unheard).
    fn is_done(&self) -> bool;
}

/// When a signal aborts by itself, and with what reason.
struct Deadline {
    clock: Arc<dyn Clock>,
    /// On the clock's monotonic time line, in nanoseconds; moved only later (invariant 6).
    at: AtomicU64,
    reason: AbortReason,
}

impl Deadline {
    fn at(&self) -> Duration {
        Duration::from_nanos(self.at.load(Ordering::Acquire))
    }

    /// How long until it comes, by its clock (zero once it has).
    fn left(&self) -> Duration {
        self.at().saturating_sub(self.clock.monotonic())
    }
}

/// A time on a monotonic time line as `Deadline::at` keeps it (saturating, some 584 years on).
fn nanos(at: Duration) -> u64 {
    u64::try_from(at.as_nanos()).unwrap_or(u64::MAX)
}

#[derive(Default)]
struct SignalState {
    reason: Option<AbortReason>,
    dependents: Vec<Weak<SignalInner>>,
    on_abort: Vec<Box<dyn OnAbort>>,
}

impl SignalInner {
    fn new() -> Arc<Self> {
        SignalInner::depending_on(Vec::new())
    }

    fn depending_on(sources: Vec<Arc<SignalInner>>) -> Arc<Self> {
        let self_aborting = sources
            .iter()
            .filter(|source| source.aborts_by_itself())
            .chain(sources.iter().flat_map(|source| &source.self_aborting))
            .cloned()
            .collect();
        Arc::new(SignalInner {
            aborted: AtomicBool::new(false),
            state: Mutex::new(SignalState::default()),
            event: Event::new(),
            sources,
            deadline: None,
            trigger: None,
            self_aborting,
        })
    }

    /// Whether this signal itself (not a source of it) has a deadline or a trigger.
    fn aborts_by_itself(&self) -> bool {
        self.deadline.is_some() || self.trigger.is_some()
    }

    /// A signal that aborts with `reason` once `clock`'s monotonic time reaches `at`.
    fn with_deadline(clock: Arc<dyn Clock>, at: Duration, reason: AbortReason) -> Arc<Self> {
        Arc::new(SignalInner {
            aborted: AtomicBool::new(false),
            state: Mutex::new(SignalState::default()),
            event: Event::new(),
            sources: Vec::new(),
            deadline: Some(Deadline {
                clock,
                at: AtomicU64::new(nanos(at)),
                reason,
            }),
            trigger: None,
            self_aborting: Vec::new(),
        })
    }

    /// A signal that aborts with `reason` once `trigger` has fired (invariant 7).
    #[cfg_attr(not(feature = "tokio-util"), allow(dead_code))]
    fn with_trigger(trigger: Box<dyn Trigger>, reason: AbortReason) -> Arc<Self> {
        Arc::new(SignalInner {
            aborted: AtomicBool::new(false),
            state: Mutex::new(SignalState::default()),
            event: Event::new(),
            sources: Vec::new(),
            deadline: None,
            trigger: Some((trigger, reason)),
            self_aborting: Vec::new(),
        })
    }

    /// This signal and its sources that abort by themselves, while they have not aborted.
    fn still_self_aborting(&self) -> impl Iterator<Item = &SignalInner> {
        std::iter::once(self)
            .chain(self.self_aborting.iter().map(|t| &**t))
            .filter(|signal| !signal.aborted.load(Ordering::Acquire))
    }

    /// Resolves once it may have aborted by itself, when it should be looked at again: once the
    /// earliest of its deadlines may have come (invariant 5: a sleep on each clock they are on,
    /// until the earliest on it), or one of its triggers has fired (invariant 7). `None` when it
    /// aborts only when told. A deadline moved later meanwhile wakes it early; the caller
    /// looks, and waits again.
    fn look_again(&self) -> Option<BoxFuture<'static, ()>> {
        let mut earliest: Vec<(&Arc<dyn Clock>, Duration)> = Vec::new();
        let deadlines = self
            .still_self_aborting()
            .filter_map(|signal| signal.deadline.as_ref());
        for deadline in deadlines {
            let left = deadline.left();
            match earliest.iter_mut().find(|(clock, _)| {
                std::ptr::addr_eq(Arc::as_ptr(clock), Arc::as_ptr(&deadline.clock))
            }) {
                Some((_, soonest)) => *soonest = (*soonest).min(left),
                None => earliest.push((&deadline.clock, left)),
            }
        }
        let triggers = self
            .still_self_aborting()
            .filter_map(|signal| signal.trigger.as_ref())
            .map(|(trigger, _)| trigger.fired());
        let mut sleeps: Vec<BoxFuture<'static, ()>> = earliest
            .into_iter()
            .map(|(clock, left)| clock.sleep(left))
            .chain(triggers)
            .collect();
        match sleeps.len() {
            0 => None,
            1 => sleeps.pop(),
            _ => Some(Box::pin(async move {
                futures::future::select_all(sleeps).await;
            })),
        }
    }

    fn reason(&self) -> Option<AbortReason> {
        if !self.aborted.load(Ordering::Acquire) {
            // Invariants 5 and 7: a timeout whose time has come, or a trigger that has fired,
            // aborts here, and passes it on.
            for source in std::iter::once(self).chain(self.self_aborting.iter().map(|t| &**t)) {
                source.abort_if_due();
            }
            if !self.aborted.load(Ordering::Acquire) {
                return None;
            }
        }
        lock(&self.state).reason.clone()
    }

    /// Aborts a signal whose deadline has come on its clock, with the deadline's reason, or
    /// whose trigger has fired, with the trigger's.
    fn abort_if_due(&self) {
        if let Some(deadline) = &self.deadline {
            if deadline.clock.monotonic() >= deadline.at() {
                self.abort(deadline.reason.clone());
            }
        }
        if let Some((trigger, reason)) = &self.trigger {
            if trigger.has_fired() {
                self.abort(reason.clone());
            }
        }
    }

    fn abort(&self, reason: AbortReason) -> bool {
        let (dependents, on_abort) = {
            let mut state = lock(&self.state);
            if state.reason.is_some() {
                return false;
            }
            state.reason = Some(reason.clone());
            self.aborted.store(true, Ordering::Release);
            (
                std::mem::take(&mut state.dependents),
                std::mem::take(&mut state.on_abort),
            )
        };
        self.event.notify(usize::MAX);
        for dependent in dependents.iter().filter_map(Weak::upgrade) {
            dependent.abort(reason.clone());
        }
        for hook in on_abort {
            hook.aborted(&reason);
        }
        true
    }

    /// Tells `hook` when this signal aborts; at once if it has (invariant 8).
    #[cfg_attr(not(feature = "tokio-util"), allow(dead_code))]
    fn add_on_abort(&self, hook: Box<dyn OnAbort>) {
        let reason = {
            let mut state = lock(&self.state);
            match &state.reason {
                Some(reason) => reason.clone(),
                None => {
                    state.on_abort.retain(|hook| !hook.is_done());
                    state.on_abort.push(hook);
                    return;
                }
            }
        };
        hook.aborted(&reason);
    }

    /// Makes `dependent` abort when this signal does; at once if it already has.
    fn add_dependent(&self, dependent: &Arc<SignalInner>) {
        let reason = {
            let mut state = lock(&self.state);
            match &state.reason {
                Some(reason) => reason.clone(),
                None => {
                    state.dependents.retain(|d| d.strong_count() > 0);
                    state.dependents.push(Arc::downgrade(dependent));
                    return;
                }
            }
        };
        dependent.abort(reason);
    }
}

impl Drop for SignalInner {
    fn drop(&mut self) {
        // Wakes a `looked_at` future, which holds the signal weakly, so that it ends with it.
        self.event.notify(usize::MAX);
    }
}

/// The side that aborts: hands out [`AbortSignal`]s and fires them once.
///
/// # Examples
///
/// ```
/// use leasehold::AbortController;
///
/// let controller = AbortController::new();
/// let signal = controller.signal();
/// assert!(controller.abort("first"));
/// assert!(!controller.abort("second"));
/// assert_eq!(signal.reason().unwrap().to_string(), "first");
/// ```
///
/// Clones are handles on the same controller: aborting any aborts it, once. The reason object
/// an abort made (to compare with [`AbortReason::ptr_eq`] later) is its signal's
/// [`reason`](AbortSignal::reason):
///
/// ```
/// use leasehold::{AbortController, Interrupted, Scoped};
///
/// # futures::executor::block_on(async {
/// let controller = AbortController::new();
/// let work = Scoped::<(), Interrupted>::new(|_| std::future::pending())
///     .with_signal(&controller.signal());
/// let elsewhere = controller.clone();
/// elsewhere.abort("stop");
/// let made = controller.signal().reason().unwrap();
/// assert!(work.await.unwrap_err().reason().ptr_eq(&made));
/// # });
/// ```
#[derive(Clone)]
pub struct AbortController {
    inner: Arc<SignalInner>,
}

impl AbortController {
    /// A controller that has not aborted.
    pub fn new() -> Self {
        AbortController {
            inner: SignalInner::new(),
        }
    }

    /// A signal that aborts when this controller does.
    pub fn signal(&self) -> AbortSignal {
        AbortSignal {
            inner: Some(self.inner.clone()),
        }
    }

    /// Aborts with `reason`; the first reason wins. Returns whether this call aborted it.
    ///
    /// Takes text (`&str`, `String`) or an [`AbortReason`]; for an error type of your own, use
    /// [`abort_with`](AbortController::abort_with).
    pub fn abort(&self, reason: impl Into<AbortReason>) -> bool {
        self.aborted_with(reason.into())
    }

    /// Aborts with `reason`, telling the entered runtime if this call aborted it.
    fn aborted_with(&self, reason: AbortReason) -> bool {
        let told = runtime::observing().then(|| reason.clone());
        let aborted = self.inner.abort(reason);
        if let Some(reason) = told.filter(|_| aborted) {
            runtime::observe(|| Observed::InterruptRequested { reason });
        }
        aborted
    }

    /// Aborts with an error of your own as the reason; the first reason wins. Returns whether
    /// this call aborted it. The interrupted work can downcast the reason back to `E`.
    ///
    /// (A generic `abort` cannot take both text and any error type: the standard library may
    /// one day implement `Error` for `&str`, so the two conversions would overlap.)
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{AbortController, Interrupted, Scoped};
    ///
    /// #[derive(Debug)]
    /// struct UserCancelled {
    ///     user: &'static str,
    /// }
    /// impl std::fmt::Display for UserCancelled {
    ///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
    ///         write!(f, "cancelled by {}", self.user)
    ///     }
    /// }
    /// impl std::error::Error for UserCancelled {}
    ///
    /// # futures::executor::block_on(async {
    /// let controller = AbortController::new();
    /// assert!(controller.abort_with(UserCancelled { user: "ada" }));
    /// let work = Scoped::<(), Interrupted>::new(|_| std::future::pending())
    ///     .with_signal(&controller.signal());
    /// let error = work.await.unwrap_err();
    /// let reason = error.reason().downcast_ref::<UserCancelled>().unwrap();
    /// assert_eq!(reason.user, "ada");
    /// # });
    /// ```
    pub fn abort_with<E: Error + Send + Sync + 'static>(&self, error: E) -> bool {
        self.aborted_with(AbortReason::new(error))
    }

    /// A second handle on the same controller, for the crate's own bookkeeping.
    pub(crate) fn share(&self) -> AbortController {
        AbortController {
            inner: self.inner.clone(),
        }
    }

    /// A controller whose signal also aborts by itself, with `reason`, once `clock`'s monotonic
    /// time reaches `at`, unless [`extend_deadline`](Self::extend_deadline) moves that later
    /// first: a lock's lease, as this process knows it.
    pub(crate) fn with_deadline(
        clock: Arc<dyn Clock>,
        at: Duration,
        reason: impl Into<AbortReason>,
    ) -> Self {
        AbortController {
            inner: SignalInner::with_deadline(clock, at, reason.into()),
        }
    }

    /// Moves the deadline later, to `at` (never earlier), unless it has come already: then the
    /// signal aborts, as any look at it would have seen (invariant 6). Returns whether the signal
    /// is still not aborted.
    pub(crate) fn extend_deadline(&self, at: Duration) -> bool {
        self.inner.abort_if_due();
        if let Some(deadline) = &self.inner.deadline {
            deadline.at.fetch_max(nanos(at), Ordering::AcqRel);
        }
        !self.inner.aborted.load(Ordering::Acquire)
    }
}

impl Default for AbortController {
    fn default() -> Self {
        AbortController::new()
    }
}

impl fmt::Debug for AbortController {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AbortController")
            .field("reason", &self.inner.reason())
            .finish()
    }
}

/// The side that is told: cheap to clone, checked by [`Scoped`](crate::Scoped) before every poll.
///
/// # Examples
///
/// ```
/// use leasehold::{AbortController, AbortSignal};
///
/// # futures::executor::block_on(async {
/// let controller = AbortController::new();
/// let signal = AbortSignal::any([controller.signal(), AbortSignal::never()]);
/// controller.abort("done");
/// assert_eq!(signal.aborted().await.to_string(), "done");
/// # });
/// ```
#[derive(Clone)]
pub struct AbortSignal {
    // `None` is a signal that can never abort, which costs nothing to make or check.
    inner: Option<Arc<SignalInner>>,
}

impl AbortSignal {
    /// A signal that never aborts.
    pub fn never() -> Self {
        AbortSignal { inner: None }
    }

    /// A signal that aborts with a [`TimedOut`] reason once `after` has passed (real time,
    /// measured from this call on the monotonic clock; inside a simulation, feature `testkit`,
    /// on the simulation's clock).
    ///
    /// No task runs for it: a look at the signal once the time has come finds it aborted, and
    /// whoever awaits it (or a [`Scoped`](crate::Scoped) it is attached to) sleeps until then
    /// on the clock's own timer, so it fires under any executor, including after the runtime
    /// it was made on has gone away.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{AbortSignal, TimedOut};
    ///
    /// # futures::executor::block_on(async {
    /// let signal = AbortSignal::timeout(Duration::from_millis(5));
    /// let reason = signal.aborted().await;
    /// assert!(reason.downcast_ref::<TimedOut>().is_some());
    /// # });
    /// ```
    pub fn timeout(after: Duration) -> Self {
        AbortSignal::timeout_on(crate::scope::ambient_clock(), after)
    }

    /// A signal that aborts with a [`TimedOut`] reason once `after` has passed on `clock`,
    /// counted from this call on its monotonic time line: with a [`TestClock`](crate::TestClock),
    /// when the test advances it that far.
    ///
    /// As for [`timeout`](AbortSignal::timeout), no task runs for it.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use leasehold::{AbortSignal, TestClock, TimedOut};
    ///
    /// # futures::executor::block_on(async {
    /// let clock = TestClock::new();
    /// let signal = AbortSignal::timeout_on(Arc::new(clock.clone()), Duration::from_secs(30));
    /// clock.advance(Duration::from_secs(29));
    /// assert!(!signal.is_aborted());
    /// clock.advance(Duration::from_secs(1));
    /// assert!(signal.is_aborted()); // seen at once: the clock says so
    /// let reason = signal.aborted().await;
    /// assert!(reason.downcast_ref::<TimedOut>().is_some());
    /// # });
    /// ```
    pub fn timeout_on(clock: Arc<dyn Clock>, after: Duration) -> Self {
        // Counted from this call.
        let at = clock.monotonic().saturating_add(after);
        AbortSignal {
            inner: Some(SignalInner::with_deadline(
                clock,
                at,
                AbortReason::new(TimedOut),
            )),
        }
    }

    /// A signal that aborts when any of `signals` does, with that signal's reason.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{AbortController, AbortSignal};
    ///
    /// let a = AbortController::new();
    /// let b = AbortController::new();
    /// let either = AbortSignal::any([a.signal(), b.signal()]);
    /// assert!(!either.is_aborted());
    /// b.abort("b");
    /// assert_eq!(either.reason().unwrap().to_string(), "b");
    /// ```
    pub fn any(signals: impl IntoIterator<Item = AbortSignal>) -> Self {
        let sources: Vec<Arc<SignalInner>> = signals.into_iter().filter_map(|s| s.inner).collect();
        match sources.len() {
            0 => AbortSignal::never(),
            1 => AbortSignal {
                inner: sources.into_iter().next(),
            },
            _ => {
                let inner = SignalInner::depending_on(sources);
                for source in &inner.sources {
                    source.add_dependent(&inner);
                }
                AbortSignal { inner: Some(inner) }
            }
        }
    }

    /// Whether the signal has aborted.
    pub fn is_aborted(&self) -> bool {
        self.reason().is_some()
    }

    /// The reason, once aborted.
    pub fn reason(&self) -> Option<AbortReason> {
        self.inner.as_ref().and_then(|inner| inner.reason())
    }

    /// Resolves with the reason when the signal aborts (at once if it has).
    ///
    /// # Cancel safety
    ///
    /// Dropping this future has no effect on the signal.
    pub fn aborted(&self) -> impl Future<Output = AbortReason> + Send + 'static {
        let inner = self.inner.clone();
        async move {
            let Some(inner) = inner else {
                return std::future::pending().await;
            };
            loop {
                // Listen first, then look: an abort in between would otherwise be missed.
                let listener = inner.event.listen();
                if let Some(reason) = inner.reason() {
                    return reason;
                }
                match inner.look_again() {
                    Some(look_again) => {
                        let listener = std::pin::pin!(listener);
                        futures::future::select(listener, look_again).await;
                    }
                    None => listener.await,
                }
            }
        }
    }

    /// A listener that fires when the signal aborts; `None` for a signal that never aborts.
    /// A signal with a deadline or a trigger aborts by itself when it is looked at once its
    /// time has come or the trigger has fired: wait for [`look_again`](Self::look_again) too.
    pub(crate) fn listen(&self) -> Option<EventListener> {
        self.inner.as_ref().map(|inner| inner.event.listen())
    }

    /// Resolves once this signal (or one it was made from) may have aborted by itself, when it
    /// should be looked at again: the earliest deadline may have come, or a trigger has
    /// fired. `None` if it aborts only when told.
    pub(crate) fn look_again(&self) -> Option<BoxFuture<'static, ()>> {
        self.inner.as_ref()?.look_again()
    }

    /// A signal that aborts with `reason` once `trigger` has fired (invariant 7): no task runs
    /// for it.
    #[cfg_attr(not(feature = "tokio-util"), allow(dead_code))]
    pub(crate) fn triggered_by(trigger: Box<dyn Trigger>, reason: AbortReason) -> Self {
        AbortSignal {
            inner: Some(SignalInner::with_trigger(trigger, reason)),
        }
    }

    /// Tells `hook` when the signal aborts, at once if it has; never, for a signal that never
    /// aborts (invariant 8). Kept until the signal aborts or is dropped, or `hook` is done.
    ///
    /// A signal that aborts by itself (a deadline, a trigger) does so when it is looked at:
    /// if nobody else may look, also run [`looked_at`](Self::looked_at).
    #[cfg_attr(not(feature = "tokio-util"), allow(dead_code))]
    pub(crate) fn on_abort(&self, hook: Box<dyn OnAbort>) {
        if let Some(inner) = &self.inner {
            inner.add_on_abort(hook);
        }
    }

    /// For a signal that may abort by itself: a future that looks at it each time it may have
    /// (invariants 5 and 7), so that it aborts then, and its hooks are told, with nobody else
    /// looking. It holds the signal weakly, and ends when the signal has aborted or its last
    /// handle is dropped. `None` for a signal that aborts only when told.
    #[cfg_attr(not(feature = "tokio-util"), allow(dead_code))]
    pub(crate) fn looked_at(&self) -> Option<BoxFuture<'static, ()>> {
        let inner = self.inner.as_ref()?;
        if !inner.aborts_by_itself() && inner.self_aborting.is_empty() {
            return None;
        }
        let inner = Arc::downgrade(inner);
        Some(Box::pin(async move {
            loop {
                let (listener, look_again) = {
                    let Some(inner) = inner.upgrade() else { return };
                    // Listen first, then look: an abort in between would otherwise be missed.
                    let listener = inner.event.listen();
                    if inner.reason().is_some() {
                        return;
                    }
                    (listener, inner.look_again())
                };
                match look_again {
                    Some(look_again) => {
                        let listener = std::pin::pin!(listener);
                        futures::future::select(listener, look_again).await;
                    }
                    None => listener.await,
                }
            }
        }))
    }
}

impl Default for AbortSignal {
    fn default() -> Self {
        AbortSignal::never()
    }
}

impl fmt::Debug for AbortSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AbortSignal")
            .field("reason", &self.reason())
            .finish()
    }
}
