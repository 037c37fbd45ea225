//! The election workload (not with `--no-election`): one task in four of every child leads the
//! election keys (`ELECTION_KEYS`) over and over with `LockManager::lead`; the parent judges the
//! bodies' records at the end.
//!
//! A body, while it leads, enters its key's *leader log* and writes to it a few times, pausing
//! up to `--hold-ms` before each write, then ends by itself (and `lead` resigns), unless it is
//! interrupted first: by its lease, or by the run (a timeout on one `lead` in five). The leader
//! log is a fenced resource as the register is: it refuses a term lower than the highest it has
//! taken. Each body records, in its key's `election-KEY` file, its term, its child, when it
//! began (its first step) and when it ended (its clean-up finalizer, the last thing in it) on the
//! machine's monotonic clock (`mono_micros`, which every process reads alike), and whether it
//! had been told that its lease was lost. The parent keeps its pauses and kills on the same
//! clock (`MONO_FAULTS_FILE`).
//!
//! What the library can promise, and so what is checked:
//!
//! 1. A leader whose process runs is told a margin (`LockManager::margin`) before its lease
//!    runs out as that process knows it (the body is interrupted with `LeaseLost`), and `lead`
//!    releases only after the body's clean-up; the store grants the key to nobody else before
//!    the lease has run out. So the body ends before the next body of its key begins, or it was told.
//! 2. A leader whose process is paused (SIGSTOP) or killed can be told nothing: the next one may
//!    begin while its body is frozen. A paused leader must be told once it resumes: a body that
//!    a pause fell in ends `lead` with `LeadError::Lock(LockError::LeaseLost(_))`, else it counts
//!    in `stops_unnoticed`. With one exception, counted in `election_losses_masked`: when the
//!    run's timeout on that `lead` also came due during the pause, `lead` ends `Interrupted`
//!    (the outer signal is looked at first, and the release's `LeaseLost` on that path is only
//!    logged), so the leader must have been told by `lost()` before its body ended.
//! 3. So an *overlap*, a body that begins while an earlier one of its key has not ended, is
//!    excused when the earlier body's process was paused during it, or the earlier body was told
//!    by its end (its scope closed interrupted with `LeaseLost`, or its `lost()` had fired), or
//!    its process was killed before it recorded its end (its end is then the kill, and whether it
//!    had been told is unknown: the check never blames a body it cannot judge, at the price of
//!    missing one that a kill hides). Any other overlap is an `election_violations`.
//! 4. Terms strictly increase in the order bodies begin, per key (grants are FIFO with
//!    increasing tickets, and a leader's body begins at once). A body that begins after one with
//!    a higher term is an `election_order_violations`, unless its process was paused just before
//!    it began (within `PAUSE_SLACK` after a pause ended): then its lease ran out between its
//!    grant and its first step.
//! 5. A write the leader log refuses comes from a superseded leader, which must have been told by
//!    then (`election_stale_writes_refused`): if it was told only later, it counts in
//!    `late_losses`; if never, in `election_untold_refusals`. A leader paused during its body
//!    writes once more after `lead` ends, as a process that ignores `lost()` would: the log must
//!    refuse it if a newer leader has entered since (`election_stale_writes_refused` again), and
//!    may take it if none has (`late_writes_accepted`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use leasehold::{ExitStatus, Interrupted, LeadError, Leadership, LeaseLost, TimedOut};

use super::*;

/// The file in the run's folder where the parent keeps its pauses and kills on the monotonic
/// clock: `stopped TAG FROM TO` and `killed TAG AT`.
pub(crate) const MONO_FAULTS_FILE: &str = "faults-monotonic";

/// How long after a pause ends a body that begins counts as paused just before (invariant 4).
pub(crate) const PAUSE_SLACK: u64 = 1_000_000;

/// How many of a child's `tasks` lead: one in four, at least one.
pub(crate) fn leading_tasks(tasks: u64) -> u64 {
    (tasks / 4).max(1)
}

/// The leader log of an election key: the fence and how many writes it took.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct LeaderLogState {
    /// The highest term it has taken.
    pub(crate) fence: u64,
    pub(crate) writes: u64,
    /// The leader that entered or wrote last.
    pub(crate) last: Option<Mark>,
}

