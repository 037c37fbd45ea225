//! The grant rule, as pure functions over rows. No SQL here: storage loads rows, asks these
//! functions, and writes what they decide.
//!
//! Per key, counting only live rows (lease not expired), held and waiting alike:
//!
//! | request                   | granted iff, of the rows on the key with a smaller ticket   |
//! |---------------------------|-------------------------------------------------------------|
//! | shared                    | every one is shared                                         |
//! | exclusive                 | there is none                                               |
//! | `count` of `limit` permits| every one is of permits, and their counts plus `count` are  |
//! |                           | at most `limit` (the smallest limit any of them names)      |
//!
//! A request on several keys (one ticket) is granted iff it is granted on every key. Because the
//! rule looks at rows with *smaller* tickets only, and does not care whether they are held or
//! waiting, promoting one request never changes whether another can be promoted: promotion is a
//! single pass in any order. For permits, counting the waiting rows ahead too is what makes the
//! queue strictly first in, first out: a request that does not fit holds back every one behind
//! it, however small, since their sums include its count.
//!
//! A key is used for shared and exclusive requests or for permits, never both, and with one
//! limit: a request that would mix them is refused before it is written ([`misfit`]). The rule
//! still judges mixed rows safely (a mode meets only its own kind ahead of it).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::Mode;

/// What the rule, and the worker around it, need to know of one live row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RowView {
    /// Shared, not owned: a decision copies rows often (SQLite's `Known` hands out copies of
    /// what it remembers), and a copy then costs no allocation.
    pub(crate) key: Arc<str>,
    pub(crate) mode: Mode,
    pub(crate) ticket: u64,
    pub(crate) held: bool,
    pub(crate) owner: Arc<str>,
    pub(crate) expires_at: i64,
    /// Every key of its request, when that is more than this row's own (a `many`) and the row
    /// waits; else empty (a held row's other keys are never needed).
    pub(crate) keys: Vec<String>,
}

impl RowView {
    /// The keys of this row's request.
    pub(crate) fn request_keys(&self) -> impl Iterator<Item = &str> {
        let own = self.keys.is_empty().then_some(&*self.key);
        own.into_iter().chain(self.keys.iter().map(String::as_str))
    }
}

/// Whether a request for `mode` with `ticket` is granted on a key whose live rows have these
/// modes and tickets (its own row, if present, is ignored: its ticket is not smaller).
pub(crate) fn grantable(
    mode: Mode,
    ticket: u64,
    rows: impl IntoIterator<Item = (Mode, u64)>,
) -> bool {
    let (mut taken, mut limit) = match mode {
        Mode::Permits { count, limit } => (u64::from(count), limit),
        Mode::Shared | Mode::Exclusive => (0, 0),
    };
    for (other, _) in rows.into_iter().filter(|&(_, other)| other < ticket) {
        match (mode, other) {
            (Mode::Shared, Mode::Shared) => {}
            (
                Mode::Permits { .. },
                Mode::Permits {
                    count,
                    limit: theirs,
                },
            ) => {
                taken += u64::from(count);
                limit = limit.min(theirs);
            }
            _ => return false,
        }
    }
    taken <= u64::from(limit)
}

/// Why `requests` may not be written beside `rows` (every live row on their keys), if they may
/// not: a request of permits on a key with shared or exclusive rows, or the reverse, or one
/// naming another limit than the key's rows name. `None` if they fit.
pub(crate) fn misfit<'a>(
    requests: impl IntoIterator<Item = (&'a str, Mode)>,
    rows: &[RowView],
) -> Option<String> {
    requests.into_iter().find_map(|(key, mode)| {
        (rows.iter().filter(|row| &*row.key == key))
            .find_map(|row| misfit_beside(key, mode, row.mode))
    })
}

