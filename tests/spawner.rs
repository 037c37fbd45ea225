//! Background work stays on the caller's runtime: clean-ups of dropped `Scoped` futures and
//! fibers run where their scope's spawner says, and can use that runtime's APIs (here tokio's
//! timers, which panic anywhere else).
//!
//! Every scenario runs under a tokio current-thread and a tokio multi-thread runtime, once with
//! an explicit spawner (a closure over the runtime's handle, which needs no feature) and, with the
//! `tokio` feature, once with `TokioSpawner` and once with nothing set at all.

mod common;

use std::panic::resume_unwind;
use std::sync::Arc;
use std::time::Duration;

use common::{within, Flag, Log, GENEROUS, SLOW};
use futures::future::{self, Either};
use leasehold::{Exit, Interrupted, LockError, LockManager, Scoped, Spawner};

/// The name of every thread of the runtime a scenario runs on (smol's and async-io's threads are
/// named otherwise), so that work can tell whether it ran there.
const RUNTIME_THREAD: &str = "scenario-runtime";

fn on_the_runtime() -> bool {
    std::thread::current().name() == Some(RUNTIME_THREAD)
}

/// How the scenario's outermost `Scoped` comes to use the runtime.
#[derive(Clone, Copy, Debug)]
enum Way {
    /// `with_spawner` with a closure that spawns on the runtime's handle.
    Closure,
    /// `with_spawner(TokioSpawner::current())`.
    #[cfg(feature = "tokio")]
    TokioSpawner,
    /// Nothing set: the `tokio` feature picks the runtime up on the first poll.
    #[cfg(feature = "tokio")]
    Ambient,
}

const WAYS: &[Way] = &[
    Way::Closure,
    #[cfg(feature = "tokio")]
    Way::TokioSpawner,
    #[cfg(feature = "tokio")]
    Way::Ambient,
];

impl Way {
    /// Gives `work` its spawner this way. Called inside the runtime.
    fn apply<T, E>(self, work: Scoped<T, E>) -> Scoped<T, E>
    where
        T: Send + 'static,
        E: From<Interrupted> + Send + 'static,
    {
        match self {
            Way::Closure => {
                let handle = tokio::runtime::Handle::current();
                let spawner: Arc<dyn Spawner> = Arc::new(move |future| {
                    handle.spawn(future);
                });
                work.with_spawner(spawner)
            }
            #[cfg(feature = "tokio")]
            Way::TokioSpawner => work.with_spawner(Arc::new(leasehold::TokioSpawner::current())),
            #[cfg(feature = "tokio")]
            Way::Ambient => work,
        }
    }
}

/// Runs the scenario on a fresh tokio current-thread runtime and a fresh multi-thread runtime
/// (two workers, the scenario spawned so that it moves between them), each time in every `Way`.
/// All of a runtime's threads are named [`RUNTIME_THREAD`].
fn on_tokio_runtimes<F, Fut>(scenario: F)
where
    F: Fn(Way) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let scenario = Arc::new(scenario);
    for &way in WAYS {
        for multi_thread in [false, true] {
            eprintln!(
                "--- {way:?} on a tokio {} runtime",
                if multi_thread {
                    "multi-thread"
                } else {
                    "current-thread"
                }
            );
            let scenario = scenario.clone();
            let run = std::thread::Builder::new()
                .name(RUNTIME_THREAD.to_owned())
                .spawn(move || {
                    let mut builder = if multi_thread {
                        let mut builder = tokio::runtime::Builder::new_multi_thread();
                        builder.worker_threads(2);
                        builder
                    } else {
                        tokio::runtime::Builder::new_current_thread()
                    };
                    let runtime = builder
                        .thread_name(RUNTIME_THREAD)
                        .enable_time()
                        .build()
                        .expect("a tokio runtime");
                    let task = runtime.spawn(scenario(way));
                    runtime.block_on(task)
                })
                .expect("a thread for the runtime");
            match run.join() {
                Ok(Ok(())) => {}
                Ok(Err(error)) => match error.try_into_panic() {
                    Ok(payload) => resume_unwind(payload),
                    Err(error) => panic!("the scenario's task failed: {error}"),
                },
                Err(payload) => resume_unwind(payload),
            }
        }
    }
}

