//! Leader election and work bound to a lease: the conformance cases of API.md's election
//! section, on every store and under every executor (`campaign`, `Leadership`, `leader`,
//! `observe`, `lead`), and the binding they share with `with_lock` and `every`.

mod common;
mod stores;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{bounded, interrupted_with, join_within, record_status, test_clock, within, Statuses};
use futures::StreamExt;
use leasehold::{
    fork_daemon, AbortController, Clock, Exit, Fiber, Interrupted, LeadError, Leader, Leadership,
    LeaseLost, LockError, LockManager, LockRequest, Observe, Removal, Schedule, Scoped, Spawner,
};

const WAIT: Duration = Duration::from_secs(10);

/// A lease short enough for a test to outlive, and its heartbeat: the margin bound work gets.
const LEASE: Duration = Duration::from_secs(2);
const HEARTBEAT: Duration = Duration::from_millis(500);

fn start(locks: &LockManager, key: &str, value: &str) -> Fiber<Result<Leadership, LockError>> {
    fork_daemon(locks.campaign(key, value))
}

async fn leadership_of(fiber: Fiber<Result<Leadership, LockError>>) -> Leadership {
    match join_within(WAIT, "the campaign", fiber).await {
        Exit::Success(Ok(leadership)) => leadership,
        other => panic!("expected a leadership, got {other:?}"),
    }
}

async fn rows(locks: &LockManager, key: &str) -> usize {
    locks.inspect(Some(key)).await.expect("inspect").len()
}

async fn next(leaders: &mut Observe) -> Option<Leader> {
    bounded(WAIT, "a leader change", leaders.next())
        .await
        .expect("the stream goes on")
        .expect("a read")
}

/// A manager whose lock heartbeat never runs (its executor drops it), with a short lease: a
/// leader that stops renewing, as one whose process is starved or cut off from the store.
/// (Not in a simulation, which runs every task on its own executor.)
async fn unrenewed(store: &stores::Store) -> LockManager {
    unrenewed_with(store, LEASE, HEARTBEAT).await
}

/// [`unrenewed`], with this `lease` and `heartbeat`.
async fn unrenewed_with(
    store: &stores::Store,
    lease: Duration,
    heartbeat: Duration,
) -> LockManager {
    let dead: Arc<dyn Spawner> = Arc::new(|future: futures::future::BoxFuture<'static, ()>| {
        drop(future);
    });
    let builder = LockManager::builder()
        .lease(lease)
        .heartbeat(heartbeat)
        .spawner(dead);
    store.open_with(builder).await
}

#[test]
fn case_e1_a_campaigner_leads_only_after_the_leader_before_it_resigns_or_is_dropped() {
    stores::on_every_store(|store| async move {
        let (a, b, c) = (store.open().await, store.open().await, store.open().await);
        let first = a.campaign("scheduler", "a").await.unwrap();
        let second = start(&b, "scheduler", "b");
        within(WAIT, "b queues", || async {
            rows(&a, "scheduler").await == 2
        })
        .await;
        let third = start(&c, "scheduler", "c");
        within(WAIT, "c queues", || async {
            rows(&a, "scheduler").await == 3
        })
        .await;
        let leader = c.leader("scheduler").await.unwrap().expect("a leads");
        assert_eq!(
            (leader.value.as_str(), leader.owner.as_str(), leader.term),
            ("a", a.owner_id(), first.term())
        );
        assert!(!second.is_finished() && !third.is_finished());

        let first_term = first.term();
        first.resign().await.unwrap();
        let second = leadership_of(second).await;
        assert!(second.term() > first_term, "terms strictly increase");
        assert_eq!(c.leader("scheduler").await.unwrap().unwrap().value, "b");
        assert!(!third.is_finished(), "c is behind b");

        let second_term = second.term();
        drop(second); // resigns
        let third = leadership_of(third).await;
        assert!(third.term() > second_term);
        third.resign().await.unwrap();
        assert_eq!(a.leader("scheduler").await.unwrap(), None);
    });
}

