//! Schedules as values: when, and whether, to go again.
//!
//! A schedule is a tree of [`Kind`] nodes. Driving it is a pure step function
//! ([`ScheduleRun::next`]): given the time a run ended, it says how long to wait before the next
//! run, or that there is none. `retry` and `repeat` are thin loops around it with a [`Clock`],
//! so all the arithmetic is tested without time passing. They give it monotonic times
//! ([`Clock::monotonic`]): wall time can be stepped back and forth, which would stretch or cut
//! short `up_to` and move `fixed`'s grid.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;

#[derive(Clone, Debug)]
enum Kind {
    Spaced(Duration),
    Fixed(Duration),
    Exponential { base: Duration, factor: f64 },
    Recurs(usize),
    Jittered(Box<Kind>),
    Capped(Box<Kind>, Duration),
    UpTo(Box<Kind>, Duration),
    Union(Box<Kind>, Box<Kind>),
    Intersect(Box<Kind>, Box<Kind>),
}

/// A value that decides whether and when to go again; drives [`retry`](Schedule::retry) and
/// [`repeat`](Schedule::repeat).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::Schedule;
///
/// // Back off from 10 ms, doubling, at most 5 more attempts, for at most 2 s in all.
/// let backoff = Schedule::exponential(Duration::from_millis(10), 2.0)
///     .jittered()
///     .intersect(Schedule::recurs(5))
///     .up_to(Duration::from_secs(2));
/// # futures::executor::block_on(async {
/// let mut calls = 0;
/// let result: Result<u32, &str> = backoff
///     .retry(|| {
///         calls += 1;
///         let ok = calls == 3;
///         async move { if ok { Ok(7) } else { Err("busy") } }
///     })
///     .await;
/// assert_eq!(result, Ok(7));
/// # });
/// ```
#[derive(Clone)]
pub struct Schedule {
    kind: Kind,
    pub(crate) clock: Option<Arc<dyn Clock>>,
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schedule")
            .field("kind", &self.kind)
            .field("custom_clock", &self.clock.is_some())
            .finish()
    }
}

impl Schedule {
    fn of(kind: Kind) -> Self {
        Schedule { kind, clock: None }
    }

    fn combine(self, other: Schedule, node: fn(Box<Kind>, Box<Kind>) -> Kind) -> Self {
        Schedule {
            clock: self.clock.or(other.clock),
            kind: node(Box::new(self.kind), Box::new(other.kind)),
        }
    }

    /// Forever; `interval` after each run ends.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let mut run = Schedule::spaced(Duration::from_secs(5)).start(Duration::ZERO);
    /// assert_eq!(run.next(Duration::from_secs(1)), Some(Duration::from_secs(5)));
    /// ```
    pub fn spaced(interval: Duration) -> Self {
        Schedule::of(Kind::Spaced(interval))
    }

    /// Forever; runs start on a grid of `interval` from the first start. A run that overran its
    /// slot is followed at once, and then the grid resumes: missed slots are not made up in a
    /// burst.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let s = Duration::from_secs;
    /// let mut run = Schedule::fixed(s(10)).start(s(0));
    /// assert_eq!(run.next(s(3)), Some(s(7)));   // next slot at 10
    /// assert_eq!(run.next(s(25)), Some(s(0)));  // overran: at once
    /// assert_eq!(run.next(s(27)), Some(s(3)));  // back on the grid at 30
    /// ```
    pub fn fixed(interval: Duration) -> Self {
        Schedule::of(Kind::Fixed(interval))
    }

    /// Forever; `base`, `base * factor`, `base * factor^2`, ... (saturating at `Duration::MAX`).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let ms = Duration::from_millis;
    /// let mut run = Schedule::exponential(ms(10), 2.0).start(ms(0));
    /// assert_eq!(run.next(ms(0)), Some(ms(10)));
    /// assert_eq!(run.next(ms(0)), Some(ms(20)));
    /// assert_eq!(run.next(ms(0)), Some(ms(40)));
    /// ```
    pub fn exponential(base: Duration, factor: f64) -> Self {
        Schedule::of(Kind::Exponential { base, factor })
    }

