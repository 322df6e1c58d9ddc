//! Put and get against a peer process: contiguous and multi-segment on
//! both sides, initiated from either side; bounds, access and forged
//! descriptor errors.

use std::time::Duration;

use na_core::{Access, Addr, MemHandle, NaError, OpKind, ProgressMode, RemoteMem, RemoteSegment};

use crate::{pattern, pattern2, Node, PeerProc, Transport};

/// Asks the server to expose a handle of `segs`; its descriptor.
pub(crate) fn expose(n: &mut Node, server: &Addr, segs: &[u32]) -> RemoteMem {
    let mut cmd = vec![b'm'];
    for s in segs {
        cmd.extend_from_slice(&s.to_le_bytes());
    }
    RemoteMem::from_bytes(&n.request(server, 1, &cmd)).expect("descriptor from the server")
}

/// Whether the server's exposed handle holds `pattern2(seed)` over the range.
fn check_remote(n: &mut Node, server: &Addr, off: u64, len: u64, seed: u8) -> bool {
    let mut cmd = vec![b'c'];
    cmd.extend_from_slice(&off.to_le_bytes());
    cmd.extend_from_slice(&len.to_le_bytes());
    cmd.push(seed);
    n.request(server, 2, &cmd) == [1]
}

/// Asks the server to put (`dir` 1) or get (0) between its handle and ours.
fn server_rma(n: &mut Node, server: &Addr, dir: u8, ro: u64, lo: u64, len: u64, mine: &RemoteMem) -> bool {
    let mut cmd = vec![b'x', dir];
    for v in [ro, lo, len] {
        cmd.extend_from_slice(&v.to_le_bytes());
    }
    cmd.extend_from_slice(&mine.to_bytes());
    n.request(server, 3, &cmd) == [1]
}

/// One RMA from us, waited for; must succeed.
struct Rma<'a> {
    local: &'a MemHandle,
    lo: u64,
    remote: &'a RemoteMem,
    ro: u64,
    len: u64,
}

fn rma(n: &mut Node, put: bool, r: &Rma<'_>, dest: &Addr) {
    let op = n.op();
    let posted = if put {
        n.ep.put(r.local, r.lo, r.remote, r.ro, r.len, dest, op)
    } else {
        n.ep.get(r.local, r.lo, r.remote, r.ro, r.len, dest, op)
    };
    posted.expect("post RMA");
    let c = n.wait(op);
    assert_eq!(c.kind, if put { OpKind::Put } else { OpKind::Get });
    c.status.expect("RMA");
}

/// A descriptor of memory the peer never exposed (an address below
/// `vm.mmap_min_addr`, a key it never issued).
fn forged() -> RemoteMem {
    let seg = RemoteSegment {
        addr: 0x10,
        len: 4096,
        key: 0x5eed,
    };
    RemoteMem::new(vec![seg], Access::ReadWrite).expect("descriptor")
}

fn segmented(lens: impl Iterator<Item = usize>) -> MemHandle {
    MemHandle::new(lens.map(|l| vec![0u8; l]).collect(), Access::ReadWrite)
}

/// One layout: the server's segments, our handle, offsets and length.
struct Layout<'a> {
    remote_segs: &'a [u32],
    local: MemHandle,
    lo: u64,
    ro: u64,
    len: u64,
    seed: u8,
}

