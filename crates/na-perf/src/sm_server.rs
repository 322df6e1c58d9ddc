//! The serving side of the NA benchmarks: an endpoint with one listening
//! plugin (shared memory by default, any spec `--transport` names) that
//! answers the [`crate::sm_proto`] protocol.

use std::sync::OnceLock;
use std::time::Duration;

use na_core::{Access, Addr, Completion, Endpoint, MemHandle, NaError, OpId, OpKind, PluginId};
use na_core::{PluginRegistry, ProgressMode, Report, Tag};

use crate::error::{PerfError, Result};
use crate::floors::alloc_segments;
use crate::sm_proto::{REPLY_ERR, REPLY_OK, TAG_CTRL, TAG_PING, TAG_PONG, TAG_REPLY};

/// A spawned peer gives up on a session this long without any completion.
const IDLE_LIMIT: Duration = Duration::from_secs(60);
/// Longest single wait in progress.
const IDLE_TICK: Duration = Duration::from_secs(1);
/// Unexpected receives kept posted.
const UNEXPECTED_POSTED: usize = 4;

#[derive(Default)]
struct ClientState {
    /// The posted expected receive for pings, if any.
    ping_recv: Option<OpId>,
    /// The handle of the last `mem` command, kept alive for the client's RMA.
    mem: Option<MemHandle>,
    /// A receive buffer to post next.
    spare: Vec<u8>,
}

/// Per-client state, found by linear search: a handful of clients at most,
/// and comparing addresses is cheaper than hashing them on every ping.
#[derive(Default)]
struct Clients(Vec<(Addr, ClientState)>);

impl Clients {
    fn get_mut(&mut self, addr: &Addr) -> Option<&mut ClientState> {
        self.0.iter_mut().find(|(a, _)| a == addr).map(|(_, st)| st)
    }

    fn entry(&mut self, addr: &Addr) -> &mut ClientState {
        let i = match self.0.iter().position(|(a, _)| a == addr) {
            Some(i) => i,
            None => {
                self.0.push((addr.clone(), ClientState::default()));
                self.0.len() - 1
            }
        };
        &mut self.0[i].1
    }

    fn remove(&mut self, addr: &Addr) -> Option<ClientState> {
        let i = self.0.iter().position(|(a, _)| a == addr)?;
        Some(self.0.swap_remove(i).1)
    }
}

struct Server {
    ep: Endpoint,
    plugin: PluginId,
    next_op: u64,
    msg_size: usize,
    clients: Clients,
    /// The answer to `bye`: the session ends when its send completes.
    bye_op: Option<OpId>,
    done: bool,
    /// Unexpected messages are taken in pull mode (into `pulled`), and
    /// pongs sent without a success completion.
    pull: bool,
    pulled: Vec<u8>,
}

/// The transport spec of this process (`--transport`), set once by `main`.
static TRANSPORT: OnceLock<String> = OnceLock::new();

/// Records the transport spec both sides use (first call wins).
pub fn set_transport(spec: &str) {
    let _ = TRANSPORT.set(spec.to_owned());
}

/// The transport spec (`sm://` unless `--transport` said otherwise).
pub fn transport() -> &'static str {
    TRANSPORT.get().map_or("sm://", String::as_str)
}

/// Creates an endpoint with one plugin of the transport (shared memory or
/// verbs, see [`transport`]); `listen` says whether peers may connect to it.
pub fn sm_endpoint(mode: ProgressMode, listen: bool) -> Result<(Endpoint, PluginId)> {
    let mut registry = PluginRegistry::new();
    registry.register(Box::new(na_sm::SmFactory::default()));
    registry.register(Box::new(na_verbs::VerbsFactory::default()));
    let mut ep = Endpoint::new(mode)?;
    let id = ep.add_from_spec(&registry, transport(), listen)?;
    Ok((ep, id))
}

impl Server {
    fn new(pull: bool) -> Result<Self> {
        let (mut ep, plugin) = sm_endpoint(ProgressMode::Busy, true)?;
        if pull && !ep.pull_unexpected(plugin)? {
            return Err(bad(format!("the {} plugin has no pull mode", transport())));
        }
        let p = ep.plugin(plugin)?;
        let msg_size = p.max_unexpected_size().max(p.max_expected_size());
        let mut s = Server {
            ep,
            plugin,
            next_op: 0,
            msg_size,
            clients: Clients::default(),
            bye_op: None,
            done: false,
            pull,
            pulled: Vec::with_capacity(msg_size),
        };
        if !pull {
            for _ in 0..UNEXPECTED_POSTED {
                s.post_unexpected(Vec::with_capacity(msg_size))?;
            }
        }
        Ok(s)
    }

