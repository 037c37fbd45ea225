//! Where a test's managers keep their rows. The lock manager's behaviour tests run on each
//! store: an SQLite file, a store in memory, and (with the `postgres` feature) a fresh schema on
//! the PostgreSQL server of `pg_support`, when there is one. Tests that look at the rows past
//! the managers (with SQL) run on the two databases.
#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;

use leasehold::{Clock, LockManager, LockManagerBuilder, MemoryStore, SystemClock, TestClock};

#[cfg(all(feature = "postgres", feature = "testkit"))]
use leasehold::testkit::postgres as pg_support;

/// One database that managers share, as processes share a file or a server.
pub enum Store {
    Sqlite {
        _dir: tempfile::TempDir,
        path: PathBuf,
    },
    Memory(MemoryStore),
    /// A store inside a simulation: its managers' workers are tasks of the simulation, on its
    /// virtual time, and meet no faults.
    #[cfg(feature = "testkit")]
    Simulated(leasehold::testkit::SimStore),
    #[cfg(all(feature = "postgres", feature = "testkit"))]
    Postgres {
        url: String,
        schema: String,
    },
}

impl Store {
    /// A new SQLite file in a temporary folder.
    pub fn sqlite() -> Store {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let path = dir.path().join("locks.db");
        Store::Sqlite { _dir: dir, path }
    }

    /// A new store in this process's memory.
    pub fn memory() -> Store {
        Store::Memory(MemoryStore::new())
    }

    /// A new store inside `sim`, for a scenario that runs in it (`common::in_simulation`).
    #[cfg(feature = "testkit")]
    pub fn simulated(sim: &leasehold::testkit::Sim) -> Store {
        Store::Simulated(leasehold::testkit::SimStore::new(sim))
    }

    /// The stores that live in this process or its file system, each new: SQLite and memory
    /// (what a property test can afford in every case).
    pub fn local() -> [Store; 2] {
        [Store::sqlite(), Store::memory()]
    }

    /// A new schema on the test server, named after the running test; `None` (the reason
    /// printed) when there is no server.
    #[cfg(all(feature = "postgres", feature = "testkit"))]
    pub fn postgres() -> Option<Store> {
        let server = pg_support::server()?;
        let test = std::thread::current()
            .name()
            .unwrap_or("test")
            .rsplit("::")
            .next()
            .unwrap_or("test")
            .to_owned();
        Some(Store::Postgres {
            url: server.url().to_owned(),
            schema: pg_support::schema(&test),
        })
    }

    /// The database file, for a SQLite store.
    pub fn sqlite_path(&self) -> Option<&std::path::Path> {
        match self {
            Store::Sqlite { path, .. } => Some(path),
            _ => None,
        }
    }

    /// Every store there is: SQLite, memory, and PostgreSQL when there is a test server.
    pub fn all() -> Vec<Store> {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        let postgres = Store::postgres();
        #[cfg(not(all(feature = "postgres", feature = "testkit")))]
        let postgres = None;
        [Some(Store::sqlite()), Some(Store::memory()), postgres]
            .into_iter()
            .flatten()
            .collect()
    }

    /// A new store of the same kind as `store`.
    pub fn like(store: &Store) -> Store {
        match store {
            Store::Sqlite { .. } => Store::sqlite(),
            Store::Memory(_) => Store::Memory(MemoryStore::new()),
            #[cfg(feature = "testkit")]
            Store::Simulated(_) => panic!("a simulated store is made with its simulation"),
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Store::Postgres { .. } => Store::postgres().expect("the server was there before"),
        }
    }

