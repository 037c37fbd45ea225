//! An operator's removal of another owner's rows (the command's `release`), for an owner whose
//! machine is gone: the rows are deleted in one transaction on their keys, which promotes the
//! waiters the rule now lets through, as a release by their owner would (invariant 2 of
//! `mod.rs`), and announced to their owner as a promotion would be. An owner still alive finds
//! its rows gone at its next look (or heartbeat), and its guards' `lost` signals abort. A
//! removed waiting request is recorded in the same transaction (a tombstone:
//! `Storage::record_removal`), so that its owner, finding its rows gone, ends the wait with
//! `LockError::Removed` rather than queue again as after a lapse (`settle.rs`).

use super::*;

impl<S: Storage> Worker<S> {
    /// Deletes `owner`'s rows of the requests `tickets` (`None`: of every request), held or
    /// waiting, live or lapsed, and records the waiting ones as removed by this owner; returns
    /// how many rows there were. A failure for a passing reason is tried again on the busy
    /// schedule. After a try whose answer was lost, the next finds the rows gone and says 0.
    pub(super) fn evict(
        &mut self,
        owner: &str,
        tickets: Option<&[u64]>,
    ) -> Result<usize, LockError> {
        loop {
            match self.try_evict(owner, tickets) {
                Ok(removed) => return Ok(removed),
                Err(error) if !self.storage.again() => return Err(error),
                Err(_) => {}
            }
        }
    }

    fn try_evict(&mut self, owner: &str, tickets: Option<&[u64]>) -> Result<usize, LockError> {
        let requests: Vec<(u64, Vec<String>)> = (self.storage.requests_of(owner)?.into_iter())
            .filter(|(found, _)| tickets.is_none_or(|tickets| tickets.contains(found)))
            .collect();
        if requests.is_empty() {
            return Ok(0);
        }
        let mut keys: Vec<String> = requests.iter().flat_map(|(_, keys)| keys.clone()).collect();
        keys.sort();
        keys.dedup();
        let (removed, freed) = self.transaction(&keys, |worker, now| {
            let mut removed = 0;
            let by = worker.common.owner.clone();
            for (ticket, keys) in &requests {
                worker.storage.record_removal(owner, *ticket, &by, now)?;
                let deleted = worker.storage.delete_request(owner, keys, *ticket, now)?;
                if deleted.rows > 0 {
                    removed += deleted.rows;
                    worker.decisions.deleted = true;
                    worker.decisions.pass.extend(keys.iter().cloned());
                    worker
                        .decisions
                        .evicted
                        .note_owner(owner, keys.iter().cloned());
                }
            }
            Ok(removed)
        })?;
        self.after_commit(&freed);
        Ok(removed)
    }
}
