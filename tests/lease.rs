//! Leases and heartbeats, driven by `TestClock`s: an owner whose clock never moves never
//! heartbeats, which is how a frozen or crashed process looks to the others. Each runs on a
//! SQLite file and on a store in memory (`Store::local`); PostgreSQL judges leases by the
//! server's clock, which a test cannot move.

mod common;
mod stores;

use common::{granted_while_stalled, read_when_stalled, warnings_during, within};
use stores::{on_each, Store};

use std::sync::Arc;
use std::time::Duration;

use futures::executor::block_on;
use leasehold::{
    fork_daemon, AbortSignal, Clock, EntryState, Fiber, Guard, LeaseLost, LockError, LockManager,
    LockRequest, Scoped, SystemClock, TestClock,
};

const LEASE: Duration = Duration::from_secs(10);
const BEAT: Duration = Duration::from_secs(2);

fn manager(store: &Store, clock: &TestClock) -> LockManager {
    let builder = LockManager::builder()
        .lease(LEASE)
        .heartbeat(BEAT)
        .poll(Duration::from_millis(5));
    store.open_on(builder, clock)
}

/// Starts an exclusive acquisition of "k" on `locks` in the background, and waits until it is
/// queued behind the one holder.
async fn queue_behind_the_holder(
    locks: &LockManager,
    operation: &'static str,
) -> Fiber<Result<Guard, LockError>> {
    let waiter = {
        let locks = locks.clone();
        fork_daemon(async move { locks.exclusive("k", operation).await })
    };
    within(Duration::from_secs(5), "the waiter queued", || async {
        locks.inspect(Some("k")).await.unwrap().len() == 2
    })
    .await;
    waiter
}

/// Lets a queued waiter's heartbeat start: its fiber is forked only once the wait has lasted a
/// quarter of a heartbeat (`beat`), by `clock`, so that short waits cost none. Waits until it
/// sleeps on `clock`.
async fn start_waiter_heartbeat(clock: &TestClock, beat: Duration) {
    let before = clock.sleepers();
    clock.advance(beat / 4);
    within(
        Duration::from_secs(5),
        "the waiter's heartbeat forked and asleep",
        || async { clock.sleepers() > before },
    )
    .await;
}

/// Advances `clock` in heartbeat steps, waiting after each for `locks` to finish the renewal
/// that step triggers, so that time never outruns the heartbeats.
async fn advance_with_heartbeats(clock: &TestClock, locks: &LockManager, total: Duration) {
    advance_with_heartbeats_until(clock, locks, total, || false).await;
}

/// [`advance_with_heartbeats`], for a manager whose only heartbeat may end on its own (a
/// waiter's, when `ended` says its wait is over): a step that wakes it then may renew nothing.
async fn advance_with_heartbeats_until(
    clock: &TestClock,
    locks: &LockManager,
    total: Duration,
    ended: impl Fn() -> bool,
) {
    let mut moved = Duration::ZERO;
    while moved < total {
        let before = locks.stats().heartbeats;
        within(
            Duration::from_secs(5),
            "a heartbeat is sleeping",
            || async { clock.sleepers() > 0 },
        )
        .await;
        let ended_before = ended();
        clock.advance(BEAT);
        moved += BEAT;
        within(Duration::from_secs(5), "the heartbeat renewed", || async {
            locks.stats().heartbeats > before || (!ended_before && ended())
        })
        .await;
    }
}

#[test]
fn heartbeats_keep_a_held_lock_past_its_lease() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let locks = manager(&store, &clock);
        let guard = locks.exclusive("k", "long job").await.unwrap();
        advance_with_heartbeats(&clock, &locks, LEASE * 3).await;
        let entries = locks.inspect(Some("k")).await.unwrap();
        assert_eq!(entries.len(), 1);
        assert!(entries[0].expires_at > std::time::Duration::from_secs(0));
        assert!(!guard.lost().is_aborted());
        guard.release().await.unwrap();
    });
}

