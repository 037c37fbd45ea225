//! A real, throwaway PostgreSQL server for the tests that need one.
//!
//! ```no_run
//! use leasehold::testkit::postgres;
//!
//! #[test]
//! fn something_against_postgres() {
//!     let Some(pg) = postgres::server() else { return }; // skipped, reason printed
//!     let schema = postgres::schema("something_against_postgres");
//!     // connect to pg.url() (or pg.conninfo()) and use `schema`
//! #   let _ = (pg, schema);
//! }
//! ```
//!
//! # Which server
//!
//! - [`server()`]: one server per test binary, started on first use and shared by its tests.
//! - [`tls_server()`]: a second shared server, with `ssl = on`, a certificate made for the run,
//!   and TCP connections without TLS rejected. It is a server of its own so that the plain
//!   server's clients, which may default to `sslmode=prefer`, never meet a certificate they
//!   cannot verify.
//! - [`start()`]: a server of the caller's own, stopped when dropped: for tests that restart the
//!   server or otherwise disturb everyone connected to it.
//! - `LEASEHOLD_POSTGRES_URL=postgres://...`: [`server()`] is that existing server instead, and
//!   [`tls_server()`] and [`start()`], which need a server the harness controls, are skipped.
//!
//! When the server programs are missing, each of them prints to standard error that the running
//! test is skipped, and why (`cargo test -- --nocapture` shows it), and returns `None`: the test
//! returns early and passes. Every PostgreSQL test of this crate reaches its server through
//! these, so none passes silently. With `LEASEHOLD_REQUIRE_POSTGRES=1` (set by `.ci/run`) a skip panics
//! instead, with the same reason. A server that exists but fails to start always panics, with
//! its log: that is a failure, not a missing program.
//!
//! # How a server is made
//!
//! The programs come from `pg_config --bindir`, or else the newest `/usr/lib/postgresql/*/bin`
//! (`pg_config` may be missing, or come from `libpq-dev` alone and name no server). `initdb`
//! writes the data directory into a fresh temporary directory, which is also the unix socket
//! directory (mode 0700); `pg_ctl start -w -t 30` starts the server on that socket and on a free
//! TCP port of 127.0.0.1, and waits until the server says it is ready (the deadline is
//! `pg_ctl`'s own). When the port was taken in between, it retries on another.
//!
//! As root, every server program runs as the `postgres` user (`initdb` refuses root) and the
//! temporary directory belongs to that user; otherwise they run as the current user.
//!
//! Roles: the superuser `postgres` is used only by the harness, over the socket. Tests connect
//! as [`USER`], which owns the database [`DATABASE`] (so it may create schemas) and is not a
//! superuser. [`Secret`] is a second role with a distinctive password, for tests that check a
//! password never leaks. `pg_hba.conf`: the socket trusts (only its owner and root can reach
//! it), TCP needs a password (`scram-sha-256`).
//!
//! Durability is traded for speed (`fsync = off`): the data is thrown away, and a server killed
//! by `restart(Shutdown::Immediate)` loses nothing, as its writes are in the kernel's cache.
//!
//! # How a server goes away
//!
//! The test harness has no global teardown, and a test run may be killed. So every server gets a
//! watchdog: a small shell process whose standard input is a pipe whose only writer is the test
//! process. When the test process ends, however it ends (normal exit, panic, `SIGKILL`), the
//! kernel closes that pipe; the watchdog reads end-of-file, stops the server with
//! `pg_ctl stop -m immediate` (or kills the postmaster if that fails) and removes the temporary
//! directory. Dropping a [`start()`] server closes the pipe the same way. The watchdog is in a
//! process group of its own and ignores `SIGINT` and `SIGHUP`, so a Ctrl-C that kills the test
//! run does not kill its clean-up; the postmaster is in a session of its own (`pg_ctl` does
//! that). Only killing the watchdog itself (say, `kill -9` of every process of the user) leaves
//! a server behind: stop it with `pg_ctl stop -D /tmp/leasehold-pg-*/data`, or remove its
//! directory (a postmaster checks its lock file every minute and shuts down when it is gone).
//!
//! # Running SQL
//!
//! The harness needs a client only for its own set-up and for the torture helpers, and uses
//! `psql` (installed with the server programs) rather than a Rust client, so that this module
//! compiles without the `postgres` feature. All of it goes through [`Server::psql`], the one place
//! to change should a machine have the server but no `psql`.
#![allow(dead_code)]

