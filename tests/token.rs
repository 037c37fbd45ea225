//! The bridge to tokio-util's `CancellationToken` (feature `tokio-util`), both ways: a signal
//! made from a token aborts when the token is cancelled, and a token made from a signal is
//! cancelled when the signal aborts; neither leaves a task behind.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{
    bounded, interrupted_with, on_every_executor, record_status, within, within_blocking, Counter,
    Flag, Statuses, GENEROUS,
};
use futures::executor::block_on;
use futures::future::{self, BoxFuture};
use leasehold::{
    AbortController, AbortReason, AbortSignal, Interrupted, Scoped, Spawner, TestClock,
    TokenCancelled,
};
use tokio_util::sync::CancellationToken;

// ---------------------------------------------------------------------------------------------
// A token to a signal
// ---------------------------------------------------------------------------------------------

#[test]
fn cancelling_the_token_interrupts_work_bound_to_its_signal_with_token_cancelled() {
    on_every_executor(|| async {
        let token = CancellationToken::new();
        let (statuses, started) = (Statuses::new(), Counter::new());
        let work = {
            let (statuses, started) = (statuses.clone(), started.clone());
            Scoped::<(), Interrupted>::new(move |scope| async move {
                record_status(&scope, &statuses);
                started.bump();
                future::pending().await
            })
            .with_signal(&AbortSignal::from(token.clone()))
        };
        let cancel = async {
            within(GENEROUS, "the work started", || async {
                started.get() == 1
            })
            .await;
            token.cancel();
        };

        let (result, ()) = bounded(GENEROUS, "the work stopped", future::join(work, cancel)).await;

        let error = result.unwrap_err();
        assert!(error.reason().downcast_ref::<TokenCancelled>().is_some());
        assert!(interrupted_with::<TokenCancelled>(&statuses.only()));
    });
}

#[test]
fn a_token_cancelled_on_another_thread_wakes_whoever_awaits_its_signal() {
    on_every_executor(|| async {
        let token = CancellationToken::new();
        let signal = AbortSignal::from(token.clone());
        let waiting = Flag::new();
        let canceller = {
            let waiting = waiting.clone();
            std::thread::spawn(move || {
                within_blocking(GENEROUS, "someone awaits the signal", || waiting.is_set());
                token.cancel();
            })
        };
        let aborted = signal.aborted();
        waiting.set();
        let reason = bounded(GENEROUS, "the signal aborted", aborted).await;
        assert!(reason.downcast_ref::<TokenCancelled>().is_some());
        canceller.join().unwrap();
    });
}

#[test]
fn a_token_cancelled_before_gives_a_signal_aborted_at_the_first_look_and_work_that_never_runs() {
    let token = CancellationToken::new();
    token.cancel();
    let signal = AbortSignal::from(token);
    assert!(signal.is_aborted());
    let ran = Flag::new();
    let body_ran = ran.clone();
    let work = Scoped::<(), Interrupted>::new(move |_| async move {
        body_ran.set();
        Ok(())
    })
    .with_signal(&signal);
    let error = block_on(work).unwrap_err();
    assert!(error.reason().ptr_eq(&signal.reason().unwrap()));
    assert!(!ran.is_set());
}

#[test]
fn each_signal_made_from_a_token_has_a_reason_of_its_own_kept_once_aborted() {
    let token = CancellationToken::new();
    let (a, b) = (
        AbortSignal::from(token.clone()),
        AbortSignal::from(token.clone()),
    );
    token.cancel();
    let (first, again) = (a.reason().unwrap(), a.reason().unwrap());
    assert!(first.ptr_eq(&again));
    assert!(!first.ptr_eq(&b.reason().unwrap()));
    assert_eq!(first.to_string(), "cancelled by a cancellation token");
}

#[test]
fn any_of_a_token_and_a_controller_aborts_with_whichever_comes_first() {
    let (token, controller) = (CancellationToken::new(), AbortController::new());
    let either = AbortSignal::any([AbortSignal::from(token.clone()), controller.signal()]);
    assert!(!either.is_aborted());
    token.cancel();
    assert!(either
        .reason()
        .unwrap()
        .downcast_ref::<TokenCancelled>()
        .is_some());
    controller.abort("too late");
    assert!(either
        .reason()
        .unwrap()
        .downcast_ref::<TokenCancelled>()
        .is_some());
}

