//! `Engine::bulk_batch`, the blocking twin of `AsyncEngine::bulk_batch`:
//! many spans moved as one batch and waited for, against a separate
//! server process over na-sm. Its data arrives (pulled and pushed across
//! both sides' segments), a span's own failure is the answer, and past
//! its timeout the spans in flight are canceled and waited for, leaving
//! nothing in flight and the engine serving and calling as before. (The
//! timeout covering the lookup of the handle's owner is in
//! `bulk_lookup_timeout.rs`.)

use std::time::Duration;

use hg_rpc::{Bulk, BulkDesc, BulkOp, Engine, RpcError, Span};
use na_core::{Access, RemoteMem, RemoteSegment};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::{fnv, Add, BlobExpose, BlobExposedDigest, BlobPut};
mod common;
use common::{contents, pattern, Server};

const T: Duration = Duration::from_secs(10);

/// Stores `data` in the server as blob `key` (the server pulls it) and
/// answers the server's copy, exposed read-write in segments of
/// `segment` bytes.
fn served_copy(c: &mut Engine, s: &na_core::Addr, key: &str, data: &[u8], segment: u64) -> Bulk {
    let put = c.expose(vec![data.to_vec()], Access::ReadOnly).unwrap();
    assert_eq!(c.call::<BlobPut>(s, &(key.into(), put), T).unwrap(), fnv(data));
    let remote = c.call::<BlobExpose>(s, &(key.into(), segment), T).unwrap();
    assert_eq!(remote.size(), data.len() as u64);
    remote
}

#[test]
fn a_batch_pulls_and_pushes_spans_across_segments_with_a_server_process() {
    let d = common::dir("bulk-batch");
    let srv = Server::start(&d);
    let mut c = common::client(&d);
    let s = c.lookup(&srv.uri).unwrap();
    let data = pattern(3_100_000, 0);
    let remote = served_copy(&mut c, &s, "k", &data, 300_000);

    // 300 spans of 5,000 bytes, scattered and out of order, many across
    // the server's segment boundaries and one across ours.
    let spans: Vec<Span> = (0..300u64)
        .rev()
        .map(|k| Span {
            remote_offset: k * 10_037,
            local_offset: k * 5_000,
            len: 5_000,
        })
        .collect();
    let scattered = c
        .expose(vec![vec![0; 1_000_002], vec![0; 499_998]], Access::ReadWrite)
        .unwrap();
    c.bulk_batch(BulkOp::Pull, &remote, &scattered, &spans, T)
        .unwrap();
    let got = contents(&scattered);
    for s in &spans {
        let (r, l) = (s.remote_offset as usize, s.local_offset as usize);
        assert!(
            got[l..l + 5_000] == data[r..r + 5_000],
            "pulled span at {r} differs"
        );
    }
    assert_eq!(c.stats().bulk_in_flight, 0);

    // One span out of bounds: the batch is refused whole, nothing moves.
    let mut bad = spans.clone();
    bad[150].remote_offset = data.len() as u64 - 10;
    let untouched = c.expose(vec![vec![0; 1_500_000]], Access::ReadWrite).unwrap();
    match c.bulk_batch(BulkOp::Pull, &remote, &untouched, &bad, T) {
        Err(RpcError::BulkRefused { reason }) => assert!(reason.contains("bounds"), "{reason}"),
        other => panic!("expected a bounds error, got {other:?}"),
    }
    // na-sm moves data as it posts: a partial start would show here.
    assert!(
        contents(&untouched).iter().all(|&b| b == 0),
        "a refused batch moved data"
    );
    assert_eq!(c.stats().bulk_in_flight, 0, "a refused batch started something");
    c.bulk_batch(BulkOp::Pull, &remote, &untouched, &[], T).unwrap();

    // A push of 40 spans from a two-segment handle into the server's
    // copy, checked by the server.
    let new = pattern(200_000, 17);
    let src = c
        .expose(
            vec![new[..70_001].to_vec(), new[70_001..].to_vec()],
            Access::ReadOnly,
        )
        .unwrap();
    let pushes: Vec<Span> = (0..40u64)
        .map(|k| Span {
            remote_offset: 777 + k * 71_003,
            local_offset: k * 5_000,
            len: 5_000,
        })
        .collect();
    c.bulk_batch(BulkOp::Push, &remote, &src, &pushes, T).unwrap();
    let mut expect = data.clone();
    for p in &pushes {
        let (r, l) = (p.remote_offset as usize, p.local_offset as usize);
        expect[r..r + 5_000].copy_from_slice(&new[l..l + 5_000]);
    }
    let digest = c.call::<BlobExposedDigest>(&s, &"k".into(), T).unwrap();
    assert_eq!(
        digest,
        (expect.len() as u64, fnv(&expect)),
        "the server's copy after the push"
    );
    assert_eq!(c.stats().bulk_in_flight, 0);
}

