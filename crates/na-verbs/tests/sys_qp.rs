//! RC queue pairs without RDMA CM, on the real soft-RoCE stack: the explicit
//! RESET → INIT → RTR → RTS state machine (QP numbers and GIDs exchanged in
//! process), a shared receive queue, two CQs on one completion channel,
//! SEND with immediate, RDMA WRITE, flushing by moving a QP to ERROR, and
//! an SGE whose region is gone failing with a local error.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so loudly
//! and asserts that opening a device fails with the clear "no RDMA device" error.

mod common;

use common::*;
use na_verbs::sys::*;
use na_verbs::VerbsError;

const BUF: usize = 8192;

#[test]
fn sys_qp_manual_transitions_with_srq() {
    let Some(env) = rdma_env("sys_qp_manual_transitions_with_srq") else {
        return;
    };
    let who = "manual";
    let ctx = Context::open(Some(&env.device)).expect("open device");
    let dev = ctx.query_device().expect("query_device");
    let port = ctx.query_port(1).expect("query_port");
    let gid_index = (0..port.gid_tbl_len.min(16))
        .find(|&i| ctx.query_gid(1, i).ok().and_then(|g| g.ipv4()) == Some(env.ip))
        .expect("an IPv4-mapped GID for the rxe address");
    let gid = ctx.query_gid(1, gid_index).expect("query_gid");

    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let comp = CompletionChannel::new(&ctx).expect("completion channel");
    let cq_a = CompletionQueue::new(&ctx, 32, Some(&comp)).expect("cq a");
    let cq_b = CompletionQueue::new(&ctx, 32, Some(&comp)).expect("cq b");
    assert!(cq_a.capacity() >= 32);
    let srq = SharedReceiveQueue::new(&pd, 16, 2).expect("srq");
    assert!(srq.max_wr() >= 16);
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline_data: 0,
    };
    let qp_a = QueuePair::new_rc(
        &pd,
        QpInitAttr {
            send_cq: &cq_a,
            recv_cq: &cq_a,
            srq: None,
            caps,
        },
    )
    .expect("qp a");
    let qp_b = QueuePair::new_rc(
        &pd,
        QpInitAttr {
            send_cq: &cq_b,
            recv_cq: &cq_b,
            srq: Some(&srq),
            caps,
        },
    )
    .expect("qp b");
    assert_eq!(qp_a.state().unwrap(), QpState::Reset);

    let mem_a = MemoryRegion::allocate(&pd, BUF, AccessFlags::LOCAL_WRITE).expect("mr a");
    let mem_b = MemoryRegion::allocate(&pd, BUF, AccessFlags::ALL_RMA).expect("mr b");

    for qp in [&qp_a, &qp_b] {
        qp.to_init(1, AccessFlags::ALL_RMA).expect("to INIT");
        assert_eq!(qp.state().unwrap(), QpState::Init);
    }
    // Receives may be posted from INIT on; the SRQ feeds qp_b.
    srq.post_recv(10, &[mem_b.sge(0, 100).unwrap(), mem_b.sge(4096, 1000).unwrap()])
        .expect("srq recv");
    srq.post_recv(11, &[mem_b.sge(200, 100).unwrap()])
        .expect("srq recv");

    let bad_mtu = RtrAttr {
        dest_qp_num: qp_b.qp_num(),
        rq_psn: 0,
        path_mtu: 1000,
        dgid: gid,
        sgid_index: gid_index as u8,
        port: 1,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
    };
    assert!(matches!(
        qp_a.to_rtr(&bad_mtu),
        Err(VerbsError::InvalidArgument { .. })
    ));

    let (psn_a, psn_b) = (0x1234, 0x5678);
    let rtr = |dest: &QueuePair, rq_psn| RtrAttr {
        dest_qp_num: dest.qp_num(),
        rq_psn,
        path_mtu: port.active_mtu,
        dgid: gid,
        sgid_index: gid_index as u8,
        port: 1,
        max_dest_rd_atomic: dev.max_qp_rd_atom.clamp(1, 4) as u8,
        min_rnr_timer: 12,
    };
    let rts = |sq_psn| RtsAttr {
        sq_psn,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
    };
    qp_a.to_rtr(&rtr(&qp_b, psn_b)).expect("a to RTR");
    qp_b.to_rtr(&rtr(&qp_a, psn_a)).expect("b to RTR");
    assert_eq!(qp_b.state().unwrap(), QpState::Rtr);
    qp_a.to_rts(&rts(psn_a)).expect("a to RTS");
    qp_b.to_rts(&rts(psn_b)).expect("b to RTS");
    assert_eq!(
        (qp_a.state().unwrap(), qp_b.state().unwrap()),
        (QpState::Rts, QpState::Rts)
    );

    // SEND with immediate, 2 SGEs → 2 SGEs through the SRQ.
    let (p1, p2) = (pattern(21, 100), pattern(22, 700));
    mem_a.write_at(0, &p1).unwrap();
    mem_a.write_at(2000, &p2).unwrap();
    let sges = [mem_a.sge(0, 100).unwrap(), mem_a.sge(2000, 700).unwrap()];
    qp_a.post_send(1, SendOp::SendWithImm(0xABCD_EF01), &sges, true)
        .expect("post SEND_WITH_IMM");
    assert_ok(&wait_wc(&cq_a, &comp, 1, who), who);
    let wc = wait_wc(&cq_b, &comp, 1, who);
    assert_ok(&wc, who);
    assert_eq!(
        (wc[0].wr_id, wc[0].opcode, wc[0].byte_len),
        (10, WcOpcode::Recv, 800)
    );
    assert_eq!((wc[0].imm, wc[0].qp_num), (Some(0xABCD_EF01), qp_b.qp_num()));
    let mut got = vec![0u8; 800];
    mem_b.read_at(0, &mut got[..100]).unwrap();
    mem_b.read_at(4096, &mut got[100..]).unwrap();
    assert!(
        got == [p1, p2].concat(),
        "SEND data differs after the SRQ scatter"
    );

    // RDMA WRITE, unsignaled, followed by a signaled one: both land in order.
    let p3 = pattern(23, 3000);
    mem_a.write_at(4000, &p3).unwrap();
    let remote = mem_b.remote(1000, 3000).unwrap();
    qp_a.post_send(
        2,
        SendOp::RdmaWrite(remote.slice(0, 1000).unwrap()),
        &[mem_a.sge(4000, 1000).unwrap()],
        false,
    )
    .expect("post WRITE");
    qp_a.post_send(
        3,
        SendOp::RdmaWrite(remote.slice(1000, 2000).unwrap()),
        &[mem_a.sge(5000, 2000).unwrap()],
        true,
    )
    .expect("post WRITE");
    let wc = wait_wc(&cq_a, &comp, 1, who);
    assert_ok(&wc, who);
    assert_eq!(wc[0].wr_id, 3, "only the signaled WRITE completes");
    let mut got = vec![0u8; 3000];
    mem_b.read_at(1000, &mut got).unwrap();
    assert!(got == p3, "RDMA WRITE data differs");

    // ERROR flushes outstanding receives with an error completion.
    qp_a.post_recv(50, &[mem_a.sge(0, 64).unwrap()])
        .expect("post_recv on a");
    qp_a.to_error().expect("to ERROR");
    assert_eq!(qp_a.state().unwrap(), QpState::Error);
    let wc = wait_wc(&cq_a, &comp, 1, who);
    assert_eq!(wc[0].wr_id, 50);
    assert!(!wc[0].is_ok(), "a flushed receive completes in error: {wc:?}");
    eprintln!("{who}: flushed receive -> {}", wc[0].status_str());

    // An SGE borrows nothing and may outlive its region (see `Sge`): the
    // device checks its lkey against the live registrations, so one whose
    // region is gone (deregistered and unmapped) fails on our side and
    // reads nothing: a local protection error on hardware, a local QP
    // operation error from soft-RoCE (its failed lkey lookup). Had the
    // device used the entry, the SEND would have gone to qp_a, which is
    // in ERROR by now and drops it: a retry error, after the retries.
    let gone = MemoryRegion::allocate(&pd, BUF, AccessFlags::LOCAL_WRITE).expect("mr");
    let stale = gone.sge(0, 64).unwrap();
    drop(gone);
    match qp_b.post_send(60, SendOp::Send, &[stale], true) {
        Err(e) => eprintln!(
            "{who}: a stale SGE refused at the post: {}",
            na_core::ErrorChain(&e)
        ),

        Ok(()) => {
            let wc = wait_wc(&cq_b, &comp, 1, who);
            assert_eq!(wc[0].wr_id, 60);
            // IBV_WC_LOC_QP_OP_ERR, IBV_WC_LOC_PROT_ERR.
            assert!(
                matches!(wc[0].status, 2 | 4),
                "a stale SGE's work request: {} ({:?})",
                wc[0].status_str(),
                wc[0]
            );
            eprintln!("{who}: stale SGE -> {}", wc[0].status_str());
        }
    }
    // Nothing was left unacked: dropping CQs and the channel must not block.
    drop((qp_a, qp_b, srq, cq_a, cq_b, comp));
}
