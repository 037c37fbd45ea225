//! Clocks: the system clock, and a test clock that moves only when told.

mod common;

use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{on_every_executor, poll_once, within_blocking};
use futures::FutureExt;
use leasehold::{Clock, SystemClock, TestClock};

/// 2024-01-01 00:00:00 UTC.
const TEST_EPOCH: Duration = Duration::from_secs(1_704_067_200);

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[test]
fn a_test_clock_starts_at_the_fixed_epoch_and_stands_still() {
    let clock = TestClock::new();
    assert_eq!(clock.now(), TEST_EPOCH);
    assert_eq!(TestClock::default().now(), TEST_EPOCH);
    std::thread::yield_now();
    assert_eq!(clock.now(), TEST_EPOCH);
}

#[test]
fn advance_moves_time_forward_by_exactly_that_much() {
    let clock = TestClock::new();
    clock.advance(Duration::from_millis(1500));
    clock.advance(secs(2));
    assert_eq!(clock.now(), TEST_EPOCH + Duration::from_millis(3500));
}

#[test]
fn clones_share_one_time_line() {
    let clock = TestClock::new();
    let other = clock.clone();
    other.advance(secs(5));
    assert_eq!(clock.now(), TEST_EPOCH + secs(5));
    let mut nap = clock.sleep(secs(1));
    other.advance(secs(1));
    assert!(poll_once(&mut nap).is_ready());
}

#[test]
fn a_sleeper_is_woken_only_when_time_reaches_its_deadline() {
    let clock = TestClock::new();
    let mut nap = clock.sleep(secs(10));
    let counter = Arc::new(common::CountingWaker::default());
    let waker = Waker::from(counter.clone());
    let mut cx = Context::from_waker(&waker);
    assert!(nap.poll_unpin(&mut cx).is_pending());

    clock.advance(secs(9));
    assert_eq!(counter.count(), 0, "woken early");
    assert!(nap.poll_unpin(&mut cx).is_pending());

    clock.advance(secs(1));
    assert_eq!(counter.count(), 1);
    assert!(nap.poll_unpin(&mut cx).is_ready());
}

#[test]
fn advancing_past_several_deadlines_wakes_exactly_the_due_sleepers() {
    let clock = TestClock::new();
    let mut naps: Vec<_> = [3, 1, 2, 5].map(|s| clock.sleep(secs(s))).into();
    for nap in &mut naps {
        assert!(poll_once(nap).is_pending());
    }
    clock.advance(secs(3));
    let ready: Vec<bool> = naps.iter_mut().map(|n| poll_once(n).is_ready()).collect();
    assert_eq!(ready, [true, true, true, false]);
    assert_eq!(clock.sleepers(), 1);
}

#[test]
fn a_sleep_measures_from_when_it_was_made() {
    let clock = TestClock::new();
    clock.advance(secs(100));
    let mut nap = clock.sleep(secs(1));
    assert!(poll_once(&mut nap).is_pending());
    clock.advance(secs(1));
    assert!(poll_once(&mut nap).is_ready());
}

#[test]
fn sleepers_counts_the_sleeps_waiting_for_time_to_move() {
    let clock = TestClock::new();
    assert_eq!(clock.sleepers(), 0);
    let short = clock.sleep(secs(1));
    let long = clock.sleep(secs(10));
    let dropped = clock.sleep(secs(5));
    assert_eq!(clock.sleepers(), 3);

    drop(dropped);
    assert_eq!(clock.sleepers(), 2);
    clock.advance(secs(1));
    assert_eq!(clock.sleepers(), 1);
    drop((short, long));
    assert_eq!(clock.sleepers(), 0);
}

#[test]
fn a_zero_sleep_is_ready_at_once_and_is_no_sleeper() {
    let clock = TestClock::new();
    let mut nap = clock.sleep(Duration::ZERO);
    assert_eq!(clock.sleepers(), 0);
    assert!(poll_once(&mut nap).is_ready());
}

#[test]
fn a_sleeper_on_another_thread_is_woken_by_advance() {
    let clock = TestClock::new();
    let nap = clock.sleep(secs(60));
    let sleeper = std::thread::spawn(move || futures::executor::block_on(nap));
    clock.advance(secs(60));
    sleeper.join().unwrap();
}

#[test]
fn the_system_clock_reads_unix_time() {
    let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let now = SystemClock.now();
    let after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    assert!(before <= now && now <= after);
}

#[test]
fn a_system_clock_sleep_lasts_at_least_its_duration_on_every_executor() {
    on_every_executor(|| async {
        let started = Instant::now();
        SystemClock.sleep(Duration::from_millis(15)).await;
        assert!(started.elapsed() >= Duration::from_millis(15));
    });
}

