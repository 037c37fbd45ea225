//! A batch: the commands that reached the worker together, sorted into writes (one
//! transaction, or one call where the storage decides at once) and reads, and the replies
//! delivered once the writes committed (invariants 1, 3 and 5 of `mod.rs`).

use super::*;

impl<S: Storage> Worker<S> {
    /// Handles one batch; returns whether the worker should stop.
    pub(super) fn handle(&mut self, batch: Vec<Command>) -> bool {
        let mut writes = Vec::new();
        let mut reads = Vec::new();
        // Requests acquired earlier in this batch: a `Remove` for one must run after it.
        let mut acquiring = Vec::new();
        let mut stop = false;
        for command in batch {
            if stop {
                // Nothing is done after a shutdown, not even what reached it in the same batch:
                // dropping the command's reply tells its caller `Shutdown`.
                continue;
            }
            match command {
                Command::Write(Write::Acquire {
                    request,
                    requests,
                    wait,
                    announce,
                    reply,
                }) => {
                    // A refusal read outside a transaction cannot note an unqueued waiter
                    // where the storage needs it noted (`Storage::watching`). Where the storage
                    // decides in one call, which writes nothing for a `try_acquire` refused, a
                    // read first would only add a round trip to every one granted.
                    let read_first = match wait {
                        Wait::No => self.storage.at_once().is_none(),
                        _ => self.caps.refuses_by_reads,
                    };
                    if wait != Wait::Queued
                        && read_first
                        && !writes.iter().any(Write::may_free)
                        && self.refused_by_a_read(&requests, wait)
                    {
                        // A waiter without a queue position, still blocked: no need to take the
                        // write lock to tell it so. Only when nothing earlier in this batch may
                        // free rows: the read sees the database before the batch's writes, and
                        // a request must see every command sent before it.
                        let _ = reply.send(Ok(Acquired::NotNow));
                        continue;
                    }
                    acquiring.push(request);
                    writes.push(Write::Acquire {
                        request,
                        requests,
                        wait,
                        announce,
                        reply,
                    });
                }
                Command::Write(Write::Remove { request, reply }) => {
                    if self.requests.contains_key(&request) || acquiring.contains(&request) {
                        writes.push(Write::Remove { request, reply });
                    } else if let Some(reply) = reply {
                        // Nothing was ever written for it, or it is gone already.
                        let _ = reply.send(Ok(Removed::NotAllLive));
                    }
                }
                Command::Write(Write::Renew { replies }) => {
                    // One renewal per batch, whoever asked: each renews every row of the owner.
                    if let Some(Write::Renew { replies: joined }) =
                        writes.iter_mut().find(|w| matches!(w, Write::Renew { .. }))
                    {
                        joined.extend(replies);
                        continue;
                    }
                    let now = self.common.clock.monotonic();
                    match self.last_renewal {
                        // Every live row got a full lease then (or since, when written). The
                        // caller is told when, and beats again one heartbeat after that, so the
                        // rows keep their whole margin; lost leases are looked for then.
                        Some(at) if now < at + self.common.heartbeat / 2 => {
                            for reply in replies {
                                let _ = reply.send(Ok(micros(at)));
                            }
                        }
                        _ => {
                            for request in std::mem::take(&mut self.doubts.failed_removals) {
                                writes.push(Write::Remove {
                                    request,
                                    reply: None,
                                });
                            }
                            writes.push(Write::Renew { replies });
                        }
                    }
                }
                Command::Write(Write::Shutdown { reply }) => {
                    writes.push(Write::Shutdown { reply });
                    stop = true;
                }
                Command::Poke => self.looks.poked = true,
                read @ (Command::Inspect { .. }
                | Command::IsLocked { .. }
                | Command::Evict { .. }
                | Command::Relabel { .. }) => reads.push(read),
            }
        }
        if !writes.is_empty() {
            self.write(writes);
        }
        for read in reads {
            self.read(read);
        }
        stop
    }

    /// Whether a read shows `requests` cannot be granted now; if so, their keys are watched
    /// until the caller is woken. (An error answers "not known": the write transaction then
    /// decides.)
    pub(super) fn refused_by_a_read(&mut self, requests: &[LockRequest], wait: Wait) -> bool {
        if wait == Wait::Unqueued {
            // Said before the read: a release committed after it will wake this owner.
            self.mark_waiting(true);
        }
        let now = self.now();
        let keys = keys_of(requests);
        let mut rows = Vec::new();
        if self.storage.rows_on_keys(&keys, now, &mut rows).is_err() {
            return false;
        }
        let wanted = || requests.iter().map(|r| (r.key.as_str(), r.mode));
        // A misfit is the write's to report.
        let refused = misfit(wanted(), &rows).is_none() && !grantable_now(wanted(), &rows);
        if refused {
            let common = Arc::clone(&self.common);
            self.not_granted(&keys, others_rows(&common.owner, &rows), wait);
        }
        refused
    }

