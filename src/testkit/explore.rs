//! Interruption explored: the same work stopped before each of its await points in turn.

use std::any::Any;
use std::fmt;

use super::events::check_cleanup;
use super::sim::{Sim, SimConfig};
use crate::abort::{AbortController, Interrupted};
use crate::exit::AbortReason;
use crate::lock::LockError;
use crate::scope::Scoped;

/// How [`every_await_point`] stops the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// By an [`AbortController`] attached to the root, aborted with a fresh reason
    /// ([`Explorer`]): the dependable way, whose clean-up finishes before the root resolves,
    /// and whose `Interrupted` must carry that very reason.
    Signal,
    /// By dropping the root, as a lost `select!` does: its clean-up runs in the background, and
    /// must still finish before the run ends.
    Drop,
}

/// The reason [`every_await_point`] interrupts with: which point it stopped before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Explorer {
    /// The step (counted from 0) the work was stopped before.
    pub point: u64,
}

impl fmt::Display for Explorer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stopped before step {} by every_await_point", self.point)
    }
}

impl std::error::Error for Explorer {}

/// How many points [`every_await_point`] explored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Explored {
    /// The steps of the run that was not stopped: each was a point to stop before.
    pub points: u64,
}

/// The first run of [`every_await_point`] that broke a promise.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Failure {
    /// The step the work was stopped before (`u64::MAX`: the run that was not stopped).
    pub point: u64,
    /// The seed of the run.
    pub seed: u64,
    /// Its trace, for [`Sim::replay`].
    pub trace: String,
    /// What went wrong.
    pub what: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.point == u64::MAX {
            write!(f, "the run that was not stopped: {}", self.what)?;
        } else {
            write!(f, "stopped before step {}: {}", self.point, self.what)?;
        }
        write!(
            f,
            " (seed {}; replay with Sim::replay({:?}))",
            self.seed, self.trace
        )
    }
}

impl std::error::Error for Failure {}

/// Runs the work `build` makes, in a simulation of `config`: once to its end, counting its
/// steps (the polls of the root, of its fibers and of its clean-up: every point at which it
/// can be stopped), then once more per step, stopped just before it as `stop` says. Each run
/// must end with nothing left behind (no [`SimError`](super::SimError)), keep every clean-up
/// promise ([`check_cleanup`]), and, stopped by a signal, resolve either with its value (it
/// was done before the stop could reach it) or with an interruption that carries the very
/// reason given. With `config.check_determinism`, every run is made twice and must record the
/// same events.
///
/// `build` is called once per run, with the run's simulation, and must make the same work each
/// time.
///
/// # Errors
///
/// The first run that broke a promise, with its point, seed and trace.
///
/// # Examples
///
/// ```
/// use leasehold::testkit::{every_await_point, SimConfig, Stop};
/// use leasehold::{Interrupted, Scoped};
///
/// for stop in [Stop::Signal, Stop::Drop] {
///     let explored = every_await_point(SimConfig::default(), stop, |_sim| {
///         Scoped::<u32, Interrupted>::new(|scope| async move {
///             scope.add_finalizer(|_| async {});
///             let fiber = scope.fork(async { 20 });
///             Ok(fiber.join().await.success().unwrap_or(0) + 1)
///         })
///     })
///     .unwrap();
///     assert!(explored.points > 2);
/// }
/// ```
pub fn every_await_point<T, E, F>(
    config: SimConfig,
    stop: Stop,
    mut build: F,
) -> Result<Explored, Failure>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
    F: FnMut(&Sim) -> Scoped<T, E>,
{
    let points = checked_run(&config, stop, None, &mut build)?;
    for point in 0..points {
        checked_run(&config, stop, Some(point), &mut build)?;
    }
    Ok(Explored { points })
}

