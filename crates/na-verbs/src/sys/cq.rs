//! Completion channels and queues: `ibv_create_comp_channel(3)`,
//! `ibv_create_cq(3)`, `ibv_poll_cq(3)`, `ibv_req_notify_cq(3)`,
//! `ibv_get_cq_event(3)`, `ibv_ack_cq_events(3)`.
//!
//! # Arm-and-drain (no lost events)
//! 1. [`CompletionQueue::arm_and_drain`]: poll until empty, arm with
//!    `ibv_req_notify_cq`, poll once more (a completion that arrived between
//!    the last poll and the arm would otherwise raise no event).
//! 2. Wait until the [`CompletionChannel`] fd is readable (epoll/poll).
//! 3. [`CompletionChannel::consume_events`]: read and ack every pending event,
//!    then go to 1.
//!
//! Events are acked as soon as they are read, so destroying a CQ never blocks.

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rdma_sys::*;

use super::{c_ptr_to_string, errno_rc, null_error, set_nonblocking, Context};
use crate::error::{Result, VerbsError};

/// A completion event channel (`struct ibv_comp_channel`): a nonblocking fd
/// that becomes readable when an armed CQ gets a completion.
pub struct CompletionChannel {
    raw: NonNull<ibv_comp_channel>,
    ctx: Arc<Context>,
    /// Serialises reading events with destroying CQs of this channel, so an
    /// event is never read for a CQ that is being destroyed.
    events: Mutex<()>,
}

// SAFETY: libibverbs channel calls are thread-safe; `events` serialises the
// only cross-object interaction (event read vs. CQ destruction).
unsafe impl Send for CompletionChannel {}
// SAFETY: see `Send`.
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    /// Creates a completion channel on `ctx` and makes its fd nonblocking.
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<CompletionChannel>> {
        // SAFETY: the context is live.
        let raw = unsafe { ibv_create_comp_channel(ctx.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::Create {
            op: "ibv_create_comp_channel",
            context: ctx.name().to_owned(),
            source: null_error(),
        })?;
        let ch = CompletionChannel {
            raw,
            ctx: Arc::clone(ctx),
            events: Mutex::new(()),
        };
        set_nonblocking(ch.fd()).map_err(|source| VerbsError::Create {
            op: "fcntl(O_NONBLOCK) on completion channel",
            context: ctx.name().to_owned(),
            source,
        })?;
        Ok(Arc::new(ch))
    }

    fn fd(&self) -> libc::c_int {
        // SAFETY: `raw` is live; `fd` is immutable after creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }

    /// The device context of the channel.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Reads and acks every pending completion event; returns how many there were.
    ///
    /// Returns `Ok(0)` when nothing is pending. Each event means "an armed CQ
    /// of this channel has completions": re-run [`CompletionQueue::arm_and_drain`].
    pub fn consume_events(&self) -> Result<u32> {
        let _guard = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut cq_ctx: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and nonblocking; out-pointers are valid.
            let rc = unsafe { ibv_get_cq_event(self.raw.as_ptr(), &mut cq, &mut cq_ctx) };
            if rc != 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    return Ok(n);
                }
                return Err(VerbsError::Completion {
                    op: "ibv_get_cq_event",
                    source: e,
                });
            }
            // SAFETY: `cq` was just returned for this channel and cannot be
            // destroyed while we hold `events` (CompletionQueue::drop takes it).
            unsafe { ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd is owned by the channel and stays open until Drop.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel holds an Arc to it, so none is
        // left; destroyed exactly once.
        let rc = unsafe { ibv_destroy_comp_channel(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_comp_channel failed");
        }
    }
}

/// Opcode of a work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOpcode {
    /// A SEND finished.
    Send,
    /// An RDMA WRITE finished.
    RdmaWrite,
    /// An RDMA READ finished.
    RdmaRead,
    /// A receive consumed an incoming SEND.
    Recv,
    /// A receive consumed an incoming RDMA WRITE with immediate.
    RecvRdmaWithImm,
    /// Anything else (atomics, memory windows...), raw value.
    Other(u32),
}

/// One work completion (`struct ibv_wc`), copied out of the CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The `wr_id` of the work request.
    pub wr_id: u64,
    /// `IBV_WC_SUCCESS` (0) or an error status; see [`WorkCompletion::status_str`].
    pub status: u32,
    /// What completed (valid for errors only as far as the device reports it).
    pub opcode: WcOpcode,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// Immediate data in host byte order, if the message carried one.
    pub imm: Option<u32>,
    /// Local QP number.
    pub qp_num: u32,
    /// Vendor error syndrome.
    pub vendor_err: u32,
}

impl WorkCompletion {
    /// True when the work request succeeded.
    pub fn is_ok(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_SUCCESS
    }

    /// Text of the status (`ibv_wc_status_str`).
    pub fn status_str(&self) -> String {
        // SAFETY: ibv_wc_status_str accepts any value and returns a static string.
        c_ptr_to_string(unsafe { ibv_wc_status_str(self.status) })
    }

