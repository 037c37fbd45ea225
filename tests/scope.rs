//! Scopes (finalizers, adopt, fork, close) and `Scoped` futures (interruption, nesting, drop).

mod common;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use common::{
    interrupted_by, interrupted_with, on_every_executor, poll_once, record_status, slow_finalizer,
    within, within_blocking, yield_now, Counter, Flag, Log, Statuses, GENEROUS, SLOW,
};
use futures::executor::block_on;
use futures::future::{self, BoxFuture, Either};
use futures::FutureExt;
use leasehold::{
    scoped, AbortController, AbortReason, Clock, Dropped, Exit, ExitStatus, Interrupted, Release,
    Scope, ScopeClosed, Scoped, TestClock, TimedOut,
};

// ---------------------------------------------------------------------------------------------
// Scope: finalizers
// ---------------------------------------------------------------------------------------------

#[test]
fn finalizers_run_last_in_first_out() {
    let log = Log::new();
    let scope = Scope::new();
    for name in ["first", "second", "third"] {
        let log = log.clone();
        scope.add_finalizer(move |_| async move { log.push(name) });
    }
    block_on(scope.close(ExitStatus::Success));
    assert_eq!(log.entries(), ["third", "second", "first"]);
}

#[test]
fn each_finalizer_runs_to_completion_before_the_next_starts() {
    let log = Log::new();
    let scope = Scope::new();
    slow_finalizer(&scope, &log, "a", Duration::ZERO);
    slow_finalizer(&scope, &log, "b", SLOW);
    block_on(scope.close(ExitStatus::Success));
    assert_eq!(log.entries(), ["b start", "b end", "a start", "a end"]);
}

#[test]
fn every_finalizer_is_told_success() {
    let statuses = Statuses::new();
    let scope = Scope::new();
    record_status(&scope, &statuses);
    record_status(&scope, &statuses);
    block_on(scope.close(ExitStatus::Success));
    let all = statuses.all();
    assert_eq!(all.len(), 2);
    assert!(
        all.iter().all(|s| matches!(s, ExitStatus::Success)),
        "{all:?}"
    );
}

#[test]
fn every_finalizer_is_told_failure() {
    let statuses = Statuses::new();
    let scope = Scope::new();
    record_status(&scope, &statuses);
    record_status(&scope, &statuses);
    block_on(scope.close(ExitStatus::Failure));
    let all = statuses.all();
    assert_eq!(all.len(), 2);
    assert!(
        all.iter().all(|s| matches!(s, ExitStatus::Failure)),
        "{all:?}"
    );
}

#[test]
fn exit_status_displays_how_the_scope_ended() {
    assert_eq!(ExitStatus::Success.to_string(), "success");
    assert_eq!(ExitStatus::Failure.to_string(), "failure");
    let status = ExitStatus::Interrupted(AbortReason::from("caller's reason"));
    assert_eq!(status.to_string(), "interrupted: caller's reason");
}

#[test]
fn every_finalizer_is_told_the_callers_interruption_reason() {
    let statuses = Statuses::new();
    let scope = Scope::new();
    record_status(&scope, &statuses);
    record_status(&scope, &statuses);
    let reason = AbortReason::from("caller's reason");
    block_on(scope.close(ExitStatus::Interrupted(reason.clone())));
    let all = statuses.all();
    assert_eq!(all.len(), 2);
    assert!(all.iter().all(|s| interrupted_by(s, &reason)), "{all:?}");
}

#[test]
fn a_panicking_finalizer_does_not_stop_the_others() {
    let log = Log::new();
    let scope = Scope::new();
    let first = log.clone();
    scope.add_finalizer(move |_| async move { first.push("first") });
    // One panics when called, one while it runs: neither stops the rest.
    scope.add_finalizer(|_| -> futures::future::Ready<()> {
        panic!("finalizer panics when called")
    });
    scope.add_finalizer(|_| async {
        yield_now().await;
        panic!("finalizer panics while it runs")
    });
    let last = log.clone();
    scope.add_finalizer(move |_| async move { last.push("last") });

    let close = AssertUnwindSafe(scope.close(ExitStatus::Success)).catch_unwind();
    assert!(block_on(close).is_err(), "the finalizer panic is surfaced");
    assert_eq!(log.entries(), ["last", "first"]);
}

#[test]
fn close_resumes_the_first_finalizer_panic_after_every_other_finalizer_ran() {
    let log = Log::new();
    let scope = Scope::new();
    let first = log.clone();
    scope.add_finalizer(move |_| async move { first.push("added first, runs last") });
    scope.add_finalizer(|_| async { panic!("runs second") });
    scope.add_finalizer(|_| async { panic!("runs first") });

    let close = AssertUnwindSafe(scope.close(ExitStatus::Success)).catch_unwind();
    let payload = block_on(close).unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"runs first"));
    assert_eq!(log.entries(), ["added first, runs last"]);
    assert!(scope.is_closed());
}

#[test]
fn only_the_close_that_started_it_is_given_the_finalizer_panic() {
    let scope = Scope::new();
    let gate = Flag::new();
    let finalizer_gate = gate.clone();
    scope.add_finalizer(move |_| async move {
        within(GENEROUS, "the gate opened", || async {
            finalizer_gate.is_set()
        })
        .await;
        panic!("the finalizer died");
    });
    let starter = scope.clone();
    let started = std::thread::spawn(move || {
        block_on(AssertUnwindSafe(starter.close(ExitStatus::Success)).catch_unwind()).is_err()
    });
    within_blocking(GENEROUS, "the close started", || scope.is_closed());
    let waiter = scope.clone();
    let waited = std::thread::spawn(move || block_on(waiter.close(ExitStatus::Failure)));
    gate.set();
    assert!(started.join().unwrap(), "the starter is given the panic");
    waited
        .join()
        .expect("a close that only waits does not panic");
}

