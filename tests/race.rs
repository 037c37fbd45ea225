//! Structured `race`, `race_first` and `all`: who wins, what the others are told, and that their
//! clean-up has finished before any of them returns. Also `Scoped` as a `FusedFuture`.

mod common;

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use common::{
    bounded, interrupted_by, interrupted_with, on_every_executor, record_status, rows_of,
    slow_finalizer, within, yield_now, Counter, Flag, Log, Statuses, GENEROUS, SLOW,
};
use futures::executor::block_on;
use futures::future::{self, FusedFuture};
use futures::FutureExt;
use leasehold::{
    all, race, race_first, AbortController, AbortReason, Clock, EntryState, Interrupted,
    LockManager, RaceLost, Scoped, TestClock,
};

/// A test's own error type, as users have: a failure of the work, or an interruption.
#[derive(Debug)]
enum Failed {
    Work(&'static str),
    Interrupted(Interrupted),
}

impl From<Interrupted> for Failed {
    fn from(interrupted: Interrupted) -> Self {
        Failed::Interrupted(interrupted)
    }
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failed::Work(what) => write!(f, "failed: {what}"),
            Failed::Interrupted(interrupted) => interrupted.fmt(f),
        }
    }
}

/// A contender that never finishes on its own: it logs `"{name} start"`/`"{name} end"` from a
/// slow finalizer, records the status it is told, and counts itself as started.
fn stubborn<T: Send + 'static>(
    name: &str,
    log: &Log,
    statuses: &Statuses,
    started: &Counter,
) -> Scoped<T, Failed> {
    let (name, log, statuses, started) = (
        name.to_owned(),
        log.clone(),
        statuses.clone(),
        started.clone(),
    );
    Scoped::new(move |scope| async move {
        slow_finalizer(&scope, &log, &name, SLOW);
        record_status(&scope, &statuses);
        started.bump();
        future::pending().await
    })
}

// ---------------------------------------------------------------------------------------------
// race
// ---------------------------------------------------------------------------------------------

#[test]
fn the_first_contender_to_succeed_wins_and_failures_before_it_do_not_end_the_race() {
    on_every_executor(|| async {
        let failed = Flag::new();
        let failing_flag = failed.clone();
        let failing = Scoped::<u32, Failed>::new(move |_| async move {
            failing_flag.set();
            Err(Failed::Work("early failure"))
        });
        let winner = Scoped::new(move |_| async move {
            within(GENEROUS, "the other contender failed", || async {
                failed.is_set()
            })
            .await;
            Ok(7)
        });
        let never = Scoped::new(|_| future::pending());
        assert_eq!(race([failing, winner, never]).await.unwrap(), 7);
    });
}

#[test]
fn the_losers_finalizers_have_finished_before_race_returns() {
    on_every_executor(|| async {
        let (log, statuses, started) = (Log::new(), Statuses::new(), Counter::new());
        let waiting = started.clone();
        let winner = Scoped::new(move |_| async move {
            within(GENEROUS, "both losers started", || async {
                waiting.get() == 2
            })
            .await;
            Ok("winner")
        });
        let contenders = [
            stubborn("loser 1", &log, &statuses, &started),
            winner,
            stubborn("loser 2", &log, &statuses, &started),
        ];

        assert_eq!(race(contenders).await.unwrap(), "winner");

        let entries = log.entries();
        for name in ["loser 1", "loser 2"] {
            assert!(entries.contains(&format!("{name} end")), "{entries:?}");
        }
        let told = statuses.all();
        assert_eq!(told.len(), 2, "{told:?}");
        assert!(told.iter().all(interrupted_with::<RaceLost>), "{told:?}");
    });
}

#[test]
fn when_every_contender_fails_race_gives_the_error_of_the_last_to_fail() {
    on_every_executor(|| async {
        let first_failed = Flag::new();
        let waiting = first_failed.clone();
        let last = Scoped::<(), Failed>::new(move |_| async move {
            within(GENEROUS, "the other contender failed", || async {
                waiting.is_set()
            })
            .await;
            Err(Failed::Work("last"))
        });
        let first = Scoped::new(move |_| async move {
            first_failed.set();
            Err(Failed::Work("first"))
        });
        let error = race([last, first]).await.unwrap_err();
        assert!(matches!(error, Failed::Work("last")), "{error}");
    });
}

