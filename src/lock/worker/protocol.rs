//! The worker's protocol: the commands a handle sends to its storage worker, and what comes
//! back. This is the interface between the public face (`manager.rs`, `guard.rs`,
//! `heartbeat.rs`) and the worker; neither side needs to know more of the other.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SendError, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use event_listener::Event;
use futures::channel::oneshot;
use futures::task::AtomicWaker;

use crate::lock::backend::Poke;
use crate::lock::backend::Row;
pub(crate) use crate::lock::backend::Wait;
use crate::lock::{LockError, LockRequest};
use crate::sync::{lock, wait_for};

pub(crate) type Reply<T> = oneshot::Sender<Result<T, LockError>>;

pub(crate) enum Command {
    /// A change, run in the batch's write transaction.
    Write(Write),
    Inspect {
        key: Option<String>,
        reply: Reply<Vec<Row>>,
    },
    IsLocked {
        key: String,
        reply: Reply<bool>,
    },
    /// An operator's removal of another owner's rows of these requests (by ticket; `None`:
    /// all of them); replies how many there were. Run alone, after the batch's writes.
    Evict {
        owner: String,
        tickets: Option<Vec<u64>>,
        reply: Reply<usize>,
    },
    /// Sets the operation of this owner's held request (a leader's new value); replies how
    /// many rows it changed (0: they are gone or lapsed). Run alone, after the batch's writes.
    Relabel {
        request: u64,
        operation: String,
        reply: Reply<usize>,
    },
    /// Another manager in this process committed to the same file: look now.
    Poke,
}

pub(crate) enum Write {
    /// Grant now, or queue (`Wait::Queued`), or report `NotNow`.
    /// `announce`: a leadership, announced to every other manager of the store whenever it
    /// is granted at once or its rows are deleted, whoever waits (observers do not).
    Acquire {
        request: u64,
        requests: Vec<LockRequest>,
        wait: Wait,
        announce: bool,
        reply: Reply<Acquired>,
    },
    /// Delete this owner's rows of a request, whatever their state (release or cancel).
    /// Replies what it found of them (a release whose lease held found them all live).
    Remove {
        request: u64,
        reply: Option<Reply<Removed>>,
    },
    /// Renew this owner's live rows, unless that was done less than half a heartbeat ago.
    /// Replies with when the rows were last renewed (micros, by the manager's clock).
    /// Every renewal asked for in one batch is one write: its replies.
    Renew { replies: Vec<Reply<i64>> },
    /// Delete every row of this owner and stop.
    Shutdown { reply: Reply<()> },
}

/// What a removal found of its request's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Removed {
    /// Every row, live: nobody else can have held the lock meanwhile.
    AllLive,
    /// Some row lapsed or gone.
    NotAllLive,
    /// None, on a try after one whose answer was lost (a connection cut as the server answered):
    /// that try may have deleted them, so the database cannot tell whether they were live. The
    /// caller judges by the lease as it knows it, and by `since`: the storage's time at the
    /// first try that may have deleted them (none can have deleted them earlier), so rows whose
    /// lease had run out by then were lost, whatever this process's clock says.
    GoneAfterLostAnswer { since: i64 },
}

impl Command {
    /// The removal of `request`'s rows, whatever their state (a release, or the clean-up of an
    /// acquisition given up), answered on `reply` if there is one.
    pub(crate) fn remove(request: u64, reply: Option<Reply<Removed>>) -> Command {
        Command::Write(Write::Remove { request, reply })
    }
}

/// The sending side of a worker's commands. A worker on a thread of its own blocks on the
/// channel, which wakes it; one that is driven as a task awaits the channel, and every send,
/// and the drop of the last sender, wakes its `waker`.
pub(crate) struct CommandTx {
    /// `None` only while dropping: the channel disconnects before the waker is woken, so the
    /// woken worker finds it disconnected.
    tx: Option<Sender<Command>>,
    /// The waker of a worker driven as a task; `None` for one on a thread of its own.
    waker: Option<Arc<AtomicWaker>>,
}

/// A channel of commands, the sender waking `waker` (a worker driven as a task), if given.
pub(crate) fn commands(waker: Option<Arc<AtomicWaker>>) -> (CommandTx, Receiver<Command>) {
    let (tx, rx) = mpsc::channel();
    let sender = CommandTx {
        tx: Some(tx),
        waker,
    };
    (sender, rx)
}

impl CommandTx {
    /// Sends `command`; an error once the worker is gone.
    pub(crate) fn send(&self, command: Command) -> Result<(), SendError<Command>> {
        let sent = match &self.tx {
            Some(tx) => tx.send(command),
            None => Err(SendError(command)),
        };
        self.wake();
        sent
    }

    /// A sender that reaches no worker: what a handle that shut down keeps.
    pub(crate) fn disconnected() -> CommandTx {
        let (tx, _) = mpsc::channel();
        CommandTx {
            tx: Some(tx),
            waker: None,
        }
    }

    fn wake(&self) {
        if let Some(waker) = &self.waker {
            waker.wake();
        }
    }
}

