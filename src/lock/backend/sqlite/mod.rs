//! SQLite storage: schema, migrations, transactions, and one method per statement.
//!
//! Policy (who is granted what) lives in `grant.rs`; the order of work lives in `worker.rs`.
//! Everything here runs on the storage worker thread, never on a caller's executor thread.
//!
//! Times are stored as whole microseconds on the store's time line (`TimeLine`), recorded in the
//! file (table `time_line`): the machine's boot clock (`Clock::boot_time`), which no step of the
//! wall clock moves and which every process of the machine reads alike, on the boot recorded;
//! or, where the manager's clock has none, its wall time (since the Unix epoch). A write-ahead
//! log is shared only by the processes of one machine, so a file whose recorded boot is not
//! this one's was last written before a restart: its rows' owners are gone, and opening it
//! deletes them (`reconcile_time_line`). `inspect` shows times on the wall clock.

mod connection;
#[cfg(unix)]
pub(crate) mod doorbell;

use self::connection::{connect, FileIdentity};

use std::cell::{RefCell, RefMut};
use std::collections::{BTreeSet, HashMap};
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::sync::Arc;

use sqlite::{Connection, State, Statement};

use crate::clock::{Clock, SystemClock};
use crate::lock::backend::codec::{
    by_ticket, decode_keys, key_hash, mode_code, mode_of, sql_ticket, stored_keys, ticket_of,
};
use crate::lock::backend::siblings::Siblings;
use crate::lock::backend::{
    Capabilities, Changes, DecidesAtOnce, Deleted, Opening, OwnedRequest, Result, Row, Serve,
    Storage, TOMBSTONE_KEPT,
};
use crate::lock::grant::RowView;
use crate::lock::time::{micros, TimeLine};
use crate::lock::{LockError, LockRequest, StorageError};
use crate::schedule::Schedule;

/// The schema version this build writes and understands.
pub(crate) const SCHEMA_VERSION: i64 = 5;

/// The time by which a manager that opened a store as it is (`Opening::existing`) judges its
/// rows when they are on another time line than its clock's (an earlier boot's): every row has
/// lapsed by it, and it is within the worker's time line (`LAST_TIME`).
const STALE_NOW: i64 = i64::MAX / 4;

/// Why a manager on the wall clock cannot use a store on the machine's boot clock.
const WALL_ON_BOOT: &str = "its leases are judged by the machine's boot clock, which this \
                            manager's clock (a `Clock` without `boot_time`) cannot read; open it \
                            with a clock that gives `boot_time` (as `SystemClock` does on Linux)";

const SQLITE_BUSY: isize = 5;
const SQLITE_LOCKED: isize = 6;

/// How many keys' rows a connection remembers from its own write transactions (`Known`) before
/// it forgets them all and starts over.
const KNOWN_KEYS: usize = 4096;

/// How many of its newest entries the change log keeps. A connection that has not looked for
/// longer than that many promotions takes a full look instead.
const LOG_KEPT: i64 = 4096;

/// A storage error with the SQLite code and what was being done; `error` is its source.
pub(crate) fn storage_error(doing: &str, error: &sqlite::Error) -> LockError {
    storage_failure(doing, error).into()
}

/// [`storage_error`], as the failure alone.
pub(crate) fn storage_failure(doing: &str, error: &sqlite::Error) -> StorageError {
    let message = error.message.as_deref().unwrap_or("unknown error");
    let failure = StorageError::new(doing, message).transient(is_busy(error));
    let failure = match error.code {
        Some(code) => failure.with_code("SQLite", code.to_string()),
        None => failure,
    };
    let source = sqlite::Error {
        code: error.code,
        message: error.message.clone(),
    };
    failure.caused_by(source)
}

fn is_busy(error: &sqlite::Error) -> bool {
    matches!(error.code, Some(code) if code & 0xff == SQLITE_BUSY || code & 0xff == SQLITE_LOCKED)
}

/// Opens the database at `path` (creating it with the permission bits `file_mode` on unix), or
/// a private in-memory one for `None`, with its doorbell; says through `opened` whether it
/// could, and hands the storage to `worker`. Runs on the storage thread: no SQLite call is
/// made on a caller's.
pub(crate) fn serve(
    path: Option<&Path>,
    file_mode: u32,
    opening: Opening,
    opened: impl FnOnce(Result<()>),
    worker: impl Serve,
) {
    let conn = match connect(
        path,
        file_mode,
        &opening.busy,
        opening.existing,
        &opening.clock,
        &opening.lock_waits,
    ) {
        Ok(conn) => conn,
        Err(error) => return opened(Err(error)),
    };
    let file = path.and_then(FileIdentity::of);
    let mut db = Db::new(&conn, opening.clock, file, opening.busy);
    db.siblings = opening.siblings;
    if opening.existing {
        // Opened as it is: its rows are judged on the line it records, a wall clock's by the
        // wall clock; on another boot's (an earlier one), nothing of it is live, and nothing is
        // changed.
        match db.stored_time_line() {
            Ok(Some(TimeLine::Wall)) => db.line = TimeLine::Wall,
            Ok(found) => db.stale = found != Some(db.line),
            Err(error) => return opened(Err(error)),
        }
    }
    opened(Ok(()));
    // A manager of a store as it is (the command's views and repairs) makes no folder beside
    // it: it rings, and is rung, only where the store's own managers made one.
    #[cfg(unix)]
    let db = db.with_doorbell(
        path.filter(|path| !opening.existing || doorbell::folder_of(path).is_dir())
            .and_then(|path| {
                doorbell::Doorbell::open(path, &opening.owner, file_mode, opening.poke)
            }),
    );
    worker.serve(db);
}

