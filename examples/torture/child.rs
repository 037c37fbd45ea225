//! The child: T tasks doing random lock operations until the deadline.

use super::*;

pub(crate) struct ChildContext {
    pub(crate) folder: PathBuf,
    pub(crate) id: usize,
    pub(crate) tag: String,
    pub(crate) deadline: u64,
    pub(crate) lease: Duration,
    /// The longest pause inside a hold (`Config::hold`).
    pub(crate) hold: Duration,
    /// Whether it takes permits too (`Config::permits`).
    pub(crate) permits: bool,
    /// Whether some of its tasks lead (`Config::election`).
    pub(crate) election: bool,
    pub(crate) locks: LockManager,
    pub(crate) counters: Counters,
}

impl ChildContext {
    /// When the parent last paused this child (set by the parent while the child is stopped, so
    /// that whoever reads it has really been stopped then).
    pub(crate) fn stopped_since(&self, since: u64) -> bool {
        fs::read_to_string(self.folder.join(format!("stopped-{}", self.tag)))
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .is_some_and(|at| at >= since)
    }

    /// Counts a storage error of an operation begun at `since`: apart from the others if it
    /// came in a restart's window. Returns whether it did (the operation may then be retried).
    pub(crate) fn storage_error(&self, doing: &str, error: &LockError, since: u64) -> bool {
        let restart = restart_overlaps(&self.folder, self.lease, since, unix_micros());
        if restart {
            bump(&self.counters.restart_storage_errors);
            eprintln!("child {}: {doing}, during a restart: {error}", self.tag);
        } else {
            bump(&self.counters.storage_errors);
            eprintln!("child {}: {doing}: {error}", self.tag);
        }
        restart
    }
}

pub(crate) fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("the child's {name} is not set"))
}

pub(crate) fn env_number(name: &str) -> u64 {
    env(name)
        .parse()
        .unwrap_or_else(|_| panic!("the child's {name} is not a number"))
}

