//! [`VerbsPlugin`]: the NA plugin over RDMA verbs.
//!
//! # Call order
//! As for every [`Plugin`]: create ([`VerbsPlugin::new`]), look peers up,
//! post operations, then drive it with `progress`/`pop_completion`, and
//! `try_wait` before sleeping on `poll_fd`. Inside:
//!
//! * `lookup` only parses the address; the RC connection (RDMA CM: resolve
//!   address, resolve route, connect with a hello in the private data) is
//!   started by the first operation on the peer, which waits in the
//!   connection's backlog until `Established`.
//! * `progress` polls the completion queue directly (no system call: this
//!   is all busy mode does) and reads RDMA CM events every
//!   [`CM_POLL_EVERY`] calls and whenever `try_wait` runs.
//! * `try_wait` consumes completion-channel events, then arms the CQ and
//!   polls it once more (arm-and-drain: a completion that raced with the
//!   arming is found by that poll, and one that comes later raises an
//!   event), and drains CM events. Only if all of that found nothing does
//!   it say the caller may sleep on `poll_fd`: an epoll fd holding the
//!   completion channel fd, the CM event channel fd and a timer for the
//!   earliest deadline (level-triggered, so nothing unread is ever lost).
//!   A connection not `Established` within `VerbsConfig::setup_timeout`,
//!   and one holding an operation canceled longer than
//!   `VerbsConfig::cancel_timeout` ago that the device has not ended,
//!   are torn down when their deadline comes, also while the caller
//!   sleeps.

mod hooks;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use na_core::sys::epoll::Epoll;
use na_core::sys::timer::Timer;
use na_core::{
    Addr, Completion, MemHandle, MsgBuf, NaError, OpId, OpKind, Plugin, PluginId, PluginStats, RemoteMem,
    Result, Rma, Tag, TokenState,
};
use na_regcache::Cache;

use crate::addr::{canonical, VerbsUri, SCHEME};
use crate::config::VerbsConfig;
use crate::conn::{Conn, ConnRef, ConnState, Outgoing};
use crate::msg::Matching;
use crate::msgbuf::BufPool;
use crate::peers::PeerTable;
use crate::rma::RmaOp;
use crate::sys::{
    CmId, CmIdKey, CompletionChannel, CompletionQueue, DeviceAttr, EventChannel, IbvRegistrar, PortSpace,
    ProtectionDomain, WorkCompletion,
};
use crate::wire::HEADER_LEN;

/// `progress` reads RDMA CM events once every this many calls (and in
/// every `try_wait`), so busy polling costs no system call per call.
pub const CM_POLL_EVERY: u32 = 16;

/// The read depth (initiator or responder) to ask for on a device whose
/// limit for it is `device_max`: that limit, at most `configured`
/// (`VerbsConfig::max_rd_atomic`). Zero stays zero: librdmacm refuses a
/// connection that asks a device for more than it has, so a device
/// without RDMA reads is used without them rather than not at all.
pub(crate) fn rd_atomic_limit(device_max: u32, configured: u8) -> u8 {
    device_max.min(u32::from(configured)) as u8
}

/// Token of our own address.
const SELF_TOKEN: u64 = u64::MAX;

/// Where an operation in flight lives (for cancel).
pub(crate) enum OpLoc {
    RecvUnexpected,
    RecvExpected(usize, Tag),
    Send(ConnRef),
    Rma(u32),
}

/// A slot of the connection table.
pub(crate) struct ConnSlot {
    pub gen: u16,
    pub conn: Option<Conn>,
}

