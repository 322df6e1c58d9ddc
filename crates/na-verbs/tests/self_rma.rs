//! Transfers whose remote descriptor names this plugin's own address (a
//! hostile server can send the client such a "bulk handle"): served by a
//! copy in memory only inside memory a live handle exposed, under its
//! whole key (rkey and secret) and with the access the transfer needs;
//! anything else is refused before a byte moves. Before this was checked
//! (2026-11-29) the transfer went over a loopback connection, where the
//! device checks only the (guessable) rkey: a forged descriptor reached
//! memory the client had lent to someone else.

mod common;

use std::time::{Duration, Instant};

use na_core::{Access, Addr, Endpoint, MemHandle, OpId, RemoteMem, RemoteSegment};

use common::pair::{node, T};

/// Starts a put (or get) of `len` bytes between `local` and `desc` at
/// `dest` and waits for its completion: its error, if any.
fn transfer(
    ep: &mut Endpoint,
    put: bool,
    local: &MemHandle,
    desc: &RemoteMem,
    dest: &Addr,
    op: u64,
) -> Result<(), String> {
    let len = desc.size().min(local.size());
    let started = if put {
        ep.put(local, 0, desc, 0, len, dest, OpId(op))
    } else {
        ep.get(local, 0, desc, 0, len, dest, OpId(op))
    };
    started.map_err(|e| format!("at start: {}", na_core::ErrorChain(&e)))?;
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "transfer {op} never completed");
        ep.progress(Some(Duration::from_millis(1))).unwrap();
        if let Some(c) = ep.pop_completion() {
            assert_eq!(c.op, OpId(op));
            return c
                .status
                .map_err(|e| format!("at completion: {}", na_core::ErrorChain(&e)));
        }
    }
}

/// A descriptor of one segment, as a forger would write it.
fn forged(addr: u64, len: u64, key: u64) -> RemoteMem {
    RemoteMem::new(vec![RemoteSegment { addr, len, key }], Access::ReadWrite).unwrap()
}

fn exposed(ep: &mut Endpoint, id: na_core::PluginId, fill: u8, access: Access) -> (MemHandle, RemoteMem) {
    let h = MemHandle::new(vec![vec![fill; 4096]], access);
    let p = ep.plugin_mut(id).unwrap();
    p.mem_register(&h).unwrap();
    let d = p.mem_describe(&h).unwrap();
    (h, d)
}

#[test]
fn forged_own_descriptors_reach_only_what_we_expose() {
    let Some(env) = common::rdma_env("forged_own_descriptors_reach_only_what_we_expose") else {
        return;
    };
    // Listening: a loopback connection to ourselves would be possible.
    let (mut ep, id) = node(&env, true);
    let own_uri = ep.self_addr(id).unwrap().uri().to_owned();
    let own = ep.lookup(&own_uri).unwrap();
    let src = MemHandle::new(vec![vec![0x55; 4096]], Access::ReadWrite);

    // Memory lent (described) to someone else, read-write.
    let (lent, lent_desc) = exposed(&mut ep, id, 0xAA, Access::ReadWrite);
    let seg = lent_desc.segments()[0];
    let rkey_only = seg.key & 0xffff_ffff;

    // Its rkey and address, without the descriptor's secret: what a
    // hostile server that guessed the rkey could forge.
    let e = transfer(
        &mut ep,
        true,
        &src,
        &forged(seg.addr, seg.len, rkey_only),
        &own,
        1,
    )
    .expect_err("a put through a guessed rkey");
    assert!(e.contains("forged or stale"), "{e}");
    assert!(
        lent.to_vec().iter().all(|&b| b == 0xAA),
        "the lent memory was written"
    );
    let sink = MemHandle::zeroed(4096, Access::ReadWrite);
    let e = transfer(
        &mut ep,
        false,
        &sink,
        &forged(seg.addr, seg.len, rkey_only),
        &own,
        2,
    )
    .expect_err("a get through a guessed rkey");
    assert!(e.contains("forged or stale"), "{e}");
    assert!(sink.to_vec().iter().all(|&b| b == 0), "the lent memory was read");

    // (a) Exposed, but not for that access: a read-only handle written,
    // a write-only one read (with their whole keys).
    let (ro, ro_desc) = exposed(&mut ep, id, 0xBB, Access::ReadOnly);
    let s = ro_desc.segments()[0];
    let e = transfer(&mut ep, true, &src, &forged(s.addr, s.len, s.key), &own, 3)
        .expect_err("a put to read-only memory");
    assert!(e.contains("forged or stale"), "{e}");
    assert!(
        ro.to_vec().iter().all(|&b| b == 0xBB),
        "read-only memory was written"
    );
    let (_wo, wo_desc) = exposed(&mut ep, id, 0xCC, Access::WriteOnly);
    let s = wo_desc.segments()[0];
    let e = transfer(&mut ep, false, &sink, &forged(s.addr, s.len, s.key), &own, 4)
        .expect_err("a get from write-only memory");
    assert!(e.contains("forged or stale"), "{e}");
    assert!(
        sink.to_vec().iter().all(|&b| b == 0),
        "write-only memory was read"
    );

    // (b) The whole key, at an address past the segment (and one nowhere).
    for (i, addr) in [seg.addr + 2048, 0x1000_0000].into_iter().enumerate() {
        let e = transfer(
            &mut ep,
            true,
            &src,
            &forged(addr, seg.len, seg.key),
            &own,
            5 + i as u64,
        )
        .expect_err("a put outside the segment");
        assert!(e.contains("forged or stale"), "{e}");
    }
    assert!(
        lent.to_vec().iter().all(|&b| b == 0xAA),
        "the lent memory was written"
    );

    // (c) A handle gone: its descriptor reaches nothing.
    let (gone, gone_desc) = exposed(&mut ep, id, 0xDD, Access::ReadWrite);
    drop(gone);
    let e = transfer(&mut ep, true, &src, &gone_desc, &own, 7).expect_err("a put to a freed handle");
    assert!(e.contains("forged or stale"), "{e}");
    let e = transfer(&mut ep, false, &sink, &gone_desc, &own, 8).expect_err("a get from a freed handle");
    assert!(e.contains("forged or stale"), "{e}");
    assert!(sink.to_vec().iter().all(|&b| b == 0), "freed memory was read");

    // The real descriptor still works, both ways, through our looked-up
    // address and our own.
    transfer(&mut ep, true, &src, &lent_desc, &own, 9).expect("a put through the real descriptor");
    assert!(lent.to_vec().iter().all(|&b| b == 0x55), "the put moved nothing");
    lent.write_at(0, &[0x77; 4096]).unwrap();
    let self_addr = ep.self_addr(id).unwrap();
    transfer(&mut ep, false, &sink, &lent_desc, &self_addr, 10).expect("a get through the real descriptor");
    assert!(sink.to_vec().iter().all(|&b| b == 0x77), "the get moved nothing");
    let st = ep.plugin(id).unwrap().stats();
    assert_eq!((st.put_bytes, st.get_bytes), (4096, 4096), "{st:?}");
    assert_eq!(st.self_rma_refused, 8, "the 8 refusals above: {st:?}");
}