impl FileState for LeaderLogState {
    fn parse(text: &str) -> LeaderLogState {
        let mut state = LeaderLogState::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(what), Some(number)) = (words.next(), words.next()) else {
                continue;
            };
            let number: u64 = number.parse().unwrap_or(0);
            match what {
                "fence" => state.fence = number,
                "writes" => state.writes = number,
                "last" => {
                    state.last = Some(Mark {
                        token: number,
                        tag: words.next().unwrap_or("").to_owned(),
                    })
                }
                _ => {}
            }
        }
        state
    }

    fn render(&self) -> String {
        let mut text = format!("fence {}\nwrites {}\n", self.fence, self.writes);
        if let Some(last) = &self.last {
            text.push_str(&format!("last {} {}\n", last.token, last.tag));
        }
        text
    }
}

impl LeaderLogState {
    /// Takes the leader `mark` in (`entering`) or its write, unless a newer term has been here.
    pub(crate) fn take(&mut self, mark: &Mark, entering: bool) -> bool {
        if mark.token < self.fence {
            return false;
        }
        self.fence = mark.token;
        self.writes += u64::from(!entering);
        self.last = Some(mark.clone());
        true
    }
}

/// An election key's leader log and its bodies' records.
#[derive(Clone)]
pub(crate) struct LeaderLog {
    pub(crate) key: String,
    pub(crate) path: PathBuf,
    pub(crate) records: PathBuf,
}

impl LeaderLog {
    pub(crate) fn new(folder: &Path, key: &str) -> LeaderLog {
        LeaderLog {
            key: key.to_owned(),
            path: folder.join(format!("leader-log-{key}")),
            records: folder.join(format!("election-{key}")),
        }
    }

    /// Enters (`entering`) or writes as the leader `mark`; whether the fence let it.
    pub(crate) async fn take(&self, mark: &Mark, entering: bool) -> std::io::Result<bool> {
        update_locked(&self.path, |state: &mut LeaderLogState| {
            state.take(mark, entering)
        })
        .await
    }

    /// Records that the body of `mark` began at `at`.
    pub(crate) fn began(&self, mark: &Mark, at: Moment) {
        let line = format!(
            "begin\t{}\t{}\t{}\t{}\n",
            mark.token, mark.tag, at.mono, at.unix
        );
        append(&self.records, &line);
    }

    /// Records that the body of `mark` ended at `at`, `told` or not that its lease was lost.
    pub(crate) fn ended(&self, mark: &Mark, at: Moment, told: bool) {
        let line = format!(
            "end\t{}\t{}\t{}\t{}\t{}\n",
            mark.token,
            mark.tag,
            at.mono,
            at.unix,
            u8::from(told)
        );
        append(&self.records, &line);
    }
}

/// A moment on the monotonic clock that every process reads alike, and on the wall clock (for
/// the store's history, which is kept by it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Moment {
    pub(crate) mono: u64,
    pub(crate) unix: u64,
}

impl Moment {
    pub(crate) fn now() -> Moment {
        Moment {
            mono: mono_micros(),
            unix: unix_micros(),
        }
    }
}

/// What one `lead` saw of its body, shared between the body and the task that awaits `lead`.
#[derive(Debug, Default)]
pub(crate) struct BodySeen {
    pub(crate) term: u64,
    pub(crate) began: Option<Moment>,
    pub(crate) ended: Option<Moment>,
    pub(crate) told: bool,
    pub(crate) writes: u64,
    /// A write (or the entry) the log refused while the leader had not been told.
    pub(crate) refused_untold: Option<Moment>,
    /// Writes (or the entry) the log refused once the leader had been told.
    pub(crate) refused_told: u64,
    pub(crate) log_errors: u64,
}

fn seen(body: &Mutex<BodySeen>) -> std::sync::MutexGuard<'_, BodySeen> {
    body.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub(crate) async fn election_loop(context: &ChildContext, mut rng: Rng) {
    while unix_micros() < context.deadline {
        lead_once(context, &mut rng).await;
        if rng.chance(30) {
            sleep(rng.millis(0, 20)).await;
        }
    }
}

