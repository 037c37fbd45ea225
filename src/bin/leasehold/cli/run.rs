//! `leasehold run`: COMMAND under a lock; and the machinery `elect` shares, which runs COMMAND
//! under whatever it holds (`Held`: a lock, or a leadership), taken by a `take` of its own
//! (`under_lease`).
//!
//! The order of things, and why:
//!
//! 1. The signals are caught before anything else, so that one that comes while the lock is
//!    being opened or waited for is never the default (which would kill this process and leave
//!    a waiting row to lapse).
//! 2. Waiting is an interruptible acquisition: a signal aborts it, and the acquisition's own
//!    clean-up removes the waiting row before it reports; only then does this process exit.
//! 3. COMMAND is spawned only once the lock is held, with the guard's fencing token, and not at
//!    all if a signal came meanwhile. Off a terminal it leads a process group of its own (as
//!    under `timeout(1)`), so that what it starts is signalled with it; on a terminal it stays
//!    in the foreground group, to read the terminal and hear Ctrl-C. A thread waits for it to
//!    end without reaping it, so that its pid names it for as long as it may be signalled.
//! 4. A signal sent to this process (by `kill`, a supervisor) is sent on to COMMAND's group (or,
//!    on a terminal, to COMMAND). One the terminal sent (Ctrl-C) went to COMMAND already, as to
//!    every process of the foreground group, and is not sent twice.
//! 5. A lost lease ends COMMAND (SIGTERM, then SIGKILL after `--grace`), with its group off a
//!    terminal (`elect`'s a heartbeat before the lease would run out: `Held::lost`); the rows
//!    are not released on anyone's behalf (they are gone, or lapsed and another may hold them
//!    now).
//! 6. This process dying, however (SIGKILL included, which it cannot catch), ends COMMAND at
//!    once with SIGKILL, and off a terminal COMMAND's group: on Linux, by a death signal and a
//!    watcher set up before COMMAND's program starts (`lifeline.rs`, which says why SIGKILL and
//!    what is not covered: on a terminal, what COMMAND started; other platforms).
//! 7. A wait ended by an operator's removal (`leasehold release`) runs nothing: it says who
//!    removed it and exits 5, without queueing again.

use std::future::Future;
use std::io::IsTerminal;
use std::os::unix::process::CommandExt;
use std::pin::pin;
use std::process::Stdio;
use std::time::Duration;

use futures::future::FusedFuture;
use futures::FutureExt;
use signal_hook::consts::{SIGHUP, SIGINT, SIGKILL, SIGTERM};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;
use signal_hook::low_level::siginfo::Cause;

use super::args::{Run, StoreArgs};
use super::store_failed;
use leasehold::{AbortController, AbortReason, AbortSignal};
use leasehold::{Guard, Leadership, LockError, LockManager, LockRequest};

/// The exit code when the lease was lost while COMMAND ran.
const LEASE_LOST: u8 = 4;

/// The exit code when an operator removed the waiting request (`leasehold release`): COMMAND
/// never ran.
const REMOVED: u8 = 5;

/// The shortest lease `--lease` takes: renewed every third of it, a heartbeat of 100 ms.
const MIN_LEASE: Duration = Duration::from_millis(300);

/// A signal that came, and whether a process sent it (rather than the terminal, to the whole
/// foreground group).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caught {
    signal: i32,
    sent: bool,
}

/// The signals caught: SIGINT, SIGTERM and SIGHUP.
pub(crate) type Signals = smol::channel::Receiver<Caught>;

/// Why the acquisition was interrupted: a signal.
#[derive(Debug)]
struct Signalled(i32);

impl std::fmt::Display for Signalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", signal_name(self.0))
    }
}

impl std::error::Error for Signalled {}

