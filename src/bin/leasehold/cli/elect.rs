//! `leasehold elect`: COMMAND while leading an election (`LockManager::campaign`), on `run`'s
//! machinery (`run.rs`: the signals, the wait, COMMAND's process and its lifeline, a lost
//! lease); and `elect --listen`, each leader change as a line (`LockManager::observe`).
//!
//! What differs from `run`: the lock is a leadership, whose value the others read; COMMAND finds
//! its term in `LEASEHOLD_TERM`; and it is told (SIGTERM) one heartbeat before the lease would
//! run out when renewals stop coming back (`Guard::lost_within`), rather than when it has run
//! out, so that it can stop before the store can let another campaigner lead.

use std::time::Duration;

use futures::{FutureExt, StreamExt};

use super::args::Elect;
use super::run::{self, Held, Job};
use super::show::json_string;
use super::{printable, store_failed};
use leasehold::{AbortController, Leader, LockManager};

pub(crate) fn elect(args: Elect) -> u8 {
    if args.listen {
        return listen(args);
    }
    let job = Job {
        key: &args.key,
        command: &args.command,
        grace: args.grace,
    };
    run::under_lease(&args.store, args.lease, &job, async |locks, signals| {
        let value = match &args.value {
            Some(value) => value.clone(),
            None => default_value(locks.owner_id()),
        };
        let interrupt = AbortController::new();
        // Told a margin before the lease would run out, as `LockManager::lead` tells its body.
        let margin = locks.margin();
        let campaign = locks.campaign(job.key, value);
        let campaign = campaign
            .with_signal(&interrupt.signal())
            .map(|outcome| outcome.map(|leadership| Held::Leadership { leadership, margin }));
        run::wait_for(campaign, &interrupt, &job, None, signals).await
    })
}

/// `HOST:PID`: the owner id (`HOST:PID:UNIQUE`) up to its last part, which says nothing to a
/// person reading the leader's value.
fn default_value(owner: &str) -> String {
    match owner.rsplit_once(':') {
        Some((host_and_pid, _)) => host_and_pid.to_owned(),
        None => owner.to_owned(),
    }
}

/// `elect --listen`: the leader, then each change, a line each, until interrupted (by the
/// signal's default, as `watch`) or the store fails.
fn listen(args: Elect) -> u8 {
    let store = match args.store.parse() {
        Ok(store) => store,
        Err(code) => return code,
    };
    smol::block_on(async {
        // Other processes' changes are seen at the change poll's next look, when nothing wakes
        // it sooner: a quarter of a second, as for `watch`.
        let builder = LockManager::builder().poll(Duration::from_millis(250));
        let locks = match store.open_existing(builder).await {
            Ok(locks) => locks,
            Err(error) => return store_failed(&error),
        };
        let mut leaders = locks.observe(&args.key);
        while let Some(leader) = leaders.next().await {
            match leader {
                Ok(leader) if args.json => println!("{}", json_line(&args.key, leader.as_ref())),
                Ok(leader) => println!("{}", text_line(&args.key, leader)),
                Err(error) => return store_failed(&error),
            }
        }
        0
    })
}

/// `KEY: VALUE (term T, OWNER)` (a [`Leader`] as it displays), or `KEY: no leader`; the texts
/// [`printable`].
fn text_line(key: &str, leader: Option<Leader>) -> String {
    match leader {
        Some(leader) => Leader {
            key: printable(&leader.key),
            value: printable(&leader.value),
            owner: printable(&leader.owner),
            ..leader
        }
        .to_string(),
        None => format!("{}: no leader", printable(key)),
    }
}

/// One JSON object on one line, with `inspect --json`'s names where they say the same:
/// `{"key":..,"value":..,"owner":..,"term":..,"since_ms":..}`, every field but the key `null`
/// when there is no leader.
fn json_line(key: &str, leader: Option<&Leader>) -> String {
    let null = || "null".to_owned();
    let (value, owner, term, since) = match leader {
        Some(leader) => (
            json_string(&leader.value),
            json_string(&leader.owner),
            leader.term.to_string(),
            leader.since.as_millis().to_string(),
        ),
        None => (null(), null(), null(), null()),
    };
    format!(
        "{{\"key\":{},\"value\":{value},\"owner\":{owner},\"term\":{term},\"since_ms\":{since}}}",
        json_string(key)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leader() -> Leader {
        Leader {
            key: "jobs/\u{1b}[2J".to_owned(),
            value: "a:8080 \"x\"".to_owned(),
            owner: "host:12:ab-0".to_owned(),
            term: 7,
            since: Duration::from_millis(1_700_000_000_123),
        }
    }

    #[test]
    fn a_leader_is_one_line_as_it_displays_with_what_would_steer_a_terminal_escaped() {
        assert_eq!(
            text_line("jobs/\u{1b}[2J", Some(leader())),
            "jobs/\\u{1b}[2J: a:8080 \"x\" (term 7, host:12:ab-0)"
        );
        assert_eq!(text_line("k\n", None), "k\\n: no leader");
    }

    #[test]
    fn a_leader_is_one_json_object_and_no_leader_the_same_with_nulls() {
        assert_eq!(
            json_line("jobs/\u{1b}[2J", Some(&leader())),
            "{\"key\":\"jobs/\\u001b[2J\",\"value\":\"a:8080 \\\"x\\\"\",\
             \"owner\":\"host:12:ab-0\",\"term\":7,\"since_ms\":1700000000123}"
        );
        assert_eq!(
            json_line("k", None),
            "{\"key\":\"k\",\"value\":null,\"owner\":null,\"term\":null,\"since_ms\":null}"
        );
    }

    #[test]
    fn the_default_value_is_the_owners_host_and_pid() {
        assert_eq!(default_value("build-7:4121:18c9a2f01b3-0"), "build-7:4121");
    }
}
