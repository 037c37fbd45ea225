//! Property: however a tree of nested `Scoped` futures ends (values, early returns that drop
//! unfinished children, one interruption at a random moment), every finalizer runs exactly once,
//! inner scopes finish closing before outer ones start, everything is closed before the root
//! resolves, and an interrupted root reports the caller's reason object.
//!
//! The trees run on a single-threaded, fully deterministic executor: background work that the
//! library hands to a spawner runs on the same thread, and time is a `TestClock` that moves one
//! millisecond only when every task is stalled.

mod common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use common::yield_now;
use futures::executor::LocalPool;
use futures::future::{self, BoxFuture};
use futures::task::LocalSpawnExt;
use leasehold::{
    AbortController, AbortReason, Clock, Dropped, Exit, ExitStatus, Interrupted, Scope, Scoped,
    Spawner, TestClock,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// What a case is made of
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct FinalizerSpec {
    /// Milliseconds of test-clock sleep inside the finalizer.
    sleep: u64,
    /// Times the finalizer yields before it sleeps.
    yields: u8,
}

#[derive(Clone, Debug)]
struct NodeSpec {
    /// Added as soon as the body starts.
    early_finalizers: Vec<FinalizerSpec>,
    /// Added after the children have finished (only if the body gets that far).
    late_finalizers: Vec<FinalizerSpec>,
    /// Milliseconds the body works before it starts its children.
    work: u64,
    /// Return `Ok` after this many milliseconds even if the children are unfinished (they are
    /// dropped).
    early_return: Option<u64>,
    /// Run concurrently.
    children: Vec<NodeSpec>,
}

#[derive(Clone, Copy, Debug)]
enum AbortPlan {
    Never,
    /// Before the root is first polled: nothing may run.
    BeforeStart,
    /// Once this many milliseconds have passed on the test clock.
    AtMillis(u64),
    /// From inside the body of a node (its number modulo the node count), while the tree is
    /// being polled.
    FromNode(usize),
}

#[derive(Debug)]
struct Case {
    root: NodeSpec,
    abort: AbortPlan,
    reason: u32,
}

fn finalizer_spec() -> impl Strategy<Value = FinalizerSpec> {
    (0u64..=3, 0u8..=2).prop_map(|(sleep, yields)| FinalizerSpec { sleep, yields })
}

fn node_spec(children: BoxedStrategy<Vec<NodeSpec>>) -> impl Strategy<Value = NodeSpec> {
    (
        prop::collection::vec(finalizer_spec(), 0..=2),
        prop::collection::vec(finalizer_spec(), 0..=1),
        0u64..=3,
        prop::option::weighted(0.3, 0u64..=6),
        children,
    )
        .prop_map(
            |(early_finalizers, late_finalizers, work, early_return, children)| NodeSpec {
                early_finalizers,
                late_finalizers,
                work,
                early_return,
                children,
            },
        )
}

fn tree() -> impl Strategy<Value = NodeSpec> {
    let leaf = node_spec(Just(Vec::new()).boxed());
    // Up to three levels below the root (depth 4), up to three children a node.
    leaf.prop_recursive(3, 60, 3, |inner| {
        node_spec(prop::collection::vec(inner, 1..=3).boxed())
    })
}

fn case() -> impl Strategy<Value = Case> {
    let abort = prop_oneof![
        1 => Just(AbortPlan::Never),
        1 => Just(AbortPlan::BeforeStart),
        6 => (0u64..=14).prop_map(AbortPlan::AtMillis),
        2 => any::<usize>().prop_map(AbortPlan::FromNode),
    ];
    (tree(), abort, any::<u32>()).prop_map(|(root, abort, reason)| Case {
        root,
        abort,
        reason,
    })
}

// ---------------------------------------------------------------------------------------------
// What happened
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Event {
    Added(usize),
    Started(usize, ExitStatus),
    Ended(usize),
    BodyDone(usize),
    RootResolved,
}

/// The shape of the tree (filled in as it is built) and the events of the run.
#[derive(Default)]
struct Record {
    parent: Vec<Option<usize>>,
    owner: Vec<usize>,
    events: Vec<Event>,
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Record>>);

impl Recorder {
    fn log(&self, event: Event) {
        self.0.lock().unwrap().events.push(event);
    }

    fn new_node(&self, parent: Option<usize>) -> usize {
        let mut record = self.0.lock().unwrap();
        record.parent.push(parent);
        record.parent.len() - 1
    }

    fn new_finalizer(&self, node: usize) -> usize {
        let mut record = self.0.lock().unwrap();
        record.owner.push(node);
        record.owner.len() - 1
    }

    fn body_done(&self, node: usize) -> bool {
        let record = self.0.lock().unwrap();
        record
            .events
            .iter()
            .any(|e| matches!(e, Event::BodyDone(n) if *n == node))
    }
}

/// The reason a case aborts with: a typed error, so that a `Display` match could not pass for
/// the same object.
#[derive(Debug)]
struct CaseReason(u32);

impl fmt::Display for CaseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "case reason {}", self.0)
    }
}

