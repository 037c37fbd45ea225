//! Storage faults give clear errors: no panic, no hang.

mod common;

use common::child::{self, Child};
use common::{until_blocking, within};
use leasehold::{LockError, LockManager, LockRequest};

#[test]
fn a_database_from_a_newer_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    drop(LockManager::open(&path).unwrap());
    sqlite::open(&path)
        .unwrap()
        .execute("PRAGMA user_version = 99")
        .unwrap();
    match LockManager::open(&path) {
        Err(LockError::SchemaTooNew { found, supported }) => {
            assert_eq!(found, 99);
            assert!(supported < found);
        }
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
}

/// A database written by schema version 1 (a separate `tickets` table) opens, migrated to the
/// current version: its rows are kept, and tickets go on from where its counter stood, so fencing
/// tokens keep increasing.
#[test]
fn a_version_1_database_is_migrated_keeping_its_rows_and_its_ticket_sequence() {
    futures::executor::block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("locks.db");
        let far_future = i64::MAX / 2;
        sqlite::open(&path)
            .unwrap()
            .execute(format!(
                "PRAGMA journal_mode = WAL;
                 CREATE TABLE tickets (id INTEGER PRIMARY KEY CHECK (id = 1), last INTEGER NOT NULL);
                 INSERT INTO tickets (id, last) VALUES (1, 41);
                 CREATE TABLE locks (
                     key TEXT NOT NULL, ticket INTEGER NOT NULL, mode INTEGER NOT NULL,
                     operation TEXT NOT NULL, owner TEXT NOT NULL, held INTEGER NOT NULL,
                     requested_at INTEGER NOT NULL, acquired_at INTEGER,
                     expires_at INTEGER NOT NULL, heartbeat_at INTEGER NOT NULL,
                     PRIMARY KEY (key, ticket)
                 ) WITHOUT ROWID;
                 INSERT INTO locks VALUES ('old', 41, 1, 'from v1', 'someone', 1, 0, 0, {far_future}, 0);
                 PRAGMA user_version = 1;"
            ))
            .unwrap();

        let locks = LockManager::open(&path).unwrap();
        let entries = locks.inspect(None).await.unwrap();
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert_eq!((entries[0].key.as_str(), entries[0].ticket), ("old", 41));
        assert!(locks.is_locked("old").await.unwrap());
        let guard = locks.exclusive("new", "after the migration").await.unwrap();
        assert_eq!(guard.fencing_token(), 42);
        guard.release().await.unwrap();

        let connection = sqlite::open(&path).unwrap();
        let mut version = connection.prepare("PRAGMA user_version").unwrap();
        version.next().unwrap();
        assert_eq!(version.read::<i64, _>(0).unwrap(), 5);
        // Leases are judged by the machine's boot clock from now on, recorded with its boot.
        let mut line = connection
            .prepare("SELECT line FROM time_line WHERE id = 1")
            .unwrap();
        line.next().unwrap();
        let line = line.read::<String, _>(0).unwrap();
        if cfg!(target_os = "linux") {
            assert!(line.starts_with("boot "), "{line}");
        }
        let mut tables = connection
            .prepare("SELECT COUNT(*) FROM sqlite_schema WHERE name = 'tickets'")
            .unwrap();
        tables.next().unwrap();
        assert_eq!(
            tables.read::<i64, _>(0).unwrap(),
            0,
            "the tickets table is gone"
        );
    });
}

/// The ticket counter is a row of the locks table (key ''), and no query shows it as a lock.
#[test]
fn the_ticket_counter_is_never_seen_as_a_lock() {
    futures::executor::block_on(async {
        let locks = LockManager::open_in_memory().unwrap();
        let guard = locks.exclusive("k", "held").await.unwrap();
        assert!(!locks.is_locked("").await.unwrap());
        assert!(locks.inspect(Some("")).await.unwrap().is_empty());
        let entries = locks.inspect(None).await.unwrap();
        assert_eq!(entries.len(), 1, "{entries:?}");
        assert_eq!(entries[0].key, "k");
        guard.release().await.unwrap();
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

#[test]
fn a_path_in_a_missing_directory_is_a_storage_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no/such/dir/locks.db");
    match LockManager::open(&path) {
        Err(LockError::Storage(error)) => {
            assert!(error.doing().starts_with("opening the database"), "{error}");
            assert_eq!(error.code(), Some("14"), "{error}");
            assert!(error.to_string().contains("does not exist"), "{error}");
        }
        other => panic!("expected a storage error, got {other:?}"),
    }
}

#[test]
fn a_file_that_is_not_a_database_is_a_storage_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let noise: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&path, noise).unwrap();
    match LockManager::open(&path) {
        Err(LockError::Storage(error)) => {
            assert!(error.to_string().contains("not a database"), "{error}");
            // The backend's own error, as the source, with its code (SQLITE_NOTADB).
            let source = std::error::Error::source(&error).expect("a source");
            let sqlite = source
                .downcast_ref::<sqlite::Error>()
                .expect("SQLite's error");
            assert_eq!(sqlite.code, Some(26));
            assert_eq!(error.code(), Some("26"));
            assert!(!error.is_transient());
        }
        other => panic!("expected a storage error, got {other:?}"),
    }
}

