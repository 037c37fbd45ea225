//! The report on PostgreSQL: the lock manager on a server of its own (or of `--url`), beside
//! a raw transaction and the server's advisory locks.

use super::*;
use postgres::{Client, NoTls};

/// The report on the server of `url`, or on a throwaway one started for the run (as the
/// tests start theirs: `leasehold::testkit::postgres`).
pub(crate) fn report(plan: &Plan, url: Option<&str>) -> Result<Report, Error> {
    let mut report = Report::new("postgres", plan.rounds);
    let server = match url {
        Some(_) => None,
        None => Some(
            pg_support::start(pg_support::Tls::Off)
                .ok_or("no PostgreSQL server could be started (see above); give --url URL")?,
        ),
    };
    // Over the unix socket when the server is ours.
    let conninfo = match (&server, url) {
        (_, Some(url)) => url.to_owned(),
        (Some(server), None) => server.conninfo().ok_or("a server without a socket")?.into(),
        (None, None) => unreachable!("a server was started above"),
    };
    let dir = tempfile::tempdir()?;
    let schema = |name: &str| format!("bench_{}_{}", name.replace('-', "_"), std::process::id());
    let schemas = RefCell::new(Vec::new());
    let opened = RefCell::new(Vec::new());
    let open = |name: &str, builder: LockManagerBuilder| -> Result<LockManager, Error> {
        let name = schema(name);
        let locks = block_on(builder.schema(&name).connect(&conninfo))?;
        schemas.borrow_mut().push(name);
        opened.borrow_mut().push(locks.clone());
        Ok(locks)
    };

    // The server's floor: one write transaction, sent as one query over the same socket.
    let raw_schema = schema("raw");
    let mut raw = Client::connect(&conninfo, NoTls)?;
    raw.batch_execute(&format!(
        "CREATE SCHEMA {raw_schema}; \
         CREATE TABLE {raw_schema}.t (id bigserial PRIMARY KEY, key text NOT NULL)"
    ))?;
    schemas.borrow_mut().push(raw_schema.clone());
    let transaction = format!(
        "BEGIN; INSERT INTO {raw_schema}.t (key) VALUES ('k'); DELETE FROM {raw_schema}.t; \
         COMMIT"
    );
    // What a user would pick instead: the server's own advisory lock, taken and given back.
    let mut advisory = Client::connect(&conninfo, NoTls)?;
    let lock = advisory.prepare("SELECT pg_advisory_lock(hashtext($1))")?;
    let unlock = advisory.prepare("SELECT pg_advisory_unlock(hashtext($1))")?;
    let advisory_key = schema("advisory-cycle");
    let floors: Vec<Floor<'_>> = vec![
        (
            "raw_txn_us",
            Box::new(|| Ok(raw.batch_execute(&transaction)?)),
        ),
        (
            "advisory_lock_cycle_us",
            Box::new(move || {
                advisory.execute(&lock, &[&advisory_key])?;
                advisory.execute(&unlock, &[&advisory_key])?;
                Ok(())
            }),
        ),
    ];
    let mut measures = vec![cycle_against_floor(
        open("uncontended", LockManager::builder())?,
        floors,
        plan.per_round(2_500, 600),
    )];
    measures.extend(scale_measures(plan, &open));
    measures.push(handoff_in_process(plan, &open)?);

    let rounds = plan.per_round(300, 60);
    let cross = schema("cross");
    // The schema exists before the two processes meet in it.
    open("cross", LockManager::builder())?;
    measures.push(handoff_cross_process(
        &[
            "handoff_cross_process_p50_us",
            "handoff_cross_process_from_call_p50_us",
        ],
        Ends::same("pg-lock", &conninfo, &cross),
        dir.path().to_owned(),
        rounds,
    ));
    let mut notes = vec![format!(
        "\nraw_txn_us: `BEGIN; INSERT; DELETE; COMMIT` sent as one query over the \
         connection the managers use ({}).\n\
         advisory_*: pg_advisory_lock + pg_advisory_unlock, two statements, on the same \
         server.",
        if server.is_some() {
            "the unix socket of a throwaway server"
        } else {
            "--url"
        }
    )];
    match &server {
        Some(server) => {
            let ends = poll_only_ends(server, &schema("cross-poll"), &open)?;
            measures.push(handoff_cross_process(
                &["handoff_cross_process_poll_only_p50_us"],
                ends,
                dir.path().to_owned(),
                rounds,
            ));
            notes.push(
                "handoff_cross_process_poll_only_p50_us: as above, but each process \
                 connects as a role allowed one\n  connection, so its LISTEN connection is \
                 refused: waiters see the change by the poll (10 ms) alone."
                    .into(),
            );
        }
        None => notes.push(
            "handoff_cross_process_poll_only_p50_us: not measured (it needs roles on a \
             server the report starts)."
                .into(),
        ),
    }
    measures.push(handoff_cross_process(
        &["advisory_handoff_cross_process_p50_us"],
        Ends::same("advisory", &conninfo, &schema("advisory-handoff")),
        dir.path().to_owned(),
        rounds,
    ));
    for name in ["elect", "crash", "observe"] {
        // Each schema exists before the processes meet in it.
        open(name, LockManager::builder())?;
    }
    measures.extend(election_measures(plan, "pg-", dir.path(), |name| {
        Ok((conninfo.clone(), schema(name)))
    })?);
    measures.extend(common_measures(plan, &open)?);

    report.notes = notes;
    run_rounds(&mut report, &mut measures, plan);
    drop(measures);
    shut_down(&opened.borrow())?;
    let mut admin = Client::connect(&conninfo, NoTls)?;
    for name in schemas.borrow().iter() {
        admin.batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))?;
    }
    shared_targets(&mut report, 3.0, 200.0, 0.5);
    election_targets(&mut report);
    let cross = report.get("handoff_cross_process_p50_us");
    report.target(
        "handoff_cross_process_p50_us",
        "<= 2000".into(),
        cross <= 2000.0,
        &[],
    );
    Ok(report)
}