/// A connection with the schema in place, and its prepared statements: parsing SQL costs more
/// than running these statements, so each is prepared once per connection. They are found by
/// the address of their text, a `&'static str`, not by hashing it: a transaction looks up about
/// ten, and hashing and comparing their text cost about a microsecond a cycle.
pub(crate) struct Db<'c> {
    conn: &'c Connection,
    statements: RefCell<Vec<(&'static str, Statement<'c>)>>,
    clock: Arc<dyn Clock>,
    /// The time line leases are judged by (the clock's), and its last reading.
    line: TimeLine,
    last_now: std::cell::Cell<i64>,
    /// Whether the store records another time line, which this manager (one that opened it as
    /// it is) judges every row lapsed by.
    stale: bool,
    /// The database file as opened; checked before every write and every look.
    file: Option<FileIdentity>,
    /// How to wait while the database is busy (`LockManagerBuilder::busy_schedule`).
    busy: Schedule,
    /// `PRAGMA data_version` and the change log's last entry as of the last `changes`.
    seen_version: Option<i64>,
    seen_seq: Option<i64>,
    /// Wakes this process's other managers of the file after a commit that freed something.
    siblings: Siblings,
    /// Wakes other processes' managers after a commit that announced something.
    #[cfg(unix)]
    doorbell: Option<crate::lock::backend::sqlite::doorbell::Doorbell>,
    ring: bool,
    /// The other owners whose requests the transaction promoted: rung by name.
    ring_owners: BTreeSet<String>,
    /// What this connection knows of the rows from its own write transactions.
    known: Known,
    /// Whether a write transaction is open (`begin` until `commit` or `rollback`).
    in_write: bool,
}

/// What a connection knows of the database from its own write transactions: every row of the
/// keys it read or wrote, and the ticket sequence's last value. While no other connection
/// commits, that stays true, so a transaction reads it from memory instead of running a
/// statement: under contention a batch's requests read the same few keys again and again, and
/// an uncontended acquisition reads the key it wrote a moment ago.
///
/// Each write transaction asks `PRAGMA data_version` as it starts, holding the write lock
/// until it ends: unchanged since the last one, no other connection committed in between, and
/// what is known holds; changed, it is forgotten. A rollback forgets it too, since the writes
/// it undid were applied here. Reads outside a write transaction never use it.
#[derive(Default)]
struct Known {
    /// `PRAGMA data_version` as of this connection's last write transaction.
    version: Option<i64>,
    /// Every row (lapsed ones too) of each key here, in ticket order.
    keys: HashMap<String, Vec<KnownRow>>,
    /// The ticket sequence's last value, if read (or taken) since `version`.
    last_ticket: Option<i64>,
    /// Whether the open transaction took tickets, whose last one `commit` writes back.
    tickets_taken: bool,
}

/// A row as a decision reads it, and when it was last renewed (which a promotion needs).
struct KnownRow {
    view: RowView,
    heartbeat_at: i64,
}

impl Known {
    /// A write transaction starts, and `PRAGMA data_version` says `version`.
    fn starting(&mut self, version: i64) {
        if self.version != Some(version) || self.keys.len() > KNOWN_KEYS {
            self.forget();
        }
        self.version = Some(version);
    }

    fn forget(&mut self) {
        self.version = None;
        self.keys.clear();
        self.last_ticket = None;
        self.tickets_taken = false;
    }
}

/// A cached statement, reset when dropped so that it never holds a read transaction open.
struct Cached<'a, 'c> {
    statement: RefMut<'a, Statement<'c>>,
}

impl<'c> Deref for Cached<'_, 'c> {
    type Target = Statement<'c>;
    fn deref(&self) -> &Statement<'c> {
        &self.statement
    }
}

impl DerefMut for Cached<'_, '_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.statement
    }
}

impl Drop for Cached<'_, '_> {
    fn drop(&mut self) {
        let _ = self.statement.reset();
    }
}

impl<'c> Db<'c> {
    /// The database on `conn`, whose leases are judged by `clock`, and whose path must go on
    /// naming `file` (where it is known); while it is busy, tries wait on `busy`.
    pub(crate) fn new(
        conn: &'c Connection,
        clock: Arc<dyn Clock>,
        file: Option<FileIdentity>,
        busy: Schedule,
    ) -> Self {
        Db {
            conn,
            statements: RefCell::new(Vec::new()),
            line: TimeLine::of(&*clock),
            last_now: std::cell::Cell::new(0),
            stale: false,
            clock,
            file,
            busy,
            seen_version: None,
            seen_seq: None,
            #[cfg(unix)]
            siblings: Siblings::alone(),
            doorbell: None,
            ring: false,
            ring_owners: BTreeSet::new(),
            known: Known::default(),
            in_write: false,
        }
    }

    /// Rings other processes' managers through `doorbell` after commits that free or promote.
    #[cfg(unix)]
    pub(crate) fn with_doorbell(
        mut self,
        doorbell: Option<crate::lock::backend::sqlite::doorbell::Doorbell>,
    ) -> Self {
        self.doorbell = doorbell;
        self
    }

    /// The change log's entries after `seq`, in order.
    fn log_after(&self, seq: i64) -> Result<Vec<(i64, i64)>> {
        let doing = "reading the change log";
        let mut statement = self.prepare(
            doing,
            "SELECT seq, key_hash FROM changes WHERE seq > ? ORDER BY seq",
        )?;
        bind(doing, &mut statement, 1, seq)?;
        let mut entries = Vec::new();
        while step(doing, &mut statement)? {
            entries.push((read(doing, &statement, 0)?, read(doing, &statement, 1)?));
        }
        Ok(entries)
    }

    fn exec(&self, doing: &str, sql: &str) -> Result<()> {
        self.conn.execute(sql).map_err(|e| storage_error(doing, &e))
    }

    /// The prepared statement for `sql`, prepared on first use.
    fn prepare(&self, doing: &str, sql: &'static str) -> Result<Cached<'_, 'c>> {
        let mut statements = self.statements.borrow_mut();
        // The same address and length: the same text. (The same text at two addresses is
        // prepared twice, which is harmless.)
        let found = statements
            .iter()
            .position(|(text, _)| std::ptr::eq(*text, sql));
        let index = match found {
            Some(index) => index,
            None => {
                // A fixed set of literals: were texts made at run time (and leaked), every one
                // would be prepared anew and lengthen the search.
                debug_assert!(
                    statements.len() < 64,
                    "prepared statements from run-time texts?"
                );
                let statement = self
                    .conn
                    .prepare(sql)
                    .map_err(|e| storage_error(doing, &e))?;
                statements.push((sql, statement));
                statements.len() - 1
            }
        };
        let statement = RefMut::map(statements, |all| &mut all[index].1);
        Ok(Cached { statement })
    }

