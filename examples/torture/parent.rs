//! The parent: starts the children, kills, pauses and (on PostgreSQL) cuts and restarts, then adds
//! up what the children saw and explains every suspect.

use super::*;

/// A child process and who it is.
pub(crate) struct Worker {
    pub(crate) id: usize,
    pub(crate) incarnation: u64,
    pub(crate) child: Child,
}

impl Worker {
    pub(crate) fn tag(&self) -> String {
        format!("{}.{}", self.id, self.incarnation)
    }
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Seed of the run.
    pub seed: u64,
    /// Children's counters, summed.
    pub totals: Totals,
    /// SIGKILLs sent.
    pub kills: u64,
    /// SIGSTOP/SIGCONT pauses.
    pub stops: u64,
    /// Children whose PostgreSQL connections were cut (`pg_terminate_backend`).
    pub connection_kills: u64,
    /// PostgreSQL server restarts (`pg_ctl restart`).
    pub server_restarts: u64,
    /// Children (by slot, whatever their incarnation) whose clock was skewed.
    pub skewed_children: u64,
    /// Steps of every child's wall clock, at once (either way).
    pub clock_steps: u64,
    /// The limit of the permits keys (0 with `--no-permits`).
    pub permits_limit: u64,
    /// The most permits of one key held at once by holders whose leases held.
    pub permits_most: u64,
    /// Times a permits key's tally passed the limit, each explained by holders that had lost
    /// their leases.
    pub permit_overruns: u64,
    /// Times it passed the limit with holders whose leases held (see `tally.rs`).
    pub permit_violations: u64,
    /// Election bodies recorded, each of its own term (0 with `--no-election`).
    pub election_terms: u64,
    /// Bodies that began while an earlier one of their key ran, excused by a pause or kill of
    /// the earlier one's child, or because it had been told its lease was lost (`election.rs`).
    pub election_overlaps_excused: u64,
    /// Of those, the ones excused only because the earlier one had been told (its child ran).
    pub election_overlaps_told: u64,
    /// Such overlaps not excused.
    pub election_violations: u64,
    /// Bodies that began after a higher term, just after a pause of their child.
    pub election_order_excused: u64,
    /// Bodies that began after a higher term otherwise.
    pub election_order_violations: u64,
    /// Where the locks were: `sqlite` or `postgres`.
    pub backend: &'static str,
    /// Rows left in the database after every owner shut down and one lease passed.
    pub leaked_rows: u64,
    /// Children that did not exit by themselves after the deadline, or exited with an error.
    pub failed_children: u64,
    /// Why the final clean-up or count did not work, if it did not.
    pub final_error: Option<String>,
    /// How long the run took.
    pub elapsed: Duration,
}

impl Summary {
    /// The checks that failed (none for a good run).
    pub fn failures(&self) -> Vec<String> {
        let t = &self.totals;
        let mut failures = Vec::new();
        for (name, value) in [
            ("violations", t.violations),
            ("permit_violations", self.permit_violations),
            ("election_violations", self.election_violations),
            ("election_order_violations", self.election_order_violations),
            ("election_untold_refusals", t.election_untold_refusals),
            ("late_losses", t.late_losses),
            ("lost_updates", t.lost_updates),
            ("stale_writes_accepted", t.stale_writes_accepted),
            ("leaked_rows", self.leaked_rows),
            ("storage_errors", t.storage_errors),
            ("stops_unnoticed", t.stops_unnoticed),
            ("register_errors", t.register_errors),
            ("failed_children", self.failed_children),
        ] {
            if value != 0 {
                failures.push(format!("{name} = {value}"));
            }
        }
        if let Some(error) = &self.final_error {
            failures.push(error.clone());
        }
        failures
    }

