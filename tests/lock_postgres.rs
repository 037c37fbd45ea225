//! The lock manager on PostgreSQL (feature `postgres`), against a real server that
//! `pg_support` starts for this test binary (or `LEASEHOLD_POSTGRES_URL`). Each test works in a
//! schema of its own. Without the server programs the tests are skipped with a printed reason,
//! unless `LEASEHOLD_REQUIRE_POSTGRES=1`.
#![cfg(all(feature = "postgres", feature = "testkit"))]

mod common;
use leasehold::testkit::postgres as pg_support;

use std::time::Duration;

use common::{
    bounded, granted_while_stalled, join_within, read_when_stalled, until_blocking, within,
};
use futures::executor::block_on;
use leasehold::{
    fork_daemon, AbortController, EntryState, Exit, LockError, LockManager, LockRequest, Schedule,
};

/// A manager on `server` in `schema`, with short leases so that tests about them are quick.
async fn manager(url: &str, schema: &str) -> LockManager {
    LockManager::builder()
        .schema(schema)
        .lease(Duration::from_secs(2))
        .heartbeat(Duration::from_millis(500))
        .poll(Duration::from_millis(5))
        .connect(url)
        .await
        .expect("connect to the test server")
}

async fn states(locks: &LockManager, key: &str) -> Vec<(String, EntryState)> {
    locks
        .inspect(Some(key))
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.operation, e.state))
        .collect()
}

#[test]
fn a_lock_is_taken_inspected_and_released_over_tcp_and_the_unix_socket() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("basic");
        let mut urls = vec![server.url().to_owned()];
        urls.extend(server.conninfo().map(str::to_owned));
        for url in &urls {
            let locks = manager(url, &schema).await;
            let guard = locks.exclusive("repo", "prune").await.unwrap();
            assert!(locks.is_locked("repo").await.unwrap());
            assert_eq!(
                states(&locks, "repo").await,
                vec![("prune".to_owned(), EntryState::Held)]
            );
            assert!(locks
                .try_acquire(LockRequest::shared("repo", "backup"))
                .await
                .unwrap()
                .is_none());
            guard.release().await.unwrap();
            assert!(!locks.is_locked("repo").await.unwrap());
            locks.shutdown().await.unwrap();
        }
    });
}

/// Conformance case 1 across two managers (two machines, as far as the server can tell): S1
/// held, X queued, S2 waits behind X; grants in the order S1, X, S2, each handed over when the
/// one before releases; fencing tokens increase in grant order.
#[test]
fn shared_waits_behind_a_queued_exclusive_across_managers() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("order");
        let a = manager(server.url(), &schema).await;
        let b = manager(server.url(), &schema).await;
        let s1 = a.shared("k", "S1").await.unwrap();
        let x = {
            let b = b.clone();
            fork_daemon(async move { b.exclusive("k", "X").await })
        };
        within(Duration::from_secs(5), "X queued", || async {
            states(&a, "k").await.len() == 2
        })
        .await;
        let s2 = {
            let a = a.clone();
            fork_daemon(async move { a.shared("k", "S2").await })
        };
        within(Duration::from_secs(5), "S2 queued", || async {
            states(&a, "k").await.len() == 3
        })
        .await;
        assert_eq!(
            states(&b, "k").await,
            vec![
                ("S1".to_owned(), EntryState::Held),
                ("X".to_owned(), EntryState::Waiting { position: 0 }),
                ("S2".to_owned(), EntryState::Waiting { position: 1 }),
            ]
        );
        let first = s1.fencing_token();
        s1.release().await.unwrap();
        let x = match join_within(Duration::from_secs(5), "X granted", x).await {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("{other:?}"),
        };
        assert!(x.fencing_token() > first);
        assert!(!s2.is_finished(), "S2 was granted while X held");
        let second = x.fencing_token();
        x.release().await.unwrap();
        let s2 = match join_within(Duration::from_secs(5), "S2 granted", s2).await {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("{other:?}"),
        };
        assert!(s2.fencing_token() > second);
        s2.release().await.unwrap();
        assert!(a.inspect(None).await.unwrap().is_empty());
    });
}

/// Conformance case 5: an interrupted queued request returns the caller's reason, and by then
/// its row is gone.
#[test]
fn an_interrupted_waiter_returns_the_callers_reason_and_leaves_no_row() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("interrupt");
        let locks = manager(server.url(), &schema).await;
        let holder = locks.exclusive("k", "holder").await.unwrap();
        let stop = AbortController::new();
        let waiter = {
            let acquisition = locks.exclusive("k", "waiter").with_signal(&stop.signal());
            fork_daemon(acquisition)
        };
        within(Duration::from_secs(5), "queued", || async {
            states(&locks, "k").await.len() == 2
        })
        .await;
        let reason = leasehold::AbortReason::from("the user left");
        stop.abort(reason.clone());
        match join_within(Duration::from_secs(5), "the interrupted waiter", waiter).await {
            Exit::Success(Err(error)) => {
                assert!(error.abort_reason().unwrap().ptr_eq(&reason));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            states(&locks, "k").await,
            vec![("holder".to_owned(), EntryState::Held)]
        );
        holder.release().await.unwrap();
    });
}

/// Rows live on the server: a guard survives its connection being cut (the next heartbeat
/// connects again and renews), and the lease is not lost.
#[test]
fn a_guard_survives_its_connection_being_cut() {
    let Some(server) = pg_support::server() else {
        return;
    };
    if server.conninfo().is_none() {
        return; // an external server: the test cannot cut connections there
    }
    block_on(async {
        let schema = pg_support::schema("cut");
        let name = format!("app_{schema}");
        let locks = manager(
            &server.url_with(&format!("application_name={name}")),
            &schema,
        )
        .await;
        let guard = locks.exclusive("k", "survivor").await.unwrap();
        let cut = server.terminate_backends(&format!("application_name = '{name}'"));
        assert!(cut >= 1, "no connection of the manager was cut");
        // Past two leases: only renewals over a new connection keep the row.
        let heartbeats = locks.stats().heartbeats;
        within(
            Duration::from_secs(10),
            "renewed over a new connection",
            || async { locks.stats().heartbeats >= heartbeats + 3 },
        )
        .await;
        smol::Timer::after(Duration::from_secs(3)).await;
        assert!(!guard.lost().is_aborted(), "the lease was lost");
        assert_eq!(
            states(&locks, "k").await,
            vec![("survivor".to_owned(), EntryState::Held)]
        );
        guard.release().await.unwrap();
    });
}

