//! RDMA connection manager: `rdma_create_event_channel(3)`, `rdma_create_id(3)`,
//! `rdma_bind_addr(3)`, `rdma_listen(3)`, `rdma_resolve_addr(3)`,
//! `rdma_resolve_route(3)`, `rdma_create_qp(3)`, `rdma_connect(3)`,
//! `rdma_accept(3)`, `rdma_reject(3)`, `rdma_disconnect(3)`,
//! `rdma_get_cm_event(3)`, `rdma_ack_cm_event(3)`.
//!
//! Call order, active side: [`CmId::resolve_addr`] → `AddrResolved` event →
//! [`CmId::resolve_route`] → `RouteResolved` → [`CmId::create_qp`] →
//! [`CmId::connect`] → `Established`. Passive side: [`CmId::bind`] →
//! [`CmId::listen`] → `ConnectRequest` (carrying a new id) → `create_qp` on
//! the new id → [`CmId::accept`] → `Established`. Either side:
//! [`CmId::disconnect`] → `Disconnected`.
//!
//! Events are copied and acked as soon as they are read, so destroying an id
//! (which waits for its events to be acked) never blocks on us.

use std::os::fd::{AsFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::{c_ptr_to_string, null_error, set_nonblocking, syscall, CmId};
use crate::error::{Result, VerbsError};

/// An RDMA CM event channel (`struct rdma_event_channel`) with a nonblocking fd.
pub struct EventChannel {
    raw: NonNull<rdma_event_channel>,
}

// SAFETY: librdmacm's event channel calls are thread-safe; the pointer is only
// used through librdmacm.
unsafe impl Send for EventChannel {}
// SAFETY: see `Send`.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub(super) fn as_ptr(&self) -> *mut rdma_event_channel {
        self.raw.as_ptr()
    }

    /// Creates an event channel and makes its fd nonblocking.
    pub fn new() -> Result<Arc<EventChannel>> {
        // SAFETY: no arguments; returns an owned channel or NULL.
        let raw = unsafe { rdma_create_event_channel() };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::Cm {
            op: "rdma_create_event_channel",
            context: "(is the rdma_ucm module loaded? /dev/infiniband/rdma_cm)".into(),
            source: null_error(),
        })?;
        let ch = EventChannel { raw };
        // SAFETY: `raw` is live; `fd` is immutable after creation.
        let fd = unsafe { (*ch.raw.as_ptr()).fd };
        set_nonblocking(fd).map_err(|source| VerbsError::Cm {
            op: "fcntl(O_NONBLOCK)",
            context: "rdma_cm event channel".into(),
            source,
        })?;
        Ok(Arc::new(ch))
    }

    /// Reads one event if there is one (`rdma_get_cm_event` + `rdma_ack_cm_event`).
    ///
    /// Returns `Ok(None)` when nothing is pending; wait for the fd to become
    /// readable then.
    pub fn get_event(self: &Arc<Self>) -> Result<Option<CmEvent>> {
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is live and nonblocking; `ev` is a valid out-pointer.
        if let Err(e) = syscall!(unsafe { rdma_get_cm_event(self.raw.as_ptr(), &mut ev) }) {
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(VerbsError::Cm {
                op: "rdma_get_cm_event",
                context: String::new(),
                source: e,
            });
        }
        // SAFETY: on success `ev` points to an event we own until it is acked below.
        let e = unsafe { &*ev };
        let kind = CmEventKind::from_raw(e.event);
        // SAFETY: the event is of a connected (TCP/IB) port space, so `conn` is
        // the active union member; private_data is valid for its length until ack.
        let (private_data, responder_resources, initiator_depth) = unsafe {
            let c = &e.param.conn;
            let pd = if c.private_data.is_null() || c.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(c.private_data.cast::<u8>(), c.private_data_len as usize).to_vec()
            };
            (pd, c.responder_resources, c.initiator_depth)
        };
        let new_id = match (kind, NonNull::new(e.id)) {
            (CmEventKind::ConnectRequest, Some(raw)) => Some(CmId::from_request(raw, Arc::clone(self))),
            _ => None,
        };
        let out = CmEvent {
            kind,
            status: e.status,
            id: CmIdKey(e.id as usize),
            listen_id: NonNull::new(e.listen_id).map(|p| CmIdKey(p.as_ptr() as usize)),
            new_id,
            private_data,
            responder_resources,
            initiator_depth,
        };
        // SAFETY: `ev` came from rdma_get_cm_event and is acked exactly once;
        // nothing borrowed from it survives (everything was copied).
        let rc = unsafe { rdma_ack_cm_event(ev) };
        if rc != 0 {
            tracing::warn!(rc, "rdma_ack_cm_event failed");
        }
        Ok(Some(out))
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd is owned by the channel and stays open until Drop.
        unsafe { BorrowedFd::borrow_raw((*self.raw.as_ptr()).fd) }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every CmId holds an Arc to its channel, so none is left;
        // destroyed exactly once.
        unsafe { rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// Identifies a [`CmId`] in events (the address of the `rdma_cm_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmIdKey(pub(super) usize);

/// Kinds of RDMA CM events (`enum rdma_cm_event_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmEventKind {
    /// `rdma_resolve_addr` found the destination's address (next: resolve the route).
    AddrResolved,
    /// `rdma_resolve_addr` failed.
    AddrError,
    /// `rdma_resolve_route` found the route (next: connect).
    RouteResolved,
    /// `rdma_resolve_route` failed.
    RouteError,
    /// A listening id got a connection request (on a new id, to accept or reject).
    ConnectRequest,
    /// A connect got its answer, where the QP is not the id's own (the caller moves it to RTS).
    ConnectResponse,
    /// Establishing the connection failed.
    ConnectError,
    /// The remote side could not be reached (or did not answer).
    Unreachable,
    /// The remote side rejected the connection (its private data says why).
    Rejected,
    /// The connection is up.
    Established,
    /// The connection is down (either side disconnected, or it failed).
    Disconnected,
    /// The id's RDMA device was removed: destroy the id.
    DeviceRemoval,
    /// The id's address now maps to another device (an address change or failover).
    AddrChange,
    /// The QP of a closed connection left time-wait: its number may be reused.
    TimewaitExit,
    /// Any other event, raw value.
    Other(u32),
}

