//! The fair (strictly FIFO) semaphore.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{on_every_executor, poll_once, yield_now, Log, GENEROUS};
use futures::executor::block_on;
use futures::future;
use leasehold::{ExitStatus, Permit, Scope, Semaphore};

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
