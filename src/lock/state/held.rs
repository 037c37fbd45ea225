//! The leases an owner holds (`Guards`): one owner for the lease of every granted request, and
//! the one place where a lost lease is told.

use std::collections::BTreeMap;
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
///
/// The worker keeps a lease's deadline as it grants and renews it; the caller who takes the
/// grant makes the guard's `lost()` signal from it ([`Guards::signal`]), so that nothing the
/// caller holds is made on the storage thread.
pub(crate) struct Guards {
    /// The manager's clock, on whose monotonic time line the deadlines are kept.
    clock: Arc<dyn Clock>,
    /// In ticket order, so that losses are told in the same order every run.
    entries: BTreeMap<u64, GuardEntry>,
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
    /// The same on the clock's monotonic time line, never moved back.
    deadline: Duration,
    /// The guard's `lost()`, once its caller took the grant: it aborts by itself at the
    /// lease's deadline, which each renewal of all the request's rows moves on.
    lost: Option<AbortController>,
    /// The guard's `lost_within(margin)` signals: each aborts by itself `margin` before the
    /// deadline, moved on with it, and with `lost` when the lease is lost.
    warnings: Vec<(Duration, AbortController)>,
}

impl GuardEntry {
    /// Whether its lease has been lost by `now` (the clock's monotonic time): its deadline
    /// came, or its guard was told.
    pub(crate) fn is_lost(&self, now: Duration) -> bool {
        match &self.lost {
            Some(lost) => lost.signal().is_aborted(),
            None => now >= self.deadline,
        }
    }

    /// When its rows' lease runs out by the storage's time, as last granted or renewed.
    pub(crate) fn expires_at(&self) -> i64 {
        self.expires_at
    }

    /// Tells the guard its lease was lost, `why` saying how.
    pub(crate) fn lose(&self, why: LeaseLost) {
        let controllers = self.lost.iter().chain(self.warnings.iter().map(|(_, w)| w));
        for controller in controllers {
            controller.abort(AbortReason::new(why));
        }
    }

    /// Moves its deadline on to `deadline`, unless it came by `now`: then it stays lost.
    fn extend(&mut self, deadline: Duration, now: Duration) -> bool {
        let live = match &self.lost {
            Some(lost) => lost.extend_deadline(deadline),
            None => now < self.deadline,
        };
        if live {
            self.deadline = self.deadline.max(deadline);
            for (margin, warning) in &self.warnings {
                warning.extend_deadline(self.deadline.saturating_sub(*margin));
            }
        }
        live
    }
}

