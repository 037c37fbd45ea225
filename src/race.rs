//! Structured `race`, `race_first` and `all`: every contender has finished, clean-up included,
//! before any of them resolves.
//!
//! Invariants:
//!
//! 1. Every contender runs with one extra signal, shared by all of them, that is aborted with
//!    [`RaceLost`] once the outcome is known (a winner, a failure of `all`, or a panic).
//! 2. None of them resolves until every contender has resolved: a `Scoped` resolves only
//!    after its scope has closed, so the losers' finalizers have finished by then.
//! 3. A contender's panic is caught, the others are interrupted and awaited as for a loss, and
//!    then the panic resumes. A contender that panics as it is interrupted (a finalizer of its
//!    clean-up) counts the same: once all have finished, its panic resumes instead of the value
//!    or error the outcome would have been. Only the first panic resumes; later ones are logged
//!    with `tracing` at error.
//! 4. Dropping `race`, `race_first` or `all` before it resolves drops the contenders, which hands
//!    their clean-up to the enclosing `Scoped` (if any, whose close then waits for it) or to
//!    their spawner, as for any dropped `Scoped`. An interruption of the enclosing `Scoped`
//!    therefore reaches every contender with the caller's reason.

use std::error::Error;
use std::fmt;
use std::panic::{resume_unwind, AssertUnwindSafe};

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;

use crate::abort::{AbortController, Interrupted};
use crate::exit::AbortReason;
use crate::scope::{log_panic, Panic, Scoped};

/// The reason given to the contenders that [`race`], [`race_first`] and [`all`] interrupt once
/// the outcome is known.
///
/// # Examples
///
/// ```
/// use leasehold::RaceLost;
///
/// assert_eq!(RaceLost.to_string(), "lost a race");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RaceLost;

impl fmt::Display for RaceLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("lost a race")
    }
}

impl Error for RaceLost {}

/// How one contender ended, with its place in the list.
type Finish<T, E> = (usize, Result<Result<T, E>, Panic>);

/// The contenders, started together and each interruptible by `lost`.
struct Contest<T, E> {
    lost: AbortController,
    running: FuturesUnordered<futures::future::BoxFuture<'static, Finish<T, E>>>,
}

impl<T: Send + 'static, E: From<Interrupted> + Send + 'static> Contest<T, E> {
    fn new(contenders: impl IntoIterator<Item = Scoped<T, E>>) -> Self {
        let lost = AbortController::new();
        let signal = lost.signal();
        let running = contenders
            .into_iter()
            .enumerate()
            .map(|(place, contender)| {
                AssertUnwindSafe(contender.with_signal(&signal))
                    .catch_unwind()
                    .map(move |result| (place, result))
                    .boxed()
            })
            .collect();
        Contest { lost, running }
    }

    fn len(&self) -> usize {
        self.running.len()
    }

    /// The next contender to finish, or `None` when none is left.
    async fn next(&mut self) -> Option<Finish<T, E>> {
        self.running.next().await
    }

    /// Interrupts every contender still running and waits for all of them. A value or an error
    /// they end with is dropped (a value that beat the interruption too, as a late winner's); the
    /// first panic is given back (invariant 3), and later ones are logged.
    async fn stop_the_rest(&mut self) -> Option<Panic> {
        self.lost.abort(AbortReason::new(RaceLost));
        let mut first = None;
        while let Some((_, finish)) = self.running.next().await {
            if let Err(panic) = finish {
                match first {
                    None => first = Some(panic),
                    Some(_) => log_panic(&panic, "a further contender panicked"),
                }
            }
        }
        first
    }

    /// [`stop_the_rest`](Contest::stop_the_rest), then resumes the panic of one of them, if any.
    async fn stop_the_rest_or_resume(&mut self) {
        if let Some(panic) = self.stop_the_rest().await {
            resume_unwind(panic)
        }
    }

