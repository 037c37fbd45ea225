//! The PostgreSQL backend's tests on a real server (the throwaway one of `super`): tombstones,
//! and the server-side rule (`functions.sql`) against the pure one of `grant.rs`.

use std::sync::Arc;

use crate::lock::backend::postgres::{parse, Postgres};
use crate::schedule::Schedule;

/// Tombstones of removals, on a real server (see `backend::tombstones_live_until_heard_or_swept`).
#[test]
fn tombstones_live_until_heard_or_swept() {
    use super as pg_support;
    let Some(server) = pg_support::server() else {
        return;
    };
    use crate::lock::backend::NoWorker;
    let target = parse(server.url()).expect("the test server's URL");
    let schema = pg_support::schema("tombstones");
    let busy = Schedule::recurs(0);
    let mut storage =
        Postgres::connect(target, schema, busy, Arc::new(NoWorker), false).expect("connect");
    crate::lock::backend::tombstones_live_until_heard_or_swept(&mut storage);
}

/// The server-side functions (`FUNCTIONS`) against the grant rule of `grant.rs`, on generated
/// rows: whether a new request is granted, and which waiters a release lets through. On a real
/// server: the throwaway one of `testkit::postgres`.
mod the_rule_in_sql {
    use postgres::fallible_iterator::FallibleIterator;
    use proptest::prelude::*;

    use std::sync::Mutex;

    use postgres::{Client, NoTls};

    use super::super as pg_support;
    use crate::lock::backend::codec::mode_code;
    use crate::lock::backend::postgres::decide::{DecideArgs, OneArgs, DECIDE};
    use crate::lock::backend::postgres::listener::channel;
    use crate::lock::backend::postgres::quote;
    use crate::lock::backend::postgres::schema::migrate;
    use crate::lock::backend::{AtOnce, Wait};
    use crate::lock::grant::{grantable_now, misfit, promotable, RowView};
    use crate::lock::{LockRequest, Mode};
    use crate::sync::lock;

    /// A row to plant: key (0 or 1), mode ([`mode`]), held, lapsed, owner (0 or 1), and
    /// whether its request names both keys. Tickets follow the order of the rows. Rows of
    /// permits and of the other modes, or of two limits, may meet on a key here, as no manager
    /// writes them: the functions must judge them as the rule does, and write nothing beside a
    /// live one.
    type Planted = (u8, u8, bool, bool, u8, bool);

    /// The mode of code `code`: 0 shared, 1 exclusive, 2 and 3 one and two of 3 permits, 4 one of
    /// 2 permits (another limit).
    fn mode(code: u8) -> Mode {
        match code {
            0 => Mode::Shared,
            1 => Mode::Exclusive,
            2 => Mode::Permits { count: 1, limit: 3 },
            3 => Mode::Permits { count: 2, limit: 3 },
            _ => Mode::Permits { count: 1, limit: 2 },
        }
    }

    fn planted() -> impl Strategy<Value = Vec<Planted>> {
        prop::collection::vec(
            (
                0..2u8,
                prop::sample::select(vec![0u8, 1, 0, 1, 2, 3, 2, 3, 4]),
                any::<bool>(),
                prop::bool::weighted(0.2),
                0..2u8,
                prop::bool::weighted(0.2),
            ),
            0..7,
        )
    }

    const KEYS: [&str; 2] = ["a", "b"];

    struct Case {
        client: Client,
        schema: String,
    }

    impl Case {
        fn new() -> Option<Case> {
            let server = pg_support::server()?;
            let schema = pg_support::schema("rule_in_sql");
            let mut client = Client::connect(server.url(), NoTls).expect("connect");
            client
                .batch_execute(
                    "SET plan_cache_mode = force_generic_plan; \
                     SET enable_seqscan = off; SET enable_bitmapscan = off",
                )
                .unwrap();
            migrate(&mut client, &schema).expect("the schema");
            // Planted tickets are small; new ones come after them.
            client
                .query_one(
                    &format!("SELECT setval('{}.tickets', 1000)", quote(&schema)),
                    &[],
                )
                .unwrap();
            Some(Case { client, schema })
        }

        /// Runs `test` on the case of this test binary (one schema for all), if there is a
        /// server.
        fn with(
            test: impl FnOnce(&mut Case) -> std::result::Result<(), TestCaseError>,
        ) -> std::result::Result<(), TestCaseError> {
            static CASE: std::sync::OnceLock<Mutex<Option<Case>>> = std::sync::OnceLock::new();
            let mut case = lock(CASE.get_or_init(|| Mutex::new(Case::new())));
            match case.as_mut() {
                Some(case) => test(case),
                None => Ok(()),
            }
        }

