//! The measurements of the lock manager that both backends make: the uncontended cycle against
//! its floors, with other keys held, handoffs in one process and across two, waiting, and
//! heartbeats.

use super::*;

/// The measurements both backends make with the lock manager alone, after the handoffs.
pub(crate) fn common_measures<'a>(plan: &Plan, open: Open<'a>) -> Result<Vec<Measure<'a>>, Error> {
    let window = plan.seconds(2.0, 1.0);
    let mut measures = Vec::new();
    for waiters in [10, 1_000] {
        measures.push(waiting(open, waiters, window));
    }
    measures.push(heartbeat_write_txn_per_round(open, 1_000)?);
    measures.push(permits_beside_exclusive(plan, open)?);
    let seconds = plan.seconds(2.0, 1.0);
    let contended = open("contended", LockManager::builder())?;
    measures.push(measure(&["contended_ops_per_s"], move || {
        Ok(vec![contended_ops_per_s(&contended, seconds)?])
    }));
    // The same cycle on the memory backend: what the worker and the caller's path cost with
    // storage that is a few operations on ordered maps.
    let in_memory = LockManager::open_in_memory()?;
    let reps = plan.per_round(10_000, 2_000);
    measures.push(measure(&["memory_cycle_us"], move || {
        Ok(vec![median(&mut timed_cycles(
            &in_memory,
            reps,
            Duration::MAX,
        )?)])
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
    #[cfg(feature = "testkit")]
    {
        let tasks = plan.per_round(500, 100);
        measures.push(measure(&["sim_polls_per_s"], move || {
            Ok(vec![sim_polls_per_s(tasks)])
        }));
        measures.push(measure(&["every_await_point_ms"], || {
            Ok(vec![every_await_point_ms()])
        }));
        let cycles = plan.per_round(20_000, 5_000);
        measures.push(measure(&["sim_lock_cycles_per_s"], move || {
            Ok(vec![sim_lock_cycles_per_s(cycles)])
        }));
    }
    Ok(measures)
}

/// A figure and the operation it times, measured beside the uncontended cycle.
pub(crate) type Floor<'a> = (&'static str, Box<dyn FnMut() -> Result<(), Error> + 'a>);

/// The floors (each operation of `floors`, timed) and an exclusive acquire + release of a free
/// key, `reps` times each per round, in interleaved batches so that all see the same machine:
/// on a shared virtual machine the speed of a whole batch can shift by a fifth from one second
/// to the next. The uncontended cycle is the second figure, after the first floor.
pub(crate) fn cycle_against_floor<'a>(
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
pub(crate) fn timed_cycles(
    locks: &LockManager,
    reps: usize,
    budget: Duration,
) -> Result<Vec<f64>, Error> {
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
pub(crate) fn scale_measures<'a>(plan: &Plan, open: Open<'a>) -> Vec<Measure<'a>> {
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

pub(crate) fn held_key(i: usize) -> String {
    format!("held {i}")
}

/// `count` keys held exclusively by `locks`, taken 500 to a transaction (`many`) to set up fast.
pub(crate) fn hold(locks: &LockManager, count: usize) -> Result<Vec<Guard>, Error> {
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

/// Permits beside exclusive locks, interleaved in each round so that both see the same machine:
/// the uncontended cycle (one of three permits; an exclusive lock), eight tasks taking turns on
/// one key (one of three permits each; exclusive), and the in-process handoff (a waiter of one
/// permit behind a holder of all three; an exclusive waiter behind an exclusive holder).
pub(crate) fn permits_beside_exclusive<'a>(
    plan: &Plan,
    open: Open<'a>,
) -> Result<Measure<'a>, Error> {
    let locks = open(
        "permits",
        LockManager::builder().poll(Duration::from_secs(30)),
    )?;
    let cycles = plan.per_round(2_000, 500);
    let handoffs = plan.per_round(500, 100);
    let seconds = plan.seconds(1.0, 0.5);
    let exclusive = |key: &str| LockRequest::exclusive(key, "bench");
    let permits = |key: &str, count| LockRequest::permits(key, "bench", count, 3);
    Ok(measure(
        &[
            "exclusive_cycle_us",
            "permit_cycle_us",
            "contended_one_key_exclusive_ops_per_s",
            "contended_one_key_permits_8_over_3_ops_per_s",
            "handoff_exclusive_p50_us",
            "handoff_permit_p50_us",
        ],
        move || {
            let mut figures = vec![0.0; 6];
            // Each pair in turn, in two halves, so that a slow second hurts both alike.
            for _ in 0..2 {
                let cycle = |request: &LockRequest| {
                    block_on(async {
                        let mut samples = Vec::with_capacity(cycles / 2);
                        for _ in 0..cycles / 2 {
                            let started = Instant::now();
                            locks.acquire(request.clone()).await?.release().await?;
                            samples.push(micros(started.elapsed()));
                        }
                        Ok::<_, Error>(median(&mut samples))
                    })
                };
                figures[0] += cycle(&exclusive("cycle x"))? / 2.0;
                figures[1] += cycle(&permits("cycle p", 1))? / 2.0;
                let turns = |request: LockRequest| {
                    grants_per_s(&locks, 8, seconds / 2, move |_| request.clone())
                };
                figures[2] += turns(exclusive("turns x"))? / 2.0;
                figures[3] += turns(permits("turns p", 1))? / 2.0;
                let handoff = |holder, waiter| {
                    block_on(handoffs_of(&locks, holder, waiter, handoffs / 2))
                        .map(|mut samples| percentile(&mut samples, 0.5))
                };
                figures[4] += handoff(exclusive("handoff x"), exclusive("handoff x"))? / 2.0;
                figures[5] += handoff(permits("handoff p", 3), permits("handoff p", 1))? / 2.0;
            }
            Ok(figures)
        },
    ))
}

/// From the call to `release()` to the waiting task holding its guard, in one manager whose
/// `poll` is 30 s: only the in-process wake-up can do it. Timed from the call, not from
/// `release()` returning, since the waiter is often granted inside the release's own
/// transaction, before `release()` returns (which made many samples 0).
pub(crate) fn handoff_in_process<'a>(plan: &Plan, open: Open<'a>) -> Result<Measure<'a>, Error> {
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

