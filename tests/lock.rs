//! The lock manager's conformance cases (API.md), one test each, plus the manager's own
//! behaviours: validation, fencing, inspection, leases, shutdown. Each runs under every executor
//! the library promises to work under (`common::on_every_executor`): the storage worker's
//! replies, and where background work runs, depend on it.

mod common;
mod stores;

use common::{join_within, within};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{
    fork_daemon, AbortController, AbortReason, EntryState, Exit, Fiber, Guard, LeaseLost,
    LockEntry, LockError, LockManager, LockRequest, Mode,
};

/// The entries of `key`, as (operation, state) pairs in ticket order.
async fn queue(locks: &LockManager, key: &str) -> Vec<(String, EntryState)> {
    locks
        .inspect(Some(key))
        .await
        .expect("inspect")
        .into_iter()
        .map(|e: LockEntry| (e.operation, e.state))
        .collect()
}

fn held(op: &str) -> (String, EntryState) {
    (op.to_owned(), EntryState::Held)
}

fn waiting(op: &str, position: usize) -> (String, EntryState) {
    (op.to_owned(), EntryState::Waiting { position })
}

/// A log of grants, in the order they happened.
#[derive(Clone, Default)]
struct Grants(Arc<Mutex<Vec<String>>>);

impl Grants {
    fn names(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// Starts an acquisition in the background; it logs its operation when granted and keeps the
/// guard until the returned fiber is joined.
fn contend(
    locks: &LockManager,
    request: LockRequest,
    grants: &Grants,
    signal: Option<&leasehold::AbortSignal>,
) -> Fiber<Result<Guard, LockError>> {
    let mut acquisition = locks.acquire(request.clone());
    if let Some(signal) = signal {
        acquisition = acquisition.with_signal(signal);
    }
    let grants = grants.clone();
    fork_daemon(async move {
        let guard = acquisition.await?;
        grants
            .0
            .lock()
            .unwrap()
            .push(guard.requests()[0].operation.clone());
        Ok(guard)
    })
}

async fn guard_of(fiber: Fiber<Result<Guard, LockError>>) -> Guard {
    match fiber.join().await {
        Exit::Success(Ok(guard)) => guard,
        other => panic!("expected a guard, got {other:?}"),
    }
}

#[test]
fn case_01_shared_waits_behind_a_queued_exclusive() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let grants = Grants::default();
        let s1 = locks.shared("k", "S1").await.unwrap();
        let x = contend(&locks, LockRequest::exclusive("k", "X"), &grants, None);
        within(Duration::from_secs(5), "X queued", || async {
            queue(&locks, "k").await.len() == 2
        })
        .await;
        let s2 = contend(&locks, LockRequest::shared("k", "S2"), &grants, None);
        within(Duration::from_secs(5), "S2 queued", || async {
            queue(&locks, "k").await == vec![held("S1"), waiting("X", 0), waiting("S2", 1)]
        })
        .await;

        s1.release().await.unwrap();
        let x = guard_of(x).await;
        assert_eq!(queue(&locks, "k").await, vec![held("X"), waiting("S2", 0)]);
        x.release().await.unwrap();
        let s2 = guard_of(s2).await;
        assert_eq!(grants.names(), ["X", "S2"]);
        assert!(s2.fencing_token() > 0);
    });
}

#[test]
fn case_02_interrupting_a_queued_exclusive_lets_the_shared_behind_it_through() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let grants = Grants::default();
        let holder = locks.exclusive("k", "H").await.unwrap();
        let stop = AbortController::new();
        let x = contend(
            &locks,
            LockRequest::exclusive("k", "X"),
            &grants,
            Some(&stop.signal()),
        );
        within(Duration::from_secs(5), "X queued", || async {
            queue(&locks, "k").await.len() == 2
        })
        .await;
        let s = contend(&locks, LockRequest::shared("k", "S"), &grants, None);
        within(Duration::from_secs(5), "S queued", || async {
            queue(&locks, "k").await.len() == 3
        })
        .await;

        stop.abort("not needed");
        assert!(matches!(
            x.join().await,
            Exit::Success(Err(LockError::Interrupted(_)))
        ));
        assert_eq!(queue(&locks, "k").await, vec![held("H"), waiting("S", 0)]);
        holder.release().await.unwrap();
        let s = guard_of(s).await;
        assert_eq!(s.requests()[0].mode, Mode::Shared);
        assert_eq!(grants.names(), ["S"]);
    });
}

#[test]
fn case_03_the_third_exclusive_is_granted_when_the_first_two_are_interrupted() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let grants = Grants::default();
        let holder = locks.exclusive("k", "H").await.unwrap();
        let stops = [AbortController::new(), AbortController::new()];
        let x1 = contend(
            &locks,
            LockRequest::exclusive("k", "X1"),
            &grants,
            Some(&stops[0].signal()),
        );
        let x2 = contend(
            &locks,
            LockRequest::exclusive("k", "X2"),
            &grants,
            Some(&stops[1].signal()),
        );
        within(Duration::from_secs(5), "X1, X2 queued", || async {
            queue(&locks, "k").await.len() == 3
        })
        .await;
        let x3 = contend(&locks, LockRequest::exclusive("k", "X3"), &grants, None);
        within(Duration::from_secs(5), "X3 queued", || async {
            queue(&locks, "k").await.len() == 4
        })
        .await;

        stops[0].abort("first");
        stops[1].abort("second");
        assert!(x1.join().await.success().unwrap().is_err());
        assert!(x2.join().await.success().unwrap().is_err());
        holder.release().await.unwrap();
        let x3 = guard_of(x3).await;
        assert_eq!(queue(&locks, "k").await, vec![held("X3")]);
        assert_eq!(grants.names(), ["X3"]);
        drop(x3);
    });
}

