//! The lock manager inside a simulation: a store that several simulated managers share
//! (`SimStore`), each a process of its own, whose worker is a task of the simulation; faults
//! (`faults.rs`); and what the store saw, with the oracle over it (`history.rs`).

mod driver;
mod faults;
mod history;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::task::AtomicWaker;

use crate::clock::{Clock, TestClock};
use crate::lock::backend::memory::Memory;
use crate::lock::builder::Starting;
use crate::lock::worker::Worker;
use crate::lock::MemoryStore;
use crate::runtime::{self, Observed};
use crate::spawn::Spawner;
use crate::sync::lock;
use crate::testkit::Sim;
use crate::{LockError, LockManager, LockManagerBuilder};

use faults::SimStorage;
pub use faults::{Fault, FaultPlan};
pub use history::{check_locks, LockEvent, LockHistory};

/// A lock store inside a simulation ([`Sim`]), that several managers share as processes share a
/// database: each opened on it with
/// [`open_simulated`](crate::LockManagerBuilder::open_simulated) is an owner of its own, whose
/// storage worker is a task of the simulation (no thread, no real-time wait), whose clock is the
/// simulation's, and whose connection meets the faults of its [`FaultPlan`]. The store records
/// what it saw ([`history`](SimStore::history)) for [`check_locks`] to judge.
///
/// A test can [`kill`](SimStore::kill) a manager (its worker ends without deleting anything,
/// as a process killed with `SIGKILL`: its rows stay until their lease runs out) or
/// [`stop`](SimStore::stop) one for a while (its worker is not polled, as a process stopped
/// with `SIGSTOP`: its heartbeats go unanswered, and its leases may run out meanwhile).
///
/// Cheap to clone: clones are the same store.
///
/// # Examples
///
/// Two processes; the holder is killed, and the waiter gets the lock once the lease runs out,
/// on virtual time:
///
/// ```
/// use std::time::Duration;
/// use leasehold::testkit::{check_locks, FaultPlan, Sim, SimStore};
/// use leasehold::{Clock, LockManager};
///
/// let mut sim = Sim::new(1);
/// let store = SimStore::new(&sim);
/// let clock = sim.clock();
/// let waited = sim.block_on({
///     let store = store.clone();
///     async move {
///         let lease = Duration::from_secs(30);
///         let open = || LockManager::builder().lease(lease).open_simulated(&store, FaultPlan::none());
///         let (first, second) = (open()?, open()?);
///         let held = first.exclusive("repo", "prune").await?;
///         store.kill(&first);
///         let start = clock.monotonic();
///         let next = second.exclusive("repo", "gc").await?;
///         assert!(held.fencing_token() < next.fencing_token());
///         next.release().await?;
///         Ok::<_, leasehold::LockError>(clock.monotonic() - start)
///     }
/// })
/// .unwrap()
/// .unwrap();
/// assert!(waited <= Duration::from_secs(31));
/// check_locks(&store.history()).unwrap();
/// ```
///
/// [`Sim`]: crate::testkit::Sim
#[derive(Clone)]
pub struct SimStore {
    inner: Arc<Inner>,
}

struct Inner {
    memory: MemoryStore,
    clock: Arc<StoreClock>,
    spawner: Arc<dyn Spawner>,
    history: Arc<Mutex<Vec<LockEvent>>>,
    /// Every owner ever opened on it.
    owners: Arc<Mutex<BTreeSet<String>>>,
    /// The seed of its simulation, which its owners' ids name.
    seed: u64,
    /// How many managers were opened on it: the last part of the next owner's id.
    opened: AtomicU64,
    /// The managers opened on it and not killed, by owner.
    managers: Mutex<BTreeMap<String, Arc<Control>>>,
}

impl SimStore {
    /// A new, empty store inside `sim` that judges leases as a SQLite file does: by the
    /// machine's boot clock (the simulation's monotonic time), which the plan's clock steps
    /// (`Fault::ClockForward`, `Fault::ClockBack`) do not move; they step the wall clock its
    /// managers show times by.
    pub fn new(sim: &Sim) -> SimStore {
        SimStore::with_clock(sim, true)
    }

    /// A new, empty store inside `sim` that judges leases by a wall clock of its own, as a
    /// PostgreSQL server does by its `clock_timestamp()`: the plan's clock steps move it, and
    /// every lease with it. With [`FaultPlan::estimate_ahead`], its managers estimate that
    /// clock as PostgreSQL's clients do.
    pub fn like_postgres(sim: &Sim) -> SimStore {
        SimStore::with_clock(sim, false)
    }

