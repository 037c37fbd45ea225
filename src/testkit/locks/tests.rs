//! The lock manager inside the simulation kit (`testkit::SimStore`): random workloads of
//! several simulated processes, with kills, stops and storage faults, judged by `check_locks`
//! and `check_cleanup`; and the bugs planted in the store double (`Planted`) that they must
//! find.
//!
//! A workload is drawn from one seed: two or three processes (managers on one store), each with
//! a few tasks that take, hold and give up locks on two keys (queued, `try_acquire`, `many`),
//! and for half the seeds one or two tasks that also take permits of a third key,
//! some interrupted while they wait (by a timeout, or by being dropped), some releasing by
//! `release`, by drop, or by the scope that adopted the guard; and a controller that kills one
//! process or stops one past its lease. Every process's connection meets drawn faults: busy
//! refusals, failed commits, lost answers, lost connections, latency and wall-clock steps, on a
//! store that judges leases as SQLite does (by the boot clock, which steps do not move) for odd
//! seeds and as PostgreSQL does (by its own stepped clock, estimated by its managers) for even
//! ones. The simulation's order of polls is drawn from the same seed, so a failure is one seed,
//! printed with the simulation's trace and the store's history.

use std::sync::Arc;
use std::time::Duration;

use futures::future::{select, Either};
use proptest::prelude::*;

use super::faults::Planted;
use crate::testkit::{
    check_cleanup, check_locks, Fault, FaultPlan, LockEvent, Sim, SimConfig, SimStore,
};
use std::sync::Mutex;

use futures::StreamExt;

use crate::{
    AbortController, AbortSignal, Clock, Interrupted, LeadError, LockError, LockManager,
    LockRequest, Mode, Scoped,
};

const LEASE: Duration = Duration::from_secs(3);
const HEARTBEAT: Duration = Duration::from_secs(1);
const KEYS: [&str; 2] = ["a", "b"];
/// The key of permits tasks (step key `KEYS.len()`), with [`SLOTS_LIMIT`] permits.
const SLOTS: &str = "slots";
const SLOTS_LIMIT: u32 = 2;
/// The election of leader tasks.
const LEADER: &str = "leader";

/// A small deterministic generator (SplitMix64), so that a workload is its seed.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn millis(&mut self, up_to: u64) -> Duration {
        Duration::from_millis(self.below(up_to + 1))
    }
}

/// How a task asks for a lock.
#[derive(Clone, Copy, Debug)]
enum Ask {
    Queued,
    Try,
    Many,
}

/// How a task lets go of a lock it holds.
#[derive(Clone, Copy, Debug)]
enum LetGo {
    Release,
    Drop,
    Scope,
}

#[derive(Clone, Debug)]
struct Step {
    ask: Ask,
    key: usize,
    mode: Mode,
    /// Given up after this long, by a timeout (`true`) or by dropping the acquisition.
    give_up: Option<(Duration, bool)>,
    hold: Duration,
    let_go: LetGo,
    /// A pause before the next step.
    pause: Duration,
}

#[derive(Clone, Debug)]
enum Disruption {
    Kill,
    Stop(Duration),
}

/// One term of a leader task: how long its body runs, and its clean-up takes (always well
/// within a heartbeat), and the pause before it campaigns again.
#[derive(Clone, Debug)]
struct Term {
    hold: Duration,
    clean_up: Duration,
    pause: Duration,
}

#[derive(Clone, Debug)]
struct Workload {
    processes: usize,
    /// Per task: its process and its steps.
    tasks: Vec<(usize, Vec<Step>)>,
    /// Per leader task: its process, and the terms it leads [`LEADER`] for.
    leaders: Vec<(usize, Vec<Term>)>,
    /// The processes with a task that observes [`LEADER`].
    observers: Vec<usize>,
    /// When, whom, what.
    disruptions: Vec<(Duration, usize, Disruption)>,
    fault_rate: f64,
}