    /// `times` more runs, with no delay.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let mut run = Schedule::recurs(1).start(Duration::ZERO);
    /// assert_eq!(run.next(Duration::ZERO), Some(Duration::ZERO));
    /// assert_eq!(run.next(Duration::ZERO), None);
    /// ```
    pub fn recurs(times: usize) -> Self {
        Schedule::of(Kind::Recurs(times))
    }

    /// Each delay multiplied by a uniform draw in `[0.8, 1.2)`.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let mut run = Schedule::spaced(Duration::from_secs(10)).jittered().start(Duration::ZERO);
    /// let delay = run.next(Duration::ZERO).unwrap();
    /// assert!(delay >= Duration::from_secs(8) && delay < Duration::from_secs(12));
    /// ```
    pub fn jittered(self) -> Self {
        Schedule {
            kind: Kind::Jittered(Box::new(self.kind)),
            clock: self.clock,
        }
    }

    /// Each delay at most `max_delay`; the schedule goes on (or stops) as before.
    ///
    /// Put [`jittered`](Schedule::jittered) after it for back-off that spreads out even at
    /// the cap (delays in `[0.8, 1.2) x max_delay`), or before it for a hard ceiling.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let ms = Duration::from_millis;
    /// let mut run = Schedule::exponential(ms(10), 2.0).capped(ms(30)).start(ms(0));
    /// assert_eq!(run.next(ms(0)), Some(ms(10)));
    /// assert_eq!(run.next(ms(0)), Some(ms(20)));
    /// assert_eq!(run.next(ms(0)), Some(ms(30)));
    /// assert_eq!(run.next(ms(0)), Some(ms(30)));
    /// ```
    pub fn capped(self, max_delay: Duration) -> Self {
        Schedule {
            kind: Kind::Capped(Box::new(self.kind), max_delay),
            clock: self.clock,
        }
    }

    /// Stops once `max_elapsed` has passed since the first run started.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let s = Duration::from_secs;
    /// let mut run = Schedule::spaced(s(1)).up_to(s(5)).start(s(0));
    /// assert_eq!(run.next(s(4)), Some(s(1)));
    /// assert_eq!(run.next(s(5)), None);
    /// ```
    pub fn up_to(self, max_elapsed: Duration) -> Self {
        Schedule {
            kind: Kind::UpTo(Box::new(self.kind), max_elapsed),
            clock: self.clock,
        }
    }

    /// Goes on while either does, with the shorter delay.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let s = Duration::from_secs;
    /// let mut run = Schedule::recurs(1).union(Schedule::spaced(s(3))).start(s(0));
    /// assert_eq!(run.next(s(0)), Some(s(0)));
    /// assert_eq!(run.next(s(0)), Some(s(3)));
    /// ```
    pub fn union(self, other: Schedule) -> Self {
        self.combine(other, Kind::Union)
    }

    /// Goes on while both do, with the longer delay.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let s = Duration::from_secs;
    /// let mut run = Schedule::recurs(1).intersect(Schedule::spaced(s(3))).start(s(0));
    /// assert_eq!(run.next(s(0)), Some(s(3)));
    /// assert_eq!(run.next(s(0)), None);
    /// ```
    pub fn intersect(self, other: Schedule) -> Self {
        self.combine(other, Kind::Intersect)
    }

    /// Sleeps and reads time on `clock` (default: [`SystemClock`](crate::SystemClock), or inside a
    /// simulation its clock), on its monotonic time line ([`Clock::monotonic`]), so that a step of
    /// the wall clock changes no decision.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use leasehold::{Schedule, TestClock};
    ///
    /// let clock = TestClock::new();
    /// let schedule = Schedule::spaced(Duration::from_secs(60)).with_clock(Arc::new(clock.clone()));
    /// # let _ = schedule;
    /// ```
    pub fn with_clock(self, clock: Arc<dyn Clock>) -> Self {
        Schedule {
            kind: self.kind,
            clock: Some(clock),
        }
    }