/// The body: enters the leader log, writes to it 2 to 5 times, and records its begin and end.
pub(crate) fn body(
    log: LeaderLog,
    tag: String,
    hold: Duration,
    margin: Duration,
    mut rng: Rng,
    seen_by_task: Arc<Mutex<BodySeen>>,
) -> impl FnOnce(&Leadership) -> Scoped<(), Interrupted> + Send + 'static {
    move |leadership: &Leadership| {
        let mark = Mark {
            token: leadership.term(),
            tag,
        };
        // Told: `lost()`, or the signal `lead` binds the body to (`margin` earlier).
        let signals = [leadership.lost(), leadership.guard().lost_within(margin)];
        let told = move || signals.iter().any(AbortSignal::is_aborted);
        Scoped::new(move |scope| async move {
            let began = Moment::now();
            log.began(&mark, began);
            {
                let mut seen = seen(&seen_by_task);
                seen.term = mark.token;
                seen.began = Some(began);
            }
            let (end_log, end_mark, end_seen, end_told) = (
                log.clone(),
                mark.clone(),
                seen_by_task.clone(),
                told.clone(),
            );
            scope.add_finalizer(move |status| async move {
                let interrupted_by_lease = matches!(
                    &status,
                    ExitStatus::Interrupted(reason) if reason.downcast_ref::<LeaseLost>().is_some()
                );
                let was_told = interrupted_by_lease || end_told();
                // The last step of the body: whatever comes after it is `lead`'s release.
                let ended = Moment::now();
                end_log.ended(&end_mark, ended, was_told);
                let mut seen = seen(&end_seen);
                seen.ended = Some(ended);
                seen.told = was_told;
            });
            let writes = 2 + rng.below(4);
            let hold = hold.as_millis() as u64;
            for step in 0..=writes {
                if step > 0 {
                    sleep(rng.millis(0, hold)).await;
                }
                let taken = log.take(&mark, step == 0).await;
                let mut seen = seen(&seen_by_task);
                match taken {
                    Ok(true) => seen.writes += u64::from(step > 0),
                    Ok(false) if told() => seen.refused_told += 1,
                    Ok(false) => {
                        seen.refused_untold.get_or_insert_with(Moment::now);
                    }
                    Err(error) => {
                        seen.log_errors += 1;
                        eprintln!("leader log {}: {error}", log.key);
                    }
                }
            }
            Ok(())
        })
    }
}

