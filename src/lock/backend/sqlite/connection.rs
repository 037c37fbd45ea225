//! Opening the database file: created with the permissions asked for, set up (write-ahead
//! logging, small pages), its schema brought up to date, and the identity of the file it opened
//! kept, to notice the file deleted or replaced under it.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlite::{Connection, OpenFlags};

use super::{retry_busy, storage_error, storage_failure, Db};
use crate::clock::Clock;
use crate::lock::backend::Result;
use crate::lock::LockError;
use crate::lock::StorageError;
use crate::schedule::Schedule;

/// How long the busy handler waits for the write lock inside each try; between tries refused
/// at once, the manager's busy schedule decides.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The busy handler's pauses, in milliseconds, one per call of a wait; then the last, again and
/// again. SQLite's own (`sqlite3_busy_timeout`): short at first, as most locks are let go
/// within a transaction's time.
const BUSY_PAUSES_MS: [u64; 12] = [1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50, 100];

/// What SQLite calls while another connection holds the lock a statement needs: counts the wait
/// into `lock_waits` at its first call (`tries` is 0), then pauses as `sqlite3_busy_timeout`
/// would and says to try again, until [`BUSY_TIMEOUT`] has passed in pauses. SQLite's own
/// handler, but for the count (`StorageStats::lock_waits`).
fn busy_handler(lock_waits: Arc<AtomicU64>) -> impl FnMut(usize) -> bool + Send + 'static {
    let mut waited = Duration::ZERO;
    move |tries| {
        if tries == 0 {
            lock_waits.fetch_add(1, Ordering::Relaxed);
            waited = Duration::ZERO;
        }
        let last = BUSY_PAUSES_MS[BUSY_PAUSES_MS.len() - 1];
        let pause = Duration::from_millis(BUSY_PAUSES_MS.get(tries).copied().unwrap_or(last))
            .min(BUSY_TIMEOUT.saturating_sub(waited));
        if pause.is_zero() {
            return false;
        }
        std::thread::sleep(pause);
        waited += pause;
        true
    }
}

/// Every connection's settings: write-ahead logging, synced at checkpoints, and for a new file
/// pages of 1 KiB (SQLite's default is 4 KiB; a file created with another page size keeps it).
///
/// Every commit appends each page it changed to the log, and each checkpoint (every 1,000
/// pages) syncs the log to disk, so the bytes a commit writes are most of its cost. A lock row
/// is about a hundred bytes, and an acquisition or a release changes one page whatever its
/// size: with 1 KiB pages the benchmark report's uncontended acquire and release took 17.7 µs
/// instead of 20.9–25.3 µs, and with 10,000 other keys held 19.4–20.3 µs instead of
/// 26.5–27.1 µs. A row whose names are near their longest allowed length spills into overflow
/// pages, a page or two more for that row.
const CONFIGURE: &str =
    "PRAGMA page_size = 1024; PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;";

/// Opens (creating if needed, with the permission bits `file_mode` on unix) the database at
/// `path`, or an in-memory one for `None`, sets it up and brings its schema up to date, waiting
/// on `busy` while another connection holds it, and counting each such wait into
/// `lock_waits`. With `existing`, opens only a file that is there with this build's schema, and
/// changes nothing in it.
pub(super) fn connect(
    path: Option<&Path>,
    file_mode: u32,
    busy: &Schedule,
    existing: bool,
    clock: &Arc<dyn Clock>,
    lock_waits: &Arc<AtomicU64>,
) -> Result<Connection> {
    let mut flags = OpenFlags::new().with_read_write().with_no_mutex();
    match path {
        Some(path) if existing => {
            if !path.is_file() {
                let doing = format!("opening the store {}", path.display());
                return Err(StorageError::new(doing, "there is no such file").into());
            }
        }
        Some(path) => {
            create_with_mode(path, file_mode);
            flags = flags.with_create();
        }
        None => flags = flags.with_create(),
    }
    let target = path.unwrap_or_else(|| Path::new(":memory:"));
    let mut conn =
        Connection::open_with_flags(target, flags).map_err(|e| open_error(target, &e))?;
    conn.set_busy_handler(busy_handler(lock_waits.clone()))
        .map_err(|e| storage_error("setting the busy handler", &e))?;
    let mut db = Db::new(&conn, clock.clone(), None, busy.clone());
    if existing {
        db.check_version(target)?;
        drop(db);
        return Ok(conn);
    }
    // Switching a new file to WAL takes an exclusive lock, and SQLite reports a clash with
    // another process opening it at the same moment as busy without waiting: retry.
    retry_busy("configuring the database", busy, || conn.execute(CONFIGURE))?;
    db.migrate()?;
    drop(db);
    Ok(conn)
}

