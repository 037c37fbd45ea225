//! Owners in real child processes sharing one database file with the test.
//!
//! The test binary is its own child (`common::child`): `child_entry` does nothing unless this
//! process was started in a role. Parent and child coordinate through marker files in a
//! temporary folder (written whole, then renamed into place). Every wait has a deadline, and a
//! child is killed and reaped whenever its handle is dropped, so that a failing test leaves
//! neither a hung test nor a zombie.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::child::{self, Child};
use common::{entries, join_within, within, within_blocking};
use futures::executor::block_on;
use leasehold::{fork_daemon, EntryState, Exit, LockManager, LockRequest, Mode};

const DB: &str = "LEASEHOLD_CHILD_DB";
const FOLDER: &str = "LEASEHOLD_CHILD_FOLDER";
const ID: &str = "LEASEHOLD_CHILD_ID";

/// How long a child waits for the parent at any one point before giving up on its own.
const CHILD_PATIENCE: Duration = Duration::from_secs(30);

const SHORT_LEASE: Duration = Duration::from_secs(1);
const SHORT_HEARTBEAT: Duration = Duration::from_millis(200);

/// Microseconds since the Unix epoch: both processes read the same system clock.
fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_micros() as u64
}

/// Writes a marker whole: a reader never sees it half written.
fn mark(folder: &Path, name: &str, content: &str) {
    let part = folder.join(format!("{name}.part"));
    fs::write(&part, content).expect("write a marker");
    fs::rename(&part, folder.join(name)).expect("publish a marker");
}

/// Waits (in the child) for a marker of the parent's.
fn await_marker(folder: &Path, name: &str) {
    within_blocking(
        CHILD_PATIENCE,
        &format!("child: {name} from the parent"),
        || folder.join(name).exists(),
    );
}

/// The child's side. Returns at once unless this process was started as a child.
#[test]
fn child_entry() {
    let Some(role) = child::role() else {
        return;
    };
    let db = PathBuf::from(std::env::var(DB).expect("database path"));
    let folder = PathBuf::from(std::env::var(FOLDER).expect("marker folder"));
    match role.as_str() {
        "hold-then-release" => block_on(hold_then_release(&db, &folder)),
        "hold-until-killed" => block_on(hold_until_killed(&db, &folder)),
        "hold-on-a-stalled-executor" => block_on(hold_on_a_stalled_executor(&db, &folder)),
        "contend" => {
            let id = std::env::var(ID).expect("child id");
            block_on(contend(&db, &folder, &id));
        }
        other => panic!("unknown child role {other:?}"),
    }
}

/// Holds `k` exclusively until the parent says `release`, noting when it began releasing.
async fn hold_then_release(db: &Path, folder: &Path) {
    let locks = LockManager::open(db).unwrap();
    let guard = locks.exclusive("k", "child").await.unwrap();
    mark(folder, "held", "");
    await_marker(folder, "release");
    mark(folder, "releasing", &unix_micros().to_string());
    guard.release().await.unwrap();
    mark(folder, "released", &unix_micros().to_string());
}

/// Holds `k` exclusively with a short lease, renewing, until killed (or, if the parent is gone,
/// until its patience runs out).
async fn hold_until_killed(db: &Path, folder: &Path) {
    let locks = LockManager::builder()
        .lease(SHORT_LEASE)
        .heartbeat(SHORT_HEARTBEAT)
        .open(db)
        .unwrap();
    let _guard = locks.exclusive("k", "child").await.unwrap();
    mark(folder, "held", "");
    smol::Timer::after(CHILD_PATIENCE).await;
}

/// How long the stalled child's executor is blocked: several leases.
const STALL: Duration = Duration::from_secs(4);

