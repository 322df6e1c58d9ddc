//! The measuring side of the NA benchmarks: a client-only endpoint talking
//! to the serving peer with the [`crate::sm_proto`] protocol. Every timed
//! operation reuses its buffers, so nothing is allocated per operation.

use std::time::Duration;

use na_core::{Addr, Endpoint, MemHandle, NaError, OpId, PluginId, ProgressMode, RemoteMem, Report};

use crate::cli::{MsgKind, RmaOp};
use crate::error::{PerfError, Result};
use crate::sm_proto::{REPLY_OK, TAG_CTRL, TAG_PING, TAG_PONG, TAG_REPLY};
use crate::sm_server::sm_endpoint;

/// How long any single operation may take before the peer is declared stuck.
const PATIENCE: Duration = Duration::from_secs(10);

/// A connected benchmark client.
pub struct Session {
    ep: Endpoint,
    plugin: PluginId,
    server: Addr,
    next_op: u64,
    /// Receive buffer, handed to the plugin and back on every ping.
    recv_buf: Vec<u8>,
    /// Unexpected messages are taken in pull mode (pongs of pulled pings).
    pull: bool,
}

impl Session {
    /// Creates a client endpoint in `mode` (taking unexpected messages in
    /// pull mode with `pull`) and looks up `uri`.
    pub fn connect(uri: &str, mode: ProgressMode, pull: bool) -> Result<Session> {
        let (mut ep, plugin) = sm_endpoint(mode, false)?;
        if pull && !ep.pull_unexpected(plugin)? {
            return Err(PerfError::Arg {
                name: "--kind pulled",
                reason: format!("the {} plugin has no pull mode", crate::sm_server::transport()),
            });
        }
        let server = ep.lookup(uri)?;
        let p = ep.plugin(plugin)?;
        let cap = p.max_unexpected_size().max(p.max_expected_size());
        Ok(Session {
            ep,
            plugin,
            server,
            next_op: 0,
            recv_buf: Vec::with_capacity(cap),
            pull,
        })
    }

    /// Largest message of `kind`.
    pub fn max_size(&self, kind: MsgKind) -> Result<usize> {
        let p = self.ep.plugin(self.plugin)?;
        Ok(match kind {
            MsgKind::Expected => p.max_expected_size(),
            MsgKind::Unexpected | MsgKind::Pulled => p.max_unexpected_size(),
        })
    }

    fn op(&mut self) -> OpId {
        self.next_op += 1;
        OpId(self.next_op)
    }

    /// Waits for `recv` and `send` to complete (either may be `None`); keeps
    /// the received buffer. Any failed completion is an error.
    fn wait(&mut self, recv: Option<OpId>, send: Option<OpId>) -> Result<()> {
        let (mut recv_left, mut send_left) = (recv.is_some(), send.is_some());
        while recv_left || send_left {
            while let Some(c) = self.ep.pop_completion() {
                if Some(c.op) == recv {
                    if let Some(b) = c.buf {
                        self.recv_buf = b;
                    }
                    recv_left = false;
                } else if Some(c.op) == send {
                    send_left = false;
                } else {
                    return Err(PerfError::Na(NaError::Plugin {
                        plugin: "na-perf",
                        message: format!("stray completion {:?} {:?}", c.op, c.kind),
                    }));
                }
                c.status?;
            }
            // In pull mode an unexpected message counts as work for
            // `progress`: one nobody expects must end the wait, not spin it.
            if self.pull {
                let mut stray_buf = Vec::new();
                if let Some((src, tag)) = self.ep.take_unexpected(self.plugin, &mut stray_buf)? {
                    return Err(stray(format!("unexpected message with tag {tag} from {src}")));
                }
            }
            if (recv_left || send_left) && self.ep.progress(Some(PATIENCE))? == 0 {
                return Err(PerfError::Timeout {
                    what: "a completion from the peer",
                    secs: PATIENCE.as_secs(),
                });
            }
        }
        Ok(())
    }

    /// Sends a control command, returns the answer's data.
    pub fn control(&mut self, cmd: &str) -> Result<Vec<u8>> {
        let (r, s) = (self.op(), self.op());
        let buf = std::mem::take(&mut self.recv_buf);
        self.ep.post_recv_expected(&self.server, TAG_REPLY, buf, r)?;
        self.ep
            .send_unexpected(&self.server, TAG_CTRL, cmd.as_bytes(), s)?;
        self.wait(Some(r), Some(s))?;
        match self.recv_buf.split_first() {
            Some((&REPLY_OK, data)) => Ok(data.to_vec()),
            _ => Err(PerfError::PeerReply {
                command: cmd.into(),
                reply: String::from_utf8_lossy(self.recv_buf.get(1..).unwrap_or_default()).into_owned(),
            }),
        }
    }