#[test]
fn a_scoped_whose_finalizer_panics_resumes_that_panic_once_its_scope_is_closed() {
    let log = Log::new();
    let body_log = log.clone();
    let work = Scoped::<u32, Interrupted>::new(move |scope| async move {
        slow_finalizer(&scope, &body_log, "after the panic", SLOW);
        scope.add_finalizer(|_| async { panic!("the finalizer died") });
        Ok(42)
    });
    let payload = block_on(AssertUnwindSafe(work).catch_unwind()).unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"the finalizer died"));
    assert_eq!(
        log.entries(),
        ["after the panic start", "after the panic end"]
    );
}

#[test]
fn a_finalizer_panic_wins_over_an_error_and_over_an_interruption() {
    let failed = Scoped::<(), Interrupted>::new(|scope| async move {
        scope.add_finalizer(|_| async { panic!("died after an error") });
        Err(Interrupted::new("an error of the body".into()))
    });
    let payload = block_on(AssertUnwindSafe(failed).catch_unwind()).unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"died after an error"));

    let stop = Arc::new(AbortController::new());
    let stop_now = stop.clone();
    let interrupted = Scoped::<(), Interrupted>::new(move |scope| async move {
        scope.add_finalizer(|_| async { panic!("died after an interruption") });
        stop_now.abort("stop");
        yield_now().await;
        future::pending().await
    })
    .with_signal(&stop.signal());
    let payload = block_on(AssertUnwindSafe(interrupted).catch_unwind()).unwrap_err();
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"died after an interruption")
    );
}

#[test]
fn a_panicking_body_wins_over_a_panicking_finalizer() {
    let work = Scoped::<(), Interrupted>::new(|scope| async move {
        scope.add_finalizer(|_| async { panic!("the finalizer died") });
        panic!("the body died");
    });
    let payload = block_on(AssertUnwindSafe(work).catch_unwind()).unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"the body died"));
}

#[test]
fn a_nested_scopeds_finalizer_panic_surfaces_through_its_interrupted_parent() {
    let stop = AbortController::new();
    let parent = Scoped::<(), Interrupted>::new(|_| async move {
        Scoped::<(), Interrupted>::new(|child| async move {
            child.add_finalizer(|_| async { panic!("the child's finalizer died") });
            future::pending().await
        })
        .await
    })
    .with_signal(&stop.signal());
    let mut parent = Box::pin(AssertUnwindSafe(parent).catch_unwind());
    assert!(poll_once(&mut parent).is_pending(), "the child started");
    stop.abort("stop");
    let payload = block_on(parent).unwrap_err();
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"the child's finalizer died")
    );
}

#[test]
fn a_finalizer_added_while_closing_runs_in_the_same_close() {
    let log = Log::new();
    let scope = Scope::new();
    let (inner_scope, inner_log) = (scope.clone(), log.clone());
    scope.add_finalizer(move |_| async move {
        inner_log.push("outer");
        let late_log = inner_log.clone();
        inner_scope.add_finalizer(move |_| async move { late_log.push("added while closing") });
    });
    block_on(scope.close(ExitStatus::Success));
    assert_eq!(log.entries(), ["outer", "added while closing"]);
}

#[test]
fn a_finalizer_that_closes_its_own_scope_does_not_wait_for_itself() {
    let log = Log::new();
    let scope = Scope::new();
    let (inner_scope, inner_log) = (scope.clone(), log.clone());
    scope.add_finalizer(move |_| async move {
        inner_scope.close(ExitStatus::Failure).await;
        inner_log.push("closed from inside");
    });
    let closing = std::thread::spawn(move || block_on(scope.close(ExitStatus::Success)));
    within_blocking(GENEROUS, "the close finished", || closing.is_finished());
    assert_eq!(log.entries(), ["closed from inside"]);
}

#[test]
fn a_scoped_started_by_a_finalizer_belongs_to_the_closing_scope() {
    let log = Log::new();
    let scope = Scope::new();
    let inner_log = log.clone();
    scope.add_finalizer(move |_| async move {
        // A nested unit of clean-up that the finalizer abandons half-way (it loses a select).
        let abandoned = Scoped::<(), Interrupted>::new(move |nested| async move {
            let log = inner_log.clone();
            nested.add_finalizer(move |_| async move {
                // Slow enough that a close that did not wait for it would return first.
                leasehold::SystemClock
                    .sleep(Duration::from_millis(50))
                    .await;
                log.push("abandoned clean-up finished");
            });
            future::pending().await
        });
        let _ = future::select(abandoned, future::ready(())).await;
    });
    let outer_log = log.clone();
    block_on(async {
        let parent = Scoped::<(), Interrupted>::new(move |_| async move {
            scope.close(ExitStatus::Success).await;
            outer_log.push("close returned");
            Ok(())
        });
        parent.await.unwrap();
    });
    // The closing scope waited for the abandoned clean-up, rather than leaving it to whichever
    // `Scoped` happened to be polling the close.
    assert_eq!(
        log.entries(),
        ["abandoned clean-up finished", "close returned"]
    );
}

#[test]
fn a_finalizer_added_after_close_runs_at_once_with_the_recorded_status() {
    on_every_executor(|| async {
        let scope = Scope::new();
        let reason = AbortReason::from("closed earlier");
        scope.close(ExitStatus::Interrupted(reason.clone())).await;

        let statuses = Statuses::new();
        record_status(&scope, &statuses);
        within(GENEROUS, "the late finalizer ran", || async {
            statuses.all().len() == 1
        })
        .await;
        assert!(interrupted_by(&statuses.only(), &reason));
    });
}

// ---------------------------------------------------------------------------------------------
// Scope: close
// ---------------------------------------------------------------------------------------------