/// Two roles allowed one connection each, members of the tests' role (so they may use its
/// schemas): a manager connecting as one has its storage connection, and its listener is
/// refused, so it hears of other processes' changes by polling alone. Checked here.
pub(crate) fn poll_only_ends(
    server: &pg_support::Server,
    schema: &str,
    open: Open<'_>,
) -> Result<Ends, Error> {
    let dir = server.dir().ok_or("a server without a socket directory")?;
    let port = server.port().ok_or("a server without a port")?;
    let roles = ["bench_poll_a", "bench_poll_b"];
    let conninfo = |role: &str| {
        format!(
            "host={} port={port} user={role} dbname={}",
            dir.display(),
            pg_support::DATABASE
        )
    };
    for role in roles {
        server.sql(&format!(
            "CREATE ROLE {role} LOGIN CONNECTION LIMIT 1 IN ROLE {}",
            pg_support::USER
        ));
    }
    // The schema, made by the tests' role, before the limited roles use it.
    open("cross-poll", LockManager::builder())?;
    let locks = block_on(
        LockManager::builder()
            .schema(schema)
            .connect(&conninfo(roles[0])),
    )?;
    let connections = || {
        server.sql(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = '{}'",
            roles[0]
        ))
    };
    std::thread::sleep(Duration::from_millis(300));
    let seen = connections();
    block_on(locks.shutdown())?;
    drop(locks);
    if seen.trim() != "1" {
        return Err(format!("a poll-only manager has {seen} connections, not 1").into());
    }
    Ok(Ends {
        kind: "pg-lock",
        ours: conninfo(roles[0]),
        theirs: conninfo(roles[1]),
        detail: schema.into(),
    })
}

/// A manager on `url` in `schema`; tries again for a while, since a role allowed one
/// connection may still have the last round's open for a moment.
pub(crate) fn connect(url: &str, schema: &str) -> Result<LockManager, Error> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match block_on(LockManager::builder().schema(schema).connect(url)) {
            Ok(locks) => return Ok(locks),
            Err(error) if Instant::now() > deadline => return Err(error.into()),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