/// One `lead` of a random election key, and what it comes to (invariants 2 and 5).
pub(crate) async fn lead_once(context: &ChildContext, rng: &mut Rng) {
    bump(&context.counters.operations);
    let key = ELECTION_KEYS[rng.below(ELECTION_KEYS.len() as u64) as usize];
    let log = LeaderLog::new(&context.folder, key);
    let seen_by_body = Arc::new(Mutex::new(BodySeen::default()));
    let body = body(
        log.clone(),
        context.tag.clone(),
        context.hold,
        context.locks.margin(),
        Rng::new(rng.next()),
        seen_by_body.clone(),
    );
    let lead = context.locks.lead(key, &context.tag, body);
    // One in five is interrupted by the run, while it campaigns or leads.
    let lead = if rng.chance(20) {
        let after = rng.millis(0, 4 * context.hold.as_millis() as u64);
        lead.with_signal(&AbortSignal::timeout(after))
    } else {
        lead
    };
    let started = unix_micros();
    let outcome = lead.await;
    let detected_at = unix_micros();
    let seen = std::mem::take(&mut *seen(&seen_by_body));
    if seen.began.is_some() {
        bump(&context.counters.election_grants);
    }
    context
        .counters
        .election_writes
        .fetch_add(seen.writes, Ordering::Relaxed);
    context
        .counters
        .register_errors
        .fetch_add(seen.log_errors, Ordering::Relaxed);
    context
        .counters
        .election_stale_writes_refused
        .fetch_add(seen.refused_told, Ordering::Relaxed);
    let lease_lost = matches!(outcome, Err(LeadError::Lock(LockError::LeaseLost(_))));
    match &outcome {
        Ok(()) => bump(&context.counters.election_resigned),
        Err(LeadError::Lock(LockError::LeaseLost(_))) => {
            bump(&context.counters.election_lease_lost)
        }
        Err(LeadError::Lock(LockError::Interrupted(_)) | LeadError::Body(_)) => {
            bump(&context.counters.interruptions)
        }
        Err(LeadError::Lock(error @ LockError::Storage(_))) if context.stopped_since(started) => {
            bump(&context.counters.expired_waits);
            eprintln!("child {}: leading, after a pause: {error}", context.tag);
        }
        Err(LeadError::Lock(error)) => {
            context.storage_error("leading", error, started);
        }
    }
    let Some(began) = seen.began else {
        return;
    };
    let mark = Mark {
        token: seen.term,
        tag: context.tag.clone(),
    };
    let suspect = |what: &str| {
        append(
            &context.folder.join("suspects"),
            &format!(
                "{what}\t{}\t{}\t{key}\t{}\t{detected_at}\n",
                mark.tag, mark.token, began.unix
            ),
        );
    };
    if let Some(refused) = seen.refused_untold {
        if lease_lost || seen.told {
            bump(&context.counters.late_losses);
            eprintln!(
                "child {}: the leader log refused term {} before it was told (at {})",
                context.tag, mark.token, refused.unix
            );
            suspect("election late loss");
        } else {
            bump(&context.counters.election_untold_refusals);
            eprintln!(
                "child {}: the leader log refused term {}, which was never told",
                context.tag, mark.token
            );
            suspect("election untold refusal");
        }
    }
    // Paused during its body: the pause began after the body began and before it ended.
    let ended = seen.ended.map_or(detected_at, |ended| ended.unix);
    let paused = context.stopped_since(began.unix) && !context.stopped_since(ended + 1);
    if !paused {
        return;
    }
    bump(&context.counters.election_stopped_leaders);
    // The run's own timeout came due during the pause too, and won: `lead` says `Interrupted`,
    // though the lease was lost and `lost()` fired (invariant 2's exception).
    let timed_out = matches!(
        &outcome,
        Err(LeadError::Lock(LockError::Interrupted(interrupted)))
            if interrupted.reason().downcast_ref::<TimedOut>().is_some()
    );
    if timed_out && seen.told {
        bump(&context.counters.election_losses_masked);
        eprintln!(
            "child {}: leader of {key} (term {}) paused past its lease and timed out: lead \
             ended Interrupted, not LeaseLost, though lost() fired",
            context.tag, mark.token
        );
    } else if !lease_lost {
        bump(&context.counters.stops_unnoticed);
        eprintln!(
            "child {}: leader of {key} (term {}) paused past its lease, yet lead ended {:?}",
            context.tag,
            mark.token,
            outcome.as_ref().map_err(ToString::to_string)
        );
        suspect("election stop unnoticed");
        return;
    }
    match log.take(&mark, false).await {
        Ok(false) => bump(&context.counters.election_stale_writes_refused),
        // Nobody newer came: the write is late but harms no one.
        Ok(true) => bump(&context.counters.late_writes_accepted),
        Err(error) => {
            bump(&context.counters.register_errors);
            eprintln!("child {}: leader log {key}: {error}", context.tag);
        }
    }
}

/// A body as its records tell it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LeaderBody {
    pub(crate) term: u64,
    pub(crate) tag: String,
    pub(crate) began: Moment,
    /// `None`: its end was not recorded (its child was killed).
    pub(crate) ended: Option<Moment>,
    pub(crate) told: bool,
}

impl LeaderBody {
    /// Reads a key's `election-KEY` records: one body per term, in no particular order.
    pub(crate) fn parse_records(text: &str) -> Vec<LeaderBody> {
        let mut bodies: BTreeMap<u64, LeaderBody> = BTreeMap::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split('\t').collect();
            let number = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
            let (Some(term), Some(tag), Some(mono), Some(unix)) =
                (number(1), fields.get(2), number(3), number(4))
            else {
                continue;
            };
            let at = Moment { mono, unix };
            let body = bodies.entry(term).or_insert_with(|| LeaderBody {
                term,
                tag: (*tag).to_owned(),
                began: at,
                ended: None,
                told: false,
            });
            match fields[0] {
                "begin" => body.began = at,
                "end" => {
                    body.ended = Some(at);
                    body.told = number(5) == Some(1);
                }
                _ => {}
            }
        }
        bodies.into_values().collect()
    }
}

/// The parent's pauses and kills on the monotonic clock (`MONO_FAULTS_FILE`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct MonoFaults {
    /// Child tag, from, to.
    pub(crate) stops: Vec<(String, u64, u64)>,
    /// Child tag, when.
    pub(crate) kills: Vec<(String, u64)>,
}

