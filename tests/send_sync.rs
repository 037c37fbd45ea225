//! Compile-time checks that public handles and futures are `Send` (and `Sync` or `Unpin` where
//! they should be). This file has nothing to run: if it compiles, the checks hold.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

use leasehold::{
    fork_daemon, AbortController, AbortReason, AbortSignal, Acquire, Exit, ExitStatus, Fiber,
    Interrupted, Permit, Schedule, ScheduleRun, Scope, Scoped, Semaphore, SmolSpawner, SystemClock,
    TestClock,
};
use leasehold::{
    EntryState, Guard, LeaseLost, LockEntry, LockError, LockManager, LockManagerBuilder,
    LockRequest, Mode, Removal, StorageStats,
};

const fn send<T: Send>() {}
const fn send_sync<T: Send + Sync>() {}
const fn send_unpin<T: Send + Unpin>() {}

/// Any payload type that is `Send` but not `Sync`: a future or handle generic over it must still
/// be `Send`.
type NotSync = std::cell::Cell<u8>;

// Handles and values shared between tasks: Send + Sync.
const _: () = send_sync::<Scope>();
const _: () = send_sync::<AbortController>();
const _: () = send_sync::<AbortSignal>();
const _: () = send_sync::<AbortReason>();
const _: () = send_sync::<Interrupted>();
const _: () = send_sync::<ExitStatus>();
const _: () = send_sync::<Semaphore>();
const _: () = send_sync::<Permit>();
const _: () = send_sync::<Schedule>();
const _: () = send_sync::<ScheduleRun>();
const _: () = send_sync::<TestClock>();
const _: () = send_sync::<SystemClock>();
const _: () = send_sync::<SmolSpawner>();
#[cfg(feature = "tokio")]
const _: () = send_sync::<leasehold::TokioSpawner>();
const _: () = send_sync::<leasehold::RaceLost>();
const _: () = send_sync::<Fiber<u32>>();
const _: () = send::<Fiber<NotSync>>();
const _: () = send::<Exit<NotSync>>();

// Futures that are named types: Send + Unpin, so they can be stored and `select!`ed freely.
const _: () = send_unpin::<Scoped<u32, Interrupted>>();
const _: () = send_unpin::<Scoped<NotSync, Interrupted>>();
const _: () = send_unpin::<Acquire<'static>>();

// Futures returned by methods and functions: Send.
fn close_future(scope: &Scope) -> impl Future<Output = ()> + Send + '_ {
    scope.close(ExitStatus::Success)
}

fn join_future(fiber: Fiber<NotSync>) -> impl Future<Output = Exit<NotSync>> + Send {
    fiber.join()
}

fn interrupt_future(fiber: Fiber<NotSync>) -> impl Future<Output = Exit<NotSync>> + Send {
    fiber.interrupt("reason")
}

fn interrupt_future_with_reason(fiber: Fiber<u8>) -> impl Future<Output = Exit<u8>> + Send {
    fiber.interrupt(AbortReason::from("reason"))
}

fn aborted_future(signal: &AbortSignal) -> impl Future<Output = AbortReason> + Send + 'static {
    signal.aborted()
}

fn retry_future(schedule: &Schedule) -> impl Future<Output = Result<u8, String>> + Send + '_ {
    schedule.retry(|| async { Err::<u8, _>(String::from("again")) })
}

fn repeat_future(schedule: &Schedule) -> impl Future<Output = Result<u8, String>> + Send + '_ {
    let mut runs = 0;
    schedule.repeat(move || {
        runs += 1;
        let n = runs;
        async move { Ok::<_, String>(n) }
    })
}

fn scoped_shorthand_future() -> impl Future<Output = Result<u8, Interrupted>> + Send {
    leasehold::scoped(|_scope| async { Ok(1) })
}

fn race_future(
    contenders: Vec<Scoped<NotSync, Interrupted>>,
) -> impl Future<Output = Result<NotSync, Interrupted>> + Send {
    leasehold::race(contenders)
}

fn race_first_future(
    contenders: Vec<Scoped<NotSync, Interrupted>>,
) -> impl Future<Output = Result<NotSync, Interrupted>> + Send {
    leasehold::race_first(contenders)
}

fn all_future(
    members: Vec<Scoped<NotSync, Interrupted>>,
) -> impl Future<Output = Result<Vec<NotSync>, Interrupted>> + Send {
    leasehold::all(members)
}

fn acquire_future(semaphore: &Semaphore) -> Acquire<'_> {
    semaphore.acquire(1)
}

fn daemon_handle() -> Fiber<u8> {
    fork_daemon(async {
        leasehold::Clock::sleep(&SystemClock, Duration::from_millis(1)).await;
        1
    })
}

// The lock manager: handles and values Send + Sync; its futures Send (acquisitions also Unpin).
const _: () = send_sync::<LockManager>();
const _: () = send_sync::<LockManagerBuilder>();
const _: () = send_sync::<Guard>();
const _: () = send_sync::<LockError>();
const _: () = send_sync::<LockRequest>();
const _: () = send_sync::<LockEntry>();
const _: () = send_sync::<EntryState>();
const _: () = send_sync::<Mode>();
const _: () = send_sync::<StorageStats>();
const _: () = send_sync::<LeaseLost>();
const _: () = send_sync::<Removal>();
const _: () = send_unpin::<Scoped<Guard, LockError>>();

fn try_acquire_future(
    locks: &LockManager,
) -> impl Future<Output = Result<Option<Guard>, LockError>> + Send + '_ {
    locks.try_acquire(LockRequest::shared("k", "op"))
}

fn is_locked_future(
    locks: &LockManager,
) -> impl Future<Output = Result<bool, LockError>> + Send + '_ {
    locks.is_locked("k")
}

fn inspect_future(
    locks: &LockManager,
) -> impl Future<Output = Result<Vec<LockEntry>, LockError>> + Send + '_ {
    locks.inspect(Some("k"))
}

fn remove_future(
    locks: &LockManager,
) -> impl Future<Output = Result<usize, LockError>> + Send + '_ {
    locks.remove(Removal::Owner("gone".into()))
}

fn shutdown_future(locks: &LockManager) -> impl Future<Output = Result<(), LockError>> + Send + '_ {
    locks.shutdown()
}

fn release_future(guard: Guard) -> impl Future<Output = Result<(), LockError>> + Send {
    guard.release()
}