pub(crate) fn run(args: Run) -> u8 {
    let operation = args.operation.clone().unwrap_or_else(|| {
        let program = std::path::Path::new(&args.command[0]);
        (program.file_name()).map_or(args.command[0].clone(), |name| {
            name.to_string_lossy().into_owned()
        })
    });
    let request = match (args.limit, args.count.unwrap_or(1)) {
        (Some(limit), count) if count > limit => {
            eprintln!("leasehold: --count {count} is more than --limit {limit}");
            return super::USAGE;
        }
        (Some(limit), count) => LockRequest::permits(args.key.as_str(), operation, count, limit),
        (None, _) if args.shared => LockRequest::shared(args.key.as_str(), operation),
        (None, _) => LockRequest::exclusive(args.key.as_str(), operation),
    };
    let job = Job {
        key: &args.key,
        command: &args.command,
        grace: args.grace,
    };
    under_lease(&args.store, args.lease, &job, async |locks, signals| {
        take(locks, request, &args, &job, signals).await
    })
}

/// What `run` and `elect` have in common: COMMAND, run on KEY, and how long it has between
/// SIGTERM and SIGKILL once its lease is lost.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Job<'a> {
    pub(crate) key: &'a str,
    pub(crate) command: &'a [String],
    pub(crate) grace: Duration,
}

/// What COMMAND runs under.
#[derive(Debug)]
pub(crate) enum Held {
    /// `run`'s lock: COMMAND is told (SIGTERM) when the lease is lost.
    Lock(Guard),
    /// `elect`'s leadership: COMMAND is told `margin` (a heartbeat) before the lease would run
    /// out with no renewal back, or as soon as it is lost, so that it can stop before another
    /// campaigner can lead.
    Leadership {
        leadership: Leadership,
        margin: Duration,
    },
}

impl Held {
    fn guard(&self) -> &Guard {
        match self {
            Held::Lock(guard) => guard,
            Held::Leadership { leadership, .. } => leadership.guard(),
        }
    }

    /// Aborted when COMMAND must stop.
    fn lost(&self) -> AbortSignal {
        match self {
            Held::Lock(guard) => guard.lost(),
            Held::Leadership { leadership, margin } => leadership.guard().lost_within(*margin),
        }
    }

    /// COMMAND's environment beside what it inherits.
    fn env(&self, locks: &LockManager, key: &str) -> Vec<(&'static str, String)> {
        let token = self.guard().fencing_token().to_string();
        let mut env = vec![
            ("LEASEHOLD_FENCING_TOKEN", token.clone()),
            ("LEASEHOLD_KEY", key.to_owned()),
            ("LEASEHOLD_OWNER", locks.owner_id().to_owned()),
        ];
        if let Held::Leadership { .. } = self {
            env.push(("LEASEHOLD_TERM", token));
        }
        env
    }

    /// Releases the lock, or resigns the leadership.
    async fn release(self) -> Result<(), LockError> {
        match self {
            Held::Lock(guard) => guard.release().await,
            Held::Leadership { leadership, .. } => leadership.resign().await,
        }
    }
}

/// COMMAND's whole life under a lease of `lease` on the store `store` names: catches the
/// signals, opens the store, takes the lock or leadership with `take` (which says why not, and
/// gives the exit code), runs COMMAND under it, and lets the store go; the exit code.
pub(crate) fn under_lease(
    store: &StoreArgs,
    lease: Duration,
    job: &Job<'_>,
    take: impl AsyncFnOnce(&LockManager, &Signals) -> Result<Held, u8>,
) -> u8 {
    let signals = match catch_signals() {
        Ok(signals) => signals,
        Err(error) => {
            eprintln!("leasehold: cannot catch signals: {error}");
            return super::USAGE;
        }
    };
    if lease < MIN_LEASE {
        eprintln!("leasehold: --lease must be at least 300ms");
        return super::USAGE;
    }
    let store = match store.parse() {
        Ok(store) => store,
        Err(code) => return code,
    };
    smol::block_on(async {
        let builder = LockManager::builder().lease(lease).heartbeat(lease / 3);
        // Opening may take a while (a server that does not answer yet): a signal ends it.
        let opened = futures::select_biased! {
            caught = signals.recv().fuse() => match caught {
                Ok(caught) => return 128 + caught.signal as u8,
                Err(_) => None,
            },
            opened = store.open(builder).fuse() => Some(opened),
        };
        let locks = match opened {
            Some(Ok(locks)) => locks,
            Some(Err(error)) => return store_failed(&error),
            None => return super::USAGE,
        };
        let code = match take(&locks, &signals).await {
            Ok(held) => hold(&locks, held, job, &signals).await,
            Err(code) => code,
        };
        // Whatever is left (nothing, after a release or a clean wait) goes with the owner.
        let _ = locks.shutdown().await;
        code
    })
}

