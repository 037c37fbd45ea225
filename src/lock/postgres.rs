//! PostgreSQL storage, for owners on several machines that share one database.
//!
//! The same rows as SQLite's (`sqlite.rs`), in tables of a schema of their own, with three
//! differences that come from the machines being several:
//!
//! 1. **Time is the server's.** Every transaction reads `clock_timestamp()` once it holds its
//!    lock, and every expiry is written and compared in that time; clients' clocks, which drift
//!    between machines, never judge a lease. Between transactions the worker estimates the
//!    server's time from its own monotonic clock and the offset seen last.
//! 2. **Decisions are serialised by an advisory lock**, taken by every write transaction
//!    (`pg_advisory_xact_lock`, in a class of this library's own and keyed by the schema), so
//!    they never race and never need SERIALIZABLE retries; tickets come from a sequence, and on
//!    each key they follow grant order.
//! 3. **Wake-ups**: a transaction that deletes or promotes rows bumps a counter and sends a
//!    `NOTIFY`. Each manager has a listener thread with a connection of its own that `LISTEN`s
//!    and pokes the worker when one arrives (and after every `LISTEN`, since notifications are
//!    not kept across a disconnect); the worker then reads the counter and looks at the queues
//!    if it moved. Where `LISTEN` cannot work (a pooler in transaction mode), the counter is
//!    still read every `poll`.
//!
//! A connection that fails is opened again on the next call (at most every
//! [`RECONNECT_AFTER`]); rows live on the server, so guards survive a disconnect shorter than
//! their lease.

use std::collections::HashMap;
use std::sync::mpsc::Sender;
use std::sync::Weak;
use std::time::{Duration, Instant};

use postgres::fallible_iterator::FallibleIterator;
use postgres::types::ToSql;
use postgres::{Client, Config, NoTls, SimpleQueryMessage, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::grant::RowView;
use super::protocol::Command;
use super::storage::{
    mode_code, mode_of, sql_ticket, ticket_of, Deleted, OwnedRequest, Result, Row, Storage,
};
use super::{LockError, LockRequest};

/// The schema version this build writes and understands.
pub(crate) const SCHEMA_VERSION: i32 = 1;

/// The advisory lock class of this library (`pg_advisory_xact_lock(class, key)`), so that its
/// locks do not collide with an application's own advisory locks on other classes.
const LOCK_CLASS: i32 = 0x4c48_4c44; // "LHLD"

/// How long after a failed connection attempt the next one is made.
pub(crate) const RECONNECT_AFTER: Duration = Duration::from_millis(100);

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
}

/// Parses a libpq connection string or URL, with its TLS settings (see `postgres_tls.rs`).
pub(crate) fn parse(url: &str) -> std::result::Result<Target, LockError> {
    let (rest, settings) = super::postgres_tls::split(url)?;
    let mut config = rest.parse::<Config>().map_err(|error| {
        // The parser's message never quotes the string it was given, so no password leaks.
        LockError::InvalidConfig(format!(
            "the PostgreSQL connection string is invalid: {error}"
        ))
    })?;
    let (mode, tls) = super::postgres_tls::connector(&settings)?;
    config.ssl_mode(mode);
    Ok(Target { config, tls })
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
    last_attempt: Option<Instant>,
    /// The server's time less this process's monotonic time, as of the last reading (micros).
    offset: i64,
    /// Whether the open transaction freed or promoted rows, to announce with its commit.
    announcing: bool,
    started: Instant,
}

impl Postgres {
    /// Connects, creates or migrates the schema, and reads the server's time.
    pub(crate) fn connect(
        target: Target,
        schema: String,
        poke: Weak<Sender<Command>>,
    ) -> Result<Postgres> {
        let mut storage = Postgres {
            config: target.config,
            tls: target.tls,
            schema,
            client: None,
            statements: HashMap::new(),
            last_attempt: None,
            offset: 0,
            announcing: false,
            started: Instant::now(),
        };
        storage.client()?;
        let listener = Listener {
            config: storage.config.clone(),
            tls: storage.tls.clone(),
            channel: channel(&storage.schema),
            poke,
        };
        std::thread::Builder::new()
            .name("leasehold-listen".into())
            .spawn(move || listener.run())
            .map_err(|e| LockError::Storage(format!("while starting the listener thread: {e}")))?;
        Ok(storage)
    }