    /// One JSON object on one line.
    pub fn json(&self) -> String {
        let t = &self.totals;
        let fields = [
            ("seed", self.seed),
            ("operations", t.operations),
            ("grants", t.grants),
            ("shared_grants", t.shared_grants),
            ("exclusive_grants", t.exclusive_grants),
            ("permit_grants", t.permit_grants),
            ("interruptions", t.interruptions),
            ("kills", self.kills),
            ("stops", self.stops),
            ("lost_signals", t.lost_signals),
            ("lost_on_release", t.lost_on_release),
            ("violations", t.violations),
            ("permits_limit", self.permits_limit),
            ("permits_most", self.permits_most),
            ("permit_overruns", self.permit_overruns),
            ("permit_violations", self.permit_violations),
            ("election_grants", t.election_grants),
            ("election_terms", self.election_terms),
            ("election_resigned", t.election_resigned),
            ("election_lease_lost", t.election_lease_lost),
            ("election_writes", t.election_writes),
            ("election_stopped_leaders", t.election_stopped_leaders),
            ("election_overlaps_excused", self.election_overlaps_excused),
            ("election_overlaps_told", self.election_overlaps_told),
            ("election_violations", self.election_violations),
            ("election_order_excused", self.election_order_excused),
            ("election_order_violations", self.election_order_violations),
            (
                "election_stale_writes_refused",
                t.election_stale_writes_refused,
            ),
            ("election_losses_masked", t.election_losses_masked),
            ("election_untold_refusals", t.election_untold_refusals),
            ("late_losses", t.late_losses),
            ("lost_updates", t.lost_updates),
            ("stale_writes_accepted", t.stale_writes_accepted),
            ("stale_writes_refused", t.stale_writes_refused),
            ("leaked_rows", self.leaked_rows),
            ("storage_errors", t.storage_errors),
            ("stops_unnoticed", t.stops_unnoticed),
            ("failed_children", self.failed_children),
            ("connection_kills", self.connection_kills),
            ("server_restarts", self.server_restarts),
            ("skewed_children", self.skewed_children),
            ("clock_steps", self.clock_steps),
            ("restart_storage_errors", t.restart_storage_errors),
        ];
        let body: Vec<String> = fields
            .iter()
            .map(|(name, value)| format!("\"{name}\":{value}"))
            .collect();
        format!("{{{}}}", body.join(","))
    }

    /// For people.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "torture run on {}: seed {}, {:.1} s, {} kills, {} stops, {} connection kills, \
             {} restarts, {} skewed children, {} clock steps, {} rows left\n",
            self.backend,
            self.seed,
            self.elapsed.as_secs_f64(),
            self.kills,
            self.stops,
            self.connection_kills,
            self.server_restarts,
            self.skewed_children,
            self.clock_steps,
            self.leaked_rows
        );
        if self.permits_limit > 0 {
            text.push_str(&format!(
                "permits: at most {} of {} held at once by holders whose leases held; the limit \
                 passed {} times with lost leases making up the excess, {} times without\n",
                self.permits_most, self.permits_limit, self.permit_overruns, self.permit_violations
            ));
        }
        if self.election_terms > 0 {
            text.push_str(&format!(
                "election: {} terms; pairs of bodies overlapped {} times excused by a pause, a \
                 kill or the earlier leader's being told ({} by being told alone), {} times not; \
                 terms out of order {} times just after a pause, {} times otherwise\n",
                self.election_terms,
                self.election_overlaps_excused,
                self.election_overlaps_told,
                self.election_violations,
                self.election_order_excused,
                self.election_order_violations
            ));
        }
        for (name, value) in self.totals.fields() {
            text.push_str(&format!("  {name:<24} {value}\n"));
        }
        let failures = self.failures();
        if failures.is_empty() {
            text.push_str("all checks passed");
        } else {
            text.push_str(&format!("FAILED: {}", failures.join(", ")));
        }
        text
    }
}

/// What the parent does next.
pub(crate) enum Fault {
    Kill,
    Stop,
    Cut,
}