#[test]
fn the_finalizer_of_an_aborted_tokio_task_runs_on_its_runtime_within_a_second() {
    // The example: a web framework aborts the handler's task when the client leaves.
    on_tokio_runtimes(|way| async move {
        let (started, cleaned_up, on_runtime) = (Flag::new(), Flag::new(), Flag::new());
        let body_started = started.clone();
        let finalized = (cleaned_up.clone(), on_runtime.clone());
        let job = async move {
            way.apply(Scoped::<_, Interrupted>::new(move |scope| async move {
                scope.add_finalizer(move |_status| async move {
                    // Panics unless it runs on a tokio runtime with timers.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if on_the_runtime() {
                        finalized.1.set();
                    }
                    finalized.0.set();
                });
                body_started.set();
                future::pending::<Result<(), Interrupted>>().await
            }))
            .await
        };
        let task = tokio::spawn(job);
        within(GENEROUS, "the job started", || async { started.is_set() }).await;

        task.abort();

        within(Duration::from_secs(1), "the finalizer finished", || async {
            cleaned_up.is_set()
        })
        .await;
        assert!(on_runtime.is_set(), "the finalizer ran off the runtime");
        assert!(task.await.unwrap_err().is_cancelled());
    });
}

/// The same with a lock held by the aborted task: within a second its finalizer has finished and
/// its row is gone.
#[test]
fn an_aborted_tokio_task_that_holds_a_lock_cleans_up_and_leaves_no_row_within_a_second() {
    on_tokio_runtimes(|way| async move {
        let locks = LockManager::open_in_memory().unwrap();
        let (started, cleaned_up) = (Flag::new(), Flag::new());
        let body_started = started.clone();
        let finalized = cleaned_up.clone();
        let holder = locks.clone();
        let job = async move {
            way.apply(Scoped::<(), LockError>::new(move |scope| async move {
                scope.adopt(holder.exclusive("repo", "handler").await?);
                scope.add_finalizer(move |_status| async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    finalized.set();
                });
                body_started.set();
                future::pending().await
            }))
            .await
        };
        let task = tokio::spawn(job);
        within(GENEROUS, "the job holds the lock", || async {
            started.is_set()
        })
        .await;
        assert_eq!(locks.inspect(None).await.unwrap().len(), 1);

        task.abort();

        within(
            Duration::from_secs(1),
            "the finalizer finished and the row is gone",
            || async { cleaned_up.is_set() && locks.inspect(None).await.unwrap().is_empty() },
        )
        .await;
    });
}

#[test]
fn a_fiber_forked_into_a_scope_can_use_tokio_and_succeeds() {
    on_tokio_runtimes(|way| async move {
        let exit = way
            .apply(Scoped::<_, Interrupted>::new(|scope| async move {
                let fiber = scope.fork(async {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    on_the_runtime()
                });
                Ok(fiber.join().await)
            }))
            .await
            .unwrap();
        assert!(matches!(exit, Exit::Success(true)), "{exit:?}");
    });
}

#[test]
fn a_fiber_forked_into_a_nested_scoped_inherits_the_outer_spawner() {
    on_tokio_runtimes(|way| async move {
        let exit = way
            .apply(Scoped::<_, Interrupted>::new(|_| async move {
                Scoped::<_, Interrupted>::new(|inner| async move {
                    let fiber = inner.fork(async {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        on_the_runtime()
                    });
                    Ok(fiber.join().await)
                })
                .await
            }))
            .await
            .unwrap();
        assert!(matches!(exit, Exit::Success(true)), "{exit:?}");
    });
}