    fn monotonic(&self) -> i64 {
        i64::try_from(self.started.elapsed().as_micros()).unwrap_or(i64::MAX)
    }

    /// The open connection, opened (and the schema brought up to date) if there is none.
    fn client(&mut self) -> Result<&mut Client> {
        if self.client.as_ref().is_some_and(Client::is_closed) {
            self.client = None;
            self.statements.clear();
        }
        if self.client.is_none() {
            if self
                .last_attempt
                .is_some_and(|at| at.elapsed() < RECONNECT_AFTER)
            {
                return Err(LockError::Storage(format!(
                    "while connecting to {}: the last attempt failed less than {RECONNECT_AFTER:?} ago",
                    describe(&self.config)
                )));
            }
            self.last_attempt = Some(Instant::now());
            let connected = match &self.tls {
                Some(tls) => self.config.connect(tls.clone()),
                None => self.config.connect(NoTls),
            };
            let mut client = connected.map_err(|e| {
                storage_error(&format!("connecting to {}", describe(&self.config)), &e)
            })?;
            migrate(&mut client, &self.schema)?;
            self.last_attempt = None;
            self.client = Some(client);
            let now = self.server_now()?;
            self.offset = now - self.monotonic();
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    /// Runs `f` with the connection; a failure that closed it is noticed on the next call.
    fn with<T>(
        &mut self,
        doing: &str,
        f: impl FnOnce(&mut Client) -> std::result::Result<T, postgres::Error>,
    ) -> Result<T> {
        f(self.client()?).map_err(|e| storage_error(doing, &e))
    }

    /// The prepared statement named `name`, whose text `sql` names the schema `{s}`.
    fn statement(&mut self, name: &'static str, sql: &str) -> Result<Statement> {
        self.client()?;
        if let Some(statement) = self.statements.get(name) {
            return Ok(statement.clone());
        }
        let text = sql.replace("{s}", &quote(&self.schema));
        let client = self.client.as_mut().expect("connected above");
        let statement = client
            .prepare(&text)
            .map_err(|e| storage_error(&format!("preparing {name}"), &e))?;
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

    fn simple(&mut self, doing: &str, sql: &str) -> Result<()> {
        self.with(doing, |client| client.batch_execute(sql))
    }
}

/// The `NOTIFY` channel of a schema. A channel is an identifier, at most 63 bytes (a longer
/// one is an error for `pg_notify` and silently cut short by `LISTEN`), so a long schema name is
/// replaced by a digest of it.
fn channel(schema: &str) -> String {
    let channel = format!("leasehold_{schema}");
    if channel.len() <= 63 {
        return channel;
    }
    // FNV-1a: stable across processes and versions, unlike the standard library's hasher.
    let digest = schema
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    format!("leasehold_{digest:016x}")
}

/// Listens for other managers' announcements on a connection of its own, and pokes the worker
/// when one comes. Stops once the worker is gone.
struct Listener {
    config: Config,
    tls: Option<MakeRustlsConnect>,
    channel: String,
    poke: Weak<Sender<Command>>,
}

impl Listener {
    /// How often a listener with nothing to hear checks whether its manager is still there.
    const CHECK_EVERY: Duration = Duration::from_millis(500);

    /// Whether the worker is still there; pokes it if so.
    fn poke(&self) -> bool {
        match self.poke.upgrade() {
            Some(tx) => tx.send(Command::Poke).is_ok(),
            None => false,
        }
    }

    fn run(self) {
        let mut backoff = RECONNECT_AFTER;
        while self.poke.strong_count() > 0 {
            if let Err(error) = self.listen() {
                tracing::debug!(%error, "listening for other managers' changes stopped; again");
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            } else {
                return;
            }
        }
    }

    /// Listens until the connection fails (an error) or the worker is gone (`Ok`).
    fn listen(&self) -> std::result::Result<(), postgres::Error> {
        let mut client = match &self.tls {
            Some(tls) => self.config.connect(tls.clone())?,
            None => self.config.connect(NoTls)?,
        };
        client.batch_execute(&format!("LISTEN {}", quote(&self.channel)))?;
        // Whatever was announced before this LISTEN was not heard: look now.
        if !self.poke() {
            return Ok(());
        }
        let mut notifications = client.notifications();
        loop {
            let mut heard = notifications.timeout_iter(Self::CHECK_EVERY);
            while heard.next()?.is_some() {
                if !self.poke() {
                    return Ok(());
                }
            }
            if self.poke.strong_count() == 0 {
                return Ok(());
            }
        }
    }
}

/// `name` as a quoted identifier (it is validated too; quoting makes sure).
fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Creates the schema and its tables if missing, under an advisory lock so that several
/// processes starting at once do it once; refuses a schema from a newer version.
fn migrate(client: &mut Client, schema: &str) -> Result<()> {
    let s = quote(schema);
    let doing = "creating the schema";
    let mut transaction = client.transaction().map_err(|e| storage_error(doing, &e))?;
    transaction
        .execute(
            "SELECT pg_advisory_xact_lock($1, hashtext($2))",
            &[&LOCK_CLASS, &schema],
        )
        .map_err(|e| storage_error(doing, &e))?;
    let exists: bool = transaction
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.tables
                            WHERE table_schema = $1 AND table_name = 'meta')",
            &[&schema],
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
                     PRIMARY KEY (key, ticket)
                 );
                 CREATE INDEX ON {s}.locks (owner);"
            ))
            .map_err(|e| storage_error(doing, &e))?;
    }
    transaction.commit().map_err(|e| storage_error(doing, &e))
}

