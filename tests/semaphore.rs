//! The fair (strictly FIFO) semaphore.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::{on_every_executor, poll_once, yield_now, Log, GENEROUS};
use futures::executor::block_on;
use futures::future;
use leasehold::{Acquire, ExitStatus, Permit, Scope, Semaphore};

/// Counts, per thread, the bytes allocated minus the bytes freed. A permit may outlive every
/// handle to its semaphore, and the semaphore's state is then freed by whichever goes last: the
/// tests below use this count to see that it is freed, and not before the last permit is back.
struct CountingAllocator;

thread_local! {
    static LIVE_BYTES: Cell<isize> = const { Cell::new(0) };
}

fn count(bytes: isize) {
    // `try_with`: allocations made while the thread's locals are torn down are not counted.
    let _ = LIVE_BYTES.try_with(|live| live.set(live.get() + bytes));
}

/// Bytes this thread has allocated and not freed (minus those it freed for other threads).
fn live_bytes() -> isize {
    LIVE_BYTES.with(Cell::get)
}

// SAFETY: forwards every call to the system allocator unchanged; only counts on the side.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let block = unsafe { System.alloc(layout) };
        if !block.is_null() {
            count(layout.size() as isize);
        }
        block
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let block = unsafe { System.alloc_zeroed(layout) };
        if !block.is_null() {
            count(layout.size() as isize);
        }
        block
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let moved = unsafe { System.realloc(block, layout, new_size) };
        if !moved.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        moved
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(block, layout) };
        count(-(layout.size() as isize));
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn ready(poll: std::task::Poll<Permit>) -> Permit {
    match poll {
        std::task::Poll::Ready(permit) => permit,
        std::task::Poll::Pending => panic!("the acquire is still waiting"),
    }
}

#[test]
fn available_counts_the_free_permits() {
    let semaphore = Semaphore::new(5);
    assert_eq!(semaphore.available(), 5);
    let a = block_on(semaphore.acquire(2));
    let b = semaphore.try_acquire(1).unwrap();
    assert_eq!(semaphore.available(), 2);
    assert_eq!((a.permits(), b.permits()), (2, 1));
    drop((a, b));
    assert_eq!(semaphore.available(), 5);
}

#[test]
fn permits_are_returned_when_dropped() {
    let semaphore = Semaphore::new(3);
    let permit = block_on(semaphore.acquire(3));
    assert_eq!(semaphore.available(), 0);
    drop(permit);
    assert_eq!(semaphore.available(), 3);
}

#[test]
fn clones_share_the_permits() {
    let semaphore = Semaphore::new(2);
    let other = semaphore.clone();
    let _permit = other.try_acquire(2).unwrap();
    assert_eq!(semaphore.available(), 0);
    assert!(semaphore.try_acquire(1).is_none());
}

#[test]
fn try_acquire_takes_free_permits_and_never_waits() {
    let semaphore = Semaphore::new(2);
    let permit = semaphore.try_acquire(2).expect("two free permits");
    assert!(semaphore.try_acquire(1).is_none());
    drop(permit);
    assert!(semaphore.try_acquire(3).is_none(), "more than the capacity");
    assert_eq!(semaphore.available(), 2);
}

#[test]
fn try_acquire_does_not_jump_the_queue() {
    let semaphore = Semaphore::new(2);
    let held = semaphore.try_acquire(1).unwrap();
    let mut queued = semaphore.acquire(2);
    assert!(poll_once(&mut queued).is_pending());
    assert_eq!(semaphore.available(), 1);
    assert!(
        semaphore.try_acquire(1).is_none(),
        "try_acquire overtook a queued request"
    );
    drop(held);
    let _granted = ready(poll_once(&mut queued));
}