/// A span whose remote memory is not mapped in the server fails in the
/// transport; the batch answers that failure (not a timeout, not
/// success) once every span has ended, and the spans around it moved
/// their data.
#[test]
fn a_failed_span_is_the_batchs_answer() {
    let d = common::dir("bulk-batch-failed");
    let srv = Server::start(&d);
    let mut c = common::client(&d);
    let s = c.lookup(&srv.uri).unwrap();
    let data = pattern(100_000, 3);
    let theirs = served_copy(&mut c, &s, "f", &data, 100_000);
    // The server's handle with a page appended that nothing maps there.
    let desc = theirs.desc().into_owned();
    let mut segs = RemoteMem::from_bytes(&desc.mem).unwrap().segments().to_vec();
    segs.push(RemoteSegment {
        addr: 0x1000,
        len: 4096,
        key: 0,
    });
    let mem = RemoteMem::new(segs, Access::ReadWrite).unwrap().to_bytes();
    let remote = Bulk::from_desc(BulkDesc {
        owner: desc.owner.clone(),
        mem: serde_bytes::ByteBuf::from(mem),
        inline: None,
    })
    .unwrap();
    let spans = [
        Span {
            remote_offset: 10,
            local_offset: 0,
            len: 1000,
        },
        Span {
            remote_offset: 100_000,
            local_offset: 1000,
            len: 4096,
        },
        Span {
            remote_offset: 50_000,
            local_offset: 5096,
            len: 1000,
        },
    ];
    let local = c.expose(vec![vec![0; 6096]], Access::ReadWrite).unwrap();
    match c.bulk_batch(BulkOp::Pull, &remote, &local, &spans, T) {
        Err(RpcError::Transport(e)) => {
            let e = na_core::ErrorChain(&e).to_string();
            assert!(e.contains("4096 bytes") && e.contains("not mapped"), "{e}")
        }
        other => panic!("expected the failed span's transport error, got {other:?}"),
    }
    let got = contents(&local);
    assert!(
        got[..1000] == data[10..1010],
        "the span before the failed one differs"
    );
    assert!(
        got[5096..] == data[50_000..51_000],
        "the span after the failed one differs"
    );
    assert_eq!(
        c.stats().bulk_in_flight,
        0,
        "the batch answered with spans in flight"
    );
    // The engine goes on.
    assert_eq!(c.call::<Add>(&s, &(2, 3), T).unwrap(), 5);
}

/// Past its timeout a batch's spans are canceled and waited for: the
/// answer is the timeout, and then the transport has nothing of them in
/// flight nor left to report, the engine counts no transfer in flight,
/// and it still serves (a handler of its own, called by another engine),
/// calls and moves data. A zero timeout always leaves spans to cancel
/// over na-sm (their ends are reported at the next progress call).
#[test]
fn a_timed_out_batch_leaves_nothing_in_flight_and_the_engine_working() {
    let d = common::dir("bulk-batch-timeout");
    let srv = Server::start(&d);
    let (ep, cid) = common::endpoint(&d, true);
    let mut c = Engine::new(ep, cid).unwrap();
    c.register::<Add>(|(a, b)| a.checked_add(b).ok_or_else(|| "overflow".to_string()))
        .unwrap();
    let s = c.lookup(&srv.uri).unwrap();
    let data = pattern(3 << 20, 1);
    let remote = served_copy(&mut c, &s, "t", &data, 1 << 20);
    let local = c.expose(vec![vec![0; 3 << 20]], Access::ReadWrite).unwrap();
    // What the transport still has to do or say about transfers (the
    // engine's progress call first posts again the receive buffers it
    // handled messages in, with QS_RPC_RECV=posted).
    let left = |c: &mut Engine| {
        c.progress_now().unwrap();
        let ep = c.endpoint();
        (
            ep.plugin(cid).unwrap().stats().in_flight,
            ep.pending_completions(),
        )
    };
    // The engine's own posted receives (QS_RPC_RECV=posted) and its
    // watch on the server stay in flight.
    let before = left(&mut c);
    let spans: Vec<Span> = (0..64u64)
        .map(|k| Span {
            remote_offset: k * 40_000,
            local_offset: k * 40_000,
            len: 40_000,
        })
        .collect();
    for round in 0..3 {
        let r = c.bulk_batch(BulkOp::Pull, &remote, &local, &spans, Duration::ZERO);
        match r {
            Err(RpcError::Timeout { rpc, millis }) => {
                assert_eq!((rpc.as_str(), millis), ("bulk transfer", 0), "round {round}")
            }
            other => panic!("round {round}: expected the batch's timeout, got {other:?}"),
        }
        assert_eq!(
            left(&mut c),
            before,
            "round {round}: the batch returned before its canceled spans ended"
        );
        assert_eq!(c.stats().bulk_in_flight, 0, "round {round}");
    }
    assert_eq!(c.stats().in_flight, 0);

    // It serves: another engine calls its handler.
    let mut other = common::client(&d);
    assert_eq!(
        common::call_both::<Add>(&mut other, &mut c, &(20, 22)).unwrap(),
        42
    );
    // It calls, and moves data.
    assert_eq!(c.call::<Add>(&s, &(2, 3), T).unwrap(), 5);
    let again = c.expose(vec![vec![0; 8192]], Access::ReadWrite).unwrap();
    let two = [0u64, 4096].map(|at| Span {
        remote_offset: 99_999 + at,
        local_offset: at,
        len: 4096,
    });
    c.bulk_batch(BulkOp::Pull, &remote, &again, &two, T).unwrap();
    assert!(
        contents(&again) == data[99_999..99_999 + 8192],
        "a batch after the timeouts differs"
    );
    assert_eq!(c.stats().bulk_in_flight, 0);
    assert_eq!(left(&mut c), before);
}