/// One layout: the server puts, we get, we put, the server gets.
fn exercise(n: &mut Node, server: &Addr, l: Layout<'_>) {
    let Layout {
        remote_segs,
        local,
        lo,
        ro,
        len,
        seed,
    } = l;
    let remote = expose(n, server, remote_segs);
    assert_eq!(remote.segments().len(), remote_segs.len());
    let plugin = n.ep.plugin_mut(n.id).expect("plugin");
    plugin.mem_register(&local).expect("register");
    let mine = plugin.mem_describe(&local).expect("describe");
    // Registering again keeps the descriptor handed out valid (a peer may
    // hold it already).
    plugin.mem_register(&local).expect("register again");
    let expect_pattern = |local: &MemHandle, what: &str| {
        let mut got = vec![0u8; len as usize];
        local.read_at(lo, &mut got).expect("read back");
        let bad = got
            .iter()
            .enumerate()
            .position(|(i, b)| *b != pattern(ro + i as u64));
        assert!(bad.is_none(), "{what}: first wrong byte at {bad:?} of {len}");
    };
    assert!(server_rma(n, server, 1, ro, lo, len, &mine), "server-side put");
    expect_pattern(&local, "server put");
    local.write_at(lo, &vec![0u8; len as usize]).expect("clear");
    let r = Rma {
        local: &local,
        lo,
        remote: &remote,
        ro,
        len,
    };
    rma(n, false, &r, server);
    expect_pattern(&local, "get");
    let data: Vec<u8> = (0..len).map(|i| pattern2(seed, i)).collect();
    local.write_at(lo, &data).expect("fill");
    rma(n, true, &r, server);
    assert!(check_remote(n, server, ro, len, seed), "put");
    let data: Vec<u8> = (0..len).map(|i| pattern2(seed ^ 1, i)).collect();
    local.write_at(lo, &data).expect("fill");
    assert!(server_rma(n, server, 0, ro, lo, len, &mine), "server-side get");
    assert!(check_remote(n, server, ro, len, seed ^ 1), "server get");
}

/// Contiguous and 16-segment handles on both sides, with offsets that cross
/// segment boundaries, both directions, initiated from both sides.
pub fn put_get(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    let remote_segs: Vec<u32> = (0..16).map(|i| 3000 + i * 517).collect();
    let layouts = [
        // Contiguous on both sides, with offsets.
        (
            &[262_144][..],
            MemHandle::zeroed(300_000, Access::ReadWrite),
            1000,
            777,
            200_000,
            5,
        ),
        // 16 segments on both sides, with different splits.
        (
            &remote_segs[..],
            segmented((0..16).map(|i| 9001 - i * 311)),
            33,
            57,
            100_000,
            9,
        ),
        // 16 local segments against one remote, and the reverse.
        (
            &[40_000][..],
            segmented((0..16).map(|i| 1024 + i * 64)),
            100,
            3,
            20_000,
            11,
        ),
        (
            &remote_segs[..],
            MemHandle::zeroed(50_000, Access::ReadWrite),
            0,
            2999,
            40_000,
            13,
        ),
    ];
    for (remote_segs, local, lo, ro, len, seed) in layouts {
        let layout = Layout {
            remote_segs,
            local,
            lo,
            ro,
            len,
            seed,
        };
        exercise(&mut n, &addr, layout);
    }
    let st = n.stats();
    assert!(st.put_bytes >= 360_000 && st.get_bytes >= 360_000, "{st:?}");
}

/// Out-of-bounds ranges and access modes are refused at post time and
/// start nothing; a forged descriptor fails with an error completion.
pub fn errors(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    let remote = expose(&mut n, &addr, &[1000, 1000]);
    let local = MemHandle::zeroed(4096, Access::ReadWrite);
    let op = n.op();
    let e =
        n.ep.put(&local, 0, &remote, 1500, 501, &addr, op)
            .expect_err("remote bounds");
    assert!(matches!(e, NaError::OutOfBounds { what: "remote", .. }), "{e}");
    let e =
        n.ep.get(&local, 4000, &remote, 0, 100, &addr, op)
            .expect_err("local bounds");
    assert!(matches!(e, NaError::OutOfBounds { what: "local", .. }), "{e}");
    let e =
        n.ep.get(&local, 0, &remote, u64::MAX, 2, &addr, op)
            .expect_err("overflow");
    assert!(matches!(e, NaError::OutOfBounds { .. }), "{e}");
    let ro_local = MemHandle::zeroed(100, Access::ReadOnly);
    let e =
        n.ep.get(&ro_local, 0, &remote, 0, 10, &addr, op)
            .expect_err("read-only local");
    assert!(matches!(e, NaError::AccessDenied { what: "local", .. }), "{e}");
    let ro_remote = RemoteMem::new(remote.segments().to_vec(), Access::ReadOnly).expect("descriptor");
    let e =
        n.ep.put(&local, 0, &ro_remote, 0, 10, &addr, op)
            .expect_err("read-only remote");
    assert!(matches!(e, NaError::AccessDenied { what: "remote", .. }), "{e}");
    n.pump(Duration::from_millis(20));
    assert!(!n.stash.contains_key(&op), "refused posts complete nothing");
    // A forged descriptor (an address the peer never exposed, a key it
    // never issued) fails remotely: an error completion, never a hang.
    let forged = forged();
    n.ep.get(&local, 0, &forged, 0, 4096, &addr, op)
        .expect("post forged get");
    let e = n.wait(op).status.expect_err("a forged descriptor must fail");
    assert!(matches!(e, NaError::Rma { .. } | NaError::PeerGone { .. }), "{e}");
    eprintln!("{}: forged descriptor: {e}", t.name);
    if t.keeps_connection_after_rma_error {
        assert_eq!(n.request(&addr, 5, b"estill-there"), b"estill-there");
    } else {
        // The connection is gone with the failed RMA; a new lookup of the
        // same peer reconnects.
        let addr = n.ep.lookup(&server.uri).expect("lookup again");
        assert_eq!(n.request(&addr, 5, b"estill-there"), b"estill-there");
    }
}

