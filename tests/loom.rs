//! Model checks, with loom, of the semaphore, the abort signal and a scope's handed-off close.
//!
//! Run with `RUSTFLAGS="--cfg leasehold_loom" cargo test --release --test loom` (in a target
//! directory of its own, so that the normal build is not thrown away). Under that cfg the library
//! takes its atomics, mutexes, `Arc`, wakers and thread-locals from loom (see `src/sync.rs`), so
//! every interleaving of the threads below that differs in those operations is explored, up to the
//! preemption bound (`LOOM_MAX_PREEMPTIONS`, 3 unless set). A lost wake-up shows as a deadlock,
//! a semaphore state that is never freed as a leak, and a broken invariant as a failed assertion.
#![cfg(leasehold_loom)]

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::task::noop_waker_ref;
use leasehold::{AbortController, AbortSignal, ExitStatus, Scope, Semaphore, Spawner};
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

// ---------------------------------------------------------------------------------------------
// Scope
// ---------------------------------------------------------------------------------------------

#[test]
fn scope_a_close_dropped_half_way_is_finished_by_the_spawner_running_every_finalizer_once() {
    model(
        "scope_a_close_dropped_half_way_is_finished_by_the_spawner_running_every_finalizer_once",
        || {
            // The spawner: a model thread per piece of background work, joined at the end.
            let spawned = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let to_spawner = spawned.clone();
            let spawner: std::sync::Arc<dyn Spawner> =
                std::sync::Arc::new(move |work: BoxFuture<'static, ()>| {
                    let handle = thread::spawn(move || block_on(work));
                    to_spawner.lock().unwrap().push(handle);
                });
            let scope = Scope::with_spawner(spawner);
            let runs: std::sync::Arc<[AtomicUsize; 2]> = std::sync::Arc::default();
            let last = runs.clone();
            scope.add_finalizer(move |_| async move {
                last[0].fetch_add(1, Ordering::SeqCst);
            });
            // Runs first, and waits for the gate: a close polled once stops half-way here,
            // unless the gate opened before.
            let gate = AbortController::new();
            let (first, gate_signal) = (runs.clone(), gate.signal());
            scope.add_finalizer(move |_| async move {
                gate_signal.aborted().await;
                first[1].fetch_add(1, Ordering::SeqCst);
            });
            let opener = thread::spawn(move || {
                gate.abort("open");
            });
            {
                let mut close = pin!(scope.close(ExitStatus::Success));
                let mut cx = Context::from_waker(noop_waker_ref());
                let _ = close.as_mut().poll(&mut cx);
            } // The caller gives up: the rest of the close goes to the spawner.
            opener.join().unwrap();
            let handles = std::mem::take(&mut *spawned.lock().unwrap());
            for handle in handles {
                handle.join().unwrap();
            }
            assert!(scope.is_closed());
            assert_eq!(
                runs[0].load(Ordering::SeqCst),
                1,
                "the last finalizer ran once"
            );
            assert_eq!(
                runs[1].load(Ordering::SeqCst),
                1,
                "the first finalizer ran once"
            );
        },
    );
}
