//! `LockManagerBuilder`: settings, validation, and starting the storage worker.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use event_listener::Event;
use futures::task::AtomicWaker;
use std::sync::mpsc::Receiver;

use crate::clock::{Clock, SystemClock};
use crate::schedule::Schedule;
use crate::spawn::Spawner;

use super::backend::siblings::Siblings;
use super::backend::{memory, sqlite, Opening, Poke};
use super::handle::{Shared, WorkerThread};
use super::state::held::Guards;
use super::state::reply::Replies;
use super::state::{Common, Counters};
use super::worker::protocol::{self, Command, CommandTx};
use super::worker::RunWorker;
use super::MemoryStore;
use super::{LockError, LockManager, StorageError};
use crate::lock::time::micros;

/// Settings for a [`LockManager`]; from [`LockManager::builder`].
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::LockManager;
///
/// let locks = LockManager::builder()
///     .lease(Duration::from_secs(10))
///     .heartbeat(Duration::from_secs(2))
///     .poll(Duration::from_millis(20))
///     .open_in_memory()
///     .unwrap();
/// # drop(locks);
/// ```
pub struct LockManagerBuilder {
    lease: Duration,
    heartbeat: Duration,
    poll: Schedule,
    busy: Schedule,
    clock: Arc<dyn Clock>,
    spawner: Option<Arc<dyn Spawner>>,
    /// Permission bits for a database file this manager creates (unix).
    file_mode: u32,
    /// The PostgreSQL schema that holds the tables.
    #[cfg(feature = "postgres")]
    schema: String,
    /// Open only a store that is there, as it is: never create or migrate it (`existing`).
    existing: bool,
}

/// The permissions of a new database file unless the builder is told otherwise: its owner's
/// alone, as whoever can read the file sees every key, operation and owner in it.
const DEFAULT_FILE_MODE: u32 = 0o600;

impl fmt::Debug for LockManagerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManagerBuilder")
            .field("lease", &self.lease)
            .field("heartbeat", &self.heartbeat)
            .field("poll", &self.poll)
            .field("busy", &self.busy)
            .field("file_mode", &format_args!("{:#o}", self.file_mode))
            .finish_non_exhaustive()
    }
}

/// The shortest heartbeat the builder accepts.
const MIN_HEARTBEAT: Duration = Duration::from_millis(1);

impl LockManagerBuilder {
    /// The defaults, as [`LockManager::builder`] documents them.
    pub(super) fn new() -> Self {
        LockManagerBuilder {
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(5),
            poll: Schedule::fixed(Duration::from_millis(10)),
            busy: default_busy_schedule(),
            clock: Arc::new(SystemClock),
            spawner: None,
            file_mode: DEFAULT_FILE_MODE,
            #[cfg(feature = "postgres")]
            schema: super::backend::postgres::DEFAULT_SCHEMA.to_owned(),
            existing: false,
        }
    }