#[test]
fn a_race_with_one_contender_is_that_contender() {
    block_on(async {
        let only = Scoped::<_, Failed>::new(|_| async { Ok("alone") });
        assert_eq!(race([only]).await.unwrap(), "alone");
        let only = Scoped::<(), _>::new(|_| async { Err(Failed::Work("alone")) });
        assert!(matches!(race([only]).await, Err(Failed::Work("alone"))));
    });
}

#[test]
#[should_panic(expected = "`race` needs at least one contender")]
fn an_empty_race_panics_rather_than_hang() {
    block_on(race(Vec::<Scoped<(), Interrupted>>::new())).ok();
}

#[test]
fn a_panicking_contender_stops_the_others_before_its_panic_resumes() {
    a_panic_stops_the_others(|contenders| {
        block_on(AssertUnwindSafe(race(contenders)).catch_unwind()).map(drop)
    });
}

/// Another contender and one that panics once the other started, settled by `settle` (which
/// catches the panic): the panic resumes only after the other was interrupted with `RaceLost`
/// and its clean-up ended.
fn a_panic_stops_the_others(
    settle: impl FnOnce([Scoped<(), Failed>; 2]) -> std::thread::Result<()>,
) {
    let (log, statuses, started) = (Log::new(), Statuses::new(), Counter::new());
    let waiting = started.clone();
    let panicking = Scoped::<(), Failed>::new(move |_| async move {
        within(GENEROUS, "the other contender started", || async {
            waiting.get() == 1
        })
        .await;
        panic!("contender panics")
    });
    let contenders = [stubborn("other", &log, &statuses, &started), panicking];

    let outcome = settle(contenders);

    let payload = outcome.expect_err("the panic resumes");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"contender panics"));
    assert_eq!(log.entries(), ["other start", "other end"]);
    assert!(interrupted_with::<RaceLost>(&statuses.only()));
}

/// A contender whose clean-up panics when it is interrupted: `"{message}"`.
fn panics_when_stopped<T: Send + 'static>(
    message: &'static str,
    started: &Counter,
) -> Scoped<T, Failed> {
    let started = started.clone();
    Scoped::new(move |scope| async move {
        scope.add_finalizer(move |_| async move { panic!("{message}") });
        started.bump();
        future::pending().await
    })
}

#[test]
fn a_losers_clean_up_that_panics_resumes_its_panic_instead_of_the_winners_value() {
    let started = Counter::new();
    let waiting = started.clone();
    let winner = Scoped::<u32, Failed>::new(move |_| async move {
        within(GENEROUS, "the loser started", || async {
            waiting.get() == 1
        })
        .await;
        Ok(1)
    });
    let contenders = [
        panics_when_stopped("the loser's clean-up", &started),
        winner,
    ];

    let outcome = block_on(AssertUnwindSafe(race(contenders)).catch_unwind());

    let payload = outcome.expect_err("the loser's panic resumes");
    assert_eq!(
        payload.downcast_ref::<String>().map(String::as_str),
        Some("the loser's clean-up")
    );
}

// ---------------------------------------------------------------------------------------------
// race_first
// ---------------------------------------------------------------------------------------------

/// A contender that sleeps `after` on `clock`, then ends with `result`; counted as started
/// once its sleep is set (a `TestClock` sleep counts from when it is made).
fn ends_after<T: Send + 'static>(
    clock: &TestClock,
    after: Duration,
    started: &Counter,
    result: Result<T, Failed>,
) -> Scoped<T, Failed> {
    let (clock, started) = (clock.clone(), started.clone());
    Scoped::new(move |_| async move {
        let sleep = clock.sleep(after);
        started.bump();
        sleep.await;
        result
    })
}

