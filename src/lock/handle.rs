//! What a `LockManager` handle is made of: the command sender to its storage worker, the calls
//! made through it, and what the handle's parts share (`state`).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::oneshot;

use crate::sync::lock;

use super::state::Common;
use super::worker::protocol;
use super::worker::protocol::{Command, CommandTx, Removed, Write};
use super::LockError;
use crate::lock::time::from_micros;

/// A handle: the command sender plus what is common.
pub(crate) struct Shared {
    // In an `Arc` so that other managers can poke this one through a `Weak` without ever
    // holding (and so possibly dropping, and joining) the whole handle.
    pub(super) tx: Arc<CommandTx>,
    pub(super) common: Arc<Common>,
    pub(super) next_request: AtomicU64,
    pub(super) worker: Mutex<Option<WorkerThread>>,
}

/// The storage worker's thread, and what tells that it has ended.
pub(crate) struct WorkerThread {
    pub(super) handle: std::thread::JoinHandle<()>,
    /// Disconnected when the thread's work is done (its sender is dropped as it ends).
    pub(super) ended: std::sync::mpsc::Receiver<()>,
}

impl Drop for Shared {
    /// The last handle is gone: disconnect the worker, and wait for it to delete this owner's
    /// rows and close the database, so that the file is settled when the drop returns: for at
    /// most half a heartbeat (when the storage is stuck, its statements' timeouts end them by
    /// then). After that the worker finishes in the background, and whatever it could not
    /// delete expires with its lease: a drop on an executor's thread never holds it longer.
    fn drop(&mut self) {
        drop(std::mem::replace(
            &mut self.tx,
            Arc::new(CommandTx::disconnected()),
        ));
        let worker = lock(&self.worker).take();
        let Some(worker) = worker else { return };
        if worker.handle.thread().id() == std::thread::current().id() {
            return;
        }
        match worker.ended.recv_timeout(self.common.heartbeat / 2) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => tracing::warn!(
                owner = %self.common.owner,
                "the storage thread did not finish closing within half a heartbeat; it goes on \
                 in the background"
            ),
            _ => {
                let _ = worker.handle.join();
            }
        }
    }
}

impl Shared {
    pub(super) fn send(&self, command: Command) -> Result<(), LockError> {
        self.tx.send(command).map_err(|_| LockError::Shutdown)
    }

    pub(super) async fn call<T>(
        &self,
        command: impl FnOnce(protocol::Reply<T>) -> Command,
    ) -> Result<T, LockError> {
        let (reply, response) = oneshot::channel();
        self.send(command(reply))?;
        self.common.replies.wait(response).await
    }

    /// Deletes a request's rows; returns what it found of them.
    pub(super) async fn remove(&self, request: u64) -> Result<Removed, LockError> {
        self.call(|reply| Command::remove(request, Some(reply)))
            .await
    }

    /// Renews this owner's rows (or finds them renewed recently); returns when, on the clock's
    /// monotonic time line.
    pub(super) async fn renew(&self) -> Result<Duration, LockError> {
        let at = self
            .call(|reply| {
                Command::Write(Write::Renew {
                    replies: vec![reply],
                })
            })
            .await?;
        Ok(from_micros(at))
    }
}
