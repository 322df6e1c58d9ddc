//! The RDMA read depth of a connection is negotiated at connect: the
//! active side asks for an initiator depth and offers responder
//! resources, the passive side grants within its own limits. This test
//! connects a raw peer asking for different depths each way and checks
//! what the listener granted, from the accept and from the peer's QP.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so
//! loudly (and checks the clear "no RDMA device" error).

mod common;

use std::net::{SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use common::raw_peer::{RawPeer, RawQp};
use common::*;
use na_core::{Plugin, PluginId};
use na_verbs::sys::{ConnParam, ReadDepths};
use na_verbs::{VerbsConfig, VerbsPlugin};

/// A plugin on the test device, not in an endpoint.
fn bare(env: &RdmaEnv, id: u32, listen: bool) -> VerbsPlugin {
    let spec = format!("verbs://{}/{}:0", env.device, env.ip);
    let cfg = VerbsConfig::from_spec(&spec, listen).unwrap();
    VerbsPlugin::new(PluginId(id), cfg).expect("verbs plugin")
}

/// What a raw peer asking for `initiator` reads at the listener and
/// offering `responder` of its own saw: the grant in the accept, and its
/// QP's depths as the device applied them.
fn raw_connect(
    dst: SocketAddr,
    ip: std::net::Ipv4Addr,
    initiator: u8,
    responder: u8,
) -> ((u8, u8), ReadDepths) {
    let peer = RawPeer::new(dst, "raw peer asking for reads", 64, RawQp::Cm);
    let param = ConnParam {
        initiator_depth: initiator,
        responder_resources: responder,
        ..raw_connect_param(ip, 4)
    };
    let ev = peer.connect(&param);
    let qp = peer.qp.read_depths().expect("ibv_query_qp");
    ((ev.initiator_depth, ev.responder_resources), qp)
}

/// A connect request asks for reads one way and offers them the other
/// (the kernel's CM hands them to the listener from its side, fields
/// crossed). The listener must grant the reads the peer asked to issue
/// as its responder resources, and take as its own initiator depth what
/// the peer offered, each within its own limits: a peer asking for 4 and
/// offering 1 may issue 4 and is sent at most 1. (It granted the
/// crossed values, 1 and 4, which only a peer asking for other values
/// each way can tell.)
#[test]
fn a_listener_grants_the_reads_the_peer_asked_for_each_way() {
    let Some(env) = rdma_env("a_listener_grants_the_reads_the_peer_asked_for_each_way") else {
        return;
    };
    let mut srv = bare(&env, 1, true);
    let port = port_of(srv.self_addr().uri());
    let dst = SocketAddr::V4(SocketAddrV4::new(env.ip, port));
    let ip = env.ip;
    // Powers of two: some devices round a QP's depths up to one.
    let peer = std::thread::spawn(move || raw_connect(dst, ip, 4, 1));
    let end = Instant::now() + WAIT;
    while !peer.is_finished() {
        assert!(Instant::now() < end, "the raw peer never connected");
        srv.progress().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let (granted, qp) = peer.join().expect("raw peer thread");
    assert_eq!(
        granted,
        (4, 1),
        "the accept granted (reads the peer may issue, reads it serves) = {granted:?}"
    );
    assert_eq!(
        qp,
        ReadDepths {
            initiator: 4,
            responder: 1
        },
        "the peer's QP"
    );
}