#[cfg(all(test, feature = "postgres"))]
mod backend;

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::{chown, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Names an existing server to test against instead of starting one.
pub const URL_VAR: &str = "LEASEHOLD_POSTGRES_URL";
/// When `1`, a test that would be skipped for want of a server panics instead.
pub const REQUIRE_VAR: &str = "LEASEHOLD_REQUIRE_POSTGRES";
/// The role the tests connect as: owner of [`DATABASE`], not a superuser.
pub const USER: &str = "leasehold";
/// The database the tests connect to.
pub const DATABASE: &str = "leasehold";
/// The role with a password that must never leak (see [`Secret`]).
pub const SECRET_USER: &str = "leasehold_secret";
/// The superuser, used by the harness itself over the socket only.
const SUPERUSER: &str = "postgres";

/// How long `initdb`, `openssl` and `psql` may take. Generous: only a failing run pays it.
const COMMAND_LIMIT: Duration = Duration::from_secs(60);
/// How long `pg_ctl` waits for a start, restart or stop (its `-t`).
const PG_CTL_SECONDS: u32 = 30;
/// How many free ports to try when another process takes the one chosen in between.
const PORT_ATTEMPTS: usize = 5;

/// Whether a server speaks TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tls {
    /// Plain connections only.
    Off,
    /// `ssl = on` with a CA and a server certificate (for `localhost` and 127.0.0.1) made for the
    /// run; TCP connections without TLS are rejected.
    On,
}

/// How [`Server::restart`] stops the server (`pg_ctl restart -m ...`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// Disconnects every client, then shuts down cleanly.
    Fast,
    /// Kills the server at once, as a crash would; the start that follows runs crash recovery.
    Immediate,
}

impl Shutdown {
    fn as_arg(self) -> &'static str {
        match self {
            Shutdown::Fast => "fast",
            Shutdown::Immediate => "immediate",
        }
    }
}

/// A role whose password is distinctive enough to search for in logs, errors and `Debug`
/// output.
#[derive(Debug)]
pub struct Secret {
    /// The role's name.
    pub user: String,
    /// Its password.
    pub password: String,
    /// A URL over TCP that contains the password.
    pub url: String,
}

/// A PostgreSQL server to test against.
#[derive(Debug)]
pub struct Server {
    url: String,
    conninfo: Option<String>,
    secret: Option<Secret>,
    local: Option<Local>,
}

/// What the harness knows of a server it started.
#[derive(Debug)]
struct Local {
    bindir: PathBuf,
    /// The `postgres` user's ids when the tests run as root.
    run_as: Option<(u32, u32)>,
    /// The temporary directory: data directory, socket, log and certificates.
    dir: PathBuf,
    port: u16,
    ca_file: Option<PathBuf>,
    /// Dropping its standard input stops the server (see the module docs).
    watchdog: Child,
}

/// Why there is no server.
#[derive(Debug)]
enum Failure {
    /// The server programs (or what they need) are missing.
    Skip(String),
    /// They are here but did not work.
    Broken(String),
}

/// The server shared by every test of this binary, started on first use; `None` (with the
/// reason printed) when the tests are to be skipped. See the module docs.
pub fn server() -> Option<&'static Server> {
    static SERVER: OnceLock<Result<Server, Failure>> = OnceLock::new();
    shared(SERVER.get_or_init(|| match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => Ok(existing(url)),
        _ => start_local(Tls::Off),
    }))
}

/// An existing server named by `url`, which the harness neither starts nor stops: its
/// [`sql`](Server::sql) connects to `url` (as the role the URL names), and what needs a server
/// the harness controls ([`restart`](Server::restart), [`conninfo`](Server::conninfo)) is not
/// there.
pub fn existing(url: String) -> Server {
    Server {
        url,
        conninfo: None,
        secret: None,
        local: None,
    }
}

/// The shared server with TLS on, started on first use; `None` (reason printed) when skipped,
/// including when `LEASEHOLD_POSTGRES_URL` is set.
pub fn tls_server() -> Option<&'static Server> {
    static SERVER: OnceLock<Result<Server, Failure>> = OnceLock::new();
    shared(SERVER.get_or_init(|| start_controlled(Tls::On)))
}

/// A server of the caller's own, stopped (and its files removed) when dropped; `None` (reason
/// printed) when skipped, including when `LEASEHOLD_POSTGRES_URL` is set.
pub fn start(tls: Tls) -> Option<Server> {
    match start_controlled(tls) {
        Ok(server) => Some(server),
        Err(failure) => skip_or_panic(&failure),
    }
}

