//! Awaiting the storage worker's replies, without paying a thread wake-up when it can be avoided.
//!
//! A reply usually takes one transaction: about 8 microseconds on SQLite, a round trip and
//! some more on a PostgreSQL server nearby. Letting the executor park the caller's thread
//! meanwhile costs a wake-up when the reply comes, and on small virtual machines that is 25 to 150
//! microseconds: often longer than the work. So a call first *yields*: its future wakes its own
//! task and returns `Pending`, for up to four times as long as the replies to calls alone in
//! awaiting the worker have been taking lately (smoothed), but at least [`YIELD_FOR`] and at most
//! [`YIELD_FOR_ASLEEP`]. An executor with other tasks runs them in between; one with nothing else
//! to do polls again at once instead of parking. Each such poll also yields the thread to the
//! operating system (`sched_yield`), in case the worker shares its CPU. After that, it waits to
//! be woken.
//!
//! One call of a manager at a time yields; the others wait to be woken at once. One is enough:
//! while it yields, its executor thread does not park, so the replies to the other calls on that
//! thread wake it for the price of a flag, not a system call. Under contention that matters
//! twice, since waking a parked thread is work for the storage worker, which is then the
//! bottleneck: with 16 tasks on one thread, a manager did 12 to 15 % more operations a second on
//! SQLite, and 13 to 27 % more on PostgreSQL, than when only a call alone in awaiting yielded.
//!
//! If the worker had gone to sleep, the reply is also one thread wake-up away, and waking a thread
//! whose CPU has gone idle can take hundreds of microseconds on a virtual machine; such a call
//! yields for up to [`YIELD_FOR_ASLEEP`]. It is the call that gets caller and worker back in step:
//! once it has its reply at once, its next call finds the worker still looking for work.
//!
//! Yielding pays only when the worker has a CPU to run on while the caller occupies another. On a
//! machine with one CPU it never happens; on an oversubscribed one the worker is starved by the
//! very caller waiting for it, and the reply does not come within [`YIELD_FOR`]. (A reply also
//! misses its window when the worker has a long queue of this manager's own calls before it, or
//! a busy database to wait for.) Each such miss doubles the number of calls that then wait
//! without yielding (up to [`MAX_SKIP`]), and a reply that comes while yielding ends the
//! back-off: the cost of a probe is bounded, and the benefit returns by itself when the machine
//! quiets down. A yielding call's window is only looked at when it is polled: a call kept but
//! not polled (the loser of a `select`, say) stays the one that yields until it is polled or
//! dropped.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::channel::oneshot;

use crate::lock::LockError;

/// The least a call to an awake worker yields before it waits to be woken.
pub(crate) const YIELD_FOR: Duration = Duration::from_micros(100);

/// How long a call to a sleeping worker yields, and the most any call yields.
/// Were it [`YIELD_FOR`], a caller that once parked (so that the worker went to sleep meanwhile)
/// would miss again on waking it, and back off further each time: the slow path would feed
/// itself. Replies that take longer than this (a server far away) are waited for without
/// yielding, after the misses that show it.
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
    /// How long replies to calls alone in awaiting have been taking, smoothed (micros).
    typical: AtomicU32,
    /// Whether a call is yielding now: one at a time does.
    yielder: AtomicBool,
    /// Whether calls never yield: where the worker is a task polled in turn with its callers
    /// (a simulated manager), a yielding caller would only delay it, and would make the
    /// simulation depend on real time.
    never: AtomicBool,
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
            alone_since: None,
        }
    }

    /// From now on, calls wait to be woken without yielding.
    pub(crate) fn never_yield(&self) {
        self.never.store(true, Relaxed);
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
            (Duration::from_micros(self.typical.load(Relaxed).into()) * 4)
                .clamp(YIELD_FOR, YIELD_FOR_ASLEEP)
        }
    }

    /// A call alone in awaiting had its reply `took` after it was made: the typical time moves
    /// an eighth of the way towards it (at least a microsecond, so that it reaches it).
    fn took(&self, took: Duration) {
        let sample = i64::try_from(took.as_micros()).unwrap_or(i64::MAX);
        let _ = self.typical.fetch_update(Relaxed, Relaxed, |typical| {
            let typical = i64::from(typical);
            let gap = sample.saturating_sub(typical);
            let moved = typical + gap.saturating_add(gap.signum() * 7) / 8;
            Some(u32::try_from(moved).unwrap_or(u32::MAX))
        });
    }

    fn alone(&self) -> bool {
        self.awaiting.load(Relaxed) == 1
    }

    /// Whether a call may start yielding: unless another one yields now, and then it becomes
    /// the one that yields. Counts down the calls left to skip.
    fn may_yield(&self) -> bool {
        if !has_a_cpu_to_spare() || self.never.load(Relaxed) || self.yielder.load(Relaxed) {
            return false;
        }
        self.skip
            .fetch_update(Relaxed, Relaxed, |skip| skip.checked_sub(1))
            .is_err()
            && self
                .yielder
                .compare_exchange(false, true, Relaxed, Relaxed)
                .is_ok()
    }

    /// The call that yielded stopped.
    fn stopped_yielding(&self) {
        self.yielder.store(false, Relaxed);
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
    /// When the call was first polled, if it was then alone in awaiting the worker.
    alone_since: Option<Instant>,
}

