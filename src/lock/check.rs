//! Checks of a store as it is (`LockManagerBuilder::check`, `check_server`): its schema, its
//! rows, who may read and write it, its clock and its notifications. Every check reads; nothing
//! is changed, and a store that is not there is not made.

use std::fmt;
use std::path::Path;

use crate::clock::SystemClock;
use crate::lock::backend::sqlite::{
    storage_error as sqlite_storage_error, SCHEMA_VERSION as SQLITE_SCHEMA_VERSION,
};
use crate::lock::time::TimeLine;
use crate::lock::{LockError, StorageError};

/// One thing a check of a store found: something wrong, with what to do about it, or something
/// found as it should be, for the record. Made by
/// [`LockManagerBuilder::check`](crate::LockManagerBuilder::check) (and `check_server`).
///
/// Printed with `{}`: `ok: ` and what was found, or `problem: `, what is wrong, `; ` and the fix.
///
/// # Examples
///
/// ```
/// use leasehold::LockManager;
///
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("locks.db");
/// drop(LockManager::open(&path)?);
/// let findings = LockManager::builder().check(&path)?;
/// assert!(findings.iter().all(|finding| !finding.problem), "{findings:?}");
/// assert!(findings.iter().any(|finding| finding.what == "0 held, 0 waiting"));
/// # Ok::<(), leasehold::LockError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// Whether something is wrong.
    pub problem: bool,
    /// What was found.
    pub what: String,
    /// What to do about it, for a problem.
    pub fix: Option<String>,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.fix, self.problem) {
            (Some(fix), true) => write!(f, "problem: {}; {fix}", self.what),
            (None, true) => write!(f, "problem: {}", self.what),
            (_, false) => write!(f, "ok: {}", self.what),
        }
    }
}

/// The findings of the SQLite store at `path`.
pub(super) fn sqlite(path: &Path) -> Result<Vec<Finding>, LockError> {
    let mut findings = Findings::default();
    check_file(path, &mut findings)?;
    Ok(findings.list)
}

/// The findings of the PostgreSQL store in `schema` of the database at `url`.
#[cfg(feature = "postgres")]
pub(super) fn postgres(url: &str, schema: &str) -> Result<Vec<Finding>, LockError> {
    let mut findings = Findings::default();
    pg::check(url, schema, &mut findings)?;
    Ok(findings.list)
}

/// What the checks found, in order.
#[derive(Default)]
struct Findings {
    list: Vec<Finding>,
}

impl Findings {
    fn ok(&mut self, what: impl fmt::Display) {
        self.list.push(Finding {
            problem: false,
            what: what.to_string(),
            fix: None,
        });
    }

    fn problem(&mut self, what: impl fmt::Display, fix: impl fmt::Display) {
        self.list.push(Finding {
            problem: true,
            what: what.to_string(),
            fix: Some(fix.to_string()),
        });
    }

    /// Compares the schema version `found` (`None`: no store there) with this build's.
    fn schema(&mut self, found: Option<i64>, ours: i64) -> bool {
        match found {
            None | Some(0) => {
                self.problem(
                    "there is no lock store here",
                    "the first manager (`leasehold run`) creates it; check the path or schema",
                );
                false
            }
            Some(found) if found > ours => {
                self.problem(
                    format!("the schema is version {found}, newer than this build's {ours}"),
                    "use a build of leasehold as new as the processes that wrote it",
                );
                false
            }
            Some(found) if found < ours => {
                self.problem(
                    format!("the schema is version {found}, older than this build's {ours}"),
                    "the first manager of this build migrates it; upgrade every process that \
                     shares it together",
                );
                false
            }
            Some(found) => {
                self.ok(format!("schema version {found}, this build's"));
                true
            }
        }
    }

    /// Counts of rows: held, waiting, and lapsed (their owners stopped renewing them).
    fn rows(&mut self, held: i64, waiting: i64, lapsed: i64) {
        self.ok(format!("{held} held, {waiting} waiting"));
        if lapsed > 0 {
            self.ok(format!(
                "{lapsed} lapsed row(s), of owners that stopped renewing: invisible to every \
                 decision, swept at the next heartbeat of any holder"
            ));
        }
    }
}

