//! A torture run for the lock manager: several processes share one lock database (a SQLite file,
//! or a PostgreSQL schema), each running several tasks that take and release locks at random,
//! while this parent kills and pauses them.
//!
//! What is checked, through a *register* per key (a small file that the lock protects):
//!
//! - an exclusive holder marks the register as its own, reads the value, pauses, and writes it
//!   back incremented, tagged with its fencing token; a shared holder reads it twice with a pause
//!   in between and checks that nothing changed;
//! - the register is a fenced resource: it refuses a write whose token is lower than the highest
//!   it has seen, so a holder that was paused past its lease cannot overwrite newer work;
//! - whenever one holder finds another's mark, the older of the two must have lost its lease: it
//!   is told so when it leaves, and it counts a violation unless its `lost()` signal fires;
//! - a holder that the parent paused (SIGSTOP) for longer than the lease must see `lost()` fire
//!   once it resumes;
//! - at the end every owner shuts down, and after one lease the database holds no rows at all.
//!
//! Run it with `cargo run --release --example torture -- --seconds 20 --processes 4 --json`;
//! `--seconds 600` is the soak run. The process exits with status 1 if any check failed.
//! Its tests (`tests.rs`, run by `cargo test`) run a few seconds of it.
//!
//! # On PostgreSQL
//!
//! `--backend postgres` (built with `--features postgres`) keeps the locks in a fresh schema of a
//! PostgreSQL server: the one `--url URL` names (a libpq URL or connection string), or else a
//! throwaway server this run starts and stops itself, from the server programs on the machine
//! (the tests' harness, `leasehold::testkit::postgres`). On top of the kills and pauses it
//!
//! - cuts random children's connections (`pg_terminate_backend`; not with `--no-cuts`);
//! - restarts the server twice, once with `pg_ctl restart -m fast` and once with `-m immediate`
//!   (a crash), at 30 % and 50 % of the run (only on a server it started);
//! - runs child 0 with a clock 10 s ahead and child 1 with one 10 s behind (a skewed
//!   [`Clock`](leasehold::Clock)): leases are judged by the server's clock, so they must not care.
//!
//! A storage error is a failure, except inside a restart's window (from the restart until two
//! leases after the server is back): there it is counted as `restart_storage_errors`, and the
//! operation is tried again.
//!
//! `cargo run --release --all-features --example torture -- --backend postgres --seconds 20 --json`

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use futures::FutureExt;
use leasehold::{
    fork_daemon, AbortController, AbortSignal, Clock, EntryState, Guard, LockError, LockManager,
    LockManagerBuilder, LockRequest, Mode, Scoped, SystemClock,
};

/// The test harness's throwaway PostgreSQL server.
#[cfg(all(feature = "postgres", feature = "testkit"))]
use leasehold::testkit::postgres as pg_support;

/// Set in a child's environment (to the folder the run works in); its absence means "parent".
const CHILD_ENV: &str = "LEASEHOLD_TORTURE_CHILD";

const KEYS: [&str; 3] = ["alpha", "beta", "gamma"];

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child_main();
        return;
    }
    let config = match Config::from_args(std::env::args().skip(1)) {
        Ok(config) => config,
        Err(why) => {
            eprintln!("{why}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    let json = config.json;
    let Some(store) = Store::open(&config) else {
        eprintln!("no PostgreSQL server to run against (the reason is above)");
        std::process::exit(2);
    };
    let summary = run(&config, &store);
    println!("{}", summary.describe());
    if json {
        println!("{}", summary.json());
    }
    if !summary.failures().is_empty() {
        std::process::exit(1);
    }
}

const USAGE: &str = "usage: torture [--seconds N] [--processes N] [--tasks N] [--seed N] \
                     [--lease-ms N] [--heartbeat-ms N] [--backend sqlite|postgres] [--url URL] \
                     [--runtime smol|tokio] [--hold-ms N] [--no-cuts] [--json]";

/// Where the locks are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// A SQLite file in the run's folder.
    Sqlite,
    /// A fresh schema on a PostgreSQL server (feature `postgres`).
    Postgres,
}

/// What runs a child's tasks (and so its background work, which follows the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// smol's global executor.
    Smol,
    /// A tokio runtime with two worker threads.
    Tokio,
}

/// What a run does.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long the children work.
    pub seconds: f64,
    /// How many child processes work at once.
    pub processes: usize,
    /// How many tasks each child runs.
    pub tasks: usize,
    /// Seeds every random choice (faults, operations, hold times).
    pub seed: u64,
    /// The lease of every owner.
    pub lease: Duration,
    /// The heartbeat of every owner.
    pub heartbeat: Duration,
    /// Print the JSON summary line.
    pub json: bool,
    /// Where the locks are kept.
    pub backend: Backend,
    /// The PostgreSQL server to use; `None`: start a throwaway one.
    pub url: Option<String>,
    /// On PostgreSQL, cut children's connections now and then.
    pub cut_connections: bool,
    /// What runs each child's tasks.
    pub runtime: Runtime,
    /// The longest pause inside a hold, between entering the register and writing, and between
    /// writing and leaving (each drawn from zero to this).
    pub hold: Duration,
    /// How to start a child: program and arguments (the child's settings go in its environment).
    pub child_command: Vec<String>,
}

