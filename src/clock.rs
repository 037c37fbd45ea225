//! Where time comes from: the system clock, or a test clock that moves only when told.
//!
//! A clock has two time lines. Wall time ([`Clock::now`]) is shared by processes, and judges
//! leases where nothing better is shared; it may be stepped (by NTP, or when a suspended machine
//! wakes). Monotonic time
//! ([`Clock::monotonic`]) only moves forward, at the rate of real time: schedules, timeouts and
//! sleeps are measured on it, so a step of the wall clock never changes when they fire.
//!
//! A clock may also tell the time since its machine booted ([`Clock::boot_time`]), a time line
//! that every process on the machine shares and that no step moves: SQLite stores, which the
//! processes of one machine share, judge leases by it.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;

use crate::sync::lock;

/// A source of time: wall-clock time (what an operator is shown, and what leases are judged by
/// where no boot time is given), monotonic time and sleeping for schedules, timeouts and
/// heartbeats, and the machine's boot time, which SQLite stores judge leases by.
///
/// Wall times are durations since the Unix epoch so that several processes agree on them.
///
/// # Examples
///
/// A clock of your own needs only `now` and `sleep`; it should also give `monotonic` if its
/// wall time can be stepped, and `boot_time` if its managers share SQLite files (a manager whose
/// clock gives none is refused a file whose leases are judged by the machine's boot clock).
///
/// ```
/// use std::time::{Duration, Instant};
/// use futures::future::BoxFuture;
/// use leasehold::{BootTime, Clock, SystemClock};
///
/// /// The system clock, seen from a process whose wall clock runs an hour ahead.
/// struct AnHourAhead;
/// impl Clock for AnHourAhead {
///     fn now(&self) -> Duration {
///         SystemClock.now() + Duration::from_secs(3600)
///     }
///     fn monotonic(&self) -> Duration {
///         SystemClock.monotonic()
///     }
///     fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
///         SystemClock.sleep(duration)
///     }
///     fn boot_time(&self) -> Option<BootTime> {
///         SystemClock.boot_time()
///     }
/// }
/// assert!(AnHourAhead.now() > SystemClock.now());
/// ```
pub trait Clock: Send + Sync + 'static {
    /// Wall-clock time since the Unix epoch, shared by processes. It may jump
    /// either way when the system clock is stepped.
    fn now(&self) -> Duration;

    /// Monotonic time since an arbitrary origin fixed for the life of the clock: it never goes
    /// back and is not moved by steps of the wall clock. Only differences between readings mean
    /// anything. Schedules and timeouts are measured on it.
    ///
    /// The default is [`now`](Clock::now), which keeps clocks written before this method
    /// existed working as they did; a clock whose wall time can be stepped should override it.
    fn monotonic(&self) -> Duration {
        self.now()
    }

    /// A future that resolves once `duration` has passed on this clock's monotonic time line.
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;

    /// The time since this machine booted, as every process on it reads it, and which boot
    /// that is; `None` where the clock cannot tell (the default).
    ///
    /// Unlike [`now`](Clock::now) it is never stepped, and unlike
    /// [`monotonic`](Clock::monotonic) its origin is the same for every process of the
    /// machine, so processes can compare readings. A SQLite store judges leases by it
    /// (recording the boot in the file, so that rows of an earlier boot are known dead); a
    /// manager whose clock gives none judges them by its wall time, which a step of the
    /// system clock moves for every process at once (see the README on clock steps).
    ///
    /// It must move at the rate of [`monotonic`](Clock::monotonic), and never faster: a lease
    /// judged by it must not run out before the deadline this process keeps for it on the
    /// monotonic time line. A clock that overrides one of them should override both from one
    /// source.
    fn boot_time(&self) -> Option<BootTime> {
        None
    }
}

/// A reading of the time since a machine booted ([`Clock::boot_time`]).
///
/// # Examples
///
/// ```
/// use leasehold::{Clock, SystemClock};
///
/// if let Some(first) = SystemClock.boot_time() {
///     let second = SystemClock.boot_time().unwrap();
///     assert_eq!(first.boot, second.boot);
///     assert!(second.since_boot >= first.since_boot);
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BootTime {
    /// Which boot of the machine this is: a different number after every restart (on Linux,
    /// `/proc/sys/kernel/random/boot_id`).
    pub boot: u128,
    /// The time since that boot, time spent suspended left out, as
    /// [`monotonic`](Clock::monotonic) leaves it out: a suspension counts for no process of the
    /// machine, so none finds another's lease run out by it.
    pub since_boot: Duration,
}

