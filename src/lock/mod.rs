//! The lease lock manager: shared/exclusive locks keyed by strings, kept as rows in SQLite.
//!
//! Layout: `grant.rs` is the grant rule (pure), `sqlite.rs` the statements, `worker.rs` the
//! storage thread that orders and batches them, `heartbeat.rs` lease renewal. This file is the
//! public face: requests are validated here, turned into commands for the worker, and wrapped in
//! `Scoped` futures so that an interruption always removes what was written.

mod grant;
mod heartbeat;
mod reply;
mod siblings;
mod sqlite;
mod worker;

use std::collections::{HashMap, HashSet};
use std::error::Error;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use event_listener::Event;
use futures::channel::oneshot;
use futures::future::BoxFuture;

use crate::abort::{AbortController, AbortReason, AbortSignal, Interrupted};
use crate::clock::{Clock, SystemClock};
use crate::scope::{ExitStatus, Release, Scope, Scoped};
use crate::spawn::Spawner;
use crate::sync::lock;

use self::reply::Replies;
use self::sqlite::{from_micros, micros, Counters, Db};
use self::worker::{Acquired, Command, Grant, Worker, Write};

/// The longest key or operation name accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;

/// How a lock is held: many shared holders at once, or one exclusive holder.
///
/// # Examples
///
/// ```
/// use leasehold::{LockRequest, Mode};
///
/// assert_eq!(LockRequest::shared("repo", "backup").mode, Mode::Shared);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Held together with other shared holders (readers).
    Shared,
    /// Held alone (a writer).
    Exclusive,
}

/// `shared` or `exclusive`, as [`LockEntry`]'s `Display` writes it. Width and alignment are
/// honoured, for tables.
///
/// # Examples
///
/// ```
/// use leasehold::Mode;
///
/// assert_eq!(Mode::Shared.to_string(), "shared");
/// assert_eq!(format!("[{:<9}]", Mode::Exclusive), "[exclusive]");
/// assert_eq!(format!("[{:<9}]", Mode::Shared), "[shared   ]");
/// ```
impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Mode::Shared => "shared",
            Mode::Exclusive => "exclusive",
        })
    }
}

/// One key to lock, how, and for what (the operation is shown by [`LockManager::inspect`]).
///
/// # Examples
///
/// ```
/// use leasehold::{LockRequest, Mode};
///
/// let request = LockRequest::exclusive("repo/photos", "prune");
/// assert_eq!((request.key.as_str(), request.mode), ("repo/photos", Mode::Exclusive));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockRequest {
    /// The lock's name: non-empty, at most 1 KiB, no NUL.
    pub key: String,
    /// Shared or exclusive.
    pub mode: Mode,
    /// What the holder is doing, for people reading `inspect`: at most 1 KiB, no NUL.
    pub operation: String,
}

impl LockRequest {
    /// A shared request.
    pub fn shared(key: impl Into<String>, operation: impl Into<String>) -> Self {
        LockRequest {
            key: key.into(),
            mode: Mode::Shared,
            operation: operation.into(),
        }
    }

    /// An exclusive request.
    pub fn exclusive(key: impl Into<String>, operation: impl Into<String>) -> Self {
        LockRequest {
            key: key.into(),
            mode: Mode::Exclusive,
            operation: operation.into(),
        }
    }
}

/// Whether an entry of [`LockManager::inspect`] holds its lock or waits for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryState {
    /// Holds the lock.
    Held,
    /// Queued; `position` 0 is next in line.
    Waiting {
        /// Place in the key's queue of waiting requests.
        position: usize,
    },
}

/// `held`, or `waiting at N` where `N` is the queue position (`waiting at 0` is next in line).
/// Width and alignment are honoured, for tables.
///
/// # Examples
///
/// ```
/// use leasehold::EntryState;
///
/// assert_eq!(EntryState::Held.to_string(), "held");
/// assert_eq!(EntryState::Waiting { position: 0 }.to_string(), "waiting at 0");
/// assert_eq!(format!("[{:>12}]", EntryState::Held), "[        held]");
/// ```
impl fmt::Display for EntryState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryState::Held => f.pad("held"),
            EntryState::Waiting { position } => f.pad(&format!("waiting at {position}")),
        }
    }
}

/// One live holder or waiter, as [`LockManager::inspect`] reports it.
///
/// Printed with `{}`, an entry is one line for operators; the format is documented on its
/// `Display` implementation.
#[derive(Clone, Debug)]
pub struct LockEntry {
    /// The lock's key.
    pub key: String,
    /// Shared or exclusive.
    pub mode: Mode,
    /// What the holder or waiter said it is doing.
    pub operation: String,
    /// The owner id of the manager that made the request.
    pub owner: String,
    /// The request's ticket (its fencing token once granted).
    pub ticket: u64,
    /// Held, or waiting at a position.
    pub state: EntryState,
    /// When it was granted (held) or requested (waiting): clock time since the Unix epoch.
    pub since: Duration,
    /// When its lease runs out unless renewed: clock time since the Unix epoch.
    pub expires_at: Duration,
}