/// Holds `k` with a short lease, its background work on an executor of one thread; when the
/// parent says `stall`, a blocking task occupies that thread for [`STALL`], so no heartbeat can
/// run. Writes `stall-over` when the thread is free again, and `lost` once the guard's `lost()`
/// signal has fired ("yes") or its patience ran out ("no").
async fn hold_on_a_stalled_executor(db: &Path, folder: &Path) {
    let executor = Arc::new(smol::Executor::<'static>::new());
    {
        let executor = executor.clone();
        std::thread::spawn(move || smol::block_on(executor.run(smol::future::pending::<()>())));
    }
    let spawner = executor.clone();
    let locks = LockManager::builder()
        .lease(SHORT_LEASE)
        .heartbeat(SHORT_HEARTBEAT)
        .spawner(Arc::new(move |task| spawner.spawn(task).detach()))
        .open(db)
        .unwrap();
    let guard = locks.exclusive("k", "stalled").await.unwrap();
    mark(folder, "held", "");
    await_marker(folder, "stall");
    let over = folder.to_path_buf();
    executor
        .spawn(async move {
            std::thread::sleep(STALL);
            mark(&over, "stall-over", "");
        })
        .detach();
    let lost = guard.lost();
    let fired = smol::future::or(async { lost.aborted().await.to_string() }, async {
        smol::Timer::after(CHILD_PATIENCE).await;
        String::new()
    })
    .await;
    mark(folder, "lost", if fired.is_empty() { "no" } else { "yes" });
    drop(guard);
}

const CONTEND_ROUNDS: usize = 15;

/// Takes `k` exclusively `CONTEND_ROUNDS` times once the parent says `go`, logging entry and
/// exit with the fencing token.
async fn contend(db: &Path, folder: &Path, id: &str) {
    let locks = LockManager::open(db).unwrap();
    mark(folder, &format!("ready-{id}"), "");
    await_marker(folder, "go");
    contend_rounds(&locks, &folder.join("log"), id).await;
}

async fn contend_rounds(locks: &LockManager, log: &Path, id: &str) {
    for round in 0..CONTEND_ROUNDS {
        let guard = locks.exclusive("k", format!("{id}-{round}")).await.unwrap();
        append(log, &format!("+ {id} {}\n", guard.fencing_token()));
        smol::Timer::after(Duration::from_millis(1)).await;
        append(log, &format!("- {id}\n"));
        guard.release().await.unwrap();
    }
}

fn append(log: &Path, line: &str) {
    use std::io::Write;
    let mut file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("open the log");
    file.write_all(line.as_bytes()).expect("append to the log");
}

/// A child in `role` (see `child_entry`) on `db`, its markers in `folder`, named `id`.
fn spawn(role: &str, db: &Path, folder: &Path, id: &str) -> Child {
    Child::start(
        Child::command("child_entry", role)
            .env(DB, db)
            .env(FOLDER, folder)
            .env(ID, id),
    )
}

fn folder_and_db() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().expect("temporary folder");
    let folder = dir.path().to_path_buf();
    let db = folder.join("locks.db");
    (dir, folder, db)
}

async fn waits_for(locks: &LockManager, operation: &str) -> bool {
    entries(locks)
        .await
        .iter()
        .any(|e| e.operation == operation && matches!(e.state, EntryState::Waiting { .. }))
}

#[test]
fn a_lock_is_handed_over_from_a_child_process_within_about_one_poll() {
    let (_dir, folder, db) = folder_and_db();
    handed_over_by(
        &folder,
        &db,
        Duration::from_millis(10),
        Duration::from_secs(2),
    );
}