#[test]
fn an_interrupted_campaign_leaves_no_row() {
    stores::on_every_store(|store| async move {
        let (a, b) = (store.open().await, store.open().await);
        let leading = a.campaign("scheduler", "a").await.unwrap();
        let stop = AbortController::new();
        let campaign = fork_daemon(b.campaign("scheduler", "b").with_signal(&stop.signal()));
        within(WAIT, "b queues", || async {
            rows(&a, "scheduler").await == 2
        })
        .await;
        stop.abort("not needed");
        match join_within(WAIT, "the interrupted campaign", campaign).await {
            Exit::Success(Err(error)) => {
                assert_eq!(error.abort_reason().unwrap().to_string(), "not needed");
            }
            other => panic!("expected an interruption, got {other:?}"),
        }
        assert_eq!(rows(&a, "scheduler").await, 1, "the campaign's row is gone");
        leading.resign().await.unwrap();
    });
}

#[test]
fn case_e2_a_proclaimed_value_is_seen_by_leader_and_observe_without_a_new_term() {
    stores::on_every_store(|store| async move {
        let (watcher, a, b) = (store.open().await, store.open().await, store.open().await);
        let mut leaders = watcher.observe("scheduler");
        assert_eq!(next(&mut leaders).await, None, "nobody leads yet");

        let leading = a.campaign("scheduler", "a:8080").await.unwrap();
        let first = next(&mut leaders).await.expect("a leads");
        assert_eq!(
            (first.value.as_str(), first.owner.as_str(), first.term),
            ("a:8080", a.owner_id(), leading.term())
        );
        // A campaigner queueing is a change of rows, not of the leader: not told.
        let queued = start(&b, "scheduler", "b:8080");
        within(WAIT, "b queues", || async {
            rows(&a, "scheduler").await == 2
        })
        .await;

        leading.proclaim("a:8081").await.unwrap();
        assert_eq!(leading.value(), "a:8081");
        let proclaimed = next(&mut leaders).await.expect("a still leads");
        assert_eq!(proclaimed.value, "a:8081");
        assert_eq!(proclaimed.term, first.term, "the same term");
        let apart = proclaimed.since.abs_diff(first.since);
        assert!(
            apart < Duration::from_secs(1),
            "led since then: {apart:?} apart"
        );
        let read = watcher.leader("scheduler").await.unwrap().expect("a leads");
        assert_eq!((read.term, read.value), (first.term, proclaimed.value));

        let bad = leading.proclaim("a\0b").await;
        assert!(
            matches!(&bad, Err(LockError::InvalidRequest(why)) if why.contains("value")),
            "{bad:?}"
        );

        leading.resign().await.unwrap();
        let second = next(&mut leaders).await.expect("b leads next");
        assert_eq!(second.value, "b:8080");
        assert!(second.term > first.term, "never back to an older term");
        let second = leadership_of(queued).await;
        second.resign().await.unwrap();
        assert_eq!(next(&mut leaders).await, None);
    });
}

#[test]
fn a_leader_removed_by_an_operator_cannot_proclaim() {
    stores::on_every_store(|store| async move {
        let (operator, a) = (store.open().await, store.open().await);
        let leading = a.campaign("scheduler", "a").await.unwrap();
        let removed = operator
            .remove(Removal::Owner(a.owner_id().to_owned()))
            .await
            .unwrap();
        assert_eq!(removed, 1);
        let proclaimed = leading.proclaim("still me").await;
        assert!(
            matches!(proclaimed, Err(LockError::LeaseLost(_))),
            "{proclaimed:?}"
        );
        assert_eq!(operator.leader("scheduler").await.unwrap(), None);
    });
}

