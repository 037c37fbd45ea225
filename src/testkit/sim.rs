//! The simulation: a seeded, single-threaded executor on virtual time.
//!
//! Invariants:
//!
//! 1. One task is polled at a time, on the thread that called [`Sim::block_on`]; which of the
//!    ready tasks comes next is a *choice*, an index into the ready list in the order the tasks
//!    became ready. The seed draws the choices ([`Sim::new`]), or they are all 0 (arrival order,
//!    [`Sim::fifo`]), or a trace gives them ([`Sim::replay`]). The choices made are the trace,
//!    so a run is replayed exactly by feeding its trace back.
//! 2. A task is in the ready list at most once: a wake sets its `queued` flag and appends it, a
//!    poll takes it out and clears the flag before polling, so a wake during its own poll queues
//!    it again.
//! 3. Time moves only when no task is ready: the clock jumps to the earliest pending sleep's
//!    deadline, never further, and wakes what was due. With nothing ready and no sleep pending,
//!    the run is over: done if the root resolved and no task remains, else a deadlock (root
//!    unresolved) or a leak (tasks left, named by what spawned them).
//! 4. The state lock is never held while a future is polled (a poll may spawn or wake).
//! 5. While a `Sim` lives it is this thread's entered runtime (`crate::runtime`; the innermost,
//!    when several are made): work that was given no spawner, clock or randomness takes the
//!    simulation's, so that nothing leaves it, and the core tells it what it did, which it
//!    records as its [`Event`]s and passes on to its listeners (the lock stores made on it).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};

use futures::future::BoxFuture;

use super::events::Event;
use crate::clock::{Clock, TestClock};
use crate::runtime::{self, Entered, Observed, Runtime};
use crate::spawn::Spawner;
use crate::sync::lock;

/// The task id of the future given to [`Sim::block_on`].
const ROOT: u64 = 0;

/// How a simulation runs.
///
/// # Examples
///
/// ```
/// use leasehold::testkit::{Sim, SimConfig};
///
/// let mut config = SimConfig::default();
/// config.seed = 7;
/// config.max_steps = 10_000;
/// let mut sim = Sim::with_config(config);
/// assert_eq!(sim.block_on(async { 1 + 1 }), Ok(2));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimConfig {
    /// Draws the order in which ready tasks are polled, and the simulation's randomness (the
    /// jitter of schedules).
    pub seed: u64,
    /// A run that polls more often than this fails with [`SimError::StepLimit`] (a task that
    /// never ends, say a loop that sleeps forever).
    pub max_steps: u64,
    /// Run each case twice and fail when the two runs differ (where the kit runs cases for you).
    pub check_determinism: bool,
    /// Choices to make instead of drawing them from the seed: at each step the ready task at
    /// this index (modulo how many are ready), then arrival order once they run out. What
    /// `strategy::schedule` draws, so that a failing case shrinks toward arrival order.
    pub schedule: Option<Vec<u32>>,
}

impl Default for SimConfig {
    /// Seed 0, a million steps, no determinism check.
    fn default() -> Self {
        SimConfig {
            seed: 0,
            max_steps: 1_000_000,
            check_determinism: false,
            schedule: None,
        }
    }
}

/// Why a simulated run failed. Every variant carries the seed and the trace of the run, and
/// its `Display` prints both, so that [`Sim::replay`] can run it again exactly.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SimError {
    /// The future given to `block_on` had not resolved, and nothing could move: no task ready,
    /// no sleep pending.
    #[non_exhaustive]
    Deadlock {
        /// What was still waiting, the root first.
        pending: Vec<String>,
        /// The run's seed.
        seed: u64,
        /// The run's trace.
        trace: String,
    },
    /// The future resolved, but background work it started can never finish: it waits for
    /// something that will not come.
    #[non_exhaustive]
    Leaked {
        /// The tasks left, each named by what spawned it (a fiber, a handed-off close, a lock
        /// heartbeat, ...).
        tasks: Vec<String>,
        /// The run's seed.
        seed: u64,
        /// The run's trace.
        trace: String,
    },
    /// The run polled more often than [`SimConfig::max_steps`].
    #[non_exhaustive]
    StepLimit {
        /// The tasks still alive, named as for `Leaked`.
        tasks: Vec<String>,
        /// The run's seed.
        seed: u64,
        /// The run's trace.
        trace: String,
    },
    /// Two runs of one case differed.
    #[non_exhaustive]
    Nondeterministic {
        /// The first thing that differed.
        first_difference: String,
        /// The run's seed.
        seed: u64,
        /// The first run's trace.
        trace: String,
    },
    /// A trace that could not be read, or that names a choice the run did not have.
    BadTrace(String),
}