    /// Starts stepping the schedule by hand; `at` is when the first run starts, on any time line
    /// that only moves forward (`retry` and `repeat` use [`Clock::monotonic`]).
    ///
    /// [`retry`](Schedule::retry) and [`repeat`](Schedule::repeat) use this; it is public for
    /// loops of your own and for tests.
    pub fn start(&self, at: Duration) -> ScheduleRun {
        ScheduleRun {
            kind: self.kind.clone(),
            state: State::new(&self.kind, at),
            start: at,
        }
    }

    fn clock(&self) -> Arc<dyn Clock> {
        self.clock
            .clone()
            .unwrap_or_else(crate::scope::ambient_clock)
    }

    /// Runs `attempt`; on `Err` asks the schedule, sleeps, runs again. `recurs(3)` means 4
    /// attempts. Returns the first `Ok`, or the last `Err` when the schedule is done.
    ///
    /// # Cancel safety
    ///
    /// Dropping this future drops the attempt in progress (or the sleep); no further attempt
    /// is made. Wrap it in a [`Scoped`](crate::Scoped) for clean-up that must run.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::Schedule;
    ///
    /// # futures::executor::block_on(async {
    /// let mut attempts = 0;
    /// let result: Result<(), u32> = Schedule::recurs(3)
    ///     .retry(|| {
    ///         attempts += 1;
    ///         let n = attempts;
    ///         async move { Err(n) }
    ///     })
    ///     .await;
    /// assert_eq!(result, Err(4));
    /// # });
    /// ```
    pub async fn retry<T, E, F, Fut>(&self, attempt: F) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.retry_while(attempt, |_| true).await
    }

    /// As [`retry`](Schedule::retry), but only errors for which `retry_if` holds are retried;
    /// others return at once.
    ///
    /// # Cancel safety
    ///
    /// As for [`retry`](Schedule::retry): dropping it drops the attempt in progress or the sleep.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::Schedule;
    ///
    /// # futures::executor::block_on(async {
    /// let mut attempts = 0;
    /// let result: Result<(), &str> = Schedule::recurs(5)
    ///     .retry_while(
    ///         || {
    ///             attempts += 1;
    ///             let error = if attempts < 3 { "busy" } else { "forbidden" };
    ///             async move { Err(error) }
    ///         },
    ///         |error| *error == "busy",
    ///     )
    ///     .await;
    /// assert_eq!((result, attempts), (Err("forbidden"), 3));
    /// # });
    /// ```
    ///
    /// Retrying [`try_acquire`](crate::LockManager::try_acquire) on a fixed spacing. A busy lock
    /// is `Ok(None)`, not an error, so a plain `retry` would stop after the first attempt: turn
    /// "busy" into an error of its own (here `None`), and retry only that one, so that a storage
    /// error returns at once.
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{LockError, LockManager, LockRequest, Schedule};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let held = locks.exclusive("repo/photos", "prune").await?;
    ///
    /// // Err(Some(error)): storage failed; Err(None): still busy.
    /// let try_backup = || async {
    ///     let request = LockRequest::shared("repo/photos", "backup");
    ///     locks.try_acquire(request).await.map_err(Some)?.ok_or(None)
    /// };
    /// let busy = |error: &Option<LockError>| error.is_none();
    /// let every_5ms_for_50ms =
    ///     Schedule::fixed(Duration::from_millis(5)).up_to(Duration::from_millis(50));
    ///
    /// let attempt = every_5ms_for_50ms.retry_while(try_backup, busy).await;
    /// assert!(matches!(attempt, Err(None)), "busy for the whole schedule");
    ///
    /// held.release().await?;
    /// let guard = every_5ms_for_50ms.retry_while(try_backup, busy).await;
    /// assert!(guard.is_ok());
    /// # Ok::<(), LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn retry_while<T, E, F, Fut, P>(
        &self,
        mut attempt: F,
        mut retry_if: P,
    ) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        P: FnMut(&E) -> bool,
    {
        let clock = self.clock();
        let mut run = self.start(clock.monotonic());
        loop {
            let error = match attempt().await {
                Ok(value) => return Ok(value),
                Err(error) if retry_if(&error) => error,
                Err(error) => return Err(error),
            };
            match run.next(clock.monotonic()) {
                None => return Err(error),
                Some(delay) => {
                    drop(error);
                    pause(&*clock, delay).await;
                }
            }
        }
    }

    /// Runs `action` once, then again per the schedule while it returns `Ok`. `recurs(3)`: 4
    /// runs. Returns the last `Ok`, or the first `Err`.
    ///
    /// # Cancel safety
    ///
    /// As for [`retry`](Schedule::retry): dropping it drops the run in progress or the sleep.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::Schedule;
    ///
    /// # futures::executor::block_on(async {
    /// let mut runs = 0;
    /// let last: Result<u32, ()> = Schedule::recurs(3)
    ///     .repeat(|| {
    ///         runs += 1;
    ///         let n = runs;
    ///         async move { Ok(n) }
    ///     })
    ///     .await;
    /// assert_eq!(last, Ok(4));
    /// # });
    /// ```
    pub async fn repeat<T, E, F, Fut>(&self, mut action: F) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let clock = self.clock();
        let mut run = self.start(clock.monotonic());
        loop {
            let value = action().await?;
            match run.next(clock.monotonic()) {
                None => return Ok(value),
                Some(delay) => {
                    drop(value);
                    pause(&*clock, delay).await;
                }
            }
        }
    }
}

