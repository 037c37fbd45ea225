//! Model checks, with loom, of the atomics that the semaphore and the abort signal rely on.
//!
//! Run with `RUSTFLAGS="--cfg leasehold_loom" cargo test --release --test loom` (in a target
//! directory of its own, so that the normal build is not thrown away). Under that cfg the library
//! takes its atomics, mutexes, `Arc` and wakers from loom (see `src/sync.rs`), so every
//! interleaving of the threads below that differs in those operations is explored, up to the
//! preemption bound (`LOOM_MAX_PREEMPTIONS`, 3 unless set). A lost wake-up shows as a deadlock,
//! a semaphore state that is never freed as a leak, and a broken invariant as a failed assertion.
#![cfg(leasehold_loom)]

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use futures::task::noop_waker_ref;
use leasehold::{AbortController, AbortSignal, Semaphore};
use loom::future::block_on;
use loom::thread;

/// Runs `test` under loom with the preemption bound given in `LOOM_MAX_PREEMPTIONS`, or 3, so
/// that the whole file finishes in minutes on two cores; prints how many interleavings it ran.
fn model(name: &str, test: impl Fn() + Sync + Send + 'static) {
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    let counted = runs.clone();
    builder.check(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        test()
    });
    let runs = runs.load(Ordering::SeqCst);
    eprintln!(
        "loom: {name}: {runs} interleavings (preemption bound {:?})",
        builder.preemption_bound
    );
    assert!(
        runs > 1,
        "loom explored a single interleaving: nothing was modelled"
    );
}

// ---------------------------------------------------------------------------------------------
// Semaphore
// ---------------------------------------------------------------------------------------------

#[test]
fn semaphore_acquires_and_releases_lose_no_wake_up_and_conserve_permits() {
    model(
        "semaphore_acquires_and_releases_lose_no_wake_up_and_conserve_permits",
        || {
            let semaphore = Semaphore::new(1);
            let contenders: Vec<_> = (0..2)
                .map(|_| {
                    let semaphore = semaphore.clone();
                    thread::spawn(move || {
                        let permit = block_on(semaphore.acquire(1));
                        assert_eq!(semaphore.available(), 0, "one permit, one holder");
                        drop(permit);
                    })
                })
                .collect();
            // The main thread contends too, so that someone queues.
            drop(block_on(semaphore.acquire(1)));
            for contender in contenders {
                contender.join().unwrap();
            }
            assert_eq!(semaphore.available(), 1);
        },
    );
}

#[test]
fn semaphore_a_queued_acquire_cancelled_while_the_permit_comes_back() {
    model(
        "semaphore_a_queued_acquire_cancelled_while_the_permit_comes_back",
        || {
            let semaphore = Semaphore::new(1);
            let held = semaphore.try_acquire(1).expect("free at first");
            let releaser = thread::spawn(move || drop(held));
            let waiter = {
                let semaphore = semaphore.clone();
                thread::spawn(move || block_on(semaphore.acquire(1)).permits())
            };
            {
                // Queue (unless the permit is already back), then give up.
                let mut cancelled = pin!(semaphore.acquire(1));
                let mut cx = Context::from_waker(noop_waker_ref());
                if let Poll::Ready(permit) = cancelled.as_mut().poll(&mut cx) {
                    drop(permit);
                }
            }
            releaser.join().unwrap();
            assert_eq!(waiter.join().unwrap(), 1, "the waiter behind was served");
            assert_eq!(semaphore.available(), 1, "no permit lost or made up");
        },
    );
}

#[test]
fn semaphore_the_last_handle_and_the_last_permit_race_to_free_the_state() {
    model(
        "semaphore_the_last_handle_and_the_last_permit_race_to_free_the_state",
        || {
            let semaphore = Semaphore::new(2);
            let a = semaphore.try_acquire(1).expect("free");
            let b = semaphore.try_acquire(1).expect("free");
            let first = thread::spawn(move || drop(a));
            let second = thread::spawn(move || drop(b));
            // The last handle goes while the permits come back: exactly one of the three frees the
            // state (a leak fails the model; a second free would be a double drop).
            drop(semaphore);
            first.join().unwrap();
            second.join().unwrap();
        },
    );
}

#[test]
fn semaphore_a_granted_waiter_and_the_last_handle_race() {
    model(
        "semaphore_a_granted_waiter_and_the_last_handle_race",
        || {
            let semaphore = Semaphore::new(1);
            let held = semaphore.try_acquire(1).expect("free");
            let waiter = {
                let semaphore = semaphore.clone();
                thread::spawn(move || {
                    let permit = block_on(semaphore.acquire(1));
                    drop(semaphore);
                    permit
                })
            };
            let releaser = thread::spawn(move || drop(held));
            drop(semaphore);
            releaser.join().unwrap();
            // The permit outlives every handle; dropping it frees the state.
            drop(waiter.join().unwrap());
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Abort signal
// ---------------------------------------------------------------------------------------------

#[test]
fn abort_the_first_reason_wins_and_every_listener_sees_it() {
    model(
        "abort_the_first_reason_wins_and_every_listener_sees_it",
        || {
            let controller = std::sync::Arc::new(AbortController::new());
            let listener = {
                let signal = controller.signal();
                thread::spawn(move || block_on(signal.aborted()).to_string())
            };
            let other = {
                let controller = controller.clone();
                thread::spawn(move || controller.abort("second"))
            };
            let first_won = controller.abort("first");
            let other_won = other.join().unwrap();
            assert!(first_won != other_won, "exactly one abort wins");
            let winner = if first_won { "first" } else { "second" };
            assert_eq!(listener.join().unwrap(), winner);
            assert_eq!(controller.signal().reason().unwrap().to_string(), winner);
        },
    );
}

#[test]
fn abort_racing_any_reaches_the_combined_signal() {
    model("abort_racing_any_reaches_the_combined_signal", || {
        let a = AbortController::new();
        let b = AbortController::new();
        let (signal_a, signal_b) = (a.signal(), b.signal());
        let combiner = thread::spawn(move || {
            let either = AbortSignal::any([signal_a, signal_b]);
            block_on(either.aborted()).to_string()
        });
        a.abort("a");
        assert_eq!(combiner.join().unwrap(), "a");
        drop(b);
    });
}
