//! The verbs sys layer on a real kernel RDMA stack (soft-RoCE `rxe0` in the
//! VM of tools/rxe-vm): device queries, then two RC QPs connected through
//! RDMA CM (listener on a thread, client on the test thread) doing SEND/RECV,
//! RDMA WRITE, RDMA READ and WRITE with immediate, all multi-SGE, with the
//! data verified byte for byte; then local argument errors and a forged rkey.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so loudly
//! and asserts that opening a device fails with the clear "no RDMA device" error.

mod common;

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::{mpsc, Arc};

use common::*;
use na_verbs::sys::*;
use na_verbs::VerbsError;

const BUF: usize = 4096;
const IMM: u32 = 0xC0DE_0042;

fn caps(dev: &DeviceAttr) -> QpCaps {
    QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: dev.max_sge.min(4),
        max_recv_sge: dev.max_sge.min(4),
        max_inline_data: 0,
    }
}

fn rd_atom(dev: &DeviceAttr) -> u8 {
    dev.max_qp_rd_atom.clamp(1, 4) as u8
}

/// What the client writes: 600 bytes then 400 bytes (two SGEs), then 40 with imm.
fn write_data() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    (pattern(1, 600), pattern(2, 400), pattern(3, 40))
}

/// The server: listen, accept, check the SEND scatter and the RDMA writes.
fn server(ip: std::net::Ipv4Addr, port_tx: mpsc::Sender<u16>) {
    let who = "server";
    let ch = EventChannel::new().expect("event channel");
    let listener = CmId::new(&ch, PortSpace::Tcp).expect("listener id");
    listener
        .bind(SocketAddr::V4(SocketAddrV4::new(ip, 0)))
        .expect("bind to the rxe address");
    listener.listen(4).expect("listen");
    let port = listener.local_addr().expect("bound address").port();
    assert_ne!(port, 0);
    port_tx.send(port).expect("send port");

    let ctx = listener.context().expect("listener is bound to rxe0");
    let dev = ctx.query_device().expect("query_device");
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let comp = CompletionChannel::new(&ctx).expect("completion channel");
    let cq = CompletionQueue::new(&ctx, 64, Some(&comp)).expect("cq");
    let rma = MemoryRegion::allocate(&pd, BUF, AccessFlags::ALL_RMA).expect("rma mr");
    let recv = MemoryRegion::allocate(&pd, BUF, AccessFlags::LOCAL_WRITE).expect("recv mr");
    rma.write_at(2048, &pattern(7, 1000))
        .expect("fill the READ source");

    let req = wait_cm(&ch, CmEventKind::ConnectRequest, who);
    assert_eq!(req.listen_id, Some(listener.key()));
    let id = req.new_id.expect("a connect request carries the new id");
    let attr = QpInitAttr {
        send_cq: &cq,
        recv_cq: &cq,
        srq: None,
        caps: caps(&dev),
    };
    let qp = id.create_qp(&pd, attr).expect("rdma_create_qp");
    // Two receives, each scattering into two separate areas.
    qp.post_recv(100, &[recv.sge(0, 64).unwrap(), recv.sge(1024, 1024).unwrap()])
        .expect("post_recv 100");
    qp.post_recv(101, &[recv.sge(2048, 16).unwrap(), recv.sge(3072, 1024).unwrap()])
        .expect("post_recv 101");
    let accept = ConnParam {
        private_data: encode_remote(&rma.remote(0, BUF).unwrap()),
        responder_resources: req.initiator_depth.min(rd_atom(&dev)),
        initiator_depth: req.responder_resources.min(rd_atom(&dev)),
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num: 0,
    };
    id.accept(&accept).expect("accept");
    wait_cm(&ch, CmEventKind::Established, who);
    assert_eq!(qp.state().expect("query_qp"), QpState::Rts);

    // 1. SEND of 564 bytes from three client SGEs, scattered over 64 + 500.
    let wc = wait_wc(&cq, &comp, 1, who);
    assert_ok(&wc, who);
    assert_eq!(
        (wc[0].wr_id, wc[0].opcode, wc[0].byte_len),
        (100, WcOpcode::Recv, 564)
    );
    let sent = [&pattern(4, 40)[..], &pattern(5, 24)[..], &pattern(6, 500)[..]].concat();
    let mut got = vec![0u8; 564];
    recv.read_at(0, &mut got[..64]).unwrap();
    recv.read_at(1024, &mut got[64..]).unwrap();
    assert!(got == sent, "{who}: SEND payload differs after scatter");

    // 2. RDMA WRITE (two SGEs) then WRITE with immediate: one receive consumed.
    let wc = wait_wc(&cq, &comp, 1, who);
    assert_ok(&wc, who);
    assert_eq!(
        (wc[0].wr_id, wc[0].opcode, wc[0].imm),
        (101, WcOpcode::RecvRdmaWithImm, Some(IMM))
    );
    let (a, b, c) = write_data();
    let mut got = vec![0u8; 1040];
    rma.read_at(0, &mut got).unwrap();
    assert!(
        got[..600] == a[..] && got[600..1000] == b[..],
        "{who}: RDMA WRITE data differs"
    );
    assert!(got[1000..] == c[..], "{who}: RDMA WRITE-with-imm data differs");
    eprintln!("{who}: SEND scatter, RDMA WRITE and WRITE_WITH_IMM verified");

    wait_cm(&ch, CmEventKind::Disconnected, who);
    drop(qp);
}