#[test]
fn a_frozen_owners_lock_goes_to_a_waiter_after_its_lease_and_not_before() {
    on_each(Store::local(), |store| async move {
        let frozen_clock = TestClock::new();
        let live_clock = TestClock::new();
        let frozen = manager(&store, &frozen_clock);
        let live = manager(&store, &live_clock);

        let stale = frozen.exclusive("k", "frozen").await.unwrap();
        let waiter = queue_behind_the_holder(&live, "waiter").await;
        start_waiter_heartbeat(&live_clock, BEAT).await;

        // Half a lease: the frozen owner's row is still live, so the waiter must wait.
        advance_with_heartbeats(&live_clock, &live, LEASE / 2).await;
        for _ in 0..10 {
            smol::Timer::after(Duration::from_millis(5)).await;
            assert!(!waiter.is_finished(), "granted before the lease ran out");
        }

        // Past the lease: granted within a few polls, with a larger fencing token.
        advance_with_heartbeats_until(&live_clock, &live, LEASE / 2 + BEAT, || {
            waiter.is_finished()
        })
        .await;
        let guard = waiter.join().await.success().unwrap().unwrap();
        assert!(guard.fencing_token() > stale.fencing_token());

        // The frozen owner thaws: its next heartbeat finds its row gone and says so.
        let lost = stale.lost();
        frozen_clock.advance(LEASE * 2);
        let reason = lost.aborted().await;
        assert!(reason.downcast_ref::<LeaseLost>().is_some(), "{reason}");
        // Its late release says the lease was lost, and must not touch the new holder's row.
        assert!(matches!(
            stale.release().await,
            Err(LockError::LeaseLost(_))
        ));
        let entries = live.inspect(Some("k")).await.unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].owner, live.owner_id());
        assert_eq!(entries[0].state, EntryState::Held);
        guard.release().await.unwrap();
    });
}

/// The waiting owner looks when the frozen owner's lease runs out, not only when its poll says:
/// here the poll is an hour.
#[test]
fn a_frozen_owners_lock_passes_on_when_its_lease_ends_however_long_the_poll() {
    on_each(Store::local(), |store| async move {
        let frozen_clock = TestClock::new();
        let live_clock = TestClock::new();
        let frozen = manager(&store, &frozen_clock);
        let live = store.open_local(
            LockManager::builder()
                .lease(LEASE)
                .heartbeat(BEAT)
                .poll(Duration::from_secs(3_600))
                .clock(Arc::new(live_clock.clone())),
        );
        let stale = frozen.exclusive("k", "frozen").await.unwrap();
        let waiter = queue_behind_the_holder(&live, "waiter").await;
        start_waiter_heartbeat(&live_clock, BEAT).await;
        advance_with_heartbeats_until(&live_clock, &live, LEASE + BEAT, || waiter.is_finished())
            .await;
        let guard = match common::join_within(Duration::from_secs(5), "the waiter", waiter).await {
            leasehold::Exit::Success(Ok(guard)) => guard,
            other => panic!("{other:?}"),
        };
        assert!(guard.fencing_token() > stale.fencing_token());
        guard.release().await.unwrap();
    });
}

#[test]
fn a_heartbeat_renews_a_thousand_locks_in_one_transaction() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let locks = manager(&store, &clock);
        let mut guards = Vec::new();
        for i in 0..1_000 {
            guards.push(locks.shared(format!("key{i}"), "hold").await.unwrap());
        }
        let before = locks.stats();
        advance_with_heartbeats(&clock, &locks, BEAT).await;
        let after = locks.stats();
        assert_eq!(after.heartbeats - before.heartbeats, 1);
        assert_eq!(after.write_transactions - before.write_transactions, 1);
        drop(guards);
    });
}