#[test]
fn the_system_clocks_monotonic_time_moves_with_instant() {
    let started = Instant::now();
    let first = SystemClock.monotonic();
    std::thread::sleep(Duration::from_millis(5));
    let second = SystemClock.monotonic();
    assert!(second - first >= Duration::from_millis(5));
    assert!(second - first <= started.elapsed());
}

#[test]
fn advance_moves_wall_and_monotonic_time_together() {
    let clock = TestClock::new();
    assert_eq!(clock.monotonic(), Duration::ZERO);
    clock.advance(secs(90));
    assert_eq!(clock.monotonic(), secs(90));
    assert_eq!(clock.now(), TEST_EPOCH + secs(90));
}

#[test]
fn stepping_the_wall_time_moves_neither_monotonic_time_nor_sleepers() {
    let clock = TestClock::new();
    let hour = secs(3600);
    let mut nap = clock.sleep(secs(10));
    assert!(poll_once(&mut nap).is_pending());

    clock.set_wall_time(TEST_EPOCH + hour);
    assert_eq!(clock.now(), TEST_EPOCH + hour);
    assert_eq!(clock.monotonic(), Duration::ZERO);
    assert!(
        poll_once(&mut nap).is_pending(),
        "a forward step wakes no sleeper"
    );

    clock.set_wall_time(TEST_EPOCH - hour);
    assert_eq!(clock.now(), TEST_EPOCH - hour);
    clock.advance(secs(10));
    assert_eq!(clock.now(), TEST_EPOCH - hour + secs(10));
    assert!(
        poll_once(&mut nap).is_ready(),
        "the sleep keeps its monotonic deadline"
    );
}

#[test]
fn a_clock_written_without_monotonic_still_compiles_and_uses_its_wall_time() {
    struct Stopped;
    impl Clock for Stopped {
        fn now(&self) -> Duration {
            TEST_EPOCH
        }
        fn sleep(&self, _: Duration) -> futures::future::BoxFuture<'static, ()> {
            Box::pin(std::future::pending())
        }
    }
    assert_eq!(Stopped.monotonic(), TEST_EPOCH);
}

#[test]
fn a_test_clock_advanced_to_the_end_of_time_wakes_every_sleeper() {
    let clock = TestClock::new();
    let mut nap = clock.sleep(Duration::MAX);
    assert!(poll_once(&mut nap).is_pending());
    clock.advance(Duration::MAX);
    assert!(nap.now_or_never().is_some());
    assert_eq!(clock.monotonic(), Duration::MAX);
}

/// A `Scoped` given a clock passes it to what is nested in it and what it forks, and an explicit
/// clock wins over it.
#[test]
fn a_scoped_clock_is_inherited_by_nested_scopes_and_fibers_and_an_explicit_one_wins() {
    use leasehold::{AbortSignal, Interrupted, Scoped, TimedOut};
    use std::sync::Mutex;

    let inherited = TestClock::new();
    let explicit = TestClock::new();
    let signals = Arc::new(Mutex::new(Vec::new()));
    let (seen, explicit_in) = (signals.clone(), explicit.clone());
    let work = Scoped::<bool, Interrupted>::new(move |scope| async move {
        let fiber = scope.fork(async move {
            let mut seen = seen.lock().unwrap();
            seen.push(AbortSignal::timeout(Duration::from_secs(10)));
            seen.push(AbortSignal::timeout_on(
                Arc::new(explicit_in),
                Duration::from_secs(10),
            ));
        });
        fiber.join().await;
        let nested = Scoped::<(), Interrupted>::new(|_| std::future::pending())
            .timeout(Duration::from_secs(10))
            .await;
        Ok(nested
            .unwrap_err()
            .reason()
            .downcast_ref::<TimedOut>()
            .is_some())
    })
    .with_clock(Arc::new(inherited.clone()));
    let running = std::thread::spawn(move || futures::executor::block_on(work));
    // The fiber has made its signals, and the nested `Scoped` sleeps on the inherited clock.
    within_blocking(Duration::from_secs(10), "the work started", || {
        signals.lock().unwrap().len() >= 2 && inherited.sleepers() > 0
    });
    inherited.advance(Duration::from_secs(10));
    let signals = signals.lock().unwrap().clone();
    assert!(
        signals[0].is_aborted(),
        "the fiber's timeout ran on the inherited clock"
    );
    assert!(!signals[1].is_aborted(), "an explicit clock wins");
    assert!(
        running.join().unwrap().unwrap(),
        "the nested timeout ran on the inherited clock"
    );
}