/// One line, as an operator would print [`LockManager::inspect`]:
///
/// ```text
/// "repo/photos" exclusive held, operation "prune", owner "4242-1a2b3c4d-0", ticket 7, expires 2024-01-01T00:00:30.000Z
/// "repo/photos" shared waiting at 0, operation "backup", owner "4242-1a2b3c4d-0", ticket 8, expires 2024-01-01T00:00:30.000Z
/// ```
///
/// The key, the mode and the state (as [`Mode`] and [`EntryState`] display them), then the
/// operation, owner, ticket and the lease's expiry, in that order. Key, operation and
/// owner are quoted and escaped as Rust string literals (`{:?}`), so that a name with spaces,
/// commas or a line break cannot make the line ambiguous or split it. The expiry is
/// [`expires_at`](LockEntry::expires_at) as a UTC time in RFC 3339 form, to the millisecond
/// (truncated). `since` is not shown. This format is stable: a change to it is a breaking change.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::{EntryState, LockEntry, Mode};
///
/// let entry = LockEntry {
///     key: "repo/photos".into(),
///     mode: Mode::Exclusive,
///     operation: "prune".into(),
///     owner: "4242-1a2b3c4d-0".into(),
///     ticket: 7,
///     state: EntryState::Held,
///     since: Duration::from_secs(1_704_067_200),
///     expires_at: Duration::from_millis(1_704_067_230_000),
/// };
/// assert_eq!(
///     entry.to_string(),
///     r#""repo/photos" exclusive held, operation "prune", owner "4242-1a2b3c4d-0", ticket 7, expires 2024-01-01T00:00:30.000Z"#,
/// );
/// ```
///
/// Printing what a manager sees:
///
/// ```
/// use leasehold::LockManager;
///
/// # futures::executor::block_on(async {
/// let locks = LockManager::open_in_memory()?;
/// let _guard = locks.exclusive("repo", "check").await?;
/// for entry in locks.inspect(None).await? {
///     println!("{entry}");
/// }
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
impl fmt::Display for LockEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} {} {}, operation {:?}, owner {:?}, ticket {}, expires {}",
            self.key,
            self.mode,
            self.state,
            self.operation,
            self.owner,
            self.ticket,
            Utc(self.expires_at)
        )
    }
}

/// A clock time (since the Unix epoch) written as RFC 3339 in UTC, to the millisecond:
/// `2024-01-01T00:00:30.000Z`.
struct Utc(Duration);

impl fmt::Display for Utc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seconds = self.0.as_secs();
        let (days, of_day) = (seconds / 86_400, seconds % 86_400);
        let (year, month, day) = civil_from_days(days);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
            of_day / 3_600,
            of_day / 60 % 60,
            of_day % 60,
            self.0.subsec_millis()
        )
    }
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's `civil_from_days`,
/// for non-negative days).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Counters since open, for tests, benchmarks and monitoring.
///
/// # Examples
///
/// ```
/// use leasehold::LockManager;
///
/// # futures::executor::block_on(async {
/// let locks = LockManager::open_in_memory()?;
/// locks.exclusive("k", "demo").await?.release().await?;
/// assert!(locks.stats().write_transactions >= 2);
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct StorageStats {
    /// Transactions that began with `BEGIN IMMEDIATE`.
    pub write_transactions: u64,
    /// Read-only looks for other processes' changes (`PRAGMA data_version`).
    pub change_checks: u64,
    /// Lease renewal rounds.
    pub heartbeats: u64,
}

/// Why a lock operation failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum LockError {
    /// The acquisition was interrupted; carries the caller's reason. Nothing it wrote remains.
    Interrupted(Interrupted),
    /// Empty or oversized key/operation, NUL, duplicate key in `many`, no keys at all.
    InvalidRequest(String),
    /// A builder setting that cannot work, such as a lease shorter than two heartbeats.
    InvalidConfig(String),
    /// SQLite failed: what was being done, the message, and the SQLite code.
    Storage(String),
    /// The database was written by a newer version of this library.
    SchemaTooNew {
        /// The schema version found in the file.
        found: i64,
        /// The newest schema version this build understands.
        supported: i64,
    },
    /// The manager was shut down.
    Shutdown,
    /// A guard was released after its lease had been lost: its rows were gone or had run out,
    /// so another holder may have had the lock meanwhile, and the work it protected may have
    /// overlapped with theirs. (A resource that checks [fencing tokens](Guard::fencing_token)
    /// has refused the stale writes.)
    LeaseLost(LeaseLost),
}

impl LockError {
    /// The caller's reason, if this is an interruption.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{AbortReason, Interrupted, LockError};
    ///
    /// let reason = AbortReason::from("stop");
    /// let error = LockError::from(Interrupted::new(reason.clone()));
    /// assert!(error.abort_reason().unwrap().ptr_eq(&reason));
    /// assert!(LockError::Shutdown.abort_reason().is_none());
    /// ```
    pub fn abort_reason(&self) -> Option<&AbortReason> {
        match self {
            LockError::Interrupted(interrupted) => Some(interrupted.reason()),
            _ => None,
        }
    }
}

impl From<Interrupted> for LockError {
    fn from(interrupted: Interrupted) -> Self {
        LockError::Interrupted(interrupted)
    }
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockError::Interrupted(interrupted) => fmt::Display::fmt(interrupted, f),
            LockError::InvalidRequest(why) => write!(f, "invalid lock request: {why}"),
            LockError::InvalidConfig(why) => write!(f, "invalid lock manager configuration: {why}"),
            LockError::Storage(why) => write!(f, "lock storage failed {why}"),
            LockError::SchemaTooNew { found, supported } => write!(
                f,
                "the lock database has schema version {found}, newer than the {supported} this \
                 version of leasehold understands; upgrade leasehold to use it"
            ),
            LockError::Shutdown => f.write_str("the lock manager has been shut down"),
            LockError::LeaseLost(lost) => write!(
                f,
                "{lost}; the work it protected may have overlapped with another holder's"
            ),
        }
    }
}

