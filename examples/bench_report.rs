//! A side-by-side report: the lock next to the baselines a user would compare it with, measured
//! in one run on one machine.
//!
//! ```text
//! cargo run --release --example bench_report              # the full run, a table for people
//! cargo run --release --example bench_report -- --quick   # under a minute on 2 cores
//! cargo run --release --example bench_report -- --json    # and one JSON object as the last line
//! # PostgreSQL: a throwaway server started for the run (as the tests do), or the one of --url
//! cargo run --release --features postgres --example bench_report -- --backend postgres
//! cargo run --release --features postgres --example bench_report -- --backend postgres --url URL
//! ```
//!
//! Every figure is measured in several rounds, interleaved: round 1 of every measurement, then
//! round 2, and so on, so that a slow spell of a shared machine falls on all of them rather than
//! on one. A figure is the median of its rounds (each round's value is itself a median over many
//! repetitions unless the name says otherwise), printed with the smallest and the largest round.
//! A target whose figures' rounds spread too far (largest − smallest > half the median) is not
//! counted as met: the verdict is "spread too wide", and the run should be repeated on a quieter
//! machine.
//!
//! SQLite databases are files in a temporary directory; PostgreSQL keeps each measurement in a
//! schema of its own (dropped at the end). Default settings unless stated.

#[cfg(all(feature = "postgres", feature = "testkit"))]
use leasehold::testkit::postgres as pg_support;

use std::cell::RefCell;
use std::fs::File;
use std::hint::black_box;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::executor::block_on;
use leasehold::{
    fork_daemon, Clock, Guard, Interrupted, LockManager, LockManagerBuilder, LockRequest, Scoped,
    Semaphore, SystemClock, TestClock,
};

type Error = Box<dyn std::error::Error>;

/// A target is not counted as met when a figure it reads has rounds further apart than this
/// share of its median.
const WIDE: f64 = 0.5;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let value_of = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    };
    let quick = args.iter().any(|a| a == "--quick");
    let json = args.iter().any(|a| a == "--json");
    let plan = Plan {
        quick,
        rounds: if quick { 3 } else { 5 },
    };
    let started = Instant::now();
    let report = match value_of("--backend").unwrap_or("sqlite") {
        "sqlite" => sqlite_report(&plan)?,
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        "postgres" => pg::report(&plan, value_of("--url"))?,
        #[cfg(not(all(feature = "postgres", feature = "testkit")))]
        "postgres" => return Err("this build has no PostgreSQL: add --features postgres".into()),
        other => return Err(format!("unknown backend {other:?}: sqlite or postgres").into()),
    };
    report.print_table(started.elapsed());
    if json {
        println!("{}", report.json());
    }
    Ok(())
}

/// How much to measure.
struct Plan {
    quick: bool,
    rounds: usize,
}

impl Plan {
    /// Repetitions in one round, of `full` (or `quick`) in all.
    fn per_round(&self, full: usize, quick: usize) -> usize {
        (if self.quick { quick } else { full } / self.rounds).max(1)
    }

    fn seconds(&self, full: f64, quick: f64) -> Duration {
        Duration::from_secs_f64(if self.quick { quick } else { full })
    }
}

/// One measurement: each call of `round` measures once more and gives one value per figure.
struct Measure<'a> {
    figures: Vec<&'static str>,
    round: Box<dyn FnMut() -> Result<Vec<f64>, Error> + 'a>,
}

fn measure<'a>(
    figures: &[&'static str],
    round: impl FnMut() -> Result<Vec<f64>, Error> + 'a,
) -> Measure<'a> {
    Measure {
        figures: figures.to_vec(),
        round: Box::new(round),
    }
}

/// Round 1 of every measurement, then round 2, and so on.
/// A round that fails is reported, and the targets that read its figures are judged "round
/// failed"; the run goes on.
fn run_rounds(report: &mut Report, measures: &mut [Measure<'_>], rounds: usize) {
    eprintln!("set up in {:.1} s", report.started.elapsed().as_secs_f64());
    for round in 1..=rounds {
        eprintln!("round {round} of {rounds}");
        for measure in measures.iter_mut() {
            let started = Instant::now();
            let values = match (measure.round)() {
                Ok(values) => values,
                Err(error) => {
                    eprintln!("  round {round} of {:?} failed: {error}", measure.figures);
                    for key in &measure.figures {
                        report
                            .failures
                            .push((key, format!("round {round}: {error}")));
                    }
                    continue;
                }
            };
            let took = started.elapsed().as_secs_f64();
            for (key, value) in measure.figures.iter().zip(values) {
                eprintln!("  measured {key} = {value:.1} (round took {took:.1} s)");
                report.add(key, value);
            }
        }
    }
}

/// Where a measurement's lock managers keep their rows: one database per name, the same one
/// for the same name.
type Open<'a> = &'a dyn Fn(&str, LockManagerBuilder) -> Result<LockManager, Error>;

fn sqlite_report(plan: &Plan) -> Result<Report, Error> {
    let mut report = Report::new("sqlite", plan.rounds);
    let dir = tempfile::tempdir()?;
    let opened = RefCell::new(Vec::new());
    let open = |name: &str, builder: LockManagerBuilder| -> Result<LockManager, Error> {
        let locks = builder.open(dir.path().join(format!("{name}.db")))?;
        opened.borrow_mut().push(locks.clone());
        Ok(locks)
    };
    let conn = sqlite::open(dir.path().join("raw.db"))?;
    conn.execute(
        "PRAGMA page_size = 1024; PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;
         PRAGMA busy_timeout = 5000;
         CREATE TABLE t (id INTEGER PRIMARY KEY, key TEXT NOT NULL);",
    )?;
    // The storage floor: one write transaction with the `sqlite` crate and the lock manager's
    // pragmas (its page size included: a commit's cost follows the bytes of the pages it
    // writes).
    let raw: Floor<'_> = (
        "raw_txn_us",
        Box::new(|| {
            conn.execute(
                "BEGIN IMMEDIATE; INSERT INTO t (key) VALUES ('k'); DELETE FROM t; COMMIT;",
            )?;
            Ok(())
        }),
    );
    let mut measures = vec![cycle_against_floor(
        open("uncontended", LockManager::builder())?,
        vec![raw],
        plan.per_round(10_000, 2_000),
    )];
    measures.extend(scale_measures(plan, &open));
    measures.push(handoff_in_process(plan, &open)?);
    for kind in ["lock", "flock"] {
        let target = dir.path().join(format!("cross-{kind}.db"));
        let target = target
            .to_str()
            .ok_or("a temporary path that is not UTF-8")?;
        measures.push(handoff_cross_process(
            if kind == "lock" {
                "handoff_cross_process_p50_us"
            } else {
                "flock_handoff_cross_process_p50_us"
            },
            Ends::same(kind, target, ""),
            dir.path().to_owned(),
            plan.per_round(300, 60),
        ));
    }
    measures.extend(common_measures(plan, &open)?);
    run_rounds(&mut report, &mut measures, plan.rounds);
    drop(measures);
    shut_down(&opened.borrow())?;
    sqlite_targets(&mut report);
    Ok(report)
}