/// Waits for every op of a batch; each must complete exactly once, with
/// the batch's kind for its direction. Returns the statuses in batch order.
fn wait_batch(n: &mut Node, batch: &[na_core::Rma<'_>]) -> Vec<Result<(), NaError>> {
    let out: Vec<_> = batch
        .iter()
        .map(|r| {
            let c = n.wait(r.op);
            assert_eq!(c.kind, r.dir.kind(), "op {:?}", r.op);
            c.status
        })
        .collect();
    n.pump(Duration::from_millis(20));
    for r in batch {
        assert!(!n.stash.contains_key(&r.op), "op {:?} completed twice", r.op);
    }
    out
}

/// Batches ([`Plugin::rma`](na_core::Plugin::rma)): 64 gets of different
/// sizes across a 16-segment remote handle and a 16-segment local one in
/// one call, then puts and gets interleaved in one batch; every transfer
/// completes once with the right bytes. A batch with one out-of-bounds
/// transfer is refused whole. A forged transfer in the middle of a batch
/// fails; on a transport whose connections survive a failed RMA the others
/// succeed around it.
pub fn batches(t: &Transport) {
    let server = PeerProc::spawn(t, &["server"]);
    let mut n = Node::new(t, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).expect("lookup");
    let remote_segs: Vec<u32> = (0..16).map(|i| 3000 + i * 517).collect();
    let remote = expose(&mut n, &addr, &remote_segs);
    let local = segmented((0..16).map(|i| 7001 + i * 123));
    let plugin = n.ep.plugin_mut(n.id).expect("plugin");
    plugin.mem_register(&local).expect("register");
    let before = n.stats();

    // 64 gets; transfer 5 is empty.
    let len_of = |k: u64| if k == 5 { 0 } else { 1 + (k * 389) % 1699 };
    let gets: Vec<na_core::Rma> = (0..64u64)
        .map(|k| na_core::Rma::get(&local, k * 1900, &remote, k * 1700, len_of(k), n.op()))
        .collect();
    n.ep.rma(&addr, &gets).expect("post 64 gets");
    for (k, s) in wait_batch(&mut n, &gets).into_iter().enumerate() {
        s.unwrap_or_else(|e| panic!("get {k}: {e}"));
        let k = k as u64;
        let mut got = vec![0u8; len_of(k) as usize];
        local.read_at(k * 1900, &mut got).expect("read back");
        let bad = (0..got.len()).position(|i| got[i] != pattern(k * 1700 + i as u64));
        assert!(bad.is_none(), "get {k}: first wrong byte at {bad:?}");
    }
    let after = n.stats();
    let moved: u64 = (0..64).map(len_of).sum();
    assert_eq!(after.get_bytes - before.get_bytes, moved, "{after:?}");
    let calls = after.rma_calls - before.rma_calls;
    assert!(calls >= 1, "{after:?}");
    if t.merges_rma_batches {
        // na-sm: one system call; na-verbs: linked work requests, one
        // ibv_post_send per up to 64 (a get may need several).
        assert!(calls <= 4, "64 gets in one batch took {calls} calls");
    }

    // Puts and gets interleaved: puts to even regions, gets from odd ones.
    let mut batch = Vec::new();
    for i in 0..32u64 {
        let (lo, ro, len) = (i * 3900, i * 3400, 1000 + i * 23);
        if i % 2 == 0 {
            let data: Vec<u8> = (0..len).map(|j| pattern2(i as u8, j)).collect();
            local.write_at(lo, &data).expect("fill");
            batch.push(na_core::Rma::put(&local, lo, &remote, ro, len, n.op()));
        } else {
            batch.push(na_core::Rma::get(&local, lo, &remote, ro, len, n.op()));
        }
    }
    n.ep.rma(&addr, &batch).expect("post a mixed batch");
    for (i, s) in wait_batch(&mut n, &batch).into_iter().enumerate() {
        s.unwrap_or_else(|e| panic!("transfer {i}: {e}"));
    }
    for i in 0..32u64 {
        let (lo, ro, len) = (i * 3900, i * 3400, 1000 + i * 23);
        if i % 2 == 0 {
            assert!(check_remote(&mut n, &addr, ro, len, i as u8), "put {i}");
        } else {
            let mut got = vec![0u8; len as usize];
            local.read_at(lo, &mut got).expect("read back");
            assert!(
                (0..got.len()).all(|j| got[j] == pattern(ro + j as u64)),
                "get {i}"
            );
        }
    }

    // One transfer out of bounds: nothing starts.
    let refused = [
        na_core::Rma::get(&local, 0, &remote, 0, 100, n.op()),
        na_core::Rma::put(&local, 0, &remote, 110_000, 100, n.op()),
    ];
    let e = n.ep.rma(&addr, &refused).expect_err("out of bounds");
    assert!(matches!(e, NaError::OutOfBounds { what: "remote", .. }), "{e}");
    n.pump(Duration::from_millis(20));
    assert!(
        refused.iter().all(|r| !n.stash.contains_key(&r.op)),
        "a refused batch starts nothing"
    );

    // A forged transfer between two honest ones.
    let forged = forged();
    // (Remote 3500.. and 10300.. lie in regions no put above touched.)
    local.write_at(0, &[0u8; 3000]).expect("clear");
    let mixed = [
        na_core::Rma::get(&local, 0, &remote, 3500, 1000, n.op()),
        na_core::Rma::get(&local, 1000, &forged, 0, 1000, n.op()),
        na_core::Rma::get(&local, 2000, &remote, 10_300, 1000, n.op()),
    ];
    n.ep.rma(&addr, &mixed).expect("post");
    let st = wait_batch(&mut n, &mixed);
    assert!(st[1].is_err(), "the forged transfer must fail");
    if t.keeps_connection_after_rma_error {
        for (k, ro) in [(0usize, 3500u64), (2, 10_300)] {
            assert!(
                st[k].is_ok(),
                "transfer {k} must not fail with its neighbour: {:?}",
                st[k]
            );
            let mut got = vec![0u8; 1000];
            local.read_at(k as u64 * 1000, &mut got).expect("read back");
            assert!(
                (0..1000).all(|j| got[j] == pattern(ro + j as u64)),
                "transfer {k}"
            );
        }
        assert_eq!(n.request(&addr, 5, b"estill-there"), b"estill-there");
    } else {
        let addr = n.ep.lookup(&server.uri).expect("lookup again");
        assert_eq!(n.request(&addr, 5, b"estill-there"), b"estill-there");
    }

    // The server is killed: a batch larger than one window (IOV_MAX) is
    // refused at once, or every transfer in it completes, exactly once,
    // with an error (never a hang, never a success).
    let mut server = server;
    server.kill();
    let big: Vec<na_core::Rma> = (0..3000u64)
        .map(|k| na_core::Rma::get(&local, k * 40, &remote, k * 30, 20, n.op()))
        .collect();
    let addr = n.ep.lookup(&server.uri).unwrap_or(addr);
    match n.ep.rma(&addr, &big) {
        Err(e) => eprintln!("{}: batch to a killed peer refused: {e}", t.name),
        Ok(()) => {
            let st = wait_batch(&mut n, &big);
            assert!(
                st.iter().all(|s| s.is_err()),
                "a transfer from a killed peer succeeded"
            );
            eprintln!(
                "{}: batch to a killed peer: {}",
                t.name,
                st[0].as_ref().unwrap_err()
            );
        }
    }
}
