//! PostgreSQL storage, for owners on several machines that share one database.
//!
//! The same rows as SQLite's (`sqlite.rs`), in tables of a schema of their own, with three
//! differences that come from the machines being several:
//!
//! 1. **Time is the server's.** Every transaction reads `clock_timestamp()` once it holds its
//!    lock, and every expiry is written and compared in that time; clients' clocks, which drift
//!    between machines, never judge a lease. Between transactions the worker estimates the
//!    server's time from its own monotonic clock and the offset seen last, measured from when the
//!    statement that read the server's time was *sent*: the estimate is never behind the server,
//!    so a lease as this process knows it never ends after the server's (it may end early by a
//!    round trip).
//! 2. **Decisions on a key are serialised by an advisory lock on that key**, taken by every
//!    write transaction for the keys it decides on (`pg_advisory_xact_lock`, in a class of this
//!    library's own, keyed by a digest of the schema and the key), all in one statement in one
//!    order, so transactions on different keys run at once, never deadlock on each other and
//!    never need SERIALIZABLE retries. Tickets come from a sequence, taken under the locks, so on
//!    each key they follow grant order. A transaction deletes the lapsed rows of its keys before
//!    it reads them, so a renewal (which takes no advisory lock, and is judged by its own
//!    earlier time) cannot revive a row that a decision passed over; renewals and promotions
//!    change rows in key order, so they do not deadlock either.
//! 3. **Wake-ups**: a transaction that deletes or promotes rows sends a `NOTIFY` naming their
//!    keys (by digest); a release by the functions of `FUNCTIONS` only while another owner may
//!    be waiting there (see `WATCHERS`). Each manager has a listener thread with a connection of its own that
//!    `LISTEN`s, keeps the digests it hears, and pokes the worker, which looks only at the keys
//!    it waits on among them. After every `LISTEN` (notifications are not kept across a
//!    disconnect), and for as long as the listener is not connected (a pooler in transaction
//!    mode cannot `LISTEN`), the worker looks at every key it waits on at each look of the poll
//!    instead.
//!
//! The two commonest writes, an acquisition and a release, are one round trip each: functions
//! in the schema (`FUNCTIONS`) that lock, read the time, and decide on the server.
//!
//! A connection that fails is opened again on the next call once the manager's busy schedule
//! (`LockManagerBuilder::busy_schedule`) allows; calls in between fail as passing failures, whose
//! work the worker does again on that schedule, which starts over after every piece of work
//! done (`Postgres::succeeded`). Rows live on the server, so guards survive a disconnect shorter
//! than their lease. The listener's connection backs off on its own run of the same schedule.