/// A step's ask, on a key of `keys` keys (the last may be [`SLOTS`]).
fn drawn_step(draw: &mut Draw, keys: usize) -> Step {
    Step {
        ask: match draw.below(5) {
            0 => Ask::Try,
            1 => Ask::Many,
            _ => Ask::Queued,
        },
        key: draw.below(keys as u64) as usize,
        mode: if draw.chance(50) {
            Mode::Exclusive
        } else {
            Mode::Shared
        },
        give_up: draw
            .chance(25)
            .then(|| (draw.millis(2000), draw.chance(50))),
        hold: draw.millis(2500),
        let_go: match draw.below(3) {
            0 => LetGo::Release,
            1 => LetGo::Drop,
            _ => LetGo::Scope,
        },
        pause: draw.millis(500),
    }
}

impl Workload {
    fn drawn(seed: u64) -> Workload {
        let mut draw = Draw(seed);
        let processes = 2 + draw.below(2) as usize;
        let mut tasks = Vec::new();
        for process in 0..processes {
            for _ in 0..1 + draw.below(2) {
                let steps = (0..2 + draw.below(4))
                    .map(|_| drawn_step(&mut draw, KEYS.len()))
                    .collect();
                tasks.push((process, steps));
            }
        }
        let mut disruptions = Vec::new();
        if draw.chance(60) {
            let at = draw.millis(3000);
            let whom = draw.below(processes as u64) as usize;
            let what = if draw.chance(40) {
                Disruption::Kill
            } else {
                Disruption::Stop(LEASE + draw.millis(3000))
            };
            disruptions.push((at, whom, what));
        }
        let fault_rate = [0.0, 0.05, 0.15][draw.below(3) as usize];
        Workload {
            processes,
            tasks,
            leaders: Vec::new(),
            observers: Vec::new(),
            disruptions,
            fault_rate,
        }
    }

    /// The workload of `seed`, and for half the seeds one or two more tasks that also take
    /// permits of [`SLOTS`] (one or two of its two, alone or in a `many` beside a shared or
    /// exclusive key). Drawn from a stream of their own, so that the rest of the workload is
    /// the seed's as before.
    fn drawn_with_permits(seed: u64) -> Workload {
        let mut workload = Workload::drawn(seed);
        let mut draw = Draw(seed ^ 0x7065_726d_6974_7321);
        if draw.chance(50) {
            for _ in 0..1 + draw.below(2) {
                let process = draw.below(workload.processes as u64) as usize;
                let steps = (0..2 + draw.below(4))
                    .map(|_| drawn_step(&mut draw, KEYS.len() + 1))
                    .collect();
                workload.tasks.push((process, steps));
            }
        }
        workload
    }
}

impl Workload {
    /// [`drawn_with_permits`](Workload::drawn_with_permits), and for half the seeds one to
    /// three leader tasks that lead [`LEADER`] for one to three terms each, their bodies bound
    /// to the lease (`lead`), and a task that observes it. Drawn from a stream of their own.
    fn drawn_with_election(seed: u64) -> Workload {
        let mut workload = Workload::drawn_with_permits(seed);
        let mut draw = Draw(seed ^ 0x656c_6563_7469_6f6e);
        if draw.chance(50) {
            let processes = workload.processes as u64;
            for _ in 0..1 + draw.below(3) {
                let process = draw.below(processes) as usize;
                let terms = (0..1 + draw.below(3))
                    .map(|_| Term {
                        hold: draw.millis(2500),
                        clean_up: draw.millis(300),
                        pause: draw.millis(500),
                    })
                    .collect();
                workload.leaders.push((process, terms));
            }
            workload.observers.push(draw.below(processes) as usize);
        }
        workload
    }
}

