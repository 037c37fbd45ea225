//! COMMAND dies with `leasehold run`. A `run` killed outright (SIGKILL from the OOM killer,
//! `kill -9`, a container runtime) can end nothing itself, and its lease lapses within `--lease`
//! while COMMAND, left running, would go on beside the next holder's. On Linux, two things set
//! up in the child between fork and exec see to it:
//!
//! 1. COMMAND is given a death signal (`PR_SET_PDEATHSIG`), sent by the kernel when the thread
//!    that forked it ends. That thread must live as long as the process: `hold` in `run.rs`
//!    spawns from the main thread (see there). A `run` dead before the death signal was set
//!    would never send it: the child compares its parent with the pid recorded before the fork,
//!    and if it is no longer this process, kills itself at once.
//! 2. The death signal reaches COMMAND alone, not what COMMAND starts. Off a terminal, where
//!    COMMAND leads a process group of its own, a *watcher* is in that group before COMMAND's
//!    program starts: forked by COMMAND's child as its sibling (`CLONE_PARENT`: this process's
//!    child, which it reaps, and not COMMAND's, whose waits never see it), it holds nothing but
//!    the read end of a pipe whose only write end is this process's. When the read ends (every
//!    copy of the write end is closed: this process is dead, however it died), the watcher kills
//!    its own group, COMMAND's: `kill(0, ..)` names the group by the caller's membership, not by
//!    a number that could have been reused. When COMMAND ends, this process kills the watcher
//!    and reaps it, so that what COMMAND left running goes on, as before.
//!
//! The signal is SIGKILL, not SIGTERM: nobody is left to send SIGKILL after `--grace` or to
//! renew the lease, and a COMMAND that caught SIGTERM would work on beside the next holder.
//!
//! Gaps. On a terminal COMMAND stays in the terminal's foreground group, which holds other
//! processes (the rest of a pipeline, the shell's job): only COMMAND gets the death signal, and
//! what it started lives on. The kernel drops the death signal when COMMAND executes a set-user-ID
//! or set-group-ID program (`sudo`), and the watcher may not signal such a process either. On
//! other platforms than Linux nothing of this is done: COMMAND and what it started outlive a
//! `run` killed outright.
//!
//! The child of a fork of this threaded process may make only async-signal-safe calls until it
//! executes COMMAND: what runs there below is system calls on integers, no allocation.

use std::io::{self, Read as _};
use std::os::fd::OwnedFd;
use std::process::Command;

/// This process's side of COMMAND's watcher. (On other platforms than Linux, nothing.)
#[derive(Debug, Default)]
pub(crate) struct Lifeline {
    /// The write end of the watcher's pipe: while it is open, this process is alive.
    alive: Option<OwnedFd>,
    /// The read end of the pipe on which COMMAND's child reports the watcher's pid.
    report: Option<std::fs::File>,
    /// The ends the child needs and this process does not: the read end the watcher watches,
    /// the write end of the report. Kept until COMMAND is spawned (closed before, they would be
    /// closed in the child too), and harmless after.
    theirs: Option<(OwnedFd, OwnedFd)>,
}

impl Lifeline {
    /// Makes `command` die with this process; with `own_group` (COMMAND leads a process group
    /// of its own, `process_group(0)`), what it starts too. The lifeline must live until
    /// `command` is spawned, and be stood down (or dropped) after.
    ///
    /// # Errors
    ///
    /// The pipes could not be made (too many open files).
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    pub(crate) fn attach(command: &mut Command, own_group: bool) -> io::Result<Lifeline> {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;

        let mut lifeline = Lifeline::default();
        let mut fds = None;
        if own_group {
            let (watched, alive) = pipe(0)?;
            let (report, reported) = pipe(libc::O_NONBLOCK)?;
            fds = Some((watched.as_raw_fd(), reported.as_raw_fd()));
            lifeline = Lifeline {
                alive: Some(alive),
                report: Some(report.into()),
                theirs: Some((watched, reported)),
            };
        }
        let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        let pre_exec = move || {
            // SAFETY: only async-signal-safe calls, on integers, in the child (see above).
            unsafe {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
                match fds {
                    Some((watched, reported)) => start_watcher(watched, reported),
                    None => Ok(()),
                }
            }
        };
        // SAFETY: the closure is async-signal-safe (see above).
        unsafe {
            command.pre_exec(pre_exec);
        }
        Ok(lifeline)
    }

    /// On other platforms than Linux: nothing (see the module docs).
    #[cfg(not(target_os = "linux"))]
    pub(crate) fn attach(_command: &mut Command, _own_group: bool) -> io::Result<Lifeline> {
        Ok(Lifeline::default())
    }