#[test]
fn waiting_costs_no_write_transactions_however_many_wait() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let locks = manager(&store, &clock);
        let holder = locks.exclusive("k", "holder").await.unwrap();
        let mut waiters = Vec::new();
        for i in 0..200 {
            let locks = locks.clone();
            waiters.push(fork_daemon(async move {
                locks.shared("k", format!("waiter {i}")).await
            }));
        }
        within(Duration::from_secs(10), "all queued", || async {
            locks.inspect(Some("k")).await.unwrap().len() == 201
        })
        .await;
        let before = locks.stats();
        // Let the worker poll a few times (on the manager's clock): reads only.
        for _ in 0..5 {
            let checks = locks.stats().change_checks;
            clock.advance(Duration::from_millis(5));
            within(Duration::from_secs(5), "a change check", || async {
                locks.stats().change_checks > checks
            })
            .await;
            // A round trip: the worker has planned its next look before it answers, so the
            // next step of the clock cannot land inside this look.
            locks.is_locked("k").await.unwrap();
        }
        // One heartbeat for all 200 waiting rows, however many waiter fibers ask.
        advance_with_heartbeats(&clock, &locks, BEAT).await;
        let after = locks.stats();
        assert_eq!(after.write_transactions - before.write_transactions, 1);
        holder.release().await.unwrap();
        for waiter in waiters {
            waiter
                .join()
                .await
                .success()
                .unwrap()
                .unwrap()
                .release()
                .await
                .unwrap();
        }
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn a_heartbeat_never_revives_an_expired_row() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let locks = manager(&store, &clock);
        let guard = locks.exclusive("k", "paused").await.unwrap();
        let lost = guard.lost();
        // Jump past the lease in one step: the heartbeat that then runs must not renew.
        within(Duration::from_secs(5), "the daemon sleeps", || async {
            clock.sleepers() > 0
        })
        .await;
        clock.advance(LEASE + BEAT);
        let reason = lost.aborted().await;
        assert!(reason.downcast_ref::<LeaseLost>().is_some());
        assert!(locks.inspect(Some("k")).await.unwrap().is_empty());
        // Another request is granted at once.
        let next = locks
            .try_acquire(LockRequest::exclusive("k", "next"))
            .await
            .unwrap();
        assert!(next.is_some());
        drop(guard);
    });
}

/// Two processes on one file, each with its own clock (on SQLite only: the managers of one
/// memory store share the store's time, which never goes back).
#[test]
fn a_waiter_whose_lease_ran_out_queues_again_and_is_granted() {
    on_each([Store::sqlite()], |store| async move {
        let holder_clock = TestClock::new();
        let waiter_clock = TestClock::new();
        let holder = manager(&store, &holder_clock);
        let waiting = manager(&store, &waiter_clock);

        let guard = holder.exclusive("k", "holder").await.unwrap();
        let waiter = queue_behind_the_holder(&waiting, "frozen waiter").await;
        start_waiter_heartbeat(&waiter_clock, BEAT).await;
        // The waiter's process is frozen (its clock stands still) while the holder's time runs
        // past the waiter's lease; the holder's release then deletes the expired waiting row.
        advance_with_heartbeats(&holder_clock, &holder, LEASE + BEAT).await;
        guard.release().await.unwrap();
        assert!(holder.inspect(Some("k")).await.unwrap().is_empty());

        // It thaws: its next heartbeat (or its storage thread, which was never frozen, looking
        // for other processes' changes) finds its row gone, and it queues again, rather than
        // failing an acquisition its caller is still waiting for.
        within(
            Duration::from_secs(5),
            "the waiter's heartbeat sleeps",
            || async { waiter_clock.sleepers() > 0 },
        )
        .await;
        waiter_clock.advance(LEASE * 2);
        let granted = waiter.join().await.success().unwrap().unwrap();
        assert_eq!(granted.requests()[0].operation, "frozen waiter");
        // If it queued again before the jump (its storage thread saw the release), the jump
        // of two leases at once has since lost the new lease too: dropping releases either way.
        drop(granted);
        assert!(waiting.inspect(None).await.unwrap().is_empty());
    });
}