/// Real time: `SystemTime` for `now`, `Instant` for `monotonic`, the `async-io` timer for
/// `sleep` (it runs its own driver thread, so it works under any executor, and waits on
/// monotonic time), and on Linux `CLOCK_MONOTONIC` (the clock `Instant` reads, whose origin is
/// the boot, the same for every process) with the kernel's boot id for
/// [`boot_time`](Clock::boot_time) (elsewhere none: see [`Clock::boot_time`]).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::{Clock, SystemClock};
///
/// # futures::executor::block_on(async {
/// let before = SystemClock.monotonic();
/// SystemClock.sleep(Duration::from_millis(2)).await;
/// assert!(SystemClock.monotonic() - before >= Duration::from_millis(2));
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

    fn monotonic(&self) -> Duration {
        // One origin for the whole process, so that readings from any `SystemClock` compare.
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let timer = smol::Timer::after(duration);
        Box::pin(async move {
            timer.await;
        })
    }

    fn boot_time(&self) -> Option<BootTime> {
        system_boot_time()
    }
}

/// `CLOCK_MONOTONIC`, with the boot id the kernel gives (read until it is read once).
///
/// Not `CLOCK_BOOTTIME`, which counts time suspended: the timers and `monotonic` (`Instant`) do
/// not, so after a suspension the store's time would have run ahead of every deadline kept.
#[cfg(any(target_os = "linux", target_os = "android"))]
#[allow(unsafe_code)]
fn system_boot_time() -> Option<BootTime> {
    static BOOT: OnceLock<u128> = OnceLock::new();
    let boot = match BOOT.get() {
        Some(&boot) => boot,
        None => {
            let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
            *BOOT.get_or_init(|| parse_boot_id(&text).unwrap_or(0))
        }
    };
    if boot == 0 {
        return None;
    }
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes one `timespec`, which `time` is, and reads nothing else.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut time) } != 0 {
        return None;
    }
    let since_boot = Duration::new(
        u64::try_from(time.tv_sec).ok()?,
        u32::try_from(time.tv_nsec).ok()?,
    );
    Some(BootTime { boot, since_boot })
}

/// No shared clock that never steps is read here (yet): leases are judged by wall time.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn system_boot_time() -> Option<BootTime> {
    None
}

/// A boot id as the kernel writes it (a UUID, `8-4-4-4-12` hexadecimal digits), as a number.
#[cfg_attr(not(any(target_os = "linux", target_os = "android")), allow(dead_code))]
fn parse_boot_id(text: &str) -> Option<u128> {
    let digits: String = text.trim().chars().filter(|c| *c != '-').collect();
    if digits.len() != 32 {
        return None;
    }
    u128::from_str_radix(&digits, 16).ok()
}

/// A clock for tests: it starts at a fixed epoch (2024-01-01 00:00:00 UTC) and moves only when
/// [`advance`](TestClock::advance) is called, which moves wall and monotonic time together and
/// wakes every sleeper whose deadline has come. [`set_wall_time`](TestClock::set_wall_time)
/// steps the wall time alone, either way, as NTP would.
///
/// Clones share one time line. Its [`boot_time`](Clock::boot_time) is its monotonic time, on
/// one boot that every `TestClock` shares ([`TestClock::BOOT`]): the managers of a test that
/// share a clone share a machine, as the processes of one machine do.
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
    monotonic: Duration,
    next_id: u64,
    // Keyed by (monotonic deadline, id) so that `advance` takes the due sleepers from the front.
    sleepers: BTreeMap<(Duration, u64), Option<Waker>>,
}

/// The Unix time at which every [`TestClock`] starts.
const TEST_EPOCH: Duration = Duration::from_secs(1_704_067_200);

impl TestClock {
    /// The boot every `TestClock` reports in [`boot_time`](Clock::boot_time).
    pub const BOOT: u128 = 0x7e57_c10c;

    /// A clock standing at 2024-01-01 00:00:00 UTC.
    pub fn new() -> Self {
        TestClock {
            inner: Arc::new(Mutex::new(TestClockState {
                now: TEST_EPOCH,
                monotonic: Duration::ZERO,
                next_id: 0,
                sleepers: BTreeMap::new(),
            })),
        }
    }

