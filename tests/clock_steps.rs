//! Steps of the wall clock while locks are held and waited for, on every store: several managers
//! share one clock that steps (`Stepped`), as the processes of one machine share its wall clock
//! when NTP or `date -s` steps it. No step lets another owner in while the holder renews, no
//! renewal is skipped for one, fencing order holds, and a stalled holder's `lost()` fires by its
//! lease's end as its renewals left it, not earlier or later for a step.
//!
//! Real time, so that PostgreSQL (whose leases the server's clock judges) runs the same cases:
//! there the client clocks step, and the server's cannot here.

mod common;
mod stores;

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use leasehold::{BootTime, Clock, LockManager, SystemClock};
use stores::{on_each, Store};

const LEASE: Duration = Duration::from_millis(900);
const BEAT: Duration = Duration::from_millis(300);
const HOUR: i64 = 3_600_000_000;

/// The system clock, whose wall time a test steps; its monotonic and boot times are the
/// system's, which no step moves.
#[derive(Default)]
struct Stepped {
    /// Micros added to the system's wall time.
    offset: AtomicI64,
}

impl Stepped {
    fn step(&self, micros: i64) {
        self.offset.fetch_add(micros, Ordering::SeqCst);
    }
}

impl Clock for Stepped {
    fn now(&self) -> Duration {
        let now = SystemClock.now().as_micros() as i64 + self.offset.load(Ordering::SeqCst);
        Duration::from_micros(now.max(0) as u64)
    }
    fn monotonic(&self) -> Duration {
        SystemClock.monotonic()
    }
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        SystemClock.sleep(duration)
    }
    fn boot_time(&self) -> Option<BootTime> {
        SystemClock.boot_time()
    }
}

async fn open(store: &Store, clock: &Arc<Stepped>) -> LockManager {
    let builder = LockManager::builder()
        .clock(clock.clone())
        .lease(LEASE)
        .heartbeat(BEAT);
    store.open_with(builder).await
}

/// A holder renewing, an exclusive and a shared request queued behind it; the clock steps an
/// hour forward, then two hours back, and stays there a few leases each time. Nobody is granted
/// over the holder, which loses nothing and renews all along; once it releases, the others are
/// granted in turn, with growing fencing tokens.
#[test]
fn a_step_of_the_wall_clock_either_way_lets_no_one_in_and_loses_no_lease() {
    on_each(Store::all(), |store| async move {
        let clock = Arc::new(Stepped::default());
        let (a, b, c) = (
            open(&store, &clock).await,
            open(&store, &clock).await,
            open(&store, &clock).await,
        );
        let first = a.exclusive("k", "first").await.unwrap();
        let released = Arc::new(AtomicBool::new(false));
        let second = smol::spawn({
            let (b, released) = (b.clone(), released.clone());
            async move {
                let guard = b.exclusive("k", "second").await.unwrap();
                assert!(released.load(Ordering::SeqCst), "granted over the holder");
                guard
            }
        });
        common::within(Duration::from_secs(10), "the second queued", || async {
            a.inspect(Some("k")).await.unwrap().len() == 2
        })
        .await;
        let third = smol::spawn({
            let c = c.clone();
            async move { c.shared("k", "third").await.unwrap() }
        });
        common::within(Duration::from_secs(10), "the third queued", || async {
            a.inspect(Some("k")).await.unwrap().len() == 3
        })
        .await;
        for step in [HOUR, -2 * HOUR] {
            let beats = a.stats().heartbeats;
            clock.step(step);
            // Three leases after the step: long enough for any lapse to be seen and granted
            // over, and for the holder to renew about nine times.
            smol::Timer::after(3 * LEASE).await;
            assert!(!first.lost().is_aborted(), "lost after a step of {step} µs");
            assert!(
                !second.is_finished(),
                "the second granted after a step of {step} µs"
            );
            assert!(
                !third.is_finished(),
                "the third granted after a step of {step} µs"
            );
            let renewed = a.stats().heartbeats - beats;
            assert!(
                renewed >= 3,
                "{renewed} renewals in three leases after a step of {step} µs"
            );
        }
        let tokens = [first.fencing_token()];
        released.store(true, Ordering::SeqCst);
        first.release().await.unwrap();
        let second = common::bounded(Duration::from_secs(10), "the second granted", second).await;
        assert!(second.fencing_token() > tokens[0]);
        assert!(
            !third.is_finished(),
            "the shared request passed the exclusive one"
        );
        let token = second.fencing_token();
        second.release().await.unwrap();
        let third = common::bounded(Duration::from_secs(10), "the third granted", third).await;
        assert!(third.fencing_token() > token);
        third.release().await.unwrap();
        for locks in [a, b, c] {
            locks.shutdown().await.unwrap();
        }
    });
}

/// A holder whose storage is stalled (its renewals wait) while the clock steps forward an hour,
/// then back two: its `lost()` fires when its lease runs out as its last renewal left it (no
/// sooner than a lease less a heartbeat after the stall began), and not an hour early or late.
/// On the stores that can be stalled (SQLite, PostgreSQL).
#[test]
fn a_stalled_holder_hears_its_lease_lost_by_its_end_whatever_the_steps() {
    for store in Store::all() {
        if store.name() == "memory" {
            continue;
        }
        eprintln!("=== on {}", store.name());
        smol::block_on(async move {
            let clock = Arc::new(Stepped::default());
            let a = open(&store, &clock).await;
            let guard = a.exclusive("k", "stalled").await.unwrap();
            // A renewal or two first, so that the lease is a renewed one.
            let beats = a.stats().heartbeats;
            common::within(Duration::from_secs(10), "renewed", || async {
                a.stats().heartbeats >= beats + 2
            })
            .await;
            let stall = store.stall(a.owner_id());
            let stalled_at = Instant::now();
            clock.step(HOUR);
            smol::Timer::after(BEAT).await;
            clock.step(-2 * HOUR);
            let lost = guard.lost();
            common::bounded(
                LEASE + Duration::from_secs(5),
                "lost() fires",
                lost.aborted(),
            )
            .await;
            let after = stalled_at.elapsed();
            // Its last renewal was at most a heartbeat before the stall (and a PostgreSQL
            // estimate runs ahead of the server by at most a round trip).
            let earliest = LEASE - BEAT - Duration::from_millis(100);
            assert!(after >= earliest, "lost {after:?} after the stall");
            drop(stall);
            drop(guard);
            a.shutdown().await.unwrap();
        });
    }
}