#[test]
fn a_large_request_at_the_head_is_not_overtaken_by_a_small_one_behind_it() {
    let semaphore = Semaphore::new(3);
    let held = block_on(semaphore.acquire(2));
    let mut large = semaphore.acquire(3);
    let mut small = semaphore.acquire(1);
    assert!(poll_once(&mut large).is_pending());
    assert!(
        poll_once(&mut small).is_pending(),
        "the small request overtook the large one at the head"
    );
    assert_eq!(semaphore.available(), 1);

    drop(held);
    let large = ready(poll_once(&mut large));
    assert!(poll_once(&mut small).is_pending());
    drop(large);
    let _small = ready(poll_once(&mut small));
}

#[test]
fn a_dropped_queued_acquire_removes_itself_and_lets_the_next_through() {
    let semaphore = Semaphore::new(2);
    let _held = semaphore.try_acquire(1).unwrap();
    let mut head = semaphore.acquire(2);
    let mut next = semaphore.acquire(1);
    assert!(poll_once(&mut head).is_pending());
    assert!(poll_once(&mut next).is_pending());

    drop(head);
    let next = ready(poll_once(&mut next));
    assert_eq!(next.permits(), 1);
    assert_eq!(semaphore.available(), 0);
}

#[test]
fn an_acquire_dropped_after_its_grant_gives_the_permits_back() {
    let semaphore = Semaphore::new(2);
    let held = semaphore.try_acquire(2).unwrap();
    let mut granted_unseen = semaphore.acquire(2);
    assert!(poll_once(&mut granted_unseen).is_pending());
    drop(held); // grants the queued request, which is never polled again
    assert_eq!(semaphore.available(), 0);

    drop(granted_unseen);
    assert_eq!(semaphore.available(), 2);
    assert!(semaphore.try_acquire(2).is_some());
}

#[test]
fn an_acquire_dropped_before_its_first_poll_changes_nothing() {
    let semaphore = Semaphore::new(1);
    drop(semaphore.acquire(1));
    assert_eq!(semaphore.available(), 1);
    assert!(semaphore.try_acquire(1).is_some());
}

#[test]
#[should_panic(expected = "requested 3 permits from a semaphore of 2")]
fn acquiring_more_than_the_capacity_panics() {
    let semaphore = Semaphore::new(2);
    let _never = semaphore.acquire(3);
}

#[test]
fn a_semaphore_its_acquisitions_and_its_permits_debug_print_what_they_hold() {
    let semaphore = Semaphore::new(3);
    let permit = semaphore.try_acquire(2).unwrap();
    let mut waiting = Box::pin(semaphore.acquire(2));
    assert!(poll_once(&mut waiting).is_pending());
    assert_eq!(
        format!("{semaphore:?}"),
        "Semaphore { capacity: 3, available: 1, waiters: 1 }"
    );
    assert_eq!(
        format!("{waiting:?}"),
        "Acquire { permits: 2, queued: true }"
    );
    assert_eq!(format!("{permit:?}"), "Permit { permits: 2 }");
}

/// The documented limit, exactly: any count that fits in 62 bits (the top two bits of the
/// state are flags), and not one more.
#[cfg(target_pointer_width = "64")]
#[test]
fn a_semaphore_holds_any_count_of_permits_that_fits_in_62_bits() {
    let most = (1usize << 62) - 1;
    let semaphore = Semaphore::new(most);
    assert_eq!(semaphore.available(), most);
    let all = semaphore.try_acquire(most).expect("every permit is free");
    assert_eq!(semaphore.available(), 0);
    assert!(semaphore.try_acquire(1).is_none());
    drop(all);
    assert_eq!(semaphore.available(), most);
}

#[cfg(target_pointer_width = "64")]
#[test]
#[should_panic(expected = "a semaphore holds at most")]
fn a_semaphore_of_more_permits_than_fit_in_62_bits_panics() {
    let _ = Semaphore::new(1usize << 62);
}

