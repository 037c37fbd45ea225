//! A side-by-side report: the lock next to the baselines a user would compare it with, measured
//! in one run on one machine.
//!
//! ```text
//! cargo run --release --example bench_report              # the full run, a table for people
//! cargo run --release --example bench_report -- --quick   # under a minute on 2 cores
//! cargo run --release --example bench_report -- --json    # and one JSON object as the last line
//! cargo run --release --example bench_report -- --only failover,observed   # those figures alone
//! # PostgreSQL: a throwaway server started for the run (as the tests do), or the one of --url
//! cargo run --release --features postgres,testkit --example bench_report -- --backend postgres
//! cargo run --release --features postgres,testkit --example bench_report -- --backend postgres --url URL
//! ```
//!
//! Every figure is measured in several rounds, interleaved: round 1 of every measurement, then
//! round 2, and so on, so that a slow spell of a shared machine falls on all of them rather than
//! on one. A figure is the median of its rounds (each round's value is itself a median over many
//! repetitions unless the name says otherwise), printed with the smallest and the largest round.
//! A target whose figures' rounds spread too far (largest − smallest > half the median) is not
//! counted as met: the verdict is "spread too wide", and the run should be repeated on a quieter
//! machine.
//!
//! SQLite databases are files in a temporary directory; PostgreSQL keeps each measurement in a
//! schema of its own (dropped at the end). Default settings unless stated.
//!
//! The parts: this file (the plan and the rounds), `on_sqlite.rs` and `on_postgres.rs` (each
//! backend's report and its floors), `lock.rs` (the lock manager's measurements, the same on
//! both), `core.rs` (contention, and the core's primitives beside `async-lock`), `report.rs`
//! (figures, targets, the table and the JSON line). What the figures have been, and why:
//! `benches/README.md`.

#[cfg(all(feature = "postgres", feature = "testkit"))]
use leasehold::testkit::postgres as pg_support;

use std::cell::RefCell;
use std::fs::File;
use std::hint::black_box;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::executor::block_on;
use leasehold::{
    fork_daemon, Clock, Guard, Interrupted, LockManager, LockManagerBuilder, LockRequest, Scoped,
    Semaphore, SystemClock, TestClock,
};

type Error = Box<dyn std::error::Error>;

/// A target is not counted as met when a figure it reads has rounds further apart than this
/// share of its median.
const WIDE: f64 = 0.5;

mod core;
mod election;
mod lock;
#[cfg(all(feature = "postgres", feature = "testkit"))]
mod on_postgres;
mod on_sqlite;
mod report;

use self::core::*;
use election::*;
use lock::*;
use on_sqlite::*;
use report::*;

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let value_of = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    };
    let quick = args.iter().any(|a| a == "--quick");
    let json = args.iter().any(|a| a == "--json");
    let plan = Plan {
        quick,
        rounds: if quick { 3 } else { 5 },
        only: value_of("--only").map_or_else(Vec::new, |only| {
            only.split(',').map(str::to_owned).collect()
        }),
    };
    let started = Instant::now();
    let report = match value_of("--backend").unwrap_or("sqlite") {
        "sqlite" => sqlite_report(&plan)?,
        #[cfg(all(feature = "postgres", feature = "testkit"))]
        "postgres" => on_postgres::report(&plan, value_of("--url"))?,
        #[cfg(not(all(feature = "postgres", feature = "testkit")))]
        "postgres" => {
            return Err("this build has no PostgreSQL: add --features postgres,testkit".into())
        }
        other => return Err(format!("unknown backend {other:?}: sqlite or postgres").into()),
    };
    report.print_table(started.elapsed());
    if json {
        println!("{}", report.json());
    }
    Ok(())
}

/// How much to measure.
struct Plan {
    quick: bool,
    rounds: usize,
    /// Parts of figure names (`--only a,b`): only the measures with a figure naming one of
    /// them are run, the others and the targets that read them left unjudged. Empty: all.
    only: Vec<String>,
}

impl Plan {
    /// Repetitions in one round, of `full` (or `quick`) in all.
    fn per_round(&self, full: usize, quick: usize) -> usize {
        (if self.quick { quick } else { full } / self.rounds).max(1)
    }

    fn seconds(&self, full: f64, quick: f64) -> Duration {
        Duration::from_secs_f64(if self.quick { quick } else { full })
    }
}

/// One measurement: each call of `round` measures once more and gives one value per figure.
struct Measure<'a> {
    figures: Vec<&'static str>,
    round: Box<dyn FnMut() -> Result<Vec<f64>, Error> + 'a>,
}

fn measure<'a>(
    figures: &[&'static str],
    round: impl FnMut() -> Result<Vec<f64>, Error> + 'a,
) -> Measure<'a> {
    Measure {
        figures: figures.to_vec(),
        round: Box::new(round),
    }
}

/// Round 1 of every measurement, then round 2, and so on.
/// A round that fails is reported, and the targets that read its figures are judged "round
/// failed"; the run goes on.
fn run_rounds(report: &mut Report, measures: &mut [Measure<'_>], plan: &Plan) {
    eprintln!("set up in {:.1} s", report.started.elapsed().as_secs_f64());
    let rounds = plan.rounds;
    let chosen = |measure: &Measure<'_>| {
        plan.only.is_empty()
            || (measure.figures.iter()).any(|figure| plan.only.iter().any(|o| figure.contains(o)))
    };
    for round in 1..=rounds {
        eprintln!("round {round} of {rounds}");
        for measure in measures.iter_mut().filter(|measure| chosen(measure)) {
            let started = Instant::now();
            let values = match (measure.round)() {
                Ok(values) => values,
                Err(error) => {
                    eprintln!("  round {round} of {:?} failed: {error}", measure.figures);
                    for key in &measure.figures {
                        report
                            .failures
                            .push((key, format!("round {round}: {error}")));
                    }
                    continue;
                }
            };
            let took = started.elapsed().as_secs_f64();
            for (key, value) in measure.figures.iter().zip(values) {
                eprintln!("  measured {key} = {value:.1} (round took {took:.1} s)");
                report.add(key, value);
            }
        }
    }
}
