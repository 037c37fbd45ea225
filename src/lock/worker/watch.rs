//! What an owner waits for, kept so that a look costs in proportion to what changed, not to how
//! many requests wait: the owner's queued requests by ticket and by key, the keys that requests
//! without a queue position were refused on, and per watched key the time at which it may be
//! freed without anyone writing (when the first other owner's row there runs out).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use crate::lock::backend::codec::key_hash;
use crate::lock::worker::protocol::WaitSlot;

/// Whether a read of keys was a look on behalf of this owner's waits (see [`Waits::note`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Look {
    /// A look read the key for the waits on it, and promoted what it could.
    Done,
    /// Some other read (of a request being refused, or about to queue).
    Pending,
}

/// A queued request of this owner.
pub(crate) struct Waiting {
    pub(crate) slot: Arc<WaitSlot>,
    pub(crate) keys: Vec<String>,
}

#[derive(Default)]
pub(crate) struct Waits {
    /// In ticket order, so that waits are settled, and their callers woken, in an order that
    /// is the same every run (a simulation replays it).
    by_ticket: BTreeMap<u64, Waiting>,
    /// Key -> the tickets of the queued requests on it.
    by_key: HashMap<String, BTreeSet<u64>>,
    /// Key digest -> the queued keys with that digest (what announcements name).
    by_hash: HashMap<i64, BTreeSet<String>>,
    /// Keys that requests without a queue position were refused on since their callers were
    /// last woken.
    refused: BTreeSet<String>,
    /// Key -> when it may be freed by a lease running out (`i64::MAX`: never).
    deadline: HashMap<String, i64>,
    /// The same, ordered by time.
    by_time: BTreeSet<(i64, String)>,
    /// When queued requests' heartbeats are due to start (the clock's monotonic time), in that
    /// order, by ticket; entries of waits that are over are dropped lazily (`beat_at`).
    beats: VecDeque<(Duration, u64)>,
}