async fn pause(clock: &dyn Clock, delay: Duration) {
    if !delay.is_zero() {
        clock.sleep(delay).await;
    }
}

/// A schedule being stepped: see [`Schedule::start`].
#[derive(Clone, Debug)]
pub struct ScheduleRun {
    kind: Kind,
    state: State,
    start: Duration,
}

impl ScheduleRun {
    /// Called when a run ends at time `ended_at`: how long to wait before the next run, or
    /// `None` when the schedule is done.
    pub fn next(&mut self, ended_at: Duration) -> Option<Duration> {
        self.next_with(ended_at, &mut jitter_draw)
    }

    /// Called when a run ends at time `ended_at`: when the next run should start, on the same
    /// time line (`ended_at` plus the delay [`next`](ScheduleRun::next) gives), or `None` when
    /// the schedule is done.
    ///
    /// This reads the schedule without sleeping, for a loop that waits in its own way: a plain
    /// thread blocked on a channel with a timeout, or a caller that learns only later when
    /// the run it counts from really ended.
    ///
    /// # Examples
    ///
    /// A thread that does its own work between runs, and runs on a schedule of monotonic time:
    ///
    /// ```
    /// use std::sync::mpsc;
    /// use std::time::Duration;
    /// use leasehold::{Clock, Schedule, SystemClock};
    ///
    /// let (tx, rx) = mpsc::channel::<&str>();
    /// let ticker = std::thread::spawn(move || {
    ///     let clock = SystemClock;
    ///     let mut run = Schedule::fixed(Duration::from_millis(5)).start(clock.monotonic());
    ///     let mut runs = 0;
    ///     let mut next = clock.monotonic(); // the first run at once
    ///     loop {
    ///         match rx.recv_timeout(next.saturating_sub(clock.monotonic())) {
    ///             Ok(_message) => {}                              // work, then wait again
    ///             Err(mpsc::RecvTimeoutError::Disconnected) => return runs,
    ///             Err(mpsc::RecvTimeoutError::Timeout) => {}
    ///         }
    ///         if clock.monotonic() >= next {
    ///             runs += 1;                                      // the scheduled run
    ///             next = run.next_at(clock.monotonic()).expect("fixed goes on forever");
    ///         }
    ///     }
    /// });
    /// tx.send("hello").unwrap();
    /// std::thread::sleep(Duration::from_millis(20));
    /// drop(tx);
    /// assert!(ticker.join().unwrap() >= 2);
    /// ```
    pub fn next_at(&mut self, ended_at: Duration) -> Option<Duration> {
        self.next(ended_at)
            .map(|delay| ended_at.saturating_add(delay))
    }

