//! Where a manager's commands wait, and who serves them: the storage thread, or, where the
//! storage lets callers run it (SQLite), the caller who finds the worker free (invariants 6 to 8
//! of `mod.rs`).
//!
//! A command reaches the worker through a thread round trip: the storage thread is woken to
//! pick it up, and it wakes the caller with the reply. On small virtual machines the two cost
//! more than the transaction itself. So a caller pushes its command here, then tries to take
//! the worker (`Desk::serve_here`): if no one holds it, the caller serves everything queued, its
//! own command among it, in one batch, as the storage thread would have, on its own thread and
//! without waiting for anything (a transaction that would wait is handed back, unanswered, to the
//! storage thread). If someone holds it, the caller rings the bell, and whoever holds it or the
//! storage thread serves the command.
//!
//! No command is left unserved (the no-lost-wake-up order): a sender pushes, then either serves
//! or rings; the storage thread listens for the bell, then looks at the queue once more, then
//! sleeps. So a command pushed after that look rings a listener already there.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;
use std::time::Duration;

use crate::lock::backend::{callers_turn, CallersTurn};
use crate::sync::{lock, AtomicWaker, Event, Lockable, Mutex};

/// Commands waiting to be served, and whether their sender is gone.
struct Queue<C> {
    commands: VecDeque<C>,
    closed: bool,
}

/// A manager's queue of commands (see the module documentation).
pub(crate) struct Inbox<C> {
    queue: Mutex<Queue<C>>,
    /// Rung for the storage thread: a command no caller served, the sender gone, or work of
    /// its own that a caller's batch made due sooner.
    bell: Event,
    /// Woken by every push and by the close, for a worker that runs as a task (a simulated
    /// manager's) and awaits the queue.
    waker: std::sync::Arc<AtomicWaker>,
    /// The worker, for callers to serve themselves, where its storage lets them.
    desk: OnceLock<std::sync::Arc<dyn Desk>>,
}

/// The worker as callers reach it: held in a mutex that the storage thread and callers take in
/// turn.
pub(crate) trait Desk: Send + Sync {
    /// Serves the queued commands on this thread, if no one holds the worker now. False if it
    /// could not (held, or gone), or if the storage thread is to be woken for what remains.
    fn serve_here(&self) -> bool;
}

/// What the storage thread and callers do with the worker (`Worker`, or a model's stand-in).
pub(crate) trait Work {
    /// The storage thread's step: serves what is queued, then its own work that is due. True
    /// once the worker is done (shut down, or the sender gone).
    fn step(&mut self) -> bool;
    /// How long the storage thread may sleep before its own work is due (`None`: until rung);
    /// asked, with the worker held, right before it sleeps.
    fn left(&mut self) -> Option<Duration>;
    /// Serves what is queued on a caller's thread, never waiting (see `Turn`); returns whether
    /// the storage thread is to be woken: a command handed back, its own work due sooner than
    /// it sleeps, or the worker done.
    fn serve_callers(&mut self) -> bool;
}

impl<C> Default for Inbox<C> {
    fn default() -> Self {
        Inbox {
            queue: Mutex::new(Queue {
                commands: VecDeque::new(),
                closed: false,
            }),
            bell: Event::new(),
            waker: std::sync::Arc::new(AtomicWaker::new()),
            desk: OnceLock::new(),
        }
    }
}

impl<C> Inbox<C> {
    /// Queues `command`; gives it back once the inbox is closed (the worker gone).
    pub(crate) fn push(&self, command: C) -> Result<(), C> {
        {
            let mut queue = lock(&self.queue);
            if queue.closed {
                return Err(command);
            }
            queue.commands.push_back(command);
        }
        self.waker.wake();
        Ok(())
    }

    /// Queues `command` for the storage thread, and wakes it.
    pub(crate) fn send(&self, command: C) -> Result<(), C> {
        self.push(command)?;
        self.ring();
        Ok(())
    }

    /// Queues `command`, then serves the queue on this thread if the worker is free and lets
    /// callers; else wakes the storage thread, as `send`.
    pub(crate) fn run(&self, command: C) -> Result<(), C> {
        self.push(command)?;
        if !self.desk.get().is_some_and(|desk| desk.serve_here()) {
            self.ring();
        }
        Ok(())
    }

    /// Wakes the storage thread.
    pub(crate) fn ring(&self) {
        self.bell.notify(usize::MAX);
    }

    /// The sender is gone: nothing more is queued, and the worker is woken to end.
    pub(crate) fn close(&self) {
        lock(&self.queue).closed = true;
        self.ring();
        self.waker.wake();
    }

    /// The worker is gone: closes the inbox, and drops what is queued unserved (their callers
    /// see the worker gone).
    pub(crate) fn shut(&self) {
        let unserved = {
            let mut queue = lock(&self.queue);
            queue.closed = true;
            std::mem::take(&mut queue.commands)
        };
        drop(unserved);
        self.waker.wake();
    }

