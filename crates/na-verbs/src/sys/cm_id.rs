//! RDMA CM identifiers, the RDMA analogue of sockets: `rdma_create_id(3)`,
//! `rdma_bind_addr(3)`, `rdma_listen(3)`, `rdma_resolve_addr(3)`,
//! `rdma_resolve_route(3)`, `rdma_create_qp(3)`, `rdma_connect(3)`,
//! `rdma_accept(3)`, `rdma_reject(3)`, `rdma_notify(3)`, `rdma_init_qp_attr(3)`,
//! `rdma_disconnect(3)`,
//! `rdma_destroy_id(3)`. The call order is documented in `cm.rs`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::{
    null_error, syscall, CmIdKey, Context, EventChannel, ProtectionDomain, QpInitAttr, QpState, QueuePair,
};
use crate::error::{Result, VerbsError};

/// RDMA CM port space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortSpace {
    /// Reliable connected, TCP-like port numbers (`RDMA_PS_TCP`).
    Tcp,
}

/// Connection parameters for [`CmId::connect`] and [`CmId::accept`].
#[derive(Debug, Clone, Default)]
pub struct ConnParam {
    /// Private data (at most 56 bytes on connect, 196 on accept, over RoCE/TCP).
    pub private_data: Vec<u8>,
    /// Outstanding RDMA READs we accept as target.
    pub responder_resources: u8,
    /// Outstanding RDMA READs we issue as initiator.
    pub initiator_depth: u8,
    /// Transport retries (connect only; 0..=7).
    pub retry_count: u8,
    /// RNR retries (0..=7, 7 = infinite).
    pub rnr_retry_count: u8,
    /// The QP of a connection whose QP was not made by
    /// [`CmId::create_qp`] (0: the id's own). Its owner then moves it
    /// through its states itself ([`CmId::modify_qp`]), and the active
    /// side gets `ConnectResponse` instead of `Established`.
    pub qp_num: u32,
}

impl ConnParam {
    fn to_raw(&self, op: &'static str) -> Result<rdma_conn_param> {
        let len = u8::try_from(self.private_data.len()).map_err(|_| VerbsError::InvalidArgument {
            op,
            reason: format!("{} bytes of private data (max 255)", self.private_data.len()),
        })?;
        Ok(rdma_conn_param {
            private_data: if len == 0 {
                std::ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: len,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 0,
            retry_count: self.retry_count.min(7),
            rnr_retry_count: self.rnr_retry_count.min(7),
            srq: 0,
            qp_num: self.qp_num,
        })
    }
}

/// An RDMA CM identifier (`struct rdma_cm_id`), the RDMA analogue of a socket.
pub struct CmId {
    raw: NonNull<rdma_cm_id>,
    _channel: Arc<EventChannel>,
}

// SAFETY: librdmacm serialises operations on an id (kernel ucma commands and
// the library's per-id lock); all methods take `&self` and only call librdmacm.
unsafe impl Send for CmId {}
// SAFETY: see `Send`.
unsafe impl Sync for CmId {}

/// A `sockaddr_storage` holding `addr`.
fn to_sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
        }
    }
    ss
}

