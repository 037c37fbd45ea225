//! An operator's removal of another owner's rows (`LockManager::remove`, the command's
//! `release`): a removed waiting request's acquisition fails with `LockError::Removed`, naming
//! the remover, and does not queue again; a removed holder hears `lost()`; a waiting request
//! whose own row lapsed (no operator removed it) still queues again and is granted. Each runs on
//! every store.

mod common;
mod stores;

use common::{join_within, within};

use std::sync::Arc;
use std::time::Duration;

use leasehold::{fork_daemon, Exit, Fiber, Guard, LockError, LockManager, Removal, TestClock};

use stores::Store;

/// Generous: a removed owner hears of it at its next heartbeat, a fraction of this.
const PATIENCE: Duration = Duration::from_secs(10);

/// A manager that renews (and so finds its rows gone) every 100 ms.
async fn open_beating(store: &Store) -> LockManager {
    let builder = LockManager::builder()
        .lease(Duration::from_secs(2))
        .heartbeat(Duration::from_millis(100));
    store.open_with(builder).await
}

/// Starts an exclusive acquisition of `key` on `locks` in the background, and waits until the
/// key has `rows` rows (the request queued among them).
async fn queue(
    locks: &LockManager,
    key: &'static str,
    operation: &'static str,
    rows: usize,
) -> Fiber<Result<Guard, LockError>> {
    let waiter = {
        let locks = locks.clone();
        fork_daemon(async move { locks.exclusive(key, operation).await })
    };
    within(PATIENCE, "the request queued", || async {
        locks.inspect(Some(key)).await.unwrap().len() == rows
    })
    .await;
    waiter
}

/// The operations of the rows of `key`, in ticket order.
async fn operations(locks: &LockManager, key: &str) -> Vec<String> {
    let rows = locks.inspect(Some(key)).await.unwrap();
    rows.into_iter().map(|entry| entry.operation).collect()
}

/// The waiter's acquisition ended with `Removed`, naming `by`.
async fn assert_removed_by(waiter: Fiber<Result<Guard, LockError>>, by: &str) {
    match join_within(PATIENCE, "the removed wait ends", waiter).await {
        Exit::Success(Err(LockError::Removed { by: remover })) => assert_eq!(remover, by),
        other => panic!("expected Removed by {by}, got {other:?}"),
    }
}

#[test]
fn a_waiter_removed_by_owner_fails_with_removed_naming_the_remover_and_leaves_no_row() {
    stores::on_every_store(|store| async move {
        let holder = store.open().await;
        let waiting = open_beating(&store).await;
        let operator = store.open().await;
        let held = holder.exclusive("k", "holder").await.unwrap();
        let waiter = queue(&waiting, "k", "waiter", 2).await;

        let removed = operator
            .remove(Removal::Owner(waiting.owner_id().to_owned()))
            .await
            .unwrap();
        assert_eq!(removed, 1);
        assert_removed_by(waiter, operator.owner_id()).await;
        assert_eq!(operations(&operator, "k").await, ["holder"]);

        // It did not queue again: once the holder lets go, the key is free.
        held.release().await.unwrap();
        assert!(operator.inspect(Some("k")).await.unwrap().is_empty());
        let taken = waiting.exclusive("k", "later").await.unwrap();
        assert_eq!(operations(&operator, "k").await, ["later"]);
        taken.release().await.unwrap();
    });
}

#[test]
fn a_waiter_removed_by_key_and_ticket_fails_with_removed_and_its_other_requests_stay() {
    stores::on_every_store(|store| async move {
        let holder = store.open().await;
        let waiting = open_beating(&store).await;
        let operator = store.open().await;
        let held_k = holder.exclusive("k", "holder").await.unwrap();
        let held_j = holder.exclusive("j", "holder").await.unwrap();
        let removed_waiter = queue(&waiting, "k", "removed", 2).await;
        let kept_waiter = queue(&waiting, "j", "kept", 2).await;
        let ticket = (operator.inspect(Some("k")).await.unwrap().into_iter())
            .find(|entry| entry.operation == "removed")
            .map(|entry| entry.ticket)
            .expect("the waiter's row");

        let removal = Removal::Request {
            key: "k".into(),
            ticket,
        };
        assert_eq!(operator.remove(removal).await.unwrap(), 1);
        assert_removed_by(removed_waiter, operator.owner_id()).await;
        assert_eq!(operations(&operator, "k").await, ["holder"]);

        // The same owner's other request waits on, and is granted when its key is free.
        held_j.release().await.unwrap();
        let kept = match join_within(PATIENCE, "the kept request granted", kept_waiter).await {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("expected a grant, got {other:?}"),
        };
        assert_eq!(kept.requests()[0].operation, "kept");
        kept.release().await.unwrap();
        held_k.release().await.unwrap();
        assert!(operator.inspect(None).await.unwrap().is_empty());
    });
}

