//! How rows' fields are written: a request's keys in one column, a mode and a ticket as
//! numbers, and a key's stable digest (what the change log and notifications name).

use crate::lock::{LockRequest, Mode};

/// (ticket, key) pairs in ticket order, grouped by ticket: what `Storage::requests_of` returns.
pub(crate) fn by_ticket(rows: Vec<(u64, String)>) -> Vec<(u64, Vec<String>)> {
    let mut requests: Vec<(u64, Vec<String>)> = Vec::new();
    for (ticket, key) in rows {
        match requests.last_mut() {
            Some((last, keys)) if *last == ticket => keys.push(key),
            _ => requests.push((ticket, vec![key])),
        }
    }
    requests
}

/// A stable digest of `bytes` (FNV-1a), the same in every process and version, unlike the
/// standard library's hasher: how a key is named in the change log and in notifications.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A key as the change log and notifications name it.
pub(crate) fn key_hash(key: &str) -> i64 {
    i64::from_ne_bytes(fnv1a(key.as_bytes()).to_ne_bytes())
}

/// The `keys` column of a request's rows: for a waiting request on several keys, every key,
/// which a decision on one of them needs in order to read the others; nothing for a held one,
/// whose other keys no decision reads (a `many` of 500 keys would otherwise store 500 × 500
/// names, and make every lookup near its rows read them). A promotion clears it.
pub(crate) fn stored_keys(requests: &[LockRequest], held: bool) -> Option<String> {
    encode_keys(requests).filter(|_| !held)
}

/// The keys of a request on several keys, as stored in its rows while it waits: each key
/// preceded by its length in bytes and `:` (keys may hold any character). `None` for one key.
pub(crate) fn encode_keys(requests: &[LockRequest]) -> Option<String> {
    (requests.len() > 1).then(|| {
        requests
            .iter()
            .map(|r| format!("{}:{}", r.key.len(), r.key))
            .collect()
    })
}

/// The keys `encode_keys` wrote; a text it did not write gives no keys.
pub(crate) fn decode_keys(mut text: &str) -> Vec<String> {
    let mut keys = Vec::new();
    while let Some((len, rest)) = text.split_once(':') {
        let Ok(len) = len.parse::<usize>() else { break };
        let (Some(key), Some(tail)) = (rest.get(..len), rest.get(len..)) else {
            break;
        };
        keys.push(key.to_owned());
        text = tail;
    }
    keys
}

/// How a mode is stored, in one 64-bit integer: 0 shared, 1 exclusive, and `count` of `limit`
/// permits as the bits of `count << 32 | limit` (a count is at least 1, so such a code is never 0
/// or 1; read as a signed integer it is negative from a count of 2^31 on). A build that knew only
/// the first two reads every other code as exclusive, which is blocked by every row before it
/// and blocks every row after it: a store shared with one never over-grants.
pub(crate) fn mode_code(mode: Mode) -> i64 {
    match mode {
        Mode::Shared => 0,
        Mode::Exclusive => 1,
        Mode::Permits { count, limit } => (u64::from(count) << 32 | u64::from(limit)) as i64,
    }
}

/// The mode stored as `code` (see [`mode_code`]).
pub(crate) fn mode_of(code: i64) -> Mode {
    let bits = code as u64;
    match (bits >> 32, bits as u32) {
        (0, 0) => Mode::Shared,
        (0, _) => Mode::Exclusive,
        (count, limit) => Mode::Permits {
            count: count as u32,
            limit,
        },
    }
}

/// A ticket as stored (a signed 64-bit integer, which both databases have) and back.
pub(crate) fn ticket_of(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

pub(crate) fn sql_ticket(ticket: u64) -> i64 {
    i64::try_from(ticket).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_of_a_request_survive_being_stored_whatever_they_hold() {
        let keys = ["a", "", "b:c", "12:x", "ключ", "x,y\n"];
        let requests: Vec<LockRequest> = keys
            .iter()
            .map(|key| LockRequest::shared(*key, "op"))
            .collect();
        let stored = encode_keys(&requests).unwrap();
        assert_eq!(decode_keys(&stored), keys);
        assert_eq!(encode_keys(&requests[..1]), None);
        assert!(decode_keys("garbage").is_empty());
        assert!(decode_keys("5:ab").is_empty());
    }

    #[test]
    fn key_hashes_are_stable() {
        // FNV-1a of the empty input is its offset basis, whatever the version or process.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(key_hash("k"), key_hash("k"));
        assert_ne!(key_hash("k"), key_hash("j"));
    }

    #[test]
    fn every_mode_survives_being_stored_and_an_old_reader_sees_permits_as_exclusive() {
        let mut modes = vec![Mode::Shared, Mode::Exclusive];
        for count in [1, 2, u32::MAX / 2, u32::MAX / 2 + 1, u32::MAX] {
            for limit in [count, u32::MAX] {
                modes.push(Mode::Permits { count, limit });
            }
        }
        for mode in modes {
            let code = mode_code(mode);
            assert_eq!(mode_of(code), mode, "{code}");
            // What a build of shared and exclusive only made of a code: 0 shared, else exclusive.
            let old = if code == 0 {
                Mode::Shared
            } else {
                Mode::Exclusive
            };
            if let Mode::Permits { .. } = mode {
                assert_eq!(old, Mode::Exclusive, "{mode:?} as {code}");
            }
        }
    }
}
