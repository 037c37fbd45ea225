//! The bridge to tokio-util's `CancellationToken` (feature `tokio-util`): a signal made from a
//! token, and a token made from a signal.
//!
//! Invariants:
//!
//! 1. A signal made from a token is a signal with a trigger (invariant 7 of `abort`): no task
//!    runs for it. A look at it once the token is cancelled aborts it, with a [`TokenCancelled`]
//!    reason made when the signal was; whoever awaits it awaits the token too.
//! 2. A token made from a signal is cancelled by a hook of the signal (invariant 8 of `abort`),
//!    in the abort itself: no task runs for a signal that aborts only when told (an
//!    `AbortController`'s, and `any` of such).
//! 3. A signal that aborts by itself (a deadline, a token, or `any` with one of them among its
//!    sources) aborts only when someone looks at it, and a token's waiters do not: for those,
//!    one task on the current spawner looks at the signal each time it may have aborted. It
//!    holds the signal weakly and ends when the signal has aborted, when its last handle is
//!    dropped, or when the token is cancelled by anyone.
//! 4. The token follows the signal while the signal lives: its hook is kept by the signal, and
//!    goes with it.

use std::error::Error;
use std::fmt;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::abort::{AbortController, AbortSignal, OnAbort, Trigger};
use crate::exit::AbortReason;
use crate::runtime::spawn_as;
use crate::scope::current_spawner;

/// The reason of a signal made from a tokio-util `CancellationToken` (`AbortSignal::from`), once
/// the token is cancelled: a token carries no reason of its own.
///
/// # Examples
///
/// ```
/// use leasehold::TokenCancelled;
///
/// assert_eq!(TokenCancelled.to_string(), "cancelled by a cancellation token");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenCancelled;

impl fmt::Display for TokenCancelled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("cancelled by a cancellation token")
    }
}

impl Error for TokenCancelled {}

/// A token as the trigger of a signal (invariant 1).
struct Cancelled(CancellationToken);

impl Trigger for Cancelled {
    fn has_fired(&self) -> bool {
        self.0.is_cancelled()
    }

    fn fired(&self) -> BoxFuture<'static, ()> {
        Box::pin(self.0.clone().cancelled_owned())
    }
}

/// A token that a signal cancels when it aborts (invariant 2).
struct Cancels(CancellationToken);

impl OnAbort for Cancels {
    fn aborted(&self, _: &AbortReason) {
        self.0.cancel();
    }

    fn is_done(&self) -> bool {
        self.0.is_cancelled()
    }
}

