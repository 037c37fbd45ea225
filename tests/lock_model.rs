//! The lock manager against a model of the grant rule.
//!
//! Random sequences of operations run on two or three owners (separate managers, each with its
//! own `TestClock`) sharing one database file and two or three keys (in half the runs the last
//! key takes permits, one or two of its two, instead of shared and exclusive requests):
//! acquisitions that may queue, `many` and `many_queued`, `try_acquire`, releases, interruptions of waiting requests,
//! and the expiry of an owner, simulated by freezing its clock (so it never heartbeats again)
//! while the others' clocks move on and their heartbeats keep their own leases alive. Time also
//! moves by fractions of a heartbeat, so that grants fall between beats.
//!
//! Bursts send several commands back to back, without awaiting in between, as a task does that
//! drops a guard and asks again at once: drops of guards and of just-sent acquisitions,
//! interruptions, `try_acquire`s, acquisitions and `many`s. They reach the storage worker in one
//! batch or several, and every command must see the effects of every command sent before it: a
//! `try_acquire` is judged against what the commands before it in the burst left.
//!
//! The model knows every live request: who made it, what it wants, how it was asked for, and the
//! ticket it was given (read once from `inspect`, and never allowed to change). From these the
//! rule says which requests must hold and which must wait; after every step the test waits,
//! within a bound, until `inspect` shows exactly that. Every snapshot it reads on the way, even
//! before the system settles, must be safe: no row of a dead request, no holder with a
//! conflicting row ahead of it, all rows of one request together. Once settled, every held row of
//! a live owner has at least a lease less one heartbeat left: one late heartbeat never loses a
//! lock, whether it was granted at once or from the queue. The pure rule is unit-tested in
//! `src/lock/grant.rs`; this is the manager built around it.
//!
//! The same runs, many thousands of times, on a simulated store (feature `testkit`): the memory
//! backend's managers stepped by a seeded simulation (`testkit::Sim`) on virtual time, where an
//! owner expires by being killed, time moves as the steps sleep, and settling takes no real
//! time; a failure prints the trace that replays it. And with the `postgres` feature on a
//! PostgreSQL server too (`stores::Store::postgres`), without the steps that move time: there
//! the server's clock judges leases, and owners beat in real time.
//!
//! The stores are `tests/stores`'s, and the simulation `common::in_simulation`.

mod common;
mod stores;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use common::{entries, join_within, rows_of};
use futures::executor::block_on;
use futures::FutureExt;
use leasehold::{
    fork_daemon, AbortController, AbortReason, Clock, Exit, Fiber, Guard, LockEntry, LockError,
    LockManager, LockRequest, Mode, Scoped, TestClock,
};
use proptest::prelude::*;
use stores::Store;

const LEASE: Duration = Duration::from_secs(6);
const HEARTBEAT: Duration = Duration::from_secs(1);
const POLL: Duration = Duration::from_millis(2);
/// How long the system may take to settle after one step.
const SETTLE: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug)]
enum Policy {
    /// `acquire`: one key, queued.
    Single,
    /// `many_queued`: every key under one ticket, queued.
    Queued,
    /// `many`: no queue position until granted everything at once.
    Unqueued,
}

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        owner: usize,
        key: usize,
        exclusive: bool,
    },
    TryAcquire {
        owner: usize,
        key: usize,
        exclusive: bool,
    },
    Many {
        owner: usize,
        first: (usize, bool),
        second: (usize, bool),
        queued: bool,
    },
    Release {
        pick: usize,
    },
    Interrupt {
        pick: usize,
    },
    Expire {
        owner: usize,
    },
    /// Every live owner's clock moves by this many tenths of a heartbeat.
    Advance {
        tenths: u32,
    },
    /// Commands sent back to back, with no await between them.
    Burst {
        actions: Vec<Action>,
    },
}

/// One command of a burst.
#[derive(Clone, Debug)]
enum Action {
    /// Drop a held guard (its release is sent from `Drop`).
    DropGuard { pick: usize },
    /// Send an acquisition (polled once) and keep it.
    Acquire {
        owner: usize,
        key: usize,
        exclusive: bool,
    },
    /// Send a `many` or `many_queued` (polled once) and keep it.
    Many {
        owner: usize,
        first: (usize, bool),
        second: (usize, bool),
        queued: bool,
    },
    /// Drop an acquisition sent earlier in this burst (its removal is sent from `Drop`).
    DropSent { pick: usize },
    /// Interrupt a waiting acquisition without waiting for it.
    Interrupt { pick: usize },
    /// Send a `try_acquire`, whose answer is read after the burst.
    Try {
        owner: usize,
        key: usize,
        exclusive: bool,
    },
}