/// The lock, or the exit code of why not.
async fn take(
    locks: &LockManager,
    request: LockRequest,
    args: &Run,
    job: &Job<'_>,
    signals: &Signals,
) -> Result<Held, u8> {
    let key = request.key.clone();
    if args.no_wait {
        return match locks.try_acquire(request).await {
            Ok(Some(guard)) => Ok(Held::Lock(guard)),
            Ok(None) => {
                eprintln!("leasehold: {key:?} is held; not waiting (-n)");
                Err(args.conflict_exit_code)
            }
            Err(error) => Err(store_failed(&error)),
        };
    }
    // A `-w` shorter than one acquisition takes (`0s`, as flock(1) reads it: do not wait)
    // must never report a free key as held: an attempt that does not wait comes first, and
    // only a key it finds held is waited for, with what is left of the wait.
    let started = std::time::Instant::now();
    let mut left = None;
    if let Some(wait) = args.wait {
        match locks.try_acquire(request.clone()).await {
            Ok(Some(guard)) => return Ok(Held::Lock(guard)),
            Ok(None) => {}
            Err(error) => return Err(store_failed(&error)),
        }
        let rest = wait.saturating_sub(started.elapsed());
        if rest.is_zero() {
            let waited = super::show_duration(wait);
            eprintln!("leasehold: {key:?} is held; gave up after {waited} (-w)");
            return Err(args.conflict_exit_code);
        }
        left = Some(rest);
    }
    let interrupt = AbortController::new();
    let mut acquiring = locks.acquire(request).with_signal(&interrupt.signal());
    if let Some(left) = left {
        acquiring = acquiring.timeout(left);
    }
    let conflict = args.wait.map(|wait| (wait, args.conflict_exit_code));
    wait_for(
        acquiring.map(|outcome| outcome.map(Held::Lock)),
        &interrupt,
        job,
        conflict,
        signals,
    )
    .await
}

/// Awaits `acquiring`, an acquisition or a campaign to which `interrupt`'s signal is attached:
/// what it was granted, or the exit code of why not, said on standard error. A signal that comes
/// meanwhile interrupts it (its clean-up removes its waiting row before it resolves); one that
/// comes as it is granted lets the grant go at once. With `conflict` (`-w`'s wait, and the
/// conflict code), an acquisition interrupted by nothing else ran out of its wait.
pub(crate) async fn wait_for(
    acquiring: impl Future<Output = Result<Held, LockError>>,
    interrupt: &AbortController,
    job: &Job<'_>,
    conflict: Option<(Duration, u8)>,
    signals: &Signals,
) -> Result<Held, u8> {
    let key = job.key;
    let mut acquiring = pin!(acquiring.fuse());
    let mut signal = None;
    let outcome = loop {
        futures::select_biased! {
            caught = signals.recv().fuse() => {
                if let Ok(caught) = caught {
                    // The acquisition cleans up (its waiting row goes) before it resolves.
                    signal.get_or_insert(caught.signal);
                    interrupt.abort(AbortReason::new(Signalled(caught.signal)));
                }
            }
            outcome = acquiring => break outcome,
        }
    };
    match (outcome, signal) {
        (Ok(held), None) => Ok(held),
        (Ok(held), Some(signal)) => {
            // Granted as the signal came: let it go at once.
            let _ = held.release().await;
            Err(128 + signal as u8)
        }
        (Err(_), Some(signal)) => {
            eprintln!(
                "leasehold: {} while waiting for {key:?}; left the queue",
                signal_name(signal)
            );
            Err(128 + signal as u8)
        }
        (Err(error), None) => match (error, conflict) {
            (LockError::Interrupted(_), Some((wait, code))) => {
                let waited = super::show_duration(wait);
                eprintln!("leasehold: {key:?} is held; gave up after {waited} (-w)");
                Err(code)
            }
            (LockError::Removed { by }, _) => {
                eprintln!(
                    "leasehold: {} removed this request while it waited for {key:?}; not \
                     running {:?}",
                    super::printable(&by),
                    job.command[0]
                );
                Err(REMOVED)
            }
            (error, _) => Err(store_failed(&error)),
        },
    }
}