/// When did each thing happen, on the test's clock (the simulation's, inside one).
#[derive(Clone, Default)]
struct Times(Arc<Mutex<Vec<(&'static str, Duration)>>>);

impl Times {
    fn mark(&self, what: &'static str) {
        let now = test_clock().monotonic();
        self.0.lock().unwrap().push((what, now));
    }

    fn of(&self, what: &str) -> Duration {
        let times = self.0.lock().unwrap();
        let found = times.iter().find(|(mark, _)| *mark == what);
        found
            .unwrap_or_else(|| panic!("no {what} in {:?}", *times))
            .1
    }
}

#[test]
fn case_e2_a_leader_whose_renewals_stop_is_interrupted_and_cleaned_up_before_the_next_leads() {
    stores::on_stores_of_this_process(|store| async move {
        stuck_leader_cleaned_up_before_the_next(&store, LEASE, HEARTBEAT).await;
    });
}

/// As above, at the smallest lease the builder allows, twice the heartbeat, where the margin
/// is half a heartbeat ([`LockManager::margin`]).
#[test]
fn at_the_smallest_lease_a_stuck_leader_is_cleaned_up_before_the_next_leads() {
    stores::on_stores_of_this_process(|store| async move {
        let heartbeat = Duration::from_millis(500);
        stuck_leader_cleaned_up_before_the_next(&store, heartbeat * 2, heartbeat).await;
    });
}

/// A leader on `store` whose renewals stop, with this `lease` and `heartbeat`, is interrupted
/// with `LeaseLost` before its lease runs out, and its clean-up has ended before the next
/// campaigner's body begins.
async fn stuck_leader_cleaned_up_before_the_next(
    store: &stores::Store,
    lease: Duration,
    heartbeat: Duration,
) {
    let stuck = unrenewed_with(store, lease, heartbeat).await;
    assert!(
        stuck.margin() > Duration::from_millis(50),
        "room for the clean-up"
    );
    let next_in_line = store.open().await;
    let (times, statuses) = (Times::default(), Statuses::new());
    let led = {
        let (times, statuses) = (times.clone(), statuses.clone());
        fork_daemon(stuck.lead("scheduler", "stuck", move |_| {
            Scoped::<(), Interrupted>::new(move |scope| async move {
                record_status(&scope, &statuses);
                times.mark("led");
                scope.add_finalizer(move |_| async move {
                    test_clock().sleep(Duration::from_millis(50)).await;
                    times.mark("cleaned up");
                });
                std::future::pending().await
            })
        }))
    };
    within(WAIT, "the stuck manager leads", || async {
        next_in_line.leader("scheduler").await.unwrap().is_some()
    })
    .await;
    let next = {
        let times = times.clone();
        fork_daemon(next_in_line.lead("scheduler", "next", move |_| {
            Scoped::<(), Interrupted>::new(move |_| async move {
                times.mark("next led");
                Ok(())
            })
        }))
    };
    match join_within(WAIT, "the stuck leader's end", led).await {
        Exit::Success(Err(LeadError::Lock(LockError::LeaseLost(why)))) => {
            assert!(why.before_expiry(), "told before its lease ran out: {why}");
        }
        other => panic!("expected LeaseLost, got {other:?}"),
    }
    assert!(interrupted_with::<LeaseLost>(&statuses.only()));
    assert!(matches!(
        join_within(WAIT, "the next leader", next).await,
        Exit::Success(Ok(()))
    ));
    let (led, cleaned, next) = (
        times.of("led"),
        times.of("cleaned up"),
        times.of("next led"),
    );
    assert!(
        cleaned < next,
        "the next leader led before the clean-up ended"
    );
    // Told a margin before the lease, which began before "led", would run out.
    assert!(
        cleaned < led + lease,
        "cleaned up {:?} after leading",
        cleaned - led
    );
}

/// At the smallest lease the builder allows (twice the heartbeat), a body whose renewals come
/// back is never told its lease is running out: the margin leaves each renewal time to return.
#[test]
fn at_the_smallest_lease_a_renewed_body_runs_on() {
    stores::on_stores_of_this_process(|store| async move {
        let (lease, heartbeat) = (Duration::from_millis(600), Duration::from_millis(300));
        let locks =
            (store.open_with(LockManager::builder().lease(lease).heartbeat(heartbeat))).await;
        let ran = locks
            .with_lock(LockRequest::exclusive("repo", "long"), move |_| {
                Scoped::<(), LockError>::new(move |_| async move {
                    test_clock().sleep(lease * 3).await;
                    Ok(())
                })
            })
            .await;
        assert!(ran.is_ok(), "{ran:?}");
    });
}

/// Marks `what` when dropped: a fiber's work that was stopped.
struct MarkOnDrop(Times, &'static str);

impl Drop for MarkOnDrop {
    fn drop(&mut self) {
        self.0.mark(self.1);
    }
}

#[test]
fn with_lock_stops_the_bodys_fibers_and_releases_before_it_resolves() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let times = Times::default();
        let token = {
            let times = times.clone();
            locks
                .with_lock(LockRequest::exclusive("repo", "prune"), move |guard| {
                    let token = guard.fencing_token();
                    Scoped::<u64, LockError>::new(move |scope| async move {
                        let upload = MarkOnDrop(times.clone(), "upload stopped");
                        // Forked and never joined: it ends with the body's scope.
                        drop(scope.fork(async move {
                            let _upload = upload;
                            std::future::pending::<()>().await
                        }));
                        Ok(token)
                    })
                })
                .await
                .unwrap()
        };
        assert!(token > 0);
        times.of("upload stopped");
        assert_eq!(rows(&locks, "repo").await, 0, "released before it resolved");

        // A body's own error comes back as it is, the lock released all the same.
        let failed = locks
            .with_lock(LockRequest::exclusive("repo", "prune"), |_| {
                Scoped::<(), LockError>::new(|_| async { Err(LockError::Shutdown) })
            })
            .await;
        assert!(matches!(failed, Err(LockError::Shutdown)), "{failed:?}");
        assert_eq!(rows(&locks, "repo").await, 0);
    });
}

