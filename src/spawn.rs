//! Where background work runs.

use std::fmt;

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
