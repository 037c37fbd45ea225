//! Storage faults (`FaultPlan`), and the connection of a simulated manager (`SimStorage`): the
//! memory backend's, with the faults applied where the real backends fail, and every committed
//! change recorded in the store's history.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::lock::backend::memory::Memory;
use crate::lock::backend::{
    Capabilities, Changes, DecidesAtOnce, Deleted, OwnedRequest, Result, Row, Storage,
};
use crate::lock::grant::RowView;
use crate::lock::{LockRequest, Mode, StorageError};
use crate::schedule::{Schedule, ScheduleRun};

use super::history::LockEvent;
use super::{Attached, StoreClock};

/// One storage fault, as [`FaultPlan::with`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The transaction is refused at its start: another process writes (SQLite's
    /// `SQLITE_BUSY`, a lock wait that timed out). Retried on the busy schedule.
    Busy,
    /// The commit fails and nothing of the transaction takes effect.
    CommitFails,
    /// The commit takes effect, but its answer is lost (a connection cut as the server
    /// answered): the worker cannot tell whether it committed.
    AnswerLost,
    /// The connection is lost before the transaction: it fails, and what other managers
    /// announced meanwhile is not known (as after a reconnection).
    ConnectionLost,
    /// The transaction's start takes this long (virtual time passes while it runs).
    Latency(Duration),
    /// The store's wall clock steps forward by this much: every lease with it on a store that
    /// judges leases by it ([`SimStore::like_postgres`](super::SimStore::like_postgres)); on
    /// one that judges them as SQLite does ([`SimStore::new`](super::SimStore::new)), only
    /// the times shown.
    ClockForward(Duration),
    /// The store's wall clock steps back by this much (see `ClockForward`).
    ClockBack(Duration),
}

/// Which storage faults a simulated manager meets ([`open_simulated`]): drawn from the
/// simulation's seed at a rate, listed by transaction, or both. The default is none.
///
/// Faults are applied where the real backends fail: a transaction refused as busy or over a
/// lost connection at its start, a commit that fails or whose answer is lost at its end,
/// latency on every round trip, and the wall clock stepped between transactions. So the worker's
/// retries, its recovery from a lost answer and its fresh look after a reconnection run as
/// they do in production.
///
/// [`open_simulated`]: crate::LockManagerBuilder::open_simulated
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use leasehold::testkit::{Fault, FaultPlan};
///
/// // About one transaction in ten faulted, up to 2 ms on every call, steps of up to a second.
/// let drawn = FaultPlan::drawn(0.1)
///     .latency(Duration::from_millis(2))
///     .clock_steps(Duration::from_secs(1));
/// // Or exactly these: the second transaction's answer lost, the third refused as busy.
/// let listed = FaultPlan::none().with(1, Fault::AnswerLost).with(2, Fault::Busy);
/// # let _ = (drawn, listed);
/// ```
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    rate: f64,
    latency: Duration,
    clock_steps: Duration,
    estimate_ahead: Duration,
    listed: BTreeMap<u64, Vec<Fault>>,
    planted: Option<Planted>,
}

/// Bugs planted in the storage double (`SimStorage`), for the crate's own tests that show the
/// simulation's checks find them. The lock manager itself is never broken: what these break is
/// the store it is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum Planted {
    /// The store hides held exclusive rows from the reads that decide grants.
    HidesHeldExclusive,
    /// The store hides one held permits row of a key from the reads that decide grants.
    HidesHeldPermits,
    /// The store renews rows as if it were a lease ago: rows lapsed since are renewed too.
    RenewsWithStaleTime,
}

impl FaultPlan {
    /// No faults.
    pub fn none() -> FaultPlan {
        FaultPlan::default()
    }

    /// Every kind of transaction fault (busy, a failed commit, a lost answer, a lost
    /// connection), each transaction meeting one with probability `rate` (in `[0, 1]`; out of
    /// range, it is clamped), drawn from the simulation's seed.
    pub fn drawn(rate: f64) -> FaultPlan {
        let rate = if rate.is_nan() {
            0.0
        } else {
            rate.clamp(0.0, 1.0)
        };
        FaultPlan {
            rate,
            ..FaultPlan::default()
        }
    }

    /// Every round trip (a transaction's start and its commit, a look for changes, a read outside
    /// a transaction) takes up to `up_to` of virtual time, drawn uniformly from the seed.
    pub fn latency(mut self, up_to: Duration) -> FaultPlan {
        self.latency = up_to;
        self
    }

