//! Time as the lock manager keeps it: whole microseconds since the Unix epoch in rows and
//! replies, and deadlines on the clock's monotonic time line.

use std::time::Duration;

use crate::clock::Clock;

/// `time` in whole microseconds, saturating.
pub(crate) fn micros(time: Duration) -> i64 {
    i64::try_from(time.as_micros()).unwrap_or(i64::MAX)
}

/// `micros` as a duration (zero for a negative value).
pub(crate) fn from_micros(micros: i64) -> Duration {
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// When `wall` (the clock's wall time) is or was on its monotonic time line, on which schedules
/// and deadlines run: its distance from now, read on the wall time line, from the monotonic now.
/// Never later than it is: the monotonic time is read first, so a pause between the two
/// readings moves the answer earlier.
pub(crate) fn monotonic_at(clock: &dyn Clock, wall: Duration) -> Duration {
    let monotonic = clock.monotonic();
    let now = clock.now();
    if wall >= now {
        monotonic.saturating_add(wall - now)
    } else {
        monotonic.saturating_sub(now - wall)
    }
}