impl SimError {
    /// The seed of the run that failed (0 for a trace that could not be read).
    pub fn seed(&self) -> u64 {
        match self {
            SimError::Deadlock { seed, .. }
            | SimError::Leaked { seed, .. }
            | SimError::StepLimit { seed, .. }
            | SimError::Nondeterministic { seed, .. } => *seed,
            SimError::BadTrace(_) => 0,
        }
    }

    /// The trace of the run that failed, for [`Sim::replay`] (empty for a trace that could not
    /// be read).
    pub fn trace(&self) -> &str {
        match self {
            SimError::Deadlock { trace, .. }
            | SimError::Leaked { trace, .. }
            | SimError::StepLimit { trace, .. }
            | SimError::Nondeterministic { trace, .. } => trace,
            SimError::BadTrace(_) => "",
        }
    }
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::Deadlock { pending, .. } => {
                write!(f, "deadlock: nothing can run, and {}", pending.join(", "))?
            }
            SimError::Leaked { tasks, .. } => write!(
                f,
                "leaked: the future resolved, but its background work can never finish: {}",
                tasks.join(", ")
            )?,
            SimError::StepLimit { tasks, .. } => write!(
                f,
                "step limit: still running after the most steps allowed: {}",
                tasks.join(", ")
            )?,
            SimError::Nondeterministic {
                first_difference, ..
            } => write!(
                f,
                "nondeterministic: two runs of one seed differed, first at {first_difference}"
            )?,
            SimError::BadTrace(why) => return write!(f, "bad trace: {why}"),
        }
        write!(
            f,
            " (seed {}; replay with Sim::replay({:?}))",
            self.seed(),
            self.trace()
        )
    }
}

impl std::error::Error for SimError {}

/// Where the choices come from.
#[derive(Clone, Debug)]
enum Choices {
    /// Drawn from a generator seeded by the seed.
    Seeded(Rng),
    /// All 0: arrival order.
    Fifo,
    /// As a trace says; 0 once it has run out.
    Replay { choices: Vec<u32>, next: usize },
    /// As a drawn schedule says, each modulo the ready count; 0 once it has run out.
    Schedule { choices: Vec<u32>, next: usize },
}

/// A run's trace: its seed and the choices it made, as `replay` reads it back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Trace {
    seed: u64,
    choices: Vec<u32>,
}

impl Trace {
    const PREFIX: &'static str = "sim1";

    /// `sim1:SEED:CHOICES`, the choices comma-separated, a run of `n` equal choices `c` written
    /// `c*n`.
    fn render(&self) -> String {
        let mut out = format!("{}:{}:", Trace::PREFIX, self.seed);
        let mut i = 0;
        let mut first = true;
        while i < self.choices.len() {
            let choice = self.choices[i];
            let run = self.choices[i..]
                .iter()
                .take_while(|&&c| c == choice)
                .count();
            if !first {
                out.push(',');
            }
            first = false;
            if run > 1 {
                out.push_str(&format!("{choice}*{run}"));
            } else {
                out.push_str(&choice.to_string());
            }
            i += run;
        }
        out
    }

