//! Wake-ups across processes for SQLite: a doorbell per manager beside the database file.
//!
//! Beside `locks.db` is a folder `locks.db-doorbell`. Each manager binds a Unix datagram socket
//! there (`<id>.sock`, `id` a digest of its owner), and a thread of its own waits on it and
//! pokes the storage worker when a datagram comes: the worker then looks at once, instead of at
//! its next `poll`. After a commit, one byte goes to
//!
//! - the owner of each request of another owner that the transaction promoted (a promoted row
//!   names its owner, so the ring is aimed: a commit on one key wakes only whom it concerns);
//! - every manager with callers waiting without a row (a `many`, refused): they have no row to
//!   be found by, and any commit that frees rows may let them through. While a manager has such
//!   callers, a marker `<id>.wait` says so; a commit that freed or promoted rows rings them all.
//!
//! The marker is put up before the read, or inside the transaction, that refuses such a caller:
//! a releaser commits after it (one writer at a time), so it sees the marker, and rings. A
//! release that committed before was seen by the refusal itself. A queued request needs no
//! marker: its promoter rings it by name. So a doorbell that works misses nothing; the poll
//! stays as the fallback where it cannot work (another OS, a folder that cannot be made, a
//! socket path longer than the system allows, a peer that crashed), and the worker's
//! correctness never depends on it.
//!
//! Ringing costs one `stat` of the folder when no marker is up (its listing is read again only
//! when the folder changed, and at every ring for a short while after a change: see invariant
//! 1), and a `sendto` per promoted owner and per marked manager. A socket
//! whose owner died (nobody bound: `ECONNREFUSED`) is removed with its marker by whoever rings
//! it.
//!
//! Invariants:
//!
//! 1. A listing is trusted only while the folder's modification time is the one it was read
//!    at, and that time was older than the reading by more than the filesystem's tick can be
//!    ([`trusted_after`]): filesystems keep coarse times (a kernel tick, a second, two on FAT),
//!    and a marker made in the same tick as the change before it leaves the time as it was.
//! 2. A manager's socket is where others ring it, or its listening thread binds it again
//!    within [`CHECK_EVERY`] (the folder was deleted, or the socket file): it then pokes the
//!    worker, which puts its marker up again if it waits, and looks for what it missed.

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::lock::backend::codec::fnv1a;
use crate::lock::backend::Poke;

/// How often the listening thread checks that its manager is still there, and that its socket
/// is (invariant 2).
const CHECK_EVERY: Duration = Duration::from_millis(500);

/// The coarsest modification times a filesystem keeps (FAT's two seconds): a listing read this
/// long after the folder last changed is trusted until it changes again (invariant 1).
const COARSE: Duration = Duration::from_secs(2);

/// The same for a time stamped by a fine clock: the kernel's tick, which is at most 10 ms
/// (Linux's lowest rate is 100 a second), with room for the tick the stamp lagged behind and
/// more.
const FINE: Duration = Duration::from_millis(50);

/// How long after `modified`, the folder's last change, a listing must have been read to be
/// trusted (invariant 1). A time with digits below the millisecond was stamped by a fine
/// clock, so a later change gets a later time once a tick has passed: [`FINE`]. Any other time
/// (whole seconds, two on FAT, hundredths on exFAT, or before 1970) may come from a coarse one:
/// [`COARSE`]. One in a million fine times falls on a whole millisecond, and waits the longer.
///
/// Until then every ring reads the listing again (an `opendir` and its reads, some 10 µs), and
/// the folder changes whenever a manager opens, closes or puts up a marker.
fn trusted_after(modified: SystemTime) -> Duration {
    let below_a_milli = modified
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.subsec_nanos() % 1_000_000);
    if below_a_milli == 0 {
        COARSE
    } else {
        FINE
    }
}

/// The longest socket path a `sockaddr_un` holds (108 bytes with the final NUL on Linux, 104 on
/// the BSDs: the smaller).
const MAX_SOCKET_PATH: usize = 103;

pub(crate) struct Doorbell {
    dir: PathBuf,
    id: String,
    /// An unbound socket to ring others with.
    sender: UnixDatagram,
    /// Whether this manager's marker is there.
    waiting: bool,
    /// The folder's modification time when `peers` was read, if `peers` may be trusted while it
    /// stays so (invariant 1), and the waiting peers' ids.
    listed: Option<SystemTime>,
    peers: Vec<String>,
    /// The database's permission bits, which the folder and the socket take.
    mode: u32,
    /// Set by the listening thread when it bound its socket again: the marker, if up, may have
    /// gone with the folder.
    rebound: Arc<AtomicBool>,
}