    /// The number a pragma such as `PRAGMA user_version` answers.
    fn pragma(&self, doing: &str, sql: &'static str) -> Result<i64> {
        let mut statement = self.prepare(doing, sql)?;
        step(doing, &mut statement)?;
        read(doing, &statement, 0)
    }

    fn user_version(&self) -> Result<i64> {
        self.pragma("reading the schema version", "PRAGMA user_version")
    }

    /// `PRAGMA data_version`: changes when another connection commits.
    fn data_version(&self) -> Result<i64> {
        self.pragma("checking for changes (data_version)", "PRAGMA data_version")
    }

    /// Appends to `into` every row of `key` whose lease ends after `after`, in ticket order,
    /// with when each was last renewed.
    fn read_rows(&self, key: &str, after: i64, into: &mut Vec<KnownRow>) -> Result<()> {
        let key: Arc<str> = key.into();
        let doing = "reading the rows of a key";
        let mut statement = self.prepare(
            doing,
            "SELECT mode, ticket, held, owner, expires_at, keys, heartbeat_at FROM locks
             WHERE key = ? AND expires_at > ? ORDER BY ticket",
        )?;
        bind(doing, &mut statement, 1, &*key)?;
        bind(doing, &mut statement, 2, after)?;
        while step(doing, &mut statement)? {
            into.push(KnownRow {
                view: RowView {
                    key: key.clone(),
                    mode: mode_of(read(doing, &statement, 0)?),
                    ticket: ticket_of(read(doing, &statement, 1)?),
                    held: read::<i64>(doing, &statement, 2)? != 0,
                    owner: read::<String>(doing, &statement, 3)?.into(),
                    expires_at: read(doing, &statement, 4)?,
                    keys: read::<Option<String>>(doing, &statement, 5)?
                        .map_or_else(Vec::new, |keys| decode_keys(&keys)),
                },
                heartbeat_at: read(doing, &statement, 6)?,
            });
        }
        Ok(())
    }

    /// An error unless the schema is this build's: never changes it.
    fn check_version(&self, path: &Path) -> Result<()> {
        let found = Some(self.user_version()?).filter(|&version| version > 0);
        let doing = format!("opening the store {}", path.display());
        crate::lock::backend::schema_is_ours(&doing, found, SCHEMA_VERSION)
    }

    fn migrate(&mut self) -> Result<()> {
        self.begin_immediate("migrating the schema")?;
        let outcome = self.migrate_in_transaction();
        match outcome {
            Ok(()) => self.run_retrying_busy("migrating the schema", "COMMIT"),
            Err(error) => {
                self.rollback();
                Err(error)
            }
        }
    }