/// Leads [`LEADER`] for each of `terms` on `locks`, until they end or its manager is gone.
async fn run_leader(locks: LockManager, clock: Arc<dyn Clock>, terms: Vec<Term>) {
    for term in terms {
        let (body_clock, hold, clean_up) = (clock.clone(), term.hold, term.clean_up);
        let led = locks
            .lead(LEADER, "leader", move |_| {
                Scoped::<(), Interrupted>::new(move |scope| async move {
                    let clock = body_clock.clone();
                    scope.add_finalizer(move |_| async move { clock.sleep(clean_up).await });
                    body_clock.sleep(hold).await;
                    Ok(())
                })
            })
            .await;
        if let Err(LeadError::Lock(LockError::Shutdown)) = led {
            return;
        }
        clock.sleep(term.pause).await;
    }
}

/// Observes [`LEADER`] on `locks` until `stop` aborts, noting each leader's term as seen.
async fn run_observer(locks: LockManager, stop: AbortSignal, seen: Arc<Mutex<Vec<Option<u64>>>>) {
    let mut leaders = locks.observe(LEADER);
    let watch = async {
        while let Some(leader) = leaders.next().await {
            if let Ok(leader) = leader {
                seen.lock().unwrap().push(leader.map(|leader| leader.term));
            }
        }
    };
    let stopped = stop.aborted();
    futures::pin_mut!(watch, stopped);
    let _ = select(watch, stopped).await;
}

/// Whether an observer saw the leaders in order: never a term older than one it saw before.
fn in_order(seen: &[Option<u64>]) -> bool {
    let terms: Vec<u64> = seen.iter().flatten().copied().collect();
    terms.windows(2).all(|pair| pair[0] <= pair[1])
}

/// The request of `step` (and for `many`, of a second key). On [`SLOTS`], an exclusive step
/// takes two permits and a shared one one.
fn requests(step: &Step) -> Vec<LockRequest> {
    let request = |key: usize| match KEYS.get(key) {
        Some(key) => LockRequest {
            key: (*key).to_owned(),
            mode: step.mode,
            operation: "work".to_owned(),
        },
        None => {
            let count = if step.mode == Mode::Exclusive { 2 } else { 1 };
            LockRequest::permits(SLOTS, "work", count, SLOTS_LIMIT)
        }
    };
    match step.ask {
        Ask::Many if step.key < KEYS.len() => vec![request(step.key), request(1 - step.key)],
        Ask::Many => vec![request(step.key), request(0)],
        _ => vec![request(step.key)],
    }
}

/// Runs one task's steps on `locks` until they end, or its manager is gone.
async fn run_task(locks: LockManager, clock: Arc<dyn Clock>, steps: Vec<Step>) {
    for step in steps {
        let requests = requests(&step);
        let acquired = match step.ask {
            Ask::Try => locks
                .try_acquire(requests[0].clone())
                .await
                .map(|guard| guard.ok_or(())),
            ask => {
                let acquisition = match ask {
                    Ask::Many => locks.many(requests),
                    _ => locks.acquire(requests[0].clone()),
                };
                match step.give_up {
                    None => acquisition.await.map(Ok),
                    Some((after, true)) => match acquisition.timeout(after).await {
                        Err(LockError::Interrupted(_)) => Ok(Err(())),
                        other => other.map(Ok),
                    },
                    Some((after, false)) => {
                        match select(acquisition, clock.sleep(after)).await {
                            Either::Left((acquired, _)) => acquired.map(Ok),
                            // Dropped while it waits: its rows must go.
                            Either::Right(_) => Ok(Err(())),
                        }
                    }
                }
            }
        };
        let guard = match acquired {
            Ok(Ok(guard)) => guard,
            Ok(Err(())) => {
                clock.sleep(step.pause).await;
                continue;
            }
            // Killed, or the store stayed busy past the busy schedule.
            Err(_) => return,
        };
        match step.let_go {
            LetGo::Release => {
                clock.sleep(step.hold).await;
                let _ = guard.release().await;
            }
            LetGo::Drop => {
                clock.sleep(step.hold).await;
                drop(guard);
            }
            LetGo::Scope => {
                let (clock, hold) = (clock.clone(), step.hold);
                let _ = Scoped::<(), LockError>::new(move |scope| async move {
                    scope.adopt(guard);
                    clock.sleep(hold).await;
                    Ok(())
                })
                .await;
            }
        }
        clock.sleep(step.pause).await;
    }
}

