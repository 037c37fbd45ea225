//! The admin API an operator's tools are built on (the `leasehold` command is one): a stream of
//! a store's changes (`LockManager::changes`) and opening a store as it is
//! (`LockManagerBuilder::open_existing`, `connect_existing`). Removal (`LockManager::remove`)
//! has its own file, `removal.rs`. Each runs on every store.

mod common;
mod stores;

use std::time::Duration;

use futures::StreamExt;
use leasehold::{Changes, EntryState, Finding, LockEntry, LockError, LockManager};

use common::{bounded, within};

/// Generous: a change of another manager is seen within a poll of 10 ms.
const PATIENCE: Duration = Duration::from_secs(10);

/// The next rows the stream reports, failing the test if none come within [`PATIENCE`].
async fn next(changes: &mut Changes, what: &str) -> Vec<LockEntry> {
    bounded(PATIENCE, what, changes.next())
        .await
        .expect("the stream goes on")
        .expect("the store can be read")
}

/// The rows as (key, operation, held) triples, for comparing.
fn shown(rows: &[LockEntry]) -> Vec<(String, String, bool)> {
    rows.iter()
        .map(|row| {
            (
                row.key.clone(),
                row.operation.clone(),
                row.state == EntryState::Held,
            )
        })
        .collect()
}

fn row(key: &str, operation: &str, held: bool) -> (String, String, bool) {
    (key.to_owned(), operation.to_owned(), held)
}

#[test]
fn changes_start_with_the_rows_as_they_are_then_report_each_grant_queue_and_release() {
    stores::on_every_store(|store| async move {
        let (watcher, first, second) = (store.open().await, store.open().await, store.open().await);
        let held = first.exclusive("repo/a", "prune").await.unwrap();
        let mut changes = watcher.changes("repo/");
        assert_eq!(
            shown(&next(&mut changes, "the rows as they are").await),
            [row("repo/a", "prune", true)]
        );

        let waiting = {
            let second = second.clone();
            leasehold::fork_daemon(async move { second.exclusive("repo/a", "backup").await })
        };
        assert_eq!(
            shown(&next(&mut changes, "the queued request").await),
            [row("repo/a", "prune", true), row("repo/a", "backup", false)]
        );

        held.release().await.unwrap();
        // The release and the waiter's promotion are one commit, or two close together.
        let mut rows = next(&mut changes, "the release").await;
        if shown(&rows) != [row("repo/a", "backup", true)] {
            rows = next(&mut changes, "the promotion").await;
        }
        assert_eq!(shown(&rows), [row("repo/a", "backup", true)]);

        let granted = waiting.join().await.success().unwrap().unwrap();
        granted.release().await.unwrap();
        assert!(next(&mut changes, "the last release").await.is_empty());
    });
}

#[test]
fn changes_leave_out_other_keys_and_heartbeats() {
    stores::on_every_store(|store| async move {
        let watcher = store.open().await;
        let beating = store
            .open_with(
                LockManager::builder()
                    .lease(Duration::from_millis(400))
                    .heartbeat(Duration::from_millis(20)),
            )
            .await;
        let mine = beating.shared("repo/a", "read").await.unwrap();
        let mut changes = watcher.changes("repo/");
        assert_eq!(shown(&next(&mut changes, "the rows").await).len(), 1);

        // Rows on other keys come and go, and the holder renews its lease several times: none
        // of it is a change of "repo/".
        let other = watcher.exclusive("other/b", "elsewhere").await.unwrap();
        other.release().await.unwrap();
        let renewed = beating.stats().heartbeats;
        within(PATIENCE, "three heartbeats", || {
            let beating = beating.clone();
            async move { beating.stats().heartbeats >= renewed + 3 }
        })
        .await;

        mine.release().await.unwrap();
        assert!(
            next(&mut changes, "the release").await.is_empty(),
            "the next item is the release, not a heartbeat or another key"
        );
    });
}

#[cfg(feature = "testkit")]
#[test]
fn a_lease_that_runs_out_is_a_change() {
    use leasehold::testkit::{FaultPlan, SimStore};
    const LEASE: Duration = Duration::from_secs(30);
    common::in_simulation(3, |sim| {
        let store = SimStore::new(sim);
        async move {
            let open = || {
                LockManager::builder()
                    .lease(LEASE)
                    .open_simulated(&store, FaultPlan::none())
            };
            let (watcher, holder) = (open()?, open()?);
            let _held = holder.exclusive("repo/a", "prune").await?;
            let mut changes = watcher.changes("repo/");
            assert_eq!(next(&mut changes, "the rows").await.len(), 1);
            // Killed: its rows stay until their lease runs out, and nobody writes.
            store.kill(&holder);
            let lapse = bounded(LEASE + PATIENCE, "the lapse", changes.next()).await;
            assert!(lapse.expect("the stream goes on")?.is_empty());
            drop(changes);
            Ok::<_, LockError>(())
        }
    })
    .unwrap();
}