#[test]
fn a_second_open_of_an_existing_database_keeps_its_rows() {
    futures::executor::block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("locks.db");
        let first = LockManager::open(&path).unwrap();
        let guard = first.exclusive("k", "held").await.unwrap();
        let second = LockManager::open(&path).unwrap();
        let entries = second.inspect(None).await.unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].owner, first.owner_id());
        guard.release().await.unwrap();
    });
}

fn page_size(path: &std::path::Path) -> i64 {
    let connection = sqlite::open(path).unwrap();
    let mut statement = connection.prepare("PRAGMA page_size").unwrap();
    statement.next().unwrap();
    statement.read::<i64, _>(0).unwrap()
}

/// A new file gets small pages (a commit's cost follows the bytes it writes); a file made with
/// SQLite's default pages keeps them, and works as well.
#[test]
fn a_new_database_has_pages_of_1_kib_and_an_existing_one_keeps_its_own() {
    futures::executor::block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("new.db");
        let locks = LockManager::open(&new).unwrap();
        locks
            .exclusive("k", "a")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        assert_eq!(page_size(&new), 1024);
        drop(locks);

        let old = dir.path().join("old.db");
        sqlite::open(&old)
            .unwrap()
            .execute(
                "PRAGMA page_size = 4096; PRAGMA journal_mode = WAL;
                 CREATE TABLE made_before (x INTEGER);",
            )
            .unwrap();
        let locks = LockManager::open(&old).unwrap();
        let held = locks.exclusive("k", "a").await.unwrap();
        let second = LockManager::open(&old).unwrap();
        let refused = second.try_acquire(LockRequest::exclusive("k", "b")).await;
        assert!(refused.unwrap().is_none());
        held.release().await.unwrap();
        second
            .exclusive("k", "b")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        assert_eq!(page_size(&old), 4096);
    });
}

/// The permission bits of `path`.
fn mode_of(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn octal(mode: u32) -> String {
    format!("{mode:#o}")
}

/// The bits the process umask lets through, found by creating a file that asks for all of them.
fn allowed_by_umask(dir: &std::path::Path) -> u32 {
    use std::os::unix::fs::OpenOptionsExt;
    let probe = dir.join("umask-probe");
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o777)
        .open(&probe)
        .unwrap();
    let allowed = mode_of(&probe);
    std::fs::remove_file(probe).unwrap();
    allowed
}

/// Opens a new database at `path` with `locks`, takes a lock so that the `-wal` and `-shm` files
/// exist, and returns the modes of the database and those two files while it is open.
fn modes_of_a_new_database(path: &std::path::Path, locks: LockManager) -> [u32; 3] {
    futures::executor::block_on(async {
        let guard = locks.exclusive("k", "w").await.unwrap();
        let wal = path.with_extension("db-wal");
        let shm = path.with_extension("db-shm");
        let modes = [mode_of(path), mode_of(&wal), mode_of(&shm)];
        guard.release().await.unwrap();
        modes
    })
}

#[test]
fn a_new_database_and_its_wal_and_shm_files_are_for_their_owner_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let expected = 0o600 & allowed_by_umask(dir.path());
    let modes = modes_of_a_new_database(&path, LockManager::open(&path).unwrap());
    assert_eq!(
        modes.map(octal),
        [expected; 3].map(octal),
        "database, -wal, -shm"
    );
}

#[test]
fn a_file_mode_for_a_group_applies_to_the_database_and_its_wal_and_shm_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let expected = 0o660 & allowed_by_umask(dir.path());
    let locks = LockManager::builder().file_mode(0o660).open(&path).unwrap();
    let modes = modes_of_a_new_database(&path, locks);
    assert_eq!(
        modes.map(octal),
        [expected; 3].map(octal),
        "database, -wal, -shm"
    );
}

