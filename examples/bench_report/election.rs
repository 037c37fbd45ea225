//! Election across processes, on either backend: graceful failover (two processes `lead` one
//! key in turn: from one body's end to the other's start, the resignation between them),
//! failover after the leader's process is killed (from the SIGKILL to the queued campaigner's
//! grant), and how soon an observer in another process sees a change of leader.

use super::*;

/// The lease and heartbeat of the leader that is killed: short, so that a round is short.
pub(crate) const CRASH_LEASE: Duration = Duration::from_secs(1);
const CRASH_HEARTBEAT: Duration = Duration::from_millis(250);
const _: () = assert!(CRASH_HEARTBEAT.as_millis() * 4 == CRASH_LEASE.as_millis());

/// The key the measurements elect on.
const KEY: &str = "elected";

/// The store of `kind` ("elect", "crash", "observe" on a SQLite file; "pg-" before them on
/// PostgreSQL, `detail` its schema), opened with `builder`.
pub(crate) fn open_kind(
    kind: &str,
    target: &str,
    detail: &str,
    builder: LockManagerBuilder,
) -> Result<LockManager, Error> {
    if kind.starts_with("pg-") {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        return Ok(block_on(builder.schema(detail).connect(target))?);
    }
    let _ = detail;
    Ok(builder.open(target)?)
}

/// The election's three measures, on the stores `at` names: for each of "elect", "crash" and
/// "observe", the target and detail of a store of its own (`prefix` before the kinds: "pg-"
/// on PostgreSQL).
pub(crate) fn election_measures<'a>(
    plan: &Plan,
    prefix: &str,
    dir: &Path,
    at: impl Fn(&str) -> Result<(String, String), Error>,
) -> Result<Vec<Measure<'a>>, Error> {
    let kind = |name: &str| -> &'static str {
        match (prefix, name) {
            ("pg-", "elect") => "pg-elect",
            ("pg-", "crash") => "pg-crash",
            ("pg-", _) => "pg-observe",
            (_, "elect") => "elect",
            (_, "crash") => "crash",
            _ => "observe",
        }
    };
    let (elect, elect_detail) = at("elect")?;
    let (crash, crash_detail) = at("crash")?;
    let (observe, observe_detail) = at("observe")?;
    Ok(vec![
        handoff_cross_process(
            &["failover_graceful_p50_us"],
            Ends::same(kind("elect"), &elect, &elect_detail),
            dir.to_owned(),
            plan.per_round(100, 30),
        ),
        failover_after_kill(
            "failover_after_kill_ms",
            kind("crash"),
            crash,
            crash_detail,
            dir.to_owned(),
            plan.per_round(5, 3),
        ),
        observed_cross_process(
            "observed_cross_process_p50_us",
            kind("observe"),
            observe,
            observe_detail,
            dir.to_owned(),
            plan.per_round(50, 15),
        ),
    ])
}

/// One side of the graceful failover: leads [`KEY`] `rounds` times, each body holding 2 ms,
/// noting when each began and ended (the resignation follows the end).
pub(crate) fn lead_in_turn(
    locks: &LockManager,
    rounds: usize,
    meeting: &Meeting,
) -> Result<Vec<Event>, Error> {
    let events = Arc::new(std::sync::Mutex::new(Vec::with_capacity(2 * rounds)));
    meeting.meet()?;
    block_on(async {
        for _ in 0..rounds {
            let noted = events.clone();
            locks
                .lead(KEY, "ping-pong", move |_| {
                    Scoped::<(), Interrupted>::new(move |_| async move {
                        noted.lock().unwrap().push(Event::Granted(unix_micros()));
                        SystemClock.sleep(Duration::from_millis(2)).await;
                        noted.lock().unwrap().push(Event::Released(unix_micros()));
                        Ok(())
                    })
                })
                .await
                .map_err(|error| error.to_string())?;
            // Outside every measured interval: the other side, waiting, takes its turn.
            SystemClock.sleep(Duration::from_millis(1)).await;
        }
        Ok::<(), Error>(())
    })?;
    let events = events.lock().unwrap().clone();
    Ok(events)
}

/// The child that leads and is killed: leads [`KEY`] with a short lease, says so by creating
/// `out`, and waits to be killed.
pub(crate) fn lead_until_killed(locks: &LockManager, out: &Path) -> Result<(), Error> {
    block_on(async {
        let _leading = locks.campaign(KEY, "killed").await?;
        File::create(out)?;
        SystemClock.sleep(Duration::from_secs(120)).await;
        Ok(())
    })
}

