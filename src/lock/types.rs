//! The public values of the lock manager: requests, modes, what `inspect` shows, counters.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use super::LockError;

/// The longest key or operation name accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;

/// How a lock is held: many shared holders at once, one exclusive holder, or some of a key's
/// permits.
///
/// A key is used either for shared and exclusive requests or for permits, never both at once;
/// and every permits request on a key names the same limit.
///
/// # Examples
///
/// ```
/// use leasehold::{LockRequest, Mode};
///
/// assert_eq!(LockRequest::shared("repo", "backup").mode, Mode::Shared);
/// assert_eq!(
///     LockRequest::permits("backups", "nightly", 1, 3).mode,
///     Mode::Permits { count: 1, limit: 3 },
/// );
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Held together with other shared holders (readers).
    Shared,
    /// Held alone (a writer).
    Exclusive,
    /// `count` of the key's `limit` permits: held together with other permit holders while
    /// their counts add up to at most `limit`. Granted in the order asked for: a request that
    /// does not fit waits, and every request behind it waits too, however small.
    Permits {
        /// How many permits the request takes: at least 1, at most `limit`.
        count: u32,
        /// How many the key has: at least 1, the same in every request on the key.
        limit: u32,
    },
}

/// `shared`, `exclusive`, or `permits K/N` (K of N permits), as [`LockEntry`]'s `Display`
/// writes it. Width and alignment are honoured, for tables.
///
/// # Examples
///
/// ```
/// use leasehold::Mode;
///
/// assert_eq!(Mode::Shared.to_string(), "shared");
/// assert_eq!(format!("[{:<9}]", Mode::Exclusive), "[exclusive]");
/// assert_eq!(format!("[{:<9}]", Mode::Shared), "[shared   ]");
/// assert_eq!(Mode::Permits { count: 2, limit: 3 }.to_string(), "permits 2/3");
/// assert_eq!(format!("[{:<12}]", Mode::Permits { count: 1, limit: 3 }), "[permits 1/3 ]");
/// ```
impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mode::Shared => f.pad("shared"),
            Mode::Exclusive => f.pad("exclusive"),
            Mode::Permits { count, limit } => f.pad(&format!("permits {count}/{limit}")),
        }
    }
}

/// One key to lock, how, and for what (the operation is shown by [`LockManager::inspect`](crate::LockManager::inspect)).
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
    /// Shared, exclusive, or some of the key's permits.
    pub mode: Mode,
    /// What the holder is doing, for people reading `inspect`: at most 1 KiB, no NUL.
    pub operation: String,
}

impl LockRequest {
    /// A request for `key` in `mode`, a [`Mode`] chosen at run time (read from a configuration
    /// or a command line, say): the same request as [`shared`](LockRequest::shared),
    /// [`exclusive`](LockRequest::exclusive) or [`permits`](LockRequest::permits) make for that
    /// mode.
    ///
    /// Nothing is checked here, for any mode: the key, the operation and a
    /// [`Mode::Permits`]'s `count` and `limit` are checked when the request is acquired, which
    /// fails with [`LockError::InvalidRequest`](crate::LockError::InvalidRequest) before
    /// anything is written (see [`permits`](LockRequest::permits) for the permits' rules).
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockError, LockManager, LockRequest, Mode};
    ///
    /// # futures::executor::block_on(async {
    /// let writing = true; // from the command line, say
    /// let mode = if writing { Mode::Exclusive } else { Mode::Shared };
    /// let request = LockRequest::new("repo/photos", mode, "sync");
    /// assert_eq!(request.mode, mode);
    ///
    /// let locks = LockManager::open_in_memory()?;
    /// let guard = locks.acquire(request).await?;
    /// guard.release().await?;
    ///
    /// // Permits are checked as those of `LockRequest::permits` are: when acquired.
    /// let too_many = LockRequest::new("slots", Mode::Permits { count: 4, limit: 3 }, "backup");
    /// assert!(matches!(locks.acquire(too_many).await, Err(LockError::InvalidRequest(_))));
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn new(key: impl Into<String>, mode: Mode, operation: impl Into<String>) -> Self {
        LockRequest {
            key: key.into(),
            mode,
            operation: operation.into(),
        }
    }

    /// A shared request.
    pub fn shared(key: impl Into<String>, operation: impl Into<String>) -> Self {
        LockRequest::new(key, Mode::Shared, operation)
    }

    /// An exclusive request.
    pub fn exclusive(key: impl Into<String>, operation: impl Into<String>) -> Self {
        LockRequest::new(key, Mode::Exclusive, operation)
    }

    /// A request for `count` of the `limit` permits of `key`: at most `limit` permits of the
    /// key are held at once, by however many holders ([`Mode::Permits`]).
    ///
    /// A `count` of 0 or above `limit`, a `limit` of 0, a limit other than the one the key's
    /// other requests name, or a key held or waited for in shared or exclusive mode, make the
    /// acquisition fail with [`LockError::InvalidRequest`](crate::LockError::InvalidRequest).
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::{LockManager, LockRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let locks = LockManager::open_in_memory()?;
    /// // The repository alone, and one of three backup slots: both or neither.
    /// let both = locks
    ///     .many(vec![
    ///         LockRequest::exclusive("repo/photos", "backup"),
    ///         LockRequest::permits("backup-slots", "backup photos", 1, 3),
    ///     ])
    ///     .await?;
    /// assert!(both.fencing_token() > 0);
    /// # Ok::<(), leasehold::LockError>(())
    /// # }).unwrap();
    /// ```
    pub fn permits(
        key: impl Into<String>,
        operation: impl Into<String>,
        count: u32,
        limit: u32,
    ) -> Self {
        LockRequest::new(key, Mode::Permits { count, limit }, operation)
    }
}

