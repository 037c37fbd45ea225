//! The seam between the worker and a database: what the worker needs of storage, and the rows
//! it gets back. One implementation per backend (`sqlite.rs`); the worker, the grant rule, the
//! heartbeats and the guards are shared.
//!
//! Every method runs on the worker's own thread. Times are whole microseconds since the Unix
//! epoch, by the clock the backend judges leases with.

use std::time::Duration;

use super::grant::RowView;
use super::{LockError, LockRequest, Mode};
use crate::clock::Clock;

pub(crate) type Result<T> = std::result::Result<T, LockError>;

/// What a backend stores and answers. A write transaction is `begin`, the changes, then
/// `commit` (or `rollback`); reads outside one see committed state.
pub(crate) trait Storage {
    /// The time leases are judged by, now.
    fn now(&self) -> i64;

    /// How far that time is ahead of `clock`'s: the worker tells callers, who judge by their
    /// own clock, of expiries in theirs.
    fn ahead_of(&self, clock: &dyn Clock) -> i64 {
        self.now() - micros(clock.now())
    }

    /// A number that changes whenever another connection may have committed: a cheap read,
    /// writing nothing. Also where a backend finds out that it no longer talks to the database
    /// it opened (an error).
    fn change_version(&mut self) -> Result<i64>;

    /// Starts a write transaction, waiting while another connection holds the write lock;
    /// returns the time read once it holds it (a time read before could be stale by however
    /// long it waited).
    fn begin(&mut self) -> Result<i64>;
    fn commit(&mut self) -> Result<()>;
    /// Called in a write transaction that deleted or promoted rows, before its commit: a
    /// backend that can wake other managers says so here (others find out by their poll).
    fn announce(&mut self) -> Result<()> {
        Ok(())
    }
    /// Rolls back if a transaction is open; a failure here leaves nothing to undo.
    fn rollback(&mut self);

    /// Appends the live rows on `key`, in ticket order.
    fn rows_on_key(&mut self, key: &str, now: i64, into: &mut Vec<RowView>) -> Result<()>;
    /// Every live row on every key that has a live waiting row: what promotion needs.
    fn rows_on_waited_keys(&mut self, now: i64) -> Result<Vec<RowView>>;
    /// The next ticket of the one sequence every request takes from.
    fn next_ticket(&mut self) -> Result<u64>;
    /// Writes one row per request, all under `ticket`, held or waiting.
    fn insert_request(
        &mut self,
        owner: &str,
        ticket: u64,
        requests: &[LockRequest],
        held: bool,
        now: i64,
        expires_at: i64,
    ) -> Result<()>;
    /// Turns the waiting row of `ticket` on `key` into a held row, keeping the ticket, with a
    /// whole lease (the row's own) from `now`.
    fn promote(&mut self, key: &str, ticket: u64, now: i64) -> Result<()>;
    /// Deletes `owner`'s row of `ticket` on `key`, held or waiting.
    fn delete_row(&mut self, owner: &str, key: &str, ticket: u64, now: i64) -> Result<Deleted>;
    /// Deletes every row of `owner`; returns how many there were.
    fn delete_owner(&mut self, owner: &str) -> Result<usize>;
    /// Deletes rows whose lease has run out; returns how many.
    fn delete_expired(&mut self, now: i64) -> Result<usize>;
    /// Renews every live row of `owner` until `expires_at`; never touches an expired row.
    fn renew(&mut self, owner: &str, now: i64, expires_at: i64) -> Result<usize>;

    /// `owner`'s live requests: ticket, whether held, how many rows, earliest expiry.
    fn owned_requests(&mut self, owner: &str, now: i64) -> Result<Vec<OwnedRequest>>;
    /// The earliest lease expiry among other owners' live rows: when a waiter may next be
    /// unblocked without anyone writing.
    fn next_foreign_expiry(&mut self, owner: &str, now: i64) -> Result<Option<i64>>;
    /// Live rows, of one key or all, ordered by key and ticket.
    fn live_rows(&mut self, key: Option<&str>, now: i64) -> Result<Vec<Row>>;
    /// Whether `key` has a live held row.
    fn is_held(&mut self, key: &str, now: i64) -> Result<bool>;
}

/// One live row, as `inspect` shows it.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) key: String,
    pub(crate) mode: Mode,
    pub(crate) operation: String,
    pub(crate) owner: String,
    pub(crate) ticket: u64,
    pub(crate) held: bool,
    pub(crate) since: i64,
    pub(crate) expires_at: i64,
}

/// The live rows of one owner's request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OwnedRequest {
    pub(crate) ticket: u64,
    pub(crate) held: bool,
    pub(crate) rows: usize,
    /// The earliest lease expiry among them.
    pub(crate) expires_at: i64,
}

/// What deleting one row found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Deleted {
    /// A row whose lease had not run out.
    Live,
    /// A row whose lease had run out (invisible to every decision already).
    Expired,
    /// No row.
    Missing,
}

pub(crate) fn micros(time: Duration) -> i64 {
    i64::try_from(time.as_micros()).unwrap_or(i64::MAX)
}

pub(crate) fn from_micros(micros: i64) -> Duration {
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// How a mode is stored: 0 shared, 1 exclusive.
pub(crate) fn mode_code(mode: Mode) -> i16 {
    match mode {
        Mode::Shared => 0,
        Mode::Exclusive => 1,
    }
}

/// The mode stored as `code`.
pub(crate) fn mode_of(code: i64) -> Mode {
    if code == 0 {
        Mode::Shared
    } else {
        Mode::Exclusive
    }
}

/// A ticket as stored (a signed 64-bit integer, which both databases have) and back.
pub(crate) fn ticket_of(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

pub(crate) fn sql_ticket(ticket: u64) -> i64 {
    i64::try_from(ticket).unwrap_or(i64::MAX)
}
