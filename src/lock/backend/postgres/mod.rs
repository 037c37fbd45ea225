//! PostgreSQL storage, for owners on several machines that share one database.
//!
//! Its parts: `target.rs` (the connection string and the bounds on every wait), `tls.rs`,
//! `schema.rs` (tables, advisory locks, migrations, and the server-side functions of
//! `functions.sql`), `decide.rs` (decisions in one round trip), `listener.rs` (wake-ups, and
//! reconnection), and here the connection and the `Storage` the worker drives.
//!
//! The same rows as SQLite's (`../sqlite`), in tables of a schema of their own, with three
//! differences that come from the machines being several:
//!
//! 1. **Time is the server's.** Every transaction reads `clock_timestamp()` once it holds its
//!    lock, and every expiry is written and compared in that time; clients' clocks, which drift
//!    between machines, never judge a lease. Between transactions the worker estimates the
//!    server's time from its own monotonic clock and the offset seen last, measured from when the
//!    statement that read the server's time was *sent*: the estimate is never behind the server,
//!    so a lease as this process knows it never ends after the server's (it may end early by a
//!    round trip). The store's time is the server's clock less the forward steps of it that
//!    clients absorbed (`meta.skew`): every call gives the server the latest time at which, by
//!    its monotonic clock and the offsets it has seen, the call can start (`Steps`); the server
//!    refuses a call that started later (`check_clock`), and this process measures the step
//!    afresh, adds it to the skew, and calls again. So a forward step of the server's clock
//!    lapses no lease, once any process that has talked to the server since before it makes a
//!    call; a backward step makes leases last longer, and a decision deletes the lapsed rows of
//!    its keys before it reads them, so none that it passed over comes back. Steps shorter than
//!    `STEP_BOUND` go unabsorbed, and a process that first connects after a step, before any
//!    other absorbed it, decides on the stepped clock.
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

pub(crate) mod decide;
pub(crate) mod listener;
pub(crate) mod schema;
mod target;
mod tls;