/// A signal that aborts once `token` is cancelled, with a [`TokenCancelled`] reason (one object
/// per signal made, so [`AbortReason::ptr_eq`] tells signals made from one token apart).
///
/// No task runs for it: a look at the signal once the token is cancelled finds it aborted, and
/// whoever awaits it (or a [`Scoped`](crate::Scoped) it is attached to) also awaits the token,
/// on any executor. The signal keeps a clone of the token until it is dropped.
///
/// A token made from a signal ([`AbortSignal::cancellation_token`]) and turned back into a
/// signal here gives `TokenCancelled`, not the first signal's reason: a token carries none. Keep
/// the first signal where its reason matters (or attach both: the first signal aborts before
/// its token is cancelled).
///
/// # Examples
///
/// ```
/// use leasehold::{AbortSignal, ExitStatus, Interrupted, Scoped, TokenCancelled};
/// use tokio_util::sync::CancellationToken;
///
/// # futures::executor::block_on(async {
/// // The rest of the service stops on this token.
/// let shutdown = CancellationToken::new();
/// let job = Scoped::<(), Interrupted>::new(|scope| async move {
///     scope.add_finalizer(|status| async move {
///         assert!(matches!(status, ExitStatus::Interrupted(_)), "told it was stopped");
///     });
///     std::future::pending().await
/// })
/// .with_signal(&AbortSignal::from(shutdown.clone()));
/// let stop = std::thread::spawn(move || shutdown.cancel());
/// let error = job.await.unwrap_err();
/// assert!(error.reason().downcast_ref::<TokenCancelled>().is_some());
/// # stop.join().unwrap();
/// # });
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "tokio-util")))]
impl From<CancellationToken> for AbortSignal {
    fn from(token: CancellationToken) -> Self {
        AbortSignal::triggered_by(Box::new(Cancelled(token)), AbortReason::new(TokenCancelled))
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "tokio-util")))]
impl AbortSignal {
    /// A tokio-util `CancellationToken` that is cancelled when this signal aborts, for the
    /// parts of a program that stop on a token. Cancelling the token does not abort the signal.
    ///
    /// The reason stays with the signal: the token carries none (read it with
    /// [`reason`](AbortSignal::reason)). A signal made back from the token (`AbortSignal::from`)
    /// aborts with [`TokenCancelled`].
    ///
    /// The token follows the signal while the signal lives, that is while a handle on it does
    /// (a clone, a `Scoped` it is attached to, the [`AbortController`] it came from, a guard's
    /// bookkeeping for [`lost`](crate::Guard::lost)). Once every handle is gone, nothing can
    /// cancel the token but you: keep the signal for as long as the token is to follow it.
    ///
    /// A signal that aborts only when told (an `AbortController`'s, or
    /// [`any`](AbortSignal::any) of those) cancels the token in the call that aborts it: no task
    /// runs. A signal that aborts by itself ([`timeout`](AbortSignal::timeout), a guard's
    /// `lost`, a signal made from a token, or `any` with one of them) aborts when it is looked
    /// at, and the token's waiters do not look: for it, one task on the current spawner (see
    /// the crate docs, "Where background work runs") looks at the signal when it may have
    /// aborted. The task holds the signal weakly, and ends when the signal aborts, when its
    /// last handle is dropped, or when the token is cancelled. (Dropping every clone of the
    /// token cannot be seen: a token tells no one.)
    ///
    /// The signal keeps each token it made until it aborts or is dropped, or the token is
    /// cancelled: make one for a long-lived signal and clone it, rather than one per use.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::AbortController;
    ///
    /// # futures::executor::block_on(async {
    /// let stop = AbortController::new();
    /// let token = stop.signal().cancellation_token();
    /// assert!(!token.is_cancelled());
    /// stop.abort("shutting down");
    /// assert!(token.is_cancelled(), "cancelled in the abort itself");
    /// token.cancelled().await;
    /// # });
    /// ```
    ///
    /// A timeout's token is cancelled when the time comes, though nobody awaits the signal:
    ///
    /// ```
    /// use std::time::Duration;
    /// use leasehold::AbortSignal;
    ///
    /// # futures::executor::block_on(async {
    /// let timeout = AbortSignal::timeout(Duration::from_millis(10));
    /// let token = timeout.cancellation_token();
    /// token.cancelled().await;
    /// assert!(timeout.is_aborted());
    /// # });
    /// ```
    pub fn cancellation_token(&self) -> CancellationToken {
        let token = CancellationToken::new();
        self.on_abort(Box::new(Cancels(token.clone())));
        if token.is_cancelled() {
            return token;
        }
        if let Some(looked_at) = self.looked_at() {
            let cancelled = token.clone().cancelled_owned();
            spawn_as(
                &*current_spawner(),
                "the look at a signal for its cancellation token",
                Box::pin(async move {
                    futures::future::select(looked_at, Box::pin(cancelled)).await;
                }),
            );
        }
        token
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "tokio-util")))]
impl AbortController {
    /// A tokio-util `CancellationToken` that is cancelled when this controller aborts, in the
    /// call that aborts it: [`AbortSignal::cancellation_token`] of its signal.
    ///
    /// # Examples
    ///
    /// ```
    /// use leasehold::AbortController;
    ///
    /// let stop = AbortController::new();
    /// let token = stop.cancellation_token();
    /// stop.abort("done");
    /// assert!(token.is_cancelled());
    /// assert_eq!(stop.signal().reason().unwrap().to_string(), "done", "the reason stays here");
    /// ```
    pub fn cancellation_token(&self) -> CancellationToken {
        self.signal().cancellation_token()
    }
}
