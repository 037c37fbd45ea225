//! The SQLite backend's own tests.

use super::*;
use crate::clock::SystemClock;
use crate::lock::Mode;
use proptest::prelude::*;

#[test]
fn tombstones_live_until_heard_or_swept() {
    let busy = Schedule::recurs(0);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let conn = connect(None, 0o600, &busy, false, &clock, &Default::default()).unwrap();
    let mut db = Db::new(&conn, clock, None, busy);
    crate::lock::backend::tombstones_live_until_heard_or_swept(&mut db);
}

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
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let (first, second) = (
            connect(Some(&path), 0o600, &busy, false, &clock, &Default::default()).unwrap(),
            connect(Some(&path), 0o600, &busy, false, &clock, &Default::default()).unwrap(),
        );
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

/// A `TestClock` on a boot of the test's choosing, or on none (`None`: its wall time).
struct OnBoot(crate::clock::TestClock, Option<u128>);

impl Clock for OnBoot {
    fn now(&self) -> std::time::Duration {
        self.0.now()
    }
    fn monotonic(&self) -> std::time::Duration {
        self.0.monotonic()
    }
    fn sleep(&self, duration: std::time::Duration) -> futures::future::BoxFuture<'static, ()> {
        self.0.sleep(duration)
    }
    fn boot_time(&self) -> Option<crate::clock::BootTime> {
        let boot = self.1?;
        Some(crate::clock::BootTime {
            boot,
            since_boot: self.0.monotonic(),
        })
    }
}

/// Opens the file at `path` with `clock` (migrating it), writes one held row of `owner` on
/// `key` with a lease of `lease` micros, and commits; returns its ticket.
fn hold(path: &Path, clock: &Arc<dyn Clock>, owner: &str, key: &str, lease: i64) -> u64 {
    let busy = Schedule::recurs(0);
    let conn = connect(Some(path), 0o600, &busy, false, clock, &Default::default()).unwrap();
    let mut db = Db::new(&conn, clock.clone(), None, busy);
    let now = db.begin(&[]).unwrap();
    let ticket = db.next_ticket().unwrap();
    let request = LockRequest::exclusive(key, "op");
    db.insert_request(owner, ticket, &[request], true, now, now + lease)
        .unwrap();
    db.commit().unwrap();
    ticket
}

/// The live rows of the file at `path`, as a manager with `clock` reads them; opened as it is
/// with `existing`.
fn live(path: &Path, clock: &Arc<dyn Clock>, existing: bool) -> Result<Vec<Row>> {
    let busy = Schedule::recurs(0);
    let conn = connect(
        Some(path),
        0o600,
        &busy,
        existing,
        clock,
        &Default::default(),
    )?;
    let mut db = Db::new(&conn, clock.clone(), None, busy);
    if existing {
        db.stale = db.stored_time_line()? != Some(db.line);
    }
    let now = db.now();
    db.live_rows(None, now)
}

#[test]
fn rows_of_an_earlier_boot_are_dead_and_tickets_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("boot.db");
    let test = crate::clock::TestClock::new();
    let first: Arc<dyn Clock> = Arc::new(OnBoot(test.clone(), Some(1)));
    let before = hold(&path, &first, "a", "k", 60_000_000);
    assert_eq!(live(&path, &first, false).unwrap().len(), 1);
    // After a restart: a new boot, its clock near zero again. A view of the store as it is
    // finds nothing live (and changes nothing); a manager deletes the rows.
    let second: Arc<dyn Clock> = Arc::new(OnBoot(crate::clock::TestClock::new(), Some(2)));
    assert!(live(&path, &second, true).unwrap().is_empty());
    assert_eq!(
        live(&path, &first, true).unwrap().len(),
        1,
        "a view changed nothing"
    );
    assert!(live(&path, &second, false).unwrap().is_empty());
    assert!(live(&path, &first, true).unwrap().is_empty(), "deleted");
    let after = hold(&path, &second, "b", "k", 60_000_000);
    assert!(after > before, "ticket {after} after {before}");
}