impl Waits {
    /// Whether no request of this owner is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_ticket.is_empty()
    }

    pub(crate) fn insert(&mut self, ticket: u64, slot: Arc<WaitSlot>, keys: Vec<String>) {
        for key in &keys {
            self.by_key.entry(key.clone()).or_default().insert(ticket);
            self.by_hash
                .entry(key_hash(key))
                .or_default()
                .insert(key.clone());
        }
        self.by_ticket.insert(ticket, Waiting { slot, keys });
    }

    /// Ends the wait of `ticket`; returns its slot.
    pub(crate) fn remove(&mut self, ticket: u64) -> Option<Arc<WaitSlot>> {
        self.end(ticket).map(|waiting| waiting.slot)
    }

    /// Ends the wait of `ticket`; returns what it was.
    pub(crate) fn end(&mut self, ticket: u64) -> Option<Waiting> {
        let waiting = self.by_ticket.remove(&ticket)?;
        for key in &waiting.keys {
            let Some(tickets) = self.by_key.get_mut(key) else {
                continue;
            };
            tickets.remove(&ticket);
            if tickets.is_empty() {
                self.by_key.remove(key);
                let hash = key_hash(key);
                if let Some(keys) = self.by_hash.get_mut(&hash) {
                    keys.remove(key);
                    if keys.is_empty() {
                        self.by_hash.remove(&hash);
                    }
                }
                self.forget_if_unwatched(key);
            }
        }
        Some(waiting)
    }

    /// Ends every wait; returns their slots.
    pub(crate) fn drain(&mut self) -> Vec<Arc<WaitSlot>> {
        let tickets: Vec<u64> = self.by_ticket.keys().copied().collect();
        tickets
            .into_iter()
            .filter_map(|ticket| self.remove(ticket))
            .collect()
    }

    /// Notes that the heartbeat of the queued request `ticket` is due to start at `at`, no
    /// earlier than any noted before. The entries of waits that are over go from the front as
    /// they come due, and all at once when they outnumber the waits: what is kept follows how
    /// many wait, not how many came and went while a long wait stood first.
    pub(crate) fn beat_at(&mut self, ticket: u64, at: Duration) {
        self.beats.push_back((at, ticket));
        if self.beats.len() > 2 * self.by_ticket.len() + 64 {
            let by_ticket = &self.by_ticket;
            self.beats
                .retain(|(_, ticket)| by_ticket.contains_key(ticket));
        }
    }

    /// When the next heartbeat is due to start, of a request still waiting.
    pub(crate) fn next_beat(&mut self) -> Option<Duration> {
        while let Some(&(at, ticket)) = self.beats.front() {
            if self.by_ticket.contains_key(&ticket) {
                return Some(at);
            }
            self.beats.pop_front();
        }
        None
    }

    /// The next request whose heartbeat is due to start by `now`, taken off the list: its
    /// ticket and slot.
    pub(crate) fn due_beat(&mut self, now: Duration) -> Option<(u64, Arc<WaitSlot>)> {
        self.next_beat().filter(|at| *at <= now)?;
        let (_, ticket) = self.beats.pop_front()?;
        Some((ticket, self.by_ticket.get(&ticket)?.slot.clone()))
    }

    /// Every queued request: its ticket and slot.
    pub(crate) fn all(&self) -> impl Iterator<Item = (u64, &Arc<WaitSlot>)> {
        self.by_ticket
            .iter()
            .map(|(&ticket, waiting)| (ticket, &waiting.slot))
    }

    /// The queued requests on `key`: ticket and slot.
    pub(crate) fn on(&self, key: &str) -> impl Iterator<Item = (u64, &Arc<WaitSlot>)> {
        self.by_key
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|ticket| Some((*ticket, &self.by_ticket.get(ticket)?.slot)))
    }

    /// Every key a queued request waits on.
    pub(crate) fn queued_keys(&self) -> impl Iterator<Item = &String> {
        self.by_key.keys()
    }

    /// The keys among `keys` on which a queued request on several keys waits.
    pub(crate) fn spanning(&self, keys: &[String]) -> Vec<String> {
        (keys.iter())
            .filter(|key| {
                (self.by_key.get(*key).into_iter().flatten())
                    .any(|ticket| self.by_ticket.get(ticket).is_some_and(|w| w.keys.len() > 1))
            })
            .cloned()
            .collect()
    }

    /// The queued keys among those `hashes` name.
    pub(crate) fn named(&self, hashes: &[i64]) -> BTreeSet<String> {
        hashes
            .iter()
            .filter_map(|hash| self.by_hash.get(hash))
            .flatten()
            .cloned()
            .collect()
    }

    /// Requests without a queue position were refused on `keys`.
    pub(crate) fn refuse(&mut self, keys: &[String]) {
        self.refused.extend(keys.iter().cloned());
    }

    /// Whether requests were refused since `take_refused`.
    pub(crate) fn any_refused(&self) -> bool {
        !self.refused.is_empty()
    }

    /// Their callers are woken (and will be refused again if still blocked): forgets the keys.
    pub(crate) fn take_refused(&mut self) {
        for key in std::mem::take(&mut self.refused) {
            self.forget_if_unwatched(&key);
        }
    }

    /// Remembers that `key` may be freed at `at` (the first other owner's row there runs out).
    /// A look sets the time; any other read only brings it forward: a key whose time has come
    /// must be looked at, even if by then the row that blocked a wait there is gone (deleted as
    /// lapsed by someone who had no reason to promote that wait).
    pub(crate) fn note(&mut self, key: &str, at: i64, look: Look) {
        let deadline = match (self.deadline.get(key), look) {
            (Some(&old), Look::Pending) => old.min(at),
            _ => at,
        };
        if let Some(old) = self.deadline.insert(key.to_owned(), deadline) {
            self.by_time.remove(&(old, key.to_owned()));
        }
        self.by_time.insert((deadline, key.to_owned()));
    }

    /// The watched keys whose time has come by `now`, and the queued keys never read. Keys no
    /// longer watched are forgotten on the way.
    pub(crate) fn due(&mut self, now: i64) -> (BTreeSet<String>, bool) {
        let mut due = BTreeSet::new();
        let mut refused_due = false;
        let mut stale = Vec::new();
        for (_, key) in self.by_time.range(..(now.saturating_add(1), String::new())) {
            // A key may be both: a queued request waits on it, and a request without a queue
            // position was refused on it. Both must hear that it may be free.
            let queued = self.by_key.contains_key(key);
            let refused = self.refused.contains(key);
            if queued {
                due.insert(key.clone());
            }
            refused_due |= refused;
            if !queued && !refused {
                stale.push(key.clone());
            }
        }
        for key in stale {
            self.forget(&key);
        }
        due.extend(
            self.by_key
                .keys()
                .filter(|key| !self.deadline.contains_key(*key))
                .cloned(),
        );
        (due, refused_due)
    }

    /// The earliest time at which a watched key may be freed, if any is known.
    pub(crate) fn first_deadline(&self) -> Option<i64> {
        self.by_time
            .iter()
            .map(|&(at, _)| at)
            .find(|&at| at != i64::MAX)
    }

    fn forget_if_unwatched(&mut self, key: &str) {
        if !self.by_key.contains_key(key) && !self.refused.contains(key) {
            self.forget(key);
        }
    }

    fn forget(&mut self, key: &str) {
        if let Some(at) = self.deadline.remove(key) {
            self.by_time.remove(&(at, key.to_owned()));
        }
    }

    /// How many keys have a deadline (for tests: nothing is kept for keys no longer watched).
    #[cfg(test)]
    fn remembered(&self) -> usize {
        debug_assert_eq!(self.deadline.len(), self.by_time.len());
        self.deadline.len()
    }
}

