//! Looking for other managers' changes (invariant 4 of `mod.rs`): when the poll looks next, what
//! a look reads, and the waits it settles.

use super::*;

/// When to look for other managers' changes, and what to read at the next look besides the
/// watched keys that changed.
pub(super) struct Looks {
    /// The change poll's schedule, when it says to look next, and when the last look ended
    /// (the clock's monotonic time).
    poll: ScheduleRun,
    next: NextLook,
    last: Duration,
    /// Look at the next step, whatever the poll says: another manager of this process poked.
    pub(super) poked: bool,
    /// Look at every watched key at the next look, changed or not.
    pub(super) all: bool,
    /// Keys this owner freed rows on by a call that announced them to other owners only
    /// (`Storage::decide_at_once`), where a request of its own on several keys waits: the next
    /// look reads them.
    pub(super) own_changes: BTreeSet<String>,
}

/// The change poll's next look.
enum NextLook {
    /// No waiter: no look. The schedule starts over from the last look when a wait begins.
    Idle,
    /// At this time (the clock's monotonic time).
    At(Duration),
    /// The schedule is done: no look until the next wait begins (or a poke).
    Over,
}

impl Looks {
    pub(super) fn new(common: &Common) -> Self {
        let last = common.clock.monotonic();
        Looks {
            poll: common.poll.start(last),
            next: NextLook::Idle,
            last,
            poked: false,
            all: false,
            own_changes: BTreeSet::new(),
        }
    }

    /// A look ended at `at`: the poll's schedule says when the next is.
    pub(super) fn looked(&mut self, at: Duration) {
        self.last = at;
        self.next = self.after(at);
    }

    /// A wait began after none: the poll's schedule starts over from the last look.
    fn restart(&mut self) {
        self.poll.reset(self.last);
        self.next = self.after(self.last);
    }

    /// The poll's next look after a look (or the start of the schedule) at `ended_at`.
    fn after(&mut self, ended_at: Duration) -> NextLook {
        match self.poll.next_at(ended_at) {
            Some(at) => NextLook::At(at),
            None => NextLook::Over,
        }
    }
}

/// Whether storage was last told that this owner has waiters (`Storage::waiting`), and since
/// when it has had none: the marker lingers a while ([`MARKER_LINGER`]) after the last.
#[derive(Default)]
pub(super) struct Marker {
    up: bool,
    idle_since: Option<Duration>,
}

impl Marker {
    /// How long until the marker, still up with no waiter, is to be taken down.
    pub(super) fn left(&self, now: Duration) -> Option<Duration> {
        let since = self.idle_since.filter(|_| self.up)?;
        Some(MARKER_LINGER.saturating_sub(now.saturating_sub(since)))
    }

    /// Whether the marker, up with no waiter (`waiting` false) since a while before `now`, is
    /// to be taken down now.
    pub(super) fn lingered(&mut self, waiting: bool, now: Duration) -> bool {
        if waiting || !self.up {
            self.idle_since = None;
            return false;
        }
        let since = *self.idle_since.get_or_insert(now);
        now.saturating_sub(since) >= MARKER_LINGER
    }
}

impl<S: Storage> Worker<S> {
    /// When the poll looks next, if it looks at all: only while this owner has waiters. When a
    /// wait begins after none, the poll's schedule starts over from the last look, so that the
    /// first look comes one delay after it (at once if that was long ago). And at the latest
    /// when another owner's row on a watched key runs out, however long the poll's delay (or
    /// if its schedule has ended): a crashed owner's lock passes on when its lease ends. (Not
    /// right after a look that failed: the poll's schedule spaces the tries then.)
    pub(super) fn next_look(&mut self) -> Option<Duration> {
        if !self.has_waiters() {
            self.looks.next = NextLook::Idle;
            return None;
        }
        if let NextLook::Idle = self.looks.next {
            self.looks.restart();
        }
        let polled = match self.looks.next {
            NextLook::At(at) => Some(at),
            NextLook::Idle | NextLook::Over => None,
        };
        let freed = self
            .waits
            .first_deadline()
            .filter(|_| !self.looks.all)
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
            && (self.looks.poked || next.is_some_and(|at| self.common.clock.monotonic() >= at))
    }

    /// Tells storage whether this owner has waiters, when that changes.
    pub(super) fn mark_waiting(&mut self, waiting: bool) {
        if waiting != self.marker.up {
            self.marker.up = waiting;
            self.marker.idle_since = None;
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
        if std::mem::take(&mut self.looks.poked) && self.common.watchers.load(Ordering::SeqCst) > 0
        {
            // Poked: another manager committed (or this one doubts a commit). Watchers of every
            // change read again at once, their reads queued behind this look, rather than
            // after the check below has said what changed: they read everything anyway.
            self.common.changed.notify(usize::MAX);
        }
        if let Err(error) = self.try_look() {
            tracing::warn!(%error, "looking for other processes' changes failed; will retry");
            self.looks.all = true;
        }
    }

    pub(super) fn try_look(&mut self) -> Result<(), LockError> {
        let changes = self.storage.changes()?;
        Counters::bump(&self.counters().change_checks);
        let now = self.now();
        let look_all = std::mem::take(&mut self.looks.all);
        // Keys on which another owner's lease has run out since they were read.
        let (due, refused_due) = self.waits.due(now);
        let mut keys: BTreeSet<String> = match &changes {
            _ if look_all => self.waits.queued_keys().cloned().collect(),
            Changes::Unknown => self.waits.queued_keys().cloned().collect(),
            Changes::Keys(hashes) => self.waits.named(hashes),
            Changes::Nothing => BTreeSet::new(),
        };
        keys.extend(due);
        keys.append(&mut self.looks.own_changes);
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
            self.decisions.pass = read;
            let ((), freed) = self.transaction(&read_list, |_, _| Ok(()))?;
            self.after_commit(&freed);
        }
        Ok(())
    }
}