/// The child's side: reads its settings from the environment that `run` set.
pub fn child_main() {
    let folder = PathBuf::from(env(CHILD_ENV));
    let id = env_number("TORTURE_ID") as usize;
    let incarnation = env_number("TORTURE_INCARNATION");
    let seed = env_number("TORTURE_SEED");
    let tasks = env_number("TORTURE_TASKS");
    let lease = Duration::from_millis(env_number("TORTURE_LEASE_MS"));
    let heartbeat = Duration::from_millis(env_number("TORTURE_HEARTBEAT_MS"));
    let deadline = env_number("TORTURE_DEADLINE");
    let hold = Duration::from_millis(env_number("TORTURE_HOLD_MS"));
    let tokio = env("TORTURE_RUNTIME") == "tokio";
    let permits = env_number("TORTURE_PERMITS") == 1;
    let election = env_number("TORTURE_ELECTION") == 1;
    let skew: i64 = env("TORTURE_SKEW_MS")
        .parse()
        .expect("the child's TORTURE_SKEW_MS is not a number");
    let place = Place::from_env(&folder);
    let counters = Counters::default();
    let steps = follow_clock_steps(&folder);
    let locks = loop {
        let clock = ChildClock {
            skew,
            steps: steps.clone(),
        };
        let builder = LockManager::builder()
            .lease(lease)
            .heartbeat(heartbeat)
            .clock(Arc::new(clock));
        let since = unix_micros();
        match smol::block_on(place.manager(builder)) {
            Ok(locks) => break locks,
            // This child was started just before a restart.
            Err(error) if restart_overlaps(&folder, lease, since, unix_micros()) => {
                bump(&counters.restart_storage_errors);
                eprintln!("child {id}.{incarnation}: opening, during a restart: {error}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(error) => panic!("the child cannot open the lock database: {error}"),
        }
    };
    let context = Arc::new(ChildContext {
        tag: format!("{id}.{incarnation}"),
        folder,
        id,
        deadline,
        lease,
        hold,
        permits,
        election,
        locks,
        counters,
    });
    if tokio {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("start the child's tokio runtime")
            .block_on(child(context, seed, tasks));
    } else {
        smol::block_on(child(context, seed, tasks));
    }
}

pub(crate) async fn child(context: Arc<ChildContext>, seed: u64, tasks: u64) {
    let counters_file = context.folder.join(format!("counters-{}", context.tag));
    let leading = if context.election {
        leading_tasks(tasks)
    } else {
        0
    };
    let fibers: Vec<_> = (0..tasks)
        .map(|task| {
            let context = context.clone();
            let seed = seed ^ ((context.id as u64) << 40) ^ (task << 20);
            fork_daemon(async move {
                if task < leading {
                    election_loop(&context, Rng::new(seed)).await
                } else {
                    task_loop(&context, Rng::new(seed)).await
                }
            })
        })
        .collect();
    while unix_micros() < context.deadline {
        publish(&counters_file, &context.counters.render());
        sleep(Duration::from_millis(100)).await;
    }
    for fiber in fibers {
        let _ = fiber.join().await;
    }
    let since = unix_micros();
    if let Err(error) = context.locks.shutdown().await {
        context.storage_error("shutting down", &error, since);
    }
    publish(&counters_file, &context.counters.render());
}

pub(crate) fn random_request(rng: &mut Rng, key: &str, operation: &str) -> LockRequest {
    if rng.chance(50) {
        LockRequest::shared(key, operation)
    } else {
        LockRequest::exclusive(key, operation)
    }
}

/// Two distinct keys with random modes.
pub(crate) fn random_pair(rng: &mut Rng, operation: &str) -> Vec<LockRequest> {
    let first = rng.below(KEYS.len() as u64) as usize;
    let second = (first + 1 + rng.below(KEYS.len() as u64 - 1) as usize) % KEYS.len();
    vec![
        random_request(rng, KEYS[first], operation),
        random_request(rng, KEYS[second], operation),
    ]
}

/// From 1 to all of `PERMIT_LIMIT` permits of `key`.
pub(crate) fn random_permits(rng: &mut Rng, key: &str, operation: &str) -> LockRequest {
    let count = 1 + rng.below(u64::from(PERMIT_LIMIT)) as u32;
    LockRequest::permits(key, operation, count, PERMIT_LIMIT)
}

/// Permits of `key` and a shared or exclusive key, in either order.
pub(crate) fn mixed_pair(rng: &mut Rng, key: &str, operation: &str) -> Vec<LockRequest> {
    let other = KEYS[rng.below(KEYS.len() as u64) as usize];
    let mut pair = vec![
        random_permits(rng, key, operation),
        random_request(rng, other, operation),
    ];
    if rng.chance(50) {
        pair.reverse();
    }
    pair
}

pub(crate) async fn task_loop(context: &ChildContext, mut rng: Rng) {
    while unix_micros() < context.deadline {
        one_operation(context, &mut rng).await;
        if rng.chance(30) {
            sleep(rng.millis(0, 20)).await;
        }
    }
}

/// How an acquisition may be cut short.
#[derive(Clone, Copy)]
pub(crate) enum Interruption {
    None,
    Timeout(Duration),
    /// A controller aborted from elsewhere after this long.
    Abort(Duration),
    /// The acquisition loses a `select` against a timer and is dropped.
    Drop(Duration),
}

/// What an operation asks for.
pub(crate) enum Ask {
    Try(LockRequest),
    Shared(&'static str),
    Exclusive(&'static str),
    /// `count` permits of a key.
    Permits(&'static str, u32),
    Many(Vec<LockRequest>),
    ManyQueued(Vec<LockRequest>),
}

impl Ask {
    /// With `permits`, three asks in ten are for permits (a run without draws what it drew
    /// before there were permits).
    pub(crate) fn random(rng: &mut Rng, permits: bool) -> Ask {
        if permits && rng.chance(30) {
            return Ask::random_permits(rng);
        }
        let key = KEYS[rng.below(KEYS.len() as u64) as usize];
        match rng.below(100) {
            0..=19 => Ask::Try(random_request(rng, key, "try")),
            20..=44 => Ask::Shared(key),
            45..=74 => Ask::Exclusive(key),
            75..=87 => Ask::Many(random_pair(rng, "many")),
            _ => Ask::ManyQueued(random_pair(rng, "many_queued")),
        }
    }

    /// An ask that takes permits of a key, alone or with a shared or exclusive key.
    pub(crate) fn random_permits(rng: &mut Rng) -> Ask {
        let key = PERMIT_KEYS[rng.below(PERMIT_KEYS.len() as u64) as usize];
        match rng.below(100) {
            0..=19 => Ask::Try(random_permits(rng, key, "try")),
            20..=69 => Ask::Permits(key, 1 + rng.below(u64::from(PERMIT_LIMIT)) as u32),
            70..=84 => Ask::Many(mixed_pair(rng, key, "many")),
            _ => Ask::ManyQueued(mixed_pair(rng, key, "many_queued")),
        }
    }

    /// `None` when the acquisition was dropped.
    pub(crate) async fn acquire(
        &self,
        locks: &LockManager,
        interruption: Interruption,
    ) -> Option<Result<Option<Guard>, LockError>> {
        let acquisition = match self {
            Ask::Try(request) => {
                let attempt = locks.try_acquire(request.clone());
                return match interruption {
                    Interruption::Drop(after) => race(attempt, after).await,
                    _ => Some(attempt.await),
                };
            }
            Ask::Shared(key) => locks.shared(*key, "read"),
            Ask::Exclusive(key) => locks.exclusive(*key, "write"),
            Ask::Permits(key, count) => locks.permits(*key, "share", *count, PERMIT_LIMIT),
            Ask::Many(requests) => locks.many(requests.clone()),
            Ask::ManyQueued(requests) => locks.many_queued(requests.clone()),
        };
        acquisition_with(acquisition, interruption)
            .await
            .map(|result| result.map(Some))
    }
}

pub(crate) async fn one_operation(context: &ChildContext, rng: &mut Rng) {
    bump(&context.counters.operations);
    let ask = Ask::random(rng, context.permits);
    let interruption = match rng.below(100) {
        0..=54 => Interruption::None,
        55..=69 => Interruption::Timeout(rng.millis(1, 300)),
        70..=84 => Interruption::Abort(rng.millis(0, 300)),
        _ => Interruption::Drop(rng.millis(0, 300)),
    };
    let started = unix_micros();
    let acquired = loop {
        let since = unix_micros();
        let acquired = ask.acquire(&context.locks, interruption).await;
        match &acquired {
            Some(Err(error @ LockError::Storage(_))) if !context.stopped_since(started) => {
                if !context.storage_error("acquiring", error, since) {
                    return;
                }
                // The server is restarting: try again.
                sleep(Duration::from_millis(50)).await;
            }
            _ => break acquired,
        }
    };
    let guard = match acquired {
        None => {
            bump(&context.counters.dropped_acquisitions);
            bump(&context.counters.interruptions);
            return;
        }
        Some(Ok(Some(guard))) => guard,
        Some(Ok(None)) => {
            bump(&context.counters.not_granted);
            return;
        }
        Some(Err(LockError::Interrupted(_))) => {
            bump(&context.counters.interruptions);
            return;
        }
        Some(Err(error @ LockError::Storage(_))) if context.stopped_since(started) => {
            // A storage error right after a pause (a waiter whose lease ran out while it was
            // stopped queues again instead, so this is rare: kept apart from real failures).
            bump(&context.counters.expired_waits);
            eprintln!("child {}: after a pause: {error}", context.tag);
            return;
        }
        Some(Err(error)) => {
            context.storage_error("acquiring", &error, started);
            return;
        }
    };
    bump(&context.counters.grants);
    for request in guard.requests() {
        bump(match request.mode {
            Mode::Shared => &context.counters.shared_grants,
            Mode::Exclusive => &context.counters.exclusive_grants,
            Mode::Permits { .. } => &context.counters.permit_grants,
        });
    }
    hold(context, rng, &guard).await;
    if guard.lost().is_aborted() {
        bump(&context.counters.lost_signals);
    }
    if rng.chance(50) {
        let since = unix_micros();
        match guard.release().await {
            Ok(()) => {}
            // The lease ran out while it was held (this child was paused, or starved): the
            // release says so. Whether a write overlapped is the register's to judge.
            Err(LockError::LeaseLost(_)) => bump(&context.counters.lost_on_release),
            Err(error) => {
                context.storage_error("releasing", &error, since);
            }
        }
    } else {
        drop(guard);
    }
}

pub(crate) async fn acquisition_with(
    acquisition: Scoped<Guard, LockError>,
    interruption: Interruption,
) -> Option<Result<Guard, LockError>> {
    match interruption {
        Interruption::None => Some(acquisition.await),
        Interruption::Timeout(after) => {
            Some(acquisition.with_signal(&AbortSignal::timeout(after)).await)
        }
        Interruption::Abort(after) => {
            let controller = AbortController::new();
            let acquisition = acquisition.with_signal(&controller.signal());
            smol::spawn(async move {
                sleep(after).await;
                controller.abort("the torture run interrupts this acquisition");
            })
            .detach();
            Some(acquisition.await)
        }
        Interruption::Drop(after) => race(acquisition, after).await,
    }
}

/// `future`'s output, or `None` (and `future` dropped) if `after` passes first.
pub(crate) async fn race<T>(
    future: impl std::future::Future<Output = T>,
    after: Duration,
) -> Option<T> {
    futures::select! {
        value = future.fuse() => Some(value),
        _ = FutureExt::fuse(smol::Timer::after(after)) => None,
    }
}

/// The protected work on every key the guard holds, one key after another.
pub(crate) async fn hold(context: &ChildContext, rng: &mut Rng, guard: &Guard) {
    let granted_at = unix_micros();
    let mark = Mark {
        token: guard.fencing_token(),
        tag: context.tag.clone(),
    };
    let mut suspicious = false;
    let mut unexplained = false;
    let mut lost_updates = 0;
    let lost = guard.lost();
    for request in guard.requests() {
        match work_on(context, rng, request, &mark, granted_at, &lost).await {
            Ok(outcome) => {
                suspicious |= outcome.suspicious;
                unexplained |= outcome.unexplained;
                lost_updates += outcome.lost_updates;
            }
            Err(error) => {
                bump(&context.counters.register_errors);
                let file = match request.mode {
                    Mode::Permits { .. } => "tally",
                    Mode::Shared | Mode::Exclusive => "register",
                };
                eprintln!("child {}: {file} {}: {error}", context.tag, request.key);
            }
        }
    }
    let stopped = context.stopped_since(granted_at);
    if stopped {
        bump(&context.counters.stopped_holders);
    }
    if suspicious || stopped || lost_updates > 0 {
        // Someone newer was here (or this process was paused past its lease): that is fine only
        // if this holder's lease was lost, and `lost()` must have said so by the time the newer
        // holder's work showed: nobody is granted the lock before the lease has run out, and
        // the lease as this process knows it runs out no later than that.
        let noticed = race(lost.aborted(), context.lease * 3).await.is_some();
        let detected_at = unix_micros();
        if unexplained && noticed {
            bump(&context.counters.late_losses);
            eprintln!(
                "child {}: overlap seen before lost() fired, which it did later ({mark:?})",
                context.tag
            );
            suspect(context, "late loss", guard, granted_at, detected_at);
        }
        if noticed {
            if suspicious || lost_updates > 0 {
                bump(&context.counters.overlaps_after_loss);
            }
            if stopped {
                late_writes(context, guard, &mark).await;
            }
        } else {
            if suspicious {
                bump(&context.counters.violations);
                eprintln!(
                    "child {}: overlap while the lease held ({mark:?})",
                    context.tag
                );
                suspect(context, "violation", guard, granted_at, detected_at);
            }
            if lost_updates > 0 {
                context
                    .counters
                    .lost_updates
                    .fetch_add(lost_updates, Ordering::Relaxed);
            }
            if stopped {
                bump(&context.counters.stops_unnoticed);
                eprintln!(
                    "child {}: paused past the lease, but lost() did not fire",
                    context.tag
                );
            }
        }
    }
}

/// Notes a holder whose overlap with another `lost()` did not explain in time, for the parent to
/// explain with the store's history of the keys (see `Store::history`): one line per key,
/// `what tag token key granted_at detected_at` (unix micros).
pub(crate) fn suspect(
    context: &ChildContext,
    what: &str,
    guard: &Guard,
    granted_at: u64,
    detected_at: u64,
) {
    for request in guard.requests() {
        append(
            &context.folder.join("suspects"),
            &format!(
                "{what}\t{}\t{}\t{}\t{granted_at}\t{detected_at}\n",
                context.tag,
                guard.fencing_token(),
                request.key
            ),
        );
    }
}

/// A holder that was paused past its lease writes once more, as a process that does not look
/// at `lost()` would: the fence must refuse it if anyone newer has been here.
pub(crate) async fn late_writes(context: &ChildContext, guard: &Guard, mark: &Mark) {
    for request in guard.requests() {
        if request.mode != Mode::Exclusive {
            continue;
        }
        let register = Register::new(&context.folder, &request.key);
        let written = match register.read().await {
            Ok(value) => register.write(mark, value).await,
            Err(error) => Err(error),
        };
        match written {
            Ok(Written::Refused) => bump(&context.counters.stale_writes_refused),
            // Nobody newer came: the write is late but harms no one.
            Ok(Written::Accepted { .. }) => bump(&context.counters.late_writes_accepted),
            Err(error) => {
                bump(&context.counters.register_errors);
                eprintln!("child {}: register {}: {error}", context.tag, request.key);
            }
        }
    }
}

pub(crate) struct WorkOutcome {
    /// Another holder's mark was found, or the value changed under a reader.
    pub(crate) suspicious: bool,
    /// Something suspicious was seen while `lost()` had not fired.
    pub(crate) unexplained: bool,
    pub(crate) lost_updates: u64,
}

impl WorkOutcome {
    /// Another holder's work showed; `lost` should have fired already.
    pub(crate) fn overlap(&mut self, lost: &AbortSignal) {
        self.suspicious = true;
        self.unexplained |= !lost.is_aborted();
    }
}

/// The protected work on the key of `request`: on its register, or on its tally if it is a
/// permits key (where nothing is suspicious on its own: the parent judges the tally's overruns).
pub(crate) async fn work_on(
    context: &ChildContext,
    rng: &mut Rng,
    request: &LockRequest,
    mark: &Mark,
    granted_at: u64,
    lost: &AbortSignal,
) -> std::io::Result<WorkOutcome> {
    let mut outcome = WorkOutcome {
        suspicious: false,
        unexplained: false,
        lost_updates: 0,
    };
    let hold = context.hold.as_millis() as u64;
    if let Mode::Permits { count, limit } = request.mode {
        let tally = Tally::new(&context.folder, &request.key);
        tally.enter(mark, count, limit, granted_at).await?;
        sleep(rng.millis(0, hold)).await;
        sleep(rng.millis(0, hold)).await;
        tally.leave(mark, lost).await?;
        return Ok(outcome);
    }
    let register = Register::new(&context.folder, &request.key);
    let exclusive = request.mode == Mode::Exclusive;
    let entered = register.enter(mark, exclusive).await?;
    let first = match entered {
        Entry::Entered(value) => value,
        Entry::Stale => {
            outcome.overlap(lost);
            register.read().await?
        }
    };
    sleep(rng.millis(0, hold)).await;
    if exclusive {
        match register.write(mark, first).await? {
            Written::Refused => bump(&context.counters.stale_writes_refused),
            Written::Accepted { lost_update, stale } => {
                bump(&context.counters.increments);
                if stale {
                    bump(&context.counters.stale_writes_accepted);
                    eprintln!(
                        "child {}: the fence accepted a stale write ({mark:?})",
                        context.tag
                    );
                }
                if lost_update {
                    outcome.lost_updates += 1;
                    outcome.unexplained |= !lost.is_aborted();
                }
            }
        }
    } else if register.read().await? != first {
        outcome.overlap(lost);
    }
    sleep(rng.millis(0, hold)).await;
    if register.leave(mark).await? {
        outcome.overlap(lost);
    }
    Ok(outcome)
}