mod tls;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postgres::fallible_iterator::FallibleIterator;
use postgres::types::ToSql;
use postgres::{Client, Config, NoTls, SimpleQueryMessage, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::clock::{Clock, SystemClock};
use crate::lock::backend::codec::{
    by_ticket, decode_keys, encode_keys, fnv1a, key_hash, mode_code, mode_of, sql_ticket,
    stored_keys, ticket_of,
};
use crate::lock::backend::{
    AtOnce, Changes, Decision, Deleted, Outcome, OwnedRequest, Removal, Result, Row, Storage,
};
use crate::lock::backend::{Capabilities, DecidesAtOnce, Opening, Poke, Serve, Wait};
use crate::lock::grant::RowView;
use crate::lock::{LockError, LockRequest, Mode};
use crate::schedule::{Schedule, ScheduleRun};
use crate::sync::lock;

/// The schema version this build writes and understands.
pub(crate) const SCHEMA_VERSION: i32 = 6;

/// The advisory lock class of this library (`pg_advisory_xact_lock(class, key)`), so that its
/// locks do not collide with an application's own advisory locks on other classes.
const LOCK_CLASS: i32 = 0x4c48_4c44; // "LHLD"

/// The class of the lock on a whole schema: taken shared, before its key locks, by a transaction
/// that decides on a few keys, and alone, exclusive, by one that decides on more than
/// [`MAX_KEY_LOCKS`] (a shutdown of an owner of thousands of locks, a `many` of hundreds of
/// keys), which then needs no key lock: the server's lock table holds only about 64 locks per
/// connection, and a statement at most 1,664 expressions.
const SCHEMA_CLASS: i32 = LOCK_CLASS + 1;

/// The most keys a transaction locks one by one.
const MAX_KEY_LOCKS: usize = 32;

/// The default schema.
pub(crate) const DEFAULT_SCHEMA: &str = "leasehold";

/// Whether `name` can be a schema of ours: lower-case letters, digits and `_`, not starting
/// with a digit, at most 63 bytes (PostgreSQL's limit). It is quoted in every statement too.
pub(crate) fn valid_schema(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// What is said of a connection string in errors and `Debug`: never its password.
pub(crate) fn describe(config: &Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|host| match host {
            postgres::config::Host::Tcp(name) => name.clone(),
            #[cfg(unix)]
            postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    format!(
        "postgres (user {:?}, host {:?}, database {:?})",
        config.get_user().unwrap_or(""),
        hosts.join(","),
        config.get_dbname().unwrap_or("")
    )
}

/// A parsed connection string: the client's settings and how to connect (with TLS or not).
pub(crate) struct Target {
    config: Config,
    tls: Option<MakeRustlsConnect>,
}

impl Target {
    /// The server and database, without the password.
    pub(crate) fn describe(&self) -> String {
        describe(&self.config)
    }

    /// Bounds every wait on the server by `heartbeat`, so that a stuck statement or lock fails
    /// (and is retried) well before a lease could run out, and the storage thread gets back to
    /// renewing: `statement_timeout`, `lock_timeout` and `idle_in_transaction_session_timeout`
    /// at half a heartbeat (the last so that a client paused inside a transaction, by a debugger
    /// or `SIGSTOP`, holds its locks on other owners' rows for no longer), added to any options
    /// the URL gave; a connection attempt bounded by a heartbeat (at least a second); and TCP
    /// keepalives, so that a server that vanished is noticed within about a heartbeat.
    fn bound_by(mut self, heartbeat: Duration) -> Target {
        let limit = (heartbeat / 2).as_millis().max(1);
        // And planner settings for statements that all find their rows by an index:
        // - Generic plans, made once per connection: a custom plan, which the server otherwise
        //   makes for each of a statement's first calls and keeps making while it estimates it
        //   cheaper, costs more to plan (about 0.4 ms) than the statement costs to run.
        // - Plain index scans, whatever the table's statistics say: a plan made while the table
        //   looked empty would scan it whole once it holds thousands of rows. And no bitmap
        //   scans: each acquisition inserts a row and each release deletes it, so a busy key's
        //   index entries are mostly dead ones until the next vacuum. An index scan marks those
        //   it meets as dead, and later scans skip them; a bitmap scan (which the planner picks
        //   for `key = ANY(..)`) never does, and walks them all every time.
        let ours = format!(
            "-c statement_timeout={limit} -c lock_timeout={limit} \
             -c idle_in_transaction_session_timeout={limit} -c plan_cache_mode=force_generic_plan -c enable_seqscan=off \
             -c enable_bitmapscan=off"
        );
        let options = match self.config.get_options() {
            Some(given) if !given.is_empty() => format!("{given} {ours}"),
            _ => ours,
        };
        self.config.options(&options);
        let idle = heartbeat.max(Duration::from_secs(1));
        self.config
            .connect_timeout(idle)
            .keepalives(true)
            .keepalives_idle(idle)
            .keepalives_interval((idle / 4).max(Duration::from_secs(1)))
            .keepalives_retries(3);
        self
    }
}

/// Parses a libpq connection string or URL, with its TLS settings (see `postgres_tls.rs`).
pub(crate) fn parse(url: &str) -> std::result::Result<Target, LockError> {
    if has_unescaped_at(url) {
        // As libpq would, the parser takes what follows the first `@` for the host, so part of
        // the password would show up in every message that names the host.
        return Err(LockError::InvalidConfig(
            "the PostgreSQL URL has more than one `@` before its host: write an `@` in the user \
             name or password as %40"
                .into(),
        ));
    }
    let (rest, settings) = crate::lock::backend::postgres::tls::split(url)?;
    let mut config = rest.parse::<Config>().map_err(|error| {
        // The parser's message never quotes the string it was given, so no password leaks.
        LockError::InvalidConfig(format!(
            "the PostgreSQL connection string is invalid: {error}"
        ))
    })?;
    let (mode, tls) = crate::lock::backend::postgres::tls::connector(&settings)?;
    config.ssl_mode(mode);
    Ok(Target { config, tls })
}

/// Whether `url` is a URL whose user information holds an `@` not written as `%40`: its part
/// before the host (up to the first `/`, `?` or `#`) has more than one `@`.
fn has_unescaped_at(url: &str) -> bool {
    let Some(rest) = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|scheme| url.strip_prefix(scheme))
    else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority.matches('@').count() > 1
}

fn storage_error(doing: &str, error: &postgres::Error) -> LockError {
    match error.as_db_error() {
        // The server's own message ("db error" alone says nothing).
        Some(db) => LockError::Storage(format!(
            "while {doing}: {} (PostgreSQL code {})",
            db.message(),
            db.code().code()
        )),
        None => LockError::Storage(format!("while {doing}: {error}")),
    }
}

/// Whether `error` is the server giving up on a statement for a reason that passes: a statement
/// or lock timeout (`57014`, `55P03`), a deadlock it broke (`40P01`), a serialisation failure
/// (`40001`), a transaction left aborted by an earlier failure (`25P02`, ended by the rollback
/// that follows every failure). The same work done again may succeed.
fn passing(error: &postgres::Error) -> bool {
    error.as_db_error().is_some_and(|db| {
        matches!(
            db.code().code(),
            "57014" | "55P03" | "40P01" | "40001" | "25P02"
        )
    })
}

/// Whether `error` ended the session: the connection broke, or the server ended it (shut down,
/// restarted, or terminated the backend: SQLSTATE class 57P).
fn session_ended(error: &postgres::Error) -> bool {
    error
        .as_db_error()
        .is_none_or(|db| db.code().code().starts_with("57P"))
}

/// A connection to the server, with the schema in place and the statements prepared.
pub(crate) struct Postgres {
    config: Config,
    tls: Option<MakeRustlsConnect>,
    schema: String,
    client: Option<Client>,
    statements: HashMap<&'static str, Statement>,
    /// When to connect again after a failed attempt.
    reconnect: Reconnect,
    /// Whether the last failure was a passing one (see `Storage::again`), and the busy
    /// schedule's run for doing failed work again.
    transient: bool,
    retry: ScheduleRun,
    /// The server's time less this process's monotonic time when the statement that read it
    /// was sent (micros): at least the true offset, by up to that statement's round trip.
    offset: i64,
    /// The keys (by digest) the open transaction freed or promoted rows on, to announce with
    /// its commit.
    announcing: Vec<i64>,
    /// Whether a write transaction is open on the connection: a connection lost inside one is
    /// an error of that transaction, never replaced by a new one under its later statements
    /// (which would then run outside it, without its locks).
    in_transaction: bool,
    started: Instant,
    /// What the listener heard.
    heard: Arc<Mutex<Heard>>,
}

/// What the listener thread heard since the worker last asked (`Storage::changes`).
#[derive(Debug, Default)]
struct Heard {
    /// Whether it is connected and listening: while not, nothing is heard, so every look
    /// looks at everything.
    listening: bool,
    /// Whether something may have been missed (it has just started listening, or heard an
    /// announcement too long to name its keys).
    missed: bool,
    /// Whether any announcement came, and the keys they named.
    any: bool,
    keys: Vec<i64>,
}

/// The longest `NOTIFY` payload sent: the server refuses 8,000 bytes and more. An announcement of
/// more keys says only that something changed (`*`).
const MAX_PAYLOAD: usize = 7_000;

/// The payload announcing `keys`: their digests, separated by commas.
fn payload(keys: &[i64]) -> String {
    let text = keys
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    if text.len() > MAX_PAYLOAD {
        "*".to_owned()
    } else {
        text
    }
}

/// The key digests a payload names; `None` when it does not name them.
fn parse_payload(payload: &str) -> Option<Vec<i64>> {
    payload
        .split(',')
        .filter(|part| !part.is_empty())
        .map(|part| part.parse().ok())
        .collect()
}

/// The advisory locks of `keys` in `schema` (sorted, without repeats) and of the schema: what
/// every write transaction takes (`lock_keys` in `FUNCTIONS`).
fn key_locks(schema: &str, keys: &[String]) -> (Vec<i32>, i32) {
    let mut locks: Vec<i32> = keys.iter().map(|key| key_lock(schema, key)).collect();
    locks.sort_unstable();
    locks.dedup();
    (locks, key_lock(schema, ""))
}

/// The advisory lock of `key` in `schema`: the second half of `pg_advisory_xact_lock(class, id)`.
fn key_lock(schema: &str, key: &str) -> i32 {
    let digest = fnv1a(format!("{schema}\0{key}").as_bytes());
    i32::from_ne_bytes(((digest ^ (digest >> 32)) as u32).to_ne_bytes())
}

/// The call of the function `decide` (see `FUNCTIONS`), for `DecideArgs::params`.
const DECIDE: &str =
    "SELECT * FROM {s}.decide($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)";

/// The arguments of the function `decide`: a batch of operations of one owner, with one entry
/// per operation and one per key of each.
struct DecideArgs<'a> {
    owner: &'a str,
    lease: i64,
    locks: Vec<i32>,
    schema_lock: i32,
    channel: String,
    ends: Vec<i32>,
    tickets: Vec<Option<i64>>,
    waits: Vec<Option<i16>>,
    all_keys: Vec<Option<String>>,
    payloads: Vec<Option<String>>,
    keys: Vec<String>,
    modes: Vec<i16>,
    operations: Vec<&'a str>,
}

impl<'a> DecideArgs<'a> {
    fn new(schema: &str, owner: &'a str, lease: i64, ops: &[AtOnce<'a>]) -> Self {
        let mut args = DecideArgs {
            owner,
            lease,
            locks: Vec::new(),
            schema_lock: 0,
            channel: channel(schema),
            ends: Vec::with_capacity(ops.len()),
            tickets: Vec::with_capacity(ops.len()),
            waits: Vec::with_capacity(ops.len()),
            all_keys: Vec::with_capacity(ops.len()),
            payloads: Vec::with_capacity(ops.len()),
            keys: Vec::new(),
            modes: Vec::new(),
            operations: Vec::new(),
        };
        for op in ops {
            args.push(op);
        }
        (args.locks, args.schema_lock) = key_locks(schema, &args.keys);
        args
    }

    fn push(&mut self, op: &AtOnce<'a>) {
        match *op {
            AtOnce::Acquire { requests, wait } => {
                for request in requests {
                    self.keys.push(request.key.clone());
                    self.modes.push(mode_code(request.mode));
                    self.operations.push(&request.operation);
                }
                self.tickets.push(None);
                self.waits.push(Some(match wait {
                    Wait::Queued => 0,
                    Wait::Unqueued => 1,
                    Wait::No => 2,
                }));
                self.all_keys.push(encode_keys(requests));
                self.payloads.push(None);
            }
            AtOnce::Remove { keys, ticket } => {
                let mut hashes: Vec<i64> = keys.iter().map(|key| key_hash(key)).collect();
                hashes.sort_unstable();
                hashes.dedup();
                for key in keys {
                    self.keys.push(key.clone());
                    self.modes.push(0);
                    self.operations.push("");
                }
                self.tickets.push(Some(sql_ticket(ticket)));
                self.waits.push(None);
                self.all_keys.push(None);
                self.payloads.push(Some(payload(&hashes)));
            }
        }
        self.ends
            .push(i32::try_from(self.keys.len()).unwrap_or(i32::MAX));
    }

    /// The parameters of `DECIDE`, in order.
    fn params(&self) -> [&(dyn ToSql + Sync); 13] {
        [
            &self.owner,
            &self.lease,
            &self.locks,
            &self.schema_lock,
            &self.channel,
            &self.ends,
            &self.tickets,
            &self.waits,
            &self.all_keys,
            &self.payloads,
            &self.keys,
            &self.modes,
            &self.operations,
        ]
    }
}

/// An acquisition's answer from `decide`, for a caller who waits as `wait` says.
fn decision(row: &postgres::Row, wait: Wait) -> Decision {
    let granted: bool = row.get(2);
    let others = if granted || wait == Wait::No {
        Vec::new()
    } else {
        let keys: Vec<Option<String>> = row.get::<_, Option<_>>(3).unwrap_or_default();
        let expiries: Vec<i64> = row.get::<_, Option<_>>(4).unwrap_or_default();
        (keys.into_iter().map(Option::unwrap_or_default))
            .zip(expiries)
            .collect()
    };
    Decision {
        now: row.get(0),
        ticket: row.get::<_, Option<i64>>(1).map(ticket_of),
        granted,
        others,
    }
}

/// Connects to `target` (its waits bounded by the heartbeat: `Target::bound_by`), brings the
/// schema up to date, starts the listener; says through `opened` whether it could, and hands
/// the storage to `worker`. Runs on the storage thread, which owns the client and its runtime.
pub(crate) fn serve(
    target: Target,
    schema: String,
    opening: Opening,
    opened: impl FnOnce(Result<()>),
    worker: impl Serve,
) {
    let target = target.bound_by(opening.heartbeat);
    match Postgres::connect(target, schema, opening.busy, opening.poke) {
        Ok(storage) => {
            opened(Ok(()));
            worker.serve(storage);
        }
        Err(error) => opened(Err(error)),
    }
}

