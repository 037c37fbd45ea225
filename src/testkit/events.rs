//! What the structured core did inside a simulation, and the clean-up oracle that checks it.
//!
//! The core records an [`Event`] only while a [`Sim`](super::Sim) is current on its thread
//! (see `sim::record`); without the `testkit` feature the hooks are not compiled at all.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::exit::{AbortReason, ExitStatus};

/// One thing the structured core did, in the order it happened (see
/// [`Sim::events`](super::Sim::events)). Ids are the simulation's own, counted from 1.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Event {
    /// A scope was opened: by a `Scoped` on its first poll (`parent` is the enclosing one's), or
    /// by `Scope::new`.
    #[non_exhaustive]
    ScopeOpened {
        /// The scope.
        scope: u64,
        /// The scope it is nested in, if any.
        parent: Option<u64>,
        /// Whether it belongs to the future given to `block_on`: opened while that future was
        /// polled, or nested in a scope that was.
        in_root: bool,
    },
    /// A finalizer was added to a scope.
    FinalizerAdded {
        /// The scope.
        scope: u64,
        /// The finalizer.
        finalizer: u64,
    },
    /// A finalizer began to run, told `status`.
    FinalizerStarted {
        /// The finalizer.
        finalizer: u64,
        /// The status it was told.
        status: ExitStatus,
    },
    /// A finalizer ended (ran to its end, panicked, or was dropped).
    FinalizerEnded {
        /// The finalizer.
        finalizer: u64,
    },
    /// A scope's close finished: its last finalizer has ended.
    ScopeClosed {
        /// The scope.
        scope: u64,
    },
    /// A fiber was forked, into a scope or (`None`) as a daemon.
    FiberForked {
        /// The fiber.
        fiber: u64,
        /// The scope it was forked into.
        scope: Option<u64>,
    },
    /// A fiber's work ended (with a value, interrupted, or panicked).
    FiberExited {
        /// The fiber.
        fiber: u64,
    },
    /// An abort controller was aborted, with this reason (the first abort of each).
    InterruptRequested {
        /// The reason, the caller's object.
        reason: AbortReason,
    },
    /// A `Scoped` saw its signal aborted and began to unwind with this reason: in `scope`, or
    /// (`None`) before its body ever ran.
    InterruptDelivered {
        /// The scope of the `Scoped` that was interrupted.
        scope: Option<u64>,
        /// The reason it unwinds with.
        reason: AbortReason,
    },
    /// The future given to `block_on` resolved.
    RootResolved,
    /// The future given to `block_on` was dropped unfinished.
    RootDropped,
}

/// A broken clean-up promise, found by [`check_cleanup`]: which promise, and the events
/// involved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CleanupViolation {
    what: String,
}

impl CleanupViolation {
    fn new(what: impl Into<String>) -> CleanupViolation {
        CleanupViolation { what: what.into() }
    }
}

impl fmt::Display for CleanupViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

impl std::error::Error for CleanupViolation {}

