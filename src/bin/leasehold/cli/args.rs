//! The command's arguments, and every `--help`.

use std::time::Duration;

use clap::{ArgGroup, Args as ClapArgs, Parser, Subcommand};

use super::parse_duration;

const STORE_HELP: &str =
    "A SQLite file, or (built with `postgres`) a postgres:// URL or libpq string";

#[derive(Debug, Parser)]
#[command(
    name = "leasehold",
    version,
    about = "Shared and exclusive locks with leases, fair queues and fencing tokens, in a SQLite \
             file (one machine) or PostgreSQL (several): run a program under one, and see, mend \
             and check what a store holds.",
    after_help = "Examples:\n  \
        leasehold run locks.db backup -- ./backup.sh\n  \
        leasehold elect locks.db scheduler -- ./scheduler\n  \
        leasehold inspect locks.db\n  \
        leasehold doctor postgres://app@db.internal/app"
)]
pub(crate) struct Args {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    Run(Run),
    Elect(Elect),
    Inspect(Inspect),
    Watch(Watch),
    Release(Release),
    Doctor(Doctor),
}

/// Where the rows are.
#[derive(Debug, ClapArgs)]
pub(crate) struct StoreArgs {
    #[arg(help = STORE_HELP)]
    pub(crate) store: String,
    /// The PostgreSQL schema that holds the tables [default: leasehold]
    #[arg(long, value_name = "NAME")]
    pub(crate) schema: Option<String>,
}

/// Run COMMAND while holding a lock on KEY
///
/// Takes the lock (exclusive unless -s; or with --limit N, K of the key's N permits: at most N
/// held at once, whoever holds them), runs COMMAND with LEASEHOLD_FENCING_TOKEN,
/// LEASEHOLD_KEY and LEASEHOLD_OWNER in its environment, renews the lease while it runs,
/// releases when it exits, and exits with its status. SIGINT, SIGTERM or SIGHUP while waiting
/// leaves the queue (no row is left) and exits 130, 143 or 129; while COMMAND runs they are
/// passed on to it. If the lease is lost while COMMAND runs (this process was stopped past it,
/// or an operator released it), COMMAND is sent SIGTERM, then SIGKILL after --grace, and the
/// exit code is 4. If an operator removes the request while it waits (`leasehold release`), it
/// says who did, runs nothing and exits 5. If this process dies (even of SIGKILL), COMMAND is
/// killed at once, and off a terminal every process in its group (Linux; elsewhere COMMAND runs
/// on without the lock).
#[derive(Debug, ClapArgs)]
#[command(
    group(ArgGroup::new("mode").args(["shared", "exclusive", "limit"])),
    group(ArgGroup::new("waiting").args(["wait", "no_wait"])),
    after_help = "Examples:\n  \
        leasehold run locks.db repo/photos -- rsync -a photos/ backup:/photos/\n  \
        leasehold run -s -w 30s locks.db repo/photos -- ./read-only-report.sh\n  \
        leasehold run -n -E 75 postgres://app@db/app nightly -- ./nightly.sh   # skip if running\n  \
        leasehold run --limit 3 locks.db backups -- ./backup.sh   # at most 3 backups at once"
)]
pub(crate) struct Run {
    /// Take a shared lock: others with -s hold it at once, none with -x
    #[arg(short = 's', long)]
    pub(crate) shared: bool,
    /// Take an exclusive lock (the default)
    #[arg(short = 'x', long)]
    pub(crate) exclusive: bool,
    /// Take permits of KEY instead of a lock: it has N, and at most N are held at once; every
    /// run on KEY must give the same N
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) limit: Option<u32>,
    /// With --limit, how many of KEY's permits to take, at most N [default: 1]
    #[arg(
        long,
        value_name = "K",
        requires = "limit",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub(crate) count: Option<u32>,
    /// Wait at most this long for the lock, then run nothing and exit with the conflict code;
    /// 0s takes a free lock and waits for none (as -n)
    #[arg(short = 'w', long, value_name = "DURATION", value_parser = parse_duration)]
    pub(crate) wait: Option<Duration>,
    /// Do not wait: if the lock is held, run nothing and exit with the conflict code
    #[arg(short = 'n', long)]
    pub(crate) no_wait: bool,
    /// The exit code when the lock could not be had (-n, or -w ran out)
    #[arg(
        short = 'E',
        long,
        value_name = "N",
        default_value_t = 1,
        value_parser = clap::value_parser!(u8).range(1..)
    )]
    pub(crate) conflict_exit_code: u8,
    /// What the holder is doing, as others see it [default: COMMAND's name]
    #[arg(long, value_name = "NAME")]
    pub(crate) operation: Option<String>,
    /// How long the lock outlives this process if it stops renewing it (at least 300ms);
    /// renewed every third of it
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub(crate) lease: Duration,
    /// After a lost lease, how long COMMAND has between SIGTERM and SIGKILL
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub(crate) grace: Duration,
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The lock's name
    pub(crate) key: String,
    /// The program to run, and its arguments (after `--`)
    #[arg(required = true, last = true, value_name = "COMMAND")]
    pub(crate) command: Vec<String>,
}