/// The verbs NA plugin. See the module docs for the call order and
/// `crate` docs for the design.
pub struct VerbsPlugin {
    pub(crate) id: PluginId,
    pub(crate) cfg: VerbsConfig,
    /// Connections the CQ has room for (`cfg.max_conns` unless the device
    /// caps the CQ lower).
    pub(crate) conn_limit: usize,
    /// Incoming connections are accepted only while fewer connections
    /// than this are live: `conn_limit` less the slots kept for our own
    /// outgoing ones (`VerbsConfig::outgoing_reserve`).
    pub(crate) incoming_limit: usize,
    pub(crate) device: String,
    pub(crate) self_uri: String,
    pub(crate) self_key: SocketAddr,
    pub(crate) slot_size: usize,
    /// Bytes queued in all connections' message backlogs (their shared total).
    pub(crate) backlog_total: na_core::BacklogTotal,
    pub(crate) max_sge_write: usize,
    pub(crate) max_sge_read: usize,
    /// RDMA reads (and atomics) we may have outstanding per QP as the
    /// initiator: the device's `max_qp_init_rd_atom`, at most
    /// `VerbsConfig::max_rd_atomic`. What we ask for as `initiator_depth`
    /// (librdmacm refuses more than the device's limit); a connection
    /// uses what the peer granted (`Conn::reads`). Zero on a device that
    /// cannot issue RDMA reads: connections still carry messages and
    /// puts, and a get fails at once with `NaError::Unsupported`.
    pub(crate) rd_initiator: u8,
    /// RDMA reads we serve at once per QP as the responder: the device's
    /// `max_qp_rd_atom`, at most `VerbsConfig::max_rd_atomic`; what we offer as
    /// `responder_resources`. Zero on a device that cannot serve RDMA
    /// reads: a peer's get of our memory then fails on its side.
    pub(crate) rd_responder: u8,
    pub(crate) dev_attr: DeviceAttr,
    pub(crate) peers: PeerTable,
    pub(crate) conns: Vec<ConnSlot>,
    /// Serial of the last connection made (see `Conn::serial`).
    pub(crate) next_conn_serial: u64,
    pub(crate) conn_by_cm: HashMap<CmIdKey, ConnRef>,
    pub(crate) matching: Matching,
    pub(crate) ops: HashMap<OpId, OpLoc>,
    /// Sends canceled while on the wire, with when they were canceled.
    pub(crate) canceled_sends: HashMap<OpId, Instant>,
    /// Operations canceled while the device had them, in order of their
    /// deadline; see `cancel.rs`.
    pub(crate) cancel_deadlines: VecDeque<crate::cancel::CancelDeadline>,
    pub(crate) rma: Vec<Option<RmaOp>>,
    pub(crate) rma_free: Vec<u32>,
    pub(crate) completions: VecDeque<Completion>,
    pub(crate) stats: PluginStats,
    pub(crate) wcs: Vec<WorkCompletion>,
    pub(crate) calls: u32,
    /// `try_wait` said the owner may sleep, and no progress call came
    /// since: a call from another thread that queues a completion must
    /// wake it (see [`wake_owner_if_work`](Self::wake_owner_if_work)).
    pub(crate) armed: bool,
    pub(crate) cache: Arc<Cache<IbvRegistrar>>,
    pub(crate) cq: Arc<CompletionQueue>,
    pub(crate) comp: Arc<CompletionChannel>,
    pub(crate) pd: Arc<ProtectionDomain>,
    /// The bound (and, when listening, listening) id: our identity. Kept
    /// alive for the plugin's lifetime; its events arrive on `events`.
    pub(crate) _local_id: Arc<CmId>,
    pub(crate) events: Arc<EventChannel>,
    pub(crate) poll: Epoll,
    /// Readable at the earliest deadline: a connection's set-up (see
    /// `sweep_setups`) or a canceled operation's end (`sweep_cancels`).
    pub(crate) deadline_timer: Timer,
    /// The earliest deadline (the timer's, unless arming it failed).
    pub(crate) next_deadline: Option<Instant>,
    /// Tokens `sleep` reads from `poll` (kept: no allocation per sleep).
    pub(crate) ready: Vec<u64>,
    /// Registered message buffers not in use.
    pub(crate) bufs: BufPool,
    /// The segments our handles expose, by rkey: what a transfer to our
    /// own address may touch (see `mem::exposed`).
    pub(crate) exposed: crate::mem::ExposedSet,
    /// RDMA CM events read off the channel by the test hook
    /// [`debug_cm_disconnects_waiting`](Self::debug_cm_disconnects_waiting)
    /// and not acted on yet: the next call that reads CM events acts on
    /// them first, in order. Always empty without the `test-hooks`
    /// feature (its type is then an empty struct).
    pub(crate) cm_read_ahead: hooks::CmReadAhead,
}

