//! Spilled arguments with a separate server process (`hg-rpc-testpeer`)
//! over na-sm: inputs and outputs too large for one eager message pulled
//! intact (buffers reused), forged descriptors and failed checksums
//! refused, and the target's pull budget.

use std::time::{Duration, Instant};

use hg_rpc::{Engine, Rpc};
use na_core::OpId;
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, endpoint, posted_ops, Server};

/// Deadline of every call and wait here: generous, for a loaded 2-core
/// machine (CI runs the suite in parallel). Only calls that must succeed
/// use it, so a longer deadline never hides a failure, it only reports a
/// hang later. A `Count` queued behind three one-way spills of 1 MiB
/// waits for the debug-built testpeer to pull, check and decode them:
/// about 0.1 s idle, 1.5 s at a load of 10, and once over the former 10 s
/// at a load of 12-15 on 2 cores.
const T: Duration = Duration::from_secs(60);

#[test]
fn spilled_data_of_changing_sizes_stays_intact_while_buffers_are_reused() {
    // Both engines keep the buffers of finished spills and pulls for the
    // next ones (the server also its released outputs', for the next
    // output), a large one, then smaller, then larger again, some at
    // once: no call may see another's bytes or a stale tail.
    let d = dir("spill-reuse");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let pattern = |i: usize, len: usize| {
        ByteBuf::from(
            (0..len)
                .map(|j| (i * 131 + j * 7 + j / 251) as u8)
                .collect::<Vec<u8>>(),
        )
    };
    let sizes = [
        5000,
        1 << 20,
        4059,
        70_000,
        4100,
        (1 << 20) - 1,
        9000,
        300_000,
        4059,
    ];
    for (i, len) in sizes.into_iter().enumerate() {
        let v = pattern(i, len);
        assert!(
            c.call::<Echo>(&s, &v, T).unwrap() == v,
            "call {i}: {len} bytes corrupted"
        );
    }
    // 24 spilled calls in flight at once, of mixed sizes, then again.
    for round in 0..2 {
        let calls: Vec<_> = (0..24)
            .map(|i| {
                let v = pattern(
                    round * 100 + i,
                    [70_000, 4059, 9000, 130_000, 4100][(i + round) % 5] - i,
                );
                (c.forward::<Echo>(&s, &v).unwrap(), v)
            })
            .collect();
        let end = Instant::now() + T;
        while !calls.iter().all(|(id, _)| c.is_finished(*id)) {
            assert!(Instant::now() < end, "spilled echo calls did not finish");
            c.progress(Some(Duration::from_millis(10))).unwrap();
            c.trigger().unwrap();
        }
        for (i, (id, v)) in calls.into_iter().enumerate() {
            let r = c.take_response::<Echo>(id).expect("finished").unwrap();
            assert!(r == v, "round {round} call {i}: {} bytes corrupted", v.len());
        }
    }
    assert_eq!(c.stats().in_flight, 0);
    // Keeping none works the same.
    c.set_spare_bytes(0);
    for (i, len) in [9000, 300_000, 9000].into_iter().enumerate() {
        let v = pattern(500 + i, len);
        assert!(
            c.call::<Echo>(&s, &v, T).unwrap() == v,
            "without spares, call {i} corrupted"
        );
    }
}