/// Checks the clean-up promises over the events of one run, and returns the first one broken:
///
/// 1. every finalizer that was added starts exactly once and ends exactly once, after it started;
/// 2. within a scope, finalizers added before its close began start last in first out, each
///    after the one before has ended;
/// 3. a nested scope's finalizers have all ended before its parent's first finalizer starts;
/// 4. every finalizer of a scope is told the same status (for an interruption, the same reason
///    object);
/// 5. no finalizer of a scope that belongs to the root runs after the root resolved (a root
///    that was dropped may clean up after: its clean-up then finishes before `block_on`
///    returns, which the simulation's own leak check sees).
///
/// # Errors
///
/// The first promise broken, saying which and where.
///
/// # Examples
///
/// ```
/// use leasehold::testkit::{check_cleanup, Sim};
/// use leasehold::{Interrupted, Scoped};
///
/// let mut sim = Sim::new(1);
/// let work = Scoped::<u32, Interrupted>::new(|scope| async move {
///     scope.add_finalizer(|_| async {});
///     scope.add_finalizer(|_| async {});
///     Ok(7)
/// });
/// assert_eq!(sim.block_on(work).unwrap().ok(), Some(7));
/// check_cleanup(&sim.events()).unwrap();
/// ```
pub fn check_cleanup(events: &[Event]) -> Result<(), CleanupViolation> {
    #[derive(Default)]
    struct Scope {
        parent: Option<u64>,
        in_root: bool,
        /// Finalizers in the order added, with whether they came before the close began.
        added: Vec<(u64, bool)>,
        first_start: Option<usize>,
        last_end: Option<usize>,
        status: Option<(u64, ExitStatus)>,
    }
    #[derive(Default)]
    struct Finalizer {
        scope: u64,
        started: Vec<usize>,
        ended: Vec<usize>,
    }
    let mut scopes: BTreeMap<u64, Scope> = BTreeMap::new();
    let mut finalizers: BTreeMap<u64, Finalizer> = BTreeMap::new();
    let mut resolved_at = None;
    let mut dropped = false;
    for (at, event) in events.iter().enumerate() {
        match event {
            Event::ScopeOpened {
                scope,
                parent,
                in_root,
            } => {
                let entry = scopes.entry(*scope).or_default();
                entry.parent = *parent;
                entry.in_root = *in_root;
            }
            Event::FinalizerAdded { scope, finalizer } => {
                let entry = scopes.entry(*scope).or_default();
                let before_close = entry.first_start.is_none();
                entry.added.push((*finalizer, before_close));
                finalizers.entry(*finalizer).or_default().scope = *scope;
            }
            Event::FinalizerStarted { finalizer, status } => {
                let Some(entry) = finalizers.get_mut(finalizer) else {
                    return Err(CleanupViolation::new(format!(
                        "finalizer {finalizer} started but was never added (event {at})"
                    )));
                };
                entry.started.push(at);
                let scope = scopes.entry(entry.scope).or_default();
                scope.first_start.get_or_insert(at);
                match &scope.status {
                    None => scope.status = Some((*finalizer, status.clone())),
                    Some((first, told)) if !same_status(told, status) => {
                        return Err(CleanupViolation::new(format!(
                            "scope {}: finalizer {finalizer} was told {status:?}, but finalizer \
                             {first} was told {told:?} (event {at})",
                            entry.scope
                        )));
                    }
                    Some(_) => {}
                }
                if resolved_at.is_some() && !dropped && scope.in_root {
                    return Err(CleanupViolation::new(format!(
                        "finalizer {finalizer} of scope {} started after the root resolved \
                         (event {at})",
                        entry.scope
                    )));
                }
            }
            Event::FinalizerEnded { finalizer } => {
                let Some(entry) = finalizers.get_mut(finalizer) else {
                    return Err(CleanupViolation::new(format!(
                        "finalizer {finalizer} ended but was never added (event {at})"
                    )));
                };
                entry.ended.push(at);
                let scope = scopes.entry(entry.scope).or_default();
                scope.last_end = Some(at);
                if resolved_at.is_some() && !dropped && scope.in_root {
                    return Err(CleanupViolation::new(format!(
                        "finalizer {finalizer} of scope {} was still running when the root \
                         resolved (it ended at event {at})",
                        entry.scope
                    )));
                }
            }
            Event::RootResolved => resolved_at = Some(at),
            Event::RootDropped => dropped = true,
            _ => {}
        }
    }
    // Promise 1.
    for (id, finalizer) in &finalizers {
        match (finalizer.started.as_slice(), finalizer.ended.as_slice()) {
            ([], _) => {
                return Err(CleanupViolation::new(format!(
                    "finalizer {id} of scope {} was added but never ran",
                    finalizer.scope
                )))
            }
            ([_, again, ..], _) => {
                return Err(CleanupViolation::new(format!(
                    "finalizer {id} of scope {} ran twice (again at event {again})",
                    finalizer.scope
                )))
            }
            ([_], []) => {
                return Err(CleanupViolation::new(format!(
                    "finalizer {id} of scope {} started but never ended",
                    finalizer.scope
                )))
            }
            ([start], [end, ..]) if end < start => {
                return Err(CleanupViolation::new(format!(
                    "finalizer {id} ended (event {end}) before it started (event {start})"
                )))
            }
            _ => {}
        }
    }
    // Promise 2: last in first out, one at a time.
    for (id, scope) in &scopes {
        let in_close: Vec<u64> = scope
            .added
            .iter()
            .filter(|(_, before_close)| *before_close)
            .map(|(finalizer, _)| *finalizer)
            .collect();
        let mut previous_end: Option<(u64, usize)> = None;
        for finalizer in in_close.iter().rev() {
            let entry = &finalizers[finalizer];
            let start = entry.started[0];
            if let Some((before, end)) = previous_end {
                if start < finalizers[&before].started[0] {
                    return Err(CleanupViolation::new(format!(
                        "scope {id}: finalizer {finalizer} started (event {start}) before \
                         finalizer {before}, which was added after it: not last in first out"
                    )));
                }
                if start < end {
                    return Err(CleanupViolation::new(format!(
                        "scope {id}: finalizer {finalizer} started (event {start}) before \
                         finalizer {before} had ended (event {end})"
                    )));
                }
            }
            previous_end = Some((*finalizer, entry.ended[0]));
        }
    }
    // Promise 3: inner before outer.
    for (id, scope) in &scopes {
        let (Some(parent), Some(end)) = (scope.parent, scope.last_end) else {
            continue;
        };
        if let Some(parent_start) = scopes.get(&parent).and_then(|p| p.first_start) {
            if parent_start < end {
                return Err(CleanupViolation::new(format!(
                    "scope {id}'s finalizers were still running (until event {end}) when its \
                     parent scope {parent}'s began (event {parent_start}): not inner before outer"
                )));
            }
        }
    }
    Ok(())
}

/// Whether two statuses are the same: the same kind, and for an interruption the same reason
/// object.
fn same_status(a: &ExitStatus, b: &ExitStatus) -> bool {
    match (a, b) {
        (ExitStatus::Success, ExitStatus::Success) | (ExitStatus::Failure, ExitStatus::Failure) => {
            true
        }
        (ExitStatus::Interrupted(a), ExitStatus::Interrupted(b)) => a.ptr_eq(b),
        _ => false,
    }
}

