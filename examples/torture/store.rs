//! Where the locks are kept: a SQLite file in the run's folder, or a PostgreSQL schema.

use super::*;

/// What a manager opens; the parent tells its children through their environment.
#[derive(Clone, Debug)]
pub(crate) enum Place {
    File(PathBuf),
    Postgres { url: String, schema: String },
}

impl Place {
    pub(crate) fn from_env(folder: &Path) -> Place {
        match (
            std::env::var("TORTURE_PG_URL"),
            std::env::var("TORTURE_PG_SCHEMA"),
        ) {
            (Ok(url), Ok(schema)) => Place::Postgres { url, schema },
            _ => Place::File(folder.join("locks.db")),
        }
    }

    pub(crate) fn to_env(&self, command: &mut Command) {
        if let Place::Postgres { url, schema } = self {
            command
                .env("TORTURE_PG_URL", url)
                .env("TORTURE_PG_SCHEMA", schema);
        }
    }

    /// The same place, with connections that `pg_stat_activity` shows as `name`.
    pub(crate) fn named(&self, name: &str) -> Place {
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

    pub(crate) async fn manager(
        &self,
        builder: LockManagerBuilder,
    ) -> Result<LockManager, LockError> {
        match self {
            Place::File(path) => builder.open(path),
            #[cfg(all(feature = "postgres", feature = "testkit"))]
            Place::Postgres { url, schema } => builder.schema(schema).connect(url).await,
            #[cfg(not(all(feature = "postgres", feature = "testkit")))]
            Place::Postgres { .. } => Err(LockError::InvalidConfig(
                "PostgreSQL needs a build with `--features postgres,testkit`".into(),
            )),
        }
    }
}

/// A child's clock: the system clock as seen on a machine whose wall clock is off by `skew`
/// milliseconds (ahead when positive), and stepped by the run's shared offset (`steps`, micros,
/// which the parent steps back and forth in the file `CLOCK_FILE`: every child sees a step at
/// once, as the processes of one machine see NTP's). Its monotonic and boot times and its sleeps
/// are the real ones, as they would be.
pub(crate) struct ChildClock {
    pub(crate) skew: i64,
    pub(crate) steps: Arc<AtomicI64>,
}

impl Clock for ChildClock {
    fn now(&self) -> Duration {
        let by = self.skew * 1_000 + self.steps.load(Ordering::Relaxed);
        let now = SystemClock.now().as_micros() as i64 + by;
        Duration::from_micros(now.max(0) as u64)
    }

    fn monotonic(&self) -> Duration {
        SystemClock.monotonic()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        SystemClock.sleep(duration)
    }

