//! Where time comes from: the system clock, or a test clock that moves only when told.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;

use crate::sync::lock;

/// A source of time: wall-clock time for leases, and sleeping for schedules and heartbeats.
///
/// Times are durations since the Unix epoch so that several processes agree on lease expiry.
pub trait Clock: Send + Sync + 'static {
    /// Wall-clock time since the Unix epoch (shared by processes for lease expiry).
    fn now(&self) -> Duration;
    /// A future that resolves once `duration` has passed on this clock.
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;
}

/// Real time: `SystemTime` for `now`, the `async-io` timer for `sleep` (it runs its own driver
/// thread, so it works under any executor).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::{Clock, SystemClock};
///
/// # futures::executor::block_on(async {
/// let before = SystemClock.now();
/// SystemClock.sleep(Duration::from_millis(2)).await;
/// assert!(SystemClock.now() > before);
/// # });
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let timer = smol::Timer::after(duration);
        Box::pin(async move {
            timer.await;
        })
    }
}

/// A clock for tests: it starts at a fixed epoch (2024-01-01 00:00:00 UTC) and moves only when
/// [`advance`](TestClock::advance) is called, which wakes every sleeper whose deadline has come.
///
/// Clones share one time line.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use futures::FutureExt;
/// use leasehold::{Clock, TestClock};
///
/// let clock = TestClock::new();
/// let start = clock.now();
/// let mut nap = clock.sleep(Duration::from_secs(60));
/// assert!((&mut nap).now_or_never().is_none());
/// clock.advance(Duration::from_secs(60));
/// assert!(nap.now_or_never().is_some());
/// assert_eq!(clock.now() - start, Duration::from_secs(60));
/// ```
#[derive(Clone)]
pub struct TestClock {
    inner: Arc<Mutex<TestClockState>>,
}

struct TestClockState {
    now: Duration,
    next_id: u64,
    // Keyed by (deadline, id) so that `advance` takes the due sleepers from the front.
    sleepers: BTreeMap<(Duration, u64), Option<Waker>>,
}

/// The Unix time at which every [`TestClock`] starts.
const TEST_EPOCH: Duration = Duration::from_secs(1_704_067_200);

impl TestClock {
    /// A clock standing at 2024-01-01 00:00:00 UTC.
    pub fn new() -> Self {
        TestClock {
            inner: Arc::new(Mutex::new(TestClockState {
                now: TEST_EPOCH,
                next_id: 0,
                sleepers: BTreeMap::new(),
            })),
        }
    }

    /// Moves time forward and wakes every sleeper whose deadline has come.
    pub fn advance(&self, by: Duration) {
        let due: Vec<Waker> = {
            let mut state = lock(&self.inner);
            state.now += by;
            let now = state.now;
            let later = state.sleepers.split_off(&(now, u64::MAX));
            let due = std::mem::replace(&mut state.sleepers, later);
            due.into_values().flatten().collect()
        };
        for waker in due {
            waker.wake();
        }
    }

    /// How many sleeps are waiting for time to move: lets a test wait until a task has reached
    /// its sleep before it advances the clock.
    pub fn sleepers(&self) -> usize {
        lock(&self.inner).sleepers.len()
    }
}

impl Default for TestClock {
    fn default() -> Self {
        TestClock::new()
    }
}

impl fmt::Debug for TestClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.inner);
        f.debug_struct("TestClock")
            .field("now", &state.now)
            .field("sleepers", &state.sleepers.len())
            .finish()
    }
}

impl Clock for TestClock {
    fn now(&self) -> Duration {
        lock(&self.inner).now
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let key = {
            let mut state = lock(&self.inner);
            state.next_id += 1;
            let key = (state.now + duration, state.next_id);
            if duration > Duration::ZERO {
                state.sleepers.insert(key, None);
            }
            key
        };
        Box::pin(TestSleep {
            clock: self.inner.clone(),
            key,
        })
    }
}

struct TestSleep {
    clock: Arc<Mutex<TestClockState>>,
    key: (Duration, u64),
}

impl Future for TestSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = lock(&self.clock);
        match state.sleepers.get_mut(&self.key) {
            Some(waker) => {
                *waker = Some(cx.waker().clone());
                Poll::Pending
            }
            None => Poll::Ready(()),
        }
    }
}

impl Drop for TestSleep {
    fn drop(&mut self) {
        lock(&self.clock).sleepers.remove(&self.key);
    }
}