    fn parse(text: &str) -> Result<Trace, SimError> {
        let bad = |why: &str| SimError::BadTrace(format!("{why}: {text:?}"));
        let mut parts = text.trim().splitn(3, ':');
        if parts.next() != Some(Trace::PREFIX) {
            return Err(bad("a trace starts with \"sim1:\""));
        }
        let seed = parts
            .next()
            .and_then(|seed| seed.parse().ok())
            .ok_or_else(|| bad("no seed after \"sim1:\""))?;
        let mut choices = Vec::new();
        for item in parts
            .next()
            .unwrap_or("")
            .split(',')
            .filter(|i| !i.is_empty())
        {
            let (choice, run) = match item.split_once('*') {
                Some((choice, run)) => (choice, run.parse::<usize>().ok()),
                None => (item, Some(1)),
            };
            let (Ok(choice), Some(run)) = (choice.parse::<u32>(), run) else {
                return Err(bad(&format!("{item:?} is not a choice")));
            };
            choices.extend(std::iter::repeat_n(choice, run));
        }
        Ok(Trace { seed, choices })
    }
}

/// A seeded, single-threaded executor on virtual time, for tests.
///
/// [`block_on`](Sim::block_on) runs a future, and every task it spawned, until the future has
/// resolved *and* its background work has finished. Ready tasks are polled one at a time, in an
/// order drawn from the seed; the clock ([`clock`](Sim::clock)) jumps to the next deadline
/// whenever nothing is ready, so a 30-second lease passes in microseconds. A run that cannot
/// finish fails with a [`SimError`] that names what was left and prints the seed and the trace
/// to [`replay`](Sim::replay) it.
///
/// While a `Sim` lives, it is its thread's current simulation: `Scoped` futures, fibers and
/// timeouts that were given no spawner or clock use the simulation's, and jitter draws from
/// its seed, so the library's own background work stays inside it.
///
/// A `Sim` belongs to the thread that made it (it is not `Send`): that is where it is current,
/// and where `block_on` polls.
///
/// Work that waits on a thread outside the simulation (a lock manager opened with `open`, real
/// I/O) cannot be seen: time may jump while that thread works, and such runs are not
/// deterministic.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::{Interrupted, Scoped, TimedOut};
/// use leasehold::testkit::Sim;
///
/// let mut sim = Sim::new(42);
/// // A 30 s timeout, on the simulation's clock: over at once in real time.
/// let slow = Scoped::<(), Interrupted>::new(|_| std::future::pending())
///     .timeout(Duration::from_secs(30));
/// let error = sim.block_on(slow).unwrap().unwrap_err();
/// assert!(error.reason().downcast_ref::<TimedOut>().is_some());
/// ```
pub struct Sim {
    shared: Arc<Shared>,
    clock: TestClock,
    choices: Choices,
    trace: Trace,
    max_steps: u64,
    /// Entered as its thread's runtime while it lives (left first when it is dropped).
    entered: Option<Entered>,
    /// It is current on the thread that made it, and runs there: not `Send`.
    _here: std::marker::PhantomData<std::rc::Rc<()>>,
}

/// What the simulation's spawner and wakers reach.
struct Shared {
    state: Mutex<State>,
    /// Draws the simulation's randomness (not its choices).
    random: Mutex<Rng>,
    /// What the structured core did (see `record`), and the ids it gave.
    events: Mutex<Vec<Event>>,
    next_event_id: AtomicU64,
    /// The scopes that belong to the root (see `Event::ScopeOpened`).
    root_scopes: Mutex<BTreeSet<u64>>,
    /// Whether the root is being polled.
    polling_root: AtomicBool,
    /// What the task being spawned is, as the core told (`Observed::Spawning`).
    naming: Mutex<Option<&'static str>>,
    /// Told everything the core tells, before it is recorded (`Sim::listen`).
    listeners: Mutex<Vec<Listener>>,
}

/// Something told what the core tells a simulation (`Sim::listen`).
pub(crate) type Listener = Box<dyn Fn(&Observed) + Send + Sync>;

#[derive(Default)]
struct State {
    tasks: BTreeMap<u64, Slot>,
    /// Task ids in the order they became ready (invariant 2).
    ready: VecDeque<u64>,
    root_queued: bool,
    next_id: u64,
}