/// A job that would succeed after `after` on `clock`, with a slow finalizer (`"job start"`,
/// `"job end"`) that records the status it is told.
fn job(
    clock: &TestClock,
    after: Duration,
    log: &Log,
    statuses: &Statuses,
    started: &Counter,
) -> Scoped<&'static str, Failed> {
    let (clock, log, statuses, started) = (
        clock.clone(),
        log.clone(),
        statuses.clone(),
        started.clone(),
    );
    Scoped::new(move |scope| async move {
        slow_finalizer(&scope, &log, "job", SLOW);
        record_status(&scope, &statuses);
        let sleep = clock.sleep(after);
        started.bump();
        sleep.await;
        Ok("job done")
    })
}

#[test]
fn race_first_a_contender_that_fails_first_wins_over_a_slower_success() {
    on_every_executor(|| async {
        let clock = TestClock::new();
        let (log, statuses, started) = (Log::new(), Statuses::new(), Counter::new());
        // The case: a cancel contender fails at 300 ms; the job would succeed at 2 s.
        let contenders = [
            job(&clock, Duration::from_secs(2), &log, &statuses, &started),
            ends_after(
                &clock,
                Duration::from_millis(300),
                &started,
                Err(Failed::Work("cancelled")),
            ),
        ];
        let result = race_first_at_300_ms(&clock, &started, contenders).await;

        assert!(
            matches!(result, Err(Failed::Work("cancelled"))),
            "{result:?}"
        );
        // Time never reached the job's 2 s: the failure did not wait for it.
        assert_eq!(clock.monotonic(), Duration::from_millis(300));
        // The job was interrupted as a loser, and its clean-up had finished.
        assert_eq!(log.entries(), ["job start", "job end"]);
        assert!(interrupted_with::<RaceLost>(&statuses.only()));
    });
}

/// `race_first` of two `contenders` on `clock`, moved to 300 ms once both `started`.
async fn race_first_at_300_ms<T: Send + 'static>(
    clock: &TestClock,
    started: &Counter,
    contenders: [Scoped<T, Failed>; 2],
) -> Result<T, Failed> {
    let move_time = async {
        within(GENEROUS, "both contenders started", || async {
            started.get() == 2
        })
        .await;
        clock.advance(Duration::from_millis(300));
    };
    let (result, ()) = bounded(
        GENEROUS,
        "race_first resolved at 300 ms",
        future::join(race_first(contenders), move_time),
    )
    .await;
    result
}

#[test]
fn race_first_a_contender_that_succeeds_first_wins_over_a_slower_failure() {
    on_every_executor(|| async {
        let clock = TestClock::new();
        let (log, statuses, started) = (Log::new(), Statuses::new(), Counter::new());
        let contenders = [
            ends_after(
                &clock,
                Duration::from_secs(2),
                &started,
                Err(Failed::Work("too late")),
            ),
            job(
                &clock,
                Duration::from_millis(300),
                &log,
                &statuses,
                &started,
            ),
        ];
        let result = race_first_at_300_ms(&clock, &started, contenders).await;

        assert_eq!(result.unwrap(), "job done");
        assert_eq!(clock.monotonic(), Duration::from_millis(300));
        assert!(matches!(statuses.only(), leasehold::ExitStatus::Success));
    });
}

#[test]
fn race_first_interrupts_the_losers_with_race_lost_and_their_finalizers_have_finished() {
    on_every_executor(|| async {
        a_failure_stops_the_others(|contenders| async {
            race_first(contenders).await.unwrap_err()
        })
        .await;
    });
}

/// Two stubborn contenders and one that fails once both have started, settled by `settle` (to
/// its error): the failure is the outcome, and the other two were interrupted with `RaceLost`
/// and their finalizers had finished before it came.
async fn a_failure_stops_the_others<F, Fut>(settle: F)
where
    F: FnOnce([Scoped<u8, Failed>; 3]) -> Fut,
    Fut: std::future::Future<Output = Failed>,
{
    let (log, statuses, started) = (Log::new(), Statuses::new(), Counter::new());
    let waiting = started.clone();
    let failing = Scoped::new(move |_| async move {
        within(GENEROUS, "the others started", || async {
            waiting.get() == 2
        })
        .await;
        Err(Failed::Work("first to finish"))
    });
    let contenders = [
        stubborn::<u8>("a", &log, &statuses, &started),
        failing,
        stubborn("b", &log, &statuses, &started),
    ];

    let error = settle(contenders).await;

    assert!(matches!(error, Failed::Work("first to finish")), "{error}");
    let entries = log.entries();
    for name in ["a", "b"] {
        assert!(entries.contains(&format!("{name} end")), "{entries:?}");
    }
    let told = statuses.all();
    assert_eq!(told.len(), 2, "{told:?}");
    assert!(told.iter().all(interrupted_with::<RaceLost>), "{told:?}");
}