/// Stops every manager, so that nothing is left renewing or waiting.
fn shut_down(opened: &[LockManager]) -> Result<(), Error> {
    block_on(async {
        for locks in opened {
            locks.shutdown().await?;
        }
        Ok(())
    })
}

/// The measurements both backends make with the lock manager alone, after the handoffs.
fn common_measures<'a>(plan: &Plan, open: Open<'a>) -> Result<Vec<Measure<'a>>, Error> {
    let window = plan.seconds(2.0, 1.0);
    let mut measures = Vec::new();
    for waiters in [10, 1_000] {
        measures.push(waiting(open, waiters, window));
    }
    measures.push(heartbeat_write_txn_per_round(open, 1_000)?);
    let seconds = plan.seconds(2.0, 1.0);
    let contended = open("contended", LockManager::builder())?;
    measures.push(measure(&["contended_ops_per_s"], move || {
        Ok(vec![contended_ops_per_s(&contended, seconds)?])
    }));
    measures.push(measure(&["rwlock_ops_per_s"], move || {
        Ok(vec![rwlock_ops_per_s(seconds)])
    }));
    let reps = plan.per_round(200_000, 50_000);
    measures.push(measure(&["scope_cycle_ns"], move || {
        Ok(vec![scope_cycle_ns(reps)])
    }));
    let reps = plan.per_round(2_000_000, 500_000);
    measures.push(measure(
        &[
            "semaphore_cycle_ns",
            "async_lock_semaphore_cycle_ns",
            "async_lock_semaphore_arc_cycle_ns",
        ],
        move || Ok(semaphore_cycle_ns(reps)),
    ));
    Ok(measures)
}

/// A figure and the operation it times, measured beside the uncontended cycle.
type Floor<'a> = (&'static str, Box<dyn FnMut() -> Result<(), Error> + 'a>);

/// The floors (each operation of `floors`, timed) and an exclusive acquire + release of a free
/// key, `reps` times each per round, in interleaved batches so that all see the same machine:
/// on a shared virtual machine the speed of a whole batch can shift by a fifth from one second
/// to the next. The uncontended cycle is the second figure, after the first floor.
fn cycle_against_floor<'a>(
    locks: LockManager,
    mut floors: Vec<Floor<'a>>,
    reps: usize,
) -> Measure<'a> {
    const BATCHES: usize = 4;
    let mut figures: Vec<&'static str> = floors.iter().map(|(key, _)| *key).collect();
    figures.insert(1, "uncontended_cycle_us");
    Measure {
        figures,
        round: Box::new(move || {
            let mut samples = vec![Vec::with_capacity(reps); floors.len() + 1];
            for _ in 0..BATCHES {
                for (i, (_, op)) in floors.iter_mut().enumerate() {
                    let i = if i == 0 { 0 } else { i + 1 };
                    for _ in 0..reps / BATCHES {
                        let started = Instant::now();
                        op()?;
                        samples[i].push(micros(started.elapsed()));
                    }
                }
                let cycles = timed_cycles(&locks, reps / BATCHES, Duration::MAX)?;
                samples[1].extend(cycles);
            }
            Ok(samples.iter_mut().map(|s| median(s)).collect())
        }),
    }
}

/// Exclusive acquire + release of the key "probe", `reps` times or until `budget` has passed
/// (at least 10 times), in microseconds each.
fn timed_cycles(locks: &LockManager, reps: usize, budget: Duration) -> Result<Vec<f64>, Error> {
    let started = Instant::now();
    block_on(async {
        let mut samples = Vec::with_capacity(reps);
        while samples.len() < reps && (samples.len() < 10 || started.elapsed() < budget) {
            let started = Instant::now();
            let guard = locks.exclusive("probe", "bench").await?;
            guard.release().await?;
            samples.push(micros(started.elapsed()));
        }
        Ok(samples)
    })
}