fn shared(cell: &'static Result<Server, Failure>) -> Option<&'static Server> {
    match cell {
        Ok(server) => Some(server),
        Err(failure) => skip_or_panic(failure),
    }
}

fn skip_or_panic<T>(failure: &Failure) -> Option<T> {
    match failure {
        Failure::Broken(message) => panic!("PostgreSQL test server: {message}"),
        Failure::Skip(reason) if std::env::var(REQUIRE_VAR).as_deref() == Ok("1") => {
            panic!("PostgreSQL tests cannot run, and {REQUIRE_VAR}=1: {reason}")
        }
        Failure::Skip(reason) => {
            let test = std::thread::current().name().unwrap_or("a test").to_owned();
            eprintln!(
                "skipped {test}, which needs PostgreSQL: {reason} \
                 (with {REQUIRE_VAR}=1 this fails instead)"
            );
            None
        }
    }
}

fn start_controlled(tls: Tls) -> Result<Server, Failure> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => Err(Failure::Skip(format!(
            "{URL_VAR} is set, and this test needs a PostgreSQL server the harness starts itself"
        ))),
        _ => start_local(tls),
    }
}

/// A fresh schema name for the test `test`: a valid unquoted identifier (lower case, at most 63
/// bytes), unique within the run and, with a random part, across runs on a shared server.
pub fn schema(test: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let suffix = format!(
        "{:x}{:08x}",
        COUNTER.fetch_add(1, Ordering::Relaxed),
        random() as u32
    );
    let name: String = test
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '_',
        })
        .take(63 - "t__".len() - suffix.len())
        .collect();
    format!("t_{name}_{suffix}")
}

/// Whether process `pid` is alive. A zombie is not: it has closed its sockets and files, and on
/// a machine whose init does not reap orphans it stays a zombie for good.
pub fn is_running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may contain anything.
        Ok(stat) => !matches!(stat.rsplit_once(") "), Some((_, rest)) if rest.starts_with('Z')),
        Err(_) => false,
    }
}

impl Server {
    /// URL form over TCP, as [`USER`] with its password:
    /// `postgres://leasehold:PASSWORD@127.0.0.1:PORT/leasehold`, or `LEASEHOLD_POSTGRES_URL`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// [`url`](Self::url) with query parameters added, such as `"sslmode=require"` or
    /// `"application_name=a&connect_timeout=5"`.
    pub fn url_with(&self, params: &str) -> String {
        let separator = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{separator}{params}", self.url)
    }

    /// Key-value (libpq) form over the unix socket, as [`USER`] without a password (the socket
    /// trusts): `host=/tmp/... port=PORT user=leasehold dbname=leasehold`. `None` for a server
    /// named by `LEASEHOLD_POSTGRES_URL`.
    pub fn conninfo(&self) -> Option<&str> {
        self.conninfo.as_deref()
    }

    /// The role with a password, for leak tests. `None` for a server named by
    /// `LEASEHOLD_POSTGRES_URL`.
    pub fn secret(&self) -> Option<&Secret> {
        self.secret.as_ref()
    }

    /// The CA certificate that signed a TLS server's certificate; `None` without TLS.
    pub fn ca_file(&self) -> Option<&Path> {
        self.local.as_ref()?.ca_file.as_deref()
    }

    /// [`url`](Self::url) for a TLS server with `sslmode` (`"require"`, `"verify-ca"`,
    /// `"verify-full"`), and the CA file when the mode verifies the certificate.
    ///
    /// # Panics
    ///
    /// When the server has no TLS.
    pub fn tls_url(&self, sslmode: &str) -> String {
        let ca = self.ca_file().expect("a server started with Tls::On");
        match sslmode {
            "verify-ca" | "verify-full" => {
                self.url_with(&format!("sslmode={sslmode}&sslrootcert={}", ca.display()))
            }
            _ => self.url_with(&format!("sslmode={sslmode}")),
        }
    }

    /// The temporary directory of a server the harness started (its socket directory), removed
    /// when the server goes away.
    pub fn dir(&self) -> Option<&Path> {
        Some(&self.local.as_ref()?.dir)
    }

    /// The TCP port of a server the harness started.
    pub fn port(&self) -> Option<u16> {
        Some(self.local.as_ref()?.port)
    }