impl Postgres {
    /// Connects, creates or migrates the schema, and reads the server's time.
    fn connect(
        target: Target,
        schema: String,
        busy: Schedule,
        poke: Arc<dyn Poke>,
    ) -> Result<Postgres> {
        let mut storage = Postgres {
            config: target.config,
            tls: target.tls,
            schema,
            client: None,
            statements: HashMap::new(),
            reconnect: Reconnect::new(busy.clone()),
            transient: false,
            retry: busy.start(SystemClock.monotonic()),
            offset: 0,
            announcing: Vec::new(),
            in_transaction: false,
            started: Instant::now(),
            heard: Arc::new(Mutex::new(Heard::default())),
        };
        storage.client()?;
        let listener = Listener {
            config: storage.config.clone(),
            tls: storage.tls.clone(),
            channel: channel(&storage.schema),
            poke,
            heard: storage.heard.clone(),
            reconnect: Reconnect::new(busy),
        };
        std::thread::Builder::new()
            .name("leasehold-listen".into())
            .spawn(move || listener.run())
            .map_err(|e| LockError::Storage(format!("while starting the listener thread: {e}")))?;
        Ok(storage)
    }

    fn monotonic(&self) -> i64 {
        micros_since(self.started)
    }

    /// The open connection, opened (and the schema brought up to date) if there is none.
    fn client(&mut self) -> Result<&mut Client> {
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
            self.statements.clear();
        }
        if self.client.is_none() && self.in_transaction {
            self.transient = true;
            return Err(LockError::Storage(
                "the connection was lost inside a write transaction".into(),
            ));
        }
        if self.client.is_none() {
            // A server that cannot be reached now is a passing failure: the work is done again
            // once the busy schedule allows (`Storage::again`).
            if let Some(left) = self.reconnect.wait_left() {
                self.transient = true;
                return Err(LockError::Storage(format!(
                    "while connecting to {}: the last attempt failed; the next in {left:?}",
                    describe(&self.config)
                )));
            }
            let connected = match &self.tls {
                Some(tls) => self.config.connect(tls.clone()),
                None => self.config.connect(NoTls),
            };
            self.transient = connected.is_err();
            let client = connected
                .map_err(|e| {
                    storage_error(&format!("connecting to {}", describe(&self.config)), &e)
                })
                .and_then(|mut client| migrate(&mut client, &self.schema).map(|()| client));
            match client {
                Ok(client) => {
                    self.reconnect.succeeded();
                    self.client = Some(client);
                }
                Err(error) => {
                    self.reconnect.failed();
                    return Err(error);
                }
            }
            let sent = self.monotonic();
            let now = self.server_now()?;
            self.offset = now - sent;
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    /// Runs `f` with the connection; a failure that closed it is noticed on the next call.
    fn with<T>(
        &mut self,
        doing: &str,
        f: impl FnOnce(&mut Client) -> std::result::Result<T, postgres::Error>,
    ) -> Result<T> {
        let result = f(self.client()?);
        result.map_err(|e| self.failed(doing, &e))
    }

    /// The error of a call that failed; a session found ended is dropped (the next call opens
    /// a new one). Remembers whether the failure was a passing one (`Storage::again`).
    fn failed(&mut self, doing: &str, error: &postgres::Error) -> LockError {
        let ended = session_ended(error);
        if ended {
            self.client = None;
            self.statements.clear();
        }
        self.transient = ended || passing(error);
        storage_error(doing, error)
    }

    /// The prepared statement named `name`, whose text `sql` names the schema `{s}`.
    fn statement(&mut self, name: &'static str, sql: &str) -> Result<Statement> {
        self.client()?;
        if let Some(statement) = self.statements.get(name) {
            return Ok(statement.clone());
        }
        let text = sql.replace("{s}", &quote(&self.schema));
        let client = self.client.as_mut().expect("connected above");
        let statement = match client.prepare(&text) {
            Ok(statement) => statement,
            Err(error) => return Err(self.failed(&format!("preparing {name}"), &error)),
        };
        self.statements.insert(name, statement.clone());
        Ok(statement)
    }

    fn query(
        &mut self,
        name: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<postgres::Row>> {
        let statement = self.statement(name, sql)?;
        self.with(name, |client| client.query(&statement, params))
    }

    fn execute(
        &mut self,
        name: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64> {
        let statement = self.statement(name, sql)?;
        self.with(name, |client| client.execute(&statement, params))
    }

    /// The server's time, read now.
    fn server_now(&mut self) -> Result<i64> {
        let rows = self.query(
            "server time",
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
            &[],
        )?;
        Ok(rows[0].get(0))
    }

    /// Work was done: the next failure waits the busy schedule's first delay, and the schedule
    /// bounds the retries of that work from then (it is a run of `up_to(60 s)` by default:
    /// started once, it would give up at the first failure a minute later).
    fn succeeded(&mut self) {
        self.retry.reset(SystemClock.monotonic());
    }

    fn key_locks(&self, keys: &[String]) -> (Vec<i32>, i32) {
        key_locks(&self.schema, keys)
    }

    /// A batch of acquisitions and removals in one call of the function `decide` (see
    /// `FUNCTIONS`), which takes the locks of all their keys once.
    fn decide_in_one(
        &mut self,
        owner: &str,
        ops: &[AtOnce<'_>],
        lease: i64,
    ) -> Result<Vec<Outcome>> {
        self.transient = false;
        let args = DecideArgs::new(&self.schema, owner, lease, ops);
        let statement = self.statement("deciding", DECIDE)?;
        let sent = self.monotonic();
        let rows = self.with("deciding", |client| {
            client.query(&statement, &args.params())
        })?;
        self.succeeded();
        if rows.len() != ops.len() {
            return Err(LockError::Storage(format!(
                "while deciding: {} answers to {} operations",
                rows.len(),
                ops.len()
            )));
        }
        if let Some(first) = rows.first() {
            // The first operation's time: the earliest read after the call was sent.
            self.offset = first.get::<_, i64>(0) - sent;
        }
        let mut outcomes = Vec::with_capacity(ops.len());
        for (op, row) in ops.iter().zip(&rows) {
            let now: i64 = row.get(0);
            outcomes.push(match op {
                AtOnce::Acquire { wait, .. } => Outcome::Acquired(decision(row, *wait)),
                AtOnce::Remove { .. } => {
                    let count = |at: usize| usize::try_from(row.get::<_, i64>(at)).unwrap_or(0);
                    Outcome::Removed(Removal {
                        now,
                        deleted: Deleted {
                            rows: count(5),
                            live: count(6),
                        },
                        freed: row.get(7),
                        promoted: row
                            .get::<_, Option<Vec<i64>>>(8)
                            .unwrap_or_default()
                            .into_iter()
                            .map(ticket_of)
                            .collect(),
                        owners: row
                            .get::<_, Option<Vec<String>>>(9)
                            .unwrap_or_default()
                            .into_iter()
                            .collect(),
                    })
                }
            });
        }
        Ok(outcomes)
    }

    fn simple(&mut self, doing: &str, sql: &str) -> Result<()> {
        self.with(doing, |client| client.batch_execute(sql))
    }
}

/// Micros since `start`: this process's monotonic time, as the server's time is estimated on.
fn micros_since(start: Instant) -> i64 {
    i64::try_from(start.elapsed().as_micros()).unwrap_or(i64::MAX)
}

/// The `NOTIFY` channel of a schema. A channel is an identifier, at most 63 bytes (a longer
/// one is an error for `pg_notify` and silently cut short by `LISTEN`), so a long schema name is
/// replaced by a digest of it.
fn channel(schema: &str) -> String {
    let channel = format!("leasehold_{schema}");
    if channel.len() <= 63 {
        return channel;
    }
    format!("leasehold_{:016x}", fnv1a(schema.as_bytes()))
}

/// When to try connecting again: after each failed attempt, the next waits for the next delay
/// of the busy schedule; a success starts the schedule over, and so does its end (the manager
/// never gives up on its server). On real time: a server is down in real time.
struct Reconnect {
    run: ScheduleRun,
    /// When the next attempt may be made (`SystemClock`'s monotonic time), after a failure.
    next: Option<Duration>,
}

impl Reconnect {
    fn new(busy: Schedule) -> Self {
        Reconnect {
            run: busy.start(SystemClock.monotonic()),
            next: None,
        }
    }

    /// How long until the next attempt may be made, if that is not now.
    fn wait_left(&self) -> Option<Duration> {
        let now = SystemClock.monotonic();
        self.next.filter(|&at| at > now).map(|at| at - now)
    }

    /// An attempt succeeded: the next failure waits the schedule's first delay.
    fn succeeded(&mut self) {
        self.run.reset(SystemClock.monotonic());
        self.next = None;
    }

    /// An attempt failed now.
    fn failed(&mut self) {
        let now = SystemClock.monotonic();
        self.next = self.run.next_at(now).or_else(|| {
            self.run.reset(now);
            self.run.next_at(now)
        });
    }

    /// Sleeps this thread until the next attempt may be made.
    fn pause(&self) {
        if let Some(left) = self.wait_left() {
            std::thread::sleep(left);
        }
    }
}

/// Listens for other managers' announcements on a connection of its own, and pokes the worker
/// when one comes. Stops once the worker is gone.
struct Listener {
    config: Config,
    tls: Option<MakeRustlsConnect>,
    channel: String,
    poke: Arc<dyn Poke>,
    heard: Arc<Mutex<Heard>>,
    reconnect: Reconnect,
}

impl Listener {
    /// How often a listener with nothing to hear checks whether its manager is still there.
    const CHECK_EVERY: Duration = Duration::from_millis(500);

    /// Whether the worker is still there; pokes it if so.
    fn poke(&self) -> bool {
        self.poke.poke()
    }

    fn run(mut self) {
        while self.poke.alive() {
            self.reconnect.pause();
            let listened = self.listen();
            lock(&self.heard).listening = false;
            match listened {
                Err(error) => {
                    tracing::debug!(%error, "listening for other managers' changes stopped; again");
                    self.reconnect.failed();
                }
                Ok(()) => return,
            }
        }
    }

    /// Listens until the connection fails (an error) or the worker is gone (`Ok`).
    fn listen(&mut self) -> std::result::Result<(), postgres::Error> {
        let mut client = match &self.tls {
            Some(tls) => self.config.connect(tls.clone())?,
            None => self.config.connect(NoTls)?,
        };
        client.batch_execute(&format!("LISTEN {}", quote(&self.channel)))?;
        self.reconnect.succeeded();
        // Whatever was announced before this LISTEN was not heard: look at everything now.
        {
            let mut heard = lock(&self.heard);
            heard.listening = true;
            heard.missed = true;
        }
        if !self.poke() {
            return Ok(());
        }
        let mut notifications = client.notifications();
        loop {
            let mut incoming = notifications.timeout_iter(Self::CHECK_EVERY);
            while let Some(notification) = incoming.next()? {
                {
                    let mut heard = lock(&self.heard);
                    heard.any = true;
                    match parse_payload(notification.payload()) {
                        Some(keys) => heard.keys.extend(keys),
                        None => heard.missed = true,
                    }
                }
                if !self.poke() {
                    return Ok(());
                }
            }
            if !self.poke.alive() {
                return Ok(());
            }
        }
    }
}

/// `name` as a quoted identifier (it is validated too; quoting makes sure).
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The server-side halves of the two commonest writes, so that a batch of them takes one round
/// trip and one transaction (`decide`, for `Storage::decide_at_once`). They take the same
/// advisory locks as `begin`, read the time once they hold them, and delete the lapsed rows of
/// their keys before they read them, as every decision does.
///
/// The grant rule is written here a second time, in SQL, for the two questions these functions
/// ask (see `grant.rs` for the rule): whether a new request is granted now (`grantable_now`),
/// and which waiting requests on one key a release lets through (`promotable`, for requests on
/// that key alone: a request on several keys is left to its owner, whom the announcement of the
/// release wakes, and whose own look promotes it). The tests below (`the_rule_in_sql`) check the
/// two writings against each other on generated rows, and the model test runs on both backends.
const FUNCTIONS: &str = r#"
CREATE OR REPLACE FUNCTION {s}.lock_keys(p_locks int4[], p_schema_lock int4)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    l int4;
BEGIN
    IF cardinality(p_locks) > {max_locks} THEN
        PERFORM pg_advisory_xact_lock({schema_class}, p_schema_lock);
    ELSE
        PERFORM pg_advisory_xact_lock_shared({schema_class}, p_schema_lock);
        FOREACH l IN ARRAY p_locks LOOP
            PERFORM pg_advisory_xact_lock({lock_class}, l);
        END LOOP;
    END IF;
    RETURN (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
END $$;

-- A batch of acquisitions and releases of one owner, decided in order in one transaction: the
-- locks of all their keys taken once, the time read afresh for each. The n-th operation's keys
-- (and modes, operations) are p_keys[p_ends[n-1] + 1 : p_ends[n]]; a release has a ticket, an
-- acquisition none, and a wait (0: queued, 1: unqueued, 2: not at all). One answer per
-- operation, in order: `now`, then
-- - for an acquisition: `ticket` (if rows were written), `granted`, and when it refused a
--   caller who waits, the other owners' live rows on its keys (`others_keys` and
--   `others_expiries`: when each key may be freed without anyone writing);
-- - for a release: the rows it `deleted`, how many of them were `live`, whether it `freed`
--   anything, the tickets it `promoted`, whoever owns them, and the other `owners` of those.
-- The other columns are left as they were: what they hold means nothing.
--
-- Written for speed: PL/pgSQL compiles each expression once per transaction, so an operation
-- alone in its call pays for every expression it meets (hence no resetting of the answer's
-- columns); each operation's part of the arrays is copied into variables once; and the
-- uncontended cases are one statement each: an acquisition on keys without rows, and a release
-- that leaves no other live row on its keys.
CREATE OR REPLACE FUNCTION {s}.decide(
    p_owner text, p_lease bigint, p_locks int4[], p_schema_lock int4, p_channel text,
    p_ends int4[], p_tickets int8[], p_waits int2[], p_all_keys text[], p_payloads text[],
    p_keys text[], p_modes int2[], p_operations text[])
RETURNS TABLE (
    now bigint, ticket bigint, granted boolean, others_keys text[], others_expiries int8[],
    deleted bigint, live bigint, freed boolean, promoted int8[], owners text[])
LANGUAGE plpgsql AS $$
DECLARE
    n int;
    lo int := 1;
    op_keys text[];
    op_modes int2[];
    op_ticket int8;
    op_wait int2;
    lapsed bigint;
    blocked boolean;
    others_left boolean;
    waited_for boolean;
BEGIN
    PERFORM {s}.lock_keys(p_locks, p_schema_lock);
    FOR n IN 1 .. coalesce(cardinality(p_ends), 0) LOOP
        op_keys := p_keys[lo:p_ends[n]];
        op_modes := p_modes[lo:p_ends[n]];
        op_ticket := p_tickets[n];
        op_wait := p_waits[n];
        now := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
        IF op_ticket IS NULL THEN
            -- An acquisition on keys without rows (the uncontended case): granted.
            INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held, requested_at,
                                   acquired_at, expires_at, heartbeat_at)
            SELECT r.key, r.mode, r.operation, p_owner, t.ticket, true, now, now,
                   now + p_lease, now
            FROM (SELECT nextval('{s}.tickets') AS ticket
                  WHERE NOT EXISTS (SELECT 1 FROM {s}.locks AS o WHERE o.key = ANY(op_keys)))
                 AS t,
                 unnest(op_keys, op_modes, p_operations[lo:p_ends[n]]) AS r(key, mode, operation);
            IF FOUND THEN
                ticket := currval('{s}.tickets');
                granted := true;
                RETURN NEXT;
                lo := p_ends[n] + 1;
                CONTINUE;
            END IF;
            -- Any other acquisition: the keys' lapsed rows deleted; granted unless a live row there
            -- conflicts; rows written under a new ticket if granted or queued. Refused, it
            -- answers when the other owners' live rows there run out, and a caller without a
            -- queue position is noted in `watchers`.
            SELECT count(*) FILTER (WHERE o.expires_at <= now),
                   bool_or(o.expires_at > now AND (r.mode = {exclusive} OR o.mode = {exclusive}))
            INTO lapsed, blocked
            FROM {s}.locks AS o
            JOIN unnest(op_keys, op_modes) AS r(key, mode) ON o.key = r.key;
            IF lapsed > 0 THEN
                DELETE FROM {s}.locks AS d WHERE d.key = ANY(op_keys) AND d.expires_at <= now;
                -- The read above may predate a renewal of a row it found lapsed that had not
                -- committed yet: the deletion waited for that renewal and left the row it
                -- renewed, so judge the keys again as they are now. (Judged on the first read,
                -- the key went to a second holder while the first went on renewing it.)
                SELECT bool_or(o.expires_at > now AND (r.mode = {exclusive} OR o.mode = {exclusive}))
                INTO blocked
                FROM {s}.locks AS o
                JOIN unnest(op_keys, op_modes) AS r(key, mode) ON o.key = r.key;
            END IF;
            granted := NOT coalesce(blocked, false);
            IF NOT granted AND op_wait <> 2 THEN
                SELECT array_agg(o.key), array_agg(o.expires_at)
                INTO others_keys, others_expiries
                FROM {s}.locks AS o
                WHERE o.key = ANY(op_keys) AND o.expires_at > now AND o.owner <> p_owner;
                IF op_wait = 1 THEN
                    INSERT INTO {s}.watchers AS w (key, owner, expires_at)
                    SELECT k, p_owner, now + 2 * p_lease FROM unnest(op_keys) AS k
                    ON CONFLICT (key, owner) DO UPDATE SET expires_at = EXCLUDED.expires_at;
                END IF;
            END IF;
            ticket := CASE WHEN granted OR op_wait = 0 THEN nextval('{s}.tickets') END;
            IF ticket IS NOT NULL THEN
                INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held, requested_at,
                                       acquired_at, expires_at, heartbeat_at, keys)
                SELECT r.key, r.mode, r.operation, p_owner, ticket, granted, now,
                       CASE WHEN granted THEN now END, now + p_lease, now,
                       CASE WHEN NOT granted THEN p_all_keys[n] END
                FROM unnest(op_keys, op_modes, p_operations[lo:p_ends[n]])
                     AS r(key, mode, operation);
            END IF;
        ELSE
            -- A release: the owner's rows of the ticket deleted, with the keys' lapsed rows;
            -- then, if other live rows are left there, the single-key waiters that the rule now
            -- lets through promoted. (A release of the only rows on its keys, the uncontended
            -- case, is this one statement.)
            WITH d AS (
                DELETE FROM {s}.locks AS d
                WHERE d.key = ANY(op_keys)
                  AND ((d.ticket = op_ticket AND d.owner = p_owner) OR d.expires_at <= now)
                RETURNING d.ticket = op_ticket AND d.owner = p_owner AS own,
                          d.expires_at > now AS live)
            SELECT count(*) FILTER (WHERE d.own), count(*) FILTER (WHERE d.own AND d.live),
                   count(*) FILTER (WHERE NOT d.own),
                   EXISTS (SELECT 1 FROM {s}.locks AS o
                           WHERE o.key = ANY(op_keys) AND o.expires_at > now
                             AND (o.ticket <> op_ticket OR o.owner <> p_owner)),
                   EXISTS (SELECT 1 FROM {s}.locks AS w
                           WHERE w.key = ANY(op_keys) AND NOT w.held AND w.expires_at > now
                             AND w.owner <> p_owner)
                   OR EXISTS (SELECT 1 FROM {s}.watchers AS w
                              WHERE w.key = ANY(op_keys) AND w.expires_at > now
                                AND w.owner <> p_owner)
            INTO deleted, live, lapsed, others_left, waited_for FROM d;
            promoted := NULL;
            owners := NULL;
            IF others_left THEN
                WITH p AS (
                    UPDATE {s}.locks AS w SET held = true, acquired_at = now,
                        expires_at = GREATEST(w.expires_at, now + (w.expires_at - w.heartbeat_at)),
                        heartbeat_at = GREATEST(w.heartbeat_at, now)
                    WHERE w.key = ANY(op_keys) AND NOT w.held AND w.keys IS NULL
                      AND w.expires_at > now
                      AND NOT EXISTS (
                          SELECT 1 FROM {s}.locks AS o
                          WHERE o.key = w.key AND o.ticket < w.ticket AND o.expires_at > now
                            AND (w.mode = {exclusive} OR o.mode = {exclusive}))
                    RETURNING w.ticket, w.owner)
                SELECT array_agg(p.ticket),
                       array_agg(DISTINCT p.owner) FILTER (WHERE p.owner <> p_owner)
                INTO promoted, owners FROM p;
            END IF;
            freed := deleted > 0 OR lapsed > 0 OR promoted IS NOT NULL;
            -- Announced only if another owner may be waiting: its request promoted, or it
            -- waited before (a waiting row, promoted since or not, or a caller without a row,
            -- in `watchers`). This owner learns of its own promotions from the answer, and
            -- looks for itself at the keys where a request of its own on several keys waits.
            IF freed AND (owners IS NOT NULL OR waited_for) THEN
                PERFORM pg_notify(p_channel, p_payloads[n]);
            END IF;
        END IF;
        RETURN NEXT;
        lo := p_ends[n] + 1;
    END LOOP;
END $$;
"#;

/// Callers that wait without a row (`many`, which takes no queue position): a row per key and
/// owner, written when such a request is refused, until twice its lease from then (each retry
/// writes it again). A release announces itself only if someone may be waiting: these, or a
/// waiting row. Lapsed ones are swept.
const WATCHERS: &str = "
CREATE TABLE {s}.watchers (
    key text NOT NULL,
    owner text NOT NULL,
    expires_at bigint NOT NULL,
    PRIMARY KEY (key, owner)
);
CREATE INDEX watchers_sweep ON {s}.watchers ((expires_at - 0));";

/// The sweep's indexes (`Storage::sweep`) are on `expires_at - 0`, an expression only the sweep
/// names. A plain index on `expires_at` was taken by the managers' generic plans for key-local
/// queries (`key = ANY(..) AND expires_at > now`), which then read every live row: with 1,000
/// keys held and waited for, an uncontended cycle on another key took three times as long.
const SWEEP_INDEXES: &str = "
DROP INDEX IF EXISTS {s}.locks_expires_at_idx;
DROP INDEX IF EXISTS {s}.watchers_expires_at_idx;
CREATE INDEX IF NOT EXISTS locks_sweep ON {s}.locks ((expires_at - 0));
CREATE INDEX IF NOT EXISTS watchers_sweep ON {s}.watchers ((expires_at - 0));";

/// `FUNCTIONS` for `schema`.
fn functions(schema: &str) -> String {
    FUNCTIONS
        .replace("{s}", &quote(schema))
        .replace("{max_locks}", &MAX_KEY_LOCKS.to_string())
        .replace("{schema_class}", &SCHEMA_CLASS.to_string())
        .replace("{lock_class}", &LOCK_CLASS.to_string())
        .replace("{exclusive}", &mode_code(Mode::Exclusive).to_string())
}

/// Creates the schema and its tables if missing, under an advisory lock so that several
/// processes starting at once do it once; refuses a schema from a newer version.
fn migrate(client: &mut Client, schema: &str) -> Result<()> {
    let s = quote(schema);
    let doing = "creating the schema";
    let mut transaction = client.transaction().map_err(|e| storage_error(doing, &e))?;
    // The planner as the server has it, for these queries of the catalog (`Target::bound_by`
    // sets it for the lock statements); and time enough for another process's creation of the
    // schema, whose lock this waits for (the lock statements' timeouts are a fraction of a
    // heartbeat).
    transaction
        .batch_execute(
            "SET LOCAL plan_cache_mode = auto; SET LOCAL enable_seqscan = on;
             SET LOCAL enable_bitmapscan = on; SET LOCAL statement_timeout = '60s';
             SET LOCAL lock_timeout = '60s'; SET LOCAL idle_in_transaction_session_timeout = '60s'",
        )
        .map_err(|e| storage_error(doing, &e))?;
    transaction
        .execute(
            "SELECT pg_advisory_xact_lock($1, hashtext($2))",
            &[&LOCK_CLASS, &schema],
        )
        .map_err(|e| storage_error(doing, &e))?;
    let exists: bool = transaction
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{s}.meta")],
        )
        .map_err(|e| storage_error(doing, &e))?
        .get(0);
    if exists {
        let found: i32 = transaction
            .query_one(&format!("SELECT version FROM {s}.meta"), &[])
            .map_err(|e| storage_error("reading the schema version", &e))?
            .get(0);
        if found > SCHEMA_VERSION {
            return Err(LockError::SchemaTooNew {
                found: i64::from(found),
                supported: i64::from(SCHEMA_VERSION),
            });
        }
        if found < 2 {
            // Key-local decisions: a request on several keys names them all in each row, and
            // the sweep of lapsed rows finds them by an index. A process of version 1 refuses
            // the schema from now on; processes sharing it must be upgraded together.
            transaction
                .batch_execute(&format!(
                    "ALTER TABLE {s}.locks ADD COLUMN keys text;
                     UPDATE {s}.meta SET version = 2;"
                ))
                .map_err(|e| storage_error("migrating the schema to version 2", &e))?;
        }
        if found < 3 {
            // Callers that wait without a row (see `WATCHERS`).
            transaction
                .batch_execute(&WATCHERS.replace("{s}", &s))
                .map_err(|e| storage_error("migrating the schema to version 3", &e))?;
        }
        if found < SCHEMA_VERSION {
            // One round trip per batch of acquisitions and releases: the functions of
            // `FUNCTIONS` (version 3 had one for an acquisition and one for a release; version
            // 4 had no shortcut for keys without other rows; version 5 judged an acquisition on
            // a read that a renewal in flight could make stale); and the sweep's indexes
            // (`SWEEP_INDEXES`).
            transaction
                .batch_execute(&format!(
                    "DROP FUNCTION IF EXISTS {s}.acquire, {s}.release;
                     {}
                     {}
                     UPDATE {s}.meta SET version = {SCHEMA_VERSION};",
                    SWEEP_INDEXES.replace("{s}", &s),
                    functions(schema)
                ))
                .map_err(|e| storage_error("migrating the schema's functions", &e))?;
        }
    } else {
        transaction
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {s};
                 CREATE TABLE {s}.meta (
                     id integer PRIMARY KEY CHECK (id = 1),
                     version integer NOT NULL,
                     changes bigint NOT NULL
                 );
                 INSERT INTO {s}.meta (id, version, changes) VALUES (1, {SCHEMA_VERSION}, 0);
                 CREATE SEQUENCE {s}.tickets;
                 CREATE TABLE {s}.locks (
                     key text NOT NULL,
                     ticket bigint NOT NULL,
                     mode smallint NOT NULL,
                     operation text NOT NULL,
                     owner text NOT NULL,
                     held boolean NOT NULL,
                     requested_at bigint NOT NULL,
                     acquired_at bigint,
                     expires_at bigint NOT NULL,
                     heartbeat_at bigint NOT NULL,
                     keys text,
                     PRIMARY KEY (key, ticket)
                 );
                 CREATE INDEX ON {s}.locks (owner);
                 CREATE INDEX locks_sweep ON {s}.locks ((expires_at - 0));
                 {}
                 {}",
                WATCHERS.replace("{s}", &s),
                functions(schema)
            ))
            .map_err(|e| storage_error(doing, &e))?;
    }
    transaction.commit().map_err(|e| storage_error(doing, &e))
}

