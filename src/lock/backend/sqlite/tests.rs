//! The SQLite backend's own tests.

use super::*;

#[test]
fn tombstones_live_until_heard_or_swept() {
    let busy = Schedule::recurs(0);
    let conn = connect(None, 0o600, &busy, false).unwrap();
    let mut db = Db::new(&conn, Arc::new(SystemClock), None, busy);
    crate::lock::backend::tombstones_live_until_heard_or_swept(&mut db);
}
use crate::clock::SystemClock;
use crate::lock::Mode;
use proptest::prelude::*;

const KEYS: [&str; 3] = ["a", "b", "c"];

/// One step of one connection, inside a write transaction.
#[derive(Clone, Debug)]
enum Op {
    /// A request on the keys whose bits are set (1 to 7), held or waiting, with a lease.
    Insert {
        keys: u8,
        held: bool,
        lease: i64,
    },
    /// Promotes the `pick`-th waiting request on the file, whoever owns it.
    Promote {
        pick: usize,
    },
    /// Deletes the `pick`-th request of this connection's owner.
    Delete {
        pick: usize,
    },
    DeleteOwner,
    DeleteExpired {
        key: usize,
    },
    Renew {
        lease: i64,
    },
    Sweep,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u8..8, any::<bool>(), prop_oneof![Just(50i64), Just(100)])
            .prop_map(|(keys, held, lease)| Op::Insert { keys, held, lease }),
        2 => (0usize..8).prop_map(|pick| Op::Promote { pick }),
        3 => (0usize..8).prop_map(|pick| Op::Delete { pick }),
        1 => Just(Op::DeleteOwner),
        1 => (0usize..3).prop_map(|key| Op::DeleteExpired { key }),
        1 => prop_oneof![Just(50i64), Just(100)].prop_map(|lease| Op::Renew { lease }),
        1 => Just(Op::Sweep),
    ]
}

/// (which connection, how far time moves first, the op, whether it commits)
fn steps() -> impl Strategy<Value = Vec<(bool, i64, Op, bool)>> {
    prop::collection::vec(
        (any::<bool>(), 0i64..80, op(), prop::bool::weighted(0.85)),
        1..40,
    )
}

/// The live rows of every key, as the statement reads them: the truth `Known` must match.
fn read_all(db: &Db<'_>, now: i64) -> Vec<RowView> {
    let mut rows = Vec::new();
    for key in KEYS {
        db.read_rows(key, now, &mut rows).unwrap();
    }
    rows.into_iter().map(|row| row.view).collect()
}

fn known_all(db: &mut Db<'_>, now: i64) -> Vec<RowView> {
    let keys: Vec<String> = KEYS.iter().map(|k| (*k).to_owned()).collect();
    let mut rows = Vec::new();
    db.rows_on_keys(&keys, now, &mut rows).unwrap();
    rows
}

/// Applies `op` for `owner`; returns the ticket it took, if any.
fn apply(db: &mut Db<'_>, owner: &str, op: &Op, now: i64) -> Option<u64> {
    let rows = db.live_rows(None, i64::MIN).unwrap();
    match *op {
        Op::Insert { keys, held, lease } => {
            let requests: Vec<LockRequest> = (0..3)
                .filter(|bit| keys & (1 << bit) != 0)
                .map(|bit| LockRequest {
                    key: KEYS[bit].to_owned(),
                    mode: if bit == 0 {
                        Mode::Exclusive
                    } else {
                        Mode::Shared
                    },
                    operation: "op".to_owned(),
                })
                .collect();
            let ticket = db.next_ticket().unwrap();
            db.insert_request(owner, ticket, &requests, held, now, now + lease)
                .unwrap();
            Some(ticket)
        }
        Op::Promote { pick } => {
            let mut waiting: Vec<u64> = rows.iter().filter(|r| !r.held).map(|r| r.ticket).collect();
            waiting.dedup();
            if let Some(&ticket) = waiting.get(pick % waiting.len().max(1)) {
                let keys: Vec<String> = rows
                    .iter()
                    .filter(|r| r.ticket == ticket && !r.held)
                    .map(|r| r.key.clone())
                    .collect();
                db.promote(&keys, ticket, now).unwrap();
            }
            None
        }
        Op::Delete { pick } => {
            let mut own: Vec<u64> = rows
                .iter()
                .filter(|r| r.owner == owner)
                .map(|r| r.ticket)
                .collect();
            own.sort_unstable();
            own.dedup();
            if let Some(&ticket) = own.get(pick % own.len().max(1)) {
                let keys: Vec<String> = rows
                    .iter()
                    .filter(|r| r.ticket == ticket)
                    .map(|r| r.key.clone())
                    .collect();
                db.delete_request(owner, &keys, ticket, now).unwrap();
            }
            None
        }
        Op::DeleteOwner => {
            db.delete_owner(owner).unwrap();
            None
        }
        Op::DeleteExpired { key } => {
            db.delete_expired(&[KEYS[key].to_owned()], now).unwrap();
            None
        }
        Op::Renew { lease } => {
            db.renew(owner, now, now + lease).unwrap();
            None
        }
        Op::Sweep => {
            db.sweep(now).unwrap();
            None
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Two connections on one file take turns writing (each commits or rolls back): what
    /// each remembers of the rows always equals what its statements read, before and after
    /// each of its writes, and tickets only grow, whichever connection takes them.
    #[test]
    fn what_a_connection_remembers_is_what_the_database_holds(steps in steps()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("known.db");
        let busy = Schedule::recurs(0);
        let (first, second) = (
            connect(Some(&path), 0o600, &busy, false).unwrap(),
            connect(Some(&path), 0o600, &busy, false).unwrap(),
        );
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let mut dbs = [
            (Db::new(&first, clock.clone(), None, busy.clone()), "owner a"),
            (Db::new(&second, clock, None, busy), "owner b"),
        ];
        let (mut now, mut last_ticket) = (1_000_000i64, 0u64);
        for (which, elapsed, op, commits) in steps {
            now += elapsed;
            let (db, owner) = &mut dbs[usize::from(which)];
            db.begin(&[]).unwrap();
            prop_assert_eq!(known_all(db, now), read_all(db, now), "before {:?}", op);
            let ticket = apply(db, owner, &op, now);
            prop_assert_eq!(known_all(db, now), read_all(db, now), "after {:?}", op);
            if commits {
                db.commit().unwrap();
                if let Some(ticket) = ticket {
                    prop_assert!(ticket > last_ticket, "ticket {} after {}", ticket, last_ticket);
                    last_ticket = ticket;
                }
            } else {
                db.rollback();
            }
        }
    }
}