/// The socket address in a `sockaddr_storage`, if it is IPv4 or IPv6.
fn from_sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match libc::c_int::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let s6 = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(s6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(s6.sin6_port),
                0,
                s6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

impl CmId {
    /// Wraps the new id of a connection request (owned by us from now on).
    pub(super) fn from_request(raw: NonNull<rdma_cm_id>, channel: Arc<EventChannel>) -> Arc<CmId> {
        Arc::new(CmId {
            raw,
            _channel: channel,
        })
    }

    /// Creates an id on `channel` (`rdma_create_id`); its events arrive there.
    pub fn new(channel: &Arc<EventChannel>, ps: PortSpace) -> Result<Arc<CmId>> {
        let ps_raw = match ps {
            PortSpace::Tcp => rdma_port_space::RDMA_PS_TCP,
        };
        let mut raw: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is live; `raw` is a valid out-pointer; no user context.
        syscall!(unsafe { rdma_create_id(channel.as_ptr(), &mut raw, std::ptr::null_mut(), ps_raw) })
            .map_err(|source| VerbsError::Cm {
                op: "rdma_create_id",
                context: format!("{ps:?}"),
                source,
            })?;
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::Cm {
            op: "rdma_create_id",
            context: format!("{ps:?}"),
            source: null_error(),
        })?;
        Ok(Arc::new(CmId {
            raw,
            _channel: Arc::clone(channel),
        }))
    }

    pub(crate) fn as_ptr(&self) -> *mut rdma_cm_id {
        self.raw.as_ptr()
    }

    /// The key events use to refer to this id.
    pub fn key(&self) -> CmIdKey {
        CmIdKey(self.raw.as_ptr() as usize)
    }

    fn cm_call(&self, op: &'static str, context: impl FnOnce() -> String, rc: libc::c_int) -> Result<()> {
        syscall!(rc).map(drop).map_err(|source| VerbsError::Cm {
            op,
            context: context(),
            source,
        })
    }

    /// Binds to a local address (`rdma_bind_addr`); port 0 picks a free port.
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        let mut ss = to_sockaddr(addr);
        // SAFETY: the id is live; `ss` is a valid sockaddr for the call.
        let rc = unsafe { rdma_bind_addr(self.as_ptr(), (&mut ss as *mut libc::sockaddr_storage).cast()) };
        self.cm_call("rdma_bind_addr", || addr.to_string(), rc)
    }

    /// Starts listening for connection requests (`rdma_listen`).
    pub fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: the id is live.
        let rc = unsafe { rdma_listen(self.as_ptr(), backlog) };
        self.cm_call("rdma_listen", || format!("backlog {backlog}"), rc)
    }

    /// Starts resolving `dst` to a device and port; completes with `AddrResolved`.
    pub fn resolve_addr(&self, src: Option<SocketAddr>, dst: SocketAddr, timeout_ms: i32) -> Result<()> {
        let mut s = src.map(to_sockaddr);
        let mut d = to_sockaddr(dst);
        let sp = s.as_mut().map_or(std::ptr::null_mut(), |s| {
            (s as *mut libc::sockaddr_storage).cast()
        });
        // SAFETY: the id is live; `sp` is NULL or a valid sockaddr, `d` is valid.
        let rc = unsafe {
            rdma_resolve_addr(
                self.as_ptr(),
                sp,
                (&mut d as *mut libc::sockaddr_storage).cast(),
                timeout_ms,
            )
        };
        self.cm_call("rdma_resolve_addr", || dst.to_string(), rc)
    }

    /// Starts resolving the route to the peer; completes with `RouteResolved`.
    pub fn resolve_route(&self, timeout_ms: i32) -> Result<()> {
        // SAFETY: the id is live.
        let rc = unsafe { rdma_resolve_route(self.as_ptr(), timeout_ms) };
        self.cm_call("rdma_resolve_route", || format!("{:?}", self.peer_addr()), rc)
    }

    /// The local address, once bound or resolved.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is live; route.addr is owned by it and only read here.
        from_sockaddr(unsafe { &(*self.as_ptr()).route.addr.src_addr_union.src_storage })
            .filter(|a| a.ip() != IpAddr::V4(Ipv4Addr::UNSPECIFIED) || a.port() != 0)
    }

    /// The peer address, once resolved or connected.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as in `local_addr`.
        from_sockaddr(unsafe { &(*self.as_ptr()).route.addr.dst_addr_union.dst_storage })
            .filter(|a| a.ip() != IpAddr::V4(Ipv4Addr::UNSPECIFIED) || a.port() != 0)
    }

    /// Port number on the device, once bound to one.
    pub fn port_num(&self) -> u8 {
        // SAFETY: the id is live; plain field read.
        unsafe { (*self.as_ptr()).port_num }
    }

    /// The device context librdmacm uses for this id (set once the id is
    /// bound to a device address, resolved, or created by a request).
    ///
    /// PDs, CQs and MRs for [`CmId::create_qp`] must be created on it.
    pub fn context(self: &Arc<Self>) -> Result<Arc<Context>> {
        // SAFETY: the id is live; `verbs` is set by librdmacm and owned by it.
        let verbs = unsafe { (*self.as_ptr()).verbs };
        let verbs = NonNull::new(verbs).ok_or_else(|| VerbsError::InvalidArgument {
            op: "CmId::context",
            reason: "the id is not bound to an RDMA device yet (bind to a device address, or \
                     resolve an address first)"
                .into(),
        })?;
        Ok(Context::from_cm_id(verbs, Arc::clone(self)))
    }

    /// Creates the RC QP of this connection (`rdma_create_qp`); librdmacm moves
    /// it through INIT/RTR/RTS on connect/accept.
    pub fn create_qp(
        self: &Arc<Self>,
        pd: &Arc<ProtectionDomain>,
        attr: QpInitAttr<'_>,
    ) -> Result<QueuePair> {
        // SAFETY: the id is live; plain field read.
        let verbs = unsafe { (*self.as_ptr()).verbs };
        if verbs.is_null() || verbs != pd.context().as_ptr() {
            return Err(VerbsError::InvalidArgument {
                op: "CmId::create_qp",
                reason: "the PD was not allocated on this id's device context (CmId::context)".into(),
            });
        }
        let mut raw_attr = attr.to_raw();
        // SAFETY: id, PD, CQs (and SRQ) are live, on the same context; `raw_attr`
        // is a valid in/out pointer.
        let rc = unsafe { rdma_create_qp(self.as_ptr(), pd.as_ptr(), &mut raw_attr) };
        self.cm_call("rdma_create_qp", || format!("{:?}", attr.caps), rc)?;
        // SAFETY: on success librdmacm stored the new QP in id->qp.
        let qp = NonNull::new(unsafe { (*self.as_ptr()).qp }).ok_or_else(|| VerbsError::Cm {
            op: "rdma_create_qp",
            context: "id->qp is NULL after success".into(),
            source: null_error(),
        })?;
        Ok(QueuePair::from_cm(qp, &raw_attr.cap, Arc::clone(self), pd, attr))
    }

    /// Connects to the resolved peer (`rdma_connect`); completes with
    /// `Established`, `Rejected`, `Unreachable` or `ConnectError`.
    pub fn connect(&self, param: &ConnParam) -> Result<()> {
        let mut p = param.to_raw("CmId::connect")?;
        // SAFETY: the id is live; `p` and its private data outlive the call.
        let rc = unsafe { rdma_connect(self.as_ptr(), &mut p) };
        self.cm_call("rdma_connect", || format!("{:?}", self.peer_addr()), rc)
    }

    /// Accepts a connection request on this (new) id (`rdma_accept`).
    pub fn accept(&self, param: &ConnParam) -> Result<()> {
        let mut p = param.to_raw("CmId::accept")?;
        // SAFETY: the id is live; `p` and its private data outlive the call.
        let rc = unsafe { rdma_accept(self.as_ptr(), &mut p) };
        self.cm_call("rdma_accept", || format!("{:?}", self.peer_addr()), rc)
    }

    /// Tells RDMA CM that the connection is in use (`rdma_notify` with
    /// `IBV_EVENT_COMM_EST`): the passive side got a message before the
    /// peer's ready-to-use (RTU) reached its CM, so the CM stops waiting
    /// (and resending its reply) and reports `Established` now. `Ok(true)`
    /// if the CM took it; `Ok(false)` if it had the RTU already (the
    /// kernel's `EISCONN`: the usual case, when the event is merely still
    /// unread).
    pub fn notify_established(&self) -> Result<bool> {
        // SAFETY: the id is live; the event is a plain enum value.
        let rc = unsafe { rdma_notify(self.as_ptr(), ibv_event_type::IBV_EVENT_COMM_EST) };
        match self.cm_call("rdma_notify", || format!("{:?}", self.peer_addr()), rc) {
            Ok(()) => Ok(true),
            Err(VerbsError::Cm { source, .. }) if source.raw_os_error() == Some(libc::EISCONN) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Moves `qp`, a QP this id did not create, to `state` (`Init`, `Rtr`
    /// or `Rts`) with the attributes RDMA CM has for the connection
    /// (`rdma_init_qp_attr`, then `ibv_modify_qp`). After `Rts` on the
    /// active side, `rdma_establish` would send the ready-to-use message
    /// (RTU); this crate never calls it (tests use that to leave the
    /// passive side without one).
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn modify_qp(&self, qp: &QueuePair, state: QpState) -> Result<()> {
        let (raw_state, name) = match state {
            QpState::Init => (ibv_qp_state::IBV_QPS_INIT, "INIT"),
            QpState::Rtr => (ibv_qp_state::IBV_QPS_RTR, "RTR"),
            QpState::Rts => (ibv_qp_state::IBV_QPS_RTS, "RTS"),
            other => {
                return Err(VerbsError::InvalidArgument {
                    op: "CmId::modify_qp",
                    reason: format!("RDMA CM has no attributes for {other:?}"),
                })
            }
        };
        // SAFETY: plain old data; all-zero is valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = raw_state;
        let mut mask: libc::c_int = 0;
        // SAFETY: the id is live; `attr` and `mask` are valid for writes.
        let rc = unsafe { rdma_init_qp_attr(self.as_ptr(), &mut attr, &mut mask) };
        self.cm_call(
            "rdma_init_qp_attr",
            || format!("{:?} to {name}", self.peer_addr()),
            rc,
        )?;
        qp.modify(name, &mut attr, ibv_qp_attr_mask(mask as u32))
    }

    /// Rejects a connection request (`rdma_reject`), with at most 255
    /// bytes of `private_data` (the transport may take fewer: 148 on
    /// InfiniBand and RoCE).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        // Cut to what the length byte can say, so it never names more
        // bytes than the slice has.
        let data = &private_data[..private_data.len().min(usize::from(u8::MAX))];
        let len = data.len() as u8;
        // SAFETY: the id is live; `data` outlives the call and is `len` bytes long.
        let rc = unsafe { rdma_reject(self.as_ptr(), data.as_ptr().cast(), len) };
        self.cm_call("rdma_reject", || format!("{:?}", self.peer_addr()), rc)
    }

    /// Disconnects (`rdma_disconnect`); both sides get `Disconnected`.
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: the id is live.
        let rc = unsafe { rdma_disconnect(self.as_ptr()) };
        self.cm_call("rdma_disconnect", || format!("{:?}", self.peer_addr()), rc)
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: the QP of this id (if any) holds an Arc to it, so it is gone;
        // all events were acked when read, so this does not block; once.
        let rc = unsafe { rdma_destroy_id(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "rdma_destroy_id failed");
        }
    }
}

impl std::fmt::Debug for CmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmId")
            .field("key", &self.key())
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .finish()
    }
}
