//! Builds of different hello versions never connect, and say so at the
//! connect, naming both versions. Since hello version 2 a memory
//! descriptor's key carries the owner's secret in its high 32 bits, which
//! a version-1 peer refuses as "not a verbs rkey": a mixed pair that
//! connected would fail on every bulk transfer instead.
//!
//! The peer of the other version is a raw one (sys layer and wire format,
//! no plugin on its side), whose hello bytes carry version 1.
//!
//! Without an RDMA device the RDMA part cannot run: the tests say so
//! loudly (and check the clear "no RDMA device" error).

mod common;

use std::net::{SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use common::*;
use na_core::{Endpoint, NaError, OpId, PluginId};
use na_verbs::sys::{CmEvent, CmEventKind, CmId, EventChannel, PortSpace, ProtectionDomain};
use na_verbs::sys::{CompletionQueue, QueuePair};
use na_verbs::wire::HELLO_VERSION;

/// The hello version before keys carried a secret.
const OLD_VERSION: u8 = 1;

/// A raw peer connects to the listener at `dst` with a valid hello whose
/// version byte is `version`; returns the CM event that ends its connect.
fn raw_connect_with_version(ip: std::net::Ipv4Addr, dst: SocketAddr, version: u8) -> CmEvent {
    let who = "raw connector";
    let (ch, id, ctx) = raw_resolved(dst, who);
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let cq = CompletionQueue::new(&ctx, 16, None).expect("cq");
    let _qp: QueuePair = id.create_qp(&pd, small_qp_attr(&cq)).expect("rdma_create_qp");
    let mut param = raw_connect_param(ip, 4);
    assert_eq!(
        param.private_data[4], HELLO_VERSION,
        "byte 4 of a hello is its version"
    );
    param.private_data[4] = version;
    id.connect(&param).expect("connect");
    let ev = next_cm(&ch);
    if ev.kind == CmEventKind::Established {
        id.disconnect().ok();
    }
    ev
}

/// Drives the listener until the raw connector's thread ends; returns
/// what it saw.
fn serve_until_done(ep: &mut Endpoint, version: u8, env: &RdmaEnv, id: PluginId) -> CmEvent {
    let port = port_of(ep.self_addr(id).unwrap().uri());
    let dst = SocketAddr::V4(SocketAddrV4::new(env.ip, port));
    let ip = env.ip;
    let peer = std::thread::spawn(move || raw_connect_with_version(ip, dst, version));
    let end = Instant::now() + 2 * WAIT;
    while !peer.is_finished() {
        assert!(Instant::now() < end, "the raw connector never finished");
        ep.progress(Some(Duration::from_millis(20))).unwrap();
    }
    peer.join().expect("raw connector thread")
}

/// A listener refuses a hello of the old version with a reject whose
/// reason names both versions; not a protocol error (another build, not a
/// hostile peer). Control: the same raw connector with our version is
/// accepted.
#[test]
fn a_hello_of_the_old_version_is_rejected_with_both_versions() {
    let Some(env) = rdma_env("a_hello_of_the_old_version_is_rejected_with_both_versions") else {
        return;
    };
    let (mut ep, id) = plugin_with(&env, true, |_| {});
    let ev = serve_until_done(&mut ep, OLD_VERSION, &env, id);
    assert_eq!(ev.kind, CmEventKind::Rejected, "status {}", ev.status);
    let reason = String::from_utf8_lossy(&ev.private_data);
    let reason = reason.trim_end_matches('\0');
    assert!(
        reason.contains(&format!("version {OLD_VERSION} refused"))
            && reason.contains(&format!("speaks version {HELLO_VERSION}")),
        "the reject does not name both versions: {reason:?}"
    );
    let st = ep.plugin(id).unwrap().stats();
    assert_eq!(st.handshakes_refused, 1, "{st:?}");
    assert_eq!(
        st.protocol_errors, 0,
        "another version is not a protocol error: {st:?}"
    );
    assert_eq!(st.peers, 0, "{st:?}");

    // Control: our own version is accepted by the same listener.
    let ev = serve_until_done(&mut ep, HELLO_VERSION, &env, id);
    assert_eq!(ev.kind, CmEventKind::Established, "status {}", ev.status);
}

/// A listener of version 1 rejects our hello as "bad hello" (it reads
/// version 2 as broken): the connecting plugin's error says that the
/// listener may be of another build, and names our version. The listener
/// is raw and rejects as a version-1 plugin does.
#[test]
fn a_reject_by_a_listener_of_the_old_version_names_ours() {
    let Some(env) = rdma_env("a_reject_by_a_listener_of_the_old_version_names_ours") else {
        return;
    };
    let ch = EventChannel::new().expect("event channel");
    let listener = CmId::new(&ch, PortSpace::Tcp).expect("cm id");
    listener
        .bind(SocketAddr::V4(SocketAddrV4::new(env.ip, 0)))
        .expect("bind");
    listener.listen(4).expect("listen");
    let port = listener.local_addr().expect("bound address").port();
    let (mut ep, _) = setup_plugin(&env, false, false);
    let uri = format!("verbs://{}/{}:{port}", env.device, env.ip);
    let to = ep.lookup(&uri).expect("lookup");
    ep.send_unexpected(&to, 1, b"hello?", OpId(7))
        .expect("the send is queued");
    let end = Instant::now() + WAIT;
    let mut rejected = 0;
    let done = loop {
        assert!(Instant::now() < end, "the send did not end within {WAIT:?}");
        if let Some(ev) = ch.get_event().expect("rdma_get_cm_event") {
            if ev.kind == CmEventKind::ConnectRequest {
                let req = ev.new_id.expect("a connect request has an id");
                let theirs = ev.private_data.get(4).copied();
                assert_eq!(theirs, Some(HELLO_VERSION), "the plugin's hello version");
                req.reject(b"bad hello").expect("rdma_reject");
                rejected += 1;
            }
        }
        ep.progress(Some(Duration::from_millis(20))).unwrap();
        if let Some(c) = ep.pop_completion() {
            break c;
        }
    };
    assert_eq!(rejected, 1);
    match done.status {
        Err(NaError::PeerGone { reason, .. }) => assert!(
            reason.contains("the listener says: bad hello")
                && reason.contains("another build")
                && reason.contains(&format!("hello version {HELLO_VERSION}")),
            "the error does not point at the version: {reason}"
        ),
        other => panic!("a send to a listener that rejected us: {other:?}"),
    }
}