#[test]
fn with_lock_interrupted_releases_before_it_resolves() {
    stores::on_every_store(|store| async move {
        let locks = store.open().await;
        let (statuses, times) = (Statuses::new(), Times::default());
        let stop = AbortController::new();
        let work = {
            let (statuses, started) = (statuses.clone(), times.clone());
            fork_daemon(
                locks
                    .with_lock(LockRequest::shared("repo", "backup"), move |_| {
                        Scoped::<(), LockError>::new(move |scope| async move {
                            record_status(&scope, &statuses);
                            started.mark("started");
                            std::future::pending().await
                        })
                    })
                    .with_signal(&stop.signal()),
            )
        };
        within(WAIT, "the body runs", || {
            let running = !times.0.lock().unwrap().is_empty();
            async move { running }
        })
        .await;
        assert_eq!(rows(&locks, "repo").await, 1);
        stop.abort("shutting down");
        match join_within(WAIT, "the interrupted work", work).await {
            Exit::Success(Err(error)) => {
                assert_eq!(error.abort_reason().unwrap().to_string(), "shutting down");
            }
            other => panic!("expected an interruption, got {other:?}"),
        }
        assert_eq!(statuses.only().to_string(), "interrupted: shutting down");
        assert_eq!(rows(&locks, "repo").await, 0, "released before it resolved");
    });
}

#[test]
fn with_lock_whose_renewals_stop_resolves_with_lease_lost() {
    stores::on_stores_of_this_process(|store| async move {
        let stuck = unrenewed(&store).await;
        let statuses = Statuses::new();
        let outcome = {
            let statuses = statuses.clone();
            stuck
                .with_lock(LockRequest::exclusive("repo", "prune"), move |_| {
                    Scoped::<(), LockError>::new(move |scope| async move {
                        record_status(&scope, &statuses);
                        std::future::pending().await
                    })
                })
                .await
        };
        assert!(
            matches!(&outcome, Err(LockError::LeaseLost(why)) if why.before_expiry()),
            "{outcome:?}"
        );
        assert!(interrupted_with::<LeaseLost>(&statuses.only()));
        assert_eq!(rows(&stuck, "repo").await, 0);
    });
}