    fn migrate_in_transaction(&self) -> Result<()> {
        let found = self.user_version()?;
        if found > SCHEMA_VERSION {
            return Err(LockError::SchemaTooNew {
                found,
                supported: SCHEMA_VERSION,
            });
        }
        if found < 1 {
            self.exec(
                "creating the schema (version 1)",
                "CREATE TABLE tickets (
                     id INTEGER PRIMARY KEY CHECK (id = 1),
                     last INTEGER NOT NULL
                 );
                 INSERT INTO tickets (id, last) VALUES (1, 0);
                 -- Keyed by what every grant decision reads (the live rows of a key in ticket
                 -- order) and with no secondary index: each index is one more page written by
                 -- every commit, and the other lookups (by owner, by expiry) scan a table that
                 -- holds only live requests.
                 CREATE TABLE locks (
                     key TEXT NOT NULL,
                     ticket INTEGER NOT NULL,
                     mode INTEGER NOT NULL,
                     operation TEXT NOT NULL,
                     owner TEXT NOT NULL,
                     held INTEGER NOT NULL,
                     requested_at INTEGER NOT NULL,
                     acquired_at INTEGER,
                     expires_at INTEGER NOT NULL,
                     heartbeat_at INTEGER NOT NULL,
                     PRIMARY KEY (key, ticket)
                 ) WITHOUT ROWID;
                 PRAGMA user_version = 1;",
            )?;
        }
        if found < 2 {
            // The ticket counter moves into `locks`, as the row with key '' (no lock has an empty
            // key) and ticket 0 (below every ticket), which never expires. While the table fits
            // in one page, an acquisition then writes that one page instead of two: a page is
            // about a third of a commit's cost. Every query that scans across keys leaves the row
            // out with `key <> ''`; the others select by key, by owner or by lapsed expiry, which
            // the row never matches. A process still on version 1 fails safely: it cannot take a
            // ticket without the `tickets` table, and reads and deletes rows as before.
            self.exec(
                "migrating the schema to version 2",
                "ALTER TABLE locks ADD COLUMN last_ticket INTEGER;
                 INSERT INTO locks (key, ticket, mode, operation, owner, held, requested_at,
                                    acquired_at, expires_at, heartbeat_at, last_ticket)
                     SELECT '', 0, 0, '', '', 1, 0, NULL, 9223372036854775807, 0, last
                     FROM tickets;
                 DROP TABLE tickets;
                 PRAGMA user_version = 2;",
            )?;
        }
        if found < 3 {
            // Key-local decisions. A request on several keys names them all in each of its rows
            // (`keys`), so that a decision on one of them knows which others to read without an
            // index by ticket. And a change log: a transaction that promotes waiters appends
            // their keys (as `key_hash`), so that other connections find out which keys
            // changed without reading every key they wait for. `seq` only grows: the log is
            // trimmed from its oldest end, and its newest entry is always kept. A process of
            // version 2 refuses this database (`SchemaTooNew`); processes sharing a file must be
            // upgraded together.
            self.exec(
                "migrating the schema to version 3",
                "ALTER TABLE locks ADD COLUMN keys TEXT;
                 CREATE TABLE changes (seq INTEGER PRIMARY KEY, key_hash INTEGER NOT NULL);
                 PRAGMA user_version = 3;",
            )?;
        }
        if found < 4 {
            // The time line the rows' times are on (see the module's docs). Every earlier
            // version judged leases by the wall clock; `reconcile_time_line` moves the rows to
            // this manager's line right after.
            self.exec(
                "migrating the schema to version 4",
                "CREATE TABLE time_line (
                     id INTEGER PRIMARY KEY CHECK (id = 1),
                     line TEXT NOT NULL
                 );
                 INSERT INTO time_line (id, line) VALUES (1, 'wall');
                 PRAGMA user_version = 4;",
            )?;
        }
        if found < 5 {
            // Tombstones of operators' removals of waiting requests (`Storage::record_removal`),
            // by which an owner tells a removal, which ends its wait, from a lapse of its own
            // rows, after which it queues again. A row per removed request, until its owner has
            // heard of it or the sweep finds it past `kept_until`: a handful at most, scanned
            // by the sweep without an index. A process of version 4 refuses this database
            // (`SchemaTooNew`); processes sharing a file must be upgraded together.
            self.exec(
                "migrating the schema to version 5",
                "CREATE TABLE removed (
                     owner TEXT NOT NULL,
                     ticket INTEGER NOT NULL,
                     by_owner TEXT NOT NULL,
                     kept_until INTEGER NOT NULL,
                     PRIMARY KEY (owner, ticket)
                 ) WITHOUT ROWID;
                 PRAGMA user_version = 5;",
            )?;
        }
        self.reconcile_time_line()
    }

    /// The time line the store records; `None` before version 4, or for one not understood.
    fn stored_time_line(&self) -> Result<Option<TimeLine>> {
        if self.user_version()? < 4 {
            return Ok(None);
        }
        let doing = "reading the store's time line";
        let mut statement = self.prepare(doing, "SELECT line FROM time_line WHERE id = 1")?;
        if !step(doing, &mut statement)? {
            return Ok(None);
        }
        Ok(TimeLine::parse(&read::<String>(doing, &statement, 0)?))
    }

    /// Puts the store on this manager's time line, in the migration's transaction:
    ///
    /// - on the same line, nothing changes;
    /// - from the wall clock (a store of an earlier version, or of managers whose clocks give
    ///   no boot time) to this boot's, every row's times (and every tombstone's) move by the
    ///   difference of the two clocks now, so that each lease keeps what it had left;
    /// - from another boot's, every row is deleted, and every tombstone of a removal: a
    ///   write-ahead log is shared only by the processes of one machine, so that boot ended, and
    ///   its owners with it (the ticket sequence stays, so fencing tokens still only grow); but
    ///   a manager whose clock reads another boot than the one this machine is on (a test's
    ///   clock) is refused a store on the machine's, whose rows may be live;
    /// - from a boot's to the wall clock, never: managers of that boot may be at work on it,
    ///   and this manager cannot read their clock.
    ///
    /// A manager on the wall clock also checks, at every write transaction, that the store is
    /// still on it (`begin`): a manager of the boot's may have moved it since it opened.
    fn reconcile_time_line(&self) -> Result<()> {
        let found = self.stored_time_line()?;
        if found == Some(self.line) {
            return Ok(());
        }
        let doing = "moving the store to this manager's time line";
        match (found, self.line) {
            (Some(TimeLine::Wall) | None, TimeLine::Boot(_)) => {
                let now = self.now();
                let shift = now - micros(self.clock.now());
                let mut statement = self.prepare(
                    doing,
                    "UPDATE locks SET requested_at = requested_at + ?1,
                                      acquired_at = acquired_at + ?1,
                                      expires_at = expires_at + ?1,
                                      heartbeat_at = heartbeat_at + ?1
                     WHERE key <> ''",
                )?;
                bind(doing, &mut statement, 1, shift)?;
                step(doing, &mut statement)?;
                drop(statement);
                let mut statement =
                    self.prepare(doing, "UPDATE removed SET kept_until = kept_until + ?1")?;
                bind(doing, &mut statement, 1, shift)?;
                step(doing, &mut statement)?;
            }
            (Some(TimeLine::Boot(theirs)), TimeLine::Boot(_)) => {
                // Unless it is the boot this machine is on, which a manager of this process
                // whose clock reads another (a test's) cannot judge, and must not delete.
                if SystemClock
                    .boot_time()
                    .is_some_and(|now| now.boot == theirs)
                {
                    let why = "its leases are judged by this machine's boot clock, and this \
                               manager's clock reads another boot's (a test clock?): it cannot \
                               tell which of its rows are live";
                    return Err(StorageError::new(doing, why).into());
                }
                self.exec(
                    doing,
                    "DELETE FROM locks WHERE key <> ''; DELETE FROM removed;",
                )?;
            }
            (_, TimeLine::Wall) => {
                // Managers of the boot's may be at work on it, with or without rows now.
                return Err(StorageError::new(doing, WALL_ON_BOOT).into());
            }
        }
        let mut statement = self.prepare(doing, "UPDATE time_line SET line = ? WHERE id = 1")?;
        bind(doing, &mut statement, 1, self.line.stored().as_str())?;
        step(doing, &mut statement)?;
        Ok(())
    }

    /// `BEGIN IMMEDIATE`, retried while another connection holds the write lock.
    fn begin_immediate(&self, doing: &str) -> Result<()> {
        self.run_retrying_busy(doing, "BEGIN IMMEDIATE")
    }

    /// Runs a cached statement that returns no rows, retrying while the database is busy.
    fn run_retrying_busy(&self, doing: &str, sql: &'static str) -> Result<()> {
        let mut statement = self.prepare(doing, sql)?;
        retry_busy(doing, &self.busy, || {
            // A reset after a refused step answers that step's error again (it resets all the
            // same): were it taken as this try's answer, every other try would be wasted.
            let _ = statement.reset();
            statement.next().map(drop)
        })
    }
}