/// A spawner that holds what it is given until `start` is called, then runs it on smol's
/// executor: background work that starts late, as on a busy executor.
#[derive(Clone, Default)]
struct LateSpawner(Arc<std::sync::Mutex<Vec<futures::future::BoxFuture<'static, ()>>>>);

impl LateSpawner {
    fn start(&self) {
        for task in self.0.lock().unwrap().drain(..) {
            smol::spawn(task).detach();
        }
    }
}

/// A waiter's heartbeat counts from when the request was sent, not from when its fiber first
/// runs: a fiber that starts a whole heartbeat late renews at once.
#[test]
fn a_waiters_first_heartbeat_counts_from_its_request_however_late_its_fiber_starts() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let late = LateSpawner::default();
        let locks = {
            let late = late.clone();
            store.open_local(
                LockManager::builder()
                    .lease(LEASE)
                    .heartbeat(BEAT)
                    .clock(Arc::new(clock.clone()))
                    .spawner(Arc::new(move |task| late.0.lock().unwrap().push(task))),
            )
        };
        let other = manager(&store, &clock);
        let guard = other.exclusive("k", "holder").await.unwrap();
        let waiter = queue_behind_the_holder(&locks, "waiter").await;
        let queued_until = clock.now() + LEASE;
        // The heartbeat's fiber is forked a quarter of a heartbeat into the wait, not sooner
        // (a round trip through the worker lets it see the clock's last step)...
        clock.advance(BEAT / 4 - Duration::from_millis(1));
        locks.is_locked("k").await.unwrap();
        assert!(
            late.0.lock().unwrap().is_empty(),
            "the heartbeat was forked before a quarter of a heartbeat"
        );
        // ... and then: start nothing before it is there to start.
        clock.advance(Duration::from_millis(1));
        within(
            Duration::from_secs(5),
            "the waiter's heartbeat handed to the spawner",
            || async { !late.0.lock().unwrap().is_empty() },
        )
        .await;

        clock.advance(BEAT - BEAT / 4);
        late.start();
        within(
            Duration::from_secs(5),
            "the late heartbeat renewed the waiting row",
            || async {
                let rows = locks.inspect(Some("k")).await.unwrap();
                rows.iter()
                    .any(|row| row.operation == "waiter" && row.expires_at == queued_until + BEAT)
            },
        )
        .await;

        guard.release().await.unwrap();
        within(Duration::from_secs(5), "the waiter was granted", || async {
            waiter.is_finished()
        })
        .await;
        waiter
            .join()
            .await
            .success()
            .unwrap()
            .unwrap()
            .release()
            .await
            .unwrap();
    });
}

/// A renewal that waited for another connection's write lock judges the rows by the time once it
/// holds the lock: a row that ran out while it waited (and that others may already have passed
/// over) stays out, and its guard is told it is lost.
#[test]
fn a_renewal_held_up_past_the_lease_does_not_revive_the_row() {
    on_each([Store::sqlite()], |store| async move {
        let clock = TestClock::new();
        let locks = manager(&store, &clock);
        let guard = locks.exclusive("k", "held").await.unwrap();
        let expires_at = clock.now() + LEASE;
        within(
            Duration::from_secs(5),
            "the lock heartbeat sleeps",
            || async { clock.sleepers() > 0 },
        )
        .await;

        let waits = locks.stats().lock_waits;
        let write_lock = common::WriteLock::take(store.sqlite_path().expect("a file"));
        clock.advance(BEAT);
        within(
            Duration::from_secs(5),
            "the renewal reached the worker and waits for the write lock",
            || async { locks.stats().lock_waits > waits },
        )
        .await;
        // While it waits, the row runs out: past `expires_at`, before `renewal time + LEASE`.
        clock.advance(LEASE - BEAT + Duration::from_secs(1));
        assert!(clock.now() > expires_at);
        drop(write_lock);

        within(
            Duration::from_secs(5),
            "the guard was told it is lost",
            || async { guard.lost().is_aborted() },
        )
        .await;
        assert!(locks.inspect(Some("k")).await.unwrap().is_empty());
    });
}

/// Two managers on one file, sharing `clock`, with the smallest lease the builder allows
/// (twice the heartbeat).
fn tight_managers(store: &Store, clock: &TestClock) -> (LockManager, LockManager) {
    let open = || {
        store.open_local(
            LockManager::builder()
                .lease(Duration::from_secs(2))
                .heartbeat(Duration::from_secs(1))
                .poll(Duration::from_millis(5))
                .clock(Arc::new(clock.clone())),
        )
    };
    (open(), open())
}

