//! Where a manager's commands wait, and who serves them: the storage thread, or, where the
//! storage lets callers run it (SQLite), the caller who finds the worker free (invariants 6 to 8
//! of `mod.rs`).
//!
//! A command handed to the storage thread costs two thread round trips: the thread is woken to
//! pick it up, and it wakes the caller with the reply. On small virtual machines the two cost
//! more than a transaction. So a caller pushes its command here and, if no one serves the queue
//! now, serves it itself (`Desk::serve_here`): one batch of everything queued, its own command
//! among it, as the storage thread would have made it, on the caller's thread and without
//! waiting for anything (a transaction that would wait is handed back, unanswered, to the
//! storage thread). If someone serves the queue already, the command waits for them.
//!
//! Who serves is decided under the queue's lock, which also holds what the storage thread is
//! doing: so no command is left unserved (the no-lost-wake-up order). Whoever stops serving
//! looks at the queue under that lock: the storage thread serves on while anything is queued;
//! a caller, who serves one batch at most, rings the storage thread for what is left, if it
//! sleeps. The storage thread marks itself asleep, and listens, under the same lock, after a
//! last look at the queue; the bell is rung only for a sleeping thread, never for one that is
//! awake or spinning.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;
use std::time::Duration;

use crate::lock::backend::{callers_turn, CallersTurn};
use crate::sync::{lock, AtomicUsize, AtomicWaker, Event, Lockable, Mutex, Ordering};

/// Commands waiting to be served, who serves them, and what the storage thread is doing.
struct Queue<C> {
    commands: VecDeque<C>,
    /// The sender is gone.
    closed: bool,
    /// Someone holds the worker to serve the queue: the storage thread or a caller.
    serving: bool,
    /// The storage thread sleeps until the bell: whoever leaves work for it rings.
    asleep: bool,
    /// The storage thread waits for a caller to give the worker back (it has work of its own).
    wants_worker: bool,
    /// A caller's batch made the storage thread's own work due sooner than it planned.
    due_sooner: bool,
}

impl<C> Queue<C> {
    /// Whether there is something for the storage thread to serve.
    fn has_work(&self) -> bool {
        self.closed || !self.commands.is_empty()
    }
}

/// A manager's queue of commands (see the module documentation).
pub(crate) struct Inbox<C> {
    queue: Mutex<Queue<C>>,
    /// How many commands are queued, as of the last change: read without the lock by the
    /// storage thread while it spins.
    queued: AtomicUsize,
    /// Rung for a sleeping storage thread (see `Queue::asleep`).
    bell: Event,
    /// Woken by every push and by the close, for a worker that runs as a task (a simulated
    /// manager's) and awaits the queue.
    waker: std::sync::Arc<AtomicWaker>,
    /// The worker, for callers to serve themselves, where its storage lets them.
    desk: OnceLock<std::sync::Arc<dyn Desk>>,
}

/// The worker as callers reach it.
pub(crate) trait Desk: Send + Sync {
    /// Serves one batch of the queue on this thread; called only by the one who claimed the
    /// serving (`Queue::serving`). True if the storage thread is to be woken for its own work:
    /// a command handed back, its work due sooner than it sleeps, or the worker done or gone.
    fn serve_here(&self) -> bool;
}

/// What the storage thread and callers do with the worker (`Worker`, or a model's stand-in).
pub(crate) trait Work {
    /// The storage thread's step: serves a batch of what is queued, then its own work that is
    /// due. True once the worker is done (shut down, or the sender gone).
    fn step(&mut self) -> bool;
    /// How long the storage thread may sleep before its own work is due (`None`: until rung);
    /// asked, with the worker held, right before it stops serving.
    fn left(&mut self) -> Option<Duration>;
    /// Serves one batch of what is queued on a caller's thread, never waiting (see
    /// `callers_turn`); returns whether the storage thread is to be woken: a command handed
    /// back, its own work due sooner than it sleeps, or the worker done.
    fn serve_callers(&mut self) -> bool;
}

impl<C> Default for Inbox<C> {
    fn default() -> Self {
        Inbox {
            queue: Mutex::new(Queue {
                commands: VecDeque::new(),
                closed: false,
                serving: false,
                asleep: false,
                wants_worker: false,
                due_sooner: false,
            }),
            queued: AtomicUsize::new(0),
            bell: Event::new(),
            waker: std::sync::Arc::new(AtomicWaker::new()),
            desk: OnceLock::new(),
        }
    }
}