#[test]
fn case_04_interrupting_a_queued_request_never_releases_anyone_else() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let grants = Grants::default();
        let s1 = locks.shared("k", "S1").await.unwrap();
        let stop = AbortController::new();
        let x = contend(
            &locks,
            LockRequest::exclusive("k", "X"),
            &grants,
            Some(&stop.signal()),
        );
        within(Duration::from_secs(5), "X queued", || async {
            queue(&locks, "k").await.len() == 2
        })
        .await;
        stop.abort("give up");
        assert!(x.join().await.success().unwrap().is_err());
        assert_eq!(queue(&locks, "k").await, vec![held("S1")]);
        assert!(locks.is_locked("k").await.unwrap());
        assert!(!s1.lost().is_aborted());
        // The holder's lock still excludes writers.
        assert!(locks
            .try_acquire(LockRequest::exclusive("k", "probe"))
            .await
            .unwrap()
            .is_none());
        s1.release().await.unwrap();
    });
}

#[test]
fn case_05_an_interrupted_request_returns_the_callers_reason_with_no_trace_left() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let holder = locks.exclusive("k", "H").await.unwrap();
        let stop = AbortController::new();
        let reason = AbortReason::from("user cancelled the backup");
        let waiter = {
            let locks = locks.clone();
            let signal = stop.signal();
            fork_daemon(async move { locks.shared("k", "backup").with_signal(&signal).await })
        };
        within(Duration::from_secs(5), "backup queued", || async {
            queue(&locks, "k").await.len() == 2
        })
        .await;
        stop.abort(reason.clone());
        let error = waiter.join().await.success().unwrap().unwrap_err();
        assert!(error.abort_reason().unwrap().ptr_eq(&reason));
        // By the time it returned, its row was gone.
        assert_eq!(queue(&locks, "k").await, vec![held("H")]);
        drop(holder);
    });
}

#[test]
fn case_06_shared_locks_are_held_together_and_exclusive_waits_for_all() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let grants = Grants::default();
        let a = locks.shared("k", "A").await.unwrap();
        let b = locks.shared("k", "B").await.unwrap();
        let c = locks.shared("k", "C").await.unwrap();
        assert_eq!(
            queue(&locks, "k").await,
            vec![held("A"), held("B"), held("C")]
        );
        let x = contend(&locks, LockRequest::exclusive("k", "X"), &grants, None);
        within(Duration::from_secs(5), "X queued", || async {
            queue(&locks, "k").await.len() == 4
        })
        .await;
        a.release().await.unwrap();
        c.release().await.unwrap();
        assert_eq!(queue(&locks, "k").await, vec![held("B"), waiting("X", 0)]);
        assert!(!x.is_finished());
        b.release().await.unwrap();
        guard_of(x).await.release().await.unwrap();
        assert_eq!(grants.names(), ["X"]);
    });
}

#[test]
fn case_07_while_exclusive_is_held_later_requests_are_granted_in_arrival_order() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let grants = Grants::default();
        let holder = locks.exclusive("k", "H").await.unwrap();
        let order = [
            LockRequest::exclusive("k", "X1"),
            LockRequest::shared("k", "S2"),
            LockRequest::exclusive("k", "X3"),
            LockRequest::exclusive("k", "X4"),
            LockRequest::shared("k", "S5"),
        ];
        let mut fibers = Vec::new();
        for (queued, request) in order.iter().enumerate() {
            fibers.push(contend(&locks, request.clone(), &grants, None));
            within(Duration::from_secs(5), "queued in turn", || async {
                queue(&locks, "k").await.len() == queued + 2
            })
            .await;
        }
        holder.release().await.unwrap();
        for fiber in fibers {
            guard_of(fiber).await.release().await.unwrap();
        }
        assert_eq!(grants.names(), ["X1", "S2", "X3", "X4", "S5"]);
    });
}

#[test]
fn case_08_releasing_exclusive_grants_the_leading_shared_run_together() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let grants = Grants::default();
        let holder = locks.exclusive("k", "H").await.unwrap();
        let mut fibers = Vec::new();
        for (queued, request) in [
            LockRequest::shared("k", "S1"),
            LockRequest::shared("k", "S2"),
            LockRequest::shared("k", "S3"),
            LockRequest::exclusive("k", "X"),
            LockRequest::shared("k", "S4"),
        ]
        .into_iter()
        .enumerate()
        {
            fibers.push(contend(&locks, request, &grants, None));
            within(Duration::from_secs(5), "queued in turn", || async {
                queue(&locks, "k").await.len() == queued + 2
            })
            .await;
        }
        holder.release().await.unwrap();
        let mut fibers = fibers.into_iter();
        let shared: Vec<Guard> =
            futures::future::join_all(fibers.by_ref().take(3).map(guard_of)).await;
        assert_eq!(
            queue(&locks, "k").await,
            vec![
                held("S1"),
                held("S2"),
                held("S3"),
                waiting("X", 0),
                waiting("S4", 1)
            ]
        );
        drop(shared);
        for fiber in fibers {
            guard_of(fiber).await.release().await.unwrap();
        }
        assert_eq!(grants.names()[3..], ["X", "S4"]);
    });
}