    /// Which store this is, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Store::Sqlite { .. } => "SQLite",
            Store::Memory(_) => "memory",
            #[cfg(feature = "testkit")]
            Store::Simulated(_) => "simulated",
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Store::Postgres { .. } => "PostgreSQL",
        }
    }

    /// Whether the test moves the time this store judges leases by: on SQLite each manager
    /// may read a `TestClock` of the test's own ([`open_on`](Store::open_on)). Elsewhere it
    /// cannot: a memory store's time is the latest of its managers' clocks, a simulated
    /// store's is the simulation's, and PostgreSQL's is the server's.
    pub fn moves_time(&self) -> bool {
        matches!(self, Store::Sqlite { .. })
    }

    /// Whether this is a store inside a simulation.
    pub fn is_simulated(&self) -> bool {
        #[cfg(feature = "testkit")]
        if let Store::Simulated(_) = self {
            return true;
        }
        false
    }

    /// The clock a manager on this store reads unless given one: inside a simulation (a
    /// simulated store is used in none other) the simulation's, else the system's.
    pub fn clock(&self) -> std::sync::Arc<dyn Clock> {
        crate::common::test_clock()
    }

    /// A new owner on this store, with `builder`'s settings, reading `clock`, a test's own. It
    /// judges the manager's leases alone on SQLite; a memory store's time is the latest of its
    /// managers' clocks (see [`moves_time`](Store::moves_time)).
    pub fn open_on(&self, builder: LockManagerBuilder, clock: &TestClock) -> LockManager {
        self.open_local(builder.clock(std::sync::Arc::new(clock.clone())))
    }

    /// A new owner on this store, with default settings.
    pub async fn open(&self) -> LockManager {
        self.open_with(LockManager::builder()).await
    }

    /// A new owner on this store, with `builder`'s settings.
    pub async fn open_with(&self, builder: LockManagerBuilder) -> LockManager {
        match self {
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Store::Postgres { url, schema } => builder
                .schema(schema)
                .connect(url)
                .await
                .expect("connect to the test server"),
            _ => self.open_local(builder),
        }
    }

    /// [`open_with`](Store::open_with) on a store of this process (not PostgreSQL), which
    /// opens without an await.
    pub fn open_local(&self, builder: LockManagerBuilder) -> LockManager {
        match self {
            Store::Sqlite { path, .. } => builder.open(path).expect("open the database"),
            Store::Memory(store) => builder.open_in(store).expect("open the memory store"),
            #[cfg(feature = "testkit")]
            Store::Simulated(store) => builder
                .open_simulated(store, leasehold::testkit::FaultPlan::none())
                .expect("open the simulated store"),
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Store::Postgres { .. } => panic!("a PostgreSQL store is connected to: open_with"),
        }
    }
}

impl Store {
    /// How many rows of the locks table meet the SQL condition `condition`, read past the
    /// managers, as an operator would.
    pub fn count_rows(&self, condition: &str) -> i64 {
        self.read_number(&format!("SELECT COUNT(*) FROM locks WHERE {condition}"))
    }

    /// How long until the last of `owner`'s rows runs out, read past the managers, by the
    /// clock the store judges leases with: the machine's boot clock for SQLite, the server's
    /// (this machine's wall clock) for PostgreSQL.
    pub fn lease_left(&self, owner: &str) -> std::time::Duration {
        let expires_at = self.read_number(&format!(
            "SELECT MAX(expires_at) FROM locks WHERE owner = '{owner}'"
        ));
        let now = match self {
            Store::Sqlite { .. } => SystemClock.boot_time().expect("a boot clock").since_boot,
            _ => SystemClock.now(),
        };
        std::time::Duration::from_micros(expires_at as u64).saturating_sub(now)
    }

    /// How many tombstones of operators' removals the store keeps, read past the managers.
    pub fn tombstones(&self) -> i64 {
        match self {
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Store::Postgres { schema, .. } => pg_support::server()
                .expect("the server was there before")
                .sql(&format!("SELECT COUNT(*) FROM \"{schema}\".removed"))
                .trim()
                .parse()
                .expect("a number"),
            _ => self.read_number("SELECT COUNT(*) FROM removed"),
        }
    }

    /// The one number `query` (of the table `locks`) reads.
    fn read_number(&self, query: &str) -> i64 {
        match self {
            Store::Sqlite { path, .. } => {
                let connection = crate::common::connection(path);
                let mut statement = connection
                    .prepare(query)
                    .expect("a query of the locks table");
                statement.next().expect("a number");
                statement.read::<i64, _>(0).expect("a number")
            }
            Store::Memory(_) => panic!("no SQL on a memory store: use on_every_database"),
            #[cfg(feature = "testkit")]
            Store::Simulated(_) => panic!("no SQL on a simulated store: use on_every_database"),
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Store::Postgres { schema, .. } => pg_support::server()
                .expect("the server was there before")
                .sql(&query.replace(" locks ", &format!(" {schema}.locks ")))
                .trim()
                .parse()
                .expect("a number"),
        }
    }
}

/// Holds the storage thread of an owner inside a statement until dropped, as a busy or stuck
/// database would: on SQLite another connection holds the write lock (every write
/// transaction waits for it, trying again and again); on PostgreSQL another session holds the
/// owner's rows locked (its renewal waits for them, and its lock timeout, and waits again).
pub enum Stall {
    Sqlite(crate::common::WriteLock),
    /// The session's thread (the synchronous client runs a runtime of its own, which may not be
    /// started inside a tokio runtime), and how to tell it to let go.
    #[cfg(all(feature = "postgres", feature = "testkit"))]
    Postgres(
        std::sync::mpsc::Sender<()>,
        Option<std::thread::JoinHandle<()>>,
    ),
}

