//! Managers of one process that share a database (a file, or a PostgreSQL schema) wake each
//! other at once after a commit, instead of waiting for their next poll to notice it: the
//! owners of the requests it promoted, and those with callers waiting without a row, whom any
//! freed row may let through (as the doorbell does across processes, see `doorbell.rs`).

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use crate::lock::worker::protocol::{Command, CommandTx};
use crate::lock::Common;
use crate::sync::lock;

/// What a worker needs to poke another manager, and no more: never its whole handle, whose last
/// drop joins that manager's worker (two workers poking each other as their managers go away
/// would then wait for each other).
struct Sibling {
    store: String,
    owner: String,
    tx: Weak<CommandTx>,
    common: Weak<Common>,
}

static SIBLINGS: Mutex<Vec<Sibling>> = Mutex::new(Vec::new());

/// Makes a new manager (its command sender `tx`, its `common`) known to the other managers of
/// this process on its store; kept without keeping it alive.
pub(crate) fn register(tx: &Arc<CommandTx>, common: &Arc<Common>) {
    let Some(store) = common.store.clone() else {
        return;
    };
    let mut siblings = lock(&SIBLINGS);
    siblings.retain(|s| s.tx.strong_count() > 0);
    siblings.push(Sibling {
        store,
        owner: common.owner.clone(),
        tx: Arc::downgrade(tx),
        common: Arc::downgrade(common),
    });
}

/// Tells the other managers on this database that something was committed: those of `owners`,
/// and those with callers waiting without a row.
pub(crate) fn poke(common: &Common, owners: &BTreeSet<String>) {
    let Some(store) = &common.store else {
        return;
    };
    let targets: Vec<(Arc<CommandTx>, Arc<Common>)> = lock(&SIBLINGS)
        .iter()
        .filter(|s| &s.store == store && s.owner != common.owner)
        .filter_map(|s| Some((s.tx.upgrade()?, s.common.upgrade()?)))
        .collect();
    for (tx, target) in targets {
        let concerned = owners.contains(&target.owner)
            || target.unqueued.load(Ordering::SeqCst) > 0
            || target.watchers.load(Ordering::SeqCst) > 0;
        if concerned {
            let _ = tx.send(Command::Poke);
        }
    }
}
