//! Put and get through CMA against a real peer process: contiguous and 16
//! segments on both sides with different splits and offsets, initiated from
//! either side; bounds, access and bad-address errors.

use std::time::Duration;

use na_core::{Access, Addr, MemHandle, NaError, OpKind, ProgressMode, RemoteMem, RemoteSegment};

use crate::common::{test_dir, Node, PeerProc};

const T: Duration = Duration::from_secs(10);

fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(7) + 3) as u8
}

fn pattern2(seed: u8, i: u64) -> u8 {
    (i.wrapping_mul(13) as u8) ^ seed
}

fn expose(n: &mut Node, server: &Addr, segs: &[u32]) -> RemoteMem {
    let mut cmd = vec![b'm'];
    for s in segs {
        cmd.extend_from_slice(&s.to_le_bytes());
    }
    RemoteMem::from_bytes(&n.request(server, 1, &cmd)).unwrap()
}

fn check_remote(n: &mut Node, server: &Addr, off: u64, len: u64, seed: u8) -> bool {
    let mut cmd = vec![b'c'];
    cmd.extend_from_slice(&off.to_le_bytes());
    cmd.extend_from_slice(&len.to_le_bytes());
    cmd.push(seed);
    n.request(server, 2, &cmd) == [1]
}

#[allow(clippy::too_many_arguments)]
fn rma(
    n: &mut Node,
    put: bool,
    local: &MemHandle,
    lo: u64,
    remote: &RemoteMem,
    ro: u64,
    len: u64,
    dest: &Addr,
) {
    let op = n.op();
    if put {
        n.ep.put(local, lo, remote, ro, len, dest, op).unwrap();
    } else {
        n.ep.get(local, lo, remote, ro, len, dest, op).unwrap();
    }
    let c = n.wait(op, T);
    assert_eq!(c.kind, if put { OpKind::Put } else { OpKind::Get });
    c.status.unwrap();
}

fn segmented(lens: impl Iterator<Item = usize>, access: Access) -> MemHandle {
    MemHandle::new(lens.map(|l| vec![0u8; l]).collect(), access)
}

/// One layout pair: get, put, and the server doing get and put on our memory.
#[allow(clippy::too_many_arguments)]
fn exercise(
    n: &mut Node,
    server: &Addr,
    remote_segs: &[u32],
    local: MemHandle,
    lo: u64,
    ro: u64,
    len: u64,
    seed: u8,
) {
    let remote = expose(n, server, remote_segs);
    assert_eq!(remote.segments().len(), remote_segs.len());
    // Server puts its pattern into our memory (server-initiated CMA).
    let mine = n.ep.plugin(n.id).unwrap().mem_describe(&local).unwrap();
    let mut cmd = vec![b'x', 1];
    for v in [ro, lo, len] {
        cmd.extend_from_slice(&v.to_le_bytes());
    }
    cmd.extend_from_slice(&mine.to_bytes());
    assert_eq!(n.request(server, 3, &cmd), [1], "server-side put");
    let mut got = vec![0u8; len as usize];
    local.read_at(lo, &mut got).unwrap();
    assert!(
        got.iter().enumerate().all(|(i, b)| *b == pattern(ro + i as u64)),
        "server put"
    );
    // We get from the server.
    local.write_at(lo, &vec![0u8; len as usize]).unwrap();
    rma(n, false, &local, lo, &remote, ro, len, server);
    local.read_at(lo, &mut got).unwrap();
    assert!(
        got.iter().enumerate().all(|(i, b)| *b == pattern(ro + i as u64)),
        "get"
    );
    // We put a new pattern; the server checks it.
    let data: Vec<u8> = (0..len).map(|i| pattern2(seed, i)).collect();
    local.write_at(lo, &data).unwrap();
    rma(n, true, &local, lo, &remote, ro, len, server);
    assert!(check_remote(n, server, ro, len, seed), "put");
    // The server gets our (new) bytes into its handle: check again with seed^1.
    let data: Vec<u8> = (0..len).map(|i| pattern2(seed ^ 1, i)).collect();
    local.write_at(lo, &data).unwrap();
    let mut cmd = vec![b'x', 0];
    for v in [ro, lo, len] {
        cmd.extend_from_slice(&v.to_le_bytes());
    }
    cmd.extend_from_slice(&mine.to_bytes());
    assert_eq!(n.request(server, 3, &cmd), [1], "server-side get");
    assert!(check_remote(n, server, ro, len, seed ^ 1), "server get");
}