/// Three managers on `store` run `every` on one key, `recurrences` + 1 times on a fixed grid of
/// `interval`, holding it `at_least`; each run of the job notes when it began and ended (the
/// test's clock). Returns the runs, in order.
async fn fleet_runs(
    store: &stores::Store,
    interval: Duration,
    recurrences: usize,
    at_least: Duration,
) -> Vec<(Duration, Duration)> {
    let runs: Arc<Mutex<Vec<(Duration, Duration)>>> = Arc::default();
    let mut fleet = Vec::new();
    for _ in 0..3 {
        let locks = store.open().await;
        let runs = runs.clone();
        let schedule = Schedule::fixed(interval).intersect(Schedule::recurs(recurrences));
        let job = move || {
            let runs = runs.clone();
            Scoped::new(move |_| async move {
                let began = test_clock().monotonic();
                test_clock().sleep(Duration::from_millis(10)).await;
                runs.lock().unwrap().push((began, test_clock().monotonic()));
                Ok(())
            })
        };
        fleet.push(fork_daemon(locks.every("compact", schedule, at_least, job)));
    }
    for member in fleet {
        let done = join_within(WAIT, "a member's schedule", member).await;
        assert!(matches!(done, Exit::Success(Ok(()))), "{done:?}");
    }
    let mut runs = runs.lock().unwrap().clone();
    runs.sort();
    runs
}

/// Three managers run one job on a fixed grid: the runs never overlap, and each holds the key
/// at least `at_least` from its recurrence's start, so no two runs start closer than that.
#[test]
fn every_runs_a_job_at_most_once_at_a_time_across_three_managers() {
    stores::on_every_store(|store| async move {
        let at_least = Duration::from_millis(150);
        let runs = fleet_runs(&store, Duration::from_millis(200), 3, at_least).await;
        assert!(!runs.is_empty());
        for pair in runs.windows(2) {
            let ((began, ended), (next, _)) = (pair[0], pair[1]);
            assert!(ended <= next, "two runs overlapped: {runs:?}");
            // From the recurrence's start, which `began` (noted once the lock was got) follows
            // by the try's round trip: a few milliseconds on a busy machine.
            let apart = next - began;
            assert!(apart >= at_least - Duration::from_millis(25), "{runs:?}");
        }
    });
}

/// In a simulation, whose managers start together and whose time moves only when all wait, the
/// job runs exactly once per recurrence.
#[cfg(feature = "testkit")]
#[test]
fn every_runs_a_job_exactly_once_per_recurrence_in_a_simulation() {
    for seed in 0..20 {
        let runs = common::in_simulation(seed, |sim| {
            let store = stores::Store::simulated(sim);
            async move {
                let at_least = Duration::from_millis(900);
                fleet_runs(&store, Duration::from_secs(1), 4, at_least).await
            }
        });
        assert_eq!(runs.len(), 5, "seed {seed}: five recurrences, one run each");
    }
}

// Across processes: the child's side, and the cases that start it.

const STORE_VAR: &str = "LEASEHOLD_ELECTION_STORE";
#[cfg(feature = "postgres")]
const SCHEMA_VAR: &str = "LEASEHOLD_ELECTION_SCHEMA";
const CHANGES_VAR: &str = "LEASEHOLD_ELECTION_CHANGES";
/// The observer's poll, in seconds, if not the default.
const POLL_VAR: &str = "LEASEHOLD_ELECTION_POLL";

/// Microseconds since the machine's boot: one monotonic time line for every process.
fn since_boot() -> u128 {
    leasehold::SystemClock
        .boot_time()
        .expect("a boot clock (Linux)")
        .since_boot
        .as_micros()
}

/// The child's side. Returns at once unless this process was started as a child.
#[test]
fn child_entry() {
    let Some(role) = common::child::role() else {
        return;
    };
    futures::executor::block_on(async {
        match role.as_str() {
            "observe" => observe_in_child().await,
            "lead-unrenewed" => lead_unrenewed_in_child().await,
            other => panic!("unknown child role {other:?}"),
        }
    });
}

