//! A leader's new value (`Leadership::proclaim`): the operation of a held request's rows set
//! anew, in a transaction on their keys, and announced as a change, so that watchers of those
//! keys (`LockManager::changes`, `observe`) here and in other processes read them again. Its
//! ticket, and so the leader's term, stays.

use super::*;

impl<S: Storage> Worker<S> {
    /// Sets the operation of this owner's request `request` to `operation`, if it still holds
    /// live rows; returns how many rows it changed (0: it holds none, or they lapsed). A
    /// failure for a passing reason is tried again on the busy schedule.
    pub(super) fn relabel(&mut self, request: u64, operation: &str) -> Result<usize, LockError> {
        let Some(written) = self.requests.get(&request) else {
            return Ok(0);
        };
        let (ticket, keys) = (written.ticket, written.keys.clone());
        loop {
            match self.try_relabel(ticket, &keys, operation) {
                Ok(changed) => return Ok(changed),
                Err(error) if !self.storage.again() => return Err(error),
                Err(_) => {}
            }
        }
    }

    fn try_relabel(
        &mut self,
        ticket: u64,
        keys: &[String],
        operation: &str,
    ) -> Result<usize, LockError> {
        let owner = self.common.owner.clone();
        let (changed, mut freed) = self.transaction(keys, |worker, now| {
            let changed = (worker.storage).relabel(&owner, keys, ticket, operation, now)?;
            if changed > 0 {
                // Frees nothing, but other managers' watchers must hear of it.
                worker.storage.announce(keys, &[], &BTreeSet::new())?;
            }
            Ok(changed)
        })?;
        // A change for every watcher to read, here and in other processes: told as a release
        // is, which frees nobody here (the rule finds the same rows held).
        freed.any |= changed > 0;
        self.after_commit(&freed);
        Ok(changed)
    }
}