#[test]
fn put_get_contiguous_and_16_segments_both_sides() {
    let dir = test_dir("rma");
    let server = PeerProc::spawn(&dir, &["server"]);
    let mut n = Node::new(&dir, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).unwrap();
    // Contiguous on both sides, with offsets.
    let local = MemHandle::zeroed(300_000, Access::ReadWrite);
    exercise(&mut n, &addr, &[262_144], local, 1000, 777, 200_000, 5);
    // 16 segments on both sides, with different splits and offsets.
    let remote_segs: Vec<u32> = (0..16).map(|i| 3000 + i * 517).collect();
    let local = segmented((0..16).map(|i| 9001 - i * 311), Access::ReadWrite);
    exercise(&mut n, &addr, &remote_segs, local, 33, 57, 100_000, 9);
    // 16 local segments against one remote, and the reverse.
    let local = segmented((0..16).map(|i| 1024 + i * 64), Access::ReadWrite);
    exercise(&mut n, &addr, &[40_000], local, 100, 3, 20_000, 11);
    let local = MemHandle::zeroed(50_000, Access::ReadWrite);
    exercise(&mut n, &addr, &remote_segs, local, 0, 2999, 40_000, 13);
    let st = n.stats();
    assert!(st.put_bytes >= 360_000 && st.get_bytes >= 360_000, "{st:?}");
}

#[test]
fn out_of_bounds_access_and_bad_address_rma_errors() {
    let dir = test_dir("rma-oob");
    let server = PeerProc::spawn(&dir, &["server"]);
    let mut n = Node::new(&dir, ProgressMode::default(), false);
    let addr = n.ep.lookup(&server.uri).unwrap();
    let remote = expose(&mut n, &addr, &[1000, 1000]);
    let local = MemHandle::zeroed(4096, Access::ReadWrite);
    let op = n.op();
    let e = n.ep.put(&local, 0, &remote, 1500, 501, &addr, op).unwrap_err();
    assert!(matches!(e, NaError::OutOfBounds { what: "remote", .. }), "{e}");
    let e = n.ep.get(&local, 4000, &remote, 0, 100, &addr, op).unwrap_err();
    assert!(matches!(e, NaError::OutOfBounds { what: "local", .. }), "{e}");
    let e = n.ep.get(&local, 0, &remote, u64::MAX, 2, &addr, op).unwrap_err();
    assert!(matches!(e, NaError::OutOfBounds { .. }), "{e}");
    let ro_local = MemHandle::zeroed(100, Access::ReadOnly);
    let e = n.ep.get(&ro_local, 0, &remote, 0, 10, &addr, op).unwrap_err();
    assert!(matches!(e, NaError::AccessDenied { what: "local", .. }), "{e}");
    let ro_remote = RemoteMem::new(remote.segments().to_vec(), Access::ReadOnly).unwrap();
    let e = n.ep.put(&local, 0, &ro_remote, 0, 10, &addr, op).unwrap_err();
    assert!(matches!(e, NaError::AccessDenied { what: "remote", .. }), "{e}");
    n.pump(Duration::from_millis(20));
    assert!(!n.stash.contains_key(&op), "rejected posts complete nothing");
    // A forged descriptor (unmapped address in the peer) fails in the kernel:
    // an error completion, and the peer stays usable.
    let forged = RemoteMem::new(
        vec![RemoteSegment {
            addr: 0x10,
            len: 4096,
            key: 0,
        }],
        Access::ReadWrite,
    )
    .unwrap();
    n.ep.get(&local, 0, &forged, 0, 4096, &addr, op).unwrap();
    let c = n.wait(op, T);
    let e = c.status.unwrap_err();
    assert!(
        matches!(e, NaError::Rma { .. }) && e.to_string().contains("EFAULT"),
        "{e}"
    );
    assert_eq!(n.request(&addr, 5, b"estill-there"), b"estill-there");
}
