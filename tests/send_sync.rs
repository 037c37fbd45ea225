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
const _: () = send_sync::<Fiber<u32>>();
const _: () = send::<Fiber<NotSync>>();
const _: () = send::<Exit<NotSync>>();

// Futures that are named types: Send + Unpin, so they can be stored and `select!`ed freely.
const _: () = send_unpin::<Scoped<u32, Interrupted>>();
const _: () = send_unpin::<Scoped<NotSync, Interrupted>>();
const _: () = send_unpin::<Acquire>();

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

fn acquire_future(semaphore: &Semaphore) -> Acquire {
    semaphore.acquire(1)
}

fn daemon_handle() -> Fiber<u8> {
    fork_daemon(async {
        leasehold::Clock::sleep(&SystemClock, Duration::from_millis(1)).await;
        1
    })
}