#[test]
fn echo_responses_of_every_eager_size_stay_intact_and_their_buffers_return() {
    let d = dir("echo-sizes");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let pattern =
        |i: usize, len: usize| ByteBuf::from((0..len).map(|j| (i * 31 + j) as u8).collect::<Vec<u8>>());
    // Up to the eager limit over sm (the bytes' length prefix and the header
    // take the rest of an 8 KiB message), a 4 KiB block among them.
    for (i, len) in [
        0, 1, 100, 1000, 1017, 1018, 1019, 1024, 2000, 4000, 4096, 8000, 8158,
    ]
    .into_iter()
    .enumerate()
    {
        let v = pattern(i, len);
        assert_eq!(c.call::<Echo>(&s, &v, T).unwrap(), v, "{len} bytes");
    }
    // 200 responses held at once (more than the 64 receive buffers): none
    // is overwritten by a later message. Half are taken, half abandoned
    // after they finished; every receive buffer is posted again.
    let ids: Vec<_> = (0..200)
        .map(|i| c.forward::<Echo>(&s, &pattern(i, 500 + i * 15)).unwrap())
        .collect();
    let end = Instant::now() + T;
    while !ids.iter().all(|&id| c.is_finished(id)) {
        assert!(Instant::now() < end, "echo calls did not finish");
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
    for (i, &id) in ids.iter().enumerate() {
        if i % 2 == 0 {
            let r = c.take_response::<Echo>(id).expect("finished").unwrap();
            assert!(r == pattern(i, 500 + i * 15), "response {i} corrupted");
        } else {
            c.abandon(id);
        }
    }
    assert_eq!(c.stats().in_flight, 0);
    assert_eq!(posted_ops(&mut c), c.posted_receives() as u64 + 1);
    let v = pattern(7, 3000);
    assert_eq!(c.call::<Echo>(&s, &v, T).unwrap(), v);
}

#[test]
fn one_mib_arguments_spill_in_both_directions_and_one_way() {
    let d = dir("spill");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let blob = ByteBuf::from(
        (0..(1u32 << 20))
            .map(|i| (i * 13 + i / 4096) as u8)
            .collect::<Vec<u8>>(),
    );
    assert_eq!(
        c.call::<Digest>(&s, &blob, T).unwrap(),
        (blob.len() as u64, fnv(&blob))
    );
    for _ in 0..3 {
        c.forward_one_way::<RecordBlob>(&s, &blob).unwrap();
    }
    // One-way spills are acknowledged internally; Count sees all three.
    let end = Instant::now() + T;
    loop {
        let (n, sum) = c.call::<Count>(&s, &(), T).unwrap();
        if n == 3 {
            assert_eq!(sum, 3 * blob.len() as u64);
            break;
        }
        assert!(Instant::now() < end, "one-way spilled requests lost: {n} arrived");
    }
    // Small calls still work, and nothing is left in flight.
    assert_eq!(c.call::<Add>(&s, &(1, 2), T).unwrap(), 3);
    let end = Instant::now() + T;
    while c.stats().in_flight > 0 {
        assert!(Instant::now() < end);
        c.progress(Some(Duration::from_millis(20))).unwrap();
        c.trigger().unwrap();
    }
}

#[test]
fn forged_spill_descriptor_gets_an_error_reply() {
    use hg_rpc::header::{Header, Status};
    use na_core::{Access, RemoteMem, RemoteSegment};
    let d = dir("forged");
    let srv = Server::start(&d);
    // A raw endpoint, so that we see the reply ourselves.
    let (mut ep, sm) = endpoint(&d, false);
    let s = ep.lookup(&srv.uri).unwrap();
    // 100 bytes of data and the 8-byte seal after them.
    let bogus = RemoteMem::new(
        vec![RemoteSegment {
            addr: 0x1000,
            len: 108,
            key: 0,
        }],
        Access::ReadOnly,
    )
    .unwrap();
    let cases: Vec<(u64, Vec<u8>)> = vec![
        // Unmapped address in our address space: the pull fails.
        (100, bogus.to_bytes()),
        // Length disagrees with the handle.
        (99, bogus.to_bytes()),
        // Way over the target's limit.
        (
            1 << 40,
            RemoteMem::new(
                vec![RemoteSegment {
                    addr: 0x1000,
                    len: (1 << 40) + 8,
                    key: 0,
                }],
                Access::ReadOnly,
            )
            .unwrap()
            .to_bytes(),
        ),
        // Garbage descriptor.
        (100, b"not a descriptor".to_vec()),
    ];
    for (i, (len, desc)) in cases.into_iter().enumerate() {
        let cookie = 1000 + i as u64;
        let msg = spilled_digest_request(cookie, len, &desc, 0);
        // Responses come as unexpected messages (since protocol version 2).
        ep.post_recv_unexpected(sm, Vec::new(), OpId(cookie)).unwrap();
        ep.send_unexpected(&s, 0, &msg, OpId(1 << 40 | cookie)).unwrap();
        let end = Instant::now() + T;
        let reply = loop {
            assert!(Instant::now() < end, "case {i}: no reply");
            ep.progress(Some(Duration::from_millis(50))).unwrap();
            let mut got = None;
            while let Some(c) = ep.pop_completion() {
                if c.op == OpId(cookie) {
                    got = c.buf;
                }
            }
            if let Some(b) = got {
                break b;
            }
        };
        let (h, text) = Header::decode(&reply).unwrap();
        assert!(h.is_response() && h.cookie == cookie, "case {i}: {h:?}");
        assert_eq!(
            h.status,
            Status::DecodeError,
            "case {i}: {}",
            String::from_utf8_lossy(text)
        );
    }
    // The server keeps serving honest clients.
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    assert_eq!(c.call::<Add>(&s, &(2, 2), T).unwrap(), 4);
}

/// Spilled requests arriving together may not make the target commit more
/// than its pull budget: beyond it, a request is answered with a decode
/// error that says so, and once the pulls in flight are done the next one
/// is served.
#[test]
fn spilled_pulls_beyond_the_budget_are_refused_with_a_clear_error() {
    use hg_rpc::header::{Header, Status};

    let d = dir("pull-budget");
    // A raw client whose memory holds the spilled inputs (real pulls).
    let (mut srv, _, mut ep, cid, s) = digest_pair(&d);
    const LEN: u64 = 64 << 10;
    srv.set_max_pull_bytes(LEN + LEN / 2);
    let input = postcard::to_allocvec(&vec![1u8; LEN as usize - 8]).unwrap();
    let mem = common::sealed(input.clone());
    ep.plugin_mut(cid).unwrap().mem_register(&mem).unwrap();
    let desc = ep.plugin(cid).unwrap().mem_describe(&mem).unwrap().to_bytes();
    let request = |cookie: u64| {
        spilled_digest_request(cookie, input.len() as u64, &desc, hg_rpc::header::crc32c(&input))
    };
    // Three requests in the target's queue before it looks: one fits.
    for cookie in 1..=3u64 {
        ep.post_recv_unexpected(cid, Vec::new(), OpId(cookie)).unwrap();
        ep.send_unexpected(&s, 0, &request(cookie), OpId(100 + cookie))
            .unwrap();
    }
    let replies = |ep: &mut na_core::Endpoint, srv: &mut Engine, n: usize| {
        let mut got = Vec::new();
        let end = Instant::now() + T;
        while got.len() < n {
            assert!(Instant::now() < end, "{} of {n} replies", got.len());
            ep.progress(Some(Duration::from_millis(1))).unwrap();
            srv.progress(Some(Duration::from_millis(1))).unwrap();
            srv.trigger().unwrap();
            while let Some(c) = ep.pop_completion() {
                if let Some(buf) = c.buf.filter(|_| c.op.0 < 100) {
                    let (h, p) = Header::decode(&buf).unwrap();
                    got.push((h.status, String::from_utf8_lossy(p).into_owned()));
                }
            }
        }
        got
    };
    let got = replies(&mut ep, &mut srv, 3);
    let ok = got.iter().filter(|(st, _)| *st == Status::Ok).count();
    let refused: Vec<_> = got.iter().filter(|(st, _)| *st == Status::Busy).collect();
    assert_eq!((ok, refused.len()), (1, 2), "{got:?}");
    for (_, why) in refused {
        assert!(why.contains("at once"), "{why}");
    }
    // The budget is free again: the next one is served.
    ep.post_recv_unexpected(cid, Vec::new(), OpId(4)).unwrap();
    ep.send_unexpected(&s, 0, &request(4), OpId(104)).unwrap();
    let got = replies(&mut ep, &mut srv, 1);
    assert_eq!(got[0].0, Status::Ok, "{got:?}");
    // An input larger than the whole budget never fits: not busy (a caller
    // would retry it forever) but a decode error that names the limit.
    srv.set_max_pull_bytes(input.len() as u64 - 1);
    ep.post_recv_unexpected(cid, Vec::new(), OpId(5)).unwrap();
    ep.send_unexpected(&s, 0, &request(5), OpId(105)).unwrap();
    let got = replies(&mut ep, &mut srv, 1);
    assert_eq!(got[0].0, Status::DecodeError, "{got:?}");
    assert!(got[0].1.contains("bytes exceed the"), "{got:?}");
}

/// Sends the raw request `msg` from `ep`'s plugin `cid` to `to`, its reply
/// expected under `cookie`, and drives both sides until the reply comes:
/// its header and payload.
fn raw_reply(
    ep: &mut na_core::Endpoint,
    cid: na_core::PluginId,
    to: &na_core::Addr,
    srv: &mut Engine,
    cookie: u64,
    msg: &[u8],
) -> (hg_rpc::header::Header, Vec<u8>) {
    ep.post_recv_unexpected(cid, Vec::new(), OpId(cookie)).unwrap();
    ep.send_unexpected(to, 0, msg, OpId(100 + cookie)).unwrap();
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "no reply to {cookie}");
        ep.progress(Some(Duration::from_millis(1))).unwrap();
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        srv.trigger().unwrap();
        let done = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == OpId(cookie));
        if let Some(buf) = done.and_then(|c| c.buf) {
            let (h, p) = hg_rpc::header::Header::decode(&buf).unwrap();
            return (h, p.to_vec());
        }
    }
}

