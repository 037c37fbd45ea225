//! The PostgreSQL test harness itself: a real server starts (or the test is skipped with a
//! reason), answers over both connection forms, speaks TLS when asked, survives restarts, and is
//! gone once the test process that started it has ended.
#![cfg(all(unix, feature = "testkit"))]

mod common;
use leasehold::testkit::postgres as pg_support;

use std::io::Read;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::child::{self, Child};
use common::within_blocking;
use pg_support::{Shutdown, Tls};

/// How long a condition in these tests may take before it counts as false; only a failing test
/// waits this long.
const LIMIT: Duration = Duration::from_secs(30);

#[test]
fn the_server_answers_over_the_socket_and_over_tcp() {
    let Some(pg) = pg_support::server() else {
        return;
    };
    let over_tcp = pg.psql(pg.url(), "SELECT 1");
    assert_eq!(over_tcp.as_deref(), Ok("1"), "over TCP ({})", pg.log());
    if let Some(conninfo) = pg.conninfo() {
        assert!(
            conninfo.starts_with("host=/"),
            "the socket form: {conninfo}"
        );
        let over_socket = pg.psql(conninfo, "SELECT current_user");
        assert_eq!(
            over_socket.as_deref(),
            Ok(pg_support::USER),
            "over the socket"
        );
    }
}

#[test]
fn tcp_needs_a_password() {
    let Some(pg) = pg_support::server() else {
        return;
    };
    let Some(port) = pg.port() else { return };
    let without = format!(
        "postgres://{}@127.0.0.1:{port}/{}",
        pg_support::USER,
        pg_support::DATABASE
    );
    let refused = pg.psql(&without, "SELECT 1").unwrap_err();
    assert!(refused.contains("password"), "{refused}");
}

#[test]
fn the_password_role_connects_over_tcp() {
    let Some(pg) = pg_support::server() else {
        return;
    };
    let Some(secret) = pg.secret() else { return };
    assert!(secret.url.contains(&secret.password));
    let user = pg.psql(&secret.url, "SELECT current_user");
    assert_eq!(user.as_deref(), Ok(pg_support::SECRET_USER));
}

#[test]
fn a_fresh_schema_can_be_created_by_the_test_role() {
    let Some(pg) = pg_support::server() else {
        return;
    };
    let schema = pg_support::schema("a_fresh_schema_can_be_created_by_the_test_role");
    let rows = pg.psql(
        pg.url(),
        &format!(
            "CREATE SCHEMA {schema};\n\
             CREATE TABLE {schema}.t (k text PRIMARY KEY);\n\
             INSERT INTO {schema}.t VALUES ('a');\n\
             SELECT count(*) FROM {schema}.t;"
        ),
    );
    assert_eq!(rows.as_deref(), Ok("1"));
}

#[test]
fn schema_names_are_fresh_valid_identifiers() {
    let long = "A test name that is far too long, with Spaces and-dashes ".repeat(3);
    let names = [
        pg_support::schema("same"),
        pg_support::schema("same"),
        pg_support::schema(&long),
    ];
    assert_ne!(names[0], names[1]);
    for name in &names {
        assert!(
            name.len() <= 63,
            "{name} is longer than PostgreSQL's 63 bytes"
        );
        assert!(name.starts_with("t_"), "{name}");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "{name} would need quoting"
        );
    }
}

#[test]
fn the_tls_server_speaks_tls() {
    let Some(pg) = pg_support::tls_server() else {
        return;
    };
    let ca = pg.ca_file().expect("a CA file");
    assert!(ca.is_file(), "{}", ca.display());
    let in_use = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
    for sslmode in ["require", "verify-full"] {
        let ssl = pg.psql(&pg.tls_url(sslmode), in_use);
        assert_eq!(ssl.as_deref(), Ok("t"), "sslmode={sslmode}\n{}", pg.log());
    }
    assert_eq!(pg.sql("SHOW ssl"), "on");
    let plain = pg.psql(&pg.url_with("sslmode=disable"), "SELECT 1");
    assert!(plain.is_err(), "a connection without TLS was accepted");
}

