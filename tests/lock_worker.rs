//! The storage worker's ordering and cost, pinned down where the interleavings are narrow.
//!
//! To make a command meet another in one batch, these tests hold SQLite's write lock from a
//! connection of their own: the worker then stalls in `BEGIN IMMEDIATE` on an earlier command,
//! and whatever is sent meanwhile reaches it together.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    bounded, join_within, rows_of, temp_db, within, within_blocking, WriteLock, GENEROUS,
};
use futures::executor::block_on;
use leasehold::{
    fork_daemon, AbortController, AbortReason, Clock, LockError, LockManager, LockRequest,
    Schedule, SystemClock, TestClock,
};

/// Starts a write on `locks` that stalls in `BEGIN IMMEDIATE` while a `WriteLock` is held, and
/// returns once the worker waits there (`StorageStats::lock_waits`): it took the write off its
/// queue alone, so whatever is sent next reaches it together, in a later batch.
async fn stall_worker(
    locks: &LockManager,
) -> leasehold::Fiber<Result<Option<leasehold::Guard>, LockError>> {
    let before = locks.stats().lock_waits;
    let blocker = fork_daemon({
        let locks = locks.clone();
        async move {
            locks
                .try_acquire(LockRequest::exclusive("blocker", "blocker"))
                .await
        }
    });
    within(GENEROUS, "the worker waits for the write lock", || async {
        locks.stats().lock_waits > before
    })
    .await;
    blocker
}

/// A write that finds another connection's write lock and waits for it counts one lock wait,
/// however many times SQLite tries again while it waits; a write that finds the file free counts
/// none.
#[test]
fn a_write_behind_another_connections_write_lock_counts_one_lock_wait() {
    block_on(async {
        let (_dir, path) = temp_db();
        let locks = LockManager::open(&path).unwrap();
        let free = locks.exclusive("free", "uncontended").await.unwrap();
        free.release().await.unwrap();
        assert_eq!(locks.stats().lock_waits, 0, "nobody else held the file");

        let write_lock = WriteLock::take(&path);
        let held_up = fork_daemon({
            let locks = locks.clone();
            async move { locks.exclusive("k", "held up").await }
        });
        within(GENEROUS, "the write waits for the lock", || async {
            locks.stats().lock_waits > 0
        })
        .await;
        // Held on a while: SQLite calls the busy handler again and again meanwhile, and none of
        // those calls may count. (However short the pause, the count below must hold.)
        SystemClock.sleep(Duration::from_millis(50)).await;
        assert!(!held_up.is_finished(), "written past the write lock");
        drop(write_lock);

        let guard = join_within(GENEROUS, "the held-up acquisition", held_up)
            .await
            .success()
            .unwrap()
            .unwrap();
        guard.release().await.unwrap();
        assert_eq!(locks.stats().lock_waits, 1, "one wait");
    });
}

#[test]
fn an_interruption_that_reaches_the_worker_with_its_acquire_leaves_no_row() {
    block_on(async {
        let (_dir, path) = temp_db();
        let locks = LockManager::open(&path).unwrap();
        for attempt in 0..3 {
            let operation = format!("interrupted-{attempt}");
            let write_lock = WriteLock::take(&path);
            let blocker = stall_worker(&locks).await;

            let stop = AbortController::new();
            let reason = AbortReason::from("stop");
            let mut acquisition =
                Box::pin(locks.exclusive("k", &operation).with_signal(&stop.signal()));
            // The first poll sends the acquisition to the worker, the second its removal.
            assert!(futures::poll!(acquisition.as_mut()).is_pending());
            stop.abort(reason.clone());
            assert!(futures::poll!(acquisition.as_mut()).is_pending());
            drop(write_lock);

            let error = bounded(
                Duration::from_secs(10),
                "the interrupted acquisition",
                acquisition,
            )
            .await
            .unwrap_err();
            assert!(error.abort_reason().unwrap().ptr_eq(&reason), "{error}");
            assert!(
                rows_of(&locks, &operation).await.is_empty(),
                "attempt {attempt}: the interrupted request left {:?}",
                rows_of(&locks, &operation).await
            );
            let blocker = join_within(Duration::from_secs(10), "the blocker", blocker).await;
            drop(blocker);
            // Nothing blocks the key: a later exclusive request is granted at once.
            let probe = locks
                .try_acquire(LockRequest::exclusive("k", "probe"))
                .await
                .unwrap();
            assert!(probe.is_some(), "attempt {attempt}: the key is still taken");
        }
    });
}