/// The uncontended cycle while other keys are held (and waited for): an operation on one key
/// should not pay for the rows of others. Each round sets up a fresh database (not timed) and
/// shuts it down after, so that its rows and renewals weigh on no other measurement.
fn scale_measures<'a>(plan: &Plan, open: Open<'a>) -> Vec<Measure<'a>> {
    let reps = plan.per_round(1_000, 300);
    let budget = plan.seconds(1.0, 0.5);

    let mut round = 0;
    let held_10k = measure(&["uncontended_cycle_10k_held_us"], move || {
        round += 1;
        let locks = open(&format!("scale-held-{round}"), LockManager::builder())?;
        let started = Instant::now();
        let guards = hold(&locks, 10_000)?;
        eprintln!(
            "  (10,000 keys held in {:.1} s)",
            started.elapsed().as_secs_f64()
        );
        let cycles = timed_cycles(&locks, reps, budget);
        block_on(locks.shutdown())?;
        drop(guards);
        Ok(vec![median(&mut cycles?)])
    });

    // One manager holds 1,000 keys; a second one, on the same database, waits for each.
    let mut round = 0;
    let waiting_1k = measure(&["uncontended_cycle_1k_waiting_us"], move || {
        round += 1;
        let name = format!("scale-waiting-{round}");
        let (holder, waiter) = (
            open(&name, LockManager::builder())?,
            open(&name, LockManager::builder())?,
        );
        let started = Instant::now();
        let guards = hold(&holder, 1_000)?;
        let fibers: Vec<_> = (0..1_000)
            .map(|i| {
                let waiter = waiter.clone();
                fork_daemon(async move { waiter.exclusive(held_key(i), "waiting").await })
            })
            .collect();
        block_on(async {
            while holder.inspect(None).await?.len() < 2_000 {
                SystemClock.sleep(Duration::from_millis(20)).await;
            }
            Ok::<_, Error>(())
        })?;
        eprintln!(
            "  (1,000 keys held and waited for in {:.1} s)",
            started.elapsed().as_secs_f64()
        );
        let cycles = timed_cycles(&holder, reps, budget);
        block_on(async {
            waiter.shutdown().await?;
            holder.shutdown().await?;
            for fiber in fibers {
                fiber.join().await;
            }
            Ok::<_, Error>(())
        })?;
        drop(guards);
        Ok(vec![median(&mut cycles?)])
    });
    vec![held_10k, waiting_1k]
}

fn held_key(i: usize) -> String {
    format!("held {i}")
}

/// `count` keys held exclusively by `locks`, taken 500 to a transaction (`many`) to set up fast.
fn hold(locks: &LockManager, count: usize) -> Result<Vec<Guard>, Error> {
    const CHUNK: usize = 500;
    block_on(async {
        let mut guards = Vec::new();
        for start in (0..count).step_by(CHUNK) {
            let chunk = (start..count.min(start + CHUNK))
                .map(|i| LockRequest::exclusive(held_key(i), "held"));
            guards.push(locks.many(chunk).await?);
        }
        Ok(guards)
    })
}

/// From the call to `release()` to the waiting task holding its guard, in one manager whose
/// `poll` is 30 s: only the in-process wake-up can do it. Timed from the call, not from
/// `release()` returning, since the waiter is often granted inside the release's own
/// transaction, before `release()` returns (which made many samples 0).
fn handoff_in_process<'a>(plan: &Plan, open: Open<'a>) -> Result<Measure<'a>, Error> {
    let locks = open(
        "in-process",
        LockManager::builder().poll(Duration::from_secs(30)),
    )?;
    let reps = plan.per_round(1_000, 200);
    Ok(measure(
        &[
            "handoff_in_process_from_release_call_p50_us",
            "handoff_in_process_from_release_call_p99_us",
        ],
        move || {
            let mut samples = block_on(handoffs_in_process(&locks, reps))?;
            Ok(vec![
                percentile(&mut samples, 0.5),
                percentile(&mut samples, 0.99),
            ])
        },
    ))
}

async fn handoffs_in_process(locks: &LockManager, reps: usize) -> Result<Vec<f64>, Error> {
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let holder = locks.exclusive("key", "holder").await?;
        let waiter = {
            let locks = locks.clone();
            fork_daemon(async move {
                let guard = locks.exclusive("key", "waiter").await;
                (Instant::now(), guard)
            })
        };
        while locks.inspect(Some("key")).await?.len() < 2 {
            SystemClock.sleep(Duration::from_micros(200)).await;
        }
        let released = Instant::now();
        holder.release().await?;
        let (granted, guard) = waiter.join().await.success().ok_or("the waiter failed")?;
        samples.push(micros(granted.saturating_duration_since(released)));
        guard?.release().await?;
    }
    Ok(samples)
}

/// The two processes of a cross-process handoff: what each side locks with (`kind`), and
/// where (`target`, and `detail`: a schema or an advisory lock's name).
#[derive(Clone)]
struct Ends {
    kind: &'static str,
    ours: String,
    theirs: String,
    detail: String,
}

impl Ends {
    fn same(kind: &'static str, target: &str, detail: &str) -> Ends {
        Ends {
            kind,
            ours: target.into(),
            theirs: target.into(),
            detail: detail.into(),
        }
    }
}