#[test]
fn a_restart_keeps_the_server_usable() {
    let Some(pg) = pg_support::start(Tls::Off) else {
        return;
    };
    for mode in [Shutdown::Fast, Shutdown::Immediate] {
        let before = pg.postmaster_pid().expect("a running postmaster");
        pg.restart(mode);
        let after = pg.postmaster_pid().expect("a running postmaster");
        assert_ne!(before, after, "{mode:?}: the same postmaster");
        within_blocking(
            LIMIT,
            &format!("{mode:?}: the old postmaster to end"),
            || !pg_support::is_running(before),
        );
        assert_eq!(
            pg.psql(pg.url(), "SELECT 1").as_deref(),
            Ok("1"),
            "{mode:?}"
        );
    }
}

#[test]
fn other_connections_can_be_terminated() {
    let Some(pg) = pg_support::server() else {
        return;
    };
    let Some(conninfo) = pg.conninfo() else {
        return;
    };
    let name = pg_support::schema("victim");
    let mut victim = pg
        .psql_command(&format!("{conninfo} application_name={name}"))
        .args(["-c", "SELECT pg_sleep(60)"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psql");
    let filter = format!("application_name = '{name}'");
    within_blocking(LIMIT, "the victim to connect", || {
        pg.sql(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE {filter}"
        )) == "1"
    });
    assert_eq!(pg.terminate_backends(&filter), 1);
    let status = wait_within(&mut victim, "the victim's psql to end");
    assert!(!status.success());
    let mut stderr = String::new();
    victim
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(stderr.contains("terminat"), "{stderr}");
}

/// Starts the lines the child of [`the_server_is_gone_after_the_test_process_ends`] reports on.
const MARK: &str = "pg-harness-child:";

/// In a normal run, does nothing. In a child started by
/// [`the_server_is_gone_after_the_test_process_ends`] in the role `exit` or `kill` (how its
/// life ends), starts the shared server, reports its postmaster's pid and directory, and then
/// either returns (the process exits as any test binary does) or waits to be killed.
#[test]
fn child_process_runs_a_server() {
    let Some(ending) = child::role() else {
        return;
    };
    let Some(pg) = pg_support::server() else {
        println!("{MARK} skip");
        return;
    };
    let pid = pg.postmaster_pid().expect("a running postmaster");
    println!(
        "{MARK} {pid} {}",
        pg.dir().expect("a local server").display()
    );
    if ending == "kill" {
        // Blocks until the parent kills this process (or, should the parent die, until its end
        // of the pipe closes).
        let _ = std::io::stdin().read_line(&mut String::new());
    }
}

#[test]
fn the_server_is_gone_after_the_test_process_ends() {
    let children: Vec<_> = ["exit", "kill"]
        .map(|ending| {
            let mut command = Child::command("child_process_runs_a_server", ending);
            (
                ending,
                Child::start(command.env_remove(pg_support::URL_VAR)),
            )
        })
        .into_iter()
        .collect();
    for (ending, mut child) in children {
        let report = child.await_report(MARK, LIMIT);
        let mut words = report.split_whitespace();
        let (Some(pid), Some(dir)) = (words.next(), words.next()) else {
            assert_eq!(report, "skip", "a report of the child ({ending})");
            eprintln!(
                "skipped the_server_is_gone_after_the_test_process_ends, which needs \
                 PostgreSQL: the child ({ending}) found no server programs"
            );
            return;
        };
        let (pid, dir): (u32, PathBuf) = (pid.parse().expect("a pid"), dir.into());
        assert!(
            pg_support::is_running(pid),
            "{ending}: the server runs while its process does"
        );
        if ending == "kill" {
            child.kill();
        }
        child.wait(LIMIT);
        within_blocking(LIMIT, &format!("{ending}: postmaster {pid} to end"), || {
            !pg_support::is_running(pid)
        });
        within_blocking(
            LIMIT,
            &format!("{ending}: {} to be removed", dir.display()),
            || !dir.exists(),
        );
    }
}

/// `child`'s exit status, once it has ended; a panic naming `what` if that takes longer than
/// [`LIMIT`].
fn wait_within(child: &mut std::process::Child, what: &str) -> std::process::ExitStatus {
    let mut status = None;
    within_blocking(LIMIT, what, || {
        status = child.try_wait().expect("try_wait");
        status.is_some()
    });
    status.expect("ended")
}
