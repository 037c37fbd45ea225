//! A few seconds of the torture run (`examples/torture.rs`) on every `cargo test`: two child
//! processes, a kill and a pause, and every check of the full run.
//!
//! The example's code is compiled into this test as a module; the test binary is its own child
//! (`torture_child` does nothing unless the run started this process as a child).

#[allow(dead_code)]
#[path = "../examples/torture.rs"]
mod torture;

use std::time::Duration;

#[test]
fn torture_child() {
    if std::env::var_os("LEASEHOLD_TORTURE_CHILD").is_some() {
        torture::child_main();
    }
}

#[test]
fn a_short_torture_run_passes_every_check() {
    let exe = std::env::current_exe().expect("the test binary");
    let config = torture::Config {
        seconds: 5.0,
        processes: 2,
        tasks: 4,
        seed: 5,
        lease: Duration::from_secs(1),
        heartbeat: Duration::from_millis(200),
        json: true,
        child_command: vec![
            exe.display().to_string(),
            "--exact".into(),
            "torture_child".into(),
            "--nocapture".into(),
        ],
    };
    let summary = torture::run(&config);
    println!("{}\n{}", summary.describe(), summary.json());
    assert!(summary.failures().is_empty(), "{}", summary.describe());
    assert!(
        summary.kills >= 1,
        "no child was killed:\n{}",
        summary.describe()
    );
    assert!(
        summary.stops >= 1,
        "no child was paused:\n{}",
        summary.describe()
    );
    assert!(
        summary.totals.grants >= 50,
        "too little happened:\n{}",
        summary.describe()
    );
}