        /// Empties the table and plants `rows`; returns the server's time and the rows as
        /// the rule sees them (live ones only).
        fn plant(&mut self, rows: &[Planted]) -> (i64, Vec<RowView>) {
            let s = quote(&self.schema);
            self.client
                .batch_execute(&format!("DELETE FROM {s}.locks"))
                .unwrap();
            let now: i64 = self
                .client
                .query_one(
                    "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
                    &[],
                )
                .unwrap()
                .get(0);
            let hour = 3_600_000_000_i64;
            let mut live = Vec::new();
            for (i, &(key, code, held, lapsed, owner, both)) in rows.iter().enumerate() {
                let key = KEYS[usize::from(key)];
                let mode = mode(code);
                let ticket = i as i64 + 1;
                let owner = format!("o{owner}");
                let expires_at = if lapsed { now - hour } else { now + hour };
                let keys = both.then(|| "1:a1:b".to_owned());
                self.client
                    .execute(
                        &format!(
                            "INSERT INTO {s}.locks (key, mode, operation, owner, ticket, held,
                                 requested_at, expires_at, heartbeat_at, keys)
                             VALUES ($1, $2, 'op', $3, $4, $5, $6, $7, $6, $8)"
                        ),
                        &[
                            &key,
                            &mode_code(mode),
                            &owner,
                            &ticket,
                            &held,
                            &(now - hour * 2),
                            &expires_at,
                            &keys,
                        ],
                    )
                    .unwrap();
                if !lapsed {
                    live.push(RowView {
                        key: key.into(),
                        mode,
                        ticket: ticket as u64,
                        held,
                        owner: owner.into(),
                        expires_at,
                        keys: if both {
                            vec!["a".into(), "b".into()]
                        } else {
                            Vec::new()
                        },
                    });
                }
            }
            (now, live)
        }

        /// The answer to `op` alone of `owner`: from `decide`, or (`one`) from the function
        /// for an operation alone on one key, if `op` is one (`None` if not).
        fn answer(&mut self, owner: &str, op: AtOnce<'_>, one: bool) -> Option<postgres::Row> {
            let s = quote(&self.schema);
            // No estimate of the store's time: nothing to check it against.
            let latest: Option<i64> = None;
            if one {
                let args = OneArgs::new(&self.schema, owner, 1_000_000, &[op])?;
                let sql = args.call().1.replace("{s}", &s);
                let params = args.params(&latest);
                return Some(self.client.query_one(&sql, &params).unwrap());
            }
            let args = DecideArgs::new(&self.schema, owner, 1_000_000, &[op]);
            let sql = DECIDE.replace("{s}", &s);
            let params = args.params(&latest);
            Some(self.client.query_one(&sql, &params).unwrap())
        }