impl Store {
    /// Stalls the storage thread of `owner` (see [`Stall`]).
    #[cfg_attr(
        not(all(feature = "postgres", feature = "testkit")),
        allow(unused_variables)
    )]
    pub fn stall(&self, owner: &str) -> Stall {
        match self {
            Store::Sqlite { path, .. } => Stall::Sqlite(crate::common::WriteLock::take(path)),
            Store::Memory(_) => panic!("a memory store cannot be stalled: use on_every_database"),
            #[cfg(feature = "testkit")]
            Store::Simulated(_) => panic!("a simulated store cannot be stalled"),
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Store::Postgres { url, schema } => {
                let (url, owner) = (url.clone(), owner.to_owned());
                let lock = format!("SELECT 1 FROM \"{schema}\".locks WHERE owner = $1 FOR UPDATE");
                let (locked, held) = std::sync::mpsc::channel();
                let (release, released) = std::sync::mpsc::channel();
                let session = std::thread::spawn(move || {
                    let mut client = postgres::Client::connect(&url, postgres::NoTls)
                        .expect("connect to the server");
                    client.batch_execute("BEGIN").expect("begin");
                    let rows = client
                        .execute(&lock, &[&owner])
                        .expect("lock the owner's rows");
                    let _ = locked.send(rows);
                    let _ = released.recv();
                    let _ = client.batch_execute("ROLLBACK");
                });
                let rows = held.recv().expect("the session locked the rows");
                assert!(rows > 0, "the owner has no rows to stall on");
                Stall::Postgres(release, Some(session))
            }
        }
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        match self {
            // Lets go as it drops.
            Stall::Sqlite(_) => {}
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Stall::Postgres(release, session) => {
                let _ = release.send(());
                if let Some(session) = session.take() {
                    let _ = session.join();
                }
            }
        }
    }
}

/// Runs `scenario` once on each of `stores`, in turn, under one executor: for tests that drive
/// time themselves, where running under every executor adds nothing.
pub fn on_each<F, Fut>(stores: impl IntoIterator<Item = Store>, scenario: F)
where
    F: Fn(Store) -> Fut,
    Fut: Future<Output = ()>,
{
    for store in stores {
        eprintln!("=== on {}", store.name());
        futures::executor::block_on(scenario(store));
    }
}

/// Runs `scenario` under every executor (`common::on_every_executor`), once on each store: a
/// fresh one for every run.
pub fn on_every_store<F, Fut>(scenario: F)
where
    F: Fn(Store) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    eprintln!("=== in memory");
    crate::common::on_every_executor(|| scenario(Store::memory()));
    in_a_simulation(&scenario);
    on_every_database(scenario);
}

/// `on_every_store` but for the simulated store: for scenarios that need what a simulation
/// does not give (an executor of the test's own for a manager's background work).
pub fn on_stores_of_this_process<F, Fut>(scenario: F)
where
    F: Fn(Store) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    eprintln!("=== in memory");
    crate::common::on_every_executor(|| scenario(Store::memory()));
    on_every_database(scenario);
}

/// Runs `scenario` once on a simulated store (feature `testkit`), inside its simulation: the
/// same lock manager, its worker stepped as a task on virtual time.
pub fn in_a_simulation<F, Fut>(scenario: &F)
where
    F: Fn(Store) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    #[cfg(feature = "testkit")]
    {
        eprintln!("=== in a simulation");
        crate::common::in_simulation(1, |sim| scenario(Store::simulated(sim)));
    }
    #[cfg(not(feature = "testkit"))]
    let _ = scenario;
}

/// `on_every_store` on the stores that are databases, whose rows a test can read and hold past
/// the managers (`count_rows`, `stall`): SQLite, and PostgreSQL when there is a test server.
pub fn on_every_database<F, Fut>(scenario: F)
where
    F: Fn(Store) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    eprintln!("=== on SQLite");
    crate::common::on_every_executor(|| scenario(Store::sqlite()));
    #[cfg(all(feature = "postgres", feature = "testkit"))]
    if pg_support::server().is_some() {
        eprintln!("=== on PostgreSQL");
        crate::common::on_every_executor(|| {
            scenario(Store::postgres().expect("the server was there a moment ago"))
        });
    }
}