#[test]
fn close_is_idempotent_and_the_first_status_wins() {
    let statuses = Statuses::new();
    let runs = Counter::new();
    let scope = Scope::new();
    record_status(&scope, &statuses);
    let counted = runs.clone();
    scope.add_finalizer(move |_| async move {
        counted.bump();
    });

    assert!(!scope.is_closed());
    block_on(scope.close(ExitStatus::Failure));
    assert!(scope.is_closed());
    block_on(scope.close(ExitStatus::Success));
    block_on(scope.close(ExitStatus::Interrupted("late".into())));

    assert_eq!(runs.get(), 1);
    assert!(matches!(statuses.only(), ExitStatus::Failure));
}

#[test]
fn a_second_close_waits_for_the_first_close_to_finish() {
    let clock = TestClock::new();
    let log = Log::new();
    let statuses = Statuses::new();
    let scope = Scope::new();
    record_status(&scope, &statuses);
    let (sleepy, sleepy_log) = (clock.clone(), log.clone());
    scope.add_finalizer(move |_| async move {
        sleepy.sleep(Duration::from_secs(10)).await;
        sleepy_log.push("finalizer done");
    });

    let mut first = Box::pin(scope.close(ExitStatus::Success));
    assert!(
        poll_once(&mut first).is_pending(),
        "the finalizer is asleep"
    );
    let mut second = Box::pin(scope.close(ExitStatus::Failure));
    assert!(poll_once(&mut second).is_pending());

    clock.advance(Duration::from_secs(10));
    // The first close has not been polled since: its work is not done, so neither is the second.
    assert!(poll_once(&mut second).is_pending());
    assert!(poll_once(&mut first).is_ready());
    assert!(poll_once(&mut second).is_ready());
    assert_eq!(log.entries(), ["finalizer done"]);
    assert!(matches!(statuses.only(), ExitStatus::Success));
}

#[test]
fn a_close_dropped_half_way_still_finishes_in_the_background() {
    let clock = TestClock::new();
    let log = Log::new();
    let scope = Scope::new();
    let early = log.clone();
    scope.add_finalizer(move |_| async move { early.push("second finalizer") });
    let (sleepy, sleepy_log) = (clock.clone(), log.clone());
    scope.add_finalizer(move |_| async move {
        sleepy_log.push("first finalizer start");
        sleepy.sleep(Duration::from_secs(1)).await;
        sleepy_log.push("first finalizer end");
    });

    let mut close = Box::pin(scope.close(ExitStatus::Success));
    assert!(poll_once(&mut close).is_pending());
    assert_eq!(log.entries(), ["first finalizer start"]);
    drop(close);

    clock.advance(Duration::from_secs(1));
    within_blocking(GENEROUS, "the dropped close finished", || log.len() == 3);
    assert_eq!(
        log.entries(),
        [
            "first finalizer start",
            "first finalizer end",
            "second finalizer"
        ]
    );
    // A later close finds the close done.
    block_on(scope.close(ExitStatus::Failure));
}

#[test]
fn a_scope_dropped_without_close_closes_in_the_background_as_dropped() {
    let statuses = Statuses::new();
    let scope = Scope::new();
    record_status(&scope, &statuses);
    drop(scope);
    within_blocking(GENEROUS, "the orphaned finalizer ran", || {
        statuses.all().len() == 1
    });
    assert!(interrupted_with::<Dropped>(&statuses.only()));
}