    /// Moves wall and monotonic time forward and wakes every sleeper whose deadline has come.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{Clock, TestClock};
    ///
    /// let clock = TestClock::new();
    /// let (wall, monotonic) = (clock.now(), clock.monotonic());
    /// clock.advance(Duration::from_secs(5));
    /// assert_eq!(clock.now() - wall, Duration::from_secs(5));
    /// assert_eq!(clock.monotonic() - monotonic, Duration::from_secs(5));
    /// ```
    pub fn advance(&self, by: Duration) {
        let due: Vec<Waker> = {
            let mut state = lock(&self.inner);
            // Saturating, as sleeps' deadlines do: advancing by `Duration::MAX` wakes them all.
            state.now = state.now.saturating_add(by);
            state.monotonic = state.monotonic.saturating_add(by);
            let monotonic = state.monotonic;
            let later = state.sleepers.split_off(&(monotonic, u64::MAX));
            let due = std::mem::replace(&mut state.sleepers, later);
            due.into_values().flatten().collect()
        };
        for waker in due {
            waker.wake();
        }
    }

    /// Steps the wall time alone to `since_epoch`, forward or back, as NTP (or a machine waking
    /// from suspend) would. Monotonic time does not move and no sleeper wakes: schedules,
    /// timeouts and sleeps carry on as if nothing happened, while leases judged by wall time
    /// see the jump.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use futures::FutureExt;
    /// use leasehold::{Clock, TestClock};
    ///
    /// let clock = TestClock::new();
    /// let hour = Duration::from_secs(3600);
    /// let (wall, monotonic) = (clock.now(), clock.monotonic());
    /// let mut nap = clock.sleep(Duration::from_secs(1));
    /// clock.set_wall_time(wall + hour);
    /// assert_eq!(clock.now(), wall + hour);
    /// assert_eq!(clock.monotonic(), monotonic);
    /// assert!((&mut nap).now_or_never().is_none(), "no sleeper woke");
    /// clock.set_wall_time(wall - hour);
    /// assert_eq!(clock.now(), wall - hour);
    /// ```
    pub fn set_wall_time(&self, since_epoch: Duration) {
        lock(&self.inner).now = since_epoch;
    }

    /// How many sleeps are waiting for time to move: lets a test wait until a task has reached
    /// its sleep before it advances the clock.
    ///
    /// It counts every sleep on this clock, the library's own among them: a lock manager built
    /// with this clock sleeps between heartbeats and polls, and a timeout that someone awaits
    /// sleeps until its deadline. Inside a simulation (the `testkit` feature's) there is no need
    /// to count: its clock moves by itself to the next deadline when nothing else can run.
    pub fn sleepers(&self) -> usize {
        lock(&self.inner).sleepers.len()
    }

    /// The monotonic time at which the earliest pending sleep ends, if any sleep is pending:
    /// where to [`advance`](TestClock::advance) it to run the next timer, and no further.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{Clock, TestClock};
    ///
    /// let clock = TestClock::new();
    /// assert_eq!(clock.next_deadline(), None);
    /// let _sleep = clock.sleep(Duration::from_secs(5));
    /// assert_eq!(clock.next_deadline(), Some(clock.monotonic() + Duration::from_secs(5)));
    /// ```
    pub fn next_deadline(&self) -> Option<Duration> {
        lock(&self.inner)
            .sleepers
            .keys()
            .next()
            .map(|(deadline, _)| *deadline)
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
            .field("monotonic", &state.monotonic)
            .field("sleepers", &state.sleepers.len())
            .finish()
    }
}

impl Clock for TestClock {
    fn now(&self) -> Duration {
        lock(&self.inner).now
    }

    /// Starts at zero; moved only by [`advance`](TestClock::advance).
    fn monotonic(&self) -> Duration {
        lock(&self.inner).monotonic
    }

    /// The monotonic time, on the boot [`TestClock::BOOT`]: no wall-clock step moves it.
    fn boot_time(&self) -> Option<BootTime> {
        Some(BootTime {
            boot: TestClock::BOOT,
            since_boot: self.monotonic(),
        })
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let key = {
            let mut state = lock(&self.inner);
            state.next_id += 1;
            let key = (state.monotonic.saturating_add(duration), state.next_id);
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