#[test]
fn a_scoped_dropped_inside_another_is_closed_on_the_same_runtime_before_the_parent_closes() {
    on_tokio_runtimes(|way| async move {
        let log = Log::new();
        let parent_log = log.clone();
        let result = way
            .apply(Scoped::<_, Interrupted>::new(move |parent| async move {
                let last = parent_log.clone();
                parent.add_finalizer(move |_| async move { last.push("parent closed") });
                let child = Scoped::<(), Interrupted>::new(move |child| async move {
                    child.add_finalizer(move |_| async move {
                        // Slow, so that a parent close that did not wait would finish first.
                        tokio::time::sleep(SLOW).await;
                        parent_log.push(if on_the_runtime() {
                            "child closed on the runtime"
                        } else {
                            "child closed elsewhere"
                        });
                    });
                    future::pending().await
                });
                // The child is polled first (and registers its finalizer), then loses.
                match future::select(child, future::ready("the other branch")).await {
                    Either::Left(_) => unreachable!("the child never finishes"),
                    Either::Right((winner, _)) => Ok(winner),
                }
            }))
            .await;
        assert_eq!(result.unwrap(), "the other branch");
        assert_eq!(
            log.entries(),
            ["child closed on the runtime", "parent closed"]
        );
    });
}

#[cfg(feature = "tokio")]
#[test]
fn with_the_tokio_feature_scopes_and_daemons_made_on_a_runtime_use_it() {
    on_tokio_runtimes(|_| async move {
        let scope = leasehold::Scope::new();
        let forked = scope.fork(async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            on_the_runtime()
        });
        let daemon = leasehold::fork_daemon(async {
            tokio::time::sleep(Duration::from_millis(1)).await;
            on_the_runtime()
        });
        assert!(matches!(forked.join().await, Exit::Success(true)));
        assert!(matches!(daemon.join().await, Exit::Success(true)));
        scope.close(leasehold::ExitStatus::Success).await;
    });
}

#[cfg(feature = "tokio")]
#[test]
#[should_panic]
fn tokio_spawner_current_panics_outside_a_runtime() {
    let _ = leasehold::TokioSpawner::current();
}

#[test]
fn a_spawner_given_explicitly_wins_over_the_runtime_the_scoped_is_polled_on() {
    // A runtime that runs the background work, and another that polls the `Scoped`.
    let background = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(RUNTIME_THREAD)
        .enable_time()
        .build()
        .expect("a tokio runtime");
    let handle = background.handle().clone();
    let spawner: Arc<dyn Spawner> = Arc::new(move |future| {
        handle.spawn(future);
    });
    let caller = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a tokio runtime");
    let exit = caller
        .block_on(
            Scoped::<_, Interrupted>::new(|scope| async move {
                Ok(scope.fork(async { on_the_runtime() }).join().await)
            })
            .with_spawner(spawner),
        )
        .unwrap();
    assert!(matches!(exit, Exit::Success(true)), "{exit:?}");
}

/// A close whose runtime shut down half-way, and whose spawner (that runtime) drops the rest, is
/// lost (and logged); a later `close`, which waits for the first, must still return.
#[test]
fn a_later_close_returns_after_the_first_was_lost_with_its_runtime() {
    use leasehold::{ExitStatus, Scope};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let handle = runtime.handle().clone();
    let scope = Scope::with_spawner(Arc::new(move |future| {
        handle.spawn(future);
    }));
    let started = Flag::new();
    let finalizer_started = started.clone();
    scope.add_finalizer(move |_| async move {
        finalizer_started.set();
        smol::Timer::after(Duration::from_millis(300)).await;
    });
    {
        let scope = scope.clone();
        runtime.spawn(async move { scope.close(ExitStatus::Success).await });
    }
    runtime.block_on(async {
        while !started.is_set() {
            tokio::task::yield_now().await;
        }
    });
    drop(runtime);
    let (done, is_done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        futures::executor::block_on(scope.close(ExitStatus::Success));
        let _ = done.send(());
    });
    assert!(
        is_done.recv_timeout(GENEROUS).is_ok(),
        "a later close still waited after the first was lost with its runtime"
    );
}
