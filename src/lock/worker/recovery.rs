//! Work whose answer was lost: removals tried in a call or a transaction that failed for a
//! passing reason (perhaps after it committed), and acquisitions decided in one call that
//! failed so, whose rows, if they are there, the next transaction deletes.

use super::*;

/// What the worker doubts: writes that failed, perhaps after they committed.
#[derive(Default)]
pub(super) struct Doubts {
    /// Acquisitions whose transaction failed, perhaps at its commit, so perhaps committed:
    /// deleted (if there) by the next transaction.
    pub(super) acquisitions: Vec<Written>,
    /// Whether an acquisition decided in one call (`Storage::decide_at_once`) failed, perhaps
    /// after it committed: its rows, if there, are found (`find_lost_requests`) and deleted
    /// by the next transaction, as `acquisitions` are.
    pub(super) lost_replies: bool,
    /// Removals tried in a call or a transaction that failed for a passing reason, perhaps
    /// after it committed: a later try that finds none of their rows cannot tell whether that
    /// first try deleted them (`Removed::GoneAfterLostAnswer`); by request, the storage's time
    /// at the first such try.
    pub(super) removals: BTreeMap<u64, i64>,
    /// Requests whose removal failed: retried with every heartbeat, so that their rows do not
    /// live on, renewed with this owner's others.
    pub(super) failed_removals: Vec<u64>,
}

impl<S: Storage> Worker<S> {
    /// The removals among `writes`, tried in a call or transaction that failed: perhaps after
    /// it committed.
    pub(super) fn doubt_removals(&mut self, writes: &[Write]) {
        for write in writes {
            if let Write::Remove { request, .. } = write {
                // The earliest time at which a try may have deleted its rows.
                let began_at = self.decisions.began_at;
                self.doubts.removals.entry(*request).or_insert(began_at);
            }
        }
    }

    /// After a write that failed, perhaps after it committed (its answer lost): what it freed
    /// and promoted, if it did, was never told to this owner's waiters, and a retry that finds
    /// the rows gone frees nothing more. So they are told to look again, as after a change of
    /// unknown extent: callers waiting without a row try again at once, and the next look reads
    /// every key the queued requests wait on (and finds those that the lost commit promoted).
    pub(super) fn doubt_commit(&mut self) {
        self.looks.all = true;
        self.looks.poked = true;
        self.waits.take_refused();
        self.common.changed.notify(usize::MAX);
    }

    /// What the removal of `request` found, having deleted `deleted` of its rows.
    pub(super) fn found(&self, request: u64, deleted: &Deleted) -> Removed {
        let Some(written) = self.requests.get(&request) else {
            return Removed::AllLive;
        };
        if deleted.live == written.keys.len() {
            Removed::AllLive
        } else if let Some(&since) = (deleted.rows == 0)
            .then(|| self.doubts.removals.get(&request))
            .flatten()
        {
            Removed::GoneAfterLostAnswer { since }
        } else {
            Removed::NotAllLive
        }
    }

    /// After an acquisition in one call failed (`lost_replies`): this owner's requests that the
    /// worker does not know of are such acquisitions, committed though their callers were told
    /// they failed; they become `doubtful`, and the next transaction deletes them. If storage
    /// cannot be read, the next write tries again.
    pub(super) fn find_lost_requests(&mut self) {
        if !self.doubts.lost_replies {
            return;
        }
        let owner = self.common.owner.clone();
        match self.storage.requests_of(&owner) {
            Ok(requests) => {
                self.doubts.lost_replies = false;
                let known: BTreeSet<u64> = (self.requests.values())
                    .chain(&self.doubts.acquisitions)
                    .map(|written| written.ticket)
                    .collect();
                for (ticket, keys) in requests {
                    if !known.contains(&ticket) {
                        self.doubts.acquisitions.push(Written {
                            ticket,
                            keys,
                            announce: false,
                        });
                    }
                }
            }
            Err(error) => {
                tracing::debug!(%error, "could not read this owner's requests; later");
            }
        }
    }
}