#[test]
fn scope_close_runs_finalizers_and_awaits_forks_on_every_executor() {
    on_every_executor(|| async {
        let log = Log::new();
        let scope = Scope::new();
        slow_finalizer(&scope, &log, "a", SLOW);
        slow_finalizer(&scope, &log, "b", Duration::ZERO);
        let started = Flag::new();
        let (fiber_log, fiber_started) = (log.clone(), started.clone());
        let fiber = scope.fork(async move {
            scoped::<(), Interrupted, _, _>(move |inner| async move {
                slow_finalizer(&inner, &fiber_log, "fiber", SLOW);
                fiber_started.set();
                future::pending().await
            })
            .await
        });
        within(GENEROUS, "the fiber started", || async { started.is_set() }).await;

        scope.close(ExitStatus::Success).await;

        assert_eq!(
            log.entries(),
            [
                "fiber start",
                "fiber end",
                "b start",
                "b end",
                "a start",
                "a end"
            ]
        );
        assert!(fiber.is_finished());
        match fiber.join().await {
            Exit::Interrupted(reason) => assert!(reason.downcast_ref::<ScopeClosed>().is_some()),
            other => panic!("expected an interrupted fiber, got {other:?}"),
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Scope: adopt and fork
// ---------------------------------------------------------------------------------------------

struct Resource {
    name: &'static str,
    log: Log,
}

impl Release for Resource {
    fn release(self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            yield_now().await;
            self.log.push(format!("release {}", self.name));
        })
    }
}

impl Drop for Resource {
    fn drop(&mut self) {
        self.log.push(format!("drop {}", self.name));
    }
}

#[test]
fn adopt_releases_resources_in_lifo_order_with_the_finalizers() {
    let log = Log::new();
    let scope = Scope::new();
    let early = log.clone();
    scope.add_finalizer(move |_| async move { early.push("finalizer 1") });
    scope.adopt(Resource {
        name: "connection",
        log: log.clone(),
    });
    let late = log.clone();
    scope.add_finalizer(move |_| async move { late.push("finalizer 2") });
    assert!(log.entries().is_empty(), "adopting releases nothing yet");

    block_on(scope.close(ExitStatus::Success));
    assert_eq!(
        log.entries(),
        [
            "finalizer 2",
            "release connection",
            "drop connection",
            "finalizer 1"
        ]
    );
}

#[test]
fn a_fork_is_told_the_callers_reason_when_the_scope_closes_interrupted() {
    let scope = Scope::new();
    let fiber = scope.fork(future::pending::<()>());
    let reason = AbortReason::from("closing on purpose");
    block_on(scope.close(ExitStatus::Interrupted(reason.clone())));
    assert!(fiber.is_finished());
    match block_on(fiber.join()) {
        Exit::Interrupted(got) => assert!(got.ptr_eq(&reason)),
        other => panic!("expected an interrupted fiber, got {other:?}"),
    }
}

#[test]
fn a_fork_that_finished_before_close_keeps_its_value() {
    let scope = Scope::new();
    let fiber = scope.fork(async { 5 });
    within_blocking(GENEROUS, "the fiber finished", || fiber.is_finished());
    block_on(scope.close(ExitStatus::Success));
    assert!(matches!(block_on(fiber.join()), Exit::Success(5)));
}

#[test]
fn a_fork_on_a_closed_scope_is_interrupted_at_once_and_never_runs() {
    let scope = Scope::new();
    block_on(scope.close(ExitStatus::Success));
    let ran = Flag::new();
    let flag = ran.clone();
    let fiber = scope.fork(async move { flag.set() });
    match block_on(fiber.join()) {
        Exit::Interrupted(reason) => assert!(reason.downcast_ref::<ScopeClosed>().is_some()),
        other => panic!("expected an interrupted fiber, got {other:?}"),
    }
    assert!(!ran.is_set());
}

// ---------------------------------------------------------------------------------------------
// Scoped: how the body ends
// ---------------------------------------------------------------------------------------------

#[test]
fn a_value_closes_the_scope_with_success_before_it_is_returned() {
    let log = Log::new();
    let statuses = Statuses::new();
    let (body_log, body_statuses) = (log.clone(), statuses.clone());
    let value = block_on(Scoped::<_, Interrupted>::new(move |scope| async move {
        slow_finalizer(&scope, &body_log, "cleanup", SLOW);
        record_status(&scope, &body_statuses);
        Ok(42)
    }));
    assert_eq!(value.unwrap(), 42);
    assert_eq!(log.entries(), ["cleanup start", "cleanup end"]);
    assert!(matches!(statuses.only(), ExitStatus::Success));
}

#[test]
fn scoped_shorthand_closes_the_scope_before_it_returns() {
    let escaped = Arc::new(std::sync::Mutex::new(None::<Scope>));
    let keep = escaped.clone();
    let value: Result<&str, Interrupted> = block_on(scoped(move |scope| async move {
        *keep.lock().unwrap() = Some(scope);
        Ok("done")
    }));
    assert_eq!(value.unwrap(), "done");
    assert!(escaped.lock().unwrap().as_ref().unwrap().is_closed());
}

#[derive(Debug)]
enum AppError {
    Broken,
    Interrupted(Interrupted),
}

impl From<Interrupted> for AppError {
    fn from(error: Interrupted) -> Self {
        AppError::Interrupted(error)
    }
}

#[test]
fn a_body_error_runs_the_finalizers_with_failure() {
    let log = Log::new();
    let statuses = Statuses::new();
    let (body_log, body_statuses) = (log.clone(), statuses.clone());
    let result = block_on(Scoped::<(), AppError>::new(move |scope| async move {
        slow_finalizer(&scope, &body_log, "cleanup", SLOW);
        record_status(&scope, &body_statuses);
        Err(AppError::Broken)
    }));
    assert!(matches!(result, Err(AppError::Broken)));
    assert_eq!(log.entries(), ["cleanup start", "cleanup end"]);
    assert!(matches!(statuses.only(), ExitStatus::Failure));
}

#[test]
fn an_interruption_converts_into_the_bodys_error_type() {
    let controller = AbortController::new();
    let reason = AbortReason::from("converted");
    controller.abort(reason.clone());
    let result = block_on(
        Scoped::<(), AppError>::new(|_| future::pending()).with_signal(&controller.signal()),
    );
    match result {
        Err(AppError::Interrupted(error)) => assert!(error.reason().ptr_eq(&reason)),
        other => panic!("expected AppError::Interrupted, got {other:?}"),
    }
}

#[test]
fn a_panicking_body_closes_its_scope_and_then_the_panic_propagates() {
    let log = Log::new();
    let statuses = Statuses::new();
    let (body_log, body_statuses) = (log.clone(), statuses.clone());
    let work = Scoped::<(), Interrupted>::new(move |scope| async move {
        slow_finalizer(&scope, &body_log, "cleanup", SLOW);
        record_status(&scope, &body_statuses);
        yield_now().await;
        panic!("the body broke");
    });
    let payload = block_on(AssertUnwindSafe(work).catch_unwind()).unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"the body broke"));
    assert_eq!(log.entries(), ["cleanup start", "cleanup end"]);
    assert!(matches!(statuses.only(), ExitStatus::Failure));
}

#[test]
fn a_panicking_body_still_waits_for_the_children_it_drops() {
    let log = Log::new();
    let parent_log = log.clone();
    let work = Scoped::<(), Interrupted>::new(move |parent| async move {
        slow_finalizer(&parent, &parent_log, "parent", Duration::ZERO);
        let child = Scoped::<(), Interrupted>::new(move |child| async move {
            slow_finalizer(&child, &parent_log, "child", SLOW);
            future::pending().await
        });
        let breaks = async {
            yield_now().await;
            panic!("a sibling of the child broke");
        };
        let (never, ()) = future::join(child, breaks).await;
        never
    });
    let payload = block_on(AssertUnwindSafe(work).catch_unwind()).unwrap_err();
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"a sibling of the child broke")
    );
    assert_eq!(
        log.entries(),
        ["child start", "child end", "parent start", "parent end"]
    );
}

// ---------------------------------------------------------------------------------------------
// Scoped: interruption
// ---------------------------------------------------------------------------------------------