/// Whether an entry of [`LockManager::inspect`](crate::LockManager::inspect) holds its lock or waits for it.
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

/// One live holder or waiter, as [`LockManager::inspect`](crate::LockManager::inspect) reports it.
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

/// One line, as an operator would print [`LockManager::inspect`](crate::LockManager::inspect):
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

/// Whose rows an operator removes ([`LockManager::remove`](crate::LockManager::remove)).
///
/// # Examples
///
/// ```
/// use leasehold::{LockManager, MemoryStore, Removal};
///
/// # futures::executor::block_on(async {
/// let store = MemoryStore::new();
/// let (gone, operator) = (
///     LockManager::builder().open_in(&store)?,
///     LockManager::builder().open_in(&store)?,
/// );
/// let guard = gone.exclusive("repo", "prune").await?;
/// // One request, by key and ticket (as `inspect` shows them); or every row of an owner.
/// let one = Removal::Request { key: "repo".into(), ticket: guard.fencing_token() };
/// assert_eq!(operator.remove(one).await?, 1);
/// assert_eq!(operator.remove(Removal::Owner(gone.owner_id().into())).await?, 0);
/// assert!(!operator.is_locked("repo").await?);
/// # Ok::<(), leasehold::LockError>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Removal {
    /// Every request of the owner with this id ([`LockManager::owner_id`](crate::LockManager::owner_id)).
    Owner(String),
    /// The one request with this ticket, whose live row on `key` shows it
    /// ([`LockEntry::ticket`]).
    Request {
        /// A key the request has a live row on.
        key: String,
        /// Its ticket.
        ticket: u64,
    },
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
    /// Times a write found the store locked by another connection and waited for it: each
    /// wait counts once, however long it lasts. Counted on SQLite, where a write waits for the
    /// file's one write lock (held by another manager, process or tool); always 0 on
    /// PostgreSQL, whose writers wait for rows rather than the store, and on the memory store.
    pub lock_waits: u64,
}

/// An error unless `text` (a key, an operation, a leader's value: `what`) may be stored.
pub(super) fn check_text(what: &str, text: &str) -> Result<(), LockError> {
    let invalid = |why: String| Err(LockError::InvalidRequest(why));
    if text.len() > MAX_NAME_BYTES {
        return invalid(format!(
            "the {what} is {} bytes long; at most {MAX_NAME_BYTES} are allowed",
            text.len()
        ));
    }
    if text.contains('\0') {
        return invalid(format!("the {what} {text:?} contains a NUL character"));
    }
    Ok(())
}

pub(super) fn validate(requests: &[LockRequest]) -> Result<(), LockError> {
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
            check_text(what, text)?;
        }
        if !seen.insert(key.as_str()) {
            return invalid(format!("the key {key:?} is named twice"));
        }
        if let Mode::Permits { count, limit } = request.mode {
            if limit == 0 {
                return invalid(format!(
                    "the key {key:?} is asked for with a limit of 0 permits"
                ));
            }
            if count == 0 || count > limit {
                return invalid(format!(
                    "{count} permits of the key {key:?} are asked for: at least 1 and at most \
                     its limit, {limit}, can be held"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_makes_the_request_the_named_constructor_makes_for_its_mode() {
        assert_eq!(
            LockRequest::new("k", Mode::Shared, "op"),
            LockRequest::shared("k", "op")
        );
        assert_eq!(
            LockRequest::new("k", Mode::Exclusive, "op"),
            LockRequest::exclusive("k", "op")
        );
        assert_eq!(
            LockRequest::new("k", Mode::Permits { count: 2, limit: 3 }, "op"),
            LockRequest::permits("k", "op", 2, 3)
        );
    }

    #[test]
    fn new_with_permits_is_checked_as_permits_is_when_acquired() {
        for (count, limit) in [(1, 3), (3, 3), (0, 3), (4, 3), (1, 0)] {
            let made = LockRequest::new("k", Mode::Permits { count, limit }, "op");
            let named = LockRequest::permits("k", "op", count, limit);
            let (made, named) = (validate(&[made]), validate(&[named]));
            assert_eq!(
                made.is_ok(),
                (1..=limit).contains(&count),
                "{count}/{limit}"
            );
            assert_eq!(
                made.map_err(|e| e.to_string()),
                named.map_err(|e| e.to_string())
            );
        }
    }
}
