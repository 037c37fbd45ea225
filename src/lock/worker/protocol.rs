//! The worker's protocol: the commands a handle sends to its storage worker, and what comes
//! back. This is the interface between the public face (`manager.rs`, `guard.rs`,
//! `heartbeat.rs`) and the worker; neither side needs to know more of the other.

use std::sync::mpsc::{self, Receiver, SendError, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use event_listener::Event;
use futures::channel::oneshot;
use futures::task::AtomicWaker;

use crate::abort::AbortSignal;
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
    /// Another manager in this process committed to the same file: look now.
    Poke,
}

pub(crate) enum Write {
    /// Grant now, or queue (`Wait::Queued`), or report `NotNow`.
    Acquire {
        request: u64,
        requests: Vec<LockRequest>,
        wait: Wait,
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

/// A granted request: its ticket, and its lease as this process knows it, kept by the worker
/// from the moment it decided the grant (see `state::held::Guards`), so that a caller who reads the
/// grant late can tell whether it is still good.
#[derive(Clone, Debug)]
pub(crate) struct Grant {
    pub(crate) ticket: u64,
    /// Aborted once the lease is lost: by its deadline, or when its rows are found gone.
    pub(crate) lost: AbortSignal,
    /// When the lease began, on the clock's monotonic time line: the lock heartbeat beats first
    /// one heartbeat after it.
    pub(crate) began: Duration,
}

/// Where a queued request learns that it was granted (or can never be), and what starts its
/// heartbeat should it wait long (see [`WaitSlot::arm`]).
#[derive(Debug, Default)]
pub(crate) struct WaitSlot {
    state: Mutex<SlotState>,
    event: Event,
    beat: Mutex<Beat>,
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

/// The start of a waiter's heartbeat: most waits end long before their first renewal is due,
/// so the heartbeat's fiber is forked only once the wait has lasted a while (a quarter of a
/// heartbeat: `worker::beat_after`), when the worker calls `WaitSlot::beat_due`.
#[derive(Default)]
enum Beat {
    /// Neither armed nor due yet.
    #[default]
    Unarmed,
    /// What starts the heartbeat, waiting for its time.
    Armed(Box<dyn FnOnce() + Send>),
    /// Its time came before it was armed: `arm` starts it at once.
    Due,
    /// Started, or never to start (the wait is over).
    Over,
}

impl std::fmt::Debug for Beat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Beat::Unarmed => "Unarmed",
            Beat::Armed(_) => "Armed",
            Beat::Due => "Due",
            Beat::Over => "Over",
        })
    }
}

impl WaitSlot {
    pub(crate) fn set(&self, state: SlotState) {
        let over = !matches!(state, SlotState::Waiting);
        *lock(&self.state) = state;
        if over {
            // The wait is over: its heartbeat never starts. Dropped outside the lock: what it
            // holds may be the last handle on the manager.
            let beat = std::mem::replace(&mut *lock(&self.beat), Beat::Over);
            drop(beat);
        }
        self.event.notify(usize::MAX);
    }

    /// Hands the slot what starts the waiter's heartbeat: run when the worker says it is due,
    /// or now if it said so already; dropped unrun if the wait ends first.
    pub(crate) fn arm(&self, start: Box<dyn FnOnce() + Send>) {
        let mut beat = lock(&self.beat);
        match std::mem::replace(&mut *beat, Beat::Over) {
            Beat::Unarmed => *beat = Beat::Armed(start),
            Beat::Due => {
                drop(beat);
                start();
            }
            // Armed once only: the first stays.
            armed @ Beat::Armed(_) => *beat = armed,
            Beat::Over => {}
        }
    }

    /// The wait has lasted long enough for its heartbeat: starts it, or has `arm` start it.
    pub(crate) fn beat_due(&self) {
        let mut beat = lock(&self.beat);
        match std::mem::replace(&mut *beat, Beat::Over) {
            Beat::Armed(start) => {
                drop(beat);
                start();
            }
            Beat::Unarmed => *beat = Beat::Due,
            Beat::Due | Beat::Over => {}
        }
    }

    fn get(&self) -> SlotState {
        lock(&self.state).clone()
    }

    /// Resolves with the grant, `None` if the request's lease ran out while it waited (its rows
    /// are gone: it may queue again), `Removed` if an operator removed it, or `Shutdown`.
    pub(crate) async fn granted(&self) -> Result<Option<Grant>, LockError> {
        loop {
            match wait_for(&self.event, || {
                Some(self.get()).filter(|s| !matches!(s, SlotState::Waiting))
            })
            .await
            {
                SlotState::Shutdown => return Err(LockError::Shutdown),
                SlotState::Expired => return Ok(None),
                SlotState::Removed { by } => return Err(LockError::Removed { by }),
                SlotState::Granted(grant) => return Ok(Some(grant)),
                SlotState::Waiting => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A start that counts its runs.
    fn counted(runs: &Arc<AtomicUsize>) -> Box<dyn FnOnce() + Send> {
        let runs = runs.clone();
        Box::new(move || {
            runs.fetch_add(1, Ordering::SeqCst);
        })
    }

    #[test]
    fn a_heartbeat_starts_once_when_due_whether_armed_before_or_after() {
        // Armed, then due: the worker's call starts it.
        let (slot, runs) = (WaitSlot::default(), Arc::new(AtomicUsize::new(0)));
        slot.arm(counted(&runs));
        assert_eq!(runs.load(Ordering::SeqCst), 0, "started before it was due");
        slot.beat_due();
        slot.beat_due();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Due before the waiting call armed it (its task slow to hear it queued): arming starts it.
        let (slot, runs) = (WaitSlot::default(), Arc::new(AtomicUsize::new(0)));
        slot.beat_due();
        slot.arm(counted(&runs));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Armed twice: the first start stays, and runs once.
        let (slot, first, second) = (
            WaitSlot::default(),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        slot.arm(counted(&first));
        slot.arm(counted(&second));
        slot.beat_due();
        assert_eq!(first.load(Ordering::SeqCst), 1);
        assert_eq!(second.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_heartbeat_never_starts_once_the_wait_is_over() {
        let granted = SlotState::Granted(Grant {
            ticket: 1,
            lost: AbortSignal::never(),
            began: Duration::ZERO,
        });
        let removed = SlotState::Removed { by: "op".into() };
        for end in [granted, SlotState::Expired, removed, SlotState::Shutdown] {
            let (slot, runs) = (WaitSlot::default(), Arc::new(AtomicUsize::new(0)));
            slot.arm(counted(&runs));
            slot.set(end.clone());
            slot.beat_due();
            assert_eq!(runs.load(Ordering::SeqCst), 0, "started after {end:?}");
            // Nor when armed after the end (a late task), however due.
            let (slot, runs) = (WaitSlot::default(), Arc::new(AtomicUsize::new(0)));
            slot.set(end.clone());
            slot.beat_due();
            slot.arm(counted(&runs));
            assert_eq!(runs.load(Ordering::SeqCst), 0, "started after {end:?}");
        }
    }
}