fn row_view(row: &postgres::Row) -> RowView {
    RowView {
        key: row.get::<_, &str>(0).into(),
        mode: mode_of(i64::from(row.get::<_, i16>(1))),
        ticket: ticket_of(row.get(2)),
        held: row.get(3),
        owner: row.get::<_, &str>(4).into(),
        expires_at: row.get(5),
        keys: row
            .get::<_, Option<String>>(6)
            .map_or_else(Vec::new, |keys| decode_keys(&keys)),
    }
}

impl Storage for Postgres {
    fn now(&self) -> i64 {
        self.monotonic() + self.offset
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            keys_locked: true,
            // A waiter without a row is noted (`watching`) under the locks of its keys.
            refuses_by_reads: false,
        }
    }

    fn again(&mut self) -> bool {
        let now = SystemClock.monotonic();
        if !std::mem::take(&mut self.transient) {
            self.retry.reset(now);
            return false;
        }
        match self.retry.next_at(now) {
            Some(at) => {
                std::thread::sleep(at.saturating_sub(now));
                true
            }
            None => {
                self.retry.reset(now);
                false
            }
        }
    }

    /// What the listener heard; everything, while it is not listening.
    fn changes(&mut self) -> Result<Changes> {
        let mut heard = lock(&self.heard);
        if !heard.listening || std::mem::take(&mut heard.missed) {
            heard.any = false;
            heard.keys.clear();
            return Ok(Changes::Unknown);
        }
        if !std::mem::take(&mut heard.any) {
            return Ok(Changes::Nothing);
        }
        Ok(Changes::Keys(std::mem::take(&mut heard.keys)))
    }

    /// One round trip: the transaction, the advisory locks of its keys, and the server's time
    /// once it holds them (`lock_keys`, in `FUNCTIONS`). The lock numbers are integers, and the
    /// schema name is validated and quoted, so both can stand in the text.
    fn begin(&mut self, keys: &[String]) -> Result<i64> {
        self.announcing.clear();
        self.transient = false;
        let (locks, schema_lock) = self.key_locks(keys);
        let locks: Vec<String> = locks.iter().map(i32::to_string).collect();
        let sql = format!(
            "BEGIN; SELECT {}.lock_keys('{{{}}}'::int4[], {schema_lock})",
            quote(&self.schema),
            locks.join(",")
        );
        let mut again = true;
        let started = self.started;
        let (sent, messages) = loop {
            let client = self.client()?;
            let sent = micros_since(started);
            match client.simple_query(&sql) {
                Ok(messages) => break (sent, messages),
                // The session was found ended (its connection cut, or the server restarted
                // since the last call): nothing was begun in it, so begin once more, on a new
                // connection.
                Err(error) if again && session_ended(&error) => {
                    again = false;
                    self.client = None;
                    self.statements.clear();
                }
                Err(error) => return Err(self.failed("starting a write transaction", &error)),
            }
        };
        let now = messages
            .iter()
            .rev()
            .find_map(|message| match message {
                SimpleQueryMessage::Row(row) => row.get(0).and_then(|text| text.parse().ok()),
                _ => None,
            })
            .ok_or_else(|| {
                LockError::Storage("while starting a write transaction: no server time".into())
            })?;
        self.offset = now - sent;
        self.in_transaction = true;
        Ok(now)
    }

    /// Sent with the commit, in its round trip: one `NOTIFY` naming the keys.
    /// The keys, by digest, in a `NOTIFY` at the commit: every listener hears it, and looks at
    /// the keys it waits on among them (the owners need not be named).
    fn announce(
        &mut self,
        freed: &[String],
        promoted: &[String],
        _owners: &BTreeSet<String>,
    ) -> Result<()> {
        let mut keys: Vec<i64> = freed.iter().chain(promoted).map(|k| key_hash(k)).collect();
        keys.sort_unstable();
        keys.dedup();
        self.announcing = keys;
        Ok(())
    }

    fn commit(&mut self) -> Result<()> {
        let keys = std::mem::take(&mut self.announcing);
        let sql = if keys.is_empty() {
            "COMMIT".to_owned()
        } else {
            // The payload holds digits, commas or `*` only.
            format!(
                "SELECT pg_notify('{}', '{}'); COMMIT",
                channel(&self.schema),
                payload(&keys)
            )
        };
        let committed = self.simple("committing", &sql);
        self.in_transaction = false;
        committed?;
        self.succeeded();
        Ok(())
    }

    fn rollback(&mut self) {
        self.announcing.clear();
        self.in_transaction = false;
        if let Some(client) = self.client.as_mut() {
            let _ = client.batch_execute("ROLLBACK");
        }
    }

    fn rows_on_keys(&mut self, keys: &[String], now: i64, into: &mut Vec<RowView>) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let rows = self.query(
            "rows on keys",
            "SELECT key, mode, ticket, held, owner, expires_at, keys FROM {s}.locks
             WHERE key = ANY($1) AND expires_at > $2 ORDER BY key, ticket",
            &[&keys, &now],
        )?;
        into.extend(rows.iter().map(row_view));
        Ok(())
    }

    fn next_ticket(&mut self) -> Result<u64> {
        let rows = self.query("taking a ticket", "SELECT nextval('{s}.tickets')", &[])?;
        Ok(ticket_of(rows[0].get(0)))
    }

    fn insert_request(
        &mut self,
        owner: &str,
        ticket: u64,
        requests: &[LockRequest],
        held: bool,
        now: i64,
        expires_at: i64,
    ) -> Result<()> {
        let ticket = sql_ticket(ticket);
        let acquired_at = held.then_some(now);
        let keys = stored_keys(requests, held);
        // One statement for every row of the request, whatever its number of keys.
        let names: Vec<&str> = requests.iter().map(|r| r.key.as_str()).collect();
        let modes: Vec<i16> = requests.iter().map(|r| mode_code(r.mode)).collect();
        let operations: Vec<&str> = requests.iter().map(|r| r.operation.as_str()).collect();
        self.execute(
            "writing a request's rows",
            "INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held, requested_at,
                                    acquired_at, expires_at, heartbeat_at, keys)
             SELECT r.key, r.mode, r.operation, $4, $5, $6, $7, $8, $9, $7, $10
             FROM unnest($1::text[], $2::int2[], $3::text[]) AS r(key, mode, operation)",
            &[
                &names,
                &modes,
                &operations,
                &owner,
                &ticket,
                &held,
                &now,
                &acquired_at,
                &expires_at,
                &keys,
            ],
        )?;
        Ok(())
    }

    /// One statement for all the request's rows. It locks them in the order its scan meets
    /// them, which may differ from the key order renewals take: a deadlock the server breaks
    /// there (`40P01`) is a passing failure, and the transaction is done again.
    fn promote(&mut self, keys: &[String], ticket: u64, now: i64) -> Result<()> {
        self.execute(
            "promoting a waiting request",
            "UPDATE {s}.locks SET held = true, acquired_at = $1,
                 expires_at = GREATEST(expires_at, $1 + (expires_at - heartbeat_at)),
                 heartbeat_at = GREATEST(heartbeat_at, $1), keys = NULL
             WHERE key = ANY($2) AND ticket = $3 AND NOT held",
            &[&now, &keys, &sql_ticket(ticket)],
        )?;
        Ok(())
    }

    /// One statement for all the request's rows, telling which were live.
    fn delete_request(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        now: i64,
    ) -> Result<Deleted> {
        let rows = self.query(
            "deleting a request's rows",
            "DELETE FROM {s}.locks WHERE key = ANY($1) AND ticket = $2 AND owner = $3
             RETURNING expires_at > $4",
            &[&keys, &sql_ticket(ticket), &owner, &now],
        )?;
        Ok(Deleted {
            rows: rows.len(),
            live: rows.iter().filter(|row| row.get::<_, bool>(0)).count(),
        })
    }

    fn delete_owner(&mut self, owner: &str) -> Result<usize> {
        let deleted = self.execute(
            "deleting an owner's rows",
            "DELETE FROM {s}.locks WHERE owner = $1",
            &[&owner],
        )?;
        Ok(usize::try_from(deleted).unwrap_or(usize::MAX))
    }

    fn delete_expired(&mut self, keys: &[String], now: i64) -> Result<usize> {
        if keys.is_empty() {
            return Ok(0);
        }
        let deleted = self.execute(
            "deleting expired rows",
            "DELETE FROM {s}.locks WHERE key = ANY($1) AND expires_at <= $2",
            &[&keys, &now],
        )?;
        Ok(usize::try_from(deleted).unwrap_or(usize::MAX))
    }

    /// Rows that another transaction has locked are left for the next sweep: this one never
    /// waits, so it never deadlocks with a decision.
    fn sweep(&mut self, now: i64) -> Result<()> {
        self.execute(
            "sweeping expired rows",
            "DELETE FROM {s}.locks WHERE ctid IN (
                 SELECT ctid FROM {s}.locks WHERE expires_at - 0 <= $1 FOR UPDATE SKIP LOCKED)",
            &[&now],
        )?;
        self.execute(
            "sweeping lapsed watchers",
            "DELETE FROM {s}.watchers WHERE ctid IN (
                 SELECT ctid FROM {s}.watchers WHERE expires_at - 0 <= $1 FOR UPDATE SKIP LOCKED)",
            &[&now],
        )?;
        Ok(())
    }

    fn watching(&mut self, owner: &str, keys: &[String], now: i64, lease: i64) -> Result<()> {
        self.execute(
            "noting a caller that waits without a row",
            "INSERT INTO {s}.watchers AS w (key, owner, expires_at)
             SELECT k, $2, $3 FROM unnest($1::text[]) AS k
             ON CONFLICT (key, owner) DO UPDATE SET expires_at = EXCLUDED.expires_at",
            &[&keys, &owner, &(now + 2 * lease)],
        )?;
        Ok(())
    }

    /// Renews the owner's live rows, in two statements. The first locks them in key order, as
    /// promotions change rows, so that the two never deadlock, and waits for any that another
    /// transaction holds; the second, which
    /// runs with every lock held, judges "live" by the server's clock then. Judged in the first
    /// (or by `now`, when the transaction began), a row whose lock had to be waited for until
    /// after its lease ran out would be revived: the server does not check a row again after
    /// such a wait unless it was changed.
    fn renew(&mut self, owner: &str, now: i64, expires_at: i64) -> Result<Vec<OwnedRequest>> {
        self.execute(
            "locking this owner's rows",
            "SELECT 1 FROM {s}.locks WHERE owner = $1 ORDER BY key, ticket FOR UPDATE",
            &[&owner],
        )?;
        let renewed = self.query(
            "renewing leases",
            "UPDATE {s}.locks SET expires_at = $1, heartbeat_at = $2
             WHERE owner = $3
               AND expires_at > (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
             RETURNING ticket, held",
            &[&expires_at, &now, &owner],
        )?;
        let rows = renewed
            .iter()
            .map(|row| (ticket_of(row.get(0)), row.get(1)));
        Ok(OwnedRequest::group(rows, expires_at))
    }

    fn at_once(&mut self) -> Option<&mut dyn DecidesAtOnce> {
        Some(self)
    }

    fn wake_others(&mut self) {}

    /// Every release announces itself to owners that may be waiting (see `WATCHERS`).
    fn waiting(&mut self, _waiting: bool) {}

    fn requests_of(&mut self, owner: &str) -> Result<Vec<(u64, Vec<String>)>> {
        let rows = self.query(
            "reading this owner's requests",
            "SELECT ticket, key FROM {s}.locks WHERE owner = $1 ORDER BY ticket, key",
            &[&owner],
        )?;
        Ok(by_ticket(
            rows.iter()
                .map(|row| (ticket_of(row.get(0)), row.get(1)))
                .collect(),
        ))
    }

    fn live_rows(&mut self, key: Option<&str>, now: i64) -> Result<Vec<Row>> {
        let rows = match key {
            Some(key) => self.query(
                "inspecting a key",
                "SELECT key, mode, operation, owner, ticket, held, requested_at, acquired_at,
                        expires_at
                 FROM {s}.locks WHERE expires_at > $1 AND key = $2 ORDER BY key, ticket",
                &[&now, &key],
            )?,
            None => self.query(
                "inspecting locks",
                "SELECT key, mode, operation, owner, ticket, held, requested_at, acquired_at,
                        expires_at
                 FROM {s}.locks WHERE expires_at > $1 ORDER BY key, ticket",
                &[&now],
            )?,
        };
        Ok(rows
            .iter()
            .map(|row| {
                let held: bool = row.get(5);
                let requested_at: i64 = row.get(6);
                let acquired_at: Option<i64> = row.get(7);
                Row {
                    key: row.get(0),
                    mode: mode_of(i64::from(row.get::<_, i16>(1))),
                    operation: row.get(2),
                    owner: row.get(3),
                    ticket: ticket_of(row.get(4)),
                    held,
                    since: if held {
                        acquired_at.unwrap_or(requested_at)
                    } else {
                        requested_at
                    },
                    expires_at: row.get(8),
                }
            })
            .collect())
    }

    fn is_held(&mut self, key: &str, now: i64) -> Result<bool> {
        let rows = self.query(
            "checking whether a key is locked",
            "SELECT EXISTS (SELECT 1 FROM {s}.locks WHERE key = $1 AND held AND expires_at > $2)",
            &[&key, &now],
        )?;
        Ok(rows[0].get(0))
    }
}

