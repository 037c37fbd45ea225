//! Abort controllers, signals and reasons.

mod common;

use std::error::Error;
use std::fmt;
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use common::{on_every_executor, poll_once, GENEROUS};
use futures::FutureExt;
use leasehold::{
    AbortController, AbortReason, AbortSignal, Clock, Interrupted, Scoped, SystemClock, TestClock,
    TimedOut,
};

#[derive(Debug)]
struct Shutdown(u32);

impl fmt::Display for Shutdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shutdown #{}", self.0)
    }
}

impl Error for Shutdown {}

#[test]
fn the_first_reason_wins_and_later_aborts_report_false() {
    let controller = AbortController::new();
    let signal = controller.signal();
    let first = AbortReason::from("first");
    let second = AbortReason::from("second");

    assert!(controller.abort(first.clone()));
    assert!(!controller.abort(second.clone()));

    let reason = signal.reason().expect("aborted");
    assert!(reason.ptr_eq(&first));
    assert!(!reason.ptr_eq(&second));
}

#[test]
fn abort_with_takes_an_error_type_directly_and_the_work_gets_it_back() {
    let controller = AbortController::new();
    assert!(controller.abort_with(Shutdown(7)));
    assert!(!controller.abort_with(Shutdown(8)), "the first reason wins");
    let work = Scoped::<(), Interrupted>::new(|_| std::future::pending())
        .with_signal(&controller.signal());
    let error = futures::executor::block_on(work).unwrap_err();
    assert_eq!(error.reason().downcast_ref::<Shutdown>().unwrap().0, 7);
    assert_eq!(error.to_string(), "interrupted: shutdown #7");
}

#[test]
fn abort_still_takes_text() {
    let controller = AbortController::new();
    assert!(controller.abort("plain text"));
    assert_eq!(
        controller.signal().reason().unwrap().to_string(),
        "plain text"
    );
}

#[test]
fn the_callers_reason_object_reaches_the_interrupted_scoped() {
    let controller = AbortController::new();
    let reason = AbortReason::new(Shutdown(7));
    let work = Scoped::<(), Interrupted>::new(|_| std::future::pending())
        .with_signal(&controller.signal());
    controller.abort(reason.clone());

    let error = futures::executor::block_on(work).unwrap_err();
    assert!(error.reason().ptr_eq(&reason));
    assert_eq!(error.reason().downcast_ref::<Shutdown>().unwrap().0, 7);
}

#[test]
fn every_signal_of_a_controller_sees_the_same_reason_object() {
    let controller = AbortController::new();
    let signals: Vec<AbortSignal> = (0..3).map(|_| controller.signal()).collect();
    let copy = signals[0].clone();
    let reason = AbortReason::from("stop");
    controller.abort(reason.clone());

    for signal in signals.iter().chain([&copy]) {
        assert!(signal.is_aborted());
        assert!(signal.reason().unwrap().ptr_eq(&reason));
    }
}

#[test]
fn a_signal_that_has_not_aborted_has_no_reason() {
    let controller = AbortController::default();
    let signal = controller.signal();
    assert!(!signal.is_aborted());
    assert!(signal.reason().is_none());
    assert!(poll_once(&mut Box::pin(signal.aborted())).is_pending());
}

#[test]
fn never_never_aborts() {
    for signal in [AbortSignal::never(), AbortSignal::default()] {
        assert!(!signal.is_aborted());
        assert!(signal.reason().is_none());
        assert!(poll_once(&mut Box::pin(signal.aborted())).is_pending());
    }
}

#[test]
fn aborted_resolves_at_once_on_an_already_aborted_signal() {
    let controller = AbortController::new();
    let reason = AbortReason::from("early");
    controller.abort(reason.clone());
    let got = futures::executor::block_on(controller.signal().aborted());
    assert!(got.ptr_eq(&reason));
}