        /// Everything `op` of `owner` leaves behind when alone, through `decide` or (`one`)
        /// the function for an operation alone on one key, from `rows` and `watcher` (a caller
        /// of owner `o{watcher}` waiting without a row on key "a"): the answer's columns that
        /// mean something for it, the rows and watchers then (new tickets as 0, times as
        /// whether live), and the announcements sent.
        fn outcome(
            &mut self,
            rows: &[Planted],
            watcher: Option<u8>,
            owner: &str,
            op: AtOnce<'_>,
            one: bool,
        ) -> Option<String> {
            let s = quote(&self.schema);
            let (now, _) = self.plant(rows);
            self.client
                .batch_execute(&format!("DELETE FROM {s}.watchers"))
                .unwrap();
            if let Some(watcher) = watcher {
                self.client
                    .execute(
                        &format!("INSERT INTO {s}.watchers (key, owner, expires_at) VALUES ('a', $1, $2)"),
                        &[&format!("o{watcher}"), &(now + 3_600_000_000_i64)],
                    )
                    .unwrap();
            }
            let listen = format!("LISTEN \"{}\"", channel(&self.schema));
            self.client.batch_execute(&listen).unwrap();
            let _ = self.client.notifications().iter().count().unwrap();
            let acquire = matches!(op, AtOnce::Acquire { .. });
            let row = self.answer(owner, op, one)?;
            let sorted = |mut v: Vec<String>| {
                v.sort();
                v
            };
            let answer = if acquire {
                let misfit = row.get::<_, Option<bool>>(2) == Some(false);
                format!(
                    "ticket {} granted {:?} others {:?} expiries {} misfit {:?}",
                    row.get::<_, Option<i64>>(1).is_some(),
                    row.get::<_, Option<bool>>(2),
                    row.get::<_, Option<Vec<String>>>(3).map(sorted),
                    row.get::<_, Option<Vec<i64>>>(4).map_or(0, |e| e.len()),
                    misfit.then(|| row.get::<_, Option<String>>(10)),
                )
            } else {
                let mut promoted = row.get::<_, Option<Vec<i64>>>(8).unwrap_or_default();
                promoted.sort_unstable();
                format!(
                    "deleted {:?} live {:?} freed {:?} promoted {:?} owners {:?}",
                    row.get::<_, Option<i64>>(5),
                    row.get::<_, Option<i64>>(6),
                    row.get::<_, Option<bool>>(7),
                    promoted,
                    row.get::<_, Option<Vec<String>>>(9).map(sorted),
                )
            };
            let table: Vec<String> = self
                .client
                .query(
                    &format!(
                        "SELECT key, CASE WHEN ticket <= 1000 THEN ticket ELSE 0 END, mode, held,
                                owner, keys, expires_at > $1, acquired_at IS NULL
                         FROM {s}.locks ORDER BY 1, 2, 5"
                    ),
                    &[&now],
                )
                .unwrap()
                .iter()
                .map(|r| {
                    format!(
                        "{} {} {} {} {} {:?} {} {}",
                        r.get::<_, &str>(0),
                        r.get::<_, i64>(1),
                        r.get::<_, i64>(2),
                        r.get::<_, bool>(3),
                        r.get::<_, &str>(4),
                        r.get::<_, Option<&str>>(5),
                        r.get::<_, bool>(6),
                        r.get::<_, bool>(7),
                    )
                })
                .collect();
            let watchers: Vec<String> = self
                .client
                .query(
                    &format!("SELECT key, owner FROM {s}.watchers ORDER BY 1, 2"),
                    &[],
                )
                .unwrap()
                .iter()
                .map(|r| format!("{} {}", r.get::<_, &str>(0), r.get::<_, &str>(1)))
                .collect();
            let heard: Vec<String> = self
                .client
                .notifications()
                .iter()
                .map(|n| Ok(n.payload().to_owned()))
                .collect()
                .unwrap();
            Some(format!(
                "{answer}\nrows {table:?}\nwatchers {watchers:?}\nheard {heard:?}"
            ))
        }