fn query_device(env: &RdmaEnv) {
    let ctx = Context::open(Some(&env.device)).expect("open the rxe device");
    assert_eq!(ctx.name(), env.device);
    let dev = ctx.query_device().expect("query_device");
    eprintln!("device attributes: {dev:?}");
    assert!(
        dev.max_sge >= 3,
        "the test needs 3 SGEs, device allows {}",
        dev.max_sge
    );
    assert!(
        dev.max_qp_wr >= 16 && dev.max_cqe >= 64 && dev.max_mr_size >= BUF as u64,
        "{dev:?}"
    );
    assert!(dev.phys_port_cnt >= 1);
    let port = ctx.query_port(1).expect("query_port 1");
    assert!(
        port.active && port.is_ethernet,
        "rxe port 1 must be an active RoCE port: {port:?}"
    );
    let gids: Vec<Gid> = (0..port.gid_tbl_len.min(16))
        .filter_map(|i| ctx.query_gid(1, i).ok())
        .collect();
    assert!(
        gids.iter().any(|g| g.ipv4() == Some(env.ip)),
        "no IPv4-mapped GID for {} among {gids:?}",
        env.ip
    );
    let missing = Context::open(Some("no-such-dev0")).expect_err("unknown device");
    assert!(
        matches!(missing, VerbsError::DeviceNotFound { .. }),
        "{missing:?}"
    );
    assert!(
        missing.to_string().contains(&env.device),
        "lists the available devices: {missing}"
    );
}

