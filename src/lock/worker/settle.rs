//! Settling waits and leases: what a commit freed and promoted, the leases a renewal moves on, and
//! the deadline of every lease granted (`state::held`).

use super::*;

impl<S: Storage> Worker<S> {
    /// After a commit: wake the local waiters that were promoted, and if anything was freed,
    /// the waiters without a queue position and the other managers of this process.
    pub(super) fn after_commit(&mut self, freed: &Freed) {
        // This owner's rows were promoted with this owner's lease (see `Db::promote`).
        let expires_at = freed.at + micros(self.common.lease);
        for &ticket in &freed.promoted {
            self.grant_wait(ticket, expires_at);
        }
        if freed.any {
            self.common.changed.notify(usize::MAX);
        } else if self
            .common
            .watchers
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0
        {
            // A watcher of every change (`LockManager::changes`) hears of this owner's own.
            self.common.changed.notify(usize::MAX);
        }
        self.storage.wake_others(freed.any.then_some(&freed.owners));
    }

    /// After a renewal at `now` (the storage's time) that renewed `renewed`, every live request
    /// of this owner: the guards whose rows it renewed last a lease from then, as this process
    /// reckons it; a guard whose rows are gone or ran out has lost its lease; a wait whose rows
    /// are held now was promoted by another manager; one whose rows are gone can never be
    /// granted. The storage says what it renewed, so nothing more is read.
    pub(super) fn settle_renewed(&mut self, now: i64, renewed: &[OwnedRequest]) {
        let find = |ticket: u64, held: bool| {
            renewed
                .iter()
                .find(|r| r.ticket == ticket && r.held == held)
        };
        let rows = |ticket: u64, held: bool| find(ticket, held).map_or(0, |r| r.rows);
        let expires_at = now + micros(self.common.lease);
        let deadline = self.deadline(expires_at);
        let lost =
            lock(&self.common.guards).renewed(|ticket| rows(ticket, true), deadline, expires_at);
        if lost > 0 {
            // Their rows ran out unseen by this owner's deadlines, which watch other owners'
            // rows: a waiter of this owner behind them may be free.
            self.looks.all = true;
        }
        if self.waits.any_refused() {
            // Callers waiting without a row try again once a heartbeat, whatever else wakes
            // them: a refusal by this owner's own rows is watched by no deadline, and those
            // rows may have run out unseen (a manager stopped past its lease, its renewal's
            // sweep deleting them now). Found by the simulated workloads: such a `many` waited
            // for ever.
            self.waits.take_refused();
            self.common.changed.notify(usize::MAX);
        }
        let mut promoted = Vec::new();
        let mut gone = Vec::new();
        for (ticket, _) in self.waits.all() {
            if let Some(held) = find(ticket, true) {
                promoted.push((ticket, held.expires_at));
            } else if rows(ticket, false) == 0 {
                gone.push(ticket);
            }
        }
        self.settle(promoted, &gone);
    }

    /// Ends the waits found `promoted` (by another manager, with this owner's lease: until when
    /// the storage says) with their grants, and those whose rows are `gone`: with `Removed` if
    /// an operator removed them (the storage's tombstone says so), else as lapsed, to queue
    /// again. If the storage cannot say, the gone waits go on, and the next look reads their
    /// keys and asks again: a removal is never taken for a lapse for want of an answer.
    pub(super) fn settle(&mut self, promoted: impl IntoIterator<Item = (u64, i64)>, gone: &[u64]) {
        for (ticket, expires_at) in promoted {
            self.grant_wait(ticket, expires_at);
        }
        if gone.is_empty() {
            return;
        }
        let owner = self.common.owner.clone();
        let removed = match self.storage.removals(&owner, gone) {
            Ok(removed) => removed,
            Err(error) => {
                tracing::warn!(
                    %error,
                    "could not read whether an operator removed waiting requests; will look again"
                );
                self.looks.all = true;
                return;
            }
        };
        for &ticket in gone {
            let by = (removed.iter())
                .find(|(removed, _)| *removed == ticket)
                .map(|(_, by)| by.clone());
            let found: Vec<u64> = (self.requests.iter())
                .filter(|(_, written)| written.ticket == ticket)
                .map(|(&request, _)| request)
                .collect();
            let Some(by) = by else {
                if let Some(slot) = self.waits.remove(ticket) {
                    slot.set(SlotState::Expired);
                }
                // Its caller queues again under the same request id. Were its rows judged gone
                // wrongly (the clock judging leases stepped back since, and they are live
                // again), they would be renewed with this owner's others for ever, ahead of
                // the new request: so the next transaction deletes them, if they are there.
                for request in found {
                    if let Some(written) = self.requests.remove(&request) {
                        self.doubts.acquisitions.push(written);
                    }
                }
                continue;
            };
            if let Some(slot) = self.waits.remove(ticket) {
                slot.set(SlotState::Removed { by });
            }
            // Deleted by the removal, which no renewal can bring back: nothing to delete.
            for request in found {
                self.requests.remove(&request);
            }
        }
        if !removed.is_empty() {
            let tickets: Vec<u64> = removed.iter().map(|(ticket, _)| *ticket).collect();
            if let Err(error) = self.storage.forget_removals(&owner, &tickets) {
                tracing::debug!(%error, "could not delete tombstones heard of; the sweep will");
            }
        }
    }

    /// `expires_at`, the storage's time at which a lease of this owner runs out, on the clock's
    /// monotonic time line, where its deadline is kept (see `Guards::granted`).
    pub(super) fn deadline(&self, expires_at: i64) -> Duration {
        self.monotonic_of(expires_at)
    }

    /// The grant of `ticket` on `keys`, whose rows' lease runs out at `expires_at` (the
    /// storage's time): its lease is kept from now on (`Guards::granted`), and its caller makes
    /// its `lost` signal from it as it takes the grant.
    pub(super) fn grant(&self, ticket: u64, keys: Vec<String>, expires_at: i64) -> Grant {
        let deadline = self.deadline(expires_at);
        lock(&self.common.guards).granted(ticket, keys, deadline, expires_at);
        Grant {
            ticket,
            began: deadline.saturating_sub(self.common.lease),
        }
    }

    /// The queued request `ticket` was granted, its rows' lease running out at `expires_at`
    /// (the storage's time): its wait ends, with the grant.
    pub(super) fn grant_wait(&mut self, ticket: u64, expires_at: i64) {
        if let Some(waiting) = self.waits.end(ticket) {
            let grant = self.grant(ticket, waiting.keys, expires_at);
            waiting.slot.set(SlotState::Granted(grant));
        }
    }
}
