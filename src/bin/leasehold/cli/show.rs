//! `leasehold inspect` and `leasehold watch`: the holders and waiters of each key, as a table or
//! as JSON lines.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{FutureExt, StreamExt};

use super::args::{Inspect, Watch};
use super::{printable, show_duration, store_failed, Store};
use leasehold::{EntryState, LockEntry, LockManager, Mode};

pub(crate) fn inspect(args: Inspect) -> u8 {
    super::on_existing(&args.store, |locks| async move {
        let entries = match entries(&locks, args.key_prefix.as_deref()).await {
            Ok(entries) => entries,
            Err(code) => return code,
        };
        let now = unix_now();
        if args.json {
            for entry in &entries {
                println!("{}", json_line(entry, now));
            }
        } else {
            print!("{}", table(&entries, now));
        }
        0
    })
}

pub(crate) fn watch(args: Watch) -> u8 {
    let store = match args.store.parse() {
        Ok(store) => store,
        Err(code) => return code,
    };
    if args.every.is_zero() {
        eprintln!("leasehold: --every must be more than 0");
        return super::USAGE;
    }
    smol::block_on(async {
        let builder = LockManager::builder().poll(Duration::from_millis(250));
        let locks = match store.open_existing(builder).await {
            Ok(locks) => locks,
            Err(error) => return store_failed(&error),
        };
        let mut changes = locks.changes(args.key_prefix.as_deref().unwrap_or(""));
        let mut entries = match changes.next().await {
            Some(Ok(entries)) => entries,
            Some(Err(error)) => return store_failed(&error),
            None => return 0,
        };
        let mut shown = None;
        loop {
            let view = table(&entries, unix_now());
            if shown.as_ref() != Some(&view) {
                // On a terminal, clear the screen and home the cursor, then draw; elsewhere,
                // one table after another.
                use std::io::IsTerminal as _;
                if std::io::stdout().is_terminal() {
                    print!("\x1b[2J\x1b[H");
                }
                print!("{}", heading(&store, args.key_prefix.as_deref()));
                print!("{view}");
                use std::io::Write as _;
                let _ = std::io::stdout().flush();
                shown = Some(view);
            }
            // The next change, or the time to redraw the times shown.
            futures::select! {
                changed = changes.next().fuse() => match changed {
                    Some(Ok(now)) => entries = now,
                    Some(Err(error)) => return store_failed(&error),
                    None => return 0,
                },
                _ = FutureExt::fuse(smol::Timer::after(args.every)) => {}
            }
        }
    })
}

/// The live rows on the keys that start with `prefix`.
pub(crate) async fn entries(
    locks: &LockManager,
    prefix: Option<&str>,
) -> Result<Vec<LockEntry>, u8> {
    match locks.inspect(None).await {
        Ok(mut entries) => {
            entries.retain(|entry| prefix.is_none_or(|prefix| entry.key.starts_with(prefix)));
            Ok(entries)
        }
        Err(error) => Err(store_failed(&error)),
    }
}

fn heading(store: &Store, prefix: Option<&str>) -> String {
    let store = match store {
        Store::File(path) => printable(&path.to_string_lossy()),
        #[cfg(feature = "postgres")]
        Store::Postgres { schema, .. } => {
            format!(
                "PostgreSQL, schema {}",
                schema.as_deref().unwrap_or("leasehold")
            )
        }
    };
    match prefix {
        Some(prefix) => format!("leasehold watch: {store}, keys {prefix:?}*\n\n"),
        None => format!("leasehold watch: {store}\n\n"),
    }
}

/// The time now, as a [`LockEntry`]'s times are given (since the Unix epoch).
pub(crate) fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// The mode's name in JSON, with its count and limit of permits (`null` for shared and
/// exclusive).
fn mode_json(mode: Mode) -> (&'static str, String, String) {
    let null = || "null".to_owned();
    match mode {
        Mode::Shared => ("shared", null(), null()),
        Mode::Exclusive => ("exclusive", null(), null()),
        Mode::Permits { count, limit } => ("permits", count.to_string(), limit.to_string()),
    }
}

