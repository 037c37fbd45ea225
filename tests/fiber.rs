//! Fibers: join, interrupt, panics, daemons.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    on_every_executor, slow_finalizer, within, within_blocking, Flag, Log, GENEROUS, SLOW,
};
use futures::executor::block_on;
use futures::future::{self, BoxFuture};
use leasehold::{
    fork_daemon, scoped, AbortReason, Clock, Exit, ExitStatus, Interrupted, Scope, Scoped,
    TestClock,
};

/// A fiber body: a `Scoped` with a slow finalizer named `name`, which sets `started` and then
/// waits forever.
async fn wait_forever_with_cleanup(log: Log, name: &'static str, started: Flag) {
    let _ = scoped::<(), Interrupted, _, _>(move |scope| async move {
        slow_finalizer(&scope, &log, name, SLOW);
        started.set();
        future::pending().await
    })
    .await;
}

#[test]
fn join_gives_the_fibers_value() {
    assert!(matches!(
        block_on(fork_daemon(async { "daemon" }).join()),
        Exit::Success("daemon")
    ));
    let scope = Scope::new();
    assert!(matches!(
        block_on(scope.fork(async { 7 }).join()),
        Exit::Success(7)
    ));
}

#[test]
fn interrupt_waits_for_the_finalizers_of_nested_scoped_inside_the_fiber() {
    on_every_executor(|| async {
        let log = Log::new();
        let started = Flag::new();
        let fiber = fork_daemon(wait_forever_with_cleanup(
            log.clone(),
            "nested",
            started.clone(),
        ));
        within(GENEROUS, "the fiber started", || async { started.is_set() }).await;

        let reason = AbortReason::from("stop the fiber");
        let exit = fiber.interrupt(reason.clone()).await;

        assert_eq!(log.entries(), ["nested start", "nested end"]);
        match exit {
            Exit::Interrupted(got) => assert!(got.ptr_eq(&reason)),
            other => panic!("expected an interrupted fiber, got {other:?}"),
        }
    });
}

#[test]
fn interrupting_a_fiber_interrupts_its_children_first_and_waits_for_them() {
    let log = Log::new();
    let started = Flag::new();
    let (fiber_log, fiber_started) = (log.clone(), started.clone());
    let fiber = fork_daemon(async move {
        scoped::<(), Interrupted, _, _>(move |scope| async move {
            slow_finalizer(&scope, &fiber_log, "parent", SLOW);
            let _child = scope.fork(wait_forever_with_cleanup(
                fiber_log.clone(),
                "child",
                fiber_started,
            ));
            future::pending().await
        })
        .await
    });
    within_blocking(GENEROUS, "the child fiber started", || started.is_set());

    let reason = AbortReason::from("stop the family");
    let exit = block_on(fiber.interrupt(reason.clone()));

    assert_eq!(
        log.entries(),
        ["child start", "child end", "parent start", "parent end"]
    );
    assert!(matches!(exit, Exit::Interrupted(got) if got.ptr_eq(&reason)));
}

#[test]
fn a_fiber_interrupted_before_its_first_poll_never_runs() {
    // A spawner that holds the fiber's task until the test lets it go.
    let held: Arc<Mutex<Vec<BoxFuture<'static, ()>>>> = Arc::default();
    let holder = held.clone();
    let scope = Scope::with_spawner(Arc::new(move |task: BoxFuture<'static, ()>| {
        holder.lock().unwrap().push(task)
    }));
    let ran = Flag::new();
    let flag = ran.clone();
    let fiber = scope.fork(async move { flag.set() });
    let reason = AbortReason::from("never mind");
    fiber.interrupt_fork(reason.clone());

    let tasks = std::mem::take(&mut *held.lock().unwrap());
    assert_eq!(tasks.len(), 1);
    block_on(future::join_all(tasks));

    assert!(!ran.is_set(), "the fiber's future ran");
    assert!(matches!(block_on(fiber.join()), Exit::Interrupted(got) if got.ptr_eq(&reason)));
    block_on(scope.close(leasehold::ExitStatus::Success));
}

#[test]
fn interrupting_an_already_successful_fiber_gives_success() {
    let fiber = fork_daemon(async { 11 });
    within_blocking(GENEROUS, "the fiber finished", || fiber.is_finished());
    assert!(matches!(
        block_on(fiber.interrupt("too late")),
        Exit::Success(11)
    ));
}