    /// With the plan's rate, the store's wall clock steps forward or back by up to `up_to`
    /// before a transaction. The clock is the store's, as a machine's is: every manager on the
    /// store sees the step.
    pub fn clock_steps(mut self, up_to: Duration) -> FaultPlan {
        self.clock_steps = up_to;
        self
    }

    /// The manager's estimate of the store's time, between transactions, runs ahead of the
    /// store's by up to `up_to`, drawn afresh for each reading, as PostgreSQL's does (the
    /// server's clock judges leases, and a process estimates it from its own, ahead by up to a
    /// round trip). A transaction reads the store's own time, as a real one does once it
    /// holds its locks.
    pub fn estimate_ahead(mut self, up_to: Duration) -> FaultPlan {
        self.estimate_ahead = up_to;
        self
    }

    /// `fault` at this manager's transaction number `transaction` (from 0), besides any drawn.
    pub fn with(mut self, transaction: u64, fault: Fault) -> FaultPlan {
        self.listed.entry(transaction).or_default().push(fault);
        self
    }

    /// The same plan, on a store double with `bug` planted.
    #[cfg(test)]
    pub(crate) fn planting(mut self, bug: Planted) -> FaultPlan {
        self.planted = Some(bug);
        self
    }
}

/// A uniform draw in `[0, 1)` from the simulation's randomness; none outside one.
fn draw() -> Option<f64> {
    crate::runtime::draw()
}

/// The connection of a simulated manager: the memory backend's, with faults.
pub(crate) struct SimStorage {
    inner: Memory,
    plan: FaultPlan,
    attached: Arc<Attached>,
    clock: Arc<StoreClock>,
    busy: Schedule,
    /// The busy schedule's run, while injected failures are retried.
    retrying: Option<ScheduleRun>,
    /// Whether the last failure was injected (a passing one, retried).
    failed: bool,
    /// The faults due at this transaction's commit.
    at_commit: Option<Fault>,
    /// Whether the next look must report that anything may have changed (a reconnection).
    reconnected: bool,
    transactions: u64,
    /// The open transaction's changes, recorded when it commits, and its time.
    pending: Vec<LockEvent>,
    began_at: i64,
}

impl SimStorage {
    pub(crate) fn new(
        inner: Memory,
        plan: FaultPlan,
        attached: Arc<Attached>,
        clock: Arc<StoreClock>,
        busy: Schedule,
    ) -> SimStorage {
        SimStorage {
            inner,
            plan,
            attached,
            clock,
            busy,
            retrying: None,
            failed: false,
            at_commit: None,
            reconnected: false,
            transactions: 0,
            pending: Vec::new(),
            began_at: 0,
        }
    }

    fn owner(&self) -> String {
        self.attached.owner.clone()
    }

    /// Virtual time passes as a call runs, if the plan says so.
    fn call(&mut self) {
        if self.plan.latency.is_zero() {
            return;
        }
        if let Some(u) = draw() {
            self.clock.advance(self.plan.latency.mul_f64(u));
        }
    }

    fn note(&self, fault: Fault) {
        self.attached.record(LockEvent::Fault {
            owner: self.owner(),
            fault: format!("{fault:?}"),
        });
    }

    /// The faults of this transaction: listed for its number, and drawn.
    fn faults_now(&mut self) -> Vec<Fault> {
        let mut faults = self
            .plan
            .listed
            .remove(&self.transactions)
            .unwrap_or_default();
        self.transactions += 1;
        if self.plan.rate > 0.0 {
            if let Some(u) = draw() {
                if u < self.plan.rate {
                    let kinds = if self.plan.clock_steps.is_zero() {
                        4
                    } else {
                        5
                    };
                    let pick = draw().unwrap_or(0.0);
                    let fault = match (pick * kinds as f64) as usize {
                        0 => Fault::Busy,
                        1 => Fault::CommitFails,
                        2 => Fault::AnswerLost,
                        3 => Fault::ConnectionLost,
                        _ => {
                            let by = self.plan.clock_steps.mul_f64(draw().unwrap_or(0.0));
                            if draw().unwrap_or(0.0) < 0.5 {
                                Fault::ClockForward(by)
                            } else {
                                Fault::ClockBack(by)
                            }
                        }
                    };
                    faults.push(fault);
                }
            }
        }
        faults
    }