/// A guard granted from the queue starts with a whole lease, as one granted at once does: a
/// waiter promoted just before its waiter heartbeat was due keeps its lock through a first lock
/// heartbeat that comes 200 ms late.
#[test]
fn a_lock_granted_from_the_queue_starts_with_a_whole_lease() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let (a, b) = tight_managers(&store, &clock);
        let holder = a.exclusive("k", "A").await.unwrap();
        let waiter = queue_behind_the_holder(&b, "B").await;
        start_waiter_heartbeat(&clock, Duration::from_secs(1)).await;
        // A's lock heartbeat and B's waiter heartbeat.
        within(Duration::from_secs(5), "both heartbeats asleep", || async {
            clock.sleepers() >= 2
        })
        .await;
        clock.advance(Duration::from_secs(1));
        let renewed_until = clock.now() + Duration::from_secs(2);
        // Both renewals must land before time moves on: A's too, or its lease would run out
        // under the next step.
        within(
            Duration::from_secs(5),
            "A's held row and B's waiting row renewed",
            || async {
                let rows = b.inspect(Some("k")).await.unwrap();
                rows.len() == 2 && rows.iter().all(|e| e.expires_at == renewed_until)
            },
        )
        .await;

        clock.advance(Duration::from_millis(900));
        holder.release().await.unwrap();
        let granted_at = clock.now();
        let guard = waiter.join().await.success().unwrap().unwrap();
        let row = b.inspect(Some("k")).await.unwrap();
        assert_eq!(row.len(), 1);
        assert_eq!(
            row[0].expires_at,
            granted_at + Duration::from_secs(2),
            "the promoted row keeps the expiry of its last waiter renewal"
        );

        // B's lock heartbeat is asleep; wake it 200 ms after it was due.
        let beats = b.stats().heartbeats;
        within(
            Duration::from_secs(5),
            "B's lock heartbeat asleep",
            || async { clock.sleepers() >= 1 },
        )
        .await;
        clock.advance(Duration::from_millis(1_200));
        within(Duration::from_secs(5), "B's lock heartbeat ran", || async {
            b.stats().heartbeats > beats
        })
        .await;
        assert!(
            !guard.lost().is_aborted(),
            "a first heartbeat 200 ms late lost a lock granted from the queue"
        );
        let row = b.inspect(Some("k")).await.unwrap();
        assert_eq!(row.len(), 1, "{row:?}");
        assert_eq!(row[0].expires_at, clock.now() + Duration::from_secs(2));
        guard.release().await.unwrap();
    });
}

/// The same on real clocks: lease 400 ms, heartbeat 200 ms, each release coming just before the
/// waiter's heartbeat was due. Every promoted guard outlives a whole lease.
#[test]
fn locks_granted_from_the_queue_on_real_clocks_are_not_lost() {
    on_each(Store::local(), |store| async move {
        let open = || {
            store.open_local(
                LockManager::builder()
                    .lease(Duration::from_millis(400))
                    .heartbeat(Duration::from_millis(200))
                    .poll(Duration::from_millis(5)),
            )
        };
        let (a, b) = (open(), open());
        let mut lost = 0;
        for _ in 0..10 {
            let holder = a.exclusive("k", "A").await.unwrap();
            let waiter = queue_behind_the_holder(&b, "B").await;
            let first = b.inspect(Some("k")).await.unwrap()[1].expires_at;
            // Its first waiter heartbeat renews the row...
            within(
                Duration::from_secs(5),
                "B's waiting row renewed",
                || async { b.inspect(Some("k")).await.unwrap()[1].expires_at > first },
            )
            .await;
            let renewed_until = b.inspect(Some("k")).await.unwrap()[1].expires_at;
            // ...and A lets go just before the second is due.
            let release_at =
                renewed_until - Duration::from_millis(400) + Duration::from_millis(198);
            SystemClock
                .sleep(release_at.saturating_sub(SystemClock.now()))
                .await;
            holder.release().await.unwrap();
            let guard = waiter.join().await.success().unwrap().unwrap();
            smol::Timer::after(Duration::from_millis(500)).await;
            lost += usize::from(guard.lost().is_aborted());
            drop(guard);
        }
        assert_eq!(
            lost, 0,
            "{lost} of 10 locks granted from the queue were lost"
        );
    });
}