/// A TCP proxy in front of the server at `upstream`. Once `cut` is set, the next answer the
/// server sends on the first connection made through the proxy (the manager's own; its
/// listening connection comes second) is swallowed and that connection closed: the statement
/// ran, and committed, and its caller never hears so.
struct AnswerCutter {
    port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

fn answer_cutter(upstream: u16) -> AnswerCutter {
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::atomic::Ordering;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let armed = cut.clone();
    std::thread::spawn(move || {
        for (index, client) in listener.incoming().enumerate() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                return;
            };
            let (mut from_client, mut to_server) =
                (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut buffer = [0u8; 65536];
                while let Ok(n @ 1..) = from_client.read(&mut buffer) {
                    if to_server.write_all(&buffer[..n]).is_err() {
                        break;
                    }
                }
                let _ = to_server.shutdown(Shutdown::Both);
            });
            let armed = armed.clone();
            std::thread::spawn(move || {
                let (mut from_server, mut to_client) = (server, client);
                let mut buffer = [0u8; 65536];
                while let Ok(n @ 1..) = from_server.read(&mut buffer) {
                    let lost = index == 0 && armed.swap(false, Ordering::SeqCst);
                    if lost || to_client.write_all(&buffer[..n]).is_err() {
                        break;
                    }
                }
                let _ = to_client.shutdown(Shutdown::Both);
                let _ = from_server.shutdown(Shutdown::Both);
            });
        }
    });
    AnswerCutter { port, cut }
}

/// A release that committed but whose answer was lost is tried again, finds no row, and cannot
/// tell from the database whether its rows were live: the lease as the process knows it,
/// which still ran, says they were. The release succeeds and the guard is not lost.
#[test]
fn a_release_whose_answer_is_lost_after_it_committed_succeeds() {
    let Some(server) = pg_support::server() else {
        return;
    };
    let Some(port) = server.port() else {
        return; // an external server: the test cannot stand between it and the manager
    };
    let cutter = answer_cutter(port);
    let url = server
        .url()
        .replace(&format!(":{port}/"), &format!(":{}/", cutter.port));
    block_on(async {
        let schema = pg_support::schema("lost_release_answer");
        let locks = LockManager::builder()
            .schema(&schema)
            .connect(&url)
            .await
            .unwrap();
        let guard = locks.exclusive("k", "work").await.unwrap();
        let lost = guard.lost();
        cutter.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        let released = guard.release().await;
        assert!(
            !cutter.cut.load(std::sync::atomic::Ordering::SeqCst),
            "no answer was cut"
        );
        assert!(locks.inspect(None).await.unwrap().is_empty());
        assert!(released.is_ok(), "{released:?}");
        assert!(!lost.is_aborted());
    });
}

/// A renewal that had to wait for a row lock until after the row's lease ran out must not
/// revive it (DESIGN §7: renewals compare with the server's clock at the row, not with when
/// their transaction began). Another session holds our row locked while a renewal waits for
/// it, lets the lease run out, then lets go: the row keeps its expiry or is gone, and the guard
/// is told its lease was lost.
#[test]
fn a_renewal_that_waited_past_the_lease_does_not_revive_the_row() {
    let Some(server) = pg_support::server() else {
        return;
    };
    let Some(socket) = server.conninfo() else {
        return; // an external server: the test cannot see the manager's sessions
    };
    block_on(async {
        let schema = pg_support::schema("renewal_waited");
        let name = format!("app_{schema}");
        // The renewal comes a heartbeat after the grant and waits for the row, trying again
        // each time its lock timeout (half a heartbeat) ends, until the lease is past.
        let locks = LockManager::builder()
            .schema(&schema)
            .lease(Duration::from_millis(600))
            .heartbeat(Duration::from_millis(300))
            .connect(&server.url_with(&format!("application_name={name}")))
            .await
            .unwrap();
        let guard = locks.exclusive("k", "held").await.unwrap();
        let mut blocker = postgres::Client::connect(socket, postgres::NoTls).unwrap();
        let micros = |client: &mut postgres::Client, sql: &str| -> Option<i64> {
            client.query_opt(sql, &[]).unwrap().map(|row| row.get(0))
        };
        let expiry = format!("SELECT expires_at FROM \"{schema}\".locks WHERE key = 'k'");
        let server_now = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint";
        let renewal_waits = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{name}' \
             AND wait_event_type = 'Lock'"
        );
        let mut caught = false;
        for _ in 0..20 {
            blocker.batch_execute("BEGIN").unwrap();
            let Some(expires_at) = micros(&mut blocker, &format!("{expiry} FOR UPDATE")) else {
                break; // lost already (a slow machine): nothing left to revive
            };
            // A renewal comes within a heartbeat and waits for the row; let the lease pass
            // while it waits.
            let waited = until_blocking(Duration::from_secs(2), || {
                let now = micros(&mut blocker, server_now).unwrap();
                let waiting = server.sql(&renewal_waits) == "1";
                now > expires_at && waiting
            });
            blocker.batch_execute("ROLLBACK").unwrap();
            if !waited {
                continue;
            }
            caught = true;
            // The renewal goes on now; whatever it does, the lapsed row keeps its expiry.
            within(
                Duration::from_secs(5),
                "the renewal after the wait",
                || async { server.sql(&renewal_waits) == "0" },
            )
            .await;
            smol::Timer::after(Duration::from_millis(100)).await;
            let after = micros(&mut blocker, &expiry);
            assert!(
                after.is_none_or(|at| at == expires_at),
                "a lapsed row was renewed: expired at {expires_at}, now {after:?}"
            );
            break;
        }
        assert!(caught, "no renewal was ever caught waiting past the lease");
        within(
            Duration::from_secs(5),
            "the guard is told its lease was lost",
            || async { guard.lost().is_aborted() },
        )
        .await;
    });
}