#[test]
fn case_09_many_never_holds_part_of_its_set_and_leaves_nothing_when_interrupted() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let mirror = locks.exclusive("mirror", "prune").await.unwrap();
        let stop = AbortController::new();
        let copy = {
            let locks = locks.clone();
            let signal = stop.signal();
            fork_daemon(async move {
                locks
                    .many([
                        LockRequest::shared("source", "copy"),
                        LockRequest::exclusive("mirror", "copy"),
                    ])
                    .with_signal(&signal)
                    .await
            })
        };
        // However long it waits, it holds nothing of its set, and does not even queue.
        for _ in 0..20 {
            smol::Timer::after(Duration::from_millis(2)).await;
            assert!(!locks.is_locked("source").await.unwrap());
            assert_eq!(queue(&locks, "mirror").await, vec![held("prune")]);
        }
        // Others are not blocked by it.
        locks
            .exclusive("source", "check")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        stop.abort("cancelled");
        assert!(copy.join().await.success().unwrap().is_err());
        assert_eq!(locks.inspect(None).await.unwrap().len(), 1);

        // Without the interruption, it gets both at once when the mirror is released.
        let copy = {
            let locks = locks.clone();
            fork_daemon(async move {
                locks
                    .many([
                        LockRequest::shared("source", "copy"),
                        LockRequest::exclusive("mirror", "copy"),
                    ])
                    .await
            })
        };
        mirror.release().await.unwrap();
        let both = copy.join().await.success().unwrap().unwrap();
        let keys: Vec<_> = locks
            .inspect(None)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.key)
            .collect();
        assert_eq!(keys, ["mirror", "source"]);
        both.release().await.unwrap();
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn case_10_an_already_aborted_signal_runs_nothing_and_writes_nothing() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let before = locks.stats().write_transactions;
        let stop = AbortController::new();
        let reason = AbortReason::from("already over");
        stop.abort(reason.clone());
        for acquisition in [
            locks.exclusive("k", "X"),
            locks.many([LockRequest::shared("a", "S"), LockRequest::shared("b", "S")]),
            locks.many_queued([LockRequest::shared("a", "S")]),
        ] {
            let error = acquisition.with_signal(&stop.signal()).await.unwrap_err();
            assert!(error.abort_reason().unwrap().ptr_eq(&reason));
        }
        assert_eq!(locks.stats().write_transactions, before);
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn case_11_release_removes_only_the_callers_rows() {
    stores::on_every_store(|store| async move {
        let alice = store.open().await;
        let bob = store.open().await;
        let a = alice.shared("k", "alice").await.unwrap();
        let b = bob.shared("k", "bob").await.unwrap();
        let a2 = alice.shared("other", "alice").await.unwrap();
        a.release().await.unwrap();
        let left = bob.inspect(None).await.unwrap();
        assert_eq!(left.len(), 2);
        assert!(left
            .iter()
            .any(|e| e.owner == bob.owner_id() && e.key == "k"));
        assert!(left
            .iter()
            .any(|e| e.owner == alice.owner_id() && e.key == "other"));
        drop((b, a2));
    });
}

#[test]
fn case_12_a_waiter_in_this_process_is_woken_at_once_even_with_a_long_poll() {
    stores::on_every_store(|store| async move {
        let slow_poll = || store.open_with(LockManager::builder().poll(Duration::from_secs(30)));
        // Same manager, and a second manager (another owner) on the same database.
        let first = slow_poll().await;
        let second = slow_poll().await;
        // A waiter on one key, and one on two keys (which the release's own storage call may
        // leave to its owner to promote).
        let waiters = [
            vec![LockRequest::exclusive("k", "W")],
            vec![
                LockRequest::exclusive("k", "W"),
                LockRequest::shared("j", "W"),
            ],
        ];
        let mut cases = Vec::new();
        for side in [&first, &second] {
            cases.extend(waiters.iter().map(|requests| (side, requests.clone())));
        }
        for (waiter_side, requests) in cases {
            let holder = first.exclusive("k", "H").await.unwrap();
            let waiter = {
                let locks = waiter_side.clone();
                fork_daemon(async move { locks.many_queued(requests).await })
            };
            within(Duration::from_secs(5), "W queued", || async {
                queue(&first, "k").await.len() == 2
            })
            .await;
            let released = std::time::Instant::now();
            holder.release().await.unwrap();
            // Far sooner than the 30 s poll: only a wake-up can have done it.
            let guard = join_within(Duration::from_secs(10), "the waiter granted", waiter)
                .await
                .success()
                .unwrap()
                .unwrap();
            assert!(released.elapsed() < Duration::from_secs(10));
            guard.release().await.unwrap();
        }
    });
}

#[test]
fn invalid_requests_are_refused_before_anything_is_written() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let long = "x".repeat(leasehold::MAX_NAME_BYTES + 1);
        let cases: Vec<Vec<LockRequest>> = vec![
            vec![],
            vec![LockRequest::exclusive("", "op")],
            vec![LockRequest::exclusive("a\0b", "op")],
            vec![LockRequest::exclusive("k", "op\0")],
            vec![LockRequest::exclusive(long.clone(), "op")],
            vec![LockRequest::exclusive("k", long.clone())],
            vec![
                LockRequest::shared("k", "a"),
                LockRequest::exclusive("k", "b"),
            ],
        ];
        for requests in cases {
            for acquisition in [
                locks.many(requests.clone()),
                locks.many_queued(requests.clone()),
            ] {
                let error = acquisition.await.unwrap_err();
                assert!(
                    matches!(error, LockError::InvalidRequest(_)),
                    "{requests:?}: {error}"
                );
            }
        }
        assert_eq!(locks.stats().write_transactions, 0);
        let ok = "k".repeat(leasehold::MAX_NAME_BYTES);
        locks
            .exclusive(&ok, "")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    });
}

