//! The simulation kit's executor (`leasehold::testkit::Sim`): seeded and replayable order,
//! virtual time that jumps, and runs that cannot finish reported, not hung.

#![cfg(feature = "testkit")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::yield_now;
use futures::channel::oneshot;
use leasehold::testkit::{Sim, SimConfig, SimError};
use leasehold::{fork_daemon, Clock, Interrupted, Schedule, Scoped, TimedOut};

/// `tasks` tasks that each log their number, yield, and log again, run to the end.
fn run_order(sim: &mut Sim, tasks: usize) -> Vec<usize> {
    let log = Arc::new(Mutex::new(Vec::new()));
    let spawner = sim.spawner();
    for task in 0..tasks {
        let log = log.clone();
        spawner.spawn(Box::pin(async move {
            log.lock().unwrap().push(task);
            yield_now().await;
            log.lock().unwrap().push(task);
        }));
    }
    sim.block_on(async {}).expect("the tasks finish");
    let log = log.lock().unwrap().clone();
    log
}

#[test]
fn fifo_polls_ready_tasks_in_the_order_they_became_ready() {
    let order = run_order(&mut Sim::fifo(), 3);
    // The root (ready first, done at once), then 0, 1, 2, then each again after its yield.
    assert_eq!(order, [0, 1, 2, 0, 1, 2]);
}

#[test]
fn a_seed_draws_an_order_and_the_same_seed_draws_it_again() {
    let orders: Vec<Vec<usize>> = (0..20)
        .map(|seed| run_order(&mut Sim::new(seed), 4))
        .collect();
    for (seed, order) in orders.iter().enumerate() {
        assert_eq!(order.len(), 8);
        assert_eq!(
            *order,
            run_order(&mut Sim::new(seed as u64), 4),
            "seed {seed}"
        );
    }
    let distinct: std::collections::BTreeSet<&Vec<usize>> = orders.iter().collect();
    assert!(
        distinct.len() > 5,
        "20 seeds drew only {} orders",
        distinct.len()
    );
}

#[test]
fn a_replayed_trace_makes_the_same_choices() {
    for seed in 0..10 {
        let mut sim = Sim::new(seed);
        let order = run_order(&mut sim, 5);
        let trace = sim.trace();
        let mut replay = Sim::replay(&trace).expect("a trace it printed");
        assert_eq!(
            run_order(&mut replay, 5),
            order,
            "seed {seed}, trace {trace}"
        );
        assert_eq!(replay.trace(), trace);
        assert_eq!(replay.seed(), seed);
    }
}

#[test]
fn a_trace_that_does_not_fit_the_run_is_refused() {
    assert!(matches!(
        Sim::replay("not a trace"),
        Err(SimError::BadTrace(_))
    ));
    // Two tasks ready at the first step, but the trace chooses the ninth.
    let mut sim = Sim::replay("sim1:0:0,9").unwrap();
    let spawner = sim.spawner();
    for _ in 0..2 {
        spawner.spawn(Box::pin(async {}));
    }
    match sim.block_on(async {}) {
        Err(SimError::BadTrace(why)) => assert!(why.contains("task 9 of"), "{why}"),
        other => panic!("expected a bad trace, got {other:?}"),
    }
}

