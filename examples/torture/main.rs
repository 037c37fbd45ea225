//! A torture run for the lock manager: several processes share one lock database (a SQLite file,
//! or a PostgreSQL schema), each running several tasks that take and release locks at random,
//! while this parent kills and pauses them.
//!
//! What is checked, through a *register* per key (a small file that the lock protects), a
//! *tally* per permits key, or a *leader log* per election key:
//!
//! - an exclusive holder marks the register as its own, reads the value, pauses, and writes it
//!   back incremented, tagged with its fencing token; a shared holder reads it twice with a pause
//!   in between and checks that nothing changed;
//! - the register is a fenced resource: it refuses a write whose token is lower than the highest
//!   it has seen, so a holder that was paused past its lease cannot overwrite newer work;
//! - whenever one holder finds another's mark, the older of the two must have lost its lease: it
//!   is told so when it leaves, and it counts a violation unless its `lost()` signal fires;
//! - a holder that the parent paused (SIGSTOP) for longer than the lease must see `lost()` fire
//!   once it resumes;
//! - the permits keys (`delta` and `epsilon`, 3 permits each; not with `--no-permits`) are taken
//!   1 to 3 permits at a time, alone (`permits`, `try_acquire`) or with a shared or exclusive key
//!   (`many`, `many_queued`), and have a tally each instead of a register: a holder adds its
//!   count when it enters and takes it out when it leaves. Whenever the counts pass the limit,
//!   the holders whose `lost()` had not fired when they left must have no more than the limit
//!   between them; an overrun is fine only if holders that had lost their leases make up the
//!   excess (`tally.rs` says why that is sound);
//! - the election keys (`leader-a` and `leader-b`; not with `--no-election`) are led, one task in
//!   four of every child, with `LockManager::lead`: a body enters its key's leader log and writes
//!   to it, tagged with its term, for a random while (`--hold-ms`), recording when it began and
//!   ended on the machine's monotonic clock. The log refuses a term lower than the highest it
//!   has taken, and a refused write must come from a leader that had been told its lease was
//!   lost. No two bodies of a key may run at once, unless the earlier one's child was paused or
//!   killed during it, or it had been told (a frozen process can be told nothing before the next
//!   leader begins; once it resumes, its `lead` must end with `LeaseLost`); and terms must grow
//!   in the order bodies begin (`election.rs` says exactly what is excused, and why);
//! - at the end every owner shuts down, and after one lease the database holds no rows at all.
//!
//! Besides the kills and pauses, every child's wall clock (its [`Clock`](leasehold::Clock)'s
//! `now`) is stepped now and then, forward and back by 2 to 5 s, all children at once, as an
//! NTP step or `date -s` is seen by every process of a machine (not with `--no-steps`; the JSON
//! line says `clock_steps`). Leases must not care.
//!
//! Run it with `cargo run --release --example torture -- --seconds 20 --processes 4 --json`;
//! `--seconds 600` is the soak run. The process exits with status 1 if any check failed.
//! Its tests (`tests.rs`, run by `cargo test`) run a few seconds of it.
//!
//! # The parts
//!
//! `config.rs` (the settings), `basics.rs` (randomness, time, files), `register.rs` (the fenced
//! resource), `tally.rs` (the permits keys' counts, and their judgement), `election.rs` (the
//! leaders' work, their leader logs, and their judgement), `store.rs` (where the
//! locks are kept, and the store's history), `counters.rs` (what each child counts), `child.rs`
//! (a child's tasks), `parent.rs` (the faults, the summary and its explanations), and
//! `tests.rs`.
//!
//! # Flags
//!
//! `--seconds`, `--processes`, `--tasks` (per process), `--seed` (a run is reproducible from its
//! seed as far as scheduling allows), `--lease-ms` and `--heartbeat-ms` (default 1,000 and 200),
//! `--hold-ms` (the longest pause inside a hold, twice per hold; default 20, so holds of seconds
//! with 1500), `--runtime smol|tokio` (what runs each child's tasks: smol's global executor, or a
//! tokio runtime of two threads), `--backend sqlite|postgres` (default `sqlite`), `--url URL` and
//! `--no-cuts` (with `postgres`, see below), `--no-steps` (no clock steps), `--no-permits` (no
//! permits keys: the shared and exclusive workload draws what it drew before there were
//! permits), `--no-election` (no election keys: every task takes locks, as before there were
//! elections), `--json` (one JSON object as the last line).
//!
//! Besides the grants (`grants` counts guards; `shared_grants`, `exclusive_grants` and
//! `permit_grants` the keys they hold), the summary gives `permits_most`, the most permits of one
//! key that holders whose leases held had at once, beside `permits_limit`, and
//! `permit_overruns`, the times a tally passed the limit with lost leases making up the excess.
//! For the elections: `election_grants` (bodies begun), `election_terms` (bodies recorded),
//! `election_resigned` and `election_lease_lost` (how `lead` ended), `election_writes`,
//! `election_stopped_leaders` (bodies a pause fell in), `election_overlaps_excused` (pairs of
//! bodies that ran at once, excused) and of those `election_overlaps_told` (excused only because
//! the earlier leader had been told, its child running: a clean-up that outlasted its
//! heartbeat), `election_order_excused` (a lower term begun just after its child's pause) and
//! `election_stale_writes_refused` (writes the leader log refused from leaders told their lease
//! was lost: mostly a paused leader's, once it resumed), `election_losses_masked` (a paused
//! leader whose `lead` the run's timeout ended as `Interrupted`, not `LeaseLost`, its `lost()`
//! having fired: see `election.rs`).
//!
//! # What counts as harm
//!
//! The run exits with status 1 if any of these is not 0: `violations`, `permit_violations`
//! (holders whose leases held had more permits of a key than its limit), `election_violations`
//! (two bodies of a key at once, not excused), `election_order_violations` (a body begun after a
//! higher term), `election_untold_refusals` (a leader log's refusal of a leader never told),
//! `late_losses` (another holder's work seen, or a leader's write refused, while `lost()` had not
//! yet fired), `lost_updates`,
//! `stale_writes_accepted`, `leaked_rows`, `storage_errors`, `stops_unnoticed` (a paused holder
//! whose `lost()` never fired) or `failed_children` (a child that did not finish: its threads'
//! stacks go to its log, by `gdb` where there is one). It then keeps its folder (child logs,
//! registers, tallies and their `overruns`, leader logs and their `election-KEY` records,
//! database) for a look. Every suspected holder is
//! explained in `explain.txt` there (and on stderr): the store's history of its key around it
//! (every row inserted, changed or deleted, with the store's time, who did it and its mode, kept
//! by a trigger the run puts on the table) and the faults the parent made meanwhile.
//!
//! # On PostgreSQL
//!
//! `--backend postgres` (built with `--features postgres,testkit`) keeps the locks in a fresh schema of a
//! PostgreSQL server: the one `--url URL` names (a libpq URL or connection string), or else a
//! throwaway server this run starts and stops itself, from the server programs on the machine
//! (the tests' harness, `leasehold::testkit::postgres`). On top of the kills and pauses it
//!
//! - cuts random children's connections (`pg_terminate_backend`; not with `--no-cuts`);
//! - restarts the server twice, once with `pg_ctl restart -m fast` and once with `-m immediate`
//!   (a crash), at 30 % and 50 % of the run (only on a server it started);
//! - runs child 0 with a clock 10 s ahead and child 1 with one 10 s behind (a skewed
//!   [`Clock`](leasehold::Clock)): leases are judged by the server's clock, so they must not care.
//!
//! A storage error is a failure, except inside a restart's window (from the restart until two
//! leases after the server is back): there it is counted as `restart_storage_errors`, and the
//! operation is tried again. The JSON line adds `connection_kills`, `server_restarts`,
//! `skewed_children` and `restart_storage_errors` (0 on SQLite). A cut that lands inside a write
//! transaction does not fail its callers: the transaction is done again on a new connection.
//!
//! `cargo run --release --all-features --example torture -- --backend postgres --seconds 20 --json`

