//! Test binaries that run themselves as child processes.
//!
//! A test that needs another process runs this same test binary again, asking for one test by
//! name (`--exact NAME --nocapture`) with [`ROLE`] set to what that process is to do. The named
//! test is the child's entry, and does nothing in a normal run:
//!
//! ```ignore
//! #[test]
//! fn child_entry() {
//!     let Some(role) = child::role() else { return };
//!     match role.as_str() { /* ... */ }
//! }
//! ```
//!
//! The parent's side is a [`Child`]. Every wait for it has a limit, and fails at once if the
//! child exits first; its standard output and error go to one file, which a test that fails
//! while it has the child prints; dropping it kills and reaps the process, so that a failing
//! test leaves neither a hung run nor a zombie. Its standard input is
//! a pipe the parent holds open: a child that reads it to its end waits until its parent is gone.
//!
//! The `leasehold` command's tests (`tests/cli.rs`) start processes of another kind, with a
//! harness of their own (`Running`): the built command rather than the test binary, each in a
//! process group that the test signals as a whole, its output and error kept apart, for tests
//! that judge them.

use std::path::Path;
use std::process::{ChildStdin, Command, ExitStatus, Stdio};
use std::time::Duration;

use super::until_blocking;

/// The variable that names a child's role.
pub const ROLE: &str = "LEASEHOLD_TEST_CHILD";

/// The role this process was started in by a [`Child`]; `None` in a normal run.
pub fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// A child process running this test binary in a role: killed and reaped when dropped,
/// whatever happened.
pub struct Child {
    process: std::process::Child,
    what: String,
    output: tempfile::NamedTempFile,
    status: Option<ExitStatus>,
    /// Held open until the child is dropped (see the module docs).
    _stdin: Option<ChildStdin>,
}

impl Child {
    /// The command that runs the test `entry` of this binary in `role`, for the caller to add
    /// the child's settings to and give to [`start`](Child::start).
    pub fn command(entry: &str, role: &str) -> Command {
        let mut command = Command::new(std::env::current_exe().expect("this test binary"));
        command
            .args(["--exact", entry, "--nocapture", "--test-threads=1"])
            .env(ROLE, role);
        command
    }

    /// Starts `command` (from [`command`](Child::command)), its output and error to one file.
    pub fn start(command: &mut Command) -> Child {
        let what = format!(
            "the child {}",
            command
                .get_envs()
                .find(|(name, _)| *name == ROLE)
                .and_then(|(_, role)| role)
                .map_or_else(String::new, |role| role.to_string_lossy().into_owned())
        );
        let output = tempfile::NamedTempFile::new().expect("a file for the child's output");
        let file = output.as_file();
        let mut process = command
            .stdin(Stdio::piped())
            .stdout(file.try_clone().expect("share the output file"))
            .stderr(file.try_clone().expect("share the output file"))
            .spawn()
            .unwrap_or_else(|error| panic!("starting {what}: {error}"));
        let stdin = process.stdin.take();
        Child {
            process,
            what,
            output,
            status: None,
            _stdin: stdin,
        }
    }

    /// What it wrote so far, output and error together.
    pub fn output(&self) -> String {
        std::fs::read_to_string(self.output.path()).unwrap_or_default()
    }

    /// How it ended, once it has.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.process.try_wait().expect("poll the child");
        }
        self.status
    }

    /// Waits until `condition` holds, for at most `limit`; fails at once if the child exits
    /// first (what it did just before its exit still counts).
    pub fn await_until(
        &mut self,
        limit: Duration,
        what: &str,
        mut condition: impl FnMut() -> bool,
    ) {
        let mut held = false;
        let ended = until_blocking(limit, || {
            let ended = self.exited().is_some();
            held = condition();
            held || ended
        });
        assert!(ended, "not within {limit:?}: {what}, from {self}");
        assert!(held, "{self} exited before {what}");
    }

    /// Waits until the file `path` exists (as a marker the child writes), for at most `limit`.
    pub fn await_file(&mut self, path: &Path, limit: Duration) {
        let what = path.display().to_string();
        self.await_until(limit, &what, || path.exists());
    }

    /// The rest of the first line of its output that contains `mark`, once there is one, within
    /// `limit`. (The line may begin with the test harness's "test NAME ... ".)
    pub fn await_report(&mut self, mark: &str, limit: Duration) -> String {
        let report = |output: String| {
            output.lines().find_map(|line| {
                line.split_once(mark)
                    .map(|(_, rest)| rest.trim().to_owned())
            })
        };
        let path = self.output.path().to_owned();
        let mut found = None;
        self.await_until(limit, &format!("a line with {mark:?}"), || {
            found = report(std::fs::read_to_string(&path).unwrap_or_default());
            found.is_some()
        });
        found.expect("found")
    }

    /// Its exit status, once it has exited, which must be within `limit`.
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let exited = until_blocking(limit, || self.exited().is_some());
        assert!(exited, "{self} did not exit within {limit:?}");
        self.status.expect("exited")
    }

    /// Waits for its exit, within `limit`, and fails unless it succeeded.
    pub fn assert_success(&mut self, limit: Duration) {
        let status = self.wait(limit);
        assert!(status.success(), "{self} failed");
    }

    /// SIGKILL on Unix: no destructor, no clean-up, as in a crash. Returns once it is reaped.
    pub fn kill(&mut self) {
        self.process.kill().expect("kill the child");
        self.status = Some(self.process.wait().expect("reap the child"));
    }
}

impl std::fmt::Display for Child {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let status = self.status.map_or("running".into(), |s| s.to_string());
        write!(f, "{} ({status})", self.what)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.exited().is_none() {
            let _ = self.process.kill();
            self.status = self.process.wait().ok();
        }
        if std::thread::panicking() {
            eprintln!("--- {self} wrote:\n{}", self.output());
        }
    }
}