impl DecidesAtOnce for Postgres {
    /// One round trip: the function `decide` (see `FUNCTIONS`).
    fn decide_at_once(
        &mut self,
        owner: &str,
        ops: &[AtOnce<'_>],
        lease: i64,
    ) -> Result<Vec<Outcome>> {
        self.decide_in_one(owner, ops, lease)
    }
}

/// The tests' PostgreSQL harness, for the tests below that need a server.
#[cfg(test)]
#[path = "../../../../tests/pg_support/mod.rs"]
#[allow(unreachable_pub, clippy::all)]
mod pg_support;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_at_sign_left_in_a_urls_user_information_is_found() {
        assert!(has_unescaped_at("postgres://u:p@ss@host/db"));
        assert!(has_unescaped_at("postgresql://u@x:p@host"));
        assert!(!has_unescaped_at("postgres://u:p%40ss@host/db"));
        assert!(!has_unescaped_at(
            "postgres://u@host/db?application_name=a@b"
        ));
        assert!(!has_unescaped_at("postgres://host/db#x@y@z"));
        // The key-value form names the password on its own.
        assert!(!has_unescaped_at("host=h user=u password=p@ss@word"));
    }

    mod the_rule_in_sql {
        //! The server-side functions (`FUNCTIONS`) against the grant rule of `grant.rs`, on
        //! generated rows: whether a new request is granted, and which waiters a release lets
        //! through.
        use super::super::pg_support;
        use super::super::*;
        use crate::lock::grant::{grantable_now, promotable};
        use proptest::prelude::*;