/// A connection cut while idle is found dead by the next transaction, which begins again on a
/// new connection: the caller sees no error.
#[test]
fn an_acquisition_right_after_a_cut_succeeds() {
    let Some(server) = pg_support::server() else {
        return;
    };
    if server.conninfo().is_none() {
        return; // an external server: the test cannot cut connections there
    }
    block_on(async {
        let schema = pg_support::schema("cut_idle");
        let name = format!("app_{schema}");
        let locks = manager(
            &server.url_with(&format!("application_name={name}")),
            &schema,
        )
        .await;
        let guard = locks.exclusive("k", "before").await.unwrap();
        guard.release().await.unwrap();
        let cut = server.terminate_backends(&format!("application_name = '{name}'"));
        assert!(cut >= 1, "no connection of the manager was cut");
        let guard = locks.exclusive("k", "after").await.unwrap();
        guard.release().await.unwrap();
    });
}

/// Takes "k" on a manager in a schema named after `test`, cutting the acquisition's connection
/// while it waits inside its transaction (for a table lock another session holds); `before` runs
/// first, with the server, the manager and the schema. Returns the manager.
async fn acquire_through_a_cut(
    test: &str,
    before: impl FnOnce(&pg_support::Server, &LockManager, &str),
) -> Option<LockManager> {
    let server = pg_support::server()?;
    let socket = server.conninfo()?; // an external server: the test cannot cut connections there
    let schema = pg_support::schema(test);
    let name = format!("app_{schema}");
    let locks = manager(
        &server.url_with(&format!("application_name={name}")),
        &schema,
    )
    .await;
    before(server, &locks, &schema);
    let mut blocker = server
        .psql_command(socket)
        .arg("-c")
        .arg(format!(
            "BEGIN; LOCK TABLE \"{schema}\".locks; SELECT pg_sleep(3); COMMIT"
        ))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    within(
        Duration::from_secs(5),
        "the other session holds the table",
        || async {
            server.sql(&format!(
                "SELECT count(*) FROM pg_locks WHERE granted AND mode = 'AccessExclusiveLock' \
             AND relation = '\"{schema}\".locks'::regclass"
            )) == "1"
        },
    )
    .await;
    let acquisition = {
        let locks = locks.clone();
        fork_daemon(async move { locks.exclusive("k", "cut").await })
    };
    let waiting = format!("application_name = '{name}' AND wait_event_type = 'Lock'");
    within(
        Duration::from_secs(5),
        "the transaction waits for the table",
        || async {
            server.sql(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE {waiting}"
            )) == "1"
        },
    )
    .await;
    assert_eq!(server.terminate_backends(&waiting), 1);
    match join_within(Duration::from_secs(10), "the acquisition", acquisition).await {
        Exit::Success(Ok(guard)) => guard.release().await.unwrap(),
        other => panic!("{other:?}"),
    }
    blocker.wait().unwrap();
    Some(locks)
}

/// A connection cut in the middle of a write transaction (here while its first statement waits
/// for a table lock that another session holds) does not fail the caller: nothing was
/// committed, and the whole transaction is done again on a new connection (where it waits for
/// the table again, with timeouts that are passing failures too, until the other session is
/// done).
#[test]
fn an_acquisition_whose_connection_is_cut_inside_its_transaction_succeeds() {
    block_on(async {
        let Some(locks) = acquire_through_a_cut("cut_inside", |_, _, _| {}).await else {
            return;
        };
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

/// The busy schedule bounds the retries of one piece of work, from its first failure: a
/// schedule that allows 300 ms of retries still retries a cut that comes long after the
/// manager started (it once ran from the start, and gave up at once after its end).
#[test]
fn a_cut_long_after_the_start_is_still_retried() {
    let Some(server) = pg_support::server() else {
        return;
    };
    if server.conninfo().is_none() {
        return; // an external server: the test cannot cut connections there
    }
    block_on(async {
        let schema = pg_support::schema("cut_later");
        let name = format!("app_{schema}");
        let allowed = Duration::from_millis(300);
        let locks = LockManager::builder()
            .schema(&schema)
            .busy_schedule(Schedule::spaced(Duration::from_millis(20)).up_to(allowed))
            .connect(&server.url_with(&format!("application_name={name}")))
            .await
            .unwrap();
        // Work for twice as long as the schedule allows retries.
        let started = std::time::Instant::now();
        while started.elapsed() < allowed * 2 {
            let guard = locks.exclusive("k", "before").await.unwrap();
            guard.release().await.unwrap();
        }
        let cut = server.terminate_backends(&format!("application_name = '{name}'"));
        assert!(cut >= 1, "no connection of the manager was cut");
        let guard = locks.exclusive("k", "after").await.unwrap();
        guard.release().await.unwrap();
    });
}

/// An acquisition whose reply is lost may have committed: after such a failure, the manager
/// deletes the rows of its owner that it knows nothing of. (The lost reply of a committed
/// acquisition cannot be arranged from outside; a row planted under the manager's owner stands
/// for its rows.)
#[test]
fn after_an_acquisition_fails_rows_of_the_owner_it_knows_nothing_of_are_deleted() {
    block_on(async {
        let planted = |server: &pg_support::Server, locks: &LockManager, schema: &str| {
            server.sql(&format!(
                "INSERT INTO \"{schema}\".locks (key, mode, operation, owner, ticket, held, \
                     requested_at, acquired_at, expires_at, heartbeat_at) \
                 VALUES ('planted', 1, 'lost', '{}', 999999, true, 0, 0, 9000000000000000, 0)",
                locks.owner_id()
            ));
        };
        let Some(locks) = acquire_through_a_cut("lost_reply", planted).await else {
            return;
        };
        assert!(
            locks.inspect(None).await.unwrap().is_empty(),
            "the planted row is deleted before the acquisition is done again"
        );
    });
}

#[test]
fn a_password_never_appears_in_errors_or_debug_output() {
    let Some(server) = pg_support::server() else {
        return;
    };
    let Some(secret) = server.secret() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("secret");
        let locks = manager(&secret.url, &schema).await;
        let shown = format!("{locks:?}");
        assert!(!shown.contains(&secret.password), "{shown}");
        let wrong = secret.url.replace(&secret.password, "wrong-password-value");
        let error = LockManager::builder()
            .schema(&schema)
            .connect(&wrong)
            .await
            .unwrap_err();
        let shown = format!("{error} {error:?}");
        assert!(matches!(error, LockError::Storage(_)), "{shown}");
        assert!(!shown.contains("wrong-password-value"), "{shown}");
        assert!(!shown.contains(&secret.password), "{shown}");
        // A password with an `@` not written as %40: the parser (as libpq's) would take its
        // tail for the host, and name it in every error.
        let unescaped = secret
            .url
            .replace(&secret.password, "first-half@second-half");
        let error = LockManager::builder()
            .schema(&schema)
            .connect(&unescaped)
            .await
            .unwrap_err();
        let shown = format!("{error} {error:?}");
        assert!(matches!(error, LockError::InvalidConfig(_)), "{shown}");
        assert!(shown.contains("%40"), "{shown}");
        assert!(!shown.contains("half"), "{shown}");
        // Written as %40 it is a password like any other.
        let escaped = secret
            .url
            .replace(&secret.password, "first-half%40second-half");
        let error = LockManager::builder()
            .schema(&schema)
            .connect(&escaped)
            .await
            .unwrap_err();
        let shown = format!("{error} {error:?}");
        assert!(matches!(error, LockError::Storage(_)), "{shown}");
        assert!(!shown.contains("half"), "{shown}");
    });
}

#[test]
fn a_schema_name_that_could_inject_sql_is_refused() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let error = LockManager::builder()
            .schema("x\"; DROP SCHEMA public; --")
            .connect(server.url())
            .await
            .unwrap_err();
        assert!(matches!(error, LockError::InvalidConfig(_)), "{error}");
    });
}