impl Error for LockError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            LockError::Interrupted(interrupted) => Some(interrupted),
            LockError::LeaseLost(lost) => Some(lost),
            _ => None,
        }
    }
}

/// The reason a [`Guard::lost`] signal aborts with.
///
/// # Examples
///
/// ```
/// use leasehold::LeaseLost;
///
/// # let reason = leasehold::AbortReason::new(LeaseLost::default());
/// assert!(reason.downcast_ref::<LeaseLost>().is_some());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseLost {
    shutdown: bool,
}

impl LeaseLost {
    fn expired() -> Self {
        LeaseLost { shutdown: false }
    }

    fn shutdown() -> Self {
        LeaseLost { shutdown: true }
    }

    /// Whether the lock was lost because its manager was shut down (rather than expiring).
    pub fn by_shutdown(&self) -> bool {
        self.shutdown
    }
}

impl fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.shutdown {
            f.write_str("lease lost: the lock manager was shut down")
        } else {
            f.write_str("lease lost: the lock's rows are gone or its lease ran out")
        }
    }
}

impl Error for LeaseLost {}

/// What the storage worker and the heartbeats share with the handles (no command sender: the
/// worker stops when every handle is gone).
pub(crate) struct Common {
    owner: String,
    lease: Duration,
    heartbeat: Duration,
    poll: Duration,
    clock: Arc<dyn Clock>,
    /// Given to the builder; `None`: background work follows the caller.
    spawner: Option<Arc<dyn Spawner>>,
    counters: Counters,
    guards: Mutex<Guards>,
    /// Notified after every commit that freed or promoted something, and when other processes
    /// changed the file: waiters without a queue position try again.
    changed: Event,
    /// Waiters without a queue position (`many`), so the worker keeps looking for changes.
    unqueued: AtomicUsize,
    /// When this owner's rows were last renewed (micros), for deciding a lease ran out when
    /// renewals fail.
    last_renewal: AtomicU64,
    /// The database file, for waking other managers of this process that share it.
    path: Option<PathBuf>,
    /// The worker's replies, as awaited by callers.
    replies: Replies,
}

#[derive(Default)]
struct Guards {
    entries: HashMap<u64, GuardEntry>,
    daemon_running: bool,
    /// Set (under this lock, as the entries are drained) when the worker has shut down, so that
    /// a guard made afterwards is born lost instead of missing the drain.
    shut_down: bool,
}

struct GuardEntry {
    rows: usize,
    keys: Vec<String>,
    lost: AbortController,
    /// When the rows' lease ran out as granted (clock micros), before any renewal.
    expires_at: i64,
}

/// A handle: the command sender plus what is common.
pub(crate) struct Shared {
    // In an `Arc` so that other managers can poke this one through a `Weak` without ever
    // holding (and so possibly dropping, and joining) the whole handle.
    tx: Arc<Sender<Command>>,
    common: Arc<Common>,
    next_request: AtomicU64,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Shared {
    /// The last handle is gone: disconnect the worker, and wait for it to delete this owner's
    /// rows and close the database, so that the file is settled when the drop returns.
    fn drop(&mut self) {
        let (disconnected, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.tx, Arc::new(disconnected)));
        let worker = lock(&self.worker).take();
        if let Some(worker) = worker {
            if worker.thread().id() != std::thread::current().id() {
                let _ = worker.join();
            }
        }
    }
}

impl Shared {
    fn send(&self, command: Command) -> Result<(), LockError> {
        self.tx.send(command).map_err(|_| LockError::Shutdown)
    }

    async fn call<T>(
        &self,
        command: impl FnOnce(worker::Reply<T>) -> Command,
    ) -> Result<T, LockError> {
        let (reply, response) = oneshot::channel();
        self.send(command(reply))?;
        self.common.replies.wait(response).await
    }

    async fn acquire(
        &self,
        request: u64,
        requests: &[LockRequest],
        queue: bool,
    ) -> Result<Acquired, LockError> {
        self.call(|reply| {
            Command::Write(Write::Acquire {
                request,
                requests: requests.to_vec(),
                queue,
                reply,
            })
        })
        .await
    }

    /// Deletes a request's rows; returns whether every row it had was still live.
    async fn remove(&self, request: u64) -> Result<bool, LockError> {
        self.call(|reply| {
            Command::Write(Write::Remove {
                request,
                reply: Some(reply),
            })
        })
        .await
    }

    /// `grant` if its lease has not run out by now. Otherwise its rows are removed and `None`
    /// returned, for the caller to ask again: a grant is read late when the caller's executor
    /// (or its whole process) was stalled after the worker decided it, and a guard whose lease
    /// has already run out must never be handed out, since another owner may hold the lock.
    async fn deliverable(&self, request: u64, grant: Grant) -> Result<Option<Grant>, LockError> {
        if micros(self.common.clock.now()) < grant.expires_at {
            return Ok(Some(grant));
        }
        tracing::warn!(
            ticket = grant.ticket,
            "a grant's lease ran out before it could be handed over (was this process paused or \
             starved for longer than the lease?); asking again"
        );
        self.remove(request).await?;
        Ok(None)
    }

    /// Renews this owner's rows (or finds them renewed recently); returns when, in clock time.
    async fn renew(&self) -> Result<Duration, LockError> {
        let at = self
            .call(|reply| Command::Write(Write::Renew { reply }))
            .await?;
        Ok(from_micros(at))
    }
}

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
    poll: Duration,
    clock: Arc<dyn Clock>,
    spawner: Option<Arc<dyn Spawner>>,
    /// Permission bits for a database file this manager creates (unix).
    file_mode: u32,
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
            .field("file_mode", &format_args!("{:#o}", self.file_mode))
            .finish_non_exhaustive()
    }
}