impl Storage for Db<'_> {
    /// The store's time line by the manager's clock (see the module's docs).
    fn now(&self) -> i64 {
        if self.stale {
            return STALE_NOW;
        }
        match self.line.now(&*self.clock) {
            Some(now) => {
                self.last_now.set(now);
                now
            }
            // A clock that stopped giving the time line it gave (a `Clock` of the user's):
            // time stands still, so that nothing lapses on the strength of it.
            None => self.last_now.get(),
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            keys_locked: false,
            refuses_by_reads: true,
            hears_every_commit: true,
        }
    }

    /// Busy databases are waited for inside each statement (`run_retrying_busy`): a failure
    /// that reaches the worker is no passing one.
    fn again(&mut self) -> bool {
        false
    }

    /// The doorbell rings whom a commit concerns (`wake_others`); nothing is noted in the file.
    fn watching(&mut self, _owner: &str, _keys: &[String], _now: i64, _lease: i64) -> Result<()> {
        Ok(())
    }

    fn at_once(&mut self) -> Option<&mut dyn DecidesAtOnce> {
        None
    }

    /// One writer at a time: `keys` need not be named to the database.
    fn begin(&mut self, _keys: &[String]) -> Result<i64> {
        if let Some(file) = &self.file {
            file.check()?;
        }
        self.begin_immediate("starting a write transaction")?;
        self.in_write = true;
        let version = self.data_version()?;
        if self.line == TimeLine::Wall && self.known.version != Some(version) {
            // Another connection committed: it may have moved the store to its boot clock.
            match self.stored_time_line() {
                Ok(Some(TimeLine::Wall) | None) => {}
                Ok(Some(TimeLine::Boot(_))) => {
                    self.rollback();
                    let doing = "starting a write transaction";
                    return Err(StorageError::new(doing, WALL_ON_BOOT).into());
                }
                Err(error) => {
                    self.rollback();
                    return Err(error);
                }
            }
        }
        self.known.starting(version);
        Ok(self.now())
    }

    /// Writes back the last ticket taken, then commits.
    fn commit(&mut self) -> Result<()> {
        if std::mem::take(&mut self.known.tickets_taken) {
            let doing = "taking a ticket";
            let mut statement = self.prepare(
                doing,
                "UPDATE locks SET last_ticket = ? WHERE key = '' AND ticket = 0",
            )?;
            bind(doing, &mut statement, 1, self.known.last_ticket)?;
            step(doing, &mut statement)?;
        }
        self.run_retrying_busy("committing", "COMMIT")?;
        self.in_write = false;
        Ok(())
    }

    fn wake_others(&mut self, freed: Option<&BTreeSet<String>>) {
        if let Some(owners) = freed {
            self.siblings.wake(owners);
        }
        let owners = std::mem::take(&mut self.ring_owners);
        if std::mem::take(&mut self.ring) {
            #[cfg(unix)]
            if let Some(doorbell) = &mut self.doorbell {
                doorbell.ring(&owners);
            }
        }
    }

    fn rollback(&mut self) {
        self.ring = false;
        self.ring_owners.clear();
        self.known.forget();
        self.in_write = false;
        let _ = self.conn.execute("ROLLBACK");
    }

    fn ring(&mut self, _keys: &[String]) {
        self.siblings.wake(&BTreeSet::new());
        #[cfg(unix)]
        if let Some(doorbell) = &mut self.doorbell {
            doorbell.ring(&BTreeSet::new());
        }
    }

    fn waiting(&mut self, waiting: bool) {
        self.siblings.waiting(waiting);
        #[cfg(unix)]
        if let Some(doorbell) = &mut self.doorbell {
            doorbell.set_waiting(waiting);
        }
        #[cfg(not(unix))]
        let _ = waiting;
    }

    /// `PRAGMA data_version` (a read that writes nothing) tells whether another connection
    /// committed; only then is the change log read, from where the last call left it.
    fn changes(&mut self) -> Result<Changes> {
        if let Some(file) = &self.file {
            file.check()?;
        }
        if let Some(doorbell) = &mut self.doorbell {
            doorbell.refresh();
        }
        let version = self.data_version()?;
        if self.seen_version == Some(version) {
            return Ok(Changes::Nothing);
        }
        self.seen_version = Some(version);
        let seen = self.seen_seq;
        let entries = self.log_after(seen.unwrap_or(-1))?;
        if let Some(&(last, _)) = entries.last() {
            self.seen_seq = Some(last);
        } else if seen.is_none() {
            self.seen_seq = Some(0);
        }
        Ok(match (seen, entries.first()) {
            // The first look, or entries trimmed before this connection read them.
            (None, _) => Changes::Unknown,
            (Some(seen), Some(&(first, _))) if first > seen + 1 => Changes::Unknown,
            _ => Changes::Keys(entries.into_iter().map(|(_, hash)| hash).collect()),
        })
    }

    /// Other connections learn of a commit from `data_version`; of promotions, which tell a
    /// waiting owner that its request was granted by another, from the log. Freed rows need no
    /// entry: a waiter whose key was freed but who was not promoted is still blocked (the
    /// promoting pass judged it), unless it has no queue position, and those look again on any
    /// commit.
    /// Promotions go into the change log, whose readers look at the keys it names; after the
    /// commit, the doorbell rings the promoted requests' owners and every manager with callers
    /// waiting without a row (`wake_others`).
    fn announce(
        &mut self,
        _freed: &[String],
        promoted: &[String],
        owners: &BTreeSet<String>,
    ) -> Result<()> {
        self.ring = true;
        self.ring_owners.extend(owners.iter().cloned());
        let doing = "writing the change log";
        let mut statement = self.prepare(doing, "INSERT INTO changes (key_hash) VALUES (?)")?;
        for key in promoted {
            statement.reset().map_err(|e| storage_error(doing, &e))?;
            bind(doing, &mut statement, 1, key_hash(key))?;
            step(doing, &mut statement)?;
        }
        Ok(())
    }

    /// The next ticket, from the sequence's last value as known (read once per transaction at
    /// most, and not at all while no other connection commits); `commit` writes the last one
    /// taken back, one statement however many were taken. Only in a write transaction.
    fn next_ticket(&mut self) -> Result<u64> {
        debug_assert!(self.in_write, "a ticket taken outside a write transaction");
        let last = match self.known.last_ticket {
            Some(last) => last,
            None => {
                let doing = "taking a ticket";
                let mut statement = self.prepare(
                    doing,
                    "SELECT last_ticket FROM locks WHERE key = '' AND ticket = 0",
                )?;
                if !step(doing, &mut statement)? {
                    let missing = "the ticket sequence row is missing";
                    return Err(StorageError::new(doing, missing).into());
                }
                read(doing, &statement, 0)?
            }
        };
        let ticket = last
            .checked_add(1)
            .ok_or_else(|| StorageError::new("taking a ticket", "the sequence is exhausted"))?;
        self.known.last_ticket = Some(ticket);
        self.known.tickets_taken = true;
        Ok(ticket_of(ticket))
    }

    /// The live rows on `keys`, by key in ticket order: in a write transaction, as known
    /// (`Known`), each key read once while no other connection commits.
    fn rows_on_keys(&mut self, keys: &[String], now: i64, into: &mut Vec<RowView>) -> Result<()> {
        let mut read = Vec::new();
        for key in keys {
            if !self.in_write {
                self.read_rows(key, now, &mut read)?;
                into.extend(read.drain(..).map(|row| row.view));
                continue;
            }
            if !self.known.keys.contains_key(key) {
                // Lapsed rows too: a later read, at a later time, filters them itself.
                self.read_rows(key, i64::MIN, &mut read)?;
                self.known
                    .keys
                    .insert(key.clone(), std::mem::take(&mut read));
            }
            let rows = self.known.keys.get(key).into_iter().flatten();
            into.extend(
                rows.filter(|row| row.view.expires_at > now)
                    .map(|row| row.view.clone()),
            );
        }
        Ok(())
    }

    /// Inserts one row per request, all under `ticket`.
    fn insert_request(
        &mut self,
        owner: &str,
        ticket: u64,
        requests: &[LockRequest],
        held: bool,
        now: i64,
        expires_at: i64,
    ) -> Result<()> {
        let doing = "writing a lock row";
        let mut statement = self.prepare(
            doing,
            "INSERT INTO locks (key, mode, operation, owner, ticket, held, requested_at,
                                acquired_at, expires_at, heartbeat_at, keys)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )?;
        let ticket = sql_ticket(ticket);
        let keys = stored_keys(requests, held);
        for request in requests {
            statement.reset().map_err(|e| storage_error(doing, &e))?;
            bind(doing, &mut statement, 1, request.key.as_str())?;
            bind(doing, &mut statement, 2, mode_code(request.mode))?;
            bind(doing, &mut statement, 3, request.operation.as_str())?;
            bind(doing, &mut statement, 4, owner)?;
            bind(doing, &mut statement, 5, ticket)?;
            bind(doing, &mut statement, 6, i64::from(held))?;
            bind(doing, &mut statement, 7, now)?;
            bind(doing, &mut statement, 8, held.then_some(now))?;
            bind(doing, &mut statement, 9, expires_at)?;
            bind(doing, &mut statement, 10, now)?;
            bind(doing, &mut statement, 11, keys.as_deref())?;
            step(doing, &mut statement)?;
        }
        drop(statement);
        let every_key = || match keys {
            Some(_) => requests.iter().map(|r| r.key.clone()).collect(),
            None => Vec::new(),
        };
        for request in requests {
            if let Some(rows) = self.known.keys.get_mut(&request.key) {
                let at = rows.partition_point(|row| row.view.ticket < ticket_of(ticket));
                let view = RowView {
                    key: request.key.as_str().into(),
                    mode: request.mode,
                    ticket: ticket_of(ticket),
                    held,
                    owner: owner.into(),
                    expires_at,
                    keys: every_key(),
                };
                rows.insert(
                    at,
                    KnownRow {
                        view,
                        heartbeat_at: now,
                    },
                );
            }
        }
        Ok(())
    }

    /// Turns the waiting row of `ticket` on `key` into a held row, keeping the ticket, with a
    /// whole lease from `now`: a grant from the queue starts as one made at once does, not with
    /// what is left of the waiter's last renewal. The lease is the row's own (its owner's
    /// setting, which may differ from the promoter's): the length its last renewal gave it. A
    /// promoter whose clock is behind the row's last renewal never shortens it.
    fn promote(&mut self, keys: &[String], ticket: u64, now: i64) -> Result<()> {
        let doing = "promoting a waiting request";
        let mut statement = self.prepare(
            doing,
            "UPDATE locks SET held = 1, acquired_at = ?1,
                              expires_at = MAX(expires_at, ?1 + (expires_at - heartbeat_at)),
                              heartbeat_at = MAX(heartbeat_at, ?1), keys = NULL
             WHERE key = ?2 AND ticket = ?3 AND held = 0",
        )?;
        for key in keys {
            statement.reset().map_err(|e| storage_error(doing, &e))?;
            bind(doing, &mut statement, 1, now)?;
            bind(doing, &mut statement, 2, key.as_str())?;
            bind(doing, &mut statement, 3, sql_ticket(ticket))?;
            step(doing, &mut statement)?;
        }
        drop(statement);
        for key in keys {
            let rows = self.known.keys.get_mut(key).into_iter().flatten();
            for row in rows.filter(|row| row.view.ticket == ticket && !row.view.held) {
                let lease = row.view.expires_at - row.heartbeat_at;
                row.view.held = true;
                row.view.expires_at = row.view.expires_at.max(now.saturating_add(lease));
                row.heartbeat_at = row.heartbeat_at.max(now);
                row.view.keys = Vec::new();
            }
        }
        Ok(())
    }

    /// Deletes this owner's rows of `ticket` on `keys` (held or waiting), counting those whose
    /// lease had not run out: per key, the live row first, in one statement (the usual case).
    fn delete_request(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        now: i64,
    ) -> Result<Deleted> {
        let doing = "deleting a request's rows";
        let delete = |sql: &'static str, key: &str| -> Result<bool> {
            let mut statement = self.prepare(doing, sql)?;
            bind(doing, &mut statement, 1, key)?;
            bind(doing, &mut statement, 2, sql_ticket(ticket))?;
            bind(doing, &mut statement, 3, owner)?;
            bind(doing, &mut statement, 4, now)?;
            step(doing, &mut statement)?;
            Ok(self.conn.change_count() > 0)
        };
        let mut deleted = Deleted::default();
        for key in keys {
            if delete(
                "DELETE FROM locks WHERE key = ?1 AND ticket = ?2 AND owner = ?3 AND expires_at > ?4",
                key,
            )? {
                deleted.rows += 1;
                deleted.live += 1;
            } else if delete(
                "DELETE FROM locks WHERE key = ?1 AND ticket = ?2 AND owner = ?3 AND expires_at <= ?4",
                key,
            )? {
                deleted.rows += 1;
            }
        }
        for key in keys {
            if let Some(rows) = self.known.keys.get_mut(key) {
                rows.retain(|row| row.view.ticket != ticket || &*row.view.owner != owner);
            }
        }
        Ok(deleted)
    }

    /// Deletes every row of this owner; returns how many there were.
    fn relabel(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        operation: &str,
        now: i64,
    ) -> Result<usize> {
        let doing = "setting a leader's value";
        let mut statement = self.prepare(
            doing,
            "UPDATE locks SET operation = ?1
             WHERE key = ?2 AND ticket = ?3 AND owner = ?4 AND held = 1 AND expires_at > ?5",
        )?;
        let mut changed = 0;
        for key in keys {
            statement.reset().map_err(|e| storage_error(doing, &e))?;
            bind(doing, &mut statement, 1, operation)?;
            bind(doing, &mut statement, 2, key.as_str())?;
            bind(doing, &mut statement, 3, sql_ticket(ticket))?;
            bind(doing, &mut statement, 4, owner)?;
            bind(doing, &mut statement, 5, now)?;
            step(doing, &mut statement)?;
            changed += self.conn.change_count();
        }
        Ok(changed)
    }

    fn delete_owner(&mut self, owner: &str) -> Result<usize> {
        let doing = "deleting an owner's rows";
        let mut statement = self.prepare(doing, "DELETE FROM locks WHERE owner = ?")?;
        bind(doing, &mut statement, 1, owner)?;
        step(doing, &mut statement)?;
        let deleted = self.conn.change_count();
        drop(statement);
        for rows in self.known.keys.values_mut() {
            rows.retain(|row| &*row.view.owner != owner);
        }
        Ok(deleted)
    }

    /// Deletes the lapsed rows on `keys`; returns how many.
    fn delete_expired(&mut self, keys: &[String], now: i64) -> Result<usize> {
        let doing = "deleting expired rows";
        let mut statement =
            self.prepare(doing, "DELETE FROM locks WHERE key = ? AND expires_at <= ?")?;
        let mut deleted = 0;
        for key in keys {
            statement.reset().map_err(|e| storage_error(doing, &e))?;
            bind(doing, &mut statement, 1, key.as_str())?;
            bind(doing, &mut statement, 2, now)?;
            step(doing, &mut statement)?;
            deleted += self.conn.change_count();
        }
        drop(statement);
        for key in keys {
            if let Some(rows) = self.known.keys.get_mut(key) {
                rows.retain(|row| row.view.expires_at > now);
            }
        }
        Ok(deleted)
    }

    /// Deletes every lapsed row (a scan of the table, as the heartbeat's renewal is) and the
    /// tombstones past their time, and trims the change log to its last [`LOG_KEPT`] entries.
    fn sweep(&mut self, now: i64) -> Result<()> {
        let doing = "deleting expired rows";
        let mut statement = self.prepare(doing, "DELETE FROM locks WHERE expires_at <= ?")?;
        bind(doing, &mut statement, 1, now)?;
        step(doing, &mut statement)?;
        drop(statement);
        for rows in self.known.keys.values_mut() {
            rows.retain(|row| row.view.expires_at > now);
        }
        let doing = "trimming the change log";
        let mut statement = self.prepare(
            doing,
            "DELETE FROM changes WHERE seq <= (SELECT MAX(seq) FROM changes) - ?",
        )?;
        bind(doing, &mut statement, 1, LOG_KEPT)?;
        step(doing, &mut statement)?;
        drop(statement);
        let doing = "sweeping the tombstones of removals";
        let mut statement = self.prepare(doing, "DELETE FROM removed WHERE kept_until <= ?")?;
        bind(doing, &mut statement, 1, now)?;
        step(doing, &mut statement)?;
        Ok(())
    }

    /// Kept until the latest of the request's waiting rows' leases would have run out, and
    /// as long again (the lease is the row's own: the length its last renewal gave it).
    fn record_removal(&mut self, owner: &str, ticket: u64, by: &str, now: i64) -> Result<()> {
        let doing = "recording a removal";
        let mut statement = self.prepare(
            doing,
            "INSERT OR REPLACE INTO removed (owner, ticket, by_owner, kept_until)
             SELECT owner, ticket, ?3,
                    MAX(MAX(expires_at, ?4) + MAX(expires_at - heartbeat_at, ?5))
             FROM locks WHERE owner = ?1 AND ticket = ?2 AND held = 0
             GROUP BY owner, ticket",
        )?;
        bind(doing, &mut statement, 1, owner)?;
        bind(doing, &mut statement, 2, sql_ticket(ticket))?;
        bind(doing, &mut statement, 3, by)?;
        bind(doing, &mut statement, 4, now)?;
        bind(doing, &mut statement, 5, TOMBSTONE_KEPT)?;
        step(doing, &mut statement)?;
        Ok(())
    }

    fn removals(&mut self, owner: &str, tickets: &[u64]) -> Result<Vec<(u64, String)>> {
        let doing = "reading whether an operator removed waiting requests";
        let mut statement = self.prepare(
            doing,
            "SELECT by_owner FROM removed WHERE owner = ? AND ticket = ?",
        )?;
        let mut found = Vec::new();
        for &ticket in tickets {
            statement.reset().map_err(|e| storage_error(doing, &e))?;
            bind(doing, &mut statement, 1, owner)?;
            bind(doing, &mut statement, 2, sql_ticket(ticket))?;
            if step(doing, &mut statement)? {
                found.push((ticket, read::<String>(doing, &statement, 0)?));
            }
        }
        Ok(found)
    }

    /// One statement per tombstone, each committed alone (there are one or two).
    fn forget_removals(&mut self, owner: &str, tickets: &[u64]) -> Result<()> {
        let doing = "forgetting removals heard of";
        let mut statement =
            self.prepare(doing, "DELETE FROM removed WHERE owner = ? AND ticket = ?")?;
        for &ticket in tickets {
            statement.reset().map_err(|e| storage_error(doing, &e))?;
            bind(doing, &mut statement, 1, owner)?;
            bind(doing, &mut statement, 2, sql_ticket(ticket))?;
            step(doing, &mut statement)?;
        }
        Ok(())
    }

    /// Renews every live row of `owner` in one statement; never touches an expired row.
    fn renew(&mut self, owner: &str, now: i64, expires_at: i64) -> Result<Vec<OwnedRequest>> {
        let doing = "renewing leases";
        let mut statement = self.prepare(
            doing,
            "UPDATE locks SET expires_at = ?, heartbeat_at = ? WHERE owner = ? AND expires_at > ?
             RETURNING ticket, held",
        )?;
        bind(doing, &mut statement, 1, expires_at)?;
        bind(doing, &mut statement, 2, now)?;
        bind(doing, &mut statement, 3, owner)?;
        bind(doing, &mut statement, 4, now)?;
        let mut rows = Vec::new();
        while step(doing, &mut statement)? {
            let ticket = ticket_of(read(doing, &statement, 0)?);
            rows.push((ticket, read::<i64>(doing, &statement, 1)? != 0));
        }
        drop(statement);
        let renewed = OwnedRequest::group(rows, expires_at);
        for rows in self.known.keys.values_mut() {
            for row in rows.iter_mut() {
                if &*row.view.owner == owner && row.view.expires_at > now {
                    row.view.expires_at = expires_at;
                    row.heartbeat_at = now;
                }
            }
        }
        Ok(renewed)
    }

    fn requests_of(&mut self, owner: &str) -> Result<Vec<(u64, Vec<String>)>> {
        let doing = "reading this owner's requests";
        let mut statement = self.prepare(
            doing,
            "SELECT ticket, key FROM locks WHERE owner = ? ORDER BY ticket, key",
        )?;
        bind(doing, &mut statement, 1, owner)?;
        let mut rows = Vec::new();
        while step(doing, &mut statement)? {
            rows.push((
                ticket_of(read(doing, &statement, 0)?),
                read::<String>(doing, &statement, 1)?,
            ));
        }
        Ok(by_ticket(rows))
    }

    /// This owner's live requests: ticket, whether held, and how many rows.
    /// Live rows, of one key or all, ordered by key and ticket.
    fn live_rows(&mut self, key: Option<&str>, now: i64) -> Result<Vec<Row>> {
        let doing = "inspecting locks";
        let sql = match key {
            Some(_) => {
                "SELECT key, mode, operation, owner, ticket, held, requested_at, acquired_at,
                        expires_at
                 FROM locks WHERE expires_at > ?1 AND key = ?2 AND key <> '' ORDER BY key, ticket"
            }
            None => {
                "SELECT key, mode, operation, owner, ticket, held, requested_at, acquired_at,
                        expires_at
                 FROM locks WHERE expires_at > ?1 AND key <> '' ORDER BY key, ticket"
            }
        };
        let mut statement = self.prepare(doing, sql)?;
        bind(doing, &mut statement, 1, now)?;
        if let Some(key) = key {
            bind(doing, &mut statement, 2, key)?;
        }
        let wall = |at: i64| self.line.wall_time(&*self.clock, at, now);
        let mut rows = Vec::new();
        while step(doing, &mut statement)? {
            let held = read::<i64>(doing, &statement, 5)? != 0;
            let requested_at: i64 = read(doing, &statement, 6)?;
            let acquired_at: Option<i64> = read(doing, &statement, 7)?;
            rows.push(Row {
                key: read(doing, &statement, 0)?,
                mode: mode_of(read(doing, &statement, 1)?),
                operation: read(doing, &statement, 2)?,
                owner: read(doing, &statement, 3)?,
                ticket: ticket_of(read(doing, &statement, 4)?),
                held,
                since: wall(if held {
                    acquired_at.unwrap_or(requested_at)
                } else {
                    requested_at
                }),
                expires_at: wall(read(doing, &statement, 8)?),
            });
        }
        Ok(rows)
    }

    /// Whether `key` has a live held row.
    fn is_held(&mut self, key: &str, now: i64) -> Result<bool> {
        let doing = "checking whether a key is locked";
        let mut statement = self.prepare(
            doing,
            "SELECT EXISTS (SELECT 1 FROM locks WHERE key = ? AND key <> '' AND held = 1 AND expires_at > ?)",
        )?;
        bind(doing, &mut statement, 1, key)?;
        bind(doing, &mut statement, 2, now)?;
        step(doing, &mut statement)?;
        Ok(read::<i64>(doing, &statement, 0)? != 0)
    }
}

