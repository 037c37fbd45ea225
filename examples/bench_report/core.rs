//! Contention, and the core's primitives beside their counterparts: the contended lock against
//! `async-lock`'s `RwLock`, a `Scoped` with finalizers, the semaphore against `async-lock`'s.

use super::*;

/// A tiny generator, so that every task draws its own keys and modes.
pub(crate) fn draw(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

pub(crate) const TASKS: u64 = 16;
pub(crate) const KEYS: u64 = 4;

/// Lock operations per second with 16 tasks over 4 keys, 80 % shared, holding for no time.
pub(crate) fn contended_ops_per_s(locks: &LockManager, duration: Duration) -> Result<f64, Error> {
    grants_per_s(locks, TASKS, duration, |state| {
        let key = format!("key {}", draw(state) % KEYS);
        if draw(state) % 5 == 0 {
            LockRequest::exclusive(key, "write")
        } else {
            LockRequest::shared(key, "read")
        }
    })
}

/// Grants per second of `tasks` tasks each taking the request `next` draws (from the task's
/// own generator state) and letting go of it at once, again and again for `duration`.
pub(crate) fn grants_per_s(
    locks: &LockManager,
    tasks: u64,
    duration: Duration,
    next: impl Fn(&mut u64) -> LockRequest + Clone,
) -> Result<f64, Error> {
    let ops = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let tasks: Vec<_> = (0..tasks)
        .map(|task| {
            let (locks, ops, next) = (locks.clone(), ops.clone(), next.clone());
            async move {
                let mut state = 0x9e37_79b9_7f4a_7c15 ^ (task + 1);
                while Instant::now() < deadline {
                    locks.acquire(next(&mut state)).await?.release().await?;
                    ops.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<(), leasehold::LockError>(())
            }
        })
        .collect();
    for result in block_on(futures::future::join_all(tasks)) {
        result?;
    }
    Ok(ops.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// The same workload on `async-lock`'s `RwLock` per key, in memory: the in-memory ceiling.
pub(crate) fn rwlock_ops_per_s(duration: Duration) -> f64 {
    let keys: Arc<Vec<async_lock::RwLock<()>>> =
        Arc::new((0..KEYS).map(|_| async_lock::RwLock::new(())).collect());
    let ops = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (keys, ops) = (keys.clone(), ops.clone());
            async move {
                let mut state = 0x9e37_79b9_7f4a_7c15 ^ (task + 1);
                let mut done = 0u64;
                while Instant::now() < deadline {
                    let key = &keys[(draw(&mut state) % KEYS) as usize];
                    if draw(&mut state) % 5 == 0 {
                        drop(black_box(key.write().await));
                    } else {
                        drop(black_box(key.read().await));
                    }
                    done += 1;
                    if done % 64 == 0 {
                        // Let the other tasks in: these locks never make a task wait.
                        yield_now().await;
                    }
                }
                ops.fetch_add(done, Ordering::Relaxed);
            }
        })
        .collect();
    block_on(futures::future::join_all(tasks));
    ops.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Gives the other tasks of this executor a turn.
pub(crate) async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

pub(crate) fn scope_cycle_ns(reps: usize) -> f64 {
    block_on(async {
        let mut samples = Vec::new();
        for _ in 0..10 {
            let started = Instant::now();
            for _ in 0..reps / 10 {
                let value = Scoped::<u32, Interrupted>::new(|scope| async move {
                    for _ in 0..3 {
                        scope.add_finalizer(|status| async move {
                            black_box(status);
                        });
                    }
                    Ok(1)
                })
                .await;
                black_box(value.ok());
            }
            samples.push(started.elapsed().as_nanos() as f64 / (reps / 10) as f64);
        }
        median(&mut samples)
    })
}

/// Ours (whose permit is owned: `'static`, so it can be handed to a scope), `async-lock`'s with
/// its borrowed guard (`acquire`), and with its owned guard (`acquire_arc`), like for like.
pub(crate) fn semaphore_cycle_ns(reps: usize) -> Vec<f64> {
    let ours = Semaphore::new(1);
    let theirs = Arc::new(async_lock::Semaphore::new(1));
    block_on(async {
        let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
        let per = |started: Instant| started.elapsed().as_nanos() as f64 / (reps / 10) as f64;
        // Interleaved batches, so that all three see the same machine.
        for _ in 0..10 {
            let started = Instant::now();
            for _ in 0..reps / 10 {
                drop(black_box(ours.acquire(1).await));
            }
            a.push(per(started));
            let started = Instant::now();
            for _ in 0..reps / 10 {
                drop(black_box(theirs.acquire().await));
            }
            b.push(per(started));
            let started = Instant::now();
            for _ in 0..reps / 10 {
                drop(black_box(theirs.acquire_arc().await));
            }
            c.push(per(started));
        }
        vec![median(&mut a), median(&mut b), median(&mut c)]
    })
}

/// Polls per second of the simulation kit's executor: `tasks` tasks that each yield 1,000 times
/// (woken at once), run by a seeded `Sim`.
#[cfg(feature = "testkit")]
pub(crate) fn sim_polls_per_s(tasks: usize) -> f64 {
    const YIELDS: usize = 1_000;
    let mut sim = leasehold::testkit::Sim::new(7);
    let spawner = sim.spawner();
    for _ in 0..tasks {
        spawner.spawn(Box::pin(async {
            for _ in 0..YIELDS {
                yield_once().await;
            }
        }));
    }
    let started = Instant::now();
    sim.block_on(async {}).expect("the tasks end");
    (tasks * (YIELDS + 1) + 1) as f64 / started.elapsed().as_secs_f64()
}

/// The wall time, in milliseconds, of `every_await_point` (stopped by signal) over a
/// three-level scope tree with two fibers and six finalizers.
#[cfg(feature = "testkit")]
pub(crate) fn every_await_point_ms() -> f64 {
    use leasehold::testkit::{every_await_point, SimConfig, Stop};
    let tree = || {
        Scoped::<u32, Interrupted>::new(|scope| async move {
            for _ in 0..2 {
                scope.add_finalizer(|_| yield_once());
            }
            let middle = Scoped::<u32, Interrupted>::new(|scope| async move {
                scope.add_finalizer(|_| yield_once());
                scope.add_finalizer(|_| async {});
                let worker = scope.fork(async {
                    yield_once().await;
                    1
                });
                let inner = Scoped::<u32, Interrupted>::new(|scope| async move {
                    scope.add_finalizer(|_| yield_once());
                    scope.add_finalizer(|_| async {});
                    let fiber = scope.fork(async {
                        yield_once().await;
                        2
                    });
                    Ok(fiber.join().await.success().unwrap_or(0))
                });
                let inner = inner.await?;
                Ok(inner + worker.join().await.success().unwrap_or(0))
            });
            middle.await
        })
    };
    let started = Instant::now();
    let explored = every_await_point(SimConfig::default(), Stop::Signal, |_| tree())
        .expect("the tree keeps every promise");
    black_box(explored);
    started.elapsed().as_secs_f64() * 1e3
}

/// Simulated lock cycles per second: an exclusive acquire and release of a free key by a
/// manager opened on a simulated store (`open_simulated`, no faults), `cycles` of them inside
/// one simulation, timed from the simulation's start to its end in real time.
#[cfg(feature = "testkit")]
pub(crate) fn sim_lock_cycles_per_s(cycles: usize) -> f64 {
    use leasehold::testkit::{FaultPlan, Sim, SimStore};
    let mut sim = Sim::new(7);
    let store = SimStore::new(&sim);
    let started = Instant::now();
    sim.block_on(async move {
        let locks = leasehold::LockManager::builder()
            .open_simulated(&store, FaultPlan::none())
            .expect("a simulated manager");
        for _ in 0..cycles {
            let guard = locks.exclusive("bench", "cycle").await.expect("granted");
            guard.release().await.expect("released");
        }
    })
    .expect("the simulation ends");
    cycles as f64 / started.elapsed().as_secs_f64()
}

/// Yields once, woken at once.
#[cfg(feature = "testkit")]
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if std::mem::replace(&mut yielded, true) {
            std::task::Poll::Ready(())
        } else {
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}