/// Failover after a kill: per repetition a child leads, this process queues behind it, the
/// child is SIGKILLed (at a moment that moves through the heartbeat from one repetition to the
/// next), and the time until this process leads is taken. Milliseconds.
pub(crate) fn failover_after_kill<'a>(
    figure: &'static str,
    kind: &'static str,
    target: String,
    detail: String,
    dir: PathBuf,
    repetitions: usize,
) -> Measure<'a> {
    let mut round = 0;
    measure(&[figure], move || {
        round += 1;
        let locks = open_kind(kind, &target, &detail, LockManager::builder())?;
        let mut samples = Vec::with_capacity(repetitions);
        for repetition in 0..repetitions {
            let leading = dir.join(format!("{figure}-{round}-{repetition}.leading"));
            let mut child = spawn_child(kind, &target, &leading, 1, &detail)?;
            let deadline = Instant::now() + Duration::from_secs(60);
            while !leading.exists() {
                if Instant::now() > deadline || child.try_wait()?.is_some() {
                    let _ = child.kill();
                    return Err("the child never led".into());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let sample = block_on(async {
                let campaign = fork_daemon(locks.campaign(KEY, "next"));
                while locks.inspect(Some(KEY)).await?.len() < 2 {
                    SystemClock.sleep(Duration::from_millis(1)).await;
                }
                // Somewhere in the child's heartbeat, a different place each repetition.
                let phase = CRASH_HEARTBEAT.as_millis() as u64 * (repetition as u64 % 5) / 5;
                SystemClock.sleep(Duration::from_millis(phase)).await;
                child.kill()?;
                let killed = Instant::now();
                let leadership = match campaign.join().await.success() {
                    Some(Ok(leadership)) => leadership,
                    _ => return Err::<f64, Error>("the campaign failed".into()),
                };
                let took = killed.elapsed().as_secs_f64() * 1e3;
                leadership.resign().await?;
                Ok(took)
            })?;
            child.wait()?;
            samples.push(sample);
        }
        drop(locks);
        Ok(vec![median(&mut samples)])
    })
}

/// The child that observes: notes each leader change of [`KEY`] (its term, 0 for none) with
/// when it was seen, `changes` of them, into `out`.
pub(crate) fn observe_changes(
    locks: &LockManager,
    changes: usize,
    meeting: &Meeting,
    out: &Path,
) -> Result<(), Error> {
    let mut leaders = locks.observe(KEY);
    let mut seen = Vec::with_capacity(changes);
    block_on(async {
        // The first item is the leader as it is: read before meeting, so that every change
        // the other side makes after is one this side is watching for.
        let first = futures::StreamExt::next(&mut leaders)
            .await
            .ok_or("no item")??;
        seen.push((first.map_or(0, |leader| leader.term), unix_micros()));
        meeting.meet()?;
        while seen.len() < changes {
            let leader = futures::StreamExt::next(&mut leaders)
                .await
                .ok_or("ended")??;
            seen.push((leader.map_or(0, |leader| leader.term), unix_micros()));
        }
        Ok::<(), Error>(())
    })?;
    let mut file = File::create(out)?;
    for (term, at) in seen {
        writeln!(file, "{term} {at}")?;
    }
    Ok(())
}

/// How soon an observer in another process sees a change: this process leads and resigns in
/// turn, 20 ms apart (longer than a change takes to be seen, so that none is merged with the
/// next), noting when each change was made; the child notes when it saw each.
pub(crate) fn observed_cross_process<'a>(
    figure: &'static str,
    kind: &'static str,
    target: String,
    detail: String,
    dir: PathBuf,
    rounds: usize,
) -> Measure<'a> {
    let mut round = 0;
    measure(&[figure], move || {
        round += 1;
        let locks = open_kind(kind, &target, &detail, LockManager::builder())?;
        let seen_file = dir.join(format!("{figure}-{round}.seen"));
        let changes = 2 * rounds;
        let mut child = spawn_child(kind, &target, &seen_file, changes + 1, &detail)?;
        Meeting::of(&seen_file, false).meet()?;
        let mut made: Vec<(u64, u64)> = Vec::with_capacity(changes);
        block_on(async {
            for _ in 0..rounds {
                let leadership = locks.campaign(KEY, "observed").await?;
                made.push((leadership.term(), unix_micros()));
                SystemClock.sleep(Duration::from_millis(20)).await;
                leadership.resign().await?;
                made.push((0, unix_micros()));
                SystemClock.sleep(Duration::from_millis(20)).await;
            }
            Ok::<(), Error>(())
        })?;
        let status = wait_with_deadline(&mut child, Duration::from_secs(60))?;
        if !status.success() {
            return Err(format!("the observing child failed: {status}").into());
        }
        let seen: Vec<(u64, u64)> = std::fs::read_to_string(&seen_file)?
            .lines()
            .map(|line| {
                let (term, at) = line.split_once(' ').ok_or("a malformed line")?;
                Ok((term.parse()?, at.parse()?))
            })
            .collect::<Result<_, Error>>()?;
        // Each change made, against the first sighting of it after the one before.
        let mut samples = Vec::with_capacity(changes);
        let mut from = 1; // the first item was the leader before any change
        for (term, at) in made {
            if let Some(offset) = seen[from..].iter().position(|&(seen, _)| seen == term) {
                samples.push(seen[from + offset].1.saturating_sub(at) as f64);
                from += offset + 1;
            }
        }
        drop(locks);
        if samples.len() < changes / 2 {
            return Err(format!("the observer saw {} of {changes} changes", samples.len()).into());
        }
        Ok(vec![median(&mut samples)])
    })
}
