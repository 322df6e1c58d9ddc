//! The RDMA read depth of a connection is negotiated at connect: the
//! active side asks for an initiator depth, the passive side grants at
//! most the responder resources it has (`VerbsConfig::max_rd_atomic`, the
//! device's limits). Each side must use what was negotiated, not what it
//! asked for or offered: where the device set the QP's depth above it
//! (soft-RoCE rounds 3 up to 4), the plugin keeps no more reads posted
//! than the depth, the rest waiting; where the QP's depth is the
//! negotiated one, the device bounds the reads and all are posted at
//! once (one linked list).
//!
//! The first test runs three plugins: L grants 3 reads, D the default
//! (16, a power of two), and C asks for the default. C's gets from L and
//! D, and D's gets over the connection L made to it, each far more than
//! the depth, all complete with the right bytes, and each connection
//! reports the depth negotiated and how many reads it posted at once
//! (`VerbsPlugin::debug_reads`): the depth, where the plugin bounds
//! them; all, where the device does. The second checks that a get from a
//! peer that grants no reads fails at once. The third connects a raw
//! peer asking for different depths each way and checks what the
//! listener granted, from the accept and from the peer's QP.
//!
//! Without an RDMA device the RDMA part cannot run: the tests say so
//! loudly (and check the clear "no RDMA device" error).

mod common;