#[test]
fn an_acquisition_sent_right_after_shutdown_leaves_no_row() {
    block_on(async {
        let (_dir, path) = temp_db();
        let locks = LockManager::open(&path).unwrap();
        let observer = LockManager::open(&path).unwrap();
        let write_lock = WriteLock::take(&path);
        let blocker = stall_worker(&locks).await;

        let mut shutdown = Box::pin(locks.shutdown());
        assert!(futures::poll!(shutdown.as_mut()).is_pending());
        let mut late = Box::pin(locks.exclusive("k", "late"));
        assert!(futures::poll!(late.as_mut()).is_pending());
        drop(write_lock);

        bounded(Duration::from_secs(10), "shutdown", shutdown)
            .await
            .unwrap();
        let late = bounded(Duration::from_secs(10), "the late acquisition", late).await;
        assert!(
            observer.inspect(None).await.unwrap().is_empty(),
            "after shutdown: {:?} (the late acquisition returned {late:?})",
            observer.inspect(None).await.unwrap()
        );
        assert!(matches!(late, Err(LockError::Shutdown)), "{late:?}");
        drop(join_within(Duration::from_secs(10), "the blocker", blocker).await);
    });
}

#[test]
fn a_guard_granted_in_the_batch_that_shuts_down_is_told_it_is_lost() {
    block_on(async {
        let (_dir, path) = temp_db();
        let locks = LockManager::open(&path).unwrap();
        let observer = LockManager::open(&path).unwrap();
        let write_lock = WriteLock::take(&path);
        let blocker = stall_worker(&locks).await;

        let mut early = Box::pin(locks.exclusive("k", "early"));
        assert!(futures::poll!(early.as_mut()).is_pending());
        let mut shutdown = Box::pin(locks.shutdown());
        assert!(futures::poll!(shutdown.as_mut()).is_pending());
        drop(write_lock);

        bounded(Duration::from_secs(10), "shutdown", shutdown)
            .await
            .unwrap();
        // Granted, then deleted by the shutdown in the same transaction: whoever holds the guard
        // must learn that it protects nothing.
        match bounded(Duration::from_secs(10), "the early acquisition", early).await {
            Ok(guard) => assert!(guard.lost().is_aborted(), "{guard:?}"),
            Err(error) => assert!(matches!(error, LockError::Shutdown), "{error}"),
        }
        assert!(observer.inspect(None).await.unwrap().is_empty());
        drop(join_within(Duration::from_secs(10), "the blocker", blocker).await);
    });
}

#[test]
fn waiting_manys_cost_no_write_transactions_even_beside_a_sibling() {
    block_on(async {
        let (_dir, path) = temp_db();
        // Two owners of one process, each with a `many` waiting on the same held key: neither
        // may retry, or wake the other, while nothing changes.
        let holder = LockManager::open(&path).unwrap();
        let owners = [
            LockManager::open(&path).unwrap(),
            LockManager::open(&path).unwrap(),
        ];
        let mirror = holder.exclusive("mirror", "prune").await.unwrap();
        let copies: Vec<_> = owners
            .iter()
            .enumerate()
            .map(|(n, locks)| {
                let locks = locks.clone();
                fork_daemon(async move {
                    locks
                        .many([
                            LockRequest::shared("source", format!("copy{n}")),
                            LockRequest::shared("mirror", format!("copy{n}")),
                        ])
                        .await
                })
            })
            .collect();
        // A refused attempt is decided by a read (no write transaction); once it is waiting, the
        // owner's worker starts looking for changes.
        within(
            Duration::from_secs(5),
            "each made its first attempt and waits",
            || async { owners.iter().all(|o| o.stats().change_checks >= 1) },
        )
        .await;
        // Settle, then measure a quiet window: a failed attempt must not wake anyone.
        smol::Timer::after(Duration::from_millis(20)).await;
        let before: Vec<u64> = owners
            .iter()
            .map(|o| o.stats().write_transactions)
            .collect();
        smol::Timer::after(Duration::from_millis(200)).await;
        for (owner, before) in owners.iter().zip(before) {
            let spent = owner.stats().write_transactions - before;
            assert!(
                spent <= 2,
                "{spent} write transactions in 200 ms while waiting with nothing changing"
            );
        }

        mirror.release().await.unwrap();
        for copy in copies {
            let both = join_within(Duration::from_secs(5), "a copy", copy)
                .await
                .success()
                .unwrap()
                .unwrap();
            assert_eq!(both.requests().len(), 2);
        }
    });
}