impl Config {
    fn from_args(args: impl Iterator<Item = String>) -> Result<Config, String> {
        let mut config = Config::default();
        let mut args = args.peekable();
        while let Some(flag) = args.next() {
            // The switches, which take no value.
            match flag.as_str() {
                "--json" => {
                    config.json = true;
                    continue;
                }
                "--no-cuts" => {
                    config.cut_connections = false;
                    continue;
                }
                _ => {}
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let bad = |_: std::num::ParseIntError| format!("{flag}: cannot read {value:?}");
            match flag.as_str() {
                "--seconds" => {
                    config.seconds = value
                        .parse()
                        .map_err(|_| format!("{flag}: cannot read {value:?}"))?
                }
                "--processes" => config.processes = value.parse().map_err(bad)?,
                "--tasks" => config.tasks = value.parse().map_err(bad)?,
                "--seed" => config.seed = value.parse().map_err(bad)?,
                "--lease-ms" => config.lease = Duration::from_millis(value.parse().map_err(bad)?),
                "--heartbeat-ms" => {
                    config.heartbeat = Duration::from_millis(value.parse().map_err(bad)?)
                }
                "--backend" => {
                    config.backend = match value.as_str() {
                        "sqlite" => Backend::Sqlite,
                        "postgres" => Backend::Postgres,
                        _ => return Err(format!("{flag}: sqlite or postgres, not {value:?}")),
                    }
                }
                "--url" => config.url = Some(value),
                "--runtime" => {
                    config.runtime = match value.as_str() {
                        "smol" => Runtime::Smol,
                        "tokio" => Runtime::Tokio,
                        _ => return Err(format!("{flag}: smol or tokio, not {value:?}")),
                    }
                }
                "--hold-ms" => config.hold = Duration::from_millis(value.parse().map_err(bad)?),
                _ => return Err(format!("unknown flag {flag}")),
            }
        }
        if config.processes == 0 || config.tasks == 0 {
            return Err("--processes and --tasks must be at least 1".into());
        }
        if config.url.is_some() && config.backend != Backend::Postgres {
            return Err("--url needs --backend postgres".into());
        }
        if config.backend == Backend::Postgres
            && cfg!(not(all(feature = "postgres", feature = "testkit")))
        {
            return Err("--backend postgres needs a build with `--features postgres`".into());
        }
        Ok(config)
    }
}

impl Default for Config {
    fn default() -> Self {
        let exe =
            std::env::current_exe().map_or_else(|_| "torture".into(), |p| p.display().to_string());
        Config {
            seconds: 20.0,
            processes: 4,
            tasks: 4,
            seed: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            lease: Duration::from_secs(1),
            heartbeat: Duration::from_millis(200),
            json: false,
            backend: Backend::Sqlite,
            url: None,
            cut_connections: true,
            runtime: Runtime::Smol,
            hold: Duration::from_millis(20),
            child_command: vec![exe],
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Randomness: a small seeded generator, so that a run is reproducible from its seed as far as
// scheduling allows.

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        // splitmix64 of the seed, so that nearby seeds give unrelated streams.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low + 1))
    }
}

fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

async fn sleep(duration: Duration) {
    smol::Timer::after(duration).await;
}

/// Writes a file whole: a reader never sees it half written.
fn publish(path: &Path, content: &str) {
    let part = path.with_extension("part");
    if fs::write(&part, content).is_ok() {
        let _ = fs::rename(&part, path);
    }
}

/// Adds `line` to a file that several processes add to (each line in one write).
fn append(path: &Path, line: &str) {
    let opened = fs::OpenOptions::new().create(true).append(true).open(path);
    if let Ok(mut file) = opened {
        let _ = file.write_all(line.as_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// The register: one small file per key, read and written under an OS file lock so that each of
// its operations is atomic across processes.

/// A holder's mark: its fencing token and which child incarnation made it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Mark {
    token: u64,
    tag: String,
}

#[derive(Default, Debug)]
struct RegisterState {
    value: u64,
    /// The highest token of any holder that entered or wrote: the fence for writes.
    fence: u64,
    /// The highest token of an exclusive holder that entered: a shared holder below it is stale.
    fence_exclusive: u64,
    writer: Option<Mark>,
    readers: Vec<Mark>,
    /// Holders whose marks a newer holder found: each must have lost its lease.
    superseded: Vec<Mark>,
}

impl RegisterState {
    fn parse(text: &str) -> RegisterState {
        let mut state = RegisterState::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(what), Some(number)) = (words.next(), words.next()) else {
                continue;
            };
            let number: u64 = number.parse().unwrap_or(0);
            let mark = || Mark {
                token: number,
                tag: words.clone().next().unwrap_or("").to_owned(),
            };
            match what {
                "value" => state.value = number,
                "fence" => state.fence = number,
                "fence_exclusive" => state.fence_exclusive = number,
                "writer" => state.writer = Some(mark()),
                "reader" => state.readers.push(mark()),
                "superseded" => state.superseded.push(mark()),
                _ => {}
            }
        }
        state
    }

    fn render(&self) -> String {
        let mut text = format!(
            "value {}\nfence {}\nfence_exclusive {}\n",
            self.value, self.fence, self.fence_exclusive
        );
        for (what, mark) in self
            .writer
            .iter()
            .map(|m| ("writer", m))
            .chain(self.readers.iter().map(|m| ("reader", m)))
            .chain(self.superseded.iter().map(|m| ("superseded", m)))
        {
            text.push_str(&format!("{what} {} {}\n", mark.token, mark.tag));
        }
        text
    }

    /// Moves every mark with a token below `token` to the superseded list.
    fn supersede_below(&mut self, token: u64) {
        if self.writer.as_ref().is_some_and(|w| w.token < token) {
            let writer = self.writer.take().expect("checked above");
            self.superseded.push(writer);
        }
        let (old, kept): (Vec<Mark>, Vec<Mark>) =
            self.readers.drain(..).partition(|r| r.token < token);
        self.readers = kept;
        self.superseded.extend(old);
    }
}

/// What entering the register found.
#[derive(Debug, PartialEq, Eq)]
enum Entry {
    /// Entered; the value now.
    Entered(u64),
    /// A newer holder has been here: this holder is stale (its lease must have been lost).
    Stale,
}

/// What a write attempt came to.
#[derive(Debug, PartialEq, Eq)]
enum Written {
    Accepted { lost_update: bool, stale: bool },
    Refused,
}

#[derive(Clone)]
struct Register {
    path: PathBuf,
}

impl Register {
    fn new(folder: &Path, key: &str) -> Register {
        Register {
            path: folder.join(format!("register-{key}")),
        }
    }

    /// Runs `change` on the state under the file lock. The lock is tried, not waited for, so that
    /// a paused process holding it never blocks this process's executor (and its heartbeats).
    async fn update<T>(&self, change: impl FnOnce(&mut RegisterState) -> T) -> std::io::Result<T> {
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path)?;
        loop {
            match fs4::FileExt::try_lock(&file) {
                Ok(()) => break,
                Err(fs4::TryLockError::WouldBlock) => sleep(Duration::from_millis(1)).await,
                Err(fs4::TryLockError::Error(error)) => return Err(error),
            }
        }
        let outcome = (|| {
            let text = std::io::read_to_string(&mut file)?;
            let mut state = RegisterState::parse(&text);
            let value = change(&mut state);
            let rendered = state.render();
            file.set_len(0)?;
            std::io::Seek::rewind(&mut file)?;
            file.write_all(rendered.as_bytes())?;
            Ok(value)
        })();
        let _ = fs4::FileExt::unlock(&file);
        outcome
    }

    async fn enter(&self, mark: &Mark, mode: Mode) -> std::io::Result<Entry> {
        self.update(|state| {
            let stale = match mode {
                Mode::Exclusive => mark.token < state.fence,
                Mode::Shared => mark.token < state.fence_exclusive,
            };
            if stale {
                state.superseded.push(mark.clone());
                return Entry::Stale;
            }
            match mode {
                Mode::Exclusive => {
                    state.supersede_below(mark.token);
                    state.writer = Some(mark.clone());
                    state.fence_exclusive = mark.token;
                }
                Mode::Shared => {
                    if state.writer.as_ref().is_some_and(|w| w.token < mark.token) {
                        let writer = state.writer.take().expect("checked above");
                        state.superseded.push(writer);
                    }
                    state.readers.push(mark.clone());
                }
            }
            state.fence = state.fence.max(mark.token);
            Entry::Entered(state.value)
        })
        .await
    }

    async fn read(&self) -> std::io::Result<u64> {
        self.update(|state| state.value).await
    }

    /// The fenced write: refused if a newer holder has been here.
    async fn write(&self, mark: &Mark, read: u64) -> std::io::Result<Written> {
        self.update(|state| {
            if mark.token < state.fence {
                return Written::Refused;
            }
            let lost_update = state.value != read;
            // A newer holder found this one's mark, yet its write got through.
            let stale = state.superseded.contains(mark);
            state.value = read + 1;
            state.fence = mark.token;
            Written::Accepted { lost_update, stale }
        })
        .await
    }

    /// Removes the holder's mark; returns whether a newer holder had superseded it.
    async fn leave(&self, mark: &Mark) -> std::io::Result<bool> {
        self.update(|state| {
            if state.writer.as_ref() == Some(mark) {
                state.writer = None;
            }
            state.readers.retain(|r| r != mark);
            let before = state.superseded.len();
            state.superseded.retain(|s| s != mark);
            state.superseded.len() != before
        })
        .await
    }

    /// Removes every mark of a dead child incarnation.
    async fn clear(&self, tag: &str) -> std::io::Result<()> {
        self.update(|state| {
            if state.writer.as_ref().is_some_and(|w| w.tag == tag) {
                state.writer = None;
            }
            state.readers.retain(|r| r.tag != tag);
            state.superseded.retain(|s| s.tag != tag);
        })
        .await
    }
}

// ---------------------------------------------------------------------------------------------
// Where the locks are kept: a SQLite file in the run's folder, or a PostgreSQL schema.

/// What a manager opens; the parent tells its children through their environment.
#[derive(Clone, Debug)]
enum Place {
    File(PathBuf),
    Postgres { url: String, schema: String },
}

impl Place {
    fn from_env(folder: &Path) -> Place {
        match (
            std::env::var("TORTURE_PG_URL"),
            std::env::var("TORTURE_PG_SCHEMA"),
        ) {
            (Ok(url), Ok(schema)) => Place::Postgres { url, schema },
            _ => Place::File(folder.join("locks.db")),
        }
    }