pub(crate) async fn handoffs_in_process(
    locks: &LockManager,
    reps: usize,
) -> Result<Vec<f64>, Error> {
    let exclusive = || LockRequest::exclusive("key", "bench");
    handoffs_of(locks, exclusive(), exclusive(), reps).await
}

/// From the call to `release()` of `holder` to the task waiting for `waiter` (on the same key)
/// holding its guard, `reps` times.
pub(crate) async fn handoffs_of(
    locks: &LockManager,
    holder: LockRequest,
    waiter: LockRequest,
    reps: usize,
) -> Result<Vec<f64>, Error> {
    let key = holder.key.clone();
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let holder = locks.acquire(holder.clone()).await?;
        let waiter = {
            let (locks, waiter) = (locks.clone(), waiter.clone());
            fork_daemon(async move {
                let guard = locks.acquire(waiter).await;
                (Instant::now(), guard)
            })
        };
        while locks.inspect(Some(&key)).await?.len() < 2 {
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
pub(crate) struct Ends {
    pub(crate) kind: &'static str,
    pub(crate) ours: String,
    pub(crate) theirs: String,
    pub(crate) detail: String,
}

impl Ends {
    pub(crate) fn same(kind: &'static str, target: &str, detail: &str) -> Ends {
        Ends {
            kind,
            ours: target.into(),
            theirs: target.into(),
            detail: detail.into(),
        }
    }
}

/// Two processes pass one lock back and forth (each holds it 2 ms); a handoff is the time from
/// one side's release returning to the other side holding it (`figures[0]`), and, if a second
/// figure is named, from the call to release (`figures[1]`: that release's own round trip
/// included). A child process per round.
pub(crate) fn handoff_cross_process<'a>(
    figures: &'static [&'static str],
    ends: Ends,
    dir: PathBuf,
    rounds: usize,
) -> Measure<'a> {
    let mut round = 0;
    let figure = figures[0];
    measure(figures, move || {
        round += 1;
        let child_events = dir.join(format!("{figure}-{round}.events"));
        let mut child = spawn_child(ends.kind, &ends.theirs, &child_events, rounds, &ends.detail)?;
        let meeting = Meeting::of(&child_events, false);
        let ours = ping_pong(ends.kind, &ends.ours, &ends.detail, rounds, &meeting);
        let status = wait_with_deadline(&mut child, Duration::from_secs(120))?;
        let ours = ours?;
        if !status.success() {
            return Err(format!("the {} child failed: {status}", ends.kind).into());
        }
        let theirs = read_events(&child_events)?;
        let mut values = Vec::with_capacity(figures.len());
        for from_call in [false, true].into_iter().take(figures.len()) {
            let mut samples = handoffs(&ours, &theirs, from_call);
            if samples.len() < rounds / 4 {
                return Err(format!(
                    "the {} lock changed hands only {} times in {rounds} rounds",
                    ends.kind,
                    samples.len()
                )
                .into());
            }
            values.push(median(&mut samples));
        }
        Ok(values)
    })
}

