//! The storage worker: one OS thread per manager that owns its storage (see `storage.rs`).
//!
//! Callers send `Command`s (see `protocol.rs`) and await a reply (see `reply.rs`); no storage call
//! happens on a caller's executor thread.
//!
//! Invariants:
//!
//! 1. Commands are handled in the order they were sent. Writes that are ready together run in one
//!    transaction; replies go out only after it commits. Reads in the same batch
//!    run after the writes, so a caller that released (even by dropping a guard) and then
//!    inspects sees its release.
//! 2. Every transaction that deletes rows (release, cancel, shutdown) also promotes, on the keys
//!    of those rows, every waiter the grant rule now allows, whoever owns it, with its ticket
//!    kept. Decisions are key-local: a transaction reads and changes the rows of the keys it
//!    decides on (and of the other keys of the waiters it judges), never the whole table.
//! 3. A request is known to the worker by the caller's request id from the moment its rows are
//!    written until they are deleted. The caller sends `Remove` by that id, so it is right
//!    whether the acquisition was granted, queued or promoted; and since commands are handled in
//!    order, a `Remove` sent after an `Acquire` whose reply was never read still finds its rows.
//! 4. While this owner has waiters, the worker asks storage what other connections changed
//!    (`Storage::changes`, a cheap check) when the poll's schedule says (on the monotonic time of
//!    the manager's clock) or when poked, and remembers, per key it waits on, when the first
//!    other owner's row there runs out (`watch.rs`). It reads a key's rows only when the key
//!    changed or such a lease ran out, and writes only when a waiter is grantable. A lease that
//!    runs out frees its key without anyone writing: the waiting owners' own deadlines are how
//!    they find out.
//! 5. `Shutdown` is the last command handled: commands behind it, even in its own batch, are
//!    dropped unanswered (their callers see `Shutdown`), so no row is written after it.

pub(crate) mod protocol;
pub(crate) mod siblings;
pub(crate) mod watch;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{Clock, SystemClock};
use crate::lock::backend::{
    AtOnce, Capabilities, Changes, Deleted, Outcome, OwnedRequest, Serve, Storage,
};
use crate::lock::grant::{grantable_now, other_keys, promotable_within, RowView};
use crate::lock::state::Counters;
use crate::lock::time::{from_micros, micros, monotonic_at};
use crate::lock::worker::protocol::{
    Acquired, Command, Grant, Removed, SlotState, Wait, WaitSlot, Write,
};
use crate::lock::worker::watch::{first_expiries, others_rows, Look, Waits};
use crate::lock::{Common, LockError, LockRequest};
use crate::schedule::{Schedule, ScheduleRun};
use crate::sync::lock;

/// At most this many commands go into one transaction.
const MAX_BATCH: usize = 256;

/// How long this owner stays marked as waiting (`Storage::waiting`) once its last caller waiting
/// without a row stopped: a task that waits again soon (a busy lock, taken in turns) keeps the
/// marker, rather than putting it up and taking it down at every turn.
const MARKER_LINGER: Duration = Duration::from_secs(1);

/// How long the worker keeps looking for the next command before it blocks.
const SPIN: Duration = Duration::from_micros(100);

/// How long a queued request waits before its heartbeat's fiber is forked (`WaitSlot::arm`): a
/// quarter of a heartbeat, well before its first renewal is due (a heartbeat after it was
/// sent). Most waits end sooner and never fork one.
fn beat_after(heartbeat: Duration) -> Duration {
    heartbeat / 4
}

/// When the worker looks for the next command again before it blocks: at once, for [`SPIN`].
fn spin_schedule() -> Schedule {
    Schedule::spaced(Duration::ZERO).up_to(SPIN)
}

/// The change poll's next look.
enum NextLook {
    /// No waiter: no look. The schedule starts over from the last look when a wait begins.
    Idle,
    /// At this time (the clock's monotonic time).
    At(Duration),
    /// The schedule is done: no look until the next wait begins (or a poke).
    Over,
}

/// What the worker remembers of a request whose rows it wrote.
struct Written {
    ticket: u64,
    keys: Vec<String>,
}

/// What a transaction freed, for waking waiters once it has committed.
struct Freed {
    /// Whether any row was deleted or promoted.
    any: bool,
    /// The promoted tickets, whoever owns them.
    promoted: Vec<u64>,
    /// When the promoted rows' leases began (clock micros).
    at: i64,
    /// The other owners whose requests were promoted: the managers of this process to wake,
    /// besides those with callers waiting without a row.
    owners: BTreeSet<String>,
}

/// The latest time (micros since the epoch) at which leases can be kept: a lease of the longest
/// length the builder accepts (under `i64::MAX / 4` micros) still ends within an `i64`. About
/// 146,000 years from 1970; a clock past it (a custom `Clock`, `TestClock::set_wall_time`) is an
/// error, not an overflow.
const LAST_TIME: i64 = i64::MAX / 2;

/// `now`, or an error if it is past [`LAST_TIME`].
fn within_time_line(now: i64) -> Result<i64, LockError> {
    if now > LAST_TIME {
        return Err(LockError::Storage(format!(
            "the clock reads {now} µs since 1970, past the last time at which leases can be \
             kept ({LAST_TIME} µs)"
        )));
    }
    Ok(now)
}

/// What a write decided inside the transaction, delivered once it has committed.
enum Decided {
    /// Granted, with rows whose lease runs out at `expires_at` (the storage's time).
    Granted {
        ticket: u64,
        expires_at: i64,
    },
    Queued(u64),
    NotNow,
    /// A removal: what it found of the request's rows.
    Removed(Removed),
    /// A renewal: this owner's live requests, all renewed.
    Renewed(Vec<OwnedRequest>),
    Done,
}

/// The worker that a backend hands its storage to once open (`Serve`): it runs there, on the
/// storage thread, until the manager is shut down or every handle is gone.
pub(crate) struct RunWorker {
    common: Arc<Common>,
    commands: Receiver<Command>,
}

impl RunWorker {
    pub(crate) fn new(common: Arc<Common>, commands: Receiver<Command>) -> Self {
        RunWorker { common, commands }
    }
}

impl Serve for RunWorker {
    fn serve<S: Storage>(self, storage: S) {
        Worker::new(storage, self.common, self.commands).run();
    }
}

