//! A few seconds of the torture run on every `cargo test` (the example is tested: `test = true`
//! in `Cargo.toml`): two child processes, a kill, a pause and clock steps both ways, and every
//! check of the full run;
//! and with the `postgres` and `testkit` features, a few seconds of it on a throwaway PostgreSQL
//! server, with a cut connection, both kinds of restart and skewed clocks besides (skipped with a
//! printed reason when the server programs are missing, unless `LEASEHOLD_REQUIRE_POSTGRES=1`).
//!
//! The test binary is its own child (`torture_child` does nothing unless the run started this
//! process as a child).
//!
//! The permits check (`tally.rs`) is also tested on its own: an overrun is a violation only when
//! the holders whose leases held pass the limit.

use std::time::Duration;

use super::{
    child_main, run, Backend, Config, ElectionFindings, FileState, Holder, LeaderBody,
    LeaderLogState, Mark, Moment, MonoFaults, PermitsFindings, Runtime, Store, Summary, TallyState,
};

#[test]
fn torture_child() {
    if std::env::var_os(super::CHILD_ENV).is_some() {
        child_main();
    }
}

/// A short run's settings, with this test binary as the child.
fn short_run(seconds: f64, backend: Backend) -> Config {
    let exe = std::env::current_exe().expect("the test binary");
    Config {
        seconds,
        processes: 2,
        tasks: 4,
        seed: 5,
        lease: Duration::from_secs(1),
        heartbeat: Duration::from_millis(200),
        json: true,
        backend,
        url: None,
        cut_connections: true,
        clock_steps: true,
        permits: true,
        election: true,
        runtime: Runtime::Smol,
        hold: Duration::from_millis(20),
        child_command: vec![
            exe.display().to_string(),
            "--exact".into(),
            "tests::torture_child".into(),
            "--nocapture".into(),
        ],
    }
}

/// Asserts that `summary` passed every check, and that kills, pauses and work happened.
fn assert_clean(summary: &Summary) {
    println!("{}\n{}", summary.describe(), summary.json());
    assert!(summary.failures().is_empty(), "{}", summary.describe());
    for (what, count) in [("killed", summary.kills), ("paused", summary.stops)] {
        assert!(count >= 1, "no child was {what}:\n{}", summary.describe());
    }
    assert!(
        summary.clock_steps >= 2,
        "the clocks were not stepped both ways:\n{}",
        summary.describe()
    );
    assert!(
        summary.totals.grants >= 50 && summary.totals.permit_grants >= 10,
        "too little happened:\n{}",
        summary.describe()
    );
    assert!(
        summary.totals.election_grants >= 10 && summary.election_terms >= 10,
        "too little leading:\n{}",
        summary.describe()
    );
}

/// A holder of `count` permits in child `tag`.
fn holder(token: u64, tag: &str, count: u64) -> Holder {
    Holder {
        mark: Mark {
            token,
            tag: tag.into(),
        },
        count,
        granted_at: token * 10,
    }
}

/// What the parent makes of `state` and the overruns it has judged (as the run's file has them).
fn findings(state: TallyState, judged: &[super::Overrun]) -> PermitsFindings {
    let lines: String = (judged.iter())
        .map(|overrun| format!("delta {}\n", overrun.render()))
        .collect();
    PermitsFindings::judge(&lines, &[("delta".into(), state)])
}

#[test]
fn holders_within_the_limit_are_no_overrun() {
    let mut state = TallyState::default();
    state.enter(holder(1, "0.1", 2), 3, 100);
    state.enter(holder(2, "1.1", 1), 3, 101);
    assert!(state.leave(&holder(1, "0.1", 2).mark, false).is_empty());
    state.enter(holder(3, "2.1", 2), 3, 102);
    let found = findings(state, &[]);
    assert_eq!((found.most, found.limit, found.overruns), (3, 3, 0));
    assert!(found.violations.is_empty());
}