/// A listening engine in `d` serving `Digest` (length and byte sum) and a
/// raw client endpoint connected to it: (engine, its plugin, client
/// endpoint, its plugin, the engine's address).
fn digest_pair(
    d: &std::path::Path,
) -> (
    Engine,
    na_core::PluginId,
    na_core::Endpoint,
    na_core::PluginId,
    na_core::Addr,
) {
    let (sep, sid) = endpoint(d, true);
    let mut srv = Engine::new(sep, sid).unwrap();
    srv.register::<Digest>(|v| Ok((v.len() as u64, v.iter().map(|&b| u64::from(b)).sum())))
        .unwrap();
    let (mut ep, cid) = endpoint(d, false);
    let s = ep.lookup(srv.self_addr().uri()).unwrap();
    (srv, sid, ep, cid, s)
}

/// A spilled `Digest` request written by hand, with a checksum: the length
/// of the spilled input, its memory descriptor and its CRC-32C `crc` as
/// the payload.
fn spilled_digest_request(cookie: u64, len: u64, desc: &[u8], crc: u32) -> Vec<u8> {
    use hg_rpc::header::{FLAG_CHECKSUM, FLAG_SPILL};
    let payload = common::spilled_payload(len, desc, Some(crc));
    common::wire_message(FLAG_CHECKSUM | FLAG_SPILL, Digest::NAME, cookie, &payload)
}

