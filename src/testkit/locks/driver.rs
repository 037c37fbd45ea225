//! The simulation's driver of a lock worker: the worker's own step (`Worker::step`), as the
//! storage thread drives it (`Worker::run`), but awaited as a task of the simulation instead of
//! blocking a thread, and stopped or killed as a process is.
//!
//! Invariants:
//!
//! 1. The driver awaits the next command (woken by every send through the waker the manager
//!    was prepared with) or the worker's next deadline on the simulation's clock, never both
//!    missed and never spinning: each wait registers the waker before it looks.
//! 2. A kill ends the driver at once, whatever it awaits, deleting nothing, as a killed process
//!    does; the worker is dropped without its close.
//! 3. While stopped, the driver sleeps on the simulation's clock until the stop ends (a kill
//!    meanwhile still ends it at once), then goes on with whatever queued up.

use std::future::poll_fn;
use std::pin::pin;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::task::Poll;

use futures::future::{select, Either};
use futures::task::AtomicWaker;

use crate::clock::Clock;
use crate::lock::backend::Storage;
use crate::lock::worker::Worker;

use super::history::LockEvent;
use super::Attached;

/// Drives `worker` until its manager is gone (every handle dropped, or shut down) or killed.
pub(crate) async fn drive<S: Storage>(
    mut worker: Worker<S>,
    clock: Arc<dyn Clock>,
    waker: Arc<AtomicWaker>,
    attached: Arc<Attached>,
) {
    let control = attached.control.clone();
    loop {
        if control.killed() {
            return;
        }
        if let Some(left) = control.stopped_for(clock.monotonic()) {
            let sleep = clock.sleep(left);
            let killed = poll_fn(|cx| {
                waker.register(cx.waker());
                if control.killed() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            });
            select(sleep, pin!(killed)).await;
            continue;
        }
        let left = worker.left();
        let (worker_ref, waker_ref, control_ref) = (&mut worker, &waker, &control);
        let next = poll_fn(move |cx| {
            waker_ref.register(cx.waker());
            if control_ref.killed() {
                return Poll::Ready(Err(RecvTimeoutError::Disconnected));
            }
            match worker_ref.next_now() {
                Some(received) => Poll::Ready(received),
                None => Poll::Pending,
            }
        });
        let received = match left {
            Some(left) => match select(pin!(next), clock.sleep(left)).await {
                Either::Left((received, _)) => received,
                Either::Right(((), _)) => Err(RecvTimeoutError::Timeout),
            },
            None => next.await,
        };
        if control.killed() {
            return;
        }
        if worker.step(received) {
            attached.record(LockEvent::Ended {
                owner: attached.owner.clone(),
            });
            return;
        }
    }
}