#[test]
fn a_test_clock_drives_a_scoped_timeout_and_the_cleanup_runs_first() {
    on_every_executor(|| async {
        let clock = TestClock::new();
        let statuses = Statuses::new();
        let body_statuses = statuses.clone();
        let mut work = Box::pin(
            Scoped::<(), Interrupted>::new(move |scope| async move {
                record_status(&scope, &body_statuses);
                future::pending().await
            })
            .timeout_on(Arc::new(clock.clone()), Duration::from_secs(60)),
        );
        assert!(poll_once(&mut work).is_pending());
        clock.advance(Duration::from_secs(59));
        assert_eq!(clock.sleepers(), 1, "the timer still sleeps at 59 s");
        clock.advance(Duration::from_secs(1));
        let error = work.await.unwrap_err();
        assert!(error.reason().downcast_ref::<TimedOut>().is_some());
        assert!(interrupted_by(&statuses.only(), error.reason()));
    });
}

#[test]
fn a_scoped_timeout_counts_from_the_first_poll_not_from_when_it_was_built() {
    let clock = TestClock::new();
    let mut work = Box::pin(
        Scoped::<(), Interrupted>::new(|_| future::pending())
            .timeout_on(Arc::new(clock.clone()), Duration::from_secs(60)),
    );
    assert_eq!(clock.sleepers(), 0, "no timer before the first poll");
    clock.advance(Duration::from_secs(600));
    assert!(poll_once(&mut work).is_pending());
    assert_eq!(clock.sleepers(), 1, "the minute starts now");
    clock.advance(Duration::from_secs(60));
    let error = block_on(work).unwrap_err();
    assert!(error.reason().downcast_ref::<TimedOut>().is_some());
}

#[test]
fn a_scoped_that_finishes_before_its_timeout_keeps_its_value() {
    let clock = TestClock::new();
    let work = Scoped::<u32, Interrupted>::new(|_| async { Ok(7) })
        .timeout_on(Arc::new(clock.clone()), Duration::from_secs(1));
    assert_eq!(block_on(work).unwrap(), 7);
}

#[test]
fn a_scoped_timeout_on_the_system_clock_interrupts_with_timed_out() {
    on_every_executor(|| async {
        let started = std::time::Instant::now();
        let work = Scoped::<(), Interrupted>::new(|_| future::pending())
            .timeout(Duration::from_millis(10));
        let error = work.await.unwrap_err();
        assert!(error.reason().downcast_ref::<TimedOut>().is_some());
        assert!(started.elapsed() >= Duration::from_millis(10));
    });
}

#[test]
fn the_first_of_a_timeout_and_a_signal_gives_the_reason() {
    let clock = TestClock::new();
    let stop = AbortController::new();
    let mut work = Box::pin(
        Scoped::<(), Interrupted>::new(|_| future::pending())
            .timeout_on(Arc::new(clock.clone()), Duration::from_secs(60))
            .with_signal(&stop.signal()),
    );
    assert!(poll_once(&mut work).is_pending());
    stop.abort("stopped first");
    clock.advance(Duration::from_secs(60));
    let error = block_on(work).unwrap_err();
    assert_eq!(error.reason().to_string(), "stopped first");
}

#[test]
fn an_already_aborted_signal_means_the_body_never_runs() {
    let controller = AbortController::new();
    let reason = AbortReason::from("before it started");
    controller.abort(reason.clone());
    let ran = Flag::new();
    let flag = ran.clone();
    let work = Scoped::<(), Interrupted>::new(move |scope| {
        flag.set();
        scope.add_finalizer(|_| async {});
        async { Ok(()) }
    })
    .with_signal(&controller.signal());
    let error = block_on(work).unwrap_err();
    assert!(error.reason().ptr_eq(&reason));
    assert!(!ran.is_set(), "the body ran");
}

#[test]
fn the_body_is_never_polled_again_once_the_signal_has_aborted() {
    let controller = AbortController::new();
    let polls = Counter::new();
    let counted = polls.clone();
    let mut work = Scoped::<(), Interrupted>::new(move |_| {
        future::poll_fn(move |_| {
            counted.bump();
            Poll::Pending
        })
    })
    .with_signal(&controller.signal());
    assert!(poll_once(&mut work).is_pending());
    assert_eq!(polls.get(), 1);

    let reason = AbortReason::from("stop now");
    controller.abort(reason.clone());
    match poll_once(&mut work) {
        Poll::Ready(Err(error)) => assert!(error.reason().ptr_eq(&reason)),
        other => panic!("expected the interruption, got {other:?}"),
    }
    assert_eq!(polls.get(), 1, "the body was polled after the abort");
}

#[test]
fn an_abort_wakes_a_waiting_scoped() {
    let controller = AbortController::new();
    let work =
        Scoped::<(), Interrupted>::new(|_| future::pending()).with_signal(&controller.signal());
    let waiter = std::thread::spawn(move || block_on(work));
    let reason = AbortReason::from("wake up");
    controller.abort(reason.clone());
    let error = waiter.join().unwrap().unwrap_err();
    assert!(error.reason().ptr_eq(&reason));
}

#[test]
fn the_first_of_several_signals_to_abort_gives_the_reason() {
    let a = AbortController::new();
    let b = AbortController::new();
    let statuses = Statuses::new();
    let recorded = statuses.clone();
    let mut work = Scoped::<(), Interrupted>::new(move |scope| async move {
        record_status(&scope, &recorded);
        future::pending().await
    })
    .with_signal(&a.signal())
    .with_signal(&b.signal());
    assert!(poll_once(&mut work).is_pending());

    let reason = AbortReason::from("b first");
    b.abort(reason.clone());
    a.abort("a later");
    let error = block_on(work).unwrap_err();
    assert!(error.reason().ptr_eq(&reason));
    assert!(interrupted_by(&statuses.only(), &reason));
}