    /// The keys a batch decides on: those of its requests, and for a shutdown every key this
    /// owner has rows on.
    pub(super) fn keys_of_batch(&self, writes: &[Write]) -> Vec<String> {
        let mut keys = BTreeSet::new();
        for write in writes {
            match write {
                Write::Acquire { requests, .. } => {
                    keys.extend(requests.iter().map(|r| r.key.clone()));
                }
                Write::Remove { request, .. } => {
                    if let Some(written) = self.requests.get(request) {
                        keys.extend(written.keys.iter().cloned());
                    }
                }
                Write::Renew { .. } => {}
                Write::Shutdown { .. } => keys.extend(self.own_keys()),
            }
        }
        keys.into_iter().collect()
    }

    /// Every key this owner has rows on, sorted, without repeats.
    pub(super) fn own_keys(&self) -> Vec<String> {
        let keys: BTreeSet<&String> = self
            .requests
            .values()
            .flat_map(|written| written.keys.iter())
            .collect();
        keys.into_iter().cloned().collect()
    }

    pub(super) fn read(&mut self, command: Command) {
        let now = self.now();
        match command {
            Command::Inspect { key, reply } => {
                let _ = reply.send(self.storage.live_rows(key.as_deref(), now));
            }
            Command::IsLocked { key, reply } => {
                let _ = reply.send(self.storage.is_held(&key, now));
            }
            Command::Evict {
                owner,
                tickets,
                reply,
            } => {
                let _ = reply.send(self.evict(&owner, tickets.as_deref()));
            }
            Command::Relabel {
                request,
                operation,
                reply,
            } => {
                let _ = reply.send(self.relabel(request, &operation));
            }
            _ => {}
        }
    }

    /// Runs `writes` in one transaction; if that fails, each alone, so one bad write does not
    /// fail the others.
    ///
    /// A batch that failed for a passing reason (its connection cut, the server restarted, a
    /// timeout: see `Storage::again`) is done again, whole, after the busy schedule's delay,
    /// rather than failing its callers.
    pub(super) fn write(&mut self, mut writes: Vec<Write>) {
        // Acquisitions and removals in one call, while the storage can decide them so
        // (`Storage::decide_at_once`) and no other work is due in a transaction.
        while self.storage.at_once().is_some() {
            self.find_lost_requests();
            if !self.doubts.acquisitions.is_empty() || !self.decisions.pass.is_empty() {
                break;
            }
            if let Some(Write::Remove { request, .. }) = writes.first() {
                if !self.requests.contains_key(request) {
                    // Its acquisition, earlier in this batch, wrote nothing: nothing to remove.
                    let write = writes.remove(0);
                    let now = self.now();
                    self.deliver(write, Decided::Removed(Removed::AllLive), now);
                    continue;
                }
            }
            let run = self.at_once_run(&writes);
            if run == 0 {
                break;
            }
            let rest = writes.split_off(run);
            match self.at_once(writes) {
                Ok(()) => writes = rest,
                Err(mut back) => {
                    back.extend(rest);
                    writes = back;
                    break;
                }
            }
        }
        if writes.is_empty() {
            return;
        }
        if let [Write::Renew { .. }] = writes.as_slice() {
            // A heartbeat alone, with no other work due in a transaction: in one call, where
            // the storage has one.
            if self.doubts.acquisitions.is_empty()
                && self.decisions.pass.is_empty()
                && self.storage.at_once().is_some()
            {
                if let Some(write) = writes.pop() {
                    self.renew_at_once(write);
                }
                return;
            }
        }
        loop {
            self.find_lost_requests();
            let keys = self.keys_of_batch(&writes);
            let outcome = self.transaction(&keys, |worker, now| {
                let mut decided = Vec::with_capacity(writes.len());
                for write in &writes {
                    decided.push(worker.apply(write, now)?);
                }
                Ok((decided, now))
            });
            let error = match outcome {
                Ok(((decided, now), freed)) => {
                    // Rung before the replies: a leader's observers elsewhere hear of it as
                    // soon as they can, a doorbell's write later than its caller.
                    let announced = Self::announced(&writes, &decided);
                    if !announced.is_empty() {
                        self.storage.ring(&announced);
                    }
                    for (write, decided) in writes.into_iter().zip(decided) {
                        self.deliver(write, decided, now);
                    }
                    self.after_commit(&freed);
                    return;
                }
                Err(error) => error,
            };
            // Rolled back, most likely: the ids recorded for this batch's acquisitions point at
            // nothing. But a failure of the commit itself (a connection cut as it was sent)
            // cannot tell whether it committed: their rows are deleted, if there, by the next
            // transaction, so that a retried acquisition is never there twice, and no row lives
            // on, renewed by this owner's heartbeats, for a caller who was told it failed.
            for write in &writes {
                if let Write::Acquire { request, .. } = write {
                    if let Some(written) = self.requests.remove(request) {
                        self.doubts.acquisitions.push(written);
                    }
                }
            }
            // A transaction that never began committed nothing; one that did may have.
            if self.decisions.began {
                self.doubt_removals(&writes);
                self.doubt_commit();
            }
            if !self.storage.again() {
                self.retry_alone(writes, error);
                return;
            }
            tracing::debug!(%error, "a write failed for a passing reason; once more");
        }
    }