impl std::error::Error for CaseReason {}

// ---------------------------------------------------------------------------------------------
// Building the tree
// ---------------------------------------------------------------------------------------------

/// Aborts the root's controller from inside the body of one node.
#[derive(Clone)]
struct Trigger {
    node: Arc<AtomicUsize>,
    controller: Arc<AbortController>,
    reason: AbortReason,
    fired: Arc<AtomicBool>,
}

impl Trigger {
    fn pull_if_at(&self, node: usize) {
        if self.node.load(Ordering::SeqCst) == node {
            self.controller.abort(self.reason.clone());
            self.fired.store(true, Ordering::SeqCst);
        }
    }
}

fn add_finalizer(
    scope: &Scope,
    spec: &FinalizerSpec,
    id: usize,
    recorder: &Recorder,
    clock: &TestClock,
) {
    let (spec, recorder, clock) = (spec.clone(), recorder.clone(), clock.clone());
    recorder.log(Event::Added(id));
    scope.add_finalizer(move |status| async move {
        recorder.log(Event::Started(id, status));
        for _ in 0..spec.yields {
            yield_now().await;
        }
        clock.sleep(Duration::from_millis(spec.sleep)).await;
        recorder.log(Event::Ended(id));
    });
}

fn build(
    spec: &NodeSpec,
    parent: Option<usize>,
    recorder: &Recorder,
    clock: &TestClock,
    trigger: &Trigger,
) -> Scoped<(), Interrupted> {
    let node = recorder.new_node(parent);
    let early: Vec<(FinalizerSpec, usize)> = spec
        .early_finalizers
        .iter()
        .map(|f| (f.clone(), recorder.new_finalizer(node)))
        .collect();
    let late: Vec<(FinalizerSpec, usize)> = spec
        .late_finalizers
        .iter()
        .map(|f| (f.clone(), recorder.new_finalizer(node)))
        .collect();
    // Children are built (and numbered) now, and first polled when the body starts them.
    let children: Vec<Scoped<(), Interrupted>> = spec
        .children
        .iter()
        .map(|child| build(child, Some(node), recorder, clock, trigger))
        .collect();
    let (work, early_return) = (spec.work, spec.early_return);
    let (recorder, clock, trigger) = (recorder.clone(), clock.clone(), trigger.clone());

    Scoped::new(move |scope| async move {
        for (finalizer, id) in &early {
            add_finalizer(&scope, finalizer, *id, &recorder, &clock);
        }
        trigger.pull_if_at(node);
        clock.sleep(Duration::from_millis(work)).await;
        let children = future::join_all(children);
        match early_return {
            None => {
                for result in children.await {
                    result?;
                }
            }
            Some(after) => {
                let give_up = clock.sleep(Duration::from_millis(after));
                // Whichever finishes first; unfinished children are dropped with the loser.
                future::select(children, give_up).await;
            }
        }
        for (finalizer, id) in &late {
            add_finalizer(&scope, finalizer, *id, &recorder, &clock);
        }
        recorder.log(Event::BodyDone(node));
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// A deterministic executor
// ---------------------------------------------------------------------------------------------

/// One thread, one `LocalPool`; the library's background work is queued by a [`Spawner`] and
/// moved into the pool by the run loop.
struct Deterministic {
    pool: LocalPool,
    queue: Arc<Mutex<Vec<BoxFuture<'static, ()>>>>,
    background: Arc<AtomicUsize>,
    clock: TestClock,
}

impl Deterministic {
    fn new(clock: TestClock) -> Self {
        Deterministic {
            pool: LocalPool::new(),
            queue: Arc::default(),
            background: Arc::default(),
            clock,
        }
    }

    fn spawner(&self) -> Arc<dyn Spawner> {
        // Weak, so that queued tasks holding the spawner do not keep the queue alive in a cycle.
        let queue: Weak<Mutex<Vec<BoxFuture<'static, ()>>>> = Arc::downgrade(&self.queue);
        Arc::new(move |task: BoxFuture<'static, ()>| {
            if let Some(queue) = queue.upgrade() {
                queue.lock().unwrap().push(task);
            }
        })
    }

    /// Runs `main` to the end. Whenever everything is stalled, `on_stall` is called with the
    /// milliseconds passed so far (it returns whether it changed anything); if it did not, the
    /// clock moves one millisecond. Panics if nothing can ever move again.
    fn run<T: 'static>(
        &mut self,
        main: impl Future<Output = T> + 'static,
        mut on_stall: impl FnMut(u64) -> bool,
    ) -> T {
        let output = Rc::new(RefCell::new(None));
        let slot = output.clone();
        self.pool
            .spawner()
            .spawn_local(async move { *slot.borrow_mut() = Some(main.await) })
            .unwrap();
        let mut elapsed = 0;
        loop {
            self.pool.run_until_stalled();
            if self.adopt_spawned() {
                continue;
            }
            if output.borrow().is_some() {
                break;
            }
            if on_stall(elapsed) {
                continue;
            }
            assert!(
                self.clock.sleepers() > 0,
                "stalled: no task can run and nobody sleeps (a lost wake-up?)"
            );
            self.clock.advance(Duration::from_millis(1));
            elapsed += 1;
            assert!(
                elapsed < 10_000,
                "the case did not finish in 10 s of test time"
            );
        }
        let value = output.borrow_mut().take().unwrap();
        value
    }

    /// Moves tasks handed to the spawner into the pool; whether there were any.
    fn adopt_spawned(&mut self) -> bool {
        let spawned = std::mem::take(&mut *self.queue.lock().unwrap());
        let any = !spawned.is_empty();
        for task in spawned {
            let background = self.background.clone();
            background.fetch_add(1, Ordering::SeqCst);
            self.pool
                .spawner()
                .spawn_local(async move {
                    task.await;
                    background.fetch_sub(1, Ordering::SeqCst);
                })
                .unwrap();
        }
        any
    }

    /// Background tasks that have not finished.
    fn unfinished_background(&mut self) -> usize {
        self.pool.run_until_stalled();
        assert!(!self.adopt_spawned(), "work was handed off after the end");
        self.background.load(Ordering::SeqCst)
    }
}

// ---------------------------------------------------------------------------------------------
// The property
// ---------------------------------------------------------------------------------------------

fn run_case(case: &Case) {
    let clock = TestClock::new();
    let mut executor = Deterministic::new(clock.clone());
    let recorder = Recorder::default();
    let controller = Arc::new(AbortController::new());
    let reason = AbortReason::new(CaseReason(case.reason));
    let trigger = Trigger {
        node: Arc::new(AtomicUsize::new(usize::MAX)),
        controller: controller.clone(),
        reason: reason.clone(),
        fired: Arc::default(),
    };

    let root =
        build(&case.root, None, &recorder, &clock, &trigger).with_signal(&controller.signal());
    if let AbortPlan::FromNode(node) = case.abort {
        let nodes = recorder.0.lock().unwrap().parent.len();
        trigger.node.store(node % nodes, Ordering::SeqCst);
    }
    let scope = Scope::with_spawner(executor.spawner());
    let resolved = recorder.clone();
    // A fiber on the deterministic spawner, so that the tree inherits that spawner.
    let fiber = scope.fork(async move {
        let result = root.await;
        resolved.log(Event::RootResolved);
        result
    });
    let main = async move {
        let exit = fiber.join().await;
        scope.close(ExitStatus::Success).await;
        exit
    };

    // Whether the root was aborted between two polls while its body had no value yet: then its
    // body must never be polled again. (An abort from inside the tree lands in the middle of a
    // poll, and the body may still finish in that same poll: then its value wins.)
    let mut must_be_interrupted = false;
    let mut aborted = false;
    if let AbortPlan::BeforeStart = case.abort {
        controller.abort(reason.clone());
        aborted = true;
        must_be_interrupted = true;
    }
    let exit = executor.run(main, |elapsed| match case.abort {
        AbortPlan::AtMillis(at) if !aborted && elapsed >= at => {
            must_be_interrupted = !recorder.body_done(0);
            controller.abort(reason.clone());
            aborted = true;
            true
        }
        _ => false,
    });
    aborted |= trigger.fired.load(Ordering::SeqCst);
    assert_eq!(
        executor.unfinished_background(),
        0,
        "background work outlived the root"
    );

    // The root's outcome.
    let result = match exit {
        Exit::Success(result) => result,
        other => panic!("the fiber running the root ended with {other:?}"),
    };
    let root_had_a_value = recorder.body_done(0);
    if must_be_interrupted {
        assert!(!root_had_a_value, "the root's body ran on after the abort");
    }
    if root_had_a_value {
        assert!(
            result.is_ok(),
            "the value lost to a late interruption: {result:?}"
        );
    } else {
        assert!(aborted, "the root neither finished nor was interrupted");
        let error = result.expect_err("the root was interrupted before it had a value");
        assert!(
            error.reason().ptr_eq(&reason),
            "the root's error carries {:?}, not the caller's reason object",
            error.reason()
        );
    }

    let record = recorder.0.lock().unwrap();
    check_finalizers(&record, &reason, aborted);
}

fn check_finalizers(record: &Record, reason: &AbortReason, aborted: bool) {
    let events = &record.events;
    let position = |wanted: &dyn Fn(&Event) -> bool| -> Vec<usize> {
        events
            .iter()
            .enumerate()
            .filter(|(_, e)| wanted(e))
            .map(|(i, _)| i)
            .collect()
    };
    let resolved = position(&|e| matches!(e, Event::RootResolved));
    assert_eq!(
        resolved.len(),
        1,
        "the root resolved {} times",
        resolved.len()
    );
    let resolved = resolved[0];
    assert_eq!(
        resolved,
        events.len() - 1,
        "something ran after the root resolved"
    );

    // Every finalizer added runs exactly once, to its end, before the root resolves.
    let mut started = HashMap::new();
    let mut ended = HashMap::new();
    for id in 0..record.owner.len() {
        let added = position(&|e| matches!(e, Event::Added(f) if *f == id));
        let starts = position(&|e| matches!(e, Event::Started(f, _) if *f == id));
        let ends = position(&|e| matches!(e, Event::Ended(f) if *f == id));
        if added.is_empty() {
            assert!(starts.is_empty(), "finalizer {id} ran but was never added");
            continue;
        }
        assert_eq!(added.len(), 1);
        assert_eq!(
            starts.len(),
            1,
            "finalizer {id} started {} times",
            starts.len()
        );
        assert_eq!(ends.len(), 1, "finalizer {id} ended {} times", ends.len());
        assert!(added[0] < starts[0] && starts[0] < ends[0]);
        assert!(
            ends[0] < resolved,
            "finalizer {id} ended after the root resolved"
        );
        started.insert(id, starts[0]);
        ended.insert(id, ends[0]);
    }

    // Inner before outer: every finalizer of a descendant ends before any of the node's starts.
    let is_ancestor = |ancestor: usize, mut node: usize| {
        while let Some(parent) = record.parent[node] {
            if parent == ancestor {
                return true;
            }
            node = parent;
        }
        false
    };
    for (&outer, &outer_start) in &started {
        for (&inner, &inner_end) in &ended {
            if is_ancestor(record.owner[outer], record.owner[inner]) {
                assert!(
                    inner_end < outer_start,
                    "finalizer {inner} (node {}) ended after finalizer {outer} (node {}) started",
                    record.owner[inner],
                    record.owner[outer]
                );
            }
        }
    }

    // Each finalizer is told how its own scope ended.
    let body_done = |node: usize| {
        events
            .iter()
            .any(|e| matches!(e, Event::BodyDone(n) if *n == node))
    };
    for event in events {
        let Event::Started(id, status) = event else {
            continue;
        };
        let node = record.owner[*id];
        if body_done(node) {
            assert!(
                matches!(status, ExitStatus::Success),
                "node {node} finished, yet its finalizer was told {status:?}"
            );
            continue;
        }
        // Unfinished: dropped by a parent that returned early, or unwound by the interruption.
        let mut dropper = node;
        let dropped_early = loop {
            match record.parent[dropper] {
                Some(parent) if body_done(parent) => break true,
                Some(parent) => dropper = parent,
                None => break false,
            }
        };
        if dropped_early {
            assert!(
                matches!(status, ExitStatus::Interrupted(r) if r.downcast_ref::<Dropped>().is_some()),
                "node {node} was dropped by its parent, yet told {status:?}"
            );
        } else {
            assert!(
                aborted,
                "node {node} did not finish, but nothing interrupted it"
            );
            assert!(
                matches!(status, ExitStatus::Interrupted(r) if r.ptr_eq(reason)),
                "node {node} was unwound by the interruption, yet told {status:?}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn nested_scopes_close_inner_before_outer_and_before_the_root_resolves(case in case()) {
        run_case(&case);
    }
}

/// One hand-written case of each kind, so that a regression shows up with a readable name too.
#[test]
fn a_deep_tree_interrupted_mid_flight_unwinds_inner_before_outer() {
    let leaf = |sleep| NodeSpec {
        early_finalizers: vec![FinalizerSpec { sleep, yields: 1 }],
        late_finalizers: vec![],
        work: 5,
        early_return: None,
        children: vec![],
    };
    let middle = |children| NodeSpec {
        early_finalizers: vec![
            FinalizerSpec {
                sleep: 2,
                yields: 0
            };
            2
        ],
        late_finalizers: vec![FinalizerSpec {
            sleep: 1,
            yields: 0,
        }],
        work: 1,
        early_return: None,
        children,
    };
    let root = middle(vec![
        middle(vec![leaf(3), leaf(0)]),
        NodeSpec {
            early_return: Some(2),
            ..middle(vec![leaf(1), middle(vec![leaf(2)])])
        },
    ]);
    for abort in [
        AbortPlan::Never,
        AbortPlan::BeforeStart,
        AbortPlan::AtMillis(0),
        AbortPlan::AtMillis(3),
        AbortPlan::AtMillis(7),
        AbortPlan::AtMillis(9),
        AbortPlan::FromNode(0),
        AbortPlan::FromNode(4),
    ] {
        run_case(&Case {
            root: root.clone(),
            abort,
            reason: 1,
        });
    }
}