/// Moves `clock` on by `times` heartbeats of `tight_managers` (a second each), each once `b`'s
/// lock heartbeat sleeps, and waits for it to renew after each.
async fn beat(clock: &TestClock, b: &LockManager, times: usize) {
    for _ in 0..times {
        let beats = b.stats().heartbeats;
        within(
            Duration::from_secs(5),
            "B's lock heartbeat asleep",
            || async { clock.sleepers() >= 1 },
        )
        .await;
        clock.advance(Duration::from_secs(1));
        within(Duration::from_secs(5), "B's lock heartbeat ran", || async {
            b.stats().heartbeats > beats
        })
        .await;
    }
}

/// A grant whose lease ran out between the decision and its delivery (the caller's executor
/// stalled past the lease) is never handed out: the caller gets a live guard or keeps waiting.
#[test]
fn a_grant_delivered_after_its_lease_ran_out_is_not_handed_out() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let (a, b) = tight_managers(&store, &clock);
        let mut acquisition = granted_while_stalled(&a, &b).await;

        // The stall outlasts the lease, and nobody renews the row meanwhile.
        clock.advance(Duration::from_secs(3));
        let guard = read_when_stalled(&mut acquisition).await;
        assert!(!guard.lost().is_aborted());
        let rows = b.inspect(Some("k")).await.unwrap();
        assert_eq!(rows.len(), 1, "B's guard has no live row: {rows:?}");
        assert_eq!(rows[0].ticket, guard.fencing_token());
        assert!(rows[0].expires_at > clock.now());
        guard.release().await.unwrap();
    });
}

/// A grant read late, after its first lease, but whose row the owner's heartbeat kept renewing
/// meanwhile (the owner holds another lock), is handed out: its place was never lost, so it
/// keeps its ticket, and its lease is the renewed one.
#[test]
fn a_grant_read_late_whose_row_heartbeats_kept_live_is_handed_out() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let (a, b) = tight_managers(&store, &clock);
        let other = b
            .exclusive("other", "keeps B's heartbeat beating")
            .await
            .unwrap();
        let mut acquisition = granted_while_stalled(&a, &b).await;
        let ticket = b.inspect(Some("k")).await.unwrap()[0].ticket;
        // Three heartbeats while the caller stalls: past the grant's first lease of 2 s.
        beat(&clock, &b, 3).await;
        let guard = read_when_stalled(&mut acquisition).await;
        assert_eq!(guard.fencing_token(), ticket, "it lost its place");
        assert!(!guard.lost().is_aborted());
        let rows = b.inspect(Some("k")).await.unwrap();
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].ticket, ticket);
        guard.release().await.unwrap();
        other.release().await.unwrap();
    });
}

/// A grant read late but while its lease still runs (the caller stalled for 1.5 s of a 2 s lease)
/// is handed out, and its lock heartbeat beats at once, not a heartbeat after the delivery
/// (which would be after the row ran out): with every heartbeat on time, the lock is kept.
#[test]
fn a_guard_delivered_late_but_live_is_renewed_before_its_lease_runs_out() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let (a, b) = tight_managers(&store, &clock);
        let mut acquisition = granted_while_stalled(&a, &b).await;
        let expires = b.inspect(Some("k")).await.unwrap()[0].expires_at;

        clock.advance(Duration::from_millis(1_500));
        let guard = read_when_stalled(&mut acquisition).await;
        assert!(clock.now() < expires, "handed out while live");

        // The first lock heartbeat is due already: it renews without the clock moving.
        within(
            Duration::from_secs(5),
            "B's first lock heartbeat renewed the row",
            || async {
                b.inspect(Some("k"))
                    .await
                    .unwrap()
                    .first()
                    .is_some_and(|row| row.expires_at > expires)
            },
        )
        .await;
        // From then on, one heartbeat at a time, each renewal made before time moves on.
        beat(&clock, &b, 3).await;
        assert!(!guard.lost().is_aborted());
        let rows = b.inspect(Some("k")).await.unwrap();
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert!(rows[0].expires_at > clock.now());
        guard.release().await.unwrap();
    });
}

