//! Helpers shared by the integration tests.
//!
//! Every test binary compiles this module but uses only part of it.
#![allow(dead_code)]

pub mod child;

use std::future::Future;
use std::panic::resume_unwind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::task::noop_waker_ref;
use futures::FutureExt;
use leasehold::{
    AbortReason, Clock, EntryState, ExitStatus, Guard, LockEntry, LockError, LockManager, Scope,
    Scoped, SystemClock,
};

/// A waker that counts how often it was woken.
#[derive(Default)]
pub struct CountingWaker(AtomicUsize);

impl CountingWaker {
    /// How often it was woken so far.
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl std::task::Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// How long a "within" wait gives a condition before it declares the condition false. Generous on
/// purpose: a wait returns as soon as the condition holds, so only a failing test pays it.
pub const GENEROUS: Duration = Duration::from_secs(5);

/// Runs the scenario once on each executor the library promises to work under, one after another:
/// `futures::executor::block_on`, `smol::block_on`, a tokio current-thread runtime, and a tokio
/// multi-thread runtime with two workers (where the scenario is spawned, so it may move between
/// worker threads at every await).
pub fn on_every_executor<F, Fut>(scenario: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    announce("futures::executor::block_on");
    futures::executor::block_on(scenario());

    announce("smol::block_on");
    smol::block_on(scenario());

    announce("tokio current-thread");
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a tokio current-thread runtime")
        .block_on(scenario());

    announce("tokio multi-thread (2 workers)");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("a tokio multi-thread runtime");
    let task = runtime.spawn(scenario());
    if let Err(error) = runtime.block_on(task) {
        match error.try_into_panic() {
            Ok(payload) => resume_unwind(payload),
            Err(error) => panic!("the scenario's task failed: {error}"),
        }
    }
}

/// Printed before each run so that a failure says which executor it happened under (the test
/// harness shows a failing test's output).
fn announce(executor: &str) {
    eprintln!("--- running under {executor}");
}

/// Waits until `condition` (an async check) holds, checking every millisecond, for at most
/// `limit`; panics with `what` if it never does. Sleeps on the library's own clock, so it works
/// under any executor.
pub async fn within<F, Fut>(limit: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let clock = test_clock();
    let deadline = clock.monotonic() + limit;
    while !condition().await {
        assert!(clock.monotonic() < deadline, "not within {limit:?}: {what}");
        clock.sleep(Duration::from_millis(1)).await;
    }
}

thread_local! {
    /// The clock of the simulation this thread runs, if it runs one (`in_simulation`).
    static SIMULATED: std::cell::RefCell<Option<std::sync::Arc<dyn Clock>>> =
        const { std::cell::RefCell::new(None) };
}

/// The clock the test helpers wait on: the simulation's inside `in_simulation`, where time is
/// virtual; otherwise the system's.
pub fn test_clock() -> std::sync::Arc<dyn Clock> {
    SIMULATED
        .with(|clock| clock.borrow().clone())
        .unwrap_or_else(|| std::sync::Arc::new(SystemClock))
}

/// Runs the scenario that `start` makes for a new simulation of `seed` (feature `testkit`)
/// inside it, to its end and the end of every task it started: they are stepped in the seed's
/// order on virtual time, on which the helpers here (`within`, `bounded`) wait too. Panics if
/// the simulation fails (a deadlock, tasks left behind), and adds to any panic of the scenario
/// the seed and the trace that replays it.
#[cfg(feature = "testkit")]
pub fn in_simulation<Fut: Future>(
    seed: u64,
    start: impl FnOnce(&leasehold::testkit::Sim) -> Fut,
) -> Fut::Output {
    let mut sim = leasehold::testkit::Sim::new(seed);
    let scenario = start(&sim);
    SIMULATED.with(|current| *current.borrow_mut() = Some(Arc::new(sim.clock())));
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            SIMULATED.with(|current| *current.borrow_mut() = None);
        }
    }
    let _reset = Reset;
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sim.block_on(scenario)));
    match outcome {
        Ok(Ok(output)) => output,
        Ok(Err(error)) => panic!("the simulation failed: {error}"),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            panic!(
                "{what}\nseed {seed}; replay with Sim::replay({:?})",
                sim.trace()
            )
        }
    }
}

/// `future`'s output, or a panic naming `what` if it takes longer than `limit`.
pub async fn bounded<T>(limit: Duration, what: &str, future: impl Future<Output = T>) -> T {
    let timer = test_clock().sleep(limit);
    futures::select! {
        value = futures::FutureExt::fuse(future) => value,
        _ = futures::FutureExt::fuse(timer) => panic!("not within {limit:?}: {what}"),
    }
}

/// Joins a fiber, failing the test if it does not end within `limit`.
pub async fn join_within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    fiber: leasehold::Fiber<T>,
) -> leasehold::Exit<T> {
    bounded(limit, what, fiber.join()).await
}

/// [`within`] for plain (non-async) test code: blocks the calling thread between checks.
pub fn within_blocking(limit: Duration, what: &str, condition: impl FnMut() -> bool) {
    assert!(
        until_blocking(limit, condition),
        "not within {limit:?}: {what}"
    );
}

/// Whether `condition` comes to hold within `limit`, checked every millisecond, blocking the
/// calling thread in between: [`within_blocking`] for a wait whose failure says more, or is
/// no failure.
pub fn until_blocking(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls `future` once with a waker that does nothing: for stepping a future by hand in tests
/// that decide themselves when to poll again.
pub fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    future.poll_unpin(&mut Context::from_waker(noop_waker_ref()))
}