/// For each of `keys`, the earliest expiry among `others` (other owners' live rows, by key and
/// expiry) on it; `i64::MAX` if none.
pub(crate) fn first_expiries<'a, 'r>(
    keys: impl IntoIterator<Item = &'a String>,
    others: impl Iterator<Item = (&'r str, i64)> + Clone,
) -> BTreeMap<&'a String, i64> {
    keys.into_iter()
        .map(|key| {
            let first = (others.clone())
                .filter(|(on, _)| on == key)
                .map(|(_, at)| at)
                .min()
                .unwrap_or(i64::MAX);
            (key, first)
        })
        .collect()
}

/// The rows of `rows` of other owners than `owner`, by key and expiry.
pub(crate) fn others_rows<'r>(
    owner: &'r str,
    rows: &'r [crate::lock::grant::RowView],
) -> impl Iterator<Item = (&'r str, i64)> + Clone + 'r {
    (rows.iter())
        .filter(move |row| &*row.owner != owner)
        .map(|row| (&*row.key, row.expires_at))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(names: &[&str]) -> Vec<String> {
        names.iter().map(|k| (*k).to_owned()).collect()
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|k| (*k).to_owned()).collect()
    }

    #[test]
    fn heartbeats_come_due_in_order_and_only_while_their_request_waits() {
        let at = Duration::from_millis;
        let mut waits = Waits::default();
        for ticket in 1..=3 {
            waits.insert(ticket, Arc::default(), keys(&["k"]));
            waits.beat_at(ticket, at(10 * ticket));
        }
        assert_eq!(waits.next_beat(), Some(at(10)));
        assert!(waits.due_beat(at(9)).is_none(), "due before its time");
        // The wait of 1 is over: its beat never comes, and 2's is next.
        waits.remove(1);
        assert_eq!(waits.next_beat(), Some(at(20)));
        assert_eq!(waits.due_beat(at(25)).map(|(t, _)| t), Some(2));
        assert!(waits.due_beat(at(25)).is_none(), "each beat comes due once");
        assert_eq!(waits.due_beat(at(30)).map(|(t, _)| t), Some(3));
        assert_eq!(waits.next_beat(), None);
    }

    #[test]
    fn beats_kept_follow_the_waits_not_how_many_came_and_went() {
        let at = Duration::from_millis;
        let mut waits = Waits::default();
        // A long wait stands first, its beat far off, while many short ones come and go.
        waits.insert(0, Arc::default(), keys(&["k"]));
        waits.beat_at(0, at(1_000_000));
        for ticket in 1..10_000 {
            waits.insert(ticket, Arc::default(), keys(&["k"]));
            waits.beat_at(ticket, at(1_000_000 + ticket));
            waits.remove(ticket);
            // At most two wait at once.
            assert!(
                waits.beats.len() <= 2 * 2 + 64,
                "{} kept",
                waits.beats.len()
            );
        }
        assert_eq!(waits.next_beat(), Some(at(1_000_000)));
    }

    #[test]
    fn a_key_is_due_when_its_time_comes_and_only_while_watched() {
        let mut waits = Waits::default();
        waits.note("a", 10, Look::Pending);
        waits.insert(1, Arc::default(), keys(&["a", "b"]));
        // "b" was never read: due at once. "a" at 10.
        assert_eq!(waits.due(5), (set(&["b"]), false));
        waits.note("b", 20, Look::Done);
        assert_eq!(waits.due(10), (set(&["a"]), false));
        assert_eq!(waits.due(25), (set(&["a", "b"]), false));
        assert!(waits.remove(1).is_some());
        assert_eq!(waits.due(25), (set(&[]), false));
        assert_eq!(waits.remembered(), 0);
    }

    #[test]
    fn only_a_look_moves_a_deadline_later() {
        let mut waits = Waits::default();
        waits.insert(1, Arc::default(), keys(&["a"]));
        waits.note("a", 10, Look::Done);
        waits.note("a", 50, Look::Pending);
        assert_eq!(waits.due(10).0, set(&["a"]));
        waits.note("a", 50, Look::Done);
        assert!(waits.due(10).0.is_empty());
        waits.note("a", 30, Look::Pending);
        assert_eq!(waits.due(30).0, set(&["a"]));
    }

    #[test]
    fn refused_keys_are_watched_until_their_callers_are_woken() {
        let mut waits = Waits::default();
        waits.refuse(&keys(&["r"]));
        waits.note("r", 10, Look::Pending);
        assert!(waits.any_refused());
        assert_eq!(waits.due(10), (set(&[]), true));
        waits.take_refused();
        assert!(!waits.any_refused());
        assert_eq!(waits.due(10), (set(&[]), false));
        assert_eq!(waits.remembered(), 0);
    }

    /// A key that a queued request waits on and a request without a queue position was refused
    /// on, when its time comes, is due for both: the queued one's key is read, and the refused
    /// one's caller is woken. (Found by the simulated model test: a `many` refused on a key that
    /// a `many_queued` of the same manager also waited on waited for ever once the holder's
    /// lease ran out.)
    #[test]
    fn a_key_both_queued_on_and_refused_on_is_due_for_both() {
        let mut waits = Waits::default();
        waits.insert(1, Arc::default(), keys(&["k"]));
        waits.refuse(&keys(&["k"]));
        waits.note("k", 10, Look::Pending);
        assert_eq!(waits.due(9), (set(&[]), false));
        assert_eq!(waits.due(10), (set(&["k"]), true));
    }

    #[test]
    fn announcements_find_the_queued_keys_they_name() {
        let mut waits = Waits::default();
        waits.insert(1, Arc::default(), keys(&["a", "b"]));
        waits.insert(2, Arc::default(), keys(&["b"]));
        assert_eq!(waits.named(&[key_hash("b"), key_hash("z")]), set(&["b"]));
        assert_eq!(waits.on("b").map(|(t, _)| t).collect::<Vec<_>>(), [1, 2]);
        waits.remove(2);
        assert_eq!(waits.named(&[key_hash("b")]), set(&["b"]));
        waits.remove(1);
        assert!(waits.named(&[key_hash("a"), key_hash("b")]).is_empty());
        assert!(waits.is_empty());
        assert_eq!(waits.queued_keys().count(), 0);
    }
}
