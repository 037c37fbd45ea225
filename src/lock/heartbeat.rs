//! Lease renewal.
//!
//! Waiter heartbeats are fibers forked into the waiting acquisition's scope, so they end with the
//! wait. Most waits end long before their first renewal is due (a heartbeat after the request was
//! sent), and a fiber costs a spawn, a timer and a join on another thread, so the waiting caller
//! forks it only when the storage worker tells it that the wait has lasted a quarter of a heartbeat
//! (`WaitSlot::beat_due`). The lock heartbeat is one daemon per owner that runs while the owner
//! holds any guard. Both ask the storage worker to renew, and the worker renews every live row of
//! the owner in one statement, at most once per half heartbeat however many ask (the number of
//! write transactions does not grow with the number of locks or waiters), and answers with when it
//! last renewed, so that every caller beats again one heartbeat after that.
//!
//! Every heartbeat beats on `Schedule::spaced(heartbeat)`, stepped on the clock's monotonic time
//! (see `Beats`): a beat is a run of the schedule, and the run ends when the renewal it asked
//! for was made, whoever asked for it.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{Common, Shared};

use crate::fiber::fork_daemon_on;
use crate::schedule::{Schedule, ScheduleRun};
use crate::scope::current_spawner;
use crate::sync::lock;

/// The beats of one heartbeat: `Schedule::spaced(heartbeat)` on the clock's monotonic time.
struct Beats<'a> {
    common: &'a Common,
    run: ScheduleRun,
}

impl<'a> Beats<'a> {
    /// Beats counted from `since` (monotonic): the first comes one heartbeat after it.
    fn since(common: &'a Common, since: Duration) -> (Self, Duration) {
        let mut beats = Beats {
            common,
            run: Schedule::spaced(common.heartbeat).start(since),
        };
        let first = beats.after(since);
        (beats, first)
    }

    /// How long to wait for the next beat, now that the renewal it asked for was made at
    /// `renewed_at` (the clock's monotonic time, as the worker reports it): one heartbeat after
    /// that, even when that renewal was made for another caller (the worker coalesces renewals).
    fn after_renewal(&mut self, renewed_at: Duration) -> Duration {
        self.after(renewed_at)
    }

    /// How long to wait for the next beat after a renewal that failed now: a whole heartbeat.
    fn after_failure(&mut self) -> Duration {
        self.after(self.common.clock.monotonic())
    }

    /// How long from now until the next beat, the last having ended at `ended_at`.
    fn after(&mut self, ended_at: Duration) -> Duration {
        // `spaced` goes on for ever: there is always a next beat.
        let next = self.run.next_at(ended_at).unwrap_or(ended_at);
        next.saturating_sub(self.common.clock.monotonic())
    }
}

/// Renews while a request waits; forked into the acquisition's scope. The first beat comes one
/// heartbeat after `since` (the clock's monotonic time when the request was sent, so no later
/// than its row's lease began), however late the fiber itself starts.
pub(super) async fn waiter(shared: Arc<Shared>, since: Duration) {
    let common = &shared.common;
    let (mut beats, mut pause) = Beats::since(common, since);
    loop {
        common.clock.sleep(pause).await;
        pause = match shared.renew().await {
            Ok(renewed_at) => beats.after_renewal(renewed_at),
            Err(error) => {
                tracing::warn!(%error, "renewing a waiting request's lease failed; retrying at the next heartbeat");
                beats.after_failure()
            }
        };
    }
}

/// Starts the owner's lock heartbeat unless it runs already, for a guard whose lease began at
/// `began` (the clock's monotonic time). A daemon that runs renews every row of the owner, the
/// new guard's too; a new one beats first one heartbeat after that lease began, which is at once
/// for a grant handed out late.
pub(super) fn ensure_daemon(shared: &Arc<Shared>, began: Duration) {
    {
        let mut guards = lock(&shared.common.guards);
        if guards.daemon_running {
            return;
        }
        guards.daemon_running = true;
    }
    let common = shared.common.clone();
    let spawner = common.spawner.clone().unwrap_or_else(current_spawner);
    // Made before the spawn and moved into the daemon, so that an executor that drops the
    // daemon unpolled (a runtime that has shut down) marks it stopped too.
    let running = Running {
        common: common.clone(),
        armed: true,
    };
    drop(fork_daemon_on(
        daemon(Arc::downgrade(shared), running, began),
        &spawner,
        "lock heartbeat",
    ));
}

/// Marks the daemon stopped if its executor drops it (a runtime shut down with the daemon on
/// it, before or after its first poll), so that the next guard starts another.
struct Running {
    common: Arc<Common>,
    armed: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.common.guards).daemon_running = false;
        }
    }
}

/// Renews every heartbeat while the owner holds a guard; stops when it holds none. The first
/// beat comes one heartbeat after `began` (monotonic), when the first guard's lease began.
///
/// It tells no guard of a lost lease by itself: each guard's `lost()` aborts at its lease's
/// deadline, which only a renewal that came back moves on, however late this runs or whether
/// it runs at all; and the worker tells those whose rows a renewal found gone.
async fn daemon(shared: Weak<Shared>, mut running: Running, began: Duration) {
    let common = running.common.clone();
    let (mut beats, mut pause) = Beats::since(&common, began);
    loop {
        common.clock.sleep(pause).await;
        let shared = {
            let mut guards = lock(&common.guards);
            match shared.upgrade() {
                Some(shared) if !guards.is_empty() => shared,
                _ => {
                    // Under the lock that a new guard takes to see whether a daemon runs.
                    guards.daemon_running = false;
                    running.armed = false;
                    return;
                }
            }
        };
        pause = match shared.renew().await {
            Ok(renewed_at) => beats.after_renewal(renewed_at),
            Err(error) => {
                tracing::warn!(%error, "renewing lock leases failed; retrying at the next heartbeat");
                beats.after_failure()
            }
        };
    }
}