/// Microseconds since the Unix epoch, by this machine's clock.
#[cfg(feature = "postgres")]
fn unix_micros() -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(now.as_micros()).unwrap_or(i64::MAX)
}

fn check_file(path: &Path, findings: &mut Findings) -> Result<(), LockError> {
    let doing = format!("checking the store {}", shown(path));
    if !path.is_file() {
        return Err(StorageError::new(doing, "there is no such file").into());
    }
    file_access(path, findings);
    let failed = |error: sqlite::Error| -> LockError { sqlite_storage_error(&doing, &error) };
    let flags = sqlite::OpenFlags::new().with_read_only().with_no_mutex();
    let conn = sqlite::Connection::open_with_flags(path, flags).map_err(failed)?;
    let version = pragma(&conn, "PRAGMA user_version").map_err(failed)?;
    let ours = SQLITE_SCHEMA_VERSION;
    if !findings.schema(Some(version), ours) {
        return Ok(());
    }
    // Leases are judged on the time line the store records: this machine's boot clock (or, for
    // managers whose clocks have none, the wall clock). Rows of an earlier boot are all dead.
    let recorded = {
        let mut statement = conn
            .prepare("SELECT line FROM time_line WHERE id = 1")
            .map_err(failed)?;
        match statement.next().map_err(failed)? {
            sqlite::State::Row => TimeLine::parse(&statement.read::<String, _>(0).map_err(failed)?),
            sqlite::State::Done => None,
        }
    };
    let now = match recorded {
        Some(line) => line.now(&SystemClock),
        None => None,
    };
    let Some(now) = now else {
        findings.ok(
            "its rows are of an earlier boot of this machine (or of another machine): none is \
             live, and the next manager to open it deletes them",
        );
        return Ok(());
    };
    // The row with the empty key keeps the ticket counter, and is no lock.
    let mut statement = conn
        .prepare(
            "SELECT
                 coalesce(sum(held AND expires_at > ?1), 0),
                 coalesce(sum(NOT held AND expires_at > ?1), 0),
                 coalesce(sum(expires_at <= ?1), 0)
             FROM locks WHERE key <> ''",
        )
        .map_err(failed)?;
    statement.bind((1, now)).map_err(failed)?;
    statement.next().map_err(failed)?;
    let count = |i: usize| statement.read::<i64, _>(i);
    let (held, waiting, lapsed) = (
        count(0).map_err(failed)?,
        count(1).map_err(failed)?,
        count(2).map_err(failed)?,
    );
    findings.rows(held, waiting, lapsed);
    Ok(())
}

fn pragma(conn: &sqlite::Connection, pragma: &str) -> Result<i64, sqlite::Error> {
    let mut statement = conn.prepare(pragma)?;
    statement.next()?;
    statement.read::<i64, _>(0)
}

/// The file's and its folder's modes and owners against the trust model: whoever may write
/// the file can take, hold or forge any lock; whoever may read it sees every key, operation and
/// owner; whoever may write its folder can replace it.
fn file_access(path: &Path, findings: &mut Findings) {
    use std::os::unix::fs::MetadataExt;

    let folder = match path.parent() {
        Some(folder) if !folder.as_os_str().is_empty() => folder,
        _ => Path::new("."),
    };
    for (file, what) in [
        (path.to_path_buf(), "the file"),
        (with_suffix(path, "-wal"), "its -wal file"),
        (with_suffix(path, "-shm"), "its -shm file"),
    ] {
        let Ok(metadata) = std::fs::metadata(&file) else {
            continue;
        };
        let mode = metadata.mode() & 0o777;
        if mode & 0o002 != 0 {
            findings.problem(
                format!(
                    "{what} {} is world-writable (mode {mode:03o}): any user can take, hold or \
                     forge any lock",
                    shown(&file)
                ),
                format!("chmod o-rw {}", shown(&file)),
            );
        } else if mode & 0o004 != 0 {
            findings.problem(
                format!(
                    "{what} {} is world-readable (mode {mode:03o}): any user sees every key, \
                     operation and owner",
                    shown(&file)
                ),
                format!("chmod o-r {}", shown(&file)),
            );
        } else if file == path {
            findings.ok(format!("the file's mode is {mode:03o}"));
        }
    }
    if let Ok(metadata) = std::fs::metadata(path) {
        let me = effective_uid();
        if metadata.uid() != me {
            findings.ok(format!(
                "the file belongs to user {}, not to you ({me}): every process that shares it \
                 needs to read and write it, its -wal and -shm files, and its folder",
                metadata.uid()
            ));
        }
    }
    if let Ok(metadata) = std::fs::metadata(folder) {
        let mode = metadata.mode() & 0o7777;
        if mode & 0o002 != 0 {
            findings.problem(
                format!(
                    "its folder {} is writable by every user (mode {mode:04o}): another user \
                     can create the file first, or (without the sticky bit) replace it",
                    shown(folder)
                ),
                "keep the store in a folder of the service's own, such as /var/lib/<service>",
            );
        }
    }
}

