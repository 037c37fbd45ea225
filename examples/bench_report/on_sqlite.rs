//! The report on SQLite: the lock manager on files in a temporary directory, beside a raw
//! write transaction and an OS file lock.

use super::*;

/// Where a measurement's lock managers keep their rows: one database per name, the same one
/// for the same name.
pub(crate) type Open<'a> = &'a dyn Fn(&str, LockManagerBuilder) -> Result<LockManager, Error>;

pub(crate) fn sqlite_report(plan: &Plan) -> Result<Report, Error> {
    let mut report = Report::new("sqlite", plan.rounds);
    let dir = tempfile::tempdir()?;
    let opened = RefCell::new(Vec::new());
    let open = |name: &str, builder: LockManagerBuilder| -> Result<LockManager, Error> {
        let locks = builder.open(dir.path().join(format!("{name}.db")))?;
        opened.borrow_mut().push(locks.clone());
        Ok(locks)
    };
    let conn = sqlite::open(dir.path().join("raw.db"))?;
    conn.execute(
        "PRAGMA page_size = 1024; PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;
         PRAGMA busy_timeout = 5000;
         CREATE TABLE t (id INTEGER PRIMARY KEY, key TEXT NOT NULL);
         CREATE TABLE l (key TEXT NOT NULL, ticket INTEGER NOT NULL, owner TEXT NOT NULL,
                         PRIMARY KEY (key, ticket)) WITHOUT ROWID;",
    )?;
    // The storage floor: one write transaction with the `sqlite` crate and the lock manager's
    // pragmas (its page size included: a commit's cost follows the bytes of the pages it
    // writes).
    let raw: Floor<'_> = (
        "raw_txn_us",
        Box::new(|| {
            conn.execute(
                "BEGIN IMMEDIATE; INSERT INTO t (key) VALUES ('k'); DELETE FROM t; COMMIT;",
            )?;
            Ok(())
        }),
    );
    // The cycle's physical part: what an acquisition and a release must each write, in a
    // write transaction of its own, with prepared statements (as the manager runs them) and
    // nothing else. The rest of the cycle is the manager's own path.
    let prepared = [
        "BEGIN IMMEDIATE",
        "INSERT INTO l (key, ticket, owner) VALUES ('probe', 1, 'bench')",
        "COMMIT",
        "BEGIN IMMEDIATE",
        "DELETE FROM l WHERE key = 'probe' AND ticket = 1 AND owner = 'bench'",
        "COMMIT",
    ]
    .map(|sql| conn.prepare(sql));
    let mut two_txns = Vec::with_capacity(prepared.len());
    for statement in prepared {
        two_txns.push(statement?);
    }
    let two: Floor<'_> = (
        "two_txns_us",
        Box::new(move || {
            for statement in &mut two_txns {
                statement.reset()?;
                while statement.next()? == sqlite::State::Row {}
            }
            Ok(())
        }),
    );
    let mut measures = vec![cycle_against_floor(
        open("uncontended", LockManager::builder())?,
        vec![raw, two],
        plan.per_round(10_000, 2_000),
    )];
    measures.extend(scale_measures(plan, &open));
    measures.push(handoff_in_process(plan, &open)?);
    for kind in ["lock", "flock"] {
        let target = dir.path().join(format!("cross-{kind}.db"));
        let target = target
            .to_str()
            .ok_or("a temporary path that is not UTF-8")?;
        measures.push(handoff_cross_process(
            if kind == "lock" {
                &[
                    "handoff_cross_process_p50_us",
                    "handoff_cross_process_from_call_p50_us",
                ]
            } else {
                &["flock_handoff_cross_process_p50_us"]
            },
            Ends::same(kind, target, ""),
            dir.path().to_owned(),
            plan.per_round(300, 60),
        ));
    }
    measures.extend(election_measures(plan, "", dir.path(), |name| {
        let path = dir.path().join(format!("{name}.db"));
        let path = path.to_str().ok_or("a temporary path that is not UTF-8")?;
        Ok((path.to_owned(), String::new()))
    })?);
    measures.extend(common_measures(plan, &open)?);
    run_rounds(&mut report, &mut measures, plan);
    drop(measures);
    shut_down(&opened.borrow())?;
    sqlite_targets(&mut report);
    Ok(report)
}

/// Stops every manager, so that nothing is left renewing or waiting.
pub(crate) fn shut_down(opened: &[LockManager]) -> Result<(), Error> {
    block_on(async {
        for locks in opened {
            locks.shutdown().await?;
        }
        Ok(())
    })
}