#[cfg(target_os = "linux")]
#[test]
fn a_manager_on_another_boot_than_this_machines_is_refused_its_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("this-boot.db");
    let here = SystemClock.boot_time().unwrap().boot;
    let machine: Arc<dyn Clock> = Arc::new(OnBoot(crate::clock::TestClock::new(), Some(here)));
    hold(&path, &machine, "a", "k", 60_000_000);
    let test: Arc<dyn Clock> = Arc::new(OnBoot(crate::clock::TestClock::new(), Some(here ^ 1)));
    let refused = live(&path, &test, false).unwrap_err().to_string();
    assert!(refused.contains("another boot"), "{refused}");
    assert_eq!(
        live(&path, &machine, false).unwrap().len(),
        1,
        "nothing deleted"
    );
}

#[test]
fn a_store_judged_by_the_wall_clock_moves_to_the_boot_clock_with_each_lease_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wall.db");
    let test = crate::clock::TestClock::new();
    test.advance(std::time::Duration::from_secs(100));
    let wall: Arc<dyn Clock> = Arc::new(OnBoot(test.clone(), None));
    hold(&path, &wall, "a", "k", 30_000_000);
    let shown = live(&path, &wall, false).unwrap();
    let boot: Arc<dyn Clock> = Arc::new(OnBoot(test.clone(), Some(7)));
    let moved = live(&path, &boot, false).unwrap();
    assert_eq!(moved.len(), 1);
    // The same times on the wall clock, and the lease runs out 30 s on, by the boot clock.
    assert_eq!(
        (moved[0].since, moved[0].expires_at),
        (shown[0].since, shown[0].expires_at)
    );
    test.set_wall_time(test.now() + std::time::Duration::from_secs(3600));
    assert_eq!(
        live(&path, &boot, false).unwrap().len(),
        1,
        "no step lapses it"
    );
    test.advance(std::time::Duration::from_secs(31));
    assert!(
        live(&path, &boot, false).unwrap().is_empty(),
        "lapsed by its lease"
    );
}

#[test]
fn a_manager_without_a_boot_clock_is_refused_a_store_on_one_rows_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mixed.db");
    let test = crate::clock::TestClock::new();
    let boot: Arc<dyn Clock> = Arc::new(OnBoot(test.clone(), Some(7)));
    let wall: Arc<dyn Clock> = Arc::new(OnBoot(test.clone(), None));
    hold(&path, &boot, "a", "k", 30_000_000);
    let refused = live(&path, &wall, false).unwrap_err().to_string();
    assert!(refused.contains("boot_time"), "{refused}");
    let busy = Schedule::recurs(0);
    let conn = connect(Some(&path), 0o600, &busy, false, &boot, &Default::default()).unwrap();
    let mut db = Db::new(&conn, boot.clone(), None, busy);
    db.begin(&[]).unwrap();
    assert_eq!(db.delete_owner("a").unwrap(), 1);
    db.commit().unwrap();
    drop(db);
    // Without rows too: a manager of the boot's may be at work on it.
    assert!(live(&path, &wall, false).is_err());
}

#[test]
fn a_manager_on_the_wall_clock_stops_writing_once_the_store_moved_to_the_boot_clock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moved.db");
    let test = crate::clock::TestClock::new();
    let wall: Arc<dyn Clock> = Arc::new(OnBoot(test.clone(), None));
    let boot: Arc<dyn Clock> = Arc::new(OnBoot(test.clone(), Some(7)));
    let busy = Schedule::recurs(0);
    let conn = connect(Some(&path), 0o600, &busy, false, &wall, &Default::default()).unwrap();
    let mut db = Db::new(&conn, wall.clone(), None, busy);
    db.begin(&[]).unwrap();
    db.commit().unwrap();
    // A manager of the boot's opens it and moves it.
    hold(&path, &boot, "b", "k", 30_000_000);
    let refused = db.begin(&[]).unwrap_err().to_string();
    assert!(refused.contains("boot_time"), "{refused}");
    assert!(!db.in_write, "rolled back");
}
