//! Schedules: retry and repeat, the step API, and each combinator.

mod common;

use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use common::{on_every_executor, poll_once, Counter};
use futures::executor::block_on;
use leasehold::{Clock, Schedule, TestClock};

fn s(secs: u64) -> Duration {
    Duration::from_secs(secs)
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

/// The delays a fresh run of `schedule` started at 0 gives for runs ending at `ends`.
fn delays(schedule: &Schedule, ends: &[Duration]) -> Vec<Option<Duration>> {
    let mut run = schedule.start(Duration::ZERO);
    ends.iter().map(|&end| run.next(end)).collect()
}

// ---------------------------------------------------------------------------------------------
// retry and repeat
// ---------------------------------------------------------------------------------------------

#[test]
fn retry_with_recurs_3_makes_4_attempts_and_returns_the_last_error() {
    let attempts = Counter::new();
    let result: Result<(), usize> = block_on(Schedule::recurs(3).retry(|| {
        let n = attempts.bump();
        async move { Err(n) }
    }));
    assert_eq!(result, Err(4));
    assert_eq!(attempts.get(), 4);
}

#[test]
fn retry_with_recurs_0_makes_a_single_attempt() {
    let attempts = Counter::new();
    let result: Result<(), usize> = block_on(Schedule::recurs(0).retry(|| {
        let n = attempts.bump();
        async move { Err(n) }
    }));
    assert_eq!(result, Err(1));
}

#[test]
fn retry_returns_the_first_ok() {
    let attempts = Counter::new();
    let result: Result<&str, &str> = block_on(Schedule::recurs(10).retry(|| {
        let n = attempts.bump();
        async move {
            if n == 3 {
                Ok("third time lucky")
            } else {
                Err("not yet")
            }
        }
    }));
    assert_eq!(result, Ok("third time lucky"));
    assert_eq!(attempts.get(), 3);
}

#[test]
fn retry_while_returns_an_error_the_predicate_refuses_at_once() {
    let attempts = Counter::new();
    let result: Result<(), &str> = block_on(Schedule::recurs(10).retry_while(
        || {
            let n = attempts.bump();
            async move { Err(if n < 3 { "busy" } else { "forbidden" }) }
        },
        |error| *error == "busy",
    ));
    assert_eq!(result, Err("forbidden"));
    assert_eq!(attempts.get(), 3);
}

#[test]
fn retry_while_retries_accepted_errors_until_the_schedule_is_done() {
    let attempts = Counter::new();
    let result: Result<(), usize> = block_on(Schedule::recurs(2).retry_while(
        || {
            let n = attempts.bump();
            async move { Err(n) }
        },
        |_| true,
    ));
    assert_eq!(result, Err(3));
}

#[test]
fn retry_while_returns_the_first_ok() {
    let attempts = Counter::new();
    let result: Result<usize, &str> = block_on(Schedule::recurs(10).retry_while(
        || {
            let n = attempts.bump();
            async move {
                if n == 2 {
                    Ok(n)
                } else {
                    Err("busy")
                }
            }
        },
        |_| true,
    ));
    assert_eq!(result, Ok(2));
}

#[test]
fn repeat_with_recurs_3_runs_4_times_and_returns_the_last_value() {
    let runs = Counter::new();
    let result: Result<usize, ()> = block_on(Schedule::recurs(3).repeat(|| {
        let n = runs.bump();
        async move { Ok(n) }
    }));
    assert_eq!(result, Ok(4));
    assert_eq!(runs.get(), 4);
}

#[test]
fn repeat_stops_at_the_first_error() {
    let runs = Counter::new();
    let result: Result<usize, String> = block_on(Schedule::recurs(10).repeat(|| {
        let n = runs.bump();
        async move {
            if n == 2 {
                Err(format!("run {n} failed"))
            } else {
                Ok(n)
            }
        }
    }));
    assert_eq!(result, Err("run 2 failed".to_owned()));
    assert_eq!(runs.get(), 2);
}

#[test]
fn retry_sleeps_on_the_schedules_clock() {
    let clock = TestClock::new();
    let schedule = Schedule::spaced(s(10))
        .intersect(Schedule::recurs(2))
        .with_clock(Arc::new(clock.clone()));
    let attempts = Counter::new();
    let mut retry = Box::pin(schedule.retry(|| {
        let n = attempts.bump();
        async move { Err::<(), _>(n) }
    }));

    assert!(poll_once(&mut retry).is_pending());
    assert_eq!((attempts.get(), clock.sleepers()), (1, 1));

    clock.advance(s(9));
    assert!(poll_once(&mut retry).is_pending());
    assert_eq!(attempts.get(), 1, "retried before the delay had passed");

    clock.advance(s(1));
    assert!(poll_once(&mut retry).is_pending());
    assert_eq!((attempts.get(), clock.sleepers()), (2, 1));

    clock.advance(s(10));
    assert_eq!(poll_once(&mut retry), Poll::Ready(Err(3)));
    assert_eq!(clock.sleepers(), 0);
}

#[test]
fn repeat_sleeps_on_the_schedules_clock() {
    let clock = TestClock::new();
    let schedule = Schedule::spaced(s(5))
        .intersect(Schedule::recurs(1))
        .with_clock(Arc::new(clock.clone()));
    let runs = Counter::new();
    let mut repeat = Box::pin(schedule.repeat(|| {
        let n = runs.bump();
        async move { Ok::<_, ()>(n) }
    }));

    assert!(poll_once(&mut repeat).is_pending());
    assert_eq!(runs.get(), 1);
    clock.advance(s(4));
    assert!(poll_once(&mut repeat).is_pending());
    clock.advance(s(1));
    assert_eq!(poll_once(&mut repeat), Poll::Ready(Ok(2)));
}

#[test]
fn retry_measures_elapsed_time_on_the_schedules_clock() {
    let clock = TestClock::new();
    let schedule = Schedule::spaced(s(1))
        .up_to(s(25))
        .with_clock(Arc::new(clock.clone()));
    let attempts = Counter::new();
    // Each attempt takes 10 s of the test clock's time.
    let mut retry = Box::pin(schedule.retry(|| {
        let n = attempts.bump();
        clock.advance(s(10));
        async move { Err::<(), _>(n) }
    }));
    // Attempts end at 10 s and 21 s (each then waits 1 s), then at 32 s, past the limit.
    for _ in 0..2 {
        assert!(poll_once(&mut retry).is_pending());
        clock.advance(s(1));
    }
    assert_eq!(poll_once(&mut retry), Poll::Ready(Err(3)));
}

/// When (in whole seconds of monotonic time) each run of `schedule`, driven by `repeat` on a
/// test clock that ticks a second at a time, started. With `step_wall`, the wall time is stepped
/// an hour forward and back again, over and over, while the runs and the sleeps go on.
fn run_starts(schedule: Schedule, step_wall: bool) -> Vec<u64> {
    let clock = TestClock::new();
    let schedule = schedule.with_clock(Arc::new(clock.clone()));
    let starts = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (run_clock, run_starts) = (clock.clone(), starts.clone());
    let mut repeat = Box::pin(schedule.repeat(move || {
        let at = run_clock.monotonic().as_secs();
        run_starts.lock().unwrap().push(at);
        async { Ok::<_, ()>(()) }
    }));
    let hour = s(3600);
    for tick in 0..1000 {
        if poll_once(&mut repeat).is_ready() {
            drop(repeat);
            return starts.lock().unwrap().clone();
        }
        clock.advance(s(1));
        if step_wall {
            match tick % 4 {
                1 => clock.set_wall_time(clock.now() + hour),
                3 => clock.set_wall_time(clock.now() - hour),
                _ => {}
            }
        }
    }
    panic!("the schedule never ended: {:?}", starts.lock().unwrap());
}

#[test]
fn stepping_the_wall_clock_changes_no_decision_of_up_to() {
    let schedule = Schedule::spaced(s(10)).up_to(s(35));
    assert_eq!(run_starts(schedule.clone(), false), [0, 10, 20, 30, 40]);
    assert_eq!(run_starts(schedule, true), [0, 10, 20, 30, 40]);
}

#[test]
fn stepping_the_wall_clock_changes_no_decision_of_fixed() {
    let schedule = Schedule::fixed(s(10)).intersect(Schedule::recurs(6));
    assert_eq!(
        run_starts(schedule.clone(), false),
        [0, 10, 20, 30, 40, 50, 60]
    );
    assert_eq!(run_starts(schedule, true), [0, 10, 20, 30, 40, 50, 60]);
}

#[test]
fn combinators_keep_the_clock_given_to_either_side() {
    let clock = TestClock::new();
    let schedule = Schedule::recurs(1)
        .intersect(Schedule::spaced(s(3)).with_clock(Arc::new(clock.clone())))
        .jittered()
        .up_to(s(100));
    let mut retry = Box::pin(schedule.retry(|| async { Err::<(), _>(()) }));
    assert!(poll_once(&mut retry).is_pending());
    assert_eq!(
        clock.sleepers(),
        1,
        "the retry is not sleeping on the test clock"
    );
    clock.advance(s(4));
    assert_eq!(poll_once(&mut retry), Poll::Ready(Err(())));
}

#[test]
fn retry_on_the_system_clock_sleeps_between_attempts_on_every_executor() {
    on_every_executor(|| async {
        let started = Instant::now();
        let attempts = Counter::new();
        let result: Result<(), usize> = Schedule::spaced(ms(5))
            .intersect(Schedule::recurs(2))
            .retry(|| {
                let n = attempts.bump();
                async move { Err(n) }
            })
            .await;
        assert_eq!(result, Err(3));
        assert!(started.elapsed() >= ms(10));
    });
}

// ---------------------------------------------------------------------------------------------
// The step API: Schedule::start and ScheduleRun::next
// ---------------------------------------------------------------------------------------------

#[test]
fn spaced_waits_the_interval_after_every_run_forever() {
    let got = delays(&Schedule::spaced(s(2)), &[s(0), s(7), s(1000)]);
    assert_eq!(got, [Some(s(2)); 3]);
}

#[test]
fn recurs_gives_that_many_more_runs_with_no_delay() {
    let got = delays(&Schedule::recurs(2), &[s(0), s(5), s(9), s(9)]);
    assert_eq!(got, [Some(s(0)), Some(s(0)), None, None]);
    assert_eq!(delays(&Schedule::recurs(0), &[s(0)]), [None]);
}

#[test]
fn fixed_waits_for_the_next_slot_of_the_grid() {
    // Slots at 0, 10, 20, 30, ...: quick runs wait for the next one.
    let got = delays(&Schedule::fixed(s(10)), &[s(1), s(13), s(29)]);
    assert_eq!(got, [Some(s(9)), Some(s(7)), Some(s(1))]);
}

#[test]
fn fixed_follows_a_late_run_at_once_without_a_burst_of_catch_ups() {
    // The first run overran three slots: the next starts at once, and the one after that is
    // back on the grid rather than making up the missed slots.
    let got = delays(&Schedule::fixed(s(10)), &[s(35), s(36), s(41)]);
    assert_eq!(got, [Some(s(0)), Some(s(4)), Some(s(9))]);
}

#[test]
fn fixed_keeps_its_grid_relative_to_the_first_start() {
    let mut run = Schedule::fixed(s(10)).start(s(1000));
    assert_eq!(run.next(s(1003)), Some(s(7)));
    assert_eq!(run.next(s(1012)), Some(s(8)));
}

#[test]
fn exponential_multiplies_each_delay_by_the_factor() {
    let got = delays(&Schedule::exponential(ms(10), 3.0), &[s(0); 4]);
    assert_eq!(
        got,
        [Some(ms(10)), Some(ms(30)), Some(ms(90)), Some(ms(270))]
    );
}

#[test]
fn exponential_saturates_instead_of_overflowing() {
    let mut run = Schedule::exponential(s(1), 1e12).start(s(0));
    run.next(s(0));
    run.next(s(0));
    assert_eq!(run.next(s(0)), Some(Duration::MAX));
}

#[test]
fn up_to_stops_once_the_limit_has_passed_since_the_first_run() {
    let schedule = Schedule::spaced(s(1)).up_to(s(10));
    let got = delays(&schedule, &[s(2), s(9), s(10), s(30)]);
    assert_eq!(got, [Some(s(1)), Some(s(1)), None, None]);
}

#[test]
fn up_to_counts_from_the_start_given_to_start() {
    let mut run = Schedule::spaced(s(1)).up_to(s(10)).start(s(500));
    assert_eq!(run.next(s(509)), Some(s(1)));
    assert_eq!(run.next(s(510)), None);
}

#[test]
fn up_to_stops_a_schedule_that_would_otherwise_go_on() {
    let schedule = Schedule::exponential(s(1), 2.0).up_to(s(5));
    // Runs end at 0, 1, 3, and then 7, past the limit.
    let got = delays(&schedule, &[s(0), s(1), s(3), s(7)]);
    assert_eq!(got, [Some(s(1)), Some(s(2)), Some(s(4)), None]);
}

#[test]
fn jittered_delays_stay_within_80_to_120_percent() {
    let mut run = Schedule::spaced(s(10)).jittered().start(s(0));
    let delays: Vec<Duration> = (0..1000).map(|_| run.next(s(0)).unwrap()).collect();
    assert!(
        delays.iter().all(|d| *d >= s(8) && *d < s(12)),
        "{delays:?}"
    );
    // 1000 uniform draws spread over the range, not one value.
    assert!(delays.iter().any(|d| *d < s(9)) && delays.iter().any(|d| *d > s(11)));
}

/// The draws behind jitter are uniform and do not repeat: 4,000 delays fill each eighth of the
/// band (about 500 each; at least 250 asked), and almost none is drawn twice.
#[test]
fn jittered_delays_fill_the_band_evenly_and_do_not_repeat() {
    let mut run = Schedule::spaced(s(8)).jittered().start(s(0));
    let delays: Vec<Duration> = (0..4000).map(|_| run.next(s(0)).unwrap()).collect();
    let mut eighths = [0usize; 8];
    for delay in &delays {
        // The band is 6.4 s to 9.6 s: eighths of 0.4 s.
        let at = (delay.as_secs_f64() - 6.4) / 0.4;
        eighths[(at as usize).min(7)] += 1;
    }
    assert!(eighths.iter().all(|&n| n >= 250), "{eighths:?}");
    let distinct: std::collections::BTreeSet<Duration> = delays.iter().copied().collect();
    assert!(
        distinct.len() >= 3990,
        "{} distinct of 4000",
        distinct.len()
    );
}

/// What a schedule's `Debug` shows: its kind, and whether it has a clock of its own.
#[test]
fn a_schedule_debugs_as_its_kind_and_whether_it_has_a_clock() {
    let shown = format!("{:?}", Schedule::spaced(s(5)).up_to(s(60)));
    assert!(shown.starts_with("Schedule {"), "{shown}");
    assert!(shown.contains("kind:"), "{shown}");
    assert!(shown.contains("custom_clock: false"), "{shown}");
    let clocked =
        Schedule::spaced(s(5)).with_clock(std::sync::Arc::new(leasehold::TestClock::new()));
    assert!(
        format!("{clocked:?}").contains("custom_clock: true"),
        "{clocked:?}"
    );
}

#[test]
fn jittered_keeps_the_end_of_the_schedule_it_wraps() {
    let got = delays(&Schedule::recurs(1).jittered(), &[s(0), s(0)]);
    assert_eq!(got, [Some(s(0)), None]);
}

#[test]
fn union_goes_on_while_either_does_with_the_shorter_delay() {
    let schedule = Schedule::spaced(s(5))
        .intersect(Schedule::recurs(3))
        .union(Schedule::spaced(s(2)).intersect(Schedule::recurs(1)));
    let got = delays(&schedule, &[s(0); 5]);
    assert_eq!(got, [Some(s(2)), Some(s(5)), Some(s(5)), None, None]);
}

#[test]
fn intersect_goes_on_while_both_do_with_the_longer_delay() {
    let schedule = Schedule::exponential(s(1), 2.0).intersect(Schedule::spaced(s(3)));
    let got = delays(&schedule, &[s(0); 4]);
    assert_eq!(got, [Some(s(3)), Some(s(3)), Some(s(4)), Some(s(8))]);
    let schedule = Schedule::spaced(s(1)).intersect(Schedule::recurs(2));
    assert_eq!(
        delays(&schedule, &[s(0); 3]),
        [Some(s(1)), Some(s(1)), None]
    );
}

#[test]
fn each_start_is_a_fresh_run() {
    let schedule = Schedule::recurs(1);
    let mut first = schedule.start(s(0));
    assert_eq!(first.next(s(0)), Some(s(0)));
    assert_eq!(first.next(s(0)), None);
    let mut second = schedule.start(s(0));
    assert_eq!(second.next(s(0)), Some(s(0)));
}

// ---------------------------------------------------------------------------------------------
// What the lock manager needs: a cap, a reset, and the next run's time without sleeping
// ---------------------------------------------------------------------------------------------

#[test]
fn capped_limits_each_delay_and_keeps_growing_below_the_cap() {
    let schedule = Schedule::exponential(ms(10), 2.0).capped(ms(50));
    let got = delays(&schedule, &[s(0); 6]);
    assert_eq!(
        got,
        [
            Some(ms(10)),
            Some(ms(20)),
            Some(ms(40)),
            Some(ms(50)),
            Some(ms(50)),
            Some(ms(50))
        ]
    );
}

#[test]
fn capped_keeps_the_end_of_the_schedule_it_wraps() {
    let schedule = Schedule::spaced(s(10))
        .intersect(Schedule::recurs(2))
        .capped(s(1));
    assert_eq!(
        delays(&schedule, &[s(0); 3]),
        [Some(s(1)), Some(s(1)), None]
    );
}

#[test]
fn jitter_after_a_cap_spreads_the_capped_delays() {
    let mut run = Schedule::exponential(s(1), 10.0)
        .capped(s(10))
        .jittered()
        .start(s(0));
    run.next(s(0));
    let at_cap: Vec<Duration> = (0..1000).map(|_| run.next(s(0)).unwrap()).collect();
    assert!(
        at_cap.iter().all(|d| *d >= s(8) && *d < s(12)),
        "{at_cap:?}"
    );
    assert!(at_cap.iter().any(|d| *d < s(9)) && at_cap.iter().any(|d| *d > s(11)));
}

#[test]
fn jitter_before_a_cap_never_exceeds_it() {
    let mut run = Schedule::spaced(s(10)).jittered().capped(s(10)).start(s(0));
    assert!((0..1000).all(|_| run.next(s(0)).unwrap() <= s(10)));
}

#[test]
fn reset_starts_the_run_over_from_the_time_given() {
    let mut run = Schedule::exponential(s(1), 2.0)
        .intersect(Schedule::recurs(2))
        .start(s(0));
    assert_eq!(run.next(s(0)), Some(s(1)));
    assert_eq!(run.next(s(1)), Some(s(2)));
    assert_eq!(run.next(s(3)), None);
    run.reset(s(100));
    assert_eq!(run.next(s(100)), Some(s(1)), "back to the base delay");
    assert_eq!(run.next(s(101)), Some(s(2)));
    assert_eq!(run.next(s(103)), None, "recurs counts afresh");
}

#[test]
fn reset_moves_the_window_of_up_to_and_the_grid_of_fixed() {
    let mut run = Schedule::spaced(s(1)).up_to(s(10)).start(s(0));
    assert_eq!(run.next(s(20)), None);
    run.reset(s(20));
    assert_eq!(run.next(s(29)), Some(s(1)));
    assert_eq!(run.next(s(30)), None);

    let mut run = Schedule::fixed(s(10)).start(s(0));
    assert_eq!(run.next(s(3)), Some(s(7)));
    run.reset(s(4));
    assert_eq!(run.next(s(5)), Some(s(9)), "slots at 4, 14, 24, ...");
}

#[test]
fn next_at_is_the_time_of_the_next_run_on_the_same_time_line() {
    let mut run = Schedule::spaced(s(5)).start(s(100));
    assert_eq!(run.next_at(s(100)), Some(s(105)));
    // Counted from when the run ended, however late the caller asks.
    assert_eq!(run.next_at(s(102)), Some(s(107)));
    let mut run = Schedule::fixed(s(10)).start(s(0));
    assert_eq!(run.next_at(s(3)), Some(s(10)));
    assert_eq!(run.next_at(s(25)), Some(s(25)), "late: at once");
    let mut run = Schedule::recurs(0).start(s(0));
    assert_eq!(run.next_at(s(0)), None);
}

#[test]
fn a_plain_thread_follows_a_schedule_on_a_test_clock_without_sleeping_on_it() {
    // The way the lock manager's storage worker polls: it reads the next run's time and waits
    // for it on its own channel, re-reading the clock, never awaiting the clock's sleep.
    let clock = TestClock::new();
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let mut run = Schedule::exponential(s(1), 2.0).start(clock.monotonic());
    let mut next = run.next_at(clock.monotonic()).unwrap();
    let worker = {
        let (clock, runs) = (clock.clone(), runs.clone());
        std::thread::spawn(move || loop {
            let left = next.saturating_sub(clock.monotonic()).min(ms(5));
            if let Err(std::sync::mpsc::RecvTimeoutError::Disconnected) = rx.recv_timeout(left) {
                return;
            }
            let now = clock.monotonic();
            if now >= next {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                next = run.next_at(now).unwrap();
            }
        })
    };
    let wait_for = |n: usize| {
        let started = Instant::now();
        while runs.load(std::sync::atomic::Ordering::SeqCst) < n {
            assert!(started.elapsed() < s(5), "the run {n} came within 5 s");
            std::thread::yield_now();
        }
    };
    // Runs due at 1, 3, 7 s of the clock's time.
    clock.advance(s(1));
    wait_for(1);
    clock.advance(s(2));
    wait_for(2);
    clock.advance(s(4));
    wait_for(3);
    assert_eq!(clock.sleepers(), 0, "nothing slept on the clock");
    drop(tx);
    worker.join().unwrap();
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 3);
}