/// `post_send_chain` keeps its promise that exactly the work requests
/// before the failing one were posted, whichever side refused: our own
/// argument check of a work request in the middle (the valid ones before
/// it must still go out, or the caller waits forever for their
/// completions), and the provider running out of send-queue room.
fn post_chains(
    qp: &QueuePair,
    cq: &CompletionQueue,
    comp: &CompletionChannel,
    mr: &MemoryRegion,
    remote: &RemoteRegion,
) {
    let who = "client chains";
    // Remote bytes 3100.. are free: the server checks only 0..1040, and
    // the READ source at 2048.. was read already.
    let write = |k: usize| SendOp::RdmaWrite(remote.slice(3100 + 8 * k as u64, 8).unwrap());
    let one = [mr.sge(0, 8).unwrap()];
    let many = vec![mr.sge(0, 1).unwrap(); qp.caps().max_send_sge as usize + 1];

    // 1. Work request 2 of 4 has more SGEs than the QP allows.
    let wr = |id, k, sges| SendWr {
        wr_id: id,
        op: write(k),
        sges,
        signaled: true,
    };
    let chain = [
        wr(10, 0, &one[..]),
        wr(11, 1, &one[..]),
        wr(12, 2, &many[..]),
        wr(13, 3, &one[..]),
    ];
    match qp.post_send_chain(&chain) {
        Err((2, VerbsError::InvalidArgument { .. })) => {}
        other => panic!("{who}: expected our check to stop the chain at 2: {other:?}"),
    }
    let mut wc = wait_wc(cq, comp, 2, who);
    assert_ok(&wc, who);
    wc.sort_by_key(|w| w.wr_id);
    assert_eq!((wc[0].wr_id, wc[1].wr_id), (10, 11), "{who}: {wc:?}");

    // 2. A chain longer than the send queue: the provider stops it.
    let n = 40usize;
    let chain: Vec<SendWr> = (0..n).map(|k| wr(100 + k as u64, k, &one[..])).collect();
    let posted = match qp.post_send_chain(&chain) {
        Err((at, VerbsError::Post { wr_id, .. })) => {
            assert_eq!(
                wr_id,
                100 + at as u64,
                "{who}: the error names the first work request not posted"
            );
            at
        }
        other => panic!(
            "{who}: a chain of {n} on a send queue of {} must stop early: {other:?}",
            qp.caps().max_send_wr
        ),
    };
    assert!(posted >= 1 && posted < n, "{who}: stopped at {posted}");
    let mut wc = wait_wc(cq, comp, posted, who);
    assert_ok(&wc, who);
    wc.sort_by_key(|w| w.wr_id);
    let ids: Vec<u64> = wc.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, (100..100 + posted as u64).collect::<Vec<_>>(), "{who}");
    eprintln!(
        "{who}: an invalid work request at 2 of 4 posted the 2 before it; a chain of {n} on a \
         send queue of {} stopped at {posted}, and exactly those completed",
        qp.caps().max_send_wr
    );
}

