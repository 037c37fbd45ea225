//! What a simulated store saw (`LockHistory`), and the oracle over it (`check_locks`).
//!
//! The store records each write transaction's changes when it commits (a transaction rolled
//! back left nothing, so it records nothing), and the managers record what their callers were
//! told of a release, and when one was killed, stopped or closed. `check_locks` replays the rows
//! from those events and judges every grant by the grant rule itself (`lock::grant`), on the
//! rows live at that moment as the store judged them.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use crate::lock::grant::grantable;
use crate::lock::Mode;

/// One thing a simulated store saw, in the order it happened. Times (`at`, `expires_at`) are
/// the store's, in microseconds since the Unix epoch: the clock leases are judged by.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockEvent {
    /// An owner wrote rows under a new ticket, one per key: held (granted at once) or waiting.
    Requested {
        /// The owner ([`LockManager::owner_id`](crate::LockManager::owner_id)).
        owner: String,
        /// The request's ticket: its fencing token.
        ticket: u64,
        /// Its keys, each with its mode.
        keys: Vec<(String, Mode)>,
        /// Whether it was granted at once.
        held: bool,
        /// When.
        at: i64,
        /// When its rows' lease runs out, unless renewed.
        expires_at: i64,
    },
    /// Waiting rows were granted (by whichever owner's transaction freed them).
    Promoted {
        /// The request's ticket.
        ticket: u64,
        /// The keys granted.
        keys: Vec<String>,
        /// When.
        at: i64,
    },
    /// An owner's live rows were renewed (its heartbeat).
    Renewed {
        /// The owner.
        owner: String,
        /// The requests renewed.
        tickets: Vec<u64>,
        /// When.
        at: i64,
        /// Until when.
        expires_at: i64,
    },
    /// An owner deleted its rows of one request (a release, a cancelled wait, a clean-up).
    Removed {
        /// The owner.
        owner: String,
        /// The request's ticket.
        ticket: u64,
        /// The keys whose rows it deleted, if there.
        keys: Vec<String>,
        /// When.
        at: i64,
    },
    /// An owner deleted every row of its own (a manager closing or shutting down).
    RemovedAll {
        /// The owner.
        owner: String,
        /// When.
        at: i64,
    },
    /// Lapsed rows were deleted.
    Swept {
        /// On these keys, or on every key (`None`).
        keys: Option<Vec<String>>,
        /// When: the rows whose lease had run out by then.
        at: i64,
    },
    /// What the caller of [`Guard::release`](crate::Guard::release) was told.
    Released {
        /// The owner.
        owner: String,
        /// The guard's ticket.
        ticket: u64,
        /// Whether it was told the lease held (`Ok`), or was lost.
        held: bool,
        /// Whether the guard's own reckoning of its lease had run out by then.
        ran_out: bool,
    },
    /// Work bound to the lease of an owner's request began ([`LockManager::with_lock`],
    /// [`lead`](crate::LockManager::lead), [`every`](crate::LockManager::every)).
    ///
    /// [`LockManager::with_lock`]: crate::LockManager::with_lock
    WorkBegan {
        /// The owner.
        owner: String,
        /// The request's ticket.
        ticket: u64,
    },
    /// That work ended, its clean-up finished; its lock is released next.
    WorkEnded {
        /// The owner.
        owner: String,
        /// The request's ticket.
        ticket: u64,
    },
    /// A storage fault was injected into an owner's connection.
    Fault {
        /// The owner.
        owner: String,
        /// The fault, as `Debug` shows it.
        fault: String,
    },
    /// An owner's manager was killed ([`SimStore::kill`](super::SimStore::kill)): its worker
    /// ended without deleting anything.
    Killed {
        /// The owner.
        owner: String,
    },
    /// An owner's manager was stopped ([`SimStore::stop`](super::SimStore::stop)).
    Stopped {
        /// The owner.
        owner: String,
        /// For how long, of virtual time.
        duration: Duration,
    },
    /// An owner's worker ended after closing (every handle gone, or shut down).
    Ended {
        /// The owner.
        owner: String,
    },
}

/// Everything a simulated store saw, in order ([`SimStore::history`](super::SimStore::history)):
/// what [`check_locks`] judges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LockHistory {
    pub(crate) events: Vec<LockEvent>,
}

impl LockHistory {
    /// The events, in the order they happened.
    pub fn events(&self) -> &[LockEvent] {
        &self.events
    }