use std::collections::BTreeSet;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use futures::FutureExt;
use leasehold::{
    fork_daemon, AbortController, AbortSignal, Clock, EntryState, Guard, LockError, LockManager,
    LockManagerBuilder, LockRequest, Mode, Scoped, SystemClock,
};

/// The test harness's throwaway PostgreSQL server.
#[cfg(all(feature = "postgres", feature = "testkit"))]
use leasehold::testkit::postgres as pg_support;

/// Set in a child's environment (to the folder the run works in); its absence means "parent".
const CHILD_ENV: &str = "LEASEHOLD_TORTURE_CHILD";

/// The keys taken shared and exclusive; each guards a register.
const KEYS: [&str; 3] = ["alpha", "beta", "gamma"];

/// The keys taken in permits (not with `--no-permits`), each of `PERMIT_LIMIT`; each has a tally.
const PERMIT_KEYS: [&str; 2] = ["delta", "epsilon"];

/// The limit of every permits key.
const PERMIT_LIMIT: u32 = 3;

/// The election keys (not with `--no-election`); each has a leader log.
const ELECTION_KEYS: [&str; 2] = ["leader-a", "leader-b"];

mod basics;
mod child;
mod config;
mod counters;
mod election;
mod parent;
mod register;
mod store;
mod tally;

use basics::*;
use child::*;
use config::*;
use counters::*;
use election::*;
use parent::*;
use register::*;
use store::*;
use tally::*;

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        child_main();
        return;
    }
    let config = match Config::from_args(std::env::args().skip(1)) {
        Ok(config) => config,
        Err(why) => {
            eprintln!("{why}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    let json = config.json;
    let Some(store) = Store::open(&config) else {
        eprintln!("no PostgreSQL server to run against (the reason is above)");
        std::process::exit(2);
    };
    let summary = run(&config, &store);
    println!("{}", summary.describe());
    if json {
        println!("{}", summary.json());
    }
    if !summary.failures().is_empty() {
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests;