#[test]
fn an_overrun_made_up_by_a_lost_lease_is_not_a_violation() {
    // Child 0 was paused past its lease holding 2 of 3; child 1 was granted 2 meanwhile.
    let mut state = TallyState::default();
    state.enter(holder(1, "0.1", 2), 3, 100);
    state.enter(holder(2, "1.1", 2), 3, 101);
    assert!(state.leave(&holder(2, "1.1", 2).mark, false).is_empty());
    let judged = state.leave(&holder(1, "0.1", 2).mark, true);
    assert_eq!(judged.len(), 1, "judged whole once both left");
    let found = findings(state, &judged);
    assert_eq!((found.most, found.overruns), (2, 1));
    assert!(found.violations.is_empty());
}

#[test]
fn an_over_limit_overlap_of_holders_whose_leases_held_is_a_violation() {
    let mut state = TallyState::default();
    state.enter(holder(1, "0.1", 2), 3, 100);
    state.enter(holder(2, "1.1", 1), 3, 101);
    state.enter(holder(3, "2.1", 1), 3, 102);
    let mut judged = state.leave(&holder(3, "2.1", 1).mark, false);
    judged.extend(state.leave(&holder(2, "1.1", 1).mark, false));
    judged.extend(state.leave(&holder(1, "0.1", 2).mark, false));
    let found = findings(state, &judged);
    assert_eq!(found.violations.len(), 1);
    assert_eq!((found.most, found.overruns), (4, 0), "4 of 3 held at once");
}

#[test]
fn a_killed_member_is_not_counted_as_holding() {
    let mut state = TallyState::default();
    state.enter(holder(1, "0.1", 3), 3, 100);
    state.enter(holder(2, "1.1", 1), 3, 101);
    let mut judged = state.clear("0.1");
    judged.extend(state.leave(&holder(2, "1.1", 1).mark, false));
    let found = findings(state, &judged);
    assert!(found.violations.is_empty());
    assert_eq!(found.overruns, 1);
}

#[test]
fn an_overrun_kept_twice_counts_once_and_an_open_one_is_judged_too() {
    let mut state = TallyState::default();
    state.enter(holder(1, "0.1", 2), 3, 100);
    state.enter(holder(2, "1.1", 2), 3, 101);
    let mut judged = state.leave(&holder(1, "0.1", 2).mark, false);
    judged.extend(state.leave(&holder(2, "1.1", 2).mark, false));
    // A child killed between keeping the overrun and writing the tally leaves it in both.
    let mut again = TallyState::parse(&state.render());
    again.open = judged.clone();
    let found = findings(again, &judged);
    assert_eq!(found.violations.len(), 1);
    // Still open at the end: its open members count as not holding.
    let mut state = TallyState::default();
    state.enter(holder(1, "0.1", 2), 3, 100);
    state.enter(holder(2, "1.1", 2), 3, 101);
    state.leave(&holder(2, "1.1", 2).mark, false);
    let found = findings(TallyState::parse(&state.render()), &[]);
    assert_eq!((found.violations.len(), found.overruns), (0, 1));
}

/// A body of child `tag` with term `term` that ran from `began` to `ended` (monotonic micros),
/// told or not that its lease was lost.
fn body(term: u64, tag: &str, began: u64, ended: Option<u64>, told: bool) -> LeaderBody {
    let at = |mono| Moment { mono, unix: mono };
    LeaderBody {
        term,
        tag: tag.into(),
        began: at(began),
        ended: ended.map(at),
        told,
    }
}

/// What the parent makes of `bodies` of one key, given its `faults`.
fn judged(bodies: Vec<LeaderBody>, faults: &str) -> ElectionFindings {
    let mut findings = ElectionFindings::default();
    findings.judge("leader-a", bodies, &MonoFaults::parse(faults));
    findings
}

#[test]
fn leaders_one_after_another_are_no_overlap() {
    let found = judged(
        vec![
            body(1, "0.1", 100, Some(200), false),
            body(2, "1.1", 210, Some(300), true),
            body(3, "0.1", 300, Some(400), false),
        ],
        "",
    );
    assert_eq!((found.terms, found.overlaps_excused), (3, 0));
    assert!(found.violations.is_empty() && found.order_violations.is_empty());
}