#[test]
fn a_value_wins_over_a_late_interruption() {
    let clock = TestClock::new();
    let controller = AbortController::new();
    let statuses = Statuses::new();
    let (sleepy, recorded) = (clock.clone(), statuses.clone());
    let mut work = Scoped::<u32, Interrupted>::new(move |scope| async move {
        scope.add_finalizer(move |status| async move {
            recorded.push(status);
            sleepy.sleep(Duration::from_secs(1)).await;
        });
        Ok(5)
    })
    .with_signal(&controller.signal());

    // The body has its value; the scope is closing, its finalizer asleep.
    assert!(poll_once(&mut work).is_pending());
    controller.abort("too late");
    assert!(poll_once(&mut work).is_pending());
    clock.advance(Duration::from_secs(1));
    assert!(matches!(poll_once(&mut work), Poll::Ready(Ok(5))));
    assert!(matches!(statuses.only(), ExitStatus::Success));
}

#[test]
fn interruption_waits_for_async_finalizers_before_resolving() {
    on_every_executor(|| async {
        let controller = AbortController::new();
        let log = Log::new();
        let started = Flag::new();
        let (body_log, body_started) = (log.clone(), started.clone());
        let work = Scoped::<(), Interrupted>::new(move |scope| async move {
            slow_finalizer(&scope, &body_log, "first", SLOW);
            slow_finalizer(&scope, &body_log, "second", SLOW);
            body_started.set();
            future::pending().await
        })
        .with_signal(&controller.signal());
        let reason = AbortReason::from("shutting down");
        let abort = async {
            within(GENEROUS, "the body started", || async { started.is_set() }).await;
            controller.abort(reason.clone());
        };

        let (result, ()) = future::join(work, abort).await;

        assert!(result.unwrap_err().reason().ptr_eq(&reason));
        assert_eq!(
            log.entries(),
            ["second start", "second end", "first start", "first end"]
        );
    });
}

#[test]
fn nested_scoped_unwind_inner_before_outer() {
    on_every_executor(|| async {
        let controller = AbortController::new();
        let log = Log::new();
        let statuses = Statuses::new();
        let started = Flag::new();
        let (outer_log, outer_statuses, outer_started) =
            (log.clone(), statuses.clone(), started.clone());
        let work = Scoped::<(), Interrupted>::new(move |outer| async move {
            slow_finalizer(&outer, &outer_log, "outer", SLOW);
            record_status(&outer, &outer_statuses);
            Scoped::<(), Interrupted>::new(move |middle| async move {
                slow_finalizer(&middle, &outer_log, "middle", SLOW);
                record_status(&middle, &outer_statuses);
                Scoped::<(), Interrupted>::new(move |inner| async move {
                    slow_finalizer(&inner, &outer_log, "inner", SLOW);
                    record_status(&inner, &outer_statuses);
                    outer_started.set();
                    future::pending().await
                })
                .await
            })
            .await
        })
        .with_signal(&controller.signal());
        let reason = AbortReason::from("unwind");
        let abort = async {
            within(GENEROUS, "the innermost body started", || async {
                started.is_set()
            })
            .await;
            controller.abort(reason.clone());
        };

        let (result, ()) = future::join(work, abort).await;

        assert!(result.unwrap_err().reason().ptr_eq(&reason));
        assert_eq!(
            log.entries(),
            [
                "inner start",
                "inner end",
                "middle start",
                "middle end",
                "outer start",
                "outer end"
            ]
        );
        let all = statuses.all();
        assert_eq!(all.len(), 3);
        assert!(all.iter().all(|s| interrupted_by(s, &reason)), "{all:?}");
    });
}

/// Inner before outer holds for the parent's fibers too: a nested `Scoped`'s clean-up may need
/// what the parent's fibers do (a pump, a heartbeat), so the parent interrupts them only after
/// the nested clean-up has finished, whether the parent is interrupted or dropped.
#[test]
fn a_parents_fibers_outlive_the_clean_up_of_its_nested_scoped() {
    for dropped in [false, true] {
        on_every_executor(move || async move {
            let controller = AbortController::new();
            let started = Flag::new();
            let fiber_alive_at_inner_cleanup = Arc::new(std::sync::Mutex::new(None));
            let cleaned = Flag::new();
            let (seen, body_started, inner_cleaned) = (
                fiber_alive_at_inner_cleanup.clone(),
                started.clone(),
                cleaned.clone(),
            );
            let mut work = Scoped::<(), Interrupted>::new(move |outer| async move {
                let pump = outer.fork(future::pending::<()>());
                Scoped::<(), Interrupted>::new(move |inner| async move {
                    inner.add_finalizer(move |_| async move {
                        // Give an early interruption of the pump time to land.
                        yield_now().await;
                        *seen.lock().unwrap() = Some(!pump.is_finished());
                        inner_cleaned.set();
                    });
                    body_started.set();
                    future::pending().await
                })
                .await
            })
            .with_signal(&controller.signal());
            assert!(poll_once(&mut work).is_pending());
            assert!(started.is_set());
            if dropped {
                drop(work);
                within(GENEROUS, "the nested clean-up ran", || async {
                    cleaned.is_set()
                })
                .await;
            } else {
                controller.abort("stop");
                assert!(work.await.is_err());
            }
            assert_eq!(
                *fiber_alive_at_inner_cleanup.lock().unwrap(),
                Some(true),
                "dropped: {dropped}: the parent's fiber was interrupted before the nested \
                 Scoped's clean-up ran"
            );
        });
    }
}