#[test]
fn a_schema_written_by_a_newer_version_is_refused() {
    let Some(server) = pg_support::server() else {
        return;
    };
    if server.conninfo().is_none() {
        return;
    }
    block_on(async {
        let schema = pg_support::schema("newer");
        manager(server.url(), &schema)
            .await
            .shutdown()
            .await
            .unwrap();
        server.sql(&format!("UPDATE {schema}.meta SET version = 99"));
        match LockManager::builder()
            .schema(&schema)
            .connect(server.url())
            .await
        {
            Err(LockError::SchemaTooNew { found: 99, .. }) => {}
            other => panic!("{other:?}"),
        }
    });
}

/// A schema of version 3 (an acquisition and a release each had a function, with no `decide`),
/// 4 (a `decide` without shortcuts), 5 (a `decide` that could judge on a stale read), 6 (no
/// `renew`), 7 (no `acquire_one` and `release_one`), 8 (no tombstones of removals), 9 (no
/// absorbed steps of the server's clock), 10 (modes in a `smallint`, no permits) or 11 (a release
/// that could judge a waiter on a stale read) is brought up to date when a manager connects,
/// keeping its rows.
#[test]
fn a_schema_of_an_older_version_is_migrated_keeping_its_rows() {
    let Some(server) = pg_support::server() else {
        return;
    };
    for old_version in [3, 4, 5, 6, 7, 8, 9, 10, 11] {
        block_on(migrated_from(server, old_version));
    }
}

async fn migrated_from(server: &pg_support::Server, old_version: i32) {
    let schema = pg_support::schema(&format!("version{old_version}"));
    let old = manager(server.url(), &schema).await;
    let held = old.exclusive("kept", "before").await.unwrap();
    let removed = if old_version < 9 {
        format!("DROP TABLE {schema}.removed;")
    } else {
        String::new()
    };
    let older = if old_version < 10 {
        format!(
            "DROP FUNCTION {schema}.decide; DROP FUNCTION {schema}.renew; \
             DROP FUNCTION {schema}.acquire_one; DROP FUNCTION {schema}.release_one; \
             DROP FUNCTION {schema}.lock_keys; DROP FUNCTION {schema}.check_clock; {removed} \
             ALTER TABLE {schema}.meta DROP COLUMN skew;"
        )
    } else {
        String::new()
    };
    let smallint = if old_version < 11 {
        format!("ALTER TABLE {schema}.locks ALTER COLUMN mode TYPE smallint;")
    } else {
        String::new()
    };
    server.sql(&format!(
        "{older} {smallint} UPDATE {schema}.meta SET version = {old_version}"
    ));
    let new = manager(server.url(), &schema).await;
    let version = server.sql(&format!("SELECT version FROM {schema}.meta"));
    assert_eq!(version.trim(), "12");
    let mode_type = server.sql(&format!(
        "SELECT data_type FROM information_schema.columns \
         WHERE table_schema = '{schema}' AND table_name = 'locks' AND column_name = 'mode'"
    ));
    assert_eq!(mode_type.trim(), "bigint");
    let skew = server.sql(&format!("SELECT skew FROM {schema}.meta"));
    assert_eq!(skew.trim(), "0");
    let tombstones = server.sql(&format!("SELECT count(*) FROM {schema}.removed"));
    assert_eq!(tombstones.trim(), "0");
    let busy = new
        .try_acquire(LockRequest::exclusive("kept", "after"))
        .await;
    assert!(busy.unwrap().is_none());
    let guard = new.exclusive("other", "after").await.unwrap();
    guard.release().await.unwrap();
    held.release().await.unwrap();
    new.exclusive("kept", "after")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // And permits, which the old schema could not keep.
    let permit = new.permits("slots", "after", 2, 3).await.unwrap();
    let entries = new.inspect(Some("slots")).await.unwrap();
    assert_eq!(
        entries[0].mode,
        leasehold::Mode::Permits { count: 2, limit: 3 }
    );
    permit.release().await.unwrap();
}

