//! Helpers shared by the lock manager's property, abort, worker and process tests.
//!
//! Each test file uses only some of them.
#![allow(dead_code)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::FutureExt;
use leasehold::{EntryState, Exit, Fiber, Guard, LockEntry, LockError, LockManager, Scoped};

/// Waits until `condition` holds, checking every millisecond, for at most `limit_ms`.
pub async fn within<F, Fut>(limit_ms: u64, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_millis(limit_ms);
    while !condition().await {
        assert!(
            Instant::now() < deadline,
            "not within {limit_ms} ms: {what}"
        );
        smol::Timer::after(Duration::from_millis(1)).await;
    }
}

/// `future`'s output, or a panic naming `what` if it takes longer than `limit_ms`.
pub async fn bounded<T>(limit_ms: u64, what: &str, future: impl Future<Output = T>) -> T {
    let timer = smol::Timer::after(Duration::from_millis(limit_ms));
    futures::select! {
        value = future.fuse() => value,
        _ = FutureExt::fuse(timer) => panic!("not within {limit_ms} ms: {what}"),
    }
}

/// Joins a fiber, failing the test if it does not end within `limit_ms`.
pub async fn join_within<T: Send + 'static>(limit_ms: u64, what: &str, fiber: Fiber<T>) -> Exit<T> {
    bounded(limit_ms, what, fiber.join()).await
}

/// A fresh database file in a temporary folder (kept alive by the returned guard).
pub fn temp_db() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temporary folder");
    let path = dir.path().join("locks.db");
    (dir, path)
}

/// Every live entry, as seen by `locks`.
pub async fn entries(locks: &LockManager) -> Vec<LockEntry> {
    locks.inspect(None).await.expect("inspect")
}

/// The live entries whose operation is `operation`.
pub async fn rows_of(locks: &LockManager, operation: &str) -> Vec<LockEntry> {
    entries(locks)
        .await
        .into_iter()
        .filter(|e| e.operation == operation)
        .collect()
}

/// A connection of the test's own to a database file, which waits while the managers write.
pub fn connection(path: &Path) -> sqlite::Connection {
    let mut connection = sqlite::Connection::open(path).expect("open the database");
    connection
        .set_busy_timeout(10_000)
        .expect("set a busy timeout");
    connection
}

/// SQLite's write lock on a database file, held by a connection of the test's own until dropped.
pub struct WriteLock(sqlite::Connection);

impl WriteLock {
    pub fn take(path: &Path) -> WriteLock {
        let connection = connection(path);
        connection
            .execute("BEGIN IMMEDIATE")
            .expect("take the write lock");
        WriteLock(connection)
    }
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        let _ = self.0.execute("ROLLBACK");
    }
}

/// B's acquisition of "k", queued behind A's and granted when A releases, but polled only by the
/// test: its task is "stalled" between polls, and has not read its grant yet.
pub async fn granted_while_stalled(a: &LockManager, b: &LockManager) -> Scoped<Guard, LockError> {
    let holder = a.exclusive("k", "A").await.unwrap();
    let mut acquisition = b.exclusive("k", "B");
    within(5_000, "B queued", || {
        assert!(futures::FutureExt::now_or_never(&mut acquisition).is_none());
        async { b.inspect(Some("k")).await.unwrap().len() == 2 }
    })
    .await;
    holder.release().await.unwrap();
    within(5_000, "B's row promoted", || async {
        let rows = b.inspect(Some("k")).await.unwrap();
        rows.len() == 1 && rows[0].state == EntryState::Held
    })
    .await;
    acquisition
}

/// Polls a stalled acquisition again until it returns a guard.
pub async fn read_when_stalled(acquisition: &mut Scoped<Guard, LockError>) -> Guard {
    let mut delivered = None;
    within(5_000, "the acquisition returned", || {
        delivered = futures::FutureExt::now_or_never(&mut *acquisition);
        let returned = delivered.is_some();
        async move { returned }
    })
    .await;
    delivered.unwrap().unwrap()
}
