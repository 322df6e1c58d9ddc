//! Bulk transfers with a separate server process (`hg-rpc-testpeer`)
//! over na-sm: pushes and pulls across segments at offsets, through the
//! engine's own plugin, a handler's caller-only rule and transfer
//! timeout, and batches of spans on both sides.

use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError};
use na_core::Plugin;
use na_sm::{SmConfig, SmPlugin};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{assert_refused_at_start, call_both, client, dir, endpoint, Server};

const T: Duration = Duration::from_secs(10);
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

/// A handle's size is its sender's word: a client that sends a
/// descriptor of its own address claiming 4 EiB (or just more than the
/// server stores) gets an error before the server allocates anything,
/// and the server goes on serving. (The test server allocated the whole
/// claimed size first, and the allocation failure aborted it.) So does
/// a chunk size that would list millions of spans.
#[test]
fn a_handle_claiming_a_huge_size_is_refused_before_anything_is_allocated() {
    use hg_rpc::{Bulk, BulkDesc};
    use na_core::{Access, RemoteMem, RemoteSegment};
    let d = dir("huge-handle");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    for claimed in [1u64 << 62, (64 << 20) + 1] {
        let mem = RemoteMem::new(
            vec![RemoteSegment {
                addr: 4096,
                len: claimed,
                key: 0,
            }],
            Access::ReadOnly,
        )
        .unwrap();
        let forged = Bulk::from_desc(BulkDesc {
            owner: c.self_addr().uri().to_owned(),
            mem: serde_bytes::ByteBuf::from(mem.to_bytes()),
            inline: None,
        })
        .unwrap();
        for call in [
            c.call::<BlobPut>(&s, &("huge".into(), forged.clone()), T),
            c.call::<BlobPutChunked>(&s, &("huge".into(), forged, 1 << 20), T),
        ] {
            match call {
                Err(RpcError::Handler { message, .. }) => {
                    assert!(message.contains("at most"), "{message}")
                }
                other => panic!("a {claimed}-byte handle was not refused: {other:?}"),
            }
        }
    }
    // A size within the bound in chunks of one byte: four million spans
    // (96 MiB to list, then a transfer of each), refused first too.
    let mem = RemoteMem::new(
        vec![RemoteSegment {
            addr: 4096,
            len: 4 << 20,
            key: 0,
        }],
        Access::ReadOnly,
    )
    .unwrap();
    let forged = Bulk::from_desc(BulkDesc {
        owner: c.self_addr().uri().to_owned(),
        mem: serde_bytes::ByteBuf::from(mem.to_bytes()),
        inline: None,
    })
    .unwrap();
    match c.call::<BlobPutChunked>(&s, &("tiny chunks".into(), forged, 1), T) {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("chunks"), "{message}"),
        other => panic!("four million one-byte chunks were not refused: {other:?}"),
    }
    assert_eq!(c.call::<Add>(&s, &(2, 3), T).unwrap(), 5);
}

/// The peak resident memory of process `pid`, in KiB (`VmHWM`).
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The segment size of `BlobExpose` is the client's word too: a 4 MiB
/// blob in one-byte segments (four million, where a handle names at
/// most 65,536) is refused before a vector is made for each segment,
/// which took the test server's memory up by about 56 bytes per byte of
/// blob before `expose` refused the count.
#[test]
fn a_blob_exposed_in_more_segments_than_a_handle_names_is_refused_first() {
    use na_core::Access;
    let d = dir("expose-segments");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let data = vec![3u8; 4 << 20];
    let put = c.expose(vec![data.clone()], Access::ReadOnly).unwrap();
    assert_eq!(c.call::<BlobPut>(&s, &("b".into(), put), T).unwrap(), fnv(&data));
    let before = peak_rss_kib(srv.child.id());
    match c.call::<BlobExpose>(&s, &("b".into(), 1), T) {
        Err(RpcError::Handler { message, .. }) => {
            assert!(message.contains("at most 65536 segments"), "{message}")
        }
        other => panic!("four million segments were not refused: {other:?}"),
    }
    let grew = peak_rss_kib(srv.child.id()) - before;
    assert!(grew < 32 << 10, "the server's peak memory grew by {grew} KiB");
    // Still serving, and a sensible segment size works.
    let remote = c.call::<BlobExpose>(&s, &("b".into(), 1 << 20), T).unwrap();
    assert_eq!(remote.size(), data.len() as u64);
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
        // `BulkCtx` fails as `Engine::bulk` does: `RpcError::Timeout`.
        Err(RpcError::Handler { message, .. }) => {
            assert_eq!(message, "bulk transfer timed out after 0 ms", "{message}")
        }
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

/// A handler that `?`s a transfer's transport error (its `String` error
/// made by `From<RpcError> for String`) gives its caller the whole
/// chain: the caller sees only that text, and "transport error" alone
/// would not say why. Here the server pulls from a handle of ours whose
/// segment nothing maps: na-sm's EFAULT hint must arrive.
#[test]
fn a_handlers_transport_error_reaches_its_caller_with_its_cause() {
    use hg_rpc::{Bulk, BulkDesc};
    use na_core::{Access, RemoteMem, RemoteSegment};
    let d = dir("handler-chain");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.lookup(&srv.uri).unwrap();
    // Our own handle's descriptor, its one segment moved to an address
    // nothing maps in this process.
    let real = c.expose(vec![vec![7; 4096]], Access::ReadOnly).unwrap();
    let desc = real.desc().into_owned();
    let key = RemoteMem::from_bytes(&desc.mem).unwrap().segments()[0].key;
    let mem = RemoteMem::new(
        vec![RemoteSegment {
            addr: 0x1000,
            len: 4096,
            key,
        }],
        Access::ReadOnly,
    )
    .unwrap()
    .to_bytes();
    let forged = Bulk::from_desc(BulkDesc {
        owner: desc.owner.clone(),
        mem: serde_bytes::ByteBuf::from(mem),
        inline: None,
    })
    .unwrap();
    match c.call::<BlobPut>(&s, &("unmapped".into(), forged), T) {
        Err(RpcError::Handler { message, .. }) => assert!(
            message.starts_with("transport error: RMA get of 4096 bytes")
                && message.contains("an address of the remote handle is not mapped"),
            "{message}"
        ),
        other => panic!("expected the handler's transport error, got {other:?}"),
    }
    // It serves on.
    assert_eq!(c.call::<Add>(&s, &(2, 3), T).unwrap(), 5);
}