#[test]
fn timeout_aborts_with_a_timed_out_reason() {
    on_every_executor(|| async {
        let started = Instant::now();
        let signal = AbortSignal::timeout(Duration::from_millis(10));
        assert!(!signal.is_aborted(), "a 10 ms timeout aborted at once");
        let reason = signal.aborted().await;
        assert!(reason.downcast_ref::<TimedOut>().is_some(), "{reason:?}");
        assert_eq!(reason.to_string(), "timed out");
        assert!(started.elapsed() >= Duration::from_millis(10));
        assert!(signal.reason().unwrap().ptr_eq(&reason));
    });
}

#[test]
fn a_test_clock_drives_timeout_on() {
    on_every_executor(|| async {
        let clock = TestClock::new();
        let signal = AbortSignal::timeout_on(Arc::new(clock.clone()), Duration::from_secs(30));
        assert_eq!(
            clock.sleepers(),
            0,
            "no task sleeps for a timeout nobody awaits"
        );
        clock.advance(Duration::from_secs(29));
        assert!(!signal.is_aborted(), "the time counts from the call");
        let mut awaiting = Box::pin(signal.aborted());
        assert!(poll_once(&mut awaiting).is_pending());
        assert_eq!(
            clock.sleepers(),
            1,
            "whoever awaits it sleeps until its deadline"
        );
        clock.advance(Duration::from_secs(1));
        let reason = awaiting.await;
        assert!(reason.downcast_ref::<TimedOut>().is_some(), "{reason:?}");
    });
}

/// What a look at a timeout sees follows its clock, not when its timer task gets to run: once
/// the clock has passed it, the timeout and any signal made from it are aborted at once.
#[test]
fn a_timeout_is_aborted_as_soon_as_its_clock_has_passed_it() {
    let clock = TestClock::new();
    let thirty = Duration::from_secs(30);
    let timeout = AbortSignal::timeout_on(Arc::new(clock.clone()), thirty);
    let other = AbortController::new();
    let nested = AbortSignal::any([AbortSignal::any([timeout.clone(), other.signal()])]);
    clock.advance(thirty - Duration::from_nanos(1));
    assert!(!timeout.is_aborted() && !nested.is_aborted());
    clock.advance(Duration::from_nanos(1));
    assert!(
        nested.is_aborted(),
        "the signal made from it, looked at first"
    );
    assert!(timeout
        .reason()
        .unwrap()
        .downcast_ref::<TimedOut>()
        .is_some());
    assert!(nested.reason().unwrap().ptr_eq(&timeout.reason().unwrap()));
}

/// A zero timeout interrupts before the body runs, every time, on any clock.
#[test]
fn a_zero_timeout_never_lets_the_body_run() {
    let clocks: [Arc<dyn Clock>; 2] = [Arc::new(TestClock::new()), Arc::new(SystemClock)];
    for clock in clocks {
        for _ in 0..200 {
            let work = Scoped::<(), Interrupted>::new(|_| async {
                panic!("the body ran despite a zero timeout")
            })
            .timeout_on(clock.clone(), Duration::ZERO);
            let error = futures::executor::block_on(work).unwrap_err();
            assert!(error.reason().downcast_ref::<TimedOut>().is_some());
        }
    }
}

#[test]
fn timeout_on_ignores_a_step_of_the_wall_clock() {
    let clock = TestClock::new();
    let signal = AbortSignal::timeout_on(Arc::new(clock.clone()), Duration::from_secs(30));
    clock.set_wall_time(clock.now() + Duration::from_secs(3600));
    assert!(!signal.is_aborted(), "an hour's step forward fired it");
    clock.advance(Duration::from_secs(30));
    let reason = futures::executor::block_on(signal.aborted());
    assert!(reason.downcast_ref::<TimedOut>().is_some());
}

#[test]
fn timeout_interrupts_a_scoped_with_timed_out() {
    let work = Scoped::<(), Interrupted>::new(|_| std::future::pending())
        .with_signal(&AbortSignal::timeout(Duration::from_millis(5)));
    let error = futures::executor::block_on(work).unwrap_err();
    assert!(error.reason().downcast_ref::<TimedOut>().is_some());
}