/// With checksums, a spilled input carries the CRC-32C of the data (the
/// header's covers only the message): the target checks what it pulled
/// and answers a mismatch with a decode error that says so, counted as
/// malformed; the right CRC is served.
#[test]
fn a_spilled_input_that_fails_its_checksum_is_refused() {
    use hg_rpc::header::{crc32c, Status};

    let d = dir("spill-crc-in");
    let (mut srv, _, mut ep, cid, s) = digest_pair(&d);
    let input = postcard::to_allocvec(&vec![1u8; 64 << 10]).unwrap();
    let mem = common::sealed(input.clone());
    ep.plugin_mut(cid).unwrap().mem_register(&mem).unwrap();
    let desc = ep.plugin(cid).unwrap().mem_describe(&mem).unwrap().to_bytes();
    let good = crc32c(&input);
    for (cookie, crc) in [(1u64, good ^ 0x10), (2, good)] {
        let msg = spilled_digest_request(cookie, input.len() as u64, &desc, crc);
        let (h, p) = raw_reply(&mut ep, cid, &s, &mut srv, cookie, &msg);
        if crc == good {
            assert_eq!(h.status, Status::Ok, "{}", String::from_utf8_lossy(&p));
        } else {
            let why = String::from_utf8_lossy(&p);
            assert_eq!(h.status, Status::DecodeError, "{why}");
            assert!(why.contains("CRC-32C"), "{why}");
            assert_eq!(srv.stats().malformed, 1);
        }
    }
    assert_eq!(srv.stats().malformed, 1);
}

