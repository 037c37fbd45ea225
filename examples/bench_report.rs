//! A side-by-side report: the lock next to the baselines a user would compare it with, measured
//! in one run on one machine.
//!
//! ```text
//! cargo run --release --example bench_report              # the full run, a table for people
//! cargo run --release --example bench_report -- --quick   # under a minute on 2 cores
//! cargo run --release --example bench_report -- --json    # and one JSON object as the last line
//! ```
//!
//! Times are medians over many repetitions unless the name says otherwise. Databases are files in
//! a temporary directory, with the library's default settings unless stated.

use std::collections::BTreeMap;
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
    fork_daemon, Clock, Interrupted, LockManager, LockRequest, Scoped, Semaphore, SystemClock,
    TestClock,
};

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let quick = args.iter().any(|a| a == "--quick");
    let json = args.iter().any(|a| a == "--json");
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    let mut report = Report::default();
    let reps = |full: usize, fast: usize| if quick { fast } else { full };

    let (raw, cycle) = floor_and_uncontended_cycle_us(dir.path(), reps(10_000, 2_000))?;
    report.put("raw_txn_us", raw);
    report.put("uncontended_cycle_us", cycle);
    let (p50, p99) = handoff_in_process_us(dir.path(), reps(1_000, 200))?;
    report.put("handoff_in_process_from_release_call_p50_us", p50);
    report.put("handoff_in_process_from_release_call_p99_us", p99);
    report.put(
        "handoff_cross_process_p50_us",
        handoff_cross_process_p50_us(dir.path(), "lock", reps(300, 60))?,
    );
    report.put(
        "flock_handoff_cross_process_p50_us",
        handoff_cross_process_p50_us(dir.path(), "flock", reps(300, 60))?,
    );
    report.put(
        "waiting_write_txn_per_s_10",
        waiting_write_txn_per_s(dir.path(), 10)?,
    );
    report.put(
        "waiting_write_txn_per_s_1000",
        waiting_write_txn_per_s(dir.path(), 1_000)?,
    );
    report.put(
        "heartbeat_write_txn_per_round_1000_locks",
        heartbeat_write_txn_per_round(dir.path(), 1_000)?,
    );
    let seconds = if quick { 2.0 } else { 5.0 };
    report.put(
        "contended_ops_per_s",
        contended_ops_per_s(dir.path(), seconds)?,
    );
    report.put("rwlock_ops_per_s", rwlock_ops_per_s(seconds));
    report.put("scope_cycle_ns", scope_cycle_ns(reps(200_000, 50_000)));
    let (ours, theirs, theirs_owned) = semaphore_cycle_ns(reps(2_000_000, 500_000));
    report.put("semaphore_cycle_ns", ours);
    report.put("async_lock_semaphore_cycle_ns", theirs);
    report.put("async_lock_semaphore_arc_cycle_ns", theirs_owned);

    report.print_table(started.elapsed());
    if json {
        println!("{}", report.json());
    }
    Ok(())
}

#[derive(Default)]
struct Report {
    values: Vec<(&'static str, f64)>,
}

impl Report {
    fn put(&mut self, key: &'static str, value: f64) {
        eprintln!("  measured {key} = {value:.1}");
        self.values.push((key, value));
    }

    fn get(&self, key: &str) -> f64 {
        self.values
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(f64::NAN, |(_, v)| *v)
    }

    fn json(&self) -> String {
        let fields: Vec<String> = self
            .values
            .iter()
            .map(|(key, value)| format!("\"{key}\":{}", number(*value)))
            .collect();
        format!("{{{}}}", fields.join(","))
    }

