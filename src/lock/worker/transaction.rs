//! A write transaction: begun on the keys it decides on, the writes applied, the promotion
//! pass over the keys whose rows it deleted (invariant 2 of `mod.rs`), and the commit.

use super::*;

/// What the current transaction decided, beyond what its writes return: kept on the worker
/// because the writes, the promotion pass and an operator's removal each add to it.
#[derive(Default)]
pub(super) struct Decisions {
    /// Whether it deleted a row (of this owner, or of the one an operator evicts).
    pub(super) deleted: bool,
    /// The keys its promotion pass looks at: those whose rows it deleted, and those a look
    /// found grantable.
    pub(super) pass: BTreeSet<String>,
    /// The owners whose requests it removed for an operator (`evict.rs`), and their keys:
    /// announced to them, so that they look at once, rather than at their next heartbeat, and
    /// a removed waiter hears of its removal.
    pub(super) evicted: Announced,
    /// The storage's time at the start of the last transaction that began, and whether the
    /// last one tried began (one that did not committed nothing).
    pub(super) began_at: i64,
    pub(super) began: bool,
}

impl<S: Storage> Worker<S> {
    /// Begins a transaction that decides on `keys`, runs `body`, then (if `body` deleted rows, or a
    /// look asked for it: `self.decisions.pass`) the promotion pass on those keys, and commits.
    /// Returns what `body` returned and what was freed. A transaction that only adds rows frees
    /// nothing, and lapsed rows are ignored by every decision, so it skips the pass.
    ///
    /// The clock is read once the transaction may decide (`Storage::begin`), and `body` is given
    /// that time: a time read before could be stale by however long another connection held
    /// the lock, and a renewal judged by it could revive a row that had run out, and been
    /// passed over, meanwhile.
    pub(super) fn transaction<T>(
        &mut self,
        keys: &[String],
        body: impl FnOnce(&mut Self, i64) -> Result<T, LockError>,
    ) -> Result<(T, Freed), LockError> {
        // The keys a look asked for; `body` adds those whose rows it deletes.
        let mut pass = std::mem::take(&mut self.decisions.pass);
        let doubtful = std::mem::take(&mut self.doubts.acquisitions);
        let mut locked = keys.to_vec();
        if !doubtful.is_empty() {
            locked.extend(doubtful.iter().flat_map(|w| w.keys.iter().cloned()));
            locked.sort();
            locked.dedup();
        }
        let keys = locked.as_slice();
        self.decisions.began = false;
        self.tried_writing = true;
        let now = match self.storage.begin(keys).and_then(within_time_line) {
            Ok(now) => now,
            Err(error) => {
                // A begin that failed half-way (a lock wait that timed out) may leave a
                // transaction open, in which every later statement would fail: end it.
                self.storage.rollback();
                self.doubts.acquisitions = doubtful;
                return Err(error);
            }
        };
        Counters::bump(&self.counters().write_transactions);
        self.decisions.began_at = now;
        self.decisions.began = true;
        self.decisions.deleted = false;
        let result = (|| {
            let owner = self.common.owner.clone();
            for written in &doubtful {
                let deleted =
                    self.storage
                        .delete_request(&owner, &written.keys, written.ticket, now)?;
                if deleted.rows > 0 {
                    self.decisions.deleted = true;
                    pass.extend(written.keys.iter().cloned());
                }
            }
            let value = body(self, now)?;
            let mut freed = Freed {
                any: self.decisions.deleted,
                promoted: Vec::new(),
                at: now,
                owners: BTreeSet::new(),
            };
            pass.append(&mut self.decisions.pass);
            if !pass.is_empty() {
                let (expired, promoted, mut announced) = self.promote_pass(&pass, keys, now)?;
                announced.append(&mut self.decisions.evicted);
                freed.any |= expired > 0 || !promoted.is_empty();
                freed.promoted = promoted;
                let freed_keys: Vec<String> = if freed.any {
                    pass.into_iter().collect()
                } else {
                    Vec::new()
                };
                if !freed_keys.is_empty() || !announced.keys.is_empty() {
                    let keys: Vec<String> = announced.keys.into_iter().collect();
                    (self.storage).announce(&freed_keys, &keys, &announced.owners)?;
                }
                freed.owners = announced.owners;
            }
            self.storage.commit()?;
            Ok((value, freed))
        })();
        self.decisions.evicted = Announced::default();
        if result.is_err() {
            self.decisions.pass.clear();
            self.storage.rollback();
            self.doubts.acquisitions.extend(doubtful);
        }
        result
    }