#[test]
fn a_race_first_with_one_contender_is_that_contender() {
    block_on(async {
        let only = Scoped::<_, Failed>::new(|_| async { Ok("alone") });
        assert_eq!(race_first([only]).await.unwrap(), "alone");
        let only = Scoped::<(), _>::new(|_| async { Err(Failed::Work("alone")) });
        assert!(matches!(
            race_first([only]).await,
            Err(Failed::Work("alone"))
        ));
    });
}

#[test]
#[should_panic(expected = "`race_first` needs at least one contender")]
fn an_empty_race_first_panics_rather_than_hang() {
    block_on(race_first(Vec::<Scoped<(), Interrupted>>::new())).ok();
}

#[test]
fn a_panicking_contender_of_race_first_stops_the_others_before_its_panic_resumes() {
    a_panic_stops_the_others(|contenders| {
        block_on(AssertUnwindSafe(race_first(contenders)).catch_unwind()).map(drop)
    });
}

// ---------------------------------------------------------------------------------------------
// all
// ---------------------------------------------------------------------------------------------

#[test]
fn all_gives_every_value_in_the_members_order_whatever_order_they_finish_in() {
    on_every_executor(|| async {
        let finished = Counter::new();
        // Member `i` finishes only after the members after it: the last finishes first.
        let members = (0..4).map(|i| {
            let finished = finished.clone();
            Scoped::<usize, Failed>::new(move |_| async move {
                within(GENEROUS, "the later members finished", || async {
                    finished.get() == 3 - i
                })
                .await;
                finished.bump();
                Ok(i * 10)
            })
        });
        assert_eq!(all(members).await.unwrap(), [0, 10, 20, 30]);
    });
}

#[test]
fn all_of_no_members_is_an_empty_list() {
    let values = block_on(all(Vec::<Scoped<u8, Interrupted>>::new())).unwrap();
    assert!(values.is_empty());
}

#[test]
fn alls_first_failure_interrupts_the_others_with_race_lost_and_awaits_their_finalizers() {
    on_every_executor(|| async {
        a_failure_stops_the_others(|members| async { all(members).await.unwrap_err() }).await;
    });
}