#[test]
fn shutdown_leaves_no_row_and_ends_waits() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("shutdown");
        let a = manager(server.url(), &schema).await;
        let b = manager(server.url(), &schema).await;
        let held = b.exclusive("j", "blocker").await.unwrap();
        let guard = a.exclusive("k", "mine").await.unwrap();
        let waiter = {
            let a = a.clone();
            fork_daemon(async move { a.exclusive("j", "waiting").await })
        };
        within(Duration::from_secs(5), "queued", || async {
            states(&b, "j").await.len() == 2
        })
        .await;
        a.shutdown().await.unwrap();
        assert!(matches!(
            join_within(Duration::from_secs(5), "the waiter", waiter).await,
            Exit::Success(Err(LockError::Shutdown))
        ));
        assert!(guard.lost().is_aborted());
        let rows = b.inspect(None).await.unwrap();
        assert!(rows.iter().all(|e| e.owner == b.owner_id()), "{rows:?}");
        held.release().await.unwrap();
    });
}

/// A clock that runs `ahead` of the system's (or behind it, if negative), as on a machine whose
/// clock is off.
struct Skewed {
    ahead: i64,
}

impl leasehold::Clock for Skewed {
    fn now(&self) -> Duration {
        let now = leasehold::SystemClock.now();
        if self.ahead >= 0 {
            now + Duration::from_secs(self.ahead as u64)
        } else {
            now - Duration::from_secs(self.ahead.unsigned_abs())
        }
    }

    fn sleep(&self, duration: Duration) -> futures::future::BoxFuture<'static, ()> {
        leasehold::SystemClock.sleep(duration)
    }
}

/// Leases are judged by the server's clock: managers whose clocks are ten seconds ahead and
/// behind (five leases) hold, renew, hand over and release as any other.
#[test]
fn leases_do_not_depend_on_the_clients_clocks() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("skew");
        let open = |ahead: i64| {
            LockManager::builder()
                .schema(&schema)
                .lease(Duration::from_secs(2))
                .heartbeat(Duration::from_millis(500))
                .poll(Duration::from_millis(5))
                .clock(std::sync::Arc::new(Skewed { ahead }))
                .connect(server.url())
        };
        let fast = open(10).await.unwrap();
        let slow = open(-10).await.unwrap();
        let held = bounded(
            Duration::from_secs(5),
            "the fast client's grant",
            fast.exclusive("k", "fast"),
        )
        .await
        .unwrap();
        let waiter = {
            let slow = slow.clone();
            fork_daemon(async move { slow.exclusive("k", "slow").await })
        };
        within(Duration::from_secs(5), "queued", || async {
            states(&fast, "k").await.len() == 2
        })
        .await;
        // Two leases: both keep their rows by heartbeat, neither is judged expired.
        smol::Timer::after(Duration::from_secs(4)).await;
        assert!(
            !held.lost().is_aborted(),
            "the fast client's lease was lost"
        );
        assert_eq!(states(&slow, "k").await.len(), 2);
        held.release().await.unwrap();
        let granted =
            match join_within(Duration::from_secs(5), "the slow client's grant", waiter).await {
                Exit::Success(Ok(guard)) => guard,
                other => panic!("{other:?}"),
            };
        smol::Timer::after(Duration::from_secs(3)).await;
        assert!(
            !granted.lost().is_aborted(),
            "the slow client's lease was lost"
        );
        granted.release().await.unwrap();
        assert!(fast.inspect(None).await.unwrap().is_empty());
    });
}

/// TLS through rustls: `sslmode=require` encrypts (the TLS server refuses plain TCP), and
/// `verify-full` checks the certificate against the CA named by `sslrootcert`, and refuses a
/// server the system's roots do not vouch for.
#[test]
fn tls_with_sslmode_require_and_verify_full() {
    let Some(server) = pg_support::tls_server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("tls");
        for mode in ["require", "verify-full"] {
            let locks = manager(&server.tls_url(mode), &schema).await;
            let guard = locks.exclusive("k", mode).await.unwrap();
            guard.release().await.unwrap();
            locks.shutdown().await.unwrap();
        }
        let unverifiable = server.url_with("sslmode=verify-full");
        let error = LockManager::builder()
            .schema(&schema)
            .connect(&unverifiable)
            .await
            .unwrap_err();
        assert!(matches!(error, LockError::Storage(_)), "{error}");
        let plain = server.url_with("sslmode=disable");
        assert!(LockManager::builder()
            .schema(&schema)
            .connect(&plain)
            .await
            .is_err());
    });
}