    fn op(&mut self) -> OpId {
        self.next_op += 1;
        OpId(self.next_op)
    }

    fn post_unexpected(&mut self, buf: Vec<u8>) -> Result<()> {
        let op = self.op();
        Ok(self.ep.post_recv_unexpected(self.plugin, buf, op)?)
    }

    fn post_ping_recv(&mut self, src: &Addr, buf: Vec<u8>) -> Result<()> {
        let op = self.op();
        self.ep.post_recv_expected(src, TAG_PING, buf, op)?;
        self.clients.entry(src).ping_recv = Some(op);
        Ok(())
    }

    fn send(&mut self, dest: &Addr, tag: Tag, data: &[u8], expected: bool) -> Result<OpId> {
        let op = self.op();
        if expected {
            self.ep.send_expected(dest, tag, data, op)?;
        } else {
            self.ep.send_unexpected(dest, tag, data, op)?;
        }
        Ok(op)
    }

    fn handle(&mut self, c: Completion) -> Result<()> {
        let buf = c.buf.unwrap_or_default();
        match (c.kind, c.status) {
            (OpKind::RecvUnexpected, Err(NaError::Canceled)) => Ok(()),
            (OpKind::RecvUnexpected, Err(e)) => {
                eprintln!(
                    "na-perf serve: unexpected receive failed: {}",
                    na_core::ErrorChain(&e)
                );
                self.post_unexpected(buf)
            }
            (OpKind::RecvUnexpected, Ok(())) => {
                if let Some(src) = c.source {
                    self.on_unexpected(&src, c.tag, &buf)?;
                }
                self.post_unexpected(buf)
            }
            (OpKind::RecvExpected, status) => {
                let src = c.source;
                let state = src.as_ref().and_then(|s| self.clients.get_mut(s));
                match (status, src, state) {
                    (Ok(()), Some(src), Some(st)) if st.ping_recv == Some(c.op) => {
                        // Answer first (the re-post is off the round trip:
                        // the client needs a one-way trip to ping again, and
                        // a ping that came earlier would wait, copied, for
                        // the receive). Re-post into the spare buffer; the
                        // ping's buffer becomes the next spare (no
                        // allocation per ping).
                        let spare = std::mem::take(&mut st.spare);
                        self.send(&src, TAG_PONG, &buf, true)?;
                        self.post_ping_recv(&src, spare)?;
                        if let Some(st) = self.clients.get_mut(&src) {
                            st.spare = buf;
                        }
                        Ok(())
                    }
                    (Err(NaError::Canceled), _, _) => Ok(()),
                    (Err(e), _, _) => Err(e.into()),
                    (Ok(()), src, _) => {
                        eprintln!("na-perf serve: stray expected message from {src:?}");
                        Ok(())
                    }
                }
            }
            (_, Err(e)) => {
                eprintln!("na-perf serve: {:?} failed: {}", c.kind, na_core::ErrorChain(&e));
                Ok(())
            }
            (_, Ok(())) => {
                if self.bye_op == Some(c.op) {
                    self.done = true;
                }
                Ok(())
            }
        }
    }

    /// An unexpected message (received or pulled): a ping to echo, or a
    /// control command.
    fn on_unexpected(&mut self, src: &Addr, tag: Tag, buf: &[u8]) -> Result<()> {
        match tag {
            // Pulled pings are answered as hg-rpc answers: in pull mode,
            // and with no completion for a send that succeeds.
            TAG_PING if self.pull => {
                let op = self.op();
                self.ep
                    .send_unexpected_parts(src, TAG_PONG, &[buf], op, Report::FailuresOnly)?;
            }
            TAG_PING => drop(self.send(src, TAG_PONG, buf, false)?),
            TAG_CTRL => self.control(src, buf)?,
            t => eprintln!("na-perf serve: ignoring unexpected message with tag {t} from {src}"),
        }
        Ok(())
    }