/// The removal is announced to the removed owner, as a promotion would be: its waiter hears of
/// it at once, not at its next heartbeat (here 40 s away).
#[test]
fn a_removed_waiter_hears_of_it_long_before_its_next_heartbeat() {
    stores::on_every_store(|store| async move {
        let holder = store.open().await;
        let slow = LockManager::builder()
            .lease(Duration::from_secs(120))
            .heartbeat(Duration::from_secs(40));
        let waiting = store.open_with(slow).await;
        let operator = store.open().await;
        let held = holder.exclusive("k", "holder").await.unwrap();
        let waiter = queue(&waiting, "k", "waiter", 2).await;
        operator
            .remove(Removal::Owner(waiting.owner_id().to_owned()))
            .await
            .unwrap();
        assert_removed_by(waiter, operator.owner_id()).await;
        held.release().await.unwrap();
    });
}

#[test]
fn a_removed_holder_hears_lost_and_the_next_waiter_is_granted() {
    stores::on_every_store(|store| async move {
        let holding = open_beating(&store).await;
        let waiting = store.open().await;
        let operator = store.open().await;
        let guard = holding.exclusive("k", "holder").await.unwrap();
        let next = queue(&waiting, "k", "next", 2).await;

        let removed = operator
            .remove(Removal::Owner(holding.owner_id().to_owned()))
            .await
            .unwrap();
        assert_eq!(removed, 1);
        let next = match join_within(PATIENCE, "the next waiter granted", next).await {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("expected a grant, got {other:?}"),
        };
        let lost = guard.lost();
        within(PATIENCE, "the removed holder hears lost()", || {
            let lost = lost.clone();
            async move { lost.is_aborted() }
        })
        .await;
        assert!(matches!(
            guard.release().await,
            Err(LockError::LeaseLost(_))
        ));
        assert_eq!(operations(&operator, "k").await, ["next"]);
        next.release().await.unwrap();
    });
}

#[test]
fn removing_what_is_not_there_removes_nothing() {
    stores::on_every_store(|store| async move {
        let operator = store.open().await;
        let holder = store.open().await;
        let held = holder.exclusive("k", "holder").await.unwrap();
        let nobody = Removal::Owner("nobody".into());
        assert_eq!(operator.remove(nobody).await.unwrap(), 0);
        let no_ticket = Removal::Request {
            key: "k".into(),
            ticket: held.fencing_token() + 1000,
        };
        assert_eq!(operator.remove(no_ticket).await.unwrap(), 0);
        assert_eq!(operations(&operator, "k").await, ["holder"]);
        held.release().await.unwrap();
    });
}