        /// A row to plant: key (0 or 1), exclusive, held, lapsed, owner (0 or 1), and whether
        /// its request names both keys. Tickets follow the order of the rows.
        type Planted = (u8, bool, bool, bool, u8, bool);

        fn planted() -> impl Strategy<Value = Vec<Planted>> {
            prop::collection::vec(
                (
                    0..2u8,
                    any::<bool>(),
                    any::<bool>(),
                    prop::bool::weighted(0.2),
                    0..2u8,
                    prop::bool::weighted(0.2),
                ),
                0..7,
            )
        }

        const KEYS: [&str; 2] = ["a", "b"];

        struct Case {
            client: Client,
            schema: String,
        }

        impl Case {
            fn new() -> Option<Case> {
                let server = pg_support::server()?;
                let schema = pg_support::schema("rule_in_sql");
                let mut client = Client::connect(server.url(), NoTls).expect("connect");
                client
                    .batch_execute(
                        "SET plan_cache_mode = force_generic_plan; \
                         SET enable_seqscan = off; SET enable_bitmapscan = off",
                    )
                    .unwrap();
                migrate(&mut client, &schema).expect("the schema");
                // Planted tickets are small; new ones come after them.
                client
                    .query_one(
                        &format!("SELECT setval('{}.tickets', 1000)", quote(&schema)),
                        &[],
                    )
                    .unwrap();
                Some(Case { client, schema })
            }

