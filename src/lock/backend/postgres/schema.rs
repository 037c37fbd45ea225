//! The schema: its tables, the server-side functions of the two commonest writes (their SQL in
//! `functions.sql` beside this file), the advisory locks every write transaction takes, and
//! migrations from earlier versions.

use postgres::Client;

use super::storage_error;
use crate::lock::backend::codec::fnv1a;
use crate::lock::backend::Result;
use crate::lock::LockError;

/// The schema version this build writes and understands.
pub(crate) const SCHEMA_VERSION: i32 = 12;

/// The advisory lock class of this library (`pg_advisory_xact_lock(class, key)`), so that its
/// locks do not collide with an application's own advisory locks on other classes.
pub(crate) const LOCK_CLASS: i32 = 0x4c48_4c44; // "LHLD"

/// The class of the lock on a whole schema: taken shared, before its key locks, by a transaction
/// that decides on a few keys, and alone, exclusive, by one that decides on more than
/// [`MAX_KEY_LOCKS`] (a shutdown of an owner of thousands of locks, a `many` of hundreds of
/// keys), which then needs no key lock: the server's lock table holds only about 64 locks per
/// connection, and a statement at most 1,664 expressions.
const SCHEMA_CLASS: i32 = LOCK_CLASS + 1;

/// The most keys a transaction locks one by one.
const MAX_KEY_LOCKS: usize = 32;

/// The advisory locks of `keys` in `schema` (sorted, without repeats) and of the schema: what
/// every write transaction takes (`lock_keys` in `FUNCTIONS`).
pub(crate) fn key_locks(schema: &str, keys: &[String]) -> (Vec<i32>, i32) {
    let mut locks: Vec<i32> = keys.iter().map(|key| key_lock(schema, key)).collect();
    locks.sort_unstable();
    locks.dedup();
    (locks, key_lock(schema, ""))
}

/// The advisory lock of `key` in `schema`: the second half of `pg_advisory_xact_lock(class, id)`.
pub(super) fn key_lock(schema: &str, key: &str) -> i32 {
    let digest = fnv1a(format!("{schema}\0{key}").as_bytes());
    i32::from_ne_bytes(((digest ^ (digest >> 32)) as u32).to_ne_bytes())
}

/// `name` as a quoted identifier (it is validated too; quoting makes sure).
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The server-side halves of the two commonest writes, so that a batch of them takes one round
/// trip and one transaction (`decide`, for `Storage::decide_at_once`). They take the same
/// advisory locks as `begin`, read the time once they hold them, and delete the lapsed rows of
/// their keys before they read them, as every decision does.
///
/// The grant rule is written here a second time, in SQL, for the two questions these functions
/// ask (see `grant.rs` for the rule, permits included): whether a new request is granted now
/// (`grantable_now`, after `misfit`: a request of the other kind, or of another limit, than a
/// key's live rows is refused with nothing written), and which waiting requests on one key a
/// release lets through (`promotable`, for requests on that key alone: a request on several keys
/// is left to its owner, whom the announcement of the release wakes, and whose own look promotes
/// it). The backend's tests (`the_rule_in_sql`) check the two writings against each other on
/// generated rows of every mode, and the model test runs on both backends.
const FUNCTIONS: &str = include_str!("functions.sql");

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

/// Tombstones of operators' removals of waiting requests (`Storage::record_removal`): a row per
/// removed request, by which its owner tells a removal, which ends its wait, from a lapse of its
/// own rows, after which it queues again. Deleted once the owner has heard of it, or by the
/// sweep once past `kept_until`.
const REMOVED: &str = "
CREATE TABLE {s}.removed (
    owner text NOT NULL,
    ticket bigint NOT NULL,
    by_owner text NOT NULL,
    kept_until bigint NOT NULL,
    PRIMARY KEY (owner, ticket)
);
CREATE INDEX removed_sweep ON {s}.removed ((kept_until - 0));";

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
}

/// An error unless `schema` holds a lock store of this build's version: changes nothing.
pub(crate) fn check_version(client: &mut Client, schema: &str) -> Result<()> {
    let doing = format!("opening the store in the schema {schema:?}");
    let found = version(client, schema)?.map(i64::from);
    crate::lock::backend::schema_is_ours(&doing, found, i64::from(SCHEMA_VERSION))
}

/// The version of the lock store in `schema`, if there is one.
pub(crate) fn version(client: &mut Client, schema: &str) -> Result<Option<i32>> {
    let doing = "reading the schema version";
    let exists: bool = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{}.meta", quote(schema))],
        )
        .map_err(|e| storage_error(doing, e))?
        .get(0);
    if !exists {
        return Ok(None);
    }
    let found: i32 = client
        .query_one(&format!("SELECT version FROM {}.meta", quote(schema)), &[])
        .map_err(|e| storage_error(doing, e))?
        .get(0);
    Ok(Some(found))
}