    /// How many requests were granted (at once or from the queue).
    pub fn grants(&self) -> usize {
        self.events
            .iter()
            .filter(|event| {
                matches!(
                    event,
                    LockEvent::Requested { held: true, .. } | LockEvent::Promoted { .. }
                )
            })
            .count()
    }
}

impl fmt::Display for LockHistory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, event) in self.events.iter().enumerate() {
            writeln!(f, "{n:5}  {event:?}")?;
        }
        Ok(())
    }
}

/// A row as the checker replays it.
#[derive(Clone, Debug)]
struct Replayed {
    owner: String,
    mode: Mode,
    held: bool,
    expires_at: i64,
    /// Its lease's length: a promotion gives it a whole one.
    lease: i64,
}

/// How a request's rows were first deleted by their owner: whether they were all there and
/// live.
#[derive(Clone, Copy, Debug)]
struct FirstRemoval {
    all_live: bool,
}

/// The largest tickets granted on a key: in any mode, and exclusive.
#[derive(Default)]
struct LastGranted {
    any: Option<u64>,
    exclusive: Option<u64>,
}

#[derive(Default)]
struct Replay {
    rows: BTreeMap<(String, u64), Replayed>,
    /// The keys and number of rows each ticket was written with.
    written: BTreeMap<u64, usize>,
    /// The largest tickets granted on each key so far.
    last_granted: BTreeMap<String, LastGranted>,
    removals: BTreeMap<u64, FirstRemoval>,
    /// The work bound to a lease that has begun and not ended, by ticket: its owner, and the
    /// keys (with their modes) its request holds.
    working: BTreeMap<u64, (String, Vec<(String, Mode)>)>,
    killed: BTreeSet<String>,
    ended: BTreeSet<String>,
}

impl Replay {
    fn live_on(&self, key: &str, at: i64) -> impl Iterator<Item = (u64, &Replayed)> + '_ {
        let key = key.to_owned();
        self.rows
            .range((key.clone(), 0)..=(key, u64::MAX))
            .filter(move |(_, row)| row.expires_at > at)
            .map(|((_, ticket), row)| (*ticket, row))
    }

    /// Judges the grant of `ticket` on `key` for `mode` at `at`: for permits, by the counts the
    /// live holders then held, within the key's limit; then by the grant rule over the rows
    /// live then, and the order of fencing tokens on the key.
    fn grant(&mut self, n: usize, key: &str, ticket: u64, mode: Mode, at: i64) -> Check {
        if let Mode::Permits { count, limit } = mode {
            // Whatever the rule says: the live holders of a key never hold more than its limit.
            let (mut held, mut least) = (u64::from(count), limit);
            for (other, row) in self
                .live_on(key, at)
                .filter(|&(t, row)| t != ticket && row.held)
            {
                let Mode::Permits { count, limit } = row.mode else {
                    return Err(format!(
                        "event {n}: ticket {ticket} was granted {mode} on {key:?} at {at} while \
                         ticket {other} held it {}",
                        row.mode
                    ));
                };
                held += u64::from(count);
                least = least.min(limit);
            }
            if held > u64::from(least) {
                return Err(format!(
                    "event {n}: ticket {ticket} was granted {mode} on {key:?} at {at}: its live \
                     holders then held {held} permits, over the key's limit of {least}"
                ));
            }
        }
        let others: Vec<(Mode, u64)> = self
            .live_on(key, at)
            .filter(|&(other, _)| other != ticket)
            .map(|(other, row)| (row.mode, other))
            .collect();
        if !grantable(mode, ticket, others.iter().copied()) {
            let holders: Vec<String> = self
                .live_on(key, at)
                .filter(|&(other, row)| other != ticket && other < ticket && row.held)
                .map(|(other, row)| {
                    format!("{} ticket {other} ({}, {})", row.mode, row.owner, {
                        let left = row.expires_at - at;
                        format!("{left} µs of lease left")
                    })
                })
                .collect();
            return Err(format!(
                "event {n}: ticket {ticket} was granted {mode} on {key:?} at {at} though the \
                 grant rule forbids it: live rows ahead of it {others:?}; holders {holders:?}"
            ));
        }
        // Only a grant that conflicts with an earlier one must have the larger token: two
        // shared holders may be granted out of ticket order (a waiter whose blocker's lease ran
        // out, passed by a new shared request before anyone promoted it), and fencing orders
        // only holders that exclude each other.
        let last = self.last_granted.entry(key.to_owned()).or_default();
        let before = match mode {
            Mode::Exclusive => last.any,
            Mode::Shared | Mode::Permits { .. } => last.exclusive,
        };
        if before.is_some_and(|before| ticket <= before) {
            return Err(format!(
                "event {n}: ticket {ticket} was granted {mode} on {key:?} after ticket {} was \
                 granted there in a mode it conflicts with: fencing tokens must increase in the \
                 order of conflicting grants on each key",
                before.unwrap_or_default()
            ));
        }
        last.any = last.any.max(Some(ticket));
        if mode == Mode::Exclusive {
            last.exclusive = last.exclusive.max(Some(ticket));
        }
        // Work bound to a lease ends, clean-up and all, before anyone who conflicts with it
        // is let in: it is told a heartbeat before its lease could run out.
        for (other, (owner, keys)) in &self.working {
            let conflicts = keys.iter().any(|(held, held_mode)| {
                held == key && (mode == Mode::Exclusive || *held_mode == Mode::Exclusive)
            });
            if *other != ticket && conflicts {
                return Err(format!(
                    "event {n}: ticket {ticket} was granted {mode} on {key:?} at {at} while the \
                     work bound to ticket {other} ({owner}) had not ended: bound work must end, \
                     its clean-up finished, before a conflicting grant"
                ));
            }
        }
        Ok(())
    }
}

