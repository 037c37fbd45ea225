//! What a run is asked to do: its settings, read from the command line.

use super::*;

pub(crate) const USAGE: &str =
    "usage: torture [--seconds N] [--processes N] [--tasks N] [--seed N] \
                     [--lease-ms N] [--heartbeat-ms N] [--backend sqlite|postgres] [--url URL] \
                     [--runtime smol|tokio] [--hold-ms N] [--no-cuts] [--no-steps] \
                     [--no-permits] [--no-election] [--json]";

/// Where the locks are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// A SQLite file in the run's folder.
    Sqlite,
    /// A fresh schema on a PostgreSQL server (feature `postgres`).
    Postgres,
}

/// What runs a child's tasks (and so its background work, which follows the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// smol's global executor.
    Smol,
    /// A tokio runtime with two worker threads.
    Tokio,
}

/// What a run does.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long the children work.
    pub seconds: f64,
    /// How many child processes work at once.
    pub processes: usize,
    /// How many tasks each child runs.
    pub tasks: usize,
    /// Seeds every random choice (faults, operations, hold times).
    pub seed: u64,
    /// The lease of every owner.
    pub lease: Duration,
    /// The heartbeat of every owner.
    pub heartbeat: Duration,
    /// Print the JSON summary line.
    pub json: bool,
    /// Where the locks are kept.
    pub backend: Backend,
    /// The PostgreSQL server to use; `None`: start a throwaway one.
    pub url: Option<String>,
    /// On PostgreSQL, cut children's connections now and then.
    pub cut_connections: bool,
    /// Step every child's wall clock back and forth, all at once, now and then.
    pub clock_steps: bool,
    /// Take permits of `PERMIT_KEYS` besides the shared and exclusive locks of `KEYS`.
    pub permits: bool,
    /// Lead `ELECTION_KEYS` in one task in four of each child.
    pub election: bool,
    /// What runs each child's tasks.
    pub runtime: Runtime,
    /// The longest pause inside a hold, between entering the register and writing, and between
    /// writing and leaving (each drawn from zero to this); twice between entering a tally and
    /// leaving it.
    pub hold: Duration,
    /// How to start a child: program and arguments (the child's settings go in its environment).
    pub child_command: Vec<String>,
}

impl Config {
    pub(crate) fn from_args(args: impl Iterator<Item = String>) -> Result<Config, String> {
        let mut config = Config::default();
        let mut args = args.peekable();
        while let Some(flag) = args.next() {
            // The switches, which take no value.
            match flag.as_str() {
                "--json" => {
                    config.json = true;
                    continue;
                }
                "--no-cuts" => {
                    config.cut_connections = false;
                    continue;
                }
                "--no-steps" => {
                    config.clock_steps = false;
                    continue;
                }
                "--no-permits" => {
                    config.permits = false;
                    continue;
                }
                "--no-election" => {
                    config.election = false;
                    continue;
                }
                _ => {}
            }
            let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let bad = |_: std::num::ParseIntError| format!("{flag}: cannot read {value:?}");
            match flag.as_str() {
                "--seconds" => {
                    config.seconds = value
                        .parse()
                        .map_err(|_| format!("{flag}: cannot read {value:?}"))?
                }
                "--processes" => config.processes = value.parse().map_err(bad)?,
                "--tasks" => config.tasks = value.parse().map_err(bad)?,
                "--seed" => config.seed = value.parse().map_err(bad)?,
                "--lease-ms" => config.lease = Duration::from_millis(value.parse().map_err(bad)?),
                "--heartbeat-ms" => {
                    config.heartbeat = Duration::from_millis(value.parse().map_err(bad)?)
                }
                "--backend" => {
                    config.backend = match value.as_str() {
                        "sqlite" => Backend::Sqlite,
                        "postgres" => Backend::Postgres,
                        _ => return Err(format!("{flag}: sqlite or postgres, not {value:?}")),
                    }
                }
                "--url" => config.url = Some(value),
                "--runtime" => {
                    config.runtime = match value.as_str() {
                        "smol" => Runtime::Smol,
                        "tokio" => Runtime::Tokio,
                        _ => return Err(format!("{flag}: smol or tokio, not {value:?}")),
                    }
                }
                "--hold-ms" => config.hold = Duration::from_millis(value.parse().map_err(bad)?),
                _ => return Err(format!("unknown flag {flag}")),
            }
        }
        if config.processes == 0 || config.tasks == 0 {
            return Err("--processes and --tasks must be at least 1".into());
        }
        if config.url.is_some() && config.backend != Backend::Postgres {
            return Err("--url needs --backend postgres".into());
        }
        if config.backend == Backend::Postgres
            && cfg!(not(all(feature = "postgres", feature = "testkit")))
        {
            return Err(
                "--backend postgres needs a build with `--features postgres,testkit`".into(),
            );
        }
        Ok(config)
    }
}

impl Default for Config {
    fn default() -> Self {
        let exe =
            std::env::current_exe().map_or_else(|_| "torture".into(), |p| p.display().to_string());
        Config {
            seconds: 20.0,
            processes: 4,
            tasks: 4,
            seed: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            lease: Duration::from_secs(1),
            heartbeat: Duration::from_millis(200),
            json: false,
            backend: Backend::Sqlite,
            url: None,
            cut_connections: true,
            clock_steps: true,
            permits: true,
            election: true,
            runtime: Runtime::Smol,
            hold: Duration::from_millis(20),
            child_command: vec![exe],
        }
    }
}