/// A waiting request whose own row lapsed (its process frozen past its lease: its clock stands
/// still, so it never renews) was removed by no one: it queues again once it thaws, and is
/// granted. On SQLite and in memory, where leases are judged by the managers' clocks.
#[test]
fn a_waiter_whose_own_row_lapsed_queues_again_and_is_granted() {
    const LEASE: Duration = Duration::from_secs(10);
    const BEAT: Duration = Duration::from_secs(2);
    for store in Store::local() {
        eprintln!("=== on {}", store.name());
        futures::executor::block_on(async {
            let holder_clock = TestClock::new();
            let waiter_clock = TestClock::new();
            let open = |clock: &TestClock| {
                let builder = LockManager::builder()
                    .lease(LEASE)
                    .heartbeat(BEAT)
                    .poll(Duration::from_millis(5))
                    .clock(Arc::new(clock.clone()));
                store.open_with(builder)
            };
            let holder = open(&holder_clock).await;
            let waiting = open(&waiter_clock).await;
            let held = holder.exclusive("k", "holder").await.unwrap();
            let waiter = queue(&waiting, "k", "frozen waiter", 2).await;

            // The holder's time runs past the waiter's lease, renewing the holder's own; its
            // release then finds the waiting row lapsed, and deletes it.
            let mut moved = Duration::ZERO;
            while moved <= LEASE {
                let before = holder.stats().heartbeats;
                within(PATIENCE, "the holder's heartbeat sleeps", || async {
                    holder_clock.sleepers() > 0
                })
                .await;
                holder_clock.advance(BEAT);
                moved += BEAT;
                within(PATIENCE, "the holder renewed", || async {
                    holder.stats().heartbeats > before
                })
                .await;
            }
            held.release().await.unwrap();

            // It thaws (in memory, where the store's time is the later of the managers', it may
            // have found its row gone already): its row is gone, with no tombstone, and it
            // queues again.
            waiter_clock.advance(LEASE * 2);
            let granted = match join_within(PATIENCE, "the waiter granted", waiter).await {
                Exit::Success(Ok(guard)) => guard,
                other => panic!("expected a grant, got {other:?}"),
            };
            assert_eq!(granted.requests()[0].operation, "frozen waiter");
            drop(granted);
            within(PATIENCE, "the store is empty", || async {
                holder.inspect(None).await.unwrap().is_empty()
            })
            .await;
        });
    }
}

/// The same with the managers' clocks left alone, on the stores whose rows a test can hold past
/// the managers (SQLite, PostgreSQL): the waiter's storage is stalled (the database busy, its
/// rows locked) past its lease, so its renewals wait and its row lapses. When the stall ends,
/// the waiter finds its row lapsed or gone, with no tombstone, queues again and is granted.
#[test]
fn a_waiter_stalled_past_its_lease_queues_again_and_is_granted() {
    stores::on_every_database(|store| async move {
        let holder = store.open().await;
        let lease = Duration::from_millis(600);
        let builder = LockManager::builder().lease(lease).heartbeat(lease / 3);
        let waiting = store.open_with(builder).await;
        let held = holder.exclusive("k", "holder").await.unwrap();
        let waiter = queue(&waiting, "k", "stalled waiter", 2).await;

        let stall = store.stall(waiting.owner_id());
        within(PATIENCE, "the waiting row lapsed", || async {
            holder.inspect(Some("k")).await.unwrap().len() == 1
        })
        .await;
        drop(stall);
        held.release().await.unwrap();
        let granted = match join_within(PATIENCE, "the waiter granted", waiter).await {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("expected a grant, got {other:?}"),
        };
        assert_eq!(granted.requests()[0].operation, "stalled waiter");
        granted.release().await.unwrap();
        assert!(holder.inspect(None).await.unwrap().is_empty());
    });
}

/// A tombstone lives only until its owner has heard of the removal: none is left behind.
#[test]
fn no_tombstone_is_left_once_the_removed_owner_has_heard() {
    stores::on_every_database(|store| async move {
        let holder = store.open().await;
        let waiting = open_beating(&store).await;
        let operator = store.open().await;
        let held = holder.exclusive("k", "holder").await.unwrap();
        let waiter = queue(&waiting, "k", "waiter", 2).await;
        // A holder's removal records none: its guard hears `lost()` without one.
        let other = open_beating(&store).await;
        let other_held = other.exclusive("j", "other holder").await.unwrap();
        operator
            .remove(Removal::Owner(other.owner_id().to_owned()))
            .await
            .unwrap();
        assert_eq!(store.tombstones(), 0);

        operator
            .remove(Removal::Owner(waiting.owner_id().to_owned()))
            .await
            .unwrap();
        assert_removed_by(waiter, operator.owner_id()).await;
        within(PATIENCE, "the tombstone deleted", || async {
            store.tombstones() == 0
        })
        .await;
        drop(other_held);
        held.release().await.unwrap();
    });
}