/// Two processes pass one lock back and forth (each holds it 2 ms); a handoff is the time from
/// one side's release returning to the other side holding it. A child process per round.
fn handoff_cross_process<'a>(
    figure: &'static str,
    ends: Ends,
    dir: PathBuf,
    rounds: usize,
) -> Measure<'a> {
    let mut round = 0;
    measure(&[figure], move || {
        round += 1;
        let child_events = dir.join(format!("{figure}-{round}.events"));
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--child", ends.kind, &ends.theirs])
            .arg(&child_events)
            .args([&rounds.to_string(), &ends.detail])
            .spawn()?;
        let ours = ping_pong(ends.kind, &ends.ours, &ends.detail, rounds);
        let status = wait_with_deadline(&mut child, Duration::from_secs(120))?;
        let ours = ours?;
        if !status.success() {
            return Err(format!("the {} child failed: {status}", ends.kind).into());
        }
        let theirs = read_events(&child_events)?;
        let mut samples = handoffs(&ours, &theirs);
        if samples.len() < rounds / 4 {
            return Err(format!(
                "the {} lock changed hands only {} times in {rounds} rounds",
                ends.kind,
                samples.len()
            )
            .into());
        }
        Ok(vec![median(&mut samples)])
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Event {
    Granted(u64),
    Released(u64),
}

/// One side of a cross-process handoff. `kind`: "lock" (a lock manager on the SQLite file
/// `target`), "flock" (an OS file lock on the file `target`), "pg-lock" (a lock manager on the
/// PostgreSQL of `target`, in the schema `detail`), "advisory" (PostgreSQL's advisory lock named
/// `detail`, on the server of `target`).
#[cfg_attr(
    not(all(feature = "postgres", feature = "testkit")),
    allow(unused_variables)
)]
fn ping_pong(kind: &str, target: &str, detail: &str, rounds: usize) -> Result<Vec<Event>, Error> {
    let mut events = Vec::with_capacity(2 * rounds);
    let hold = Duration::from_millis(2);
    // After releasing, wait before asking again, so that the other side (already waiting) takes
    // its turn even under an unfair lock: this pause is outside every measured interval.
    let rest = Duration::from_millis(1);
    let locks = match kind {
        "lock" => Some(LockManager::open(target)?),
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        "pg-lock" => Some(pg::connect(target, detail)?),
        _ => None,
    };
    if let Some(locks) = locks {
        block_on(async {
            for _ in 0..rounds {
                let guard = locks.exclusive("ball", "ping-pong").await?;
                events.push(Event::Granted(unix_micros()));
                SystemClock.sleep(hold).await;
                guard.release().await?;
                events.push(Event::Released(unix_micros()));
                SystemClock.sleep(rest).await;
            }
            Ok::<(), Error>(())
        })?;
        return Ok(events);
    }
    match kind {
        "flock" => {
            let file = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(target)?;
            for _ in 0..rounds {
                fs4::FileExt::lock(&file)?;
                events.push(Event::Granted(unix_micros()));
                std::thread::sleep(hold);
                fs4::FileExt::unlock(&file)?;
                events.push(Event::Released(unix_micros()));
                std::thread::sleep(rest);
            }
        }
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        "advisory" => {
            let mut client = postgres::Client::connect(target, postgres::NoTls)?;
            let lock = client.prepare("SELECT pg_advisory_lock(hashtext($1))")?;
            let unlock = client.prepare("SELECT pg_advisory_unlock(hashtext($1))")?;
            for _ in 0..rounds {
                client.execute(&lock, &[&detail])?;
                events.push(Event::Granted(unix_micros()));
                std::thread::sleep(hold);
                client.execute(&unlock, &[&detail])?;
                events.push(Event::Released(unix_micros()));
                std::thread::sleep(rest);
            }
        }
        other => return Err(format!("unknown lock kind {other:?}").into()),
    }
    Ok(events)
}

/// Pairs each release by one side with the next grant, when that grant went to the other side.
fn handoffs(ours: &[Event], theirs: &[Event]) -> Vec<f64> {
    let mut all: Vec<(u64, bool, usize)> = Vec::new();
    for (side, events) in [ours, theirs].into_iter().enumerate() {
        for event in events {
            match *event {
                Event::Granted(t) => all.push((t, true, side)),
                Event::Released(t) => all.push((t, false, side)),
            }
        }
    }
    all.sort_unstable();
    let mut samples = Vec::new();
    let mut last_release: Option<(u64, usize)> = None;
    for (t, granted, side) in all {
        if granted {
            if let Some((released, by)) = last_release.take() {
                if by != side {
                    samples.push(t.saturating_sub(released) as f64);
                }
            }
        } else {
            last_release = Some((t, side));
        }
    }
    samples
}

fn read_events(path: &Path) -> Result<Vec<Event>, Error> {
    let text = std::fs::read_to_string(path)?;
    let mut events = Vec::new();
    for line in text.lines() {
        let (what, t) = line.split_once(' ').ok_or("a malformed event line")?;
        let t: u64 = t.parse()?;
        events.push(if what == "granted" {
            Event::Granted(t)
        } else {
            Event::Released(t)
        });
    }
    Ok(events)
}

fn child(args: &[String]) -> Result<(), Error> {
    let [kind, target, out, rounds, detail] = args else {
        return Err("usage: --child KIND TARGET OUT ROUNDS DETAIL".into());
    };
    let events = ping_pong(kind, target, detail, rounds.parse()?)?;
    let mut file = File::create(PathBuf::from(out))?;
    for event in events {
        match event {
            Event::Granted(t) => writeln!(file, "granted {t}")?,
            Event::Released(t) => writeln!(file, "released {t}")?,
        }
    }
    Ok(())
}

fn wait_with_deadline(
    child: &mut Child,
    limit: Duration,
) -> std::io::Result<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            child.kill()?;
            return child.wait();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Write transactions and change checks per second while `waiters` tasks wait on a held key,
/// counted over `window`. Each round sets up a fresh database and shuts it down after.
fn waiting<'a>(open: Open<'a>, waiters: usize, window: Duration) -> Measure<'a> {
    let figures: &[&'static str] = if waiters == 10 {
        &[
            "waiting_write_txn_per_s_10",
            "waiting_change_checks_per_s_10",
        ]
    } else {
        &[
            "waiting_write_txn_per_s_1000",
            "waiting_change_checks_per_s_1000",
        ]
    };
    let mut round = 0;
    measure(figures, move || {
        round += 1;
        let locks = open(
            &format!("waiting-{waiters}-{round}"),
            LockManager::builder(),
        )?;
        block_on(async {
            let holder = locks.exclusive("key", "holder").await?;
            let fibers: Vec<_> = (0..waiters)
                .map(|i| {
                    let locks = locks.clone();
                    fork_daemon(async move { locks.shared("key", format!("waiter {i}")).await })
                })
                .collect();
            while locks.inspect(Some("key")).await?.len() < waiters + 1 {
                SystemClock.sleep(Duration::from_millis(5)).await;
            }
            let before = locks.stats();
            SystemClock.sleep(window).await;
            let after = locks.stats();
            locks.shutdown().await?;
            for fiber in fibers {
                fiber.join().await;
            }
            drop(holder);
            let per_s = |n: u64| n as f64 / window.as_secs_f64();
            Ok(vec![
                per_s(after.write_transactions - before.write_transactions),
                per_s(after.change_checks - before.change_checks),
            ])
        })
    })
}