    /// How long a row stays live without a heartbeat. Default 30 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How often leases are renewed. Default 5 s, at least 1 ms; the lease must be at least
    /// twice this.
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every;
        self
    }

    /// How often waiters look for other processes' changes (a read-only check). Default 10 ms.
    /// Waiters in this process are woken at once whatever this is.
    ///
    /// The shorthand for [`poll_schedule`](LockManagerBuilder::poll_schedule)`(Schedule::fixed(every))`.
    pub fn poll(self, every: Duration) -> Self {
        self.poll_schedule(Schedule::fixed(every))
    }

    /// The cadence of the change poll: when, while this manager has waiters, its storage
    /// thread looks for other processes' changes (a read-only check; only when something
    /// changed does it read the queues). Default `Schedule::fixed(10 ms)`.
    ///
    /// The poll is one per manager however many tasks wait. Each look is one run of its
    /// schedule; when a wait begins after none, the schedule starts over from the last look (so
    /// the first look comes one delay after that, at once if it was long ago). It is
    /// stepped on the monotonic time of the manager's [`clock`](LockManagerBuilder::clock)
    /// (a clock given to the schedule itself with [`Schedule::with_clock`] is not used), so
    /// with a [`TestClock`](crate::TestClock) the poll follows the test's time. (The storage
    /// thread waits for the time left in real time and then reads the clock again, so it sees a
    /// clock moved by hand within one delay of real time.) A schedule that
    /// ends stops the poll until the next wait begins: waiters then learn of other processes'
    /// changes only from this process's own commits, so give a schedule that goes on.
    ///
    /// Waiters in this process are woken at once whatever this is, and so are the waiters of
    /// other managers of this process on the same database.
    ///
    /// # Errors
    ///
    /// [`open`](LockManagerBuilder::open) and the other ways to start return
    /// [`LockError::InvalidConfig`] for a schedule whose first delay is zero or that stops at
    /// once: that would be a storage thread busy looking, or no poll at all.
    ///
    /// # Examples
    ///
    /// Hundreds of processes that wait on one database seldom: back off from 10 ms to at most
    /// a second between looks, jittered so that they do not look together.
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{LockManager, Schedule};
    ///
    /// let poll = Schedule::exponential(Duration::from_millis(10), 2.0)
    ///     .capped(Duration::from_secs(1))
    ///     .jittered();
    /// let locks = LockManager::builder().poll_schedule(poll).open_in_memory()?;
    /// # drop(locks);
    /// # Ok::<(), leasehold::LockError>(())
    /// ```
    pub fn poll_schedule(mut self, schedule: Schedule) -> Self {
        self.poll = schedule;
        self
    }

    /// How to wait while the database is busy, and for how long.
    ///
    /// With SQLite, each try to begin or commit a write transaction already waits for the
    /// write lock inside SQLite (up to 5 s); a try refused at once as busy (as SQLite does for
    /// some clashes between connections) is tried again after each delay of this schedule,
    /// and reported as [`LockError::Storage`] when it is done. With PostgreSQL, it is the
    /// back-off between attempts to connect again after the connection was lost: calls made
    /// meanwhile fail at once with [`LockError::Storage`], the schedule starts over after a
    /// connection succeeds, and also when it is done (the manager never gives up on its
    /// server). Its own clock ([`Schedule::with_clock`], default real time) measures it: a
    /// busy database is busy in real time, whatever clock judges the leases.
    ///
    /// Default: exponential from 1 ms, doubling, capped at 100 ms, jittered, for up to 60 s:
    /// `Schedule::exponential(1 ms, 2.0).capped(100 ms).jittered().up_to(60 s)`.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{LockManager, Schedule};
    ///
    /// // Give up after 5 s of a busy database, retrying every 10 ms or so.
    /// let busy = Schedule::spaced(Duration::from_millis(10))
    ///     .jittered()
    ///     .up_to(Duration::from_secs(5));
    /// let locks = LockManager::builder().busy_schedule(busy).open_in_memory()?;
    /// # drop(locks);
    /// # Ok::<(), leasehold::LockError>(())
    /// ```
    pub fn busy_schedule(mut self, schedule: Schedule) -> Self {
        self.busy = schedule;
        self
    }

    /// Where time comes from (leases, heartbeats). Default [`SystemClock`].
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Where background work (heartbeats, clean-ups of dropped acquisitions) runs.
    ///
    /// By default it follows the caller, as a [`Scoped`](crate::Scoped)'s does: an acquisition's waiter
    /// heartbeat and its clean-up run on the spawner of the scope it is awaited in, or (with
    /// the `tokio` feature) on the tokio runtime it is first polled on, otherwise on smol's
    /// global executor; the lock heartbeat runs where the first guard of a quiet spell was
    /// taken. Give a spawner here to pin all of it down, for instance when guards outlive the
    /// runtime (or executor) that took them: work on a runtime runs only while that runtime
    /// does.
    ///
    /// Heartbeats renew leases only while their executor runs them. An executor blocked for
    /// longer than the lease (a blocking call on a single-threaded runtime, a CPU-bound task)
    /// loses the locks of this manager: another owner may take them, and the guards'
    /// [`lost`](crate::Guard::lost) signals abort once the heartbeat runs again. That is deliberate (a
    /// stuck holder must not keep a lock forever); to avoid it, keep blocking work off the
    /// executor (`spawn_blocking`), or use a multi-threaded runtime or a spawner of its own.
    pub fn spawner(mut self, spawner: Arc<dyn Spawner>) -> Self {
        self.spawner = Some(spawner);
        self
    }

    /// The permissions a new database file is created with, and with it the `-wal` and `-shm`
    /// files SQLite keeps beside it (SQLite gives them the main file's permissions). Default
    /// `0o600`: the owner alone can read and write the file. For a group of users whose
    /// processes share the file, use `0o660`, in a directory that belongs to that group; see
    /// "Trust model" in the README. Unix only.
    ///
    /// The process umask still applies when the file is created: with the common umask `0o022`,
    /// `0o660` gives `0o640`, which the group can read but not write. A service whose group
    /// shares the file runs with umask `0o002` (systemd: `UMask=0002`), or the file is made
    /// with the right mode beforehand. An existing file's permissions are left as they are
    /// (change them with `chmod`).
    ///
    /// Anyone who can write the file can take, hold or forge any lock in it, and anyone who can
    /// read it sees every key, operation and owner: give access to the processes that take part
    /// in the locking and to nobody else.
    ///
    /// # Errors
    ///
    /// [`open`](LockManagerBuilder::open) and [`open_in_memory`](LockManagerBuilder::open_in_memory)
    /// return [`LockError::InvalidConfig`] for bits outside `0o777`, or a mode that does not let
    /// the owner read and write the file.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::os::unix::fs::PermissionsExt;
    /// use leasehold::LockManager;
    ///
    /// let dir = tempfile::tempdir()?;
    /// let path = dir.path().join("locks.db");
    /// let locks = LockManager::builder().file_mode(0o660).open(&path)?;
    /// let mode = std::fs::metadata(&path)?.permissions().mode();
    /// assert_eq!(mode & 0o777 & !0o660, 0); // 0o660 less the umask
    /// # drop(locks);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg(unix)]
    pub fn file_mode(mut self, mode: u32) -> Self {
        self.file_mode = mode;
        self
    }

    /// Opens (creating if needed) the database file at `path`.
    ///
    /// A new file is created with the permissions of
    /// [`file_mode`](LockManagerBuilder::file_mode) (default `0o600`) on unix.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidConfig`] for impossible settings, and for a path that names no file
    /// that other processes could open: the empty path and `:memory:`, for which SQLite would
    /// open a private database (use [`open_in_memory`](LockManagerBuilder::open_in_memory) for
    /// one). [`LockError::Storage`] if the file cannot be opened or is not a database,
    /// [`LockError::SchemaTooNew`] if a newer version of this library wrote it.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockError, LockManager};
    ///
    /// assert!(matches!(LockManager::open(""), Err(LockError::InvalidConfig(_))));
    /// ```
    pub fn open(self, path: impl AsRef<Path>) -> Result<LockManager, LockError> {
        let path = path.as_ref();
        if path.as_os_str().is_empty() || path.as_os_str() == ":memory:" {
            return Err(LockError::InvalidConfig(format!(
                "{path:?} names no database file: SQLite would open a private database that no \
                 other process sees; give a file's path, or use open_in_memory for a private one"
            )));
        }
        self.start(path)
    }

    /// Opens the SQLite store at `path` as it is: like [`open`](Self::open), but a missing
    /// file, or one whose schema is not this build's, is an error, and nothing is created or
    /// migrated. For views and repairs of a store (the `leasehold` command's), which must not
    /// make one where a path was mistyped, nor upgrade one that older processes still share.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open), and [`LockError::Storage`] if there is no such file, or no lock
    /// store in it, or one of another schema version.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockError, LockManager};
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let path = dir.path().join("locks.db");
    /// let missing = LockManager::builder().open_existing(&path);
    /// assert!(matches!(missing, Err(LockError::Storage(_))));
    /// assert!(!path.exists(), "nothing was created");
    /// drop(LockManager::open(&path)?);
    /// let locks = LockManager::builder().open_existing(&path)?;
    /// # drop(locks);
    /// # Ok::<(), LockError>(())
    /// ```
    pub fn open_existing(mut self, path: impl AsRef<Path>) -> Result<LockManager, LockError> {
        self.existing = true;
        self.open(path)
    }

    /// Checks the SQLite store at `path` as it is, changing nothing: its schema version against
    /// this build's, its rows (held, waiting, lapsed) on the time line it records, and who may
    /// read and write the file and its folder. What the `leasehold doctor` command prints.
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`] if there is no such file or it cannot be read; what is wrong
    /// with a store that can be read is a [`Finding`](crate::Finding).
    ///
    /// # Examples
    ///
    /// See [`Finding`](crate::Finding).
    pub fn check(self, path: impl AsRef<Path>) -> Result<Vec<crate::Finding>, LockError> {
        super::check::sqlite(path.as_ref())
    }

    /// Opens a private store in this process's memory (the memory backend): one owner, for
    /// tests and single-process use. Its only thread is the storage worker's.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidConfig`] for impossible settings.
    pub fn open_in_memory(self) -> Result<LockManager, LockError> {
        self.open_memory(&MemoryStore::new(), None)
    }

    /// Opens a new owner on `store`, a lock store in this process's memory that several
    /// managers may share, each an owner of its own, as processes share a database file. See
    /// [`MemoryStore`].
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidConfig`] for impossible settings.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockManager, MemoryStore};
    ///
    /// # futures::executor::block_on(async {
    /// let store = MemoryStore::new();
    /// let first = LockManager::builder().open_in(&store)?;
    /// let second = LockManager::builder().open_in(&store)?;
    /// let guard = first.exclusive("k", "one owner").await?;
    /// assert!(second.is_locked("k").await?);
    /// # drop(guard);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn open_in(self, store: &MemoryStore) -> Result<LockManager, LockError> {
        self.open_memory(store, Some(store.name()))
    }

    /// A manager on the memory `store`, known to this process's other managers as `name`
    /// (`None`: to none, a private store).
    fn open_memory(
        self,
        store: &MemoryStore,
        name: Option<String>,
    ) -> Result<LockManager, LockError> {
        let store = store.clone();
        let (opened, result) = std::sync::mpsc::channel();
        let starting = self.launch(name, move |opening, worker| {
            let opened = move |result| drop(opened.send(result));
            memory::serve(&store, opening, opened, worker);
        })?;
        starting.finish(result.recv())
    }

    fn validate(&self) -> Result<(), LockError> {
        let invalid = |why: String| Err(LockError::InvalidConfig(why));
        if self.heartbeat < MIN_HEARTBEAT {
            return invalid(format!(
                "the heartbeat interval ({:?}) must be at least {MIN_HEARTBEAT:?}: each heartbeat \
                 is a write transaction, and leases are kept in whole microseconds",
                self.heartbeat
            ));
        }
        match self.poll.start(Duration::ZERO).next(Duration::ZERO) {
            Some(first) if !first.is_zero() => {}
            _ => {
                return invalid(format!(
                    "the poll schedule must go on, with a first delay of more than zero: {:?}",
                    self.poll
                ))
            }
        }
        if self.lease < self.heartbeat.saturating_mul(2) {
            return invalid(format!(
                "the lease ({:?}) must be at least twice the heartbeat interval ({:?}), so that \
                 one late heartbeat does not lose the lock",
                self.lease, self.heartbeat
            ));
        }
        if micros(self.lease) >= i64::MAX / 4 {
            return invalid(format!("the lease ({:?}) is too long", self.lease));
        }
        if self.file_mode & !0o777 != 0 {
            return invalid(format!(
                "the file mode {:#o} has bits outside 0o777",
                self.file_mode
            ));
        }
        if self.file_mode & 0o600 != 0o600 {
            return invalid(format!(
                "the file mode {:#o} must let the file's owner read and write it (0o600)",
                self.file_mode
            ));
        }
        Ok(())
    }

    /// Connects to a PostgreSQL database, for owners on several machines (feature `postgres`).
    /// `url` is a libpq connection string or URL (`postgres://user:password@host/db`,
    /// `host=/run/postgresql dbname=app`). The tables live in their own schema (see
    /// [`schema`](LockManagerBuilder::schema)), created on first use.
    ///
    /// Every other method behaves as with SQLite, with these differences: leases are judged by
    /// the server's clock (`clock_timestamp()`), never by this process's [`Clock`], which only
    /// schedules heartbeats; fencing tokens come from a sequence and increase in the order of
    /// conflicting grants on each key.
    ///
    #[doc = include_str!("connect.md")]
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidConfig`] for impossible settings or a malformed `url`,
    /// [`LockError::Storage`] if the server cannot be reached or the schema cannot be created
    /// (the message names the host and database, never the password),
    /// [`LockError::SchemaTooNew`] if a newer version of this library created the schema.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn connect(self, url: &str) -> Result<LockManager, LockError> {
        let target = super::backend::postgres::parse(url)?;
        if !super::backend::postgres::valid_schema(&self.schema) {
            return Err(LockError::InvalidConfig(format!(
                "the schema name {:?} must be lower-case letters, digits and _, not start with a \
                 digit, and be at most 63 bytes",
                self.schema
            )));
        }
        let schema = self.schema.clone();
        let store = Some(format!("{} schema {schema:?}", target.describe()));
        let (opened, connected) = futures::channel::oneshot::channel();
        let starting = self.launch(store, move |opening, worker| {
            let opened = move |result| drop(opened.send(result));
            super::backend::postgres::serve(target, schema, opening, opened, worker);
        })?;
        starting.finish(connected.await)
    }

    /// Connects to the PostgreSQL store as it is (feature `postgres`): like
    /// [`connect`](Self::connect), but a missing schema, or one of another version, is an
    /// error, and nothing is created or migrated. For views and repairs of a store.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect), and [`LockError::Storage`] if the schema is not there or
    /// is not this build's.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn connect_existing(mut self, url: &str) -> Result<LockManager, LockError> {
        self.existing = true;
        self.connect(url).await
    }

    /// Checks the PostgreSQL store in this builder's [`schema`](Self::schema) of the database
    /// at `url` as it is (feature `postgres`), changing nothing: this machine's clock against
    /// the server's, the schema version against this build's, what this role may do with the
    /// tables, the rows, and whether notifications arrive (they do not through a pooler in
    /// transaction mode). Its connections are made on a thread of their own, so it may be
    /// awaited on any executor; the last check waits up to 3 s for a notification.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidConfig`] for a malformed `url`, [`LockError::Storage`] if the
    /// server cannot be reached or the schema holds no lock store; what is wrong with a store
    /// that can be read is a [`Finding`](crate::Finding).
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub async fn check_server(self, url: &str) -> Result<Vec<crate::Finding>, LockError> {
        let (url, schema) = (url.to_owned(), self.schema);
        let (tx, checked) = futures::channel::oneshot::channel();
        std::thread::Builder::new()
            .name("leasehold-check".into())
            .spawn(move || drop(tx.send(super::check::postgres(&url, &schema))))
            .map_err(|e| StorageError::new("starting a thread", e.to_string()).caused_by(e))?;
        checked.await.map_err(|_| {
            LockError::from(StorageError::new(
                "checking the store",
                "the checking thread stopped",
            ))
        })?
    }

    /// The PostgreSQL schema that holds the tables (default `leasehold`); created if missing.
    /// Lower-case letters, digits and `_` only: anything else is refused by
    /// [`connect`](LockManagerBuilder::connect).
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn schema(mut self, name: &str) -> Self {
        self.schema = name.to_owned();
        self
    }

    fn start(self, path: &Path) -> Result<LockManager, LockError> {
        let file_mode = self.file_mode;
        // The absolute path: managers of this process that share the file know each other by
        // it, and so do the doorbells of every process.
        let path = canonical(path);
        let store = Some(path.display().to_string());
        // A plain channel, not a future: `open` may be called inside any executor, and must
        // not run one of its own there.
        let (opened, result) = std::sync::mpsc::channel();
        let starting = self.launch(store, move |opening, worker| {
            let opened = move |result| drop(opened.send(result));
            sqlite::serve(Some(&path), file_mode, opening, opened, worker);
        })?;
        // Opening a file takes a moment on the storage thread; this waits for it.
        starting.finish(result.recv())
    }

    /// Validates the settings and starts the storage thread, which runs `open`: it opens a
    /// backend's storage with what `Opening` says, says whether it could, and hands it to the
    /// worker (`Serve`).
    fn launch<F>(self, store: Option<String>, open: F) -> Result<Starting, LockError>
    where
        F: FnOnce(Opening, RunWorker) + Send + 'static,
    {
        let parts = self.prepare(store, None, new_owner_id())?;
        let worker = RunWorker::new(parts.common.clone(), parts.commands);
        let opening = parts.opening;
        let (ended_tx, ended) = std::sync::mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name("leasehold-storage".into())
            .spawn(move || {
                let _ended = ended_tx;
                open(opening, worker);
            })
            .map_err(|e| {
                StorageError::new("starting the storage thread", e.to_string()).caused_by(e)
            })?;
        let worker = Some(WorkerThread { handle, ended });
        Ok(Starting {
            common: parts.common,
            tx: parts.tx,
            worker,
        })
    }

    /// Validates the settings and makes what a new manager's parts share, known to this
    /// process's other managers on the same store as `store`, with its command channel. A
    /// worker that will be driven as a task gives the `waker` it awaits commands with: every
    /// send wakes it, and callers then never yield to it (it runs only when they wait).
    ///
    /// The backend is given a way to poke the worker (`Opening::poke`) that does not keep it
    /// alive: the worker stops when every handle is gone. The manager's `owner` id is the
    /// caller's: `new_owner_id()`, unless a simulation draws it from its seed.
    pub(crate) fn prepare(
        self,
        store: Option<String>,
        waker: Option<Arc<AtomicWaker>>,
        owner: String,
    ) -> Result<Parts, LockError> {
        self.validate()?;
        let clock = self.clock;
        let common = Arc::new(Common {
            owner,
            lease: self.lease,
            heartbeat: self.heartbeat,
            poll: self.poll,
            busy: self.busy,
            clock: clock.clone(),
            spawner: self.spawner,
            counters: Counters::default(),
            guards: Mutex::new(Guards::new(clock.clone())),
            changed: Event::new(),
            unqueued: AtomicUsize::new(0),
            watchers: AtomicUsize::new(0),
            store,
            replies: Replies::default(),
        });
        if waker.is_some() {
            common.replies.never_yield();
        }
        let (tx, commands) = protocol::commands(waker);
        let tx = Arc::new(tx);
        let poke: Arc<dyn Poke> = Arc::new(Arc::downgrade(&tx));
        let opening = Opening {
            existing: self.existing,
            owner: common.owner.clone(),
            heartbeat: common.heartbeat,
            busy: common.busy.clone(),
            clock: common.clock.clone(),
            siblings: Siblings::join(common.store.clone(), &common.owner, poke.clone()),
            poke,
            lock_waits: common.counters.lock_waits.clone(),
        };
        Ok(Parts {
            common,
            tx,
            commands,
            opening,
        })
    }
}