    /// COMMAND ended, or never started: its watcher, if it was started, is killed and reaped
    /// without signalling anything.
    pub(crate) fn stand_down(self) {
        let Lifeline {
            alive,
            report,
            theirs,
        } = self;
        let mut pid = [0; std::mem::size_of::<i32>()];
        if let Some(mut report) = report {
            if report.read_exact(&mut pid).is_ok() {
                reap(i32::from_ne_bytes(pid));
            }
        }
        // Only now: while the watcher lives, the end of its pipe says that this process died.
        drop((alive, theirs));
    }
}

/// Kills and reaps the watcher `pid`, a child of this process not reaped yet (so `pid` is its).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn reap(pid: libc::pid_t) {
    // SAFETY: `kill` and `waitpid` take integers (and a null status pointer).
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        while libc::waitpid(pid, std::ptr::null_mut(), 0) < 0
            && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
        {}
    }
}

#[cfg(not(target_os = "linux"))]
fn reap(_pid: i32) {}

/// A pipe, both ends closed on exec (COMMAND gets neither), with `flags`: (read, write).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn pipe(flags: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    use std::os::fd::FromRawFd;

    let mut fds = [0; 2];
    // SAFETY: `fds` is two integers that `pipe2` writes into.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | flags) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `pipe2` opened both, and nothing else owns them.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// In COMMAND's child, in its own group: forks the watcher of `watched` as this child's sibling
/// (a child of `run`'s) in this group, and writes its pid to `reported`.
///
/// # Safety
///
/// Async-signal-safe; for the child of a fork only.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
unsafe fn start_watcher(watched: libc::c_int, reported: libc::c_int) -> io::Result<()> {
    // A fork (as glibc's own: no stack of its own, SIGCHLD to the parent) whose parent is this
    // child's. The parent-death signal is not inherited.
    let flags = (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong;
    let watcher = libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0);
    if watcher < 0 {
        return Err(io::Error::last_os_error());
    }
    if watcher == 0 {
        watch(watched);
    }
    let pid = (watcher as libc::pid_t).to_ne_bytes();
    // Four bytes into a new pipe: all of them, at once.
    if libc::write(reported, pid.as_ptr().cast(), pid.len()) != pid.len() as isize {
        let error = io::Error::last_os_error();
        libc::kill(watcher as libc::pid_t, libc::SIGKILL);
        return Err(error);
    }
    Ok(())
}

/// The watcher: kills its group (COMMAND's) when the pipe's read end `watched` ends.
///
/// # Safety
///
/// Async-signal-safe; for the child of a fork only. Nothing but system calls through their
/// plain C wrappers: after a raw `clone`, the C library's record of this thread (its id) is
/// the parent's, so nothing that reads it (`raise`, threads, locks).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
unsafe fn watch(watched: libc::c_int) -> ! {
    // Named apart from `run` in `ps -o comm` and `top`.
    libc::prctl(libc::PR_SET_NAME, c"leasehold-watch".as_ptr());
    // What is sent to COMMAND's group (passed on by `run`, or sent to the group by anyone) is
    // for COMMAND. Of all signals, only SIGKILL and SIGSTOP, which cannot be ignored, reach the
    // watcher: the first when the group is killed, as after a lost lease, or by `run`.
    for signal in 1..=64 {
        libc::signal(signal, libc::SIG_IGN);
    }
    // Nothing of `run`'s but the read end, on fd 0: not the store's files and sockets (a
    // PostgreSQL session lives as long as any copy of its socket), not the pipe on which the
    // spawn learns that COMMAND started (it waits for every copy to close), not the standard
    // output (a reader of it waits for every copy), and not the write end.
    if libc::dup2(watched, 0) < 0 {
        libc::_exit(1);
    }
    close_from(1);
    let mut byte = 0u8;
    loop {
        match libc::read(0, (&raw mut byte).cast(), 1) {
            0 => {
                libc::kill(0, libc::SIGKILL);
                libc::_exit(0);
            }
            -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            _ => libc::_exit(1),
        }
    }
}

/// Closes every file descriptor from `first` up.
///
/// # Safety
///
/// Async-signal-safe; closes descriptors others may own.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
unsafe fn close_from(first: libc::c_int) {
    // `close_range` came with Linux 5.9; before it, each descriptor up to the limit.
    if libc::syscall(libc::SYS_close_range, first, libc::c_uint::MAX, 0) == 0 {
        return;
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    let last = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
        limit.rlim_cur.min(1 << 20) as libc::c_int
    } else {
        1 << 16
    };
    for fd in first..last {
        libc::close(fd);
    }
}
