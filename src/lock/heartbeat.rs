//! Lease renewal.
//!
//! Waiter heartbeats are fibers forked into the waiting acquisition's scope, so they live exactly
//! as long as the wait. The lock heartbeat is one daemon per owner that runs while the owner
//! holds any guard. Both ask the storage worker to renew, and the worker renews every live row of
//! the owner in one statement, at most once per half heartbeat however many ask (the number of
//! write transactions does not grow with the number of locks or waiters), and answers with when
//! it last renewed, so that every caller beats again one heartbeat after that.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::storage::micros;
use super::{Common, Shared};

use crate::clock::{Clock, SystemClock};
use crate::fiber::fork_daemon_on;
use crate::scope::current_spawner;
use crate::sync::lock;

/// Renews while a request waits; forked into the acquisition's scope. The first beat comes one
/// heartbeat after `since` (when the request was sent, so no later than its row's lease began),
/// however late the fiber itself starts.
pub(super) async fn waiter(shared: Arc<Shared>, since: Duration) {
    let common = &shared.common;
    let mut pause = (since + common.heartbeat).saturating_sub(common.clock.now());
    loop {
        common.clock.sleep(pause).await;
        pause = match shared.renew().await {
            Ok(renewed_at) => until_next_beat(common, renewed_at),
            Err(error) => {
                tracing::warn!(%error, "renewing a waiting request's lease failed; retrying at the next heartbeat");
                common.heartbeat
            }
        };
    }
}

/// How long to sleep so that the next renewal comes one heartbeat after the last one, even when
/// the last one was made for another caller (the worker coalesces renewals).
fn until_next_beat(common: &Common, renewed_at: Duration) -> Duration {
    (renewed_at + common.heartbeat)
        .saturating_sub(common.clock.now())
        .clamp(common.heartbeat / 4, common.heartbeat)
}

/// Starts the owner's lock heartbeat unless it runs already.
pub(super) fn ensure_daemon(shared: &Arc<Shared>) {
    {
        let mut guards = lock(&shared.common.guards);
        if guards.daemon_running {
            return;
        }
        guards.daemon_running = true;
    }
    let common = shared.common.clone();
    let spawner = common.spawner.clone().unwrap_or_else(current_spawner);
    drop(fork_daemon_on(
        daemon(Arc::downgrade(shared), common),
        &spawner,
    ));
}

/// Marks the daemon stopped if its executor drops it (a runtime shut down with the daemon on
/// it), so that the next guard starts another.
struct Running<'a> {
    common: &'a Common,
    armed: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.common.guards).daemon_running = false;
        }
    }
}

/// Renews every heartbeat while the owner holds a guard; stops when it holds none.
async fn daemon(shared: Weak<Shared>, common: Arc<Common>) {
    let mut running = Running {
        common: &common,
        armed: true,
    };
    let mut pause = common.heartbeat;
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
        let mut renewal = std::pin::pin!(shared.renew());
        pause = loop {
            // A renewal stuck behind a busy database must not keep a guard from hearing that its
            // lease ran out: look every heartbeat while it is pending. (How long a renewal takes
            // is real time, whatever clock judges the leases.)
            let beat = SystemClock.sleep(common.heartbeat);
            match futures::future::select(renewal.as_mut(), beat).await {
                futures::future::Either::Left((Ok(renewed_at), _)) => {
                    break until_next_beat(&common, renewed_at)
                }
                futures::future::Either::Left((Err(error), _)) => {
                    tracing::warn!(%error, "renewing lock leases failed; retrying at the next heartbeat");
                    lose_expired(&common);
                    break common.heartbeat;
                }
                futures::future::Either::Right(((), _)) => lose_expired(&common),
            }
        };
    }
}

/// When renewals fail, a guard is lost only once its lease has really run out.
fn lose_expired(common: &Common) {
    let now = micros(common.clock.now());
    let renewed = i64::try_from(common.last_renewal.load(Ordering::SeqCst)).unwrap_or(0);
    let lease = micros(common.lease);
    lock(&common.guards).lose(
        |_, _, expires_at| expires_at.max(renewed + lease) <= now,
        "renewals failed until it ran out",
    );
}