    fn with_clock(sim: &Sim, boot: bool) -> SimStore {
        let history: Arc<Mutex<Vec<LockEvent>>> = Arc::default();
        let owners: Arc<Mutex<BTreeSet<String>>> = Arc::default();
        // What the callers of its managers' `Guard::release` were told, as the lock manager
        // tells the simulation.
        sim.listen(Box::new({
            let (history, owners) = (history.clone(), owners.clone());
            move |observed| {
                let event = match observed {
                    Observed::Released {
                        owner,
                        ticket,
                        held,
                        ran_out,
                    } => LockEvent::Released {
                        owner: owner.clone(),
                        ticket: *ticket,
                        held: *held,
                        ran_out: *ran_out,
                    },
                    Observed::WorkBegan { owner, ticket } => LockEvent::WorkBegan {
                        owner: owner.clone(),
                        ticket: *ticket,
                    },
                    Observed::WorkEnded { owner, ticket } => LockEvent::WorkEnded {
                        owner: owner.clone(),
                        ticket: *ticket,
                    },
                    _ => return,
                };
                let owner = match &event {
                    LockEvent::Released { owner, .. }
                    | LockEvent::WorkBegan { owner, .. }
                    | LockEvent::WorkEnded { owner, .. } => owner,
                    _ => return,
                };
                if lock(&owners).contains(owner) {
                    lock(&history).push(event);
                }
            }
        }));
        SimStore {
            inner: Arc::new(Inner {
                memory: MemoryStore::new(),
                clock: Arc::new(StoreClock {
                    sim: sim.clock(),
                    offset: AtomicI64::new(0),
                    boot,
                }),
                spawner: sim.spawner(),
                history,
                owners,
                seed: sim.seed(),
                opened: AtomicU64::new(0),
                managers: Mutex::default(),
            }),
        }
    }

    /// Everything the store saw so far, in order.
    pub fn history(&self) -> LockHistory {
        LockHistory {
            events: lock(&self.inner.history).clone(),
        }
    }

    /// Kills `manager`, as `SIGKILL` kills a process: its worker ends at once, deleting
    /// nothing, and its callers see [`LockError::Shutdown`](crate::LockError::Shutdown). Its
    /// rows stay until their lease runs out. Nothing happens to a manager not opened on this
    /// store.
    pub fn kill(&self, manager: &LockManager) {
        if let Some(control) = self.control(manager) {
            if !control.killed.swap(true, Ordering::SeqCst) {
                self.record(LockEvent::Killed {
                    owner: manager.owner_id().to_owned(),
                });
            }
            control.waker.wake();
        }
    }

    /// Stops `manager` for `duration` of virtual time, as `SIGSTOP` and, later, `SIGCONT` would:
    /// its worker handles nothing meanwhile (its callers' commands and its heartbeats wait), and
    /// then goes on with whatever queued up. Nothing happens to a manager not opened on this
    /// store.
    pub fn stop(&self, manager: &LockManager, duration: Duration) {
        if let Some(control) = self.control(manager) {
            let until = self.inner.clock.monotonic().saturating_add(duration);
            let mut stopped = lock(&control.stopped_until);
            *stopped = Some(stopped.map_or(until, |before| before.max(until)));
            drop(stopped);
            self.record(LockEvent::Stopped {
                owner: manager.owner_id().to_owned(),
                duration,
            });
            control.waker.wake();
        }
    }

    fn control(&self, manager: &LockManager) -> Option<Arc<Control>> {
        lock(&self.inner.managers).get(manager.owner_id()).cloned()
    }

    fn record(&self, event: LockEvent) {
        lock(&self.inner.history).push(event);
    }

    /// The memory store underneath.
    fn memory(&self) -> &MemoryStore {
        &self.inner.memory
    }

    /// The store's clock: the simulation's, with the wall-clock steps of every fault plan.
    pub(crate) fn clock(&self) -> Arc<StoreClock> {
        self.inner.clock.clone()
    }

    pub(crate) fn spawner(&self) -> Arc<dyn Spawner> {
        self.inner.spawner.clone()
    }

    /// The id of the next manager opened on it: `sim:SEED:N`, the seed in hex and the count of
    /// managers opened before, so that two runs of one seed give their managers the same ids
    /// (a manager outside a simulation is named by its host, process and time).
    fn next_owner_id(&self) -> String {
        let n = self.inner.opened.fetch_add(1, Ordering::SeqCst);
        format!("sim:{:x}:{n}", self.inner.seed)
    }

    /// What a new manager of owner `owner`, with its worker's `waker`, records through, and
    /// what stops or kills it.
    fn attach(&self, owner: &str, waker: Arc<AtomicWaker>) -> Arc<Attached> {
        let control = Arc::new(Control {
            killed: AtomicBool::new(false),
            stopped_until: Mutex::new(None),
            waker,
        });
        lock(&self.inner.owners).insert(owner.to_owned());
        let mut managers = lock(&self.inner.managers);
        managers.retain(|_, control| !control.killed.load(Ordering::SeqCst));
        managers.insert(owner.to_owned(), control.clone());
        Arc::new(Attached {
            owner: owner.to_owned(),
            history: self.inner.history.clone(),
            control,
        })
    }
}

impl fmt::Debug for SimStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimStore")
            .field("memory", &self.inner.memory)
            .field("events", &lock(&self.inner.history).len())
            .finish()
    }
}