/// Names of the longest allowed length are kept whole in every kind of row (a holder's, a
/// waiter's on several keys, which also names all its keys) and through a promotion: such rows
/// are larger than a SQLite page, and spill into overflow pages.
#[test]
fn names_of_the_longest_allowed_length_survive_queueing_and_promotion() {
    stores::on_every_store(|store| async move {
        let name = |c: char| c.to_string().repeat(leasehold::MAX_NAME_BYTES);
        let keys = [name('a'), name('b'), name('c')];
        let holder = store.open().await;
        let waiter = store.open().await;
        let held = holder.exclusive(&keys[0], name('h')).await.unwrap();
        let queued = {
            let requests: Vec<LockRequest> = keys
                .iter()
                .map(|key| LockRequest::exclusive(key, name('w')))
                .collect();
            let waiter = waiter.clone();
            fork_daemon(async move { waiter.many_queued(requests).await })
        };
        let entries = || async { holder.inspect(None).await.unwrap() };
        within(
            Duration::from_secs(5),
            "the waiter queued on all three keys",
            || async { entries().await.len() == 4 },
        )
        .await;
        for entry in entries().await {
            assert!(keys.contains(&entry.key), "a key cut short");
            // The waiter is first in line on each of its keys.
            let (operation, state) = if entry.owner == holder.owner_id() {
                (name('h'), EntryState::Held)
            } else {
                (name('w'), EntryState::Waiting { position: 0 })
            };
            assert_eq!((entry.operation, entry.state), (operation, state));
        }
        held.release().await.unwrap();
        let granted = guard_of(queued).await;
        let granted_entries = entries().await;
        assert_eq!(granted_entries.len(), 3);
        for (entry, key) in granted_entries.iter().zip(&keys) {
            assert_eq!(&entry.key, key);
            assert_eq!(entry.operation, name('w'));
            assert_eq!(entry.state, EntryState::Held);
            assert_eq!(entry.ticket, granted.fencing_token());
        }
        granted.release().await.unwrap();
        assert!(entries().await.is_empty());
    });
}

#[test]
fn a_lease_shorter_than_two_heartbeats_or_a_heartbeat_under_a_millisecond_is_refused() {
    let error = LockManager::builder()
        .lease(Duration::from_secs(9))
        .heartbeat(Duration::from_secs(5))
        .open_in_memory()
        .unwrap_err();
    assert!(matches!(error, LockError::InvalidConfig(_)), "{error}");
    assert!(LockManager::builder()
        .lease(Duration::from_secs(10))
        .heartbeat(Duration::from_secs(5))
        .open_in_memory()
        .is_ok());
    for zero in [
        LockManager::builder().heartbeat(Duration::ZERO),
        // Below a millisecond: rows would be born expired (leases are kept in microseconds).
        LockManager::builder()
            .lease(Duration::from_nanos(999))
            .heartbeat(Duration::from_nanos(400)),
        LockManager::builder()
            .lease(Duration::from_micros(1_998))
            .heartbeat(Duration::from_micros(999)),
        LockManager::builder().poll(Duration::ZERO),
        // A poll that would never look, or look without pause.
        LockManager::builder().poll_schedule(leasehold::Schedule::recurs(0)),
        LockManager::builder().poll_schedule(leasehold::Schedule::recurs(5)),
    ] {
        assert!(matches!(
            zero.open_in_memory(),
            Err(LockError::InvalidConfig(_))
        ));
    }
}

/// A path that names no file other processes could open is refused, not opened as a private
/// database: two managers "sharing" it would never see each other's locks.
#[test]
fn a_path_that_names_no_shared_file_is_refused() {
    for path in ["", ":memory:"] {
        let error = LockManager::open(path).unwrap_err();
        assert!(
            matches!(error, LockError::InvalidConfig(_)),
            "{path:?}: {error}"
        );
        assert!(error.to_string().contains("open_in_memory"), "{error}");
    }
}

#[test]
fn fencing_tokens_increase_across_keys_and_owners() {
    // On SQLite only: on PostgreSQL they increase in grant order on each key.
    common::on_every_executor(|| async {
        let store = stores::Store::sqlite();
        let a = store.open().await;
        let b = store.open().await;
        let mut last = 0;
        for round in 0..10 {
            let locks = if round % 2 == 0 { &a } else { &b };
            let key = format!("key{}", round % 3);
            let guard = locks.exclusive(&key, "write").await.unwrap();
            assert!(guard.fencing_token() > last);
            last = guard.fencing_token();
            guard.release().await.unwrap();
        }
    });
}

