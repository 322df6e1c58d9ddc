//! A raw peer that breaks the verbs plugin's protocol on purpose, built
//! from the sys layer and the wire format (no plugin on its side), and
//! the listening plugin it attacks (`hostile_peer.rs`, `violation_log.rs`).

use std::net::{SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use na_core::{Endpoint, Plugin, PluginId, ProgressMode};
use na_verbs::sys::*;
use na_verbs::wire::{Header, MsgKind, HEADER_LEN};
use na_verbs::{VerbsConfig, VerbsPlugin};

use super::*;

/// Receive depth of the listening plugin (the flooder's initial credits).
pub const DEPTH: u16 = 16;
/// Messages the listening plugin holds before it withholds credits.
pub const MAX_HELD: u32 = 32;
/// Messages the flooder tries to send.
pub const FLOOD: u32 = 2000;
/// Send slots of the flooder (one message in flight at a time).
pub const WINDOW: u32 = 32;
/// Pause between the flooder's messages. The listener grants RNR retries
/// of 0, so a flooder that outruns its reposts fails on its own; pacing is
/// how a real one gets through, since buffers are reposted even while
/// their credits are withheld.
pub const PACE: Duration = Duration::from_millis(2);
pub const PAYLOAD: usize = 8;

/// What the flooder saw: messages the device delivered, and the first error.
pub struct Flood {
    pub delivered: u32,
    pub stopped_by: Option<String>,
}

/// True if `stopped_by` says the listener ended an established
/// connection: a disconnect, or a reject. The listener may handle a
/// violation before it has taken the connection's `ESTABLISHED` event
/// (its QP takes messages as soon as it accepted, before the peer's
/// ready-to-use reaches its CM): in its CM that connection is still being
/// set up (the reply sent), where the kernel cannot send a disconnect
/// request, and the way IB CM ends it is a reject, which the kernel sends
/// when the listener destroys the id. The peer, already established,
/// gets `REJECTED` then (seen once in the VM), `DISCONNECTED` otherwise.
pub fn ended_after_connect(stopped_by: &str) -> bool {
    stopped_by.contains("DISCONNECTED") || stopped_by == "CM event RDMA_CM_EVENT_REJECTED"
}

/// What the raw peer does once connected.
#[derive(Clone, Copy, PartialEq)]
pub enum Attack {
    /// `FLOOD` unexpected messages, never returning or waiting for credits.
    Flood,
    /// One zero-length RDMA WRITE with immediate (it consumes a receive).
    WriteWithImm,
}

/// Connects to `dst` with a hello naming `hello_ip` as its address and
/// carries out `attack`.
pub fn flood(hello_ip: std::net::Ipv4Addr, dst: SocketAddr, attack: Attack) -> Flood {
    let who = "flooder";
    let (ch, id, ctx) = raw_resolved(dst, who);
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let comp = CompletionChannel::new(&ctx).expect("completion channel");
    let send_cq = CompletionQueue::new(&ctx, 256, Some(&comp)).expect("send cq");
    // Credit updates from the plugin land here and are never looked at.
    let recv_cq = CompletionQueue::new(&ctx, 256, None).expect("recv cq");
    let slot = HEADER_LEN + 4096;
    let recv =
        MemoryRegion::allocate(&pd, slot * usize::from(DEPTH), AccessFlags::LOCAL_WRITE).expect("recv mr");
    let send = MemoryRegion::allocate(
        &pd,
        (HEADER_LEN + PAYLOAD) * WINDOW as usize,
        AccessFlags::LOCAL_WRITE,
    )
    .expect("send mr");
    let attr = QpInitAttr {
        send_cq: &send_cq,
        recv_cq: &recv_cq,
        srq: None,
        caps: QpCaps {
            max_send_wr: WINDOW,
            max_recv_wr: u32::from(DEPTH),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
    };
    let qp = id.create_qp(&pd, attr).expect("rdma_create_qp");
    for i in 0..usize::from(DEPTH) {
        qp.post_recv(i as u64, &[recv.sge(i * slot, slot).unwrap()])
            .expect("post_recv");
    }
    let param = raw_connect_param(hello_ip, DEPTH);
    id.connect(&param).expect("connect");
    let ev = next_cm(&ch);
    if ev.kind != CmEventKind::Established {
        return Flood {
            delivered: 0,
            stopped_by: Some(format!("connect: {} (status {})", ev.kind.name(), ev.status)),
        };
    }

    if attack == Attack::WriteWithImm {
        let nowhere = RemoteRegion {
            addr: 0,
            len: 0,
            rkey: 0,
        };
        qp.post_send(1, SendOp::RdmaWriteWithImm(nowhere, 7), &[], true)
            .expect("post write with immediate");
        let wc = wait_wc(&send_cq, &comp, 1, who);
        assert_ok(&wc, who);
        // The listener ends the connection.
        let ev = next_cm(&ch);
        return Flood {
            delivered: 1,
            stopped_by: Some(format!("CM event {}", ev.kind.name())),
        };
    }
    let (mut posted, mut delivered, mut wcs) = (0u32, 0u32, Vec::new());
    let deadline = Instant::now() + WAIT;
    loop {
        while posted < FLOOD && posted == delivered {
            let at = (posted % WINDOW) as usize * (HEADER_LEN + PAYLOAD);
            let header = Header {
                kind: MsgKind::Unexpected,
                credits: 0,
                tag: posted,
                len: PAYLOAD as u32,
            };
            send.write_at(at, &header.encode()).unwrap();
            send.write_at(at + HEADER_LEN, &posted.to_le_bytes().repeat(2))
                .unwrap();
            let sge = send.sge(at, HEADER_LEN + PAYLOAD).unwrap();
            if let Err(e) = qp.post_send(u64::from(posted), SendOp::Send, &[sge], true) {
                return Flood {
                    delivered,
                    stopped_by: Some(format!("post_send: {}", na_core::ErrorChain(&e))),
                };
            }
            posted += 1;
        }
        if delivered == FLOOD {
            return Flood {
                delivered,
                stopped_by: None,
            };
        }
        wcs.clear();
        send_cq.poll(&mut wcs, WINDOW as usize).expect("poll_cq");
        for wc in &wcs {
            if !wc.is_ok() {
                return Flood {
                    delivered,
                    stopped_by: Some(wc.status_str().to_string()),
                };
            }
            delivered += 1;
            std::thread::sleep(PACE);
        }
        if let Some(ev) = ch.get_event().expect("rdma_get_cm_event") {
            return Flood {
                delivered,
                stopped_by: Some(format!("CM event {}", ev.kind.name())),
            };
        }
        if Instant::now() > deadline {
            return Flood {
                delivered,
                stopped_by: Some(format!("nothing happened for {WAIT:?}")),
            };
        }
        if wcs.is_empty() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A listening plugin that posts no receive, with [`DEPTH`] receives
/// and [`MAX_HELD`] held messages: what the flooder attacks.
pub fn listener(env: &RdmaEnv) -> (Endpoint, PluginId) {
    let spec = format!("verbs://{}/{}:0", env.device, env.ip);
    let cfg = VerbsConfig {
        listen: true,
        recv_depth: DEPTH,
        max_held: MAX_HELD,
        ..VerbsConfig::from_spec(&spec, true).unwrap()
    };
    let mut ep = Endpoint::new(ProgressMode::Busy).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .expect("verbs plugin");
    (ep, id)
}

/// Runs the flooder (its hello naming `hello_ip`) against listener `id`
/// of `ep` (see [`listener`]), driving `ep` until the flooder stops and
/// then for half a second more; returns what the flooder saw.
pub fn attack_listener(
    env: &RdmaEnv,
    ep: &mut Endpoint,
    id: PluginId,
    hello_ip: std::net::Ipv4Addr,
    attack: Attack,
) -> Flood {
    let port = port_of(ep.self_addr(id).unwrap().uri());
    let dst = SocketAddr::V4(SocketAddrV4::new(env.ip, port));
    let flooder = std::thread::spawn(move || flood(hello_ip, dst, attack));
    let end = Instant::now() + 2 * WAIT;
    while !flooder.is_finished() {
        assert!(Instant::now() < end, "the flooder never stopped");
        ep.progress(Some(Duration::from_millis(1))).unwrap();
    }
    let seen = flooder.join().expect("flooder thread");
    // Let the listener take in whatever the device already delivered.
    let settle = Instant::now() + Duration::from_millis(500);
    while Instant::now() < settle {
        ep.progress(Some(Duration::from_millis(1))).unwrap();
    }
    seen
}