    /// The keys of the announced requests (`Write::Acquire`'s `announce`) among `writes` that
    /// a transaction granted, having `decided` so: rung once it committed. (A removal deletes
    /// rows, which the transaction announces itself, as the storage does where it decides in
    /// one call.)
    fn announced(writes: &[Write], decided: &[Decided]) -> Vec<String> {
        let mut keys = BTreeSet::new();
        for (write, decided) in writes.iter().zip(decided) {
            if let (
                Write::Acquire {
                    requests,
                    announce: true,
                    ..
                },
                Decided::Granted { .. },
            ) = (write, decided)
            {
                keys.extend(requests.iter().map(|r| r.key.clone()));
            }
        }
        keys.into_iter().collect()
    }

    pub(super) fn retry_alone(&mut self, writes: Vec<Write>, error: LockError) {
        match writes.len() {
            1 => {
                if let Some(write) = writes.into_iter().next() {
                    fail(write, error, &mut self.doubts.failed_removals);
                }
            }
            _ => {
                for write in writes {
                    self.write(vec![write]);
                }
            }
        }
    }

    pub(super) fn deliver(&mut self, write: Write, decided: Decided, now: i64) {
        match (write, decided) {
            (
                Write::Acquire {
                    reply, requests, ..
                },
                Decided::Granted { ticket, expires_at },
            ) => {
                let grant = self.grant(ticket, keys_of(&requests), expires_at);
                let _ = reply.send(Ok(Acquired::Granted(grant)));
            }
            (
                Write::Acquire {
                    reply, requests, ..
                },
                Decided::Queued(ticket),
            ) => {
                let slot = Arc::new(WaitSlot::default());
                self.waits.insert(ticket, slot.clone(), keys_of(&requests));
                let at = self.common.clock.monotonic() + beat_after(self.common.heartbeat);
                self.waits.beat_at(ticket, at);
                let _ = reply.send(Ok(Acquired::Queued(ticket, slot)));
            }
            (Write::Acquire { reply, .. }, Decided::Misfit(why)) => {
                let _ = reply.send(Err(LockError::InvalidRequest(why)));
            }
            (Write::Acquire { reply, .. }, _) => {
                let _ = reply.send(Ok(Acquired::NotNow));
            }
            (Write::Remove { request, reply }, decided) => {
                if let Some(Written { ticket, .. }) = self.requests.remove(&request) {
                    self.waits.remove(ticket);
                    // Granted, perhaps, but never handed to its caller (or released: then
                    // forgotten already).
                    lock(&self.common.guards).forget(ticket);
                }
                self.doubts.removals.remove(&request);
                if let Some(reply) = reply {
                    let found = match decided {
                        Decided::Removed(found) => found,
                        _ => Removed::NotAllLive,
                    };
                    let _ = reply.send(Ok(found));
                }
            }
            (Write::Renew { replies }, decided) => {
                let renewed_at = self.monotonic_of(now);
                self.last_renewal = Some(renewed_at);
                Counters::bump(&self.counters().heartbeats);
                let renewed = match decided {
                    Decided::Renewed(renewed) => renewed,
                    _ => Vec::new(),
                };
                self.settle_renewed(now, &renewed);
                send_all(replies, Ok(micros(renewed_at)));
            }
            (Write::Shutdown { reply }, _) => {
                self.requests.clear();
                for slot in self.waits.drain() {
                    slot.set(SlotState::Shutdown);
                }
                lock(&self.common.guards).shut_down();
                // Waiters without a queue position wake, try again, and find the manager shut.
                self.common.changed.notify(usize::MAX);
                let _ = reply.send(Ok(()));
            }
        }
    }
}