    /// Promotes, whoever owns them, the waiters on `keys` that the rule now allows. Reads the
    /// rows of `keys`, and of the other keys those waiters wait on: where the storage serialises
    /// by key, only of the keys this transaction `locked`, and a waiter with a key outside them
    /// is left for its owner, whose own look takes all its keys (its keys are announced so that
    /// the owner looks). Returns how many lapsed rows were deleted, the promoted tickets, and
    /// what to announce.
    pub(super) fn promote_pass(
        &mut self,
        keys: &BTreeSet<String>,
        locked: &[String],
        now: i64,
    ) -> Result<(usize, Vec<u64>, Announced), LockError> {
        let list: Vec<String> = keys.iter().cloned().collect();
        // Where renewals run beside this transaction, lapsed rows must be gone before it reads
        // (see `Storage::rows_on_keys`); a lone writer ignores them, and its heartbeat sweeps.
        let delete_lapsed = self.caps.keys_locked;
        let mut expired = 0;
        if delete_lapsed {
            expired += self.storage.delete_expired(&list, now)?;
        }
        let mut rows = Vec::new();
        self.storage.rows_on_keys(&list, now, &mut rows)?;
        let mut read = keys.clone();
        let mut more: Vec<String> = other_keys(&rows, &read).into_iter().collect();
        let mut announced = Announced::default();
        if self.caps.keys_locked {
            let (reachable, out_of_reach): (Vec<String>, Vec<String>) = more
                .into_iter()
                .partition(|key| locked.binary_search(key).is_ok());
            more = reachable;
            if !out_of_reach.is_empty() {
                // The waiters with a key out of reach: their owners look again.
                let blocked: BTreeSet<&str> = out_of_reach.iter().map(String::as_str).collect();
                for row in rows.iter().filter(|row| !row.held) {
                    if row.request_keys().any(|key| blocked.contains(key)) {
                        announced.note(row, row.request_keys().map(str::to_owned));
                    }
                }
            }
        }
        if !more.is_empty() {
            if delete_lapsed {
                expired += self.storage.delete_expired(&more, now)?;
            }
            self.storage.rows_on_keys(&more, now, &mut rows)?;
            read.extend(more);
        }
        let promoted = promotable_within(&rows, &read);
        // What this read found is the truth as the transaction's time judges it; a look that
        // sent the keys here judged by an estimate of that time (ahead of it, by up to a round
        // trip, on PostgreSQL) and may have found another owner's row lapsed that is live here.
        // Its waits must then be woken when that row runs out, or a waiter whose holder died
        // would wait for ever.
        let waited: Vec<String> = (read.iter())
            .filter(|key| self.waits.on(key).next().is_some())
            .cloned()
            .collect();
        if !waited.is_empty() {
            let common = Arc::clone(&self.common);
            self.watch(&waited, others_rows(&common.owner, &rows), Look::Done);
        }
        // Each request at once, its keys in order, as every transaction changes rows.
        let mut by_ticket: BTreeMap<u64, Vec<&RowView>> = BTreeMap::new();
        for row in rows.iter().filter(|row| !row.held) {
            if promoted.binary_search(&row.ticket).is_ok() {
                by_ticket.entry(row.ticket).or_default().push(row);
            }
        }
        for (ticket, mut own) in by_ticket {
            own.sort_by(|a, b| a.key.cmp(&b.key));
            let keys: Vec<String> = own.iter().map(|row| row.key.to_string()).collect();
            self.storage.promote(&keys, ticket, now)?;
            // Another owner learns of its grant from the announcement; this one, as it commits
            // (`after_commit`).
            if *own[0].owner != *self.common.owner {
                announced.note(own[0], keys);
            }
        }
        announced.owners.remove(&self.common.owner);
        Ok((expired, promoted, announced))
    }