impl LockManagerBuilder {
    /// How long a row stays live without a heartbeat. Default 30 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How often leases are renewed. Default 5 s; the lease must be at least twice this.
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every;
        self
    }

    /// How often waiters look for other processes' changes (a read-only check). Default 10 ms.
    /// Waiters in this process are woken at once whatever this is.
    pub fn poll(mut self, every: Duration) -> Self {
        self.poll = every;
        self
    }

    /// Where time comes from (leases, heartbeats). Default [`SystemClock`].
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Where background work (heartbeats, clean-ups of dropped acquisitions) runs.
    ///
    /// By default it follows the caller, as a [`Scoped`]'s does: an acquisition's waiter
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
    /// [`lost`](Guard::lost) signals abort once the heartbeat runs again. That is deliberate (a
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
    /// [`LockError::InvalidConfig`] for impossible settings, [`LockError::Storage`] if the file
    /// cannot be opened or is not a database, [`LockError::SchemaTooNew`] if a newer version of
    /// this library wrote it.
    pub fn open(self, path: impl AsRef<Path>) -> Result<LockManager, LockError> {
        self.start(Some(path.as_ref()))
    }

    /// Opens a private in-memory database: one owner, for tests and single-process use.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidConfig`] for impossible settings.
    pub fn open_in_memory(self) -> Result<LockManager, LockError> {
        self.start(None)
    }

    fn validate(&self) -> Result<(), LockError> {
        let invalid = |why: String| Err(LockError::InvalidConfig(why));
        if self.heartbeat.is_zero() {
            return invalid("the heartbeat interval must be more than zero".into());
        }
        if self.poll.is_zero() {
            return invalid("the poll interval must be more than zero".into());
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

    fn start(self, path: Option<&Path>) -> Result<LockManager, LockError> {
        self.validate()?;
        let common = Arc::new(Common {
            owner: new_owner_id(),
            lease: self.lease,
            heartbeat: self.heartbeat,
            poll: self.poll,
            clock: self.clock,
            spawner: self.spawner,
            counters: Counters::default(),
            guards: Mutex::new(Guards::default()),
            changed: Event::new(),
            unqueued: AtomicUsize::new(0),
            last_renewal: AtomicU64::new(0),
            path: path.map(canonical),
            replies: Replies::default(),
        });
        // SQLite is opened on the worker thread: no SQLite call on the caller's thread.
        let (opened_tx, opened_rx) = std::sync::mpsc::channel();
        let (tx, rx) = std::sync::mpsc::channel();
        let open_path = path.map(Path::to_path_buf);
        let file_mode = self.file_mode;
        let worker_common = common.clone();
        let worker = std::thread::Builder::new()
            .name("leasehold-storage".into())
            .spawn(
                move || match sqlite::connect(open_path.as_deref(), file_mode) {
                    Ok(conn) => {
                        let file = open_path.as_deref().and_then(sqlite::FileIdentity::of);
                        let _ = opened_tx.send(Ok(()));
                        Worker::new(Db::new(&conn), worker_common, rx, file).run();
                    }
                    Err(error) => {
                        let _ = opened_tx.send(Err(error));
                    }
                },
            )
            .map_err(|e| LockError::Storage(format!("while starting the storage thread: {e}")))?;
        opened_rx.recv().map_err(|_| {
            LockError::Storage("while opening the database: the storage thread stopped".into())
        })??;
        let shared = Arc::new(Shared {
            tx: Arc::new(tx),
            common,
            next_request: AtomicU64::new(1),
            worker: Mutex::new(Some(worker)),
        });
        siblings::register(&shared);
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

fn new_owner_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemClock.now().as_nanos() as u64;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}-{:x}-{n}", std::process::id(), nanos & 0xffff_ffff_ffff)
}

/// Shared/exclusive lease locks keyed by strings, kept in one SQLite file so that several
/// processes on one machine coordinate through it.
///
/// One `LockManager` is one owner (normally one per process). Clones share the owner; two
/// `open` calls are two owners. Every acquisition is a [`Scoped`] future: attach an
/// [`AbortSignal`] with [`Scoped::with_signal`] to interrupt it, and it resolves with
/// [`LockError::Interrupted`] only after its rows are deleted.
///
/// # Cancel safety
///
/// Every acquisition is cancel safe: interrupted, it deletes its waiting row (and any row a
/// peer promoted for it) before it returns; dropped, it does the same in the background (through
/// the storage worker, so a later call on this manager already sees it gone). A granted lock is
/// never lost: if it cannot be handed to the caller, it is released.
///
/// Dropping the last handle (clones, guards and pending acquisitions all hold one) deletes this
/// owner's remaining rows and closes the database, and waits for that: a single transaction,
/// usually well under a millisecond. [`shutdown`](LockManager::shutdown) does the same without
/// blocking.
///
/// # Examples
///
/// ```
/// use leasehold::LockManager;
///
/// # futures::executor::block_on(async {
/// let locks = LockManager::open_in_memory()?;
/// let backup = locks.shared("repo", "backup").await?;
/// let restore = locks.shared("repo", "restore").await?;   // shared: held together
/// assert!(locks.is_locked("repo").await?);
/// backup.release().await?;
/// restore.release().await?;
/// let prune = locks.exclusive("repo", "prune").await?;   // alone
/// assert!(prune.fencing_token() > 0);
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct LockManager {
    shared: Arc<Shared>,
}

impl fmt::Debug for LockManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManager")
            .field("owner", &self.shared.common.owner)
            .field("path", &self.shared.common.path)
            .finish()
    }
}