impl Guards {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Guards {
            clock,
            entries: BTreeMap::new(),
            daemon_running: false,
            shut_down: false,
        }
    }

    /// Whether no lease is kept that may still be live: those lost by their deadline are
    /// forgotten first, so that a heartbeat with nothing left to renew stops.
    pub(crate) fn is_empty(&mut self) -> bool {
        let now = self.clock.monotonic();
        self.entries.retain(|_, entry| !entry.is_lost(now));
        self.entries.is_empty()
    }

    /// Keeps the lease of `ticket`, just granted on `keys`, until `deadline` (the clock's
    /// monotonic time) unless renewed. A grant made after the manager shut down is not kept:
    /// its caller finds it lost.
    pub(crate) fn granted(
        &mut self,
        ticket: u64,
        keys: Vec<String>,
        deadline: Duration,
        expires_at: i64,
    ) {
        if self.shut_down {
            return;
        }
        let rows = keys.len();
        let entry = GuardEntry {
            rows,
            keys,
            expires_at,
            deadline,
            lost: None,
            warnings: Vec::new(),
        };
        self.entries.insert(ticket, entry);
    }

    /// The signal that tells of the loss of `ticket`'s lease, made by the caller who takes its
    /// grant: aborted already if the lease was lost before (its deadline came, a renewal found
    /// its rows gone, or the manager shut down).
    pub(crate) fn signal(&mut self, ticket: u64) -> AbortSignal {
        let expired = || AbortReason::new(LeaseLost::expired());
        if let Some(entry) = self.entries.get_mut(&ticket) {
            let (clock, deadline) = (&self.clock, entry.deadline);
            let lost = (entry.lost).get_or_insert_with(|| {
                AbortController::with_deadline(clock.clone(), deadline, expired())
            });
            return lost.signal();
        }
        let lost = AbortController::new();
        lost.abort(match self.shut_down {
            true => AbortReason::new(LeaseLost::shutdown()),
            false => expired(),
        });
        lost.signal()
    }

    /// A signal that aborts once `ticket`'s lease has `margin` or less left (its deadline,
    /// `margin` before, moved on by every renewal), or is lost; `None` if the lease is no
    /// longer kept (lost, or released).
    pub(crate) fn signal_within(&mut self, ticket: u64, margin: Duration) -> Option<AbortSignal> {
        let entry = self.entries.get_mut(&ticket)?;
        let at = entry.deadline.saturating_sub(margin);
        let reason = AbortReason::new(LeaseLost::running_out());
        let warning = AbortController::with_deadline(self.clock.clone(), at, reason);
        let signal = warning.signal();
        entry.warnings.push((margin, warning));
        Some(signal)
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
        let now = self.clock.monotonic();
        let lost = self.lose(
            |ticket, entry| renewed(ticket) < entry.rows || !entry.extend(deadline, now),
            "the lock's rows are gone or expired",
        );
        for entry in self.entries.values_mut() {
            entry.expires_at = expires_at;
        }
        lost
    }

    /// Tells every lease for which `is_lost` holds that it is lost, and forgets it; `why` goes
    /// to the log. Returns how many were lost.
    fn lose(&mut self, mut is_lost: impl FnMut(u64, &mut GuardEntry) -> bool, why: &str) -> usize {
        let lost: Vec<u64> = self
            .entries
            .iter_mut()
            .filter_map(|(&ticket, entry)| is_lost(ticket, entry).then_some(ticket))
            .collect();
        for &ticket in &lost {
            if let Some(entry) = self.forget(ticket) {
                tracing::warn!(ticket, keys = ?entry.keys, "lease lost: {why}");
                entry.lose(LeaseLost::expired());
            }
        }
        lost.len()
    }

    /// The manager has shut down: every lease is lost, and any granted later is born lost.
    pub(crate) fn shut_down(&mut self) {
        self.shut_down = true;
        for (_, entry) in std::mem::take(&mut self.entries) {
            entry.lose(LeaseLost::shutdown());
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
        let mut guards = Guards::new(Arc::new(clock.clone()));
        let mut grant = |ticket: u64, key: &str| {
            guards.granted(ticket, keys(key), at(10), i64::MAX);
            guards.signal(ticket)
        };
        let lapsed = grant(1, "a");
        let renewed = grant(2, "b");
        let released = grant(3, "c");
        clock.advance(Duration::from_secs(5));
        let entry = guards.forget(3).expect("kept until released");
        let lost = guards.renewed(|ticket| usize::from(ticket != 1), at(10), i64::MAX);
        assert_eq!(lost, 1);
        assert!(lapsed.is_aborted(), "a lease whose row was not renewed");
        assert!(!renewed.is_aborted() && !released.is_aborted());
        clock.advance(Duration::from_secs(6));
        assert!(!renewed.is_aborted(), "renewed until 15 s");
        assert!(
            entry.is_lost(clock.monotonic()),
            "the released guard's own lease ran out"
        );
        assert!(released.is_aborted());
        clock.advance(Duration::from_secs(4));
        assert!(renewed.is_aborted(), "past its renewed deadline");
    }

    /// A renewal that comes back after a lease's deadline does not revive it: once a look could
    /// have found it lost, it is lost.
    #[test]
    fn a_renewal_that_comes_back_too_late_leaves_the_lease_lost() {
        let clock = TestClock::new();
        let mut guards = Guards::new(Arc::new(clock.clone()));
        let deadline = clock.monotonic() + Duration::from_secs(10);
        guards.granted(1, keys("a"), deadline, i64::MAX);
        let lost = guards.signal(1);
        clock.advance(Duration::from_secs(10));
        let later = deadline + Duration::from_secs(10);
        assert_eq!(guards.renewed(|_| 1, later, i64::MAX), 1);
        assert!(lost.is_aborted());
        assert!(guards.is_empty());
    }

    /// A warning comes `margin` before the deadline, moves on with every renewal of the lease,
    /// and comes at once with a loss (a renewal that did not renew it).
    #[test]
    fn a_warning_comes_a_margin_before_the_deadline_and_with_a_loss() {
        let clock = TestClock::new();
        let at = |secs: u64| clock.monotonic() + Duration::from_secs(secs);
        let mut guards = Guards::new(Arc::new(clock.clone()));
        guards.granted(1, keys("a"), at(10), i64::MAX);
        let lost = guards.signal(1);
        let warned = guards.signal_within(1, Duration::from_secs(3)).unwrap();
        clock.advance(Duration::from_secs(6));
        assert!(!warned.is_aborted());
        assert_eq!(
            guards.renewed(|_| 1, at(10), i64::MAX),
            0,
            "renewed until 16 s"
        );
        clock.advance(Duration::from_secs(6));
        assert!(!warned.is_aborted(), "the warning moved on to 13 s");
        clock.advance(Duration::from_secs(1));
        let reason = warned.reason().unwrap();
        assert!(reason.downcast_ref::<LeaseLost>().unwrap().before_expiry());
        assert!(!lost.is_aborted(), "3 s of lease are left");

        let later = guards.signal_within(1, Duration::from_secs(1)).unwrap();
        assert!(!later.is_aborted());
        assert_eq!(
            guards.renewed(|_| 0, at(10), i64::MAX),
            1,
            "its rows are gone"
        );
        let reason = later.reason().unwrap();
        assert_eq!(
            reason.downcast_ref::<LeaseLost>(),
            Some(&LeaseLost::expired())
        );
        assert!(
            guards.signal_within(1, Duration::from_secs(1)).is_none(),
            "no lease kept"
        );
    }

    /// The worker keeps a lease from its grant; the caller makes its signal when it takes the
    /// grant, however late: renewed meanwhile, it runs to the renewed deadline; lost meanwhile
    /// (by its deadline, a renewal that did not renew it, or a shutdown), it is born lost, and
    /// says why.
    #[test]
    fn a_grant_taken_late_has_its_lease_as_the_worker_kept_it() {
        let clock = TestClock::new();
        let at = |secs: u64| clock.monotonic() + Duration::from_secs(secs);
        let reason = |signal: &AbortSignal| {
            signal
                .reason()
                .and_then(|r| r.downcast_ref::<LeaseLost>().copied())
        };
        let mut guards = Guards::new(Arc::new(clock.clone()));
        guards.granted(1, keys("renewed"), at(10), i64::MAX);
        guards.granted(2, keys("not renewed"), at(10), i64::MAX);
        guards.granted(3, keys("ran out"), at(1), i64::MAX);
        clock.advance(Duration::from_secs(2));
        assert_eq!(
            guards.renewed(|ticket| usize::from(ticket == 1), at(18), 7),
            2
        );
        let renewed = guards.signal(1);
        clock.advance(Duration::from_secs(15));
        assert!(
            !renewed.is_aborted(),
            "renewed before it was taken, until 20 s"
        );
        assert_eq!(reason(&guards.signal(2)), Some(LeaseLost::expired()));
        assert_eq!(reason(&guards.signal(3)), Some(LeaseLost::expired()));
        clock.advance(Duration::from_secs(3));
        assert!(renewed.is_aborted(), "past its renewed deadline");

        let mut guards = Guards::new(Arc::new(clock.clone()));
        guards.granted(1, keys("a"), at(10), i64::MAX);
        guards.shut_down();
        guards.granted(2, keys("b"), at(10), i64::MAX);
        for ticket in [1, 2] {
            assert_eq!(reason(&guards.signal(ticket)), Some(LeaseLost::shutdown()));
        }
    }
}