/// One case of [`every_await_point`]: the work `build` makes, stopped before step `point` as
/// `stop` says (a point past the run's last step stops nothing), and checked the same way. For
/// property tests that draw the point (`strategy::interrupt_at`) and the seed themselves.
///
/// # Errors
///
/// The run's [`Failure`], if it broke a promise.
///
/// # Examples
///
/// ```
/// use leasehold::testkit::{stop_at, SimConfig, Stop};
/// use leasehold::{Interrupted, Scoped};
///
/// for point in 0..10 {
///     stop_at(SimConfig::default(), Stop::Drop, point, |_| {
///         Scoped::<(), Interrupted>::new(|scope| async move {
///             scope.add_finalizer(|_| async {});
///             Ok(())
///         })
///     })
///     .unwrap();
/// }
/// ```
pub fn stop_at<T, E, F>(
    config: SimConfig,
    stop: Stop,
    point: u64,
    mut build: F,
) -> Result<(), Failure>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
    F: FnMut(&Sim) -> Scoped<T, E>,
{
    checked_run(&config, stop, Some(point), &mut build).map(drop)
}

/// One run (twice, with the determinism check), stopped before `point` if given; returns its
/// steps.
fn checked_run<T, E, F>(
    config: &SimConfig,
    stop: Stop,
    point: Option<u64>,
    build: &mut F,
) -> Result<u64, Failure>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
    F: FnMut(&Sim) -> Scoped<T, E>,
{
    let first = one_run(config, stop, point, build)?;
    if config.check_determinism {
        let second = one_run(config, stop, point, build)?;
        if let Some(at) = (0..first.events.len().max(second.events.len()))
            .find(|&i| first.events.get(i) != second.events.get(i))
        {
            return Err(Failure {
                point: point.unwrap_or(u64::MAX),
                seed: config.seed,
                trace: first.trace,
                what: format!(
                    "two runs differed, first at event {at}: {:?} against {:?}",
                    first.events.get(at),
                    second.events.get(at)
                ),
            });
        }
    }
    Ok(first.steps)
}

struct Run {
    steps: u64,
    trace: String,
    /// The events, printed (reasons compare by what they say across runs).
    events: Vec<String>,
}

fn one_run<T, E, F>(
    config: &SimConfig,
    stop: Stop,
    point: Option<u64>,
    build: &mut F,
) -> Result<Run, Failure>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
    F: FnMut(&Sim) -> Scoped<T, E>,
{
    let mut sim = Sim::with_config(config.clone());
    let controller = AbortController::new();
    let reason = AbortReason::new(Explorer {
        point: point.unwrap_or(u64::MAX),
    });
    let mut work = build(&sim);
    if stop == Stop::Signal {
        work = work.with_signal(&controller.signal());
    }
    let mut steps = 0;
    let outcome = sim.run(work, &mut |step| {
        steps = step + 1;
        match point {
            Some(point) if point == step => match stop {
                Stop::Signal => {
                    controller.abort(reason.clone());
                    false
                }
                Stop::Drop => true,
            },
            _ => false,
        }
    });
    let fail = |sim: &Sim, what: String| Failure {
        point: point.unwrap_or(u64::MAX),
        seed: sim.seed(),
        trace: sim.trace(),
        what,
    };
    let outcome = outcome.map_err(|error| fail(&sim, error.to_string()))?;
    let events = sim.events();
    check_cleanup(&events).map_err(|violation| fail(&sim, violation.to_string()))?;
    if let (Stop::Signal, Some(_), Some(Err(error))) = (stop, point, &outcome) {
        if let Some(carried) = interruption_reason(error) {
            if !carried.ptr_eq(&reason) {
                return Err(fail(
                    &sim,
                    format!("interrupted with {carried:?}, not with the reason given ({reason:?})"),
                ));
            }
        }
    }
    Ok(Run {
        steps,
        trace: sim.trace(),
        events: events.iter().map(|event| format!("{event:?}")).collect(),
    })
}

/// The reason an error says it was interrupted with, for the error types that carry one.
fn interruption_reason<E: 'static>(error: &E) -> Option<&AbortReason> {
    let error = error as &dyn Any;
    if let Some(interrupted) = error.downcast_ref::<Interrupted>() {
        return Some(interrupted.reason());
    }
    error.downcast_ref::<LockError>()?.abort_reason()
}