impl MonoFaults {
    pub(crate) fn parse(text: &str) -> MonoFaults {
        let mut faults = MonoFaults::default();
        for line in text.lines() {
            let fields: Vec<&str> = line.split('\t').collect();
            let number = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
            match (fields[0], fields.get(1)) {
                ("stopped", Some(tag)) => {
                    if let (Some(from), Some(to)) = (number(2), number(3)) {
                        faults.stops.push(((*tag).to_owned(), from, to));
                    }
                }
                ("killed", Some(tag)) => {
                    if let Some(at) = number(2) {
                        faults.kills.push(((*tag).to_owned(), at));
                    }
                }
                _ => {}
            }
        }
        faults
    }

    fn killed_at(&self, tag: &str) -> Option<u64> {
        (self.kills.iter())
            .find(|(killed, _)| killed == tag)
            .map(|(_, at)| *at)
    }

    fn paused_during(&self, tag: &str, from: u64, to: u64) -> bool {
        (self.stops.iter())
            .any(|(stopped, start, end)| stopped == tag && *start < to && from < *end)
    }
}

/// Two bodies of a key that broke invariant 3 or 4: the earlier (by its beginning) and the later.
pub(crate) type Pair = (String, LeaderBody, LeaderBody);

/// What the election records of a run came to.
#[derive(Clone, Debug, Default)]
pub(crate) struct ElectionFindings {
    /// Bodies recorded (each its own term).
    pub(crate) terms: u64,
    /// Pairs of bodies that overlapped, excused (invariant 3).
    pub(crate) overlaps_excused: u64,
    /// Of those, the ones excused only by the earlier body's having been told (its child was
    /// neither paused nor killed during it): its clean-up outlasted the margin it was given.
    pub(crate) overlaps_told: u64,
    /// Pairs that overlapped, not excused.
    pub(crate) violations: Vec<Pair>,
    /// Bodies that began after a higher term, just after a pause (invariant 4).
    pub(crate) order_excused: u64,
    /// Bodies that began after a higher term, not after a pause: the higher one, and it.
    pub(crate) order_violations: Vec<Pair>,
}

impl ElectionFindings {
    /// Judges the bodies of `key` against the parent's `faults`, adding to what is found.
    pub(crate) fn judge(&mut self, key: &str, mut bodies: Vec<LeaderBody>, faults: &MonoFaults) {
        bodies.sort_by_key(|body| (body.began.mono, body.term));
        self.terms += bodies.len() as u64;
        // Where a body ended on the monotonic clock: as recorded, else when its child was killed
        // (else it still runs).
        let end = |body: &LeaderBody| {
            (body.ended.map(|ended| ended.mono))
                .or_else(|| faults.killed_at(&body.tag))
                .unwrap_or(u64::MAX)
        };
        for (i, later) in bodies.iter().enumerate() {
            for earlier in &bodies[..i] {
                if end(earlier) <= later.began.mono {
                    continue;
                }
                let killed = earlier.ended.is_none() && faults.killed_at(&earlier.tag).is_some();
                let paused = faults.paused_during(&earlier.tag, earlier.began.mono, end(earlier));
                if killed || paused || earlier.told {
                    self.overlaps_excused += 1;
                    self.overlaps_told += u64::from(!killed && !paused);
                } else {
                    self.violations
                        .push((key.to_owned(), earlier.clone(), later.clone()));
                }
            }
            let Some(higher) = bodies[..i].iter().max_by_key(|body| body.term) else {
                continue;
            };
            if higher.term < later.term {
                continue;
            }
            let began = later.began.mono;
            let paused_just_before = (faults.stops.iter()).any(|(tag, from, to)| {
                *tag == later.tag && *from <= began && began <= to.saturating_add(PAUSE_SLACK)
            });
            if paused_just_before {
                self.order_excused += 1;
            } else {
                self.order_violations
                    .push((key.to_owned(), higher.clone(), later.clone()));
            }
        }
    }

    /// Reads the records of `keys` and the parent's faults in `folder`, and judges them.
    pub(crate) fn read(folder: &Path, keys: &[&str]) -> ElectionFindings {
        let faults = MonoFaults::parse(
            &fs::read_to_string(folder.join(MONO_FAULTS_FILE)).unwrap_or_default(),
        );
        let mut findings = ElectionFindings::default();
        for key in keys {
            let records = LeaderLog::new(folder, key).records;
            let text = fs::read_to_string(records).unwrap_or_default();
            findings.judge(key, LeaderBody::parse_records(&text), &faults);
        }
        findings
    }
}
