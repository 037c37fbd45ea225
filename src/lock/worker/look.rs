//! Looking for other managers' changes (invariant 4 of `mod.rs`): when the poll looks next, what
//! a look reads, and the waits it settles.

use super::*;

impl<S: Storage> Worker<S> {
    /// The poll's next look after a look (or the start of the schedule) at `ended_at`.
    pub(super) fn look_after(&mut self, ended_at: Duration) -> NextLook {
        match self.poll.next_at(ended_at) {
            Some(at) => NextLook::At(at),
            None => NextLook::Over,
        }
    }

    /// When the poll looks next, if it looks at all: only while this owner has waiters. When a
    /// wait begins after none, the poll's schedule starts over from the last look, so that the
    /// first look comes one delay after it (at once if that was long ago). And at the latest
    /// when another owner's row on a watched key runs out, however long the poll's delay (or
    /// if its schedule has ended): a crashed owner's lock passes on when its lease ends. (Not
    /// right after a look that failed: the poll's schedule spaces the tries then.)
    pub(super) fn next_look(&mut self) -> Option<Duration> {
        if !self.has_waiters() {
            self.next_look = NextLook::Idle;
            return None;
        }
        if let NextLook::Idle = self.next_look {
            self.poll.reset(self.last_look);
            self.next_look = self.look_after(self.last_look);
        }
        let polled = match self.next_look {
            NextLook::At(at) => Some(at),
            NextLook::Idle | NextLook::Over => None,
        };
        let freed = self
            .waits
            .first_deadline()
            .filter(|_| !self.look_all)
            .map(|deadline| {
                // From the storage's time to the manager's clock's monotonic time.
                self.monotonic_of(deadline)
            });
        match (polled, freed) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether to look for other processes' changes now: while this owner has waiters, when the
    /// poll's time has come or another manager of this process poked.
    pub(super) fn look_due(&mut self) -> bool {
        let next = self.next_look();
        self.has_waiters()
            && (self.poked || next.is_some_and(|at| self.common.clock.monotonic() >= at))
    }

    /// How long until the waiting marker, still up with no waiter, is to be taken down.
    pub(super) fn marker_left(&self, now: Duration) -> Option<Duration> {
        let since = self.idle_since.filter(|_| self.marked_waiting)?;
        Some(MARKER_LINGER.saturating_sub(now.saturating_sub(since)))
    }

    /// Tells storage whether this owner has waiters, when that changes.
    pub(super) fn mark_waiting(&mut self, waiting: bool) {
        if waiting != self.marked_waiting {
            self.marked_waiting = waiting;
            self.storage.waiting(waiting);
        }
    }

    /// Remembers, for each of `keys` (where `others` are the other owners' live rows, by key and
    /// expiry), when the first other owner's row on it runs out: that is when the key may be
    /// freed without anyone writing.
    pub(super) fn watch<'r>(
        &mut self,
        keys: &[String],
        others: impl Iterator<Item = (&'r str, i64)> + Clone,
        look: Look,
    ) {
        for (key, at) in first_expiries(keys, others) {
            self.waits.note(key, at, look);
        }
    }

    /// The same, for the waits on `keys` only, from `rows` (every live row on them): a wait
    /// whose row there is held was promoted (by another manager: this one's promotions settle
    /// their waits as they commit); one whose row there is gone ran out.
    pub(super) fn settle_waits(&mut self, keys: &BTreeSet<String>, rows: &[RowView]) {
        let seen: HashMap<(&str, u64), &RowView> = rows
            .iter()
            .filter(|row| *row.owner == *self.common.owner)
            .map(|row| ((&*row.key, row.ticket), row))
            .collect();
        let mut promoted = BTreeMap::new();
        let mut gone = BTreeSet::new();
        for key in keys {
            for (ticket, _) in self.waits.on(key) {
                match seen.get(&(key.as_str(), ticket)) {
                    Some(row) if row.held => {
                        promoted.insert(ticket, row.expires_at);
                    }
                    Some(_) => {}
                    None => {
                        gone.insert(ticket);
                    }
                }
            }
        }
        let gone: Vec<u64> = gone.into_iter().collect();
        self.settle(promoted, &gone);
    }

    /// The poll: a cheap check of what others changed, then, only for the watched keys that
    /// changed or whose deadline passed, a read of their rows and a promotion if one is due.
    pub(super) fn look_for_changes(&mut self) {
        self.poked = false;
        if let Err(error) = self.try_look() {
            tracing::warn!(%error, "looking for other processes' changes failed; will retry");
            self.look_all = true;
        }
    }

    pub(super) fn try_look(&mut self) -> Result<(), LockError> {
        let changes = self.storage.changes()?;
        Counters::bump(&self.counters().change_checks);
        let now = self.now();
        let look_all = std::mem::take(&mut self.look_all);
        // Keys on which another owner's lease has run out since they were read.
        let (due, refused_due) = self.waits.due(now);
        let mut keys: BTreeSet<String> = match &changes {
            _ if look_all => self.waits.queued_keys().cloned().collect(),
            Changes::Unknown => self.waits.queued_keys().cloned().collect(),
            Changes::Keys(hashes) => self.waits.named(hashes),
            Changes::Nothing => BTreeSet::new(),
        };
        keys.extend(due);
        keys.append(&mut self.own_changes);
        // Watchers of every change read again after a look that heard of one, or after every
        // look where a look does not hear of every commit (a request queued elsewhere, on
        // PostgreSQL).
        if (changes != Changes::Nothing || !self.caps.hears_every_commit)
            && self.common.watchers.load(Ordering::SeqCst) > 0
        {
            self.common.changed.notify(usize::MAX);
        }
        if (changes != Changes::Nothing || refused_due) && self.waits.any_refused() {
            // Requests without a queue position have no rows to promote: their callers try
            // again, and are refused (and watched) again if still blocked.
            self.waits.take_refused();
            self.common.changed.notify(usize::MAX);
        }
        if keys.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = keys.iter().cloned().collect();
        let mut rows = Vec::new();
        self.storage.rows_on_keys(&list, now, &mut rows)?;
        let more: Vec<String> = other_keys(&rows, &keys).into_iter().collect();
        self.storage.rows_on_keys(&more, now, &mut rows)?;
        let mut read = keys;
        read.extend(more);
        let read_list: Vec<String> = read.iter().cloned().collect();
        let common = Arc::clone(&self.common);
        self.watch(&read_list, others_rows(&common.owner, &rows), Look::Done);
        self.settle_waits(&read, &rows);
        if !promotable_within(&rows, &read).is_empty() {
            self.pass = read;
            let ((), freed) = self.transaction(&read_list, |_, _| Ok(()))?;
            self.after_commit(&freed);
        }
        Ok(())
    }
}