    /// The postmaster's pid (from `postmaster.pid`), for a server the harness started and that
    /// is running.
    pub fn postmaster_pid(&self) -> Option<u32> {
        let local = self.local.as_ref()?;
        let pid_file = std::fs::read_to_string(local.data_dir().join("postmaster.pid")).ok()?;
        pid_file.lines().next()?.trim().parse().ok()
    }

    /// The server's log so far (empty for a server named by `LEASEHOLD_POSTGRES_URL`).
    pub fn log(&self) -> String {
        match &self.local {
            Some(local) => local.log(),
            None => String::new(),
        }
    }

    /// Runs `sql` as the superuser over the socket (or as the role of `LEASEHOLD_POSTGRES_URL`)
    /// and returns its output: one line per row, columns separated by `|`.
    ///
    /// # Panics
    ///
    /// When `psql` fails; the message has its error and the server's log.
    pub fn sql(&self, sql: &str) -> String {
        let admin = match &self.local {
            Some(local) => local.admin_conninfo(),
            None => self.url.clone(),
        };
        self.psql(&admin, sql)
            .unwrap_or_else(|error| panic!("{error}\n{}", self.log_tail()))
    }

    /// Runs `sql` with `psql` over `conninfo` (either form; a password may be in it) and returns
    /// its output as [`sql`](Self::sql) does, or `psql`'s error. Never prompts for a password
    /// and reads no password file.
    pub fn psql(&self, conninfo: &str, sql: &str) -> Result<String, String> {
        let mut command = self.psql_command(conninfo);
        command.args(["-f", "-"]);
        let output = run(&mut command, Some(sql), COMMAND_LIMIT)?;
        if output.status.success() {
            Ok(output.stdout.trim_end().to_owned())
        } else {
            Err(format!(
                "psql failed ({}): {}",
                output.status,
                output.stderr.trim_end()
            ))
        }
    }

    /// `psql` connecting over `conninfo`, with tuples-only, unaligned output, stopping at the
    /// first error; add `-c SQL` or `-f FILE`. For a session a test keeps open in the
    /// background.
    pub fn psql_command(&self, conninfo: &str) -> Command {
        let psql = match &self.local {
            Some(local) => local.bindir.join("psql"),
            None => PathBuf::from("psql"),
        };
        let mut command = Command::new(psql);
        command
            .args(["-X", "-q", "-A", "-t", "-w", "-v", "ON_ERROR_STOP=1"])
            .arg("-d")
            .arg(conninfo);
        clean_env(&mut command);
        command
            .env("PGPASSFILE", "/dev/null")
            .env("PGCONNECT_TIMEOUT", "10");
        command
    }

    /// Restarts a server the harness started (`pg_ctl restart -m fast` or `-m immediate`) and
    /// returns once it accepts connections again. Everyone connected is disconnected.
    ///
    /// # Panics
    ///
    /// For a server named by `LEASEHOLD_POSTGRES_URL`, or when the restart fails (with the log).
    pub fn restart(&self, mode: Shutdown) {
        let local = self
            .local
            .as_ref()
            .expect("restart needs a server the harness started");
        let mut command = local.command("pg_ctl");
        command
            .arg("restart")
            .arg("-D")
            .arg(local.data_dir())
            .args(["-m", mode.as_arg(), "-w", "-t", &PG_CTL_SECONDS.to_string()])
            .arg("-l")
            .arg(local.log_file());
        if let Err(error) = succeed(&mut command, "pg_ctl restart") {
            panic!("{error}\n{}", self.log_tail());
        }
    }

    /// Terminates the other client connections for which the SQL condition `filter` holds
    /// (over `pg_stat_activity`; `"true"` for all of them, or say
    /// `"application_name LIKE 'torture-%'"`) and returns how many were terminated.
    pub fn terminate_backends(&self, filter: &str) -> usize {
        let count = self.sql(&format!(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE pid <> pg_backend_pid() AND backend_type = 'client backend' AND ({filter})"
        ));
        count
            .parse()
            .unwrap_or_else(|_| panic!("a count from pg_terminate_backend, not {count:?}"))
    }

    fn log_tail(&self) -> String {
        self.local.as_ref().map(Local::log_tail).unwrap_or_default()
    }
}

