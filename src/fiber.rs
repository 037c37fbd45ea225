//! Fibers: spawned units of work that can be joined or interrupted.

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::FutureExt;

use crate::abort::{AbortController, Dropped, Interrupted};
use crate::exit::AbortReason;
use crate::runtime::{self, Observed};
use crate::scope::{current_spawner, panic_message, Scoped};
use crate::spawn::Spawner;
use crate::sync::{lock, CompleteOnDrop, Completion};

/// How a fiber ended.
///
/// # Examples
///
/// ```
/// use leasehold::fork_daemon;
///
/// # futures::executor::block_on(async {
/// let exit = fork_daemon(async { 2 + 2 }).join().await;
/// assert!(exit.is_success());
/// assert_eq!(exit.success(), Some(4));
/// # });
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Exit<T> {
    /// The fiber's future finished with this value.
    Success(T),
    /// The fiber was interrupted for this reason (the caller's object), after its clean-up ran.
    Interrupted(AbortReason),
    /// The fiber's future, or one of its finalizers, panicked with this message (its clean-up
    /// still ran to the end).
    Panicked(String),
}

impl<T> Exit<T> {
    /// Whether the fiber finished with a value.
    pub fn is_success(&self) -> bool {
        matches!(self, Exit::Success(_))
    }

    /// Whether the fiber was interrupted.
    pub fn is_interrupted(&self) -> bool {
        matches!(self, Exit::Interrupted(_))
    }

    /// The value, if the fiber finished with one.
    pub fn success(self) -> Option<T> {
        match self {
            Exit::Success(value) => Some(value),
            _ => None,
        }
    }
}

/// `success: ` and the value, `interrupted: ` and the reason, or `panicked: ` and the message.
///
/// # Examples
///
/// ```
/// use leasehold::Exit;
///
/// assert_eq!(Exit::Success(42).to_string(), "success: 42");
/// assert_eq!(Exit::<u8>::Interrupted("enough".into()).to_string(), "interrupted: enough");
/// assert_eq!(Exit::<u8>::Panicked("boom".into()).to_string(), "panicked: boom");
/// ```
impl<T: fmt::Display> fmt::Display for Exit<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Success(value) => write!(f, "success: {value}"),
            Exit::Interrupted(reason) => write!(f, "interrupted: {reason}"),
            Exit::Panicked(message) => write!(f, "panicked: {message}"),
        }
    }
}

struct FiberShared<T> {
    exit: Mutex<ExitSlot<T>>,
    done: Arc<Completion>,
    controller: AbortController,
}

/// How the fiber ended, kept for whoever joins it; and whether anyone still can.
struct ExitSlot<T> {
    exit: Option<Exit<T>>,
    /// The `Fiber` was dropped without being joined: nobody can be given the exit, so a panic
    /// is logged instead (the scope's invariant 6).
    abandoned: bool,
}

impl<T> ExitSlot<T> {
    /// Keeps `exit` for the joiner; a panic nobody can join any more is logged.
    fn end(&mut self, exit: Exit<T>) {
        match exit {
            Exit::Panicked(message) if self.abandoned => log_abandoned(&message),
            exit => self.exit = Some(exit),
        }
    }

    /// Nobody will join: a panic kept for the joiner is logged.
    fn abandon(&mut self) {
        self.abandoned = true;
        if let Some(Exit::Panicked(message)) = self.exit.take() {
            log_abandoned(&message);
        }
    }
}

fn log_abandoned(message: &str) {
    tracing::error!(panic = %message, "a fiber that nobody joins panicked");
}

