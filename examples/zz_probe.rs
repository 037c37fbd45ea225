use futures::executor::block_on;
use leasehold::{LockManager, LockRequest};
use std::time::Instant;

fn main() {
    block_on(async {
        for n in [0usize, 1000, 10_000, 50_000] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("l.db");
            let locks = LockManager::open(&path).unwrap();
            let mut held = Vec::new();
            for i in 0..n {
                held.push(
                    locks
                        .try_acquire(LockRequest::exclusive(format!("o{i}"), "x"))
                        .await
                        .unwrap()
                        .unwrap(),
                );
            }
            let rounds = 2000;
            let t = Instant::now();
            for i in 0..rounds {
                let g = locks.exclusive(format!("fresh{i}"), "c").await.unwrap();
                g.release().await.unwrap();
            }
            let cycle = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
            let t = Instant::now();
            for _ in 0..rounds {
                locks.is_locked("fresh").await.unwrap();
            }
            let il = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
            println!("held {n}: cycle {cycle:.1} us, is_locked {il:.1} us");
            drop(held);
        }
        for n in [0usize, 1000, 5000] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("l.db");
            let a = LockManager::open(&path).unwrap();
            let b = LockManager::open(&path).unwrap();
            let mut held = Vec::new();
            let mut waits = Vec::new();
            for i in 0..n {
                held.push(
                    a.try_acquire(LockRequest::exclusive(format!("o{i}"), "x"))
                        .await
                        .unwrap()
                        .unwrap(),
                );
                let b = b.clone();
                let key = format!("o{i}");
                waits.push(smol::spawn(async move { b.exclusive(key, "w").await }));
            }
            // let waits get queued
            while b
                .inspect(None)
                .await
                .unwrap()
                .iter()
                .filter(|e| e.owner == b.owner_id())
                .count()
                < n
            {
                smol::Timer::after(std::time::Duration::from_millis(20)).await;
            }
            let rounds = 2000;
            let t = Instant::now();
            for i in 0..rounds {
                let g = a.exclusive(format!("fresh{i}"), "c").await.unwrap();
                g.release().await.unwrap();
            }
            let cycle = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
            println!("held+waited {n}: cycle {cycle:.1} us");
            drop(held);
            for w in waits {
                let _ = w.await;
            }
        }
    });
}
