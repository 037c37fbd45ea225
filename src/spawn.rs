//! Where background work runs.
//!
//! Background work goes to the first of: a spawner given explicitly, the spawner of the enclosing
//! scope, the entered runtime's (`runtime`), (with the `tokio` feature) the tokio runtime current
//! when the default is chosen, and smol's global executor. This module holds the last two:
//! `process_spawner` chooses between them.

use std::fmt;
use std::sync::{Arc, LazyLock};

use futures::future::BoxFuture;

/// Runs background work: fibers, finalizers handed off by dropped scopes, heartbeats.
///
/// Closures implement it, so any executor can be plugged in:
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use leasehold::Spawner;
///
/// let spawner: Arc<dyn Spawner> = Arc::new(|future| {
///     std::thread::spawn(move || futures::executor::block_on(future));
/// });
/// # let (tx, rx) = std::sync::mpsc::channel();
/// # spawner.spawn(Box::pin(async move { tx.send(1).unwrap() }));
/// # assert_eq!(rx.recv().unwrap(), 1);
/// ```
pub trait Spawner: Send + Sync + 'static {
    /// Starts `future` and lets it run to completion without being awaited.
    fn spawn(&self, future: BoxFuture<'static, ()>);
}

impl<F: Fn(BoxFuture<'static, ()>) + Send + Sync + 'static> Spawner for F {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        self(future)
    }
}

/// The default spawner: smol's global executor, which runs on threads of its own, so it works
/// whichever executor the caller uses.
///
/// # Examples
///
/// ```
/// use leasehold::{SmolSpawner, Spawner};
///
/// let (tx, rx) = std::sync::mpsc::channel();
/// SmolSpawner.spawn(Box::pin(async move { tx.send(42).unwrap() }));
/// assert_eq!(rx.recv().unwrap(), 42);
/// ```
#[derive(Clone, Copy, Default)]
pub struct SmolSpawner;

impl Spawner for SmolSpawner {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        smol::spawn(future).detach();
    }
}

impl fmt::Debug for SmolSpawner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SmolSpawner")
    }
}

/// A tokio runtime as a [`Spawner`]: background work runs as tasks on that runtime, so it can use
/// tokio's timers and I/O, and it stops when the runtime shuts down.
///
/// Available with the `tokio` feature, which also makes a `Scoped` first polled inside a tokio
/// runtime (with no spawner given or inherited) use that runtime without being told.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use leasehold::{Interrupted, Scoped, TokioSpawner};
///
/// let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
/// let spawner = Arc::new(TokioSpawner::new(runtime.handle().clone()));
/// let work = Scoped::<_, Interrupted>::new(|scope| async move {
///     // Forked onto `runtime`, whichever executor polls `work`.
///     let fiber = scope.fork(async { tokio::task::yield_now().await; 7 });
///     Ok(fiber.join().await.success())
/// })
/// .with_spawner(spawner);
/// assert_eq!(runtime.block_on(work).unwrap(), Some(7));
/// ```
#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
#[derive(Clone, Debug)]
pub struct TokioSpawner {
    handle: tokio::runtime::Handle,
}

#[cfg(feature = "tokio")]
impl TokioSpawner {
    /// The runtime this is called on.
    ///
    /// # Panics
    ///
    /// Panics when called outside a tokio runtime (as [`tokio::runtime::Handle::current`] does).
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{Spawner, TokioSpawner};
    ///
    /// let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let spawner = runtime.block_on(async { TokioSpawner::current() });
    /// let (tx, rx) = futures::channel::oneshot::channel();
    /// spawner.spawn(Box::pin(async move { tx.send(42).unwrap() }));
    /// assert_eq!(runtime.block_on(rx).unwrap(), 42);
    /// ```
    pub fn current() -> Self {
        TokioSpawner::new(tokio::runtime::Handle::current())
    }

    /// The runtime of `handle`.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::TokioSpawner;
    ///
    /// let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let spawner = TokioSpawner::new(runtime.handle().clone());
    /// # drop(spawner);
    /// ```
    pub fn new(handle: tokio::runtime::Handle) -> Self {
        TokioSpawner { handle }
    }
}

#[cfg(feature = "tokio")]
impl Spawner for TokioSpawner {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        // Detached: the work reports through its own completion, not through the JoinHandle.
        // On a runtime that has shut down, tokio drops the future at once.
        drop(self.handle.spawn(future));
    }
}

/// The process's spawner for work that was given none and inherits none: with the `tokio`
/// feature, the tokio runtime this is called on, if any; otherwise smol's global executor.
/// (An entered runtime comes first: `runtime::default_spawner`.)
pub(crate) fn process_spawner() -> Arc<dyn Spawner> {
    #[cfg(feature = "tokio")]
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        return Arc::new(TokioSpawner::new(handle));
    }
    // One shared handle: most `Scoped` futures take the default, and each would allocate.
    static SMOL: LazyLock<Arc<dyn Spawner>> = LazyLock::new(|| Arc::new(SmolSpawner));
    SMOL.clone()
}