    /// Starts over, as if the schedule had just been [`start`](Schedule::start)ed at `at`:
    /// exponential delays fall back to their base, `recurs` and `up_to` count afresh, `fixed`
    /// lays its grid from `at`. For a back-off that should begin again after a success.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::Schedule;
    ///
    /// let ms = Duration::from_millis;
    /// let mut backoff = Schedule::exponential(ms(10), 2.0).start(ms(0));
    /// assert_eq!(backoff.next(ms(0)), Some(ms(10)));
    /// assert_eq!(backoff.next(ms(10)), Some(ms(20)));
    /// backoff.reset(ms(30)); // the attempt succeeded
    /// assert_eq!(backoff.next(ms(500)), Some(ms(10)));
    /// ```
    pub fn reset(&mut self, at: Duration) {
        self.state.reset(at);
        self.start = at;
    }

    /// [`next`](ScheduleRun::next) with the jitter draws (in `[0, 1)`) supplied by the caller.
    pub(crate) fn next_with(
        &mut self,
        ended_at: Duration,
        draw: &mut dyn FnMut() -> f64,
    ) -> Option<Duration> {
        step(&self.kind, &mut self.state, self.start, ended_at, draw)
    }
}

/// Per-node state, shaped like the `Kind` tree.
#[derive(Clone, Debug)]
struct State {
    /// Decisions made so far.
    steps: u64,
    /// `Fixed`: when the last run was scheduled to start.
    last: Duration,
    children: Vec<State>,
}

impl State {
    fn new(kind: &Kind, start: Duration) -> Self {
        let children = match kind {
            Kind::Jittered(inner) | Kind::Capped(inner, _) | Kind::UpTo(inner, _) => {
                vec![State::new(inner, start)]
            }
            Kind::Union(a, b) | Kind::Intersect(a, b) => {
                vec![State::new(a, start), State::new(b, start)]
            }
            _ => Vec::new(),
        };
        State {
            steps: 0,
            last: start,
            children,
        }
    }

    /// As `State::new(kind, start)` for the kind this state was made for, without allocating.
    fn reset(&mut self, start: Duration) {
        self.steps = 0;
        self.last = start;
        for child in &mut self.children {
            child.reset(start);
        }
    }
}