    /// [`stop_the_rest`](Contest::stop_the_rest), then resumes `panic`, a contender's.
    async fn stop_the_rest_and_resume(&mut self, panic: Panic) -> ! {
        if let Some(later) = self.stop_the_rest().await {
            log_panic(&later, "a further contender panicked");
        }
        resume_unwind(panic)
    }
}

/// Effect's `raceAll`: the first contender to succeed wins; the others are interrupted (reason
/// [`RaceLost`]) and their clean-up has finished before `race` resolves. If every contender
/// fails, the error of the last to fail. (To end the race with the first to finish, failures
/// included, use [`race_first`].)
///
/// The contenders run concurrently, polled by the task that awaits `race` (so inside a `Scoped`,
/// each is nested in it). A loser that produced its value before it saw the interruption has
/// that value dropped.
///
/// # Panics
///
/// Panics, when first polled, if `contenders` is empty: there would be neither a winner nor a
/// last error (Effect's `raceAll` dies the same way). If a contender panics, the others are
/// interrupted and awaited, and then the panic resumes; so does the panic of a loser's clean-up,
/// instead of the winner's value.
///
/// # Cancel safety
///
/// Dropping this future drops the contenders: their clean-up goes to the enclosing `Scoped`,
/// whose close waits for it, or to the background. Interrupt the enclosing `Scoped` instead to
/// wait for it; every contender is then interrupted with your reason.
///
/// # Examples
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use leasehold::{race, ExitStatus, Interrupted, RaceLost, Scoped};
///
/// # futures::executor::block_on(async {
/// let told = Arc::new(Mutex::new(None));
/// let record = told.clone();
/// let slow = Scoped::<&str, Interrupted>::new(|scope| async move {
///     scope.add_finalizer(move |status| async move { *record.lock().unwrap() = Some(status) });
///     std::future::pending().await
/// });
/// let quick = Scoped::new(|_| async { Ok("quick") });
/// assert_eq!(race([slow, quick]).await.unwrap(), "quick");
/// // The loser was interrupted, and its finalizer had finished, before `race` returned.
/// let status = told.lock().unwrap().take().unwrap();
/// assert!(matches!(status, ExitStatus::Interrupted(reason) if reason.downcast_ref::<RaceLost>().is_some()));
/// # });
/// ```
pub async fn race<T, E>(contenders: impl IntoIterator<Item = Scoped<T, E>>) -> Result<T, E>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
{
    first_to(contenders, "race", Result::is_ok).await
}

/// Effect's `raceFirst` over many, and what `select!` does with clean-up: the first contender to
/// finish wins, whether it succeeded or failed; the others are interrupted (reason [`RaceLost`])
/// and their clean-up has finished before `race_first` resolves with the winner's result.
///
/// Use it where a failure should end the race too (a cancel button, a deadline of your own, a
/// health check that fails); [`race`] waits past failures for a success. As in [`race`], the
/// contenders run concurrently, polled by the task that awaits `race_first`, and a loser that
/// produced its value (or error) before it saw the interruption has it dropped.
///
/// # Panics
///
/// Panics, when first polled, if `contenders` is empty: there would be no winner. If a
/// contender panics before one has won, the others are interrupted and awaited, and then the
/// panic resumes; so does the panic of a loser's clean-up, instead of the winner's result.
///
/// # Cancel safety
///
/// As for [`race`]: dropping this future drops the contenders, whose clean-up goes to the
/// enclosing `Scoped` (whose close waits for it) or to the background. Interrupt the enclosing
/// `Scoped` instead to wait for it; every contender is then interrupted with your reason.
///
/// # Examples
///
/// A job raced against a cancel contender that fails: the failure wins, and the job's clean-up
/// has finished, told it lost, when `race_first` returns.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use leasehold::{race_first, ExitStatus, Interrupted, RaceLost, Scoped};
///
/// #[derive(Debug)]
/// enum JobError {
///     Cancelled,
///     Interrupted(Interrupted),
/// }
/// impl From<Interrupted> for JobError {
///     fn from(interrupted: Interrupted) -> Self {
///         JobError::Interrupted(interrupted)
///     }
/// }
///
/// # futures::executor::block_on(async {
/// let told = Arc::new(Mutex::new(None));
/// let record = told.clone();
/// let job = Scoped::<&str, JobError>::new(|scope| async move {
///     scope.add_finalizer(move |status| async move { *record.lock().unwrap() = Some(status) });
///     std::future::pending().await
/// });
/// let cancel = Scoped::new(|_| async { Err(JobError::Cancelled) });
/// assert!(matches!(race_first([job, cancel]).await, Err(JobError::Cancelled)));
/// let status = told.lock().unwrap().take().unwrap();
/// assert!(matches!(status, ExitStatus::Interrupted(reason) if reason.downcast_ref::<RaceLost>().is_some()));
/// # });
/// ```
pub async fn race_first<T, E>(contenders: impl IntoIterator<Item = Scoped<T, E>>) -> Result<T, E>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
{
    first_to(contenders, "race_first", |_| true).await
}