/// Whoever may write the database may ring its managers: each manager's doorbell socket, and
/// the folder that holds them, follow the database's permissions (here an existing file made
/// for a group), not the process umask.
#[cfg(unix)]
#[test]
fn a_doorbell_socket_and_its_folder_follow_the_databases_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    drop(LockManager::open(&path).unwrap());
    std::fs::remove_dir_all(dir.path().join("locks.db-doorbell")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660)).unwrap();
    let locks = LockManager::open(&path).unwrap();
    let doorbell = dir.path().join("locks.db-doorbell");
    // The worker sets the doorbell up after the open returns, and the socket's mode just after
    // binding it.
    let mut sockets = Vec::new();
    let made = until_blocking(std::time::Duration::from_secs(10), || {
        sockets = std::fs::read_dir(&doorbell)
            .into_iter()
            .flatten()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|e| e == "sock"))
            .collect();
        sockets.len() == 1 && mode_of(&sockets[0]) == 0o660
    });
    assert!(
        made,
        "no doorbell socket of mode 0o660 within 10 s: {:?}",
        sockets
            .iter()
            .map(|s| octal(mode_of(s)))
            .collect::<Vec<_>>()
    );
    assert_eq!(sockets.len(), 1, "{sockets:?}");
    assert_eq!(octal(mode_of(&doorbell)), octal(0o770), "the folder");
    drop(locks);
}

#[test]
fn an_existing_database_keeps_its_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    drop(LockManager::open(&path).unwrap());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    drop(LockManager::builder().file_mode(0o600).open(&path).unwrap());
    assert_eq!(mode_of(&path), 0o640);
}

#[test]
fn a_file_mode_outside_0o777_or_without_owner_read_and_write_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    for mode in [0o1660, 0o4600, 0o10_0600, 0o400, 0o200, 0o060, 0] {
        match LockManager::builder().file_mode(mode).open(&path) {
            Err(LockError::InvalidConfig(why)) => assert!(why.contains("file mode"), "{why}"),
            other => panic!("{mode:#o}: expected InvalidConfig, got {other:?}"),
        }
    }
    assert!(!path.exists(), "a refused configuration created the file");
    for mode in [0o600, 0o640, 0o660, 0o700, 0o777] {
        assert!(LockManager::builder()
            .file_mode(mode)
            .open_in_memory()
            .is_ok());
    }
}

/// Marks an existing database read-only the way SQLite itself understands: a file-format write
/// version above 2 in the header. (Permissions cannot simulate this when the tests run as root,
/// which ignores them.)
fn make_read_only(path: &std::path::Path) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[18] = 3;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_read_only_database_is_a_storage_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    drop(LockManager::open(&path).unwrap());
    // Back to a rollback journal first, so that the whole database is in the main file.
    sqlite::open(&path)
        .unwrap()
        .execute("PRAGMA journal_mode = DELETE")
        .unwrap();
    make_read_only(&path);
    match LockManager::open(&path) {
        Err(LockError::Storage(error)) => {
            assert!(error.code().is_some(), "{error}");
            assert!(error.to_string().contains("readonly"), "{error}");
        }
        other => panic!("expected a storage error, got {other:?}"),
    }
}

#[test]
fn a_database_file_without_write_permission_is_refused_or_still_works() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    drop(LockManager::open(&path).unwrap());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
    let writable = std::fs::OpenOptions::new().write(true).open(&path).is_ok();
    match LockManager::open(&path) {
        Err(LockError::Storage(error)) => {
            assert!(!writable, "refused a writable file: {error}");
            assert!(error.code().is_some(), "{error}");
        }
        // Running as root, permissions do not stop writes, and neither should they stop us.
        Ok(locks) if writable => futures::executor::block_on(async {
            locks
                .exclusive("k", "w")
                .await
                .unwrap()
                .release()
                .await
                .unwrap();
        }),
        other => panic!("expected a storage error, got {other:?}"),
    }
}