pub(crate) struct Worker<S> {
    storage: S,
    /// What the storage can do (`Storage::capabilities`), asked once.
    caps: Capabilities,
    common: Arc<Common>,
    rx: Receiver<Command>,
    /// Request id -> its ticket and keys, for every request of this owner that has rows.
    requests: HashMap<u64, Written>,
    /// This owner's queued requests, and the keys it watches (see `watch.rs`).
    waits: Waits,
    /// The change poll's schedule, when it says to look next, and when the last look ended
    /// (the clock's monotonic time).
    poll: ScheduleRun,
    next_look: NextLook,
    last_look: Duration,
    /// Looking for the next command before blocking ([`spin_schedule`]), on real time.
    spin: ScheduleRun,
    poked: bool,
    /// Keys this owner freed rows on by a call that announced them to other owners only
    /// (`Storage::decide_at_once`), where a request of its own on several keys waits: the next
    /// look reads them.
    own_changes: BTreeSet<String>,
    last_renewal: Option<i64>,
    /// Whether the current transaction deleted a row of this owner.
    deleted: bool,
    /// The keys the current transaction's promotion pass looks at: those whose rows it deleted,
    /// and those a look found grantable.
    pass: BTreeSet<String>,
    /// Look at every watched key at the next tick, changed or not.
    look_all: bool,
    /// Whether storage was last told that this owner has waiters (`Storage::waiting`), and
    /// since when it has had none.
    marked_waiting: bool,
    idle_since: Option<Instant>,
    /// Acquisitions whose transaction failed, perhaps at its commit, so perhaps committed:
    /// deleted (if there) by the next transaction.
    doubtful: Vec<Written>,
    /// Whether an acquisition decided in one call (`Storage::decide_at_once`) failed, perhaps
    /// after it committed: its rows, if there, are found (`find_lost_requests`) and deleted
    /// by the next transaction, as `doubtful` ones are.
    lost_replies: bool,
    /// Removals tried in a call or a transaction that failed for a passing reason, perhaps
    /// after it committed: a later try that finds none of their rows cannot tell whether that
    /// first try deleted them (`Removed::GoneAfterLostAnswer`).
    removals_in_doubt: BTreeSet<u64>,
    /// Requests whose removal failed: retried with every heartbeat, so that their rows do not
    /// live on, renewed with this owner's others.
    failed_removals: Vec<u64>,
}

impl<S: Storage> Worker<S> {
    pub(crate) fn new(storage: S, common: Arc<Common>, rx: Receiver<Command>) -> Self {
        let last_look = common.clock.monotonic();
        let poll = common.poll.start(last_look);
        Worker {
            caps: storage.capabilities(),
            storage,
            common,
            rx,
            requests: HashMap::new(),
            waits: Waits::default(),
            poll,
            next_look: NextLook::Idle,
            last_look,
            spin: spin_schedule().start(Duration::ZERO),
            poked: false,
            own_changes: BTreeSet::new(),
            last_renewal: None,
            deleted: false,
            pass: BTreeSet::new(),
            look_all: false,
            marked_waiting: false,
            idle_since: None,
            doubtful: Vec::new(),
            lost_replies: false,
            removals_in_doubt: BTreeSet::new(),
            failed_removals: Vec::new(),
        }
    }

    fn now(&self) -> i64 {
        self.storage.now()
    }

    /// `at`, a time of the storage's clock, in the manager's clock: what callers judge by.
    fn local(&self, at: i64) -> i64 {
        at - self.storage.ahead_of(&*self.common.clock)
    }

    fn counters(&self) -> &Counters {
        &self.common.counters
    }

    fn has_waiters(&self) -> bool {
        !self.waits.is_empty() || self.common.unqueued.load(Ordering::SeqCst) > 0
    }