    fn print_table(&self, took: Duration) {
        let v = |key| self.get(key);
        let raw = v("raw_txn_us");
        let targets: BTreeMap<&str, (String, bool)> = [
            (
                "uncontended_cycle_us",
                (
                    format!("<= 3 x raw = {:.1}", 3.0 * raw),
                    v("uncontended_cycle_us") <= 3.0 * raw,
                ),
            ),
            (
                "handoff_in_process_from_release_call_p50_us",
                (
                    "<= 200".into(),
                    v("handoff_in_process_from_release_call_p50_us") <= 200.0,
                ),
            ),
            (
                "handoff_in_process_from_release_call_p99_us",
                (
                    "<= 2000".into(),
                    v("handoff_in_process_from_release_call_p99_us") <= 2000.0,
                ),
            ),
            (
                "handoff_cross_process_p50_us",
                (
                    "<= 15000".into(),
                    v("handoff_cross_process_p50_us") <= 15_000.0,
                ),
            ),
            (
                "waiting_write_txn_per_s_1000",
                (
                    format!(
                        "<= 2 x max(1, at 10) = {:.1}",
                        2.0 * v("waiting_write_txn_per_s_10").max(1.0)
                    ),
                    v("waiting_write_txn_per_s_1000")
                        <= 2.0 * v("waiting_write_txn_per_s_10").max(1.0),
                ),
            ),
            (
                "heartbeat_write_txn_per_round_1000_locks",
                (
                    "<= 2".into(),
                    v("heartbeat_write_txn_per_round_1000_locks") <= 2.0,
                ),
            ),
            (
                "contended_ops_per_s",
                (
                    format!(">= half the floor = {:.0}", 0.5 * 1e6 / (2.0 * raw)),
                    v("contended_ops_per_s") >= 0.5 * 1e6 / (2.0 * raw),
                ),
            ),
            (
                "semaphore_cycle_ns",
                (
                    format!(
                        "<= 1.5 x async-lock = {:.1}",
                        1.5 * v("async_lock_semaphore_cycle_ns")
                    ),
                    v("semaphore_cycle_ns") <= 1.5 * v("async_lock_semaphore_cycle_ns"),
                ),
            ),
        ]
        .into_iter()
        .collect();
        println!();
        println!("{:<44} {:>14}  {:<32} met", "measure", "value", "target");
        println!("{}", "-".repeat(100));
        for (key, value) in &self.values {
            let (target, met) = match targets.get(key) {
                Some((target, met)) => (target.as_str(), if *met { "yes" } else { "NO" }),
                None => ("", ""),
            };
            println!("{key:<44} {:>14}  {target:<32} {met}", pretty(*value));
        }
        println!(
            "\nhandoff_in_process_from_release_call_*: from the call to release() to the waiting \
             task holding\n  its guard (one manager, poll 30 s: the in-process wake-up alone).\n\
             handoff_cross_process_p50_us, flock_*: from release() returning in one process to \
             the other\n  process holding the lock."
        );
        println!(
            "\n{} of {} targets met; the run took {:.1} s on {} CPUs.",
            targets.values().filter(|(_, met)| *met).count(),
            targets.len(),
            took.as_secs_f64(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
    }
}

fn number(value: f64) -> String {
    if value.is_finite() {
        format!("{value:.3}")
    } else {
        "null".into()
    }
}

fn pretty(value: f64) -> String {
    if value >= 100.0 {
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

/// The storage floor, one `BEGIN IMMEDIATE; INSERT; DELETE; COMMIT` with the `sqlite` crate and
/// the lock manager's pragmas, and an exclusive acquire + release of a free key, each `reps`
/// times. Measured in interleaved batches, so that both see the same machine: on a shared virtual
/// machine the speed of a whole batch can shift by a fifth from one second to the next.
fn floor_and_uncontended_cycle_us(dir: &Path, reps: usize) -> Result<(f64, f64), Error> {
    const BATCHES: usize = 10;
    let conn = sqlite::open(dir.join("raw.db"))?;
    conn.execute(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA busy_timeout = 5000;
         CREATE TABLE t (id INTEGER PRIMARY KEY, key TEXT NOT NULL);",
    )?;
    let locks = LockManager::open(dir.join("uncontended.db"))?;
    let (mut raw, mut cycle) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
    for _ in 0..BATCHES {
        for _ in 0..reps / BATCHES {
            let started = Instant::now();
            conn.execute(
                "BEGIN IMMEDIATE; INSERT INTO t (key) VALUES ('k'); DELETE FROM t; COMMIT;",
            )?;
            raw.push(micros(started.elapsed()));
        }
        block_on(async {
            for _ in 0..reps / BATCHES {
                let started = Instant::now();
                let guard = locks.exclusive("key", "bench").await?;
                guard.release().await?;
                cycle.push(micros(started.elapsed()));
            }
            Ok::<_, Error>(())
        })?;
    }
    Ok((median(&mut raw), median(&mut cycle)))
}

/// From the call to `release()` to the waiting task holding its guard, in one manager whose
/// `poll` is 30 s: only the in-process wake-up can do it. Timed from the call, not from
/// `release()` returning, since the waiter is often granted inside the release's own
/// transaction, before `release()` returns (which made many samples 0).
fn handoff_in_process_us(dir: &Path, reps: usize) -> Result<(f64, f64), Error> {
    let locks = LockManager::builder()
        .poll(Duration::from_secs(30))
        .open(dir.join("in-process.db"))?;
    block_on(async {
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
        Ok((
            percentile(&mut samples, 0.5),
            percentile(&mut samples, 0.99),
        ))
    })
}

/// Two processes pass one lock back and forth (each holds it 2 ms); a handoff is the time from
/// one side's release returning to the other side holding it.
fn handoff_cross_process_p50_us(dir: &Path, kind: &str, rounds: usize) -> Result<f64, Error> {
    let target = dir.join(format!("cross-{kind}.db"));
    let child_events = dir.join(format!("child-{kind}.events"));
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--child", kind])
        .arg(&target)
        .arg(&child_events)
        .arg(rounds.to_string())
        .spawn()?;
    let ours = ping_pong(kind, &target, rounds);
    let status = wait_with_deadline(&mut child, Duration::from_secs(120))?;
    let ours = ours?;
    if !status.success() {
        return Err(format!("the {kind} child failed: {status}").into());
    }
    let theirs = read_events(&child_events)?;
    let mut samples = handoffs(&ours, &theirs);
    if samples.len() < rounds / 4 {
        return Err(format!(
            "the {kind} lock changed hands only {} times in {rounds} rounds",
            samples.len()
        )
        .into());
    }
    Ok(median(&mut samples))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Event {
    Granted(u64),
    Released(u64),
}

fn ping_pong(kind: &str, target: &Path, rounds: usize) -> Result<Vec<Event>, Error> {
    let mut events = Vec::with_capacity(2 * rounds);
    let hold = Duration::from_millis(2);
    // After releasing, wait before asking again, so that the other side (already waiting) takes
    // its turn even under an unfair lock: this pause is outside every measured interval.
    let rest = Duration::from_millis(1);
    match kind {
        "lock" => {
            let locks = LockManager::open(target)?;
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
        }
        _ => {
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
    let [kind, target, out, rounds] = args else {
        return Err("usage: --child KIND TARGET OUT ROUNDS".into());
    };
    let events = ping_pong(kind, Path::new(target), rounds.parse()?)?;
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

/// Write transactions per second while `waiters` tasks wait on a held key for 2 s.
fn waiting_write_txn_per_s(dir: &Path, waiters: usize) -> Result<f64, Error> {
    let locks = LockManager::open(dir.join(format!("waiting-{waiters}.db")))?;
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
        let before = locks.stats().write_transactions;
        let window = Duration::from_secs(2);
        SystemClock.sleep(window).await;
        let writes = locks.stats().write_transactions - before;
        holder.release().await?;
        for fiber in fibers {
            if let Some(Ok(guard)) = fiber.join().await.success() {
                guard.release().await?;
            }
        }
        Ok(writes as f64 / window.as_secs_f64())
    })
}

/// Write transactions in one heartbeat round while `count` locks are held (a test clock moves
/// time, so the round is exactly one).
fn heartbeat_write_txn_per_round(dir: &Path, count: usize) -> Result<f64, Error> {
    let clock = TestClock::new();
    let heartbeat = Duration::from_secs(5);
    let locks = LockManager::builder()
        .heartbeat(heartbeat)
        .clock(Arc::new(clock.clone()))
        .open(dir.join("heartbeat.db"))?;
    block_on(async {
        let mut guards = Vec::with_capacity(count);
        for i in 0..count {
            guards.push(locks.shared(format!("key {i}"), "held").await?);
        }
        while clock.sleepers() == 0 {
            SystemClock.sleep(Duration::from_millis(1)).await;
        }
        let before = locks.stats();
        clock.advance(heartbeat);
        while locks.stats().heartbeats == before.heartbeats {
            SystemClock.sleep(Duration::from_millis(1)).await;
        }
        let writes = locks.stats().write_transactions - before.write_transactions;
        drop(guards);
        Ok(writes as f64)
    })
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
fn contended_ops_per_s(dir: &Path, seconds: f64) -> Result<f64, Error> {
    let locks = LockManager::open(dir.join("contended.db"))?;
    let ops = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
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
fn rwlock_ops_per_s(seconds: f64) -> f64 {
    let keys: Arc<Vec<async_lock::RwLock<()>>> =
        Arc::new((0..KEYS).map(|_| async_lock::RwLock::new(())).collect());
    let ops = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
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
fn semaphore_cycle_ns(reps: usize) -> (f64, f64, f64) {
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
        (median(&mut a), median(&mut b), median(&mut c))
    })
}