/// A call alone in awaiting the worker yields to its executor for a moment, as its reply is
/// usually one transaction away; but when the reply is held up (here by another connection's
/// write lock) it stops within a moment and waits to be woken, leaving the thread to park.
#[test]
fn a_call_whose_reply_is_held_up_stops_yielding_and_is_woken_by_the_reply() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    use std::time::Instant;

    let (_dir, path) = temp_db();
    let locks = LockManager::open(&path).unwrap();
    let write_lock = WriteLock::take(&path);
    let counter = std::sync::Arc::new(common::CountingWaker::default());
    let waker = Waker::from(counter.clone());
    let mut cx = Context::from_waker(&waker);
    let mut acquire = Box::pin(locks.try_acquire(LockRequest::exclusive("k", "held up")));

    // Poll again whenever the future woke itself, as an executor would.
    let started = Instant::now();
    let mut yields = 0;
    loop {
        let before = counter.count();
        assert!(
            acquire.as_mut().poll(&mut cx).is_pending(),
            "granted while another connection held the write lock"
        );
        if counter.count() == before {
            break;
        }
        yields += 1;
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "still yielding after 5 s"
        );
    }
    if std::thread::available_parallelism().is_ok_and(|n| n.get() > 1) {
        assert!(
            yields > 0,
            "never yielded while alone in awaiting the worker"
        );
    }

    let parked = counter.count();
    drop(write_lock);
    within_blocking(Duration::from_secs(10), "the reply woke the caller", || {
        counter.count() != parked
    });
    let mut reply = None;
    within_blocking(Duration::from_secs(10), "a reply after the wake-up", || {
        reply = match acquire.as_mut().poll(&mut cx) {
            Poll::Ready(result) => Some(result.unwrap().expect("the key is free")),
            Poll::Pending => None,
        };
        reply.is_some()
    });
    block_on(reply.expect("a reply").release()).unwrap();
}

/// Two round trips to the worker: whatever it was due to do at the clock's time when this was
/// called (a look for changes included) is done when it returns.
async fn settle(locks: &LockManager) {
    for _ in 0..2 {
        locks.is_locked("k").await.unwrap();
    }
}

#[test]
fn the_change_poll_follows_its_schedule_on_the_managers_clock() {
    block_on(async {
        let (_dir, path) = temp_db();
        let clock = TestClock::new();
        // Looks 100, 200, 400, 800 ms apart, where the default would look every 10 ms.
        let locks = LockManager::builder()
            .clock(Arc::new(clock.clone()))
            .poll_schedule(Schedule::exponential(Duration::from_millis(100), 2.0))
            .open(&path)
            .unwrap();
        let holder = locks.exclusive("k", "holder").await.unwrap();
        let waiter = {
            let locks = locks.clone();
            fork_daemon(async move { locks.exclusive("k", "waiter").await })
        };
        within(Duration::from_secs(5), "the waiter queued", || async {
            locks.inspect(Some("k")).await.unwrap().len() == 2
        })
        .await;
        // The first look comes one delay after the manager started (it had not looked yet).
        settle(&locks).await;
        for delay in [100, 200, 400, 800] {
            let checks = locks.stats().change_checks;
            clock.advance(Duration::from_millis(delay - 1));
            settle(&locks).await;
            assert_eq!(
                locks.stats().change_checks,
                checks,
                "no look within {delay} ms"
            );
            clock.advance(Duration::from_millis(1));
            within(
                Duration::from_secs(5),
                "a look once the delay has passed",
                || async { locks.stats().change_checks > checks },
            )
            .await;
            settle(&locks).await;
            assert_eq!(locks.stats().change_checks, checks + 1, "one look");
        }
        holder.release().await.unwrap();
        let granted = join_within(Duration::from_secs(5), "the waiter is granted", waiter).await;
        granted.success().unwrap().unwrap().release().await.unwrap();
    });
}

#[test]
fn a_busy_database_is_reported_once_the_busy_schedule_is_done() {
    block_on(async {
        let (_dir, path) = temp_db();
        // No try after the first refusal (the default goes on for 60 s).
        let locks = LockManager::builder()
            .busy_schedule(Schedule::recurs(0))
            .open(&path)
            .unwrap();
        let _write_lock = WriteLock::take(&path);
        // SQLite's own busy handler waits 5 s inside the one try.
        let refused = bounded(
            Duration::from_secs(30),
            "the busy database is reported",
            locks.try_acquire(LockRequest::exclusive("k", "busy")),
        )
        .await;
        assert!(matches!(refused, Err(LockError::Storage(_))), "{refused:?}");
    });
}

/// A `TestClock` that gives no boot time: leases are judged by its wall time.
struct WallOnly(TestClock);

impl Clock for WallOnly {
    fn now(&self) -> Duration {
        self.0.now()
    }
    fn monotonic(&self) -> Duration {
        self.0.monotonic()
    }
    fn sleep(&self, duration: Duration) -> futures::future::BoxFuture<'static, ()> {
        self.0.sleep(duration)
    }
}