// ---------------------------------------------------------------------------------------------
// A signal to a token
// ---------------------------------------------------------------------------------------------

#[test]
fn aborting_the_controller_cancels_its_token_in_the_abort_itself() {
    let controller = AbortController::new();
    let (from_controller, from_signal) = (
        controller.cancellation_token(),
        controller.signal().cancellation_token(),
    );
    let reason = AbortReason::from("shutting down");
    assert!(!from_controller.is_cancelled() && !from_signal.is_cancelled());

    controller.abort(reason.clone());

    assert!(from_controller.is_cancelled() && from_signal.is_cancelled());
    assert!(
        controller.signal().reason().unwrap().ptr_eq(&reason),
        "the reason stays"
    );
}

#[test]
fn a_token_made_from_an_aborted_signal_is_cancelled_already() {
    let controller = AbortController::new();
    controller.abort("done");
    assert!(controller.signal().cancellation_token().is_cancelled());
}

#[test]
fn a_token_of_a_signal_that_never_aborts_is_not_cancelled_and_cancelling_it_aborts_nothing() {
    let never = AbortSignal::never().cancellation_token();
    assert!(!never.is_cancelled());
    let controller = AbortController::new();
    let token = controller.cancellation_token();
    token.cancel();
    assert!(!controller.signal().is_aborted());
}

#[test]
fn a_token_of_any_of_controllers_is_cancelled_when_one_aborts() {
    let (a, b) = (AbortController::new(), AbortController::new());
    let either = AbortSignal::any([a.signal(), b.signal()]);
    let token = either.cancellation_token();
    b.abort("b");
    assert!(token.is_cancelled());
}

#[test]
fn waiters_on_the_token_wake_when_the_controller_aborts() {
    on_every_executor(|| async {
        let controller = AbortController::new();
        let token = controller.cancellation_token();
        let waiting = Flag::new();
        let aborter = {
            let waiting = waiting.clone();
            std::thread::spawn(move || {
                within_blocking(GENEROUS, "someone awaits the token", || waiting.is_set());
                controller.abort("stop");
            })
        };
        let cancelled = token.cancelled_owned();
        waiting.set();
        bounded(GENEROUS, "the token was cancelled", cancelled).await;
        aborter.join().unwrap();
    });
}

#[test]
fn a_timeouts_token_is_cancelled_when_its_time_comes_on_its_clock() {
    on_every_executor(|| async {
        let clock = TestClock::new();
        let timeout = AbortSignal::timeout_on(Arc::new(clock.clone()), Duration::from_secs(30));
        let token = timeout.cancellation_token();
        within(
            GENEROUS,
            "the token's task sleeps until the deadline",
            || async { clock.sleepers() == 1 },
        )
        .await;
        clock.advance(Duration::from_secs(29));
        assert!(!token.is_cancelled());
        clock.advance(Duration::from_secs(1));
        bounded(GENEROUS, "the token was cancelled", token.cancelled()).await;
        assert!(interrupted_reason_is_timeout(&timeout));
        // Its task has ended: nothing sleeps on the clock any more.
        within(GENEROUS, "the token's task ended", || async {
            clock.sleepers() == 0
        })
        .await;
    });
}

fn interrupted_reason_is_timeout(signal: &AbortSignal) -> bool {
    signal
        .reason()
        .is_some_and(|reason| reason.downcast_ref::<leasehold::TimedOut>().is_some())
}

#[test]
fn a_token_made_from_a_signal_made_from_a_token_follows_the_first_token() {
    on_every_executor(|| async {
        let first = CancellationToken::new();
        let signal = AbortSignal::from(first.clone());
        let second = signal.cancellation_token();
        first.cancel();
        bounded(
            GENEROUS,
            "the second token was cancelled",
            second.cancelled(),
        )
        .await;
        // A token carries no reason: the way back gives `TokenCancelled`.
        let back = AbortSignal::from(second);
        assert!(back
            .reason()
            .unwrap()
            .downcast_ref::<TokenCancelled>()
            .is_some());
    });
}

// ---------------------------------------------------------------------------------------------
// Nothing left behind
// ---------------------------------------------------------------------------------------------

/// A spawner that runs its work on smol's executor and counts what it was given and what has
/// ended (finished or dropped).
#[derive(Clone, Default)]
struct Counting {
    spawned: Arc<AtomicUsize>,
    ended: Arc<AtomicUsize>,
}