/// A SQLite manager remembers the rows its own transactions read and wrote, and the ticket
/// sequence, while no other connection commits: each of its transactions must notice when
/// another one did, whether that took a key it knew free, freed a key it knew held, or took
/// tickets.
#[test]
fn a_manager_decides_on_what_others_committed_since_its_own_last_transaction() {
    common::on_every_executor(|| async {
        let store = stores::Store::sqlite();
        let a = store.open().await;
        let b = store.open().await;
        // A knows "k" free, and the sequence's last ticket.
        let first = a.exclusive("k", "first").await.unwrap();
        let first_token = first.fencing_token();
        first.release().await.unwrap();
        // B takes "k", with a later ticket.
        let holder = b.exclusive("k", "holder").await.unwrap();
        assert!(holder.fencing_token() > first_token);
        // A queues behind B's row, not granted by its memory of a free key.
        let waiter = {
            let a = a.clone();
            fork_daemon(async move { a.exclusive("k", "waiter").await })
        };
        within(Duration::from_secs(5), "A queued behind B", || async {
            queue(&a, "k").await == vec![held("holder"), waiting("waiter", 0)]
        })
        .await;
        // Its ticket comes after B's, not after A's own last one.
        let entries = a.inspect(Some("k")).await.unwrap();
        assert!(entries[1].ticket > holder.fencing_token());
        holder.release().await.unwrap();
        let granted = waiter.join().await.success().unwrap().unwrap();
        assert_eq!(granted.fencing_token(), entries[1].ticket);
        // B now holds "j"; A, which never read "j", is refused it, then B's release (which A's
        // memory of "k" does not cover) and A's own acquisitions go on in ticket order.
        let other = b.exclusive("j", "other").await.unwrap();
        assert!(a
            .try_acquire(LockRequest::exclusive("j", "late"))
            .await
            .unwrap()
            .is_none());
        let token = other.fencing_token();
        other.release().await.unwrap();
        granted.release().await.unwrap();
        // Another connection deletes a row A knows of (as an operator clearing a stuck lock
        // would): A is granted the key at once, not refused by its memory of its own row.
        let mine = a.exclusive("k", "mine").await.unwrap();
        let path = store.sqlite_path().unwrap().to_owned();
        sqlite::open(&path)
            .unwrap()
            .execute("DELETE FROM locks WHERE operation = 'mine'")
            .unwrap();
        let again = a
            .try_acquire(LockRequest::exclusive("k", "again"))
            .await
            .unwrap()
            .expect("granted: the row A knew of is gone");
        assert!(again.fencing_token() > token);
        assert_eq!(queue(&a, "k").await, vec![held("again")]);
        again.release().await.unwrap();
        drop(mine);
    });
}

/// A waiter's heartbeat starts a quarter of a heartbeat into its wait, from the storage thread,
/// on the waiting acquisition's executor: a wait of several heartbeats keeps its row renewed and
/// its place (its ticket), with the lease at its smallest allowed (twice the heartbeat), on
/// every executor and both backends.
#[test]
fn a_long_wait_keeps_its_row_and_its_place_at_the_smallest_lease() {
    stores::on_every_store(|store| async move {
        let lease = Duration::from_millis(600);
        let builder = || LockManager::builder().lease(lease).heartbeat(lease / 2);
        let holder = store.open_with(builder()).await;
        let locks = store.open_with(builder()).await;
        let held_lock = holder.exclusive("k", "holder").await.unwrap();
        let waiter = {
            let locks = locks.clone();
            fork_daemon(async move { locks.exclusive("k", "waiter").await })
        };
        within(Duration::from_secs(5), "queued", || async {
            queue(&locks, "k").await == vec![held("holder"), waiting("waiter", 0)]
        })
        .await;
        let row = |entries: Vec<LockEntry>| entries.into_iter().find(|e| e.operation == "waiter");
        let first = row(locks.inspect(Some("k")).await.unwrap()).unwrap();
        // Past its first lease only if renewed, more than once.
        within(
            Duration::from_secs(5),
            "the waiting row renewed past its first lease",
            || async {
                row(locks.inspect(Some("k")).await.unwrap()).is_some_and(|e| {
                    e.ticket == first.ticket && e.expires_at > first.expires_at + lease
                })
            },
        )
        .await;
        assert_eq!(
            queue(&locks, "k").await,
            vec![held("holder"), waiting("waiter", 0)]
        );
        held_lock.release().await.unwrap();
        let guard = waiter.join().await.success().unwrap().unwrap();
        assert_eq!(guard.fencing_token(), first.ticket, "it kept its place");
        guard.release().await.unwrap();
    });
}

/// The two promises of a lease while the storage thread is stuck (the database busy, another
/// session holding the owner's rows): the guard's `lost()` has fired by the time the store's
/// row runs out, when another owner could take the lock, whatever the storage thread is doing;
/// and the caller's executor goes on running its other tasks meanwhile, since no call of the
/// library blocks its thread. On every executor and both backends.
#[test]
fn a_guard_hears_its_lease_lost_by_its_end_while_the_storage_thread_is_stuck() {
    stores::on_every_database(|store| async move {
        let lease = Duration::from_millis(600);
        let builder = LockManager::builder().lease(lease).heartbeat(lease / 3);
        let locks = store.open_with(builder).await;
        let guard = locks.exclusive("k", "stuck").await.unwrap();
        assert!(!guard.lost().is_aborted(), "lost at once");
        let stall = store.stall(locks.owner_id());
        // When the store's row runs out, renewed as it may have been before the stall (by the
        // machine's clock, which the server shares here).
        let left = store.lease_left(locks.owner_id());
        let runs_out = Instant::now() + left + Duration::from_millis(1);
        let renewals = locks.stats().heartbeats;
        let ticks = AtomicUsize::new(0);
        let ticker = async {
            loop {
                smol::Timer::after(Duration::from_millis(5)).await;
                ticks.fetch_add(1, Ordering::Relaxed);
            }
        };
        let lost = guard.lost();
        let watch = async {
            let awaited = lost.aborted();
            smol::Timer::at(runs_out).await;
            assert!(lost.is_aborted(), "not lost when the row ran out");
            let reason =
                common::bounded(Duration::from_secs(5), "the awaiter wakes", awaited).await;
            assert!(reason.downcast_ref::<LeaseLost>().is_some(), "{reason:?}");
        };
        futures::pin_mut!(ticker, watch);
        futures::future::select(watch, ticker).await;
        assert!(
            ticks.load(Ordering::Relaxed) >= 10,
            "the executor's other task hardly ran: {} ticks",
            ticks.load(Ordering::Relaxed)
        );
        assert_eq!(locks.stats().heartbeats, renewals, "a renewal came back");
        drop(stall);
        assert!(matches!(
            guard.release().await,
            Err(LockError::LeaseLost(_))
        ));
        locks
            .exclusive("k", "after")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    });
}