#[test]
fn a_thirty_second_timeout_passes_without_waiting() {
    let mut sim = Sim::new(1);
    let started = Instant::now();
    let slow =
        Scoped::<(), Interrupted>::new(|_| std::future::pending()).timeout(Duration::from_secs(30));
    let error = sim.block_on(slow).unwrap().unwrap_err();
    assert!(error.reason().downcast_ref::<TimedOut>().is_some());
    // Virtual time moved exactly to the deadline, and real time hardly at all (generously).
    assert_eq!(sim.clock().monotonic(), Duration::from_secs(30));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn time_jumps_to_each_deadline_in_turn_and_never_past_it() {
    let mut sim = Sim::new(3);
    let clock = sim.clock();
    let woke = Arc::new(Mutex::new(Vec::new()));
    let spawner = sim.spawner();
    for secs in [5u64, 1, 3] {
        let (clock, woke) = (clock.clone(), woke.clone());
        spawner.spawn(Box::pin(async move {
            clock.sleep(Duration::from_secs(secs)).await;
            woke.lock().unwrap().push((secs, clock.monotonic()));
        }));
    }
    sim.block_on(async {}).unwrap();
    let woke = woke.lock().unwrap().clone();
    assert_eq!(
        woke,
        [1, 3, 5].map(|s| (s, Duration::from_secs(s))),
        "each woke at its own deadline"
    );
}

#[test]
fn a_future_that_can_never_resolve_is_a_deadlock_naming_what_waits() {
    let mut sim = Sim::new(4);
    let (_keep, never) = oneshot::channel::<()>();
    let error = sim
        .block_on(async move {
            let fiber = fork_daemon(async move { never.await.ok() });
            fiber.join().await
        })
        .unwrap_err();
    match &error {
        SimError::Deadlock { pending, .. } => {
            assert!(pending[0].contains("block_on"), "{pending:?}");
            assert!(
                pending.iter().any(|p| p.contains("daemon fiber")),
                "{pending:?}"
            );
        }
        other => panic!("expected a deadlock, got {other:?}"),
    }
    let text = error.to_string();
    assert!(
        text.contains("seed 4") && text.contains("sim1:4:"),
        "{text}"
    );
}

#[test]
fn background_work_left_waiting_after_the_future_resolved_is_a_leak() {
    let mut sim = Sim::new(5);
    let (keep, never) = oneshot::channel::<()>();
    let error = sim
        .block_on(async move {
            drop(fork_daemon(async move { never.await.ok() }));
            "resolved"
        })
        .unwrap_err();
    drop(keep);
    match error {
        SimError::Leaked { tasks, .. } => {
            assert_eq!(tasks.len(), 1, "{tasks:?}");
            assert!(tasks[0].starts_with("daemon fiber"), "{tasks:?}");
        }
        other => panic!("expected a leak, got {other:?}"),
    }
}

#[test]
fn background_work_that_ends_is_waited_for() {
    let mut sim = Sim::new(6);
    let done = Arc::new(Mutex::new(false));
    let flag = done.clone();
    let clock = sim.clock();
    let value = sim
        .block_on(async move {
            drop(fork_daemon(async move {
                clock.sleep(Duration::from_secs(60)).await;
                *flag.lock().unwrap() = true;
            }));
            7
        })
        .unwrap();
    assert_eq!(value, 7);
    assert!(
        *done.lock().unwrap(),
        "the daemon ran to its end before block_on returned"
    );
}

#[test]
fn a_task_that_never_ends_stops_at_the_step_limit() {
    let mut config = SimConfig::default();
    config.max_steps = 1_000;
    let mut sim = Sim::with_config(config);
    let error = sim
        .block_on(async {
            loop {
                yield_now().await;
            }
        })
        .unwrap_err();
    assert!(matches!(error, SimError::StepLimit { .. }), "{error:?}");
}

#[test]
fn fibers_and_handed_off_clean_up_run_inside_the_simulation() {
    let mut sim = Sim::new(8);
    let here = std::thread::current().id();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (fiber_saw, finalizer_saw) = (seen.clone(), seen.clone());
    let work = Scoped::<(), Interrupted>::new(move |scope| async move {
        let fiber = scope.fork(async move {
            fiber_saw.lock().unwrap().push(std::thread::current().id());
        });
        fiber.join().await;
        scope.add_finalizer(move |_| async move {
            finalizer_saw
                .lock()
                .unwrap()
                .push(std::thread::current().id());
        });
        std::future::pending::<()>().await;
        Ok(())
    });
    // Dropped after a few steps, unfinished: its close is handed to the simulation's spawner.
    let outcome = sim.block_on(async move {
        let mut work = Box::pin(work);
        for _ in 0..3 {
            let _ = futures::poll!(work.as_mut());
            yield_now().await;
        }
        drop(work);
    });
    outcome.unwrap();
    assert_eq!(*seen.lock().unwrap(), [here, here]);
}

#[test]
fn jitter_draws_from_the_simulations_seed() {
    let delays = |seed: u64| {
        let _sim = Sim::new(seed);
        let mut run = Schedule::spaced(Duration::from_secs(1))
            .jittered()
            .start(Duration::ZERO);
        (0..5).map(|_| run.next(Duration::ZERO)).collect::<Vec<_>>()
    };
    assert_eq!(delays(9), delays(9));
    assert_ne!(delays(9), delays(10));
}

#[test]
fn a_spawn_from_a_drop_is_accepted_and_run() {
    struct SpawnsOnDrop(Arc<dyn leasehold::Spawner>, Arc<Mutex<bool>>);
    impl Drop for SpawnsOnDrop {
        fn drop(&mut self) {
            let flag = self.1.clone();
            self.0
                .spawn(Box::pin(async move { *flag.lock().unwrap() = true }));
        }
    }
    let mut sim = Sim::new(11);
    let ran = Arc::new(Mutex::new(false));
    let spawns = SpawnsOnDrop(sim.spawner(), ran.clone());
    sim.block_on(async move { drop(spawns) }).unwrap();
    assert!(*ran.lock().unwrap());
}

#[test]
fn a_runs_events_show_its_scopes_finalizers_and_fibers_and_pass_the_oracle() {
    use leasehold::testkit::{check_cleanup, Event};
    use leasehold::{AbortController, ExitStatus};

    let mut sim = Sim::new(12);
    let stop = AbortController::new();
    let reason = leasehold::AbortReason::new(TimedOut);
    let outer = Scoped::<(), Interrupted>::new(|scope| async move {
        scope.add_finalizer(|_| async {});
        let inner = Scoped::<(), Interrupted>::new(|scope| async move {
            scope.add_finalizer(|_| async {});
            scope.add_finalizer(|_| async {});
            drop(scope.fork(std::future::pending::<()>()));
            std::future::pending().await
        });
        inner.await
    })
    .with_signal(&stop.signal());
    let clock = sim.clock();
    let given = reason.clone();
    let result = sim.block_on(async move {
        let mut outer = Box::pin(outer);
        // Let it open both scopes, then interrupt it with our reason.
        let _ = futures::poll!(outer.as_mut());
        clock.sleep(Duration::from_millis(1)).await;
        stop.abort(given);
        outer.await
    });
    let error = result.unwrap().unwrap_err();
    assert!(error.reason().ptr_eq(&reason), "the caller's reason object");
    let events = sim.events();
    check_cleanup(&events).unwrap();

    let opened: Vec<(u64, Option<u64>, bool)> = events
        .iter()
        .filter_map(|e| match e {
            Event::ScopeOpened {
                scope,
                parent,
                in_root,
                ..
            } => Some((*scope, *parent, *in_root)),
            _ => None,
        })
        .collect();
    // The outer scope, the inner one nested in it, and the fiber's own (a fiber is a scope of
    // its own, not nested in the one it was forked into, and not the root's).
    assert_eq!(opened.len(), 3, "{events:#?}");
    assert_eq!(
        opened[1].1,
        Some(opened[0].0),
        "the inner scope is nested in the outer"
    );
    assert!(opened[0].2 && opened[1].2);
    assert_eq!((opened[2].1, opened[2].2), (None, false));
    let count = |f: fn(&Event) -> bool| events.iter().filter(|e| f(e)).count();
    assert_eq!(count(|e| matches!(e, Event::FinalizerAdded { .. })), 3);
    assert_eq!(count(|e| matches!(e, Event::FinalizerEnded { .. })), 3);
    assert_eq!(count(|e| matches!(e, Event::FiberForked { .. })), 1);
    assert_eq!(count(|e| matches!(e, Event::FiberExited { .. })), 1);
    assert!(events
        .iter()
        .any(|e| matches!(e, Event::InterruptRequested { reason: r } if r.ptr_eq(&reason))));
    // Every finalizer was told the interruption, with the caller's reason object.
    for event in &events {
        if let Event::FinalizerStarted { status, .. } = event {
            match status {
                ExitStatus::Interrupted(told) => assert!(told.ptr_eq(&reason)),
                other => panic!("told {other:?}"),
            }
        }
    }
    assert!(
        matches!(events.last(), Some(Event::RootResolved)),
        "{events:#?}"
    );
}

#[test]
fn no_events_are_recorded_outside_a_simulation() {
    // Made and run with no Sim alive on this thread: nothing to record into, nothing recorded
    // later into a simulation made afterwards.
    let work = Scoped::<(), Interrupted>::new(|scope| async move {
        scope.add_finalizer(|_| async {});
        Ok(())
    });
    futures::executor::block_on(work).unwrap();
    let sim = Sim::new(13);
    assert!(sim.events().is_empty());
}

#[test]
fn a_leak_replays_exactly_from_its_trace() {
    let run = |sim: &mut Sim| {
        let (keep, never) = oneshot::channel::<()>();
        let spawner = sim.spawner();
        for _ in 0..3 {
            spawner.spawn(Box::pin(yield_now()));
        }
        let error = sim
            .block_on(async move {
                drop(fork_daemon(async move { never.await.ok() }));
                yield_now().await;
            })
            .unwrap_err();
        drop(keep);
        error
    };
    let error = run(&mut Sim::new(14));
    assert!(matches!(error, SimError::Leaked { .. }));
    let again = run(&mut Sim::replay(error.trace()).unwrap());
    assert_eq!(again, error);
}

/// A three-level scope tree with two fibers and six finalizers, each finalizer logging itself.
fn tree() -> Scoped<u32, Interrupted> {
    Scoped::new(|scope| async move {
        for _ in 0..2 {
            scope.add_finalizer(|_| yield_now());
        }
        let middle = Scoped::<u32, Interrupted>::new(|scope| async move {
            scope.add_finalizer(|_| yield_now());
            scope.add_finalizer(|_| async {});
            let worker = scope.fork(async {
                yield_now().await;
                1
            });
            let inner = Scoped::<u32, Interrupted>::new(|scope| async move {
                scope.add_finalizer(|_| yield_now());
                scope.add_finalizer(|_| async {});
                let fiber = scope.fork(async {
                    yield_now().await;
                    2
                });
                Ok(fiber.join().await.success().unwrap_or(0))
            });
            let inner = inner.await?;
            Ok(inner + worker.join().await.success().unwrap_or(0))
        });
        middle.await
    })
}

#[test]
fn every_await_point_of_a_scope_tree_keeps_every_promise_stopped_either_way() {
    use leasehold::testkit::{every_await_point, Stop};
    for seed in 0..4 {
        let mut config = SimConfig::default();
        config.seed = seed;
        config.check_determinism = true;
        for stop in [Stop::Signal, Stop::Drop] {
            let explored = every_await_point(config.clone(), stop, |_| tree())
                .unwrap_or_else(|failure| panic!("{failure}"));
            assert!(explored.points >= 8, "{explored:?}");
        }
    }
}

#[test]
fn every_await_point_reports_a_leaked_fiber_with_a_trace_that_replays_it() {
    use leasehold::testkit::{every_await_point, Stop};
    let leaky = || {
        Scoped::<(), Interrupted>::new(|scope| async move {
            scope.add_finalizer(|_| async {
                // A clean-up that starts work it never finishes.
                drop(fork_daemon(std::future::pending::<()>()));
            });
            yield_now().await;
            Ok(())
        })
    };
    let failure = every_await_point(SimConfig::default(), Stop::Signal, |_| leaky()).unwrap_err();
    assert!(failure.what.contains("leaked"), "{failure}");
    assert!(failure.what.contains("daemon fiber"), "{failure}");
    // The trace reproduces the run exactly: the same leak, at the same point.
    let mut sim = Sim::replay(&failure.trace).unwrap();
    let error = sim.block_on(leaky()).unwrap_err();
    assert!(matches!(error, SimError::Leaked { .. }), "{error}");
    assert_eq!(sim.trace(), failure.trace);
}

#[test]
fn stop_at_checks_one_drawn_point() {
    use leasehold::testkit::{stop_at, Stop};
    for point in [0, 1, 5, 1_000] {
        stop_at(SimConfig::default(), Stop::Signal, point, |_| tree())
            .unwrap_or_else(|failure| panic!("{failure}"));
    }
}

#[test]
fn a_drawn_schedule_is_followed_and_an_empty_one_is_arrival_order() {
    let with = |schedule: Vec<u32>| {
        let mut config = SimConfig::default();
        config.schedule = Some(schedule);
        let mut sim = Sim::with_config(config);
        let order = run_order(&mut sim, 3);
        (order, sim.trace())
    };
    let (fifo, _) = with(Vec::new());
    assert_eq!(fifo, run_order(&mut Sim::fifo(), 3));
    // Each choice is taken modulo the ready count: 7 of 4 ready is the fourth.
    let (order, trace) = with(vec![7, 1, 9]);
    assert_ne!(order, fifo);
    assert!(trace.starts_with("sim1:0:3,1,"), "{trace}");
    assert_eq!(run_order(&mut Sim::replay(&trace).unwrap(), 3), order);
}

#[test]
fn an_interruption_is_recorded_when_requested_and_when_delivered() {
    use leasehold::testkit::Event;
    use leasehold::AbortController;
    let mut sim = Sim::new(15);
    let stop = AbortController::new();
    let work =
        Scoped::<(), Interrupted>::new(|_| std::future::pending()).with_signal(&stop.signal());
    let clock = sim.clock();
    let given = leasehold::AbortReason::new(TimedOut);
    let reason = given.clone();
    sim.block_on(async move {
        let mut work = Box::pin(work);
        let _ = futures::poll!(work.as_mut());
        clock.sleep(Duration::from_millis(1)).await;
        stop.abort(given);
        work.await
    })
    .unwrap()
    .unwrap_err();
    let events = sim.events();
    let requested = events
        .iter()
        .position(|e| matches!(e, Event::InterruptRequested { reason: r } if r.ptr_eq(&reason)));
    let delivered = events.iter().position(
        |e| matches!(e, Event::InterruptDelivered { scope: Some(_), reason: r } if r.ptr_eq(&reason)),
    );
    assert!(requested.is_some() && requested < delivered, "{events:#?}");
}