/// A spawned unit of work: join it, or interrupt it and wait for its clean-up.
///
/// Dropping a `Fiber` detaches it: it runs on (a scoped one until its scope closes), and a panic
/// it ends with, which nobody can be given any more, is logged with `tracing` at error.
///
/// # Examples
///
/// ```
/// use leasehold::{fork_daemon, Exit};
///
/// # futures::executor::block_on(async {
/// let fiber = fork_daemon(std::future::pending::<()>());
/// let exit = fiber.interrupt("enough").await;
/// assert!(matches!(exit, Exit::Interrupted(reason) if reason.to_string() == "enough"));
/// # });
/// ```
pub struct Fiber<T> {
    shared: Arc<FiberShared<T>>,
}

/// A fiber made but not yet spawned, so that a scope can register it first.
pub(crate) struct Prepared<T> {
    shared: Arc<FiberShared<T>>,
    task: futures::future::BoxFuture<'static, ()>,
}

/// Wraps `future` as a fiber: a detached `Scoped` interrupted by the fiber's own controller.
/// The entered runtime is told of its fork into `scope` (by id; 0: a daemon, or a scope it was
/// not told of) and of the end of its work.
pub(crate) fn prepare<T, Fut>(
    future: Fut,
    spawner: &Arc<dyn Spawner>,
    clock: Option<Arc<dyn crate::Clock>>,
    scope: u64,
) -> (Prepared<T>, AbortController, Arc<Completion>)
where
    T: Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let controller = AbortController::new();
    let done = Arc::new(Completion::default());
    let shared = Arc::new(FiberShared {
        exit: Mutex::new(ExitSlot {
            exit: None,
            abandoned: false,
        }),
        done: done.clone(),
        controller: controller.share(),
    });
    let fiber = runtime::next_id();
    if fiber != 0 {
        runtime::observe(|| Observed::FiberForked {
            fiber,
            scope: (scope != 0).then_some(scope),
        });
    }
    /// Tells of the exit when dropped: after the work ended, or was dropped by an interruption.
    struct Exits(u64);
    impl Drop for Exits {
        fn drop(&mut self) {
            if self.0 != 0 {
                runtime::observe(|| Observed::FiberExited { fiber: self.0 });
            }
        }
    }
    let exits = Exits(fiber);
    let mut unit = Scoped::<T, Interrupted>::new(move |_| async move {
        let _exits = exits;
        Ok(future.await)
    })
    .with_signal(&controller.signal())
    .with_spawner(spawner.clone())
    .detached();
    if let Some(clock) = clock {
        unit = unit.with_clock(clock);
    }
    let task_shared = shared.clone();
    let id = Arc::as_ptr(&done) as usize;
    let task = Box::pin(async move {
        // Completes the fiber even if the executor drops this task before it finishes.
        let _complete = CompleteOnDrop(task_shared.done.clone());
        let exit = match AssertUnwindSafe(unit).catch_unwind().await {
            Ok(Ok(value)) => Exit::Success(value),
            Ok(Err(interrupted)) => Exit::Interrupted(interrupted.reason().clone()),
            Err(payload) => Exit::Panicked(panic_message(&*payload)),
        };
        lock(&task_shared.exit).end(exit);
    });
    let task = Box::pin(AsFiber { id, task });
    (Prepared { shared, task }, controller, done)
}

crate::sync::const_thread_local! {
    /// The fiber whose task this thread is polling, if any (see [`current`]).
    static CURRENT: Cell<Option<usize>> = Cell::new(None);
}

/// The fiber whose task this thread is polling: the address of its completion flag, which is
/// how the scope it was forked into knows it among its children. A scope's close uses it to
/// leave alone the fiber that asked for the close (the scope's invariant 7).
pub(crate) fn current() -> Option<usize> {
    CURRENT.with(Cell::get)
}

/// A fiber's task, marked as the current fiber while it is polled.
struct AsFiber {
    id: usize,
    task: futures::future::BoxFuture<'static, ()>,
}

impl Future for AsFiber {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        struct Restore(Option<usize>);
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|current| current.set(self.0));
            }
        }
        let _restore = Restore(CURRENT.with(|current| current.replace(Some(self.id))));
        self.task.as_mut().poll(cx)
    }
}