    fn to_env(&self, command: &mut Command) {
        if let Place::Postgres { url, schema } = self {
            command
                .env("TORTURE_PG_URL", url)
                .env("TORTURE_PG_SCHEMA", schema);
        }
    }

    /// The same place, with connections that `pg_stat_activity` shows as `name`.
    fn named(&self, name: &str) -> Place {
        match self {
            Place::File(_) => self.clone(),
            Place::Postgres { url, schema } => {
                let url = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
                    let separator = if url.contains('?') { '&' } else { '?' };
                    format!("{url}{separator}application_name={name}")
                } else {
                    format!("{url} application_name={name}")
                };
                Place::Postgres {
                    url,
                    schema: schema.clone(),
                }
            }
        }
    }

    async fn manager(&self, builder: LockManagerBuilder) -> Result<LockManager, LockError> {
        match self {
            Place::File(path) => builder.open(path),
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Place::Postgres { url, schema } => builder.schema(schema).connect(url).await,
            #[cfg(not(all(feature = "postgres", feature = "testkit")))]
            Place::Postgres { .. } => Err(LockError::InvalidConfig(
                "PostgreSQL needs a build with `--features postgres`".into(),
            )),
        }
    }
}

/// The system clock as seen on a machine whose wall clock is off by this many milliseconds
/// (ahead when positive). Its monotonic time and sleeps are the real ones, as they would be.
struct SkewedClock(i64);

impl Clock for SkewedClock {
    fn now(&self) -> Duration {
        let by = Duration::from_millis(self.0.unsigned_abs());
        if self.0 >= 0 {
            SystemClock.now() + by
        } else {
            SystemClock.now().saturating_sub(by)
        }
    }

    fn monotonic(&self) -> Duration {
        SystemClock.monotonic()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        SystemClock.sleep(duration)
    }
}

/// How far the clock of child `id` is off (milliseconds): on PostgreSQL, child 0 runs 10 s ahead
/// and child 1 10 s behind; on SQLite, which judges leases by the clients' clocks, nobody.
fn clock_skew(backend: Backend, id: usize) -> i64 {
    match (backend, id) {
        (Backend::Postgres, 0) => 10_000,
        (Backend::Postgres, 1) => -10_000,
        _ => 0,
    }
}

/// A run's database as the parent sees it: where the locks are, and the faults it allows.
pub struct Store {
    #[cfg(all(feature = "postgres", feature = "testkit"))]
    postgres: Option<PgStore>,
}

#[cfg(all(feature = "postgres", feature = "testkit"))]
struct PgStore {
    server: pg_support::Server,
    url: String,
    schema: String,
}

impl Store {
    /// A SQLite store, or a fresh schema on the PostgreSQL server of `config` (starting one if
    /// it names none). `None` (the harness printed why) when there is no server to start.
    pub fn open(config: &Config) -> Option<Store> {
        match config.backend {
            Backend::Sqlite => Some(Store {
                #[cfg(all(feature = "postgres", feature = "testkit"))]
                postgres: None,
            }),
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Backend::Postgres => {
                let server = match &config.url {
                    Some(url) => pg_support::existing(url.clone()),
                    None => pg_support::start(pg_support::Tls::Off)?,
                };
                // Our own server: over its unix socket, which needs no password.
                let url = server.conninfo().unwrap_or(server.url()).to_owned();
                Some(Store {
                    postgres: Some(PgStore {
                        server,
                        url,
                        schema: pg_support::schema("torture"),
                    }),
                })
            }
            #[cfg(not(all(feature = "postgres", feature = "testkit")))]
            Backend::Postgres => {
                eprintln!("PostgreSQL needs a build with `--features postgres`");
                None
            }
        }
    }

    fn place(&self, folder: &Path) -> Place {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = &self.postgres {
            return Place::Postgres {
                url: pg.url.clone(),
                schema: pg.schema.clone(),
            };
        }
        Place::File(folder.join("locks.db"))
    }

    /// Whether connections can be cut: on PostgreSQL.
    fn cuts_connections(&self) -> bool {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        return self.postgres.is_some();
        #[cfg(not(all(feature = "postgres", feature = "testkit")))]
        false
    }

    /// Cuts every connection shown as `name`; returns how many there were.
    fn cut_connections(&self, name: &str) -> usize {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = &self.postgres {
            return pg
                .server
                .terminate_backends(&format!("application_name = '{name}'"));
        }
        let _ = name;
        0
    }

    /// Whether the server can be restarted: one this run started.
    fn restarts(&self) -> bool {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        return self
            .postgres
            .as_ref()
            .is_some_and(|pg| pg.server.dir().is_some());
        #[cfg(not(all(feature = "postgres", feature = "testkit")))]
        false
    }

    /// `pg_ctl restart -m fast`, or `-m immediate` (a crash) when `immediate`.
    fn restart(&self, immediate: bool) {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = &self.postgres {
            pg.server.restart(if immediate {
                pg_support::Shutdown::Immediate
            } else {
                pg_support::Shutdown::Fast
            });
        }
        let _ = immediate;
    }

    /// Every lock row left, live or not (the ticket counter is not one).
    fn count_rows(&self, folder: &Path) -> Result<u64, Box<dyn std::error::Error>> {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = &self.postgres {
            let count = pg
                .server
                .sql(&format!("SELECT count(*) FROM \"{}\".locks", pg.schema));
            return Ok(count.trim().parse()?);
        }
        let connection = sqlite::open(folder.join("locks.db"))?;
        // The row with key '' is the ticket counter, not a lock.
        let mut statement = connection.prepare("SELECT COUNT(*) FROM locks WHERE key <> ''")?;
        statement.next()?;
        Ok(statement.read::<i64, _>(0)? as u64)
    }