impl Local {
    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_file(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_file()).unwrap_or_default()
    }

    fn admin_conninfo(&self) -> String {
        format!(
            "host={} port={} user={SUPERUSER} dbname={DATABASE}",
            self.dir.display(),
            self.port
        )
    }

    /// A server program, run as the server's user, in the server's directory (a server program
    /// run as `postgres` cannot always enter the caller's).
    fn command(&self, program: &str) -> Command {
        program_command(&self.bindir.join(program), self.run_as, &self.dir)
    }

    /// Writes a file of the server's and gives it to the server's user.
    fn write(&self, path: &Path, contents: &str) -> Result<(), Failure> {
        std::fs::write(path, contents)
            .map_err(|e| Failure::Broken(format!("writing {}: {e}", path.display())))?;
        self.give(path)
    }

    fn give(&self, path: &Path) -> Result<(), Failure> {
        match self.run_as {
            Some((uid, gid)) => chown(path, Some(uid), Some(gid))
                .map_err(|e| Failure::Broken(format!("chown {}: {e}", path.display()))),
            None => Ok(()),
        }
    }

    /// The end of the log, which is where a failure's reason is.
    fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        format!(
            "server log ({}), last lines:\n{}",
            self.log_file().display(),
            lines[lines.len().saturating_sub(60)..].join("\n")
        )
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        let watchdog = &mut self.watchdog;
        // Closing the pipe is what tells the watchdog to stop the server and remove its files.
        drop(watchdog.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(PG_CTL_SECONDS as u64 + 10);
        loop {
            match watchdog.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => {
                    eprintln!(
                        "the watchdog of the server in {} did not finish",
                        self.dir.display()
                    );
                    return;
                }
            }
        }
    }
}