#[test]
fn racing_two_acquisitions_on_busy_keys_leaves_one_guard_and_no_row_of_the_loser() {
    on_every_executor(|| async {
        let locks = LockManager::open_in_memory().unwrap();
        let holder_of_a = locks.exclusive("a", "hold").await.unwrap();
        let holder_of_b = locks.exclusive("b", "hold").await.unwrap();
        let racers = [locks.exclusive("a", "race"), locks.exclusive("b", "race")];
        let free_a = async {
            within(GENEROUS, "both racers queued", || async {
                rows_of(&locks, "race").await.len() >= 2
            })
            .await;
            holder_of_a.release().await.unwrap();
        };

        let (winner, ()) = future::join(race(racers), free_a).await;

        let winner = winner.unwrap();
        assert_eq!(winner.requests()[0].key, "a");
        let rows = rows_of(&locks, "race").await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(
            (rows[0].key.as_str(), &rows[0].state),
            ("a", &EntryState::Held)
        );
        winner.release().await.unwrap();
        holder_of_b.release().await.unwrap();
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

// ---------------------------------------------------------------------------------------------
// Interrupting the caller
// ---------------------------------------------------------------------------------------------

/// Runs `contest` (a `race`, `race_first` or `all` of three stubborn contenders) inside a
/// `Scoped`, and interrupts that `Scoped` once every contender has started.
async fn interrupt_the_caller_of<F, Fut>(contest: F)
where
    F: FnOnce([Scoped<u8, Failed>; 3]) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), Failed>> + Send + 'static,
{
    let (log, statuses, started) = (Log::new(), Statuses::new(), Counter::new());
    let controller = AbortController::new();
    let contenders = ["a", "b", "c"].map(|name| stubborn(name, &log, &statuses, &started));
    let caller_log = log.clone();
    let caller = Scoped::<(), Failed>::new(move |scope| async move {
        slow_finalizer(&scope, &caller_log, "caller", SLOW);
        contest(contenders).await
    })
    .with_signal(&controller.signal());
    let reason = AbortReason::from("the caller's reason");
    let interrupt = async {
        within(GENEROUS, "every contender started", || async {
            started.get() == 3
        })
        .await;
        controller.abort(reason.clone());
    };

    let (result, ()) = future::join(caller, interrupt).await;

    match result {
        Err(Failed::Interrupted(interrupted)) => assert!(interrupted.reason().ptr_eq(&reason)),
        other => panic!("expected the caller's interruption, got {other:?}"),
    }
    let told = statuses.all();
    assert_eq!(told.len(), 3, "{told:?}");
    assert!(told.iter().all(|s| interrupted_by(s, &reason)), "{told:?}");
    // Every contender's clean-up finished before the caller's own began.
    let entries = log.entries();
    assert_eq!(entries.len(), 8, "{entries:?}");
    assert_eq!(&entries[6..], ["caller start", "caller end"]);
}

#[test]
fn an_interrupted_members_clean_up_that_panics_resumes_its_panic_instead_of_the_failure() {
    let started = Counter::new();
    let waiting = started.clone();
    let failing = Scoped::<u32, Failed>::new(move |_| async move {
        within(GENEROUS, "the other member started", || async {
            waiting.get() == 1
        })
        .await;
        Err(Failed::Work("the member failed"))
    });
    let members = [
        panics_when_stopped("the member's clean-up", &started),
        failing,
    ];

    let outcome = block_on(AssertUnwindSafe(all(members)).catch_unwind());

    let payload = outcome.expect_err("the member's panic resumes");
    assert_eq!(
        payload.downcast_ref::<String>().map(String::as_str),
        Some("the member's clean-up")
    );
}

#[test]
fn interrupting_the_scoped_that_runs_a_race_interrupts_every_contender_with_the_callers_reason() {
    on_every_executor(|| {
        interrupt_the_caller_of(|contenders| async move { race(contenders).await.map(drop) })
    });
}

#[test]
fn interrupting_the_scoped_that_runs_a_race_first_interrupts_every_contender_with_the_callers_reason(
) {
    on_every_executor(|| {
        interrupt_the_caller_of(|contenders| async move { race_first(contenders).await.map(drop) })
    });
}

#[test]
fn interrupting_the_scoped_that_runs_all_interrupts_every_member_with_the_callers_reason() {
    on_every_executor(|| {
        interrupt_the_caller_of(|members| async move { all(members).await.map(drop) })
    });
}

// ---------------------------------------------------------------------------------------------
// Scoped as a FusedFuture
// ---------------------------------------------------------------------------------------------

#[test]
fn a_scoped_is_terminated_once_it_has_resolved() {
    block_on(async {
        let mut work = Scoped::<u8, Interrupted>::new(|_| async {
            yield_now().await;
            Ok(1)
        });
        assert!(!work.is_terminated());
        assert!(common::poll_once(&mut work).is_pending());
        assert!(!work.is_terminated());
        assert_eq!((&mut work).await.unwrap(), 1);
        assert!(work.is_terminated());
    });
}

#[test]
fn select_takes_a_scoped_without_fuse_and_never_polls_it_again_once_resolved() {
    block_on(async {
        let mut quick = Scoped::<u8, Interrupted>::new(|_| async { Ok(1) });
        let mut slow = Scoped::<u8, Interrupted>::new(|_| async {
            yield_now().await;
            Ok(2)
        });
        let mut seen = Vec::new();
        // The second round would panic ("polled after it resolved") if `select!` polled the
        // finished one again.
        for _ in 0..2 {
            futures::select! {
                value = quick => seen.push(value.unwrap()),
                value = slow => seen.push(value.unwrap()),
            }
        }
        seen.sort_unstable();
        assert_eq!(seen, [1, 2]);
        assert!(quick.is_terminated() && slow.is_terminated());
    });
}