/// Runs the parent: starts the children, injects faults until the deadline, collects the
/// counters, and checks that the database (`store`) is left empty.
pub fn run(config: &Config, store: &Store) -> Summary {
    let started = Instant::now();
    // A folder of its own, as several runs may share a process (the tests) and a seed.
    let folder = tempfile::Builder::new()
        .prefix(&format!("leasehold-torture-{}-", config.seed))
        .tempdir()
        .expect("create the run's folder")
        .keep();
    let place = store.place(&folder);
    let mut summary = Summary {
        seed: config.seed,
        backend: match config.backend {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        },
        skewed_children: (0..config.processes)
            .filter(|&id| clock_skew(config.backend, id) != 0)
            .count() as u64,
        ..Summary::default()
    };
    // The parent's own owner: it only looks (inspect) to pick whom to kill or pause.
    let observer = smol::block_on(
        place.named("torture-parent").manager(
            LockManager::builder()
                .lease(config.lease)
                .heartbeat(config.heartbeat),
        ),
    )
    .expect("open the lock database");
    if let Err(error) = store.keep_history(&folder) {
        eprintln!("the store's history is not kept (a violation will be told without it): {error}");
    }
    let note_fault = |what: &str, tag: &str| {
        append(
            &folder.join("faults"),
            &format!("{}\t{what}\t{tag}\n", unix_micros()),
        );
    };
    let note_mono_fault = |line: String| append(&folder.join(MONO_FAULTS_FILE), &line);
    let run_start = unix_micros();
    let deadline = run_start + (config.seconds * 1e6) as u64;
    let mut incarnations = 0u64;
    let mut spawn = |id: usize| {
        incarnations += 1;
        spawn_child(config, &folder, &place, id, incarnations, deadline)
    };
    let mut workers: Vec<Worker> = (0..config.processes).map(&mut spawn).collect();
    let mut rng = Rng::new(config.seed);
    // Faults start once the children are busy, and the last pause ends well before the deadline.
    let pause_for = || config.lease + config.lease / 2;
    let fault_window_end =
        deadline.saturating_sub(micros(pause_for() + config.lease / 2) + 600_000);
    let mut next_fault = unix_micros() + (config.seconds * 0.2e6) as u64;
    // The restarts (of a server this run started): fast at 30 % of the run, a crash at 50 %.
    let restarts: Vec<(u64, bool)> = [(0.3, false), (0.5, true)]
        .into_iter()
        .filter(|_| store.restarts())
        .map(|(at, immediate)| (run_start + (config.seconds * at * 1e6) as u64, immediate))
        .collect();
    let mut windows: Vec<(u64, u64)> = Vec::new();
    // The children's shared wall-clock offset, stepped every few seconds, alternately forward
    // and back by 2 to 5 s, as an NTP step (or `date -s`) is seen by every process at once.
    let mut offset = 0i64;
    let mut next_step = run_start + (config.seconds * 0.1e6) as u64;
    while unix_micros() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        let now = unix_micros();
        if now > fault_window_end {
            continue;
        }
        if config.clock_steps && now >= next_step {
            let by = micros(rng.millis(2_000, 5_000)) as i64;
            let by = if summary.clock_steps % 2 == 0 {
                by
            } else {
                -by
            };
            offset += by;
            publish(&folder.join(CLOCK_FILE), &offset.to_string());
            note_fault(&format!("clock stepped by {} ms", by / 1_000), "");
            summary.clock_steps += 1;
            next_step = now + micros(rng.millis(1_000, 3_000));
        }
        if let Some(&(at, immediate)) = restarts.get(summary.server_restarts as usize) {
            if now >= at {
                let how = if immediate { "immediate" } else { "fast" };
                note_fault(&format!("server restart ({how}) begins"), "");
                restart(store, &folder, &mut windows, immediate);
                note_fault(&format!("server restart ({how}) ends"), "");
                summary.server_restarts += 1;
                next_fault = unix_micros() + micros(rng.millis(100, 300));
                continue;
            }
        }
        if now < next_fault {
            continue;
        }
        let holders = smol::block_on(observer.inspect(None)).unwrap_or_default();
        // The first fault is a kill, the second a pause, the third (on PostgreSQL) a cut
        // connection; then any, at random.
        let cuts = config.cut_connections && store.cuts_connections();
        let fault = match (summary.kills, summary.stops, summary.connection_kills) {
            (0, _, _) => Fault::Kill,
            (_, 0, _) => Fault::Stop,
            (_, _, 0) if cuts => Fault::Cut,
            _ if cuts => match rng.below(100) {
                0..=34 => Fault::Cut,
                35..=59 => Fault::Kill,
                _ => Fault::Stop,
            },
            _ if rng.chance(40) => Fault::Kill,
            _ => Fault::Stop,
        };
        let kill = !matches!(fault, Fault::Stop);
        let Some(index) = pick_victim(&workers, &holders, kill, &mut rng) else {
            continue;
        };
        if let Fault::Cut = fault {
            let name = format!("torture-{}", workers[index].tag());
            if store.cut_connections(&name) > 0 {
                summary.connection_kills += 1;
                note_fault("connections cut", &workers[index].tag());
            }
        } else if kill {
            let worker = &mut workers[index];
            let _ = worker.child.kill();
            let _ = worker.child.wait();
            summary.kills += 1;
            let tag = worker.tag();
            note_fault("killed", &tag);
            note_mono_fault(format!("killed\t{tag}\t{}\n", mono_micros()));
            for key in KEYS {
                let _ = smol::block_on(Register::new(&folder, key).clear(&tag));
            }
            for key in PERMIT_KEYS.iter().filter(|_| config.permits) {
                let _ = smol::block_on(Tally::new(&folder, key).clear(&tag));
            }
            let id = worker.id;
            workers[index] = spawn(id);
        } else {
            let worker = &workers[index];
            let pid = worker.child.id().to_string();
            let stopped_at = unix_micros();
            let stopped_mono = mono_micros();
            if signal(&pid, "-STOP") {
                note_fault("stopped", &worker.tag());
                wait_until_stopped(&pid);
                // Written while the child is stopped: whatever reads it has really been paused.
                publish(
                    &folder.join(format!("stopped-{}", worker.tag())),
                    &stopped_at.to_string(),
                );
                std::thread::sleep(pause_for() + config.lease / 2 * rng.below(100) as u32 / 100);
                signal(&pid, "-CONT");
                note_fault("continued", &worker.tag());
                note_mono_fault(format!(
                    "stopped\t{}\t{stopped_mono}\t{}\n",
                    worker.tag(),
                    mono_micros()
                ));
                summary.stops += 1;
            }
        }
        // Soon after the first kill come the first pause and cut, so that short runs see them.
        let gap = if summary.stops == 0 || (cuts && summary.connection_kills == 0) {
            rng.millis(100, 300)
        } else {
            rng.millis(500, 2_500)
        };
        next_fault = unix_micros() + micros(gap);
    }
    for worker in &mut workers {
        match wait_for_exit(&mut worker.child, Duration::from_secs(30)) {
            Ok(()) => {}
            Err(why) => {
                summary.failed_children += 1;
                eprintln!(
                    "child {} {why} (its log: {})",
                    worker.tag(),
                    folder.join(format!("child-{}.log", worker.tag())).display()
                );
            }
        }
    }
    let _ = smol::block_on(observer.shutdown());
    drop(observer);
    summary.leaked_rows = match final_count(config, store, &folder) {
        Ok(rows) => rows,
        Err(error) => {
            summary.final_error = Some(format!("the final count failed: {error}"));
            0
        }
    };
    for entry in fs::read_dir(&folder).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("counters-") && !name.ends_with(".part") {
            summary
                .totals
                .add(&fs::read_to_string(entry.path()).unwrap_or_default());
        }
    }
    if config.permits {
        judge_permits(&mut summary, &folder);
    }
    if config.election {
        judge_election(&mut summary, &folder);
    }
    summary.elapsed = started.elapsed();
    explain_suspects(config, store, &folder);
    if summary.failures().is_empty() {
        let _ = fs::remove_dir_all(&folder);
        store.forget();
    } else {
        eprintln!(
            "the run's files (child logs, registers, tallies, database) are kept in {}",
            folder.display()
        );
    }
    summary
}