#[test]
fn a_waiter_on_another_thread_is_woken_when_permits_come_back() {
    let semaphore = Semaphore::new(1);
    let held = semaphore.try_acquire(1).unwrap();
    let waiter = {
        let semaphore = semaphore.clone();
        std::thread::spawn(move || block_on(semaphore.acquire(1)).permits())
    };
    drop(held);
    assert_eq!(waiter.join().unwrap(), 1);
    assert_eq!(semaphore.available(), 1);
}

#[test]
fn a_permit_adopted_by_a_scope_is_released_when_the_scope_closes() {
    let semaphore = Semaphore::new(2);
    let scope = Scope::new();
    scope.adopt(block_on(semaphore.acquire(2)));
    assert_eq!(semaphore.available(), 0);
    block_on(scope.close(ExitStatus::Success));
    assert_eq!(semaphore.available(), 2);
}

#[test]
fn waiters_are_granted_in_request_order_on_every_executor() {
    on_every_executor(|| async {
        let semaphore = Semaphore::new(2);
        let order = Log::new();
        let all = semaphore.acquire(2).await;
        // Alternate requests of 2 and 1 permits: a request of 1 could fit while a request of 2
        // ahead of it waits, and must not be let through.
        let waiters = (0..6).map(|i| {
            let (semaphore, order) = (semaphore.clone(), order.clone());
            async move {
                let permit = semaphore.acquire(if i % 2 == 0 { 2 } else { 1 }).await;
                order.push(i.to_string());
                yield_now().await;
                drop(permit);
            }
        });
        // `join` polls the waiters first, so they are all queued, in order, before the release.
        let release = async move {
            yield_now().await;
            drop(all);
        };
        future::join(future::join_all(waiters), release).await;

        assert_eq!(order.entries(), ["0", "1", "2", "3", "4", "5"]);
        assert_eq!(semaphore.available(), 2);
    });
}

#[test]
fn no_more_than_the_capacity_is_ever_held_under_contention() {
    const CAPACITY: usize = 4;
    const TASKS: usize = 32;
    const ROUNDS: usize = 200;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let semaphore = Semaphore::new(CAPACITY);
    let held = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));

    runtime.block_on(async {
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let (semaphore, held, most) = (semaphore.clone(), held.clone(), most.clone());
                tokio::spawn(async move {
                    for round in 0..ROUNDS {
                        let want = 1 + (task + round) % 3;
                        if round % 7 == 0 {
                            // A request abandoned while it may be queued.
                            let mut abandoned = semaphore.acquire(want);
                            let _ = poll_once(&mut abandoned);
                            continue;
                        }
                        let permit = if round % 5 == 0 {
                            match semaphore.try_acquire(want) {
                                Some(permit) => permit,
                                None => continue,
                            }
                        } else {
                            semaphore.acquire(want).await
                        };
                        let now = held.fetch_add(want, Ordering::SeqCst) + want;
                        most.fetch_max(now, Ordering::SeqCst);
                        assert!(now <= CAPACITY, "{now} permits held at once");
                        tokio::task::yield_now().await;
                        held.fetch_sub(want, Ordering::SeqCst);
                        drop(permit);
                    }
                })
            })
            .collect();
        for task in tasks {
            tokio::time::timeout(GENEROUS, task)
                .await
                .expect("a task got stuck waiting for permits")
                .unwrap();
        }
    });

    assert!(most.load(Ordering::SeqCst) <= CAPACITY);
    assert!(most.load(Ordering::SeqCst) >= 2, "there was no contention");
    assert_eq!(held.load(Ordering::SeqCst), 0);
    assert_eq!(semaphore.available(), CAPACITY);
}