#[test]
fn an_overlap_of_a_leader_never_told_is_a_violation() {
    // Child 0's body still ran, untold, not paused, when child 1's began.
    let found = judged(
        vec![
            body(1, "0.1", 100, Some(250), false),
            body(2, "1.1", 200, Some(300), false),
        ],
        // A pause of another child, and one of child 0 after its body, excuse nothing.
        "stopped\t1.1\t100\t150\nstopped\t0.1\t260\t900\n",
    );
    assert_eq!(found.violations.len(), 1);
    let (key, earlier, later) = &found.violations[0];
    assert_eq!((key.as_str(), earlier.term, later.term), ("leader-a", 1, 2));
    assert_eq!(found.overlaps_excused, 0);
}

#[test]
fn an_overlap_of_a_paused_told_or_killed_leader_is_excused() {
    let found = judged(
        vec![
            // Paused during its body.
            body(1, "0.1", 100, Some(2_500), true),
            body(2, "1.1", 2_000, Some(2_600), false),
            // Told, by its end, that its lease was lost.
            body(3, "1.1", 2_600, Some(3_100), true),
            body(4, "0.1", 3_000, Some(3_200), false),
            // Killed before it recorded its end.
            body(5, "2.1", 3_200, None, false),
            body(6, "1.1", 3_300, Some(3_400), false),
        ],
        "stopped\t0.1\t150\t2400\nkilled\t2.1\t3500\n",
    );
    assert!(found.violations.is_empty(), "{:?}", found.violations);
    assert_eq!((found.overlaps_excused, found.overlaps_told), (3, 1));
}

#[test]
fn a_lower_term_beginning_later_is_a_violation_unless_just_after_a_pause() {
    let bodies = || {
        vec![
            body(2, "1.1", 100, Some(200), false),
            body(1, "0.1", 300, Some(400), true),
        ]
    };
    let found = judged(bodies(), "");
    assert_eq!(found.order_violations.len(), 1);
    let found = judged(bodies(), "stopped\t0.1\t50\t290\n");
    assert_eq!((found.order_violations.len(), found.order_excused), (0, 1));
}

#[test]
fn the_leader_log_refuses_an_older_term() {
    let mark = |token| Mark {
        token,
        tag: "0.1".into(),
    };
    let mut log = LeaderLogState::default();
    assert!(log.take(&mark(3), true));
    assert!(log.take(&mark(3), false));
    assert!(log.take(&mark(5), true));
    assert!(!log.take(&mark(3), false), "a deposed leader's write");
    assert!(
        !log.take(&mark(4), true),
        "a leader that begins after a newer one"
    );
    let again = LeaderLogState::parse(&log.render());
    assert_eq!((again.fence, again.writes), (5, 1));
    assert_eq!(again, log);
}

#[test]
fn a_short_torture_run_passes_every_check() {
    // Long enough that, on a busy machine, the pause still finds a holder in the fault window
    // (from 20 % of the run to 2.6 s before its end); at 5 s it once did not.
    let config = short_run(8.0, Backend::Sqlite);
    let store = Store::open(&config).expect("SQLite needs no server");
    assert_clean(&run(&config, &store));
}

/// On the server `LEASEHOLD_POSTGRES_URL` names, if any (then without restarts), else on one the
/// run starts.
#[cfg(feature = "postgres")]
#[test]
fn a_short_torture_run_on_postgres_passes_every_check() {
    let config = Config {
        url: std::env::var("LEASEHOLD_POSTGRES_URL")
            .ok()
            .filter(|url| !url.is_empty()),
        ..short_run(8.0, Backend::Postgres)
    };
    let Some(store) = Store::open(&config) else {
        return; // skipped, the reason printed
    };
    let summary = run(&config, &store);
    assert_clean(&summary);
    let restarts = if config.url.is_some() { 0 } else { 2 };
    assert_eq!(summary.server_restarts, restarts, "{}", summary.describe());
    assert_eq!(summary.skewed_children, 2, "{}", summary.describe());
}
