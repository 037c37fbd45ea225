//! Keyed permits (`Mode::Permits`): at most `limit` permits of a key held at once, in the same
//! queue as every other request. The conformance cases of API.md's permits section, on every
//! store and under every executor.

mod common;
mod stores;

use std::time::Duration;

use common::{join_within, within};
use leasehold::{
    fork_daemon, EntryState, Exit, Fiber, Guard, LockError, LockManager, LockRequest, Mode,
};

/// The entries of `key`, as (operation, state) pairs in ticket order.
async fn queue(locks: &LockManager, key: &str) -> Vec<(String, EntryState)> {
    (locks.inspect(Some(key)).await.expect("inspect").into_iter())
        .map(|entry| (entry.operation, entry.state))
        .collect()
}

fn held(op: &str) -> (String, EntryState) {
    (op.to_owned(), EntryState::Held)
}

fn waiting(op: &str, position: usize) -> (String, EntryState) {
    (op.to_owned(), EntryState::Waiting { position })
}

/// Starts `request` in the background; the fiber ends with its guard.
fn start(locks: &LockManager, request: LockRequest) -> Fiber<Result<Guard, LockError>> {
    fork_daemon(locks.acquire(request))
}

async fn guard_of(fiber: Fiber<Result<Guard, LockError>>) -> Guard {
    match join_within(Duration::from_secs(10), "the grant", fiber).await {
        Exit::Success(Ok(guard)) => guard,
        other => panic!("expected a guard, got {other:?}"),
    }
}

/// The message of an `InvalidRequest`, or a panic naming what came instead.
fn invalid(result: Result<Guard, LockError>) -> String {
    match result {
        Err(LockError::InvalidRequest(why)) => why,
        other => panic!("expected InvalidRequest, got {other:?}"),
    }
}

#[test]
fn case_p1_three_of_three_permits_are_held_together_and_a_fourth_waits() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let other = store.open().await;
        let a = locks.permits("slots", "a", 1, 3).await.unwrap();
        let b = other.permits("slots", "b", 1, 3).await.unwrap();
        let c = locks.permits("slots", "c", 1, 3).await.unwrap();
        assert_eq!(
            queue(&locks, "slots").await,
            vec![held("a"), held("b"), held("c")]
        );
        let refused = other.try_acquire(LockRequest::permits("slots", "d", 1, 3));
        assert!(refused.await.unwrap().is_none(), "three of three are held");
        let d = start(&other, LockRequest::permits("slots", "d", 1, 3));
        within(Duration::from_secs(5), "d queued", || async {
            queue(&locks, "slots").await.len() == 4
        })
        .await;
        assert!(!d.is_finished(), "a fourth permit was granted beside three");

        b.release().await.unwrap();
        let d = guard_of(d).await;
        assert_eq!(
            queue(&locks, "slots").await,
            vec![held("a"), held("c"), held("d")]
        );
        // Fencing tokens of permits increase as every grant's do.
        assert!(a.fencing_token() < c.fencing_token());
        assert!(c.fencing_token() < d.fencing_token());
        assert_eq!(d.requests()[0].mode, Mode::Permits { count: 1, limit: 3 });
        for guard in [a, c, d] {
            guard.release().await.unwrap();
        }
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn case_p1_a_large_request_at_the_head_is_not_passed_by_a_smaller_one_behind_it() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let first = locks.permits("slots", "first", 2, 3).await.unwrap();
        let large = start(&locks, LockRequest::permits("slots", "large", 2, 3));
        within(Duration::from_secs(5), "large queued", || async {
            queue(&locks, "slots").await.len() == 2
        })
        .await;
        // One permit is free, and a request of one would fit beside `first`: it waits behind
        // `large`, and so does a try.
        let small = start(&locks, LockRequest::permits("slots", "small", 1, 3));
        within(Duration::from_secs(5), "small queued", || async {
            queue(&locks, "slots").await
                == vec![held("first"), waiting("large", 0), waiting("small", 1)]
        })
        .await;
        let tried = locks.try_acquire(LockRequest::permits("slots", "try", 1, 3));
        assert!(tried.await.unwrap().is_none(), "a try passed the queue");
        assert!(
            !small.is_finished(),
            "a small request passed a large one at the head"
        );

        first.release().await.unwrap();
        let large = guard_of(large).await;
        let small = guard_of(small).await;
        assert_eq!(
            queue(&locks, "slots").await,
            vec![held("large"), held("small")]
        );
        large.release().await.unwrap();
        small.release().await.unwrap();
    });
}