/// Another machine's release reaches a waiter through `LISTEN/NOTIFY`, not its poll: with the
/// poll at 30 s, the waiter is granted at once. (The two managers reach the server by different
/// routes, TCP and the unix socket, so they do not know each other as managers of one process
/// sharing a database, which wake each other directly.)
#[test]
fn a_release_on_another_machine_wakes_a_waiter_through_notify() {
    let Some(server) = pg_support::server() else {
        return;
    };
    let Some(socket) = server.conninfo() else {
        return;
    };
    block_on(async {
        // Neither the waiter's poll (30 s) nor the holder's lease running out (10 s) could
        // wake the waiter within the bound: only the announcement can (or a look that was
        // already under way when the release committed).
        let schema = pg_support::schema("notify");
        let holder = LockManager::builder()
            .schema(&schema)
            .lease(Duration::from_secs(10))
            .heartbeat(Duration::from_secs(2))
            .connect(server.url())
            .await
            .unwrap();
        // A queued waiter on one key (promoted by the release itself), a queued waiter on two
        // keys (left waiting: its owner promotes it), then a `many` (without a row: noted as a
        // watcher), each on a manager of its own that is listening before it waits. (Whether
        // the look that finds the grant is the announcement's own cannot be told: a look under
        // way when the release commits may read it first.)
        for (case, rows) in [("queued", 2), ("queued on two keys", 3), ("many", 0)] {
            let name = format!("waiting_{}_{schema}", case.replace(' ', "_"));
            let waiting = LockManager::builder()
                .schema(&schema)
                .poll(Duration::from_secs(30))
                .connect(&format!("{socket} application_name={name}"))
                .await
                .unwrap();
            within(
                Duration::from_secs(5),
                "the waiting manager listens",
                || async {
                    server.sql(&format!(
                        "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name = '{name}' AND query LIKE 'LISTEN%'"
                    )) == "1"
                },
            )
            .await;
            let guard = holder.exclusive("k", "holder").await.unwrap();
            let waiter = {
                let waiting = waiting.clone();
                fork_daemon(async move {
                    let requests = [
                        LockRequest::exclusive("k", "waiter"),
                        LockRequest::shared("other", "waiter"),
                    ];
                    match case {
                        "queued" => waiting.exclusive("k", "waiter").await,
                        "many" => waiting.many(requests).await,
                        _ => waiting.many_queued(requests).await,
                    }
                })
            };
            within(Duration::from_secs(5), "waiting", || async {
                if rows > 0 {
                    holder.inspect(None).await.unwrap().len() == rows
                } else {
                    server.sql(&format!(
                        "SELECT count(*) FROM \"{schema}\".watchers WHERE owner = '{}'",
                        waiting.owner_id()
                    )) == "2"
                }
            })
            .await;
            guard.release().await.unwrap();
            match join_within(
                Duration::from_secs(3),
                "the grant, long before the next poll",
                waiter,
            )
            .await
            {
                Exit::Success(Ok(granted)) => granted.release().await.unwrap(),
                other => panic!("{case}: {other:?}"),
            }
        }
    });
}

/// A refused `try_acquire` does not wait: it writes nothing (one call decides it, in one round
/// trip, with no read before it), and no release is announced to it.
#[test]
fn a_refused_try_acquire_writes_nothing() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("try_refused");
        let holder = manager(server.url(), &schema).await;
        let trying = manager(server.url(), &schema).await;
        let guard = holder.exclusive("k", "holder").await.unwrap();
        let writes = trying.stats().write_transactions;
        for _ in 0..5 {
            let refused = trying.try_acquire(LockRequest::shared("k", "try")).await;
            assert!(refused.unwrap().is_none());
        }
        assert_eq!(trying.stats().write_transactions, writes);
        assert_eq!(
            server.sql(&format!("SELECT count(*) FROM \"{schema}\".watchers")),
            "0"
        );
        guard.release().await.unwrap();
        let granted = trying.try_acquire(LockRequest::shared("k", "try")).await;
        granted.unwrap().expect("free now").release().await.unwrap();
    });
}

/// A transaction on more keys than the server would lock one by one (its lock table holds about
/// 64 per connection) locks the schema instead: a `many` of 200 keys, and a shutdown of an owner
/// of 2,000 locks, work, and keep others out while they run.
#[test]
fn transactions_on_thousands_of_keys_work() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("many_keys");
        let locks = manager(server.url(), &schema).await;
        let other = manager(server.url(), &schema).await;
        let requests: Vec<LockRequest> = (0..200)
            .map(|i| LockRequest::exclusive(format!("m{i}"), "many"))
            .collect();
        let all = locks.many(requests).await.unwrap();
        assert!(other
            .try_acquire(LockRequest::exclusive("m199", "other"))
            .await
            .unwrap()
            .is_none());
        all.release().await.unwrap();
        let mut guards = Vec::new();
        for i in 0..2_000 {
            let request = LockRequest::exclusive(format!("k{i}"), "held");
            guards.push(locks.try_acquire(request).await.unwrap().unwrap());
        }
        let waiter = {
            let other = other.clone();
            fork_daemon(async move { other.exclusive("k1999", "waiter").await })
        };
        within(Duration::from_secs(5), "the waiter queued", || async {
            states(&other, "k1999").await.len() == 2
        })
        .await;
        locks.shutdown().await.unwrap();
        let guard = match join_within(Duration::from_secs(5), "the waiter", waiter).await {
            Exit::Success(Ok(guard)) => guard,
            other => panic!("{other:?}"),
        };
        assert_eq!(other.inspect(None).await.unwrap().len(), 1);
        guard.release().await.unwrap();
    });
}

/// The advisory lock the library takes for `key` in `schema` (its class, and the key's digest:
/// FNV-1a of the schema, a NUL and the key, folded to 32 bits), so that a test can hold it.
fn key_lock(schema: &str, key: &str) -> (i32, i32) {
    let digest = format!("{schema}\0{key}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    (0x4c48_4c44, ((digest ^ (digest >> 32)) as u32) as i32)
}

/// A transaction that waits for its key's lock longer than the lock timeout (half a heartbeat)
/// fails as it begins; it is ended and done again, so the caller gets the
/// lock once the other session lets go, and the manager goes on working.
#[test]
fn a_begin_that_times_out_on_its_key_lock_is_done_again() {
    let Some(server) = pg_support::server() else {
        return;
    };
    let Some(socket) = server.conninfo() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("lock_timeout");
        let locks = manager(server.url(), &schema).await;
        let (class, id) = key_lock(&schema, "k");
        let mut other = server
            .psql_command(socket)
            .arg("-c")
            .arg(format!(
                "SELECT pg_advisory_lock({class}, {id}); SELECT pg_sleep(2.5)"
            ))
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        within(
            Duration::from_secs(5),
            "the other session holds the key's lock",
            || async {
                server.sql(&format!(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
                 AND classid = {} AND objid = {}",
                    class as u32, id as u32
                )) == "1"
            },
        )
        .await;
        let guard = bounded(
            Duration::from_secs(20),
            "the acquisition",
            locks.exclusive("k", "late"),
        )
        .await
        .unwrap();
        other.wait().unwrap();
        guard.release().await.unwrap();
        assert!(locks.inspect(None).await.unwrap().is_empty());
    });
}

