//! Time as the lock manager keeps it: whole microseconds in rows and replies, of the time line
//! each store judges leases by (see `Storage::now`), and deadlines on the clock's monotonic
//! time line.

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

/// The time line a store judges leases by, as the manager's clock gives it: the machine's boot
/// clock, which no step moves and which every process of the machine shares, on one boot; or,
/// for a clock without one (a `Clock` of the user's that gives no `boot_time`), its wall time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TimeLine {
    Boot(u128),
    Wall,
}

impl TimeLine {
    /// The line `clock` gives.
    pub(crate) fn of(clock: &dyn Clock) -> TimeLine {
        match clock.boot_time() {
            Some(time) => TimeLine::Boot(time.boot),
            None => TimeLine::Wall,
        }
    }

    /// Now on this line, by `clock`; `None` if the clock no longer gives it (a boot time of
    /// another boot, or none).
    pub(crate) fn now(self, clock: &dyn Clock) -> Option<i64> {
        match self {
            TimeLine::Wall => Some(micros(clock.now())),
            TimeLine::Boot(boot) => clock
                .boot_time()
                .filter(|time| time.boot == boot)
                .map(|time| micros(time.since_boot)),
        }
    }

    /// `at`, a time on this line that is `now` on it, as the clock's wall time: what an operator
    /// is shown (`inspect`).
    pub(crate) fn wall_time(self, clock: &dyn Clock, at: i64, now: i64) -> i64 {
        match self {
            TimeLine::Wall => at,
            TimeLine::Boot(_) => micros(clock.now()).saturating_sub(now.saturating_sub(at)),
        }
    }

    /// How a store records it.
    pub(crate) fn stored(self) -> String {
        match self {
            TimeLine::Wall => "wall".into(),
            TimeLine::Boot(boot) => format!("boot {boot:032x}"),
        }
    }

    /// What `stored` wrote; `None` for anything else.
    pub(crate) fn parse(text: &str) -> Option<TimeLine> {
        match text.strip_prefix("boot ") {
            Some(hex) => u128::from_str_radix(hex, 16).ok().map(TimeLine::Boot),
            None => (text == "wall").then_some(TimeLine::Wall),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{SystemClock, TestClock};

    #[test]
    fn a_time_line_is_read_back_as_stored() {
        for line in [TimeLine::Wall, TimeLine::Boot(0), TimeLine::Boot(u128::MAX)] {
            assert_eq!(TimeLine::parse(&line.stored()), Some(line));
        }
        assert_eq!(TimeLine::parse("boot"), None);
        assert_eq!(TimeLine::parse("Wall"), None);
    }

    #[test]
    fn a_test_clock_times_leases_on_its_boot_whatever_its_wall_clock_does() {
        let clock = TestClock::new();
        let line = TimeLine::of(&clock);
        assert_eq!(line, TimeLine::Boot(TestClock::BOOT));
        let before = line.now(&clock).unwrap();
        clock.set_wall_time(clock.now() + Duration::from_secs(3600));
        assert_eq!(line.now(&clock), Some(before));
        clock.set_wall_time(clock.now() - Duration::from_secs(7200));
        assert_eq!(line.now(&clock), Some(before));
        clock.advance(Duration::from_secs(1));
        assert_eq!(line.now(&clock), Some(before + 1_000_000));
        // Shown on the wall clock as it reads now: a second ago is a second before its now.
        let wall = micros(clock.now());
        assert_eq!(
            line.wall_time(&clock, before, before + 1_000_000),
            wall - 1_000_000
        );
        assert_eq!(TimeLine::Boot(1).now(&clock), None, "another boot");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_system_clock_times_leases_on_this_boot() {
        let line = TimeLine::of(&SystemClock);
        assert!(matches!(line, TimeLine::Boot(_)), "{line:?}");
        let first = line.now(&SystemClock).unwrap();
        let second = line.now(&SystemClock).unwrap();
        assert!(second >= first);
    }
}