fn action() -> impl Strategy<Value = Action> {
    let owner = 0..3usize;
    let key = 0..3usize;
    prop_oneof![
        3 => any::<usize>().prop_map(|pick| Action::DropGuard { pick }),
        2 => (owner.clone(), key.clone(), any::<bool>())
            .prop_map(|(owner, key, exclusive)| Action::Acquire { owner, key, exclusive }),
        1 => (owner.clone(), (key.clone(), any::<bool>()), (key.clone(), any::<bool>()), any::<bool>())
            .prop_map(|(owner, first, second, queued)| Action::Many { owner, first, second, queued }),
        1 => any::<usize>().prop_map(|pick| Action::DropSent { pick }),
        1 => any::<usize>().prop_map(|pick| Action::Interrupt { pick }),
        3 => (owner, key, any::<bool>())
            .prop_map(|(owner, key, exclusive)| Action::Try { owner, key, exclusive }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let owner = 0..3usize;
    let key = 0..3usize;
    prop_oneof![
        6 => (owner.clone(), key.clone(), any::<bool>())
            .prop_map(|(owner, key, exclusive)| Op::Acquire { owner, key, exclusive }),
        1 => (owner.clone(), key.clone(), any::<bool>())
            .prop_map(|(owner, key, exclusive)| Op::TryAcquire { owner, key, exclusive }),
        2 => (owner.clone(), (key.clone(), any::<bool>()), (key, any::<bool>()), any::<bool>())
            .prop_map(|(owner, first, second, queued)| Op::Many { owner, first, second, queued }),
        4 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Interrupt { pick }),
        1 => owner.prop_map(|owner| Op::Expire { owner }),
        2 => (3..=9u32).prop_map(|tenths| Op::Advance { tenths }),
        3 => proptest::collection::vec(action(), 2..=5).prop_map(|actions| Op::Burst { actions }),
    ]
}

struct Owner {
    locks: LockManager,
    /// The clock the manager reads.
    clock: Arc<dyn Clock>,
    /// That clock, where the test moves it (SQLite); `None` where time is the server's.
    test_clock: Option<TestClock>,
    frozen: bool,
}

impl Owner {
    fn test_clock(&self) -> &TestClock {
        self.test_clock
            .as_ref()
            .expect("time is moved only where the test owns the clocks")
    }
}

/// A new owner on `store`: on SQLite with a `TestClock` of its own, which the test moves;
/// elsewhere reading the store's clock (the simulation's, or the system's on PostgreSQL, whose
/// server judges leases).
async fn open_owner(store: &Store) -> Owner {
    let builder = LockManager::builder()
        .lease(LEASE)
        .heartbeat(HEARTBEAT)
        .poll(POLL);
    if store.moves_time() {
        let clock = TestClock::default();
        Owner {
            locks: store.open_on(builder, &clock),
            clock: Arc::new(clock.clone()),
            test_clock: Some(clock),
            frozen: false,
        }
    } else {
        Owner {
            locks: store.open_with(builder).await,
            clock: store.clock(),
            test_clock: None,
            frozen: false,
        }
    }
}

/// How much of its lease a held row of a live owner keeps, at least, once settled: a lease less
/// one heartbeat where the test moves time or a simulation does (one late beat never loses a
/// lock); less two in real time, where a beat may also be late by however busy the machine is.
fn margin(store: &Store) -> Duration {
    if store.moves_time() || store.is_simulated() {
        LEASE - HEARTBEAT
    } else {
        LEASE - 2 * HEARTBEAT
    }
}

enum State {
    Pending {
        fiber: Fiber<Result<Guard, LockError>>,
        stop: AbortController,
    },
    Held(Guard),
    /// Only while a finished acquisition is being joined.
    Joining,
}

struct Request {
    /// Its operation name, unique in the run: how its rows are recognised.
    name: String,
    owner: usize,
    wants: Vec<(String, Mode)>,
    policy: Policy,
    ticket: Option<u64>,
    state: State,
    /// When it was sent, by its owner's clock: a queued request's heartbeat starts a quarter of
    /// a heartbeat later.
    sent_at: Duration,
}

impl Request {
    fn is_pending(&self) -> bool {
        matches!(self.state, State::Pending { .. })
    }

    fn is_finished(&self) -> bool {
        matches!(&self.state, State::Pending { fiber, .. } if fiber.is_finished())
    }
}

/// `count` of the permits key's permits: it has two.
#[allow(non_snake_case)]
fn PERMITS(count: u32) -> Mode {
    Mode::Permits { count, limit: 2 }
}

/// Whether a request for `mode` is granted behind rows of the modes `ahead` (those with smaller
/// tickets on its key): shared needs only shared rows ahead, exclusive none at all, permits only
/// permits, whose counts leave room for its own within the limit.
fn fits(mode: Mode, ahead: impl IntoIterator<Item = Mode>) -> bool {
    let mut taken = 0;
    for other in ahead {
        match (mode, other) {
            (Mode::Shared, Mode::Shared) => {}
            (Mode::Permits { .. }, Mode::Permits { count, .. }) => taken += count,
            _ => return false,
        }
    }
    match mode {
        Mode::Permits { count, limit } => taken + count <= limit,
        Mode::Shared | Mode::Exclusive => true,
    }
}

/// Whether a request for `mode` on `key` with `ticket` is granted by the rule, given `rows`.
fn allowed(rows: &[LockEntry], key: &str, mode: Mode, ticket: u64) -> bool {
    let ahead = rows
        .iter()
        .filter(|row| row.key == key && row.ticket < ticket);
    fits(mode, ahead.map(|row| row.mode))
}

fn mode(exclusive: bool) -> Mode {
    if exclusive {
        Mode::Exclusive
    } else {
        Mode::Shared
    }
}

/// Whether a new request for `mode` on `key` is granted after the rows in `model` (request name,
/// key, mode): every one of them is ahead of it.
fn free_for(model: &[(String, String, Mode)], key: &str, mode: Mode) -> bool {
    let ahead = model.iter().filter(|(_, k, _)| k == key);
    fits(mode, ahead.map(|(_, _, other)| *other))
}

/// Notes that `owner`'s manager changed the keys of `wants` in a burst.
fn touch(touched: &mut HashMap<String, HashSet<usize>>, wants: &[(String, Mode)], owner: usize) {
    for (key, _) in wants {
        touched.entry(key.clone()).or_default().insert(owner);
    }
}

/// An acquisition of a burst, sent (polled once) but not yet handed to a fiber.
struct Sent {
    name: String,
    owner: usize,
    wants: Vec<(String, Mode)>,
    policy: Policy,
    acquisition: Scoped<Guard, LockError>,
    stop: AbortController,
    /// The guard, if the acquisition returned at its first poll already.
    early: Option<Guard>,
    /// Its owner's clock when it was made (which only the run moves, between steps).
    sent_at: Duration,
}

impl Sent {
    /// Polls the acquisition once, which sends its request to the storage worker.
    fn send(&mut self) {
        match (&mut self.acquisition).now_or_never() {
            None => {}
            Some(Ok(guard)) => self.early = Some(guard),
            Some(Err(error)) => panic!("{} failed at its first poll: {error}", self.name),
        }
    }

    /// The rows it will have, in the burst's model.
    fn rows(&self) -> Vec<(String, String, Mode)> {
        self.wants
            .iter()
            .map(|(key, mode)| (self.name.clone(), key.clone(), *mode))
            .collect()
    }

    fn into_request(self) -> Request {
        let state = match self.early {
            Some(guard) => State::Held(guard),
            None => State::Pending {
                fiber: fork_daemon(self.acquisition),
                stop: self.stop,
            },
        };
        Request {
            name: self.name,
            owner: self.owner,
            wants: self.wants,
            policy: self.policy,
            ticket: None,
            state,
            sent_at: self.sent_at,
        }
    }
}

/// A `try_acquire` of a burst: what the model expects (`None` where it cannot tell), and its
/// answer, if the first poll had it already.
struct Try {
    name: String,
    owner: usize,
    key: String,
    mode: Mode,
    expected: Option<bool>,
    early: Option<Result<Option<Guard>, LockError>>,
    answer: Pin<Box<dyn Future<Output = Result<Option<Guard>, LockError>> + Send>>,
}

struct World {
    store: Store,
    owners: Vec<Owner>,
    keys: Vec<String>,
    /// The key that takes permits ([`PERMITS`], the last key), in a run with permits; the
    /// others take shared and exclusive requests.
    permit_key: Option<String>,
    requests: Vec<Request>,
    /// Requests of frozen owners: kept alive, and out of the model.
    graveyard: Vec<Request>,
    next_name: usize,
    /// The largest ticket seen before the current step.
    max_ticket: u64,
    log: Vec<String>,
}

impl World {
    /// A world of `owners` on `keys` keys of `store`; with `permits`, the last key takes
    /// permits ([`PERMITS`]) instead of shared and exclusive requests.
    async fn open(store: Store, owners: usize, keys: usize, permits: bool) -> World {
        let mut opened = Vec::new();
        for _ in 0..owners {
            opened.push(open_owner(&store).await);
        }
        let owners = opened;
        let keys: Vec<String> = (0..keys).map(|k| format!("key{k}")).collect();
        World {
            store,
            owners,
            permit_key: permits.then(|| keys[keys.len() - 1].clone()),
            keys,
            requests: Vec::new(),
            graveyard: Vec::new(),
            next_name: 0,
            max_ticket: 0,
            log: Vec::new(),
        }
    }

    /// A live owner: the model's view of the database is the live owners' view.
    fn observer(&self) -> &LockManager {
        &self
            .owners
            .iter()
            .find(|owner| !owner.frozen)
            .expect("one owner always stays live")
            .locks
    }

    /// The live owner for a generated index (frozen owners take no more requests).
    fn live_owner(&self, index: usize) -> usize {
        let live: Vec<usize> = (0..self.owners.len())
            .filter(|&o| !self.owners[o].frozen)
            .collect();
        live[index % live.len()]
    }

    fn key(&self, index: usize) -> String {
        self.keys[index % self.keys.len()].clone()
    }

    /// What a generated request asks for on the key of `index`: shared or exclusive, or on the
    /// permits key one or two of its permits.
    fn want(&self, index: usize, exclusive: bool) -> (String, Mode) {
        let key = self.key(index);
        let mode = match &self.permit_key {
            Some(permits) if *permits == key => PERMITS(if exclusive { 2 } else { 1 }),
            _ => mode(exclusive),
        };
        (key, mode)
    }

    fn fail(&self, what: &str, rows: &[LockEntry]) -> ! {
        let rows: Vec<String> = rows
            .iter()
            .map(|e| {
                format!(
                    "{}:{}:{:?}:t{}:{:?}:{}",
                    e.operation,
                    e.key,
                    e.mode,
                    e.ticket,
                    e.state,
                    self.owners
                        .iter()
                        .position(|o| o.locks.owner_id() == e.owner)
                        .map_or("?".to_owned(), |o| format!("o{o}"))
                )
            })
            .collect();
        panic!(
            "{what}\nrows: {rows:#?}\nsteps:\n  {}",
            self.log.join("\n  ")
        );
    }

    async fn step(&mut self, op: &Op) {
        match *op {
            Op::Acquire {
                owner,
                key,
                exclusive,
            } => {
                let owner = self.live_owner(owner);
                let want = self.want(key, exclusive);
                self.start(owner, vec![want], Policy::Single);
            }
            Op::Many {
                owner,
                first,
                second,
                queued,
            } => {
                let owner = self.live_owner(owner);
                let (wants, policy) = self.many_wants(first, second, queued);
                self.start(owner, wants, policy);
            }
            Op::TryAcquire {
                owner,
                key,
                exclusive,
            } => {
                let owner = self.live_owner(owner);
                let (key, mode) = self.want(key, exclusive);
                self.try_acquire(owner, key, mode).await;
            }
            Op::Release { pick } => self.release(pick).await,
            Op::Interrupt { pick } => {
                let pending: Vec<usize> = (0..self.requests.len())
                    .filter(|&r| self.requests[r].is_pending())
                    .collect();
                if !pending.is_empty() {
                    self.interrupt(pending[pick % pending.len()]).await;
                }
            }
            Op::Expire { owner } => self.expire(owner % self.owners.len()).await,
            Op::Advance { tenths } => self.advance(HEARTBEAT * tenths / 10).await,
            Op::Burst { ref actions } => self.burst(actions).await,
        }
        self.settle().await;
    }

    /// The keys and policy of a `many` (two different keys: `many` refuses a key named twice).
    fn many_wants(
        &self,
        first: (usize, bool),
        second: (usize, bool),
        queued: bool,
    ) -> (Vec<(String, Mode)>, Policy) {
        let n = self.keys.len();
        let a = first.0 % n;
        let b = (a + 1 + second.0 % (n - 1)) % n;
        let wants = vec![self.want(a, first.1), self.want(b, second.1)];
        let policy = if queued {
            Policy::Queued
        } else {
            Policy::Unqueued
        };
        (wants, policy)
    }

    fn start(&mut self, owner: usize, wants: Vec<(String, Mode)>, policy: Policy) {
        let sent = self.acquisition(owner, wants, policy);
        self.requests.push(sent.into_request());
    }

    /// A new request, not yet sent: its acquisition sends it when first polled.
    fn acquisition(&mut self, owner: usize, wants: Vec<(String, Mode)>, policy: Policy) -> Sent {
        let name = format!("r{}", self.next_name);
        self.next_name += 1;
        self.log
            .push(format!("  {name}: o{owner} {policy:?} {wants:?}"));
        let requests: Vec<LockRequest> = wants
            .iter()
            .map(|(key, mode)| LockRequest {
                key: key.clone(),
                mode: *mode,
                operation: name.clone(),
            })
            .collect();
        let locks = &self.owners[owner].locks;
        let sent_at = self.owners[owner].clock.now();
        let stop = AbortController::new();
        let acquisition = match policy {
            Policy::Single => locks.acquire(requests[0].clone()),
            Policy::Queued => locks.many_queued(requests),
            Policy::Unqueued => locks.many(requests),
        }
        .with_signal(&stop.signal());
        Sent {
            name,
            owner,
            wants,
            policy,
            acquisition,
            stop,
            early: None,
            sent_at,
        }
    }

    /// Sends the commands of a burst back to back, then reads their answers. A `try_acquire` is
    /// judged against the rows that the commands before it left, where those are certain: not on
    /// a key that an interruption may or may not have freed yet, or that a waiting `many` may
    /// have taken meanwhile, or that a command of the burst sent to another manager changes,
    /// before or after it (each manager keeps the order of its own commands; two managers' are
    /// concurrent).
    async fn burst(&mut self, actions: &[Action]) {
        self.log.push("burst {".into());
        // Settled: these rows (in ticket order) are what the burst starts from. Each is
        // (request name, key, mode); new requests' rows go after them, as their tickets will.
        let mut model: Vec<(String, String, Mode)> = entries(self.observer())
            .await
            .into_iter()
            .map(|e| (e.operation, e.key, e.mode))
            .collect();
        let mut uncertain: HashSet<String> = self
            .requests
            .iter()
            .filter(|r| r.is_pending() && matches!(r.policy, Policy::Unqueued))
            .flat_map(|r| r.wants.iter().map(|(key, _)| key.clone()))
            .collect();
        // Key -> the managers that commands of this burst changed it through.
        let mut touched: HashMap<String, HashSet<usize>> = HashMap::new();
        let mut sent: Vec<Sent> = Vec::new();
        // The keys of each `many` of the burst: it takes all or none of them, so its outcome on
        // one key depends on the others.
        let mut manys: Vec<Vec<String>> = Vec::new();
        let mut tries: Vec<Try> = Vec::new();
        let mut interrupted: Vec<(Request, AbortReason)> = Vec::new();
        for action in actions {
            match *action {
                Action::DropGuard { pick } => {
                    let held: Vec<usize> = (0..self.requests.len())
                        .filter(|&r| matches!(self.requests[r].state, State::Held(_)))
                        .collect();
                    if held.is_empty() {
                        continue;
                    }
                    let request = self.requests.remove(held[pick % held.len()]);
                    self.log
                        .push(format!("  drop the guard of {}", request.name));
                    model.retain(|(name, _, _)| *name != request.name);
                    touch(&mut touched, &request.wants, request.owner);
                    drop(request);
                }
                Action::Acquire {
                    owner,
                    key,
                    exclusive,
                } => {
                    let owner = self.live_owner(owner);
                    let wants = vec![self.want(key, exclusive)];
                    let mut new = self.acquisition(owner, wants, Policy::Single);
                    new.send();
                    touch(&mut touched, &new.wants, owner);
                    model.extend(new.rows());
                    sent.push(new);
                }
                Action::Many {
                    owner,
                    first,
                    second,
                    queued,
                } => {
                    let owner = self.live_owner(owner);
                    let (wants, policy) = self.many_wants(first, second, queued);
                    let mut new = self.acquisition(owner, wants, policy);
                    new.send();
                    touch(&mut touched, &new.wants, owner);
                    let takes_rows = match policy {
                        Policy::Unqueued => {
                            manys.push(new.wants.iter().map(|(key, _)| key.clone()).collect());
                            if new.wants.iter().any(|(key, _)| uncertain.contains(key)) {
                                uncertain.extend(new.wants.iter().map(|(key, _)| key.clone()));
                            }
                            new.wants
                                .iter()
                                .all(|(key, mode)| free_for(&model, key, *mode))
                        }
                        _ => true,
                    };
                    if takes_rows {
                        model.extend(new.rows());
                    }
                    sent.push(new);
                }
                Action::DropSent { pick } => {
                    if sent.is_empty() {
                        continue;
                    }
                    let dropped = sent.remove(pick % sent.len());
                    self.log.push(format!("  drop {} as sent", dropped.name));
                    model.retain(|(name, _, _)| *name != dropped.name);
                    touch(&mut touched, &dropped.wants, dropped.owner);
                    drop(dropped);
                }
                Action::Interrupt { pick } => {
                    let pending: Vec<usize> = (0..self.requests.len())
                        .filter(|&r| self.requests[r].is_pending())
                        .collect();
                    if pending.is_empty() {
                        continue;
                    }
                    let request = self.requests.remove(pending[pick % pending.len()]);
                    self.log.push(format!("  interrupt {}", request.name));
                    let reason = AbortReason::from(format!("interrupt {}", request.name));
                    if let State::Pending { stop, .. } = &request.state {
                        stop.abort(reason.clone());
                    }
                    uncertain.extend(request.wants.iter().map(|(key, _)| key.clone()));
                    // Its removal runs on its own manager, concurrently with the commands sent
                    // to the others before it, not only after it.
                    touch(&mut touched, &request.wants, request.owner);
                    interrupted.push((request, reason));
                }
                Action::Try {
                    owner,
                    key,
                    exclusive,
                } => {
                    let owner = self.live_owner(owner);
                    let (key, mode) = self.want(key, exclusive);
                    let name = format!("r{}", self.next_name);
                    self.next_name += 1;
                    self.log
                        .push(format!("  {name}: o{owner} try_acquire {key} {mode:?}"));
                    let granted = free_for(&model, &key, mode);
                    let expected = (!uncertain.contains(&key)).then_some(granted);
                    if granted {
                        model.push((name.clone(), key.clone(), mode));
                    }
                    touch(&mut touched, &[(key.clone(), mode)], owner);
                    let locks = self.owners[owner].locks.clone();
                    let request = LockRequest {
                        key: key.clone(),
                        mode,
                        operation: name.clone(),
                    };
                    let mut answer: Pin<Box<dyn Future<Output = _> + Send>> =
                        Box::pin(async move { locks.try_acquire(request).await });
                    let early = (&mut answer).now_or_never();
                    tries.push(Try {
                        name,
                        owner,
                        key,
                        mode,
                        expected,
                        early,
                        answer,
                    });
                }
            }
        }
        self.log.push("}".into());
        // Each manager handles its commands in order: once a read on each has returned, every
        // command of the burst has taken effect, and any manager's snapshot shows it.
        for owner in self.owners.iter().filter(|o| !o.frozen) {
            entries(&owner.locks).await;
        }

        for new in sent {
            self.requests.push(new.into_request());
        }
        // Keys whose state a `try_acquire` cannot be sure of: those another manager's commands
        // change, concurrently; and then every key of a `many` that names one of them.
        let mut open: HashSet<String> = touched
            .iter()
            .filter(|(_, owners)| owners.len() > 1)
            .map(|(key, _)| key.clone())
            .collect();
        loop {
            let before = open.len();
            for keys in &manys {
                if keys.iter().any(|key| open.contains(key)) {
                    open.extend(keys.iter().cloned());
                }
            }
            if open.len() == before {
                break;
            }
        }
        for attempt in &mut tries {
            let others = touched
                .get(&attempt.key)
                .is_some_and(|owners| owners.iter().any(|&o| o != attempt.owner));
            if others || open.contains(&attempt.key) {
                attempt.expected = None;
            }
        }
        for attempt in tries {
            let Try {
                name,
                owner,
                key,
                mode,
                expected,
                early,
                answer,
            } = attempt;
            let granted = match early {
                Some(granted) => granted,
                None => common::bounded(SETTLE, "a try_acquire", answer).await,
            }
            .expect("try_acquire");
            if expected.is_some_and(|expected| expected != granted.is_some()) {
                let rows = entries(self.observer()).await;
                self.fail(
                    &format!(
                        "{name}: try_acquire in a burst gave {granted:?}; the commands before \
                         it left the rule saying {expected:?}"
                    ),
                    &rows,
                );
            }
            if let Some(guard) = granted {
                self.hold(name, owner, key, mode, guard);
            }
        }
        for (mut request, reason) in interrupted {
            let State::Pending { fiber, .. } =
                std::mem::replace(&mut request.state, State::Joining)
            else {
                unreachable!("picked among pending requests")
            };
            match join_within(SETTLE, "an interrupted acquisition", fiber).await {
                Exit::Success(Err(error))
                    if error.abort_reason().is_some_and(|r| r.ptr_eq(&reason)) =>
                {
                    let left = rows_of(&self.owners[request.owner].locks, &request.name).await;
                    if !left.is_empty() {
                        self.fail(
                            &format!("{} left rows when its interruption returned", request.name),
                            &left,
                        );
                    }
                }
                // Granted by a command earlier in the burst before the interruption was seen:
                // the value wins, and it holds.
                Exit::Success(Ok(guard)) => {
                    request.state = State::Held(guard);
                    self.requests.push(request);
                }
                other => self.fail(
                    &format!("{} interrupted returned {other:?}", request.name),
                    &[],
                ),
            }
        }
    }

    async fn try_acquire(&mut self, owner: usize, key: String, mode: Mode) {
        let name = format!("r{}", self.next_name);
        self.next_name += 1;
        self.log
            .push(format!("{name}: o{owner} try_acquire {key} {mode:?}"));
        // The system is settled: nothing changes between this look and the attempt.
        let rows = entries(self.observer()).await;
        let expected = allowed(&rows, &key, mode, u64::MAX);
        let request = LockRequest {
            key: key.clone(),
            mode,
            operation: name.clone(),
        };
        let granted = self.owners[owner]
            .locks
            .try_acquire(request)
            .await
            .expect("try_acquire");
        if granted.is_some() != expected {
            self.fail(
                &format!("{name}: try_acquire gave {granted:?}; the rule says {expected}"),
                &rows,
            );
        }
        if let Some(guard) = granted {
            self.hold(name, owner, key, mode, guard);
        }
    }

    /// Records the guard a `try_acquire` returned.
    fn hold(&mut self, name: String, owner: usize, key: String, mode: Mode, guard: Guard) {
        self.requests.push(Request {
            name,
            owner,
            wants: vec![(key, mode)],
            policy: Policy::Single,
            ticket: None,
            state: State::Held(guard),
            sent_at: self.owners[owner].clock.now(),
        });
    }

    async fn release(&mut self, pick: usize) {
        let held: Vec<usize> = (0..self.requests.len())
            .filter(|&r| matches!(self.requests[r].state, State::Held(_)))
            .collect();
        if held.is_empty() {
            return;
        }
        let request = self.requests.remove(held[pick % held.len()]);
        self.log.push(format!("release {}", request.name));
        let State::Held(guard) = request.state else {
            unreachable!("picked among held requests")
        };
        guard.release().await.expect("release");
        let left = rows_of(&self.owners[request.owner].locks, &request.name).await;
        if !left.is_empty() {
            self.fail(&format!("{} left rows after release", request.name), &left);
        }
    }

    async fn interrupt(&mut self, index: usize) {
        let request = self.requests.remove(index);
        self.log.push(format!("interrupt {}", request.name));
        let State::Pending { fiber, stop } = request.state else {
            unreachable!("picked among pending requests")
        };
        let reason = AbortReason::from(format!("interrupt {}", request.name));
        stop.abort(reason.clone());
        // Settled, and the rule says it waits: nothing can grant it meanwhile.
        match join_within(SETTLE, "an interrupted acquisition", fiber).await {
            Exit::Success(Err(error))
                if error.abort_reason().is_some_and(|r| r.ptr_eq(&reason)) => {}
            other => self.fail(
                &format!("{} interrupted returned {other:?}", request.name),
                &[],
            ),
        }
        let left = rows_of(&self.owners[request.owner].locks, &request.name).await;
        if !left.is_empty() {
            self.fail(
                &format!("{} left rows when its interruption returned", request.name),
                &left,
            );
        }
    }

    /// Freezes `owner` (its clock never moves again, so it never renews) and moves the other
    /// owners' clocks past its lease, one heartbeat at a time so that they renew theirs.
    async fn expire(&mut self, owner: usize) {
        let live = self.owners.iter().filter(|o| !o.frozen).count();
        if self.owners[owner].frozen || live < 2 {
            return;
        }
        self.log.push(format!("expire o{owner}"));
        self.owners[owner].frozen = true;
        let (dead, alive): (Vec<Request>, Vec<Request>) = std::mem::take(&mut self.requests)
            .into_iter()
            .partition(|r| r.owner == owner);
        self.requests = alive;
        self.graveyard.extend(dead);
        #[cfg(feature = "testkit")]
        if let Store::Simulated(store) = &self.store {
            // Killed: it never renews again, and the others' heartbeats run as the lease
            // passes.
            store.kill(&self.owners[owner].locks);
            self.owners[owner].clock.sleep(LEASE).await;
            return;
        }

        let ticks = (LEASE.as_millis() / HEARTBEAT.as_millis()) as usize;
        for tick in 1..=ticks {
            self.heartbeats_asleep().await;
            for o in self.owners.iter().filter(|o| !o.frozen) {
                o.test_clock().advance(HEARTBEAT);
            }
            if tick == ticks {
                // The frozen owner's rows have just run out: let `settle` judge what follows.
                break;
            }
            for o in self.owners.iter().filter(|o| !o.frozen) {
                let now = o.clock.now();
                let id = o.locks.owner_id();
                common::within(SETTLE, "every live row renewed", || async {
                    entries(&o.locks)
                        .await
                        .iter()
                        .filter(|e| e.owner == id)
                        .all(|e| e.expires_at == now + LEASE)
                })
                .await;
            }
        }
    }

    /// Waits until every heartbeat of every live owner is asleep on its clock: before the
    /// clocks move, and after, when the beats they woke have renewed. A queued request's
    /// heartbeat is forked once it has waited a quarter of a heartbeat.
    async fn heartbeats_asleep(&self) {
        if self.store.is_simulated() {
            // The simulation runs every beat that falls due as its clock moves.
            return;
        }
        for o in (0..self.owners.len()).filter(|&o| !self.owners[o].frozen) {
            let now = self.owners[o].clock.now();
            let waiting = self
                .requests
                .iter()
                .filter(|r| r.owner == o && r.is_pending() && !matches!(r.policy, Policy::Unqueued))
                .filter(|r| now >= r.sent_at + HEARTBEAT / 4)
                .count();
            let holding = self
                .requests
                .iter()
                .any(|r| r.owner == o && matches!(r.state, State::Held(_)));
            let beats = waiting + usize::from(holding);
            let clock = self.owners[o].test_clock();
            common::within(SETTLE, "heartbeats asleep", || async {
                clock.sleepers() >= beats
            })
            .await;
        }
    }

    /// Moves every live owner's clock by `by` (less than a heartbeat), so that the beats due
    /// then run, and grants made next fall between beats.
    async fn advance(&mut self, by: Duration) {
        self.log.push(format!("advance {by:?}"));
        if self.store.is_simulated() {
            self.owners[0].clock.sleep(by).await;
            return;
        }
        self.heartbeats_asleep().await;
        for o in self.owners.iter().filter(|o| !o.frozen) {
            o.test_clock().advance(by);
        }
        self.heartbeats_asleep().await;
    }

    /// Every held row of a live owner has at least `margin` of its lease left, by its
    /// owner's clock: one late heartbeat does not lose it.
    fn check_margins(&self, rows: &[LockEntry]) {
        for row in rows
            .iter()
            .filter(|e| e.state == leasehold::EntryState::Held)
        {
            let Some(owner) = self
                .owners
                .iter()
                .find(|o| !o.frozen && o.locks.owner_id() == row.owner)
            else {
                continue;
            };
            let left = row.expires_at.saturating_sub(owner.clock.now());
            let margin = margin(&self.store);
            if left < margin {
                self.fail(
                    &format!(
                        "{} holds {} with {left:?} of its lease left, less than {margin:?}",
                        row.operation, row.key
                    ),
                    rows,
                );
            }
        }
    }

    /// Waits until the system is quiescent and matches the model; checks every snapshot on the
    /// way for safety.
    async fn settle(&mut self) {
        // On the simulation's clock inside one, where waiting takes no real time.
        let clock = common::test_clock();
        let deadline = clock.monotonic() + SETTLE;
        loop {
            // Read before the snapshot: an acquisition that had returned then must hold in it.
            let finished: Vec<bool> = self.requests.iter().map(Request::is_finished).collect();
            let rows = entries(self.observer()).await;
            let by_request = self.check_safety(&rows, &finished);
            match self.quiescent(&rows, &by_request, &finished) {
                Ok(()) => {
                    self.check_margins(&rows);
                    self.absorb(&rows, &by_request).await;
                    return;
                }
                Err(why) if clock.monotonic() > deadline => {
                    self.fail(&format!("not settled within {SETTLE:?}: {why}"), &rows)
                }
                Err(_) => clock.sleep(Duration::from_millis(1)).await,
            }
        }
    }

    /// Whether `row` is of a request of an expired owner's.
    fn in_graveyard(&self, row: &LockEntry) -> bool {
        self.graveyard.iter().any(|r| r.name == row.operation)
    }

    /// Safety, true of every snapshot. Returns, per request index, its rows' ticket and whether
    /// they are held.
    fn check_safety(&self, rows: &[LockEntry], finished: &[bool]) -> HashMap<usize, (u64, bool)> {
        let index: HashMap<&str, usize> = self
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.as_str(), i))
            .collect();
        let mut grouped: BTreeMap<usize, Vec<&LockEntry>> = BTreeMap::new();
        for row in rows {
            match index.get(row.operation.as_str()) {
                Some(&r) => grouped.entry(r).or_default().push(row),
                // A killed owner's waiting request, promoted by another owner once what it
                // waited behind ran out: granted with a whole lease, which runs out unused.
                None if self.store.is_simulated() && self.in_graveyard(row) => {}
                None => self.fail(
                    &format!(
                        "a row of {}, which is released, interrupted or of an expired owner",
                        row.operation
                    ),
                    rows,
                ),
            }
        }
        let mut by_request = HashMap::new();
        for (&r, own) in &grouped {
            let request = &self.requests[r];
            let name = &request.name;
            let mut seen: Vec<String> = own
                .iter()
                .map(|e| format!("{}:{:?}", e.key, e.mode))
                .collect();
            let mut wanted: Vec<String> = request
                .wants
                .iter()
                .map(|(key, mode)| format!("{key}:{mode:?}"))
                .collect();
            seen.sort();
            wanted.sort();
            if seen != wanted {
                self.fail(&format!("{name} has rows {seen:?}, wants {wanted:?}"), rows);
            }
            let owner = self.owners[request.owner].locks.owner_id();
            if own.iter().any(|e| e.owner != owner) {
                self.fail(&format!("{name} has a row of another owner"), rows);
            }
            let ticket = own[0].ticket;
            let held = own[0].state == leasehold::EntryState::Held;
            if own
                .iter()
                .any(|e| e.ticket != ticket || (e.state == leasehold::EntryState::Held) != held)
            {
                self.fail(&format!("{name}'s rows differ in ticket or state"), rows);
            }
            if request.ticket.is_some_and(|t| t != ticket) {
                self.fail(&format!("{name}'s ticket changed"), rows);
            }
            if matches!(request.policy, Policy::Unqueued) && !held {
                self.fail(&format!("{name} is a `many` but waits in the queue"), rows);
            }
            by_request.insert(r, (ticket, held));
        }
        for (r, request) in self.requests.iter().enumerate() {
            if finished[r] && !by_request.get(&r).is_some_and(|&(_, held)| held) {
                self.fail(
                    &format!("{} returned but does not hold", request.name),
                    rows,
                );
            }
        }
        for key in &self.keys {
            let holders: Vec<&LockEntry> = rows
                .iter()
                .filter(|e| &e.key == key && e.state == leasehold::EntryState::Held)
                .collect();
            if holders.len() > 1 && holders.iter().any(|e| e.mode == Mode::Exclusive) {
                self.fail(&format!("an exclusive holder of {key} is not alone"), rows);
            }
            let permits: u32 = (holders.iter())
                .map(|e| match e.mode {
                    Mode::Permits { count, .. } => count,
                    Mode::Shared | Mode::Exclusive => 0,
                })
                .sum();
            if permits > 2 {
                self.fail(&format!("{permits} permits of {key} are held, of 2"), rows);
            }
        }
        // No holder has a conflicting row ahead of it (held or waiting): grants follow tickets.
        for row in rows
            .iter()
            .filter(|e| e.state == leasehold::EntryState::Held)
        {
            if !allowed(rows, &row.key, row.mode, row.ticket) {
                self.fail(
                    &format!(
                        "{} holds {} although a conflicting row is ahead of it",
                        row.operation, row.key
                    ),
                    rows,
                );
            }
        }
        by_request
    }

    /// Whether the snapshot is what the rule says the model must settle to.
    fn quiescent(
        &self,
        rows: &[LockEntry],
        by_request: &HashMap<usize, (u64, bool)>,
        finished: &[bool],
    ) -> Result<(), String> {
        for (r, request) in self.requests.iter().enumerate() {
            let name = &request.name;
            match (by_request.get(&r), request.policy) {
                (None, Policy::Unqueued) => {
                    let grantable = request
                        .wants
                        .iter()
                        .all(|(key, mode)| allowed(rows, key, *mode, u64::MAX));
                    if grantable {
                        return Err(format!("{name} (a `many`) could be granted but is not"));
                    }
                }
                (None, _) => return Err(format!("{name} has no rows yet")),
                (Some(&(ticket, held)), _) => {
                    let must_hold = request
                        .wants
                        .iter()
                        .all(|(key, mode)| allowed(rows, key, *mode, ticket));
                    if must_hold != held {
                        return Err(format!(
                            "{name} (ticket {ticket}) {} but the rule says it must {}",
                            if held { "holds" } else { "waits" },
                            if must_hold { "hold" } else { "wait" }
                        ));
                    }
                    if held && request.is_pending() && !finished[r] {
                        return Err(format!(
                            "{name} holds, but its acquisition has not returned"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Takes what a settled snapshot taught: new tickets, and the guards of returned acquisitions.
    async fn absorb(&mut self, rows: &[LockEntry], by_request: &HashMap<usize, (u64, bool)>) {
        let before = self.max_ticket;
        for (&r, &(ticket, held)) in by_request {
            if self.requests[r].ticket.is_none() {
                if ticket <= before {
                    self.fail(
                        &format!(
                            "{} got ticket {ticket}, not above the {before} seen before",
                            self.requests[r].name
                        ),
                        rows,
                    );
                }
                self.requests[r].ticket = Some(ticket);
            }
            self.max_ticket = self.max_ticket.max(ticket);
            if held && self.requests[r].is_pending() {
                let State::Pending { fiber, .. } =
                    std::mem::replace(&mut self.requests[r].state, State::Joining)
                else {
                    unreachable!("checked pending")
                };
                let guard = match fiber.join().await {
                    Exit::Success(Ok(guard)) => guard,
                    other => self.fail(
                        &format!("{} holds but returned {other:?}", self.requests[r].name),
                        rows,
                    ),
                };
                assert_eq!(guard.fencing_token(), ticket, "{}", self.requests[r].name);
                self.requests[r].state = State::Held(guard);
            }
        }
    }

    /// Everyone lets go: the waiting are interrupted (from the back of the queues, so that no
    /// interruption grants anyone), the holders release, and nothing is left.
    async fn finish(mut self) {
        loop {
            let last = (0..self.requests.len())
                .filter(|&r| self.requests[r].is_pending())
                .max_by_key(|&r| self.requests[r].ticket.unwrap_or(u64::MAX));
            let Some(last) = last else { break };
            self.interrupt(last).await;
            self.settle().await;
        }
        while !self.requests.is_empty() {
            self.release(0).await;
        }
        if self.store.is_simulated() && !self.graveyard.is_empty() {
            // Killed owners' rows, promoted perhaps after the kill, run out within a lease.
            common::test_clock().sleep(LEASE).await;
        }
        let left = entries(self.observer()).await;
        if !left.is_empty() {
            self.fail("rows left after everyone let go", &left);
        }
        // The frozen owners' requests, then every owner: afterwards not even an expired row may
        // remain (a fresh clock, back at the start, would see it live).
        for request in std::mem::take(&mut self.graveyard) {
            if let State::Pending { fiber, stop } = request.state {
                stop.abort("the end");
                drop(join_within(SETTLE, "a frozen owner's acquisition", fiber).await);
            }
        }
        for owner in &self.owners {
            // A killed owner (an expired one, in a simulation) is shut down already.
            let killed = owner.frozen && self.store.is_simulated();
            if !killed {
                owner.locks.shutdown().await.expect("shutdown");
            }
        }
        let fresh = open_owner(&self.store).await.locks;
        let left = entries(&fresh).await;
        if !left.is_empty() {
            self.fail("rows left after every owner shut down", &left);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        max_shrink_time: 60_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_manager_grants_what_the_rule_says(
        owners in 2..=3usize,
        keys in 2..=3usize,
        permits in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..=30),
    ) {
        block_on(async {
            let mut world = World::open(Store::sqlite(), owners, keys, permits).await;
            for op in &ops {
                world.step(op).await;
            }
            world.finish().await;
        });
    }
}

/// How many cases the simulated model runs (`LEASEHOLD_MODEL_CASES`, default 8,192).
#[cfg(feature = "testkit")]
fn simulated_cases() -> u32 {
    std::env::var("LEASEHOLD_MODEL_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(8192)
}

/// Runs `ops` on a simulated store inside a simulation of `seed` (with `permits`, the last key
/// takes permits); a failure panics with the trace that replays it.
#[cfg(feature = "testkit")]
fn run_simulated(seed: u64, owners: usize, keys: usize, permits: bool, ops: Vec<Op>) {
    common::in_simulation(seed, |sim| {
        let store = Store::simulated(sim);
        async move {
            let mut world = World::open(store, owners, keys, permits).await;
            for op in &ops {
                world.step(op).await;
            }
            world.finish().await;
        }
    });
}

#[cfg(feature = "testkit")]
proptest! {
    #![proptest_config(ProptestConfig {
        cases: simulated_cases(),
        failure_persistence: None,
        max_shrink_time: 60_000,
        ..ProptestConfig::default()
    })]

    /// The model on a simulated store: the memory backend's manager stepped by a seeded
    /// simulation on virtual time, so that settling, expiries and heartbeats take no real time,
    /// and every interleaving of its workers and callers is the seed's.
    #[test]
    fn the_manager_in_a_simulation_grants_what_the_rule_says(
        seed in any::<u64>(),
        owners in 2..=3usize,
        keys in 2..=3usize,
        permits in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..=30),
    ) {
        run_simulated(seed, owners, keys, permits, ops);
    }
}

#[cfg(all(feature = "postgres", feature = "testkit"))]
proptest! {
    #![proptest_config(ProptestConfig {
        cases: 32,
        failure_persistence: None,
        max_shrink_time: 60_000,
        ..ProptestConfig::default()
    })]

    /// The same on PostgreSQL, where the server's clock judges leases: every step but those
    /// that move time (the expiry of a frozen owner, fractions of a heartbeat). Fewer cases, as
    /// each connects its managers anew.
    #[test]
    fn the_manager_on_postgres_grants_what_the_rule_says(
        owners in 2..=3usize,
        keys in 2..=3usize,
        permits in any::<bool>(),
        ops in proptest::collection::vec(
            op().prop_filter("time moves only on SQLite", |op| {
                !matches!(op, Op::Expire { .. } | Op::Advance { .. })
            }),
            1..=30,
        ),
    ) {
        let Some(store) = Store::postgres() else {
            return Ok(());
        };
        block_on(async {
            let mut world = World::open(store, owners, keys, permits).await;
            for op in &ops {
                world.step(op).await;
            }
            world.finish().await;
        });
    }
}

/// A `many` refused on a key that a `many_queued` of the same manager also waits on is woken
/// when the holder's lease runs out (found by the simulated model; see `watch.rs`).
#[cfg(feature = "testkit")]
#[test]
fn a_refused_many_beside_a_queued_request_of_its_manager_is_woken_by_a_lapse() {
    let ops = vec![
        Op::TryAcquire {
            owner: 1,
            key: 1,
            exclusive: false,
        },
        Op::Acquire {
            owner: 0,
            key: 0,
            exclusive: true,
        },
        Op::Many {
            owner: 1,
            first: (2, false),
            second: (2, false),
            queued: false,
        },
        Op::Acquire {
            owner: 0,
            key: 2,
            exclusive: true,
        },
        Op::Many {
            owner: 1,
            first: (2, false),
            second: (1, true),
            queued: true,
        },
        Op::Expire { owner: 0 },
    ];
    run_simulated(0, 2, 3, false, ops);
}