/// Write transactions in one heartbeat round while `count` locks are held (a test clock moves
/// time, so the round is exactly one).
fn heartbeat_write_txn_per_round<'a>(open: Open<'a>, count: usize) -> Result<Measure<'a>, Error> {
    let clock = TestClock::new();
    let heartbeat = Duration::from_secs(5);
    let locks = open(
        "heartbeat",
        LockManager::builder()
            .heartbeat(heartbeat)
            .clock(Arc::new(clock.clone())),
    )?;
    // Taken all at once: the set-up is not what is measured.
    let started = Instant::now();
    let guards = block_on(futures::future::try_join_all(
        (0..count).map(|i| locks.shared(format!("key {i}"), "held")),
    ))?;
    eprintln!(
        "{count} locks for the heartbeat taken in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(measure(
        &["heartbeat_write_txn_per_round_1000_locks"],
        move || {
            let _held = &guards;
            block_on(async {
                while clock.sleepers() == 0 {
                    SystemClock.sleep(Duration::from_millis(1)).await;
                }
                let before = locks.stats();
                // One round, however many moves of the clock it takes: once, on PostgreSQL, no
                // round followed a move (the worker may answer a beat with its last renewal,
                // which it dates by the server's time, not by this clock), and this loop waited
                // for good.
                let mut moves = 0;
                while locks.stats().heartbeats == before.heartbeats {
                    clock.advance(heartbeat);
                    moves += 1;
                    let deadline = Instant::now() + Duration::from_secs(3);
                    while locks.stats().heartbeats == before.heartbeats && Instant::now() < deadline
                    {
                        SystemClock.sleep(Duration::from_millis(1)).await;
                    }
                }
                if moves > 1 {
                    eprintln!("  (the heartbeat round took {moves} moves of the test clock)");
                }
                Ok(vec![
                    (locks.stats().write_transactions - before.write_transactions) as f64,
                ])
            })
        },
    ))
}

