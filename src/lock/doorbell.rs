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
//! when the folder changed), and a `sendto` per promoted owner and per marked manager. A socket
//! whose owner died (nobody bound: `ECONNREFUSED`) is removed with its marker by whoever rings
//! it.

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::Weak;
use std::time::{Duration, SystemTime};

use super::protocol::Command;
use super::storage::fnv1a;

/// How often the listening thread checks that its manager is still there.
const CHECK_EVERY: Duration = Duration::from_millis(500);

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
    /// The folder's modification time when `peers` was read, and the waiting peers' ids.
    listed: Option<SystemTime>,
    peers: Vec<String>,
}

impl Doorbell {
    /// Sets up the doorbell of a manager (`owner`) on the database at `db`, whose permission
    /// bits are `file_mode`, and starts the thread that pokes the worker through `poke`. `None`
    /// where it cannot be set up: the poll then does its work.
    pub(crate) fn open(
        db: &Path,
        owner: &str,
        file_mode: u32,
        poke: Weak<Sender<Command>>,
    ) -> Option<Doorbell> {
        let mut dir = db.as_os_str().to_owned();
        dir.push("-doorbell");
        let dir = PathBuf::from(dir);
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
        let made = make_dir(&dir, mode)
            .and_then(|()| {
                let _ = std::fs::remove_file(&socket_path);
                let socket = UnixDatagram::bind(&socket_path)?;
                std::fs::set_permissions(&socket_path, std::fs::Permissions::from_mode(mode))?;
                Ok(socket)
            })
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
        let _ = listener.set_read_timeout(Some(CHECK_EVERY));
        let started = std::thread::Builder::new()
            .name("leasehold-doorbell".into())
            .spawn(move || listen(&listener, &poke));
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
        })
    }

    /// Puts up or takes down this manager's marker.
    pub(crate) fn set_waiting(&mut self, waiting: bool) {
        if waiting == self.waiting {
            return;
        }
        let marker = self.dir.join(format!("{}.wait", self.id));
        let done = if waiting {
            std::fs::File::create(&marker).map(drop)
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
        let modified = std::fs::metadata(&self.dir).and_then(|m| m.modified()).ok();
        if modified.is_none() || modified != self.listed {
            self.listed = modified;
            self.peers = self.waiting_peers();
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

/// The listening thread: pokes the worker at every datagram, and stops once the worker is gone.
fn listen(listener: &UnixDatagram, poke: &Weak<Sender<Command>>) {
    let mut buffer = [0u8; 16];
    loop {
        let heard = listener.recv(&mut buffer).is_ok();
        let Some(tx) = poke.upgrade() else { return };
        if heard && tx.send(Command::Poke).is_err() {
            return;
        }
    }
}