#[test]
fn permits_that_outlive_every_handle_return_cleanly_and_the_last_one_frees_the_semaphore() {
    let before = live_bytes();
    let semaphore = Semaphore::new(4);
    let other = semaphore.clone();
    let a = semaphore.try_acquire(1).unwrap();
    let b = ready(poll_once(&mut other.acquire(2)));
    let none = ready(poll_once(&mut semaphore.acquire(0)));
    let c = other.try_acquire(1).unwrap();
    drop((semaphore, other));

    drop(b);
    drop(a);
    assert!(
        live_bytes() > before,
        "the semaphore was freed while a permit was still out"
    );
    drop(c);
    assert_eq!(
        live_bytes(),
        before,
        "the last permit back did not free the semaphore"
    );
    // A permit of no permits never touches the semaphore: dropping it now is harmless.
    assert_eq!(none.permits(), 0);
    drop(none);
}

#[test]
fn the_last_handle_frees_the_semaphore_when_every_permit_is_already_back() {
    let before = live_bytes();
    let semaphore = Semaphore::new(2);
    let permit = ready(poll_once(&mut semaphore.acquire(2)));
    let other = semaphore.clone();
    drop(permit);
    drop(semaphore);
    assert!(live_bytes() > before, "freed while a handle was left");
    drop(other);
    assert_eq!(live_bytes(), before, "the last handle did not free it");
}

#[test]
fn a_permit_that_outlives_a_cancelled_waiter_and_every_handle_frees_the_semaphore() {
    let before = live_bytes();
    let semaphore = Semaphore::new(2);
    let first = semaphore.try_acquire(1).unwrap();
    let second = ready(poll_once(&mut semaphore.acquire(1)));
    {
        let mut cancelled = semaphore.acquire(2);
        assert!(poll_once(&mut cancelled).is_pending());
        drop(first); // granted to nobody: the head needs 2
        let mut granted_unseen = semaphore.acquire(1);
        assert!(poll_once(&mut granted_unseen).is_pending());
        drop(cancelled); // the request behind it takes the free permit, and is never polled
        assert_eq!(semaphore.available(), 0);
    } // ... and gives it back when dropped
    assert_eq!(semaphore.available(), 1);
    drop(semaphore);
    drop(second);
    assert_eq!(live_bytes(), before, "the semaphore was not freed");
}

// `mem::forget` of a queued request is safe code. Its permits may then be granted and never come
// back: the semaphore's state may leak, but must not be freed early, nor twice. (Both tests leak
// on purpose: run them apart from the others under a leak checker.)

#[test]
fn a_leaked_acquire_granted_while_handles_remain_keeps_its_permits_and_the_rest_work() {
    let semaphore = Semaphore::new(2);
    let held = semaphore.try_acquire(2).unwrap();
    let mut leaked = semaphore.acquire(1);
    assert!(poll_once(&mut leaked).is_pending());
    std::mem::forget(leaked);
    drop(held); // grants the leaked request one permit, for good
    assert_eq!(semaphore.available(), 1);
    let last = semaphore.try_acquire(1).expect("the queue flag went down");
    drop(semaphore);
    drop(last); // the leaked permit is still out: the state stays (leaked)
}

#[test]
fn a_leaked_acquire_granted_after_the_last_handle_went_does_not_stop_the_free() {
    let semaphore = Semaphore::new(2);
    let held = semaphore.try_acquire(2).unwrap();
    let mut leaked = semaphore.acquire(1);
    assert!(poll_once(&mut leaked).is_pending());
    std::mem::forget(leaked);
    drop(semaphore);
    // Every permit is back and no handle is left, so this return frees the state, after serving
    // the queue under its lock: which grants the leaked request, whose permits never come back.
    drop(held);
}

/// Runs `test` on its own thread and fails if it has not finished within `limit`: a deadlock
/// fails the test instead of hanging it.
fn finishes_within(limit: Duration, test: impl FnOnce() + Send + 'static) {
    let (finished, done) = std::sync::mpsc::channel();
    let runner = std::thread::spawn(move || {
        test();
        let _ = finished.send(());
    });
    match done.recv_timeout(limit) {
        Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = runner.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("not finished within {limit:?}: deadlocked?")
        }
    }
}

