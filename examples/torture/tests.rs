//! A few seconds of the torture run on every `cargo test` (the example is tested: `test = true`
//! in `Cargo.toml`): two child processes, a kill, a pause and clock steps both ways, and every
//! check of the full run;
//! and with the `postgres` and `testkit` features, a few seconds of it on a throwaway PostgreSQL
//! server, with a cut connection, both kinds of restart and skewed clocks besides (skipped with a
//! printed reason when the server programs are missing, unless `LEASEHOLD_REQUIRE_POSTGRES=1`).
//!
//! The test binary is its own child (`torture_child` does nothing unless the run started this
//! process as a child).

use std::time::Duration;

use super::{child_main, run, Backend, Config, Runtime, Store, Summary};

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
        summary.totals.grants >= 50,
        "too little happened:\n{}",
        summary.describe()
    );
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