impl Counting {
    fn spawned(&self) -> usize {
        self.spawned.load(Ordering::SeqCst)
    }

    fn running(&self) -> usize {
        self.spawned() - self.ended.load(Ordering::SeqCst)
    }
}

impl Spawner for Counting {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        struct Ends(Arc<AtomicUsize>);
        impl Drop for Ends {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.spawned.fetch_add(1, Ordering::SeqCst);
        let ends = Ends(self.ended.clone());
        smol::spawn(async move {
            let _ends = ends;
            future.await;
        })
        .detach();
    }
}

/// Runs `scenario` inside a `Scoped` whose spawner is `spawner`, so that background work it
/// starts goes there.
fn with_spawner<F>(spawner: &Counting, scenario: F)
where
    F: FnOnce() -> BoxFuture<'static, ()> + Send + 'static,
{
    let work = Scoped::<(), Interrupted>::new(move |_| async move {
        scenario().await;
        Ok(())
    })
    .with_spawner(Arc::new(spawner.clone()));
    block_on(work).unwrap();
}

#[test]
fn signals_that_abort_only_when_told_make_tokens_without_a_task() {
    let spawner = Counting::default();
    with_spawner(&spawner, || {
        Box::pin(async {
            let (a, b) = (AbortController::new(), AbortController::new());
            let either = AbortSignal::any([a.signal(), b.signal()]);
            let tokens = [
                a.cancellation_token(),
                either.cancellation_token(),
                AbortSignal::never().cancellation_token(),
            ];
            a.abort("stop");
            assert!(tokens[..2].iter().all(CancellationToken::is_cancelled));
            // And the other way: a signal made from a token needs no task either.
            let token = CancellationToken::new();
            let signal = AbortSignal::from(token.clone());
            token.cancel();
            assert!(signal.is_aborted());
        })
    });
    assert_eq!(spawner.spawned(), 0);
}

#[test]
fn dropping_a_signal_that_aborts_by_itself_ends_its_tokens_task_and_leaves_the_token_alone() {
    let spawner = Counting::default();
    let clock = TestClock::new();
    let (timeout, token) = {
        let clock = clock.clone();
        let (sender, receiver) = std::sync::mpsc::channel();
        with_spawner(&spawner, move || {
            Box::pin(async move {
                let timeout = AbortSignal::timeout_on(Arc::new(clock), Duration::from_secs(30));
                let token = timeout.cancellation_token();
                sender.send((timeout, token)).unwrap();
            })
        });
        receiver.recv().unwrap()
    };
    assert_eq!(spawner.spawned(), 1);
    within_blocking(GENEROUS, "the token's task sleeps", || {
        clock.sleepers() == 1
    });

    drop(timeout);

    within_blocking(GENEROUS, "the token's task ended", || {
        spawner.running() == 0
    });
    assert_eq!(clock.sleepers(), 0);
    clock.advance(Duration::from_secs(60));
    assert!(!token.is_cancelled(), "no signal is left to cancel it");
}

#[test]
fn cancelling_the_token_ends_its_task() {
    let spawner = Counting::default();
    let never_cancelled = CancellationToken::new();
    let (sender, receiver) = std::sync::mpsc::channel();
    let source = never_cancelled.clone();
    with_spawner(&spawner, move || {
        Box::pin(async move {
            let signal = AbortSignal::from(source);
            let token = signal.cancellation_token();
            sender.send((signal, token)).unwrap();
        })
    });
    let (signal, token) = receiver.recv().unwrap();
    assert_eq!(spawner.spawned(), 1);

    token.cancel();

    within_blocking(GENEROUS, "the token's task ended", || {
        spawner.running() == 0
    });
    assert!(
        !signal.is_aborted(),
        "a token made from a signal does not abort it"
    );
    drop(never_cancelled);
}

#[test]
fn dropping_a_signal_made_from_a_token_leaves_nothing_waiting_on_the_token() {
    // The signal's trigger is a clone of the token, and whoever awaited the signal awaited a
    // clone too: once they are gone, cancelling the token wakes nobody and nothing hangs.
    let token = CancellationToken::new();
    let signal = AbortSignal::from(token.clone());
    let mut waiting = Box::pin(signal.aborted());
    assert!(common::poll_once(&mut waiting).is_pending());
    drop(waiting);
    drop(signal);
    token.cancel();
    assert!(token.is_cancelled());
}