    fn injected(&mut self, doing: &str, why: &str) -> crate::lock::LockError {
        self.failed = true;
        StorageError::new(doing, format!("injected by the fault plan: {why}"))
            .transient(true)
            .into()
    }

    fn flush(&mut self) {
        for event in self.pending.drain(..) {
            self.attached.record(event);
        }
    }

    fn planted(&self, bug: Planted) -> bool {
        self.plan.planted == Some(bug)
    }
}

impl Storage for SimStorage {
    fn now(&self) -> i64 {
        let now = self.inner.now();
        if self.plan.estimate_ahead.is_zero() {
            return now;
        }
        let ahead = self.plan.estimate_ahead.mul_f64(draw().unwrap_or(0.0));
        now + i64::try_from(ahead.as_micros()).unwrap_or(i64::MAX / 2)
    }

    fn ahead_of(&self, clock: &dyn Clock) -> i64 {
        self.inner.ahead_of(clock)
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn changes(&mut self) -> Result<Changes> {
        self.call();
        if std::mem::take(&mut self.reconnected) {
            // Whatever the log says: what was announced while the connection was down is lost.
            let _ = self.inner.changes();
            return Ok(Changes::Unknown);
        }
        self.inner.changes()
    }

    fn begin(&mut self, keys: &[String]) -> Result<i64> {
        self.call();
        self.pending.clear();
        self.at_commit = None;
        for fault in self.faults_now() {
            self.note(fault);
            match fault {
                Fault::Busy => return Err(self.injected("starting a transaction", "busy")),
                Fault::ConnectionLost => {
                    self.reconnected = true;
                    return Err(self.injected("starting a transaction", "connection lost"));
                }
                Fault::CommitFails | Fault::AnswerLost => self.at_commit = Some(fault),
                Fault::Latency(by) => self.clock.advance(by),
                Fault::ClockForward(by) => self.clock.step(micros_of(by)),
                Fault::ClockBack(by) => self.clock.step(-micros_of(by)),
            }
        }
        let now = self.inner.begin(keys)?;
        self.began_at = now;
        Ok(now)
    }

    fn commit(&mut self) -> Result<()> {
        self.call();
        match self.at_commit.take() {
            Some(Fault::CommitFails) => {
                self.inner.rollback();
                self.pending.clear();
                Err(self.injected("committing", "the commit failed"))
            }
            Some(_) => {
                self.inner.commit()?;
                self.flush();
                Err(self.injected("committing", "the commit's answer was lost"))
            }
            None => {
                self.inner.commit()?;
                self.flush();
                self.retrying = None;
                self.failed = false;
                Ok(())
            }
        }
    }

    fn announce(
        &mut self,
        freed: &[String],
        promoted: &[String],
        owners: &BTreeSet<String>,
    ) -> Result<()> {
        self.inner.announce(freed, promoted, owners)
    }

    fn rollback(&mut self) {
        self.pending.clear();
        self.inner.rollback();
    }

    /// An injected failure passes: wait the busy schedule's next delay (virtual time), and
    /// try again, until the schedule gives up.
    fn again(&mut self) -> bool {
        if !std::mem::take(&mut self.failed) {
            return false;
        }
        let now = self.clock.monotonic();
        let busy = &self.busy;
        let run = self.retrying.get_or_insert_with(|| busy.start(now));
        match run.next(now) {
            Some(delay) => {
                self.clock.advance(delay);
                true
            }
            None => {
                self.retrying = None;
                false
            }
        }
    }

    fn wake_others(&mut self, freed: Option<&BTreeSet<String>>) {
        self.inner.wake_others(freed);
    }

    fn waiting(&mut self, waiting: bool) {
        self.inner.waiting(waiting);
    }

    fn watching(&mut self, owner: &str, keys: &[String], now: i64, lease: i64) -> Result<()> {
        self.inner.watching(owner, keys, now, lease)
    }

    fn rows_on_keys(&mut self, keys: &[String], now: i64, into: &mut Vec<RowView>) -> Result<()> {
        let before = into.len();
        self.inner.rows_on_keys(keys, now, into)?;
        if self.planted(Planted::HidesHeldExclusive) {
            let mut n = 0;
            into.retain(|row| {
                n += 1;
                n <= before || !(row.held && row.mode == Mode::Exclusive)
            });
        }
        if self.planted(Planted::HidesHeldPermits) {
            let (mut n, mut hidden) = (0, false);
            into.retain(|row| {
                n += 1;
                let hide =
                    n > before && !hidden && row.held && matches!(row.mode, Mode::Permits { .. });
                hidden |= hide;
                !hide
            });
        }
        Ok(())
    }

    fn next_ticket(&mut self) -> Result<u64> {
        self.inner.next_ticket()
    }

    fn insert_request(
        &mut self,
        owner: &str,
        ticket: u64,
        requests: &[LockRequest],
        held: bool,
        now: i64,
        expires_at: i64,
    ) -> Result<()> {
        self.inner
            .insert_request(owner, ticket, requests, held, now, expires_at)?;
        self.pending.push(LockEvent::Requested {
            owner: owner.to_owned(),
            ticket,
            keys: requests.iter().map(|r| (r.key.clone(), r.mode)).collect(),
            held,
            at: now,
            expires_at,
        });
        Ok(())
    }

    fn promote(&mut self, keys: &[String], ticket: u64, now: i64) -> Result<()> {
        self.inner.promote(keys, ticket, now)?;
        self.pending.push(LockEvent::Promoted {
            ticket,
            keys: keys.to_vec(),
            at: now,
        });
        Ok(())
    }

    fn delete_request(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        now: i64,
    ) -> Result<Deleted> {
        let deleted = self.inner.delete_request(owner, keys, ticket, now)?;
        self.pending.push(LockEvent::Removed {
            owner: owner.to_owned(),
            ticket,
            keys: keys.to_vec(),
            at: now,
        });
        Ok(deleted)
    }

    fn ring(&mut self, keys: &[String]) {
        self.inner.ring(keys);
    }

    fn relabel(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        operation: &str,
        now: i64,
    ) -> Result<usize> {
        self.inner.relabel(owner, keys, ticket, operation, now)
    }

    fn delete_owner(&mut self, owner: &str) -> Result<usize> {
        let deleted = self.inner.delete_owner(owner)?;
        self.pending.push(LockEvent::RemovedAll {
            owner: owner.to_owned(),
            at: self.began_at,
        });
        Ok(deleted)
    }

    fn delete_expired(&mut self, keys: &[String], now: i64) -> Result<usize> {
        let deleted = self.inner.delete_expired(keys, now)?;
        self.pending.push(LockEvent::Swept {
            keys: Some(keys.to_vec()),
            at: now,
        });
        Ok(deleted)
    }

    fn sweep(&mut self, now: i64) -> Result<()> {
        self.inner.sweep(now)?;
        self.pending.push(LockEvent::Swept {
            keys: None,
            at: now,
        });
        Ok(())
    }

    fn record_removal(&mut self, owner: &str, ticket: u64, by: &str, now: i64) -> Result<()> {
        self.inner.record_removal(owner, ticket, by, now)
    }

    fn removals(&mut self, owner: &str, tickets: &[u64]) -> Result<Vec<(u64, String)>> {
        self.call();
        self.inner.removals(owner, tickets)
    }

    fn forget_removals(&mut self, owner: &str, tickets: &[u64]) -> Result<()> {
        self.call();
        self.inner.forget_removals(owner, tickets)
    }

    fn renew(&mut self, owner: &str, now: i64, expires_at: i64) -> Result<Vec<OwnedRequest>> {
        // A planted bug judges which rows are live as if it were a lease ago.
        let judged_at = if self.planted(Planted::RenewsWithStaleTime) {
            now.saturating_sub(expires_at.saturating_sub(now))
        } else {
            now
        };
        let renewed = self.inner.renew(owner, judged_at, expires_at)?;
        self.pending.push(LockEvent::Renewed {
            owner: owner.to_owned(),
            tickets: renewed.iter().map(|r| r.ticket).collect(),
            at: now,
            expires_at,
        });
        Ok(renewed)
    }

    fn at_once(&mut self) -> Option<&mut dyn DecidesAtOnce> {
        None
    }

    fn requests_of(&mut self, owner: &str) -> Result<Vec<(u64, Vec<String>)>> {
        self.call();
        self.inner.requests_of(owner)
    }

    fn live_rows(&mut self, key: Option<&str>, now: i64) -> Result<Vec<Row>> {
        self.call();
        self.inner.live_rows(key, now)
    }

    fn is_held(&mut self, key: &str, now: i64) -> Result<bool> {
        self.call();
        self.inner.is_held(key, now)
    }
}

fn micros_of(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}