/// Raw event types and their kinds.
const KINDS: [(u32, CmEventKind); 14] = {
    use rdma_cm_event_type::*;
    [
        (RDMA_CM_EVENT_ADDR_RESOLVED, CmEventKind::AddrResolved),
        (RDMA_CM_EVENT_ADDR_ERROR, CmEventKind::AddrError),
        (RDMA_CM_EVENT_ROUTE_RESOLVED, CmEventKind::RouteResolved),
        (RDMA_CM_EVENT_ROUTE_ERROR, CmEventKind::RouteError),
        (RDMA_CM_EVENT_CONNECT_REQUEST, CmEventKind::ConnectRequest),
        (RDMA_CM_EVENT_CONNECT_RESPONSE, CmEventKind::ConnectResponse),
        (RDMA_CM_EVENT_CONNECT_ERROR, CmEventKind::ConnectError),
        (RDMA_CM_EVENT_UNREACHABLE, CmEventKind::Unreachable),
        (RDMA_CM_EVENT_REJECTED, CmEventKind::Rejected),
        (RDMA_CM_EVENT_ESTABLISHED, CmEventKind::Established),
        (RDMA_CM_EVENT_DISCONNECTED, CmEventKind::Disconnected),
        (RDMA_CM_EVENT_DEVICE_REMOVAL, CmEventKind::DeviceRemoval),
        (RDMA_CM_EVENT_ADDR_CHANGE, CmEventKind::AddrChange),
        (RDMA_CM_EVENT_TIMEWAIT_EXIT, CmEventKind::TimewaitExit),
    ]
};

impl CmEventKind {
    fn from_raw(t: u32) -> CmEventKind {
        KINDS
            .iter()
            .find(|(r, _)| *r == t)
            .map_or(CmEventKind::Other(t), |(_, k)| *k)
    }

    fn to_raw(self) -> u32 {
        match self {
            CmEventKind::Other(o) => o,
            k => KINDS.iter().find(|(_, x)| *x == k).map_or(u32::MAX, |(r, _)| *r),
        }
    }

    /// librdmacm's name of the event (`rdma_event_str`).
    pub fn name(&self) -> String {
        // SAFETY: rdma_event_str accepts any value and returns a static string.
        c_ptr_to_string(unsafe { rdma_event_str(self.to_raw()) })
    }
}

/// One RDMA CM event, copied out of librdmacm (already acked).
#[derive(Debug)]
pub struct CmEvent {
    /// What happened.
    pub kind: CmEventKind,
    /// 0, or a negative errno / reject reason for error events.
    pub status: i32,
    /// The id the event is about (for `ConnectRequest`: the new id).
    pub id: CmIdKey,
    /// For `ConnectRequest`: the listening id.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub listen_id: Option<CmIdKey>,
    /// For `ConnectRequest`: the new connection's id, to accept or reject
    /// (dropping it rejects the request).
    pub new_id: Option<Arc<CmId>>,
    /// Private data of a request, accept or reject (untrusted peer bytes).
    pub private_data: Vec<u8>,
    /// RDMA READs the peer may have outstanding at us (the kernel's CM
    /// reports both depths from our side): for `ConnectRequest`, the
    /// initiator depth the peer asks for; for `Established` on the active
    /// side, the one its accept granted. Untrusted.
    pub responder_resources: u8,
    /// RDMA READs we may have outstanding at the peer: for
    /// `ConnectRequest`, the responder resources the peer offers; for
    /// `Established` on the active side, those its accept granted.
    /// Untrusted.
    pub initiator_depth: u8,
}