enum Policy {
    /// Queue under one ticket (single key, or `many_queued`).
    Queue,
    /// All or nothing, holding no queue position while waiting (`many`).
    NoQueue,
}

impl LockManager {
    /// Opens (creating if needed) the database file at `path` with default settings.
    ///
    /// # Errors
    ///
    /// See [`LockManagerBuilder::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LockError> {
        LockManager::builder().open(path)
    }

    /// Opens a private in-memory database with default settings.
    ///
    /// # Errors
    ///
    /// See [`LockManagerBuilder::open_in_memory`].
    pub fn open_in_memory() -> Result<Self, LockError> {
        LockManager::builder().open_in_memory()
    }

    /// Settings: lease 30 s, heartbeat 5 s, poll 10 ms, [`SystemClock`], background work that
    /// follows the caller (see [`LockManagerBuilder::spawner`]), and on unix new database files
    /// readable and writable by their owner alone (`0o600`).
    pub fn builder() -> LockManagerBuilder {
        LockManagerBuilder {
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(5),
            poll: Duration::from_millis(10),
            clock: Arc::new(SystemClock),
            spawner: None,
            file_mode: DEFAULT_FILE_MODE,
        }
    }

    /// This owner's id, as it appears in [`LockEntry::owner`].
    pub fn owner_id(&self) -> &str {
        &self.shared.common.owner
    }

    /// Waits for a shared lock on `key`. See [`acquire`](LockManager::acquire).
    ///
    /// The key and operation may be borrowed or owned: `locks.shared(format!("repo/{id}"),
    /// "backup")` works as `locks.shared("repo/7", "backup")` does.
    pub fn shared(
        &self,
        key: impl AsRef<str>,
        operation: impl AsRef<str>,
    ) -> Scoped<Guard, LockError> {
        self.acquire(LockRequest::shared(key.as_ref(), operation.as_ref()))
    }

    /// Waits for an exclusive lock on `key`. See [`acquire`](LockManager::acquire).
    ///
    /// The key and operation may be borrowed or owned, as for [`shared`](LockManager::shared).
    pub fn exclusive(
        &self,
        key: impl AsRef<str>,
        operation: impl AsRef<str>,
    ) -> Scoped<Guard, LockError> {
        self.acquire(LockRequest::exclusive(key.as_ref(), operation.as_ref()))
    }

    /// Waits, in FIFO order, for the lock `request` describes.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidRequest`] for a bad key or operation (nothing is written),
    /// [`LockError::Interrupted`] when an attached signal aborts, [`LockError::Storage`],
    /// [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// Interrupting it deletes its waiting row, and any row promoted for it, before it returns;
    /// dropping it does the same in the background. No row is left behind.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::{AbortSignal, LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let held = locks.exclusive("repo", "prune").await?;
    /// let error = locks
    ///     .acquire(LockRequest::shared("repo", "backup"))
    ///     .with_signal(&AbortSignal::timeout(Duration::from_millis(20)))
    ///     .await
    ///     .unwrap_err();
    /// assert!(error.abort_reason().is_some());
    /// assert_eq!(locks.inspect(Some("repo")).await?.len(), 1); // only the holder
    /// # drop(held);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn acquire(&self, request: LockRequest) -> Scoped<Guard, LockError> {
        self.start(vec![request], Policy::Queue)
    }

    /// All or nothing; holds no queue position while it waits (never blocks others, but may
    /// starve behind a steady stream of other requests).
    ///
    /// While it waits it holds no row at all, so [`inspect`](LockManager::inspect) does not show
    /// it: the database records it only once it holds every key. Use
    /// [`many_queued`](LockManager::many_queued) for a request that waits visibly, in line.
    ///
    /// # Errors
    ///
    /// As [`acquire`](LockManager::acquire); also [`LockError::InvalidRequest`] for no keys or a
    /// key named twice.
    ///
    /// # Cancel safety
    ///
    /// It never holds part of its set, and writes nothing until it is granted everything at once.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// // A mirror copy: shared on the source, exclusive on the mirror.
    /// let copy = locks
    ///     .many([
    ///         LockRequest::shared("repo/main", "copy"),
    ///         LockRequest::exclusive("repo/mirror", "copy"),
    ///     ])
    ///     .await?;
    /// assert_eq!(copy.requests().len(), 2);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn many(
        &self,
        requests: impl IntoIterator<Item = LockRequest>,
    ) -> Scoped<Guard, LockError> {
        self.start(requests.into_iter().collect(), Policy::NoQueue)
    }

    /// All or nothing; queues every key under one ticket, in one transaction (never starves;
    /// one global ticket order makes it deadlock-free).
    ///
    /// # Errors
    ///
    /// As [`many`](LockManager::many).
    ///
    /// # Cancel safety
    ///
    /// As [`acquire`](LockManager::acquire): every row of the request is deleted when it is
    /// interrupted or dropped.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let both = locks
    ///     .many_queued([LockRequest::exclusive("a", "swap"), LockRequest::exclusive("b", "swap")])
    ///     .await?;
    /// assert!(locks.is_locked("a").await? && locks.is_locked("b").await?);
    /// both.release().await?;
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn many_queued(
        &self,
        requests: impl IntoIterator<Item = LockRequest>,
    ) -> Scoped<Guard, LockError> {
        self.start(requests.into_iter().collect(), Policy::Queue)
    }

    /// Granted now or `None`; never queues.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidRequest`], [`LockError::Storage`], [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// Dropping this future before it completes releases the lock if it was granted.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let first = locks.try_acquire(LockRequest::exclusive("k", "a")).await?;
    /// assert!(first.is_some());
    /// assert!(locks.try_acquire(LockRequest::shared("k", "b")).await?.is_none());
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn try_acquire(&self, request: LockRequest) -> Result<Option<Guard>, LockError> {
        let requests = vec![request];
        validate(&requests)?;
        let shared = self.shared.clone();
        let id = shared.next_request.fetch_add(1, Ordering::Relaxed);
        let undo = RemoveOnDrop::new(&shared, id);
        let grant = loop {
            let grant = match shared.acquire(id, &requests, false).await? {
                Acquired::Granted(grant) => grant,
                Acquired::NotNow | Acquired::Queued(..) => break None,
            };
            if let Some(grant) = shared.deliverable(id, grant).await? {
                break Some(grant);
            }
        };
        undo.disarm();
        Ok(grant.map(|grant| Guard::new(&shared, id, grant, requests, None)))
    }

    /// Whether `key` has a live holder.
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`], [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// A read: dropping it has no effect.
    pub async fn is_locked(&self, key: &str) -> Result<bool, LockError> {
        let key = key.to_owned();
        self.shared
            .call(|reply| Command::IsLocked { key, reply })
            .await
    }

    /// The live holders and waiters of `key`, or of every key, ordered by key and ticket.
    ///
    /// A waiting [`many`](LockManager::many) holds no row, so it is not listed until it is
    /// granted; every other waiting acquisition is. Each entry prints as one line (see
    /// [`LockEntry`]'s `Display`).
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`], [`LockError::Shutdown`].
    ///
    /// # Cancel safety
    ///
    /// A read: dropping it has no effect.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{EntryState, LockManager};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let _guard = locks.exclusive("repo", "check").await?;
    /// let entries = locks.inspect(None).await?;
    /// assert_eq!(entries[0].operation, "check");
    /// assert_eq!(entries[0].state, EntryState::Held);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn inspect(&self, key: Option<&str>) -> Result<Vec<LockEntry>, LockError> {
        let key = key.map(str::to_owned);
        let rows = self
            .shared
            .call(|reply| Command::Inspect { key, reply })
            .await?;
        let views: Vec<grant::RowView> = rows
            .iter()
            .map(|row| grant::RowView {
                key: row.key.clone(),
                mode: row.mode,
                ticket: row.ticket,
                held: row.held,
            })
            .collect();
        let mut positions: HashMap<&str, std::collections::BTreeMap<u64, usize>> = HashMap::new();
        Ok(rows
            .iter()
            .map(|row| {
                let state = if row.held {
                    EntryState::Held
                } else {
                    let on_key = positions
                        .entry(row.key.as_str())
                        .or_insert_with(|| grant::queue_positions(&row.key, &views));
                    EntryState::Waiting {
                        position: on_key.get(&row.ticket).copied().unwrap_or(0),
                    }
                };
                LockEntry {
                    key: row.key.clone(),
                    mode: row.mode,
                    operation: row.operation.clone(),
                    owner: row.owner.clone(),
                    ticket: row.ticket,
                    state,
                    since: from_micros(row.since),
                    expires_at: from_micros(row.expires_at),
                }
            })
            .collect())
    }

    /// Releases every row of this owner and stops its background work. Waiting acquisitions
    /// end with [`LockError::Shutdown`]; guards' [`lost`](Guard::lost) signals abort. Calling it
    /// again does nothing.
    ///
    /// # Errors
    ///
    /// [`LockError::Storage`] if the rows could not be deleted (they then expire with their
    /// lease).
    ///
    /// # Cancel safety
    ///
    /// The shutdown is sent when this future is first polled, and then happens whether or not
    /// the future is awaited to the end.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockError, LockManager};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// let guard = locks.exclusive("k", "work").await?;
    /// locks.shutdown().await?;
    /// assert!(guard.lost().is_aborted());
    /// assert!(matches!(locks.exclusive("k", "more").await, Err(LockError::Shutdown)));
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn shutdown(&self) -> Result<(), LockError> {
        match self
            .shared
            .call(|reply| Command::Write(Write::Shutdown { reply }))
            .await
        {
            Err(LockError::Shutdown) => Ok(()),
            other => other,
        }
    }

    /// Counters since open.
    pub fn stats(&self) -> StorageStats {
        let counters = &self.shared.common.counters;
        StorageStats {
            write_transactions: counters.write_transactions.load(Ordering::Relaxed),
            change_checks: counters.change_checks.load(Ordering::Relaxed),
            heartbeats: counters.heartbeats.load(Ordering::Relaxed),
        }
    }

    fn start(&self, requests: Vec<LockRequest>, policy: Policy) -> Scoped<Guard, LockError> {
        let shared = self.shared.clone();
        let spawner = shared.common.spawner.clone();
        let span = tracing::debug_span!(
            "acquire",
            keys = ?requests.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(),
            modes = ?requests.iter().map(|r| r.mode).collect::<Vec<_>>(),
            operation = requests.first().map_or("", |r| r.operation.as_str()),
            owner = %shared.common.owner,
        );
        let acquisition = Scoped::new(move |scope| {
            tracing::Instrument::instrument(acquire_in_scope(shared, scope, requests, policy), span)
        });
        match spawner {
            Some(spawner) => acquisition.with_spawner(spawner),
            None => acquisition,
        }
    }
}