#[test]
fn a_killed_childs_lock_is_granted_when_its_lease_runs_out_and_not_before() {
    let (_dir, folder, db) = folder_and_db();
    let mut child = spawn("hold-until-killed", &db, &folder, "0");
    child.await_file(&folder.join("held"), Duration::from_secs(20));
    block_on(async {
        let locks = LockManager::builder()
            .lease(SHORT_LEASE)
            .heartbeat(SHORT_HEARTBEAT)
            .open(&db)
            .unwrap();
        let waiter = {
            let locks = locks.clone();
            fork_daemon(async move { locks.exclusive("k", "parent").await })
        };
        within(
            Duration::from_secs(5),
            "the parent queued behind the child",
            || waits_for(&locks, "parent"),
        )
        .await;

        // Kill it right after a renewal, so that its lease has nearly all of its second to run.
        let child_expiry = || async {
            entries(&locks)
                .await
                .into_iter()
                .find(|e| e.operation == "child")
                .map(|e| e.expires_at)
        };
        let first = child_expiry().await.expect("the child's row");
        within(
            Duration::from_secs(5),
            "the child renewed its lease",
            || async { child_expiry().await.is_some_and(|e| e > first) },
        )
        .await;
        let expires_at = child_expiry().await.expect("the child's row");
        child.kill();
        let killed = Instant::now();

        // Not before the lease runs out: not within half a lease of the kill...
        while killed.elapsed() < SHORT_LEASE / 2 {
            assert!(
                !waiter.is_finished(),
                "granted {:?} after the kill",
                killed.elapsed()
            );
            smol::Timer::after(Duration::from_millis(5)).await;
        }
        // ...but soon after it.
        let guard = match join_within(
            Duration::from_secs(3),
            "the grant after the lease ran out",
            waiter,
        )
        .await
        {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("{other:?}"),
        };
        let granted_at = Duration::from_micros(unix_micros());
        assert!(
            granted_at >= expires_at,
            "granted at {granted_at:?}, before the child's lease ran out at {expires_at:?}"
        );
        assert!(killed.elapsed() < SHORT_LEASE + Duration::from_secs(2));
        let rows = entries(&locks).await;
        assert!(
            rows.iter().all(|e| e.operation == "parent"),
            "the dead child's row is still visible: {rows:?}"
        );
        guard.release().await.unwrap();
    });
}

#[test]
fn owners_in_several_processes_take_turns() {
    let (_dir, folder, db) = folder_and_db();
    let mut children: Vec<Child> = ["a", "b"]
        .iter()
        .map(|id| spawn("contend", &db, &folder, id))
        .collect();
    for (child, id) in children.iter_mut().zip(["a", "b"]) {
        child.await_file(&folder.join(format!("ready-{id}")), Duration::from_secs(20));
    }
    let log = folder.join("log");
    block_on(async {
        let locks = LockManager::open(&db).unwrap();
        mark(&folder, "go", "");
        contend_rounds(&locks, &log, "parent").await;
    });
    for child in &mut children {
        child.assert_success(Duration::from_secs(30));
    }
    // The log must be a sequence of "+ who token" / "- who" pairs, never overlapping, with
    // tokens that only grow.
    let log = fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 3 * CONTEND_ROUNDS * 2, "{log}");
    let mut last_token = 0;
    for pair in lines.chunks(2) {
        let entry: Vec<&str> = pair[0].split(' ').collect();
        assert_eq!(entry[0], "+", "overlapping holders:\n{log}");
        assert_eq!(
            pair[1],
            format!("- {}", entry[1]),
            "overlapping holders:\n{log}"
        );
        let token: u64 = entry[2].parse().unwrap();
        assert!(token > last_token, "fencing tokens out of order:\n{log}");
        last_token = token;
    }
}

