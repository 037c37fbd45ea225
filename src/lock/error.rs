//! Why a lock operation failed, why its storage failed, and the reason a lost lease is
//! reported with.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

use crate::abort::Interrupted;
use crate::exit::AbortReason;

/// Why a lock operation failed.
///
/// Cloning it is cheap (a storage error keeps its cause behind an `Arc`).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum LockError {
    /// The acquisition was interrupted; carries the caller's reason. Nothing it wrote remains.
    Interrupted(Interrupted),
    /// Empty or oversized key/operation, NUL, duplicate key in `many`, no keys at all.
    InvalidRequest(String),
    /// A builder setting that cannot work, such as a lease shorter than two heartbeats.
    InvalidConfig(String),
    /// The storage failed (SQLite, PostgreSQL), or the storage thread could not do its work:
    /// what was being done, the message, and the backend's own error as
    /// [`source`](Error::source), with its code. [`StorageError::is_transient`] says whether
    /// the same work may succeed if tried again.
    Storage(StorageError),
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
    /// overlapped with theirs. (A resource that checks [fencing tokens](crate::Guard::fencing_token)
    /// has refused the stale writes.)
    LeaseLost(LeaseLost),
    /// An operator removed this waiting request (the command's `release`, or
    /// [`LockManager::remove`](crate::LockManager::remove) on another manager): it does not
    /// queue again. `by` is the remover's owner id, as the store recorded it. (A request whose
    /// waiting row lapsed instead, its process paused past its lease, queues again by itself.)
    Removed {
        /// The owner id of the manager that removed the request.
        by: String,
    },
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
            LockError::Storage(error) => write!(f, "lock storage failed {error}"),
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
            LockError::Removed { by } => write!(
                f,
                "an operator ({by}) removed this waiting request; it does not queue again"
            ),
        }
    }
}

impl Error for LockError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            LockError::Interrupted(interrupted) => Some(interrupted),
            LockError::LeaseLost(lost) => Some(lost),
            LockError::Storage(error) => Some(error),
            _ => None,
        }
    }
}

impl From<StorageError> for LockError {
    fn from(error: StorageError) -> Self {
        LockError::Storage(error)
    }
}

/// Why the storage failed: what was being done, the message, the backend's code, and its own
/// error underneath as [`source`](Error::source) (a `sqlite::Error`, a `postgres::Error`, an
/// `io::Error`), when there is one.
///
/// # Examples
///
/// ```
/// use std::error::Error;
/// use leasehold::{LockError, LockManager};
///
/// let dir = tempfile::tempdir()?;
/// // A folder where the database file should be.
/// let Err(LockError::Storage(error)) = LockManager::open(dir.path()) else {
///     panic!("a folder opened as a database");
/// };
/// assert_eq!(error.doing(), format!("opening the database {}", dir.path().display()));
/// assert_eq!(error.code(), Some("14")); // SQLITE_CANTOPEN
/// assert!(error.to_string().contains("a folder, not a file"), "{error}");
/// assert!(error.source().is_some());
/// assert!(!error.is_transient());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct StorageError {
    doing: String,
    message: String,
    /// The backend's name and its code for the error.
    code: Option<(&'static str, String)>,
    transient: bool,
    source: Option<Arc<dyn Error + Send + Sync>>,
}

impl StorageError {
    /// A failure while `doing` something, said by `message`.
    pub(crate) fn new(doing: impl Into<String>, message: impl Into<String>) -> Self {
        StorageError {
            doing: doing.into(),
            message: message.into(),
            code: None,
            transient: false,
            source: None,
        }
    }

    /// The same, caused by `source` (the backend's own error).
    pub(crate) fn caused_by(mut self, source: impl Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The same, with the code `backend` gave it.
    pub(crate) fn with_code(mut self, backend: &'static str, code: impl Into<String>) -> Self {
        self.code = Some((backend, code.into()));
        self
    }

    /// The same, its message followed by `why` (what makes it plain).
    pub(crate) fn explained(mut self, why: &str) -> Self {
        self.message = format!("{}: {why}", self.message);
        self
    }

    /// The same, for a failure that passes (see [`is_transient`](Self::is_transient)).
    pub(crate) fn transient(mut self, transient: bool) -> Self {
        self.transient = transient;
        self
    }

    /// What was being done: `"deciding"`, `"opening the database /var/lib/app/locks.db"`.
    pub fn doing(&self) -> &str {
        &self.doing
    }

    /// The backend's code for the error, if it gave one: SQLite's result code (extended, as a
    /// number: `"14"`), or PostgreSQL's SQLSTATE (`"55P03"`).
    pub fn code(&self) -> Option<&str> {
        self.code.as_ref().map(|(_, code)| code.as_str())
    }

    /// Whether the same work may succeed if done again: the database was busy, a statement or
    /// a lock wait timed out, a deadlock was broken, the connection ended or the server could
    /// not be reached. The manager does such work again by itself on its busy schedule; a
    /// caller that sees one got it once that schedule gave up.
    pub fn is_transient(&self) -> bool {
        self.transient
    }
}

impl fmt::Display for StorageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "while {}: {}", self.doing, self.message)?;
        match &self.code {
            Some((backend, code)) => write!(f, " ({backend} code {code})"),
            None => Ok(()),
        }
    }
}

impl fmt::Debug for StorageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StorageError")
            .field("doing", &self.doing)
            .field("message", &self.message)
            .field("code", &self.code)
            .field("transient", &self.transient)
            .field("source", &self.source)
            .finish()
    }
}

impl Error for StorageError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn Error + 'static))
    }
}

/// The reason a [`Guard::lost`](crate::Guard::lost) signal aborts with.
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
    why: Why,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Why {
    #[default]
    Expired,
    Shutdown,
    RunningOut,
}

impl LeaseLost {
    pub(super) fn expired() -> Self {
        LeaseLost { why: Why::Expired }
    }

    pub(super) fn shutdown() -> Self {
        LeaseLost { why: Why::Shutdown }
    }

    pub(super) fn running_out() -> Self {
        LeaseLost {
            why: Why::RunningOut,
        }
    }

    /// Whether the lock was lost because its manager was shut down (rather than expiring).
    pub fn by_shutdown(&self) -> bool {
        self.why == Why::Shutdown
    }

    /// Whether this is a warning given a margin before the lease runs out, no renewal having
    /// come back in time ([`Guard::lost_within`](crate::Guard::lost_within)): the rows may
    /// still be held, and whoever was told has the margin to stop before another owner can be
    /// granted the lock.
    pub fn before_expiry(&self) -> bool {
        self.why == Why::RunningOut
    }
}

impl fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.why {
            Why::Expired => "lease lost: the lock's rows are gone or its lease ran out",
            Why::Shutdown => "lease lost: the lock manager was shut down",
            Why::RunningOut => "lease running out: no renewal came back in time",
        })
    }
}

impl Error for LeaseLost {}