/// The watchdog's script; `$1` is `pg_ctl`, `$2` the data directory, `$3` the directory to
/// remove.
const WATCHDOG: &str = r#"
trap '' HUP INT
# Standard input is a pipe whose only writer is the test process: end-of-file means that process
# has ended or dropped its server.
cat >/dev/null
"$1" stop -D "$2" -m immediate -w -t 10 >/dev/null 2>&1
# A postmaster pg_ctl could not stop (its pid file still names a live process) is killed.
if pid=$(head -n 1 "$2/postmaster.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid"
fi
rm -rf "$3"
"#;

fn start_local(tls: Tls) -> Result<Server, Failure> {
    let bindir = bindir().map_err(Failure::Skip)?;
    let run_as = run_as().map_err(Failure::Skip)?;
    if tls == Tls::On {
        Command::new("openssl")
            .arg("version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .ok()
            .filter(ExitStatus::success)
            .ok_or_else(|| {
                Failure::Skip(
                    "the `openssl` program, which makes the certificates, is missing".into(),
                )
            })?;
    }

    let dir = tempfile::Builder::new()
        .prefix("leasehold-pg-")
        .tempdir()
        .map_err(|e| Failure::Broken(format!("a temporary directory: {e}")))?
        .keep();
    if let Some((uid, gid)) = run_as {
        chown(&dir, Some(uid), Some(gid))
            .map_err(|e| Failure::Broken(format!("chown {}: {e}", dir.display())))?;
    }
    // The watchdog comes first, so that whatever happens from here on, the directory goes away.
    let watchdog = program_command(Path::new("/bin/sh"), run_as, &dir)
        .arg("-c")
        .arg(WATCHDOG)
        .arg("leasehold-pg-watchdog")
        .arg(bindir.join("pg_ctl"))
        .arg(dir.join("data"))
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| Failure::Broken(format!("starting the watchdog: {e}")))?;
    let mut local = Local {
        bindir,
        run_as,
        dir,
        port: 0,
        ca_file: None,
        watchdog,
    };

    let mut initdb = local.command("initdb");
    initdb
        .arg("-D")
        .arg(local.data_dir())
        .args(["-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--locale=C"])
        // No fsync: the data is thrown away.
        .args(["--no-sync", "--no-instructions"]);
    succeed(&mut initdb, "initdb").map_err(Failure::Broken)?;

    let mut settings = format!(
        "listen_addresses = '127.0.0.1'\n\
         unix_socket_directories = '{}'\n\
         unix_socket_permissions = 0700\n\
         fsync = off\n\
         full_page_writes = off\n\
         max_connections = 200\n\
         shared_buffers = 32MB\n\
         log_line_prefix = '%m [%p] %q%u@%d '\n",
        local.dir.display()
    );
    let mut hba = String::from(
        "# The socket directory is private (0700): trust admits only its owner and root.\n\
         local all all trust\n",
    );
    if tls == Tls::On {
        let ca_file = make_certificates(&local)?;
        let tls_dir = local.dir.join("tls");
        settings += &format!(
            "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\n",
            tls_dir.join("server.crt").display(),
            tls_dir.join("server.key").display()
        );
        hba += "hostssl all all 127.0.0.1/32 scram-sha-256\n\
                hostnossl all all 0.0.0.0/0 reject\n";
        local.ca_file = Some(ca_file);
    } else {
        hba += "host all all 127.0.0.1/32 scram-sha-256\n";
    }
    local.write(&local.data_dir().join("pg_hba.conf"), &hba)?;
    let config = local.data_dir().join("postgresql.conf");
    let mut original = std::fs::read_to_string(&config)
        .map_err(|e| Failure::Broken(format!("reading {}: {e}", config.display())))?;
    original += "include 'harness.conf'\n";
    local.write(&config, &original)?;

    for attempt in 1..=PORT_ATTEMPTS {
        local.port = free_port().map_err(Failure::Broken)?;
        let harness_conf = format!("{settings}port = {}\n", local.port);
        local.write(&local.data_dir().join("harness.conf"), &harness_conf)?;
        let mut pg_ctl = local.command("pg_ctl");
        pg_ctl
            .arg("start")
            .arg("-D")
            .arg(local.data_dir())
            .args(["-w", "-t", &PG_CTL_SECONDS.to_string()])
            .arg("-l")
            .arg(local.log_file());
        match succeed(&mut pg_ctl, "pg_ctl start") {
            Ok(_) => break,
            // Another process took the port between our probe and the server's bind.
            Err(_) if attempt < PORT_ATTEMPTS && local.log().contains("could not bind") => {}
            Err(error) => return Err(Failure::Broken(format!("{error}\n{}", local.log_tail()))),
        }
    }

    let password = format!("{:016x}", random());
    let secret_password = format!("leak-canary-{:016x}", random());
    let tcp = |user: &str, password: &str| {
        format!(
            "postgres://{user}:{password}@127.0.0.1:{}/{DATABASE}",
            local.port
        )
    };
    let socket = |user: &str, database: &str| {
        format!(
            "host={} port={} user={user} dbname={database}",
            local.dir.display(),
            local.port
        )
    };
    let (url, secret_url) = (tcp(USER, &password), tcp(SECRET_USER, &secret_password));
    let (conninfo, bootstrap) = (socket(USER, DATABASE), socket(SUPERUSER, "postgres"));
    let server = Server {
        url,
        conninfo: Some(conninfo),
        secret: Some(Secret {
            user: SECRET_USER.to_owned(),
            password: secret_password.clone(),
            url: secret_url,
        }),
        local: Some(local),
    };
    // Over the socket, as the superuser, to the one database initdb made.
    let setup = format!(
        "CREATE ROLE {USER} LOGIN PASSWORD '{password}';\n\
         CREATE DATABASE {DATABASE} OWNER {USER};\n\
         CREATE ROLE {SECRET_USER} LOGIN PASSWORD '{secret_password}';\n\
         GRANT CREATE ON DATABASE {DATABASE} TO {SECRET_USER};\n"
    );
    server.psql(&bootstrap, &setup).map_err(|error| {
        Failure::Broken(format!("setting up roles: {error}\n{}", server.log_tail()))
    })?;
    Ok(server)
}

/// A CA and a server certificate for `localhost` and 127.0.0.1 signed by it, in `tls/`;
/// returns the CA's certificate file.
fn make_certificates(local: &Local) -> Result<PathBuf, Failure> {
    let tls = local.dir.join("tls");
    std::fs::create_dir(&tls)
        .map_err(|e| Failure::Broken(format!("mkdir {}: {e}", tls.display())))?;
    local.give(&tls)?;
    // webpki (rustls) wants a v3 CA with these constraints, and the server's names in its
    // subjectAltName, not its common name.
    local.write(
        &tls.join("server.ext"),
        "basicConstraints = critical, CA:FALSE\n\
         keyUsage = critical, digitalSignature, keyEncipherment\n\
         extendedKeyUsage = serverAuth\n\
         subjectAltName = DNS:localhost, IP:127.0.0.1\n",
    )?;
    let steps: [&[&str]; 3] = [
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=leasehold test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    ];
    for args in steps {
        // Run as the server's user, so that the server may read its key.
        let mut openssl = program_command(Path::new("openssl"), local.run_as, &tls);
        openssl.args(args);
        succeed(&mut openssl, "openssl").map_err(Failure::Broken)?;
    }
    // The server refuses a key that others may read.
    std::fs::set_permissions(
        tls.join("server.key"),
        std::fs::Permissions::from_mode(0o600),
    )
    .map_err(|e| Failure::Broken(format!("chmod server.key: {e}")))?;
    Ok(tls.join("ca.crt"))
}

/// The directory of `initdb`, `pg_ctl`, `postgres` and `psql`, or why there is none: the one
/// `pg_config --bindir` names, else the newest of Debian's. (`pg_config` may come from
/// `libpq-dev` alone, naming a directory without a server; `.ci/run` follows the same rule.)
fn bindir() -> Result<PathBuf, String> {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()));
    let mut looked_in = Vec::new();
    for bindir in from_pg_config.into_iter().chain(newest_debian_bindir()) {
        let missing: Vec<_> = ["initdb", "pg_ctl", "postgres", "psql"]
            .into_iter()
            .filter(|program| !bindir.join(program).is_file())
            .collect();
        if missing.is_empty() {
            return Ok(bindir);
        }
        looked_in.push(format!(
            "{} has no {}",
            bindir.display(),
            missing.join(", ")
        ));
    }
    if looked_in.is_empty() {
        looked_in
            .push("`pg_config --bindir` failed and there is no /usr/lib/postgresql/*/bin".into());
    }
    Err(format!(
        "no PostgreSQL server programs: {} (on Debian: apt-get install postgresql)",
        looked_in.join("; ")
    ))
}