impl VerbsPlugin {
    /// Opens the device, binds RDMA CM (listening if `cfg.listen`), and
    /// creates the PD, CQ, completion channel, registration cache and the
    /// plugin's epoll set. Without any RDMA device the error says
    /// "no RDMA device found" and what to install or load.
    pub fn new(id: PluginId, cfg: VerbsConfig) -> Result<VerbsPlugin> {
        cfg.validate()?;
        let mut local = crate::device::choose(&cfg)?;
        let events = EventChannel::new()?;
        let local_id = CmId::new(&events, PortSpace::Tcp)?;
        let port = cfg.bind.map_or(0, |b| b.port());
        local_id.bind(SocketAddr::new(local.ip, port))?;
        if cfg.listen {
            local_id.listen(128)?;
        }
        // The device context lives as long as anything registered on it
        // (a memory handle or message buffer the application keeps after
        // the plugin). Anchored on the listening id, it would keep that id,
        // and so the port, bound and listening with nobody to accept:
        // another plugin could not bind the port, and peers would wait
        // out their set-up timeout. So it hangs on an id of its own, bound
        // to the same address with any port and never listening.
        let anchor_events = EventChannel::new()?;
        let anchor = CmId::new(&anchor_events, PortSpace::Tcp)?;
        anchor.bind(SocketAddr::new(local.ip, 0))?;
        let ctx = anchor.context()?;
        if local_id.context()?.as_ptr() != ctx.as_ptr() {
            return Err(NaError::Plugin {
                plugin: SCHEME,
                message: "librdmacm gave two ids bound to the same address different device contexts".into(),
            });
        }
        if ctx.name() != local.device {
            return Err(crate::VerbsError::WrongDevice {
                addr: local.ip.to_string(),
                actual: ctx.name().to_owned(),
                requested: local.device,
            }
            .into());
        }
        if cfg.bind.is_some() && local_id.port_num() != local.ib_port {
            // The IP is on another port of the device: that port, unless
            // one was asked for.
            if cfg.ib_port.is_some() {
                return Err(crate::VerbsError::WrongPort {
                    addr: local.ip.to_string(),
                    device: local.device,
                    actual: local_id.port_num(),
                    requested: local.ib_port,
                }
                .into());
            }
            local.ib_port = local_id.port_num();
        }
        // Canonical, as every parsed address is (`addr::canonical_sock`):
        // `mem::exposed::is_own` compares peers' keys with it.
        let self_key = local_id
            .local_addr()
            .map(crate::addr::canonical_sock)
            .ok_or_else(|| NaError::Plugin {
                plugin: SCHEME,
                message: "rdma_bind_addr gave no local address".into(),
            })?;
        let dev_attr = ctx.query_device()?;
        let pd = ProtectionDomain::new(&ctx)?;
        let comp = CompletionChannel::new(&ctx)?;
        let per_conn = u32::from(cfg.recv_depth) + cfg.send_queue_depth;
        let cqe = (per_conn as usize * cfg.max_conns).min(dev_attr.max_cqe.max(1) as usize) as u32;
        // Every work request of every connection may be outstanding at
        // once: the CQ must hold them all, or an overflow errors every QP.
        // A device whose CQ is smaller than asked for takes fewer
        // connections.
        let conn_limit = cfg.max_conns.min(cqe as usize / per_conn.max(1) as usize);
        if conn_limit == 0 {
            return Err(NaError::Plugin {
                plugin: SCHEME,
                message: format!(
                    "the device's largest completion queue ({} entries) cannot hold one connection's \
                     {per_conn} work requests: lower recv_depth or send_queue_depth",
                    dev_attr.max_cqe
                ),
            });
        }
        let cq = CompletionQueue::new(&ctx, cqe, Some(&comp))?;
        let cache_cfg = match &cfg.cache {
            Some(c) => c.clone(),
            None => na_regcache::CacheConfig::from_env().map_err(cache_err)?,
        };
        let cache = Cache::new(IbvRegistrar::for_mem_handles(&pd), cache_cfg).map_err(cache_err)?;
        let poll = Epoll::new().map_err(|e| NaError::sys("epoll_create1", e))?;
        poll.add(comp.as_fd(), 0)
            .map_err(|e| NaError::sys("epoll_ctl add completion channel", e))?;
        poll.add(events.as_fd(), 1)
            .map_err(|e| NaError::sys("epoll_ctl add RDMA CM channel", e))?;
        let deadline_timer = Timer::new().map_err(|e| NaError::sys("timerfd_create", e))?;
        poll.add(deadline_timer.as_fd(), 2)
            .map_err(|e| NaError::sys("epoll_ctl add deadline timer", e))?;
        let cap = |v: u32| (v.max(1) as usize).min(cfg.max_sge.map_or(usize::MAX, |m| m as usize));
        let slot_size = (HEADER_LEN + cfg.max_msg_size).div_ceil(64) * 64;
        let self_uri = canonical(Some(&local.device), self_key);
        tracing::info!(uri = %self_uri, ib_port = local.ib_port, listen = cfg.listen, cache = cache.monitor_name(), "verbs plugin up");
        Ok(VerbsPlugin {
            id,
            device: local.device,
            self_uri,
            self_key,
            slot_size,
            backlog_total: na_core::BacklogTotal::default(),
            max_sge_write: cap(dev_attr.max_sge),
            max_sge_read: cap(dev_attr.max_sge_rd.min(dev_attr.max_sge)),
            rd_initiator: rd_atomic_limit(dev_attr.max_qp_init_rd_atom, cfg.max_rd_atomic),
            rd_responder: rd_atomic_limit(dev_attr.max_qp_rd_atom, cfg.max_rd_atomic),
            dev_attr,
            conn_limit,
            incoming_limit: conn_limit - crate::config::outgoing_reserve(conn_limit, cfg.outgoing_reserve),
            cfg,
            peers: PeerTable::default(),
            conns: Vec::new(),
            next_conn_serial: 0,
            conn_by_cm: HashMap::new(),
            matching: Matching::default(),
            ops: HashMap::new(),
            canceled_sends: HashMap::new(),
            cancel_deadlines: VecDeque::new(),
            rma: Vec::new(),
            rma_free: Vec::new(),
            completions: VecDeque::new(),
            stats: PluginStats::default(),
            wcs: Vec::with_capacity(64),
            calls: 0,
            armed: false,
            cache: Arc::new(cache),
            cq,
            comp,
            pd,
            _local_id: local_id,
            events,
            poll,
            deadline_timer,
            next_deadline: None,
            ready: Vec::with_capacity(32),
            bufs: BufPool::default(),
            exposed: crate::mem::ExposedSet::default(),
            cm_read_ahead: hooks::CmReadAhead::default(),
        })
    }

