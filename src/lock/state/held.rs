//! The leases an owner holds (`Guards`): one owner for the lease of every granted request, and
//! the one place where a lost lease is told.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::abort::{AbortController, AbortSignal};
use crate::clock::Clock;
use crate::exit::AbortReason;
use crate::lock::LeaseLost;

/// The leases an owner holds: of every request the worker granted, from the moment it decided
/// the grant until the guard is released (or the request removed before its caller took the
/// guard), as its heartbeat and its storage worker see them. Every change to them is one of
/// these methods, so that a lost lease is told in one place.
#[derive(Default)]
pub(crate) struct Guards {
    entries: HashMap<u64, GuardEntry>,
    /// Whether the owner's lock heartbeat runs (see `heartbeat::ensure_daemon`).
    pub(crate) daemon_running: bool,
    /// Set (as the entries are drained) when the worker has shut down, so that a grant made
    /// afterwards is born lost instead of missing the drain.
    shut_down: bool,
}

pub(crate) struct GuardEntry {
    rows: usize,
    keys: Vec<String>,
    /// When its rows' lease runs out by the storage's time, as last granted or renewed.
    expires_at: i64,
    /// Its signal is the guard's `lost()`: it aborts by itself at the lease's deadline, which
    /// each renewal of all the request's rows moves on.
    lost: AbortController,
}

impl GuardEntry {
    /// Whether its lease has been lost by now: its deadline came, or it was told.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.signal().is_aborted()
    }

    /// When its rows' lease runs out by the storage's time, as last granted or renewed.
    pub(crate) fn expires_at(&self) -> i64 {
        self.expires_at
    }

    /// Tells the guard its lease was lost, `why` saying how.
    pub(crate) fn lose(&self, why: LeaseLost) {
        self.lost.abort(AbortReason::new(why));
    }
}

impl Guards {
    /// Whether no lease is kept that may still be live: those lost by their deadline are
    /// forgotten first, so that a heartbeat with nothing left to renew stops.
    pub(crate) fn is_empty(&mut self) -> bool {
        self.entries.retain(|_, entry| !entry.is_lost());
        self.entries.is_empty()
    }

    /// Keeps the lease of `ticket`, just granted on `keys`, until `deadline` (the clock's
    /// monotonic time) unless renewed; returns the signal that tells of its loss. A grant made
    /// after the manager shut down is born lost.
    pub(crate) fn granted(
        &mut self,
        ticket: u64,
        keys: Vec<String>,
        clock: Arc<dyn Clock>,
        deadline: Duration,
        expires_at: i64,
    ) -> AbortSignal {
        let expired = AbortReason::new(LeaseLost::expired());
        let lost = AbortController::with_deadline(clock, deadline, expired);
        let signal = lost.signal();
        if self.shut_down {
            lost.abort(AbortReason::new(LeaseLost::shutdown()));
            return signal;
        }
        let rows = keys.len();
        self.entries.insert(
            ticket,
            GuardEntry {
                rows,
                keys,
                expires_at,
                lost,
            },
        );
        signal
    }

    /// The guard is released, or its request removed: its lease is no longer this owner's
    /// business. Returns its entry, unless a lost lease or a shutdown took it already.
    pub(crate) fn forget(&mut self, ticket: u64) -> Option<GuardEntry> {
        self.entries.remove(&ticket)
    }

    /// After a renewal that made `deadline` (the clock's monotonic time) the end of the leases
    /// it renewed, `renewed(ticket)` being how many of a request's held rows it renewed: the
    /// leases whose rows were all renewed last until then; the others are lost (their rows are
    /// gone, or ran out before the renewal came), and so are those whose deadline came before
    /// this renewal came back. Returns how many were lost.
    pub(crate) fn renewed(
        &mut self,
        renewed: impl Fn(u64) -> usize,
        deadline: Duration,
        expires_at: i64,
    ) -> usize {
        let lost = self.lose(
            |ticket, entry| renewed(ticket) < entry.rows || !entry.lost.extend_deadline(deadline),
            "the lock's rows are gone or expired",
        );
        for entry in self.entries.values_mut() {
            entry.expires_at = expires_at;
        }
        lost
    }

    /// Tells every lease for which `is_lost` holds that it is lost, and forgets it; `why` goes
    /// to the log. Returns how many were lost.
    fn lose(&mut self, mut is_lost: impl FnMut(u64, &GuardEntry) -> bool, why: &str) -> usize {
        let lost: Vec<u64> = self
            .entries
            .iter()
            .filter(|(&ticket, entry)| is_lost(ticket, entry))
            .map(|(&ticket, _)| ticket)
            .collect();
        for &ticket in &lost {
            if let Some(entry) = self.forget(ticket) {
                tracing::warn!(ticket, keys = ?entry.keys, "lease lost: {why}");
                entry.lost.abort(AbortReason::new(LeaseLost::expired()));
            }
        }
        lost.len()
    }

    /// The manager has shut down: every lease is lost, and any granted later is born lost.
    pub(crate) fn shut_down(&mut self) {
        self.shut_down = true;
        let reason = AbortReason::new(LeaseLost::shutdown());
        for (_, entry) in self.entries.drain() {
            entry.lost.abort(reason.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::TestClock;

    fn keys(key: &str) -> Vec<String> {
        vec![key.to_owned()]
    }

    /// A renewal moves on only the leases whose rows it renewed: one whose row had run out is
    /// lost, however recent the renewal of the owner's other rows. And a lease forgotten by a
    /// release is judged by its own deadline, which no later renewal moves: the release of a
    /// guard whose row ran out, answered only "no rows" (a lost answer), says it was lost.
    #[test]
    fn a_renewal_moves_on_only_the_leases_whose_rows_it_renewed() {
        let clock = TestClock::new();
        let at = |secs: u64| clock.monotonic() + Duration::from_secs(secs);
        let mut guards = Guards::default();
        let lapsed = guards.granted(1, keys("a"), Arc::new(clock.clone()), at(10), i64::MAX);
        let renewed = guards.granted(2, keys("b"), Arc::new(clock.clone()), at(10), i64::MAX);
        let released = guards.granted(3, keys("c"), Arc::new(clock.clone()), at(10), i64::MAX);
        clock.advance(Duration::from_secs(5));
        let entry = guards.forget(3).expect("kept until released");
        let lost = guards.renewed(|ticket| usize::from(ticket != 1), at(10), i64::MAX);
        assert_eq!(lost, 1);
        assert!(lapsed.is_aborted(), "a lease whose row was not renewed");
        assert!(!renewed.is_aborted() && !released.is_aborted());
        clock.advance(Duration::from_secs(6));
        assert!(!renewed.is_aborted(), "renewed until 15 s");
        assert!(entry.is_lost(), "the released guard's own lease ran out");
        assert!(released.is_aborted());
        clock.advance(Duration::from_secs(4));
        assert!(renewed.is_aborted(), "past its renewed deadline");
    }

    /// A renewal that comes back after a lease's deadline does not revive it: once a look could
    /// have found it lost, it is lost.
    #[test]
    fn a_renewal_that_comes_back_too_late_leaves_the_lease_lost() {
        let clock = TestClock::new();
        let mut guards = Guards::default();
        let deadline = clock.monotonic() + Duration::from_secs(10);
        let lost = guards.granted(1, keys("a"), Arc::new(clock.clone()), deadline, i64::MAX);
        clock.advance(Duration::from_secs(10));
        let later = deadline + Duration::from_secs(10);
        assert_eq!(guards.renewed(|_| 1, later, i64::MAX), 1);
        assert!(lost.is_aborted());
        assert!(guards.is_empty());
    }
}
