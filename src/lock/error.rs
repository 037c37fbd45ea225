//! Why a lock operation failed, and the reason a lost lease is reported with.

use std::error::Error;
use std::fmt;

use crate::abort::{AbortReason, Interrupted};

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
    /// overlapped with theirs. (A resource that checks [fencing tokens](crate::Guard::fencing_token)
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
    shutdown: bool,
}

impl LeaseLost {
    pub(super) fn expired() -> Self {
        LeaseLost { shutdown: false }
    }

    pub(super) fn shutdown() -> Self {
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
