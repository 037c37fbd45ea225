//! The register: one small file per key, read and written under an OS file lock so that each of
//! its operations is atomic across processes (`update_locked`).

use super::*;

/// A holder's mark: its fencing token and which child incarnation made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mark {
    pub(crate) token: u64,
    pub(crate) tag: String,
}

#[derive(Default, Debug)]
pub(crate) struct RegisterState {
    pub(crate) value: u64,
    /// The highest token of any holder that entered or wrote: the fence for writes.
    pub(crate) fence: u64,
    /// The highest token of an exclusive holder that entered: a shared holder below it is stale.
    pub(crate) fence_exclusive: u64,
    pub(crate) writer: Option<Mark>,
    pub(crate) readers: Vec<Mark>,
    /// Holders whose marks a newer holder found: each must have lost its lease.
    pub(crate) superseded: Vec<Mark>,
}

impl FileState for RegisterState {
    fn parse(text: &str) -> RegisterState {
        let mut state = RegisterState::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let (Some(what), Some(number)) = (words.next(), words.next()) else {
                continue;
            };
            let number: u64 = number.parse().unwrap_or(0);
            let mark = || Mark {
                token: number,
                tag: words.clone().next().unwrap_or("").to_owned(),
            };
            match what {
                "value" => state.value = number,
                "fence" => state.fence = number,
                "fence_exclusive" => state.fence_exclusive = number,
                "writer" => state.writer = Some(mark()),
                "reader" => state.readers.push(mark()),
                "superseded" => state.superseded.push(mark()),
                _ => {}
            }
        }
        state
    }

    fn render(&self) -> String {
        let mut text = format!(
            "value {}\nfence {}\nfence_exclusive {}\n",
            self.value, self.fence, self.fence_exclusive
        );
        for (what, mark) in self
            .writer
            .iter()
            .map(|m| ("writer", m))
            .chain(self.readers.iter().map(|m| ("reader", m)))
            .chain(self.superseded.iter().map(|m| ("superseded", m)))
        {
            text.push_str(&format!("{what} {} {}\n", mark.token, mark.tag));
        }
        text
    }
}

impl RegisterState {
    /// Moves every mark with a token below `token` to the superseded list.
    pub(crate) fn supersede_below(&mut self, token: u64) {
        if self.writer.as_ref().is_some_and(|w| w.token < token) {
            let writer = self.writer.take().expect("checked above");
            self.superseded.push(writer);
        }
        let (old, kept): (Vec<Mark>, Vec<Mark>) =
            self.readers.drain(..).partition(|r| r.token < token);
        self.readers = kept;
        self.superseded.extend(old);
    }
}

/// What entering the register found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    /// Entered; the value now.
    Entered(u64),
    /// A newer holder has been here: this holder is stale (its lease must have been lost).
    Stale,
}

/// What a write attempt came to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Written {
    Accepted { lost_update: bool, stale: bool },
    Refused,
}

#[derive(Clone)]
pub(crate) struct Register {
    pub(crate) path: PathBuf,
}

impl Register {
    pub(crate) fn new(folder: &Path, key: &str) -> Register {
        Register {
            path: folder.join(format!("register-{key}")),
        }
    }

    /// Runs `change` on the state under the register's file lock (see `update_locked`).
    pub(crate) async fn update<T>(
        &self,
        change: impl FnOnce(&mut RegisterState) -> T,
    ) -> std::io::Result<T> {
        update_locked(&self.path, change).await
    }

    /// Enters as the one writer (`exclusive`) or as a reader.
    pub(crate) async fn enter(&self, mark: &Mark, exclusive: bool) -> std::io::Result<Entry> {
        self.update(|state| {
            let stale = if exclusive {
                mark.token < state.fence
            } else {
                mark.token < state.fence_exclusive
            };
            if stale {
                state.superseded.push(mark.clone());
                return Entry::Stale;
            }
            if exclusive {
                state.supersede_below(mark.token);
                state.writer = Some(mark.clone());
                state.fence_exclusive = mark.token;
            } else {
                if state.writer.as_ref().is_some_and(|w| w.token < mark.token) {
                    let writer = state.writer.take().expect("checked above");
                    state.superseded.push(writer);
                }
                state.readers.push(mark.clone());
            }
            state.fence = state.fence.max(mark.token);
            Entry::Entered(state.value)
        })
        .await
    }

    pub(crate) async fn read(&self) -> std::io::Result<u64> {
        self.update(|state| state.value).await
    }

    /// The fenced write: refused if a newer holder has been here.
    pub(crate) async fn write(&self, mark: &Mark, read: u64) -> std::io::Result<Written> {
        self.update(|state| {
            if mark.token < state.fence {
                return Written::Refused;
            }
            let lost_update = state.value != read;
            // A newer holder found this one's mark, yet its write got through.
            let stale = state.superseded.contains(mark);
            state.value = read + 1;
            state.fence = mark.token;
            Written::Accepted { lost_update, stale }
        })
        .await
    }

    /// Removes the holder's mark; returns whether a newer holder had superseded it.
    pub(crate) async fn leave(&self, mark: &Mark) -> std::io::Result<bool> {
        self.update(|state| {
            if state.writer.as_ref() == Some(mark) {
                state.writer = None;
            }
            state.readers.retain(|r| r != mark);
            let before = state.superseded.len();
            state.superseded.retain(|s| s != mark);
            state.superseded.len() != before
        })
        .await
    }

    /// Removes every mark of a dead child incarnation.
    pub(crate) async fn clear(&self, tag: &str) -> std::io::Result<()> {
        self.update(|state| {
            if state.writer.as_ref().is_some_and(|w| w.tag == tag) {
                state.writer = None;
            }
            state.readers.retain(|r| r.tag != tag);
            state.superseded.retain(|s| s.tag != tag);
        })
        .await
    }
}