#[test]
fn several_owners_in_one_process_hand_off_correctly() {
    const OWNERS: usize = 3;
    const TASKS_PER_OWNER: usize = 3;
    const ROUNDS: usize = 20;
    const KEYS: [&str; 3] = ["k0", "k1", "k2"];
    let (_dir, _folder, db) = folder_and_db();
    block_on(async {
        let owners: Vec<LockManager> = (0..OWNERS)
            .map(|_| LockManager::open(&db).unwrap())
            .collect();
        // Per key: -1 while held exclusively, else the number of shared holders; and the largest
        // fencing token of an exclusive grant, which every later grant must exceed.
        let held: Arc<Vec<AtomicI64>> = Arc::new(KEYS.iter().map(|_| AtomicI64::new(0)).collect());
        let fences: Arc<Vec<Mutex<u64>>> = Arc::new(KEYS.iter().map(|_| Mutex::new(0)).collect());
        let mut tasks = Vec::new();
        for (o, locks) in owners.iter().enumerate() {
            for t in 0..TASKS_PER_OWNER {
                let (locks, held, fences) = (locks.clone(), held.clone(), fences.clone());
                tasks.push(fork_daemon(async move {
                    for round in 0..ROUNDS {
                        // A fixed, varied pattern: keys and modes differ by owner, task and round.
                        let k = (o + t + round) % KEYS.len();
                        let exclusive = (o * 7 + t * 3 + round) % 3 == 0;
                        let mode = if exclusive {
                            Mode::Exclusive
                        } else {
                            Mode::Shared
                        };
                        let request = LockRequest {
                            key: KEYS[k].to_owned(),
                            mode,
                            operation: format!("o{o}t{t}r{round}"),
                        };
                        let guard = locks.acquire(request).await.unwrap();
                        {
                            let mut fence = fences[k].lock().unwrap();
                            assert!(
                                guard.fencing_token() > *fence,
                                "{} granted token {} after an exclusive grant of {}",
                                KEYS[k],
                                guard.fencing_token(),
                                *fence
                            );
                            if exclusive {
                                *fence = guard.fencing_token();
                            }
                        }
                        let entered = if exclusive {
                            held[k].compare_exchange(0, -1, Ordering::SeqCst, Ordering::SeqCst)
                        } else {
                            held[k].fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                                (n >= 0).then_some(n + 1)
                            })
                        };
                        assert!(
                            entered.is_ok(),
                            "{} held alongside a conflicting holder",
                            KEYS[k]
                        );
                        smol::Timer::after(Duration::from_micros(500)).await;
                        if exclusive {
                            held[k].store(0, Ordering::SeqCst);
                        } else {
                            held[k].fetch_sub(1, Ordering::SeqCst);
                        }
                        guard.release().await.unwrap();
                    }
                }));
            }
        }
        for task in tasks {
            match join_within(Duration::from_secs(30), "a contending task", task).await {
                Exit::Success(()) => {}
                other => panic!("{other:?}"),
            }
        }
        for locks in &owners {
            assert!(entries(locks).await.is_empty());
        }
    });
}

/// Heartbeats run on the manager's spawner: a holder whose executor is blocked for longer than
/// the lease loses its lock (deliberately: a stuck holder must not keep it forever). A waiter in
/// another process gets the lock while the holder is still stuck, and the holder's `lost()`
/// fires once its executor runs again; its late heartbeat does not take the lock back.
#[test]
fn a_holder_whose_executor_is_stalled_past_its_lease_loses_the_lock_and_is_told() {
    let (_dir, folder, db) = folder_and_db();
    let mut child = spawn("hold-on-a-stalled-executor", &db, &folder, "0");
    child.await_file(&folder.join("held"), Duration::from_secs(20));
    block_on(async {
        let locks = LockManager::open(&db).unwrap();
        mark(&folder, "stall", "");
        let waiter = {
            let locks = locks.clone();
            fork_daemon(async move { locks.exclusive("k", "parent").await })
        };
        let guard =
            match join_within(Duration::from_secs(10), "the grant to the parent", waiter).await {
                Exit::Success(Ok(guard)) => guard,
                other => panic!("{other:?}\n{}", child.output()),
            };
        assert!(
            !folder.join("stall-over").exists(),
            "the parent waited for the stalled holder to recover"
        );
        child.await_file(&folder.join("lost"), Duration::from_secs(20));
        assert_eq!(
            fs::read_to_string(folder.join("lost")).unwrap(),
            "yes",
            "the stalled holder was not told it lost the lock:\n{}",
            child.output()
        );
        let rows = entries(&locks).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].operation, "parent");
        assert!(!guard.lost().is_aborted());
        guard.release().await.unwrap();
    });
    child.assert_success(Duration::from_secs(20));
}