/// Why a request for `mode` on `key` may not be written beside a live row of `theirs` there,
/// if it may not (see [`misfit`]).
pub(crate) fn misfit_beside(key: &str, mode: Mode, theirs: Mode) -> Option<String> {
    match (mode, theirs) {
        (Mode::Permits { limit, .. }, Mode::Permits { limit: theirs, .. }) if limit != theirs => {
            Some(format!(
                "the key {key:?} has {theirs} permits, as its requests say; this one says {limit}"
            ))
        }
        (Mode::Permits { .. }, Mode::Shared | Mode::Exclusive) => Some(format!(
            "the key {key:?} is locked in {theirs} mode: permits of it cannot be asked for until \
             no shared or exclusive request is on it"
        )),
        (Mode::Shared | Mode::Exclusive, Mode::Permits { limit, .. }) => Some(format!(
            "the key {key:?} is used for permits (a limit of {limit}): it cannot be locked in \
             {mode} mode until no permits request is on it"
        )),
        _ => None,
    }
}

/// Whether a new request (whose ticket is larger than every existing one) would be granted now
/// on every key it names; `rows` are the live rows on those keys.
pub(crate) fn grantable_now<'a>(
    requests: impl IntoIterator<Item = (&'a str, Mode)>,
    rows: &[RowView],
) -> bool {
    requests.into_iter().all(|(key, mode)| {
        grantable(
            mode,
            u64::MAX,
            rows.iter()
                .filter(|row| &*row.key == key)
                .map(|row| (row.mode, row.ticket)),
        )
    })
}

/// The tickets of the waiting requests that can be promoted now, ascending. `rows` must hold
/// every live row on every key that has a waiting row.
pub(crate) fn promotable(rows: &[RowView]) -> Vec<u64> {
    let mut by_key: BTreeMap<&str, Vec<(Mode, u64)>> = BTreeMap::new();
    for row in rows {
        by_key
            .entry(&*row.key)
            .or_default()
            .push((row.mode, row.ticket));
    }
    // ticket -> granted on every key seen so far
    let mut verdicts: BTreeMap<u64, bool> = BTreeMap::new();
    for row in rows.iter().filter(|row| !row.held) {
        let on_key = grantable(row.mode, row.ticket, by_key[&*row.key].iter().copied());
        *verdicts.entry(row.ticket).or_insert(true) &= on_key;
    }
    verdicts
        .into_iter()
        .filter_map(|(ticket, granted)| granted.then_some(ticket))
        .collect()
}

/// The keys, not among `have`, that the waiting requests in `rows` also wait on: what must be
/// read before `promotable` can judge them.
pub(crate) fn other_keys(rows: &[RowView], have: &BTreeSet<String>) -> BTreeSet<String> {
    rows.iter()
        .filter(|row| !row.held)
        .flat_map(RowView::request_keys)
        .filter(|key| !have.contains(*key))
        .map(str::to_owned)
        .collect()
}

/// Like `promotable`, for `rows` that hold every live row of the keys in `read` and no other:
/// the waiting requests that can be promoted now and whose keys were all read (a request with
/// a key outside `read` cannot be judged from these rows).
pub(crate) fn promotable_within(rows: &[RowView], read: &BTreeSet<String>) -> Vec<u64> {
    let judged: BTreeSet<u64> = rows
        .iter()
        .filter(|row| !row.held && row.request_keys().all(|key| read.contains(key)))
        .map(|row| row.ticket)
        .collect();
    let mut tickets = promotable(rows);
    tickets.retain(|ticket| judged.contains(ticket));
    tickets
}