    /// Keeps, from now on, every change to a lock row (inserted, changed, deleted) with the time
    /// the store made it and who made it, so that a violation can be explained from the store's
    /// point of view (`history`).
    fn keep_history(&self, folder: &Path) -> Result<(), Box<dyn std::error::Error>> {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = &self.postgres {
            let s = format!("\"{}\"", pg.schema);
            pg.server.sql(&format!(
                "CREATE TABLE {s}.history (
                     at bigint NOT NULL, op text NOT NULL, txid bigint NOT NULL, app text NOT NULL,
                     key text NOT NULL, ticket bigint NOT NULL, owner text NOT NULL,
                     held boolean NOT NULL, expires_at bigint NOT NULL);
                 CREATE INDEX ON {s}.history (key, at);
                 GRANT INSERT ON {s}.history TO PUBLIC;
                 CREATE FUNCTION {s}.keep_history() RETURNS trigger LANGUAGE plpgsql AS $$
                 DECLARE
                     r record;
                 BEGIN
                     IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
                     INSERT INTO {s}.history VALUES (
                         (extract(epoch FROM clock_timestamp()) * 1000000)::bigint, lower(TG_OP),
                         txid_current(), current_setting('application_name'), r.key, r.ticket,
                         r.owner, r.held, r.expires_at);
                     RETURN NULL;
                 END $$;
                 CREATE TRIGGER keep_history AFTER INSERT OR UPDATE OR DELETE ON {s}.locks
                     FOR EACH ROW EXECUTE FUNCTION {s}.keep_history();"
            ));
            return Ok(());
        }
        let connection = sqlite::open(folder.join("locks.db"))?;
        connection.execute("PRAGMA busy_timeout = 10000")?;
        let now = "CAST((julianday('now') - 2440587.5) * 86400000000.0 AS INTEGER)";
        let mut sql = String::from(
            "CREATE TABLE history (at INTEGER NOT NULL, op TEXT NOT NULL, key TEXT NOT NULL,
                 ticket INTEGER NOT NULL, owner TEXT NOT NULL, held INTEGER NOT NULL,
                 expires_at INTEGER NOT NULL);
             CREATE INDEX history_key ON history (key, at);",
        );
        for (op, row) in [("insert", "NEW"), ("update", "NEW"), ("delete", "OLD")] {
            sql.push_str(&format!(
                "CREATE TRIGGER history_{op} AFTER {op} ON locks BEGIN
                     INSERT INTO history VALUES ({now}, '{op}', {row}.key, {row}.ticket,
                         {row}.owner, {row}.held, {row}.expires_at);
                 END;"
            ));
        }
        connection.execute(sql)?;
        Ok(())
    }

    /// The changes to the rows of `key` made from `from` to `to` (unix micros), one per line,
    /// oldest first: when (the store's time), what, by whom, and the row as it then was.
    fn history(
        &self,
        folder: &Path,
        key: &str,
        from: u64,
        to: u64,
    ) -> Result<String, Box<dyn std::error::Error>> {
        let header = "at (store's clock, unix µs)\top\tticket\towner\theld\texpires_at\tleft (µs)";
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = &self.postgres {
            let rows = pg.server.sql(&format!(
                "SELECT at, op || ' (txid ' || txid || ', ' || app || ')', ticket, owner, held,
                        expires_at, expires_at - at
                 FROM \"{}\".history WHERE key = '{}' AND at BETWEEN {from} AND {to}
                 ORDER BY at, txid",
                pg.schema,
                key.replace('\'', "''")
            ));
            return Ok(format!("{header}\n{}", rows.replace('|', "\t")));
        }
        let connection = sqlite::open(folder.join("locks.db"))?;
        let mut statement = connection.prepare(
            "SELECT at, op, ticket, owner, held, expires_at, expires_at - at FROM history
             WHERE key = ? AND at BETWEEN ? AND ? ORDER BY at",
        )?;
        statement.bind((1, key))?;
        statement.bind((2, from as i64))?;
        statement.bind((3, to as i64))?;
        let mut text = header.to_owned();
        while let sqlite::State::Row = statement.next()? {
            text.push('\n');
            for column in 0..7 {
                if column > 0 {
                    text.push('\t');
                }
                text.push_str(&statement.read::<String, _>(column)?);
            }
        }
        Ok(text)
    }

    /// After a run that passed: drops the run's schema from a server this run did not start
    /// (its own server goes away with it).
    fn forget(&self) {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = self
            .postgres
            .as_ref()
            .filter(|pg| pg.server.dir().is_none())
        {
            pg.server
                .sql(&format!("DROP SCHEMA \"{}\" CASCADE", pg.schema));
        }
    }
}

/// The restarts' windows, as the parent publishes them in the run's folder: one line per
/// restart, `start end` (unix micros; `end` is the largest number while it runs).
fn restart_windows(folder: &Path) -> Vec<(u64, u64)> {
    fs::read_to_string(folder.join("restarts"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let (start, end) = line.split_once(' ')?;
            Some((start.parse().ok()?, end.parse().ok()?))
        })
        .collect()
}

/// Whether the span `from..to` overlaps a restart's window, which lasts until two leases after
/// the server is back (a connection the restart broke is found out on its next use, and a
/// reconnection is tried at most every 100 ms).
fn restart_overlaps(folder: &Path, lease: Duration, from: u64, to: u64) -> bool {
    restart_windows(folder)
        .iter()
        .any(|&(start, end)| start <= to && from <= end.saturating_add(2 * micros(lease)))
}