/// A clock set absurdly far ahead (about 292,000 years) gives a clear error, not an overflow in
/// the storage thread (which once panicked, after which every call said `Shutdown`); set back,
/// the manager works on. (A wall clock: a boot clock that far on cannot be set back.)
#[test]
fn a_clock_past_the_last_keepable_time_is_an_error_and_the_manager_lives_on() {
    block_on(async {
        let clock = TestClock::new();
        let sane = clock.now();
        clock.set_wall_time(Duration::from_micros(i64::MAX as u64));
        let locks = LockManager::builder()
            .clock(Arc::new(WallOnly(clock.clone())))
            .open_in_memory()
            .unwrap();
        match locks.exclusive("k", "far future").await {
            Err(LockError::Storage(why)) => assert!(why.to_string().contains("clock"), "{why}"),
            other => panic!(
                "expected a storage error, got {:?}",
                other.map(|g| g.fencing_token())
            ),
        }
        clock.set_wall_time(sane);
        let guard = locks.exclusive("k", "back to now").await.unwrap();
        guard.release().await.unwrap();
    });
}

/// Each try after a refusal is a real try: with one try allowed after the first, a write lock
/// held for 7 s (past the first try's 5 s inside SQLite) is waited out by the second.
#[test]
fn each_try_of_the_busy_schedule_asks_the_database_again() {
    block_on(async {
        let (_dir, path) = temp_db();
        let locks = LockManager::builder()
            .busy_schedule(Schedule::recurs(1))
            .open(&path)
            .unwrap();
        let (taken, is_taken) = std::sync::mpsc::channel();
        let holder = {
            let path = path.clone();
            std::thread::spawn(move || {
                let _write_lock = WriteLock::take(&path);
                taken.send(()).unwrap();
                std::thread::sleep(Duration::from_secs(7));
            })
        };
        is_taken.recv().unwrap();
        let acquired = bounded(
            Duration::from_secs(30),
            "the acquisition after the busy moment",
            locks.try_acquire(LockRequest::exclusive("k", "after a busy moment")),
        )
        .await;
        holder.join().unwrap();
        let guard = acquired.unwrap().expect("nobody holds k");
        guard.release().await.unwrap();
    });
}

/// Each renewal renews every row of its owner, so renewals asked for together (the beats of
/// many waiters, due at one moment) are one write, whose time every one of them is told.
#[test]
fn renewals_asked_for_together_are_one_write() {
    block_on(async {
        let (_dir, path) = temp_db();
        let clock = TestClock::new();
        let open = || {
            LockManager::builder()
                .clock(Arc::new(clock.clone()))
                .lease(Duration::from_secs(3))
                .heartbeat(Duration::from_secs(1))
                .open(&path)
                .unwrap()
        };
        let (holder, locks) = (open(), open());
        let mut held = Vec::new();
        let mut waiters = Vec::new();
        for i in 0..20 {
            held.push(holder.exclusive(format!("k{i}"), "holder").await.unwrap());
            let locks = locks.clone();
            waiters.push(fork_daemon(async move {
                locks.exclusive(format!("k{i}"), "waiter").await
            }));
        }
        within(Duration::from_secs(5), "every waiter queued", || async {
            locks
                .inspect(None)
                .await
                .unwrap()
                .iter()
                .filter(|e| e.operation == "waiter")
                .count()
                == 20
        })
        .await;
        // The waiters' heartbeats (forked a quarter of a heartbeat into their wait), and the
        // holder's.
        clock.advance(Duration::from_millis(250));
        within(Duration::from_secs(5), "every heartbeat asleep", || async {
            clock.sleepers() >= 21
        })
        .await;
        let before = locks.stats().heartbeats;
        let write_lock = WriteLock::take(&path);
        let blocker = stall_worker(&locks).await;
        clock.advance(Duration::from_secs(1));
        within(Duration::from_secs(5), "every heartbeat woke", || async {
            clock.sleepers() == 0
        })
        .await;
        drop(write_lock);
        drop(join_within(Duration::from_secs(10), "the blocker", blocker).await);
        within(Duration::from_secs(5), "the waiters renewed", || async {
            clock.sleepers() >= 21
        })
        .await;
        assert_eq!(locks.stats().heartbeats, before + 1, "one renewal for all");
        for guard in held {
            guard.release().await.unwrap();
        }
        for waiter in waiters {
            let guard = join_within(Duration::from_secs(5), "a waiter", waiter).await;
            guard.success().unwrap().unwrap().release().await.unwrap();
        }
    });
}