    pub(crate) fn run(mut self) {
        loop {
            let received = match self.spin() {
                Some(received) => received,
                None => {
                    self.common.replies.worker_sleeps();
                    // Blocks in real time for as long as the clock says is left, then reads the
                    // clock again: on the system clock that is the moment of the look, and a
                    // clock moved by hand (`TestClock`) is seen to move within one delay.
                    let due = self
                        .next_look()
                        .into_iter()
                        .chain(self.waits.next_beat())
                        .min();
                    let left = due.map(|at| at.saturating_sub(self.common.clock.monotonic()));
                    let received = match left.into_iter().chain(self.marker_left()).min() {
                        Some(left) => self.rx.recv_timeout(left),
                        None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                    };
                    self.common.replies.worker_wakes();
                    received
                }
            };
            match received {
                Ok(first) => {
                    // Room for a busy moment's batch at once, rather than growing it command by
                    // command.
                    let mut batch = Vec::with_capacity(32);
                    batch.push(first);
                    while batch.len() < MAX_BATCH {
                        match self.rx.try_recv() {
                            Ok(command) => batch.push(command),
                            Err(_) => break,
                        }
                    }
                    if self.handle(batch) {
                        return;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    self.close();
                    return;
                }
            }
            self.start_due_beats();
            if self.look_due() {
                self.look_for_changes();
                self.last_look = self.common.clock.monotonic();
                self.next_look = self.look_after(self.last_look);
            }
            if self.common.unqueued.load(Ordering::SeqCst) > 0 {
                self.idle_since = None;
            } else if self.marked_waiting {
                let since = *self.idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= MARKER_LINGER {
                    self.mark_waiting(false);
                    self.idle_since = None;
                }
            }
        }
    }

    /// The poll's next look after a look (or the start of the schedule) at `ended_at`.
    fn look_after(&mut self, ended_at: Duration) -> NextLook {
        match self.poll.next_at(ended_at) {
            Some(at) => NextLook::At(at),
            None => NextLook::Over,
        }
    }

    /// When the poll looks next, if it looks at all: only while this owner has waiters. When a
    /// wait begins after none, the poll's schedule starts over from the last look, so that the
    /// first look comes one delay after it (at once if that was long ago). And at the latest
    /// when another owner's row on a watched key runs out, however long the poll's delay (or
    /// if its schedule has ended): a crashed owner's lock passes on when its lease ends. (Not
    /// right after a look that failed: the poll's schedule spaces the tries then.)
    fn next_look(&mut self) -> Option<Duration> {
        if !self.has_waiters() {
            self.next_look = NextLook::Idle;
            return None;
        }
        if let NextLook::Idle = self.next_look {
            self.poll.reset(self.last_look);
            self.next_look = self.look_after(self.last_look);
        }
        let polled = match self.next_look {
            NextLook::At(at) => Some(at),
            NextLook::Idle | NextLook::Over => None,
        };
        let freed = self
            .waits
            .first_deadline()
            .filter(|_| !self.look_all)
            .map(|deadline| {
                // From the storage's time to the manager's clock's monotonic time.
                let clock = &*self.common.clock;
                let local = deadline - self.storage.ahead_of(clock);
                let left = local.saturating_sub(micros(clock.now()));
                clock.monotonic() + from_micros(left)
            });
        match (polled, freed) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Starts the heartbeats of the queued requests that have waited long enough.
    fn start_due_beats(&mut self) {
        let now = self.common.clock.monotonic();
        while let Some((ticket, slot)) = self.waits.due_beat(now) {
            // It forks a fiber on the caller's spawner: a spawner that panics must not end this
            // thread. The wait goes on; its rows run out if it outlasts their lease, and it
            // queues again.
            if std::panic::catch_unwind(AssertUnwindSafe(|| slot.beat_due())).is_err() {
                tracing::warn!(ticket, "starting a waiting request's heartbeat panicked");
            }
        }
    }

    /// Whether to look for other processes' changes now: while this owner has waiters, when the
    /// poll's time has come or another manager of this process poked.
    fn look_due(&mut self) -> bool {
        let next = self.next_look();
        self.has_waiters()
            && (self.poked || next.is_some_and(|at| self.common.clock.monotonic() >= at))
    }

    /// Right after a batch, callers often send again at once (release after acquire, the next
    /// request of a busy task). Waking a blocked thread costs tens of microseconds on small
    /// virtual machines, more than a transaction, so look for a while before blocking. This
    /// spends the worker's own time, never a caller's.
    fn spin(&mut self) -> Option<Result<Command, RecvTimeoutError>> {
        self.spin.reset(SystemClock.monotonic());
        loop {
            match self.rx.try_recv() {
                Ok(command) => return Some(Ok(command)),
                Err(TryRecvError::Disconnected) => {
                    return Some(Err(RecvTimeoutError::Disconnected))
                }
                Err(TryRecvError::Empty) => match self.spin.next(SystemClock.monotonic()) {
                    Some(_) => std::thread::yield_now(),
                    None => return None,
                },
            }
        }
    }

    /// Handles one batch; returns whether the worker should stop.
    fn handle(&mut self, batch: Vec<Command>) -> bool {
        let mut writes = Vec::new();
        let mut reads = Vec::new();
        // Requests acquired earlier in this batch: a `Remove` for one must run after it.
        let mut acquiring = Vec::new();
        let mut stop = false;
        for command in batch {
            if stop {
                // Nothing is done after a shutdown, not even what reached it in the same batch:
                // dropping the command's reply tells its caller `Shutdown`.
                continue;
            }
            match command {
                Command::Write(Write::Acquire {
                    request,
                    requests,
                    wait,
                    reply,
                }) => {
                    // A refusal read outside a transaction cannot note an unqueued waiter
                    // where the storage needs it noted (`Storage::watching`).
                    if wait != Wait::Queued
                        && (wait == Wait::No || self.caps.refuses_by_reads)
                        && !writes.iter().any(Write::may_free)
                        && self.refused_by_a_read(&requests, wait)
                    {
                        // A waiter without a queue position, still blocked: no need to take the
                        // write lock to tell it so. Only when nothing earlier in this batch may
                        // free rows: the read sees the database before the batch's writes, and
                        // a request must see every command sent before it.
                        let _ = reply.send(Ok(Acquired::NotNow));
                        continue;
                    }
                    acquiring.push(request);
                    writes.push(Write::Acquire {
                        request,
                        requests,
                        wait,
                        reply,
                    });
                }
                Command::Write(Write::Remove { request, reply }) => {
                    if self.requests.contains_key(&request) || acquiring.contains(&request) {
                        writes.push(Write::Remove { request, reply });
                    } else if let Some(reply) = reply {
                        // Nothing was ever written for it, or it is gone already.
                        let _ = reply.send(Ok(Removed::NotAllLive));
                    }
                }
                Command::Write(Write::Renew { replies }) => {
                    // One renewal per batch, whoever asked: each renews every row of the owner.
                    if let Some(Write::Renew { replies: joined }) =
                        writes.iter_mut().find(|w| matches!(w, Write::Renew { .. }))
                    {
                        joined.extend(replies);
                        continue;
                    }
                    let now = self.now();
                    let half_beat = micros(self.common.heartbeat / 2);
                    match self.last_renewal {
                        // Every live row got a full lease then (or since, when written). The
                        // caller is told when, and beats again one heartbeat after that, so the
                        // rows keep their whole margin; lost leases are looked for then.
                        Some(at) if now < at + half_beat => {
                            for reply in replies {
                                let _ = reply.send(Ok(self.local(at)));
                            }
                        }
                        _ => {
                            for request in std::mem::take(&mut self.failed_removals) {
                                writes.push(Write::Remove {
                                    request,
                                    reply: None,
                                });
                            }
                            writes.push(Write::Renew { replies });
                        }
                    }
                }
                Command::Write(Write::Shutdown { reply }) => {
                    writes.push(Write::Shutdown { reply });
                    stop = true;
                }
                Command::Poke => self.poked = true,
                read @ (Command::Inspect { .. } | Command::IsLocked { .. }) => reads.push(read),
            }
        }
        if !writes.is_empty() {
            self.write(writes);
        }
        for read in reads {
            self.read(read);
        }
        stop
    }

    /// Whether a read shows `requests` cannot be granted now; if so, their keys are watched
    /// until the caller is woken. (An error answers "not known": the write transaction then
    /// decides.)
    fn refused_by_a_read(&mut self, requests: &[LockRequest], wait: Wait) -> bool {
        if wait == Wait::Unqueued {
            // Said before the read: a release committed after it will wake this owner.
            self.mark_waiting(true);
        }
        let now = self.now();
        let keys = keys_of(requests);
        let mut rows = Vec::new();
        if self.storage.rows_on_keys(&keys, now, &mut rows).is_err() {
            return false;
        }
        let refused = !grantable_now(requests.iter().map(|r| (r.key.as_str(), r.mode)), &rows);
        if refused {
            let common = Arc::clone(&self.common);
            self.not_granted(&keys, others_rows(&common.owner, &rows), wait);
        }
        refused
    }

    /// How long until the waiting marker, still up with no waiter, is to be taken down.
    fn marker_left(&self) -> Option<Duration> {
        let since = self.idle_since.filter(|_| self.marked_waiting)?;
        Some(MARKER_LINGER.saturating_sub(since.elapsed()))
    }

    /// Tells storage whether this owner has waiters, when that changes.
    fn mark_waiting(&mut self, waiting: bool) {
        if waiting != self.marked_waiting {
            self.marked_waiting = waiting;
            self.storage.waiting(waiting);
        }
    }

    /// Remembers, for each of `keys` (where `others` are the other owners' live rows, by key and
    /// expiry), when the first other owner's row on it runs out: that is when the key may be
    /// freed without anyone writing.
    fn watch<'r>(
        &mut self,
        keys: &[String],
        others: impl Iterator<Item = (&'r str, i64)> + Clone,
        look: Look,
    ) {
        for (key, at) in first_expiries(keys, others) {
            self.waits.note(key, at, look);
        }
    }

    /// The keys a batch decides on: those of its requests, and for a shutdown every key this
    /// owner has rows on.
    fn keys_of_batch(&self, writes: &[Write]) -> Vec<String> {
        let mut keys = BTreeSet::new();
        for write in writes {
            match write {
                Write::Acquire { requests, .. } => {
                    keys.extend(requests.iter().map(|r| r.key.clone()));
                }
                Write::Remove { request, .. } => {
                    if let Some(written) = self.requests.get(request) {
                        keys.extend(written.keys.iter().cloned());
                    }
                }
                Write::Renew { .. } => {}
                Write::Shutdown { .. } => keys.extend(self.own_keys()),
            }
        }
        keys.into_iter().collect()
    }

    /// Every key this owner has rows on, sorted, without repeats.
    fn own_keys(&self) -> Vec<String> {
        let keys: BTreeSet<&String> = self
            .requests
            .values()
            .flat_map(|written| written.keys.iter())
            .collect();
        keys.into_iter().cloned().collect()
    }

    fn read(&mut self, command: Command) {
        let now = self.now();
        match command {
            Command::Inspect { key, reply } => {
                let _ = reply.send(self.storage.live_rows(key.as_deref(), now));
            }
            Command::IsLocked { key, reply } => {
                let _ = reply.send(self.storage.is_held(&key, now));
            }
            _ => {}
        }
    }

    /// Runs `writes` in one transaction; if that fails, each alone, so one bad write does not
    /// fail the others.
    ///
    /// A batch that failed for a passing reason (its connection cut, the server restarted, a
    /// timeout: see `Storage::again`) is done again, whole, after the busy schedule's delay,
    /// rather than failing its callers.
    fn write(&mut self, mut writes: Vec<Write>) {
        // Acquisitions and removals in one call, while the storage can decide them so
        // (`Storage::decide_at_once`) and no other work is due in a transaction.
        while self.storage.at_once().is_some() {
            self.find_lost_requests();
            if !self.doubtful.is_empty() || !self.pass.is_empty() {
                break;
            }
            if let Some(Write::Remove { request, .. }) = writes.first() {
                if !self.requests.contains_key(request) {
                    // Its acquisition, earlier in this batch, wrote nothing: nothing to remove.
                    let write = writes.remove(0);
                    let now = self.now();
                    self.deliver(write, Decided::Removed(Removed::AllLive), now);
                    continue;
                }
            }
            let run = self.at_once_run(&writes);
            if run == 0 {
                break;
            }
            let rest = writes.split_off(run);
            match self.at_once(writes) {
                Ok(()) => writes = rest,
                Err(mut back) => {
                    back.extend(rest);
                    writes = back;
                    break;
                }
            }
        }
        if writes.is_empty() {
            return;
        }
        loop {
            self.find_lost_requests();
            let keys = self.keys_of_batch(&writes);
            let outcome = self.transaction(&keys, |worker, now| {
                let mut decided = Vec::with_capacity(writes.len());
                for write in &writes {
                    decided.push(worker.apply(write, now)?);
                }
                Ok((decided, now))
            });
            let error = match outcome {
                Ok(((decided, now), freed)) => {
                    for (write, decided) in writes.into_iter().zip(decided) {
                        self.deliver(write, decided, now);
                    }
                    self.after_commit(&freed);
                    return;
                }
                Err(error) => error,
            };
            // Rolled back, most likely: the ids recorded for this batch's acquisitions point at
            // nothing. But a failure of the commit itself (a connection cut as it was sent)
            // cannot tell whether it committed: their rows are deleted, if there, by the next
            // transaction, so that a retried acquisition is never there twice, and no row lives
            // on, renewed by this owner's heartbeats, for a caller who was told it failed.
            for write in &writes {
                if let Write::Acquire { request, .. } = write {
                    if let Some(written) = self.requests.remove(request) {
                        self.doubtful.push(written);
                    }
                }
            }
            self.doubt_removals(&writes);
            if !self.storage.again() {
                self.retry_alone(writes, error);
                return;
            }
            tracing::debug!(%error, "a write failed for a passing reason; once more");
        }
    }

    /// How many of the first `writes` one call can decide: acquisitions, and removals of
    /// requests written before it (a removal of one acquired in the same run waits for the
    /// next call, which knows its ticket).
    fn at_once_run(&self, writes: &[Write]) -> usize {
        let mut removed = BTreeSet::new();
        writes
            .iter()
            .take_while(|write| match write {
                Write::Acquire { .. } => true,
                Write::Remove { request, .. } => {
                    self.requests.contains_key(request) && removed.insert(*request)
                }
                _ => false,
            })
            .count()
    }

    /// Does `writes` (acquisitions and removals: see `at_once_run`) in one call to storage, or
    /// gives them back if the call failed perhaps after writing rows that must be found first. A failure for a passing reason is tried again after the busy
    /// schedule's delay; any other failure of several writes tries each alone, so that one bad
    /// write does not fail the others.
    fn at_once(&mut self, writes: Vec<Write>) -> Result<(), Vec<Write>> {
        let owner = self.common.owner.clone();
        let lease = micros(self.common.lease);
        loop {
            let ops: Vec<AtOnce<'_>> = writes
                .iter()
                .filter_map(|write| match write {
                    Write::Acquire { requests, wait, .. } => Some(AtOnce::Acquire {
                        requests,
                        wait: *wait,
                    }),
                    Write::Remove { request, .. } => {
                        let written = self.requests.get(request)?;
                        Some(AtOnce::Remove {
                            keys: &written.keys,
                            ticket: written.ticket,
                        })
                    }
                    _ => None,
                })
                .collect();
            if ops.len() != writes.len() {
                return Err(writes);
            }
            let decided = match self.storage.at_once() {
                Some(decider) => decider.decide_at_once(&owner, &ops, lease),
                None => return Err(writes),
            };
            let error = match decided {
                Ok(outcomes) => {
                    Counters::bump(&self.counters().write_transactions);
                    for (write, outcome) in writes.into_iter().zip(outcomes) {
                        self.decided_at_once(write, outcome, lease);
                    }
                    return Ok(());
                }
                Err(error) => error,
            };
            if writes.iter().any(|w| matches!(w, Write::Acquire { .. })) {
                self.lost_replies = true;
            }
            self.doubt_removals(&writes);
            if !self.storage.again() {
                self.retry_alone(writes, error);
                return Ok(());
            }
            tracing::debug!(%error, "a write failed for a passing reason; once more");
            self.find_lost_requests();
            if !self.doubtful.is_empty() {
                return Err(writes);
            }
        }
    }

    /// The removals among `writes`, tried in a call or transaction that failed: perhaps after
    /// it committed.
    fn doubt_removals(&mut self, writes: &[Write]) {
        for write in writes {
            if let Write::Remove { request, .. } = write {
                self.removals_in_doubt.insert(*request);
            }
        }
    }

    /// What the removal of `request` found, having deleted `deleted` of its rows.
    fn found(&self, request: u64, deleted: &Deleted) -> Removed {
        let Some(written) = self.requests.get(&request) else {
            return Removed::AllLive;
        };
        if deleted.live == written.keys.len() {
            Removed::AllLive
        } else if deleted.rows == 0 && self.removals_in_doubt.contains(&request) {
            Removed::GoneAfterLostAnswer
        } else {
            Removed::NotAllLive
        }
    }

    /// Delivers what one call decided for `write`.
    fn decided_at_once(&mut self, write: Write, outcome: Outcome, lease: i64) {
        match (&write, outcome) {
            (
                Write::Acquire {
                    request,
                    requests,
                    wait,
                    ..
                },
                Outcome::Acquired(decision),
            ) => {
                let (request, wait) = (*request, *wait);
                let keys = keys_of(requests);
                let decided = match decision.ticket {
                    Some(ticket) => self.written(
                        request,
                        requests,
                        ticket,
                        decision.granted.then_some(decision.now + lease),
                    ),
                    None => Decided::NotNow,
                };
                if !decision.granted {
                    let others = decision.others.iter().map(|(key, at)| (key.as_str(), *at));
                    self.not_granted(&keys, others, wait);
                }
                self.deliver(write, decided, decision.now);
            }
            (Write::Remove { request, .. }, Outcome::Removed(removal)) => {
                let found = self.found(*request, &removal.deleted);
                let written = self.requests.get(request);
                // The storage promoted the single-key waiters it could, and announced the keys
                // only to other owners: this owner's own waits on several keys there are for
                // its next look.
                if let Some(written) = written.filter(|_| removal.freed) {
                    let spanning = self.waits.spanning(&written.keys);
                    if !spanning.is_empty() {
                        self.own_changes.extend(spanning);
                        self.poked = true;
                    }
                }
                self.deliver(write, Decided::Removed(found), removal.now);
                self.after_commit(&Freed {
                    any: removal.freed,
                    promoted: removal.promoted,
                    at: removal.now,
                    owners: removal.owners,
                });
            }
            (_, outcome) => {
                let error = LockError::Storage(format!("an answer of the wrong kind: {outcome:?}"));
                fail(write, error, &mut self.failed_removals);
            }
        }
    }

    /// After an acquisition in one call failed (`lost_replies`): this owner's requests that the
    /// worker does not know of are such acquisitions, committed though their callers were told
    /// they failed; they become `doubtful`, and the next transaction deletes them. If storage
    /// cannot be read, the next write tries again.
    fn find_lost_requests(&mut self) {
        if !self.lost_replies {
            return;
        }
        let owner = self.common.owner.clone();
        match self.storage.requests_of(&owner) {
            Ok(requests) => {
                self.lost_replies = false;
                let known: BTreeSet<u64> = (self.requests.values())
                    .chain(&self.doubtful)
                    .map(|written| written.ticket)
                    .collect();
                for (ticket, keys) in requests {
                    if !known.contains(&ticket) {
                        self.doubtful.push(Written { ticket, keys });
                    }
                }
            }
            Err(error) => {
                tracing::debug!(%error, "could not read this owner's requests; later");
            }
        }
    }

    fn retry_alone(&mut self, writes: Vec<Write>, error: LockError) {
        match writes.len() {
            1 => {
                if let Some(write) = writes.into_iter().next() {
                    fail(write, error, &mut self.failed_removals);
                }
            }
            _ => {
                for write in writes {
                    self.write(vec![write]);
                }
            }
        }
    }

    /// Begins a transaction that decides on `keys`, runs `body`, then (if `body` deleted rows,
    /// or a look asked for it: `self.pass`) the promotion pass on those keys, and commits.
    /// Returns what `body` returned and what was freed. A transaction that only adds rows frees
    /// nothing, and lapsed rows are ignored by every decision, so it skips the pass.
    ///
    /// The clock is read once the transaction may decide (`Storage::begin`), and `body` is given
    /// that time: a time read before could be stale by however long another connection held
    /// the lock, and a renewal judged by it could revive a row that had run out, and been
    /// passed over, meanwhile.
    fn transaction<T>(
        &mut self,
        keys: &[String],
        body: impl FnOnce(&mut Self, i64) -> Result<T, LockError>,
    ) -> Result<(T, Freed), LockError> {
        // The keys a look asked for; `body` adds those whose rows it deletes.
        let mut pass = std::mem::take(&mut self.pass);
        let doubtful = std::mem::take(&mut self.doubtful);
        let mut locked = keys.to_vec();
        if !doubtful.is_empty() {
            locked.extend(doubtful.iter().flat_map(|w| w.keys.iter().cloned()));
            locked.sort();
            locked.dedup();
        }
        let keys = locked.as_slice();
        let now = match self.storage.begin(keys).and_then(within_time_line) {
            Ok(now) => now,
            Err(error) => {
                // A begin that failed half-way (a lock wait that timed out) may leave a
                // transaction open, in which every later statement would fail: end it.
                self.storage.rollback();
                self.doubtful = doubtful;
                return Err(error);
            }
        };
        Counters::bump(&self.counters().write_transactions);
        self.deleted = false;
        let result = (|| {
            let owner = self.common.owner.clone();
            for written in &doubtful {
                let deleted =
                    self.storage
                        .delete_request(&owner, &written.keys, written.ticket, now)?;
                if deleted.rows > 0 {
                    self.deleted = true;
                    pass.extend(written.keys.iter().cloned());
                }
            }
            let value = body(self, now)?;
            let mut freed = Freed {
                any: self.deleted,
                promoted: Vec::new(),
                at: now,
                owners: BTreeSet::new(),
            };
            pass.append(&mut self.pass);
            if !pass.is_empty() {
                let (expired, promoted, announced) = self.promote_pass(&pass, keys, now)?;
                freed.any |= expired > 0 || !promoted.is_empty();
                freed.promoted = promoted;
                let freed_keys: Vec<String> = if freed.any {
                    pass.into_iter().collect()
                } else {
                    Vec::new()
                };
                if !freed_keys.is_empty() || !announced.keys.is_empty() {
                    let keys: Vec<String> = announced.keys.into_iter().collect();
                    (self.storage).announce(&freed_keys, &keys, &announced.owners)?;
                }
                freed.owners = announced.owners;
            }
            self.storage.commit()?;
            Ok((value, freed))
        })();
        if result.is_err() {
            self.pass.clear();
            self.storage.rollback();
            self.doubtful.extend(doubtful);
        }
        result
    }

    /// Promotes, whoever owns them, the waiters on `keys` that the rule now allows. Reads the
    /// rows of `keys`, and of the other keys those waiters wait on: where the storage serialises
    /// by key, only of the keys this transaction `locked`, and a waiter with a key outside them
    /// is left for its owner, whose own look takes all its keys (its keys are announced so that
    /// the owner looks). Returns how many lapsed rows were deleted, the promoted tickets, and
    /// what to announce.
    fn promote_pass(
        &mut self,
        keys: &BTreeSet<String>,
        locked: &[String],
        now: i64,
    ) -> Result<(usize, Vec<u64>, Announced), LockError> {
        let list: Vec<String> = keys.iter().cloned().collect();
        // Where renewals run beside this transaction, lapsed rows must be gone before it reads
        // (see `Storage::rows_on_keys`); a lone writer ignores them, and its heartbeat sweeps.
        let delete_lapsed = self.caps.keys_locked;
        let mut expired = 0;
        if delete_lapsed {
            expired += self.storage.delete_expired(&list, now)?;
        }
        let mut rows = Vec::new();
        self.storage.rows_on_keys(&list, now, &mut rows)?;
        let mut read = keys.clone();
        let mut more: Vec<String> = other_keys(&rows, &read).into_iter().collect();
        let mut announced = Announced::default();
        if self.caps.keys_locked {
            let (reachable, out_of_reach): (Vec<String>, Vec<String>) = more
                .into_iter()
                .partition(|key| locked.binary_search(key).is_ok());
            more = reachable;
            if !out_of_reach.is_empty() {
                // The waiters with a key out of reach: their owners look again.
                let blocked: BTreeSet<&str> = out_of_reach.iter().map(String::as_str).collect();
                for row in rows.iter().filter(|row| !row.held) {
                    if row.request_keys().any(|key| blocked.contains(key)) {
                        announced.note(row, row.request_keys().map(str::to_owned));
                    }
                }
            }
        }
        if !more.is_empty() {
            if delete_lapsed {
                expired += self.storage.delete_expired(&more, now)?;
            }
            self.storage.rows_on_keys(&more, now, &mut rows)?;
            read.extend(more);
        }
        let promoted = promotable_within(&rows, &read);
        // Each request at once, its keys in order, as every transaction changes rows.
        let mut by_ticket: BTreeMap<u64, Vec<&RowView>> = BTreeMap::new();
        for row in rows.iter().filter(|row| !row.held) {
            if promoted.binary_search(&row.ticket).is_ok() {
                by_ticket.entry(row.ticket).or_default().push(row);
            }
        }
        for (ticket, mut own) in by_ticket {
            own.sort_by(|a, b| a.key.cmp(&b.key));
            let keys: Vec<String> = own.iter().map(|row| row.key.to_string()).collect();
            self.storage.promote(&keys, ticket, now)?;
            // Another owner learns of its grant from the announcement; this one, as it commits
            // (`after_commit`).
            if *own[0].owner != *self.common.owner {
                announced.note(own[0], keys);
            }
        }
        announced.owners.remove(&self.common.owner);
        Ok((expired, promoted, announced))
    }

    fn apply(&mut self, write: &Write, now: i64) -> Result<Decided, LockError> {
        let common = self.common.clone();
        let owner = common.owner.as_str();
        match write {
            Write::Acquire {
                request,
                requests,
                wait,
                ..
            } => {
                let keys = keys_of(requests);
                if self.caps.keys_locked {
                    // Lapsed rows are ignored by the rule either way; where renewals run beside
                    // this transaction, they must also be gone before it decides (see
                    // `Storage::rows_on_keys`).
                    self.storage.delete_expired(&keys, now)?;
                }
                let mut rows = Vec::new();
                self.storage.rows_on_keys(&keys, now, &mut rows)?;
                let wanted = requests.iter().map(|r| (r.key.as_str(), r.mode));
                let granted = grantable_now(wanted, &rows);
                if !granted {
                    let common = Arc::clone(&self.common);
                    self.not_granted(&keys, others_rows(&common.owner, &rows), *wait);
                    if *wait == Wait::Unqueued {
                        let lease = micros(self.common.lease);
                        self.storage.watching(owner, &keys, now, lease)?;
                    }
                    if *wait != Wait::Queued {
                        return Ok(Decided::NotNow);
                    }
                }
                let ticket = self.storage.next_ticket()?;
                let expires_at = now + micros(self.common.lease);
                self.storage
                    .insert_request(owner, ticket, requests, granted, now, expires_at)?;
                // Recorded now, not after the commit, so that a `Remove` later in this batch
                // finds it; `write` forgets it again if the transaction rolls back.
                Ok(self.written(*request, requests, ticket, granted.then_some(expires_at)))
            }
            Write::Remove { request, .. } => {
                let Some(written) = self.requests.get(request) else {
                    return Ok(Decided::Removed(Removed::AllLive));
                };
                let deleted =
                    self.storage
                        .delete_request(owner, &written.keys, written.ticket, now)?;
                self.deleted |= deleted.rows > 0;
                self.pass.extend(written.keys.iter().cloned());
                Ok(Decided::Removed(self.found(*request, &deleted)))
            }
            Write::Renew { .. } => {
                let expires_at = now + micros(self.common.lease);
                let renewed = self.storage.renew(owner, now, expires_at)?;
                self.storage.sweep(now)?;
                Ok(Decided::Renewed(renewed))
            }
            Write::Shutdown { .. } => {
                self.delete_own_rows(now)?;
                Ok(Decided::Done)
            }
        }
    }

    /// A request on `keys` was not granted, `others` being the other owners' live rows there (by
    /// key and expiry): unless it does not
    /// wait at all (`try_acquire`), it waits, queued or not, until another owner's row there
    /// runs out, or another owner, committing after this decision, wakes it. Without a queue
    /// position, it is refused for now.
    fn not_granted<'r>(
        &mut self,
        keys: &[String],
        others: impl Iterator<Item = (&'r str, i64)> + Clone,
        wait: Wait,
    ) {
        if wait == Wait::No {
            return;
        }
        if wait == Wait::Unqueued {
            self.mark_waiting(true);
        }
        self.watch(keys, others, Look::Pending);
        if wait != Wait::Queued {
            self.waits.refuse(keys);
        }
    }

    /// Records the rows written for `request` under `ticket`, held until `expires_at` if
    /// granted; what that decided.
    fn written(
        &mut self,
        request: u64,
        requests: &[LockRequest],
        ticket: u64,
        granted_until: Option<i64>,
    ) -> Decided {
        let keys = requests.iter().map(|r| r.key.clone()).collect();
        self.requests.insert(request, Written { ticket, keys });
        match granted_until {
            Some(expires_at) => Decided::Granted { ticket, expires_at },
            None => Decided::Queued(ticket),
        }
    }

    fn deliver(&mut self, write: Write, decided: Decided, now: i64) {
        match (write, decided) {
            (
                Write::Acquire {
                    reply, requests, ..
                },
                Decided::Granted { ticket, expires_at },
            ) => {
                let grant = self.grant(ticket, keys_of(&requests), expires_at);
                let _ = reply.send(Ok(Acquired::Granted(grant)));
            }
            (
                Write::Acquire {
                    reply, requests, ..
                },
                Decided::Queued(ticket),
            ) => {
                let slot = Arc::new(WaitSlot::default());
                self.waits.insert(ticket, slot.clone(), keys_of(&requests));
                let at = self.common.clock.monotonic() + beat_after(self.common.heartbeat);
                self.waits.beat_at(ticket, at);
                let _ = reply.send(Ok(Acquired::Queued(ticket, slot)));
            }
            (Write::Acquire { reply, .. }, _) => {
                let _ = reply.send(Ok(Acquired::NotNow));
            }
            (Write::Remove { request, reply }, decided) => {
                if let Some(Written { ticket, .. }) = self.requests.remove(&request) {
                    self.waits.remove(ticket);
                    // Granted, perhaps, but never handed to its caller (or released: then
                    // forgotten already).
                    lock(&self.common.guards).forget(ticket);
                }
                self.removals_in_doubt.remove(&request);
                if let Some(reply) = reply {
                    let found = match decided {
                        Decided::Removed(found) => found,
                        _ => Removed::NotAllLive,
                    };
                    let _ = reply.send(Ok(found));
                }
            }
            (Write::Renew { replies }, decided) => {
                self.last_renewal = Some(now);
                Counters::bump(&self.counters().heartbeats);
                let renewed = match decided {
                    Decided::Renewed(renewed) => renewed,
                    _ => Vec::new(),
                };
                self.settle_renewed(now, &renewed);
                send_all(replies, Ok(self.local(now)));
            }
            (Write::Shutdown { reply }, _) => {
                self.requests.clear();
                for slot in self.waits.drain() {
                    slot.set(SlotState::Shutdown);
                }
                lock(&self.common.guards).shut_down();
                // Waiters without a queue position wake, try again, and find the manager shut.
                self.common.changed.notify(usize::MAX);
                let _ = reply.send(Ok(()));
            }
        }
    }

    /// After a commit: wake the local waiters that were promoted, and if anything was freed,
    /// the waiters without a queue position and the other managers of this process.
    fn after_commit(&mut self, freed: &Freed) {
        // This owner's rows were promoted with this owner's lease (see `Db::promote`).
        let expires_at = freed.at + micros(self.common.lease);
        for &ticket in &freed.promoted {
            self.grant_wait(ticket, expires_at);
        }
        if freed.any {
            self.common.changed.notify(usize::MAX);
            crate::lock::worker::siblings::poke(&self.common, &freed.owners);
        }
        self.storage.wake_others();
    }

    /// After a renewal at `now` (the storage's time) that renewed `renewed`, every live request
    /// of this owner: the guards whose rows it renewed last a lease from then, as this process
    /// reckons it; a guard whose rows are gone or ran out has lost its lease; a wait whose rows
    /// are held now was promoted by another manager; one whose rows are gone can never be
    /// granted. The storage says what it renewed, so nothing more is read.
    fn settle_renewed(&mut self, now: i64, renewed: &[OwnedRequest]) {
        let find = |ticket: u64, held: bool| {
            renewed
                .iter()
                .find(|r| r.ticket == ticket && r.held == held)
        };
        let rows = |ticket: u64, held: bool| find(ticket, held).map_or(0, |r| r.rows);
        let deadline = self.deadline(now + micros(self.common.lease));
        let lost = lock(&self.common.guards).renewed(|ticket| rows(ticket, true), deadline);
        if lost > 0 {
            // Their rows ran out unseen by this owner's deadlines, which watch other owners'
            // rows: a waiter of this owner behind them may be free.
            self.look_all = true;
        }
        let mut promoted = Vec::new();
        let mut gone = Vec::new();
        for (ticket, _) in self.waits.all() {
            if let Some(held) = find(ticket, true) {
                promoted.push((ticket, held.expires_at));
            } else if rows(ticket, false) == 0 {
                gone.push(ticket);
            }
        }
        self.settle(promoted, &gone);
        for ticket in gone {
            self.requests.retain(|_, written| written.ticket != ticket);
        }
    }

    /// Ends the waits found `promoted` (by another manager, with this owner's lease: until when
    /// the storage says) with their grants, and those whose rows are `gone`.
    fn settle(&mut self, promoted: impl IntoIterator<Item = (u64, i64)>, gone: &[u64]) {
        for (ticket, expires_at) in promoted {
            self.grant_wait(ticket, expires_at);
        }
        for &ticket in gone {
            if let Some(slot) = self.waits.remove(ticket) {
                slot.set(SlotState::Expired);
            }
        }
    }

    /// `expires_at`, the storage's time at which a lease of this owner runs out, on the clock's
    /// monotonic time line, where its deadline is kept (see `Guards::granted`).
    fn deadline(&self, expires_at: i64) -> Duration {
        monotonic_at(&*self.common.clock, from_micros(self.local(expires_at)))
    }

    /// The grant of `ticket` on `keys`, whose rows' lease runs out at `expires_at` (the
    /// storage's time): its lease is kept from now on (`Guards::granted`).
    fn grant(&self, ticket: u64, keys: Vec<String>, expires_at: i64) -> Grant {
        let deadline = self.deadline(expires_at);
        let lost =
            lock(&self.common.guards).granted(ticket, keys, self.common.clock.clone(), deadline);
        Grant {
            ticket,
            lost,
            began: deadline.saturating_sub(self.common.lease),
        }
    }

    /// The queued request `ticket` was granted, its rows' lease running out at `expires_at`
    /// (the storage's time): its wait ends, with the grant.
    fn grant_wait(&mut self, ticket: u64, expires_at: i64) {
        if let Some(waiting) = self.waits.end(ticket) {
            let grant = self.grant(ticket, waiting.keys, expires_at);
            waiting.slot.set(SlotState::Granted(grant));
        }
    }

    /// The same, for the waits on `keys` only, from `rows` (every live row on them): a wait
    /// whose row there is held was promoted (by another manager: this one's promotions settle
    /// their waits as they commit); one whose row there is gone ran out.
    fn settle_waits(&mut self, keys: &BTreeSet<String>, rows: &[RowView]) {
        let seen: HashMap<(&str, u64), &RowView> = rows
            .iter()
            .filter(|row| *row.owner == *self.common.owner)
            .map(|row| ((&*row.key, row.ticket), row))
            .collect();
        let mut promoted = BTreeMap::new();
        let mut gone = BTreeSet::new();
        for key in keys {
            for (ticket, _) in self.waits.on(key) {
                match seen.get(&(key.as_str(), ticket)) {
                    Some(row) if row.held => {
                        promoted.insert(ticket, row.expires_at);
                    }
                    Some(_) => {}
                    None => {
                        gone.insert(ticket);
                    }
                }
            }
        }
        let gone: Vec<u64> = gone.into_iter().collect();
        self.settle(promoted, &gone);
    }

    /// The poll: a cheap check of what others changed, then, only for the watched keys that
    /// changed or whose deadline passed, a read of their rows and a promotion if one is due.
    fn look_for_changes(&mut self) {
        self.poked = false;
        if let Err(error) = self.try_look() {
            tracing::warn!(%error, "looking for other processes' changes failed; will retry");
            self.look_all = true;
        }
    }

    fn try_look(&mut self) -> Result<(), LockError> {
        let changes = self.storage.changes()?;
        Counters::bump(&self.counters().change_checks);
        let now = self.now();
        let look_all = std::mem::take(&mut self.look_all);
        // Keys on which another owner's lease has run out since they were read.
        let (due, refused_due) = self.waits.due(now);
        let mut keys: BTreeSet<String> = match &changes {
            _ if look_all => self.waits.queued_keys().cloned().collect(),
            Changes::Unknown => self.waits.queued_keys().cloned().collect(),
            Changes::Keys(hashes) => self.waits.named(hashes),
            Changes::Nothing => BTreeSet::new(),
        };
        keys.extend(due);
        keys.append(&mut self.own_changes);
        if (changes != Changes::Nothing || refused_due) && self.waits.any_refused() {
            // Requests without a queue position have no rows to promote: their callers try
            // again, and are refused (and watched) again if still blocked.
            self.waits.take_refused();
            self.common.changed.notify(usize::MAX);
        }
        if keys.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = keys.iter().cloned().collect();
        let mut rows = Vec::new();
        self.storage.rows_on_keys(&list, now, &mut rows)?;
        let more: Vec<String> = other_keys(&rows, &keys).into_iter().collect();
        self.storage.rows_on_keys(&more, now, &mut rows)?;
        let mut read = keys;
        read.extend(more);
        let read_list: Vec<String> = read.iter().cloned().collect();
        let common = Arc::clone(&self.common);
        self.watch(&read_list, others_rows(&common.owner, &rows), Look::Done);
        self.settle_waits(&read, &rows);
        if !promotable_within(&rows, &read).is_empty() {
            self.pass = read;
            let ((), freed) = self.transaction(&read_list, |_, _| Ok(()))?;
            self.after_commit(&freed);
        }
        Ok(())
    }

    /// Deletes every row of this owner, and promotes whom that frees.
    fn delete_own_rows(&mut self, now: i64) -> Result<(), LockError> {
        let owner = self.common.owner.clone();
        self.deleted |= self.storage.delete_owner(&owner)? > 0;
        let keys = self.own_keys();
        self.pass.extend(keys);
        self.storage.sweep(now)
    }

    /// The manager is gone (every handle dropped): leave no row behind.
    fn close(&mut self) {
        let keys = self.own_keys();
        let deleted = self.transaction(&keys, |worker, now| worker.delete_own_rows(now));
        match deleted {
            Ok(((), freed)) => self.after_commit(&freed),
            Err(error) => tracing::warn!(
                %error,
                "could not delete this owner's rows on close; they expire with their lease"
            ),
        }
    }
}

/// What a promotion pass found to announce: the keys of other owners' requests it promoted (or
/// must leave to their owners), and those owners.
#[derive(Default)]
struct Announced {
    keys: BTreeSet<String>,
    owners: BTreeSet<String>,
}

impl Announced {
    fn note(&mut self, row: &RowView, keys: impl IntoIterator<Item = String>) {
        self.keys.extend(keys);
        self.owners.insert(row.owner.to_string());
    }
}

/// The keys of `requests`, sorted, without repeats: the order in which every transaction
/// takes them.
fn keys_of(requests: &[LockRequest]) -> Vec<String> {
    let keys: BTreeSet<&str> = requests.iter().map(|r| r.key.as_str()).collect();
    keys.into_iter().map(str::to_owned).collect()
}

impl<S> Drop for Worker<S> {
    /// However the worker stops (shutdown, every handle gone, or a panic), no waiter is left
    /// waiting for it.
    fn drop(&mut self) {
        for slot in self.waits.drain() {
            slot.set(SlotState::Shutdown);
        }
        self.common.changed.notify(usize::MAX);
    }
}

fn fail(write: Write, error: LockError, failed_removals: &mut Vec<u64>) {
    match write {
        Write::Acquire { reply, .. } => {
            let _ = reply.send(Err(error));
        }
        Write::Remove { request, reply } => {
            tracing::warn!(%error, "removing a lock's rows failed; retrying with every heartbeat");
            failed_removals.push(request);
            if let Some(reply) = reply {
                let _ = reply.send(Err(error));
            }
        }
        Write::Renew { replies } => send_all(replies, Err(error)),
        Write::Shutdown { reply } => {
            let _ = reply.send(Err(error));
        }
    }
}

/// Sends `result` to every one of `replies`; an error is repeated by its message.
fn send_all(
    replies: Vec<crate::lock::worker::protocol::Reply<i64>>,
    result: Result<i64, LockError>,
) {
    let again = |result: &Result<i64, LockError>| match result {
        Ok(at) => Ok(*at),
        Err(error) => Err(LockError::Storage(error.to_string())),
    };
    let mut replies = replies.into_iter();
    let first = replies.next();
    for reply in replies {
        let _ = reply.send(again(&result));
    }
    if let Some(reply) = first {
        let _ = reply.send(result);
    }
}