/// The parent waits behind a child with a `poll` of 30 s (and heartbeats every 10 s), and the
/// child releases: the parent's grant comes from the doorbell the child rings as it commits.
#[cfg(unix)]
#[test]
fn a_waiting_process_is_woken_by_the_doorbell_not_by_the_poll() {
    let (_dir, folder, db) = folder_and_db();
    handed_over_by(
        &folder,
        &db,
        Duration::from_secs(30),
        Duration::from_secs(2),
    );
}

/// The same for a parent that waits without a row (a `many`): the child's commit rings every
/// manager whose marker is up.
#[cfg(unix)]
#[test]
fn a_process_waiting_without_a_row_is_woken_by_the_doorbell_not_by_the_poll() {
    let (_dir, folder, db) = folder_and_db();
    handed_over(
        &folder,
        &db,
        Duration::from_secs(30),
        Duration::from_secs(2),
        false,
    );
}

/// The doorbell's folder deleted while the managers run (by hand, or a clean-up of the folder
/// the database lives in): each manager binds its socket again, and puts its marker up again if
/// it waits, so the parent is still woken by the doorbell, not by its 30 s poll; in the queue
/// and without a row.
#[cfg(unix)]
#[test]
fn after_the_doorbell_folder_is_deleted_a_waiting_process_is_still_woken_by_it() {
    for queued in [true, false] {
        let (_dir, folder, db) = folder_and_db();
        handed_over_after(
            &folder,
            &db,
            Duration::from_secs(30),
            Duration::from_secs(2),
            queued,
            |doorbell| {
                fs::remove_dir_all(doorbell).unwrap();
                let entries = |suffix: &str| {
                    fs::read_dir(doorbell).map_or(0, |entries| {
                        (entries.filter_map(Result::ok))
                            .filter(|e| e.file_name().to_string_lossy().ends_with(suffix))
                            .count()
                    })
                };
                // Both managers' sockets, and the parent's marker if it waits without a row.
                within_blocking(Duration::from_secs(5), "the doorbell made again", || {
                    entries(".sock") >= 2 && (queued || entries(".wait") >= 1)
                });
            },
        );
    }
}

/// A manager's waiting marker makes every other process ring it at each commit that frees rows.
/// A refused `try_acquire` waits for nothing, and a queued request is rung by name when it is
/// promoted: neither puts one up. A caller waiting without a row (a `many`) does.
#[cfg(unix)]
#[test]
fn only_a_caller_waiting_without_a_row_puts_up_a_waiting_marker() {
    let (_dir, _folder, db) = folder_and_db();
    let mut doorbell = db.as_os_str().to_owned();
    doorbell.push("-doorbell");
    let doorbell = PathBuf::from(doorbell);
    let markers = || {
        fs::read_dir(&doorbell)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".wait"))
                    .count()
            })
            .unwrap_or(0)
    };
    block_on(async {
        let holder = LockManager::open(&db).unwrap();
        let trying = LockManager::open(&db).unwrap();
        let guard = holder.exclusive("k", "holder").await.unwrap();
        for _ in 0..3 {
            let refused = trying.try_acquire(LockRequest::shared("k", "try")).await;
            assert!(refused.unwrap().is_none());
        }
        assert_eq!(
            markers(),
            0,
            "a refused try_acquire put up a waiting marker"
        );
        // A queued waiter puts up none either: its promoter rings its owner by name.
        let queued = {
            let trying = trying.clone();
            fork_daemon(async move { trying.shared("k", "queued").await })
        };
        within(
            Duration::from_secs(5),
            "the queued waiter's row",
            || async { holder.inspect(Some("k")).await.unwrap().len() == 2 },
        )
        .await;
        assert_eq!(markers(), 0, "a queued waiter put up a waiting marker");
        // A caller waiting without a row has nothing else to be found by.
        let unqueued = {
            let trying = trying.clone();
            fork_daemon(async move { trying.many([LockRequest::shared("k", "unqueued")]).await })
        };
        within(
            Duration::from_secs(5),
            "a caller waiting without a row puts up its marker",
            || async { markers() == 1 },
        )
        .await;
        guard.release().await.unwrap();
        for waiter in [queued, unqueued] {
            match join_within(Duration::from_secs(5), "the waiter's grant", waiter).await {
                Exit::Success(Ok(granted)) => granted.release().await.unwrap(),
                other => panic!("{other:?}"),
            }
        }
    });
}