/// Creates the schema and its tables if missing, under an advisory lock so that several
/// processes starting at once do it once; refuses a schema from a newer version.
pub(crate) fn migrate(client: &mut Client, schema: &str) -> Result<()> {
    let s = quote(schema);
    let doing = "creating the schema";
    let mut transaction = client.transaction().map_err(|e| storage_error(doing, e))?;
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
        .map_err(|e| storage_error(doing, e))?;
    transaction
        .execute(
            "SELECT pg_advisory_xact_lock($1, hashtext($2))",
            &[&LOCK_CLASS, &schema],
        )
        .map_err(|e| storage_error(doing, e))?;
    let exists: bool = transaction
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!("{s}.meta")],
        )
        .map_err(|e| storage_error(doing, e))?
        .get(0);
    if exists {
        let found: i32 = transaction
            .query_one(&format!("SELECT version FROM {s}.meta"), &[])
            .map_err(|e| storage_error("reading the schema version", e))?
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
                .map_err(|e| storage_error("migrating the schema to version 2", e))?;
        }
        if found < 3 {
            // Callers that wait without a row (see `WATCHERS`).
            transaction
                .batch_execute(&WATCHERS.replace("{s}", &s))
                .map_err(|e| storage_error("migrating the schema to version 3", e))?;
        }
        if found < 9 {
            // Operators' removals that stick (see `REMOVED`). A process of version 8 refuses
            // the schema from now on; processes sharing it must be upgraded together.
            transaction
                .batch_execute(&REMOVED.replace("{s}", &s))
                .map_err(|e| storage_error("migrating the schema to version 9", e))?;
        }
        if found < 10 {
            // Forward steps of the server's clock absorbed (`meta.skew`, `check_clock` in
            // `FUNCTIONS`): every function takes the caller's latest estimate of the store's
            // time, so the old ones go. A process of version 9 then finds none of its
            // functions, and fails: processes sharing the schema must be upgraded together.
            transaction
                .batch_execute(&format!(
                    "ALTER TABLE {s}.meta ADD COLUMN skew bigint NOT NULL DEFAULT 0;
                     DROP FUNCTION IF EXISTS {s}.lock_keys, {s}.decide, {s}.renew,
                         {s}.acquire_one, {s}.release_one;"
                ))
                .map_err(|e| storage_error("migrating the schema to version 10", e))?;
        }
        if found < 11 {
            // Permits: a mode is `mode_code`'s 64-bit integer, and the functions take modes of
            // that type, decide permits and answer misfits, so the old ones go. A process of version 10 refuses
            // the schema from now on; processes sharing it must be upgraded together.
            transaction
                .batch_execute(&format!(
                    "ALTER TABLE {s}.locks ALTER COLUMN mode TYPE bigint;
                     DROP FUNCTION IF EXISTS {s}.decide, {s}.acquire_one, {s}.release_one;"
                ))
                .map_err(|e| storage_error("migrating the schema to version 11", e))?;
        }
        if found < 12 {
            // Leaderships announced by the functions that write them (`p_announce`, and a
            // channel and payload for `acquire_one`): the old ones go.
            transaction
                .batch_execute(&format!(
                    "DROP FUNCTION IF EXISTS {s}.decide, {s}.acquire_one, {s}.release_one;"
                ))
                .map_err(|e| storage_error("migrating the schema to version 12", e))?;
        }
        if found < SCHEMA_VERSION {
            // One round trip per batch of acquisitions and releases: the functions of
            // `FUNCTIONS` (version 3 had one for an acquisition and one for a release; version
            // 4 had no shortcut for keys without other rows; version 5 judged an acquisition on
            // a read that a renewal in flight could make stale; version 6 had no heartbeat in
            // one call; version 7 had no functions for an operation alone on one key; version 8's
            // heartbeat swept no tombstones; version 9's judged by the server's clock as it
            // stepped; version 10's knew no permits; version 11's release judged a waiter on a
            // read that a renewal in flight could make stale, and left it waiting, and
            // announced no leadership); and the
            // sweep's indexes (`SWEEP_INDEXES`). A process of version 11 refuses the schema
            // from now on; processes sharing it must be upgraded together.
            transaction
                .batch_execute(&format!(
                    "DROP FUNCTION IF EXISTS {s}.acquire, {s}.release;
                     {}
                     {}
                     UPDATE {s}.meta SET version = {SCHEMA_VERSION};",
                    SWEEP_INDEXES.replace("{s}", &s),
                    functions(schema)
                ))
                .map_err(|e| storage_error("migrating the schema's functions", e))?;
        }
    } else {
        transaction
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {s};
                 CREATE TABLE {s}.meta (
                     id integer PRIMARY KEY CHECK (id = 1),
                     version integer NOT NULL,
                     changes bigint NOT NULL,
                     skew bigint NOT NULL DEFAULT 0
                 );
                 INSERT INTO {s}.meta (id, version, changes) VALUES (1, {SCHEMA_VERSION}, 0);
                 CREATE SEQUENCE {s}.tickets;
                 CREATE TABLE {s}.locks (
                     key text NOT NULL,
                     ticket bigint NOT NULL,
                     mode bigint NOT NULL,
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
                 {}
                 {}",
                WATCHERS.replace("{s}", &s),
                REMOVED.replace("{s}", &s),
                functions(schema)
            ))
            .map_err(|e| storage_error(doing, e))?;
    }
    transaction.commit().map_err(|e| storage_error(doing, e))
}