/// A renewal of `owner`'s rows in `schema` that judged them live, renewed them for a minute and
/// has not committed yet: its session, to commit when the test says.
fn renewal_in_flight(socket: &str, schema: &str, owner: &str) -> postgres::Client {
    let now = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";
    let mut renewal = postgres::Client::connect(socket, postgres::NoTls).unwrap();
    renewal.batch_execute("BEGIN").unwrap();
    renewal
        .execute(
            &format!(
                "UPDATE \"{schema}\".locks SET expires_at = {now} + 60000000, \
                 heartbeat_at = {now} WHERE owner = $1"
            ),
            &[&owner],
        )
        .unwrap();
    renewal
}

/// A decision on a key whose only row lapsed, while a renewal of that row that judged it live
/// has not yet committed, must see the renewal: the decision's deletion of lapsed rows waits for
/// the renewal, finds the row renewed and leaves it, and the rule is then asked about the row as
/// it is, not as it was read before the wait. (Judged on the earlier read, the key was granted a
/// second time while the renewed holder went on holding it, with no lost lease to tell it.)
#[test]
fn a_decision_that_waited_for_a_renewal_sees_the_row_renewed() {
    let Some(server) = pg_support::server() else {
        return;
    };
    let Some(socket) = server.conninfo() else {
        return; // an external server: the test cannot see the manager's sessions
    };
    block_on(async {
        let schema = pg_support::schema("renewal_straddles");
        let name = format!("app_{schema}");
        let locks = LockManager::builder()
            .schema(&schema)
            .connect(&server.url_with(&format!("application_name={name}")))
            .await
            .unwrap();
        let now = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";
        // Another owner's lock whose lease ran out a moment ago, as its owner's renewal comes.
        server.sql(&format!(
            "INSERT INTO \"{schema}\".locks (key, ticket, mode, operation, owner, held, \
             requested_at, acquired_at, expires_at, heartbeat_at) \
             SELECT 'k', nextval('\"{schema}\".tickets'), 1, 'renewed', 'other-owner', true, \
             {now} - 10000000, {now} - 10000000, {now} - 1000, {now} - 2000000"
        ));
        // The renewal: it judged the row live, renewed it, and has not committed yet.
        let mut renewal = renewal_in_flight(socket, &schema, "other-owner");
        let attempt = {
            let locks = locks.clone();
            fork_daemon(async move {
                locks
                    .try_acquire(LockRequest::exclusive("k", "second"))
                    .await
            })
        };
        let waiting = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{name}' \
             AND wait_event_type = 'Lock'"
        );
        within(
            Duration::from_secs(5),
            "the decision waits for the renewal's row lock",
            || async { server.sql(&waiting) == "1" },
        )
        .await;
        renewal.batch_execute("COMMIT").unwrap();
        let granted = match join_within(Duration::from_secs(5), "the decision", attempt).await {
            Exit::Success(result) => result.unwrap(),
            other => panic!("the attempt did not succeed: {other:?}"),
        };
        assert!(
            granted.is_none(),
            "granted a key whose holder's renewal had committed"
        );
        let holders: Vec<String> = locks
            .inspect(Some("k"))
            .await
            .unwrap()
            .into_iter()
            .map(|entry| entry.operation)
            .collect();
        assert_eq!(holders, ["renewed"]);
    });
}

/// A release on a key where another owner's waiting row lapsed, while that owner's renewal,
/// which judged it live, has not yet committed, must see the renewal: the release's deletion
/// of lapsed rows waits for it and leaves the row renewed, and that waiter is then promoted
/// and told. (Judged on the release's first read, the waiter was neither, and waited for the
/// next change or the holder's whole lease.) Both server functions that release are asked:
/// `release_one`, for a release alone, and `decide`, for a batch.
#[test]
fn a_release_that_waited_for_a_renewal_promotes_the_renewed_waiter() {
    let Some(server) = pg_support::server() else {
        return;
    };
    let Some(socket) = server.conninfo() else {
        return; // an external server: the test cannot see the sessions that wait
    };
    for function in ["release_one", "decide"] {
        let schema = pg_support::schema(&format!("release_straddles_{function}"));
        block_on(async {
            manager(server.url(), &schema)
                .await
                .shutdown()
                .await
                .unwrap();
        });
        let now = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint";
        let insert = |owner: &str, held: bool, expires_in: i64| {
            server.sql(&format!(
                "INSERT INTO \"{schema}\".locks (key, ticket, mode, operation, owner, held, \
                 requested_at, acquired_at, expires_at, heartbeat_at) \
                 SELECT 'k', nextval('\"{schema}\".tickets'), 1, '{owner}', '{owner}', {held}, \
                 {now} - 10000000, CASE WHEN {held} THEN {now} END, {now} + {expires_in}, \
                 {now} - 2000000 RETURNING ticket"
            ))
        };
        let holder: i64 = insert("holder", true, 60_000_000).trim().parse().unwrap();
        // The waiter's lease ran out a moment ago, as its owner's renewal comes.
        insert("waiter", false, -1000);
        let mut renewal = renewal_in_flight(socket, &schema, "waiter");
        let name = format!("release_{schema}");
        let call = match function {
            "release_one" => format!(
                "SELECT promoted, owners FROM \"{schema}\".release_one('holder', 1, 2, 'c', 'k', \
                 {holder}, '*', NULL, false)"
            ),
            _ => format!(
                "SELECT promoted, owners FROM \"{schema}\".decide('holder', 60000000, '{{1}}', 2, \
                 'c', '{{1}}', '{{{holder}}}', '{{0}}', '{{NULL}}', '{{*}}', '{{k}}', '{{1}}', \
                 '{{x}}', NULL, '{{false}}')"
            ),
        };
        let url = format!("{socket} application_name={name}");
        let release = std::thread::spawn(move || {
            let mut client = postgres::Client::connect(&url, postgres::NoTls).unwrap();
            let row = client.query_one(&call, &[]).unwrap();
            let promoted: Option<Vec<i64>> = row.get(0);
            let owners: Option<Vec<String>> = row.get(1);
            (promoted, owners)
        });
        let waiting = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{name}' \
             AND wait_event_type = 'Lock'"
        );
        let waits = until_blocking(Duration::from_secs(5), || {
            server.sql(&waiting).trim() == "1"
        });
        assert!(
            waits,
            "{function}: the release waits for the renewal's row lock"
        );
        renewal.batch_execute("COMMIT").unwrap();
        let (promoted, owners) = release.join().unwrap();
        assert_eq!(promoted.map(|p| p.len()), Some(1), "{function}: promoted");
        assert_eq!(owners, Some(vec!["waiter".to_owned()]), "{function}: told");
        let held = server.sql(&format!(
            "SELECT held FROM \"{schema}\".locks WHERE owner = 'waiter'"
        ));
        assert_eq!(held.trim(), "t", "{function}: the waiter holds the key");
    }
}

