//! Small helpers shared by the primitives, and the one place that chooses where their atomics
//! come from.
//!
//! Under `--cfg leasehold_loom` (the model tests in `tests/loom.rs`), the atomics, mutexes, `Arc`,
//! wakers and thread-locals of the semaphore, the abort signal and the scope's close are loom's,
//! so that loom explores every interleaving of them; otherwise they are the standard library's
//! (and `futures`' waker). Their `Event` is then a small stand-in on loom's mutex: event-listener
//! wakes its listeners under a lock of its own that loom cannot see, and a switch of model threads
//! there hangs the model. The lock manager keeps the standard types.
//!
//! The cfg is `leasehold_loom`, not the customary `loom`: that one would reach every crate in the
//! build and would break smol's timer driver.

#[cfg(not(leasehold_loom))]
pub(crate) use event_listener::{Event, EventListener};
#[cfg(not(leasehold_loom))]
pub(crate) use futures::task::AtomicWaker;
#[cfg(leasehold_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(leasehold_loom)]
pub(crate) use loom::sync::{Arc, Mutex};
#[cfg(leasehold_loom)]
pub(crate) use model_event::{Event, EventListener};
#[cfg(not(leasehold_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(leasehold_loom))]
pub(crate) use std::sync::{Arc, Mutex};

use std::future::Future;
use std::ops::DerefMut;

/// Locks a mutex (the standard library's, or loom's under `--cfg leasehold_loom`), ignoring
/// poisoning: every critical section in this crate leaves its state consistent before anything
/// that could panic, so a poisoned lock still guards valid data.
pub(crate) fn lock<M: Lockable>(mutex: &M) -> M::Guard<'_> {
    mutex.lock_ignoring_poison()
}

/// A mutex that [`lock`] can lock.
pub(crate) trait Lockable {
    /// What the mutex guards.
    type Data;
    /// Its guard.
    type Guard<'a>: DerefMut<Target = Self::Data>
    where
        Self: 'a;
    /// Locks it, ignoring poisoning.
    fn lock_ignoring_poison(&self) -> Self::Guard<'_>;
}

impl<T> Lockable for std::sync::Mutex<T> {
    type Data = T;
    type Guard<'a>
        = std::sync::MutexGuard<'a, T>
    where
        T: 'a;
    fn lock_ignoring_poison(&self) -> Self::Guard<'_> {
        self.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// So that a mutex shared through an `Arc` locks as it would through a reference.
impl<M: Lockable> Lockable for std::sync::Arc<M> {
    type Data = M::Data;
    type Guard<'a>
        = M::Guard<'a>
    where
        M: 'a;
    fn lock_ignoring_poison(&self) -> Self::Guard<'_> {
        (**self).lock_ignoring_poison()
    }
}

