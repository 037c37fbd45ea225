//! Awaiting the storage worker's replies, without paying a thread wake-up when it can be avoided.
//!
//! A reply usually takes one transaction, 10 to 20 microseconds. Letting the executor park the
//! caller's thread meanwhile costs a wake-up when the reply comes, and on small virtual machines
//! that is 25 to 150 microseconds: longer than the work. So a call that is alone in awaiting the
//! worker (the worker is then idle, and its reply one transaction away) first *yields*: its future
//! wakes its own task and returns `Pending`, for up to [`YIELD_FOR`]. An executor with other tasks
//! runs them in between; one with nothing else to do polls again at once instead of parking. Each
//! such poll also yields the thread to the operating system (`sched_yield`), in case the worker
//! shares its CPU. After that, or as soon as another call is waiting too, it waits to be woken.
//!
//! If the worker had gone to sleep, the reply is also one thread wake-up away, and waking a thread
//! whose CPU has gone idle can take hundreds of microseconds on a virtual machine; such a call
//! yields for up to [`YIELD_FOR_ASLEEP`]. It is the call that gets caller and worker back in step:
//! once it has its reply at once, its next call finds the worker still looking for work.
//!
//! Yielding pays only when the worker has a CPU to run on while the caller occupies another. On a
//! machine with one CPU it never happens; on an oversubscribed one the worker is starved by the
//! very caller waiting for it, and the reply does not come within [`YIELD_FOR`]. Each such miss
//! doubles the number of calls that then wait without yielding (up to [`MAX_SKIP`]), and a reply
//! that comes while yielding ends the back-off: the cost of a probe is bounded, and the benefit
//! returns by itself when the machine quiets down.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::channel::oneshot;

use super::LockError;

/// How long a call alone in awaiting an awake worker yields before it waits to be woken.
pub(crate) const YIELD_FOR: Duration = Duration::from_micros(100);

/// How long a call alone in awaiting a sleeping worker yields. Were it [`YIELD_FOR`], a caller
/// that once parked (so that the worker went to sleep meanwhile) would miss again on waking it,
/// and back off further each time: the slow path would feed itself.
pub(crate) const YIELD_FOR_ASLEEP: Duration = Duration::from_millis(1);

/// The most calls that wait without yielding after replies kept missing their time.
pub(crate) const MAX_SKIP: u32 = 1024;

/// The replies a manager (with all its clones) awaits, and whether yielding for them pays.
#[derive(Debug, Default)]
pub(crate) struct Replies {
    /// Calls awaiting a reply now.
    awaiting: AtomicUsize,
    /// Calls that will still wait without yielding.
    skip: AtomicU32,
    /// How many the last miss set `skip` to (0 after a hit).
    backoff: AtomicU32,
    /// Whether the worker is blocked waiting for a command.
    worker_asleep: AtomicBool,
}

impl Replies {
    /// Awaits the reply `receiver` will get.
    pub(crate) fn wait<T>(
        &self,
        receiver: oneshot::Receiver<Result<T, LockError>>,
    ) -> Response<'_, T> {
        self.awaiting.fetch_add(1, Relaxed);
        Response {
            replies: self,
            receiver,
            yielding: Yielding::NotYet,
        }
    }

    /// The worker is about to block waiting for a command.
    pub(crate) fn worker_sleeps(&self) {
        self.worker_asleep.store(true, Relaxed);
    }

    /// The worker is back from waiting.
    pub(crate) fn worker_wakes(&self) {
        self.worker_asleep.store(false, Relaxed);
    }

    /// How long a call that starts yielding now may yield.
    fn yield_for(&self) -> Duration {
        if self.worker_asleep.load(Relaxed) {
            YIELD_FOR_ASLEEP
        } else {
            YIELD_FOR
        }
    }

    fn alone(&self) -> bool {
        self.awaiting.load(Relaxed) == 1
    }

    /// Whether a call may start yielding; counts down the calls left to skip.
    fn may_yield(&self) -> bool {
        if !has_a_cpu_to_spare() {
            return false;
        }
        self.skip
            .fetch_update(Relaxed, Relaxed, |skip| skip.checked_sub(1))
            .is_err()
    }

    /// The reply came while its caller yielded: yielding pays.
    fn hit(&self) {
        self.backoff.store(0, Relaxed);
    }

    /// The reply did not come while its caller yielded: skip twice as many calls as last time.
    fn missed(&self) {
        let backoff = (self.backoff.load(Relaxed) * 2).clamp(1, MAX_SKIP);
        self.backoff.store(backoff, Relaxed);
        self.skip.store(backoff, Relaxed);
    }
}

fn has_a_cpu_to_spare() -> bool {
    static SPARE: OnceLock<bool> = OnceLock::new();
    *SPARE.get_or_init(|| std::thread::available_parallelism().is_ok_and(|n| n.get() > 1))
}

enum Yielding {
    NotYet,
    Until(Instant),
    Over,
}

/// The worker's reply to one command; see the module documentation.
pub(crate) struct Response<'a, T> {
    replies: &'a Replies,
    receiver: oneshot::Receiver<Result<T, LockError>>,
    yielding: Yielding,
}

impl<T> Future for Response<'_, T> {
    type Output = Result<T, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(reply) = Pin::new(&mut self.receiver).poll(cx) {
            if let Yielding::Until(_) = self.yielding {
                self.replies.hit();
            }
            // A reply dropped unsent means the worker stopped.
            return Poll::Ready(reply.unwrap_or(Err(LockError::Shutdown)));
        }
        let replies = self.replies;
        self.yielding = match self.yielding {
            Yielding::NotYet if replies.alone() && replies.may_yield() => {
                Yielding::Until(Instant::now() + replies.yield_for())
            }
            Yielding::Until(until) if Instant::now() >= until => {
                replies.missed();
                Yielding::Over
            }
            // Another call awaits the worker too: the worker is busy, and that call's reply
            // will come in the same batch or before this one.
            Yielding::Until(_) if !replies.alone() => Yielding::Over,
            Yielding::Until(until) => Yielding::Until(until),
            Yielding::NotYet | Yielding::Over => Yielding::Over,
        };
        if let Yielding::Until(_) = self.yielding {
            // After the thread last slept, the scheduler may have woken it on the worker's CPU;
            // polling there without a pause would starve the very transaction it waits for.
            std::thread::yield_now();
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }
}

impl<T> Drop for Response<'_, T> {
    fn drop(&mut self) {
        self.replies.awaiting.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_double_the_calls_skipped_up_to_the_cap_and_a_hit_ends_the_back_off() {
        if !has_a_cpu_to_spare() {
            return;
        }
        let replies = Replies::default();
        let mut skipped = Vec::new();
        for _ in 0..13 {
            assert!(replies.may_yield());
            replies.missed();
            let mut skips = 0;
            while !replies.may_yield() {
                skips += 1;
            }
            skipped.push(skips);
        }
        assert_eq!(
            skipped,
            [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024, 1024]
        );
        replies.hit();
        replies.missed();
        assert!(!replies.may_yield(), "a miss after a hit skips one call");
        assert!(replies.may_yield());
    }
}