/// Dropping the last handle waits for the worker to delete the owner's rows, but no longer than
/// half a heartbeat while the storage is stuck: the caller's thread (an executor's, here) is
/// held for no more than that, and the rows go once the storage lets the worker through.
#[test]
fn dropping_the_last_handle_while_the_storage_is_stuck_returns_within_half_a_heartbeat() {
    stores::on_every_database(|store| async move {
        let heartbeat = Duration::from_millis(200);
        let builder = LockManager::builder()
            .lease(heartbeat * 3)
            .heartbeat(heartbeat);
        let locks = store.open_with(builder).await;
        let owner = locks.owner_id().to_owned();
        let guard = locks.exclusive("k", "held").await.unwrap();
        let stall = store.stall(&owner);
        drop(guard);
        let started = Instant::now();
        drop(locks);
        let took = started.elapsed();
        // Half a heartbeat, and a generous margin for a busy machine.
        assert!(
            took < heartbeat / 2 + Duration::from_secs(1),
            "the drop took {took:?}"
        );
        drop(stall);
        within(Duration::from_secs(10), "the owner's rows gone", || async {
            store.count_rows(&format!("owner = '{owner}'")) == 0
        })
        .await;
    });
}

#[test]
fn many_queued_takes_one_ticket_for_all_keys_and_holds_them_together() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let b = locks.exclusive("b", "holder").await.unwrap();
        let both = {
            let locks = locks.clone();
            fork_daemon(async move {
                locks
                    .many_queued([
                        LockRequest::exclusive("a", "swap"),
                        LockRequest::exclusive("b", "swap"),
                    ])
                    .await
            })
        };
        within(Duration::from_secs(5), "queued on both keys", || async {
            locks.inspect(None).await.unwrap().len() == 3
        })
        .await;
        let entries = locks.inspect(None).await.unwrap();
        let tickets: Vec<u64> = entries
            .iter()
            .filter(|e| e.operation == "swap")
            .map(|e| e.ticket)
            .collect();
        assert_eq!(tickets.len(), 2);
        assert_eq!(tickets[0], tickets[1]);
        // Its queued row on "a" keeps later requests on "a" behind it (it never starves).
        assert!(locks
            .try_acquire(LockRequest::shared("a", "late"))
            .await
            .unwrap()
            .is_none());
        b.release().await.unwrap();
        let both = both.join().await.success().unwrap().unwrap();
        assert_eq!(both.fencing_token(), tickets[0]);
        assert!(locks
            .inspect(None)
            .await
            .unwrap()
            .iter()
            .all(|e| e.state == EntryState::Held));
    });
}

#[test]
fn dropping_a_queued_acquisition_removes_its_row() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let holder = locks.exclusive("k", "H").await.unwrap();
        {
            let mut acquisition = locks.exclusive("k", "dropped");
            // Poll it until it is queued, then drop it (as losing a select would).
            within(Duration::from_secs(5), "queued", || {
                let polled = futures::FutureExt::now_or_never(&mut acquisition).is_some();
                assert!(!polled);
                async { queue(&locks, "k").await.len() == 2 }
            })
            .await;
        }
        within(
            Duration::from_secs(5),
            "the dropped request's row is removed",
            || async { queue(&locks, "k").await == vec![held("H")] },
        )
        .await;
        holder.release().await.unwrap();
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn dropping_a_guard_releases_it() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        drop(locks.exclusive("k", "H").await.unwrap());
        // The release went to the worker before this inspection, so it is already done.
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn shutdown_releases_everything_and_ends_waits() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let other = store.open().await;
        let guard = locks.exclusive("k", "H").await.unwrap();
        let blocker = other.exclusive("j", "blocker").await.unwrap();
        let waiter = {
            let locks = locks.clone();
            fork_daemon(async move { locks.exclusive("j", "W").await })
        };
        within(Duration::from_secs(5), "waiter queued", || async {
            queue(&other, "j").await.len() == 2
        })
        .await;
        locks.shutdown().await.unwrap();
        assert!(matches!(
            waiter.join().await.success().unwrap(),
            Err(LockError::Shutdown)
        ));
        assert!(guard.lost().is_aborted());
        let rows = other.inspect(None).await.unwrap();
        assert!(rows.iter().all(|e| e.owner == other.owner_id()), "{rows:?}");
        assert!(matches!(
            locks.is_locked("k").await,
            Err(LockError::Shutdown)
        ));
        assert!(locks.shutdown().await.is_ok());
        drop(blocker);
    });
}

