//! Decisions in one round trip: a batch of acquisitions and releases of one owner in one call of
//! the server's function `decide` (`functions.sql`), which takes the locks of all their keys
//! once and decides each in turn (`DecidesAtOnce`); an operation alone on one key, the
//! commonest batch, in a call of `acquire_one` or `release_one`, which decide it the same way
//! with less work on the server.

use postgres::types::ToSql;

use super::listener::{channel, payload};
use super::schema::{key_lock, key_locks};
use super::Postgres;
use crate::lock::backend::codec::{
    encode_keys, key_hash, mode_code, mode_of, sql_ticket, ticket_of,
};
use crate::lock::backend::{
    AtOnce, DecidesAtOnce, Decision, Deleted, Outcome, OwnedRequest, Removal, Result, Wait,
};
use crate::lock::StorageError;

/// The call of the function `decide` (see `FUNCTIONS`), for `DecideArgs::params`.
pub(crate) const DECIDE: &str =
    "SELECT * FROM {s}.decide($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)";

/// The arguments of the function `decide`: a batch of operations of one owner, with one entry
/// per operation and one per key of each.
pub(crate) struct DecideArgs<'a> {
    owner: &'a str,
    lease: i64,
    locks: Vec<i32>,
    schema_lock: i32,
    channel: String,
    ends: Vec<i32>,
    tickets: Vec<Option<i64>>,
    waits: Vec<Option<i16>>,
    all_keys: Vec<Option<String>>,
    payloads: Vec<Option<String>>,
    keys: Vec<String>,
    modes: Vec<i64>,
    operations: Vec<&'a str>,
    announces: Vec<bool>,
}

impl<'a> DecideArgs<'a> {
    pub(crate) fn new(schema: &str, owner: &'a str, lease: i64, ops: &[AtOnce<'a>]) -> Self {
        let mut args = DecideArgs {
            owner,
            lease,
            locks: Vec::new(),
            schema_lock: 0,
            channel: channel(schema),
            ends: Vec::with_capacity(ops.len()),
            tickets: Vec::with_capacity(ops.len()),
            waits: Vec::with_capacity(ops.len()),
            all_keys: Vec::with_capacity(ops.len()),
            payloads: Vec::with_capacity(ops.len()),
            keys: Vec::new(),
            modes: Vec::new(),
            operations: Vec::new(),
            announces: Vec::with_capacity(ops.len()),
        };
        for op in ops {
            args.push(op);
        }
        (args.locks, args.schema_lock) = key_locks(schema, &args.keys);
        args
    }

    fn push(&mut self, op: &AtOnce<'a>) {
        match *op {
            AtOnce::Acquire {
                requests,
                wait,
                announce,
            } => {
                for request in requests {
                    self.keys.push(request.key.clone());
                    self.modes.push(mode_code(request.mode));
                    self.operations.push(&request.operation);
                }
                self.tickets.push(None);
                self.waits.push(Some(wait_code(wait)));
                self.all_keys.push(encode_keys(requests));
                let keys = requests.iter().map(|request| request.key.as_str());
                self.payloads.push(announce.then(|| payload_of(keys)));
                self.announces.push(announce);
            }
            AtOnce::Remove {
                keys,
                ticket,
                announce,
            } => {
                for key in keys {
                    self.keys.push(key.clone());
                    self.modes.push(0);
                    self.operations.push("");
                }
                self.tickets.push(Some(sql_ticket(ticket)));
                self.waits.push(None);
                self.all_keys.push(None);
                self.payloads
                    .push(Some(payload_of(keys.iter().map(String::as_str))));
                self.announces.push(announce);
            }
        }
        self.ends
            .push(i32::try_from(self.keys.len()).unwrap_or(i32::MAX));
    }

    /// The parameters of `DECIDE`, in order, `latest` the caller's estimate of the store's
    /// time (`check_clock` in `FUNCTIONS`).
    pub(crate) fn params<'s>(&'s self, latest: &'s Option<i64>) -> Vec<&'s (dyn ToSql + Sync)> {
        vec![
            &self.owner,
            &self.lease,
            &self.locks,
            &self.schema_lock,
            &self.channel,
            &self.ends,
            &self.tickets,
            &self.waits,
            &self.all_keys,
            &self.payloads,
            &self.keys,
            &self.modes,
            &self.operations,
            latest,
            &self.announces,
        ]
    }
}

/// The calls of the functions `acquire_one` and `release_one` (see `FUNCTIONS`): `decide` for
/// an operation alone on one key, the commonest call, with less work on the server. Their
/// answer is one row of `decide`'s columns.
const ACQUIRE_ONE: &str =
    "SELECT * FROM {s}.acquire_one($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";