impl Doorbell {
    /// Sets up the doorbell of a manager (`owner`) on the database at `db`, whose permission
    /// bits are `file_mode`, and starts the thread that pokes the worker through `poke`. `None`
    /// where it cannot be set up: the poll then does its work.
    pub(crate) fn open(
        db: &Path,
        owner: &str,
        file_mode: u32,
        poke: Arc<dyn Poke>,
    ) -> Option<Doorbell> {
        let dir = folder_of(db);
        let id = id_of(owner);
        let socket_path = dir.join(format!("{id}.sock"));
        if socket_path.as_os_str().len() > MAX_SOCKET_PATH {
            tracing::debug!(
                path = %socket_path.display(),
                "no doorbell: the socket path is too long; other processes' changes are seen by \
                 the poll"
            );
            return None;
        }
        // Whoever may write the database may ring and may make a doorbell: the socket and the
        // folder follow the database's own permissions (an existing file keeps its own), not the
        // process umask, which `bind` would apply.
        let mode = database_mode(db).unwrap_or(file_mode);
        let made = bind(&dir, &socket_path, mode)
            .and_then(|listener| Ok((listener, UnixDatagram::unbound()?)));
        let (listener, sender) = match made {
            Ok(sockets) => sockets,
            Err(error) => {
                tracing::debug!(
                    %error,
                    dir = %dir.display(),
                    "no doorbell; other processes' changes are seen by the poll"
                );
                return None;
            }
        };
        let _ = sender.set_nonblocking(true);
        let rebound = Arc::new(AtomicBool::new(false));
        let listening = Listening {
            socket: listener,
            dir: dir.clone(),
            path: socket_path.clone(),
            mode,
            poke,
            rebound: rebound.clone(),
        };
        let started = std::thread::Builder::new()
            .name("leasehold-doorbell".into())
            .spawn(move || listening.run());
        if started.is_err() {
            let _ = std::fs::remove_file(&socket_path);
            return None;
        }
        Some(Doorbell {
            dir,
            id,
            sender,
            waiting: false,
            listed: None,
            peers: Vec::new(),
            mode,
            rebound,
        })
    }

    /// After the listening thread bound its socket again (invariant 2): puts the marker up
    /// again if it was up, the folder having perhaps gone with it. Cheap when nothing happened.
    pub(crate) fn refresh(&mut self) {
        if self.rebound.swap(false, Ordering::AcqRel) && self.waiting {
            self.waiting = false;
            self.set_waiting(true);
        }
    }

    /// Puts up or takes down this manager's marker.
    pub(crate) fn set_waiting(&mut self, waiting: bool) {
        if waiting == self.waiting {
            return;
        }
        let marker = self.dir.join(format!("{}.wait", self.id));
        let done = if waiting {
            // The folder may have been deleted since this manager made it.
            make_dir(&self.dir, self.mode).and_then(|()| std::fs::File::create(&marker).map(drop))
        } else {
            std::fs::remove_file(&marker)
        };
        match done {
            Ok(()) => self.waiting = waiting,
            Err(error) => tracing::debug!(%error, "the doorbell's marker could not be changed"),
        }
    }

    /// Rings every other manager with a marker up, and the managers of `owners`.
    pub(crate) fn ring(&mut self, owners: &BTreeSet<String>) {
        self.refresh();
        let modified = std::fs::metadata(&self.dir).and_then(|m| m.modified()).ok();
        if modified.is_none() || modified != self.listed {
            let read_at = SystemTime::now();
            self.peers = self.waiting_peers();
            // Trusted from now on only if the folder had not changed for a while (invariant 1).
            self.listed = modified.filter(|&modified| {
                read_at
                    .duration_since(modified)
                    .is_ok_and(|since| since > trusted_after(modified))
            });
        }
        let named = owners.iter().map(|owner| id_of(owner));
        let peers: BTreeSet<String> = self.peers.iter().cloned().chain(named).collect();
        let mut gone = false;
        for peer in peers.iter().filter(|peer| **peer != self.id) {
            let socket = self.dir.join(format!("{peer}.sock"));
            match self.sender.send_to(&[1], &socket) {
                Ok(_) => {}
                // Nobody is bound there (its process died, or it has no doorbell): clear its
                // marker and socket, if there.
                Err(error)
                    if matches!(
                        error.kind(),
                        ErrorKind::ConnectionRefused | ErrorKind::NotFound
                    ) =>
                {
                    let _ = std::fs::remove_file(self.dir.join(format!("{peer}.wait")));
                    let _ = std::fs::remove_file(&socket);
                    gone |= self.peers.contains(peer);
                }
                // A full buffer: it has been rung already and will look.
                Err(error) if error.kind() == ErrorKind::WouldBlock => {}
                // Not ours to ring (say, a socket another user made without the database's
                // permissions): its poll will see the change.
                Err(error) => tracing::debug!(%error, peer, "a doorbell could not be rung"),
            }
        }
        if gone {
            self.listed = None;
        }
    }