/// The scopes that belong to the root: opened while it was polled, or nested in one that was.
pub(crate) fn in_root(scopes: &BTreeSet<u64>, parent: Option<u64>, polling_root: bool) -> bool {
    polling_root || parent.is_some_and(|parent| scopes.contains(&parent))
}

#[cfg(test)]
mod tests {
    use super::*;

    use Event::*;

    fn opened(scope: u64, parent: Option<u64>) -> Event {
        ScopeOpened {
            scope,
            parent,
            in_root: true,
        }
    }

    fn started(finalizer: u64) -> Event {
        FinalizerStarted {
            finalizer,
            status: ExitStatus::Success,
        }
    }

    fn ended(finalizer: u64) -> Event {
        FinalizerEnded { finalizer }
    }

    /// Scope 1 with finalizers 3 and 4, and nested in it scope 2 with finalizer 5: closed inner
    /// first, each last in first out, then the root resolves.
    fn good() -> Vec<Event> {
        vec![
            opened(1, None),
            FinalizerAdded {
                scope: 1,
                finalizer: 3,
            },
            FinalizerAdded {
                scope: 1,
                finalizer: 4,
            },
            opened(2, Some(1)),
            FinalizerAdded {
                scope: 2,
                finalizer: 5,
            },
            started(5),
            ended(5),
            ScopeClosed { scope: 2 },
            started(4),
            ended(4),
            started(3),
            ended(3),
            ScopeClosed { scope: 1 },
            RootResolved,
        ]
    }

    fn violation(events: Vec<Event>) -> String {
        check_cleanup(&events)
            .expect_err("a broken promise")
            .to_string()
    }

    #[test]
    fn a_clean_run_passes() {
        check_cleanup(&good()).unwrap();
    }

    #[test]
    fn a_finalizer_skipped_is_caught() {
        let mut events = good();
        events.retain(|e| {
            !matches!(
                e,
                FinalizerStarted { finalizer: 3, .. } | FinalizerEnded { finalizer: 3 }
            )
        });
        assert!(violation(events).contains("finalizer 3 of scope 1 was added but never ran"));
    }

    #[test]
    fn a_finalizer_run_twice_is_caught() {
        let mut events = good();
        events.insert(12, started(3));
        events.insert(13, ended(3));
        assert!(violation(events).contains("finalizer 3 of scope 1 ran twice"));
    }

    #[test]
    fn a_finalizer_that_never_ends_is_caught() {
        let mut events = good();
        events.retain(|e| !matches!(e, FinalizerEnded { finalizer: 3 }));
        assert!(violation(events).contains("started but never ended"));
    }

    #[test]
    fn finalizers_run_first_in_first_out_are_caught() {
        let mut events = good();
        // 3 before 4: the order they were added in.
        events[8] = started(3);
        events[9] = ended(3);
        events[10] = started(4);
        events[11] = ended(4);
        assert!(violation(events).contains("not last in first out"));
    }

    #[test]
    fn finalizers_that_overlap_are_caught() {
        let mut events = good();
        // 3 starts while 4 runs.
        events[9] = started(3);
        events[10] = ended(4);
        assert!(violation(events).contains("before finalizer 4 had ended"));
    }

    #[test]
    fn an_outer_finalizer_before_an_inner_one_ended_is_caught() {
        let mut events = good();
        let inner_end = events.remove(6);
        events.insert(9, inner_end);
        assert!(violation(events).contains("not inner before outer"));
    }

    #[test]
    fn a_finalizer_after_the_root_resolved_is_caught() {
        let mut events = good();
        let resolved = events.pop().unwrap();
        events.insert(10, resolved);
        assert!(violation(events).contains("started after the root resolved"));
        // Allowed once the root was dropped: its clean-up finishes in the background.
        let mut dropped = good();
        dropped.pop();
        dropped.insert(10, RootDropped);
        dropped.insert(11, RootResolved);
        check_cleanup(&dropped).unwrap();
    }

    #[test]
    fn a_finalizer_still_running_when_the_root_resolved_is_caught() {
        let mut events = good();
        let resolved = events.pop().unwrap();
        events.insert(11, resolved);
        assert!(violation(events).contains("still running when the root resolved"));
    }

    #[test]
    fn finalizers_of_one_scope_told_different_statuses_are_caught() {
        let mut events = good();
        let reason = AbortReason::new(crate::Dropped);
        events[10] = FinalizerStarted {
            finalizer: 3,
            status: ExitStatus::Interrupted(reason.clone()),
        };
        assert!(violation(events.clone()).contains("was told"));
        // The same kind with another reason object differs too.
        events[8] = FinalizerStarted {
            finalizer: 4,
            status: ExitStatus::Interrupted(AbortReason::new(crate::Dropped)),
        };
        assert!(violation(events.clone()).contains("was told"));
        events[8] = FinalizerStarted {
            finalizer: 4,
            status: ExitStatus::Interrupted(reason),
        };
        check_cleanup(&events).unwrap();
    }
}
