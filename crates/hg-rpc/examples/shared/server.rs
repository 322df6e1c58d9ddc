//! The server process an example's client starts, tied to the client both
//! ways: the client kills and reaps it if it gives up early (an error, a
//! panic), and it dies when the client does (even of `SIGKILL`). Without
//! that, an orphaned server keeps its socket and owner files and the
//! client's stderr (a `./x test | tee log` would never end).
// Each example uses a subset.
#![allow(dead_code)]

use std::io::{self, BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The variable that tells a server which process it must not outlive.
pub const PARENT_VAR: &str = "QS_EXAMPLE_PARENT";

/// How long [`ServerProcess::wait_ok`] waits for the server to exit.
const EXIT_WAIT: Duration = Duration::from_secs(10);

/// A running server: killed and reaped when dropped, unless
/// [`ServerProcess::wait_ok`] saw it exit.
pub struct ServerProcess {
    child: Child,
    line: String,
    exited: bool,
}

impl ServerProcess {
    /// Starts this binary with `args` (see [`ServerProcess::spawn`]).
    pub fn start(args: &[&str]) -> io::Result<ServerProcess> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(args);
        ServerProcess::spawn(cmd)
    }

    /// Runs `cmd` with its stdout piped to us and [`PARENT_VAR`] set to our
    /// pid, and reads the first line it prints.
    pub fn spawn(mut cmd: Command) -> io::Result<ServerProcess> {
        let child = cmd
            .env(PARENT_VAR, std::process::id().to_string())
            .stdout(Stdio::piped())
            .spawn()?;
        let mut s = ServerProcess {
            child,
            line: String::new(),
            exited: false,
        };
        let out = s
            .child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("no stdout"))?;
        if BufReader::new(out).read_line(&mut s.line)? == 0 {
            return Err(io::Error::other("the server exited before printing its address"));
        }
        Ok(s)
    }

    /// The address on the server's first line (`ADDR <uri>`).
    pub fn addr(&self) -> io::Result<&str> {
        let line = self.line.trim();
        line.strip_prefix("ADDR ")
            .ok_or_else(|| io::Error::other(format!("the server printed {line:?}, not its address")))
    }

    /// The server's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits (at most 10 s) for the server to exit; an error unless it
    /// exited successfully.
    pub fn wait_ok(mut self) -> io::Result<ExitStatus> {
        let end = Instant::now() + EXIT_WAIT;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() > end {
                return Err(io::Error::other(format!(
                    "the server did not exit within {EXIT_WAIT:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        self.exited = true;
        if !status.success() {
            return Err(io::Error::other(format!("the server failed: {status}")));
        }
        Ok(status)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if !self.exited {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// For a server's first step: makes the kernel kill this process when the
/// client that started it dies (the pid in [`PARENT_VAR`], else our parent).
pub fn exit_with_parent() -> io::Result<()> {
    let parent = match std::env::var(PARENT_VAR) {
        Ok(v) => v
            .parse()
            .map_err(|_| io::Error::other(format!("{PARENT_VAR}={v:?} is not a process id")))?,
        Err(_) => std::os::unix::process::parent_id(),
    };
    na_core::sys::process::exit_with_parent(parent)
}