/// Run COMMAND while leading the election KEY; or, with --listen, print each leader change
///
/// Campaigns with VALUE: waits, in the order campaigners came, for the exclusive lock on KEY,
/// whose operation is the leader's VALUE; then runs COMMAND while leading, as `run` runs it
/// (its signals, --lease, --grace, and the exit codes), with LEASEHOLD_TERM (the leader's term:
/// its fencing token, larger than every earlier leader's) besides LEASEHOLD_FENCING_TOKEN,
/// LEASEHOLD_KEY and LEASEHOLD_OWNER in its environment. When COMMAND exits, it resigns, so
/// that the next campaigner leads at once, and exits with COMMAND's status. SIGINT, SIGTERM or
/// SIGHUP while campaigning leaves the queue (no row is left) and exits 130, 143 or 129. When
/// renewals stop coming back, COMMAND is told (SIGTERM) one heartbeat (a third of --lease)
/// before the lease would run out, before any other campaigner can lead, and SIGKILL follows
/// after --grace; the exit code is then 4. It is told at once when the leadership is lost
/// outright (an operator's `leasehold release`).
///
/// With --listen, it campaigns for nothing: it prints the leader, then a line for each change
/// (a new leader, or none), until interrupted: `KEY: VALUE (term T, OWNER)`, or `KEY: no
/// leader`, with --json one object per line. The store must exist, as for `watch`.
#[derive(Debug, ClapArgs)]
#[command(after_help = "Examples:\n  \
        leasehold elect --value \"$(hostname):8080\" locks.db scheduler -- ./scheduler\n  \
        leasehold elect --lease 10s postgres://app@db/app compactor -- ./compact --forever\n  \
        leasehold elect --listen locks.db scheduler\n  \
        leasehold elect -l --json locks.db scheduler | jq -r '.value // \"none\"'")]
pub(crate) struct Elect {
    /// Print the leader and each change of it instead of campaigning
    #[arg(short = 'l', long)]
    pub(crate) listen: bool,
    /// With --listen, one JSON object per line: key, value, owner, term, since_ms (all but
    /// the key null when there is no leader)
    #[arg(long)]
    pub(crate) json: bool,
    /// What the leader tells others, as `inspect` shows its operation and --listen its value
    /// (an address, say) [default: HOST:PID, as its owner begins]
    #[arg(long, value_name = "VALUE", conflicts_with = "listen")]
    pub(crate) value: Option<String>,
    /// How long the leadership outlives this process if it stops renewing it (at least
    /// 300ms); renewed every third of it
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "30s",
        value_parser = parse_duration,
        conflicts_with = "listen"
    )]
    pub(crate) lease: Duration,
    /// After the leadership is lost, how long COMMAND has between SIGTERM and SIGKILL
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "10s",
        value_parser = parse_duration,
        conflicts_with = "listen"
    )]
    pub(crate) grace: Duration,
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// The election's name
    pub(crate) key: String,
    /// The program to run while leading, and its arguments (after `--`)
    #[arg(
        last = true,
        value_name = "COMMAND",
        required_unless_present = "listen",
        // Not `requires = "listen"` on --json: a flag's default, false, would satisfy it.
        conflicts_with_all = ["listen", "json"]
    )]
    pub(crate) command: Vec<String>,
}

/// Show the holders and waiters of every key (or of the keys that start with KEY_PREFIX)
///
/// Read-only: it never creates a store that is not there. Keys, operations and owners are
/// written by whoever takes a lock: the table shows their control and other non-printing
/// characters escaped (\n, \u{1b}, and a backslash as \\); --json gives them exactly.
#[derive(Debug, ClapArgs)]
#[command(after_help = "Examples:\n  \
        leasehold inspect locks.db\n  \
        leasehold inspect locks.db repo/ --json | jq 'select(.state == \"waiting\")'")]
pub(crate) struct Inspect {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Only the keys that start with this
    pub(crate) key_prefix: Option<String>,
    /// One JSON object per row, one per line: key, mode, count and limit (of permits; null for
    /// shared and exclusive), state, position, owner, operation, ticket, since_ms,
    /// expires_at_ms, lease_left_ms
    #[arg(long)]
    pub(crate) json: bool,
}

/// Show the holders and waiters, redrawn on each change, until interrupted
///
/// Woken by the store's own wake-ups, as a waiter is: the doorbell beside a SQLite file rings it
/// when a lock is released or a waiter promoted (and its poll sees any other commit within a
/// quarter of a second); on PostgreSQL, NOTIFY wakes it when a lock that others wait for is
/// released. Otherwise it looks again every --every, for the leases left.
#[derive(Debug, ClapArgs)]
#[command(after_help = "Example:\n  leasehold watch locks.db repo/")]
pub(crate) struct Watch {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Only the keys that start with this
    pub(crate) key_prefix: Option<String>,
    /// The longest time between two looks
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub(crate) every: Duration,
}