    /// Takes up to `max` commands, in order, into `into`; true if none was queued and the
    /// sender is gone.
    pub(crate) fn take(&self, max: usize, into: &mut Vec<C>) -> bool {
        let mut queue = lock(&self.queue);
        let n = queue.commands.len().min(max);
        into.extend(queue.commands.drain(..n));
        n == 0 && queue.closed
    }

    /// Puts `commands` back at the head of the queue, in their order: handed back unserved.
    pub(crate) fn put_back(&self, commands: Vec<C>) {
        let mut queue = lock(&self.queue);
        for command in commands.into_iter().rev() {
            queue.commands.push_front(command);
        }
    }

    /// Whether there is something to serve: a command, or the sender gone.
    pub(crate) fn has_work(&self) -> bool {
        let queue = lock(&self.queue);
        queue.closed || !queue.commands.is_empty()
    }

    /// Where a worker that runs as a task registers to be woken by the next push or close.
    #[cfg_attr(not(feature = "testkit"), allow(dead_code))]
    pub(crate) fn waker(&self) -> &std::sync::Arc<AtomicWaker> {
        &self.waker
    }

    /// Lets callers serve the queue themselves through `desk`, from now on.
    pub(crate) fn open_desk(&self, desk: std::sync::Arc<dyn Desk>) {
        let _ = self.desk.set(desk);
    }
}

impl<W: Work + Send> Desk for Mutex<Option<W>> {
    fn serve_here(&self) -> bool {
        // Not from a drop during a panic, nor from inside a turn already (a guard dropped by
        // what a batch's replies released): the storage thread serves those.
        if std::thread::panicking() || callers_turn() {
            return false;
        }
        let Some(mut seat) = self.try_lock_free() else {
            return false;
        };
        let Some(worker) = seat.as_mut() else {
            return false;
        };
        let turn = CallersTurn::begin();
        let served = std::panic::catch_unwind(AssertUnwindSafe(|| worker.serve_callers()));
        drop(turn);
        match served {
            Ok(wake) => !wake,
            Err(_) => {
                // Its state is not to be trusted: the worker ends here, as it would on its
                // thread, and every caller waiting on it hears that it is gone.
                tracing::error!("the storage worker panicked serving a caller's batch; it stops");
                *seat = None;
                false
            }
        }
    }
}

/// The storage thread's loop: serves the worker in `seat` while callers may take it in turn,
/// sleeping between steps until rung or its own work is due, and telling `asleep` when it
/// sleeps (`true`) and wakes. Returns once the worker is done, or gone (it panicked); the worker
/// is dropped in the seat, on this thread, either way.
pub(crate) fn serve_on_this_thread<C, W: Work>(
    inbox: &Inbox<C>,
    seat: &Mutex<Option<W>>,
    asleep: impl Fn(bool),
) {
    let mut spin = Spin::new();
    loop {
        let (listener, left) = {
            let mut guard = lock(seat);
            let Some(worker) = guard.as_mut() else {
                return;
            };
            match std::panic::catch_unwind(AssertUnwindSafe(|| worker.step())) {
                Ok(false) => {}
                Ok(true) => {
                    *guard = None;
                    return;
                }
                Err(_) => {
                    tracing::error!("the storage worker panicked; it stops");
                    *guard = None;
                    return;
                }
            }
            // Listening before the last look at the queue: a command pushed after it rings.
            let listener = inbox.bell.listen();
            if inbox.has_work() {
                continue;
            }
            (listener, worker.left())
        };
        if spin.until_work(inbox) {
            continue;
        }
        asleep(true);
        wait(listener, left);
        asleep(false);
    }
}

/// How long the storage thread keeps looking for the next command before it sleeps.
#[cfg(not(leasehold_loom))]
const SPIN: Duration = Duration::from_micros(100);

/// Right after a step, callers often send again at once (release after acquire, the next
/// request of a busy task), and waking a sleeping thread costs tens of microseconds on small
/// virtual machines, more than a transaction: so the storage thread looks for a while before it
/// sleeps (without holding the worker, which callers may take meanwhile). This spends its own
/// time, never a caller's.
struct Spin {
    #[cfg(not(leasehold_loom))]
    run: crate::schedule::ScheduleRun,
}

impl Spin {
    #[cfg(not(leasehold_loom))]
    fn new() -> Spin {
        let schedule = crate::schedule::Schedule::spaced(Duration::ZERO).up_to(SPIN);
        Spin {
            run: schedule.start(Duration::ZERO),
        }
    }

    /// Looks for work for up to [`SPIN`]; true if it came.
    #[cfg(not(leasehold_loom))]
    fn until_work<C>(&mut self, inbox: &Inbox<C>) -> bool {
        use crate::clock::{Clock, SystemClock};
        self.run.reset(SystemClock.monotonic());
        loop {
            if inbox.has_work() {
                return true;
            }
            match self.run.next(SystemClock.monotonic()) {
                Some(_) => std::thread::yield_now(),
                None => return false,
            }
        }
    }