/// An executor that shut down drops the lock heartbeat it was given without ever polling it.
/// The guard that started it goes without renewals (the docs say so); a later guard, once the
/// executor works again, must get a heartbeat again.
#[test]
fn a_lock_heartbeat_dropped_unpolled_is_started_again_for_a_later_guard() {
    use std::sync::atomic::{AtomicBool, Ordering};
    block_on(async {
        let clock = TestClock::new();
        let working = Arc::new(AtomicBool::new(false));
        let spawner: Arc<dyn leasehold::Spawner> = {
            let working = working.clone();
            Arc::new(move |future: futures::future::BoxFuture<'static, ()>| {
                if working.load(Ordering::SeqCst) {
                    smol::spawn(future).detach();
                }
            })
        };
        let locks = LockManager::builder()
            .lease(LEASE)
            .heartbeat(BEAT)
            .clock(Arc::new(clock.clone()))
            .spawner(spawner)
            .open_in_memory()
            .unwrap();
        let first = locks.exclusive("a", "on a dead executor").await.unwrap();
        first.release().await.unwrap();

        working.store(true, Ordering::SeqCst);
        let guard = locks.exclusive("b", "later").await.unwrap();
        advance_with_heartbeats(&clock, &locks, LEASE + BEAT).await;
        assert!(!guard.lost().is_aborted());
        assert_eq!(locks.inspect(Some("b")).await.unwrap().len(), 1);
        guard.release().await.unwrap();
    });
}

/// A guard whose lock heartbeat never runs (its executor dropped it: a runtime that shut down)
/// is still told, by the storage worker, when its lease runs out, as a heartbeat would have.
#[test]
fn a_guard_whose_heartbeat_never_runs_is_told_when_its_lease_runs_out() {
    block_on(async {
        let dead: Arc<dyn leasehold::Spawner> =
            Arc::new(|future: futures::future::BoxFuture<'static, ()>| drop(future));
        let locks = LockManager::builder()
            .lease(Duration::from_millis(400))
            .heartbeat(Duration::from_millis(200))
            .spawner(dead)
            .open_in_memory()
            .unwrap();
        let guard = locks.exclusive("k", "unrenewed").await.unwrap();
        let lost = guard.lost();
        within(
            Duration::from_secs(5),
            "the guard is told its lease ran out",
            || {
                let told = lost.is_aborted();
                async move { told }
            },
        )
        .await;
        assert_eq!(locks.stats().heartbeats, 0, "a heartbeat ran after all");
        assert!(matches!(
            guard.release().await,
            Err(LockError::LeaseLost(_))
        ));
    });
}

/// The same when the executor keeps the heartbeat but never runs it (an idle runtime): the
/// heartbeat counts as running, yet renews nothing, and the guard must still be told.
#[test]
fn a_guard_whose_heartbeat_is_never_polled_is_told_when_its_lease_runs_out() {
    block_on(async {
        let kept = Arc::new(std::sync::Mutex::new(Vec::new()));
        let idle: Arc<dyn leasehold::Spawner> = {
            let kept = kept.clone();
            Arc::new(move |future: futures::future::BoxFuture<'static, ()>| {
                kept.lock().unwrap().push(future);
            })
        };
        let locks = LockManager::builder()
            .lease(Duration::from_millis(400))
            .heartbeat(Duration::from_millis(200))
            .spawner(idle)
            .open_in_memory()
            .unwrap();
        let first = locks.exclusive("a", "first").await.unwrap();
        let second = locks.exclusive("b", "second").await.unwrap();
        let lost = [first.lost(), second.lost()];
        within(
            Duration::from_secs(5),
            "both guards are told their leases ran out",
            || {
                let told = lost.iter().all(|l| l.is_aborted());
                async move { told }
            },
        )
        .await;
        assert_eq!(locks.stats().heartbeats, 0, "a heartbeat ran after all");
        assert!(
            !kept.lock().unwrap().is_empty(),
            "the heartbeat was never handed over"
        );
    });
}

