//! The `leasehold` command (feature `cli`): run a program under a lock or while leading an
//! election, and see, mend and check what a store holds, over SQLite (a file) or PostgreSQL (a
//! URL), with the same rows, rules and fencing tokens as the library's managers. `main.rs` calls
//! `main`.
//!
//! Its parts: `args.rs` (the arguments, and every `--help`), `run.rs` (a program under a lock,
//! with its signals), `elect.rs` (a program while leading, on `run`'s machinery, and the leader
//! changes), `show.rs` (`inspect` and `watch`), `release.rs` (an operator's removal of a gone
//! owner's rows), `doctor.rs` (what is wrong with a store, and what to do about it), and here
//! the stores and the exit codes.
//!
//! Exit codes, beside a `run`'s or `elect`'s COMMAND's own (and 128 + N when it died of signal
//! N):
//!
//! | code | meaning |
//! |---|---|
//! | 0 | done; `doctor`: nothing is wrong |
//! | 1 | `run`: the key is held (`-n`, or `-w` ran out; `-E` changes it); `release`: nothing removed; `doctor`: a problem found |
//! | 2 | the arguments are wrong |
//! | 3 | the store could not be opened or failed (missing, a schema of another version, a storage error) |
//! | 4 | `run`, `elect`: the lease was lost while COMMAND ran (it was sent SIGTERM, then SIGKILL after `--grace`); `elect` tells COMMAND a heartbeat before the lease would run out |
//! | 5 | `run`, `elect`: an operator removed the waiting request (`release`); COMMAND never ran |
//! | 126, 127 | `run`, `elect`: COMMAND could not be run, or was not found |
//! | 129, 130, 143 | `run`, `elect`: SIGHUP, SIGINT or SIGTERM came while waiting (the queue was left) |
//!
//! `watch` and `elect --listen` run until a signal ends them, by its default action.

mod args;
mod doctor;
mod elect;
mod lifeline;
mod release;
mod run;
mod show;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use leasehold::{LockError, LockManager, LockManagerBuilder};

use self::args::{Args, Command};

/// The arguments are wrong (as clap says of those it checks).
pub(crate) const USAGE: u8 = 2;

/// The store could not be opened or failed.
const STORE_FAILED: u8 = 3;

/// Runs the command with this process's arguments; returns its exit code.
pub(crate) fn main() -> ExitCode {
    let args = Args::parse();
    let code = match args.command {
        Command::Run(run) => run::run(run),
        Command::Elect(elect) => elect::elect(elect),
        Command::Inspect(inspect) => show::inspect(inspect),
        Command::Watch(watch) => show::watch(watch),
        Command::Release(release) => release::release(release),
        Command::Doctor(doctor) => doctor::doctor(doctor),
    };
    ExitCode::from(code)
}

/// Where the rows are: a SQLite file, or a PostgreSQL database (and schema).
#[derive(Clone, Debug)]
pub(crate) enum Store {
    File(PathBuf),
    #[cfg(feature = "postgres")]
    Postgres {
        url: String,
        schema: Option<String>,
    },
}

impl Store {
    /// `STORE` as given: a `postgres://` or `postgresql://` URL, or a libpq string (`key=value`
    /// pairs), is a PostgreSQL database; anything else is a file's path.
    pub(crate) fn parse(store: &str, schema: Option<String>) -> Result<Store, String> {
        let looks_postgres = store.starts_with("postgres://")
            || store.starts_with("postgresql://")
            || (store.contains('=') && !std::path::Path::new(store).exists());
        if !looks_postgres {
            if schema.is_some() {
                return Err("--schema names a PostgreSQL schema; a SQLite store has none".into());
            }
            return Ok(Store::File(PathBuf::from(store)));
        }
        #[cfg(feature = "postgres")]
        return Ok(Store::Postgres {
            url: store.to_owned(),
            schema,
        });
        #[cfg(not(feature = "postgres"))]
        Err(
            "this build has no PostgreSQL backend: install it with `--features cli,postgres`"
                .into(),
        )
    }

