//! Counters: each child keeps them, publishes them to a file now and then (a killed child's are
//! partial), and the parent adds them up.

use super::*;

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// What one child did and saw.
        #[derive(Default)]
        pub(crate) struct Counters { $(pub(crate) $name: AtomicU64,)* }

        /// The sum over all children, plus what the parent saw.
        #[derive(Clone, Debug, Default)]
        pub struct Totals { $(pub $name: u64,)* }

        impl Counters {
            pub(crate) fn render(&self) -> String {
                let mut text = String::new();
                $(text.push_str(&format!("{} {}\n", stringify!($name), self.$name.load(Ordering::Relaxed)));)*
                text
            }
        }

        impl Totals {
            pub(crate) fn add(&mut self, text: &str) {
                for line in text.lines() {
                    let mut words = line.split_whitespace();
                    let (Some(name), Some(value)) = (words.next(), words.next()) else { continue };
                    let value: u64 = value.parse().unwrap_or(0);
                    match name {
                        $(stringify!($name) => self.$name += value,)*
                        _ => {}
                    }
                }
            }

            pub(crate) fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

counters! {
    operations,
    grants,
    shared_grants,
    exclusive_grants,
    permit_grants,
    not_granted,
    interruptions,
    dropped_acquisitions,
    lost_signals,
    lost_on_release,
    violations,
    late_losses,
    lost_updates,
    stale_writes_accepted,
    stale_writes_refused,
    late_writes_accepted,
    increments,
    overlaps_after_loss,
    stopped_holders,
    stops_unnoticed,
    expired_waits,
    storage_errors,
    restart_storage_errors,
    register_errors,
    election_grants,
    election_resigned,
    election_lease_lost,
    election_writes,
    election_stopped_leaders,
    election_stale_writes_refused,
    election_untold_refusals,
    election_losses_masked,
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}
