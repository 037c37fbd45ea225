//! The managers of one process that share a store (a file, a PostgreSQL schema, a
//! `MemoryStore`) wake each other at once after a commit, rather than at their next poll: the
//! owners of the requests it promoted, and those that say they wait without a row
//! (`Storage::waiting`), whom any freed row may let through. It is how the memory store wakes
//! its managers, and what SQLite's doorbell and PostgreSQL's notifications do across processes,
//! here without a system call. Each backend's storage keeps its manager's membership
//! ([`Siblings`]) and wakes the others from `Storage::wake_others`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::Poke;
use crate::sync::lock;

/// One manager as its siblings know it: never its handle, only a way to poke its worker that
/// does not keep it (two workers poking each other as their managers go away would otherwise
/// wait for each other).
struct Member {
    store: String,
    owner: String,
    poke: Arc<dyn Poke>,
    /// Whether it has callers waiting without a row, or watchers of every change.
    waiting: AtomicBool,
}

/// Every member of this process, of every store; those gone are dropped as others join.
static MEMBERS: Mutex<Vec<Weak<Member>>> = Mutex::new(Vec::new());

/// A manager's membership among the managers of this process on its store; it ends when
/// dropped (with the storage that keeps it).
pub(crate) struct Siblings {
    /// `None`: a store no other manager can share.
    member: Option<Arc<Member>>,
}

impl Siblings {
    /// Makes the manager `owner`, poked by `poke`, known to the other managers of this process
    /// on `store` (`None`: a store no other manager can share).
    pub(crate) fn join(store: Option<String>, owner: &str, poke: Arc<dyn Poke>) -> Siblings {
        let Some(store) = store else {
            return Siblings::alone();
        };
        let member = Arc::new(Member {
            store,
            owner: owner.to_owned(),
            poke,
            waiting: AtomicBool::new(false),
        });
        let mut members = lock(&MEMBERS);
        members.retain(|member| member.strong_count() > 0);
        members.push(Arc::downgrade(&member));
        Siblings {
            member: Some(member),
        }
    }

    /// A manager that has no siblings (a storage opened for a test of its own).
    pub(crate) fn alone() -> Siblings {
        Siblings { member: None }
    }

    /// Says whether this manager has callers waiting without a row (or watchers of every
    /// change): while it does, every commit of a sibling that freed something wakes it.
    pub(crate) fn waiting(&self, waiting: bool) {
        if let Some(member) = &self.member {
            member.waiting.store(waiting, Ordering::SeqCst);
        }
    }

    /// After a commit that freed or promoted something (`owners`: the other owners whose
    /// requests it promoted): wakes those of them that are siblings, and the siblings that wait
    /// without a row.
    pub(crate) fn wake(&self, owners: &BTreeSet<String>) {
        let Some(me) = &self.member else {
            return;
        };
        let targets: Vec<Arc<Member>> = (lock(&MEMBERS).iter())
            .filter_map(Weak::upgrade)
            .filter(|other| other.store == me.store && other.owner != me.owner)
            .collect();
        for target in targets {
            if owners.contains(&target.owner) || target.waiting.load(Ordering::SeqCst) {
                target.poke.poke();
            }
        }
    }
}