/// The same for a lock granted at once: a `try_acquire` whose reply is read after the lease ran
/// out takes the lock again, with a new ticket, or reports it busy; never an expired guard.
#[test]
fn an_immediate_grant_read_after_its_lease_ran_out_is_not_handed_out() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let (locks, _) = tight_managers(&store, &clock);
        let mut stalled = 0;
        for _ in 0..20 {
            let mut attempt = Box::pin(locks.try_acquire(LockRequest::exclusive("k", "late")));
            let mut delivered = futures::FutureExt::now_or_never(&mut attempt);
            if delivered.is_none() {
                // The reply was not there at the first poll: stall past the lease before the next.
                stalled += 1;
                within(Duration::from_secs(5), "the grant was written", || async {
                    locks.is_locked("k").await.unwrap()
                })
                .await;
                clock.advance(Duration::from_secs(3));
                within(Duration::from_secs(5), "try_acquire returned", || {
                    delivered = futures::FutureExt::now_or_never(&mut attempt);
                    let returned = delivered.is_some();
                    async move { returned }
                })
                .await;
            }
            let guard = delivered.unwrap().unwrap().expect("nothing else holds k");
            assert!(!guard.lost().is_aborted());
            let rows = locks.inspect(Some("k")).await.unwrap();
            assert_eq!(rows.len(), 1, "the guard has no live row: {rows:?}");
            assert_eq!(rows[0].ticket, guard.fencing_token());
            guard.release().await.unwrap();
        }
        assert!(stalled > 0, "no reply was ever late enough to stall");
    });
}

/// Releasing a guard whose lease was lost says so: the critical section may have overlapped
/// with another holder's.
#[test]
fn releasing_a_lost_lease_reports_it() {
    on_each(Store::local(), |store| async move {
        let clock = TestClock::new();
        let locks = manager(&store, &clock);

        // Lost, and told so by the heartbeat.
        let guard = locks.exclusive("k", "told").await.unwrap();
        within(Duration::from_secs(5), "the daemon sleeps", || async {
            clock.sleepers() > 0
        })
        .await;
        clock.advance(LEASE + BEAT);
        guard.lost().aborted().await;
        match guard.release().await {
            Err(LockError::LeaseLost(lost)) => assert!(!lost.by_shutdown()),
            other => panic!("released a lost lease with {other:?}"),
        }

        // Lost, before any heartbeat could tell: the release itself finds the row run out.
        let guard = locks.exclusive("k", "untold").await.unwrap();
        let lost = guard.lost();
        clock.advance(LEASE + BEAT);
        assert!(matches!(
            guard.release().await,
            Err(LockError::LeaseLost(_))
        ));
        assert!(lost.is_aborted(), "the lost signal was not aborted");

        // A live lease releases cleanly, and a lost one dropped says nothing.
        locks
            .exclusive("k", "live")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

/// A guard adopted by a scope whose lease was lost before the scope closed: its release error
/// does not reach the caller, which gets its body's value (`Release` resolves to `()`, and the
/// close has no error to give); it is logged with `tracing` at warn, and the guard's `lost()`
/// signal was aborted by then (what `Scope::adopt`'s docs say).
#[test]
fn an_adopted_guards_release_error_is_logged_at_warn_and_the_scoped_keeps_its_value() {
    let ((), warnings) = warnings_during(|| {
        on_each(Store::local(), |store| async move {
            let clock = TestClock::new();
            let locks = manager(&store, &clock);
            let (lost, told) = futures::channel::oneshot::channel::<AbortSignal>();
            let work = {
                let (locks, clock) = (locks.clone(), clock.clone());
                Scoped::<&str, LockError>::new(move |scope| async move {
                    let guard = locks.exclusive("k", "adopted").await?;
                    lost.send(guard.lost()).unwrap();
                    scope.adopt(guard);
                    // Past the lease, with no heartbeat: the release at the close finds it lost.
                    clock.advance(LEASE + BEAT);
                    Ok("the body's value")
                })
            };

            assert_eq!(work.await.unwrap(), "the body's value");

            let lost = told.await.unwrap();
            assert!(
                lost.is_aborted(),
                "the guard's lost() signal was not aborted"
            );
            assert!(locks.inspect(None).await.unwrap().is_empty());
        })
    });
    let failed: Vec<_> = warnings
        .iter()
        .filter(|line| line.contains("releasing a lock owned by a scope failed"))
        .collect();
    assert_eq!(failed.len(), 2, "one per store: {warnings:?}");
    assert!(
        failed.iter().all(|line| line.contains("lease")),
        "{failed:?}"
    );
}