/// The queue position of each waiting request on `key` (0 = next in line), by ticket, from
/// rows given as (key, ticket, held).
pub(crate) fn queue_positions<'a>(
    key: &str,
    rows: impl IntoIterator<Item = (&'a str, u64, bool)>,
) -> BTreeMap<u64, usize> {
    let mut waiting: Vec<u64> = rows
        .into_iter()
        .filter(|&(on, _, held)| on == key && !held)
        .map(|(_, ticket, _)| ticket)
        .collect();
    waiting.sort_unstable();
    waiting.dedup();
    waiting
        .into_iter()
        .enumerate()
        .map(|(at, ticket)| (ticket, at))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use Mode::{Exclusive as X, Shared as S};

    /// `count` of `limit` permits.
    fn p(count: u32, limit: u32) -> Mode {
        Mode::Permits { count, limit }
    }

    fn row(key: &str, mode: Mode, ticket: u64, held: bool) -> RowView {
        RowView {
            key: key.into(),
            mode,
            ticket,
            held,
            owner: "o".into(),
            expires_at: 1,
            keys: Vec::new(),
        }
    }

    /// A row of a request on all of `keys`.
    fn many(key: &str, keys: &[&str], mode: Mode, ticket: u64, held: bool) -> RowView {
        RowView {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            ..row(key, mode, ticket, held)
        }
    }

    fn set(keys: &[&str]) -> BTreeSet<String> {
        keys.iter().map(|k| (*k).to_owned()).collect()
    }

    #[test]
    fn a_request_with_a_key_not_read_is_not_judged() {
        // Ticket 2 waits on "a" and "b"; only "a" was read: it may be blocked on "b".
        let rows = [many("a", &["a", "b"], X, 2, false), row("a", S, 3, false)];
        assert_eq!(other_keys(&rows, &set(&["a"])), set(&["b"]));
        assert!(promotable_within(&rows, &set(&["a"])).is_empty());
        // With "b" read (and free), 2 goes; 3, shared behind the exclusive 2, waits.
        let mut all = rows.to_vec();
        all.push(many("b", &["a", "b"], X, 2, false));
        assert_eq!(promotable_within(&all, &set(&["a", "b"])), vec![2]);
        assert!(other_keys(&all, &set(&["a", "b"])).is_empty());
    }

    #[test]
    fn single_key_requests_are_judged_by_their_key_alone() {
        let rows = [row("a", S, 1, true), row("a", S, 2, false)];
        assert_eq!(promotable_within(&rows, &set(&["a"])), vec![2]);
        assert!(other_keys(&rows, &set(&["a"])).is_empty());
    }

    #[test]
    fn shared_is_blocked_only_by_an_earlier_exclusive() {
        assert!(grantable(S, 5, [(S, 1), (S, 2), (S, 9)]));
        assert!(!grantable(S, 5, [(S, 1), (X, 3)]));
        assert!(grantable(S, 5, [(X, 7)]));
    }

    #[test]
    fn exclusive_is_blocked_by_any_earlier_row() {
        assert!(!grantable(X, 5, [(S, 1)]));
        assert!(!grantable(X, 5, [(X, 4)]));
        assert!(grantable(X, 5, [(S, 6), (X, 8)]));
        assert!(grantable(X, 5, []));
    }

    #[test]
    fn exhaustive_over_small_queues() {
        // Every queue of up to 4 earlier rows, each shared or exclusive: the rule is exactly
        // "shared needs all earlier shared; exclusive needs none earlier".
        for len in 0..=4u32 {
            for bits in 0..(1u32 << len) {
                let rows: Vec<(Mode, u64)> = (0..len)
                    .map(|i| (if bits >> i & 1 == 1 { X } else { S }, u64::from(i)))
                    .collect();
                assert_eq!(grantable(S, 10, rows.clone()), bits == 0, "{rows:?}");
                assert_eq!(grantable(X, 10, rows.clone()), len == 0, "{rows:?}");
            }
        }
    }

    #[test]
    fn permits_fit_while_the_counts_ahead_leave_room() {
        assert!(grantable(p(1, 3), 5, [(p(1, 3), 1), (p(1, 3), 2)]));
        assert!(!grantable(p(1, 3), 5, [(p(1, 3), 1), (p(2, 3), 2)]));
        assert!(grantable(p(3, 3), 5, []));
        assert!(
            grantable(p(3, 3), 5, [(p(1, 3), 7)]),
            "later rows do not count"
        );
        // Another kind ahead blocks, whatever the counts; and permits block the other kinds.
        assert!(!grantable(p(1, 3), 5, [(S, 1)]));
        assert!(!grantable(p(1, 3), 5, [(X, 1)]));
        assert!(!grantable(S, 5, [(p(1, 3), 1)]));
        assert!(!grantable(X, 5, [(p(1, 3), 1)]));
        // Rows that name a smaller limit (never written together: `misfit`) are judged by it.
        assert!(!grantable(p(1, 3), 5, [(p(1, 1), 1)]));
    }

    #[test]
    fn permits_exhaustive_over_small_queues() {
        // Every queue of up to 4 earlier permit rows with counts 1 to 3, limit 4: granted iff
        // the counts ahead plus its own fit; never when any earlier row is of another kind.
        for len in 0..=4u32 {
            for code in 0..3u32.pow(len) {
                let counts: Vec<u32> = (0..len).map(|i| code / 3u32.pow(i) % 3 + 1).collect();
                let rows: Vec<(Mode, u64)> = (counts.iter().enumerate())
                    .map(|(i, &count)| (p(count, 4), i as u64))
                    .collect();
                let ahead: u32 = counts.iter().sum();
                for count in 1..=4 {
                    let fits = ahead + count <= 4;
                    assert_eq!(grantable(p(count, 4), 10, rows.clone()), fits, "{rows:?}");
                    for other in [S, X] {
                        let mut mixed = rows.clone();
                        mixed.push((other, 9));
                        assert!(!grantable(p(count, 4), 10, mixed), "{rows:?} and {other}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_large_permits_request_at_the_head_is_not_passed_by_smaller_ones() {
        // Limit 3: two held, a request of 2 at the head, a request of 1 behind it.
        let rows = [
            row("k", p(2, 3), 1, true),
            row("k", p(2, 3), 2, false),
            row("k", p(1, 3), 3, false),
        ];
        assert!(
            promotable(&rows).is_empty(),
            "1 would fit beside the held 2, but waits"
        );
        // The held 2 released: both fit, and go together.
        assert_eq!(promotable(&rows[1..]), vec![2, 3]);
    }

    #[test]
    fn a_misfit_is_a_request_of_another_kind_or_limit() {
        let rows = [row("s", S, 1, true), row("p", p(1, 3), 2, false)];
        assert_eq!(misfit([("p", p(2, 3)), ("s", S)], &rows), None);
        assert_eq!(misfit([("free", p(1, 9))], &rows), None);
        let said =
            |requests: &[(&str, Mode)]| misfit(requests.iter().copied(), &rows).expect("a misfit");
        assert!(said(&[("p", p(1, 4))]).contains("has 3 permits"));
        assert!(said(&[("s", p(1, 3))]).contains("locked in shared mode"));
        assert!(said(&[("p", X)]).contains("used for permits (a limit of 3)"));
    }

    #[test]
    fn writer_preference_blocks_later_readers() {
        // S1 held, X2 waiting, S3 waiting: only nothing can be promoted.
        let rows = [
            row("k", S, 1, true),
            row("k", X, 2, false),
            row("k", S, 3, false),
        ];
        assert!(promotable(&rows).is_empty());
        // S1 released: X2 goes, S3 still waits behind it.
        assert_eq!(promotable(&rows[1..]), vec![2]);
    }

    #[test]
    fn leading_shared_run_is_promoted_together() {
        let rows = [
            row("k", X, 1, true),
            row("k", S, 2, false),
            row("k", S, 3, false),
            row("k", X, 4, false),
            row("k", S, 5, false),
        ];
        assert!(promotable(&rows).is_empty());
        assert_eq!(promotable(&rows[1..]), vec![2, 3]);
    }

    #[test]
    fn a_request_on_several_keys_needs_every_key() {
        let rows = [
            row("a", X, 1, true),
            row("a", S, 2, false),
            row("b", X, 2, false),
            row("b", S, 3, false),
        ];
        // Ticket 2 is blocked on "a", so it holds "b" back too; 3 waits behind 2 on "b".
        assert!(promotable(&rows).is_empty());
        assert_eq!(promotable(&rows[1..]), vec![2]);
    }

    #[test]
    fn grantable_now_checks_every_named_key() {
        let rows = [row("a", S, 1, true), row("b", X, 2, true)];
        assert!(grantable_now([("a", S)], &rows));
        assert!(!grantable_now([("a", X)], &rows));
        assert!(!grantable_now([("a", S), ("b", S)], &rows));
        assert!(grantable_now([("c", X)], &rows));
    }

    #[test]
    fn queue_positions_count_waiting_requests_in_ticket_order() {
        let rows = [
            row("k", S, 1, true),
            row("k", X, 7, false),
            row("k", S, 4, false),
            row("j", S, 2, false),
        ];
        let positions = queue_positions("k", rows.iter().map(|r| (&*r.key, r.ticket, r.held)));
        assert_eq!(positions.get(&4), Some(&0));
        assert_eq!(positions.get(&7), Some(&1));
        assert_eq!(positions.get(&1), None);
    }
}