/// A clean-up handed to an executor that drops it unfinished (a runtime shutting down) cannot
/// run; that is logged at error, not lost without a word.
#[test]
fn a_clean_up_that_its_executor_drops_unfinished_is_reported() {
    common::error_logged("");
    let dead: Arc<dyn leasehold::Spawner> = Arc::new(|future: BoxFuture<'static, ()>| drop(future));
    let mut work = Scoped::<(), Interrupted>::new(|scope| async move {
        scope.add_finalizer(|_| async {});
        future::pending().await
    })
    .with_spawner(dead);
    assert!(poll_once(&mut work).is_pending());
    drop(work);
    assert!(common::error_logged(
        "dropped by its executor before it finished"
    ));
}

/// Runs `work`, interrupting it through `stop` once `started` is set; its outcome.
async fn interrupted_once<T, E>(
    work: Scoped<T, E>,
    stop: &AbortController,
    started: &Flag,
) -> Result<T, E>
where
    T: Send + 'static,
    E: Send + 'static,
{
    let abort = async {
        within(GENEROUS, "the nested body started", || async {
            started.is_set()
        })
        .await;
        stop.abort("stop");
    };
    future::join(work, abort).await.0
}

/// On interruption the nested `Scoped` futures unwind first, their finalizers finished, and only
/// then is the parent's body dropped: its locals outlive the nested clean-up.
#[test]
fn a_nested_clean_up_finishes_before_the_interrupted_parents_body_is_dropped() {
    on_every_executor(|| async {
        let log = Log::new();
        struct Local(Log);
        impl Drop for Local {
            fn drop(&mut self) {
                self.0.push("parent body dropped");
            }
        }
        let stop = AbortController::new();
        let started = Flag::new();
        let (in_body, in_finalizer, body_started) = (log.clone(), log.clone(), started.clone());
        let parent = Scoped::<(), Interrupted>::new(move |_| async move {
            let _local = Local(in_body);
            Scoped::<(), Interrupted>::new(move |nested| async move {
                nested.add_finalizer(move |_| async move {
                    yield_now().await;
                    in_finalizer.push("nested finalizer finished");
                });
                body_started.set();
                future::pending().await
            })
            .await
        })
        .with_signal(&stop.signal());
        assert!(interrupted_once(parent, &stop, &started).await.is_err());
        assert_eq!(
            log.entries(),
            ["nested finalizer finished", "parent body dropped"]
        );
    });
}

/// The same with a lock: a nested clean-up of work done under the parent's guard still runs
/// under it.
#[test]
fn a_nested_clean_up_runs_while_the_interrupted_parent_still_holds_its_lock() {
    on_every_executor(|| async {
        let locks = leasehold::LockManager::open_in_memory().unwrap();
        let held = Arc::new(std::sync::Mutex::new(None));
        let stop = AbortController::new();
        let started = Flag::new();
        let (inner_locks, seen, body_started) = (locks.clone(), held.clone(), started.clone());
        let parent = Scoped::<(), leasehold::LockError>::new(move |_| async move {
            let _guard = inner_locks.exclusive("repo", "write").await?;
            Scoped::<(), leasehold::LockError>::new(move |nested| async move {
                nested.add_finalizer(move |_| async move {
                    *seen.lock().unwrap() = Some(inner_locks.is_locked("repo").await.unwrap());
                });
                body_started.set();
                future::pending().await
            })
            .await
        })
        .with_signal(&stop.signal());
        assert!(interrupted_once(parent, &stop, &started).await.is_err());
        assert_eq!(
            *held.lock().unwrap(),
            Some(true),
            "the lock was released before the nested clean-up ran"
        );
        assert!(!locks.is_locked("repo").await.unwrap());
    });
}

#[test]
fn interruption_unwinds_every_concurrent_child_before_the_parent_closes() {
    let controller = AbortController::new();
    let log = Log::new();
    let started = Counter::new();
    let (parent_log, parent_started) = (log.clone(), started.clone());
    let work = Scoped::<(), Interrupted>::new(move |parent| async move {
        slow_finalizer(&parent, &parent_log, "parent", Duration::ZERO);
        let children = (0..3).map(|i| {
            let (log, started) = (parent_log.clone(), parent_started.clone());
            Scoped::<(), Interrupted>::new(move |child| async move {
                slow_finalizer(&child, &log, &format!("child {i}"), SLOW);
                started.bump();
                future::pending().await
            })
        });
        future::join_all(children).await;
        Ok(())
    })
    .with_signal(&controller.signal());
    let reason = AbortReason::from("stop all");
    let abort = async {
        within(GENEROUS, "every child started", || async {
            started.get() == 3
        })
        .await;
        controller.abort(reason.clone());
    };

    let (result, ()) = block_on(future::join(work, abort));

    assert!(result.unwrap_err().reason().ptr_eq(&reason));
    let entries = log.entries();
    assert_eq!(entries.len(), 8, "{entries:?}");
    assert_eq!(&entries[6..], ["parent start", "parent end"]);
    for i in 0..3 {
        let start = entries
            .iter()
            .position(|e| *e == format!("child {i} start"));
        let end = entries.iter().position(|e| *e == format!("child {i} end"));
        assert!(start.unwrap() < end.unwrap(), "{entries:?}");
    }
}

#[test]
fn a_child_interrupted_by_its_own_signal_leaves_the_parent_running() {
    let child_stop = AbortController::new();
    let reason = AbortReason::from("only the child");
    child_stop.abort(reason.clone());
    let log = Log::new();
    let parent_log = log.clone();
    let result = block_on(Scoped::<&str, Interrupted>::new(move |parent| async move {
        slow_finalizer(&parent, &parent_log, "parent", Duration::ZERO);
        let child = Scoped::<(), Interrupted>::new(|_| future::pending())
            .with_signal(&child_stop.signal())
            .await;
        assert!(child.unwrap_err().reason().ptr_eq(&reason));
        Ok("parent finished")
    }));
    assert_eq!(result.unwrap(), "parent finished");
    assert_eq!(log.entries(), ["parent start", "parent end"]);
}

#[test]
fn an_interruption_reaches_a_nested_scoped_that_is_already_closing() {
    let clock = TestClock::new();
    let controller = AbortController::new();
    let log = Log::new();
    let (sleepy, parent_log) = (clock.clone(), log.clone());
    let mut work = Scoped::<(), Interrupted>::new(move |parent| async move {
        slow_finalizer(&parent, &parent_log, "parent", Duration::ZERO);
        let child_log = parent_log.clone();
        Scoped::<(), Interrupted>::new(move |child| async move {
            child.add_finalizer(move |_| async move {
                child_log.push("child start");
                sleepy.sleep(Duration::from_secs(1)).await;
                child_log.push("child end");
            });
            Ok(())
        })
        .await?;
        future::pending().await
    })
    .with_signal(&controller.signal());

    // The child has its value and sleeps in its finalizer when the parent is interrupted.
    assert!(poll_once(&mut work).is_pending());
    assert_eq!(log.entries(), ["child start"]);
    let reason = AbortReason::from("mid-close");
    controller.abort(reason.clone());
    assert!(poll_once(&mut work).is_pending());
    assert_eq!(log.entries(), ["child start"], "the parent did not wait");
    clock.advance(Duration::from_secs(1));
    match poll_once(&mut work) {
        Poll::Ready(Err(error)) => assert!(error.reason().ptr_eq(&reason)),
        other => panic!("expected the interruption, got {other:?}"),
    }
    assert_eq!(
        log.entries(),
        ["child start", "child end", "parent start", "parent end"]
    );
}

// ---------------------------------------------------------------------------------------------
// Scoped: dropped before it finished
// ---------------------------------------------------------------------------------------------

#[test]
fn dropping_an_unfinished_scoped_runs_its_finalizers_in_the_background() {
    let log = Log::new();
    let statuses = Statuses::new();
    let (body_log, body_statuses) = (log.clone(), statuses.clone());
    let mut work = Scoped::<(), Interrupted>::new(move |scope| async move {
        slow_finalizer(&scope, &body_log, "cleanup", SLOW);
        record_status(&scope, &body_statuses);
        future::pending().await
    });
    assert!(poll_once(&mut work).is_pending());
    drop(work);

    within_blocking(GENEROUS, "the dropped Scoped's finalizers ran", || {
        log.contains("cleanup end")
    });
    assert!(interrupted_with::<Dropped>(&statuses.only()));
}

#[test]
fn a_scoped_dropped_while_closing_still_finishes_its_close() {
    let clock = TestClock::new();
    let log = Log::new();
    let (sleepy, body_log) = (clock.clone(), log.clone());
    let mut work = Scoped::<u32, Interrupted>::new(move |scope| async move {
        scope.add_finalizer(move |_| async move {
            sleepy.sleep(Duration::from_secs(1)).await;
            body_log.push("finalizer end");
        });
        Ok(1)
    });
    assert!(poll_once(&mut work).is_pending());
    drop(work);
    clock.advance(Duration::from_secs(1));
    within_blocking(GENEROUS, "the close finished", || {
        log.contains("finalizer end")
    });
}

#[test]
fn a_hard_cancelled_parent_closes_its_children_before_itself_in_the_background() {
    let log = Log::new();
    let started = Flag::new();
    let (parent_log, parent_started) = (log.clone(), started.clone());
    let mut work = Scoped::<(), Interrupted>::new(move |parent| async move {
        slow_finalizer(&parent, &parent_log, "parent", Duration::ZERO);
        Scoped::<(), Interrupted>::new(move |child| async move {
            slow_finalizer(&child, &parent_log, "child", SLOW);
            parent_started.set();
            future::pending().await
        })
        .await
    });
    assert!(poll_once(&mut work).is_pending());
    assert!(started.is_set());
    drop(work);

    within_blocking(GENEROUS, "both scopes closed", || log.len() == 4);
    assert_eq!(
        log.entries(),
        ["child start", "child end", "parent start", "parent end"]
    );
}

#[test]
fn a_child_dropped_by_its_parent_body_is_awaited_by_the_parent_close() {
    on_every_executor(|| async {
        let log = Log::new();
        let statuses = Statuses::new();
        let (parent_log, child_statuses) = (log.clone(), statuses.clone());
        let result = Scoped::<&str, Interrupted>::new(move |parent| async move {
            slow_finalizer(&parent, &parent_log, "parent", Duration::ZERO);
            let child = Scoped::<(), Interrupted>::new(move |child| async move {
                slow_finalizer(&child, &parent_log, "child", SLOW);
                record_status(&child, &child_statuses);
                future::pending().await
            });
            // The child is polled first (and registers its finalizer), then loses the race.
            match future::select(child, future::ready("the other branch")).await {
                Either::Left(_) => unreachable!("the child never finishes"),
                Either::Right((winner, _)) => Ok(winner),
            }
        })
        .await;

        assert_eq!(result.unwrap(), "the other branch");
        assert_eq!(
            log.entries(),
            ["child start", "child end", "parent start", "parent end"]
        );
        assert!(interrupted_with::<Dropped>(&statuses.only()));
    });
}

#[test]
fn a_child_dropped_during_an_interruption_hands_its_close_to_the_parent() {
    // The parent's body is dropped by the interruption; the child inside it unwinds with the
    // parent's reason, not as merely dropped.
    let controller = AbortController::new();
    let statuses = Statuses::new();
    let recorded = statuses.clone();
    let mut work = Scoped::<(), Interrupted>::new(move |_| async move {
        let child = Scoped::<(), Interrupted>::new(move |child| async move {
            record_status(&child, &recorded);
            future::pending().await
        });
        let _ = future::select(child, future::pending::<()>()).await;
        Ok(())
    })
    .with_signal(&controller.signal());
    assert!(poll_once(&mut work).is_pending());
    let reason = AbortReason::from("parent interrupted");
    controller.abort(reason.clone());
    let error = block_on(work).unwrap_err();
    assert!(error.reason().ptr_eq(&reason));
    assert!(interrupted_by(&statuses.only(), &reason));
}