/// A tiny generator, so that every task draws its own keys and modes.
fn draw(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

const TASKS: u64 = 16;
const KEYS: u64 = 4;

/// Lock operations per second with 16 tasks over 4 keys, 80 % shared, holding for no time.
fn contended_ops_per_s(locks: &LockManager, duration: Duration) -> Result<f64, Error> {
    let ops = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (locks, ops) = (locks.clone(), ops.clone());
            async move {
                let mut state = 0x9e37_79b9_7f4a_7c15 ^ (task + 1);
                while Instant::now() < deadline {
                    let key = format!("key {}", draw(&mut state) % KEYS);
                    let request = if draw(&mut state) % 5 == 0 {
                        LockRequest::exclusive(key, "write")
                    } else {
                        LockRequest::shared(key, "read")
                    };
                    locks.acquire(request).await?.release().await?;
                    ops.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<(), leasehold::LockError>(())
            }
        })
        .collect();
    for result in block_on(futures::future::join_all(tasks)) {
        result?;
    }
    Ok(ops.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// The same workload on `async-lock`'s `RwLock` per key, in memory: the in-memory ceiling.
fn rwlock_ops_per_s(duration: Duration) -> f64 {
    let keys: Arc<Vec<async_lock::RwLock<()>>> =
        Arc::new((0..KEYS).map(|_| async_lock::RwLock::new(())).collect());
    let ops = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (keys, ops) = (keys.clone(), ops.clone());
            async move {
                let mut state = 0x9e37_79b9_7f4a_7c15 ^ (task + 1);
                let mut done = 0u64;
                while Instant::now() < deadline {
                    let key = &keys[(draw(&mut state) % KEYS) as usize];
                    if draw(&mut state) % 5 == 0 {
                        drop(black_box(key.write().await));
                    } else {
                        drop(black_box(key.read().await));
                    }
                    done += 1;
                    if done % 64 == 0 {
                        // Let the other tasks in: these locks never make a task wait.
                        yield_now().await;
                    }
                }
                ops.fetch_add(done, Ordering::Relaxed);
            }
        })
        .collect();
    block_on(futures::future::join_all(tasks));
    ops.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Gives the other tasks of this executor a turn.
async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

fn scope_cycle_ns(reps: usize) -> f64 {
    block_on(async {
        let mut samples = Vec::new();
        for _ in 0..10 {
            let started = Instant::now();
            for _ in 0..reps / 10 {
                let value = Scoped::<u32, Interrupted>::new(|scope| async move {
                    for _ in 0..3 {
                        scope.add_finalizer(|status| async move {
                            black_box(status);
                        });
                    }
                    Ok(1)
                })
                .await;
                black_box(value.ok());
            }
            samples.push(started.elapsed().as_nanos() as f64 / (reps / 10) as f64);
        }
        median(&mut samples)
    })
}

/// Ours (whose permit is owned: `'static`, so it can be handed to a scope), `async-lock`'s with
/// its borrowed guard (`acquire`), and with its owned guard (`acquire_arc`), like for like.
fn semaphore_cycle_ns(reps: usize) -> Vec<f64> {
    let ours = Semaphore::new(1);
    let theirs = Arc::new(async_lock::Semaphore::new(1));
    block_on(async {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let per = |started: Instant| started.elapsed().as_nanos() as f64 / (reps / 10) as f64;
        // Interleaved batches, so that all three see the same machine.
        for _ in 0..10 {
            let started = Instant::now();
            for _ in 0..reps / 10 {
                drop(black_box(ours.acquire(1).await));
            }
            a.push(per(started));
            let started = Instant::now();
            for _ in 0..reps / 10 {
                drop(black_box(theirs.acquire().await));
            }
            b.push(per(started));
            let started = Instant::now();
            for _ in 0..reps / 10 {
                drop(black_box(theirs.acquire_arc().await));
            }
            c.push(per(started));
        }
        vec![median(&mut a), median(&mut b), median(&mut c)]
    })
}

// ----------------------------------------------------------------------------------------------
// The report: figures with their rounds, targets, the table and the JSON line.

/// What a figure should be, judged from the medians of one run.
struct Target {
    figure: &'static str,
    text: String,
    met: bool,
    /// Every figure the judgement reads (the figure itself, and those it is compared with).
    reads: Vec<&'static str>,
}

struct Report {
    backend: &'static str,
    rounds: usize,
    /// Each figure's value in every round, in the order first measured.
    figures: Vec<(&'static str, Vec<f64>)>,
    targets: Vec<Target>,
    notes: Vec<String>,
    /// Rounds that failed, by figure.
    failures: Vec<(&'static str, String)>,
    /// When the set-up began.
    started: Instant,
}

impl Report {
    fn new(backend: &'static str, rounds: usize) -> Report {
        Report {
            backend,
            rounds,
            figures: Vec::new(),
            targets: Vec::new(),
            notes: Vec::new(),
            failures: Vec::new(),
            started: Instant::now(),
        }
    }

    fn add(&mut self, key: &'static str, value: f64) {
        match self.figures.iter_mut().find(|(k, _)| *k == key) {
            Some((_, values)) => values.push(value),
            None => self.figures.push((key, vec![value])),
        }
    }

    fn rounds_of(&self, key: &str) -> &[f64] {
        self.figures
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(&[], |(_, values)| values.as_slice())
    }

    /// The median of a figure's rounds (NaN for a figure not measured).
    fn get(&self, key: &str) -> f64 {
        median(&mut self.rounds_of(key).to_vec())
    }

    fn min_max(&self, key: &str) -> (f64, f64) {
        let values = self.rounds_of(key);
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (min, max)
    }

    /// Whether a figure's rounds are further apart than [`WIDE`] of its median.
    fn too_wide(&self, key: &str) -> bool {
        let (min, max) = self.min_max(key);
        max - min > WIDE * self.get(key).abs().max(1.0)
    }

    /// "yes", "NO", or "spread too wide" for a target met by figures whose rounds disagree.
    fn verdict(&self, target: &Target) -> &'static str {
        if target
            .reads
            .iter()
            .any(|key| self.failures.iter().any(|(k, _)| k == key))
        {
            "round failed"
        } else if !target.met {
            "NO"
        } else if target.reads.iter().any(|key| self.too_wide(key)) {
            "spread too wide"
        } else {
            "yes"
        }
    }

    /// A target on `figure`: `met` judged from the medians; `reads` lists the other figures the
    /// judgement compares it with.
    fn target(&mut self, figure: &'static str, text: String, met: bool, reads: &[&'static str]) {
        let mut all = vec![figure];
        all.extend_from_slice(reads);
        self.targets.push(Target {
            figure,
            text,
            met,
            reads: all,
        });
    }

    fn count(&self, verdict: &str) -> usize {
        self.targets
            .iter()
            .filter(|t| self.verdict(t) == verdict)
            .count()
    }

    fn json(&self) -> String {
        let mut fields = vec![
            format!("\"backend\":\"{}\"", self.backend),
            format!("\"rounds\":{}", self.rounds),
        ];
        for (key, _) in &self.figures {
            let (min, max) = self.min_max(key);
            fields.push(format!("\"{key}\":{}", number(self.get(key))));
            fields.push(format!("\"{key}_min\":{}", number(min)));
            fields.push(format!("\"{key}_max\":{}", number(max)));
        }
        fields.push(format!("\"targets\":{}", self.targets.len()));
        fields.push(format!("\"targets_met\":{}", self.count("yes")));
        fields.push(format!(
            "\"targets_spread_too_wide\":{}",
            self.count("spread too wide")
        ));
        fields.push(format!("\"failed_rounds\":{}", self.failures.len()));
        format!("{{{}}}", fields.join(","))
    }

    fn print_table(&self, took: Duration) {
        println!();
        println!(
            "{:<44} {:>10} {:>10} {:>10}  {:<34} met",
            "measure", "median", "min", "max", "target"
        );
        println!("{}", "-".repeat(130));
        for (key, _) in &self.figures {
            let (min, max) = self.min_max(key);
            let (text, verdict) = match self.targets.iter().find(|t| t.figure == *key) {
                Some(target) => (target.text.as_str(), self.verdict(target)),
                None if self.too_wide(key) => ("", "(spread too wide)"),
                None => ("", ""),
            };
            println!(
                "{key:<44} {:>10} {:>10} {:>10}  {text:<34} {verdict}",
                pretty(self.get(key)),
                pretty(min),
                pretty(max),
            );
        }
        println!(
            "\nEach figure is the median of {} interleaved rounds, with the smallest and largest \
             round;\n  \"spread too wide\": a figure the target reads has rounds further apart \
             than {:.0} % of its median.\n\
             handoff_in_process_from_release_call_*: from the call to release() to the waiting \
             task holding\n  its guard (one manager, poll 30 s: the in-process wake-up alone).\n\
             *handoff_cross_process_p50_us: from release() returning in one process to the \
             other process holding\n  the lock.\n\
             uncontended_cycle_10k_held_us: the cycle on a fresh key while the same manager \
             holds 10,000 other keys;\n  uncontended_cycle_1k_waiting_us: while it holds 1,000, \
             each waited for by a second manager on the same database.",
            self.rounds,
            WIDE * 100.0
        );
        for note in &self.notes {
            println!("{note}");
        }
        for (key, failure) in &self.failures {
            println!("FAILED {key}, {failure}");
        }
        println!(
            "\n{} of {} targets met, {} more met by the medians but with the rounds spread too \
             wide; the run\n({}) took {:.1} s on {} CPUs.",
            self.count("yes"),
            self.targets.len(),
            self.count("spread too wide"),
            self.backend,
            took.as_secs_f64(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!("verdict: {}", self.overall());
    }

    /// The run in one phrase: a run with rounds spread too wide, or a failed round, does not
    /// pass, whatever its medians say.
    fn overall(&self) -> String {
        let (failed, wide) = (self.count("round failed"), self.count("spread too wide"));
        let missed = self.count("NO");
        if failed > 0 {
            format!("ROUND FAILED ({failed} targets cannot be judged)")
        } else if wide > 0 {
            format!(
                "SPREAD TOO WIDE ({wide} targets; repeat on a quieter machine), {missed} targets \
                 missed"
            )
        } else if missed > 0 {
            format!("{missed} targets missed")
        } else {
            "every target met".into()
        }
    }
}

/// The targets both backends share; `handoff_p50_us` is the in-process handoff's, the
/// contended target is `contended_floor_share` of the floor, 1,000,000 / (2 × raw) ops/s.
fn shared_targets(
    report: &mut Report,
    cycle_ratio: f64,
    handoff_p50_us: f64,
    contended_floor_share: f64,
) {
    let v = |key| report.get(key);
    let (raw, cycle) = (v("raw_txn_us"), v("uncontended_cycle_us"));
    let handoff = v("handoff_in_process_from_release_call_p50_us");
    let handoff_p99 = v("handoff_in_process_from_release_call_p99_us");
    let floor = 1e6 / (2.0 * raw);
    let contended = v("contended_ops_per_s");
    let scale: Vec<(&'static str, f64)> = [
        "uncontended_cycle_10k_held_us",
        "uncontended_cycle_1k_waiting_us",
    ]
    .into_iter()
    .map(|key| (key, v(key)))
    .collect();
    let waiting: Vec<(&'static str, f64, f64)> = [
        ("waiting_write_txn_per_s_1000", "waiting_write_txn_per_s_10"),
        (
            "waiting_change_checks_per_s_1000",
            "waiting_change_checks_per_s_10",
        ),
    ]
    .into_iter()
    .map(|(many, few)| (many, v(many), v(few)))
    .collect();
    let (semaphore, async_lock) = (v("semaphore_cycle_ns"), v("async_lock_semaphore_cycle_ns"));
    let heartbeat = v("heartbeat_write_txn_per_round_1000_locks");

    report.target(
        "uncontended_cycle_us",
        format!("<= {cycle_ratio} x raw = {:.1}", cycle_ratio * raw),
        cycle <= cycle_ratio * raw,
        &["raw_txn_us"],
    );
    for (key, value) in scale {
        report.target(
            key,
            format!("<= 1.5 x uncontended = {:.1}", 1.5 * cycle),
            value <= 1.5 * cycle,
            &["uncontended_cycle_us"],
        );
    }
    report.target(
        "handoff_in_process_from_release_call_p50_us",
        format!("<= {handoff_p50_us}"),
        handoff <= handoff_p50_us,
        &[],
    );
    report.target(
        "handoff_in_process_from_release_call_p99_us",
        "<= 2000".into(),
        handoff_p99 <= 2000.0,
        &[],
    );
    for (many, at_many, at_few) in waiting {
        let limit = 2.0 * at_few.max(1.0);
        report.target(
            many,
            format!("<= 2 x max(1, at 10) = {limit:.1}"),
            at_many <= limit,
            &[],
        );
    }
    report.target(
        "heartbeat_write_txn_per_round_1000_locks",
        "<= 2".into(),
        heartbeat <= 2.0,
        &[],
    );
    report.target(
        "contended_ops_per_s",
        format!(
            ">= {contended_floor_share} x floor = {:.0}",
            contended_floor_share * floor
        ),
        contended >= contended_floor_share * floor,
        &["raw_txn_us"],
    );
    report.target(
        "semaphore_cycle_ns",
        format!("<= 1.5 x async-lock = {:.1}", 1.5 * async_lock),
        semaphore <= 1.5 * async_lock,
        &["async_lock_semaphore_cycle_ns"],
    );
}

/// Issue 14's targets for SQLite.
fn sqlite_targets(report: &mut Report) {
    shared_targets(report, 2.5, 50.0, 1.5);
    let cross = report.get("handoff_cross_process_p50_us");
    report.target(
        "handoff_cross_process_p50_us",
        "<= 500".into(),
        cross <= 500.0,
        &[],
    );
}

fn number(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.3}")
    } else {
        "null".into()
    }
}

fn pretty(value: f64) -> String {
    if !value.is_finite() {
        "-".into()
    } else if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    }
}