    pub(super) fn apply(&mut self, write: &Write, now: i64) -> Result<Decided, LockError> {
        let common = self.common.clone();
        let owner = common.owner.as_str();
        match write {
            Write::Acquire {
                request,
                requests,
                wait,
                announce,
                ..
            } => {
                let keys = keys_of(requests);
                if self.caps.keys_locked {
                    // Lapsed rows are ignored by the rule either way; where renewals run beside
                    // this transaction, they must also be gone before it decides (see
                    // `Storage::rows_on_keys`).
                    self.storage.delete_expired(&keys, now)?;
                }
                let mut rows = Vec::new();
                self.storage.rows_on_keys(&keys, now, &mut rows)?;
                let wanted = || requests.iter().map(|r| (r.key.as_str(), r.mode));
                if let Some(why) = misfit(wanted(), &rows) {
                    return Ok(Decided::Misfit(why));
                }
                let granted = grantable_now(wanted(), &rows);
                if !granted {
                    let common = Arc::clone(&self.common);
                    self.not_granted(&keys, others_rows(&common.owner, &rows), *wait);
                    if *wait == Wait::Unqueued {
                        let lease = micros(self.common.lease);
                        self.storage.watching(owner, &keys, now, lease)?;
                    }
                    if *wait != Wait::Queued {
                        return Ok(Decided::NotNow);
                    }
                }
                let ticket = self.storage.next_ticket()?;
                let expires_at = now + micros(self.common.lease);
                self.storage
                    .insert_request(owner, ticket, requests, granted, now, expires_at)?;
                // Recorded now, not after the commit, so that a `Remove` later in this batch
                // finds it; `write` forgets it again if the transaction rolls back.
                let granted_until = granted.then_some(expires_at);
                Ok(self.written(*request, requests, ticket, granted_until, *announce))
            }
            Write::Remove { request, .. } => {
                let Some(written) = self.requests.get(request) else {
                    return Ok(Decided::Removed(Removed::AllLive));
                };
                let deleted =
                    self.storage
                        .delete_request(owner, &written.keys, written.ticket, now)?;
                self.decisions.deleted |= deleted.rows > 0;
                self.decisions.pass.extend(written.keys.iter().cloned());
                Ok(Decided::Removed(self.found(*request, &deleted)))
            }
            Write::Renew { .. } => {
                let expires_at = now + micros(self.common.lease);
                let renewed = self.storage.renew(owner, now, expires_at)?;
                self.storage.sweep(now)?;
                Ok(Decided::Renewed(renewed))
            }
            Write::Shutdown { .. } => {
                self.delete_own_rows(now)?;
                Ok(Decided::Done)
            }
        }
    }

    /// A request on `keys` was not granted, `others` being the other owners' live rows there (by
    /// key and expiry): unless it does not
    /// wait at all (`try_acquire`), it waits, queued or not, until another owner's row there
    /// runs out, or another owner, committing after this decision, wakes it. Without a queue
    /// position, it is refused for now.
    pub(super) fn not_granted<'r>(
        &mut self,
        keys: &[String],
        others: impl Iterator<Item = (&'r str, i64)> + Clone,
        wait: Wait,
    ) {
        if wait == Wait::No {
            return;
        }
        if wait == Wait::Unqueued {
            self.mark_waiting(true);
        }
        self.watch(keys, others, Look::Pending);
        if wait != Wait::Queued {
            self.waits.refuse(keys);
        }
    }

    /// Records the rows written for `request` under `ticket`, held until `expires_at` if
    /// granted; what that decided.
    pub(super) fn written(
        &mut self,
        request: u64,
        requests: &[LockRequest],
        ticket: u64,
        granted_until: Option<i64>,
        announce: bool,
    ) -> Decided {
        let keys = requests.iter().map(|r| r.key.clone()).collect();
        self.requests.insert(
            request,
            Written {
                ticket,
                keys,
                announce,
            },
        );
        match granted_until {
            Some(expires_at) => Decided::Granted { ticket, expires_at },
            None => Decided::Queued(ticket),
        }
    }
}