#[test]
fn case_p1_another_limit_or_another_kind_on_a_key_is_an_invalid_request() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let other = store.open().await;
        let permit = locks.permits("slots", "p", 1, 3).await.unwrap();
        let shared = locks.shared("repo", "s").await.unwrap();

        let why = invalid(other.permits("slots", "q", 1, 4).await);
        assert!(why.contains("has 3 permits"), "{why}");
        let why = invalid(other.exclusive("slots", "x").await);
        assert!(why.contains("used for permits"), "{why}");
        let why = invalid(other.permits("repo", "q", 1, 3).await);
        assert!(why.contains("locked in shared mode"), "{why}");
        let tried = other
            .try_acquire(LockRequest::permits("repo", "t", 1, 3))
            .await;
        assert!(
            matches!(tried, Err(LockError::InvalidRequest(_))),
            "{tried:?}"
        );
        // A `many` with one misfit writes nothing at all.
        let why = invalid(
            other
                .many(vec![
                    LockRequest::exclusive("free", "x"),
                    LockRequest::permits("slots", "q", 1, 9),
                ])
                .await,
        );
        assert!(why.contains("has 3 permits"), "{why}");
        assert_eq!(queue(&locks, "free").await, vec![]);
        assert_eq!(queue(&locks, "slots").await, vec![held("p")]);

        // Once the key's rows are gone, it may be used either way again.
        permit.release().await.unwrap();
        other
            .exclusive("slots", "x")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        other
            .permits("slots", "q", 1, 4)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        shared.release().await.unwrap();
    });
}

#[test]
fn case_p1_many_of_an_exclusive_key_and_a_permit_is_all_or_nothing() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let other = store.open().await;
        let both = || {
            vec![
                LockRequest::exclusive("repo", "backup"),
                LockRequest::permits("slots", "backup", 1, 2),
            ]
        };
        let full = [
            other.permits("slots", "a", 1, 2).await.unwrap(),
            other.permits("slots", "b", 1, 2).await.unwrap(),
        ];
        let looks = locks.stats().change_checks;
        let many = {
            let locks = locks.clone();
            fork_daemon(async move { locks.many(both()).await })
        };
        // No permit is free: it waits (its manager looks for changes for it), and holds
        // neither the repository nor a slot meanwhile.
        within(
            Duration::from_secs(5),
            "the many refused and waiting",
            || async { locks.stats().change_checks > looks + 1 },
        )
        .await;
        assert!(!many.is_finished());
        for _ in 0..20 {
            assert_eq!(queue(&locks, "repo").await, vec![], "part of a many held");
            common::yield_now().await;
        }
        let [a, b] = full;
        a.release().await.unwrap();
        let guard = match join_within(Duration::from_secs(10), "the many", many).await {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("{other:?}"),
        };
        assert_eq!(queue(&locks, "repo").await, vec![held("backup")]);
        assert_eq!(
            queue(&locks, "slots").await,
            vec![held("b"), held("backup")]
        );
        guard.release().await.unwrap();
        b.release().await.unwrap();

        // many_queued: one ticket on both keys, waiting on both until both are free.
        let x = other.exclusive("repo", "x").await.unwrap();
        let queued = {
            let locks = locks.clone();
            fork_daemon(async move { locks.many_queued(both()).await })
        };
        within(Duration::from_secs(5), "queued on both keys", || async {
            queue(&locks, "slots").await == vec![waiting("backup", 0)]
        })
        .await;
        x.release().await.unwrap();
        match join_within(Duration::from_secs(10), "many_queued", queued).await {
            Exit::Success(Ok(guard)) => guard.release().await.unwrap(),
            other => panic!("{other:?}"),
        }
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn a_permit_guard_dropped_or_interrupted_leaves_no_row() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        drop(locks.permits("slots", "dropped", 3, 3).await.unwrap());
        let full = locks.permits("slots", "full", 3, 3).await.unwrap();
        let stop = leasehold::AbortController::new();
        let waiter = {
            let acquisition = locks
                .permits("slots", "w", 1, 3)
                .with_signal(&stop.signal());
            fork_daemon(acquisition)
        };
        within(Duration::from_secs(5), "w queued", || async {
            queue(&locks, "slots").await.len() == 2
        })
        .await;
        stop.abort("enough");
        match join_within(Duration::from_secs(10), "the interrupted wait", waiter).await {
            Exit::Success(Err(LockError::Interrupted(_))) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(queue(&locks, "slots").await, vec![held("full")]);
        drop(full);
        within(
            Duration::from_secs(5),
            "the dropped guard's release",
            || async { locks.inspect(None).await.unwrap().is_empty() },
        )
        .await;
    });
}

#[test]
fn bad_counts_and_limits_are_refused_before_anything_is_written() {
    futures::executor::block_on(async {
        let locks = LockManager::open_in_memory().unwrap();
        for (count, limit, says) in [
            (0, 3, "at least 1"),
            (4, 3, "at most its limit, 3"),
            (1, 0, "limit of 0"),
        ] {
            let why = invalid(locks.permits("k", "p", count, limit).await);
            assert!(why.contains(says), "{count} of {limit}: {why}");
        }
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn permits_show_their_count_and_limit() {
    futures::executor::block_on(async {
        let locks = LockManager::open_in_memory().unwrap();
        let guard = locks.permits("slots", "p", 2, 5).await.unwrap();
        let entries = locks.inspect(Some("slots")).await.unwrap();
        assert_eq!(entries[0].mode, Mode::Permits { count: 2, limit: 5 });
        assert!(
            entries[0].to_string().contains("permits 2/5"),
            "{}",
            entries[0]
        );
        guard.release().await.unwrap();
    });
}