/// Polls `acquire` until it is granted, yielding the thread in between.
fn spin_until_granted(acquire: &mut Acquire<'_>) -> Permit {
    let deadline = Instant::now() + GENEROUS;
    loop {
        if let std::task::Poll::Ready(permit) = poll_once(acquire) {
            return permit;
        }
        assert!(Instant::now() < deadline, "a waiter was never granted");
        std::thread::yield_now();
    }
}

/// What a thread of the race below does with its handle besides dropping it.
#[derive(Clone, Copy)]
enum Request {
    None,
    /// Queues a request, then drops it when the race starts.
    Cancelled,
    /// Queues a request, then polls it until granted and drops the permit.
    Awaited,
}

#[test]
fn the_last_handle_and_the_last_permits_racing_free_the_semaphore_exactly_once() {
    const CAPACITY: usize = 3;
    const ROUNDS: usize = 2000;

    // Each round, released by one barrier: a thread drops a handle, two drop a permit each, and
    // two, each with a handle and a request queued behind those permits, cancel their request or
    // take it. Whoever goes last frees the semaphore's state. Every other round the test keeps a
    // handle too, and checks that every permit came back. Each thread counts the bytes it
    // allocates and frees, so the sum over a round is zero when the state was freed (a second
    // free would make it negative, if the allocator did not abort first).
    finishes_within(Duration::from_secs(120), || {
        for round in 0..ROUNDS {
            let start = live_bytes();
            let semaphore = Semaphore::new(CAPACITY);
            let one = semaphore.try_acquire(1).unwrap();
            let two = ready(poll_once(&mut semaphore.acquire(2)));
            let [first, second] = [semaphore.clone(), semaphore.clone()];
            let kept = (round % 2 == 0).then(|| semaphore.clone());
            let barrier = Barrier::new(5);
            let requests = match round % 8 / 2 {
                0 => [Request::None, Request::None],
                1 => [Request::Cancelled, Request::Cancelled],
                2 => [Request::Awaited, Request::Awaited],
                _ => [Request::Cancelled, Request::Awaited],
            };
            let setup = live_bytes() - start;

            let threads: isize = std::thread::scope(|scope| {
                let barrier = &barrier;
                let mut counted = Vec::new();
                counted.push(scope.spawn(move || {
                    let start = live_bytes();
                    barrier.wait();
                    drop(semaphore);
                    live_bytes() - start
                }));
                for permit in [one, two] {
                    counted.push(scope.spawn(move || {
                        let start = live_bytes();
                        barrier.wait();
                        drop(permit);
                        live_bytes() - start
                    }));
                }
                // Requests of 2 and 1 permits, queued in whichever order their threads start.
                for ((handle, request), wants) in
                    [first, second].into_iter().zip(requests).zip([2, 1])
                {
                    counted.push(scope.spawn(move || {
                        let start = live_bytes();
                        let mut acquire = handle.acquire(wants);
                        if !matches!(request, Request::None) {
                            assert!(poll_once(&mut acquire).is_pending(), "nothing is free yet");
                        }
                        barrier.wait();
                        if let Request::Awaited = request {
                            drop(spin_until_granted(&mut acquire));
                        }
                        // Cancelled while permits come back: still queued, or granted unseen.
                        drop(acquire);
                        drop(handle);
                        live_bytes() - start
                    }));
                }
                counted.into_iter().map(|t| t.join().unwrap()).sum()
            });

            let end = live_bytes();
            if let Some(kept) = kept {
                assert_eq!(
                    kept.available(),
                    CAPACITY,
                    "round {round}: permits went missing"
                );
                let all = kept.try_acquire(CAPACITY);
                assert!(all.is_some(), "round {round}: the queue flag was left up");
                drop((all, kept));
            }
            let freed = live_bytes() - end;
            assert_eq!(
                setup + threads + freed,
                0,
                "round {round}: the semaphore's state was not freed"
            );
        }
    });
}