    /// Switches both sides to `mode`.
    pub fn set_mode(&mut self, mode: ProgressMode) -> Result<()> {
        self.control(&format!("mode {}", mode.spec()))?;
        self.ep.set_mode(mode);
        Ok(())
    }

    /// Prepares the server for pings of `kind`.
    pub fn start_pings(&mut self, kind: MsgKind) -> Result<()> {
        if kind == MsgKind::Expected {
            self.control("expect-pings")?;
        }
        Ok(())
    }

    /// Undoes [`start_pings`](Self::start_pings).
    pub fn stop_pings(&mut self, kind: MsgKind) -> Result<()> {
        if kind == MsgKind::Expected {
            self.control("stop-pings")?;
        }
        Ok(())
    }

    /// One round trip: sends `data` as a ping of `kind`, waits for the pong.
    pub fn ping(&mut self, kind: MsgKind, data: &[u8]) -> Result<()> {
        if kind == MsgKind::Pulled {
            return self.ping_pulled(data);
        }
        let (r, s) = (self.op(), self.op());
        let buf = std::mem::take(&mut self.recv_buf);
        // Send first: posting the receive then overlaps the trip (a pong
        // that came earlier would wait, copied, for the receive).
        match kind {
            MsgKind::Expected => {
                self.ep.send_expected(&self.server, TAG_PING, data, s)?;
                self.ep.post_recv_expected(&self.server, TAG_PONG, buf, r)?;
            }
            MsgKind::Unexpected => {
                self.ep.send_unexpected(&self.server, TAG_PING, data, s)?;
                self.ep.post_recv_unexpected(self.plugin, buf, r)?;
            }
            MsgKind::Pulled => unreachable!("pulled pings return above"),
        }
        self.wait(Some(r), Some(s))?;
        if self.recv_buf.len() != data.len() {
            return Err(PerfError::Na(NaError::Plugin {
                plugin: "na-perf",
                message: format!(
                    "pong of {} bytes for a ping of {}",
                    self.recv_buf.len(),
                    data.len()
                ),
            }));
        }
        Ok(())
    }

    /// A pulled round trip: the ping goes out with no success completion
    /// (as hg-rpc sends), the pong is taken where it waits.
    fn ping_pulled(&mut self, data: &[u8]) -> Result<()> {
        if !self.pull {
            return Err(PerfError::Arg {
                name: "--kind pulled",
                reason: "the session was not opened in pull mode".into(),
            });
        }
        let s = self.op();
        self.ep
            .send_unexpected_parts(&self.server, TAG_PING, &[data], s, Report::FailuresOnly)?;
        loop {
            if let Some((_, tag)) = self.ep.take_unexpected(self.plugin, &mut self.recv_buf)? {
                if tag != TAG_PONG {
                    return Err(stray(format!("unexpected message with tag {tag}")));
                }
                break;
            }
            // A completion here is the ping's failure (or a stray one).
            if let Some(c) = self.ep.pop_completion() {
                c.status?;
                return Err(stray(format!("completion {:?} {:?}", c.op, c.kind)));
            }
            if self.ep.progress(Some(PATIENCE))? == 0 {
                return Err(PerfError::Timeout {
                    what: "a pong from the peer",
                    secs: PATIENCE.as_secs(),
                });
            }
        }
        if self.recv_buf.len() != data.len() {
            return Err(stray(format!(
                "pong of {} bytes for a ping of {}",
                self.recv_buf.len(),
                data.len()
            )));
        }
        Ok(())
    }

    /// Asks the server for a read-write handle of `size` bytes in `segments`.
    pub fn remote_mem(&mut self, size: usize, segments: usize) -> Result<RemoteMem> {
        let bytes = self.control(&format!("mem {size} {segments}"))?;
        Ok(RemoteMem::from_bytes(&bytes)?)
    }

    /// Registers a local handle with the plugin.
    pub fn register(&mut self, mem: &MemHandle) -> Result<()> {
        Ok(self.ep.plugin_mut(self.plugin)?.mem_register(mem)?)
    }

    /// One whole-handle transfer of `len` bytes.
    pub fn rma(&mut self, op: RmaOp, local: &MemHandle, remote: &RemoteMem, len: u64) -> Result<()> {
        let id = self.op();
        match op {
            RmaOp::Put => self.ep.put(local, 0, remote, 0, len, &self.server, id)?,
            RmaOp::Get => self.ep.get(local, 0, remote, 0, len, &self.server, id)?,
        }
        self.wait(None, Some(id))
    }

    /// Ends the session (the spawned peer then answers its `sm` command).
    pub fn bye(mut self) -> Result<()> {
        self.control("bye").map(drop)
    }
}

/// The error for something the protocol does not expect.
fn stray(message: String) -> PerfError {
    PerfError::Na(NaError::Plugin {
        plugin: "na-perf",
        message,
    })
}