    fn from_raw(wc: &ibv_wc) -> WorkCompletion {
        use ibv_wc_opcode::*;
        let opcode = match wc.opcode {
            IBV_WC_SEND => WcOpcode::Send,
            IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            IBV_WC_RECV => WcOpcode::Recv,
            IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            o => WcOpcode::Other(o),
        };
        let with_imm = wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
        // SAFETY: both union members are u32; reading either is always valid.
        let imm = with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
        WorkCompletion {
            wr_id: wc.wr_id,
            status: wc.status,
            opcode,
            byte_len: wc.byte_len,
            imm,
            qp_num: wc.qp_num,
            vendor_err: wc.vendor_err,
        }
    }
}

/// A completion queue (`struct ibv_cq`), optionally attached to a channel.
pub struct CompletionQueue {
    raw: NonNull<ibv_cq>,
    capacity: u32,
    channel: Option<Arc<CompletionChannel>>,
    ctx: Arc<Context>,
}

// SAFETY: ibv_poll_cq/ibv_req_notify_cq are thread-safe in libibverbs providers
// (per-CQ locking); the pointer is only used through libibverbs.
unsafe impl Send for CompletionQueue {}
// SAFETY: see `Send`.
unsafe impl Sync for CompletionQueue {}

/// Completions copied per `ibv_poll_cq` call.
const POLL_BATCH: usize = 16;

impl CompletionQueue {
    /// Creates a CQ with at least `min_entries` entries (`ibv_create_cq`).
    pub fn new(
        ctx: &Arc<Context>,
        min_entries: u32,
        channel: Option<&Arc<CompletionChannel>>,
    ) -> Result<Arc<CompletionQueue>> {
        let ch_ptr = channel.map_or(std::ptr::null_mut(), |c| c.raw.as_ptr());
        let cqe = libc::c_int::try_from(min_entries.max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: the context (and channel, if any) are live; no cq_context.
        let raw = unsafe { ibv_create_cq(ctx.as_ptr(), cqe, std::ptr::null_mut(), ch_ptr, 0) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::Create {
            op: "ibv_create_cq",
            context: format!("{} entries on {}", min_entries, ctx.name()),
            source: null_error(),
        })?;
        // SAFETY: `raw` is live; `cqe` holds the actual size after creation.
        let capacity = unsafe { (*raw.as_ptr()).cqe }.max(0) as u32;
        Ok(Arc::new(CompletionQueue {
            raw,
            capacity,
            channel: channel.cloned(),
            ctx: Arc::clone(ctx),
        }))
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv_cq {
        self.raw.as_ptr()
    }

    /// Number of entries the device allocated.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// The device context of the CQ.
    #[cfg_attr(not(feature = "test-hooks"), allow(dead_code))]
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Polls up to `max` completions and appends them to `out`; returns how many.
    ///
    /// On error, the completions taken off the CQ before the failing
    /// `ibv_poll_cq` are in `out` already (they are no longer in the CQ):
    /// the caller must handle them as well as the error.
    pub fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
        let mut buf: [MaybeUninit<ibv_wc>; POLL_BATCH] = [const { MaybeUninit::uninit() }; POLL_BATCH];
        let mut total = 0;
        while total < max {
            let want = (max - total).min(POLL_BATCH);
            // SAFETY: the CQ is live; `buf` has room for `want` entries, and the
            // provider initialises the first `rc` of them.
            let rc = unsafe { ibv_poll_cq(self.raw.as_ptr(), want as i32, buf.as_mut_ptr().cast()) };
            if rc < 0 {
                return Err(VerbsError::Completion {
                    op: "ibv_poll_cq",
                    source: std::io::Error::from_raw_os_error(if rc == -1 { libc::EIO } else { -rc }),
                });
            }
            let got = rc as usize;
            for wc in &buf[..got] {
                // SAFETY: the first `got` entries were written by ibv_poll_cq.
                out.push(WorkCompletion::from_raw(unsafe { wc.assume_init_ref() }));
            }
            total += got;
            if got < want {
                break;
            }
        }
        Ok(total)
    }

    /// Arms the CQ: the next completion raises an event on its channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: the CQ is live.
        errno_rc(unsafe { ibv_req_notify_cq(self.raw.as_ptr(), i32::from(solicited_only)) }).map_err(
            |source| VerbsError::Completion {
                op: "ibv_req_notify_cq",
                source,
            },
        )
    }

    /// Polls everything, arms, and polls again (see the module docs); appends
    /// to `out` and returns how many completions were found. On error, what
    /// was taken off the CQ before it is in `out` (see [`poll`](Self::poll)).
    pub fn arm_and_drain(&self, out: &mut Vec<WorkCompletion>) -> Result<usize> {
        let mut n = self.poll(out, usize::MAX)?;
        self.req_notify(false)?;
        n += self.poll(out, usize::MAX)?;
        Ok(n)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // Hold the channel's event lock so no event for this CQ is being read.
        let _guard = self
            .channel
            .as_ref()
            .map(|c| c.events.lock().unwrap_or_else(|p| p.into_inner()));
        // SAFETY: every QP/SRQ using this CQ holds an Arc to it, so none is
        // left; all events were acked in consume_events; destroyed once.
        let rc = unsafe { ibv_destroy_cq(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_cq failed");
        }
    }
}