    /// The RDMA device in use.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Device limits (max SGEs, queue sizes...).
    pub fn device_attr(&self) -> &DeviceAttr {
        &self.dev_attr
    }

    /// The peer an address names (any state).
    pub(crate) fn peer_of(&self, a: &Addr) -> Result<usize> {
        let resolved = if a.plugin() == self.id {
            self.peers.resolve(a.token())
        } else {
            TokenState::Unknown
        };
        match resolved {
            TokenState::Live(p) => Ok(p),
            TokenState::Released => Err(NaError::PeerGone {
                peer: a.uri().to_owned(),
                reason: "it went earlier (disconnected or failed); look it up again to reconnect".into(),
            }),
            TokenState::Unknown => Err(NaError::InvalidAddress {
                uri: a.uri().to_owned(),
                reason: if a.token() == SELF_TOKEN {
                    "this is the plugin's own address".into()
                } else {
                    "not an address of this verbs plugin instance".into()
                },
            }),
        }
    }

    /// The peer an address names, if it is still usable.
    pub(crate) fn live_peer(&self, a: &Addr) -> Result<usize> {
        let p = self.peer_of(a)?;
        match &self.peers[p].dead {
            Some(reason) => Err(NaError::PeerGone {
                peer: self.peers[p].uri.clone(),
                reason: reason.clone(),
            }),
            None => Ok(p),
        }
    }

    /// Makes the poll fd readable (the deadline timer fires now) if the
    /// owner may be asleep on it and completions wait: a call from another
    /// thread queued them (a receive that matched a held message, a
    /// cancel, a send to a peer already gone), and nothing else would wake
    /// it. The timer's next sweep puts it back to the next deadline. One
    /// load when nobody sleeps.
    #[inline]
    pub(crate) fn wake_owner_if_work(&mut self) {
        if self.armed && !self.completions.is_empty() {
            self.arm_deadline(Instant::now());
        }
    }

    /// `r`, once [`wake_owner_if_work`](Self::wake_owner_if_work) ran:
    /// the tail of every entry point that may queue a completion.
    #[inline]
    fn woken_if_work<T>(&mut self, r: T) -> T {
        self.wake_owner_if_work();
        r
    }

