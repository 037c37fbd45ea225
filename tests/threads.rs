//! Which threads a lock manager starts, read from the process's own task list (Linux). One test
//! in its own binary, so that no other test's managers come and go meanwhile.

#![cfg(target_os = "linux")]

mod common;

use std::time::Duration;

use common::{temp_db, within_blocking};
use futures::executor::block_on;
use leasehold::LockManager;

/// The names of this process's threads that the lock manager starts (all begin `leasehold-`; the
/// kernel keeps 15 bytes of a name).
fn leasehold_threads() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .expect("the process's task list")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_owned())
        .filter(|name| name.starts_with("leasehold-"))
        .collect();
    names.sort();
    names
}

#[test]
fn the_memory_backend_runs_on_the_storage_worker_alone_and_sqlite_adds_its_doorbell() {
    assert_eq!(leasehold_threads(), Vec::<String>::new());

    let memory = LockManager::open_in_memory().unwrap();
    block_on(async {
        let guard = memory.exclusive("k", "test").await.unwrap();
        assert!(memory.is_locked("k").await.unwrap());
        guard.release().await.unwrap();
    });
    within_blocking(Duration::from_secs(5), "the storage thread", || {
        leasehold_threads() == ["leasehold-stora"]
    });

    // The same check sees a backend's own thread: SQLite's doorbell, for other processes.
    let (_dir, path) = temp_db();
    let file = LockManager::open(&path).unwrap();
    block_on(async {
        file.exclusive("k", "test")
            .await
            .unwrap()
            .release()
            .await
            .unwrap()
    });
    // A new thread names itself once it runs (until then it shows its parent's name).
    within_blocking(Duration::from_secs(5), "the doorbell's thread", || {
        leasehold_threads() == ["leasehold-doorb", "leasehold-stora", "leasehold-stora"]
    });

    block_on(async {
        memory.shutdown().await.unwrap();
        file.shutdown().await.unwrap();
    });
    drop((memory, file));
    within_blocking(
        Duration::from_secs(10),
        "every thread the managers started has ended",
        || leasehold_threads().is_empty(),
    );
}