const RELEASE_ONE: &str = "SELECT * FROM {s}.release_one($1, $2, $3, $4, $5, $6, $7, $8, $9)";

/// The arguments of `acquire_one` or `release_one`, for a batch of one operation on one key.
pub(crate) enum OneArgs<'a> {
    Acquire {
        owner: &'a str,
        lease: i64,
        lock: i32,
        schema_lock: i32,
        key: &'a str,
        mode: i64,
        operation: &'a str,
        wait: i16,
        channel: String,
        /// The announcement of a grant, if asked for.
        payload: Option<String>,
    },
    Release {
        owner: &'a str,
        lock: i32,
        schema_lock: i32,
        channel: String,
        key: &'a str,
        ticket: i64,
        payload: String,
        announce: bool,
    },
}

impl<'a> OneArgs<'a> {
    /// `None` unless `ops` is one operation on one key.
    pub(crate) fn new(
        schema: &str,
        owner: &'a str,
        lease: i64,
        ops: &[AtOnce<'a>],
    ) -> Option<Self> {
        let schema_lock = key_lock(schema, "");
        match *ops {
            [AtOnce::Acquire {
                requests: [ref request],
                wait,
                announce,
            }] => Some(OneArgs::Acquire {
                owner,
                lease,
                lock: key_lock(schema, &request.key),
                schema_lock,
                key: &request.key,
                mode: mode_code(request.mode),
                operation: &request.operation,
                wait: wait_code(wait),
                channel: channel(schema),
                payload: announce.then(|| payload_of([request.key.as_str()])),
            }),
            [AtOnce::Remove {
                keys: [ref key],
                ticket,
                announce,
            }] => Some(OneArgs::Release {
                owner,
                lock: key_lock(schema, key),
                schema_lock,
                channel: channel(schema),
                key,
                ticket: sql_ticket(ticket),
                payload: payload(&[key_hash(key)]),
                announce,
            }),
            _ => None,
        }
    }

    /// What the call does, and its text (`ACQUIRE_ONE` or `RELEASE_ONE`).
    pub(crate) fn call(&self) -> (&'static str, &'static str) {
        match self {
            OneArgs::Acquire { .. } => ("deciding an acquisition", ACQUIRE_ONE),
            OneArgs::Release { .. } => ("deciding a release", RELEASE_ONE),
        }
    }

    /// The parameters of the call, in order, `latest` the caller's estimate of the store's time
    /// (`check_clock` in `FUNCTIONS`).
    pub(crate) fn params<'s>(&'s self, latest: &'s Option<i64>) -> Vec<&'s (dyn ToSql + Sync)> {
        match self {
            OneArgs::Acquire {
                owner,
                lease,
                lock,
                schema_lock,
                key,
                mode,
                operation,
                wait,
                channel,
                payload,
            } => vec![
                owner,
                lease,
                lock,
                schema_lock,
                key,
                mode,
                operation,
                wait,
                latest,
                channel,
                payload,
            ],
            OneArgs::Release {
                owner,
                lock,
                schema_lock,
                channel,
                key,
                ticket,
                payload,
                announce,
            } => vec![
                owner,
                lock,
                schema_lock,
                channel,
                key,
                ticket,
                payload,
                latest,
                announce,
            ],
        }
    }
}

/// The call that decides a batch: `decide`, or the function for an operation alone on one key.
enum Call<'a> {
    One(OneArgs<'a>),
    Many(DecideArgs<'a>),
}

/// The announcement of `keys`: the payload of their digests, each once.
fn payload_of<'k>(keys: impl IntoIterator<Item = &'k str>) -> String {
    let mut hashes: Vec<i64> = keys.into_iter().map(key_hash).collect();
    hashes.sort_unstable();
    hashes.dedup();
    payload(&hashes)
}

/// The code of `wait` in the functions' arguments.
fn wait_code(wait: Wait) -> i16 {
    match wait {
        Wait::Queued => 0,
        Wait::Unqueued => 1,
        Wait::No => 2,
    }
}

/// An acquisition's answer from `decide`, for a caller who waits as `wait` says.
fn decision(row: &postgres::Row, wait: Wait) -> Decision {
    let granted: bool = row.get(2);
    let misfit = (!granted)
        .then(|| {
            Some((
                row.get::<_, Option<String>>(10)?,
                row.get::<_, Option<i64>>(11)?,
            ))
        })
        .flatten()
        .map(|(key, mode)| (key, mode_of(mode)));
    let others = if granted || wait == Wait::No {
        Vec::new()
    } else {
        let keys: Vec<Option<String>> = row.get::<_, Option<_>>(3).unwrap_or_default();
        let expiries: Vec<i64> = row.get::<_, Option<_>>(4).unwrap_or_default();
        (keys.into_iter().map(Option::unwrap_or_default))
            .zip(expiries)
            .collect()
    };
    Decision {
        now: row.get(0),
        ticket: row.get::<_, Option<i64>>(1).map(ticket_of),
        granted,
        others,
        misfit,
    }
}

impl Postgres {
    /// A batch of acquisitions and removals in one call of the function `decide` (see
    /// `FUNCTIONS`), which takes the locks of all their keys once.
    fn decide_in_one(
        &mut self,
        owner: &str,
        ops: &[AtOnce<'_>],
        lease: i64,
    ) -> Result<Vec<Outcome>> {
        self.transient = false;
        let call = match OneArgs::new(&self.schema, owner, lease, ops) {
            Some(one) => Call::One(one),
            None => Call::Many(DecideArgs::new(&self.schema, owner, lease, ops)),
        };
        let (doing, sql) = match &call {
            Call::One(one) => one.call(),
            Call::Many(_) => ("deciding", DECIDE),
        };
        let statement = self.statement(doing, sql)?;
        let latest = self.latest();
        let params = match &call {
            Call::One(one) => one.params(&latest),
            Call::Many(many) => many.params(&latest),
        };
        let sent = self.monotonic();
        let rows = self.with(doing, |client| client.query(&statement, &params))?;
        self.succeeded();
        if rows.len() != ops.len() {
            let answers = format!("{} answers to {} operations", rows.len(), ops.len());
            return Err(StorageError::new("deciding", answers).into());
        }
        if let Some(first) = rows.first() {
            // The first operation's time: the earliest read after the call was sent.
            self.observed(first.get::<_, i64>(0), sent);
        }
        let mut outcomes = Vec::with_capacity(ops.len());
        for (op, row) in ops.iter().zip(&rows) {
            let now: i64 = row.get(0);
            outcomes.push(match op {
                AtOnce::Acquire { wait, .. } => Outcome::Acquired(decision(row, *wait)),
                AtOnce::Remove { .. } => {
                    let count = |at: usize| usize::try_from(row.get::<_, i64>(at)).unwrap_or(0);
                    Outcome::Removed(Removal {
                        now,
                        deleted: Deleted {
                            rows: count(5),
                            live: count(6),
                        },
                        freed: row.get(7),
                        promoted: row
                            .get::<_, Option<Vec<i64>>>(8)
                            .unwrap_or_default()
                            .into_iter()
                            .map(ticket_of)
                            .collect(),
                        owners: row
                            .get::<_, Option<Vec<String>>>(9)
                            .unwrap_or_default()
                            .into_iter()
                            .collect(),
                    })
                }
            });
        }
        Ok(outcomes)
    }
}

/// The call of the function `renew` (see `FUNCTIONS`).
const RENEW: &str = "SELECT * FROM {s}.renew($1, $2, $3, $4)";

impl DecidesAtOnce for Postgres {
    /// One round trip: the function `renew` (see `FUNCTIONS`).
    fn renew_at_once(&mut self, owner: &str, lease: i64) -> Result<(i64, Vec<OwnedRequest>)> {
        self.transient = false;
        let (_, schema_lock) = key_locks(&self.schema, &[]);
        let statement = self.statement("renewing leases", RENEW)?;
        let latest = self.latest();
        let sent = self.monotonic();
        let rows = self.with("renewing leases", |client| {
            client.query(&statement, &[&owner, &lease, &schema_lock, &latest])
        })?;
        self.succeeded();
        let Some(row) = rows.first() else {
            return Err(StorageError::new("renewing leases", "no answer").into());
        };
        let now: i64 = row.get(0);
        // Read once the rows were locked: the earliest time it may be, as of the call's sending.
        self.observed(now, sent);
        let tickets = row.get::<_, Option<Vec<i64>>>(1).unwrap_or_default();
        let helds = row.get::<_, Option<Vec<bool>>>(2).unwrap_or_default();
        let renewed = tickets.into_iter().map(ticket_of).zip(helds);
        Ok((now, OwnedRequest::group(renewed, now + lease)))
    }

    /// One round trip: the function `decide` (see `FUNCTIONS`).
    fn decide_at_once(
        &mut self,
        owner: &str,
        ops: &[AtOnce<'_>],
        lease: i64,
    ) -> Result<Vec<Outcome>> {
        self.decide_in_one(owner, ops, lease)
    }
}