#[test]
fn interrupt_fork_sends_the_interruption_without_waiting() {
    let clock = TestClock::new();
    let started = Flag::new();
    let finalized = Flag::new();
    let (sleepy, fiber_started, fiber_finalized) =
        (clock.clone(), started.clone(), finalized.clone());
    let fiber = fork_daemon(async move {
        scoped::<(), Interrupted, _, _>(move |scope| async move {
            scope.add_finalizer(move |_| async move {
                sleepy.sleep(Duration::from_secs(1)).await;
                fiber_finalized.set();
            });
            fiber_started.set();
            future::pending().await
        })
        .await
    });
    within_blocking(GENEROUS, "the fiber started", || started.is_set());

    let reason = AbortReason::from("asked, not awaited");
    fiber.interrupt_fork(reason.clone());
    // The fiber is now asleep in its finalizer and cannot finish until the clock moves.
    within_blocking(GENEROUS, "the finalizer is asleep", || {
        clock.sleepers() == 1
    });
    assert!(!fiber.is_finished());

    clock.advance(Duration::from_secs(1));
    let exit = block_on(fiber.join());
    assert!(finalized.is_set());
    assert!(matches!(exit, Exit::Interrupted(got) if got.ptr_eq(&reason)));
}

#[test]
fn is_finished_turns_true_only_once_the_cleanup_has_finished() {
    let clock = TestClock::new();
    let sleepy = clock.clone();
    let fiber = fork_daemon(async move {
        scoped::<u8, Interrupted, _, _>(move |scope| async move {
            scope.add_finalizer(move |_| async move {
                sleepy.sleep(Duration::from_secs(1)).await;
            });
            Ok(3)
        })
        .await
    });
    within_blocking(GENEROUS, "the finalizer is asleep", || {
        clock.sleepers() == 1
    });
    assert!(!fiber.is_finished(), "finished before its clean-up");

    clock.advance(Duration::from_secs(1));
    within_blocking(GENEROUS, "the fiber finished", || fiber.is_finished());
    assert!(matches!(block_on(fiber.join()), Exit::Success(Ok(3))));
}

#[test]
fn a_panic_gives_exit_panicked_with_the_message_after_the_cleanup() {
    let log = Log::new();
    let fiber_log = log.clone();
    let fiber = fork_daemon(async move {
        Scoped::<(), Interrupted>::new(move |scope| async move {
            slow_finalizer(&scope, &fiber_log, "cleanup", SLOW);
            panic!("the fiber broke: {}", 42);
        })
        .await
    });
    match block_on(fiber.join()) {
        Exit::Panicked(message) => assert_eq!(message, "the fiber broke: 42"),
        other => panic!("expected a panicked fiber, got {other:?}"),
    }
    assert_eq!(log.entries(), ["cleanup start", "cleanup end"]);
}

#[test]
fn a_fiber_whose_finalizer_panics_ends_panicked() {
    // The reproduction from the issue: the value does not hide the finalizer's panic.
    let fiber = fork_daemon(scoped::<u32, Interrupted, _, _>(|scope| async move {
        scope.add_finalizer(|_| async { panic!("the finalizer died") });
        Ok(42)
    }));
    let exit = block_on(fiber.join());
    assert!(!exit.is_success());
    assert!(
        matches!(&exit, Exit::Panicked(message) if message == "the finalizer died"),
        "{exit:?}"
    );
}

#[test]
fn a_fiber_that_closes_its_own_scope_is_not_interrupted_and_keeps_its_value() {
    // As Effect's forkIn: the close started by the fiber neither interrupts nor awaits it.
    on_every_executor(|| async {
        let log = Log::new();
        let scope = Scope::new();
        let sibling_started = Flag::new();
        let sibling = scope.fork(wait_forever_with_cleanup(
            log.clone(),
            "sibling",
            sibling_started.clone(),
        ));
        within(GENEROUS, "the sibling started", || async {
            sibling_started.is_set()
        })
        .await;
        let finalizer_log = log.clone();
        scope.add_finalizer(move |_| async move { finalizer_log.push("scope finalizer") });
        let (closer_scope, closer_log) = (scope.clone(), log.clone());
        let closer = scope.fork(async move {
            closer_scope.close(ExitStatus::Success).await;
            closer_log.push("the closer went on");
            42
        });
        assert!(matches!(closer.join().await, Exit::Success(42)));
        assert!(sibling.join().await.is_interrupted());
        assert_eq!(
            log.entries(),
            [
                "sibling start",
                "sibling end",
                "scope finalizer",
                "the closer went on"
            ]
        );
    });
}

#[test]
fn a_plain_panicking_future_gives_exit_panicked() {
    let fiber = fork_daemon(async {
        panic!("plain panic");
    });
    assert!(matches!(
        block_on(fiber.join()),
        Exit::<()>::Panicked(message) if message == "plain panic"
    ));
}