struct Slot {
    /// Out while it is being polled.
    future: Option<BoxFuture<'static, ()>>,
    what: String,
    queued: bool,
}

impl Shared {
    fn wake(&self, id: u64) {
        let mut state = lock(&self.state);
        let state = &mut *state;
        if id == ROOT {
            if !state.root_queued {
                state.root_queued = true;
                state.ready.push_back(ROOT);
            }
        } else if let Some(slot) = state.tasks.get_mut(&id) {
            if !slot.queued {
                slot.queued = true;
                state.ready.push_back(id);
            }
        }
    }

    fn spawn(&self, future: BoxFuture<'static, ()>) {
        let what = lock(&self.naming).unwrap_or("task");
        let mut state = lock(&self.state);
        state.next_id += 1;
        let id = state.next_id;
        state.tasks.insert(
            id,
            Slot {
                future: Some(future),
                what: format!("{what} #{id}"),
                queued: true,
            },
        );
        state.ready.push_back(id);
    }

    fn names(&self) -> Vec<String> {
        lock(&self.state)
            .tasks
            .values()
            .map(|slot| slot.what.clone())
            .collect()
    }
}

struct TaskWaker {
    id: u64,
    shared: Weak<Shared>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(shared) = self.shared.upgrade() {
            shared.wake(self.id);
        }
    }
}

/// The simulation's spawner: tasks go to its ready list, from any thread and at any moment
/// (from a `Drop` included); they run when `block_on` polls them.
struct SimSpawner(Weak<Shared>);

impl Spawner for SimSpawner {
    fn spawn(&self, future: BoxFuture<'static, ()>) {
        match self.0.upgrade() {
            Some(shared) => shared.spawn(future),
            // The simulation is gone: nothing will ever poll this.
            None => drop(future),
        }
    }
}

impl Sim {
    /// A simulation whose ready tasks are polled in an order drawn from `seed`.
    pub fn new(seed: u64) -> Sim {
        Sim::with_config(SimConfig {
            seed,
            ..SimConfig::default()
        })
    }

    /// A simulation that polls ready tasks in the order they became ready (seed 0).
    pub fn fifo() -> Sim {
        let mut sim = Sim::new(0);
        sim.choices = Choices::Fifo;
        sim
    }

    /// A simulation that makes exactly the choices `trace` records (as [`trace`](Sim::trace)
    /// and every [`SimError`] print it), with the randomness of its seed; after its last
    /// choice it goes on in arrival order.
    ///
    /// # Errors
    ///
    /// [`SimError::BadTrace`] if `trace` cannot be read. A run that needs a choice the trace
    /// names but does not have (the code under test changed) fails with `BadTrace` too.
    pub fn replay(trace: &str) -> Result<Sim, SimError> {
        let trace = Trace::parse(trace)?;
        let mut sim = Sim::new(trace.seed);
        sim.choices = Choices::Replay {
            choices: trace.choices,
            next: 0,
        };
        Ok(sim)
    }