    pub(crate) fn conn_mut(&mut self, c: ConnRef) -> Option<&mut Conn> {
        self.conns
            .get_mut(c.idx as usize)
            .filter(|s| s.gen == c.gen)
            .and_then(|s| s.conn.as_mut())
    }

    pub(crate) fn conn(&self, c: ConnRef) -> Option<&Conn> {
        self.conns
            .get(c.idx as usize)
            .filter(|s| s.gen == c.gen)
            .and_then(|s| s.conn.as_ref())
    }

    /// Every connection, with the reference that names it.
    pub(crate) fn conns_with_refs(&self) -> impl Iterator<Item = (ConnRef, &Conn)> + '_ {
        self.conns.iter().enumerate().filter_map(|(i, s)| {
            let r = ConnRef {
                idx: i as u16,
                gen: s.gen,
            };
            Some((r, s.conn.as_ref()?))
        })
    }

    /// The URI of the peer of a connection (for error messages).
    pub(crate) fn peer_uri_of(&self, c: ConnRef) -> String {
        self.conn(c)
            .and_then(|c| self.peers.get(c.peer))
            .map_or_else(|| String::from("(unknown peer)"), |p| p.uri.clone())
    }
}

pub(crate) fn cache_err(e: na_regcache::Error) -> NaError {
    // The chain: "memory monitor uffd unavailable" alone hides the EPERM
    // or ENOSYS that says why.
    NaError::Plugin {
        plugin: SCHEME,
        message: format!("registration cache: {}", na_core::ErrorChain(&e)),
    }
}