    /// A manager of this store, opened by `builder`.
    pub(crate) async fn open(&self, builder: LockManagerBuilder) -> Result<LockManager, LockError> {
        match self {
            Store::File(path) => builder.open(path),
            #[cfg(feature = "postgres")]
            Store::Postgres { url, schema } => Self::schema(builder, schema).connect(url).await,
        }
    }

    /// A manager of the store as it is, opened by `builder`, for a view or a repair: never
    /// creates or migrates it.
    pub(crate) async fn open_existing(
        &self,
        builder: LockManagerBuilder,
    ) -> Result<LockManager, LockError> {
        match self {
            Store::File(path) => builder.open_existing(path),
            #[cfg(feature = "postgres")]
            Store::Postgres { url, schema } => {
                Self::schema(builder, schema).connect_existing(url).await
            }
        }
    }

    #[cfg(feature = "postgres")]
    fn schema(builder: LockManagerBuilder, schema: &Option<String>) -> LockManagerBuilder {
        match schema {
            Some(schema) => builder.schema(schema),
            None => builder,
        }
    }
}

/// Runs `work` on a manager of the store `args` name, as it is (never created or migrated);
/// the exit code, `work`'s or that of why the store could not be opened.
pub(crate) fn on_existing<F, Fut>(args: &args::StoreArgs, work: F) -> u8
where
    F: FnOnce(LockManager) -> Fut,
    Fut: std::future::Future<Output = u8>,
{
    let store = match args.parse() {
        Ok(store) => store,
        Err(code) => return code,
    };
    smol::block_on(async {
        match store.open_existing(LockManager::builder()).await {
            Ok(locks) => work(locks).await,
            Err(error) => store_failed(&error),
        }
    })
}

impl args::StoreArgs {
    /// The store these arguments name; if they name none, says why and gives the exit code.
    pub(crate) fn parse(&self) -> Result<Store, u8> {
        Store::parse(&self.store, self.schema.clone()).map_err(|error| {
            eprintln!("leasehold: {error}");
            USAGE
        })
    }
}

/// `error` on standard error as the command's one line about it, and its exit code: 2 for what
/// was asked (a key too long, a URL that does not parse), else that of a store that failed.
pub(crate) fn store_failed(error: &LockError) -> u8 {
    eprintln!("leasehold: {error}");
    match error {
        LockError::InvalidRequest(_) | LockError::InvalidConfig(_) => USAGE,
        _ => STORE_FAILED,
    }
}

/// `500ms`, `30s`, `2m`, `1h`, or a sum of them (`1m30s`); a bare number is seconds.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration: write it as 500ms, 30s, 2m or 1h");
    let text = text.trim();
    if text.is_empty() {
        return Err(bad());
    }
    if let Ok(seconds) = text.parse::<u64>() {
        return Ok(Duration::from_secs(seconds));
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let amount: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let one = match &rest[..unit] {
            "ms" => Duration::from_millis(1),
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            _ => return Err(bad()),
        };
        rest = &rest[unit..];
        let amount = u32::try_from(amount).map_err(|_| bad())?;
        total = total.checked_add(one * amount).ok_or_else(bad)?;
    }
    Ok(total)
}

