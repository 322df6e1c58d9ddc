//! A raw peer: a hand-made RDMA CM client, built from the sys layer and
//! the wire format with no plugin on its side, that connects to a
//! listening verbs plugin with a hello of the test's choosing and
//! exchanges single messages with it. Tests use it to be a peer the
//! plugin cannot trust (`claimed_address.rs`, `hostile_peer.rs`,
//! `lost_rtu.rs`).
//!
//! One RC QP on one CQ (16 entries, on a completion channel), [`RECVS`]
//! receive buffers of a header and `payload` bytes each (work requests
//! `0..RECVS`, posted before connecting), and one send buffer for a
//! message of up to `payload` bytes (work request [`SEND_WR`]).

use std::net::SocketAddr;
use std::sync::Arc;

use na_verbs::sys::*;
use na_verbs::wire::{Header, MsgKind, HEADER_LEN};

use super::*;

/// Receive buffers a raw peer posts (work request ids `0..RECVS`).
pub const RECVS: u64 = 4;

/// Work request id of a raw peer's sends.
pub const SEND_WR: u64 = 100;

/// How a raw peer's QP is made and moved through its states.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RawQp {
    /// `rdma_create_qp` on the CM id: librdmacm moves it to RTS and sends
    /// the ready-to-use message (RTU) on connect.
    Cm,
    /// `ibv_create_qp`, moved through INIT, RTR and RTS by the peer itself
    /// (`rdma_init_qp_attr`), and no `rdma_establish`: the listener never
    /// gets the RTU, as when it is lost on the wire.
    Own,
}

/// A raw peer whose address and route to a listener are resolved and
/// whose receives are posted (see the module docs).
pub struct RawPeer {
    /// Names it in failure messages.
    pub who: &'static str,
    /// Its RDMA CM event channel.
    pub ch: Arc<EventChannel>,
    /// Its RDMA CM id.
    pub id: Arc<CmId>,
    /// Its QP.
    pub qp: QueuePair,
    /// The CQ of both its queues.
    pub cq: Arc<CompletionQueue>,
    /// The completion channel of `cq`.
    pub comp: Arc<CompletionChannel>,
    mode: RawQp,
    payload: usize,
    recv: MemoryRegion,
    send: MemoryRegion,
}

impl RawPeer {
    /// Resolves `dst` and sets up the QP (`mode`) and buffers, receives
    /// posted, for messages of up to `payload` bytes (whatever its hello
    /// will claim).
    pub fn new(dst: SocketAddr, who: &'static str, payload: usize, mode: RawQp) -> RawPeer {
        let (ch, id, ctx) = raw_resolved(dst, who);
        let pd = ProtectionDomain::new(&ctx).expect("pd");
        let comp = CompletionChannel::new(&ctx).expect("completion channel");
        let cq = CompletionQueue::new(&ctx, 16, Some(&comp)).expect("cq");
        let slot = HEADER_LEN + payload;
        let recv =
            MemoryRegion::allocate(&pd, RECVS as usize * slot, AccessFlags::LOCAL_WRITE).expect("recv mr");
        let send = MemoryRegion::allocate(&pd, slot, AccessFlags::LOCAL_WRITE).expect("send mr");
        let qp = match mode {
            RawQp::Cm => id.create_qp(&pd, small_qp_attr(&cq)).expect("rdma_create_qp"),
            RawQp::Own => {
                let qp = QueuePair::new_rc(&pd, small_qp_attr(&cq)).expect("ibv_create_qp");
                id.modify_qp(&qp, QpState::Init).expect("to INIT");
                qp
            }
        };
        let peer = RawPeer {
            who,
            ch,
            id,
            qp,
            cq,
            comp,
            mode,
            payload,
            recv,
            send,
        };
        for i in 0..RECVS {
            peer.repost(i);
        }
        peer
    }

    /// Connects with `param` (its `qp_num` is filled in for an own QP) and
    /// waits for the reply: `Established` for [`RawQp::Cm`]; for
    /// [`RawQp::Own`], `ConnectResponse` (librdmacm hands the reply over
    /// instead of answering it), after which the QP is moved to RTR and
    /// RTS and no RTU is sent. Returns the event.
    pub fn connect(&self, param: &ConnParam) -> CmEvent {
        let param = ConnParam {
            qp_num: if self.mode == RawQp::Own {
                self.qp.qp_num()
            } else {
                param.qp_num
            },
            ..param.clone()
        };
        self.id.connect(&param).expect("connect");
        if self.mode == RawQp::Cm {
            return wait_cm(&self.ch, CmEventKind::Established, self.who);
        }
        let ev = wait_cm(&self.ch, CmEventKind::ConnectResponse, self.who);
        self.id.modify_qp(&self.qp, QpState::Rtr).expect("to RTR");
        self.id.modify_qp(&self.qp, QpState::Rts).expect("to RTS");
        ev
    }

    /// Sends one unexpected message (`tag`, `body`) as work request
    /// [`SEND_WR`], signaled.
    pub fn send_unexpected(&self, tag: u32, body: &[u8]) {
        assert!(
            body.len() <= self.payload,
            "{}: a send buffer holds {} bytes",
            self.who,
            self.payload
        );
        let header = Header {
            kind: MsgKind::Unexpected,
            credits: 0,
            tag,
            len: body.len() as u32,
        };
        self.send.write_at(0, &header.encode()).unwrap();
        self.send.write_at(HEADER_LEN, body).unwrap();
        let sge = self.send.sge(0, HEADER_LEN + body.len()).unwrap();
        self.qp
            .post_send(SEND_WR, SendOp::Send, &[sge], true)
            .expect("post_send");
    }

    /// The next completion (waiting at most [`WAIT`]).
    pub fn next_wc(&self) -> WorkCompletion {
        wait_wc(&self.cq, &self.comp, 1, self.who)
            .pop()
            .expect("one completion")
    }

    /// Whether `wc` is one of the receives.
    pub fn is_recv(wc: &WorkCompletion) -> bool {
        wc.wr_id < RECVS
    }

    /// The bytes receive completion `wc` put in its buffer (header first).
    pub fn received(&self, wc: &WorkCompletion) -> Vec<u8> {
        let slot = HEADER_LEN + self.payload;
        let mut b = vec![0; (wc.byte_len as usize).min(slot)];
        self.recv
            .read_at(wc.wr_id as usize * slot, &mut b)
            .expect("read the receive buffer");
        b
    }

    /// The header (checked, with `max_payload`) and payload of the
    /// message receive completion `wc` brought.
    pub fn message(&self, wc: &WorkCompletion, max_payload: usize) -> (Header, Vec<u8>) {
        let b = self.received(wc);
        let head: &[u8; HEADER_LEN] = b
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .unwrap_or_else(|| panic!("{}: {} bytes hold no header", self.who, b.len()));
        let h = Header::decode(head, wc.byte_len as usize, max_payload).expect("a valid header");
        (h, b[HEADER_LEN..].to_vec())
    }

    /// Posts receive buffer `i` (again).
    pub fn repost(&self, i: u64) {
        let slot = HEADER_LEN + self.payload;
        let sge = self.recv.sge(i as usize * slot, slot).unwrap();
        self.qp.post_recv(i, &[sge]).expect("post_recv");
    }
}
