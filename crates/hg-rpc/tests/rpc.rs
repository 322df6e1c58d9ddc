//! hg-rpc over na-sm with a separate server process (`hg-rpc-testpeer`).

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use hg_rpc::{Engine, Rpc, RpcError};
use na_core::{OpId, Plugin};
use na_sm::{SmConfig, SmPlugin};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{assert_refused_at_start, call_both, client, dir, endpoint, posted_ops, Server};

const T: Duration = Duration::from_secs(10);

/// Same name as `test.add` with another input type: the server cannot decode it.
struct AddWrongType;
impl Rpc for AddWrongType {
    const NAME: &'static str = "test.add";
    type Input = String;
    type Output = u64;
}

/// The name of the engine's own release message.
struct Reserved;
impl Rpc for Reserved {
    const NAME: &'static str = "hg.release-output";
    type Input = ();
    type Output = ();
}

/// Registered nowhere.
struct Missing;
impl Rpc for Missing {
    const NAME: &'static str = "test.missing";
    type Input = ();
    type Output = ();
}

#[test]
fn typed_calls_and_each_kind_of_error() {
    let d = dir("typed");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    assert_eq!(c.call::<Add>(&s, &(40, 2), T).unwrap(), 42);
    assert_eq!(c.call::<Echo>(&s, &b"hello".to_vec(), T).unwrap(), b"hello");
    match c.call::<Fail>(&s, &"boom".to_string(), T) {
        Err(RpcError::Handler { message, .. }) => assert_eq!(message, "boom"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    match c.call::<Add>(&s, &(u64::MAX, 1), T) {
        Err(RpcError::Handler { message, .. }) => assert_eq!(message, "overflow"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    assert!(matches!(
        c.call::<Missing>(&s, &(), T),
        Err(RpcError::UnknownRpc { .. })
    ));
    assert!(matches!(
        c.call::<AddWrongType>(&s, &"x".repeat(40), T),
        Err(RpcError::Decode { what: "input", .. })
    ));
    // Inputs and outputs just over the eager size spill both ways.
    assert_eq!(c.call::<Echo>(&s, &vec![3; 5000], T).unwrap(), vec![3; 5000]);
    // The server still serves after all of that.
    assert_eq!(c.call::<Add>(&s, &(1, 2), T).unwrap(), 3);
    let st = c.stats();
    assert_eq!(st.in_flight, 0);
    assert!(st.errors >= 4, "{st:?}");
}

#[test]
fn timeout_then_late_response_is_discarded() {
    let d = dir("timeout");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let t0 = Instant::now();
    // The handler sleeps 2 s: a call that waited for it (instead of timing
    // out after 100 ms) takes that long; the margin absorbs a loaded machine.
    match c.call::<Sleep>(&s, &2000, Duration::from_millis(100)) {
        Err(RpcError::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "timeout took {:?}",
        t0.elapsed()
    );
    // The next call gets its own answer, not the late one.
    assert_eq!(c.call::<Add>(&s, &(5, 6), T).unwrap(), 11);
}

#[test]
fn one_way_calls_arrive() {
    let d = dir("oneway");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    for i in 1..=100u64 {
        c.forward_one_way::<Record>(&s, &i).unwrap();
    }
    // Requests from one origin are served in order, so Count sees all 100.
    assert_eq!(c.call::<Count>(&s, &(), T).unwrap(), (100, 5050));
}

#[test]
fn ten_thousand_calls_with_a_thousand_in_flight() {
    let d = dir("many");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let (total, window) = (10_000u64, 1_000usize);
    let mut inflight = std::collections::VecDeque::new();
    let (mut next, mut done) = (0u64, 0u64);
    let deadline = Instant::now() + Duration::from_secs(60);
    while done < total {
        while next < total && inflight.len() < window {
            inflight.push_back((next, c.forward::<Add>(&s, &(next, 1)).unwrap()));
            next += 1;
        }
        assert!(Instant::now() < deadline, "only {done} of {total} calls finished");
        c.progress(Some(Duration::from_millis(100))).unwrap();
        c.trigger().unwrap();
        while let Some(&(i, id)) = inflight.front() {
            match c.take_response::<Add>(id) {
                Some(r) => {
                    assert_eq!(r.unwrap(), i + 1);
                    inflight.pop_front();
                    done += 1;
                }
                None => break,
            }
        }
    }
    assert_eq!(c.stats().in_flight, 0);
    // Every receive buffer a response used is posted again: all 64 (plus
    // the watch on the server).
    assert_eq!(posted_ops(&mut c), c.posted_receives() as u64 + 1);
}

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
        (0..len)
            .map(|j| (i * 131 + j * 7 + j / 251) as u8)
            .collect::<Vec<u8>>()
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
    let pattern = |i: usize, len: usize| (0..len).map(|j| (i * 31 + j) as u8).collect::<Vec<u8>>();
    // Up to the eager limit over sm (a Vec's length prefix and the header
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
fn self_forward_runs_the_handler_without_the_network() {
    let d = dir("self");
    let mut c = client(&d);
    c.register::<Add>(|(a, b)| Ok(a * 10 + b)).unwrap();
    let me = c.self_addr().clone();
    assert_eq!(c.call::<Add>(&me, &(4, 2), T).unwrap(), 42);
    // "Wait forever" as the largest timeout is a timeout, not an overflow.
    assert_eq!(c.call::<Add>(&me, &(1, 3), Duration::MAX).unwrap(), 13);
    assert!(matches!(
        c.call::<Missing>(&me, &(), T),
        Err(RpcError::UnknownRpc { .. })
    ));
    // Registration errors.
    assert!(matches!(
        c.register::<Add>(|_| Ok(0)),
        Err(RpcError::Registration { .. })
    ));
    assert!(matches!(
        c.register::<AddWrongType>(|_| Ok(0)),
        Err(RpcError::Registration { .. })
    ));
    // The engine's own message: a handler there would never run, and
    // its callers would wait out their timeout.
    match c.register::<Reserved>(|()| Ok(())) {
        Err(RpcError::Registration { reason, .. }) => {
            assert!(reason.contains("keeps for itself"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(c.register_deferred::<Reserved>().is_err());
}

#[test]
fn server_killed_mid_call_fails_the_call_before_its_timeout() {
    let d = dir("kill");
    let mut srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    assert_eq!(c.call::<Add>(&s, &(1, 1), T).unwrap(), 2);
    // Several calls in flight (the server runs them one after another):
    // the peer's end must fail every one of them.
    let ids: Vec<_> = (0..3).map(|_| c.forward::<Sleep>(&s, &10_000).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    srv.child.kill().unwrap();
    let t0 = Instant::now();
    for id in ids {
        let r = loop {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "no error within 5 s of the kill"
            );
            if let Some(r) = c.take_response::<Sleep>(id) {
                break r;
            }
            c.progress(Some(Duration::from_millis(100))).unwrap();
            c.trigger().unwrap();
        };
        assert!(matches!(r, Err(RpcError::Transport(_))), "{r:?}");
    }
    assert_eq!(c.stats().in_flight, 0);
}

#[test]
fn hostile_input_gets_no_crash_and_the_server_keeps_serving() {
    let d = dir("hostile");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let mut good = Vec::new();
    hg_rpc::header::Header {
        flags: hg_rpc::header::FLAG_CHECKSUM,
        status: hg_rpc::header::Status::Ok,
        rpc_id: hg_rpc::rpc_id(Add::NAME),
        cookie: 7,
        payload_len: 0,
        checksum: 0,
    }
    .encode_with(&[1, 2], &mut good);
    let mut huge_len = good.clone();
    huge_len[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut bad_sum = good.clone();
    *bad_sum.last_mut().unwrap() ^= 1;
    let garbage: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"garbage".to_vec(),
        good[..20].to_vec(),
        huge_len,
        bad_sum,
        (0..4000u32).map(|i| (i * 7) as u8).collect(),
    ];
    for (i, g) in garbage.iter().enumerate() {
        c.endpoint()
            .send_unexpected(&s, 0, g, OpId(1 << 50 | i as u64))
            .unwrap();
    }
    assert_eq!(c.call::<Add>(&s, &(20, 22), T).unwrap(), 42);
    assert_eq!(c.call::<Echo>(&s, &vec![9; 1000], T).unwrap(), vec![9; 1000]);
}

#[test]
fn one_mib_arguments_spill_in_both_directions_and_one_way() {
    let d = dir("spill");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let blob: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 13 + i / 4096) as u8).collect();
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

/// 384,346 bytes of `byte(i)`, and the same split into five segments of
/// very different sizes (one of a single byte).
fn five_segments(byte: impl Fn(usize) -> u8) -> (Vec<u8>, Vec<Vec<u8>>) {
    let sizes = [1000usize, 70_000, 1, 300_000, 12_345];
    let data: Vec<u8> = (0..sizes.iter().sum::<usize>()).map(byte).collect();
    let mut segs = Vec::new();
    let mut at = 0;
    for n in sizes {
        segs.push(data[at..at + n].to_vec());
        at += n;
    }
    (data, segs)
}

#[test]
fn blobstore_bulk_push_pull_multi_segment_with_offsets() {
    use hg_rpc::{Bulk, BulkOp};
    use na_core::Access;
    let d = dir("blob");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let (data, segs) = five_segments(|i| (i * 7 + i / 1000) as u8);
    // Put: the server pulls from our five segments.
    let put = c.expose(segs, Access::ReadOnly).unwrap();
    assert_eq!(
        c.call::<BlobPut>(&s, &("k".into(), put.clone()), T).unwrap(),
        fnv(&data)
    );
    // A small read-only handle travels inline: no RMA needed to pull it.
    // Its data is read when it is sent: a change after exposing travels.
    let small = c.expose(vec![b"tiny blob".to_vec()], Access::ReadOnly).unwrap();
    small.local().unwrap().write_at(0, b"TINY").unwrap();
    assert!(small.desc().inline.is_some());
    assert_eq!(
        c.call::<BlobPut>(&s, &("t".into(), small.clone()), T).unwrap(),
        fnv(b"TINY blob")
    );
    // A pull from it inside this process sees the current bytes too.
    let copy = c.expose(vec![vec![0; 9]], Access::ReadWrite).unwrap();
    c.bulk(BulkOp::Pull, &small, 0, &copy, 0, 9, T).unwrap();
    assert_eq!(copy.local().unwrap().to_vec(), b"TINY blob");
    // Get: the server pushes into three segments of ours, at offset 100.
    let into = c
        .expose(
            vec![vec![0; 100_000], vec![0; 7], vec![0; 300_000]],
            Access::ReadWrite,
        )
        .unwrap();
    assert_eq!(
        c.call::<BlobGet>(&s, &("k".into(), into.clone(), 100), T)
            .unwrap(),
        data.len() as u64
    );
    let mut back = vec![0; data.len()];
    into.local().unwrap().read_at(100, &mut back).unwrap();
    assert!(back == data, "pushed data differs");
    // Out of bounds: the server's push fails and says so; it keeps serving.
    match c.call::<BlobGet>(&s, &("k".into(), into.clone(), 200_000), T) {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("out of bounds"), "{message}"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    // Client-driven partial transfers across segment boundaries (to ourselves).
    let src: Bulk = put;
    let dst = c
        .expose(vec![vec![0; 5000], vec![0; 5000]], Access::ReadWrite)
        .unwrap();
    let me_src: Bulk = postcard::from_bytes(&postcard::to_allocvec(&src).unwrap()).unwrap();
    c.bulk(BulkOp::Pull, &me_src, 900, &dst, 4000, 3000, T).unwrap();
    let mut got = vec![0; 3000];
    dst.local().unwrap().read_at(4000, &mut got).unwrap();
    assert_eq!(got, data[900..3900]);
    assert!(c
        .bulk(BulkOp::Pull, &me_src, data.len() as u64 - 10, &dst, 0, 11, T)
        .is_err());
    assert_eq!(c.call::<Add>(&s, &(1, 1), T).unwrap(), 2);
}

/// With two plugins of one scheme on the endpoint, an engine's bulk
/// transfers go through its own plugin (where `forget_bulk` cancels them),
/// not through whichever plugin of the scheme came first.
#[test]
fn bulk_transfers_go_through_the_engine_s_own_plugin() {
    use hg_rpc::{Bulk, BulkOp};
    use na_core::Access;
    let d = dir("twoplugins");
    let (mut ep, first) = endpoint(&d, true);
    let cfg = SmConfig {
        listen: true,
        ..SmConfig::default()
    }
    .with_dir(&*d);
    let second = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let mut c = Engine::new(ep, second).unwrap();
    let data: Vec<u8> = (0..50_000u32).map(|i| (i * 13 % 251) as u8).collect();
    let src = c.expose(vec![data.clone()], Access::ReadWrite).unwrap();
    // As received from a peer: only the descriptor (owner: our plugin).
    let src: Bulk = postcard::from_bytes(&postcard::to_allocvec(&src).unwrap()).unwrap();
    let dst = c.expose(vec![vec![0; data.len()]], Access::ReadWrite).unwrap();
    c.bulk(BulkOp::Pull, &src, 0, &dst, 0, data.len() as u64, T)
        .unwrap();
    assert!(dst.local().unwrap().to_vec() == data);
    let got = |c: &mut Engine, id| c.endpoint().plugin(id).unwrap().stats().get_bytes;
    assert_eq!(
        got(&mut c, first),
        0,
        "moved through the endpoint's first sm plugin"
    );
    assert_eq!(got(&mut c, second), data.len() as u64);
}

/// A handler moves data only with its caller: a client that sends another
/// process's handle cannot make the server pull from (or push into) that
/// process; the owner itself still can.
#[test]
fn a_handler_transfers_only_with_the_caller_s_handles() {
    use hg_rpc::Bulk;
    use na_core::Access;
    let d = dir("owner");
    let srv = Server::start(&d);
    let mut victim = client(&d);
    let mut other = client(&d);
    let s_v = victim.endpoint().lookup(&srv.uri).unwrap();
    let s_o = other.endpoint().lookup(&srv.uri).unwrap();
    // Large enough not to travel inline: a pull needs RMA with the owner.
    let data = vec![0x5au8; 64 * 1024];
    let theirs = victim.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    let stolen: Bulk = postcard::from_bytes(&postcard::to_allocvec(&theirs).unwrap()).unwrap();
    match other.call::<BlobPut>(&s_o, &("x".into(), stolen), T) {
        Err(RpcError::Handler { message, .. }) => {
            assert!(message.contains("not to the caller"), "{message}")
        }
        r => panic!("a third party's handle was used: {r:?}"),
    }
    // The owner's own call works, and the server kept serving.
    assert_eq!(
        victim.call::<BlobPut>(&s_v, &("x".into(), theirs), T).unwrap(),
        fnv(&data)
    );
    assert_eq!(other.call::<Add>(&s_o, &(2, 3), T).unwrap(), 5);
}

/// A handler's transfer that outlasts the engine's handler transfer
/// timeout (`Engine::set_handler_transfer_timeout`, 0 here: sm reports a
/// transfer's end at the next progress call) fails at once, saying so,
/// and the windows of spans after the one in flight are not started: the
/// server's transport read one window of the client's memory, not the
/// rest (the window's transfers are canceled and waited for before the
/// answer). The server goes on serving, and with no timeout
/// (`Duration::MAX`) the same call moves everything. Both engines in this process (the server's
/// transport stats are read here); the test peer's
/// `HG_TESTPEER_TRANSFER_TIMEOUT_MS` is refused when it is not a number.
#[test]
fn a_handler_transfer_past_its_timeout_fails_and_starts_no_more_windows() {
    use hg_rpc::{BulkOp, Span, BATCH_WINDOW};
    use na_core::Access;
    let d = dir("transfer-timeout");
    let (ep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(ep, sid).unwrap();
    srv.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    srv.register_with_bulk::<BlobPutChunked>(|ctx, (_key, data, chunk)| {
        let size = data.size();
        let local = ctx.expose(vec![vec![0; size as usize]], Access::ReadWrite)?;
        let spans: Vec<Span> = (0..size.div_ceil(chunk))
            .map(|i| Span {
                remote_offset: i * chunk,
                local_offset: i * chunk,
                len: chunk.min(size - i * chunk),
            })
            .collect();
        ctx.transfer_batch(BulkOp::Pull, &data, &local, &spans)?;
        Ok(fnv(&local.local().ok_or("not local")?.to_vec()))
    })
    .unwrap();
    srv.set_handler_transfer_timeout(Duration::ZERO);
    let mut c = client(&d);
    let read = |srv: &mut Engine| {
        let ep = srv.endpoint();
        let id = ep.plugin_ids().next().expect("one plugin");
        ep.plugin(id).expect("plugin").stats().get_bytes
    };
    let spans = 2500u64;
    assert!(spans > 2 * BATCH_WINDOW as u64 && spans < 3 * BATCH_WINDOW as u64);
    let data: Vec<u8> = (0..spans as usize * 64).map(|i| (i * 31 + 7) as u8).collect();
    let put = c.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    let before = read(&mut srv);
    match call_both::<BlobPutChunked>(&mut c, &mut srv, &("k".into(), put.clone(), 64)) {
        Err(RpcError::Handler { message, .. }) => assert!(
            message.contains(&format!(
                "of {BATCH_WINDOW} bulk transfers did not finish within 0ns"
            )) && message.ends_with(&format!(
                "{} later spans were not started",
                spans - BATCH_WINDOW as u64
            )),
            "{message}"
        ),
        other => panic!("expected the handler's timeout, got {other:?}"),
    }
    // Nothing of the later windows moves, then or later.
    for i in 0..20u64 {
        assert_eq!(call_both::<Add>(&mut c, &mut srv, &(i, 1)).unwrap(), i + 1);
    }
    assert_eq!(
        read(&mut srv) - before,
        BATCH_WINDOW as u64 * 64,
        "one window was read"
    );
    // No limit at all (a deadline far away, not an overflow).
    srv.set_handler_transfer_timeout(Duration::MAX);
    assert_eq!(
        call_both::<BlobPutChunked>(&mut c, &mut srv, &("k".into(), put, 64)).unwrap(),
        fnv(&data)
    );
    assert_refused_at_start(&d, "HG_TESTPEER_TRANSFER_TIMEOUT_MS", "soon", "invalid digit");
}

/// Batches of spans: the server pulls a five-segment handle in 4 KiB (and
/// odd-sized, and 100-byte: several windows) chunks, last chunk first; the client
/// starts a batch of spans with offsets into its own handle; a batch with
/// one span out of bounds starts nothing.
#[test]
fn bulk_batches_of_spans_on_both_sides() {
    use hg_rpc::{Bulk, BulkOp, Span};
    use na_core::Access;
    let d = dir("batch");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let (data, segs) = five_segments(|i| (i * 11 + i / 4096) as u8);
    let put = c.expose(segs, Access::ReadOnly).unwrap();
    let na_stats = |c: &mut Engine| {
        let ep = c.endpoint();
        let id = ep.plugin_ids().next().expect("one plugin");
        ep.plugin(id).expect("plugin").stats()
    };
    let before = na_stats(&mut c);
    // 100-byte chunks: 3,844 spans, more than one window (BATCH_WINDOW).
    for chunk in [4096u64, 777, 1 << 20, 100] {
        let key = format!("c{chunk}");
        let got = c
            .call::<BlobPutChunked>(&s, &(key, put.clone(), chunk), T)
            .unwrap();
        assert_eq!(got, fnv(&data), "chunk {chunk}");
    }
    match c.call::<BlobPutChunked>(&s, &("z".into(), put.clone(), 0), T) {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("chunk size 0"), "{message}"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    // The server read our memory; we moved nothing ourselves.
    let after = na_stats(&mut c);
    assert_eq!(after.get_bytes, before.get_bytes);

    // Client side: spans of a handle of ours, reversed into another.
    let src: Bulk = postcard::from_bytes(&postcard::to_allocvec(&put).unwrap()).unwrap();
    let dst = c
        .expose(vec![vec![0; 50_000], vec![0; 50_000]], Access::ReadWrite)
        .unwrap();
    let spans: Vec<Span> = (0..10u64)
        .map(|i| Span {
            remote_offset: 900 + i * 9000,
            local_offset: 90_000 - i * 10_000,
            len: 9000,
        })
        .collect();
    let ids = c.bulk_start_batch(BulkOp::Pull, &src, &dst, &spans).unwrap();
    assert_eq!(ids.len(), 10);
    // `src` came back through serde, so it is a remote handle (our own
    // address): real RMA, through the plugin's connection to itself.
    let end = Instant::now() + T;
    for id in &ids {
        let r = loop {
            if let Some(r) = c.take_bulk(*id) {
                break r;
            }
            assert!(Instant::now() < end, "batch did not finish");
            c.progress(Some(Duration::from_millis(10))).unwrap();
            c.trigger().unwrap();
        };
        r.unwrap();
    }
    assert_eq!(na_stats(&mut c).get_bytes - after.get_bytes, 90_000);
    for sp in &spans {
        let mut got = vec![0; sp.len as usize];
        dst.local().unwrap().read_at(sp.local_offset, &mut got).unwrap();
        let r = sp.remote_offset as usize;
        assert_eq!(got, data[r..r + sp.len as usize]);
    }
    let moved = na_stats(&mut c).get_bytes;
    let beyond = Span {
        remote_offset: data.len() as u64 - 5000,
        ..spans[9]
    };
    assert!(c
        .bulk_start_batch(BulkOp::Pull, &src, &dst, &[spans[0], beyond])
        .is_err());
    c.progress(Some(Duration::from_millis(20))).unwrap();
    c.trigger().unwrap();
    assert_eq!(na_stats(&mut c).get_bytes, moved, "a refused batch moves nothing");
    assert_eq!(c.call::<Add>(&s, &(1, 1), T).unwrap(), 2);
}

/// Several contexts: the server runs three engines (threads, one address
/// each), the client two (threads); every client context calls every
/// server context concurrently and each response reaches the context that
/// made the call.
#[test]
fn several_contexts_on_both_sides() {
    let d = dir("contexts");
    let mut child = common::testpeer()
        .env("QS_SM_DIR", &d)
        .env("HG_TESTPEER_CONTEXTS", "3")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut uris = Vec::new();
    for _ in 0..3 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let (ctx, uri) = match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["CTX", i, uri] => (i.parse::<u64>().unwrap(), uri.to_owned()),
            ["ADDR", uri] => (0, uri.to_owned()),
            _ => panic!("unexpected line {line:?}"),
        };
        uris.push((ctx, uri));
    }
    let _srv = Server {
        child,
        uri: uris[2].1.clone(),
    };
    let threads: Vec<_> = (0..2u64)
        .map(|me| {
            let (d, uris) = (d.to_path_buf(), uris.clone());
            std::thread::spawn(move || {
                let mut c = client(&d);
                for round in 0..200u64 {
                    for (want, uri) in &uris {
                        let s = c.endpoint().lookup(uri).unwrap();
                        let token = me * 1_000_000 + round;
                        let (ctx, echoed) = c.call::<WhoAmI>(&s, &token, T).unwrap();
                        assert_eq!(echoed, token, "a response reached the wrong origin context");
                        assert_eq!(ctx, *want, "the call ran in the wrong target context");
                    }
                }
                c.stats().calls
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), 600);
    }
}

#[test]
fn a_bad_receive_mode_variable_is_a_clear_error_at_start() {
    for (value, why) in [
        ("pulled", "expected pull or posted"),
        ("", "expected pull or posted"),
    ] {
        let d = dir("bad-recv-mode");
        assert_refused_at_start(&d, hg_rpc::engine::RECV_MODE_ENV, value, why);
    }
    // Both valid values start a server that answers.
    for value in ["pull", "posted"] {
        let d = dir(&format!("recv-mode-{value}"));
        let server = Server::with_envs(&[
            ("QS_SM_DIR", d.as_os_str()),
            (hg_rpc::engine::RECV_MODE_ENV, value.as_ref()),
        ]);
        let mut c = client(&d);
        let s = c.endpoint().lookup(&server.uri).unwrap();
        assert_eq!(
            c.call::<Add>(&s, &(2, 3), T).unwrap(),
            5,
            "server in {value} mode"
        );
    }
}

/// Spilled requests arriving together may not make the target commit more
/// than its pull budget: beyond it, a request is answered with a decode
/// error that says so, and once the pulls in flight are done the next one
/// is served.
#[test]
fn spilled_pulls_beyond_the_budget_are_refused_with_a_clear_error() {
    use hg_rpc::header::{Header, Status};

    let d = dir("pull-budget");
    let (sep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(sep, sid).unwrap();
    srv.register::<Digest>(|v| Ok((v.len() as u64, v.iter().map(|&b| u64::from(b)).sum())))
        .unwrap();
    const LEN: u64 = 64 << 10;
    srv.set_max_pull_bytes(LEN + LEN / 2);
    // A raw client whose memory holds the spilled inputs (real pulls).
    let (mut ep, cid) = endpoint(&d, false);
    let s = ep.lookup(srv.self_addr().uri()).unwrap();
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
    use hg_rpc::header::{crc32c, Header, Status};

    let d = dir("spill-crc-in");
    let (sep, sid) = endpoint(&d, true);
    let mut srv = Engine::new(sep, sid).unwrap();
    srv.register::<Digest>(|v| Ok((v.len() as u64, v.iter().map(|&b| u64::from(b)).sum())))
        .unwrap();
    let (mut ep, cid) = endpoint(&d, false);
    let s = ep.lookup(srv.self_addr().uri()).unwrap();
    let input = postcard::to_allocvec(&vec![1u8; 64 << 10]).unwrap();
    let mem = common::sealed(input.clone());
    ep.plugin_mut(cid).unwrap().mem_register(&mem).unwrap();
    let desc = ep.plugin(cid).unwrap().mem_describe(&mem).unwrap().to_bytes();
    let good = crc32c(&input);
    for (cookie, crc) in [(1u64, good ^ 0x10), (2, good)] {
        let msg = spilled_digest_request(cookie, input.len() as u64, &desc, crc);
        ep.post_recv_unexpected(cid, Vec::new(), OpId(cookie)).unwrap();
        ep.send_unexpected(&s, 0, &msg, OpId(100 + cookie)).unwrap();
        let end = Instant::now() + T;
        let (h, p) = loop {
            assert!(Instant::now() < end, "no reply to {cookie}");
            ep.progress(Some(Duration::from_millis(1))).unwrap();
            srv.progress(Some(Duration::from_millis(1))).unwrap();
            srv.trigger().unwrap();
            let done = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == OpId(cookie));
            if let Some(buf) = done.and_then(|c| c.buf) {
                let (h, p) = Header::decode(&buf).unwrap();
                break (h, p.to_vec());
            }
        };
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