/// Who is to serve a command just queued.
enum Next {
    /// Someone serves the queue now, or the storage thread is awake and will look: nothing
    /// more to do.
    Served,
    /// The storage thread sleeps: ring it.
    Ring,
    /// This caller claimed the serving: it serves, then gives the serving up.
    ServeHere,
}

impl<C> Inbox<C> {
    fn note_len(&self, queue: &Queue<C>) {
        self.queued.store(queue.commands.len(), Ordering::SeqCst);
    }

    /// Queues `command`, and says who serves it; gives it back once the inbox is closed (the
    /// worker gone). `claim`: whether this caller may serve it itself.
    fn push(&self, command: C, claim: bool) -> Result<Next, C> {
        let next = {
            let mut queue = lock(&self.queue);
            if queue.closed {
                return Err(command);
            }
            queue.commands.push_back(command);
            self.note_len(&queue);
            if queue.serving {
                Next::Served
            } else if claim && !queue.due_sooner && !queue.wants_worker {
                // (After a hand-back, or while it waits for the worker, the storage thread
                // serves next: a stream of callers could otherwise keep it waiting.)
                queue.serving = true;
                Next::ServeHere
            } else if queue.asleep {
                Next::Ring
            } else {
                Next::Served
            }
        };
        self.waker.wake();
        Ok(next)
    }

    /// Queues `command` for the storage thread, and wakes it if it sleeps.
    pub(crate) fn send(&self, command: C) -> Result<(), C> {
        if let Next::Ring = self.push(command, false)? {
            self.ring();
        }
        Ok(())
    }

    /// Queues `command`, then serves one batch of the queue on this thread if no one serves it
    /// now and the storage lets callers; else as `send`.
    pub(crate) fn run(&self, command: C) -> Result<(), C> {
        // Not from a drop during a panic, nor from inside a turn already (a guard dropped by
        // what a batch's replies released): the one serving now serves it.
        let desk = self
            .desk
            .get()
            .filter(|_| !std::thread::panicking() && !callers_turn());
        match (self.push(command, desk.is_some())?, desk) {
            (Next::ServeHere, Some(desk)) => {
                let wake = desk.serve_here();
                self.give_up_serving(wake);
            }
            (Next::Ring, _) => self.ring(),
            _ => {}
        }
        Ok(())
    }

    /// A caller stops serving: it rings the storage thread if it sleeps and anything is left
    /// for it (commands, or `wake`: its own work due sooner, or the worker done).
    fn give_up_serving(&self, wake: bool) {
        let ring = {
            let mut queue = lock(&self.queue);
            queue.serving = false;
            queue.due_sooner |= wake;
            queue.asleep && (queue.has_work() || queue.due_sooner || queue.wants_worker)
        };
        if ring {
            self.ring();
        }
    }

    fn ring(&self) {
        self.bell.notify(usize::MAX);
    }

    /// The sender is gone: nothing more is queued, and the worker is woken to end.
    pub(crate) fn close(&self) {
        let ring = {
            let mut queue = lock(&self.queue);
            queue.closed = true;
            queue.asleep
        };
        if ring {
            self.ring();
        }
        self.waker.wake();
    }