/// The rows as a table, one line per row, with a heading; "no locks" for none. Keys,
/// operations and owners are shown [`printable`]: one of them cannot break a row into lines,
/// move the cursor or clear the screen.
pub(crate) fn table(entries: &[LockEntry], now: Duration) -> String {
    if entries.is_empty() {
        return "no locks held or waited for\n".to_owned();
    }
    let header = [
        "KEY",
        "STATE",
        "MODE",
        "OPERATION",
        "OWNER",
        "TICKET",
        "FOR",
        "LEASE LEFT",
    ];
    let rows: Vec<[String; 8]> = entries
        .iter()
        .map(|entry| {
            let state = match entry.state {
                EntryState::Held => "held".to_owned(),
                EntryState::Waiting { position } => format!("waiting #{}", position + 1),
            };
            [
                printable(&entry.key),
                state,
                entry.mode.to_string(),
                printable(&entry.operation),
                printable(&entry.owner),
                entry.ticket.to_string(),
                show_duration(now.saturating_sub(entry.since)),
                show_duration(entry.expires_at.saturating_sub(now)),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (cell, width) in cells.zip(widths) {
            let _ = write!(text, "{cell:<width$}  ");
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in &rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// One row as a JSON object on one line.
pub(crate) fn json_line(entry: &LockEntry, now: Duration) -> String {
    let (state, position) = match entry.state {
        EntryState::Held => ("held", "null".to_owned()),
        EntryState::Waiting { position } => ("waiting", position.to_string()),
    };
    let (mode, count, limit) = mode_json(entry.mode);
    format!(
        "{{\"key\":{},\"mode\":\"{mode}\",\"count\":{count},\"limit\":{limit},\
         \"state\":\"{state}\",\"position\":{position},\
         \"owner\":{},\"operation\":{},\"ticket\":{},\"since_ms\":{},\"expires_at_ms\":{},\
         \"lease_left_ms\":{}}}",
        json_string(&entry.key),
        json_string(&entry.owner),
        json_string(&entry.operation),
        entry.ticket,
        entry.since.as_millis(),
        entry.expires_at.as_millis(),
        entry.expires_at.saturating_sub(now).as_millis(),
    )
}

/// `text` as a JSON string, quoted and escaped: exact, and with every control character
/// (C0, DEL, C1) escaped, so that it cannot steer a terminal it is printed on either.
pub(crate) fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, state: EntryState) -> LockEntry {
        LockEntry {
            key: key.to_owned(),
            mode: Mode::Exclusive,
            operation: "back \"up\"".to_owned(),
            owner: "host:12:ab-0".to_owned(),
            ticket: 7,
            state,
            since: Duration::from_secs(100),
            expires_at: Duration::from_secs(130),
        }
    }

    #[test]
    fn a_row_is_one_json_object_with_its_strings_escaped() {
        let now = Duration::from_secs(110);
        assert_eq!(
            json_line(
                &entry("repo/\u{1}x", EntryState::Waiting { position: 2 }),
                now
            ),
            "{\"key\":\"repo/\\u0001x\",\"mode\":\"exclusive\",\"count\":null,\"limit\":null,\
             \"state\":\"waiting\",\"position\":2,\"owner\":\"host:12:ab-0\",\"operation\":\"back \\\"up\\\"\",\
             \"ticket\":7,\"since_ms\":100000,\"expires_at_ms\":130000,\"lease_left_ms\":20000}"
        );
        assert!(json_line(&entry("k", EntryState::Held), now).contains("\"position\":null"));
        let permits = LockEntry {
            mode: Mode::Permits { count: 2, limit: 3 },
            ..entry("k", EntryState::Held)
        };
        assert!(json_line(&permits, now).contains("\"mode\":\"permits\",\"count\":2,\"limit\":3,"));
        assert_eq!(
            json_string("\u{1b}[2J\n\u{7f}\u{9b}é"),
            "\"\\u001b[2J\\n\\u007f\\u009bé\""
        );
    }

    #[test]
    fn the_table_shows_a_key_that_would_steer_the_terminal_escaped_and_lined_up() {
        let now = Duration::from_secs(112);
        let shown = table(
            &[
                entry("evil\u{1b}[2J\u{1b}[31mkey\nk  held", EntryState::Held),
                entry("k", EntryState::Waiting { position: 0 }),
            ],
            now,
        );
        assert!(!shown.contains('\u{1b}'), "{shown}");
        let lines: Vec<&str> = shown.lines().collect();
        assert_eq!(lines.len(), 3, "{shown}");
        let escaped = "evil\\u{1b}[2J\\u{1b}[31mkey\\nk  held";
        // The second column starts after the widest key as shown, on every line.
        let column = escaped.len() + 2;
        assert!(lines[1].starts_with(escaped), "{shown}");
        assert!(lines[0][column..].starts_with("STATE"), "{shown}");
        assert!(lines[1][column..].starts_with("held"), "{shown}");
        assert!(lines[2][column..].starts_with("waiting"), "{shown}");
    }

    #[test]
    fn the_table_lines_up_its_columns() {
        let now = Duration::from_secs(112);
        let shown = table(
            &[
                entry("repo/photos", EntryState::Held),
                entry("k", EntryState::Waiting { position: 0 }),
            ],
            now,
        );
        let lines: Vec<&str> = shown.lines().collect();
        assert_eq!(lines.len(), 3, "{shown}");
        assert!(lines[0].starts_with("KEY          STATE"), "{shown}");
        assert!(lines[1].starts_with("repo/photos  held"), "{shown}");
        assert!(lines[2].starts_with("k            waiting #1"), "{shown}");
        assert!(lines[1].ends_with("12.0s  18.0s"), "{shown}");
        assert_eq!(table(&[], now), "no locks held or waited for\n");
    }
}