/// The clock of a simulated store: the simulation's, whose wall time faults may step
/// (`Fault::ClockForward`, `Fault::ClockBack`) while its monotonic time goes on.
pub(crate) struct StoreClock {
    sim: TestClock,
    /// Microseconds added to the simulation's wall time.
    offset: AtomicI64,
    /// Whether it gives a boot time (the monotonic time), by which the store then judges
    /// leases (`SimStore::new`), or none, so that it judges them by the stepped wall time
    /// (`SimStore::like_postgres`).
    boot: bool,
}

impl StoreClock {
    pub(crate) fn advance(&self, by: Duration) {
        self.sim.advance(by);
    }

    pub(crate) fn step(&self, by: i64) {
        self.offset.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for StoreClock {
    fn now(&self) -> Duration {
        let now = i128::try_from(self.sim.now().as_micros()).unwrap_or(i128::MAX);
        let stepped = now + i128::from(self.offset.load(Ordering::SeqCst));
        Duration::from_micros(u64::try_from(stepped.max(0)).unwrap_or(u64::MAX))
    }

    fn monotonic(&self) -> Duration {
        self.sim.monotonic()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.sim.sleep(duration)
    }

    fn boot_time(&self) -> Option<crate::clock::BootTime> {
        self.boot.then(|| crate::clock::BootTime {
            boot: TestClock::BOOT,
            since_boot: self.sim.monotonic(),
        })
    }
}

/// How a simulated manager is killed or stopped (`SimStore::kill`, `SimStore::stop`); its
/// driver looks before each step (`driver.rs`).
pub(crate) struct Control {
    killed: AtomicBool,
    stopped_until: Mutex<Option<Duration>>,
    /// The worker's: woken to see a kill or a stop at once.
    waker: Arc<AtomicWaker>,
}

impl Control {
    pub(crate) fn killed(&self) -> bool {
        self.killed.load(Ordering::SeqCst)
    }

    /// How long the worker is still stopped for at `now` (the monotonic time), if it is.
    pub(crate) fn stopped_for(&self, now: Duration) -> Option<Duration> {
        let mut stopped = lock(&self.stopped_until);
        match *stopped {
            Some(until) if until > now => Some(until - now),
            _ => {
                *stopped = None;
                None
            }
        }
    }
}

/// What a simulated manager's storage and driver keep of its store: where to record, and what
/// stops or kills it.
pub(crate) struct Attached {
    pub(crate) owner: String,
    history: Arc<Mutex<Vec<LockEvent>>>,
    pub(crate) control: Arc<Control>,
}

impl Attached {
    pub(crate) fn record(&self, event: LockEvent) {
        lock(&self.history).push(event);
    }
}

impl LockManagerBuilder {
    /// Opens a new owner on `store`, a lock store inside a simulation (feature `testkit`), as
    /// another process on its database: its storage worker runs as a task of the simulation
    /// (the same worker, stepped: no thread, no real-time wait), its clock is the store's (the
    /// simulation's), so its heartbeats, polls and busy retries run on virtual time, and its
    /// connection meets the storage faults of `faults`. Call it inside the simulation's
    /// `block_on`. The builder's clock and, if it was given one, its spawner are replaced by
    /// the simulation's.
    ///
    /// See [`testkit::SimStore`](crate::testkit::SimStore) for killing and stopping managers,
    /// and [`testkit::check_locks`](crate::testkit::check_locks) for judging what happened.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidConfig`] for impossible settings.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::testkit::{check_locks, FaultPlan, Sim, SimStore};
    /// use leasehold::LockManager;
    ///
    /// let mut sim = Sim::new(3);
    /// let store = SimStore::new(&sim);
    /// sim.block_on({
    ///     let store = store.clone();
    ///     async move {
    ///         // One transaction in five faulted: the worker retries, as it would in production.
    ///         let locks = LockManager::builder().open_simulated(&store, FaultPlan::drawn(0.2))?;
    ///         for _ in 0..10 {
    ///             locks.exclusive("repo", "prune").await?.release().await?;
    ///         }
    ///         Ok::<(), leasehold::LockError>(())
    ///     }
    /// })
    /// .unwrap()
    /// .unwrap();
    /// check_locks(&store.history()).unwrap();
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
    pub fn open_simulated(
        self,
        store: &SimStore,
        faults: FaultPlan,
    ) -> Result<LockManager, LockError> {
        let clock = store.clock();
        let waker = Arc::new(AtomicWaker::new());
        let parts = self.clock(clock.clone()).spawner(store.spawner()).prepare(
            Some(store.memory().name()),
            Some(waker.clone()),
            store.next_owner_id(),
        )?;
        let common = parts.common;
        let attached = store.attach(&common.owner, waker.clone());
        let connection =
            Memory::new(store.memory(), parts.opening.clock.clone()).joined(parts.opening.siblings);
        let storage = SimStorage::new(
            connection,
            faults,
            attached.clone(),
            clock.clone(),
            common.busy.clone(),
        );
        let worker = Worker::new(storage, common.clone(), parts.commands);
        runtime::spawn_as(
            &*store.spawner(),
            "leasehold's simulated storage worker",
            Box::pin(driver::drive(worker, clock, waker, attached)),
        );
        Starting {
            common,
            tx: parts.tx,
            worker: None,
        }
        .finish(Ok::<_, ()>(Ok(())))
    }
}