type Check = Result<(), String>;

/// Checks the lock promises over what a simulated store saw: `Err` says which was broken, and
/// at which event.
///
/// - **Exclusion and order.** Every grant (at once or from the queue) is one the grant rule
///   allows over the rows live at that moment, as the store judged them: no two holders where
///   the rule forbids it while both leases are live, and no waiter passed over (FIFO with
///   writer preference).
/// - **Permits within the limit.** At no grant of permits do the live holders of the key hold
///   more than its limit, or hold it in another mode.
/// - **Fencing.** On each key, a grant's ticket is larger than those of every earlier grant
///   it conflicts with (an exclusive one after any, any after an exclusive one).
/// - **No revival.** No renewal or promotion touches a row whose lease had run out.
/// - **Lost leases are told.** A release that tells its caller the lease held found the rows
///   all there and live when it deleted them; one that tells of a loss did not, or the
///   guard's own reckoning of its lease had run out.
/// - **Bound work ends first.** Work bound to a lease ([`with_lock`](crate::LockManager::with_lock),
///   [`lead`](crate::LockManager::lead), [`every`](crate::LockManager::every)) has ended, its
///   clean-up finished, before any grant on its keys that conflicts with its lock: it is told
///   a heartbeat before its lease could run out. (A clean-up that takes longer than a
///   heartbeat breaks this, and is reported.)
/// - **Nothing left.** No row is written by an owner after its worker ended, and when every
///   owner's worker has ended, no row is left but those of killed owners (which run out with
///   their lease).
///
/// # Examples
///
/// ```
/// use leasehold::testkit::{check_locks, FaultPlan, Sim, SimStore};
/// use leasehold::LockManager;
///
/// let mut sim = Sim::new(7);
/// let store = SimStore::new(&sim);
/// sim.block_on({
///     let store = store.clone();
///     async move {
///         let locks = LockManager::builder().open_simulated(&store, FaultPlan::none())?;
///         let guard = locks.exclusive("repo", "prune").await?;
///         guard.release().await
///     }
/// })
/// .unwrap()
/// .unwrap();
/// check_locks(&store.history()).unwrap();
/// assert_eq!(store.history().grants(), 1);
/// ```
pub fn check_locks(history: &LockHistory) -> Result<(), String> {
    let mut replay = Replay::default();
    for (n, event) in history.events.iter().enumerate() {
        match event {
            LockEvent::Requested {
                owner,
                ticket,
                keys,
                held,
                at,
                expires_at,
            } => {
                if replay.ended.contains(owner) {
                    return Err(format!(
                        "event {n}: {owner} wrote ticket {ticket} after its worker ended"
                    ));
                }
                if *held {
                    for (key, mode) in keys {
                        replay.grant(n, key, *ticket, *mode, *at)?;
                    }
                }
                // A ticket taken by a transaction that was rolled back is taken again.
                replay.written.insert(*ticket, keys.len());
                replay.removals.remove(ticket);
                for (key, mode) in keys {
                    let row = Replayed {
                        owner: owner.clone(),
                        mode: *mode,
                        held: *held,
                        expires_at: *expires_at,
                        lease: expires_at - at,
                    };
                    replay.rows.insert((key.clone(), *ticket), row);
                }
            }
            LockEvent::Promoted { ticket, keys, at } => {
                for key in keys {
                    let Some(row) = replay.rows.get(&(key.clone(), *ticket)).cloned() else {
                        return Err(format!(
                            "event {n}: ticket {ticket} was promoted on {key:?}, where it has no row"
                        ));
                    };
                    if row.expires_at <= *at {
                        return Err(format!(
                            "event {n}: ticket {ticket} was promoted on {key:?} at {at}, though \
                             its row had run out at {}",
                            row.expires_at
                        ));
                    }
                    replay.grant(n, key, *ticket, row.mode, *at)?;
                    if let Some(row) = replay.rows.get_mut(&(key.clone(), *ticket)) {
                        row.held = true;
                        row.expires_at = row.expires_at.max(at + row.lease);
                    }
                }
            }
            LockEvent::Renewed {
                owner,
                tickets,
                at,
                expires_at,
            } => {
                let tickets: BTreeSet<u64> = tickets.iter().copied().collect();
                for ((key, ticket), row) in replay.rows.iter_mut() {
                    if &row.owner != owner || !tickets.contains(ticket) {
                        continue;
                    }
                    if row.expires_at <= *at {
                        return Err(format!(
                            "event {n}: {owner} renewed ticket {ticket} on {key:?} at {at}, \
                             though its row had run out at {}: a renewal revived a lapsed row",
                            row.expires_at
                        ));
                    }
                    row.lease = expires_at - at;
                    row.expires_at = *expires_at;
                }
            }
            LockEvent::Removed {
                owner,
                ticket,
                keys,
                at,
            } => {
                let mut found = 0;
                let mut live = 0;
                for key in keys {
                    let at_row = (key.clone(), *ticket);
                    if replay
                        .rows
                        .get(&at_row)
                        .is_some_and(|row| &row.owner == owner)
                    {
                        let row = replay.rows.remove(&at_row).expect("just seen");
                        found += 1;
                        live += usize::from(row.expires_at > *at);
                    }
                }
                let written = replay.written.get(ticket).copied().unwrap_or(keys.len());
                if found > 0 || !replay.removals.contains_key(ticket) {
                    replay.removals.entry(*ticket).or_insert(FirstRemoval {
                        all_live: found == written && live == written,
                    });
                }
            }
            LockEvent::RemovedAll { owner, .. } => {
                replay.rows.retain(|_, row| &row.owner != owner);
            }
            LockEvent::Swept { keys, at } => {
                replay.rows.retain(|(key, _), row| {
                    let on = keys.as_ref().is_none_or(|keys| keys.contains(key));
                    !(on && row.expires_at <= *at)
                });
            }
            LockEvent::Released {
                owner,
                ticket,
                held,
                ran_out,
            } => {
                let all_live = replay.removals.get(ticket).is_some_and(|r| r.all_live);
                if *held && !all_live {
                    return Err(format!(
                        "event {n}: {owner}'s release of ticket {ticket} said the lease held, but \
                         its rows were gone or had run out when they were deleted: a lost lease \
                         was not told"
                    ));
                }
                if !*held && all_live && !*ran_out {
                    return Err(format!(
                        "event {n}: {owner}'s release of ticket {ticket} said the lease was lost, \
                         though its rows were all live when deleted and its own lease had not run \
                         out"
                    ));
                }
            }
            LockEvent::Killed { owner } => {
                replay.killed.insert(owner.clone());
            }
            LockEvent::Ended { owner } => {
                replay.ended.insert(owner.clone());
            }
            LockEvent::WorkBegan { owner, ticket } => {
                let keys = (replay.rows.iter())
                    .filter(|((_, held), _)| held == ticket)
                    .map(|((key, _), row)| (key.clone(), row.mode))
                    .collect();
                replay.working.insert(*ticket, (owner.clone(), keys));
            }
            LockEvent::WorkEnded { ticket, .. } => {
                replay.working.remove(ticket);
            }
            LockEvent::Fault { .. } | LockEvent::Stopped { .. } => {}
        }
    }
    let owners: BTreeSet<&String> = history
        .events
        .iter()
        .filter_map(|event| match event {
            LockEvent::Requested { owner, .. } => Some(owner),
            _ => None,
        })
        .collect();
    let all_ended = owners
        .iter()
        .all(|owner| replay.ended.contains(*owner) || replay.killed.contains(*owner));
    if all_ended {
        if let Some(((key, ticket), row)) = replay
            .rows
            .iter()
            .find(|(_, row)| !replay.killed.contains(&row.owner))
        {
            return Err(format!(
                "every owner's worker ended, but {}'s row of ticket {ticket} on {key:?} is left",
                row.owner
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn granted(owner: &str, ticket: u64, key: &str, mode: Mode, at: i64) -> LockEvent {
        LockEvent::Requested {
            owner: owner.into(),
            ticket,
            keys: vec![(key.into(), mode)],
            held: true,
            at,
            expires_at: at + 100,
        }
    }

    fn history(events: Vec<LockEvent>) -> LockHistory {
        LockHistory { events }
    }

    #[test]
    fn two_exclusive_holders_are_an_overlap_only_while_both_leases_are_live() {
        let live = history(vec![
            granted("a", 1, "k", Mode::Exclusive, 0),
            granted("b", 2, "k", Mode::Exclusive, 50),
        ]);
        assert!(check_locks(&live)
            .unwrap_err()
            .contains("grant rule forbids"));
        let lapsed = history(vec![
            granted("a", 1, "k", Mode::Exclusive, 0),
            granted("b", 2, "k", Mode::Exclusive, 100),
        ]);
        assert_eq!(check_locks(&lapsed), Ok(()));
        let shared = history(vec![
            granted("a", 1, "k", Mode::Shared, 0),
            granted("b", 2, "k", Mode::Shared, 50),
        ]);
        assert_eq!(check_locks(&shared), Ok(()));
    }

    #[test]
    fn a_renewal_of_a_lapsed_row_and_an_untold_loss_are_found() {
        let renewed = |at| {
            history(vec![
                granted("a", 1, "k", Mode::Exclusive, 0),
                LockEvent::Renewed {
                    owner: "a".into(),
                    tickets: vec![1],
                    at,
                    expires_at: at + 100,
                },
            ])
        };
        assert_eq!(check_locks(&renewed(99)), Ok(()));
        assert!(check_locks(&renewed(100)).unwrap_err().contains("revived"));
        let released = |at, held, ran_out| {
            history(vec![
                granted("a", 1, "k", Mode::Exclusive, 0),
                LockEvent::Removed {
                    owner: "a".into(),
                    ticket: 1,
                    keys: vec!["k".into()],
                    at,
                },
                LockEvent::Released {
                    owner: "a".into(),
                    ticket: 1,
                    held,
                    ran_out,
                },
            ])
        };
        assert_eq!(check_locks(&released(50, true, false)), Ok(()));
        assert_eq!(check_locks(&released(150, false, true)), Ok(()));
        assert!(
            check_locks(&released(150, true, false)).is_err(),
            "a loss untold"
        );
        assert!(
            check_locks(&released(50, false, false)).is_err(),
            "a loss made up"
        );
        assert_eq!(
            check_locks(&released(50, false, true)),
            Ok(()),
            "its own lease ran out"
        );
    }

    /// A conflicting grant while bound work on the key goes on is found; one after it ended,
    /// or beside it in a mode that does not conflict, is not.
    #[test]
    fn a_grant_while_bound_work_goes_on_is_found() {
        let work = |owner: &str, began: bool| {
            let (owner, ticket) = (owner.into(), 1);
            match began {
                true => LockEvent::WorkBegan { owner, ticket },
                false => LockEvent::WorkEnded { owner, ticket },
            }
        };
        let overlapping = history(vec![
            granted("a", 1, "k", Mode::Exclusive, 0),
            work("a", true),
            granted("b", 2, "k", Mode::Exclusive, 100),
        ]);
        let error = check_locks(&overlapping).unwrap_err();
        assert!(error.contains("work bound to ticket 1"), "{error}");
        let ended = history(vec![
            granted("a", 1, "k", Mode::Exclusive, 0),
            work("a", true),
            work("a", false),
            granted("b", 2, "k", Mode::Exclusive, 100),
        ]);
        assert_eq!(check_locks(&ended), Ok(()));
        let readers = history(vec![
            granted("a", 1, "k", Mode::Shared, 0),
            work("a", true),
            granted("b", 2, "k", Mode::Shared, 50),
            granted("c", 3, "other", Mode::Exclusive, 50),
        ]);
        assert_eq!(check_locks(&readers), Ok(()));
    }

    #[test]
    fn rows_left_once_every_owner_ended_are_found_unless_their_owner_was_killed() {
        let left = |killed: bool| {
            let mut events = vec![granted("a", 1, "k", Mode::Exclusive, 0)];
            events.push(if killed {
                LockEvent::Killed { owner: "a".into() }
            } else {
                LockEvent::Ended { owner: "a".into() }
            });
            history(events)
        };
        assert!(check_locks(&left(false)).unwrap_err().contains("is left"));
        assert_eq!(check_locks(&left(true)), Ok(()));
    }
}