/// Where the two sides of a handoff meet before the first round, each once its lock is open, so
/// that neither plays its rounds alone while the other is still starting (a busy machine can take
/// longer to start a process than a quick run's rounds last).
pub(crate) struct Meeting {
    mine: PathBuf,
    theirs: PathBuf,
}

impl Meeting {
    /// The child's side (`child`) or the parent's, named after the child's events file.
    pub(crate) fn of(events: &Path, child: bool) -> Meeting {
        let side = |name: &str| events.with_extension(format!("{name}.ready"));
        let (mine, theirs) = if child {
            (side("child"), side("parent"))
        } else {
            (side("parent"), side("child"))
        };
        Meeting { mine, theirs }
    }

    /// Says this side is ready, and waits (up to a minute) for the other.
    pub(crate) fn meet(&self) -> Result<(), Error> {
        File::create(&self.mine)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.theirs.exists() {
            if Instant::now() > deadline {
                return Err("the other side of the handoff did not start within a minute".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    Granted(u64),
    /// Release called.
    Releasing(u64),
    /// Release returned.
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
pub(crate) fn ping_pong(
    kind: &str,
    target: &str,
    detail: &str,
    rounds: usize,
    meeting: &Meeting,
) -> Result<Vec<Event>, Error> {
    let mut events = Vec::with_capacity(2 * rounds);
    let hold = Duration::from_millis(2);
    // After releasing, wait before asking again, so that the other side (already waiting) takes
    // its turn even under an unfair lock: this pause is outside every measured interval.
    let rest = Duration::from_millis(1);
    if kind.ends_with("elect") {
        let locks = open_kind(kind, target, detail, LockManager::builder())?;
        return lead_in_turn(&locks, rounds, meeting);
    }
    let locks = match kind {
        "lock" => Some(LockManager::open(target)?),
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        "pg-lock" => Some(on_postgres::connect(target, detail)?),
        _ => None,
    };
    if let Some(locks) = locks {
        meeting.meet()?;
        block_on(async {
            for _ in 0..rounds {
                let guard = locks.exclusive("ball", "ping-pong").await?;
                events.push(Event::Granted(unix_micros()));
                SystemClock.sleep(hold).await;
                events.push(Event::Releasing(unix_micros()));
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
            meeting.meet()?;
            for _ in 0..rounds {
                fs4::FileExt::lock(&file)?;
                events.push(Event::Granted(unix_micros()));
                std::thread::sleep(hold);
                events.push(Event::Releasing(unix_micros()));
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
            meeting.meet()?;
            for _ in 0..rounds {
                client.execute(&lock, &[&detail])?;
                events.push(Event::Granted(unix_micros()));
                std::thread::sleep(hold);
                events.push(Event::Releasing(unix_micros()));
                client.execute(&unlock, &[&detail])?;
                events.push(Event::Released(unix_micros()));
                std::thread::sleep(rest);
            }
        }
        other => return Err(format!("unknown lock kind {other:?}").into()),
    }
    Ok(events)
}

/// Pairs each release by one side (as it returned, or as it was called: `from_call`) with the
/// next grant, when that grant went to the other side.
pub(crate) fn handoffs(ours: &[Event], theirs: &[Event], from_call: bool) -> Vec<f64> {
    let mut all: Vec<(u64, bool, usize)> = Vec::new();
    for (side, events) in [ours, theirs].into_iter().enumerate() {
        for event in events {
            match *event {
                Event::Granted(t) => all.push((t, true, side)),
                Event::Releasing(t) if from_call => all.push((t, false, side)),
                Event::Released(t) if !from_call => all.push((t, false, side)),
                Event::Releasing(_) | Event::Released(_) => {}
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

pub(crate) fn read_events(path: &Path) -> Result<Vec<Event>, Error> {
    let text = std::fs::read_to_string(path)?;
    let mut events = Vec::new();
    for line in text.lines() {
        let (what, t) = line.split_once(' ').ok_or("a malformed event line")?;
        let t: u64 = t.parse()?;
        events.push(match what {
            "granted" => Event::Granted(t),
            "releasing" => Event::Releasing(t),
            _ => Event::Released(t),
        });
    }
    Ok(events)
}

/// This program again, as the child `kind` on `target` (see [`child`]): its output to `out`,
/// `count` its rounds (or what else its kind counts), `detail` the kind's detail.
pub(crate) fn spawn_child(
    kind: &str,
    target: &str,
    out: &Path,
    count: usize,
    detail: &str,
) -> Result<Child, Error> {
    Ok(Command::new(std::env::current_exe()?)
        .args(["--child", kind, target])
        .arg(out)
        .args([&count.to_string(), detail])
        .spawn()?)
}

pub(crate) fn child(args: &[String]) -> Result<(), Error> {
    let [kind, target, out, rounds, detail] = args else {
        return Err("usage: --child KIND TARGET OUT ROUNDS DETAIL".into());
    };
    let meeting = Meeting::of(Path::new(out), true);
    match kind.as_str() {
        "crash" | "pg-crash" => {
            let builder = LockManager::builder()
                .lease(CRASH_LEASE)
                .heartbeat(CRASH_LEASE / 4);
            let locks = open_kind(kind, target, detail, builder)?;
            return lead_until_killed(&locks, Path::new(out));
        }
        "observe" | "pg-observe" => {
            let locks = open_kind(kind, target, detail, LockManager::builder())?;
            return observe_changes(&locks, rounds.parse()?, &meeting, Path::new(out));
        }
        _ => {}
    }
    let events = ping_pong(kind, target, detail, rounds.parse()?, &meeting)?;
    let mut file = File::create(PathBuf::from(out))?;
    for event in events {
        match event {
            Event::Granted(t) => writeln!(file, "granted {t}")?,
            Event::Releasing(t) => writeln!(file, "releasing {t}")?,
            Event::Released(t) => writeln!(file, "released {t}")?,
        }
    }
    Ok(())
}

pub(crate) fn wait_with_deadline(
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
pub(crate) fn waiting<'a>(open: Open<'a>, waiters: usize, window: Duration) -> Measure<'a> {
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
pub(crate) fn heartbeat_write_txn_per_round<'a>(
    open: Open<'a>,
    count: usize,
) -> Result<Measure<'a>, Error> {
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
        &[
            "heartbeat_write_txn_per_round_1000_locks",
            "heartbeat_round_ms_1000_locks",
        ],
        move || {
            let _held = &guards;
            block_on(async {
                while clock.sleepers() == 0 {
                    SystemClock.sleep(Duration::from_millis(1)).await;
                }
                let before = locks.stats();
                // From the move of the clock to the round's end, as seen within a millisecond:
                // the time the worker serves nothing else.
                let mut moved_at = Instant::now();
                // One round, however many moves of the clock it takes: once, on PostgreSQL, no
                // round followed a move (the worker may answer a beat with its last renewal,
                // which it dates by the server's time, not by this clock), and this loop waited
                // for good.
                let mut moves = 0;
                while locks.stats().heartbeats == before.heartbeats {
                    moved_at = Instant::now();
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
                let round = moved_at.elapsed().as_secs_f64() * 1e3;
                Ok(vec![
                    (locks.stats().write_transactions - before.write_transactions) as f64,
                    round,
                ])
            })
        },
    ))
}
