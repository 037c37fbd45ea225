//! Writes decided in one call (`DecidesAtOnce`): the runs of acquisitions and removals that
//! one call of the storage can decide, and what each decided.

use super::*;

impl<S: Storage> Worker<S> {
    /// How many of the first `writes` one call can decide: acquisitions, and removals of
    /// requests written before it (a removal of one acquired in the same run waits for the
    /// next call, which knows its ticket).
    pub(super) fn at_once_run(&self, writes: &[Write]) -> usize {
        let mut removed = BTreeSet::new();
        writes
            .iter()
            .take_while(|write| match write {
                Write::Acquire { .. } => true,
                Write::Remove { request, .. } => {
                    self.requests.contains_key(request) && removed.insert(*request)
                }
                _ => false,
            })
            .count()
    }

    /// Does `writes` (acquisitions and removals: see `at_once_run`) in one call to storage, or
    /// gives them back if the call failed perhaps after writing rows that must be found first. A failure for a passing reason is tried again after the busy
    /// schedule's delay; any other failure of several writes tries each alone, so that one bad
    /// write does not fail the others.
    pub(super) fn at_once(&mut self, writes: Vec<Write>) -> Result<(), Vec<Write>> {
        let owner = self.common.owner.clone();
        let lease = micros(self.common.lease);
        loop {
            let ops: Vec<AtOnce<'_>> = writes
                .iter()
                .filter_map(|write| match write {
                    Write::Acquire {
                        requests,
                        wait,
                        announce,
                        ..
                    } => Some(AtOnce::Acquire {
                        requests,
                        wait: *wait,
                        announce: *announce,
                    }),
                    Write::Remove { request, .. } => {
                        let written = self.requests.get(request)?;
                        Some(AtOnce::Remove {
                            keys: &written.keys,
                            ticket: written.ticket,
                            announce: written.announce,
                        })
                    }
                    _ => None,
                })
                .collect();
            if ops.len() != writes.len() {
                return Err(writes);
            }
            self.tried_writing = true;
            let decided = match self.storage.at_once() {
                Some(decider) => decider.decide_at_once(&owner, &ops, lease),
                None => return Err(writes),
            };
            let error = match decided {
                Ok(outcomes) => {
                    // A call that only refused `try_acquire`s wrote no row of theirs (the
                    // refusal it replaced was a read): it is not counted as a write.
                    let wrote =
                        ops.iter()
                            .zip(&outcomes)
                            .any(|(op, outcome)| match (op, outcome) {
                                (
                                    AtOnce::Acquire { wait: Wait::No, .. },
                                    Outcome::Acquired(decision),
                                ) => decision.ticket.is_some(),
                                _ => true,
                            });
                    if wrote {
                        Counters::bump(&self.counters().write_transactions);
                    }
                    for (write, outcome) in writes.into_iter().zip(outcomes) {
                        self.decided_at_once(write, outcome, lease);
                    }
                    return Ok(());
                }
                Err(error) => error,
            };
            if writes.iter().any(|w| matches!(w, Write::Acquire { .. })) {
                self.doubts.lost_replies = true;
            }
            self.doubt_removals(&writes);
            self.doubt_commit();
            if !self.storage.again() {
                self.retry_alone(writes, error);
                return Ok(());
            }
            tracing::debug!(%error, "a write failed for a passing reason; once more");
            self.find_lost_requests();
            if !self.doubts.acquisitions.is_empty() {
                return Err(writes);
            }
        }
    }

    /// A heartbeat (`write`, a `Renew`) in one call to storage (`DecidesAtOnce::renew_at_once`).
    /// A failure for a passing reason is tried again after the busy schedule's delay: a
    /// renewal done twice renews twice, which is harmless.
    pub(super) fn renew_at_once(&mut self, write: Write) {
        let owner = self.common.owner.clone();
        let lease = micros(self.common.lease);
        loop {
            self.tried_writing = true;
            let renewed = match self.storage.at_once() {
                Some(decider) => decider.renew_at_once(&owner, lease),
                None => Err(StorageError::new("renewing leases", "no one-call renewal").into()),
            };
            match renewed {
                Ok((now, renewed)) => {
                    Counters::bump(&self.counters().write_transactions);
                    self.deliver(write, Decided::Renewed(renewed), now);
                    self.after_commit(&Freed {
                        any: false,
                        promoted: Vec::new(),
                        at: now,
                        owners: BTreeSet::new(),
                    });
                    return;
                }
                Err(error) if !self.storage.again() => {
                    return fail(write, error, &mut self.doubts.failed_removals);
                }
                Err(error) => {
                    tracing::debug!(%error, "a renewal failed for a passing reason; once more");
                }
            }
        }
    }

    /// Delivers what one call decided for `write`.
    pub(super) fn decided_at_once(&mut self, write: Write, outcome: Outcome, lease: i64) {
        match (&write, outcome) {
            (
                Write::Acquire {
                    request,
                    requests,
                    wait,
                    announce,
                    ..
                },
                Outcome::Acquired(decision),
            ) => {
                let (request, wait, announce) = (*request, *wait, *announce);
                let keys = keys_of(requests);
                let misfit = (decision.misfit.as_ref()).and_then(|(key, theirs)| {
                    let mode = requests.iter().find(|r| r.key == *key)?.mode;
                    misfit_beside(key, mode, *theirs)
                });
                if let Some(why) = misfit {
                    return self.deliver(write, Decided::Misfit(why), decision.now);
                }
                let decided = match decision.ticket {
                    Some(ticket) => self.written(
                        request,
                        requests,
                        ticket,
                        decision.granted.then_some(decision.now + lease),
                        announce,
                    ),
                    None => Decided::NotNow,
                };
                if !decision.granted {
                    let others = decision.others.iter().map(|(key, at)| (key.as_str(), *at));
                    self.not_granted(&keys, others, wait);
                }
                self.deliver(write, decided, decision.now);
            }
            (Write::Remove { request, .. }, Outcome::Removed(removal)) => {
                let found = self.found(*request, &removal.deleted);
                let written = self.requests.get(request);
                // The storage promoted the single-key waiters it could, and announced the keys
                // only to other owners: this owner's own waits on several keys there are for
                // its next look.
                if let Some(written) = written.filter(|_| removal.freed) {
                    let spanning = self.waits.spanning(&written.keys);
                    if !spanning.is_empty() {
                        self.looks.own_changes.extend(spanning);
                        self.looks.poked = true;
                    }
                }
                self.deliver(write, Decided::Removed(found), removal.now);
                self.after_commit(&Freed {
                    any: removal.freed,
                    promoted: removal.promoted,
                    at: removal.now,
                    owners: removal.owners,
                });
            }
            (_, outcome) => {
                let wrong = format!("an answer of the wrong kind: {outcome:?}");
                let error = StorageError::new("deciding", wrong).into();
                fail(write, error, &mut self.doubts.failed_removals);
            }
        }
    }
}