            /// Runs `test` on the case of this test binary (one schema for all), if there is a
            /// server.
            fn with(
                test: impl FnOnce(&mut Case) -> std::result::Result<(), TestCaseError>,
            ) -> std::result::Result<(), TestCaseError> {
                static CASE: std::sync::OnceLock<Mutex<Option<Case>>> = std::sync::OnceLock::new();
                let mut case = lock(CASE.get_or_init(|| Mutex::new(Case::new())));
                match case.as_mut() {
                    Some(case) => test(case),
                    None => Ok(()),
                }
            }

            /// Empties the table and plants `rows`; returns the server's time and the rows as
            /// the rule sees them (live ones only).
            fn plant(&mut self, rows: &[Planted]) -> (i64, Vec<RowView>) {
                let s = quote(&self.schema);
                self.client
                    .batch_execute(&format!("DELETE FROM {s}.locks"))
                    .unwrap();
                let now: i64 = self
                    .client
                    .query_one(
                        "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
                        &[],
                    )
                    .unwrap()
                    .get(0);
                let hour = 3_600_000_000_i64;
                let mut live = Vec::new();
                for (i, &(key, exclusive, held, lapsed, owner, both)) in rows.iter().enumerate() {
                    let key = KEYS[usize::from(key)];
                    let mode = if exclusive {
                        Mode::Exclusive
                    } else {
                        Mode::Shared
                    };
                    let ticket = i as i64 + 1;
                    let owner = format!("o{owner}");
                    let expires_at = if lapsed { now - hour } else { now + hour };
                    let keys = both.then(|| "1:a1:b".to_owned());
                    self.client
                        .execute(
                            &format!(
                                "INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held,
                                     requested_at, expires_at, heartbeat_at, keys)
                                 VALUES ($1, $2, 'op', $3, $4, $5, $6, $7, $6, $8)"
                            ),
                            &[
                                &key,
                                &mode_code(mode),
                                &owner,
                                &ticket,
                                &held,
                                &(now - hour * 2),
                                &expires_at,
                                &keys,
                            ],
                        )
                        .unwrap();
                    if !lapsed {
                        live.push(RowView {
                            key: key.into(),
                            mode,
                            ticket: ticket as u64,
                            held,
                            owner: owner.into(),
                            expires_at,
                            keys: if both {
                                vec!["a".into(), "b".into()]
                            } else {
                                Vec::new()
                            },
                        });
                    }
                }
                (now, live)
            }

