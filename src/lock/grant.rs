//! The grant rule, as pure functions over rows. No SQL here: storage loads rows, asks these
//! functions, and writes what they decide.
//!
//! Per key, counting only live rows (lease not expired), held and waiting alike:
//!
//! | request   | granted iff                                                  |
//! |-----------|--------------------------------------------------------------|
//! | shared    | no exclusive row on the key has a smaller ticket             |
//! | exclusive | no row at all on the key has a smaller ticket                |
//!
//! A request on several keys (one ticket) is granted iff it is granted on every key. Because the
//! rule looks at rows with *smaller* tickets only, and does not care whether they are held or
//! waiting, promoting one request never changes whether another can be promoted: promotion is a
//! single pass in any order.

use std::collections::BTreeMap;

use super::Mode;

/// What the rule needs to know of one live row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RowView {
    pub(crate) key: String,
    pub(crate) mode: Mode,
    pub(crate) ticket: u64,
    pub(crate) held: bool,
}

/// Whether a request for `mode` with `ticket` is granted on a key whose live rows have these
/// modes and tickets (its own row, if present, is ignored: its ticket is not smaller).
pub(crate) fn grantable(
    mode: Mode,
    ticket: u64,
    rows: impl IntoIterator<Item = (Mode, u64)>,
) -> bool {
    rows.into_iter()
        .filter(|&(_, other)| other < ticket)
        .all(|(other_mode, _)| mode == Mode::Shared && other_mode == Mode::Shared)
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
                .filter(|row| row.key == key)
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
            .entry(row.key.as_str())
            .or_default()
            .push((row.mode, row.ticket));
    }
    // ticket -> granted on every key seen so far
    let mut verdicts: BTreeMap<u64, bool> = BTreeMap::new();
    for row in rows.iter().filter(|row| !row.held) {
        let on_key = grantable(
            row.mode,
            row.ticket,
            by_key[row.key.as_str()].iter().copied(),
        );
        *verdicts.entry(row.ticket).or_insert(true) &= on_key;
    }
    verdicts
        .into_iter()
        .filter_map(|(ticket, granted)| granted.then_some(ticket))
        .collect()
}

/// The queue position of each waiting request on `key` (0 = next in line), by ticket.
pub(crate) fn queue_positions<'a>(
    key: &str,
    rows: impl IntoIterator<Item = &'a RowView>,
) -> BTreeMap<u64, usize> {
    let mut waiting: Vec<u64> = rows
        .into_iter()
        .filter(|row| row.key == key && !row.held)
        .map(|row| row.ticket)
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

    fn row(key: &str, mode: Mode, ticket: u64, held: bool) -> RowView {
        RowView {
            key: key.to_owned(),
            mode,
            ticket,
            held,
        }
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
        let positions = queue_positions("k", &rows);
        assert_eq!(positions.get(&4), Some(&0));
        assert_eq!(positions.get(&7), Some(&1));
        assert_eq!(positions.get(&1), None);
    }
}