/// A spilled input whose descriptor forbids reading (write-only) fails
/// the descriptor's checks: answered with a decode error (status 3) before
/// anything is pulled, and counted as malformed on the target, as a
/// checksum that fails is (it was answered but not counted); a readable
/// one after it is served.
#[test]
fn a_spilled_input_described_write_only_is_answered_and_counted_malformed() {
    use hg_rpc::header::{crc32c, Status};

    let d = dir("spill-write-only-in");
    let (mut srv, sid, mut ep, cid, s) = digest_pair(&d);
    let input = postcard::to_allocvec(&vec![1u8; 64 << 10]).unwrap();
    let crc = crc32c(&input);
    let write_only = na_core::MemHandle::new(
        vec![input.clone(), common::TEST_SEAL.to_le_bytes().to_vec()],
        na_core::Access::WriteOnly,
    );
    let readable = common::sealed(input.clone());
    for (cookie, mem) in [(1u64, &write_only), (2, &readable)] {
        ep.plugin_mut(cid).unwrap().mem_register(mem).unwrap();
        let desc = ep.plugin(cid).unwrap().mem_describe(mem).unwrap().to_bytes();
        let msg = spilled_digest_request(cookie, input.len() as u64, &desc, crc);
        let (h, p) = raw_reply(&mut ep, cid, &s, &mut srv, cookie, &msg);
        let why = String::from_utf8_lossy(&p);
        if cookie == 1 {
            assert_eq!(h.status, Status::DecodeError, "{why}");
            assert!(why.contains("read"), "{why}");
            let st = srv.stats();
            assert_eq!((st.malformed, st.pulls_refused), (1, 0), "{st:?}");
        } else {
            assert_eq!(h.status, Status::Ok, "{why}");
        }
    }
    assert_eq!(srv.stats().malformed, 1);
    let pulled = srv.endpoint().plugin(sid).unwrap().stats().get_bytes;
    assert_eq!(
        pulled,
        input.len() as u64 + 8,
        "only the readable input was pulled"
    );
}

/// A spilled input whose descriptor names the target's own process
/// outside the memory it exposes (an origin in the same process forging
/// one) is refused by the transport when the pull starts: that is a bad
/// descriptor from the peer, so it is answered with a decode error
/// (status 3) and counted as malformed, as a write-only one is, not
/// passed off as a transport failure; nothing is pulled, and an honest
/// request after it is served.
#[test]
fn a_spilled_input_forged_to_name_the_target_s_own_memory_is_counted_malformed() {
    use hg_rpc::header::{crc32c, Status};
    use na_core::{Access, RemoteMem, RemoteSegment};

    let d = dir("spill-forged-self");
    let (mut srv, sid, mut ep, cid, s) = digest_pair(&d);
    let input = postcard::to_allocvec(&vec![1u8; 64 << 10]).unwrap();
    let crc = crc32c(&input);
    // Mapped memory of this process (so of the target's), never exposed.
    let hidden = vec![0u8; input.len() + 8];
    let forged = RemoteMem::new(
        vec![RemoteSegment {
            addr: hidden.as_ptr() as u64,
            len: hidden.len() as u64,
            key: 0,
        }],
        Access::ReadOnly,
    )
    .unwrap()
    .to_bytes();
    let readable = common::sealed(input.clone());
    ep.plugin_mut(cid).unwrap().mem_register(&readable).unwrap();
    let honest = ep
        .plugin(cid)
        .unwrap()
        .mem_describe(&readable)
        .unwrap()
        .to_bytes();
    for (cookie, desc) in [(1u64, &forged), (2, &honest)] {
        let msg = spilled_digest_request(cookie, input.len() as u64, desc, crc);
        let (h, p) = raw_reply(&mut ep, cid, &s, &mut srv, cookie, &msg);
        let why = String::from_utf8_lossy(&p);
        if cookie == 1 {
            assert_eq!(h.status, Status::DecodeError, "{why}");
            assert!(why.contains("descriptor"), "{why}");
            let st = srv.stats();
            assert_eq!((st.malformed, st.pulls_refused), (1, 0), "{st:?}");
            let t = srv.endpoint().plugin(sid).unwrap().stats();
            assert_eq!((t.self_rma_refused, t.get_bytes), (1, 0), "{t:?}");
        } else {
            assert_eq!(h.status, Status::Ok, "{why}");
        }
    }
    assert_eq!(srv.stats().malformed, 1);
    drop(hidden);
}