/// `path` as a finding names it.
fn shown(path: &Path) -> String {
    path.display().to_string()
}

fn with_suffix(path: &Path, suffix: &str) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    name.into()
}

#[allow(unsafe_code)]
fn effective_uid() -> u32 {
    // SAFETY: `geteuid` takes nothing, cannot fail and touches no memory of this process.
    unsafe { libc::geteuid() }
}

#[cfg(feature = "postgres")]
mod pg {
    use std::time::Duration;

    use ::postgres::fallible_iterator::FallibleIterator;

    use super::*;
    use crate::lock::backend::postgres::{parse, quote, schema_version, Target, SCHEMA_VERSION};

    /// The most this machine's clock may be off the server's before it is a problem worth
    /// fixing: leases are judged by the server's clock, but the times `inspect` shows are this
    /// machine's.
    const CLOCK_OFF: Duration = Duration::from_secs(2);

    pub(super) fn check(url: &str, schema: &str, findings: &mut Findings) -> Result<(), LockError> {
        let target = parse(url)?;
        let doing = format!("checking the store on {}", target.describe());
        let failed = |error: ::postgres::Error| -> LockError {
            let message = match error.as_db_error() {
                Some(db) => format!("{} ({})", db.message(), db.code().code()),
                None => error.to_string(),
            };
            StorageError::new(&doing, message).into()
        };
        let mut client = target.connect().map_err(failed)?;
        findings.ok(format!("connected to {}", target.describe()));
        clock(&mut client, findings).map_err(failed)?;
        let Some(version) = schema_version(&mut client, schema)? else {
            // As a missing file is: nothing to check, and nothing is made.
            let why = format!("there is no lock store in the schema {schema:?}");
            return Err(StorageError::new(&doing, why).into());
        };
        let s = quote(schema);
        if findings.schema(Some(i64::from(version)), i64::from(SCHEMA_VERSION)) {
            privileges(&mut client, schema, findings).map_err(failed)?;
            let row = client
                .query_one(
                    &format!(
                        "SELECT count(*) FILTER (WHERE held AND expires_at > now),
                                count(*) FILTER (WHERE NOT held AND expires_at > now),
                                count(*) FILTER (WHERE expires_at <= now)
                         FROM {s}.locks,
                              (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
                                      - skew AS now
                               FROM {s}.meta WHERE id = 1) AS t"
                    ),
                    &[],
                )
                .map_err(failed)?;
            findings.rows(row.get(0), row.get(1), row.get(2));
        }
        notifications(&target, &mut client, findings).map_err(failed)?;
        Ok(())
    }