impl Drop for CommandTx {
    fn drop(&mut self) {
        drop(self.tx.take());
        self.wake();
    }
}

/// The worker's side of a backend's `Poke`: a command sender that does not keep the worker.
impl Poke for Weak<CommandTx> {
    fn poke(&self) -> bool {
        self.upgrade()
            .is_some_and(|tx| tx.send(Command::Poke).is_ok())
    }

    fn alive(&self) -> bool {
        self.strong_count() > 0
    }
}

impl Write {
    /// Whether this write may delete rows, and so change what a request after it is granted.
    pub(crate) fn may_free(&self) -> bool {
        matches!(self, Write::Remove { .. } | Write::Shutdown { .. })
    }
}

pub(crate) enum Acquired {
    Granted(Grant),
    Queued(u64, Arc<WaitSlot>),
    NotNow,
}

/// A granted request: its ticket, and when its lease began. The worker keeps the lease from the
/// moment it decided the grant (see `state::held::Guards`), so that a caller who reads the grant
/// late can tell whether it is still good (`Guards::signal`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    pub(crate) ticket: u64,
    /// When the lease began, on the clock's monotonic time line: the lock heartbeat beats first
    /// one heartbeat after it.
    pub(crate) began: Duration,
}

/// Where a queued request learns that it was granted (or can never be), and that it has waited
/// long enough to start its heartbeat (see [`WaitSlot::beat_due`]).
#[derive(Debug, Default)]
pub(crate) struct WaitSlot {
    state: Mutex<SlotState>,
    /// Set once by the worker when the wait has lasted long enough for its heartbeat; taken by
    /// the waiting caller, which starts the heartbeat itself.
    beat: AtomicBool,
    event: Event,
}

#[derive(Debug, Default, Clone)]
pub(crate) enum SlotState {
    #[default]
    Waiting,
    Granted(Grant),
    /// Its rows are gone, by a lapse: it may queue again.
    Expired,
    /// Its rows were removed by an operator, `by`: it does not queue again.
    Removed {
        by: String,
    },
    Shutdown,
}

/// What woke a queued request's caller.
#[derive(Debug)]
pub(crate) enum Woken {
    Granted(Grant),
    /// Its lease ran out while it waited (its rows are gone): it may queue again.
    Lapsed,
    /// It still waits, and has waited long enough to start its heartbeat (told once).
    BeatDue,
}

impl WaitSlot {
    pub(crate) fn set(&self, state: SlotState) {
        *lock(&self.state) = state;
        self.event.notify(usize::MAX);
    }

    /// The wait has lasted long enough for its heartbeat (a quarter of a heartbeat:
    /// `worker::beat_after`): most waits end long before their first renewal is due, so the
    /// caller forks the heartbeat's fiber only when told this.
    pub(crate) fn beat_due(&self) {
        self.beat.store(true, Ordering::SeqCst);
        self.event.notify(usize::MAX);
    }

    fn woken(&self) -> Option<Result<Woken, LockError>> {
        match &*lock(&self.state) {
            SlotState::Shutdown => return Some(Err(LockError::Shutdown)),
            SlotState::Expired => return Some(Ok(Woken::Lapsed)),
            SlotState::Removed { by } => return Some(Err(LockError::Removed { by: by.clone() })),
            SlotState::Granted(grant) => return Some(Ok(Woken::Granted(*grant))),
            SlotState::Waiting => {}
        }
        self.beat
            .swap(false, Ordering::SeqCst)
            .then_some(Ok(Woken::BeatDue))
    }

    /// Resolves with what ended the wait (the grant; `Lapsed` if the request's lease ran out
    /// while it waited; `Removed` if an operator removed it; `Shutdown`), or with `BeatDue`
    /// once, while it still waits, when its heartbeat is due to start.
    pub(crate) async fn woken_by(&self) -> Result<Woken, LockError> {
        wait_for(&self.event, || self.woken()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn woken(slot: &WaitSlot) -> Option<Result<Woken, LockError>> {
        futures::FutureExt::now_or_never(slot.woken_by())
    }

    #[test]
    fn a_due_heartbeat_is_told_once_and_only_while_the_request_waits() {
        let slot = WaitSlot::default();
        assert!(woken(&slot).is_none(), "woken before anything happened");
        slot.beat_due();
        assert!(matches!(woken(&slot), Some(Ok(Woken::BeatDue))));
        assert!(woken(&slot).is_none(), "told twice");
        // Due as the wait ends: the end is told, the beat never.
        let grant = Grant {
            ticket: 1,
            began: Duration::ZERO,
        };
        let removed = SlotState::Removed { by: "op".into() };
        for end in [
            SlotState::Granted(grant),
            SlotState::Expired,
            removed,
            SlotState::Shutdown,
        ] {
            let slot = WaitSlot::default();
            slot.beat_due();
            slot.set(end.clone());
            for _ in 0..2 {
                let told = woken(&slot).expect("the end is told");
                assert!(
                    !matches!(told, Ok(Woken::BeatDue)),
                    "a beat told after {end:?}"
                );
            }
        }
    }
}