/// Runs COMMAND while `held` holds; the exit code.
async fn hold(locks: &LockManager, held: Held, job: &Job<'_>, signals: &Signals) -> u8 {
    // A signal that came while the lock was being taken (with `-n`, or as it was granted) is
    // for this process: nothing has run yet, so nothing runs.
    if let Ok(caught) = signals.try_recv() {
        let _ = held.release().await;
        eprintln!(
            "leasehold: {}; not running {:?}",
            signal_name(caught.signal),
            job.command[0]
        );
        return 128 + caught.signal as u8;
    }
    // Off a terminal (a script, cron, CI), COMMAND leads a process group of its own, as under
    // `timeout(1)`, so that a lost lease ends everything it started. On a terminal it stays in
    // the foreground group, where it can read the terminal and hears Ctrl-C itself; a lost
    // lease then signals COMMAND alone.
    let own_group = !std::io::stdin().is_terminal();
    let mut command = std::process::Command::new(&job.command[0]);
    command
        .args(&job.command[1..])
        .envs(held.env(locks, job.key))
        .stdin(Stdio::inherit());
    if own_group {
        command.process_group(0);
    }
    // COMMAND (and off a terminal its group) dies with this process, however it dies (see
    // `lifeline.rs`). The kernel's death signal follows the thread that forks: this is the
    // main thread, which lives as long as the process, as `run` runs this future on the thread
    // that called it (`smol::block_on`, no executor threads) and `cli::main` calls `run` from
    // the binary's `main`.
    let lifeline = super::lifeline::Lifeline::attach(&mut command, own_group);
    let spawned = lifeline.and_then(|lifeline| match command.spawn() {
        Ok(child) => Ok((child, lifeline)),
        Err(error) => {
            lifeline.stand_down();
            Err(error)
        }
    });
    let (mut child, lifeline) = match spawned {
        Ok(spawned) => spawned,
        Err(error) => {
            eprintln!("leasehold: cannot run {:?}: {error}", job.command[0]);
            let _ = held.release().await;
            return match error.kind() {
                std::io::ErrorKind::NotFound => 127,
                _ => 126,
            };
        }
    };
    let pid = child.id();
    // Whom a signal goes to: the group, or COMMAND alone (see above).
    let target = if own_group {
        Target::Group(pid)
    } else {
        Target::Process(pid)
    };
    // A thread waits for COMMAND to end without reaping it, so that its pid stays its own
    // (and no other process's) for as long as this loop may signal it; reaped after the loop.
    let (exited_tx, exited) = futures::channel::oneshot::channel();
    std::thread::spawn(move || {
        let _ = exited_tx.send(wait_without_reaping(pid));
    });
    let mut exited = exited.fuse();
    let lost = held.lost();
    let mut lost_heard = Box::pin(lost.aborted().fuse());
    // When COMMAND, sent SIGTERM for a lost lease, is to be sent SIGKILL.
    let mut kill_at: Option<std::time::Instant> = None;
    loop {
        let mut grace_over = match kill_at {
            Some(at) => FutureExt::fuse(smol::Timer::at(at)).left_future(),
            None => futures::future::pending().right_future(),
        };
        futures::select_biased! {
            _ = exited => break,
            caught = signals.recv().fuse() => {
                if let Ok(caught) = caught {
                    // In its own group, nothing else signals COMMAND; in the terminal's, a
                    // signal the terminal sent reached it already.
                    if own_group || caught.sent {
                        send_signal(target, caught.signal);
                    }
                }
            }
            reason = lost_heard => {
                // Told early, and the lease itself not yet lost (a process stopped past its
                // lease finds both due as it resumes: it was lost).
                let running_out = (reason.downcast_ref::<leasehold::LeaseLost>())
                    .is_some_and(|lost| lost.before_expiry())
                    && !held.guard().lost().is_aborted();
                let (what, why) = match running_out {
                    true => ("is running out", "no renewal came back in time".to_owned()),
                    false => ("was lost", reason.to_string()),
                };
                eprintln!(
                    "leasehold: the lease on {:?} {what} ({why}); sending SIGTERM to \
                     {:?}, and SIGKILL in {}",
                    job.key,
                    job.command[0],
                    super::show_duration(job.grace),
                );
                send_signal(target, SIGTERM);
                kill_at = Some(std::time::Instant::now() + job.grace);
            }
            _ = grace_over => {
                send_signal(target, SIGKILL);
                kill_at = None;
            }
        }
    }
    // COMMAND ended: what it left running is not killed when this process ends.
    lifeline.stand_down();
    let code = match child.wait() {
        Ok(status) => exit_code(status),
        Err(error) => {
            eprintln!("leasehold: lost track of {:?}: {error}", job.command[0]);
            126
        }
    };
    if lost.is_aborted() {
        // Unless heard while COMMAND ran (and said so then), it was lost as COMMAND ended.
        if !lost_heard.is_terminated() {
            eprintln!(
                "leasehold: the lease on {:?} was lost as {:?} ended",
                job.key, job.command[0]
            );
        }
        drop(held);
        return LEASE_LOST;
    }
    match held.release().await {
        Ok(()) => code,
        Err(LockError::LeaseLost(_)) => {
            eprintln!(
                "leasehold: the lease on {:?} ran out before {:?} ended",
                job.key, job.command[0]
            );
            LEASE_LOST
        }
        Err(error) => {
            // COMMAND ran under the lock; the row lapses with its lease.
            eprintln!("leasehold: releasing {:?}: {error}", job.key);
            code
        }
    }
}