/// How far ahead of the store's time its managers' estimates of it run (`FaultPlan::estimate_ahead`):
/// as on PostgreSQL, whose clock judges leases while a process estimates it from its own.
const ESTIMATE_AHEAD: Duration = Duration::from_millis(5);

/// The store a drawn workload runs on, by its seed: odd seeds on one that judges leases as
/// SQLite does (`None`: by the boot clock, which the plan's clock steps do not move), even ones
/// on a PostgreSQL-like one (its own wall clock, which they step, estimated by its managers up
/// to `ESTIMATE_AHEAD` ahead).
fn like(seed: u64) -> Option<Duration> {
    (seed % 2 == 0).then_some(ESTIMATE_AHEAD)
}

/// Runs `workload` in a simulation of `seed`, with a bug `planted` in the store double if
/// any, on a store that judges
/// leases as SQLite does (`postgres_like` `None`) or as PostgreSQL does, the managers'
/// estimates of its time up to `postgres_like` ahead of it; `Err` says what broke, with what
/// to replay it by.
fn run(
    seed: u64,
    planted: Option<Planted>,
    postgres_like: Option<Duration>,
) -> Result<Run, String> {
    run_workload(
        seed,
        Workload::drawn_with_election(seed),
        planted,
        postgres_like,
    )
}

