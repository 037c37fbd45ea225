//! The worker's protocol: the commands a handle sends to its storage worker, and what comes
//! back. This is the interface between the public face (`manager.rs`, `guard.rs`,
//! `heartbeat.rs`) and the worker; neither side needs to know more of the other.

use std::sync::{Arc, Mutex};

use event_listener::Event;
use futures::channel::oneshot;

use super::storage::Row;
use super::{LockError, LockRequest};
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
    /// Another manager in this process committed to the same file: look now.
    Poke,
}

/// What a request does when it cannot be granted at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Takes a place in the queue (waiting rows) until it is granted.
    Queued,
    /// Waits without a row (`many`): it is refused (`NotNow`), and asks again whenever its
    /// keys may have changed.
    Unqueued,
    /// Does not wait (`try_acquire`): it is refused.
    No,
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
    /// Replies whether every row it had was still live (a release whose lease held).
    Remove {
        request: u64,
        reply: Option<Reply<bool>>,
    },
    /// Renew this owner's live rows, unless that was done less than half a heartbeat ago.
    /// Replies with when the rows were last renewed (micros, by the manager's clock).
    /// Every renewal asked for in one batch is one write: its replies.
    Renew { replies: Vec<Reply<i64>> },
    /// Delete every row of this owner and stop.
    Shutdown { reply: Reply<()> },
}

impl Write {
    /// Whether this write may delete rows, and so change what a request after it is granted.
    pub(super) fn may_free(&self) -> bool {
        matches!(self, Write::Remove { .. } | Write::Shutdown { .. })
    }
}

pub(crate) enum Acquired {
    Granted(Grant),
    Queued(u64, Arc<WaitSlot>),
    NotNow,
}

/// A granted request: its ticket, and when its rows' lease runs out unless renewed (clock
/// micros), so that a caller who reads the grant late can tell it is no longer good.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grant {
    pub(crate) ticket: u64,
    pub(crate) expires_at: i64,
}

/// Where a queued request learns that it was granted (or can never be).
#[derive(Debug, Default)]
pub(crate) struct WaitSlot {
    state: Mutex<SlotState>,
    event: Event,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotState {
    #[default]
    Waiting,
    /// Granted; the rows' lease runs out at this clock time (micros) unless renewed.
    Granted(i64),
    Expired,
    Shutdown,
}

impl WaitSlot {
    pub(super) fn set(&self, state: SlotState) {
        *lock(&self.state) = state;
        self.event.notify(usize::MAX);
    }

    fn get(&self) -> SlotState {
        *lock(&self.state)
    }

    /// Resolves with when the granted rows' lease runs out, `None` if it ran out while the
    /// request waited (its rows are gone: it may queue again), or `Shutdown`.
    pub(crate) async fn granted(&self) -> Result<Option<i64>, LockError> {
        loop {
            match wait_for(&self.event, || {
                Some(self.get()).filter(|s| *s != SlotState::Waiting)
            })
            .await
            {
                SlotState::Shutdown => return Err(LockError::Shutdown),
                SlotState::Expired => return Ok(None),
                SlotState::Granted(expires_at) => return Ok(Some(expires_at)),
                SlotState::Waiting => {}
            }
        }
    }
}