// ---------------------------------------------------------------------------------------------
// Counters: each child keeps them, publishes them to a file now and then (a killed child's are
// partial), and the parent adds them up.

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// What one child did and saw.
        #[derive(Default)]
        struct Counters { $($name: AtomicU64,)* }

        /// The sum over all children, plus what the parent saw.
        #[derive(Clone, Debug, Default)]
        pub struct Totals { $(pub $name: u64,)* }

        impl Counters {
            fn render(&self) -> String {
                let mut text = String::new();
                $(text.push_str(&format!("{} {}\n", stringify!($name), self.$name.load(Ordering::Relaxed)));)*
                text
            }
        }

        impl Totals {
            fn add(&mut self, text: &str) {
                for line in text.lines() {
                    let mut words = line.split_whitespace();
                    let (Some(name), Some(value)) = (words.next(), words.next()) else { continue };
                    let value: u64 = value.parse().unwrap_or(0);
                    match name {
                        $(stringify!($name) => self.$name += value,)*
                        _ => {}
                    }
                }
            }

            fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

counters! {
    operations,
    grants,
    not_granted,
    interruptions,
    dropped_acquisitions,
    lost_signals,
    lost_on_release,
    violations,
    late_losses,
    lost_updates,
    stale_writes_accepted,
    stale_writes_refused,
    late_writes_accepted,
    increments,
    overlaps_after_loss,
    stopped_holders,
    stops_unnoticed,
    expired_waits,
    storage_errors,
    restart_storage_errors,
    register_errors,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------------
// The child: T tasks doing random lock operations until the deadline.

struct ChildContext {
    folder: PathBuf,
    id: usize,
    tag: String,
    deadline: u64,
    lease: Duration,
    /// The longest pause inside a hold (`Config::hold`).
    hold: Duration,
    locks: LockManager,
    counters: Counters,
}

impl ChildContext {
    /// When the parent last paused this child (set by the parent while the child is stopped, so
    /// that whoever reads it has really been stopped then).
    fn stopped_since(&self, since: u64) -> bool {
        fs::read_to_string(self.folder.join(format!("stopped-{}", self.tag)))
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .is_some_and(|at| at >= since)
    }

    /// Counts a storage error of an operation begun at `since`: apart from the others if it
    /// came in a restart's window. Returns whether it did (the operation may then be retried).
    fn storage_error(&self, doing: &str, error: &LockError, since: u64) -> bool {
        let restart = restart_overlaps(&self.folder, self.lease, since, unix_micros());
        if restart {
            bump(&self.counters.restart_storage_errors);
            eprintln!("child {}: {doing}, during a restart: {error}", self.tag);
        } else {
            bump(&self.counters.storage_errors);
            eprintln!("child {}: {doing}: {error}", self.tag);
        }
        restart
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("the child's {name} is not set"))
}

fn env_number(name: &str) -> u64 {
    env(name)
        .parse()
        .unwrap_or_else(|_| panic!("the child's {name} is not a number"))
}

/// The child's side: reads its settings from the environment that `run` set.
pub fn child_main() {
    let folder = PathBuf::from(env(CHILD_ENV));
    let id = env_number("TORTURE_ID") as usize;
    let incarnation = env_number("TORTURE_INCARNATION");
    let seed = env_number("TORTURE_SEED");
    let tasks = env_number("TORTURE_TASKS");
    let lease = Duration::from_millis(env_number("TORTURE_LEASE_MS"));
    let heartbeat = Duration::from_millis(env_number("TORTURE_HEARTBEAT_MS"));
    let deadline = env_number("TORTURE_DEADLINE");
    let hold = Duration::from_millis(env_number("TORTURE_HOLD_MS"));
    let tokio = env("TORTURE_RUNTIME") == "tokio";
    let skew: i64 = env("TORTURE_SKEW_MS")
        .parse()
        .expect("the child's TORTURE_SKEW_MS is not a number");
    let place = Place::from_env(&folder);
    let counters = Counters::default();
    let locks = loop {
        let mut builder = LockManager::builder().lease(lease).heartbeat(heartbeat);
        if skew != 0 {
            builder = builder.clock(Arc::new(SkewedClock(skew)));
        }
        let since = unix_micros();
        match smol::block_on(place.manager(builder)) {
            Ok(locks) => break locks,
            // This child was started just before a restart.
            Err(error) if restart_overlaps(&folder, lease, since, unix_micros()) => {
                bump(&counters.restart_storage_errors);
                eprintln!("child {id}.{incarnation}: opening, during a restart: {error}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(error) => panic!("the child cannot open the lock database: {error}"),
        }
    };
    let context = Arc::new(ChildContext {
        tag: format!("{id}.{incarnation}"),
        folder,
        id,
        deadline,
        lease,
        hold,
        locks,
        counters,
    });
    if tokio {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("start the child's tokio runtime")
            .block_on(child(context, seed, tasks));
    } else {
        smol::block_on(child(context, seed, tasks));
    }
}

async fn child(context: Arc<ChildContext>, seed: u64, tasks: u64) {
    let counters_file = context.folder.join(format!("counters-{}", context.tag));
    let fibers: Vec<_> = (0..tasks)
        .map(|task| {
            let context = context.clone();
            let seed = seed ^ ((context.id as u64) << 40) ^ (task << 20);
            fork_daemon(async move { task_loop(&context, Rng::new(seed)).await })
        })
        .collect();
    while unix_micros() < context.deadline {
        publish(&counters_file, &context.counters.render());
        sleep(Duration::from_millis(100)).await;
    }
    for fiber in fibers {
        let _ = fiber.join().await;
    }
    let since = unix_micros();
    if let Err(error) = context.locks.shutdown().await {
        context.storage_error("shutting down", &error, since);
    }
    publish(&counters_file, &context.counters.render());
}

fn random_request(rng: &mut Rng, key: &str, operation: &str) -> LockRequest {
    if rng.chance(50) {
        LockRequest::shared(key, operation)
    } else {
        LockRequest::exclusive(key, operation)
    }
}

/// Two distinct keys with random modes.
fn random_pair(rng: &mut Rng, operation: &str) -> Vec<LockRequest> {
    let first = rng.below(KEYS.len() as u64) as usize;
    let second = (first + 1 + rng.below(KEYS.len() as u64 - 1) as usize) % KEYS.len();
    vec![
        random_request(rng, KEYS[first], operation),
        random_request(rng, KEYS[second], operation),
    ]
}

async fn task_loop(context: &ChildContext, mut rng: Rng) {
    while unix_micros() < context.deadline {
        one_operation(context, &mut rng).await;
        if rng.chance(30) {
            sleep(rng.millis(0, 20)).await;
        }
    }
}

/// How an acquisition may be cut short.
#[derive(Clone, Copy)]
enum Interruption {
    None,
    Timeout(Duration),
    /// A controller aborted from elsewhere after this long.
    Abort(Duration),
    /// The acquisition loses a `select` against a timer and is dropped.
    Drop(Duration),
}

/// What an operation asks for.
enum Ask {
    Try(LockRequest),
    Shared(&'static str),
    Exclusive(&'static str),
    Many(Vec<LockRequest>),
    ManyQueued(Vec<LockRequest>),
}

impl Ask {
    fn random(rng: &mut Rng) -> Ask {
        let key = KEYS[rng.below(KEYS.len() as u64) as usize];
        match rng.below(100) {
            0..=19 => Ask::Try(random_request(rng, key, "try")),
            20..=44 => Ask::Shared(key),
            45..=74 => Ask::Exclusive(key),
            75..=87 => Ask::Many(random_pair(rng, "many")),
            _ => Ask::ManyQueued(random_pair(rng, "many_queued")),
        }
    }

    /// `None` when the acquisition was dropped.
    async fn acquire(
        &self,
        locks: &LockManager,
        interruption: Interruption,
    ) -> Option<Result<Option<Guard>, LockError>> {
        let acquisition = match self {
            Ask::Try(request) => {
                let attempt = locks.try_acquire(request.clone());
                return match interruption {
                    Interruption::Drop(after) => race(attempt, after).await,
                    _ => Some(attempt.await),
                };
            }
            Ask::Shared(key) => locks.shared(*key, "read"),
            Ask::Exclusive(key) => locks.exclusive(*key, "write"),
            Ask::Many(requests) => locks.many(requests.clone()),
            Ask::ManyQueued(requests) => locks.many_queued(requests.clone()),
        };
        acquisition_with(acquisition, interruption)
            .await
            .map(|result| result.map(Some))
    }
}

async fn one_operation(context: &ChildContext, rng: &mut Rng) {
    bump(&context.counters.operations);
    let ask = Ask::random(rng);
    let interruption = match rng.below(100) {
        0..=54 => Interruption::None,
        55..=69 => Interruption::Timeout(rng.millis(1, 300)),
        70..=84 => Interruption::Abort(rng.millis(0, 300)),
        _ => Interruption::Drop(rng.millis(0, 300)),
    };
    let started = unix_micros();
    let acquired = loop {
        let since = unix_micros();
        let acquired = ask.acquire(&context.locks, interruption).await;
        match &acquired {
            Some(Err(error @ LockError::Storage(_))) if !context.stopped_since(started) => {
                if !context.storage_error("acquiring", error, since) {
                    return;
                }
                // The server is restarting: try again.
                sleep(Duration::from_millis(50)).await;
            }
            _ => break acquired,
        }
    };
    let guard = match acquired {
        None => {
            bump(&context.counters.dropped_acquisitions);
            bump(&context.counters.interruptions);
            return;
        }
        Some(Ok(Some(guard))) => guard,
        Some(Ok(None)) => {
            bump(&context.counters.not_granted);
            return;
        }
        Some(Err(LockError::Interrupted(_))) => {
            bump(&context.counters.interruptions);
            return;
        }
        Some(Err(error @ LockError::Storage(_))) if context.stopped_since(started) => {
            // A storage error right after a pause (a waiter whose lease ran out while it was
            // stopped queues again instead, so this is rare: kept apart from real failures).
            bump(&context.counters.expired_waits);
            eprintln!("child {}: after a pause: {error}", context.tag);
            return;
        }
        Some(Err(error)) => {
            context.storage_error("acquiring", &error, started);
            return;
        }
    };
    bump(&context.counters.grants);
    hold(context, rng, &guard).await;
    if guard.lost().is_aborted() {
        bump(&context.counters.lost_signals);
    }
    if rng.chance(50) {
        let since = unix_micros();
        match guard.release().await {
            Ok(()) => {}
            // The lease ran out while it was held (this child was paused, or starved): the
            // release says so. Whether a write overlapped is the register's to judge.
            Err(LockError::LeaseLost(_)) => bump(&context.counters.lost_on_release),
            Err(error) => {
                context.storage_error("releasing", &error, since);
            }
        }
    } else {
        drop(guard);
    }
}

async fn acquisition_with(
    acquisition: Scoped<Guard, LockError>,
    interruption: Interruption,
) -> Option<Result<Guard, LockError>> {
    match interruption {
        Interruption::None => Some(acquisition.await),
        Interruption::Timeout(after) => {
            Some(acquisition.with_signal(&AbortSignal::timeout(after)).await)
        }
        Interruption::Abort(after) => {
            let controller = AbortController::new();
            let acquisition = acquisition.with_signal(&controller.signal());
            smol::spawn(async move {
                sleep(after).await;
                controller.abort("the torture run interrupts this acquisition");
            })
            .detach();
            Some(acquisition.await)
        }
        Interruption::Drop(after) => race(acquisition, after).await,
    }
}

/// `future`'s output, or `None` (and `future` dropped) if `after` passes first.
async fn race<T>(future: impl std::future::Future<Output = T>, after: Duration) -> Option<T> {
    futures::select! {
        value = future.fuse() => Some(value),
        _ = FutureExt::fuse(smol::Timer::after(after)) => None,
    }
}

/// The protected work on every key the guard holds, one key after another.
async fn hold(context: &ChildContext, rng: &mut Rng, guard: &Guard) {
    let granted_at = unix_micros();
    let mark = Mark {
        token: guard.fencing_token(),
        tag: context.tag.clone(),
    };
    let mut suspicious = false;
    let mut unexplained = false;
    let mut lost_updates = 0;
    let lost = guard.lost();
    for request in guard.requests() {
        let register = Register::new(&context.folder, &request.key);
        match work_on(context, rng, &register, &mark, request.mode, &lost).await {
            Ok(outcome) => {
                suspicious |= outcome.suspicious;
                unexplained |= outcome.unexplained;
                lost_updates += outcome.lost_updates;
            }
            Err(error) => {
                bump(&context.counters.register_errors);
                eprintln!("child {}: register {}: {error}", context.tag, request.key);
            }
        }
    }
    let stopped = context.stopped_since(granted_at);
    if stopped {
        bump(&context.counters.stopped_holders);
    }
    if suspicious || stopped || lost_updates > 0 {
        // Someone newer was here (or this process was paused past its lease): that is fine only
        // if this holder's lease was lost, and `lost()` must have said so by the time the newer
        // holder's work showed: nobody is granted the lock before the lease has run out, and
        // the lease as this process knows it runs out no later than that.
        let noticed = race(lost.aborted(), context.lease * 3).await.is_some();
        let detected_at = unix_micros();
        if unexplained && noticed {
            bump(&context.counters.late_losses);
            eprintln!(
                "child {}: overlap seen before lost() fired, which it did later ({mark:?})",
                context.tag
            );
            suspect(context, "late loss", guard, granted_at, detected_at);
        }
        if noticed {
            if suspicious || lost_updates > 0 {
                bump(&context.counters.overlaps_after_loss);
            }
            if stopped {
                late_writes(context, guard, &mark).await;
            }
        } else {
            if suspicious {
                bump(&context.counters.violations);
                eprintln!(
                    "child {}: overlap while the lease held ({mark:?})",
                    context.tag
                );
                suspect(context, "violation", guard, granted_at, detected_at);
            }
            if lost_updates > 0 {
                context
                    .counters
                    .lost_updates
                    .fetch_add(lost_updates, Ordering::Relaxed);
            }
            if stopped {
                bump(&context.counters.stops_unnoticed);
                eprintln!(
                    "child {}: paused past the lease, but lost() did not fire",
                    context.tag
                );
            }
        }
    }
}

/// Notes a holder whose overlap with another `lost()` did not explain in time, for the parent to
/// explain with the store's history of the keys (see `Store::history`): one line per key,
/// `what tag token key granted_at detected_at` (unix micros).
fn suspect(context: &ChildContext, what: &str, guard: &Guard, granted_at: u64, detected_at: u64) {
    for request in guard.requests() {
        append(
            &context.folder.join("suspects"),
            &format!(
                "{what}\t{}\t{}\t{}\t{granted_at}\t{detected_at}\n",
                context.tag,
                guard.fencing_token(),
                request.key
            ),
        );
    }
}

/// A holder that was paused past its lease writes once more, as a process that does not look
/// at `lost()` would: the fence must refuse it if anyone newer has been here.
async fn late_writes(context: &ChildContext, guard: &Guard, mark: &Mark) {
    for request in guard.requests() {
        if request.mode != Mode::Exclusive {
            continue;
        }
        let register = Register::new(&context.folder, &request.key);
        let written = match register.read().await {
            Ok(value) => register.write(mark, value).await,
            Err(error) => Err(error),
        };
        match written {
            Ok(Written::Refused) => bump(&context.counters.stale_writes_refused),
            // Nobody newer came: the write is late but harms no one.
            Ok(Written::Accepted { .. }) => bump(&context.counters.late_writes_accepted),
            Err(error) => {
                bump(&context.counters.register_errors);
                eprintln!("child {}: register {}: {error}", context.tag, request.key);
            }
        }
    }
}

struct WorkOutcome {
    /// Another holder's mark was found, or the value changed under a reader.
    suspicious: bool,
    /// Something suspicious was seen while `lost()` had not fired.
    unexplained: bool,
    lost_updates: u64,
}

impl WorkOutcome {
    /// Another holder's work showed; `lost` should have fired already.
    fn overlap(&mut self, lost: &AbortSignal) {
        self.suspicious = true;
        self.unexplained |= !lost.is_aborted();
    }
}

async fn work_on(
    context: &ChildContext,
    rng: &mut Rng,
    register: &Register,
    mark: &Mark,
    mode: Mode,
    lost: &AbortSignal,
) -> std::io::Result<WorkOutcome> {
    let mut outcome = WorkOutcome {
        suspicious: false,
        unexplained: false,
        lost_updates: 0,
    };
    let entered = register.enter(mark, mode).await?;
    let first = match entered {
        Entry::Entered(value) => value,
        Entry::Stale => {
            outcome.overlap(lost);
            register.read().await?
        }
    };
    let hold = context.hold.as_millis() as u64;
    sleep(rng.millis(0, hold)).await;
    match mode {
        Mode::Exclusive => match register.write(mark, first).await? {
            Written::Refused => bump(&context.counters.stale_writes_refused),
            Written::Accepted { lost_update, stale } => {
                bump(&context.counters.increments);
                if stale {
                    bump(&context.counters.stale_writes_accepted);
                    eprintln!(
                        "child {}: the fence accepted a stale write ({mark:?})",
                        context.tag
                    );
                }
                if lost_update {
                    outcome.lost_updates += 1;
                    outcome.unexplained |= !lost.is_aborted();
                }
            }
        },
        Mode::Shared => {
            if register.read().await? != first {
                outcome.overlap(lost);
            }
        }
    }
    sleep(rng.millis(0, hold)).await;
    if register.leave(mark).await? {
        outcome.overlap(lost);
    }
    Ok(outcome)
}

// ---------------------------------------------------------------------------------------------
// The parent.

/// A child process and who it is.
struct Worker {
    id: usize,
    incarnation: u64,
    child: Child,
}

impl Worker {
    fn tag(&self) -> String {
        format!("{}.{}", self.id, self.incarnation)
    }
}

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Seed of the run.
    pub seed: u64,
    /// Children's counters, summed.
    pub totals: Totals,
    /// SIGKILLs sent.
    pub kills: u64,
    /// SIGSTOP/SIGCONT pauses.
    pub stops: u64,
    /// Children whose PostgreSQL connections were cut (`pg_terminate_backend`).
    pub connection_kills: u64,
    /// PostgreSQL server restarts (`pg_ctl restart`).
    pub server_restarts: u64,
    /// Children (by slot, whatever their incarnation) whose clock was skewed.
    pub skewed_children: u64,
    /// Where the locks were: `sqlite` or `postgres`.
    pub backend: &'static str,
    /// Rows left in the database after every owner shut down and one lease passed.
    pub leaked_rows: u64,
    /// Children that did not exit by themselves after the deadline, or exited with an error.
    pub failed_children: u64,
    /// Why the final clean-up or count did not work, if it did not.
    pub final_error: Option<String>,
    /// How long the run took.
    pub elapsed: Duration,
}

impl Summary {
    /// The checks that failed (none for a good run).
    pub fn failures(&self) -> Vec<String> {
        let t = &self.totals;
        let mut failures = Vec::new();
        for (name, value) in [
            ("violations", t.violations),
            ("late_losses", t.late_losses),
            ("lost_updates", t.lost_updates),
            ("stale_writes_accepted", t.stale_writes_accepted),
            ("leaked_rows", self.leaked_rows),
            ("storage_errors", t.storage_errors),
            ("stops_unnoticed", t.stops_unnoticed),
            ("register_errors", t.register_errors),
            ("failed_children", self.failed_children),
        ] {
            if value != 0 {
                failures.push(format!("{name} = {value}"));
            }
        }
        if let Some(error) = &self.final_error {
            failures.push(error.clone());
        }
        failures
    }

    /// One JSON object on one line.
    pub fn json(&self) -> String {
        let t = &self.totals;
        let fields = [
            ("seed", self.seed),
            ("operations", t.operations),
            ("grants", t.grants),
            ("interruptions", t.interruptions),
            ("kills", self.kills),
            ("stops", self.stops),
            ("lost_signals", t.lost_signals),
            ("lost_on_release", t.lost_on_release),
            ("violations", t.violations),
            ("late_losses", t.late_losses),
            ("lost_updates", t.lost_updates),
            ("stale_writes_accepted", t.stale_writes_accepted),
            ("stale_writes_refused", t.stale_writes_refused),
            ("leaked_rows", self.leaked_rows),
            ("storage_errors", t.storage_errors),
            ("stops_unnoticed", t.stops_unnoticed),
            ("failed_children", self.failed_children),
            ("connection_kills", self.connection_kills),
            ("server_restarts", self.server_restarts),
            ("skewed_children", self.skewed_children),
            ("restart_storage_errors", t.restart_storage_errors),
        ];
        let body: Vec<String> = fields
            .iter()
            .map(|(name, value)| format!("\"{name}\":{value}"))
            .collect();
        format!("{{{}}}", body.join(","))
    }

    /// For people.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "torture run on {}: seed {}, {:.1} s, {} kills, {} stops, {} connection kills, \
             {} restarts, {} skewed children, {} rows left\n",
            self.backend,
            self.seed,
            self.elapsed.as_secs_f64(),
            self.kills,
            self.stops,
            self.connection_kills,
            self.server_restarts,
            self.skewed_children,
            self.leaked_rows
        );
        for (name, value) in self.totals.fields() {
            text.push_str(&format!("  {name:<24} {value}\n"));
        }
        let failures = self.failures();
        if failures.is_empty() {
            text.push_str("all checks passed");
        } else {
            text.push_str(&format!("FAILED: {}", failures.join(", ")));
        }
        text
    }
}

/// What the parent does next.
enum Fault {
    Kill,
    Stop,
    Cut,
}

/// Runs the parent: starts the children, injects faults until the deadline, collects the
/// counters, and checks that the database (`store`) is left empty.
pub fn run(config: &Config, store: &Store) -> Summary {
    let started = Instant::now();
    // A folder of its own, as several runs may share a process (the tests) and a seed.
    let folder = tempfile::Builder::new()
        .prefix(&format!("leasehold-torture-{}-", config.seed))
        .tempdir()
        .expect("create the run's folder")
        .keep();
    let place = store.place(&folder);
    let mut summary = Summary {
        seed: config.seed,
        backend: match config.backend {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        },
        skewed_children: (0..config.processes)
            .filter(|&id| clock_skew(config.backend, id) != 0)
            .count() as u64,
        ..Summary::default()
    };
    // The parent's own owner: it only looks (inspect) to pick whom to kill or pause.
    let observer = smol::block_on(
        place.named("torture-parent").manager(
            LockManager::builder()
                .lease(config.lease)
                .heartbeat(config.heartbeat),
        ),
    )
    .expect("open the lock database");
    if let Err(error) = store.keep_history(&folder) {
        eprintln!("the store's history is not kept (a violation will be told without it): {error}");
    }
    let note_fault = |what: &str, tag: &str| {
        append(
            &folder.join("faults"),
            &format!("{}\t{what}\t{tag}\n", unix_micros()),
        );
    };
    let run_start = unix_micros();
    let deadline = run_start + (config.seconds * 1e6) as u64;
    let mut incarnations = 0u64;
    let mut spawn = |id: usize| {
        incarnations += 1;
        spawn_child(config, &folder, &place, id, incarnations, deadline)
    };
    let mut workers: Vec<Worker> = (0..config.processes).map(&mut spawn).collect();
    let mut rng = Rng::new(config.seed);
    // Faults start once the children are busy, and the last pause ends well before the deadline.
    let pause_for = || config.lease + config.lease / 2;
    let fault_window_end =
        deadline.saturating_sub(micros(pause_for() + config.lease / 2) + 600_000);
    let mut next_fault = unix_micros() + (config.seconds * 0.2e6) as u64;
    // The restarts (of a server this run started): fast at 30 % of the run, a crash at 50 %.
    let restarts: Vec<(u64, bool)> = [(0.3, false), (0.5, true)]
        .into_iter()
        .filter(|_| store.restarts())
        .map(|(at, immediate)| (run_start + (config.seconds * at * 1e6) as u64, immediate))
        .collect();
    let mut windows: Vec<(u64, u64)> = Vec::new();
    while unix_micros() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        let now = unix_micros();
        if now > fault_window_end {
            continue;
        }
        if let Some(&(at, immediate)) = restarts.get(summary.server_restarts as usize) {
            if now >= at {
                let how = if immediate { "immediate" } else { "fast" };
                note_fault(&format!("server restart ({how}) begins"), "");
                restart(store, &folder, &mut windows, immediate);
                note_fault(&format!("server restart ({how}) ends"), "");
                summary.server_restarts += 1;
                next_fault = unix_micros() + micros(rng.millis(100, 300));
                continue;
            }
        }
        if now < next_fault {
            continue;
        }
        let holders = smol::block_on(observer.inspect(None)).unwrap_or_default();
        // The first fault is a kill, the second a pause, the third (on PostgreSQL) a cut
        // connection; then any, at random.
        let cuts = config.cut_connections && store.cuts_connections();
        let fault = match (summary.kills, summary.stops, summary.connection_kills) {
            (0, _, _) => Fault::Kill,
            (_, 0, _) => Fault::Stop,
            (_, _, 0) if cuts => Fault::Cut,
            _ if cuts => match rng.below(100) {
                0..=34 => Fault::Cut,
                35..=59 => Fault::Kill,
                _ => Fault::Stop,
            },
            _ if rng.chance(40) => Fault::Kill,
            _ => Fault::Stop,
        };
        let kill = !matches!(fault, Fault::Stop);
        let Some(index) = pick_victim(&workers, &holders, kill, &mut rng) else {
            continue;
        };
        if let Fault::Cut = fault {
            let name = format!("torture-{}", workers[index].tag());
            if store.cut_connections(&name) > 0 {
                summary.connection_kills += 1;
                note_fault("connections cut", &workers[index].tag());
            }
        } else if kill {
            let worker = &mut workers[index];
            let _ = worker.child.kill();
            let _ = worker.child.wait();
            summary.kills += 1;
            let tag = worker.tag();
            note_fault("killed", &tag);
            for key in KEYS {
                let _ = smol::block_on(Register::new(&folder, key).clear(&tag));
            }
            let id = worker.id;
            workers[index] = spawn(id);
        } else {
            let worker = &workers[index];
            let pid = worker.child.id().to_string();
            let stopped_at = unix_micros();
            if signal(&pid, "-STOP") {
                note_fault("stopped", &worker.tag());
                wait_until_stopped(&pid);
                // Written while the child is stopped: whatever reads it has really been paused.
                publish(
                    &folder.join(format!("stopped-{}", worker.tag())),
                    &stopped_at.to_string(),
                );
                std::thread::sleep(pause_for() + config.lease / 2 * rng.below(100) as u32 / 100);
                signal(&pid, "-CONT");
                note_fault("continued", &worker.tag());
                summary.stops += 1;
            }
        }
        // Soon after the first kill come the first pause and cut, so that short runs see them.
        let gap = if summary.stops == 0 || (cuts && summary.connection_kills == 0) {
            rng.millis(100, 300)
        } else {
            rng.millis(500, 2_500)
        };
        next_fault = unix_micros() + micros(gap);
    }
    for worker in &mut workers {
        match wait_for_exit(&mut worker.child, Duration::from_secs(30)) {
            Ok(()) => {}
            Err(why) => {
                summary.failed_children += 1;
                eprintln!(
                    "child {} {why} (its log: {})",
                    worker.tag(),
                    folder.join(format!("child-{}.log", worker.tag())).display()
                );
            }
        }
    }
    let _ = smol::block_on(observer.shutdown());
    drop(observer);
    summary.leaked_rows = match final_count(config, store, &folder) {
        Ok(rows) => rows,
        Err(error) => {
            summary.final_error = Some(format!("the final count failed: {error}"));
            0
        }
    };
    for entry in fs::read_dir(&folder).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("counters-") && !name.ends_with(".part") {
            summary
                .totals
                .add(&fs::read_to_string(entry.path()).unwrap_or_default());
        }
    }
    summary.elapsed = started.elapsed();
    explain_suspects(config, store, &folder);
    if summary.failures().is_empty() {
        let _ = fs::remove_dir_all(&folder);
        store.forget();
    } else {
        eprintln!(
            "the run's files (child logs, registers, database) are kept in {}",
            folder.display()
        );
    }
    summary
}

fn micros(duration: Duration) -> u64 {
    duration.as_micros() as u64
}

/// Restarts the server, and publishes the restart's window for the children while it runs
/// and once it is over.
fn restart(store: &Store, folder: &Path, windows: &mut Vec<(u64, u64)>, immediate: bool) {
    let publish_windows = |windows: &[(u64, u64)]| {
        let lines: Vec<String> = windows.iter().map(|(s, e)| format!("{s} {e}\n")).collect();
        publish(&folder.join("restarts"), &lines.concat());
    };
    windows.push((unix_micros(), u64::MAX));
    publish_windows(windows);
    store.restart(immediate);
    if let Some(window) = windows.last_mut() {
        window.1 = unix_micros();
    }
    publish_windows(windows);
}

fn spawn_child(
    config: &Config,
    folder: &Path,
    place: &Place,
    id: usize,
    incarnation: u64,
    deadline: u64,
) -> Worker {
    let log = fs::File::create(folder.join(format!("child-{id}.{incarnation}.log")))
        .expect("create a child's log");
    let seed = config.seed ^ (id as u64) << 32 ^ incarnation;
    let mut command = Command::new(&config.child_command[0]);
    place
        .named(&format!("torture-{id}.{incarnation}"))
        .to_env(&mut command);
    let child = command
        .args(&config.child_command[1..])
        .env(CHILD_ENV, folder)
        .env("TORTURE_ID", id.to_string())
        .env("TORTURE_INCARNATION", incarnation.to_string())
        .env("TORTURE_SEED", seed.to_string())
        .env("TORTURE_TASKS", config.tasks.to_string())
        .env("TORTURE_LEASE_MS", config.lease.as_millis().to_string())
        .env(
            "TORTURE_HEARTBEAT_MS",
            config.heartbeat.as_millis().to_string(),
        )
        .env("TORTURE_DEADLINE", deadline.to_string())
        .env("TORTURE_HOLD_MS", config.hold.as_millis().to_string())
        .env(
            "TORTURE_RUNTIME",
            match config.runtime {
                Runtime::Smol => "smol",
                Runtime::Tokio => "tokio",
            },
        )
        .env(
            "TORTURE_SKEW_MS",
            clock_skew(config.backend, id).to_string(),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("share the log"))
        .stderr(log)
        .spawn()
        .expect("start a child");
    Worker {
        id,
        incarnation,
        child,
    }
}

/// A child to kill (one that holds or waits) or to pause (one that holds, exclusively if any).
fn pick_victim(
    workers: &[Worker],
    rows: &[leasehold::LockEntry],
    kill: bool,
    rng: &mut Rng,
) -> Option<usize> {
    let score = |worker: &Worker| {
        let pid = worker.child.id().to_string();
        let mine = rows
            .iter()
            .filter(|row| row.owner.split('-').next() == Some(pid.as_str()));
        mine.map(|row| match (&row.state, row.mode) {
            (EntryState::Held, Mode::Exclusive) => 4,
            (EntryState::Held, Mode::Shared) => 2,
            (EntryState::Waiting { .. }, _) if kill => 1,
            _ => 0,
        })
        .max()
        .unwrap_or(0)
    };
    let best = workers.iter().map(score).max()?;
    if best == 0 {
        // Nobody holds anything right now: try again at the next tick.
        return None;
    }
    let candidates: Vec<usize> = (0..workers.len())
        .filter(|&i| score(&workers[i]) == best)
        .collect();
    Some(candidates[rng.below(candidates.len() as u64) as usize])
}

fn signal(pid: &str, which: &str) -> bool {
    Command::new("kill")
        .args([which, pid])
        .status()
        .is_ok_and(|status| status.success())
}

/// Waits (briefly) until the kernel reports the process as stopped.
fn wait_until_stopped(pid: &str) {
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the parenthesised command name.
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next());
        if matches!(state, Some("T") | None) {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits for `child` to exit by itself; else says why not. A child still running at `limit`
/// has its threads' stacks written to its log (by `gdb`, if the machine has it), then is killed.
fn wait_for_exit(child: &mut Child, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("exited with {status}")),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let stacks = Command::new("gdb")
                    .args([
                        "-p",
                        &child.id().to_string(),
                        "-batch",
                        "-ex",
                        "thread apply all bt",
                    ])
                    .stdin(Stdio::null())
                    .output();
                let _ = child.kill();
                let _ = child.wait();
                return Err(match stacks {
                    Ok(stacks) => format!(
                        "did not finish in time; killed. Its threads were at:\n{}",
                        String::from_utf8_lossy(&stacks.stdout)
                    ),
                    Err(_) => "did not finish in time; killed (no gdb to show where)".into(),
                });
            }
            Err(error) => return Err(format!("could not be waited for: {error}")),
        }
    }
}