    /// The worker is gone: closes the inbox, and drops what is queued unserved (their callers
    /// see the worker gone).
    pub(crate) fn shut(&self) {
        let unserved = {
            let mut queue = lock(&self.queue);
            queue.closed = true;
            let unserved = std::mem::take(&mut queue.commands);
            self.note_len(&queue);
            unserved
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
        self.note_len(&queue);
        n == 0 && queue.closed
    }

    /// Puts `commands` back at the head of the queue, in their order: handed back unserved.
    pub(crate) fn put_back(&self, commands: Vec<C>) {
        let mut queue = lock(&self.queue);
        for command in commands.into_iter().rev() {
            queue.commands.push_front(command);
        }
        self.note_len(&queue);
    }

    /// Whether there is something to serve: a command, or the sender gone.
    pub(crate) fn has_work(&self) -> bool {
        lock(&self.queue).has_work()
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
        // Free: whoever serves holds it, and the storage thread lets go of it before it gives
        // up the serving. Held all the same (the storage thread dropping the worker at its
        // end), the thread is woken.
        let Some(mut seat) = self.try_lock_free() else {
            return true;
        };
        let Some(worker) = seat.as_mut() else {
            return true;
        };
        let turn = CallersTurn::begin();
        let served = std::panic::catch_unwind(AssertUnwindSafe(|| worker.serve_callers()));
        drop(turn);
        match served {
            Ok(wake) => wake,
            Err(_) => {
                // Its state is not to be trusted: the worker ends here, as it would on its
                // thread, and every caller waiting on it hears that it is gone.
                tracing::error!("the storage worker panicked serving a caller's batch; it stops");
                *seat = None;
                true
            }
        }
    }
}

/// The storage thread's loop: serves the worker in `seat`, in turn with callers that claim it,
/// sleeping between steps until rung or its own work is due, and telling `asleep` when it
/// sleeps (`true`) and wakes. `spin`: whether to look for commands a while before sleeping
/// (where callers do not serve themselves). Returns once the worker is done, or gone (it
/// panicked); the worker is dropped in the seat, on this thread, either way.
pub(crate) fn serve_on_this_thread<C, W: Work>(
    inbox: &Inbox<C>,
    seat: &Mutex<Option<W>>,
    spin: bool,
    asleep: impl Fn(bool),
) {
    let mut spin = Spin::new(spin);
    loop {
        // Claim the serving, or wait for the caller who has it to give it back.
        if let Err(listener) = claim(inbox) {
            asleep(true);
            wait(listener, None);
            asleep(false);
            continue;
        }
        // Serve while anything is queued.
        loop {
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
            drop(guard);
            let mut queue = lock(&inbox.queue);
            if !queue.has_work() {
                queue.serving = false;
                break;
            }
        }
        if spin.until_work(inbox) {
            continue;
        }
        // How long to sleep, asked of the worker; then a last look, and sleep: a command queued
        // after it, or a caller's batch that makes the thread's work due sooner, rings the bell
        // it listens to.
        if claim(inbox).is_err() {
            // A caller serves: it rings if it leaves work for this thread (it asks `left` again
            // when it wakes).
            continue;
        }
        let left = match lock(seat).as_mut() {
            Some(worker) => worker.left(),
            None => return,
        };
        let listener = {
            let mut queue = lock(&inbox.queue);
            queue.serving = false;
            if queue.has_work() || std::mem::take(&mut queue.due_sooner) {
                continue;
            }
            queue.asleep = true;
            inbox.bell.listen()
        };
        asleep(true);
        wait(listener, left);
        asleep(false);
    }
}

/// Claims the serving for the storage thread; if a caller has it, marks the thread as waiting
/// for it, asleep, and gives the listener to wait on.
fn claim<C>(inbox: &Inbox<C>) -> Result<(), crate::sync::EventListener> {
    let mut queue = lock(&inbox.queue);
    queue.asleep = false;
    if queue.serving {
        queue.wants_worker = true;
        queue.asleep = true;
        Err(inbox.bell.listen())
    } else {
        // What a caller's batch made due is done by the step this claim is for.
        queue.serving = true;
        queue.wants_worker = false;
        queue.due_sooner = false;
        Ok(())
    }
}

/// How long the storage thread keeps looking for the next command before it sleeps.
#[cfg(not(leasehold_loom))]
const SPIN: Duration = Duration::from_micros(100);

/// Right after a step, callers often send again at once (release after acquire, the next
/// request of a busy task), and waking a sleeping thread costs tens of microseconds on small
/// virtual machines, more than a transaction: so where callers do not serve themselves, the
/// storage thread looks for a while before it sleeps, at the count of queued commands, without
/// the lock. This spends its own time, never a caller's.
struct Spin {
    #[cfg(not(leasehold_loom))]
    run: Option<crate::schedule::ScheduleRun>,
}

impl Spin {
    #[cfg(not(leasehold_loom))]
    fn new(spin: bool) -> Spin {
        let schedule = crate::schedule::Schedule::spaced(Duration::ZERO).up_to(SPIN);
        Spin {
            run: spin.then(|| schedule.start(Duration::ZERO)),
        }
    }

    /// Looks for work for up to [`SPIN`]; true if it came.
    #[cfg(not(leasehold_loom))]
    fn until_work<C>(&mut self, inbox: &Inbox<C>) -> bool {
        use crate::clock::{Clock, SystemClock};
        let Some(run) = self.run.as_mut() else {
            return false;
        };
        run.reset(SystemClock.monotonic());
        loop {
            if inbox.queued.load(Ordering::SeqCst) > 0 {
                return true;
            }
            match run.next(SystemClock.monotonic()) {
                Some(_) => std::thread::yield_now(),
                None => return false,
            }
        }
    }

    /// Under the model, never: the bell is what is explored.
    #[cfg(leasehold_loom)]
    fn new(_: bool) -> Spin {
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
            thread::spawn(move || serve_on_this_thread(&inbox, &*seat, false, |_| {}))
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