/// The store the parent named, opened with `builder`.
async fn open_in_child(builder: leasehold::LockManagerBuilder) -> LockManager {
    let store = std::env::var(STORE_VAR).expect("the store");
    if store.starts_with("postgres") {
        #[cfg(feature = "postgres")]
        {
            let schema = std::env::var(SCHEMA_VAR).expect("the schema");
            return builder.schema(&schema).connect(&store).await.unwrap();
        }
    }
    builder.open(&store).unwrap()
}

/// Prints each leader change of `scheduler`, numbered, until it has seen as many as asked.
async fn observe_in_child() {
    let changes: usize = std::env::var(CHANGES_VAR).unwrap().parse().unwrap();
    let mut builder = LockManager::builder();
    if let Ok(poll) = std::env::var(POLL_VAR) {
        builder = builder.poll(Duration::from_secs(poll.parse().unwrap()));
    }
    let locks = open_in_child(builder).await;
    let mut leaders = locks.observe("scheduler");
    for n in 0..changes {
        match leaders.next().await.expect("the stream goes on").unwrap() {
            Some(leader) => println!("change-{n}: {} {}", leader.term, leader.value),
            None => println!("change-{n}: none"),
        }
    }
}

/// Leads `scheduler` on a manager whose heartbeats never run, until its lease is about to run
/// out; reports when its body's clean-up ended, on the boot clock, and how `lead` ended.
async fn lead_unrenewed_in_child() {
    let dead: Arc<dyn Spawner> = Arc::new(|future: futures::future::BoxFuture<'static, ()>| {
        drop(future);
    });
    let builder = LockManager::builder()
        .lease(LEASE)
        .heartbeat(HEARTBEAT)
        .spawner(dead);
    let locks = open_in_child(builder).await;
    let led = locks
        .lead("scheduler", "child", |leadership| {
            println!("leading: {}", leadership.term());
            Scoped::<(), Interrupted>::new(|scope| async move {
                scope.add_finalizer(|_| async {
                    leasehold::SystemClock
                        .sleep(Duration::from_millis(50))
                        .await;
                    println!("cleaned-up: {}", since_boot());
                });
                std::future::pending().await
            })
        })
        .await;
    match led {
        Err(LeadError::Lock(LockError::LeaseLost(why))) if why.before_expiry() => {
            println!("ended: lease lost");
        }
        other => println!("ended: {other:?}"),
    }
}

/// The stores another process can share, each new: SQLite, and PostgreSQL if there is a
/// test server.
fn shared_stores() -> Vec<stores::Store> {
    let sqlite = stores::Store::sqlite();
    #[cfg(all(feature = "postgres", feature = "testkit"))]
    return std::iter::once(sqlite)
        .chain(stores::Store::postgres())
        .collect();
    #[cfg(not(all(feature = "postgres", feature = "testkit")))]
    vec![sqlite]
}

/// A child in `role` (see `child_entry`) on `store`, with `changes` for an observer.
fn child_on(store: &stores::Store, role: &str, changes: usize) -> common::child::Child {
    child_with(store, role, changes, None)
}

/// [`child_on`], with the observer's `poll` if given.
fn child_with(
    store: &stores::Store,
    role: &str,
    changes: usize,
    poll: Option<Duration>,
) -> common::child::Child {
    let mut command = common::child::Child::command("child_entry", role);
    command.env(CHANGES_VAR, changes.to_string());
    if let Some(poll) = poll {
        command.env(POLL_VAR, poll.as_secs().to_string());
    }
    match store {
        stores::Store::Sqlite { path, .. } => command.env(STORE_VAR, path),
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        stores::Store::Postgres { url, schema } => {
            command.env(STORE_VAR, url).env(SCHEMA_VAR, schema)
        }
        _ => panic!("not a store another process can share"),
    };
    common::child::Child::start(&mut command)
}