    /// This machine's clock against the server's, which judges every lease.
    fn clock(
        client: &mut ::postgres::Client,
        findings: &mut Findings,
    ) -> Result<(), ::postgres::Error> {
        let before = unix_micros();
        let server: i64 = client
            .query_one(
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
                &[],
            )?
            .get(0);
        let after = unix_micros();
        let off = server - (before + after) / 2;
        let shown = format!("{} ms", off.unsigned_abs() / 1000);
        let way = if off >= 0 { "behind" } else { "ahead of" };
        if Duration::from_micros(off.unsigned_abs()) > CLOCK_OFF {
            findings.problem(
                format!("this machine's clock is {shown} {way} the server's"),
                "leases are judged by the server's clock, but the times shown here are off: \
                 check NTP on both",
            );
        } else {
            findings.ok(format!(
                "this machine's clock is within {shown} of the server's"
            ));
        }
        Ok(())
    }

    /// What the role may do with the schema's tables, sequence and functions.
    fn privileges(
        client: &mut ::postgres::Client,
        schema: &str,
        findings: &mut Findings,
    ) -> Result<(), ::postgres::Error> {
        let s = quote(schema);
        let row = client.query_one(
            // A list of privileges asks whether any of them is held: each is asked alone.
            "SELECT has_schema_privilege($1, 'USAGE'),
                    (SELECT bool_and(has_table_privilege($2, p))
                     FROM unnest('{SELECT,INSERT,UPDATE,DELETE}'::text[]) AS p),
                    (SELECT bool_and(has_table_privilege($3, p))
                     FROM unnest('{SELECT,UPDATE}'::text[]) AS p),
                    (SELECT bool_and(has_table_privilege($4, p))
                     FROM unnest('{SELECT,INSERT,UPDATE,DELETE}'::text[]) AS p),
                    has_sequence_privilege($5, 'USAGE'),
                    coalesce((SELECT bool_and(has_function_privilege(p.oid, 'EXECUTE'))
                              FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                              WHERE n.nspname = $6), true),
                    (SELECT bool_and(has_table_privilege($7, p))
                     FROM unnest('{SELECT,INSERT,UPDATE,DELETE}'::text[]) AS p)",
            &[
                &schema.to_owned(),
                &format!("{s}.locks"),
                &format!("{s}.meta"),
                &format!("{s}.watchers"),
                &format!("{s}.tickets"),
                &schema.to_owned(),
                &format!("{s}.removed"),
            ],
        )?;
        let missing: Vec<&str> = [
            "USAGE on the schema",
            "SELECT, INSERT, UPDATE, DELETE on its table locks",
            "SELECT, UPDATE on its table meta",
            "SELECT, INSERT, UPDATE, DELETE on its table watchers",
            "USAGE on its sequence tickets",
            "EXECUTE on its functions",
            "SELECT, INSERT, UPDATE, DELETE on its table removed",
        ]
        .into_iter()
        .enumerate()
        .filter(|&(i, _)| !row.get::<_, bool>(i))
        .map(|(_, what)| what)
        .collect();
        if missing.is_empty() {
            findings.ok("this role may read and write the lock tables and run their functions");
        } else {
            findings.problem(
                format!("this role lacks {}", missing.join("; ")),
                format!("GRANT them to it on the schema {schema:?}"),
            );
        }
        Ok(())
    }

    /// Whether a notification sent on one connection reaches another that listens: waiters are
    /// woken so. Behind a pooler in transaction mode it does not, and they wait for their poll.
    fn notifications(
        target: &Target,
        client: &mut ::postgres::Client,
        findings: &mut Findings,
    ) -> Result<(), ::postgres::Error> {
        let channel = format!("leasehold_doctor_{}", std::process::id());
        let mut listener = target.connect()?;
        listener.batch_execute(&format!("LISTEN {channel}"))?;
        client.execute("SELECT pg_notify($1, 'doctor')", &[&channel])?;
        let heard = listener
            .notifications()
            .timeout_iter(Duration::from_secs(3))
            .next()?
            .is_some();
        if heard {
            findings.ok("notifications arrive (LISTEN works): waiters are woken at once");
        } else {
            findings.problem(
                "a notification sent did not arrive within 3 s (a pooler in transaction mode?): \
                 waiters in other processes are woken only by their poll",
                "connect the lock managers to the server directly, or through a pooler in \
                 session mode",
            );
        }
        Ok(())
    }
}
