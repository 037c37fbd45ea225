//! Wake-ups from other managers: the listener thread `LISTEN`s on a connection of its own and
//! keeps what it heard (`Heard`) for the worker's next look; and when to connect again after a
//! failure (`Reconnect`), for it and for the storage thread's own connection.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use postgres::fallible_iterator::FallibleIterator;
use postgres::{Config, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::schema::quote;
use crate::clock::{Clock, SystemClock};
use crate::lock::backend::codec::fnv1a;
use crate::lock::backend::Poke;
use crate::schedule::{Schedule, ScheduleRun};
use crate::sync::lock;

/// What the listener thread heard since the worker last asked (`Storage::changes`).
#[derive(Debug, Default)]
pub(super) struct Heard {
    /// Whether it is connected and listening: while not, nothing is heard, so every look
    /// looks at everything.
    pub(super) listening: bool,
    /// Whether something may have been missed (it has just started listening, or heard an
    /// announcement too long to name its keys).
    pub(super) missed: bool,
    /// Whether any announcement came, and the keys they named.
    pub(super) any: bool,
    pub(super) keys: Vec<i64>,
}

/// The longest `NOTIFY` payload sent: the server refuses 8,000 bytes and more. An announcement of
/// more keys says only that something changed (`*`).
const MAX_PAYLOAD: usize = 7_000;

/// The payload announcing `keys`: their digests, separated by commas.
pub(super) fn payload(keys: &[i64]) -> String {
    let text = keys
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    if text.len() > MAX_PAYLOAD {
        "*".to_owned()
    } else {
        text
    }
}

/// The key digests a payload names; `None` when it does not name them.
pub(super) fn parse_payload(payload: &str) -> Option<Vec<i64>> {
    payload
        .split(',')
        .filter(|part| !part.is_empty())
        .map(|part| part.parse().ok())
        .collect()
}

/// The `NOTIFY` channel of a schema. A channel is an identifier, at most 63 bytes (a longer
/// one is an error for `pg_notify` and silently cut short by `LISTEN`), so a long schema name is
/// replaced by a digest of it.
pub(crate) fn channel(schema: &str) -> String {
    let channel = format!("leasehold_{schema}");
    if channel.len() <= 63 {
        return channel;
    }
    format!("leasehold_{:016x}", fnv1a(schema.as_bytes()))
}

/// When to try connecting again: after each failed attempt, the next waits for the next delay
/// of the busy schedule; a success starts the schedule over, and so does its end (the manager
/// never gives up on its server). On real time: a server is down in real time.
pub(super) struct Reconnect {
    run: ScheduleRun,
    /// When the next attempt may be made (`SystemClock`'s monotonic time), after a failure.
    next: Option<Duration>,
}

impl Reconnect {
    pub(super) fn new(busy: Schedule) -> Self {
        Reconnect {
            run: busy.start(SystemClock.monotonic()),
            next: None,
        }
    }

    /// How long until the next attempt may be made, if that is not now.
    pub(super) fn wait_left(&self) -> Option<Duration> {
        let now = SystemClock.monotonic();
        self.next.filter(|&at| at > now).map(|at| at - now)
    }

    /// An attempt succeeded: the next failure waits the schedule's first delay.
    pub(super) fn succeeded(&mut self) {
        self.run.reset(SystemClock.monotonic());
        self.next = None;
    }

    /// An attempt failed now.
    pub(super) fn failed(&mut self) {
        let now = SystemClock.monotonic();
        self.next = self.run.next_at(now).or_else(|| {
            self.run.reset(now);
            self.run.next_at(now)
        });
    }

    /// Sleeps this thread until the next attempt may be made.
    pub(super) fn pause(&self) {
        if let Some(left) = self.wait_left() {
            std::thread::sleep(left);
        }
    }
}

/// Listens for other managers' announcements on a connection of its own, and pokes the worker
/// when one comes. Stops once the worker is gone.
pub(super) struct Listener {
    pub(super) config: Config,
    pub(super) tls: Option<MakeRustlsConnect>,
    pub(super) channel: String,
    pub(super) poke: Arc<dyn Poke>,
    pub(super) heard: Arc<Mutex<Heard>>,
    pub(super) reconnect: Reconnect,
}

impl Listener {
    /// How often a listener with nothing to hear checks whether its manager is still there.
    const CHECK_EVERY: Duration = Duration::from_millis(500);

    /// Whether the worker is still there; pokes it if so.
    fn poke(&self) -> bool {
        self.poke.poke()
    }

    pub(super) fn run(mut self) {
        while self.poke.alive() {
            self.reconnect.pause();
            let listened = self.listen();
            lock(&self.heard).listening = false;
            match listened {
                Err(error) => {
                    tracing::debug!(%error, "listening for other managers' changes stopped; again");
                    self.reconnect.failed();
                }
                Ok(()) => return,
            }
        }
    }

    /// Listens until the connection fails (an error) or the worker is gone (`Ok`).
    fn listen(&mut self) -> std::result::Result<(), postgres::Error> {
        let mut client = match &self.tls {
            Some(tls) => self.config.connect(tls.clone())?,
            None => self.config.connect(NoTls)?,
        };
        client.batch_execute(&format!("LISTEN {}", quote(&self.channel)))?;
        self.reconnect.succeeded();
        // Whatever was announced before this LISTEN was not heard: look at everything now.
        {
            let mut heard = lock(&self.heard);
            heard.listening = true;
            heard.missed = true;
        }
        if !self.poke() {
            return Ok(());
        }
        let mut notifications = client.notifications();
        loop {
            let mut incoming = notifications.timeout_iter(Self::CHECK_EVERY);
            while let Some(notification) = incoming.next()? {
                {
                    let mut heard = lock(&self.heard);
                    heard.any = true;
                    match parse_payload(notification.payload()) {
                        Some(keys) => heard.keys.extend(keys),
                        None => heard.missed = true,
                    }
                }
                if !self.poke() {
                    return Ok(());
                }
            }
            if !self.poke.alive() {
                return Ok(());
            }
        }
    }
}
