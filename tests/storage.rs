//! Storage faults give clear errors: no panic, no hang.

use leasehold::{LockError, LockManager};

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

#[test]
fn a_path_in_a_missing_directory_is_a_storage_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no/such/dir/locks.db");
    match LockManager::open(&path) {
        Err(LockError::Storage(message)) => {
            assert!(message.contains("opening"), "{message}");
            assert!(message.contains("SQLite code"), "{message}");
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
        Err(LockError::Storage(message)) => {
            assert!(message.contains("not a database"), "{message}");
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