#[test]
fn open_existing_on_a_missing_file_fails_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    match LockManager::builder().open_existing(&path) {
        Err(LockError::Storage(error)) => {
            assert!(error.to_string().contains("no such file"), "{error}")
        }
        other => panic!("expected a storage error, got {other:?}"),
    }
    assert!(!path.exists(), "no file was made");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn open_existing_opens_a_store_that_is_there_and_sees_its_rows() {
    common::on_every_executor(|| async {
        let (_dir, path) = common::temp_db();
        let holder = LockManager::open(&path).unwrap();
        let _held = holder.exclusive("k", "work").await.unwrap();
        let operator = LockManager::builder().open_existing(&path).unwrap();
        let rows = operator.inspect(None).await.unwrap();
        assert_eq!(shown(&rows), [row("k", "work", true)]);
    });
}

#[cfg(all(feature = "postgres", feature = "testkit"))]
#[test]
fn connect_existing_on_a_missing_schema_fails_and_creates_nothing() {
    use leasehold::testkit::postgres as pg_support;
    let Some(server) = pg_support::server() else {
        return;
    };
    let schema = pg_support::schema("connect_existing_missing");
    let connected = futures::executor::block_on(
        LockManager::builder()
            .schema(&schema)
            .connect_existing(server.url()),
    );
    assert!(
        matches!(connected, Err(LockError::Storage(_))),
        "{connected:?}"
    );
    let schemas = server.sql(&format!(
        "SELECT COUNT(*) FROM pg_namespace WHERE nspname = '{schema}'"
    ));
    assert_eq!(schemas.trim(), "0", "no schema was made");
}

/// What a check of `store` finds (SQLite or PostgreSQL).
async fn check(store: &stores::Store) -> Vec<Finding> {
    match store {
        stores::Store::Sqlite { path, .. } => LockManager::builder().check(path),
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        stores::Store::Postgres { url, schema } => {
            LockManager::builder()
                .schema(schema)
                .check_server(url)
                .await
        }
        _ => unreachable!("on_every_database gives databases"),
    }
    .expect("the store can be checked")
}

#[test]
fn a_check_finds_nothing_wrong_with_a_store_in_use_and_counts_its_rows() {
    stores::on_every_database(|store| async move {
        let (holder, waiter) = (store.open().await, store.open().await);
        let held = holder.exclusive("k", "work").await.unwrap();
        let waiting = {
            let waiter = waiter.clone();
            leasehold::fork_daemon(async move { waiter.exclusive("k", "more").await })
        };
        within(PATIENCE, "the request queued", || {
            let holder = holder.clone();
            async move { holder.inspect(Some("k")).await.unwrap().len() == 2 }
        })
        .await;
        let findings = check(&store).await;
        let problems: Vec<_> = findings.iter().filter(|f| f.problem).collect();
        assert!(problems.is_empty(), "{problems:?}");
        assert!(
            findings.iter().any(|f| f.what == "1 held, 1 waiting"),
            "{findings:?}"
        );
        held.release().await.unwrap();
        let granted = waiting.join().await.success().unwrap().unwrap();
        granted.release().await.unwrap();
    });
}

#[cfg(unix)]
#[test]
fn a_check_finds_a_world_writable_file_and_says_how_to_mend_it() {
    use std::os::unix::fs::PermissionsExt;
    let (_dir, path) = common::temp_db();
    drop(LockManager::open(&path).unwrap());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let findings = LockManager::builder().check(&path).unwrap();
    let problem = findings
        .iter()
        .find(|f| f.problem)
        .expect("a problem found");
    assert!(problem.what.contains("world-writable"), "{problem}");
    assert_eq!(
        problem.fix.as_deref(),
        Some(format!("chmod o-rw {}", path.display()).as_str())
    );
    assert!(
        problem.to_string().starts_with("problem: the file "),
        "{problem}"
    );
}

#[test]
fn a_check_of_a_missing_file_fails_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    assert!(matches!(
        LockManager::builder().check(&path),
        Err(LockError::Storage(_))
    ));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