/// A grant read late, a lease and more after it was made, whose row the owner's heartbeat kept
/// renewing meanwhile (the owner holds another lock), is handed out with its ticket: the worker
/// knows each request's lease as renewed, not only as granted.
#[test]
fn a_grant_read_late_whose_row_heartbeats_kept_live_is_handed_out() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("late_but_renewed");
        let lease = Duration::from_millis(600);
        let open = || async {
            LockManager::builder()
                .schema(&schema)
                .lease(lease)
                .heartbeat(lease / 3)
                .connect(server.url())
                .await
                .unwrap()
        };
        let (a, b) = (open().await, open().await);
        let other = b
            .exclusive("other", "keeps B's heartbeat beating")
            .await
            .unwrap();
        let mut acquisition = granted_while_stalled(&a, &b).await;
        let ticket = b.inspect(Some("k")).await.unwrap()[0].ticket;
        // The caller stalls for two leases; B's lock heartbeat goes on renewing.
        smol::Timer::after(lease * 2).await;
        let guard = read_when_stalled(&mut acquisition).await;
        assert_eq!(guard.fencing_token(), ticket, "it lost its place");
        assert!(!guard.lost().is_aborted());
        guard.release().await.unwrap();
        other.release().await.unwrap();
    });
}

/// A server that cannot be reached says why ("Connection refused", underneath the client's "error
/// connecting to server"), keeps the client's error as its source, and counts as a failure that
/// may pass; a refused login says so with the server's own message and SQLSTATE.
#[test]
fn a_failed_connection_says_why_and_keeps_the_clients_error_as_its_source() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    block_on(async {
        let url = format!("postgres://nobody@127.0.0.1:{port}/nothing");
        let Err(LockError::Storage(error)) = LockManager::connect(&url).await else {
            panic!("connected to a closed port");
        };
        let shown = error.to_string().to_lowercase();
        assert!(shown.contains("connection refused"), "{error}");
        assert!(error.is_transient(), "{error:?}");
        let source = std::error::Error::source(&error).expect("the client's error");
        assert!(
            source.downcast_ref::<postgres::Error>().is_some(),
            "{source:?}"
        );
    });
    let Some(server) = pg_support::server() else {
        return;
    };
    let Some(secret) = server.secret() else {
        return;
    };
    block_on(async {
        let wrong = secret.url.replace(&secret.password, "not-the-password");
        let Err(LockError::Storage(error)) = LockManager::connect(&wrong).await else {
            panic!("logged in with the wrong password");
        };
        assert_eq!(error.code(), Some("28P01"), "{error}");
        assert!(
            error.to_string().contains("password authentication failed"),
            "{error}"
        );
    });
}

/// A forward step of the server's clock (made here by moving the skew the store's time is read
/// with, which is what a step of `clock_timestamp()` does to it) lapses no lease: the holder's
/// next renewal and the waiter's next call are refused by the server as started later than
/// they could be, measure the step, absorb it into the skew, and go on. The holder keeps its
/// lock and hears no `lost()`; the waiter is granted only once it releases.
#[test]
fn a_forward_step_of_the_servers_clock_lapses_no_lease() {
    let Some(server) = pg_support::server() else {
        return;
    };
    block_on(async {
        let schema = pg_support::schema("forward_step");
        let (a, b) = (
            manager(server.url(), &schema).await,
            manager(server.url(), &schema).await,
        );
        let held = a.exclusive("k", "hold").await.unwrap();
        let waiter = smol::spawn({
            let b = b.clone();
            async move { b.exclusive("k", "wait").await.unwrap() }
        });
        within(Duration::from_secs(10), "the waiter queued", || async {
            a.inspect(Some("k")).await.unwrap().len() == 2
        })
        .await;
        let beats = a.stats().heartbeats;
        let skew = || {
            let text = server.sql(&format!("SELECT skew FROM \"{schema}\".meta"));
            text.trim().parse::<i64>().expect("a number")
        };
        // An hour forward.
        server.sql(&format!(
            "UPDATE \"{schema}\".meta SET skew = skew - 3600000000"
        ));
        // Three leases: the holder renews about twelve times meanwhile.
        smol::Timer::after(Duration::from_secs(6)).await;
        assert!(!held.lost().is_aborted(), "the holder lost its lease");
        assert!(
            !waiter.is_finished(),
            "the waiter was granted over the holder"
        );
        assert!(
            a.stats().heartbeats >= beats + 3,
            "the holder stopped renewing"
        );
        let left = skew();
        assert!(
            left.abs() < 1_000_000,
            "the step was not absorbed: skew {left} µs"
        );
        let token = held.fencing_token();
        held.release().await.unwrap();
        let next = bounded(Duration::from_secs(10), "the waiter granted", waiter).await;
        assert!(next.fencing_token() > token);
        next.release().await.unwrap();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    });
}
