//! Awaiting the storage worker's replies, without paying a thread wake-up when it can be avoided.
//!
//! A reply usually takes one transaction, 10 to 20 microseconds. Letting the executor park the
//! caller's thread meanwhile costs a wake-up when the reply comes, and on small virtual machines
//! that is 25 to 40 microseconds: longer than the work. So a call that is alone in awaiting the
//! worker (the worker is then idle, and its reply at most one transaction away) first *yields*:
//! its future wakes its own task and returns `Pending`, for up to [`YIELD_FOR`]. An executor with
//! other tasks runs them in between; one with nothing else to do polls again at once instead of
//! parking. After that, or as soon as another call is waiting too, it waits to be woken.
//!
//! Yielding pays only when the worker has a CPU to run on while the caller occupies another. On a
//! machine with one CPU it never happens; on an oversubscribed one the worker is starved by the
//! very caller waiting for it, and the reply does not come within [`YIELD_FOR`]. Each such miss
//! doubles the number of calls that then wait without yielding (up to [`MAX_SKIP`]), and a reply
//! that comes while yielding ends the back-off: the cost of a probe is bounded, and the benefit
//! returns by itself when the machine quiets down.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::channel::oneshot;

use super::LockError;

/// How long a call alone in awaiting the worker yields before it waits to be woken.
pub(crate) const YIELD_FOR: Duration = Duration::from_micros(100);

/// The most calls that wait without yielding after replies kept missing [`YIELD_FOR`].
pub(crate) const MAX_SKIP: u32 = 1024;

/// The replies one manager handle awaits, and whether yielding for them pays.
#[derive(Debug, Default)]
pub(crate) struct Replies {
    /// Calls awaiting a reply now.
    awaiting: AtomicUsize,
    /// Calls that will still wait without yielding.
    skip: AtomicU32,
    /// How many the last miss set `skip` to (0 after a hit).
    backoff: AtomicU32,
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

    /// The reply did not come within [`YIELD_FOR`]: skip twice as many calls as last time.
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
                Yielding::Until(Instant::now() + YIELD_FOR)
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