/// COMMAND's exit code, or 128 + the signal that ended it, as a shell reports it.
fn exit_code(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => 128 + signal as u8,
        (None, None) => 126,
    }
}

/// Catches SIGINT, SIGTERM and SIGHUP from now on; each comes on the channel.
fn catch_signals() -> std::io::Result<Signals> {
    let mut signals = SignalsInfo::<WithOrigin>::new([SIGINT, SIGTERM, SIGHUP])?;
    let (tx, rx) = smol::channel::unbounded();
    std::thread::Builder::new()
        .name("leasehold-signals".into())
        .spawn(move || {
            for origin in signals.forever() {
                // Where the system does not say (`Unknown`), taken for the terminal's: a
                // signal sent twice is worse than one sent only to this process.
                let sent = matches!(origin.cause, Cause::Sent(_));
                let caught = Caught {
                    signal: origin.signal,
                    sent,
                };
                if tx.send_blocking(caught).is_err() {
                    break;
                }
            }
        })?;
    Ok(rx)
}

/// Where COMMAND's signals go.
#[derive(Clone, Copy, Debug)]
enum Target {
    /// The process group COMMAND leads.
    Group(u32),
    /// COMMAND alone.
    Process(u32),
}

/// Sends `signal` to `target`. COMMAND is not reaped before this process stops signalling it
/// (see `wait_without_reaping`), so its pid, and its group's, are still its own.
#[allow(unsafe_code)]
fn send_signal(target: Target, signal: i32) {
    let (Target::Group(pid) | Target::Process(pid)) = target;
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    let pid = match target {
        Target::Group(_) => -pid,
        Target::Process(_) => pid,
    };
    // SAFETY: `kill` takes two integers and touches no memory of this process.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Waits until the child `pid` has ended, leaving it to be reaped (`WNOWAIT`).
#[allow(unsafe_code)]
fn wait_without_reaping(pid: u32) -> std::io::Result<()> {
    let pid = libc::id_t::from(pid);
    loop {
        // SAFETY: `info` is a zeroed `siginfo_t` that `waitid` writes into and nothing else
        // reads; the other arguments are integers.
        let done = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT)
        };
        if done == 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_command_killed_by_a_signal_exits_as_a_shell_reports_it() {
        assert_eq!(exit_code(std::process::ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(std::process::ExitStatus::from_raw(SIGTERM)), 143);
    }
}