        /// How many lapsed rows are left on `keys`.
        fn lapsed_on(&mut self, keys: &[String], now: i64) -> i64 {
            let s = quote(&self.schema);
            self.client
                .query_one(
                    &format!(
                        "SELECT count(*) FROM {s}.locks WHERE key = ANY($1) AND expires_at <= $2"
                    ),
                    &[&keys, &now],
                )
                .unwrap()
                .get(0)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn a_new_request_is_granted_in_sql_as_by_the_rule(
            rows in planted(),
            wanted in prop::sample::subsequence(vec![0u8, 1], 1..=2),
            modes in [0..5u8, 0..5u8],
        ) {
            Case::with(|case| {
            // Through `decide`, then through `acquire_one` where the request has one key.
            for one in [false, true] {
            let (now, live) = case.plant(&rows);
            let requests: Vec<LockRequest> = wanted
                .iter()
                .map(|&k| LockRequest {
                    key: KEYS[usize::from(k)].to_owned(),
                    mode: mode(modes[usize::from(k)]),
                    operation: "new".to_owned(),
                })
                .collect();
            let keys: Vec<String> = requests.iter().map(|r| r.key.clone()).collect();
            let op = AtOnce::Acquire { requests: &requests, wait: Wait::No, announce: false };
            let Some(row) = case.answer("o9", op, one) else {
                continue;
            };
            let granted: bool = row.get(2);
            let wanted = || requests.iter().map(|r| (r.key.as_str(), r.mode));
            // A live row of the other kind, or of another limit, is a misfit: refused, and
            // nothing written.
            let misfit = misfit(wanted(), &live);
            let expected = misfit.is_none() && grantable_now(wanted(), &live);
            prop_assert_eq!(granted, expected, "rows {:?}, one {}", rows, one);
            prop_assert_eq!(row.get::<_, Option<i64>>(1).is_some(), expected);
            let answered: Option<String> = row.get(10);
            prop_assert_eq!(answered.is_some(), misfit.is_some(), "rows {:?}, one {}", rows, one);
            prop_assert_eq!(case.lapsed_on(&keys, now), 0, "lapsed rows are deleted first");
            }
            Ok(())
            })?;
        }

        /// `acquire_one` and `release_one` decide as `decide` does, in everything they
        /// answer, write and announce; and an operation asked to be announced (a leadership)
        /// is, whenever it changes its key, whoever waits.
        #[test]
        fn an_operation_on_one_key_is_decided_by_its_function_as_by_decide(
            rows in planted(),
            watcher in prop::option::of(0..2u8),
            acquire in any::<bool>(),
            announce in any::<bool>(),
            key in 0..2u8,
            code in 0..5u8,
            wait in 0..3u8,
            owner in prop::sample::select(vec![0u8, 1, 9]),
            released in any::<prop::sample::Index>(),
        ) {
            Case::with(|case| {
            let key = KEYS[usize::from(key)];
            let requests = [LockRequest {
                key: key.to_owned(),
                mode: mode(code),
                operation: "new".to_owned(),
            }];
            let wait = [Wait::Queued, Wait::Unqueued, Wait::No][usize::from(wait)];
            let keys = [key.to_owned()];
            // A release of a planted request (its owner's, by its ticket), or of none.
            let (ticket, owner) = match rows.len() {
                0 => (1, format!("o{owner}")),
                n => {
                    let at = released.index(n);
                    (at as u64 + 1, format!("o{}", rows[at].4))
                }
            };
            let op = || match acquire {
                true => AtOnce::Acquire { requests: &requests, wait, announce },
                false => AtOnce::Remove { keys: &keys, ticket, announce },
            };
            let by_decide = case.outcome(&rows, watcher, &owner, op(), false);
            let by_one = case.outcome(&rows, watcher, &owner, op(), true);
            prop_assert!(by_one.is_some(), "an operation on one key has its function");
            prop_assert_eq!(&by_decide, &by_one, "rows {:?}", rows);
            let outcome = by_one.unwrap_or_default();
            let changed = match acquire {
                true => outcome.contains("granted Some(true)"),
                false => !outcome.contains("deleted Some(0)"),
            };
            if announce && changed {
                prop_assert!(!outcome.contains("heard []"), "not announced: {}", outcome);
            }
            Ok(())
            })?;
        }

        #[test]
        fn a_release_promotes_in_sql_whom_the_rule_lets_through(
            rows in planted(),
            released in any::<prop::sample::Index>(),
        ) {
            Case::with(|case| {
            if rows.is_empty() {
                return Ok(());
            }
            // Through `decide`, then through `release_one` where the request has one key.
            for one in [false, true] {
            let (_, live) = case.plant(&rows);
            // Release one planted request (all its rows), live or lapsed, held or not.
            let at = released.index(rows.len());
            let (key, _, _, lapsed, owner, both) = rows[at];
            let keys: Vec<String> = if both {
                vec!["a".into(), "b".into()]
            } else {
                vec![KEYS[usize::from(key)].to_owned()]
            };
            let ticket = at as i64 + 1;
            let owner = format!("o{owner}");
            let op = AtOnce::Remove { keys: &keys, ticket: ticket as u64, announce: false };
            let Some(row) = case.answer(&owner, op, one) else {
                continue;
            };
            let deleted: i64 = row.get(5);
            let mut promoted: Vec<u64> = row
                .get::<_, Option<Vec<i64>>>(8)
                .unwrap_or_default()
                .into_iter()
                .map(|t| t as u64)
                .collect();
            promoted.sort_unstable();
            // The rows planted under that ticket on those keys are gone (a planted row on
            // one key only names its own key: it is deleted only through it).
            prop_assert_eq!(deleted, 1);
            prop_assert_eq!(row.get::<_, i64>(6), i64::from(!lapsed), "live rows deleted");
            prop_assert!(row.get::<_, bool>(7), "a deletion frees");
            let left: Vec<RowView> = live
                .into_iter()
                .filter(|r| r.ticket != ticket as u64 && keys.iter().any(|k| **k == *r.key))
                .collect();
            // Waiters on the released keys alone (one on both keys is its owner's to promote).
            let mut expected: Vec<u64> = promotable(&left)
                .into_iter()
                .filter(|t| left.iter().any(|r| r.ticket == *t && r.keys.is_empty()))
                .collect();
            expected.sort_unstable();
            prop_assert_eq!(promoted, expected, "rows {:?}, released {}, one {}", rows, at, one);
            }
            Ok(())
            })?;
        }
    }
}
