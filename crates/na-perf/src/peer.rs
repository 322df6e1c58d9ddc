//! The peer process: started by re-executing ourselves with the hidden
//! `serve` subcommand, driven by one-line commands over its stdin, answering
//! one line per command on its stdout (`ok ...` or `err ...`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cli::CommonArgs;
use crate::error::{PerfError, Result};
use crate::sys::affinity;
use crate::sys::eventfd::{self, EventFd};
use crate::sys::shm::{SharedMap, SLOT};

/// Largest payload of the shared-memory floors.
pub const FLOOR_MAX_MSG: usize = 64 << 10;
/// Start of the area written by the parent: its flag, then its payload in
/// the same cache line onwards (so that a small message moves one line).
const AREA_TO_PEER: usize = 0;
/// Start of the area written by the peer (page-aligned after the first).
const AREA_FROM_PEER: usize = (8 + FLOOR_MAX_MSG).next_multiple_of(4096);
/// Offset of the payload written by the parent.
pub const DATA_TO_PEER: usize = AREA_TO_PEER + 8;
/// Offset of the payload written by the peer.
pub const DATA_FROM_PEER: usize = AREA_FROM_PEER + 8;
/// Size of the floors' shared mapping.
pub const FLOOR_SHM_LEN: usize = AREA_FROM_PEER * 2;
/// Flag slot written by the parent.
pub const FLAG_TO_PEER: usize = AREA_TO_PEER / SLOT;
/// Flag slot written by the peer.
pub const FLAG_FROM_PEER: usize = AREA_FROM_PEER / SLOT;

/// The raw channels of the floor measurements, shared with the peer.
#[derive(Debug)]
pub struct FloorLinks {
    /// Signalled by the parent, waited on by the peer.
    pub to_peer: EventFd,
    /// Signalled by the peer, waited on by the parent.
    pub from_peer: EventFd,
    /// Flags and data areas.
    pub shm: SharedMap,
}

/// A running peer process.
pub struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The floor channels, if the peer was started with them.
    pub links: Option<FloorLinks>,
}

impl Peer {
    /// Starts `na-perf serve`, pinned to `pin`, with the floor channels if
    /// `floors`. Waits for its `ready` line.
    pub fn spawn(pin: Option<usize>, floors: bool) -> Result<Peer> {
        let exe = std::env::current_exe().map_err(|source| PerfError::SpawnPeer {
            exe: "<current executable>".into(),
            source,
        })?;
        let links = if floors {
            Some(FloorLinks {
                to_peer: eventfd::new(true).map_err(PerfError::sys("eventfd"))?,
                from_peer: eventfd::new(true).map_err(PerfError::sys("eventfd"))?,
                shm: SharedMap::create(FLOOR_SHM_LEN, true).map_err(PerfError::sys("memfd mapping"))?,
            })
        } else {
            None
        };
        let mut cmd = Command::new(&exe);
        cmd.args(["serve", "--transport", crate::sm_server::transport()])
            .arg("--parent")
            .arg(std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(cpu) = pin {
            cmd.arg("--pin").arg(cpu.to_string());
        }
        if let Some(l) = &links {
            use std::os::fd::AsRawFd;
            let fds = [l.to_peer.as_raw_fd(), l.from_peer.as_raw_fd(), l.shm.raw_fd()];
            cmd.arg("--floor-fds").arg(fds.map(|f| f.to_string()).join(","));
        }
        let spawn_err = |source| PerfError::SpawnPeer {
            exe: exe.display().to_string(),
            source,
        };
        let mut child = cmd.spawn().map_err(spawn_err)?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| spawn_err(std::io::Error::other("no stdin pipe")))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| spawn_err(std::io::Error::other("no stdout pipe")))?;
        let mut peer = Peer {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            links,
        };
        peer.reply("<start>")?;
        Ok(peer)
    }

    /// The peer's process id.
    pub fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    /// Sends `command` and returns the text after `ok` of its answer.
    pub fn request(&mut self, command: &str) -> Result<String> {
        self.send(command)?;
        self.reply(command)
    }

    /// Sends `command` without waiting for the answer.
    pub fn send(&mut self, command: &str) -> Result<()> {
        writeln!(self.stdin, "{command}")
            .and_then(|()| self.stdin.flush())
            .map_err(|source| PerfError::PeerIo {
                what: "sending a command",
                source,
            })
    }

    /// Reads one answer line; `ok <rest>` gives `rest`, anything else is an error.
    pub fn reply(&mut self, command: &str) -> Result<String> {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .map_err(|source| PerfError::PeerIo {
                what: "reading an answer",
                source,
            })?;
        if n == 0 {
            return Err(PerfError::PeerReply {
                command: command.into(),
                reply: "<peer exited>".into(),
            });
        }
        match line.trim_end().strip_prefix("ok") {
            Some(rest) => Ok(rest.trim_start().to_owned()),
            None => Err(PerfError::PeerReply {
                command: command.into(),
                reply: line.trim_end().into(),
            }),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit").and_then(|()| self.stdin.flush());
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        eprintln!(
            "na-perf: peer process {} did not quit; killing it",
            self.child.id()
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The CPUs for (this process, the peer): `--cpu A,B`, none with
/// `--no-pin`, else the first two allowed CPUs if there are two or more.
pub fn choose_cpus(args: &CommonArgs) -> Result<(Option<usize>, Option<usize>)> {
    if args.no_pin {
        return Ok((None, None));
    }
    if !args.cpu.is_empty() {
        return match args.cpu[..] {
            [a, b] => Ok((Some(a), Some(b))),
            _ => Err(PerfError::Arg {
                name: "--cpu",
                reason: "expected two CPUs: --cpu A,B".into(),
            }),
        };
    }
    let allowed = affinity::allowed_cpus().map_err(PerfError::sys("sched_getaffinity"))?;
    Ok(match allowed[..] {
        [a, b, ..] => (Some(a), Some(b)),
        _ => (None, None),
    })
}

/// Pins this process to `cpu`, if given.
pub fn pin_self(cpu: Option<usize>) -> Result<()> {
    match cpu {
        Some(c) => affinity::pin_to(c).map_err(PerfError::sys("sched_setaffinity")),
        None => Ok(()),
    }
}