    /// Pull mode: handles every unexpected message waiting.
    fn take_pulled(&mut self) -> Result<()> {
        let mut buf = std::mem::take(&mut self.pulled);
        let r = loop {
            match self.ep.take_unexpected(self.plugin, &mut buf) {
                Ok(Some((src, tag))) => {
                    if let Err(e) = self.on_unexpected(&src, tag, &buf) {
                        break Err(e);
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e.into()),
            }
        };
        self.pulled = buf;
        r
    }

    fn control(&mut self, src: &Addr, cmd: &[u8]) -> Result<()> {
        let mut reply = vec![REPLY_OK];
        let is_bye = cmd == b"bye";
        match self.command(src, cmd) {
            Ok(data) => reply.extend_from_slice(&data),
            Err(e) => {
                reply[0] = REPLY_ERR;
                reply.extend_from_slice(na_core::ErrorChain(&e).to_string().as_bytes());
            }
        }
        let op = self.send(src, TAG_REPLY, &reply, true)?;
        if is_bye {
            self.bye_op = Some(op);
        }
        Ok(())
    }

    fn command(&mut self, src: &Addr, cmd: &[u8]) -> Result<Vec<u8>> {
        let text = std::str::from_utf8(cmd).map_err(|_| bad("command is not UTF-8".into()))?;
        let words: Vec<&str> = text.split_whitespace().collect();
        match words[..] {
            ["mode", m] => self.ep.set_mode(ProgressMode::parse(m)?),
            ["expect-pings"] => self.post_ping_recv(src, Vec::with_capacity(self.msg_size))?,
            ["stop-pings"] | ["bye"] => {
                let st = self.clients.remove(src).unwrap_or_default();
                if let Some(op) = st.ping_recv {
                    self.ep.cancel(self.plugin, op)?;
                }
            }
            ["mem", size, segs] => {
                let (size, segs) = (num(size)?, num(segs)?);
                if segs == 0 || segs > 1024 || size > 1 << 30 {
                    return Err(bad(format!(
                        "mem {size} {segs}: want 1..=1024 segments, at most 1 GiB"
                    )));
                }
                let st = self.clients.entry(src);
                if let Some(old) = st.mem.take() {
                    self.ep.plugin_mut(self.plugin)?.mem_deregister(&old)?;
                }
                let mem = MemHandle::new(alloc_segments(size, segs, 0x5a), Access::ReadWrite);
                let p = self.ep.plugin_mut(self.plugin)?;
                p.mem_register(&mem)?;
                let desc = p.mem_describe(&mem)?;
                self.clients.entry(src).mem = Some(mem);
                return Ok(desc.to_bytes());
            }
            _ => return Err(bad(format!("unknown command {text:?}"))),
        }
        Ok(Vec::new())
    }

    /// Runs until `bye` (or forever if `forever`).
    fn run(&mut self, forever: bool) -> Result<()> {
        // Counted in idle progress timeouts (no clock read on the hot path).
        let mut idle = Duration::ZERO;
        while forever || !self.done {
            let n = self.ep.progress(Some(IDLE_TICK))?;
            idle = if n == 0 { idle + IDLE_TICK } else { Duration::ZERO };
            if !forever && idle > IDLE_LIMIT {
                return Err(PerfError::Timeout {
                    what: "the benchmark client",
                    secs: IDLE_LIMIT.as_secs(),
                });
            }
            while let Some(c) = self.ep.pop_completion() {
                if let Err(e) = self.handle(c) {
                    if !forever {
                        return Err(e);
                    }
                    eprintln!("na-perf serve: {}", na_core::ErrorChain(&e));
                }
            }
            if self.pull {
                if let Err(e) = self.take_pulled() {
                    if !forever {
                        return Err(e);
                    }
                    eprintln!("na-perf serve: {}", na_core::ErrorChain(&e));
                }
            }
        }
        Ok(())
    }
}

fn num(w: &str) -> Result<usize> {
    w.parse().map_err(|_| bad(format!("{w:?} is not a number")))
}

fn bad(reason: String) -> PerfError {
    PerfError::Arg {
        name: "control command",
        reason,
    }
}

/// Serves one client session (taking unexpected messages in pull mode
/// with `pull`): calls `announce` with our address once the plugin
/// listens, and returns when the client says `bye`.
pub fn serve_session(pull: bool, announce: impl FnOnce(&str) -> Result<()>) -> Result<()> {
    let mut server = Server::new(pull)?;
    announce(&server.ep.self_addr(server.plugin)?.to_string())?;
    server.run(false)
}

/// Serves any number of clients until killed (`na-perf serve --standalone`).
pub fn serve_forever() -> Result<()> {
    let mut server = Server::new(false)?;
    println!("{}", server.ep.self_addr(server.plugin)?);
    server.run(true)
}