            /// How many lapsed rows are left on `keys`.
            fn lapsed_on(&mut self, keys: &[String], now: i64) -> i64 {
                let s = quote(&self.schema);
                self.client
                    .query_one(
                        &format!("SELECT count(*) FROM {s}.locks WHERE key = ANY($1) AND expires_at <= $2"),
                        &[&keys, &now],
                    )
                    .unwrap()
                    .get(0)
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

            #[test]
            fn a_new_request_is_granted_in_sql_as_by_the_rule(
                rows in planted(),
                wanted in prop::sample::subsequence(vec![0u8, 1], 1..=2),
                exclusive in any::<[bool; 2]>(),
            ) {
                Case::with(|case| {
                let (now, live) = case.plant(&rows);
                let requests: Vec<LockRequest> = wanted
                    .iter()
                    .map(|&k| {
                        let key = KEYS[usize::from(k)];
                        if exclusive[usize::from(k)] {
                            LockRequest::exclusive(key, "new")
                        } else {
                            LockRequest::shared(key, "new")
                        }
                    })
                    .collect();
                let keys: Vec<String> = requests.iter().map(|r| r.key.clone()).collect();
                let op = AtOnce::Acquire { requests: &requests, wait: Wait::No };
                let args = DecideArgs::new(&case.schema, "o9", 1_000_000, &[op]);
                let sql = DECIDE.replace("{s}", &quote(&case.schema));
                let row = case.client.query_one(&sql, &args.params()).unwrap();
                let granted: bool = row.get(2);
                let expected = grantable_now(requests.iter().map(|r| (r.key.as_str(), r.mode)), &live);
                prop_assert_eq!(granted, expected, "rows {:?}", rows);
                prop_assert_eq!(row.get::<_, Option<i64>>(1).is_some(), expected);
                prop_assert_eq!(case.lapsed_on(&keys, now), 0, "lapsed rows are deleted first");
                Ok(())
                })?;
            }

            #[test]
            fn a_release_promotes_in_sql_whom_the_rule_lets_through(
                rows in planted(),
                released in any::<prop::sample::Index>(),
            ) {
                Case::with(|case| {
                let (_, live) = case.plant(&rows);
                if rows.is_empty() {
                    return Ok(());
                }
                // Release one planted request (all its rows), live or lapsed, held or not.
                let at = released.index(rows.len());
                let (key, _, _, lapsed, owner, both) = rows[at];
                let keys: Vec<String> = if both {
                    vec!["a".into(), "b".into()]
                } else {
                    vec![KEYS[usize::from(key)].to_owned()]
                };
                let ticket = at as i64 + 1;
                let owner = format!("o{owner}");
                let op = AtOnce::Remove { keys: &keys, ticket: ticket as u64 };
                let args = DecideArgs::new(&case.schema, &owner, 1_000_000, &[op]);
                let sql = DECIDE.replace("{s}", &quote(&case.schema));
                let row = case.client.query_one(&sql, &args.params()).unwrap();
                let deleted: i64 = row.get(5);
                let mut promoted: Vec<u64> = row
                    .get::<_, Option<Vec<i64>>>(8)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|t| t as u64)
                    .collect();
                promoted.sort_unstable();
                // The rows planted under that ticket on those keys are gone (a planted row on
                // one key only names its own key: it is deleted only through it).
                prop_assert_eq!(deleted, 1);
                prop_assert_eq!(row.get::<_, i64>(6), i64::from(!lapsed), "live rows deleted");
                prop_assert!(row.get::<_, bool>(7), "a deletion frees");
                let left: Vec<RowView> = live
                    .into_iter()
                    .filter(|r| r.ticket != ticket as u64 && keys.iter().any(|k| **k == *r.key))
                    .collect();
                let mut expected: Vec<u64> = promotable(&left)
                    .into_iter()
                    .filter(|t| left.iter().any(|r| r.ticket == *t && r.keys.is_empty()))
                    .collect();
                expected.sort_unstable();
                prop_assert_eq!(promoted, expected, "rows {:?}, released {}", rows, at);
                Ok(())
                })?;
            }
        }
    }

    #[test]
    fn reconnects_back_off_on_the_busy_schedule_and_start_over_after_a_success_or_its_end() {
        let minute = Duration::from_secs(60);
        let backoff = Schedule::spaced(minute).intersect(Schedule::recurs(1));
        let mut reconnect = Reconnect::new(backoff);
        assert_eq!(reconnect.wait_left(), None, "the first attempt at once");
        reconnect.failed();
        let left = reconnect.wait_left().expect("a failure waits");
        assert!(left > minute - Duration::from_secs(1) && left <= minute);
        reconnect.failed();
        assert!(
            reconnect.wait_left().is_some(),
            "the schedule's end starts it over: the manager never gives up"
        );
        reconnect.succeeded();
        assert_eq!(reconnect.wait_left(), None);
    }

    #[test]
    fn channels_fit_in_an_identifier_whatever_the_schema() {
        assert_eq!(channel("leasehold"), "leasehold_leasehold");
        let long = "s".repeat(63);
        assert!(channel(&long).len() <= 63);
        assert_ne!(channel(&long), channel(&"t".repeat(63)));
        assert_eq!(channel(&long), channel(&long));
    }

    #[test]
    fn announcements_name_their_keys_or_say_that_something_changed() {
        let keys = [
            key_hash("a"),
            key_hash("b,c"),
            key_hash(&"x".repeat(10_000)),
        ];
        assert_eq!(parse_payload(&payload(&keys)), Some(keys.to_vec()));
        assert_eq!(parse_payload(""), Some(Vec::new()));
        let many: Vec<i64> = (0..2_000).collect();
        assert_eq!(payload(&many), "*");
        assert_eq!(parse_payload("*"), None);
    }

    #[test]
    fn key_locks_depend_on_the_schema_and_the_key() {
        assert_eq!(key_lock("s", "k"), key_lock("s", "k"));
        assert_ne!(key_lock("s", "k"), key_lock("t", "k"));
        assert_ne!(key_lock("s", "k"), key_lock("s", "j"));
    }

    #[test]
    fn schema_names_that_could_inject_sql_are_refused() {
        assert!(valid_schema("leasehold"));
        assert!(valid_schema("app_locks_2"));
        for bad in [
            "",
            "Leasehold",
            "a b",
            "x\"; DROP TABLE t; --",
            "1abc",
            &"a".repeat(64),
        ] {
            assert!(!valid_schema(bad), "{bad:?}");
        }
        assert_eq!(quote("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn a_password_never_appears_in_the_description() {
        let target = parse("postgres://alice:s3cret@db.example/app?sslmode=disable").unwrap();
        let config = &target.config;
        let text = format!("{} {config:?}", describe(config));
        assert!(!text.contains("s3cret"), "{text}");
        let target = parse("host=/run/postgresql user=alice password=s3cret dbname=app").unwrap();
        let config = &target.config;
        let text = format!("{} {config:?}", describe(config));
        assert!(!text.contains("s3cret"), "{text}");
        let Err(error) = parse("postgres://alice:s3cret@db.example:notaport/app") else {
            panic!("a port that is not a number was accepted");
        };
        assert!(!error.to_string().contains("s3cret"), "{error}");
    }
}