#[cfg(leasehold_loom)]
impl<T> Lockable for loom::sync::Mutex<T> {
    type Data = T;
    type Guard<'a>
        = loom::sync::MutexGuard<'a, T>
    where
        T: 'a;
    fn lock_ignoring_poison(&self) -> Self::Guard<'_> {
        self.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// `thread_local!` with `const` initializers: the standard library's, or loom's (whose macro
/// takes no `const` block) under `--cfg leasehold_loom`, since loom's threads share one system
/// thread and so the standard thread-locals.
macro_rules! const_thread_local {
    ($($(#[$attr:meta])* static $name:ident: $t:ty = $init:expr;)*) => {
        #[cfg(not(leasehold_loom))]
        std::thread_local! { $($(#[$attr])* static $name: $t = const { $init };)* }
        #[cfg(leasehold_loom)]
        loom::thread_local! { $($(#[$attr])* static $name: $t = $init;)* }
    };
}
pub(crate) use const_thread_local;

/// loom's waker slot, under the name and methods of `futures`' [`AtomicWaker`].
#[cfg(leasehold_loom)]
#[derive(Debug, Default)]
pub(crate) struct AtomicWaker(loom::future::AtomicWaker);

#[cfg(leasehold_loom)]
impl AtomicWaker {
    pub(crate) fn new() -> Self {
        AtomicWaker::default()
    }

    pub(crate) fn register(&self, waker: &std::task::Waker) {
        self.0.register_by_ref(waker);
    }

    pub(crate) fn wake(&self) {
        self.0.wake();
    }
}

/// A one-shot "finished" flag that can be awaited.
#[derive(Debug)]
pub(crate) struct Completion {
    done: AtomicBool,
    event: Event,
}

impl Default for Completion {
    fn default() -> Self {
        Completion {
            done: AtomicBool::new(false),
            event: Event::new(),
        }
    }
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
pub(crate) struct CompleteOnDrop(pub(crate) std::sync::Arc<Completion>);

impl Drop for CompleteOnDrop {
    fn drop(&mut self) {
        self.0.complete();
    }
}

/// Something to listen to for notifications: event-listener's `Event`, and the model's stand-in.
pub(crate) trait Listen {
    /// Resolves once notified after it was made.
    type Listener: Future<Output = ()>;
    /// A listener for the notifications from now on.
    fn listen(&self) -> Self::Listener;
}

impl Listen for event_listener::Event {
    type Listener = event_listener::EventListener;
    fn listen(&self) -> Self::Listener {
        event_listener::Event::listen(self)
    }
}

/// Waits until `ready` returns a value, re-checking whenever `event` is notified.
///
/// The no-lost-wake-up idiom, written once: listen first, then check, then await. A notification
/// between a check and the `listen` that follows it would otherwise be missed; listening first
/// means it either happened before the check (which then sees it) or wakes the listener.
pub(crate) async fn wait_for<T, E: Listen>(event: &E, mut ready: impl FnMut() -> Option<T>) -> T {
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

/// The part of event-listener's `Event` that the abort signal uses, on loom's mutex.
#[cfg(leasehold_loom)]
mod model_event {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll, Waker};

    use loom::sync::{Arc, Mutex};

    use super::{lock, Listen};

    #[derive(Debug)]
    pub(crate) struct Event {
        state: Arc<Mutex<State>>,
    }

    #[derive(Debug, Default)]
    struct State {
        /// How many notifications there have been: a listener made before the latest one fires.
        notifications: u64,
        next_id: u64,
        wakers: Vec<(u64, Waker)>,
    }

    impl Event {
        pub(crate) fn new() -> Self {
            Event {
                state: Arc::new(Mutex::new(State::default())),
            }
        }

        pub(crate) fn listen(&self) -> EventListener {
            let mut state = lock(&*self.state);
            state.next_id += 1;
            EventListener {
                state: self.state.clone(),
                seen: state.notifications,
                id: state.next_id,
            }
        }

        /// Wakes every listener (the crate only ever notifies all).
        pub(crate) fn notify(&self, _: usize) {
            let wakers = {
                let mut state = lock(&*self.state);
                state.notifications += 1;
                std::mem::take(&mut state.wakers)
            };
            for (_, waker) in wakers {
                waker.wake();
            }
        }
    }

    impl Listen for Event {
        type Listener = EventListener;
        fn listen(&self) -> EventListener {
            Event::listen(self)
        }
    }

    #[derive(Debug)]
    pub(crate) struct EventListener {
        state: Arc<Mutex<State>>,
        seen: u64,
        id: u64,
    }

    impl Future for EventListener {
        type Output = ();

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            let mut state = lock(&*self.state);
            if state.notifications != self.seen {
                return Poll::Ready(());
            }
            state.wakers.retain(|(id, _)| *id != self.id);
            state.wakers.push((self.id, cx.waker().clone()));
            Poll::Pending
        }
    }

    impl Drop for EventListener {
        fn drop(&mut self) {
            lock(&*self.state).wakers.retain(|(id, _)| *id != self.id);
        }
    }
}