/// Judges the permits keys' tallies, and notes the holders of every violation as suspects (see
/// `suspect`), to be explained with the others.
pub(crate) fn judge_permits(summary: &mut Summary, folder: &Path) {
    let findings = PermitsFindings::read(folder, &PERMIT_KEYS);
    summary.permits_limit = findings.limit;
    summary.permits_most = findings.most;
    summary.permit_overruns = findings.overruns;
    summary.permit_violations = findings.violations.len() as u64;
    for (key, overrun) in &findings.violations {
        eprintln!(
            "permits of {key:?}: {} of {} held at once by holders whose leases held: {overrun:?}",
            overrun.held(),
            overrun.limit
        );
        for (holder, verdict) in &overrun.members {
            if *verdict == Verdict::Held {
                append(
                    &folder.join("suspects"),
                    &format!(
                        "permits violation\t{}\t{}\t{key}\t{}\t{}\n",
                        holder.mark.tag, holder.mark.token, holder.granted_at, overrun.at
                    ),
                );
            }
        }
    }
}

/// Judges the election keys' records (`election.rs`), and notes both bodies of every violation
/// as suspects, to be explained with the others.
pub(crate) fn judge_election(summary: &mut Summary, folder: &Path) {
    let findings = ElectionFindings::read(folder, &ELECTION_KEYS);
    summary.election_terms = findings.terms;
    summary.election_overlaps_excused = findings.overlaps_excused;
    summary.election_overlaps_told = findings.overlaps_told;
    summary.election_violations = findings.violations.len() as u64;
    summary.election_order_excused = findings.order_excused;
    summary.election_order_violations = findings.order_violations.len() as u64;
    let found = (findings
        .violations
        .iter()
        .map(|pair| ("election overlap", pair)))
    .chain(
        findings
            .order_violations
            .iter()
            .map(|pair| ("election order", pair)),
    );
    for (what, (key, earlier, later)) in found {
        eprintln!("{what} on {key:?}: {earlier:?} then {later:?}");
        for body in [earlier, later] {
            append(
                &folder.join("suspects"),
                &format!(
                    "{what}\t{}\t{}\t{key}\t{}\t{}\n",
                    body.tag, body.term, earlier.began.unix, later.began.unix
                ),
            );
        }
    }
}