impl Plugin for VerbsPlugin {
    fn scheme(&self) -> &'static str {
        SCHEME
    }

    fn id(&self) -> PluginId {
        self.id
    }

    fn self_addr(&self) -> Addr {
        Addr::new(self.self_uri.clone(), self.id, SELF_TOKEN, true)
    }

    fn lookup(&mut self, uri: &str) -> Result<Addr> {
        let (key, device) = VerbsUri::parse_peer(uri)?;
        let (p, _) = self.peers.find_or_insert(self.id, key, device.as_deref());
        Ok(self.peers[p].addr.clone())
    }

    fn max_unexpected_size(&self) -> usize {
        self.cfg.max_msg_size
    }

    fn max_expected_size(&self) -> usize {
        self.cfg.max_msg_size
    }

    /// Ours, or the peer's (from its connection's hello) when smaller;
    /// before the hello, nothing past [`min_peer_unexpected_size`]
    /// (0: a peer may take empty messages only). An address that names
    /// no live peer (ourselves, a peer gone) gets ours: a send to it
    /// fails or stays local whatever its size.
    ///
    /// [`min_peer_unexpected_size`]: na_core::Plugin::min_peer_unexpected_size
    fn max_unexpected_size_to(&self, dest: &Addr) -> usize {
        let own = self.cfg.max_msg_size;
        let Ok(p) = self.live_peer(dest) else {
            return own;
        };
        let known = self.peers[p]
            .conn
            .and_then(|c| self.conn(c))
            .filter(|c| c.state != ConnState::Dead)
            .and_then(|c| c.peer_max_msg);
        match known {
            Some(peer) => own.min(peer),
            None => own.min(self.min_peer_unexpected_size()),
        }
    }

    /// 0: every process picks its own limit
    /// ([`VerbsConfig::max_msg_size`](crate::VerbsConfig::max_msg_size),
    /// which may be 0) and tells it in its hello.
    fn min_peer_unexpected_size(&self) -> usize {
        0
    }

    fn max_tag(&self) -> Tag {
        Tag::MAX
    }

    fn send_unexpected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()> {
        let r = self.send_msg(dest, OpKind::SendUnexpected, tag, Outgoing::Slice(data), op);
        self.woken_if_work(r)
    }

    fn send_expected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()> {
        let r = self.send_msg(dest, OpKind::SendExpected, tag, Outgoing::Slice(data), op);
        self.woken_if_work(r)
    }

    /// Registered buffers: sends from them need no copy (see `msgbuf.rs`).
    fn alloc_msg_buf(&mut self, size: usize) -> Result<MsgBuf> {
        self.alloc_buf(size)
    }

    fn send_unexpected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        let r = self.send_msg(dest, OpKind::SendUnexpected, tag, Outgoing::Buf(buf), op);
        self.woken_if_work(r)
    }

    fn send_expected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        let r = self.send_msg(dest, OpKind::SendExpected, tag, Outgoing::Buf(buf), op);
        self.woken_if_work(r)
    }

    fn post_recv_unexpected(&mut self, buf: Vec<u8>, op: OpId) -> Result<()> {
        let r = self.recv_unexpected(buf, op);
        self.woken_if_work(r)
    }

    fn post_recv_expected(&mut self, source: &Addr, tag: Tag, buf: Vec<u8>, op: OpId) -> Result<()> {
        let r = self.recv_expected(source, tag, buf, op);
        self.woken_if_work(r)
    }

    /// A handle registered already keeps its registration while it is
    /// valid: a new one would drop the exposed registrations, revoking the
    /// keys of descriptors peers already hold. An invalidated one (its
    /// memory was remapped) is replaced.
    fn mem_register(&mut self, mem: &MemHandle) -> Result<()> {
        if self.valid_registration(mem).is_some() {
            return Ok(());
        }
        self.register_mem(mem).map(drop)
    }

    fn mem_describe(&self, mem: &MemHandle) -> Result<RemoteMem> {
        self.describe(mem)
    }

    fn rma(&mut self, dest: &Addr, ops: &[Rma<'_>]) -> Result<()> {
        let r = self.rma_batch(dest, ops);
        self.woken_if_work(r)
    }

    fn cancel(&mut self, op: OpId) -> Result<()> {
        let r = self.cancel_op(op);
        self.woken_if_work(r)
    }

    fn poll_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.poll.as_fd())
    }

    fn try_wait(&mut self) -> Result<bool> {
        self.try_wait_inner()
    }

    /// Arms like `try_wait` and waits on the internal epoll set (completion
    /// channel and RDMA CM channel) itself; the next `progress` handles
    /// what woke it.
    fn sleep(&mut self, timeout: Option<Duration>) -> Result<bool> {
        if self.try_wait_inner()? {
            self.ready.clear();
            self.poll
                .wait(&mut self.ready, timeout)
                .map_err(|e| NaError::sys("epoll_wait (verbs)", e))?;
        }
        Ok(true)
    }

    fn progress(&mut self) -> Result<usize> {
        self.progress_inner()
    }

    fn pop_completion(&mut self) -> Option<Completion> {
        self.completions.pop_front()
    }

    fn take_completions(&mut self, out: &mut VecDeque<Completion>) {
        out.append(&mut self.completions);
    }

    fn stats(&self) -> PluginStats {
        let mut s = self.stats;
        s.peers = self
            .conns
            .iter()
            .filter_map(|c| c.conn.as_ref())
            .filter(|c| c.state != crate::conn::ConnState::Dead)
            .count() as u64;
        s.queued_arrivals = self.matching.held_count() as u64;
        s.peer_entries = self.peers.len() as u64;
        s.backlog_bytes = self.backlog_total.bytes() as u64;
        s.sends_posted = self
            .conns
            .iter()
            .filter_map(|c| c.conn.as_ref())
            .map(|c| (c.send_ops.len() - c.free_send.len()) as u64)
            .sum();
        s
    }
}

impl Drop for VerbsPlugin {
    fn drop(&mut self) {
        // Disconnect politely so peers see `Disconnected` at once; QPs,
        // CQ, PD and ids are then released by their RAII owners.
        for slot in &self.conns {
            if let Some(c) = &slot.conn {
                if c.state == crate::conn::ConnState::Established {
                    let _ = c.id.disconnect();
                }
            }
        }
        self.cache.log_stats();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_depths_never_exceed_the_device_nor_invent_reads() {
        let max = crate::config::DEFAULT_MAX_RD_ATOMIC;
        assert_eq!(rd_atomic_limit(0, max), 0, "a device without reads gets none");
        assert_eq!(rd_atomic_limit(1, max), 1);
        assert_eq!(rd_atomic_limit(4, max), 4);
        assert_eq!(rd_atomic_limit(128, max), max);
        assert_eq!(rd_atomic_limit(u32::MAX, max), max);
        assert_eq!(rd_atomic_limit(128, 2), 2, "the configured bound");
        assert_eq!(rd_atomic_limit(128, 0), 0, "configured without reads");
    }
}