/// `text` (a key, an operation, an owner: written by any process that may take a lock) as it can
/// be shown to a person without steering the terminal: the characters `str::escape_debug`
/// escapes (controls such as ESC, newline, DEL and the C1 set; Unicode's format characters, such
/// as the bidirectional overrides and the zero-width ones; separators other than the space; a
/// combining mark that begins it, which would join what comes before) are written as Rust
/// writes them (`\n`, `\u{1b}`), and the backslash as `\\`, so that the escaped form reads
/// one way only. Quotes are shown as they are. (Messages that quote a name use `{:?}`, which
/// escapes the same, and every combining mark too.)
pub(crate) fn printable(text: &str) -> String {
    let escaped = text.escape_debug().to_string();
    let mut shown = String::with_capacity(escaped.len());
    let mut chars = escaped.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            shown.push(c);
            continue;
        }
        // An escape: of a quote (shown as it is here), or one kept as it is.
        if let Some(escaped) = chars.next() {
            if !matches!(escaped, '"' | '\'') {
                shown.push('\\');
            }
            shown.push(escaped);
        }
    }
    shown
}

/// `duration` as a person reads it: `850ms`, `12.3s`, `4m05s`, `2h10m`.
pub(crate) fn show_duration(duration: Duration) -> String {
    let ms = duration.as_millis();
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 => format!("{}.{}s", ms / 1000, (ms % 1000) / 100),
        60_000..=3_599_999 => format!("{}m{:02}s", ms / 60_000, (ms % 60_000) / 1000),
        _ => format!("{}h{:02}m", ms / 3_600_000, (ms % 3_600_000) / 60_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_read_in_the_units_people_write() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn a_duration_without_a_known_unit_is_refused_with_the_forms_allowed() {
        for bad in ["", "s", "5 s", "5x", "-5s", "1.5s", "ms5", "99999999999h"] {
            let error = parse_duration(bad).unwrap_err();
            assert!(error.contains("500ms, 30s, 2m"), "{bad:?}: {error}");
        }
    }

    #[test]
    fn durations_are_shown_to_the_precision_that_matters() {
        assert_eq!(show_duration(Duration::from_millis(850)), "850ms");
        assert_eq!(show_duration(Duration::from_millis(12_345)), "12.3s");
        assert_eq!(show_duration(Duration::from_secs(245)), "4m05s");
        assert_eq!(show_duration(Duration::from_secs(7_800)), "2h10m");
    }

    #[test]
    fn what_could_steer_a_terminal_is_shown_escaped() {
        for (text, shown) in [
            ("evil\u{1b}[2J\u{1b}[31mkey", "evil\\u{1b}[2J\\u{1b}[31mkey"),
            ("two\nlines\r", "two\\nlines\\r"),
            ("tab\there", "tab\\there"),
            ("del\u{7f}", "del\\u{7f}"),
            ("c1 csi \u{9b}31m", "c1 csi \\u{9b}31m"),
            ("bidi \u{202e}txt.exe", "bidi \\u{202e}txt.exe"),
            ("zero\u{200b}width\u{feff}", "zero\\u{200b}width\\u{feff}"),
            ("\u{301}leading mark", "\\u{301}leading mark"),
            ("back\\slash", "back\\\\slash"),
        ] {
            assert_eq!(printable(text), shown, "{text:?}");
        }
    }

    #[test]
    fn ordinary_text_is_shown_as_it_is() {
        for text in [
            "repo/photos",
            "café",
            "cafe\u{301}",
            "हिन्दी",
            "日本語のキー",
            "a \"quoted\" 'word'",
            "",
        ] {
            assert_eq!(printable(text), text);
        }
    }

    #[test]
    fn a_store_is_a_file_unless_it_names_a_postgres_database() {
        assert!(matches!(Store::parse("locks.db", None), Ok(Store::File(_))));
        assert!(Store::parse("locks.db", Some("s".into())).is_err());
        let url = Store::parse("postgres://u@h/db", None);
        let libpq = Store::parse("host=/tmp dbname=x", None);
        #[cfg(feature = "postgres")]
        {
            assert!(matches!(url, Ok(Store::Postgres { .. })));
            assert!(matches!(libpq, Ok(Store::Postgres { .. })));
        }
        #[cfg(not(feature = "postgres"))]
        {
            assert!(url.unwrap_err().contains("--features cli,postgres"));
            assert!(libpq.is_err());
        }
    }
}