#[test]
fn any_passes_the_sources_reason_object_on() {
    let a = AbortController::new();
    let b = AbortController::new();
    let either = AbortSignal::any([a.signal(), b.signal(), AbortSignal::never()]);
    assert!(!either.is_aborted());

    let reason = AbortReason::new(Shutdown(2));
    b.abort(reason.clone());
    assert!(either.reason().unwrap().ptr_eq(&reason));
    assert!(futures::executor::block_on(either.aborted()).ptr_eq(&reason));

    // The other source aborting later changes nothing.
    a.abort("later");
    assert!(either.reason().unwrap().ptr_eq(&reason));
}

#[test]
fn any_with_an_already_aborted_source_is_aborted_at_once() {
    let a = AbortController::new();
    let reason = AbortReason::from("already");
    a.abort(reason.clone());
    let b = AbortController::new();
    let either = AbortSignal::any([b.signal(), a.signal()]);
    assert!(either.reason().unwrap().ptr_eq(&reason));
}

#[test]
fn any_of_any_passes_the_reason_through_every_level() {
    let a = AbortController::new();
    let b = AbortController::new();
    let c = AbortController::new();
    let inner = AbortSignal::any([a.signal(), b.signal()]);
    let outer = AbortSignal::any([inner, c.signal()]);
    let reason = AbortReason::from("deep");
    a.abort(reason.clone());
    assert!(outer.reason().unwrap().ptr_eq(&reason));
}

#[test]
fn any_with_a_timeout_source_aborts_when_the_timeout_fires() {
    let user = AbortController::new();
    // Nobody but the combined signal holds the timeout signal.
    let either = AbortSignal::any([
        user.signal(),
        AbortSignal::timeout(Duration::from_millis(5)),
    ]);
    let reason = futures::executor::block_on(async {
        futures::select! {
            reason = either.aborted().fuse() => Some(reason),
            _ = SystemClock.sleep(GENEROUS).fuse() => None,
        }
    })
    .expect("the combined signal aborted when its timeout fired");
    assert!(reason.downcast_ref::<TimedOut>().is_some(), "{reason:?}");
}

#[test]
fn any_of_nothing_never_aborts() {
    let none = AbortSignal::any(std::iter::empty());
    assert!(!none.is_aborted());
    let nevers = AbortSignal::any([AbortSignal::never(), AbortSignal::never()]);
    assert!(!nevers.is_aborted());
}

#[test]
fn any_wakes_a_waiter_that_was_already_waiting() {
    let a = AbortController::new();
    let b = AbortController::new();
    let either = AbortSignal::any([a.signal(), b.signal()]);
    let mut waiting = Box::pin(either.aborted());
    assert!(poll_once(&mut waiting).is_pending());
    let reason = AbortReason::from("woken");
    let waiter = thread::spawn(move || futures::executor::block_on(waiting));
    a.abort(reason.clone());
    assert!(waiter.join().unwrap().ptr_eq(&reason));
}