    /// A simulation with the settings of `config`.
    pub fn with_config(config: SimConfig) -> Sim {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            random: Mutex::new(Rng::new(config.seed ^ 0x005e_ed0f_7a11)),
            events: Mutex::new(Vec::new()),
            next_event_id: AtomicU64::new(1),
            root_scopes: Mutex::new(BTreeSet::new()),
            polling_root: AtomicBool::new(false),
            naming: Mutex::new(None),
            listeners: Mutex::new(Vec::new()),
        });
        let clock = TestClock::new();
        let entered = runtime::enter(Arc::new(SimRuntime {
            shared: Arc::downgrade(&shared),
            clock: clock.clone(),
        }));
        let choices = match config.schedule {
            Some(choices) => Choices::Schedule { choices, next: 0 },
            None => Choices::Seeded(Rng::new(config.seed)),
        };
        Sim {
            shared,
            clock,
            choices,
            trace: Trace {
                seed: config.seed,
                choices: Vec::new(),
            },
            max_steps: config.max_steps,
            entered: Some(entered),
            _here: std::marker::PhantomData,
        }
    }

    /// The simulation's clock. It moves by itself, straight to the earliest pending deadline,
    /// whenever no task is ready; [`TestClock::advance`] still moves it by hand.
    pub fn clock(&self) -> TestClock {
        self.clock.clone()
    }

    /// The simulation's spawner: what it spawns runs inside the simulation.
    pub fn spawner(&self) -> Arc<dyn Spawner> {
        Arc::new(SimSpawner(Arc::downgrade(&self.shared)))
    }

    /// The seed this simulation was made with.
    pub fn seed(&self) -> u64 {
        self.trace.seed
    }

    /// Tells `listener` everything the core tells this simulation from now on.
    pub(crate) fn listen(&self, listener: Listener) {
        lock(&self.shared.listeners).push(listener);
    }

    /// What the structured core has done so far in this simulation, in order: scopes opened and
    /// closed, finalizers added, started and ended, fibers forked and exited, interruptions
    /// requested, the root resolved or dropped. [`check_cleanup`](super::check_cleanup) checks
    /// them.
    pub fn events(&self) -> Vec<Event> {
        lock(&self.shared.events).clone()
    }

    /// The choices made so far, as [`replay`](Sim::replay) takes them.
    pub fn trace(&self) -> String {
        self.trace.render()
    }

    /// Runs `future`, and every task spawned into the simulation, until the future has resolved
    /// and every task has finished.
    ///
    /// # Errors
    ///
    /// [`SimError::Deadlock`] when nothing can move and the future has not resolved,
    /// [`SimError::Leaked`] when it has but tasks are left that nothing can move,
    /// [`SimError::StepLimit`] after [`SimConfig::max_steps`] polls, and
    /// [`SimError::BadTrace`] when a replayed trace names a choice the run did not have.
    /// The tasks left behind by a failed run stay in the simulation.
    pub fn block_on<F: Future>(&mut self, future: F) -> Result<F::Output, SimError> {
        let output = self.run(future, &mut |_| false)?;
        Ok(output.expect("a root that was not dropped resolved"))
    }

    /// [`block_on`](Sim::block_on), calling `before_step` with the number of each step before
    /// it is taken; when it returns `true`, the root is dropped there (unfinished) and the run
    /// goes on until its background work is done: `Ok(None)` then.
    pub(crate) fn run<F: Future>(
        &mut self,
        future: F,
        before_step: &mut dyn FnMut(u64) -> bool,
    ) -> Result<Option<F::Output>, SimError> {
        let mut root: Option<Pin<Box<F>>> = Some(Box::pin(future));
        let mut output = None;
        let mut dropped = false;
        let root_waker = Waker::from(Arc::new(TaskWaker {
            id: ROOT,
            shared: Arc::downgrade(&self.shared),
        }));
        self.shared.wake(ROOT);
        let mut steps = 0u64;
        loop {
            let ready = lock(&self.shared.state).ready.len();
            if ready == 0 {
                if let Some(deadline) = self.clock.next_deadline() {
                    let now = self.clock.monotonic();
                    self.clock.advance(deadline.saturating_sub(now));
                    continue;
                }
                let tasks = self.shared.names();
                return match output {
                    Some(output) if tasks.is_empty() => Ok(Some(output)),
                    None if dropped && tasks.is_empty() => Ok(None),
                    Some(_) => Err(SimError::Leaked {
                        tasks,
                        seed: self.seed(),
                        trace: self.trace(),
                    }),
                    None if dropped => Err(SimError::Leaked {
                        tasks,
                        seed: self.seed(),
                        trace: self.trace(),
                    }),
                    None => {
                        let mut pending = vec!["the future given to block_on waits".to_owned()];
                        pending.extend(tasks);
                        Err(SimError::Deadlock {
                            pending,
                            seed: self.seed(),
                            trace: self.trace(),
                        })
                    }
                };
            }
            if steps >= self.max_steps {
                return Err(SimError::StepLimit {
                    tasks: self.shared.names(),
                    seed: self.seed(),
                    trace: self.trace(),
                });
            }
            if root.is_some() && before_step(steps) {
                lock(&self.shared.events).push(Event::RootDropped);
                // Dropped outside the state lock: its drop hands its clean-up to the spawner.
                root = None;
                dropped = true;
            }
            steps += 1;
            let choice = self.choose(ready)?;
            let (id, task) = {
                let mut state = lock(&self.shared.state);
                let state = &mut *state;
                let id = state
                    .ready
                    .remove(choice as usize)
                    .expect("the choice is within the ready list");
                if id == ROOT {
                    state.root_queued = false;
                    (id, None)
                } else {
                    let slot = state.tasks.get_mut(&id).expect("a ready task has a slot");
                    slot.queued = false;
                    (id, slot.future.take())
                }
            };
            match task {
                None => {
                    let Some(future) = root.as_mut() else {
                        continue;
                    };
                    /// Clears the flag even if the root panics.
                    struct Polling<'a>(&'a AtomicBool);
                    impl Drop for Polling<'_> {
                        fn drop(&mut self) {
                            self.0.store(false, Ordering::Relaxed);
                        }
                    }
                    self.shared.polling_root.store(true, Ordering::Relaxed);
                    let polling = Polling(&self.shared.polling_root);
                    let polled = future.as_mut().poll(&mut Context::from_waker(&root_waker));
                    drop(polling);
                    if let Poll::Ready(value) = polled {
                        output = Some(value);
                        lock(&self.shared.events).push(Event::RootResolved);
                        // Dropped now, as an executor drops a finished future.
                        root = None;
                    }
                }
                Some(mut task) => {
                    let waker = Waker::from(Arc::new(TaskWaker {
                        id,
                        shared: Arc::downgrade(&self.shared),
                    }));
                    let polled = task.as_mut().poll(&mut Context::from_waker(&waker));
                    let mut state = lock(&self.shared.state);
                    match polled {
                        Poll::Ready(()) => {
                            state.tasks.remove(&id);
                            state.ready.retain(|&ready| ready != id);
                            // Dropped outside the lock: its drop may spawn.
                            drop(state);
                            drop(task);
                        }
                        Poll::Pending => {
                            if let Some(slot) = state.tasks.get_mut(&id) {
                                slot.future = Some(task);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The index of the next ready task to poll, among `ready`, recorded in the trace.
    fn choose(&mut self, ready: usize) -> Result<u32, SimError> {
        let ready = u32::try_from(ready).unwrap_or(u32::MAX);
        let choice = match &mut self.choices {
            Choices::Seeded(rng) => rng.below(u64::from(ready)) as u32,
            Choices::Fifo => 0,
            Choices::Replay { choices, next } => {
                let choice = choices.get(*next).copied().unwrap_or(0);
                *next += 1;
                if choice >= ready {
                    return Err(SimError::BadTrace(format!(
                        "step {} chooses task {choice} of {ready} ready (the code under test \
                         changed?)",
                        *next
                    )));
                }
                choice
            }
            Choices::Schedule { choices, next } => {
                let choice = choices.get(*next).copied().unwrap_or(0) % ready;
                *next += 1;
                choice
            }
        };
        self.trace.choices.push(choice);
        Ok(choice)
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        drop(self.entered.take());
        // The tasks left (a failed run's) are dropped here, outside the state lock: their drops
        // may spawn, which a gone simulation ignores.
        let tasks = std::mem::take(&mut lock(&self.shared.state).tasks);
        drop(tasks);
    }
}

impl fmt::Debug for Sim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = lock(&self.shared.state);
        f.debug_struct("Sim")
            .field("seed", &self.trace.seed)
            .field("steps", &self.trace.choices.len())
            .field("tasks", &state.tasks.len())
            .field("ready", &state.ready.len())
            .field("clock", &self.clock)
            .finish()
    }
}

// ----------------------------------------------------------------------------------------------
// The simulation as the core's runtime (invariant 5): what it gives work that was given nothing,
// and what it is told.

/// The simulation entered as this thread's runtime (`runtime::enter`) while the `Sim` lives.
struct SimRuntime {
    shared: Weak<Shared>,
    clock: TestClock,
}

impl Runtime for SimRuntime {
    fn clock(&self) -> Option<Arc<dyn Clock>> {
        Some(Arc::new(self.clock.clone()))
    }

    fn spawner(&self) -> Option<Arc<dyn Spawner>> {
        self.shared
            .upgrade()
            .map(|shared| Arc::new(SimSpawner(Arc::downgrade(&shared))) as Arc<dyn Spawner>)
    }

    fn draw(&self) -> Option<f64> {
        let shared = self.shared.upgrade()?;
        let bits = lock(&shared.random).next() >> 11;
        Some(bits as f64 / (1u64 << 53) as f64)
    }

    fn next_id(&self) -> u64 {
        self.shared.upgrade().map_or(0, |shared| {
            shared.next_event_id.fetch_add(1, Ordering::Relaxed)
        })
    }

    fn observe(&self, observed: Observed) {
        if let Some(shared) = self.shared.upgrade() {
            shared.observe(observed);
        }
    }
}

impl Shared {
    /// Records what the core told, as an [`Event`]; names the task being spawned; passes it on
    /// to the listeners (`listen`).
    fn observe(&self, observed: Observed) {
        for listener in lock(&self.listeners).iter() {
            listener(&observed);
        }
        let event = match observed {
            Observed::ScopeOpened { scope, parent } => {
                let in_root = {
                    let mut root_scopes = lock(&self.root_scopes);
                    let in_root = super::events::in_root(
                        &root_scopes,
                        parent,
                        self.polling_root.load(Ordering::Relaxed),
                    );
                    if in_root {
                        root_scopes.insert(scope);
                    }
                    in_root
                };
                Event::ScopeOpened {
                    scope,
                    parent,
                    in_root,
                }
            }
            Observed::FinalizerAdded { scope, finalizer } => {
                Event::FinalizerAdded { scope, finalizer }
            }
            Observed::FinalizerStarted { finalizer, status } => {
                Event::FinalizerStarted { finalizer, status }
            }
            Observed::FinalizerEnded { finalizer } => Event::FinalizerEnded { finalizer },
            Observed::ScopeClosed { scope } => Event::ScopeClosed { scope },
            Observed::FiberForked { fiber, scope } => Event::FiberForked { fiber, scope },
            Observed::FiberExited { fiber } => Event::FiberExited { fiber },
            Observed::InterruptRequested { reason } => Event::InterruptRequested { reason },
            Observed::InterruptDelivered { scope, reason } => {
                Event::InterruptDelivered { scope, reason }
            }
            Observed::Spawning { what } => {
                *lock(&self.naming) = Some(what);
                return;
            }
            Observed::Spawned => {
                *lock(&self.naming) = None;
                return;
            }
            Observed::Released { .. } | Observed::WorkBegan { .. } | Observed::WorkEnded { .. } => {
                return
            }
        };
        lock(&self.events).push(event);
    }
}

// ----------------------------------------------------------------------------------------------

/// A small seeded generator (splitmix64 of the seed, then xorshift64*).
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_reads_back_as_it_was_written() {
        let trace = Trace {
            seed: 42,
            choices: vec![0, 0, 0, 2, 1, 1, 0],
        };
        let text = trace.render();
        assert_eq!(text, "sim1:42:0*3,2,1*2,0");
        assert_eq!(Trace::parse(&text), Ok(trace));
        assert_eq!(
            Trace::parse("sim1:7:"),
            Ok(Trace {
                seed: 7,
                choices: Vec::new()
            })
        );
        for bad in ["", "sim2:1:0", "sim1:x:0", "sim1:1:0,a", "sim1:1:1*b"] {
            assert!(
                matches!(Trace::parse(bad), Err(SimError::BadTrace(_))),
                "{bad:?}"
            );
        }
    }
}