/// Remove the rows of an owner that is gone (an operator's repair)
///
/// Its holders' and waiters' rows are deleted, and the waiters behind them granted, as if the
/// owner had released; an owner still running finds its lease lost at its next heartbeat.
/// Asks before it removes anything, unless --yes.
#[derive(Debug, ClapArgs)]
#[command(
    group(ArgGroup::new("whose").required(true).args(["owner", "key"])),
    after_help = "Examples:\n  \
        leasehold release locks.db --owner build-7:4121:18c9a2f01b3-0\n  \
        leasehold release locks.db --key repo/photos --ticket 812 --yes"
)]
pub(crate) struct Release {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
    /// Every row of this owner (as `inspect` shows it)
    #[arg(long, value_name = "OWNER")]
    pub(crate) owner: Option<String>,
    /// The request on this key with --ticket
    #[arg(long, value_name = "KEY", requires = "ticket")]
    pub(crate) key: Option<String>,
    /// The ticket of the request on --key (as `inspect` shows it)
    #[arg(long, value_name = "TICKET", requires = "key")]
    pub(crate) ticket: Option<u64>,
    /// Do not ask
    #[arg(long)]
    pub(crate) yes: bool,
}

/// Check a store: its schema, its rows, who may read and write it, and (PostgreSQL) the role's
/// privileges, the server's clock and whether notifications arrive
///
/// Exits 0 only when nothing is wrong; every finding is a line that says what to do about it.
#[derive(Debug, ClapArgs)]
#[command(after_help = "Examples:\n  \
        leasehold doctor /var/lib/app/locks.db\n  \
        leasehold doctor postgres://app@db.internal/app --schema leasehold")]
pub(crate) struct Doctor {
    #[command(flatten)]
    pub(crate) store: StoreArgs,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_arguments_are_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn a_run_takes_its_command_after_two_dashes() {
        let args = Args::try_parse_from([
            "leasehold",
            "run",
            "-s",
            "-w",
            "2m",
            "locks.db",
            "k",
            "--",
            "ls",
            "-l",
        ])
        .unwrap();
        let Command::Run(run) = args.command else {
            panic!("not a run")
        };
        assert!(run.shared);
        assert_eq!((run.limit, run.count), (None, None));
        assert_eq!(run.wait, Some(Duration::from_secs(120)));
        assert_eq!(run.command, ["ls", "-l"]);
        assert_eq!(run.conflict_exit_code, 1);
    }

    #[test]
    fn an_elect_takes_its_command_after_two_dashes_and_a_listener_none() {
        let args = Args::try_parse_from([
            "leasehold",
            "elect",
            "--value",
            "a:80",
            "l.db",
            "e",
            "--",
            "ls",
            "-l",
        ])
        .unwrap();
        let Command::Elect(elect) = args.command else {
            panic!("not an elect")
        };
        assert!(!elect.listen);
        assert_eq!(elect.value.as_deref(), Some("a:80"));
        assert_eq!(elect.lease, Duration::from_secs(30));
        assert_eq!(elect.command, ["ls", "-l"]);

        let args = Args::try_parse_from(["leasehold", "elect", "-l", "--json", "l.db", "e"]);
        let Command::Elect(listen) = args.unwrap().command else {
            panic!("not an elect")
        };
        assert!(listen.listen && listen.json && listen.command.is_empty());
    }

    #[test]
    fn an_elect_without_a_command_or_a_listener_with_one_is_refused() {
        for args in [
            &["leasehold", "elect", "l.db", "e"][..],
            &["leasehold", "elect", "--json", "l.db", "e", "--", "true"],
            &["leasehold", "elect", "-l", "l.db", "e", "--", "true"],
            &["leasehold", "elect", "-l", "--value", "v", "l.db", "e"],
            &["leasehold", "elect", "-l", "--lease", "5s", "l.db", "e"],
        ] {
            assert!(Args::try_parse_from(args).is_err(), "{args:?}");
        }
    }

    #[test]
    fn contradictory_flags_are_refused() {
        for args in [
            &["leasehold", "run", "-s", "-x", "l.db", "k", "--", "true"][..],
            &[
                "leasehold",
                "run",
                "-n",
                "-w",
                "1s",
                "l.db",
                "k",
                "--",
                "true",
            ],
            &["leasehold", "run", "-E", "0", "l.db", "k", "--", "true"],
            &[
                "leasehold",
                "run",
                "-s",
                "--limit",
                "3",
                "l.db",
                "k",
                "--",
                "true",
            ],
            &[
                "leasehold",
                "run",
                "--count",
                "2",
                "l.db",
                "k",
                "--",
                "true",
            ],
            &[
                "leasehold",
                "run",
                "--limit",
                "0",
                "l.db",
                "k",
                "--",
                "true",
            ],
            &[
                "leasehold",
                "run",
                "--limit",
                "3",
                "--count",
                "0",
                "l.db",
                "k",
                "--",
                "true",
            ],
            &["leasehold", "run", "l.db", "k"],
            &["leasehold", "release", "l.db"],
            &["leasehold", "release", "l.db", "--key", "k"],
            &[
                "leasehold",
                "release",
                "l.db",
                "--owner",
                "o",
                "--key",
                "k",
                "--ticket",
                "1",
            ],
        ] {
            assert!(Args::try_parse_from(args).is_err(), "{args:?}");
        }
    }
}
