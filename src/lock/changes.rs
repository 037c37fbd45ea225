//! [`LockManager::changes`]: the rows under a key prefix, each time they change.
//!
//! Invariants:
//!
//! 1. While a `Changes` lives, its manager is a watcher of every change: its worker looks for
//!    other processes' commits on its poll and announces each (and each of its own) by
//!    notifying `Common::changed`.
//! 2. Listen, then read, then wait: a change between a read and the wait is heard, so no change
//!    is missed, though several may be reported as one.
//! 3. A change is a difference in anything but the lease times (who holds or waits, in which
//!    mode and state, for what operation): a heartbeat is not a change. A lapse is one: the
//!    stream reads again when the earliest lease it showed runs out, by the manager's clock.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::select;
use futures::stream::{self, BoxStream, Stream, StreamExt};

use super::state::Common;
use super::worker::protocol::Command;
use super::{EntryState, LockEntry, LockError, LockManager, Mode};

/// Every change of the rows under a key prefix: a [`Stream`] of the live rows, as
/// [`LockManager::inspect`] lists them, first as they are and then after each change. Made by
/// [`LockManager::changes`].
///
/// Errors of a read are items too; after [`LockError::Shutdown`] the stream ends.
#[must_use = "streams do nothing unless polled"]
pub struct Changes {
    rows: BoxStream<'static, Result<Vec<LockEntry>, LockError>>,
}

impl Stream for Changes {
    type Item = Result<Vec<LockEntry>, LockError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rows.poll_next_unpin(cx)
    }
}

impl fmt::Debug for Changes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Changes").finish_non_exhaustive()
    }
}

/// Makes its manager a watcher of every change while it lives (invariant 1).
struct Watching(Arc<Common>);

impl Watching {
    fn new(locks: &LockManager) -> Watching {
        locks.shared.common.watchers.fetch_add(1, Ordering::SeqCst);
        // Wakes the worker, so that it puts its waiting marker up and starts looking.
        let _ = locks.shared.send(Command::Poke);
        Watching(locks.shared.common.clone())
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.0.watchers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What of a row counts as a change (invariant 3).
type Identity = (String, Mode, String, String, u64, EntryState);

fn identity(entry: &LockEntry) -> Identity {
    (
        entry.key.clone(),
        entry.mode,
        entry.operation.clone(),
        entry.owner.clone(),
        entry.ticket,
        entry.state.clone(),
    )
}

/// Which rows a stream shows.
pub(super) enum Rows {
    /// Of the keys that start with this (`LockManager::changes`).
    Prefix(String),
    /// Of this key alone, read by key (`LockManager::observe`).
    Key(String),
}

struct State {
    locks: LockManager,
    rows: Rows,
    _watching: Watching,
    shown: Option<Vec<Identity>>,
    ended: bool,
}

pub(super) fn changes(locks: &LockManager, rows: Rows) -> Changes {
    let state = State {
        locks: locks.clone(),
        rows,
        _watching: Watching::new(locks),
        shown: None,
        ended: false,
    };
    Changes {
        rows: stream::unfold(state, next).boxed(),
    }
}

/// The next change, or the error of a read.
async fn next(mut state: State) -> Option<(Result<Vec<LockEntry>, LockError>, State)> {
    if state.ended {
        return None;
    }
    loop {
        let common = &state.locks.shared.common;
        let changed = common.changed.listen();
        let read = match &state.rows {
            Rows::Prefix(prefix) => (state.locks.inspect(None).await).map(|mut entries| {
                entries.retain(|entry| entry.key.starts_with(prefix.as_str()));
                entries
            }),
            Rows::Key(key) => state.locks.inspect(Some(key)).await,
        };
        let entries = match read {
            Ok(entries) => entries,
            Err(error) => {
                state.ended = matches!(error, LockError::Shutdown);
                return Some((Err(error), state));
            }
        };
        let seen: Vec<Identity> = entries.iter().map(identity).collect();
        if state.shown.as_ref() != Some(&seen) {
            state.shown = Some(seen);
            return Some((Ok(entries), state));
        }
        // Nothing new: wait for a change, or for the earliest lease shown to run out.
        let clock = common.clock.clone();
        let now = clock.now();
        let lapse = entries
            .iter()
            .map(|entry| entry.expires_at.saturating_sub(now))
            .min()
            .map(|left| left + Duration::from_millis(1));
        match lapse {
            Some(left) => drop(select(changed, clock.sleep(left)).await),
            None => changed.await,
        }
    }
}