use self::listener::{channel, payload, Heard, Listener, Reconnect};
use self::schema::{check_version, key_locks, migrate};
pub(crate) use self::schema::{quote, version as schema_version, SCHEMA_VERSION};
use self::target::describe;
pub(crate) use self::target::{parse, valid_schema, Target, DEFAULT_SCHEMA};

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use postgres::types::ToSql;
use postgres::{Client, Config, NoTls, SimpleQueryMessage, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::clock::{Clock, SystemClock};
use crate::lock::backend::codec::{
    by_ticket, decode_keys, key_hash, mode_code, mode_of, sql_ticket, stored_keys, ticket_of,
};
use crate::lock::backend::siblings::Siblings;
use crate::lock::backend::{Capabilities, DecidesAtOnce, Opening, Poke, Serve};
use crate::lock::backend::{Changes, Deleted, OwnedRequest, Result, Row, Storage, TOMBSTONE_KEPT};
use crate::lock::grant::RowView;
use crate::lock::{LockError, LockRequest, StorageError};
use crate::schedule::{Schedule, ScheduleRun};
use crate::sync::lock;

/// The error of a call that failed while `doing` something: the server's own message and
/// SQLSTATE ("db error" alone says nothing), or the client's message with what it says caused
/// it ("error connecting to server: Connection refused"); `error` is its source.
fn storage_error(doing: &str, error: postgres::Error) -> LockError {
    let transient = session_ended(&error) || passing(&error);
    let failure = match error.as_db_error() {
        Some(db) => {
            StorageError::new(doing, db.message()).with_code("PostgreSQL", db.code().code())
        }
        None => {
            let mut message = error.to_string();
            let mut cause = std::error::Error::source(&error);
            while let Some(error) = cause {
                message.push_str(&format!(": {error}"));
                cause = error.source();
            }
            StorageError::new(doing, message)
        }
    };
    failure.transient(transient).caused_by(error).into()
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

/// The skew `check_clock` read, if `error` is its refusal of a call on a clock stepped forward.
fn clock_stepped(error: &postgres::Error) -> Option<i64> {
    let db = error.as_db_error()?;
    if db.code().code() != "LH001" {
        return None;
    }
    db.detail()?.split(' ').next()?.parse().ok()
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
    /// What the round trips say of that offset, for finding steps of the server's clock.
    steps: Steps,
    /// A step the server reported (`check_clock`): the skew it read, to absorb it by.
    stepped: Option<i64>,
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
    /// Whether the schema must be there already, with this build's version: never created or
    /// migrated (`Opening::existing`).
    existing: bool,
    /// Wakes this process's other managers of the schema after a commit that freed something
    /// (those of other processes hear its notification).
    siblings: Siblings,
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
    match Postgres::connect(target, schema, opening.busy, opening.poke, opening.existing) {
        Ok(mut storage) => {
            storage.siblings = opening.siblings;
            opened(Ok(()));
            worker.serve(storage);
        }
        Err(error) => opened(Err(error)),
    }
}

impl Postgres {
    /// Connects, creates or migrates the schema (or, if `existing`, checks that it is there and
    /// this build's), and reads the server's time.
    pub(crate) fn connect(
        target: Target,
        schema: String,
        busy: Schedule,
        poke: Arc<dyn Poke>,
        existing: bool,
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
            steps: Steps::default(),
            stepped: None,
            announcing: Vec::new(),
            in_transaction: false,
            started: Instant::now(),
            heard: Arc::new(Mutex::new(Heard::default())),
            existing,
            siblings: Siblings::alone(),
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
            .map_err(|e| {
                StorageError::new("starting the listener thread", e.to_string()).caused_by(e)
            })?;
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
            return Err(StorageError::new(
                "a write transaction",
                "the connection was lost inside it",
            )
            .transient(true)
            .into());
        }
        if self.client.is_none() {
            // A server that cannot be reached now is a passing failure: the work is done again
            // once the busy schedule allows (`Storage::again`).
            if let Some(left) = self.reconnect.wait_left() {
                self.transient = true;
                let doing = format!("connecting to {}", describe(&self.config));
                let why = format!("the last attempt failed; the next in {left:?}");
                return Err(StorageError::new(doing, why).transient(true).into());
            }
            let connected = match &self.tls {
                Some(tls) => self.config.connect(tls.clone()),
                None => self.config.connect(NoTls),
            };
            self.transient = connected.is_err();
            let client = connected
                .map_err(|e| storage_error(&format!("connecting to {}", describe(&self.config)), e))
                .and_then(|mut client| {
                    match self.existing {
                        true => check_version(&mut client, &self.schema),
                        false => migrate(&mut client, &self.schema),
                    }
                    .map(|()| client)
                });
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
            self.observed(now, sent);
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
        result.map_err(|e| self.failed(doing, e))
    }

    /// The error of a call that failed; a session found ended is dropped (the next call opens
    /// a new one). Remembers whether the failure was a passing one (`Storage::again`).
    fn failed(&mut self, doing: &str, error: postgres::Error) -> LockError {
        let ended = session_ended(&error);
        if ended {
            self.client = None;
            self.statements.clear();
        }
        self.stepped = clock_stepped(&error);
        self.transient = ended || passing(&error) || self.stepped.is_some();
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
            Err(error) => return Err(self.failed(&format!("preparing {name}"), error)),
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

    /// The store's time, read now.
    fn server_now(&mut self) -> Result<i64> {
        Ok(self.store_time()?.0)
    }

    /// The store's time, read now, and the skew it is read with.
    fn store_time(&mut self) -> Result<(i64, i64)> {
        let rows = self.query(
            "server time",
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint - skew, skew
             FROM {s}.meta WHERE id = 1",
            &[],
        )?;
        Ok((rows[0].get(0), rows[0].get(1)))
    }

    /// A call sent at `sent` read the store's time `now`, and its answer is here: the offset
    /// as estimated from now on, and what it says of steps.
    fn observed(&mut self, now: i64, sent: i64) {
        self.offset = now - sent;
        let received = self.monotonic();
        self.steps.observed(now, sent, received);
    }

    /// The latest store time at which a call sent now can start (`check_clock`), if known.
    fn latest(&self) -> Option<i64> {
        self.steps.latest(self.monotonic())
    }

    /// After the server refused a call (`check_clock`) on the skew `seen`: measures the step
    /// afresh (the refused call may have been late for this process's own reasons, a pause
    /// between reading its clock and sending), and if the server's clock did step forward,
    /// adds the step to the skew, unless another process changed the skew since.
    fn absorb(&mut self, seen: i64) -> Result<()> {
        if let Some(client) = self.client.as_mut() {
            // The refused call's transaction, if it began one.
            let _ = client.batch_execute("ROLLBACK");
        }
        self.in_transaction = false;
        let sent = self.monotonic();
        let (now, skew) = self.store_time()?;
        let received = self.monotonic();
        if skew != seen {
            // Another process absorbed it (or another step) meanwhile.
            self.steps.bounds = None;
            self.observed(now, sent);
            return Ok(());
        }
        let Some(step) = self.steps.step(now, sent, received) else {
            self.observed(now, sent);
            return Ok(());
        };
        let moved = self.execute(
            "absorbing a step of the server's clock",
            "UPDATE {s}.meta SET skew = skew + $2 WHERE id = 1 AND skew = $1",
            &[&seen, &step],
        )?;
        // Absorbed, the store's time is back on the line the bounds were measured on.
        if moved == 1 {
            tracing::warn!(
                step_us = step,
                "the server's clock stepped forward; leases are judged as if it had not"
            );
        } else {
            self.steps.bounds = None;
        }
        Ok(())
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

    fn simple(&mut self, doing: &str, sql: &str) -> Result<()> {
        self.with(doing, |client| client.batch_execute(sql))
    }
}

/// Micros since `start`: this process's monotonic time, as the server's time is estimated on.
/// What a heartbeat's sweep deletes once past its time, each table by its own statement (see
/// `Storage::sweep`): lapsed rows, lapsed watchers, and tombstones of removals kept long enough.
const SWEEPS: [(&str, &str); 3] = [
    (
        "sweeping expired rows",
        "DELETE FROM {s}.locks WHERE ctid IN (
             SELECT ctid FROM {s}.locks WHERE expires_at - 0 <= $1 FOR UPDATE SKIP LOCKED)",
    ),
    (
        "sweeping lapsed watchers",
        "DELETE FROM {s}.watchers WHERE ctid IN (
             SELECT ctid FROM {s}.watchers WHERE expires_at - 0 <= $1 FOR UPDATE SKIP LOCKED)",
    ),
    (
        "sweeping the tombstones of removals",
        "DELETE FROM {s}.removed WHERE ctid IN (
             SELECT ctid FROM {s}.removed WHERE kept_until - 0 <= $1 FOR UPDATE SKIP LOCKED)",
    ),
];

/// The least forward step of the server's clock that is found (micros): more than a call's way
/// to the server and its queue there takes, as a rule.
const STEP_BOUND: i64 = 250_000;

/// Bounds on the store's time less this process's monotonic time, from the round trips that
/// read the store's time (`now`, between `sent` and `received`): the true offset is at most
/// `now - sent` and at least `now - received`, unless the server's clock stepped. Each bound
/// widens with time (the two clocks may drift apart, by up to `DRIFT` parts per million).
#[derive(Clone, Copy, Debug, Default)]
struct Steps {
    /// (upper, lower, when: this process's monotonic time of the latest round trip).
    bounds: Option<(i64, i64, i64)>,
}

/// How fast this process's monotonic clock and the server's may drift apart, in parts per
/// million: NTP slews a clock by at most 500.
const DRIFT: i64 = 1_000;

impl Steps {
    /// The bounds as of `at`, widened by the drift since they were measured.
    fn at(&self, at: i64) -> Option<(i64, i64)> {
        let (upper, lower, when) = self.bounds?;
        let drift = at.saturating_sub(when).max(0) / (1_000_000 / DRIFT);
        Some((upper + drift, lower - drift))
    }

    /// A round trip read the store's time `now` between `sent` and `received`.
    fn observed(&mut self, now: i64, sent: i64, received: i64) {
        let (upper, lower) = (now - sent, now - received);
        self.bounds = Some(match self.at(received) {
            // Below what was known: a backward step, or an absorbed one. Start over.
            Some((known_upper, _)) if upper < known_upper - STEP_BOUND => (upper, lower, received),
            Some((known_upper, known_lower)) => (
                upper.min(known_upper),
                lower.max(known_lower).min(upper.min(known_upper)),
                received,
            ),
            None => (upper, lower, received),
        });
    }

    /// The latest store time at which a call sent at `sent` can start, if anything is known.
    fn latest(&self, sent: i64) -> Option<i64> {
        self.at(sent).map(|(upper, _)| sent + upper + STEP_BOUND)
    }

    /// How far a round trip that read `now` between `sent` and `received` shows the server's
    /// clock stepped forward: enough to be sure the store's time runs no more ahead of this
    /// process's than before it (an overestimate, by up to the bounds' width and a round
    /// trip); `None` if it is within `STEP_BOUND` of what was known.
    fn step(&self, now: i64, sent: i64, received: i64) -> Option<i64> {
        let (upper, lower) = self.at(received)?;
        let late = (now - received) - upper;
        (late > STEP_BOUND).then_some((now - sent) - lower)
    }
}

fn micros_since(start: Instant) -> i64 {
    i64::try_from(start.elapsed().as_micros()).unwrap_or(i64::MAX)
}

fn row_view(row: &postgres::Row) -> RowView {
    RowView {
        key: row.get::<_, &str>(0).into(),
        mode: mode_of(row.get::<_, i64>(1)),
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
            hears_every_commit: false,
        }
    }

    fn again(&mut self) -> bool {
        if let Some(seen) = self.stepped.take() {
            // Absorbed (or found absorbed, or no step after all): the work is done again at
            // once; a failure to absorb waits the busy schedule, as any passing one.
            if self.absorb(seen).is_ok() {
                self.transient = false;
                return true;
            }
            self.transient = true;
        }
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
        let latest = self
            .latest()
            .map_or_else(|| "NULL".to_owned(), |latest| latest.to_string());
        let sql = format!(
            "BEGIN; SELECT {}.lock_keys('{{{}}}'::int4[], {schema_lock}, {latest})",
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
                Err(error) => return Err(self.failed("starting a write transaction", error)),
            }
        };
        let now = messages
            .iter()
            .rev()
            .find_map(|message| match message {
                SimpleQueryMessage::Row(row) => row.get(0).and_then(|text| text.parse().ok()),
                _ => None,
            })
            .ok_or_else(|| StorageError::new("starting a write transaction", "no server time"))?;
        self.observed(now, sent);
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
        let modes: Vec<i64> = requests.iter().map(|r| mode_code(r.mode)).collect();
        let operations: Vec<&str> = requests.iter().map(|r| r.operation.as_str()).collect();
        self.execute(
            "writing a request's rows",
            "INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held, requested_at,
                                    acquired_at, expires_at, heartbeat_at, keys)
             SELECT r.key, r.mode, r.operation, $4, $5, $6, $7, $8, $9, $7, $10
             FROM unnest($1::text[], $2::int8[], $3::text[]) AS r(key, mode, operation)",
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

    fn relabel(
        &mut self,
        owner: &str,
        keys: &[String],
        ticket: u64,
        operation: &str,
        now: i64,
    ) -> Result<usize> {
        let changed = self.execute(
            "setting a leader's value",
            "UPDATE {s}.locks SET operation = $1
             WHERE key = ANY($2) AND ticket = $3 AND owner = $4 AND held AND expires_at > $5",
            &[&operation, &keys, &sql_ticket(ticket), &owner, &now],
        )?;
        Ok(usize::try_from(changed).unwrap_or(usize::MAX))
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
        for (doing, sql) in SWEEPS {
            self.execute(doing, sql, &[&now])?;
        }
        Ok(())
    }

    /// Kept until the latest of the request's waiting rows' leases would have run out, and a
    /// day (or the lease, the row's own, if longer) after that.
    fn record_removal(&mut self, owner: &str, ticket: u64, by: &str, now: i64) -> Result<()> {
        self.execute(
            "recording a removal",
            "INSERT INTO {s}.removed AS r (owner, ticket, by_owner, kept_until)
             SELECT owner, ticket, $3,
                    max(greatest(expires_at, $4) + greatest(expires_at - heartbeat_at, $5))
             FROM {s}.locks WHERE owner = $1 AND ticket = $2 AND NOT held
             GROUP BY owner, ticket
             ON CONFLICT (owner, ticket) DO UPDATE
                 SET by_owner = EXCLUDED.by_owner, kept_until = EXCLUDED.kept_until",
            &[&owner, &sql_ticket(ticket), &by, &now, &TOMBSTONE_KEPT],
        )?;
        Ok(())
    }

    fn removals(&mut self, owner: &str, tickets: &[u64]) -> Result<Vec<(u64, String)>> {
        let tickets: Vec<i64> = tickets.iter().map(|&ticket| sql_ticket(ticket)).collect();
        let rows = self.query(
            "reading whether an operator removed waiting requests",
            "SELECT ticket, by_owner FROM {s}.removed WHERE owner = $1 AND ticket = ANY($2)",
            &[&owner, &tickets],
        )?;
        Ok(rows
            .iter()
            .map(|row| (ticket_of(row.get(0)), row.get(1)))
            .collect())
    }

    fn forget_removals(&mut self, owner: &str, tickets: &[u64]) -> Result<()> {
        let tickets: Vec<i64> = tickets.iter().map(|&ticket| sql_ticket(ticket)).collect();
        self.execute(
            "forgetting removals heard of",
            "DELETE FROM {s}.removed WHERE owner = $1 AND ticket = ANY($2)",
            &[&owner, &tickets],
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
                                - (SELECT skew FROM {s}.meta WHERE id = 1)
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

    fn wake_others(&mut self, freed: Option<&BTreeSet<String>>) {
        if let Some(owners) = freed {
            self.siblings.wake(owners);
        }
    }

    fn ring(&mut self, keys: &[String]) {
        self.siblings.wake(&BTreeSet::new());
        let mut hashes: Vec<i64> = keys.iter().map(|key| key_hash(key)).collect();
        hashes.sort_unstable();
        hashes.dedup();
        // The payload holds digits, commas or `*` only.
        let sql = format!(
            "SELECT pg_notify('{}', '{}')",
            channel(&self.schema),
            payload(&hashes)
        );
        if let Err(error) = self.simple("announcing a change", &sql) {
            tracing::debug!(%error, "a change could not be announced; watchers see it by their poll");
        }
    }

    /// Every release announces itself to owners that may be waiting (see `WATCHERS`).
    fn waiting(&mut self, waiting: bool) {
        self.siblings.waiting(waiting);
    }

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
                    mode: mode_of(row.get::<_, i64>(1)),
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

#[cfg(test)]
mod tests;