fn median(samples: &mut [f64]) -> f64 {
    percentile(samples, 0.5)
}

fn percentile(samples: &mut [f64], at: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(f64::total_cmp);
    let index = ((samples.len() - 1) as f64 * at).round() as usize;
    samples[index]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

// ----------------------------------------------------------------------------------------------
// PostgreSQL

#[cfg(all(feature = "postgres", feature = "testkit"))]
mod pg {
    use super::*;
    use postgres::{Client, NoTls};

    /// The report on the server of `url`, or on a throwaway one started for the run (as the
    /// tests start theirs: `leasehold::testkit::postgres`).
    pub(super) fn report(plan: &Plan, url: Option<&str>) -> Result<Report, Error> {
        let mut report = Report::new("postgres", plan.rounds);
        let server = match url {
            Some(_) => None,
            None => Some(
                pg_support::start(pg_support::Tls::Off)
                    .ok_or("no PostgreSQL server could be started (see above); give --url URL")?,
            ),
        };
        // Over the unix socket when the server is ours.
        let conninfo = match (&server, url) {
            (_, Some(url)) => url.to_owned(),
            (Some(server), None) => server.conninfo().ok_or("a server without a socket")?.into(),
            (None, None) => unreachable!("a server was started above"),
        };
        let dir = tempfile::tempdir()?;
        let schema =
            |name: &str| format!("bench_{}_{}", name.replace('-', "_"), std::process::id());
        let schemas = RefCell::new(Vec::new());
        let opened = RefCell::new(Vec::new());
        let open = |name: &str, builder: LockManagerBuilder| -> Result<LockManager, Error> {
            let name = schema(name);
            let locks = block_on(builder.schema(&name).connect(&conninfo))?;
            schemas.borrow_mut().push(name);
            opened.borrow_mut().push(locks.clone());
            Ok(locks)
        };

        // The server's floor: one write transaction, sent as one query over the same socket.
        let raw_schema = schema("raw");
        let mut raw = Client::connect(&conninfo, NoTls)?;
        raw.batch_execute(&format!(
            "CREATE SCHEMA {raw_schema}; \
             CREATE TABLE {raw_schema}.t (id bigserial PRIMARY KEY, key text NOT NULL)"
        ))?;
        schemas.borrow_mut().push(raw_schema.clone());
        let transaction = format!(
            "BEGIN; INSERT INTO {raw_schema}.t (key) VALUES ('k'); DELETE FROM {raw_schema}.t; \
             COMMIT"
        );
        // What a user would pick instead: the server's own advisory lock, taken and given back.
        let mut advisory = Client::connect(&conninfo, NoTls)?;
        let lock = advisory.prepare("SELECT pg_advisory_lock(hashtext($1))")?;
        let unlock = advisory.prepare("SELECT pg_advisory_unlock(hashtext($1))")?;
        let advisory_key = schema("advisory-cycle");
        let floors: Vec<Floor<'_>> = vec![
            (
                "raw_txn_us",
                Box::new(|| Ok(raw.batch_execute(&transaction)?)),
            ),
            (
                "advisory_lock_cycle_us",
                Box::new(move || {
                    advisory.execute(&lock, &[&advisory_key])?;
                    advisory.execute(&unlock, &[&advisory_key])?;
                    Ok(())
                }),
            ),
        ];
        let mut measures = vec![cycle_against_floor(
            open("uncontended", LockManager::builder())?,
            floors,
            plan.per_round(2_500, 600),
        )];
        measures.extend(scale_measures(plan, &open));
        measures.push(handoff_in_process(plan, &open)?);

        let rounds = plan.per_round(300, 60);
        let cross = schema("cross");
        // The schema exists before the two processes meet in it.
        open("cross", LockManager::builder())?;
        measures.push(handoff_cross_process(
            "handoff_cross_process_p50_us",
            Ends::same("pg-lock", &conninfo, &cross),
            dir.path().to_owned(),
            rounds,
        ));
        let mut notes = vec![format!(
            "\nraw_txn_us: `BEGIN; INSERT; DELETE; COMMIT` sent as one query over the \
             connection the managers use ({}).\n\
             advisory_*: pg_advisory_lock + pg_advisory_unlock, two statements, on the same \
             server.",
            if server.is_some() {
                "the unix socket of a throwaway server"
            } else {
                "--url"
            }
        )];
        match &server {
            Some(server) => {
                let ends = poll_only_ends(server, &schema("cross-poll"), &open)?;
                measures.push(handoff_cross_process(
                    "handoff_cross_process_poll_only_p50_us",
                    ends,
                    dir.path().to_owned(),
                    rounds,
                ));
                notes.push(
                    "handoff_cross_process_poll_only_p50_us: as above, but each process \
                     connects as a role allowed one\n  connection, so its LISTEN connection is \
                     refused: waiters see the change by the poll (10 ms) alone."
                        .into(),
                );
            }
            None => notes.push(
                "handoff_cross_process_poll_only_p50_us: not measured (it needs roles on a \
                 server the report starts)."
                    .into(),
            ),
        }
        measures.push(handoff_cross_process(
            "advisory_handoff_cross_process_p50_us",
            Ends::same("advisory", &conninfo, &schema("advisory-handoff")),
            dir.path().to_owned(),
            rounds,
        ));
        measures.extend(common_measures(plan, &open)?);

        report.notes = notes;
        run_rounds(&mut report, &mut measures, plan.rounds);
        drop(measures);
        shut_down(&opened.borrow())?;
        let mut admin = Client::connect(&conninfo, NoTls)?;
        for name in schemas.borrow().iter() {
            admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))?;
        }
        shared_targets(&mut report, 3.0, 200.0, 0.5);
        let cross = report.get("handoff_cross_process_p50_us");
        report.target(
            "handoff_cross_process_p50_us",
            "<= 2000".into(),
            cross <= 2000.0,
            &[],
        );
        Ok(report)
    }

    /// Two roles allowed one connection each, members of the tests' role (so they may use its
    /// schemas): a manager connecting as one has its storage connection, and its listener is
    /// refused, so it hears of other processes' changes by polling alone. Checked here.
    fn poll_only_ends(
        server: &pg_support::Server,
        schema: &str,
        open: Open<'_>,
    ) -> Result<Ends, Error> {
        let dir = server.dir().ok_or("a server without a socket directory")?;
        let port = server.port().ok_or("a server without a port")?;
        let roles = ["bench_poll_a", "bench_poll_b"];
        let conninfo = |role: &str| {
            format!(
                "host={} port={port} user={role} dbname={}",
                dir.display(),
                pg_support::DATABASE
            )
        };
        for role in roles {
            server.sql(&format!(
                "CREATE ROLE {role} LOGIN CONNECTION LIMIT 1 IN ROLE {}",
                pg_support::USER
            ));
        }
        // The schema, made by the tests' role, before the limited roles use it.
        open("cross-poll", LockManager::builder())?;
        let locks = block_on(
            LockManager::builder()
                .schema(schema)
                .connect(&conninfo(roles[0])),
        )?;
        let connections = || {
            server.sql(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = '{}'",
                roles[0]
            ))
        };
        std::thread::sleep(Duration::from_millis(300));
        let seen = connections();
        block_on(locks.shutdown())?;
        drop(locks);
        if seen.trim() != "1" {
            return Err(format!("a poll-only manager has {seen} connections, not 1").into());
        }
        Ok(Ends {
            kind: "pg-lock",
            ours: conninfo(roles[0]),
            theirs: conninfo(roles[1]),
            detail: schema.into(),
        })
    }

    /// A manager on `url` in `schema`; tries again for a while, since a role allowed one
    /// connection may still have the last round's open for a moment.
    pub(super) fn connect(url: &str, schema: &str) -> Result<LockManager, Error> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match block_on(LockManager::builder().schema(schema).connect(url)) {
                Ok(locks) => return Ok(locks),
                Err(error) if Instant::now() > deadline => return Err(error.into()),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}