/// A client-only plugin (which cannot connect to itself) moves data with
/// a descriptor of its own: served in memory, with no connection.
#[test]
fn a_client_only_plugin_serves_its_own_descriptors() {
    let Some(env) = common::rdma_env("a_client_only_plugin_serves_its_own_descriptors") else {
        return;
    };
    let (mut ep, id) = node(&env, false);
    let own_uri = ep.self_addr(id).unwrap().uri().to_owned();
    let own = ep.lookup(&own_uri).unwrap();
    let (lent, desc) = exposed(&mut ep, id, 0x11, Access::ReadWrite);
    let src = MemHandle::new(vec![vec![0x22; 4096]], Access::ReadOnly);
    transfer(&mut ep, true, &src, &desc, &own, 1).expect("a put to our own memory");
    assert!(lent.to_vec().iter().all(|&b| b == 0x22), "the put moved nothing");
    let sink = MemHandle::zeroed(4096, Access::ReadWrite);
    transfer(&mut ep, false, &sink, &desc, &own, 2).expect("a get of our own memory");
    assert!(sink.to_vec().iter().all(|&b| b == 0x22), "the get moved nothing");
    let st = ep.plugin(id).unwrap().stats();
    assert_eq!(st.self_rma_refused, 0, "nothing was refused: {st:?}");
}

/// Our own address spelt as an IPv4-mapped IPv6 address
/// (`[::ffff:10.77.0.1]:port`) is ours: a forged descriptor naming it is
/// refused like one naming the plain spelling, and a real one is served
/// in memory. Before (2026-11-29) the spellings were compared exactly:
/// the mapped one was taken for a peer, and its transfer went for a
/// loopback connection (where only the rkey is checked; this kernel's
/// RDMA CM happened to refuse the mixed-family route).
#[test]
fn our_address_in_ipv6_form_is_ours() {
    let Some(env) = common::rdma_env("our_address_in_ipv6_form_is_ours") else {
        return;
    };
    let (mut ep, id) = node(&env, true);
    let own_uri = ep.self_addr(id).unwrap().uri().to_owned();
    let port = common::port_of(&own_uri);
    let own = ep.lookup(&own_uri).unwrap();
    let (lent, lent_desc) = exposed(&mut ep, id, 0xAA, Access::ReadWrite);
    let seg = lent_desc.segments()[0];
    let rkey_only = seg.key & 0xffff_ffff;
    let src = MemHandle::new(vec![vec![0x55; 4096]], Access::ReadOnly);
    let sink = MemHandle::zeroed(4096, Access::ReadWrite);
    let mut op = 0;
    for spelt in [
        format!("verbs://[::ffff:{}]:{port}", env.ip),
        format!("verbs://{}/[::ffff:{}]:{port}", env.device, env.ip),
    ] {
        let mapped = ep.lookup(&spelt).unwrap();
        for put in [true, false] {
            op += 1;
            let local = if put { &src } else { &sink };
            let e = transfer(
                &mut ep,
                put,
                local,
                &forged(seg.addr, seg.len, rkey_only),
                &mapped,
                op,
            )
            .expect_err("a transfer through a guessed rkey");
            assert!(
                e.contains("at start") && e.contains("forged or stale"),
                "{spelt}: {e}"
            );
        }
        assert!(
            lent.to_vec().iter().all(|&b| b == 0xAA),
            "the lent memory was written"
        );
        assert!(sink.to_vec().iter().all(|&b| b == 0), "the lent memory was read");
        // One listener, one peer, whichever way its address is spelt.
        assert_eq!(mapped, own, "{spelt} is another peer than {own_uri}");
    }
    // The real descriptor through the mapped spelling: served in memory.
    let mapped = ep.lookup(&format!("verbs://[::ffff:{}]:{port}", env.ip)).unwrap();
    transfer(&mut ep, true, &src, &lent_desc, &mapped, 10).expect("a put through the real descriptor");
    assert!(lent.to_vec().iter().all(|&b| b == 0x55), "the put moved nothing");
    let st = ep.plugin(id).unwrap().stats();
    assert_eq!(st.self_rma_refused, 4, "the 4 refusals above: {st:?}");
    assert_eq!((st.put_bytes, st.peers), (4096, 0), "no connection: {st:?}");
}