pub(crate) fn micros(duration: Duration) -> u64 {
    duration.as_micros() as u64
}

/// Restarts the server, and publishes the restart's window for the children while it runs
/// and once it is over.
pub(crate) fn restart(
    store: &Store,
    folder: &Path,
    windows: &mut Vec<(u64, u64)>,
    immediate: bool,
) {
    let publish_windows = |windows: &[(u64, u64)]| {
        let lines: Vec<String> = windows.iter().map(|(s, e)| format!("{s} {e}\n")).collect();
        publish(&folder.join("restarts"), &lines.concat());
    };
    windows.push((unix_micros(), u64::MAX));
    publish_windows(windows);
    store.restart(immediate);
    if let Some(window) = windows.last_mut() {
        window.1 = unix_micros();
    }
    publish_windows(windows);
}

pub(crate) fn spawn_child(
    config: &Config,
    folder: &Path,
    place: &Place,
    id: usize,
    incarnation: u64,
    deadline: u64,
) -> Worker {
    let log = fs::File::create(folder.join(format!("child-{id}.{incarnation}.log")))
        .expect("create a child's log");
    let seed = config.seed ^ (id as u64) << 32 ^ incarnation;
    let mut command = Command::new(&config.child_command[0]);
    place
        .named(&format!("torture-{id}.{incarnation}"))
        .to_env(&mut command);
    let child = command
        .args(&config.child_command[1..])
        .env(CHILD_ENV, folder)
        .env("TORTURE_ID", id.to_string())
        .env("TORTURE_INCARNATION", incarnation.to_string())
        .env("TORTURE_SEED", seed.to_string())
        .env("TORTURE_TASKS", config.tasks.to_string())
        .env("TORTURE_LEASE_MS", config.lease.as_millis().to_string())
        .env(
            "TORTURE_HEARTBEAT_MS",
            config.heartbeat.as_millis().to_string(),
        )
        .env("TORTURE_DEADLINE", deadline.to_string())
        .env("TORTURE_HOLD_MS", config.hold.as_millis().to_string())
        .env("TORTURE_PERMITS", u8::from(config.permits).to_string())
        .env("TORTURE_ELECTION", u8::from(config.election).to_string())
        .env(
            "TORTURE_RUNTIME",
            match config.runtime {
                Runtime::Smol => "smol",
                Runtime::Tokio => "tokio",
            },
        )
        .env(
            "TORTURE_SKEW_MS",
            clock_skew(config.backend, id).to_string(),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("share the log"))
        .stderr(log)
        .spawn()
        .expect("start a child");
    Worker {
        id,
        incarnation,
        child,
    }
}

/// A child to kill (one that holds or waits) or to pause (one that holds, exclusively or permits
/// if any).
pub(crate) fn pick_victim(
    workers: &[Worker],
    rows: &[leasehold::LockEntry],
    kill: bool,
    rng: &mut Rng,
) -> Option<usize> {
    let score = |worker: &Worker| {
        let pid = worker.child.id().to_string();
        let mine = rows
            .iter()
            // An owner is `host:pid:…`.
            .filter(|row| row.owner.split(':').nth(1) == Some(pid.as_str()));
        mine.map(|row| match (&row.state, row.mode) {
            (EntryState::Held, Mode::Exclusive | Mode::Permits { .. }) => 4,
            (EntryState::Held, Mode::Shared) => 2,
            (EntryState::Waiting { .. }, _) if kill => 1,
            _ => 0,
        })
        .max()
        .unwrap_or(0)
    };
    let best = workers.iter().map(score).max()?;
    if best == 0 {
        // Nobody holds anything right now: try again at the next tick.
        return None;
    }
    let candidates: Vec<usize> = (0..workers.len())
        .filter(|&i| score(&workers[i]) == best)
        .collect();
    Some(candidates[rng.below(candidates.len() as u64) as usize])
}

