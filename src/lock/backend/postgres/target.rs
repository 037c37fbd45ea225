//! What `connect` is given: the connection string, parsed (with its TLS settings, `tls.rs`), the
//! schema's name, and the bounds put on every wait on the server.

use std::time::Duration;

use postgres::Config;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::lock::LockError;

/// The default schema.
pub(crate) const DEFAULT_SCHEMA: &str = "leasehold";

/// Whether `name` can be a schema of ours: lower-case letters, digits and `_`, not starting
/// with a digit, at most 63 bytes (PostgreSQL's limit). It is quoted in every statement too.
pub(crate) fn valid_schema(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// What is said of a connection string in errors and `Debug`: never its password.
pub(crate) fn describe(config: &Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|host| match host {
            postgres::config::Host::Tcp(name) => name.clone(),
            #[cfg(unix)]
            postgres::config::Host::Unix(path) => path.display().to_string(),
        })
        .collect();
    format!(
        "postgres (user {:?}, host {:?}, database {:?})",
        config.get_user().unwrap_or(""),
        hosts.join(","),
        config.get_dbname().unwrap_or("")
    )
}

/// A parsed connection string: the client's settings and how to connect (with TLS or not).
pub(crate) struct Target {
    pub(super) config: Config,
    pub(super) tls: Option<MakeRustlsConnect>,
}

impl Target {
    /// A plain connection to the server, with this target's TLS settings: for the command's
    /// checks of a store (`doctor`), which ask what no manager asks.
    pub(crate) fn connect(&self) -> std::result::Result<postgres::Client, postgres::Error> {
        match &self.tls {
            Some(tls) => self.config.connect(tls.clone()),
            None => self.config.connect(postgres::NoTls),
        }
    }

    /// The server and database, without the password.
    pub(crate) fn describe(&self) -> String {
        describe(&self.config)
    }

    /// Bounds every wait on the server by `heartbeat`, so that a stuck statement or lock fails
    /// (and is retried) well before a lease could run out, and the storage thread gets back to
    /// renewing: `statement_timeout`, `lock_timeout` and `idle_in_transaction_session_timeout`
    /// at half a heartbeat (the last so that a client paused inside a transaction, by a debugger
    /// or `SIGSTOP`, holds its locks on other owners' rows for no longer), added to any options
    /// the URL gave; a connection attempt bounded by a heartbeat (at least a second); and TCP
    /// keepalives, so that a server that vanished is noticed within about a heartbeat.
    pub(super) fn bound_by(mut self, heartbeat: Duration) -> Target {
        let limit = (heartbeat / 2).as_millis().max(1);
        // And planner settings for statements that all find their rows by an index:
        // - Generic plans, made once per connection: a custom plan, which the server otherwise
        //   makes for each of a statement's first calls and keeps making while it estimates it
        //   cheaper, costs more to plan (about 0.4 ms) than the statement costs to run.
        // - Plain index scans, whatever the table's statistics say: a plan made while the table
        //   looked empty would scan it whole once it holds thousands of rows. And no bitmap
        //   scans: each acquisition inserts a row and each release deletes it, so a busy key's
        //   index entries are mostly dead ones until the next vacuum. An index scan marks those
        //   it meets as dead, and later scans skip them; a bitmap scan (which the planner picks
        //   for `key = ANY(..)`) never does, and walks them all every time.
        let ours = format!(
            "-c statement_timeout={limit} -c lock_timeout={limit} \
             -c idle_in_transaction_session_timeout={limit} -c plan_cache_mode=force_generic_plan -c enable_seqscan=off \
             -c enable_bitmapscan=off"
        );
        let options = match self.config.get_options() {
            Some(given) if !given.is_empty() => format!("{given} {ours}"),
            _ => ours,
        };
        self.config.options(&options);
        let idle = heartbeat.max(Duration::from_secs(1));
        self.config
            .connect_timeout(idle)
            .keepalives(true)
            .keepalives_idle(idle)
            .keepalives_interval((idle / 4).max(Duration::from_secs(1)))
            .keepalives_retries(3);
        self
    }
}

/// Parses a libpq connection string or URL, with its TLS settings (see `postgres_tls.rs`).
pub(crate) fn parse(url: &str) -> std::result::Result<Target, LockError> {
    if has_unescaped_at(url) {
        // As libpq would, the parser takes what follows the first `@` for the host, so part of
        // the password would show up in every message that names the host.
        return Err(LockError::InvalidConfig(
            "the PostgreSQL URL has more than one `@` before its host: write an `@` in the user \
             name or password as %40"
                .into(),
        ));
    }
    let (rest, settings) = super::tls::split(url)?;
    let mut config = rest.parse::<Config>().map_err(|error| {
        // The parser's message never quotes the string it was given, so no password leaks.
        LockError::InvalidConfig(format!(
            "the PostgreSQL connection string is invalid: {error}"
        ))
    })?;
    let (mode, tls) = super::tls::connector(&settings)?;
    config.ssl_mode(mode);
    Ok(Target { config, tls })
}

/// Whether `url` is a URL whose user information holds an `@` not written as `%40`: its part
/// before the host (up to the first `/`, `?` or `#`) has more than one `@`.
pub(super) fn has_unescaped_at(url: &str) -> bool {
    let Some(rest) = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|scheme| url.strip_prefix(scheme))
    else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority.matches('@').count() > 1
}