#[test]
fn inspect_reports_modes_owners_positions_and_times() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let grants = Grants::default();
        let s = locks.shared("k", "S").await.unwrap();
        let x = contend(&locks, LockRequest::exclusive("k", "X"), &grants, None);
        within(Duration::from_secs(5), "X queued", || async {
            queue(&locks, "k").await.len() == 2
        })
        .await;
        let entries = locks.inspect(Some("k")).await.unwrap();
        assert_eq!(entries[0].mode, Mode::Shared);
        assert_eq!(entries[1].mode, Mode::Exclusive);
        assert!(entries.iter().all(|e| e.owner == locks.owner_id()));
        assert!(entries[0].ticket < entries[1].ticket);
        assert!(entries.iter().all(|e| e.expires_at > e.since));
        assert!(locks.inspect(Some("nothing")).await.unwrap().is_empty());
        drop(s);
        guard_of(x).await.release().await.unwrap();
    });
}

#[test]
fn modes_and_states_display_as_words() {
    assert_eq!(Mode::Shared.to_string(), "shared");
    assert_eq!(Mode::Exclusive.to_string(), "exclusive");
    assert_eq!(EntryState::Held.to_string(), "held");
    assert_eq!(
        EntryState::Waiting { position: 0 }.to_string(),
        "waiting at 0"
    );
    assert_eq!(
        EntryState::Waiting { position: 12 }.to_string(),
        "waiting at 12"
    );
    assert_eq!(format!("{:>9}|", Mode::Shared), "   shared|");
    assert_eq!(
        format!("{:<14}|", EntryState::Waiting { position: 3 }),
        "waiting at 3  |"
    );
}

fn entry(key: &str, operation: &str, state: EntryState, expires_at: Duration) -> LockEntry {
    LockEntry {
        key: key.into(),
        mode: Mode::Shared,
        operation: operation.into(),
        owner: "4242-1a2b3c4d-0".into(),
        ticket: 8,
        state,
        since: Duration::ZERO,
        expires_at,
    }
}

#[test]
fn an_entry_displays_as_one_line_of_key_mode_state_operation_owner_ticket_and_expiry() {
    let waiting = entry(
        "repo/photos",
        "backup",
        EntryState::Waiting { position: 0 },
        Duration::from_millis(1_704_067_230_250),
    );
    assert_eq!(
        waiting.to_string(),
        r#""repo/photos" shared waiting at 0, operation "backup", owner "4242-1a2b3c4d-0", ticket 8, expires 2024-01-01T00:00:30.250Z"#
    );
    // Names are escaped, so that no key or operation can split the line or forge a field.
    let odd = entry(
        "a, \"b\"\nc",
        "x\", ticket 1",
        EntryState::Held,
        Duration::ZERO,
    );
    let line = odd.to_string();
    assert_eq!(
        line,
        r#""a, \"b\"\nc" shared held, operation "x\", ticket 1", owner "4242-1a2b3c4d-0", ticket 8, expires 1970-01-01T00:00:00.000Z"#
    );
    assert!(!line.contains('\n'));
}

#[test]
fn an_entry_shows_its_expiry_as_a_utc_time_to_the_millisecond() {
    let expiry = |since_epoch: Duration| {
        let line = entry("k", "o", EntryState::Held, since_epoch).to_string();
        line.rsplit(' ').next().unwrap().to_owned()
    };
    let cases = [
        (0, "1970-01-01T00:00:00.000Z"),
        (951_782_400_000, "2000-02-29T00:00:00.000Z"),
        (951_868_800_000, "2000-03-01T00:00:00.000Z"),
        (1_709_251_199_999, "2024-02-29T23:59:59.999Z"),
        (1_735_689_599_000, "2024-12-31T23:59:59.000Z"),
        (4_107_542_400_000, "2100-03-01T00:00:00.000Z"),
    ];
    for (millis, written) in cases {
        assert_eq!(
            expiry(Duration::from_millis(millis)),
            written,
            "{millis} ms"
        );
    }
    // Below a millisecond is cut off, not rounded up into the next second.
    assert_eq!(
        expiry(Duration::from_nanos(1_999_999_999)),
        "1970-01-01T00:00:01.999Z"
    );
}

#[test]
fn inspect_prints_one_line_per_entry_with_the_lease_expiry() {
    common::on_every_executor(|| async {
        let clock = leasehold::TestClock::new();
        let locks = LockManager::builder()
            .lease(Duration::from_secs(30))
            .clock(Arc::new(clock.clone()))
            .open_in_memory()
            .unwrap();
        let holder = locks.exclusive("repo", "prune").await.unwrap();
        let waiter = contend(
            &locks,
            LockRequest::shared("repo", "backup"),
            &Grants::default(),
            None,
        );
        within(Duration::from_secs(5), "the backup queued", || async {
            queue(&locks, "repo").await.len() == 2
        })
        .await;
        let lines: Vec<String> = locks
            .inspect(None)
            .await
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        let owner = locks.owner_id();
        assert_eq!(
            lines,
            [
                format!(
                    r#""repo" exclusive held, operation "prune", owner "{owner}", ticket 1, expires 2024-01-01T00:00:30.000Z"#
                ),
                format!(
                    r#""repo" shared waiting at 0, operation "backup", owner "{owner}", ticket 2, expires 2024-01-01T00:00:30.000Z"#
                ),
            ]
        );
        drop(holder);
        guard_of(waiter).await.release().await.unwrap();
    });
}