// ---------------------------------------------------------------------------------------------
// The ends of the time line
// ---------------------------------------------------------------------------------------------

#[test]
fn an_exponential_schedule_from_zero_stays_at_zero_however_far_its_factor_grows() {
    let mut run = Schedule::exponential(Duration::ZERO, 1e300).start(Duration::ZERO);
    for step in 0..5 {
        assert_eq!(
            run.next(Duration::ZERO),
            Some(Duration::ZERO),
            "step {step}"
        );
    }
    let mut run = Schedule::exponential(Duration::ZERO, 2.0).start(Duration::ZERO);
    for step in 0..2_000 {
        assert_eq!(
            run.next(Duration::ZERO),
            Some(Duration::ZERO),
            "step {step}"
        );
    }
}

#[test]
fn fixed_saturates_near_the_end_of_the_time_line() {
    let start = Duration::MAX - s(150);
    let mut run = Schedule::fixed(s(100)).start(start);
    assert_eq!(run.next(start + s(60)), Some(s(40)));
    // The next slot would begin past `Duration::MAX`: the delay runs to the end of the line.
    let now = start + s(140);
    assert_eq!(run.next(now), Some(Duration::MAX - now));
}

#[test]
fn fixed_with_an_interval_beyond_u64_nanoseconds_counts_its_slots() {
    // Longer than u64::MAX nanoseconds (about 584 years).
    let interval = s(20_000_000_000);
    let mut run = Schedule::fixed(interval).start(Duration::ZERO);
    assert_eq!(run.next(s(19_000_000_000)), Some(s(1_000_000_000)));
    let mut run = Schedule::fixed(Duration::MAX).start(Duration::ZERO);
    assert_eq!(
        run.next(s(20_000_000_000)),
        Some(Duration::MAX - s(20_000_000_000))
    );
}