#[test]
fn a_panic_with_a_non_string_payload_still_gives_exit_panicked() {
    let fiber = fork_daemon(async {
        std::panic::panic_any(42_u8);
    });
    assert!(matches!(block_on(fiber.join()), Exit::<()>::Panicked(_)));
}

#[test]
fn fork_daemon_is_tied_to_no_scope() {
    let started = Flag::new();
    let fiber_started = started.clone();
    // The daemon is started inside a Scoped that then resolves: it is not interrupted.
    let fiber = block_on(Scoped::<_, Interrupted>::new(move |_scope| async move {
        Ok(fork_daemon(async move {
            fiber_started.set();
            future::pending::<()>().await
        }))
    }))
    .unwrap();
    within_blocking(GENEROUS, "the daemon started", || started.is_set());
    assert!(!fiber.is_finished());
    assert!(block_on(fiber.interrupt("done with it")).is_interrupted());
}

#[test]
fn dropping_a_fiber_detaches_it_and_it_runs_on() {
    let gate = Flag::new();
    let done = Flag::new();
    let (fiber_gate, fiber_done) = (gate.clone(), done.clone());
    let fiber = fork_daemon(async move {
        within(GENEROUS, "the gate opened", || async {
            fiber_gate.is_set()
        })
        .await;
        fiber_done.set();
    });
    drop(fiber);
    gate.set();
    within_blocking(GENEROUS, "the detached fiber finished", || done.is_set());
}

/// A panic nobody can be given is logged: a fiber dropped before it panics (here in a
/// finalizer of its clean-up), or after, ends `Panicked` with nobody to join it.
#[test]
fn a_panic_of_a_fiber_nobody_joins_is_logged() {
    common::error_logged("");
    let gate = Flag::new();
    let fiber_gate = gate.clone();
    let before = fork_daemon(async move {
        let _ = scoped::<(), Interrupted, _, _>(move |scope| async move {
            scope.add_finalizer(|_| async { panic!("a finalizer of a fiber dropped before") });
            within(GENEROUS, "the gate opened", || async {
                fiber_gate.is_set()
            })
            .await;
            Ok(())
        })
        .await;
    });
    drop(before);
    gate.set();
    let after = fork_daemon(async { panic!("a fiber dropped after it panicked") });
    within_blocking(GENEROUS, "the second fiber ended", || after.is_finished());
    drop(after);
    within_blocking(GENEROUS, "both panics logged", || {
        common::error_logged("a finalizer of a fiber dropped before")
            && common::error_logged("a fiber dropped after it panicked")
    });
}

/// Background work started inside a `Scoped`'s body stays on that body's spawner, whatever
/// starts it: a daemon, or the fibers of a scope made there.
#[test]
fn daemons_and_scopes_made_inside_a_body_run_on_its_spawner() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let spawned = Arc::new(AtomicUsize::new(0));
    let counted = spawned.clone();
    let spawner: Arc<dyn leasehold::Spawner> = Arc::new(move |future: BoxFuture<'static, ()>| {
        counted.fetch_add(1, Ordering::SeqCst);
        std::thread::spawn(move || block_on(future));
    });
    let (daemon, forked) = block_on(
        Scoped::<_, Interrupted>::new(|_| async move {
            let daemon = fork_daemon(async { 1 }).join().await;
            let scope = Scope::new();
            let forked = scope.fork(async { 2 }).join().await;
            scope.close(ExitStatus::Success).await;
            Ok((daemon, forked))
        })
        .with_spawner(spawner),
    )
    .unwrap();
    assert_eq!((daemon.success(), forked.success()), (Some(1), Some(2)));
    assert_eq!(
        spawned.load(Ordering::SeqCst),
        2,
        "both ran on the body's spawner"
    );
}

#[test]
fn exit_tells_how_the_fiber_ended() {
    let success: Exit<u8> = Exit::Success(1);
    assert!(success.is_success() && !success.is_interrupted());
    assert_eq!(success.success(), Some(1));

    let interrupted: Exit<u8> = Exit::Interrupted("stop".into());
    assert!(interrupted.is_interrupted() && !interrupted.is_success());
    assert_eq!(interrupted.success(), None);

    let panicked: Exit<u8> = Exit::Panicked("boom".into());
    assert!(!panicked.is_success() && !panicked.is_interrupted());
    assert_eq!(panicked.success(), None);
}

#[test]
fn exit_displays_how_the_fiber_ended() {
    assert_eq!(Exit::Success("done").to_string(), "success: done");
    assert_eq!(
        Exit::<u8>::Interrupted("stop".into()).to_string(),
        "interrupted: stop"
    );
    assert_eq!(
        Exit::<u8>::Panicked("boom".into()).to_string(),
        "panicked: boom"
    );
}