/// [`run`] with the workload given (drawn from `seed`, whose simulation runs it).
fn run_workload(
    seed: u64,
    workload: Workload,
    planted: Option<Planted>,
    postgres_like: Option<Duration>,
) -> Result<Run, String> {
    let config = SimConfig {
        seed,
        max_steps: 2_000_000,
        ..SimConfig::default()
    };
    let mut sim = Sim::with_config(config);
    let store = match postgres_like {
        None => SimStore::new(&sim),
        Some(_) => SimStore::like_postgres(&sim),
    };
    let estimate_ahead = postgres_like.unwrap_or_default();
    let clock: Arc<dyn Clock> = Arc::new(sim.clock());
    let spawner = sim.spawner();
    let owners = Arc::new(std::sync::Mutex::new(Vec::new()));
    let outcome = sim.block_on({
        let (store, workload, clock) = (store.clone(), workload.clone(), clock.clone());
        let owners = owners.clone();
        async move {
            let plan = || {
                let plan = FaultPlan::drawn(workload.fault_rate)
                    .latency(Duration::from_millis(5))
                    .clock_steps(Duration::from_millis(500))
                    .estimate_ahead(estimate_ahead);
                match planted {
                    Some(bug) => plan.planting(bug),
                    None => plan,
                }
            };
            let managers: Vec<LockManager> = (0..workload.processes)
                .map(|_| {
                    LockManager::builder()
                        .lease(LEASE)
                        .heartbeat(HEARTBEAT)
                        .open_simulated(&store, plan())
                })
                .collect::<Result<_, _>>()?;
            owners
                .lock()
                .unwrap()
                .extend(managers.iter().map(|m| m.owner_id().to_owned()));
            let mut done = Vec::new();
            for (process, steps) in workload.tasks.clone() {
                let (locks, clock) = (managers[process].clone(), clock.clone());
                let (tx, rx) = futures::channel::oneshot::channel::<()>();
                spawner.spawn(Box::pin(async move {
                    run_task(locks, clock, steps).await;
                    let _ = tx.send(());
                }));
                done.push(rx);
            }
            for (process, terms) in workload.leaders.clone() {
                let (locks, clock) = (managers[process].clone(), clock.clone());
                let (tx, rx) = futures::channel::oneshot::channel::<()>();
                spawner.spawn(Box::pin(async move {
                    run_leader(locks, clock, terms).await;
                    let _ = tx.send(());
                }));
                done.push(rx);
            }
            let stop_observers = AbortController::new();
            let mut observed = Vec::new();
            for &process in &workload.observers {
                let seen: Arc<Mutex<Vec<Option<u64>>>> = Arc::default();
                let (locks, stop) = (managers[process].clone(), stop_observers.signal());
                let (tx, rx) = futures::channel::oneshot::channel::<()>();
                spawner.spawn(Box::pin({
                    let seen = seen.clone();
                    async move {
                        run_observer(locks, stop, seen).await;
                        let _ = tx.send(());
                    }
                }));
                observed.push((seen, rx));
            }
            for (at, whom, what) in &workload.disruptions {
                clock.sleep(*at).await;
                match what {
                    Disruption::Kill => store.kill(&managers[*whom]),
                    Disruption::Stop(duration) => store.stop(&managers[*whom], *duration),
                }
            }
            for rx in done {
                let _ = rx.await;
            }
            stop_observers.abort("every task ended");
            for (seen, rx) in observed {
                let _ = rx.await;
                let seen = seen.lock().unwrap().clone();
                if !in_order(&seen) {
                    return Ok(Err(format!("an observer saw a leader go back: {seen:?}")));
                }
            }
            // Every task has ended: no row is left but a killed process's.
            let killed: Vec<String> = store
                .history()
                .events()
                .iter()
                .filter_map(|event| match event {
                    LockEvent::Killed { owner } => Some(owner.clone()),
                    _ => None,
                })
                .collect();
            // Each manager asked about its own rows: its commands are handled in order, so a
            // guard dropped by a task (its removal sent, not awaited) is gone by then.
            for locks in &managers {
                if killed.iter().any(|k| k == locks.owner_id()) {
                    continue;
                }
                let left: Vec<_> = locks
                    .inspect(None)
                    .await?
                    .into_iter()
                    .filter(|entry| entry.owner == locks.owner_id())
                    .collect();
                if !left.is_empty() {
                    return Ok(Err(format!("rows left once every task ended: {left:?}")));
                }
            }
            Ok::<_, LockError>(Ok(()))
        }
    });
    let owners = owners.lock().unwrap().clone();
    let history = store.history();
    let failed = |what: String| {
        let text = history.to_string();
        let lines: Vec<&str> = text.lines().collect();
        let shown = std::env::var("LEASEHOLD_SIM_EVENTS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(40);
        let tail = lines[lines.len().saturating_sub(shown)..].join("\n");
        format!(
            "{what}\nseed {seed}; replay the simulation with Sim::replay({:?})\n{workload:?}\n\
             last events:\n{tail}",
            sim.trace(),
        )
    };
    match outcome {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(what))) => return Err(failed(what)),
        Ok(Err(error)) => return Err(failed(format!("the workload failed: {error}"))),
        Err(error) => return Err(failed(format!("the simulation failed: {error}"))),
    }
    check_locks(&history).map_err(failed)?;
    check_cleanup(&sim.events()).map_err(|violation| failed(violation.to_string()))?;
    Ok(Run {
        grants: history.grants(),
        history: without_owner_ids(&history.to_string(), &owners),
    })
}

/// What a workload did: how many grants, and the store's history with each owner id replaced
/// by its process's number (ids name the test process and the time they were made).
#[derive(Debug, PartialEq, Eq)]
struct Run {
    grants: usize,
    history: String,
}

fn without_owner_ids(text: &str, owners: &[String]) -> String {
    owners
        .iter()
        .enumerate()
        .fold(text.to_owned(), |text, (n, owner)| {
            text.replace(owner.as_str(), &format!("process {n}"))
        })
}

