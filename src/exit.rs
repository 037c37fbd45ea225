//! How work ended and why it was stopped: the plain vocabulary that the core, its runtime seam
//! (`runtime`) and whatever observes it all name, kept apart so that each can import it without
//! importing the others.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// Why a unit of work was interrupted: the caller's own error object, shared.
///
/// A reason is an `Arc<dyn Error + Send + Sync>` inside, so cloning it is cheap and the object the
/// caller passed to [`AbortController::abort`](crate::AbortController::abort) is the very
/// object that reaches the interrupted work ([`AbortReason::ptr_eq`] tells).
///
/// # Examples
///
/// ```
/// use leasehold::AbortReason;
///
/// let reason = AbortReason::from("user pressed stop");
/// assert_eq!(reason.to_string(), "user pressed stop");
/// assert!(reason.ptr_eq(&reason.clone()));
/// ```
#[derive(Clone)]
pub struct AbortReason(Arc<dyn Error + Send + Sync>);

impl AbortReason {
    /// Wraps an error as a reason.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{AbortReason, TimedOut};
    ///
    /// let reason = AbortReason::new(TimedOut);
    /// assert!(reason.downcast_ref::<TimedOut>().is_some());
    /// ```
    pub fn new<E: Error + Send + Sync + 'static>(error: E) -> Self {
        AbortReason(Arc::new(error))
    }

    /// Whether both are the same reason object (not merely equal text).
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::AbortReason;
    ///
    /// let a = AbortReason::from("stop");
    /// let b = AbortReason::from("stop");
    /// assert!(a.ptr_eq(&a.clone()));
    /// assert!(!a.ptr_eq(&b));
    /// ```
    pub fn ptr_eq(&self, other: &AbortReason) -> bool {
        // Compare data pointers only: vtable pointers of one type may differ between codegen units.
        std::ptr::addr_eq(Arc::as_ptr(&self.0), Arc::as_ptr(&other.0))
    }

    /// The error inside, if it is an `E`.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{AbortReason, TimedOut};
    ///
    /// assert!(AbortReason::from("x").downcast_ref::<TimedOut>().is_none());
    /// ```
    pub fn downcast_ref<E: Error + 'static>(&self) -> Option<&E> {
        let error: &(dyn Error + 'static) = &*self.0;
        error.downcast_ref::<E>()
    }

    /// The error inside, for `source()` chains.
    pub(crate) fn as_error(&self) -> &(dyn Error + 'static) {
        &*self.0
    }
}

/// A reason given as plain text.
#[derive(Debug)]
struct Message(String);

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for Message {}

impl From<&str> for AbortReason {
    fn from(message: &str) -> Self {
        AbortReason::new(Message(message.to_owned()))
    }
}

impl From<String> for AbortReason {
    fn from(message: String) -> Self {
        AbortReason::new(Message(message))
    }
}

impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl fmt::Debug for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AbortReason").field(&self.0).finish()
    }
}

/// How a scope ended; every finalizer is told.
///
/// # Examples
///
/// ```
/// use leasehold::{ExitStatus, Scope};
///
/// # futures::executor::block_on(async {
/// let scope = Scope::new();
/// scope.add_finalizer(|status| async move {
///     assert!(matches!(status, ExitStatus::Failure));
/// });
/// scope.close(ExitStatus::Failure).await;
/// # });
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ExitStatus {
    /// The work finished with a value.
    Success,
    /// The work finished with an error, or panicked.
    Failure,
    /// The work was interrupted, for this reason (the caller's object).
    Interrupted(AbortReason),
}

/// `success`, `failure`, or `interrupted: ` and the reason.
///
/// # Examples
///
/// ```
/// use leasehold::ExitStatus;
///
/// assert_eq!(ExitStatus::Success.to_string(), "success");
/// assert_eq!(ExitStatus::Failure.to_string(), "failure");
/// let stopped = ExitStatus::Interrupted("user pressed stop".into());
/// assert_eq!(stopped.to_string(), "interrupted: user pressed stop");
/// ```
impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitStatus::Success => f.write_str("success"),
            ExitStatus::Failure => f.write_str("failure"),
            ExitStatus::Interrupted(reason) => write!(f, "interrupted: {reason}"),
        }
    }
}
