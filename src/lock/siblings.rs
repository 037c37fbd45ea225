//! Managers of one process that share a database file wake each other at once after a commit,
//! instead of waiting for their next poll to notice it.

use std::path::PathBuf;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, Weak};

use super::protocol::Command;
use super::{Common, Shared};
use crate::sync::lock;

struct Sibling {
    path: PathBuf,
    owner: String,
    tx: Weak<Sender<Command>>,
}

static SIBLINGS: Mutex<Vec<Sibling>> = Mutex::new(Vec::new());

pub(super) fn register(shared: &Arc<Shared>) {
    let Some(path) = shared.common.path.clone() else {
        return;
    };
    let mut siblings = lock(&SIBLINGS);
    siblings.retain(|s| s.tx.strong_count() > 0);
    siblings.push(Sibling {
        path,
        owner: shared.common.owner.clone(),
        tx: Arc::downgrade(&shared.tx),
    });
}

/// Tells the other managers on this file that something was committed.
pub(super) fn poke(common: &Common) {
    let Some(path) = &common.path else {
        return;
    };
    let targets: Vec<Arc<Sender<Command>>> = lock(&SIBLINGS)
        .iter()
        .filter(|s| &s.path == path && s.owner != common.owner)
        .filter_map(|s| s.tx.upgrade())
        .collect();
    for target in targets {
        let _ = target.send(Command::Poke);
    }
}