#[test]
fn sys_rc_over_rdma_cm() {
    let Some(env) = rdma_env("sys_rc_over_rdma_cm") else {
        return;
    };
    query_device(&env);
    let who = "client";
    let (port_tx, port_rx) = mpsc::channel();
    let ip = env.ip;
    let srv = std::thread::spawn(move || server(ip, port_tx));
    let port = port_rx.recv_timeout(WAIT).expect("server port");
    let dst = SocketAddr::V4(SocketAddrV4::new(env.ip, port));

    let ch = EventChannel::new().expect("event channel");
    let id = CmId::new(&ch, PortSpace::Tcp).expect("client id");
    id.resolve_addr(None, dst, 5000).expect("resolve_addr");
    wait_cm(&ch, CmEventKind::AddrResolved, who);
    id.resolve_route(5000).expect("resolve_route");
    wait_cm(&ch, CmEventKind::RouteResolved, who);
    assert_eq!(id.peer_addr(), Some(dst));

    let ctx: Arc<Context> = id.context().expect("resolved id has a device");
    assert_eq!(ctx.name(), env.device);
    let dev = ctx.query_device().expect("query_device");
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let comp = CompletionChannel::new(&ctx).expect("completion channel");
    let cq = CompletionQueue::new(&ctx, 64, Some(&comp)).expect("cq");
    let mr1 = MemoryRegion::allocate(&pd, BUF, AccessFlags::LOCAL_WRITE).expect("mr1");
    let mr2 = MemoryRegion::allocate(&pd, BUF, AccessFlags::LOCAL_WRITE).expect("mr2");
    let attr = QpInitAttr {
        send_cq: &cq,
        recv_cq: &cq,
        srq: None,
        caps: caps(&dev),
    };
    let qp = id.create_qp(&pd, attr).expect("rdma_create_qp");
    let param = ConnParam {
        private_data: b"quicksilver".to_vec(),
        responder_resources: rd_atom(&dev),
        initiator_depth: rd_atom(&dev),
        retry_count: 7,
        rnr_retry_count: 7,
        qp_num: 0,
    };
    id.connect(&param).expect("connect");
    let est = wait_cm(&ch, CmEventKind::Established, who);
    let remote = decode_remote(&est.private_data);
    assert_eq!(remote.len, BUF as u64);

    // SEND from three SGEs in two regions.
    mr1.write_at(0, &pattern(4, 40)).unwrap();
    mr2.write_at(0, &pattern(5, 24)).unwrap();
    mr1.write_at(100, &pattern(6, 500)).unwrap();
    let sges = [
        mr1.sge(0, 40).unwrap(),
        mr2.sge(0, 24).unwrap(),
        mr1.sge(100, 500).unwrap(),
    ];
    qp.post_send(1, SendOp::Send, &sges, true).expect("post SEND");
    let wc = wait_wc(&cq, &comp, 1, who);
    assert_ok(&wc, who);
    assert_eq!((wc[0].wr_id, wc[0].opcode), (1, WcOpcode::Send));

    // RDMA WRITE of two SGEs into the server's region.
    let (a, b, c) = write_data();
    mr1.write_at(1000, &a).unwrap();
    mr2.write_at(1000, &b).unwrap();
    let sges = [mr1.sge(1000, 600).unwrap(), mr2.sge(1000, 400).unwrap()];
    qp.post_send(2, SendOp::RdmaWrite(remote.slice(0, 1000).unwrap()), &sges, true)
        .expect("post WRITE");
    // RDMA READ of the server's pattern, gathered into two SGEs.
    let sges = [mr2.sge(2000, 300).unwrap(), mr1.sge(3000, 700).unwrap()];
    qp.post_send(
        3,
        SendOp::RdmaRead(remote.slice(2048, 1000).unwrap()),
        &sges,
        true,
    )
    .expect("post READ");
    let mut wc = wait_wc(&cq, &comp, 2, who);
    assert_ok(&wc, who);
    wc.sort_by_key(|w| w.wr_id);
    assert_eq!(
        (wc[0].opcode, wc[1].opcode),
        (WcOpcode::RdmaWrite, WcOpcode::RdmaRead)
    );
    let mut got = vec![0u8; 1000];
    mr2.read_at(2000, &mut got[..300]).unwrap();
    mr1.read_at(3000, &mut got[300..]).unwrap();
    assert!(got == pattern(7, 1000), "{who}: RDMA READ data differs");

    // WRITE with immediate: lands after the first write, wakes the server.
    mr1.write_at(3900, &c).unwrap();
    let op = SendOp::RdmaWriteWithImm(remote.slice(1000, 40).unwrap(), IMM);
    qp.post_send(4, op, &[mr1.sge(3900, 40).unwrap()], true)
        .expect("post WRITE_WITH_IMM");
    assert_ok(&wait_wc(&cq, &comp, 1, who), who);
    eprintln!("{who}: SEND, RDMA WRITE, RDMA READ (multi-SGE) and WRITE_WITH_IMM completed");

    post_chains(&qp, &cq, &comp, &mr1, &remote);

    // Local argument checks: nothing is posted.
    let too_long = qp.post_send(
        5,
        SendOp::RdmaWrite(remote.slice(0, 10).unwrap()),
        &[mr1.sge(0, 600).unwrap()],
        true,
    );
    assert!(
        matches!(too_long, Err(VerbsError::InvalidArgument { .. })),
        "{too_long:?}"
    );
    let many = vec![mr1.sge(0, 1).unwrap(); qp.caps().max_send_sge as usize + 1];
    let too_many = qp.post_send(6, SendOp::Send, &many, true);
    assert!(
        matches!(too_many, Err(VerbsError::InvalidArgument { .. })),
        "{too_many:?}"
    );
    assert!(mr1.sge(BUF - 10, 11).is_err() && remote.slice(BUF as u64, 1).is_err());

    // A forged rkey: the device refuses, the work request completes in error.
    let forged = RemoteRegion {
        rkey: remote.rkey ^ 0x00ff_ff00,
        ..remote
    };
    qp.post_send(
        7,
        SendOp::RdmaRead(forged.slice(0, 64).unwrap()),
        &[mr1.sge(0, 64).unwrap()],
        true,
    )
    .expect("post READ with a forged rkey");
    let wc = wait_wc(&cq, &comp, 1, who);
    assert_eq!(wc[0].wr_id, 7);
    assert!(!wc[0].is_ok(), "a READ with a forged rkey must fail: {wc:?}");
    eprintln!(
        "{who}: forged rkey -> {} (QP state {:?})",
        wc[0].status_str(),
        qp.state()
    );
    assert_eq!(qp.state().expect("query_qp"), QpState::Error);

    id.disconnect().expect("disconnect");
    wait_cm(&ch, CmEventKind::Disconnected, who);
    srv.join().expect("server thread panicked");
}