use std::net::{SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use common::raw_peer::{RawPeer, RawQp};
use common::*;
use na_core::{Access, Addr, Completion, MemHandle, OpId, Plugin, PluginId, RemoteMem, Rma};
use na_verbs::config::DEFAULT_MAX_RD_ATOMIC;
use na_verbs::sys::{ConnParam, ReadDepths};
use na_verbs::{VerbsConfig, VerbsPlugin};

/// Gets of one batch: far more than any read depth here.
const GETS: usize = 48;
/// Bytes of each get (one work request).
const PIECE: usize = 4096;
/// The read depth L grants: not a power of two, so soft-RoCE sets the
/// QPs' depth above it (to 4) and the plugin must bound the reads.
const SMALL_DEPTH: u8 = 3;

/// A plugin on the test device, not in an endpoint (the test reads its
/// connections' read windows), granting at most `max_rd_atomic` reads.
fn bare(env: &RdmaEnv, id: u32, listen: bool, max_rd_atomic: u8) -> VerbsPlugin {
    let spec = format!("verbs://{}/{}:0", env.device, env.ip);
    let cfg = VerbsConfig {
        max_rd_atomic,
        ..VerbsConfig::from_spec(&spec, listen).unwrap()
    };
    VerbsPlugin::new(PluginId(id), cfg).expect("verbs plugin")
}

/// Drives every plugin until `ps[who]` has `n` completions; returns them
/// (the others' stay queued).
fn drive(ps: &mut [&mut VerbsPlugin], who: usize, n: usize) -> Vec<Completion> {
    let mut got = Vec::new();
    let end = Instant::now() + WAIT;
    while got.len() < n {
        assert!(
            Instant::now() < end,
            "{} of {n} completions within {WAIT:?}: {got:?}",
            got.len()
        );
        for p in ps.iter_mut() {
            p.progress().unwrap();
        }
        got.extend(std::iter::from_fn(|| ps[who].pop_completion()));
    }
    got
}

/// `GETS` patterned pieces registered on `owner`, and their descriptor.
fn owned(owner: &mut VerbsPlugin, seed: u64) -> (MemHandle, RemoteMem, Vec<u8>) {
    let data = pattern(seed, GETS * PIECE);
    let mem = MemHandle::new(vec![data.clone()], Access::ReadWrite);
    owner.mem_register(&mem).unwrap();
    let desc = owner.mem_describe(&mem).unwrap();
    (mem, desc, data)
}

/// `ps[who]` gets all of `desc` from `to` in `GETS` gets of one batch
/// (one call: far more wait than the window takes); checks
/// every get and the bytes, and returns the connection's read window.
fn get_all(
    ps: &mut [&mut VerbsPlugin],
    who: usize,
    to: &Addr,
    desc: &RemoteMem,
    want: &[u8],
) -> na_verbs::ReadWindow {
    let local = MemHandle::zeroed(GETS * PIECE, Access::ReadWrite);
    let ops: Vec<Rma<'_>> = (0..GETS)
        .map(|i| {
            let off = (i * PIECE) as u64;
            Rma::get(&local, off, desc, off, PIECE as u64, OpId(1000 + i as u64))
        })
        .collect();
    ps[who].rma(to, &ops).unwrap();
    let done = drive(ps, who, GETS);
    let mut ops: Vec<u64> = done
        .iter()
        .map(|c| {
            assert!(c.status.is_ok(), "a get failed: {c:?}");
            c.op.0
        })
        .collect();
    ops.sort_unstable();
    assert_eq!(
        ops,
        (1000..1000 + GETS as u64).collect::<Vec<_>>(),
        "each get once"
    );
    assert!(local.to_vec() == want, "the gets brought other bytes");
    ps[who].debug_reads(to).expect("the connection is there")
}

#[test]
fn connections_keep_no_more_reads_outstanding_than_negotiated() {
    let Some(env) = rdma_env("connections_keep_no_more_reads_outstanding_than_negotiated") else {
        return;
    };
    let mut l = bare(&env, 1, true, SMALL_DEPTH);
    let mut d = bare(&env, 2, true, DEFAULT_MAX_RD_ATOMIC);
    let mut c = bare(&env, 3, false, DEFAULT_MAX_RD_ATOMIC);
    let dev = c.device_attr();
    let default_depth = u32::from(DEFAULT_MAX_RD_ATOMIC)
        .min(dev.max_qp_init_rd_atom)
        .min(dev.max_qp_rd_atom);
    assert!(
        default_depth > u32::from(SMALL_DEPTH),
        "the device's read depth {default_depth} leaves nothing to negotiate down"
    );
    let (_l_mem, l_desc, l_data) = owned(&mut l, 1);
    let (_d_mem, d_desc, d_data) = owned(&mut d, 2);
    let to_l = c.lookup(l.self_addr().uri()).unwrap();
    let to_d = c.lookup(d.self_addr().uri()).unwrap();

    // The active side: C asked for the default, L granted 3.
    let w = get_all(&mut [&mut c, &mut l, &mut d], 0, &to_l, &l_desc, &l_data);
    assert_eq!(w.depth, u32::from(SMALL_DEPTH), "C's connection to L: {w:?}");
    assert_plugin_bounds(&w, "C's reads to L");
    // What C asks for where nothing lowers it: the device bounds them.
    let w = get_all(&mut [&mut c, &mut l, &mut d], 0, &to_d, &d_desc, &d_data);
    assert_eq!(w.depth, default_depth, "C's connection to D: {w:?}");
    assert!(w.device_bounds(), "C's QP to D has the depth: {w:?}");
    assert_eq!(
        w.peak, GETS as u32,
        "C's reads to D were held back though the device bounds them: {w:?}"
    );

    // The passive side: L connects to D asking for 3 reads each way; D
    // pulls from L over that connection (the source of L's message).
    let to_d_from_l = l.lookup(d.self_addr().uri()).unwrap();
    d.post_recv_unexpected(Vec::new(), OpId(1)).unwrap();
    l.send_unexpected(&to_d_from_l, 7, &l_desc.to_bytes(), OpId(2))
        .unwrap();
    let msg = drive(&mut [&mut d, &mut l, &mut c], 0, 1).remove(0);
    let bytes = msg.buf.clone().expect("L's message");
    let src = msg.source.clone().expect("a message has a source");
    let desc = RemoteMem::from_bytes(&bytes).expect("L's descriptor");
    let w = get_all(&mut [&mut d, &mut l, &mut c], 0, &src, &desc, &l_data);
    assert_eq!(w.depth, u32::from(SMALL_DEPTH), "D's connection from L: {w:?}");
    assert_plugin_bounds(&w, "D's reads to L");
}

/// `w`'s QP runs deeper than its depth (soft-RoCE rounded it up), so the
/// plugin kept the reads posted to the depth: it reached it, and no more.
fn assert_plugin_bounds(w: &na_verbs::ReadWindow, what: &str) {
    assert!(
        w.qp_depth.is_some_and(|q| q > w.depth) && !w.device_bounds(),
        "{what}: the test needs a QP deeper than the grant (soft-RoCE rounds 3 up to 4): {w:?}"
    );
    assert_eq!(
        w.peak, w.depth,
        "{what} did not fill the window, or overran it: {w:?}"
    );
    assert_eq!(w.posted, 0, "{what}: {w:?}");
}

/// A listener that grants no reads (`max_rd_atomic` 0): a get from it
/// could never be issued on the connection, so it fails at once with
/// `Unsupported` instead of waiting for ever, and the connection stays
/// (a put over it still works).
#[test]
fn a_get_from_a_peer_that_grants_no_reads_fails_at_once() {
    let Some(env) = rdma_env("a_get_from_a_peer_that_grants_no_reads_fails_at_once") else {
        return;
    };
    let mut z = bare(&env, 1, true, 0);
    let mut c = bare(&env, 2, false, DEFAULT_MAX_RD_ATOMIC);
    let (z_mem, z_desc, _) = owned(&mut z, 3);
    let to_z = c.lookup(z.self_addr().uri()).unwrap();
    let local = MemHandle::zeroed(PIECE, Access::ReadWrite);
    c.rma(&to_z, &[Rma::get(&local, 0, &z_desc, 0, PIECE as u64, OpId(1))])
        .unwrap();
    let got = drive(&mut [&mut c, &mut z], 0, 1).remove(0);
    let err = got.status.expect_err("a get the peer grants no read for");
    assert!(matches!(err, na_core::NaError::Unsupported { .. }), "{err:?}");
    assert!(err.to_string().contains("grants no RDMA reads"), "{err}");
    let w = c.debug_reads(&to_z).expect("the connection stays");
    assert_eq!((w.depth, w.peak), (0, 0), "{w:?}");
    let data = pattern(4, PIECE);
    let src = MemHandle::new(vec![data.clone()], Access::ReadOnly);
    c.rma(&to_z, &[Rma::put(&src, 0, &z_desc, 0, PIECE as u64, OpId(2))])
        .unwrap();
    let put = drive(&mut [&mut c, &mut z], 0, 1).remove(0);
    put.status.expect("a put over the same connection");
    let mut back = vec![0; PIECE];
    z_mem.read_at(0, &mut back).unwrap();
    assert!(back == data, "the put's bytes");
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
    let mut srv = bare(&env, 1, true, DEFAULT_MAX_RD_ATOMIC);
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