/// What [`LockManagerBuilder::prepare`] makes: a manager's shared state, its command channel,
/// and what its storage is opened with.
pub(crate) struct Parts {
    pub(crate) common: Arc<Common>,
    pub(crate) tx: Arc<CommandTx>,
    pub(crate) commands: Receiver<Command>,
    pub(crate) opening: Opening,
}

/// The default of [`LockManagerBuilder::busy_schedule`].
fn default_busy_schedule() -> Schedule {
    Schedule::exponential(Duration::from_millis(1), 2.0)
        .capped(Duration::from_millis(100))
        .jittered()
        .up_to(Duration::from_secs(60))
}

/// A manager whose storage thread (if it has one) is opening its storage.
pub(crate) struct Starting {
    pub(crate) common: Arc<Common>,
    pub(crate) tx: Arc<CommandTx>,
    pub(crate) worker: Option<WorkerThread>,
}

impl Starting {
    /// The manager, given what the storage thread said of opening its storage (an error to
    /// receive means it stopped without saying).
    pub(crate) fn finish<E>(
        self,
        opened: Result<Result<(), LockError>, E>,
    ) -> Result<LockManager, LockError> {
        opened.map_err(|_| {
            StorageError::new("opening the database", "the storage thread stopped")
        })??;
        let shared = Arc::new(Shared {
            tx: self.tx,
            common: self.common,
            next_request: AtomicU64::new(1),
            worker: Mutex::new(self.worker),
        });
        Ok(LockManager { shared })
    }
}

/// The absolute form of a database path (its folder resolved, as the file may not exist yet),
/// so that managers of one process can tell they share a file.
fn canonical(path: &Path) -> PathBuf {
    let folder = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(folder), path.file_name()) {
        (Ok(folder), Some(name)) => folder.join(name),
        _ => path.to_path_buf(),
    }
}

/// `host:pid:time-n`: which machine and process an owner is, for whoever reads a store at
/// 3 a.m., made unique by the time of its making and a count.
pub(crate) fn new_owner_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemClock.now().as_nanos() as u64;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        "{}:{}:{:x}-{n}",
        host_name(),
        std::process::id(),
        nanos & 0xffff_ffff_ffff
    )
}

/// This machine's name, as far as it can be told without a system call of its own: the
/// kernel's (Linux), or `HOSTNAME`, or `localhost`. Only the characters of a host name are
/// kept (an owner is shown on one line and named in a shell).
fn host_name() -> String {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let found = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_default();
        let name: String = (found.trim().chars())
            .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
            .take(64)
            .collect();
        if name.is_empty() {
            "localhost".to_owned()
        } else {
            name
        }
    })
    .clone()
}
