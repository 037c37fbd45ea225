//! Small helpers shared by the primitives.

use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, ignoring poisoning: every critical section in this crate leaves its state
/// consistent before anything that could panic, so a poisoned lock still guards valid data.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use event_listener::Event;

/// A one-shot "finished" flag that can be awaited.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    done: AtomicBool,
    event: Event,
}

impl Completion {
    pub(crate) fn complete(&self) {
        self.done.store(true, Ordering::Release);
        self.event.notify(usize::MAX);
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    pub(crate) async fn wait(&self) {
        wait_for(&self.event, || self.is_done().then_some(())).await
    }
}

/// Completes a [`Completion`] when dropped: the work it stands for finished, or was dropped by
/// its executor, and either way nobody should wait for it any longer.
#[derive(Debug)]
pub(crate) struct CompleteOnDrop(pub(crate) Arc<Completion>);

impl Drop for CompleteOnDrop {
    fn drop(&mut self) {
        self.0.complete();
    }
}

/// Waits until `ready` returns a value, re-checking whenever `event` is notified.
///
/// The no-lost-wake-up idiom, written once: listen first, then check, then await. A notification
/// between a check and the `listen` that follows it would otherwise be missed; listening first
/// means it either happened before the check (which then sees it) or wakes the listener.
pub(crate) async fn wait_for<T>(event: &Event, mut ready: impl FnMut() -> Option<T>) -> T {
    loop {
        if let Some(value) = ready() {
            return value;
        }
        let listener = event.listen();
        if let Some(value) = ready() {
            return value;
        }
        listener.await;
    }
}
