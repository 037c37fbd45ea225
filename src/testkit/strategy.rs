//! Proptest strategies for simulated runs: a seed or a schedule, a way to stop, and a point to
//! stop before.
//!
//! A failing case shrinks as proptest shrinks these values: the point toward earlier steps (0:
//! before the first poll), a schedule ([`SimConfig::schedule`](super::SimConfig::schedule))
//! toward arrival order, the seed toward 0. With [`stop_at`](super::stop_at), a property test
//! draws all three and checks one case each time.
//!
//! # Examples
//!
//! ```
//! use leasehold::testkit::{stop_at, strategy, SimConfig};
//! use leasehold::{Interrupted, Scoped};
//! use proptest::prelude::*;
//!
//! proptest! {
//!     // In a test file: #[test]
//!     fn clean_up_holds_wherever_it_stops(
//!         seed in strategy::seed(),
//!         stop in strategy::stop(),
//!         point in strategy::interrupt_at(),
//!     ) {
//!         let mut config = SimConfig::default();
//!         config.seed = seed;
//!         let result = stop_at(config, stop, point, |_| {
//!             Scoped::<(), Interrupted>::new(|scope| async move {
//!                 scope.add_finalizer(|_| async {});
//!                 Ok(())
//!             })
//!         });
//!         prop_assert!(result.is_ok(), "{}", result.unwrap_err());
//!     }
//! }
//! # clean_up_holds_wherever_it_stops();
//! ```

use proptest::prelude::*;

use super::Stop;

/// Any seed.
pub fn seed() -> impl Strategy<Value = u64> {
    any::<u64>()
}

/// [`Stop::Signal`] or [`Stop::Drop`] (shrinking toward `Signal`).
pub fn stop() -> impl Strategy<Value = Stop> {
    prop_oneof![Just(Stop::Signal), Just(Stop::Drop)]
}

/// A schedule for [`SimConfig::schedule`](super::SimConfig::schedule): up to 64 choices of the
/// ready task to poll next, shrinking toward fewer and smaller ones, that is toward arrival
/// order.
pub fn schedule() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(0u32..8, 0..64)
}

/// A step to stop before: 0 to 999 (a point past a run's last step stops nothing), shrinking
/// toward 0.
pub fn interrupt_at() -> impl Strategy<Value = u64> {
    0u64..1_000
}
