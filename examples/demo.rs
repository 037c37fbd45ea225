//! The main demo: several tasks in this process, and a child process, contend for a few
//! repository locks kept in one SQLite file. A monitor prints who holds and who waits (from
//! `inspect`) as the work proceeds; one impatient task is interrupted by a timeout and cleans up
//! before it reports; then everything shuts down and the file is left empty.
//!
//! Run it with `cargo run --example demo`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use leasehold::{
    fork_daemon, AbortController, AbortSignal, Clock, EntryState, ExitStatus, Fiber, LockError,
    LockManager, LockRequest, Mode, Scoped, SystemClock,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let [_, flag, path, since] = args.as_slice() {
        if flag == "--child" {
            // Report times from the parent's start, so both processes share one time line.
            let since = Duration::from_millis(since.parse()?);
            let started = Instant::now() - SystemClock.now().saturating_sub(since);
            return block_on(child(Path::new(path), started));
        }
    }
    block_on(parent())
}

/// Sleeps on the real clock (works under any executor).
async fn pause(ms: u64) {
    SystemClock.sleep(Duration::from_millis(ms)).await;
}

fn say(started: Instant, who: &str, what: &str) {
    println!("[{:>5} ms] {who:<16} {what}", started.elapsed().as_millis());
}

/// One unit of repository work: take the lock(s), work for a while inside a scope whose
/// finalizer reports, release.
fn job(
    locks: &LockManager,
    started: Instant,
    who: &'static str,
    requests: Vec<LockRequest>,
    delay_ms: u64,
    work_ms: u64,
    signal: Option<AbortSignal>,
) -> Fiber<Result<(), LockError>> {
    let locks = locks.clone();
    fork_daemon(async move {
        pause(delay_ms).await;
        say(started, who, "asks for its lock");
        let mut acquisition = if requests.len() == 1 {
            locks.acquire(requests[0].clone())
        } else {
            locks.many(requests)
        };
        if let Some(signal) = &signal {
            acquisition = acquisition.with_signal(signal);
        }
        let guard = match acquisition.await {
            Ok(guard) => guard,
            Err(error) => {
                say(
                    started,
                    who,
                    &format!("gave up: {error} (its queue entry is already gone)"),
                );
                return Err(error);
            }
        };
        say(
            started,
            who,
            &format!("holds it (fencing token {})", guard.fencing_token()),
        );
        // The work runs in a scope: its finalizer runs however the work ends, and the guard is
        // adopted so the scope releases it last-in-first-out with the other clean-up.
        Scoped::<(), LockError>::new(move |scope| async move {
            scope.adopt(guard);
            scope.add_finalizer(move |status: ExitStatus| async move {
                say(
                    started,
                    who,
                    &format!("cleans up after {status:?} and releases"),
                );
            });
            pause(work_ms).await;
            Ok(())
        })
        .await
    })
}

async fn parent() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let dir = std::env::temp_dir().join(format!("leasehold-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("locks.db");
    let locks = LockManager::open(&path)?;
    println!("lock database: {}", path.display());
    println!("this process is owner {}\n", locks.owner_id());

    let monitor_stop = AbortController::new();
    let monitor = monitor(&locks, started, monitor_stop.signal());

    let parent_start = SystemClock.now().saturating_sub(started.elapsed());
    let mut child = spawn_child(&path, parent_start)?;
    let photos = "repo/photos";
    let mirror = "repo/mirror";
    let jobs = vec![
        job(
            &locks,
            started,
            "backup #1",
            vec![LockRequest::shared(photos, "backup")],
            0,
            400,
            None,
        ),
        job(
            &locks,
            started,
            "restore",
            vec![LockRequest::shared(photos, "restore")],
            50,
            300,
            None,
        ),
        job(
            &locks,
            started,
            "prune",
            vec![LockRequest::exclusive(photos, "prune")],
            100,
            300,
            None,
        ),
        job(
            &locks,
            started,
            "backup #2",
            vec![LockRequest::shared(photos, "backup")],
            150,
            200,
            None,
        ),
        job(
            &locks,
            started,
            "impatient check",
            vec![LockRequest::exclusive(photos, "check")],
            200,
            100,
            Some(AbortSignal::timeout(Duration::from_millis(250))),
        ),
        job(
            &locks,
            started,
            "mirror copy",
            vec![
                LockRequest::shared(photos, "copy"),
                LockRequest::exclusive(mirror, "copy"),
            ],
            250,
            200,
            None,
        ),
    ];
    let mut failures = 0;
    for job in jobs {
        if job.join().await.success().is_none_or(|r| r.is_err()) {
            failures += 1;
        }
    }
    let status = wait_child(&mut child, Duration::from_secs(30))?;
    say(started, "child process", &format!("exited with {status}"));

    monitor_stop.abort("work done");
    let _ = monitor.join().await;
    locks.shutdown().await?;
    let left = LockManager::open(&path)?.inspect(None).await?;
    println!(
        "\n{failures} job gave up as planned; rows left in the database: {}",
        left.len()
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Prints the live holders and waiters whenever they change.
fn monitor(locks: &LockManager, started: Instant, stop: AbortSignal) -> Fiber<()> {
    let locks = locks.clone();
    fork_daemon(async move {
        let mut last = String::new();
        while !stop.is_aborted() {
            if let Ok(entries) = locks.inspect(None).await {
                let mut lines = Vec::new();
                for key in ["repo/photos", "repo/mirror"] {
                    let describe = |held: bool| {
                        entries
                            .iter()
                            .filter(|e| e.key == key && (e.state == EntryState::Held) == held)
                            .map(|e| {
                                let side = if e.owner == locks.owner_id() {
                                    ""
                                } else {
                                    ", child"
                                };
                                let mode = if e.mode == Mode::Shared { "S" } else { "X" };
                                format!("{}({mode}{side})", e.operation)
                            })
                            .collect::<Vec<_>>()
                            .join(" ")
                    };
                    lines.push(format!(
                        "    {key:<12} held: {:<34} waiting: {}",
                        describe(true),
                        describe(false)
                    ));
                }
                let view = lines.join("\n");
                if view != last {
                    println!(
                        "[{:>5} ms] -- locks --\n{view}",
                        started.elapsed().as_millis()
                    );
                    last = view;
                }
            }
            pause(20).await;
        }
    })
}

fn spawn_child(path: &Path, parent_start: Duration) -> std::io::Result<Child> {
    Command::new(std::env::current_exe()?)
        .arg("--child")
        .arg(path)
        .arg(parent_start.as_millis().to_string())
        .spawn()
}

fn wait_child(child: &mut Child, limit: Duration) -> std::io::Result<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            child.kill()?;
            return child.wait();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The child process: another owner on the same file, pruning the mirror.
async fn child(path: &Path, started: Instant) -> Result<(), Box<dyn std::error::Error>> {
    let locks = LockManager::open(PathBuf::from(path))?;
    pause(100).await;
    say(started, "child: prune", "asks for repo/mirror");
    let guard = locks.exclusive("repo/mirror", "prune").await?;
    say(started, "child: prune", "holds repo/mirror");
    pause(350).await;
    guard.release().await?;
    say(started, "child: prune", "released repo/mirror");
    locks.shutdown().await?;
    Ok(())
}