/// The body of every acquisition. Whatever it writes is removed unless the body hands a `Guard`
/// out: at once, through the worker, if the body is dropped (the removal is queued behind the
/// acquisition, so it finds what that wrote); and by the finalizer registered before the first
/// write, which waits for the removal, so that an interrupted acquisition reports only after it.
async fn acquire_in_scope(
    shared: Arc<Shared>,
    scope: Scope,
    requests: Vec<LockRequest>,
    policy: Policy,
) -> Result<Guard, LockError> {
    validate(&requests)?;
    let started = shared.common.clock.now();
    let id = shared.next_request.fetch_add(1, Ordering::Relaxed);
    let undo = shared.clone();
    scope.add_finalizer(move |status| async move {
        if !matches!(status, ExitStatus::Success) {
            match undo.remove(id).await {
                // A shut-down manager has deleted every row of its owner already.
                Ok(_) | Err(LockError::Shutdown) => {}
                Err(error) => tracing::warn!(
                    %error,
                    "removing an abandoned lock request failed; the worker retries it"
                ),
            }
        }
    });
    let removal = RemoveOnDrop::new(&shared, id);
    let mut beating = false;
    // The caller still wants the lock whenever a grant or a wait runs out of lease: its place
    // is lost, its turn is not, so it asks again.
    let grant = loop {
        let grant = match policy {
            Policy::Queue => {
                // No later than the row's lease starts: the heartbeat counts from here.
                let sent_at = shared.common.clock.now();
                match shared.acquire(id, &requests, true).await? {
                    Acquired::Granted(grant) => grant,
                    Acquired::Queued(ticket, slot) => {
                        if !beating {
                            beating = true;
                            scope.fork(heartbeat::waiter(shared.clone(), sent_at));
                        }
                        match slot.granted().await? {
                            Some(expires_at) => Grant { ticket, expires_at },
                            None => {
                                tracing::warn!(
                                    ticket,
                                    "a waiting request's lease ran out (was this process paused \
                                     or starved for longer than the lease?); queueing it again"
                                );
                                continue;
                            }
                        }
                    }
                    Acquired::NotNow => {
                        return Err(LockError::Storage(
                            "while acquiring: a queued request was refused".into(),
                        ))
                    }
                }
            }
            Policy::NoQueue => {
                let _waiting = UnqueuedWaiter::new(&shared.common);
                loop {
                    // Listen before trying, so a change between the try and the wait is not
                    // missed.
                    let changed = shared.common.changed.listen();
                    match shared.acquire(id, &requests, false).await? {
                        Acquired::Granted(grant) => break grant,
                        Acquired::NotNow | Acquired::Queued(..) => changed.await,
                    }
                }
            }
        };
        if let Some(grant) = shared.deliverable(id, grant).await? {
            break grant;
        }
    };
    removal.disarm();
    Ok(Guard::new(&shared, id, grant, requests, Some(started)))
}

