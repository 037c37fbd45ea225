//! Property: however a tree of nested `Scoped` futures ends (values, early returns that drop
//! unfinished children, an interruption at a random moment, the root dropped at a random step),
//! the clean-up promises hold (the kit's `check_cleanup` and leak check), each finalizer is told
//! how its own scope ended, a value already produced is never lost, and an interrupted root
//! reports the caller's reason object. The trees run in the simulation kit.

#![cfg(feature = "testkit")]

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::yield_now;
use futures::future;
use leasehold::testkit::{check_cleanup, stop_at, strategy, Sim, SimConfig};
use leasehold::{
    AbortController, AbortReason, Clock, Dropped, ExitStatus, Interrupted, Scope, Scoped,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct FinalizerSpec {
    /// Milliseconds of sleep inside the finalizer, after `yields` yields.
    sleep: u64,
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
    /// Once this many milliseconds have passed (a task of the simulation aborts then).
    AtMillis(u64),
    /// From inside the body of a node (its number modulo the node count), while it is polled.
    FromNode(usize),
}

fn finalizer_spec() -> impl Strategy<Value = FinalizerSpec> {
    (0u64..=3, 0u8..=2).prop_map(|(sleep, yields)| FinalizerSpec { sleep, yields })
}

fn tree() -> impl Strategy<Value = NodeSpec> {
    let node = |children: BoxedStrategy<Vec<NodeSpec>>| {
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
    };
    // Up to three levels below the root, up to three children a node.
    node(Just(Vec::new()).boxed()).prop_recursive(3, 60, 3, move |inner| {
        node(prop::collection::vec(inner, 1..=3).boxed())
    })
}

fn abort_plan() -> impl Strategy<Value = AbortPlan> {
    prop_oneof![
        1 => Just(AbortPlan::Never),
        1 => Just(AbortPlan::BeforeStart),
        6 => (0u64..=14).prop_map(AbortPlan::AtMillis),
        2 => any::<usize>().prop_map(AbortPlan::FromNode),
    ]
}

/// What only the tree's author can know: which bodies finished, and what each node's
/// finalizers were told.
#[derive(Default)]
struct Seen {
    parent: Vec<Option<usize>>,
    done: BTreeSet<usize>,
    told: Vec<(usize, ExitStatus)>,
}

/// Builds the tree; `abort_in` is called with each node's number as its body starts.
fn build(
    spec: &NodeSpec,
    parent: Option<usize>,
    seen: &Arc<Mutex<Seen>>,
    clock: &Arc<dyn Clock>,
    abort_in: &Arc<dyn Fn(usize) + Send + Sync>,
) -> Scoped<(), Interrupted> {
    let node = {
        let mut seen = seen.lock().unwrap();
        seen.parent.push(parent);
        seen.parent.len() - 1
    };
    let children: Vec<_> = (spec.children.iter())
        .map(|child| build(child, Some(node), seen, clock, abort_in))
        .collect();
    let (spec, seen, clock, abort_in) =
        (spec.clone(), seen.clone(), clock.clone(), abort_in.clone());
    Scoped::new(move |scope| async move {
        let add = |finalizers: &[FinalizerSpec]| {
            for finalizer in finalizers.iter().cloned() {
                add_finalizer(&scope, finalizer, node, &seen, &clock);
            }
        };
        add(&spec.early_finalizers);
        abort_in(node);
        clock.sleep(Duration::from_millis(spec.work)).await;
        let children = future::join_all(children);
        match spec.early_return {
            None => {
                for result in children.await {
                    result?;
                }
            }
            // Whichever finishes first; unfinished children are dropped with the loser.
            Some(after) => {
                drop(future::select(children, clock.sleep(Duration::from_millis(after))).await)
            }
        }
        add(&spec.late_finalizers);
        seen.lock().unwrap().done.insert(node);
        Ok(())
    })
}

fn add_finalizer(
    scope: &Scope,
    spec: FinalizerSpec,
    node: usize,
    seen: &Arc<Mutex<Seen>>,
    clock: &Arc<dyn Clock>,
) {
    let (seen, clock) = (seen.clone(), clock.clone());
    scope.add_finalizer(move |status| async move {
        seen.lock().unwrap().told.push((node, status));
        for _ in 0..spec.yields {
            yield_now().await;
        }
        clock.sleep(Duration::from_millis(spec.sleep)).await;
    });
}

/// Each finalizer was told how its own scope ended: success if its body finished; `Dropped`
/// if an ancestor finished first and dropped it; else the caller's interruption.
fn check_told(seen: &Seen, reason: &AbortReason) {
    for (node, status) in &seen.told {
        let mut ancestor = seen.parent[*node];
        let dropped = loop {
            match ancestor {
                Some(parent) if seen.done.contains(&parent) => break true,
                Some(parent) => ancestor = seen.parent[parent],
                None => break false,
            }
        };
        match status {
            ExitStatus::Success => assert!(seen.done.contains(node), "node {node} told success"),
            ExitStatus::Interrupted(told) if dropped => {
                assert!(
                    told.downcast_ref::<Dropped>().is_some(),
                    "node {node}: {told:?}"
                )
            }
            ExitStatus::Interrupted(told) => assert!(told.ptr_eq(reason), "node {node}: {told:?}"),
            other => panic!("node {node} was told {other:?}"),
        }
    }
}

fn run_case(root: &NodeSpec, abort: AbortPlan, seed: u64) {
    let mut sim = Sim::new(seed);
    let clock: Arc<dyn Clock> = Arc::new(sim.clock());
    let controller = AbortController::new();
    let reason = AbortReason::new(std::io::Error::other("the case's reason"));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (trigger, given) = (controller.clone(), reason.clone());
    let target = Arc::new(Mutex::new(usize::MAX));
    let at_node = target.clone();
    let abort_in: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |node| {
        if *at_node.lock().unwrap() == node {
            trigger.abort(given.clone());
        }
    });
    let tree = build(root, None, &seen, &clock, &abort_in).with_signal(&controller.signal());
    let nodes = seen.lock().unwrap().parent.len();
    // Aborted between two polls while the root's body had no value: it must not run on. (An
    // abort from inside the tree lands mid-poll, and the body may still finish in that poll.)
    let must_be_interrupted = Arc::new(Mutex::new(matches!(abort, AbortPlan::BeforeStart)));
    match abort {
        AbortPlan::Never => {}
        AbortPlan::BeforeStart => drop(controller.abort(reason.clone())),
        AbortPlan::FromNode(node) => *target.lock().unwrap() = node % nodes,
        AbortPlan::AtMillis(at) => {
            let (controller, reason, clock) = (controller.clone(), reason.clone(), clock.clone());
            let (seen, must) = (seen.clone(), must_be_interrupted.clone());
            sim.spawner().spawn(Box::pin(async move {
                clock.sleep(Duration::from_millis(at)).await;
                *must.lock().unwrap() = !seen.lock().unwrap().done.contains(&0);
                controller.abort(reason);
            }));
        }
    }
    let result = sim.block_on(tree).unwrap_or_else(|error| panic!("{error}"));
    check_cleanup(&sim.events())
        .unwrap_or_else(|violation| panic!("{violation} ({})", sim.trace()));
    let seen = seen.lock().unwrap();
    if let AbortPlan::BeforeStart = abort {
        assert!(
            seen.told.is_empty() && seen.done.is_empty(),
            "the root ran after the abort"
        );
    }
    if *must_be_interrupted.lock().unwrap() {
        assert!(result.is_err(), "the root's body ran on after the abort");
    }
    match result {
        // A value already produced is never lost to a late interruption.
        Ok(()) => assert!(seen.done.contains(&0)),
        Err(error) => {
            assert!(
                !seen.done.contains(&0),
                "the root's value was lost: {error}"
            );
            assert!(
                error.reason().ptr_eq(&reason),
                "not the caller's reason object"
            );
        }
    }
    check_told(&seen, &reason);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn nested_scopes_close_inner_before_outer_and_before_the_root_resolves(
        root in tree(),
        abort in abort_plan(),
        seed in strategy::seed(),
    ) {
        run_case(&root, abort, seed);
    }

    #[test]
    fn a_tree_stopped_at_any_step_by_signal_or_drop_cleans_up(
        root in tree(),
        stop in strategy::stop(),
        point in strategy::interrupt_at(),
        schedule in strategy::schedule(),
    ) {
        let mut config = SimConfig::default();
        config.schedule = Some(schedule);
        let result = stop_at(config, stop, point, |sim| {
            let clock: Arc<dyn Clock> = Arc::new(sim.clock());
            let nothing: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(|_| {});
            build(&root, None, &Arc::default(), &clock, &nothing)
        });
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}

/// One hand-written case of each kind, so that a regression shows up with a readable name too.
#[test]
fn a_deep_tree_interrupted_mid_flight_unwinds_inner_before_outer() {
    let finalizer = |sleep, yields| FinalizerSpec { sleep, yields };
    let leaf = |sleep| NodeSpec {
        early_finalizers: vec![finalizer(sleep, 1)],
        late_finalizers: vec![],
        work: 5,
        early_return: None,
        children: vec![],
    };
    let middle = |children| NodeSpec {
        early_finalizers: vec![finalizer(2, 0); 2],
        late_finalizers: vec![finalizer(1, 0)],
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
        for seed in 0..4 {
            run_case(&root, abort, seed);
        }
    }
}
