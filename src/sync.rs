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
        while !self.is_done() {
            // Listen, then re-check, so a completion between the two is not missed.
            let listener = self.event.listen();
            if self.is_done() {
                return;
            }
            listener.await;
        }
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