#[test]
fn an_acquisition_dropped_right_after_it_was_sent_leaves_no_row() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        for round in 0..200 {
            // Polled once (the request is sent), then dropped, usually before the reply: the
            // removal it sends from `Drop` then reaches the storage worker in the same batch. (If
            // the reply was quicker, the guard it returned is dropped, which releases it.)
            let mut attempt = Box::pin(locks.try_acquire(LockRequest::exclusive("k", "dropped")));
            let _ = futures::FutureExt::now_or_never(&mut attempt);
            drop(attempt);
            let left = locks.inspect(None).await.unwrap();
            assert!(left.is_empty(), "round {round}: {left:?}");
        }
    });
}

/// How many of 1,000 back-to-back `try_acquire`s of "k" are refused, each sent right after
/// `before` (which may drop something of "k") and each guard dropped at once; nothing else
/// holds "k", so the answer must be 0. Leaves nothing behind.
async fn refused_after(locks: &LockManager, before: impl Fn()) -> usize {
    let mut refused = 0;
    for _ in 0..1000 {
        before();
        match locks
            .try_acquire(LockRequest::exclusive("k", "a"))
            .await
            .unwrap()
        {
            Some(guard) => drop(guard),
            None => refused += 1,
        }
    }
    assert!(locks.inspect(None).await.unwrap().is_empty());
    refused
}

/// Every command sees what every command sent before it did, whatever batch they share: a
/// `try_acquire` right after a guard was dropped finds the lock free.
#[test]
fn a_try_acquire_right_after_a_dropped_guard_is_never_refused() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let refused = refused_after(&locks, || {}).await;
        assert_eq!(
            refused, 0,
            "refused {refused} of 1000 with nothing else holding k"
        );
    });
}

/// As above, with a pending acquisition dropped (granted or not, its removal is sent from
/// `Drop`) instead of a guard.
#[test]
fn a_try_acquire_right_after_a_dropped_acquisition_is_never_refused() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let refused = refused_after(&locks, || {
            let mut pending = locks.exclusive("k", "dropped");
            let _ = futures::FutureExt::now_or_never(&mut pending);
        })
        .await;
        assert_eq!(
            refused, 0,
            "refused {refused} of 1000 with nothing else holding k"
        );
    });
}

/// A request on several keys names them all in its rows only while it waits: held, a `many` of
/// N keys stores N names, not N × N (with 2,000 keys, 40 MB of SQLite file), and lookups near its
/// rows stay cheap. A promotion clears them.
#[test]
fn a_held_request_on_several_keys_stores_each_key_once() {
    stores::on_every_database(|store| async move {
        let locks = store.open().await;
        let naming = || store.count_rows("keys IS NOT NULL");
        let held = locks
            .many((0..2_000).map(|i| LockRequest::exclusive(format!("key-{i:05}"), "held")))
            .await
            .unwrap();
        assert_eq!(naming(), 0);
        if let Some(path) = store.sqlite_path() {
            let wal = path.with_extension("db-wal");
            let size = std::fs::metadata(path).unwrap().len()
                + std::fs::metadata(wal).map_or(0, |m| m.len());
            assert!(size < 4 << 20, "{size} bytes for 2,000 rows");
        }
        let blocker = locks.exclusive("b", "blocker").await.unwrap();
        let waiter = {
            let locks = locks.clone();
            fork_daemon(async move {
                locks
                    .many_queued([LockRequest::shared("a", "w"), LockRequest::shared("b", "w")])
                    .await
            })
        };
        within(
            Duration::from_secs(5),
            "the waiter's two rows name their keys",
            || async { naming() == 2 },
        )
        .await;
        blocker.release().await.unwrap();
        let guard = guard_of(waiter).await;
        assert_eq!(naming(), 0);
        guard.release().await.unwrap();
        held.release().await.unwrap();
    });
}

/// A commit on one key wakes only the managers it concerns: a manager waiting in the queue of
/// another key (here of the same process, on the same store, `poll` 30 s) is neither poked nor
/// rung, so it does not look while the other key changes hands a hundred times; the commit that
/// promotes its request wakes it at once.
#[test]
fn a_commit_on_one_key_does_not_wake_a_manager_waiting_on_another() {
    stores::on_every_store(|store| async move {
        let slow_poll = || store.open_with(LockManager::builder().poll(Duration::from_secs(30)));
        let (busy, waiting) = (slow_poll().await, slow_poll().await);
        let blocker = busy.exclusive("x", "blocker").await.unwrap();
        let waiter = {
            let waiting = waiting.clone();
            fork_daemon(async move { waiting.exclusive("x", "waiter").await })
        };
        within(Duration::from_secs(5), "the waiter's row", || async {
            queue(&busy, "x").await.len() == 2
        })
        .await;
        let looks = waiting.stats().change_checks;
        for _ in 0..100 {
            busy.exclusive("y", "busy")
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        }
        // On PostgreSQL, the waiting manager also looks once each time its listener (re)starts
        // listening, which may fall here; a manager woken by each commit looks about 100 times.
        let allowed = match &store {
            stores::Store::Sqlite { .. } => 0,
            #[allow(unreachable_patterns)]
            _ => 2,
        };
        let woken = waiting.stats().change_checks - looks;
        assert!(
            woken <= allowed,
            "commits on another key woke the waiting manager {woken} times"
        );
        blocker.release().await.unwrap();
        let granted = join_within(Duration::from_secs(5), "the waiter's grant", waiter).await;
        granted.success().unwrap().unwrap().release().await.unwrap();
    });
}