    /// Under the model, never: the bell is what is explored.
    #[cfg(leasehold_loom)]
    fn new() -> Spin {
        Spin {}
    }

    #[cfg(leasehold_loom)]
    fn until_work<C>(&mut self, _: &Inbox<C>) -> bool {
        false
    }
}

/// Sleeps until `listener` hears the bell, or for `left` if given.
#[cfg(not(leasehold_loom))]
fn wait(listener: event_listener::EventListener, left: Option<Duration>) {
    use event_listener::Listener;
    match left {
        Some(left) => {
            let _ = listener.wait_timeout(left);
        }
        None => listener.wait(),
    }
}

/// Under the model, until the bell (its work never comes due by time).
#[cfg(leasehold_loom)]
fn wait(listener: crate::sync::EventListener, _: Option<Duration>) {
    loom::future::block_on(listener);
}

/// Model checks (loom, `--cfg leasehold_loom`) of who serves a command: callers who find the
/// worker free, the storage thread otherwise, and the batches handed back. A stand-in worker
/// records what it served; every interleaving must serve each command once, each sender's in
/// its order, and leave none queued (a lost wake-up would leave the storage thread asleep, which
/// loom reports as a deadlock).
#[cfg(all(test, leasehold_loom))]
mod model {
    use super::*;
    use loom::thread;
    use std::sync::Arc;

    /// Who served a command.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum By {
        Caller,
        Thread,
    }

    struct Stand {
        inbox: Arc<Inbox<u32>>,
        served: Arc<Mutex<Vec<(u32, By)>>>,
        /// Caller's turns still to refuse (as a busy database is): their batch is handed back.
        refuse: usize,
    }

    impl Work for Stand {
        fn step(&mut self) -> bool {
            let mut batch = Vec::new();
            let gone = self.inbox.take(usize::MAX, &mut batch);
            let mut served = lock(&*self.served);
            served.extend(batch.into_iter().map(|c| (c, By::Thread)));
            gone
        }

        fn left(&mut self) -> Option<Duration> {
            None
        }

        fn serve_callers(&mut self) -> bool {
            // One command at a time, as a batch cut short would leave the rest queued.
            let mut batch = Vec::new();
            self.inbox.take(1, &mut batch);
            if self.refuse > 0 && !batch.is_empty() {
                self.refuse -= 1;
                self.inbox.put_back(batch);
                return true;
            }
            let mut served = lock(&*self.served);
            served.extend(batch.into_iter().map(|c| (c, By::Caller)));
            self.inbox.has_work()
        }
    }

    /// Two callers run two commands each (10, 11 and 20, 21) while the storage thread serves;
    /// `refuse` caller's turns are handed back. Returns what was served, in order.
    fn run_two_callers(refuse: usize) -> Vec<(u32, By)> {
        let inbox = Arc::new(Inbox::<u32>::default());
        let served = Arc::new(Mutex::new(Vec::new()));
        let seat = Arc::new(Mutex::new(Some(Stand {
            inbox: inbox.clone(),
            served: served.clone(),
            refuse,
        })));
        inbox.open_desk(seat.clone());
        let thread = {
            let (inbox, seat) = (inbox.clone(), seat.clone());
            thread::spawn(move || serve_on_this_thread(&inbox, &*seat, |_| {}))
        };
        let caller = {
            let inbox = inbox.clone();
            thread::spawn(move || {
                inbox.run(10).unwrap();
                inbox.run(11).unwrap();
            })
        };
        inbox.run(20).unwrap();
        inbox.run(21).unwrap();
        caller.join().unwrap();
        inbox.close();
        thread.join().unwrap();
        assert!(lock(&*seat).is_none(), "the worker outlived its thread");
        let served = lock(&*served).clone();
        served
    }

    fn check(served: &[(u32, By)]) {
        let order: Vec<u32> = served.iter().map(|(c, _)| *c).collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [10, 11, 20, 21], "served {order:?}");
        let at = |c: u32| order.iter().position(|&o| o == c);
        assert!(
            at(10) < at(11) && at(20) < at(21),
            "out of order: {order:?}"
        );
    }

    fn model(test: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(3);
        }
        builder.check(test);
    }

    #[test]
    fn loom_every_command_is_served_once_in_order_by_a_caller_or_the_thread() {
        model(|| check(&run_two_callers(0)));
    }

    /// A caller's turn refused (the database busy): its command goes back to the head of the
    /// queue, and is still served, before anything sent after it.
    #[test]
    fn loom_a_batch_handed_back_is_served_before_what_came_after_it() {
        model(|| check(&run_two_callers(1)));
    }
}
