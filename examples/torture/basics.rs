//! What every part uses: a small seeded generator (so that a run is reproducible from its seed as
//! far as scheduling allows), the time, and files written whole, appended to, or changed under a
//! lock.

use super::*;

pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        // splitmix64 of the seed, so that nearby seeds give unrelated streams.
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub(crate) fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low + 1))
    }
}

pub(crate) fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The machine's monotonic clock (`CLOCK_MONOTONIC` on Linux), in micros: every process reads
/// it alike, and no step of the wall clock moves it.
pub(crate) fn mono_micros() -> u64 {
    SystemClock
        .boot_time()
        .map_or(0, |time| time.since_boot.as_micros() as u64)
}

pub(crate) async fn sleep(duration: Duration) {
    smol::Timer::after(duration).await;
}

/// Writes a file whole: a reader never sees it half written.
pub(crate) fn publish(path: &Path, content: &str) {
    let part = path.with_extension("part");
    if fs::write(&part, content).is_ok() {
        let _ = fs::rename(&part, path);
    }
}

/// Adds `line` to a file that several processes add to (each line in one write).
pub(crate) fn append(path: &Path, line: &str) {
    let opened = fs::OpenOptions::new().create(true).append(true).open(path);
    if let Ok(mut file) = opened {
        let _ = file.write_all(line.as_bytes());
    }
}

/// A small state kept in a file that several processes change (see `update_locked`).
pub(crate) trait FileState: Sized {
    fn parse(text: &str) -> Self;
    fn render(&self) -> String;
}

/// Runs `change` on the state kept in `path`, under an OS file lock, so that each change is
/// atomic across processes. The lock is tried, not waited for, so that a paused process holding
/// it never blocks this process's executor (and its heartbeats). The lock is a file of its own
/// beside the state's, and the new state is written to a temporary file and renamed over the
/// old, so that a process killed in the middle leaves the old state or the new one, never a torn
/// one (a truncated register once looked like another holder's write to a reader that held the
/// lock rightly).
pub(crate) async fn update_locked<S: FileState, T>(
    path: &Path,
    change: impl FnOnce(&mut S) -> T,
) -> std::io::Result<T> {
    let lock = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path.with_extension("lock"))?;
    loop {
        match fs4::FileExt::try_lock(&lock) {
            Ok(()) => break,
            Err(fs4::TryLockError::WouldBlock) => sleep(Duration::from_millis(1)).await,
            Err(fs4::TryLockError::Error(error)) => return Err(error),
        }
    }
    let outcome = (|| {
        let text = match fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(error) => return Err(error),
        };
        let mut state = S::parse(&text);
        let value = change(&mut state);
        let part = path.with_extension("part");
        fs::write(&part, state.render())?;
        fs::rename(&part, path)?;
        Ok(value)
    })();
    let _ = fs4::FileExt::unlock(&lock);
    outcome
}