    fn waiting_peers(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                let id = name.strip_suffix(".wait")?;
                (id != self.id).then(|| id.to_owned())
            })
            .collect()
    }
}

impl Drop for Doorbell {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.join(format!("{}.wait", self.id)));
        let _ = std::fs::remove_file(self.dir.join(format!("{}.sock", self.id)));
    }
}

/// The name of `owner`'s socket and marker in the folder.
/// The doorbell folder beside the database at `db`.
pub(crate) fn folder_of(db: &Path) -> PathBuf {
    let mut dir = db.as_os_str().to_owned();
    dir.push("-doorbell");
    PathBuf::from(dir)
}

fn id_of(owner: &str) -> String {
    format!("{:016x}", fnv1a(owner.as_bytes()))
}

/// The permission bits of the database file at `db`.
fn database_mode(db: &Path) -> Option<u32> {
    Some(std::fs::metadata(db).ok()?.permissions().mode() & 0o777)
}

/// Makes the folder if it is not there, with the database's permissions (`mode`) plus the right
/// to enter it for whoever may read or write the database.
fn make_dir(dir: &Path, mode: u32) -> std::io::Result<()> {
    let mut mode = mode & 0o777;
    for shift in [0, 3, 6] {
        if mode >> shift & 0o6 != 0 {
            mode |= 0o7 << shift;
        }
    }
    match std::fs::create_dir(dir) {
        // Set after, as the umask would narrow the mode asked for at creation.
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)),
        Err(error) if error.kind() == ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(error) => Err(error),
    }
}

/// Makes the folder if it is not there and binds a socket at `path` in it, with the
/// database's permissions (`mode`).
fn bind(dir: &Path, path: &Path, mode: u32) -> std::io::Result<UnixDatagram> {
    make_dir(dir, mode)?;
    let _ = std::fs::remove_file(path);
    let socket = UnixDatagram::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    socket.set_read_timeout(Some(CHECK_EVERY))?;
    Ok(socket)
}

/// What the listening thread listens on, and how it binds it again.
struct Listening {
    socket: UnixDatagram,
    dir: PathBuf,
    path: PathBuf,
    mode: u32,
    poke: Arc<dyn Poke>,
    rebound: Arc<AtomicBool>,
}

impl Listening {
    /// Pokes the worker at every datagram; binds the socket again where it is gone (invariant
    /// 2); stops once the worker is gone.
    fn run(mut self) {
        let mut buffer = [0u8; 16];
        let mut bound = inode(&self.path);
        loop {
            let heard = self.socket.recv(&mut buffer).is_ok();
            if !self.poke.alive() {
                return;
            }
            if !heard && (bound.is_none() || inode(&self.path) != bound) {
                if let Ok(socket) = bind(&self.dir, &self.path, self.mode) {
                    self.socket = socket;
                    bound = inode(&self.path);
                    self.rebound.store(true, Ordering::Release);
                    tracing::debug!(path = %self.path.display(), "the doorbell's socket was gone; bound again");
                    // Rings may have been missed meanwhile: look.
                    if !self.poke.poke() {
                        return;
                    }
                }
                continue;
            }
            if heard && !self.poke.poke() {
                return;
            }
        }
    }
}