fn remove_database(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

/// After the file under a running manager is deleted or replaced, its writes are refused with a
/// clear error once it looks at the path again (within a millisecond), and the guard it held is
/// told it is lost within about one lease; a manager on the new file starts from nothing.
fn assert_file_loss_is_reported(replace: bool) {
    use std::time::Duration;
    futures::executor::block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("locks.db");
        let locks = LockManager::builder()
            .lease(Duration::from_secs(1))
            .heartbeat(Duration::from_millis(200))
            .open(&path)
            .unwrap();
        let guard = locks.exclusive("k", "held").await.unwrap();
        remove_database(&path);
        if replace {
            let other = dir.path().join("other.db");
            drop(LockManager::open(&other).unwrap());
            std::fs::rename(&other, &path).unwrap();
        }
        within(
            Duration::from_secs(5),
            "writes to the old file were refused",
            || async {
                match locks.exclusive("j", "after").await {
                    Err(LockError::Storage(error)) => {
                        assert!(error.to_string().contains("deleted or replaced"), "{error}");
                        true
                    }
                    // Granted on the old file, in the moment before the manager looked again.
                    Ok(guard) => {
                        drop(guard);
                        false
                    }
                    Err(other) => panic!("expected a storage error, got {other:?}"),
                }
            },
        )
        .await;
        within(
            Duration::from_secs(5),
            "the guard was told it is lost",
            || async { guard.lost().is_aborted() },
        )
        .await;
        assert!(matches!(
            guard.release().await,
            Err(LockError::Storage(_)) | Ok(())
        ));
        let fresh = LockManager::open(&path).unwrap();
        assert!(fresh.inspect(None).await.unwrap().is_empty());
        fresh
            .exclusive("k", "new")
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        drop(locks);
    });
}

#[test]
fn a_database_deleted_while_a_manager_runs_is_reported_and_loses_its_guards() {
    assert_file_loss_is_reported(false);
}

#[test]
fn a_database_replaced_while_a_manager_runs_is_reported_and_loses_its_guards() {
    assert_file_loss_is_reported(true);
}

/// The shared file, for the children of `eight_processes_hammering_one_file_never_see_busy`.
const HAMMER_DB: &str = "LEASEHOLD_HAMMER_DB";
const HAMMER_PROCESSES: usize = 8;
const HAMMER_ROUNDS: usize = 60;

/// A child of `eight_processes_hammering_one_file_never_see_busy`: opens the shared file at
/// the same moment as the others (which races to switch it to WAL) and takes and releases locks
/// as fast as it can. Any error fails the child.
#[test]
fn hammer_child() {
    if child::role().is_none() {
        return;
    }
    let db = std::path::PathBuf::from(std::env::var_os(HAMMER_DB).expect("the shared file"));
    let log = db.with_file_name("exclusive.log");
    let id = std::process::id();
    futures::executor::block_on(async {
        let locks = LockManager::open(&db).expect("open");
        for round in 0..HAMMER_ROUNDS {
            let guard = match round % 4 {
                0 => locks.exclusive("k", "hammer").await.expect("exclusive"),
                1 => locks.shared("k", "hammer").await.expect("shared"),
                2 => locks
                    .many([
                        LockRequest::shared("j", "hammer"),
                        LockRequest::exclusive("k", "hammer"),
                    ])
                    .await
                    .expect("many"),
                _ => match locks
                    .try_acquire(LockRequest::exclusive("k", "hammer"))
                    .await
                    .expect("try_acquire")
                {
                    Some(guard) => guard,
                    None => continue,
                },
            };
            let exclusive = guard
                .requests()
                .iter()
                .any(|r| r.key == "k" && r.mode == leasehold::Mode::Exclusive);
            if exclusive {
                append(&log, &format!("+ {id}\n"));
                append(&log, &format!("- {id}\n"));
            }
            guard.release().await.expect("release");
        }
        locks.shutdown().await.expect("shutdown");
    });
}

fn append(log: &std::path::Path, line: &str) {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .and_then(|mut file| file.write_all(line.as_bytes()))
        .expect("append to the log");
}

#[test]
fn eight_processes_hammering_one_file_never_see_busy() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locks.db");
    let mut children: Vec<Child> = (0..HAMMER_PROCESSES)
        .map(|_| Child::start(Child::command("hammer_child", "hammer").env(HAMMER_DB, &db)))
        .collect();
    for child in &mut children {
        child.assert_success(std::time::Duration::from_secs(120));
    }
    // Exclusive holds never overlapped: every entry is followed by the same process's exit.
    let log = std::fs::read_to_string(dir.path().join("exclusive.log")).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert!(
        lines.len() >= 2 * HAMMER_PROCESSES,
        "too few exclusive holds:\n{log}"
    );
    for pair in lines.chunks(2) {
        assert_eq!(pair.len(), 2, "an unfinished hold:\n{log}");
        assert_eq!(
            pair[0].replace('+', "-"),
            pair[1],
            "overlapping holds:\n{log}"
        );
    }
    // And nothing is left behind.
    futures::executor::block_on(async {
        let locks = LockManager::open(&db).unwrap();
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}
