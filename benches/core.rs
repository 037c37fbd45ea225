//! Criterion benchmarks of the hot paths, for profiling: scopes, fibers, the semaphore (next to
//! `async-lock`'s, in the same run), and uncontended lock cycles.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use futures::executor::block_on;
use leasehold::{fork_daemon, Interrupted, LockManager, Scoped, Semaphore};

fn scopes(c: &mut Criterion) {
    c.bench_function("scope: Scoped with 3 finalizers, run to completion", |b| {
        b.iter(|| {
            block_on(Scoped::<u32, Interrupted>::new(|scope| async move {
                for _ in 0..3 {
                    scope.add_finalizer(|status| async move {
                        black_box(status);
                    });
                }
                Ok(black_box(1))
            }))
        })
    });
}

fn fibers(c: &mut Criterion) {
    c.bench_function("fiber: fork_daemon + join", |b| {
        b.iter(|| block_on(fork_daemon(async { black_box(1) }).join()))
    });
}

fn semaphores(c: &mut Criterion) {
    let ours = Semaphore::new(1);
    let theirs = async_lock::Semaphore::new(1);
    let mut group = c.benchmark_group("semaphore: uncontended acquire + release");
    group.bench_function("leasehold", |b| {
        b.iter(|| block_on(async { drop(black_box(ours.acquire(1).await)) }))
    });
    group.bench_function("async-lock", |b| {
        b.iter(|| block_on(async { drop(black_box(theirs.acquire().await)) }))
    });
    group.finish();
}

/// The storage floor: one write transaction done directly with the `sqlite` crate, with the
/// pragmas the lock manager uses.
fn raw_transaction(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let conn = sqlite::open(dir.path().join("raw.db")).unwrap();
    conn.execute(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;
         CREATE TABLE t (id INTEGER PRIMARY KEY, key TEXT NOT NULL);",
    )
    .unwrap();
    c.bench_function("sqlite: BEGIN IMMEDIATE; INSERT; DELETE; COMMIT", |b| {
        b.iter(|| {
            conn.execute(
                "BEGIN IMMEDIATE; INSERT INTO t (key) VALUES ('k'); DELETE FROM t; COMMIT;",
            )
            .unwrap()
        })
    });
}

fn locks(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let on_file = LockManager::open(dir.path().join("bench.db")).unwrap();
    let in_memory = LockManager::open_in_memory().unwrap();
    let mut group = c.benchmark_group("lock: uncontended exclusive acquire + release");
    for (name, locks) in [("file", &on_file), ("in memory", &in_memory)] {
        group.bench_function(name, |b| {
            b.iter(|| {
                block_on(async {
                    let guard = locks.exclusive("key", "bench").await.unwrap();
                    guard.release().await.unwrap();
                })
            })
        });
    }
    group.finish();
}

criterion_group!(benches, scopes, fibers, semaphores, raw_transaction, locks);
criterion_main!(benches);