/// Why the database at `path` could not be opened: SQLite's error, and what the path is, when
/// that explains it ("unable to open database file" alone does not).
fn open_error(path: &Path, error: &sqlite::Error) -> LockError {
    let doing = format!("opening the database {}", path.display());
    let folder = path
        .parent()
        .filter(|folder| !folder.as_os_str().is_empty());
    let why = if path.is_dir() {
        Some("the path is a folder, not a file".to_owned())
    } else if folder.is_some_and(|folder| !folder.is_dir()) {
        Some(format!(
            "its folder {} does not exist",
            folder.map_or_else(String::new, |folder| folder.display().to_string())
        ))
    } else {
        None
    };
    let failure = storage_failure(&doing, error);
    match why {
        Some(why) => failure.explained(&why).into(),
        None => failure.into(),
    }
}

/// Creates the database file with the permission bits `mode` (less the umask) if there is none
/// yet. SQLite then creates the `-wal` and `-shm` files with the main file's permissions, which
/// it would otherwise create world-readable. An existing file is not touched.
///
/// Only a file this call creates is opened (`create_new`), and it is closed at once: closing a
/// descriptor of a file drops every POSIX lock the process holds on it, so opening and closing a
/// database that another connection of this process uses would break that connection's locking.
/// Any failure (a missing directory, no permission) is left to the open that follows, which
/// reports it with SQLite's code.
#[cfg(unix)]
fn create_with_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path);
}

#[cfg(not(unix))]
fn create_with_mode(_path: &Path, _mode: u32) {}

/// Which file a path names (device and inode), to notice the file being deleted or replaced
/// under an open connection, which would go on working on the old file unseen by everyone else.
///
/// Looking the path up costs about two microseconds, a tenth of a write transaction, so a file
/// found in place is not looked at again for [`FileIdentity::RECHECK_AFTER`]: a manager stops
/// writing to a deleted or replaced file within that much of the change, and when writing in a
/// tight loop pays for one look per millisecond instead of one per transaction.
#[derive(Debug)]
pub(crate) struct FileIdentity {
    path: std::path::PathBuf,
    #[cfg(unix)]
    id: (u64, u64),
    /// When the path last named the file.
    seen_at: std::cell::Cell<Option<std::time::Instant>>,
}

impl FileIdentity {
    /// The identity of the file at `path` now; `None` where it cannot be told.
    pub(crate) fn of(path: &Path) -> Option<FileIdentity> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let metadata = std::fs::metadata(path).ok()?;
            Some(FileIdentity {
                path: path.to_path_buf(),
                id: (metadata.dev(), metadata.ino()),
                seen_at: std::cell::Cell::new(None),
            })
        }
        #[cfg(not(unix))]
        {
            let _ = path;
            None
        }
    }

    /// How long a file found in place is trusted to stay there.
    pub(crate) const RECHECK_AFTER: Duration = Duration::from_millis(1);

    /// An error if the path no longer names the file that was opened (as of at most
    /// [`RECHECK_AFTER`](Self::RECHECK_AFTER) ago).
    pub(crate) fn check(&self) -> Result<()> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            if self
                .seen_at
                .get()
                .is_some_and(|at| at.elapsed() < Self::RECHECK_AFTER)
            {
                return Ok(());
            }
            let same = std::fs::metadata(&self.path)
                .is_ok_and(|metadata| (metadata.dev(), metadata.ino()) == self.id);
            if !same {
                let doing = format!("checking the database file {}", self.path.display());
                let why = "it was deleted or replaced since this manager opened it, so its locks \
                           are no longer seen by anyone else; open a new manager";
                return Err(StorageError::new(doing, why).into());
            }
            self.seen_at.set(Some(std::time::Instant::now()));
        }
        Ok(())
    }
}