/// For every holder the children suspected (see `suspect`): the store's history of the key
/// around it, and the faults the parent made then, printed and kept in the run's folder
/// (`explain.txt`).
fn explain_suspects(config: &Config, store: &Store, folder: &Path) {
    let suspects = fs::read_to_string(folder.join("suspects")).unwrap_or_default();
    let faults = fs::read_to_string(folder.join("faults")).unwrap_or_default();
    let lease = micros(config.lease);
    let mut report = String::new();
    for line in suspects.lines().take(10) {
        let fields: Vec<&str> = line.split('\t').collect();
        let [what, tag, token, key, granted_at, detected_at] = fields[..] else {
            continue;
        };
        let (Ok(granted_at), Ok(detected_at)) =
            (granted_at.parse::<u64>(), detected_at.parse::<u64>())
        else {
            continue;
        };
        let (from, to) = (granted_at.saturating_sub(2 * lease), detected_at + lease);
        report.push_str(&format!(
            "\n== {what}: child {tag}, token {token}, key {key:?}, granted at {granted_at}, \
             seen at {detected_at} (unix µs)\n-- faults from {from} to {to}:\n"
        ));
        for fault in faults.lines() {
            let at = fault
                .split('\t')
                .next()
                .and_then(|at| at.parse::<u64>().ok());
            if at.is_some_and(|at| (from..=to).contains(&at)) {
                report.push_str(fault);
                report.push('\n');
            }
        }
        report.push_str(&format!("-- the store's history of {key:?}:\n"));
        match store.history(folder, key, from, to) {
            Ok(history) => report.push_str(&history),
            Err(error) => report.push_str(&format!("(not read: {error})")),
        }
        report.push('\n');
    }
    if !report.is_empty() {
        publish(&folder.join("explain.txt"), &report);
        eprintln!("what the store saw of the suspected holders:{report}");
    }
}

/// After one lease, a fresh owner's write transaction deletes the rows of killed children that
/// ran out; then every row left in the database is counted, live or not.
fn final_count(
    config: &Config,
    store: &Store,
    folder: &Path,
) -> Result<u64, Box<dyn std::error::Error>> {
    std::thread::sleep(config.lease + config.heartbeat);
    let builder = LockManager::builder()
        .lease(config.lease)
        .heartbeat(config.heartbeat);
    let place = store.place(folder).named("torture-cleaner");
    let cleaner = smol::block_on(place.manager(builder))?;
    smol::block_on(async {
        let guard = cleaner
            .try_acquire(LockRequest::exclusive("torture/clean-up", "clean-up"))
            .await?;
        if let Some(guard) = guard {
            guard.release().await?;
        }
        cleaner.shutdown().await
    })?;
    drop(cleaner);
    store.count_rows(folder)
}

#[cfg(test)]
mod tests;