/// The core of [`race`] and [`race_first`]: the first contender whose result `wins` is the
/// outcome, once the others have been stopped (invariants 1 to 3); if none wins, the result of
/// the last to finish. `name` is the caller's, for the panic of an empty race.
async fn first_to<T, E>(
    contenders: impl IntoIterator<Item = Scoped<T, E>>,
    name: &str,
    wins: impl Fn(&Result<T, E>) -> bool,
) -> Result<T, E>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
{
    let mut contest = Contest::new(contenders);
    assert!(contest.len() > 0, "`{name}` needs at least one contender");
    let mut last = None;
    while let Some((_, finish)) = contest.next().await {
        match finish {
            Ok(result) if wins(&result) => {
                contest.stop_the_rest_or_resume().await;
                return result;
            }
            Ok(result) => last = Some(result),
            Err(panic) => contest.stop_the_rest_and_resume(panic).await,
        }
    }
    last.expect("a race with contenders ends with a winner or a last result")
}

/// Effect's `all`, run concurrently: every member to success, values in the members' order. On
/// the first failure the others are interrupted (reason [`RaceLost`]) and awaited, then that
/// failure is returned.
///
/// No members gives `Ok(vec![])`. The members are polled by the task that awaits `all` (so inside
/// a `Scoped`, each is nested in it).
///
/// # Panics
///
/// If a member panics, the others are interrupted and awaited, and then the panic resumes; so
/// does the panic of an interrupted member's clean-up, instead of the failure.
///
/// # Cancel safety
///
/// Dropping this future drops the members: their clean-up goes to the enclosing `Scoped`, whose
/// close waits for it, or to the background. Interrupt the enclosing `Scoped` instead to wait for
/// it; every member is then interrupted with your reason.
///
/// # Examples
///
/// ```
/// use leasehold::{all, Interrupted, Scoped};
///
/// # futures::executor::block_on(async {
/// let members = (1..=3).map(|n| Scoped::<u32, Interrupted>::new(move |_| async move { Ok(n * 10) }));
/// assert_eq!(all(members).await.unwrap(), [10, 20, 30]);
/// # });
/// ```
pub async fn all<T, E>(members: impl IntoIterator<Item = Scoped<T, E>>) -> Result<Vec<T>, E>
where
    T: Send + 'static,
    E: From<Interrupted> + Send + 'static,
{
    let mut contest = Contest::new(members);
    let mut values: Vec<Option<T>> = (0..contest.len()).map(|_| None).collect();
    while let Some((place, finish)) = contest.next().await {
        match finish {
            Ok(Ok(value)) => values[place] = Some(value),
            Ok(Err(error)) => {
                contest.stop_the_rest_or_resume().await;
                return Err(error);
            }
            Err(panic) => contest.stop_the_rest_and_resume(panic).await,
        }
    }
    Ok(values
        .into_iter()
        .map(|value| value.expect("every member succeeded"))
        .collect())
}