    fn boot_time(&self) -> Option<leasehold::BootTime> {
        SystemClock.boot_time()
    }
}

/// The file in the run's folder that holds the wall-clock offset every child adds (micros).
pub(crate) const CLOCK_FILE: &str = "clock-offset";

/// The offset the parent keeps in `folder`'s `CLOCK_FILE`, read every few milliseconds by a
/// thread of this process's own for as long as it lives.
pub(crate) fn follow_clock_steps(folder: &Path) -> Arc<AtomicI64> {
    let steps = Arc::new(AtomicI64::new(0));
    let (path, seen) = (folder.join(CLOCK_FILE), steps.clone());
    std::thread::spawn(move || loop {
        if let Some(offset) = fs::read_to_string(&path)
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            seen.store(offset, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(5));
    });
    steps
}

/// How far the clock of child `id` is off (milliseconds): on PostgreSQL, child 0 runs 10 s ahead
/// and child 1 10 s behind; on SQLite, which judges leases by the clients' clocks, nobody.
pub(crate) fn clock_skew(backend: Backend, id: usize) -> i64 {
    match (backend, id) {
        (Backend::Postgres, 0) => 10_000,
        (Backend::Postgres, 1) => -10_000,
        _ => 0,
    }
}

/// A run's database as the parent sees it: where the locks are, and the faults it allows.
pub struct Store {
    #[cfg(all(feature = "postgres", feature = "testkit"))]
    pub(crate) postgres: Option<PgStore>,
}

#[cfg(all(feature = "postgres", feature = "testkit"))]
pub(crate) struct PgStore {
    pub(crate) server: pg_support::Server,
    pub(crate) url: String,
    pub(crate) schema: String,
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
                eprintln!("PostgreSQL needs a build with `--features postgres,testkit`");
                None
            }
        }
    }

    pub(crate) fn place(&self, folder: &Path) -> Place {
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
    pub(crate) fn cuts_connections(&self) -> bool {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        return self.postgres.is_some();
        #[cfg(not(all(feature = "postgres", feature = "testkit")))]
        false
    }

    /// Cuts every connection shown as `name`; returns how many there were.
    pub(crate) fn cut_connections(&self, name: &str) -> usize {
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
    pub(crate) fn restarts(&self) -> bool {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        return self
            .postgres
            .as_ref()
            .is_some_and(|pg| pg.server.dir().is_some());
        #[cfg(not(all(feature = "postgres", feature = "testkit")))]
        false
    }

    /// `pg_ctl restart -m fast`, or `-m immediate` (a crash) when `immediate`.
    pub(crate) fn restart(&self, immediate: bool) {
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
    pub(crate) fn count_rows(&self, folder: &Path) -> Result<u64, Box<dyn std::error::Error>> {
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
    pub(crate) fn keep_history(&self, folder: &Path) -> Result<(), Box<dyn std::error::Error>> {
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = &self.postgres {
            let s = format!("\"{}\"", pg.schema);
            pg.server.sql(&format!(
                "CREATE TABLE {s}.history (
                     at bigint NOT NULL, op text NOT NULL, txid bigint NOT NULL, app text NOT NULL,
                     key text NOT NULL, ticket bigint NOT NULL, mode bigint NOT NULL,
                     owner text NOT NULL, held boolean NOT NULL, expires_at bigint NOT NULL);
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
                         r.mode, r.owner, r.held, r.expires_at);
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
                 ticket INTEGER NOT NULL, mode INTEGER NOT NULL, owner TEXT NOT NULL,
                 held INTEGER NOT NULL, expires_at INTEGER NOT NULL);
             CREATE INDEX history_key ON history (key, at);",
        );
        for (op, row) in [("insert", "NEW"), ("update", "NEW"), ("delete", "OLD")] {
            sql.push_str(&format!(
                "CREATE TRIGGER history_{op} AFTER {op} ON locks BEGIN
                     INSERT INTO history VALUES ({now}, '{op}', {row}.key, {row}.ticket,
                         {row}.mode, {row}.owner, {row}.held, {row}.expires_at);
                 END;"
            ));
        }
        connection.execute(sql)?;
        Ok(())
    }

    /// The changes to the rows of `key` made from `from` to `to` (unix micros), one per line,
    /// oldest first: when (the store's time), what, by whom, and the row as it then was.
    pub(crate) fn history(
        &self,
        folder: &Path,
        key: &str,
        from: u64,
        to: u64,
    ) -> Result<String, Box<dyn std::error::Error>> {
        let header =
            "at (store's clock, unix µs)\top\tticket\tmode\towner\theld\texpires_at\tleft (µs)";
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        if let Some(pg) = &self.postgres {
            let rows = pg.server.sql(&format!(
                "SELECT at, op || ' (txid ' || txid || ', ' || app || ')', ticket, {MODE}, owner,
                        held, expires_at, expires_at - at
                 FROM \"{}\".history WHERE key = '{}' AND at BETWEEN {from} AND {to}
                 ORDER BY at, txid",
                pg.schema,
                key.replace('\'', "''")
            ));
            return Ok(format!("{header}\n{}", rows.replace('|', "\t")));
        }
        // SQLite rows keep their expiry on the machine's boot clock: shown on the wall clock,
        // by how far it is ahead of the boot clock now (the run steps no real clock).
        let boot = SystemClock
            .boot_time()
            .map_or(0, |time| time.since_boot.as_micros());
        let shift = SystemClock.now().as_micros() as i64 - boot as i64;
        let connection = sqlite::open(folder.join("locks.db"))?;
        let mut statement = connection.prepare(format!(
            "SELECT at, op, ticket, {MODE}, owner, held, expires_at + ?4,
                        expires_at + ?4 - at
                 FROM history WHERE key = ?1 AND at BETWEEN ?2 AND ?3 ORDER BY at"
        ))?;
        statement.bind((1, key))?;
        statement.bind((2, from as i64))?;
        statement.bind((3, to as i64))?;
        statement.bind((4, shift))?;
        let mut text = header.to_owned();
        while let sqlite::State::Row = statement.next()? {
            text.push('\n');
            for column in 0..8 {
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
    pub(crate) fn forget(&self) {
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

/// A history row's mode, in words, from the integer the stores keep: 0 shared, 1 exclusive, else
/// `count << 32 | limit` permits.
const MODE: &str = "CASE mode WHEN 0 THEN 'shared' WHEN 1 THEN 'exclusive'
    ELSE (mode >> 32) || ' of ' || (mode & 4294967295) || ' permits' END";

/// The restarts' windows, as the parent publishes them in the run's folder: one line per
/// restart, `start end` (unix micros; `end` is the largest number while it runs).
pub(crate) fn restart_windows(folder: &Path) -> Vec<(u64, u64)> {
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
pub(crate) fn restart_overlaps(folder: &Path, lease: Duration, from: u64, to: u64) -> bool {
    restart_windows(folder)
        .iter()
        .any(|&(start, end)| start <= to && from <= end.saturating_add(2 * micros(lease)))
}
