//! Managers of one process that share a database (a file, or a PostgreSQL schema) wake each
//! other at once after a commit, instead of waiting for their next poll to notice it.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, Weak};

use super::protocol::Command;
use super::{Common, Shared};
use crate::sync::lock;

struct Sibling {
    store: String,
    owner: String,
    tx: Weak<Sender<Command>>,
}

static SIBLINGS: Mutex<Vec<Sibling>> = Mutex::new(Vec::new());

pub(super) fn register(shared: &Arc<Shared>) {
    let Some(store) = shared.common.store.clone() else {
        return;
    };
    let mut siblings = lock(&SIBLINGS);
    siblings.retain(|s| s.tx.strong_count() > 0);
    siblings.push(Sibling {
        store,
        owner: shared.common.owner.clone(),
        tx: Arc::downgrade(&shared.tx),
    });
}

/// Tells the other managers on this database that something was committed.
pub(super) fn poke(common: &Common) {
    let Some(store) = &common.store else {
        return;
    };
    let targets: Vec<Arc<Sender<Command>>> = lock(&SIBLINGS)
        .iter()
        .filter(|s| &s.store == store && s.owner != common.owner)
        .filter_map(|s| s.tx.upgrade())
        .collect();
    for target in targets {
        let _ = target.send(Command::Poke);
    }
}