/// Counts a waiter without a queue position while it lives.
struct UnqueuedWaiter<'a>(&'a Common);

impl<'a> UnqueuedWaiter<'a> {
    fn new(common: &'a Common) -> Self {
        common.unqueued.fetch_add(1, Ordering::SeqCst);
        UnqueuedWaiter(common)
    }
}

impl Drop for UnqueuedWaiter<'_> {
    fn drop(&mut self) {
        self.0.unqueued.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Sends a `Remove` for a request if dropped before being disarmed: the synchronous half of
/// every acquisition's clean-up.
struct RemoveOnDrop<'a> {
    shared: &'a Shared,
    request: u64,
    armed: bool,
}

impl<'a> RemoveOnDrop<'a> {
    fn new(shared: &'a Shared, request: u64) -> Self {
        RemoveOnDrop {
            shared,
            request,
            armed: true,
        }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.shared.send(Command::Write(Write::Remove {
                request: self.request,
                reply: None,
            }));
        }
    }
}

fn validate(requests: &[LockRequest]) -> Result<(), LockError> {
    let invalid = |why: String| Err(LockError::InvalidRequest(why));
    if requests.is_empty() {
        return invalid("no keys to lock".into());
    }
    let mut seen = HashSet::new();
    for request in requests {
        let key = &request.key;
        if key.is_empty() {
            return invalid("the key is empty".into());
        }
        for (what, text) in [("key", key), ("operation", &request.operation)] {
            if text.len() > MAX_NAME_BYTES {
                return invalid(format!(
                    "the {what} is {} bytes long; at most {MAX_NAME_BYTES} are allowed",
                    text.len()
                ));
            }
            if text.contains('\0') {
                return invalid(format!("the {what} {text:?} contains a NUL character"));
            }
        }
        if !seen.insert(key.as_str()) {
            return invalid(format!("the key {key:?} is named twice"));
        }
    }
    Ok(())
}

/// A granted lock. Released by [`release`](Guard::release), by dropping it, or by a [`Scope`]
/// that [adopted](Scope::adopt) it.
///
/// # Examples
///
/// ```
/// use leasehold::{LockManager, Scoped, LockError};
///
/// # futures::executor::block_on(async {
/// let locks = LockManager::open_in_memory()?;
/// let guard = locks.exclusive("repo", "prune").await?;
/// let token = guard.fencing_token();   // pass it to the resource you write to
/// // Interrupt the protected work if the lease is ever lost:
/// let work = Scoped::<(), LockError>::new(|_| async { Ok(()) }).with_signal(&guard.lost());
/// work.await?;
/// guard.release().await?;
/// # let _ = token;
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
#[must_use = "dropping a Guard releases the lock"]
pub struct Guard {
    shared: Arc<Shared>,
    request: u64,
    ticket: u64,
    requests: Vec<LockRequest>,
    lost: AbortSignal,
    acquired_at: Duration,
    released: bool,
}