fn step(
    kind: &Kind,
    state: &mut State,
    start: Duration,
    now: Duration,
    draw: &mut dyn FnMut() -> f64,
) -> Option<Duration> {
    let decision = match kind {
        Kind::Spaced(interval) => Some(*interval),
        Kind::Fixed(interval) => Some(fixed_delay(*interval, start, &mut state.last, now)),
        Kind::Exponential { base, factor } => {
            let exponent = i32::try_from(state.steps).unwrap_or(i32::MAX);
            Some(scale(*base, factor.powi(exponent)))
        }
        Kind::Recurs(times) => (state.steps < *times as u64).then_some(Duration::ZERO),
        Kind::Jittered(inner) => step(inner, &mut state.children[0], start, now, draw)
            .map(|delay| scale(delay, 0.8 + 0.4 * draw())),
        Kind::Capped(inner, max_delay) => {
            step(inner, &mut state.children[0], start, now, draw).map(|delay| delay.min(*max_delay))
        }
        Kind::UpTo(inner, max_elapsed) => {
            let inner = step(inner, &mut state.children[0], start, now, draw);
            inner.filter(|_| now.saturating_sub(start) < *max_elapsed)
        }
        Kind::Union(a, b) | Kind::Intersect(a, b) => {
            let (left, right) = state.children.split_at_mut(1);
            let a = step(a, &mut left[0], start, now, draw);
            let b = step(b, &mut right[0], start, now, draw);
            match (kind, a, b) {
                (Kind::Union(..), Some(a), Some(b)) => Some(a.min(b)),
                (Kind::Union(..), a, b) => a.or(b),
                (_, Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            }
        }
    };
    state.steps += 1;
    decision
}

/// Effect's fixed-rate rule: wait for the next grid slot, or go at once when behind.
fn fixed_delay(
    interval: Duration,
    start: Duration,
    last: &mut Duration,
    now: Duration,
) -> Duration {
    if interval.is_zero() {
        return Duration::ZERO;
    }
    let behind = now > last.saturating_add(interval);
    let into_slot = now.saturating_sub(start).as_nanos() % interval.as_nanos();
    // Below `interval.as_nanos()`, so it fits a `Duration` (whose nanoseconds may exceed u64).
    let to_boundary = interval.saturating_sub(duration_of_nanos(into_slot));
    // Saturating at the end of the time line, as `next_at` does.
    let next = if behind {
        now
    } else {
        now.saturating_add(to_boundary)
    };
    *last = next;
    next - now
}

/// A `Duration` of `nanos` nanoseconds, which may be more than a `u64` holds.
fn duration_of_nanos(nanos: u128) -> Duration {
    const PER_SECOND: u128 = 1_000_000_000;
    let seconds = u64::try_from(nanos / PER_SECOND).unwrap_or(u64::MAX);
    // Below a billion: fits.
    Duration::new(seconds, (nanos % PER_SECOND) as u32)
}

/// `delay * factor`, saturating instead of panicking on overflow, NaN or a negative product. No
/// delay stays none, whatever the factor (an exponential back-off from zero grows to infinity
/// times zero).
fn scale(delay: Duration, factor: f64) -> Duration {
    if delay.is_zero() {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(delay.as_secs_f64() * factor).unwrap_or(if factor < 0.0 {
        Duration::ZERO
    } else {
        Duration::MAX
    })
}

/// A uniform draw in `[0, 1)`, from a per-thread generator seeded by the standard library's
/// random hash keys (so no random-number crate is needed for jitter); from the entered
/// runtime's, if it gives them (a simulation's, from its seed, so that a run replays).
fn jitter_draw() -> f64 {
    use std::cell::Cell;
    if let Some(draw) = crate::runtime::draw() {
        return draw;
    }
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let mut hasher = RandomState::new().build_hasher();
            hasher.write_u64(0x9e37_79b9_7f4a_7c15);
            hasher.finish() | 1
        });
    }
    STATE.with(|state| {
        // xorshift64*
        let mut x = state.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        state.set(x);
        let bits = x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11;
        bits as f64 / (1u64 << 53) as f64
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn ms(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }

    /// Steps `schedule` with runs ending at `ends` and fixed jitter draws.
    fn delays(schedule: &Schedule, ends: &[Duration], draw: f64) -> Vec<Option<Duration>> {
        let mut run = schedule.start(Duration::ZERO);
        ends.iter()
            .map(|&end| run.next_with(end, &mut || draw))
            .collect()
    }

    #[test]
    fn spaced_waits_the_interval_after_every_run_forever() {
        let got = delays(&Schedule::spaced(s(2)), &[s(0), s(5), s(100)], 0.5);
        assert_eq!(got, vec![Some(s(2)); 3]);
    }

    #[test]
    fn recurs_counts_extra_runs_then_stops() {
        let got = delays(&Schedule::recurs(3), &[s(0); 5], 0.5);
        assert_eq!(got, vec![Some(s(0)), Some(s(0)), Some(s(0)), None, None]);
        assert_eq!(delays(&Schedule::recurs(0), &[s(0)], 0.5), vec![None]);
    }

    #[test]
    fn exponential_multiplies_and_saturates() {
        let got = delays(&Schedule::exponential(ms(100), 3.0), &[s(0); 4], 0.5);
        assert_eq!(
            got,
            vec![Some(ms(100)), Some(ms(300)), Some(ms(900)), Some(ms(2700))]
        );
        let mut run = Schedule::exponential(s(1), 1e300).start(s(0));
        run.next(s(0));
        assert_eq!(run.next(s(0)), Some(Duration::MAX));
        let mut run = Schedule::exponential(s(1), f64::NAN).start(s(0));
        assert_eq!(run.next(s(0)), Some(s(1)));
        assert_eq!(run.next(s(0)), Some(Duration::MAX));
        let mut run = Schedule::exponential(s(1), -2.0).start(s(0));
        run.next(s(0));
        assert_eq!(run.next(s(0)), Some(Duration::ZERO));
    }

    #[test]
    fn fixed_keeps_the_grid_and_never_bursts() {
        let schedule = Schedule::fixed(s(10));
        // Quick runs: wait for the next slot.
        assert_eq!(
            delays(&schedule, &[s(1), s(12), s(29)], 0.5),
            vec![Some(s(9)), Some(s(8)), Some(s(1))]
        );
        // A run that overruns several slots is followed at once, then the grid resumes.
        assert_eq!(
            delays(&schedule, &[s(45), s(46), s(51)], 0.5),
            vec![Some(s(0)), Some(s(4)), Some(s(9))]
        );
        // Ending exactly on a boundary waits a whole interval.
        assert_eq!(delays(&schedule, &[s(10)], 0.5), vec![Some(s(10))]);
        assert_eq!(
            delays(&Schedule::fixed(Duration::ZERO), &[s(3)], 0.5),
            vec![Some(s(0))]
        );
    }

    #[test]
    fn jittered_scales_each_delay_within_bounds() {
        let schedule = Schedule::spaced(s(10)).jittered();
        assert_eq!(delays(&schedule, &[s(0)], 0.0), vec![Some(s(8))]);
        assert_eq!(delays(&schedule, &[s(0)], 0.5), vec![Some(s(10))]);
        let top = delays(&schedule, &[s(0)], 0.999_999)[0].unwrap();
        assert!(top < s(12) && top > ms(11_999));
        assert_eq!(
            delays(&Schedule::recurs(1).jittered(), &[s(0), s(0)], 0.3),
            vec![Some(s(0)), None]
        );
    }

    #[test]
    fn jitter_draws_cover_the_range_and_stay_inside_it() {
        let draws: Vec<f64> = (0..10_000).map(|_| jitter_draw()).collect();
        assert!(draws.iter().all(|d| (0.0..1.0).contains(d)));
        assert!(draws.iter().any(|&d| d < 0.05) && draws.iter().any(|&d| d > 0.95));
    }

    #[test]
    fn up_to_stops_after_the_elapsed_limit() {
        let schedule = Schedule::spaced(s(1)).up_to(s(10));
        assert_eq!(
            delays(&schedule, &[s(1), s(9), s(10), s(11)], 0.5),
            vec![Some(s(1)), Some(s(1)), None, None]
        );
    }

    #[test]
    fn union_goes_on_while_either_does_with_the_shorter_delay() {
        let schedule = Schedule::recurs(2)
            .intersect(Schedule::spaced(s(5)))
            .union(Schedule::exponential(s(1), 2.0).intersect(Schedule::recurs(3)));
        assert_eq!(
            delays(&schedule, &[s(0); 5], 0.5),
            vec![Some(s(1)), Some(s(2)), Some(s(4)), None, None]
        );
        let schedule = Schedule::recurs(1).union(Schedule::recurs(2));
        assert_eq!(
            delays(&schedule, &[s(0); 3], 0.5),
            vec![Some(s(0)), Some(s(0)), None]
        );
    }

    #[test]
    fn intersect_goes_on_while_both_do_with_the_longer_delay() {
        let schedule = Schedule::spaced(s(2)).intersect(Schedule::exponential(s(1), 2.0));
        assert_eq!(
            delays(&schedule, &[s(0); 3], 0.5),
            vec![Some(s(2)), Some(s(2)), Some(s(4))]
        );
        let schedule = Schedule::recurs(2).intersect(Schedule::spaced(s(1)));
        assert_eq!(
            delays(&schedule, &[s(0); 3], 0.5),
            vec![Some(s(1)), Some(s(1)), None]
        );
    }
}