/// Returns `Pending` once, after asking to be polled again: lets other work run in between.
pub async fn yield_now() {
    let mut yielded = false;
    futures::future::poll_fn(move |cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

/// An ordered record of what happened, shared by everything a test starts.
#[derive(Clone, Debug, Default)]
pub struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    pub fn new() -> Self {
        Log::default()
    }

    pub fn push(&self, entry: impl Into<String>) {
        self.0.lock().unwrap().push(entry.into());
    }

    pub fn entries(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    pub fn contains(&self, entry: &str) -> bool {
        self.0.lock().unwrap().iter().any(|e| e == entry)
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// A flag that can be set from anywhere and checked from the test.
#[derive(Clone, Debug, Default)]
pub struct Flag(Arc<AtomicBool>);

impl Flag {
    pub fn new() -> Self {
        Flag::default()
    }

    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A counter that can be bumped from anywhere and read from the test.
#[derive(Clone, Debug, Default)]
pub struct Counter(Arc<AtomicUsize>);

impl Counter {
    pub fn new() -> Self {
        Counter::default()
    }

    pub fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }

    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// The statuses the finalizers of a test were told, in the order they ran.
#[derive(Clone, Debug, Default)]
pub struct Statuses(Arc<Mutex<Vec<ExitStatus>>>);

impl Statuses {
    pub fn new() -> Self {
        Statuses::default()
    }

    pub fn push(&self, status: ExitStatus) {
        self.0.lock().unwrap().push(status);
    }

    pub fn all(&self) -> Vec<ExitStatus> {
        self.0.lock().unwrap().clone()
    }

    /// The one status recorded; panics unless there is exactly one.
    pub fn only(&self) -> ExitStatus {
        let all = self.all();
        assert_eq!(all.len(), 1, "expected exactly one status, got {all:?}");
        all.into_iter().next().unwrap()
    }
}

/// Adds a finalizer that logs `"{name} start"`, sleeps `sleep` of real time, then logs
/// `"{name} end"`: the sleep makes "waited for the finalizer" observable.
pub fn slow_finalizer(scope: &Scope, log: &Log, name: &str, sleep: Duration) {
    let log = log.clone();
    let name = name.to_owned();
    scope.add_finalizer(move |_| async move {
        log.push(format!("{name} start"));
        if !sleep.is_zero() {
            SystemClock.sleep(sleep).await;
        }
        log.push(format!("{name} end"));
    });
}

/// Adds a finalizer that records the status it is told.
pub fn record_status(scope: &Scope, statuses: &Statuses) {
    let statuses = statuses.clone();
    scope.add_finalizer(move |status| async move { statuses.push(status) });
}

/// Whether `status` is an interruption for exactly `reason` (the same object).
pub fn interrupted_by(status: &ExitStatus, reason: &AbortReason) -> bool {
    matches!(status, ExitStatus::Interrupted(r) if r.ptr_eq(reason))
}

/// Whether `status` is an interruption whose reason is an `E`.
pub fn interrupted_with<E: std::error::Error + 'static>(status: &ExitStatus) -> bool {
    matches!(status, ExitStatus::Interrupted(r) if r.downcast_ref::<E>().is_some())
}

/// A short real-time pause for finalizers and bodies that must visibly take time.
pub const SLOW: Duration = Duration::from_millis(20);

/// Whether an event logged with `tracing` at error level, on any thread of this test binary
/// since its first call here, contains `text`. The first call installs the binary's subscriber.
pub fn error_logged(text: &str) -> bool {
    logged_errors()
        .lock()
        .unwrap()
        .iter()
        .any(|line| line.contains(text))
}

fn logged_errors() -> &'static Mutex<Vec<String>> {
    static LOG: std::sync::OnceLock<Arc<Mutex<Vec<String>>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let subscriber = Kept(tracing::Level::ERROR, lines.clone());
        tracing::subscriber::set_global_default(subscriber).expect("no other subscriber");
        lines
    })
}

struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!(" {}={value:?}", field.name()));
    }
}

/// A subscriber that keeps the text of every event at its level or a more severe one.
struct Kept(tracing::Level, Arc<Mutex<Vec<String>>>);

impl tracing::Subscriber for Kept {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= self.0
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        self.1.lock().unwrap().push(fields.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Runs `f` with a `tracing` subscriber of this thread's own that keeps the text of every
/// warning and error logged on this thread while it runs (work that `f` polls with
/// `futures::executor::block_on` included; other threads' not); gives them with `f`'s output.
pub fn warnings_during<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let subscriber = Kept(tracing::Level::WARN, lines.clone());
    let output = tracing::subscriber::with_default(subscriber, f);
    let lines = lines.lock().unwrap().clone();
    (output, lines)
}

// The lock manager's helpers: databases, entries, and grants read late.

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
    within(Duration::from_secs(5), "B queued", || {
        assert!(futures::FutureExt::now_or_never(&mut acquisition).is_none());
        async { b.inspect(Some("k")).await.unwrap().len() == 2 }
    })
    .await;
    holder.release().await.unwrap();
    within(Duration::from_secs(5), "B's row promoted", || async {
        let rows = b.inspect(Some("k")).await.unwrap();
        rows.len() == 1 && rows[0].state == EntryState::Held
    })
    .await;
    acquisition
}

/// Polls a stalled acquisition again until it returns a guard.
pub async fn read_when_stalled(acquisition: &mut Scoped<Guard, LockError>) -> Guard {
    let mut delivered = None;
    within(Duration::from_secs(5), "the acquisition returned", || {
        delivered = futures::FutureExt::now_or_never(&mut *acquisition);
        let returned = delivered.is_some();
        async move { returned }
    })
    .await;
    delivered.unwrap().unwrap()
}