impl Guard {
    fn new(
        shared: &Arc<Shared>,
        request: u64,
        grant: Grant,
        requests: Vec<LockRequest>,
        started: Option<Duration>,
    ) -> Guard {
        let ticket = grant.ticket;
        let common = &shared.common;
        let now = common.clock.now();
        let lost = AbortController::new();
        let signal = lost.signal();
        let shut_down = {
            let mut guards = lock(&common.guards);
            if guards.shut_down {
                Some(lost)
            } else {
                guards.entries.insert(
                    ticket,
                    GuardEntry {
                        rows: requests.len(),
                        keys: requests.iter().map(|r| r.key.clone()).collect(),
                        lost,
                        expires_at: grant.expires_at,
                    },
                );
                None
            }
        };
        match shut_down {
            // Granted in the batch that shut the manager down, whose deletion took it again:
            // the shutdown has already told the other guards, so tell this one here.
            Some(lost) => {
                lost.abort(AbortReason::new(LeaseLost::shutdown()));
            }
            None => heartbeat::ensure_daemon(shared),
        }
        for request in &requests {
            tracing::debug!(
                key = %request.key,
                mode = ?request.mode,
                operation = %request.operation,
                ticket,
                waited_us = started.map(|s| now.saturating_sub(s).as_micros() as u64),
                "lock acquired"
            );
        }
        Guard {
            shared: shared.clone(),
            request,
            ticket,
            requests,
            lost: signal,
            acquired_at: now,
            released: false,
        }
    }

    /// The request's ticket: strictly increasing across keys and owners of one database. A
    /// resource that remembers the largest token it has accepted can refuse writes from a holder
    /// whose lease ran out while it was paused.
    pub fn fencing_token(&self) -> u64 {
        self.ticket
    }

    /// What this guard holds, in the order requested.
    pub fn requests(&self) -> &[LockRequest] {
        &self.requests
    }

    /// Aborted with a [`LeaseLost`] reason if the lease is lost while held. Attach it to the
    /// protected work with [`Scoped::with_signal`].
    pub fn lost(&self) -> AbortSignal {
        self.lost.clone()
    }

    /// Deletes this owner's rows and wakes local waiters. Dropping the guard releases it too
    /// (silently, whether or not the lease was lost).
    ///
    /// A guard from `many` releases all its keys in one transaction, so no other request ever
    /// sees part of the set released.
    ///
    /// # Errors
    ///
    /// [`LockError::LeaseLost`] if the lease had been lost before the release: the rows were
    /// gone or had run out (the [`lost`](Guard::lost) signal is then aborted too, if it was
    /// not already), so the work the guard protected may have overlapped with another
    /// holder's. [`LockError::Storage`] if the rows could not be deleted (they then expire
    /// with their lease); [`LockError::Shutdown`] if the manager was shut down (which released
    /// them).
    ///
    /// # Cancel safety
    ///
    /// The release is sent before the first await, so dropping this future still releases.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use leasehold::{LockError, LockManager, TestClock};
    ///
    /// # futures::executor::block_on(async {
    /// let clock = TestClock::new();
    /// let locks = LockManager::builder().clock(Arc::new(clock.clone())).open_in_memory()?;
    /// let guard = locks.exclusive("k", "paused too long").await?;
    /// clock.advance(Duration::from_secs(60)); // past the lease, with no heartbeat
    /// assert!(matches!(guard.release().await, Err(LockError::LeaseLost(_))));
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub async fn release(mut self) -> Result<(), LockError> {
        self.released = true;
        let entry = self.forget();
        let (reply, response) = oneshot::channel();
        let sent = self.shared.send(Command::Write(Write::Remove {
            request: self.request,
            reply: Some(reply),
        }));
        self.trace_release();
        sent?;
        // The database decides: rows that were all live when deleted mean nobody else can have
        // held the lock meanwhile, even if a slow renewal made this process fear otherwise.
        if self.shared.common.replies.wait(response).await? {
            return Ok(());
        }
        let lost = self
            .lost
            .reason()
            .and_then(|reason| reason.downcast_ref::<LeaseLost>().copied())
            .unwrap_or_else(LeaseLost::expired);
        if let Some(entry) = entry {
            // Lost before any heartbeat could tell: tell the work it protected now.
            tracing::warn!(
                ticket = self.ticket,
                "released a lock whose lease had run out"
            );
            entry.lost.abort(AbortReason::new(lost));
        }
        Err(LockError::LeaseLost(lost))
    }

    /// Stops the heartbeat's bookkeeping of this guard; returns its entry, unless a lost lease
    /// or a shutdown took it already.
    fn forget(&self) -> Option<GuardEntry> {
        lock(&self.shared.common.guards)
            .entries
            .remove(&self.ticket)
    }

    fn trace_release(&self) {
        let held_for = self
            .shared
            .common
            .clock
            .now()
            .saturating_sub(self.acquired_at);
        for request in &self.requests {
            tracing::debug!(
                key = %request.key,
                ticket = self.ticket,
                held_us = held_for.as_micros() as u64,
                "lock released"
            );
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.released {
            self.forget();
            self.trace_release();
            // Through the worker without waiting; it runs before any later command.
            let _ = self.shared.send(Command::Write(Write::Remove {
                request: self.request,
                reply: None,
            }));
        }
    }
}

impl Release for Guard {
    fn release(self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if let Err(error) = Guard::release(self).await {
                tracing::warn!(%error, "releasing a lock owned by a scope failed");
            }
        })
    }
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("fencing_token", &self.ticket)
            .field("requests", &self.requests)
            .field("lost", &self.lost.is_aborted())
            .finish()
    }
}