/// With no doorbell (its folder's path taken by a file), the parent still gets the lock, by
/// polling.
#[test]
fn without_a_doorbell_a_waiting_process_gets_the_lock_by_polling() {
    let (_dir, folder, db) = folder_and_db();
    let mut doorbell = db.as_os_str().to_owned();
    doorbell.push("-doorbell");
    fs::write(&doorbell, "not a folder").unwrap();
    handed_over_by(
        &folder,
        &db,
        Duration::from_millis(20),
        Duration::from_secs(5),
    );
    assert!(
        Path::new(&doorbell).is_file(),
        "the doorbell was set up after all"
    );
}

/// A child holds `k` and releases it when told; the parent, polling every `poll`, queues behind
/// it and must hold `k` within `limit` of the child's release.
fn handed_over_by(folder: &Path, db: &Path, poll: Duration, limit: Duration) {
    handed_over(folder, db, poll, limit, true);
}

/// `handed_over_by`, the parent waiting in the queue or (`queued` false) without a row.
fn handed_over(folder: &Path, db: &Path, poll: Duration, limit: Duration, queued: bool) {
    handed_over_after(folder, db, poll, limit, queued, |_| {});
}

/// `handed_over`, with `meanwhile` done to the doorbell's folder once the parent waits.
fn handed_over_after(
    folder: &Path,
    db: &Path,
    poll: Duration,
    limit: Duration,
    queued: bool,
    meanwhile: impl FnOnce(&Path),
) {
    let mut child = spawn("hold-then-release", db, folder, "0");
    child.await_file(&folder.join("held"), Duration::from_secs(20));
    block_on(async {
        let locks = LockManager::builder().poll(poll).open(db).unwrap();
        let waiter = {
            let locks = locks.clone();
            fork_daemon(async move {
                let request = LockRequest::exclusive("k", "parent");
                if queued {
                    locks.acquire(request).await
                } else {
                    locks.many([request]).await
                }
            })
        };
        if queued {
            within(
                Duration::from_secs(5),
                "the parent queued behind the child",
                || waits_for(&locks, "parent"),
            )
            .await;
        } else {
            // Without a row, its waiting marker is what shows it waits.
            let markers = db.with_extension("db-doorbell");
            within(
                Duration::from_secs(5),
                "the parent waiting without a row",
                || {
                    let markers = markers.clone();
                    async move {
                        fs::read_dir(&markers).is_ok_and(|entries| {
                            (entries.filter_map(Result::ok))
                                .any(|e| e.file_name().to_string_lossy().ends_with(".wait"))
                        })
                    }
                },
            )
            .await;
        }
        meanwhile(&db.with_extension("db-doorbell"));
        // However long it waits, it is not granted while the child holds.
        smol::Timer::after(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "granted while the child held");
        assert!(locks.is_locked("k").await.unwrap());
        mark(folder, "release", "");
        let guard = match join_within(Duration::from_secs(10), "the parent's grant", waiter).await {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("{other:?}\n{}", child.output()),
        };
        let granted_at = unix_micros();
        let released: u64 = fs::read_to_string(folder.join("releasing"))
            .expect("granted before the child began to release")
            .parse()
            .unwrap();
        let waited = Duration::from_micros(granted_at.saturating_sub(released));
        assert!(
            waited < limit,
            "granted {waited:?} after the child released (poll {poll:?})"
        );
        assert_eq!(guard.requests()[0].operation, "parent");
        guard.release().await.unwrap();
    });
    child.assert_success(Duration::from_secs(20));
}