impl<T> Prepared<T> {
    pub(crate) fn start(self, spawner: &Arc<dyn Spawner>, what: &'static str) -> Fiber<T> {
        runtime::spawn_as(&**spawner, what, self.task);
        Fiber {
            shared: self.shared,
        }
    }
}

impl<T: Send + 'static> Fiber<T> {
    /// Waits for the fiber to end.
    ///
    /// # Cancel safety
    ///
    /// Dropping this future detaches the fiber, as dropping the `Fiber` does.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::fork_daemon;
    ///
    /// # futures::executor::block_on(async {
    /// assert_eq!(fork_daemon(async { "done" }).join().await.success(), Some("done"));
    /// # });
    /// ```
    pub async fn join(self) -> Exit<T> {
        self.shared.done.wait().await;
        lock(&self.shared.exit)
            .exit
            .take()
            .unwrap_or_else(|| Exit::Interrupted(AbortReason::new(Dropped)))
    }

    /// Interrupts and waits until the fiber's finalizers and children are done.
    /// A fiber that had already succeeded gives `Exit::Success`.
    ///
    /// # Cancel safety
    ///
    /// The interruption is sent when this future is first polled; dropping it after that leaves
    /// the fiber interrupted (detached), dropping it before that does nothing. Use
    /// [`interrupt_fork`](Fiber::interrupt_fork) to interrupt without awaiting.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{fork_daemon, Exit};
    ///
    /// # futures::executor::block_on(async {
    /// let quick = fork_daemon(async { 1 });
    /// while !quick.is_finished() { std::thread::yield_now() }
    /// assert!(matches!(quick.interrupt("late").await, Exit::Success(1)));
    /// # });
    /// ```
    pub async fn interrupt(self, reason: impl Into<AbortReason>) -> Exit<T> {
        self.interrupt_fork(reason);
        self.join().await
    }

    /// Sends the interruption without waiting.
    pub fn interrupt_fork(&self, reason: impl Into<AbortReason>) {
        self.shared.controller.abort(reason);
    }

    /// Whether the fiber has ended (its clean-up included).
    pub fn is_finished(&self) -> bool {
        self.shared.done.is_done()
    }
}

/// Dropping a fiber unjoined detaches it; if it panics (or has), the panic is logged.
impl<T> Drop for Fiber<T> {
    fn drop(&mut self) {
        lock(&self.shared.exit).abandon();
    }
}

impl<T> fmt::Debug for Fiber<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fiber")
            .field("finished", &self.shared.done.is_done())
            .finish()
    }
}

/// Effect's forkDaemon: a fiber tied to no scope, on the default spawner.
///
/// Called inside a `Scoped`'s body, that is the body's spawner (given with `with_spawner` or
/// inherited), so that background work stays on the caller's executor; elsewhere, with the
/// `tokio` feature, the tokio runtime this is called on, if any; otherwise smol's global
/// executor.
///
/// # Examples
///
/// ```
/// use leasehold::fork_daemon;
///
/// # futures::executor::block_on(async {
/// let heartbeat = fork_daemon(async { /* runs until done or interrupted */ 3 });
/// assert_eq!(heartbeat.join().await.success(), Some(3));
/// # });
/// ```
pub fn fork_daemon<T, Fut>(future: Fut) -> Fiber<T>
where
    T: Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    fork_daemon_on(future, &current_spawner(), "daemon fiber")
}

/// [`fork_daemon`] on a given spawner; `what` names the task to the entered runtime (see
/// `runtime::spawn_as`).
pub(crate) fn fork_daemon_on<T, Fut>(
    future: Fut,
    spawner: &Arc<dyn Spawner>,
    what: &'static str,
) -> Fiber<T>
where
    T: Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let (prepared, _, _) = prepare(future, spawner, crate::scope::current_clock(), 0);
    prepared.start(spawner, what)
}