/// Runs `attempt`, and while it is refused as busy, again on the `busy` schedule until that is
/// done: a busy database is a reason to wait, not an error. (SQLite's own busy handler waits
/// inside each attempt, but some clashes it reports at once.)
///
/// This runs on the storage thread, never on a caller's executor, so it may block it: the
/// schedule's sleeps (on its own clock) are awaited with `block_on`.
fn retry_busy(
    doing: &str,
    busy: &Schedule,
    mut attempt: impl FnMut() -> sqlite::Result<()>,
) -> Result<()> {
    // The first try outside the schedule: nearly every try succeeds, and starting a schedule
    // costs allocations.
    let mut refused = match attempt() {
        Ok(()) => return Ok(()),
        Err(error) if !is_busy(&error) => return Err(storage_error(doing, &error)),
        Err(error) => Some(error),
    };
    tracing::debug!(doing, "database busy; retrying");
    // That refusal is the schedule's first attempt: its first delay comes before the next try.
    let retried = busy.retry_while(
        || std::future::ready(refused.take().map_or_else(&mut attempt, Err)),
        is_busy,
    );
    futures::executor::block_on(retried).map_err(|error| storage_error(doing, &error))
}

fn step(doing: &str, statement: &mut Statement<'_>) -> Result<bool> {
    match statement.next() {
        Ok(State::Row) => Ok(true),
        Ok(State::Done) => Ok(false),
        Err(error) => Err(storage_error(doing, &error)),
    }
}

fn bind<V: sqlite::BindableWithIndex>(
    doing: &str,
    statement: &mut Statement<'_>,
    index: usize,
    value: V,
) -> Result<()> {
    statement
        .bind((index, value))
        .map_err(|e| storage_error(doing, &e))
}

fn read<T: sqlite::ReadableWithIndex>(
    doing: &str,
    statement: &Statement<'_>,
    column: usize,
) -> Result<T> {
    statement
        .read::<T, _>(column)
        .map_err(|e| storage_error(doing, &e))
}

#[cfg(test)]
mod tests;