fn row_view(row: &postgres::Row, key: Option<&str>) -> RowView {
    let (key, first) = match key {
        Some(key) => (key.to_owned(), 0),
        None => (row.get::<_, String>(0), 1),
    };
    RowView {
        key,
        mode: mode_of(i64::from(row.get::<_, i16>(first))),
        ticket: ticket_of(row.get(first + 1)),
        held: row.get(first + 2),
    }
}

impl Storage for Postgres {
    fn now(&self) -> i64 {
        self.monotonic() + self.offset
    }

    fn change_version(&mut self) -> Result<i64> {
        let rows = self.query("changes", "SELECT changes FROM {s}.meta", &[])?;
        Ok(rows[0].get(0))
    }

    /// One round trip: the transaction, its decision lock, and the server's time once it
    /// holds the lock. (The schema name is validated, so it can stand in the text.)
    fn begin(&mut self) -> Result<i64> {
        self.announcing = false;
        let sql = format!(
            "BEGIN; SELECT pg_advisory_xact_lock({LOCK_CLASS}, hashtext('{}'));
             SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
            self.schema.replace('\'', "''")
        );
        let mut again = true;
        let messages = loop {
            match self.client()?.simple_query(&sql) {
                Ok(messages) => break messages,
                // The session was found ended (its connection cut, or the server restarted
                // since the last call): nothing was begun in it, so begin once more, on a new
                // connection.
                Err(error) if again && session_ended(&error) => {
                    again = false;
                    self.client = None;
                    self.statements.clear();
                }
                Err(error) => return Err(storage_error("starting a write transaction", &error)),
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
        self.offset = now - self.monotonic();
        Ok(now)
    }

    /// Sent with the commit, in its round trip.
    fn announce(&mut self) -> Result<()> {
        self.announcing = true;
        Ok(())
    }

    fn commit(&mut self) -> Result<()> {
        let sql = if std::mem::take(&mut self.announcing) {
            format!(
                "UPDATE {}.meta SET changes = changes + 1; SELECT pg_notify('{}', ''); COMMIT",
                quote(&self.schema),
                channel(&self.schema)
            )
        } else {
            "COMMIT".to_owned()
        };
        self.simple("committing", &sql)
    }

    fn rollback(&mut self) {
        self.announcing = false;
        if let Some(client) = self.client.as_mut() {
            let _ = client.batch_execute("ROLLBACK");
        }
    }

    fn rows_on_key(&mut self, key: &str, now: i64, into: &mut Vec<RowView>) -> Result<()> {
        let rows = self.query(
            "rows on a key",
            "SELECT mode, ticket, held FROM {s}.locks
             WHERE key = $1 AND expires_at > $2 ORDER BY ticket",
            &[&key, &now],
        )?;
        into.extend(rows.iter().map(|row| row_view(row, Some(key))));
        Ok(())
    }

    fn rows_on_waited_keys(&mut self, now: i64) -> Result<Vec<RowView>> {
        let rows = self.query(
            "rows on waited keys",
            "SELECT key, mode, ticket, held FROM {s}.locks
             WHERE expires_at > $1
               AND key IN (SELECT key FROM {s}.locks WHERE NOT held AND expires_at > $1)
             ORDER BY key, ticket",
            &[&now],
        )?;
        Ok(rows.iter().map(|row| row_view(row, None)).collect())
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
        for request in requests {
            self.execute(
                "writing a lock row",
                "INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held, requested_at,
                                        acquired_at, expires_at, heartbeat_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $7)",
                &[
                    &request.key,
                    &mode_code(request.mode),
                    &request.operation,
                    &owner,
                    &ticket,
                    &held,
                    &now,
                    &acquired_at,
                    &expires_at,
                ],
            )?;
        }
        Ok(())
    }

    fn promote(&mut self, key: &str, ticket: u64, now: i64) -> Result<()> {
        self.execute(
            "promoting a waiting request",
            "UPDATE {s}.locks SET held = true, acquired_at = $1,
                 expires_at = GREATEST(expires_at, $1 + (expires_at - heartbeat_at)),
                 heartbeat_at = GREATEST(heartbeat_at, $1)
             WHERE key = $2 AND ticket = $3 AND NOT held",
            &[&now, &key, &sql_ticket(ticket)],
        )?;
        Ok(())
    }

    fn delete_row(&mut self, owner: &str, key: &str, ticket: u64, now: i64) -> Result<Deleted> {
        let ticket = sql_ticket(ticket);
        if self.execute(
            "deleting a live row",
            "DELETE FROM {s}.locks
             WHERE key = $1 AND ticket = $2 AND owner = $3 AND expires_at > $4",
            &[&key, &ticket, &owner, &now],
        )? > 0
        {
            return Ok(Deleted::Live);
        }
        if self.execute(
            "deleting an expired row",
            "DELETE FROM {s}.locks WHERE key = $1 AND ticket = $2 AND owner = $3",
            &[&key, &ticket, &owner],
        )? > 0
        {
            return Ok(Deleted::Expired);
        }
        Ok(Deleted::Missing)
    }

    fn delete_owner(&mut self, owner: &str) -> Result<usize> {
        let deleted = self.execute(
            "deleting an owner's rows",
            "DELETE FROM {s}.locks WHERE owner = $1",
            &[&owner],
        )?;
        Ok(usize::try_from(deleted).unwrap_or(usize::MAX))
    }

    fn delete_expired(&mut self, now: i64) -> Result<usize> {
        let deleted = self.execute(
            "deleting expired rows",
            "DELETE FROM {s}.locks WHERE expires_at <= $1",
            &[&now],
        )?;
        Ok(usize::try_from(deleted).unwrap_or(usize::MAX))
    }

    fn renew(&mut self, owner: &str, now: i64, expires_at: i64) -> Result<usize> {
        let renewed = self.execute(
            "renewing leases",
            "UPDATE {s}.locks SET expires_at = $1, heartbeat_at = $2
             WHERE owner = $3 AND expires_at > $2",
            &[&expires_at, &now, &owner],
        )?;
        Ok(usize::try_from(renewed).unwrap_or(usize::MAX))
    }

    fn owned_requests(&mut self, owner: &str, now: i64) -> Result<Vec<OwnedRequest>> {
        let rows = self.query(
            "reading this owner's rows",
            "SELECT ticket, held, COUNT(*), MIN(expires_at) FROM {s}.locks
             WHERE owner = $1 AND expires_at > $2 GROUP BY ticket, held",
            &[&owner, &now],
        )?;
        Ok(rows
            .iter()
            .map(|row| OwnedRequest {
                ticket: ticket_of(row.get(0)),
                held: row.get(1),
                rows: usize::try_from(row.get::<_, i64>(2)).unwrap_or(0),
                expires_at: row.get(3),
            })
            .collect())
    }

    fn next_foreign_expiry(&mut self, owner: &str, now: i64) -> Result<Option<i64>> {
        let rows = self.query(
            "reading the next lease expiry",
            "SELECT MIN(expires_at) FROM {s}.locks WHERE expires_at > $1 AND owner <> $2",
            &[&now, &owner],
        )?;
        Ok(rows[0].get(0))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_fit_in_an_identifier_whatever_the_schema() {
        assert_eq!(channel("leasehold"), "leasehold_leasehold");
        let long = "s".repeat(63);
        assert!(channel(&long).len() <= 63);
        assert_ne!(channel(&long), channel(&"t".repeat(63)));
        assert_eq!(channel(&long), channel(&long));
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