/// Many threads wait while several others race to abort: every waiter wakes, exactly one abort
/// wins, and every waiter sees the winner's reason object. Repeated so that the abort lands at
/// every point of a waiter's listen/check/await sequence.
#[test]
fn aborted_never_misses_a_wakeup() {
    const ROUNDS: usize = 200;
    const WAITERS: usize = 6;
    const ABORTERS: usize = 3;

    for round in 0..ROUNDS {
        let controller = Arc::new(AbortController::new());
        // Half the waiters go through `any`, which aborts on another thread's call stack.
        let other = AbortController::new();
        let start = Arc::new(Barrier::new(WAITERS + ABORTERS));
        let (woke, woken) = mpsc::channel::<AbortReason>();
        let (won, winners) = mpsc::channel::<AbortReason>();

        let mut threads = Vec::new();
        for w in 0..WAITERS {
            let signal = if w % 2 == 0 {
                controller.signal()
            } else {
                AbortSignal::any([other.signal(), controller.signal()])
            };
            let start = start.clone();
            let woke = woke.clone();
            threads.push(thread::spawn(move || {
                start.wait();
                let reason = futures::executor::block_on(signal.aborted());
                woke.send(reason).unwrap();
            }));
        }
        for a in 0..ABORTERS {
            let controller = controller.clone();
            let start = start.clone();
            let won = won.clone();
            threads.push(thread::spawn(move || {
                let reason = AbortReason::from(format!("round {round} aborter {a}"));
                start.wait();
                if controller.abort(reason.clone()) {
                    won.send(reason).unwrap();
                }
            }));
        }
        drop((woke, won));

        let mut reasons = Vec::new();
        for _ in 0..WAITERS {
            match woken.recv_timeout(GENEROUS) {
                Ok(reason) => reasons.push(reason),
                Err(_) => panic!("round {round}: a waiter missed the abort"),
            }
        }
        let winner = winners.recv_timeout(GENEROUS).expect("one abort won");
        assert!(
            winners.recv_timeout(Duration::from_millis(50)).is_err(),
            "round {round}: two aborts won"
        );
        for reason in &reasons {
            assert!(
                reason.ptr_eq(&winner),
                "round {round}: {reason} is not the winner"
            );
        }
        for thread in threads {
            thread.join().unwrap();
        }
    }
}

#[test]
fn interrupted_displays_the_reason_and_exposes_it_as_its_source() {
    let reason = AbortReason::new(Shutdown(3));
    let error = Interrupted::new(reason.clone());
    assert_eq!(error.to_string(), "interrupted: shutdown #3");
    assert!(error.reason().ptr_eq(&reason));
    let source = error.source().expect("a source");
    assert!(source.downcast_ref::<Shutdown>().is_some());
}

#[test]
fn a_reason_displays_and_downcasts_to_the_error_inside() {
    let text = AbortReason::from(String::from("plain text"));
    assert_eq!(text.to_string(), "plain text");
    assert!(text.downcast_ref::<Shutdown>().is_none());

    let typed = AbortReason::new(Shutdown(9));
    assert_eq!(typed.to_string(), "shutdown #9");
    assert_eq!(typed.downcast_ref::<Shutdown>().unwrap().0, 9);
    assert!(format!("{typed:?}").contains("Shutdown"));
}

#[test]
fn equal_text_is_not_the_same_reason() {
    let a = AbortReason::from("same");
    let b = AbortReason::from("same");
    assert!(!a.ptr_eq(&b));
    assert!(a.ptr_eq(&a.clone()));
}

/// A timeout made on a tokio runtime that then shuts down still fires, for whoever awaits it on
/// another executor and for a `Scoped` it interrupts there: no task of that runtime had to run
/// for it (with the `tokio` feature such a runtime used to hold its timer task, and took it
/// along when it went away).
#[test]
fn a_timeout_made_on_a_runtime_that_went_away_still_fires() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (awaited, attached) = runtime.block_on(async {
        (
            AbortSignal::timeout(Duration::from_millis(20)),
            AbortSignal::timeout(Duration::from_millis(20)),
        )
    });
    drop(runtime);
    let (done, outcome) = mpsc::channel();
    thread::spawn(move || {
        let reason = futures::executor::block_on(awaited.aborted());
        let work =
            Scoped::<(), Interrupted>::new(|_| std::future::pending()).with_signal(&attached);
        let error = futures::executor::block_on(work).unwrap_err();
        let _ = done.send((reason, error.reason().clone()));
    });
    let (awaited, interrupted) = outcome
        .recv_timeout(GENEROUS)
        .expect("the timeouts fired within the limit");
    assert!(awaited.downcast_ref::<TimedOut>().is_some(), "{awaited:?}");
    assert!(
        interrupted.downcast_ref::<TimedOut>().is_some(),
        "{interrupted:?}"
    );
}