pub(crate) fn signal(pid: &str, which: &str) -> bool {
    Command::new("kill")
        .args([which, pid])
        .status()
        .is_ok_and(|status| status.success())
}

/// Waits (briefly) until the kernel reports the process as stopped.
pub(crate) fn wait_until_stopped(pid: &str) {
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the parenthesised command name.
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next());
        if matches!(state, Some("T") | None) {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits for `child` to exit by itself; else says why not. A child still running at `limit`
/// has its threads' stacks written to its log (by `gdb`, if the machine has it), then is killed.
pub(crate) fn wait_for_exit(child: &mut Child, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("exited with {status}")),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let stacks = Command::new("gdb")
                    .args([
                        "-p",
                        &child.id().to_string(),
                        "-batch",
                        "-ex",
                        "thread apply all bt",
                    ])
                    .stdin(Stdio::null())
                    .output();
                let _ = child.kill();
                let _ = child.wait();
                return Err(match stacks {
                    Ok(stacks) => format!(
                        "did not finish in time; killed. Its threads were at:\n{}",
                        String::from_utf8_lossy(&stacks.stdout)
                    ),
                    Err(_) => "did not finish in time; killed (no gdb to show where)".into(),
                });
            }
            Err(error) => return Err(format!("could not be waited for: {error}")),
        }
    }
}

/// For every holder the children suspected (see `suspect`): the store's history of the key
/// around it, and the faults the parent made then, printed and kept in the run's folder
/// (`explain.txt`).
pub(crate) fn explain_suspects(config: &Config, store: &Store, folder: &Path) {
    let suspects = fs::read_to_string(folder.join("suspects")).unwrap_or_default();
    let faults = fs::read_to_string(folder.join("faults")).unwrap_or_default();
    let lease = micros(config.lease);
    let mut report = String::new();
    for line in suspects.lines().take(10) {
        let fields: Vec<&str> = line.split('\t').collect();
        let [what, tag, token, key, granted_at, detected_at] = fields[..] else {
            continue;
        };
        let (Ok(granted_at), Ok(detected_at)) =
            (granted_at.parse::<u64>(), detected_at.parse::<u64>())
        else {
            continue;
        };
        let (from, to) = (granted_at.saturating_sub(2 * lease), detected_at + lease);
        report.push_str(&format!(
            "\n== {what}: child {tag}, token {token}, key {key:?}, granted at {granted_at}, \
             seen at {detected_at} (unix µs)\n-- faults from {from} to {to}:\n"
        ));
        for fault in faults.lines() {
            let at = fault
                .split('\t')
                .next()
                .and_then(|at| at.parse::<u64>().ok());
            if at.is_some_and(|at| (from..=to).contains(&at)) {
                report.push_str(fault);
                report.push('\n');
            }
        }
        report.push_str(&format!("-- the store's history of {key:?}:\n"));
        match store.history(folder, key, from, to) {
            Ok(history) => report.push_str(&history),
            Err(error) => report.push_str(&format!("(not read: {error})")),
        }
        report.push('\n');
    }
    if !report.is_empty() {
        publish(&folder.join("explain.txt"), &report);
        eprintln!("what the store saw of the suspected holders:{report}");
    }
}

/// After one lease, a fresh owner's write transaction deletes the rows of killed children that
/// ran out; then every row left in the database is counted, live or not.
pub(crate) fn final_count(
    config: &Config,
    store: &Store,
    folder: &Path,
) -> Result<u64, Box<dyn std::error::Error>> {
    std::thread::sleep(config.lease + config.heartbeat);
    let builder = LockManager::builder()
        .lease(config.lease)
        .heartbeat(config.heartbeat);
    let place = store.place(folder).named("torture-cleaner");
    let cleaner = smol::block_on(place.manager(builder))?;
    smol::block_on(async {
        let guard = cleaner
            .try_acquire(LockRequest::exclusive("torture/clean-up", "clean-up"))
            .await?;
        if let Some(guard) = guard {
            guard.release().await?;
        }
        cleaner.shutdown().await
    })?;
    drop(cleaner);
    store.count_rows(folder)
}
