//! A hello's address is a claim the listener checks only up to its IP
//! (RDMA CM connects from an ephemeral port). A process on the same IP that
//! names another process's listen address in its hello must not get that
//! process's traffic: its connection has a peer of its own, which a lookup
//! of the claimed address never finds.
//!
//! The claimer is a raw peer (the sys layer and the wire format, no plugin
//! on its side) connecting to a listening plugin S with a hello that names
//! the listen address L of another plugin X of this process, before S
//! ever looked L up. S then looks L up and sends: X must receive it, the
//! claimer must not. A reply to the claimer's own source address reaches
//! the claimer (so its silence above is not deafness).
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::raw_peer::{RawPeer, RawQp};
use common::*;
use na_core::{Completion, Endpoint, OpId, PluginId};
use na_verbs::sys::ConnParam;
use na_verbs::wire::{Hello, HEADER_LEN};

/// Payload bytes the claimer's receive buffers hold (its hello says so).
const PAYLOAD: usize = 64;

/// A raw peer that connects to `dst` with a hello naming `claim`, sends
/// one unexpected message ("claimer", tag 5), then reports the payload of
/// every message it receives on `got` until `stop` is set.
fn claimer(dst: SocketAddr, claim: SocketAddr, stop: Arc<AtomicBool>, got: mpsc::Sender<Vec<u8>>) {
    let peer = RawPeer::new(dst, "claimer", PAYLOAD, RawQp::Cm);
    let who = peer.who;
    let hello = Hello {
        addr: claim,
        depth: 4,
        max_payload: PAYLOAD as u32,
        device: String::new(),
    };
    let param = ConnParam {
        private_data: hello.encode(),
        ..raw_connect_param(std::net::Ipv4Addr::UNSPECIFIED, 4)
    };
    peer.connect(&param);
    peer.send_unexpected(5, b"claimer");
    let mut wcs = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        wcs.clear();
        peer.cq.poll(&mut wcs, 4).expect("poll_cq");
        for wc in &wcs {
            if !RawPeer::is_recv(wc) || !wc.is_ok() {
                assert!(
                    wc.is_ok(),
                    "{who}: work request {} failed: {}",
                    wc.wr_id,
                    wc.status_str()
                );
                continue;
            }
            let b = peer.received(wc);
            let body = b.get(HEADER_LEN..).unwrap_or_default().to_vec();
            let _ = got.send(body);
            peer.repost(wc.wr_id);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Drives `eps` until `pick` finds a completion of op `op` on `eps[which]`,
/// failing if `forbidden` yields anything meanwhile.
fn wait_for(
    eps: &mut [&mut Endpoint],
    which: usize,
    op: OpId,
    forbidden: &mpsc::Receiver<Vec<u8>>,
    what: &str,
) -> Completion {
    let end = Instant::now() + WAIT;
    loop {
        assert!(
            Instant::now() < end,
            "{what}: {op:?} did not complete within {WAIT:?}"
        );
        if let Ok(b) = forbidden.try_recv() {
            panic!(
                "{what}: the claimer received {:?}, traffic meant for the address it claimed",
                String::from_utf8_lossy(&b)
            );
        }
        for ep in eps.iter_mut() {
            ep.progress(Some(Duration::from_millis(5))).unwrap();
        }
        if let Some(c) = std::iter::from_fn(|| eps[which].pop_completion()).find(|c| c.op == op) {
            return c;
        }
    }
}

fn sock_of(env: &RdmaEnv, ep: &Endpoint, id: PluginId) -> SocketAddr {
    let uri = ep.self_addr(id).unwrap().uri().to_owned();
    SocketAddr::V4(SocketAddrV4::new(env.ip, port_of(&uri)))
}

#[test]
fn a_hello_claiming_another_listeners_address_takes_none_of_its_traffic() {
    let Some(env) = rdma_env("a_hello_claiming_another_listeners_address_takes_none_of_its_traffic") else {
        return;
    };
    let (mut s, sid) = plugin_with(&env, true, |_| {});
    let (mut x, xid) = plugin_with(&env, true, |_| {});
    let l_uri = x.self_addr(xid).unwrap().uri().to_owned();
    let (s_sock, l_sock) = (sock_of(&env, &s, sid), sock_of(&env, &x, xid));
    s.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    x.post_recv_unexpected(xid, Vec::new(), OpId(1)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (got_tx, got) = mpsc::channel();
    let y = std::thread::spawn({
        let stop = stop.clone();
        move || claimer(s_sock, l_sock, stop, got_tx)
    });
    // The claimer's message, before anyone looked L up.
    let req = wait_for(&mut [&mut s, &mut x], 0, OpId(1), &got, "the claimer's message");
    assert_eq!(req.buf.as_deref(), Some(&b"claimer"[..]), "{:?}", req.status);
    let y_src = req.source.clone().expect("a message has a source");
    let l = s.lookup(&l_uri).expect("lookup of L");
    assert_ne!(
        y_src, l,
        "the claimer's messages carry the address of the listener it claimed ({l_uri})"
    );
    // S sends to L: X has it, the claimer nothing.
    s.send_unexpected(&l, 7, b"for L", OpId(2)).unwrap();
    let at_x = wait_for(&mut [&mut s, &mut x], 1, OpId(1), &got, "S's message to L");
    assert_eq!(at_x.buf.as_deref(), Some(&b"for L"[..]), "{:?}", at_x.status);
    let sent = wait_for(&mut [&mut s, &mut x], 0, OpId(2), &got, "S's send to L");
    sent.status.expect("the send to L");
    // Give a misrouted copy time to arrive anywhere.
    let quiet = Instant::now() + Duration::from_millis(300);
    while Instant::now() < quiet {
        s.progress(Some(Duration::from_millis(5))).unwrap();
        x.progress(Some(Duration::from_millis(5))).unwrap();
        if let Ok(b) = got.try_recv() {
            panic!("the claimer received {:?}", String::from_utf8_lossy(&b));
        }
    }
    // A reply to the claimer's own address goes back over its connection.
    s.send_unexpected(&y_src, 8, b"for Y", OpId(3)).unwrap();
    let end = Instant::now() + WAIT;
    let at_y = loop {
        assert!(
            Instant::now() < end,
            "the reply to the claimer's source never reached it"
        );
        s.progress(Some(Duration::from_millis(5))).unwrap();
        x.progress(Some(Duration::from_millis(5))).unwrap();
        if let Ok(b) = got.try_recv() {
            break b;
        }
    };
    assert_eq!(at_y, b"for Y", "the claimer got something else");
    let st = s.plugin(sid).unwrap().stats();
    assert_eq!(
        st.peers, 2,
        "S holds the claimer's connection and its own to L: {st:?}"
    );
    stop.store(true, Ordering::Relaxed);
    y.join().expect("claimer thread");
    // The claimer's connection going leaves L usable.
    x.post_recv_unexpected(xid, Vec::new(), OpId(4)).unwrap();
    s.send_unexpected(&l, 7, b"again", OpId(5)).unwrap();
    let (_tx, none) = mpsc::channel();
    let again = wait_for(
        &mut [&mut s, &mut x],
        1,
        OpId(4),
        &none,
        "S's second message to L",
    );
    assert_eq!(again.buf.as_deref(), Some(&b"again"[..]), "{:?}", again.status);
}
