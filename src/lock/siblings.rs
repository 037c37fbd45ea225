//! Managers of one process that share a database (a file, or a PostgreSQL schema) wake each
//! other at once after a commit, instead of waiting for their next poll to notice it: the
//! owners of the requests it promoted, and those with callers waiting without a row, whom any
//! freed row may let through (as the doorbell does across processes, see `doorbell.rs`).

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use super::protocol::Command;
use super::{Common, Shared};
use crate::sync::lock;

struct Sibling {
    store: String,
    owner: String,
    shared: Weak<Shared>,
}

static SIBLINGS: Mutex<Vec<Sibling>> = Mutex::new(Vec::new());

pub(super) fn register(shared: &Arc<Shared>) {
    let Some(store) = shared.common.store.clone() else {
        return;
    };
    let mut siblings = lock(&SIBLINGS);
    siblings.retain(|s| s.shared.strong_count() > 0);
    siblings.push(Sibling {
        store,
        owner: shared.common.owner.clone(),
        shared: Arc::downgrade(shared),
    });
}

/// Tells the other managers on this database that something was committed: those of `owners`,
/// and those with callers waiting without a row.
pub(super) fn poke(common: &Common, owners: &BTreeSet<String>) {
    let Some(store) = &common.store else {
        return;
    };
    let targets: Vec<Arc<Shared>> = lock(&SIBLINGS)
        .iter()
        .filter(|s| &s.store == store && s.owner != common.owner)
        .filter_map(|s| s.shared.upgrade())
        .collect();
    for target in targets {
        let concerned = owners.contains(&target.common.owner)
            || target.common.unqueued.load(Ordering::SeqCst) > 0;
        if concerned {
            let _ = target.tx.send(Command::Poke);
        }
    }
}