fn newest_debian_bindir() -> Option<PathBuf> {
    std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version: u32 = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .max()
        .map(|(_, bin)| bin)
}

/// The ids to run the server programs as: `postgres`'s when root, none (the current user's)
/// otherwise.
fn run_as() -> Result<Option<(u32, u32)>, String> {
    let id = |args: &[&str]| -> Option<u32> {
        let output = Command::new("id")
            .args(args)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        output.status.success().then_some(())?;
        String::from_utf8_lossy(&output.stdout).trim().parse().ok()
    };
    if id(&["-u"]).ok_or("`id -u` failed")? != 0 {
        return Ok(None);
    }
    match (id(&["-u", "postgres"]), id(&["-g", "postgres"])) {
        (Some(uid), Some(gid)) => Ok(Some((uid, gid))),
        _ => Err("running as root, and there is no `postgres` user to run the server as".into()),
    }
}

fn program_command(program: &Path, run_as: Option<(u32, u32)>, dir: &Path) -> Command {
    let mut command = Command::new(program);
    command.current_dir(dir);
    if let Some((uid, gid)) = run_as {
        // The standard library also drops root's supplementary groups when it sets the uid.
        command.uid(uid).gid(gid);
    }
    clean_env(&mut command);
    command
}

/// Removes the caller's `PG*` variables, which would otherwise fill in what a connection string
/// leaves out (or point `pg_ctl` at another data directory).
fn clean_env(command: &mut Command) {
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("PG") {
            command.env_remove(name);
        }
    }
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

/// 64 random bits, from the standard library's per-process hash keys (no extra dependency).
fn random() -> u64 {
    RandomState::new().hash_one(Instant::now())
}

struct Output {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs `command` to completion, failing with its output unless it exits successfully.
fn succeed(command: &mut Command, what: &str) -> Result<Output, String> {
    let output = run(command, None, COMMAND_LIMIT)?;
    if output.status.success() {
        Ok(output)
    } else {
        Err(format!(
            "{what} failed ({}):\n{}{}",
            output.status, output.stdout, output.stderr
        ))
    }
}

/// Runs `command` with `input` on its standard input, and kills it if it has not finished
/// within `limit`.
fn run(command: &mut Command, input: Option<&str>, limit: Duration) -> Result<Output, String> {
    let mut child = command
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting {command:?}: {e}"))?;
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = read(Box::new(child.stdout.take().expect("piped")));
    let stderr = read(Box::new(child.stderr.take().expect("piped")));
    if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
        // A program that fails early may not read it all; its error says why.
        let _ = stdin.write_all(input.as_bytes());
    }
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{command:?} did not finish within {limit:?}"));
            }
            Err(e) => return Err(format!("waiting for {command:?}: {e}")),
        }
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}