/// The inode of the file at `path`, if there is one.
fn inode(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|metadata| metadata.ino())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::backend::NoWorker;

    /// A peer bound at `id`'s socket in `dir`, with its marker up.
    fn waiting_peer(dir: &Path, id: &str) -> UnixDatagram {
        let socket = UnixDatagram::bind(dir.join(format!("{id}.sock"))).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        std::fs::File::create(dir.join(format!("{id}.wait"))).unwrap();
        socket
    }

    /// A marker put up in the same tick of the filesystem's clock as the change before it
    /// leaves the folder's modification time as it was (coarse times: a kernel tick, a second,
    /// two on FAT). Its manager is rung all the same: a listing read so soon after a change is
    /// never trusted to stand for the folder (invariant 1).
    #[test]
    fn a_marker_put_up_in_the_tick_of_the_last_listing_is_rung() {
        let folder = tempfile::tempdir().unwrap();
        let db = folder.path().join("locks.db");
        let mut doorbell = Doorbell::open(&db, "ringer", 0o600, Arc::new(NoWorker)).unwrap();
        let dir = doorbell.dir.clone();
        let first = waiting_peer(&dir, "first");
        let mut byte = [0u8; 1];
        doorbell.ring(&BTreeSet::new());
        first.recv(&mut byte).expect("the first peer was rung");
        // The second peer comes; the folder's time stays what it was.
        let unchanged = std::fs::metadata(&dir).unwrap().modified().unwrap();
        let second = waiting_peer(&dir, "second");
        std::fs::File::open(&dir)
            .unwrap()
            .set_modified(unchanged)
            .unwrap();
        doorbell.ring(&BTreeSet::new());
        second.recv(&mut byte).expect("the second peer was rung");
    }

    #[test]
    fn a_time_below_the_millisecond_is_trusted_after_a_tick_any_other_after_two_seconds() {
        let at = |nanos| UNIX_EPOCH + Duration::new(1_700_000_000, nanos);
        assert_eq!(trusted_after(at(123_456_789)), FINE);
        assert_eq!(trusted_after(at(1)), FINE);
        for coarse in [0, 500_000_000, 10_000_000, 7_000_000] {
            assert_eq!(trusted_after(at(coarse)), COARSE, "{coarse} ns");
        }
        assert_eq!(trusted_after(UNIX_EPOCH - Duration::from_nanos(1)), COARSE);
    }

    /// Whether a ring since the last look reached `peer`, without waiting: a ring sends before
    /// it returns.
    fn was_rung(peer: &UnixDatagram) -> bool {
        peer.set_nonblocking(true).unwrap();
        let mut rung = false;
        while peer.recv(&mut [0u8; 1]).is_ok() {
            rung = true;
        }
        rung
    }

    /// A listing read more than [`FINE`] after a change stamped by a fine clock is trusted, and
    /// not read again while the folder's time stays; one read as long after a change stamped in
    /// whole milliseconds is not. (Seen through a marker taken down with the folder's time put
    /// back: a trusted listing still names its peer.) A filesystem that keeps coarse times
    /// keeps no digits below the millisecond, and its listings wait the longer.
    #[test]
    fn a_listing_is_trusted_once_the_tick_of_the_last_change_has_passed() {
        for nanos in [123_457, 0] {
            let folder = tempfile::tempdir().unwrap();
            let db = folder.path().join("locks.db");
            let mut doorbell = Doorbell::open(&db, "ringer", 0o600, Arc::new(NoWorker)).unwrap();
            let dir = doorbell.dir.clone();
            let peer = waiting_peer(&dir, "peer");
            let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap() - 3 * FINE;
            let changed = UNIX_EPOCH + Duration::new(since.as_secs(), nanos);
            let set_time = || {
                let folder = std::fs::File::open(&dir).unwrap();
                folder.set_modified(changed).unwrap();
            };
            set_time();
            // What the filesystem kept, read apart from the rule under test (were it asked,
            // a rule that never trusts would expect itself).
            let kept = std::fs::metadata(&dir).unwrap().modified().unwrap();
            let trusted = kept.duration_since(UNIX_EPOCH).unwrap().subsec_nanos() % 1_000_000 != 0;
            doorbell.ring(&BTreeSet::new());
            assert!(was_rung(&peer), "a marked peer is rung");
            std::fs::remove_file(dir.join("peer.wait")).unwrap();
            set_time();
            doorbell.ring(&BTreeSet::new());
            assert_eq!(
                was_rung(&peer),
                trusted,
                "changed at {nanos} ns past the second"
            );
        }
    }
}