impl<T> Future for Response<'_, T> {
    type Output = Result<T, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(reply) = Pin::new(&mut self.receiver).poll(cx) {
            if self.stop_yielding() {
                self.replies.hit();
            }
            if let Some(since) = self.alone_since {
                self.replies.took(since.elapsed());
            }
            // A reply dropped unsent means the worker stopped.
            return Poll::Ready(reply.unwrap_or(Err(LockError::Shutdown)));
        }
        let replies = self.replies;
        match self.yielding {
            Yielding::NotYet => {
                self.alone_since = replies.alone().then(Instant::now);
                self.yielding = if replies.may_yield() {
                    Yielding::Until(Instant::now() + replies.yield_for())
                } else {
                    Yielding::Over
                };
            }
            Yielding::Until(until) if Instant::now() >= until => {
                self.stop_yielding();
                replies.missed();
            }
            Yielding::Until(_) | Yielding::Over => {}
        }
        if let Yielding::Until(_) = self.yielding {
            // After the thread last slept, the scheduler may have woken it on the worker's CPU;
            // polling there without a pause would starve the very transaction it waits for.
            std::thread::yield_now();
            cx.waker().wake_by_ref();
        }
        Poll::Pending
    }
}

impl<T> Response<'_, T> {
    /// Ends this call's yielding, so that another call may yield; returns whether it yielded.
    fn stop_yielding(&mut self) -> bool {
        let yielded = matches!(self.yielding, Yielding::Until(_));
        if yielded {
            self.replies.stopped_yielding();
        }
        self.yielding = Yielding::Over;
        yielded
    }
}

impl<T> Drop for Response<'_, T> {
    fn drop(&mut self) {
        self.replies.awaiting.fetch_sub(1, Relaxed);
        // Dropped while yielding (its caller cancelled): another call may yield now.
        self.stop_yielding();
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
            replies.stopped_yielding();
            let mut skips = 0;
            while !replies.may_yield() {
                skips += 1;
            }
            replies.stopped_yielding();
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

    #[test]
    fn one_call_at_a_time_yields_and_the_next_may_once_it_stops() {
        if !has_a_cpu_to_spare() {
            return;
        }
        let replies = Replies::default();
        assert!(replies.may_yield());
        assert!(!replies.may_yield(), "a second call while the first yields");
        replies.stopped_yielding();
        assert!(replies.may_yield(), "once the first stopped");
        replies.stopped_yielding();
    }

    /// A call's reply, and the call awaiting it.
    type Call<'a> = (
        oneshot::Sender<Result<(), LockError>>,
        Pin<Box<Response<'a, ()>>>,
    );

    /// A call that starts yielding: polled once, before its reply comes.
    fn yielding_call(replies: &Replies) -> Call<'_> {
        let (reply, receiver) = oneshot::channel();
        let mut call = Box::pin(replies.wait(receiver));
        let waker = futures::task::noop_waker();
        assert!(call
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        assert!(matches!(call.yielding, Yielding::Until(_)));
        assert!(!replies.may_yield(), "a second call while the first yields");
        (reply, call)
    }

    /// Each way a yielding call ends lets the next call yield: its reply, the end of its
    /// window, and its cancellation (the future dropped).
    #[test]
    fn every_end_of_a_yielding_call_lets_another_yield() {
        if !has_a_cpu_to_spare() {
            return;
        }
        let replies = Replies::default();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);

        let (reply, mut call) = yielding_call(&replies);
        reply.send(Ok(())).unwrap();
        assert!(matches!(call.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
        drop(call);
        assert!(replies.may_yield(), "after a reply");
        replies.stopped_yielding();

        let (_reply, mut call) = yielding_call(&replies);
        // The window is at most `YIELD_FOR_ASLEEP`: past it, the next poll ends the yield.
        std::thread::sleep(YIELD_FOR_ASLEEP * 2);
        assert!(call.as_mut().poll(&mut cx).is_pending());
        assert!(matches!(call.yielding, Yielding::Over));
        // A miss: the next call skips yielding (the back-off), and none yields meanwhile.
        assert!(!replies.yielder.load(Relaxed), "after the window ran out");
        assert!(
            !replies.may_yield(),
            "the call after a miss waits without yielding"
        );
        assert!(replies.may_yield());
        replies.stopped_yielding();
        drop(call);

        let (_reply, call) = yielding_call(&replies);
        drop(call);
        assert!(replies.may_yield(), "after a cancellation");
    }

    #[test]
    fn a_call_yields_four_times_as_long_as_replies_take_within_bounds() {
        let replies = Replies::default();
        assert_eq!(replies.yield_for(), YIELD_FOR, "no reply seen yet");
        let settle = |took: Duration| {
            for _ in 0..200 {
                replies.took(took);
            }
            replies.yield_for()
        };
        // SQLite: replies of 15 µs; the least yield stands.
        assert_eq!(settle(Duration::from_micros(15)), YIELD_FOR);
        // A PostgreSQL server nearby: a round trip and the server's work.
        let nearby = settle(Duration::from_micros(90));
        assert_eq!(nearby, Duration::from_micros(360));
        // A server far away: replies are not yielded for longer than the most.
        assert_eq!(settle(Duration::from_millis(5)), YIELD_FOR_ASLEEP);
        assert_eq!(settle(Duration::MAX), YIELD_FOR_ASLEEP, "no overflow");
        replies.worker_sleeps();
        assert_eq!(settle(Duration::from_micros(15)), YIELD_FOR_ASLEEP);
    }
}