/// How many workloads a run checks (`LEASEHOLD_SIM_CASES`, default 1,000).
fn cases() -> u64 {
    std::env::var("LEASEHOLD_SIM_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(1000)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases() as u32,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// The standing search: workloads of seeds drawn anew each run (a failure prints its seed,
    /// which `one_seed` replays).
    #[test]
    fn random_workloads_with_kills_stops_and_faults_keep_every_promise(seed in any::<u64>()) {
        let run = run(seed, None, like(seed));
        prop_assert!(run.is_ok(), "{}", run.unwrap_err());
    }
}

/// The same over the first seeds, every run: they take locks, and keep every promise.
#[test]
fn the_first_workloads_keep_every_promise() {
    let mut grants = 0;
    for seed in 0..cases() / 4 {
        match run(seed, None, like(seed)) {
            Ok(run) => grants += run.grants,
            Err(why) => panic!("{why}"),
        }
    }
    assert!(
        grants > (cases() / 4) as usize,
        "the workloads took locks: {grants} grants"
    );
}

/// The first seed a workload (of `workload`) with `bug` planted fails on, within the default
/// case count; its message must say `what` broke.
fn found(bug: Planted, workload: fn(u64) -> Workload, what: &str) {
    let found = (0..cases()).find_map(|seed| {
        run_workload(seed, workload(seed), Some(bug), Some(ESTIMATE_AHEAD))
            .err()
            .map(|why| (seed, why))
    });
    let (seed, why) = found.unwrap_or_else(|| panic!("{bug:?} not found in {} cases", cases()));
    eprintln!(
        "{bug:?} found by case {}: {}",
        seed + 1,
        why.lines().next().unwrap_or("")
    );
    assert!(
        why.contains(what),
        "{bug:?} found for another reason: {why}"
    );
}

#[test]
fn a_store_that_hides_held_exclusive_rows_is_found() {
    found(
        Planted::HidesHeldExclusive,
        Workload::drawn,
        "the grant rule forbids it",
    );
}

#[test]
fn a_store_that_hides_held_permits_is_found() {
    found(
        Planted::HidesHeldPermits,
        Workload::drawn_with_permits,
        "over the key's limit",
    );
}

#[test]
fn a_store_that_renews_with_a_stale_time_is_found() {
    found(
        Planted::RenewsWithStaleTime,
        Workload::drawn,
        "a renewal revived a lapsed row",
    );
}

// The worker's own bugs (forgetting that a removal whose answer was lost may have deleted its
// rows, say) are made by `cargo mutants` over its recovery (`scripts/mutants.sh`), not planted.

/// Every listed fault is applied at the transaction it names (recorded in the history), and
/// the manager rides over each: the worker retries on the busy schedule, in virtual time.
#[test]
fn listed_faults_are_applied_at_their_transactions_and_ridden_over() {
    let faults = [
        Fault::Busy,
        Fault::CommitFails,
        Fault::AnswerLost,
        Fault::ConnectionLost,
        Fault::Latency(Duration::from_millis(40)),
        Fault::ClockForward(Duration::from_millis(200)),
        Fault::ClockBack(Duration::from_millis(200)),
    ];
    for fault in faults {
        let mut sim = Sim::new(9);
        let store = SimStore::new(&sim);
        sim.block_on({
            let store = store.clone();
            async move {
                let plan = FaultPlan::none().with(1, fault);
                let locks = LockManager::builder().open_simulated(&store, plan)?;
                for _ in 0..3 {
                    locks.exclusive("k", "work").await?.release().await?;
                }
                Ok::<_, LockError>(())
            }
        })
        .unwrap()
        .unwrap_or_else(|error| panic!("{fault:?}: {error}"));
        let history = store.history();
        let noted: Vec<&LockEvent> = history
            .events()
            .iter()
            .filter(|event| matches!(event, LockEvent::Fault { .. }))
            .collect();
        assert_eq!(noted.len(), 1, "{fault:?}: {noted:?}");
        assert_eq!(history.grants(), 3, "{fault:?}");
        check_locks(&history).unwrap_or_else(|why| panic!("{fault:?}: {why}"));
    }
}

/// On a store that judges leases as SQLite does, steps of the wall clock far past the lease,
/// forward and back, while one manager holds and another waits, let no one in: the waiter is
/// granted only once the holder releases, the holder renews all along and hears no `lost()`.
#[test]
fn on_a_sqlite_like_store_no_clock_step_lets_a_waiter_in() {
    let mut sim = Sim::new(3);
    let store = SimStore::new(&sim);
    let clock = sim.clock();
    sim.block_on({
        let store = store.clone();
        async move {
            let step = 20 * LEASE;
            // Each manager's every transaction after its first steps the clock, one way then
            // the other (the store's clock is shared: each step is seen by both).
            let steps = |plan: FaultPlan| {
                (1..40).fold(plan, |plan, n| {
                    plan.with(
                        n,
                        if n % 2 == 0 {
                            Fault::ClockBack(step)
                        } else {
                            Fault::ClockForward(step)
                        },
                    )
                })
            };
            let open = || {
                LockManager::builder()
                    .lease(LEASE)
                    .heartbeat(HEARTBEAT)
                    .open_simulated(&store, steps(FaultPlan::none()))
            };
            let (holder, waiter) = (open()?, open()?);
            let held = holder.exclusive("k", "hold").await?;
            let waiting = waiter.exclusive("k", "wait");
            let waited = async {
                clock.sleep(4 * LEASE).await;
                None
            };
            futures::pin_mut!(waiting, waited);
            match select(waiting, waited).await {
                Either::Left((granted, _)) => {
                    panic!(
                        "granted over a live holder: {:?}",
                        granted.map(|g| g.fencing_token())
                    )
                }
                Either::Right((None::<()>, waiting)) => {
                    assert!(!held.lost().is_aborted(), "the holder lost its lease");
                    let token = held.fencing_token();
                    held.release().await?;
                    let next = waiting.await?;
                    assert!(next.fencing_token() > token);
                    next.release().await?;
                }
                Either::Right((Some(()), _)) => unreachable!(),
            }
            Ok::<_, LockError>(())
        }
    })
    .unwrap()
    .unwrap();
    let history = store.history();
    let steps = history
        .events()
        .iter()
        .filter(
            |event| matches!(event, LockEvent::Fault { fault, .. } if fault.starts_with("Clock")),
        )
        .count();
    assert!(steps >= 4, "{steps} clock steps");
    check_locks(&history).unwrap();
}

/// The seeds on which the search found bugs, kept as they were found (while the workload
/// generator stays as it is, each replays the same run): 1399, a `many` waiter of the same
/// manager never woken after a release whose answer was lost; 768, shared grants out of ticket
/// order (allowed: only conflicting grants are ordered); 5104, a check of this test's own that
/// raced a dropped guard's removal; 21344, a waiting request judged gone by a look, queued
/// again, while the wall clock stepped back made its old row live again: renewed for ever,
/// ahead of the request itself; 1504486325539948817, a wall clock stepped back that made a
/// lapsed waiting row live again for a connection that had judged it lapsed, which promoted
/// it beside the exclusive holder granted over it; 4016030577864982332, a `many` refused by
/// its own manager's rows, which ran out while the manager was stopped, never woken. These ran
/// with exact estimates of the store's time (the fault that skews them came later, and draws
/// from the same seed); 17138760511752577244 ran with it: a waiter whose holder was killed, its
/// look judging by an estimate ahead of the store that the holder's row had run out, and the
/// transaction (by the store's time) finding it live and promoting nothing, never woken again
/// (the PostgreSQL command test found the same).
#[test]
fn the_seeds_that_found_bugs_pass() {
    for seed in [
        768,
        1399,
        5104,
        21344,
        1504486325539948817,
        4016030577864982332,
    ] {
        // The workloads as they were when these seeds found their bugs: without permits.
        if let Err(why) = run_workload(seed, Workload::drawn(seed), None, Some(Duration::ZERO)) {
            panic!("{why}");
        }
    }
    let seed = 17138760511752577244;
    if let Err(why) = run_workload(seed, Workload::drawn(seed), None, Some(ESTIMATE_AHEAD)) {
        panic!("{why}");
    }
}

/// A failure replays: a seed gives the same history, event for event, every time.
#[test]
fn a_workload_is_its_seed() {
    for seed in [3, 17, 40] {
        let first = run(seed, None, like(seed)).unwrap();
        assert!(first.grants > 0);
        assert_eq!(first, run(seed, None, like(seed)).unwrap(), "seed {seed}");
    }
}

/// Two runs of one seed give their managers the same owner ids, drawn from the seed (not the
/// real clock), and so the same lock history, owners and all; another seed names them apart.
#[test]
fn a_seed_names_its_owners_and_gives_one_lock_history() {
    let run = |seed: u64| {
        let mut sim = Sim::new(seed);
        let store = SimStore::new(&sim);
        let owners = sim
            .block_on({
                let store = store.clone();
                async move {
                    let a = LockManager::builder().open_simulated(&store, FaultPlan::none())?;
                    let b = LockManager::builder().open_simulated(&store, FaultPlan::none())?;
                    let held = a.exclusive("k", "first").await?;
                    let waiter = crate::fork_daemon(b.exclusive("k", "second"));
                    held.release().await?;
                    let crate::Exit::Success(next) = waiter.join().await else {
                        panic!("the waiter ends with a guard");
                    };
                    next?.release().await?;
                    Ok::<_, LockError>([a.owner_id().to_owned(), b.owner_id().to_owned()])
                }
            })
            .unwrap()
            .unwrap();
        (owners, store.history())
    };
    let (owners, history) = run(5);
    assert_eq!(owners, ["sim:5:0", "sim:5:1"]);
    assert!(!history.events.is_empty());
    assert_eq!(run(5), (owners.clone(), history), "one seed, one history");
    assert_ne!(run(6).0, owners, "another seed, other owners");
}

/// A release whose commit took effect but whose answer was lost still lets through the
/// callers of the same manager waiting without a row (`many`): the retry finds the rows gone
/// and frees nothing more, so the worker must tell its waiters to look again. (The random
/// workloads found this: such a waiter waited for ever.) Whichever transaction loses its answer.
#[test]
fn a_release_whose_answer_was_lost_still_lets_a_waiter_of_the_same_manager_through() {
    for lost in 0..6 {
        let mut sim = Sim::new(lost);
        let store = SimStore::new(&sim);
        let clock = sim.clock();
        let waited = sim
            .block_on({
                let store = store.clone();
                async move {
                    let plan = FaultPlan::none().with(lost, Fault::AnswerLost);
                    let locks = LockManager::builder().open_simulated(&store, plan)?;
                    let both = || {
                        [
                            LockRequest::exclusive("a", "one"),
                            LockRequest::exclusive("b", "one"),
                        ]
                    };
                    let held = locks.many(both()).await?;
                    let waiter = crate::fork_daemon(locks.many(both()));
                    clock.sleep(Duration::from_millis(100)).await;
                    let _ = held.release().await;
                    let start = clock.monotonic();
                    let crate::Exit::Success(next) = waiter.join().await else {
                        panic!("the waiter ends with a guard");
                    };
                    let next = next?;
                    let waited = clock.monotonic() - start;
                    next.release().await?;
                    Ok::<_, LockError>(waited)
                }
            })
            .unwrap()
            .unwrap();
        assert!(
            waited < Duration::from_secs(1),
            "lost answer at transaction {lost}: waited {waited:?}"
        );
        check_locks(&store.history()).unwrap();
    }
}

/// Runs the one workload of `LEASEHOLD_SIM_SEED`, for a failure found by the others (with
/// `LEASEHOLD_SIM_EVENTS` to see more of its history):
/// `LEASEHOLD_SIM_SEED=768 cargo test --all-features --lib testkit::locks::tests::one_seed --
/// --ignored`.
#[test]
#[ignore = "replays the workload of LEASEHOLD_SIM_SEED"]
fn one_seed() {
    let seed = std::env::var("LEASEHOLD_SIM_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .expect("LEASEHOLD_SIM_SEED, a number");
    if let Err(why) = run(seed, None, like(seed)) {
        panic!("{why}");
    }
}