#[test]
fn case_e2_observe_in_another_process_sees_each_change_in_order() {
    for store in shared_stores() {
        eprintln!("=== on {}", store.name());
        futures::executor::block_on(async {
            let (a, b) = (store.open().await, store.open().await);
            let mut child = child_on(&store, "observe", 5);
            let limit = Duration::from_secs(20);
            assert_eq!(child.await_report("change-0:", limit), "none");
            let first = a.campaign("scheduler", "a").await.unwrap();
            let term = first.term();
            assert_eq!(child.await_report("change-1:", limit), format!("{term} a"));
            first.proclaim("a2").await.unwrap();
            assert_eq!(child.await_report("change-2:", limit), format!("{term} a2"));
            let next = start(&b, "scheduler", "b");
            within(WAIT, "b queues", || async {
                rows(&a, "scheduler").await == 2
            })
            .await;
            first.resign().await.unwrap();
            let second = leadership_of(next).await;
            let report = child.await_report("change-3:", limit);
            assert_eq!(report, format!("{} b", second.term()));
            second.resign().await.unwrap();
            assert_eq!(child.await_report("change-4:", limit), "none");
            child.assert_success(limit);
        });
    }
}

/// A leadership is announced to other processes when it is granted at once and when it ends by
/// a resignation or a drop, whoever waits: an observer whose own poll would take a minute sees
/// each within seconds. (On PostgreSQL a release that frees no waiter announces nothing
/// otherwise, and such an observer saw a resignation by its poll alone.)
#[test]
fn an_observer_in_another_process_hears_a_leader_come_and_go_without_its_poll() {
    for store in shared_stores() {
        eprintln!("=== on {}", store.name());
        futures::executor::block_on(async {
            let a = store.open().await;
            let slow = Some(Duration::from_secs(60));
            let mut child = child_with(&store, "observe", 5, slow);
            let limit = Duration::from_secs(20);
            assert_eq!(child.await_report("change-0:", limit), "none");
            let leading = a.campaign("scheduler", "a").await.unwrap();
            let term = leading.term();
            assert_eq!(child.await_report("change-1:", limit), format!("{term} a"));
            leading.resign().await.unwrap();
            assert_eq!(child.await_report("change-2:", limit), "none", "resigned");
            let leading = a.campaign("scheduler", "a").await.unwrap();
            let term = leading.term();
            assert_eq!(child.await_report("change-3:", limit), format!("{term} a"));
            drop(leading);
            assert_eq!(child.await_report("change-4:", limit), "none", "dropped");
            child.assert_success(limit);
        });
    }
}

#[test]
fn case_e2_a_leader_in_another_process_is_cleaned_up_before_the_next_leads() {
    for store in shared_stores() {
        eprintln!("=== on {}", store.name());
        futures::executor::block_on(async {
            let locks = store.open().await;
            let mut child = child_on(&store, "lead-unrenewed", 0);
            let limit = Duration::from_secs(20);
            let term: u64 = child.await_report("leading:", limit).parse().unwrap();
            let next_led = Arc::new(Mutex::new(None));
            let led = {
                let next_led = next_led.clone();
                locks.lead("scheduler", "parent", move |leadership| {
                    let term = leadership.term();
                    Scoped::<u64, Interrupted>::new(move |_| async move {
                        *next_led.lock().unwrap() = Some(since_boot());
                        Ok(term)
                    })
                })
            };
            let next_term = bounded(limit, "the next leader", led).await.unwrap();
            assert!(next_term > term, "terms strictly increase");
            let cleaned: u128 = child.await_report("cleaned-up:", limit).parse().unwrap();
            let next_led = next_led
                .lock()
                .unwrap()
                .expect("the next leader's body ran");
            assert!(
                cleaned < next_led,
                "the next leader's body began {} µs before the last one's clean-up ended",
                cleaned - next_led
            );
            assert_eq!(child.await_report("ended:", limit), "lease lost");
            child.assert_success(limit);
        });
    }
}
