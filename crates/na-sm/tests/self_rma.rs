//! A transfer to this process (its own address, or another sm instance of
//! the same process) may touch only memory that a live handle registered
//! with sm exposes. `process_vm_writev` on
//! our own pid is not checked by the kernel, so a remote handle naming our
//! address and someone else's idea of our memory (a hostile server's
//! "bulk handle" whose owner is the client) must be refused before
//! anything moves: the canaries below are plain heap memory.
//!
//! Every test runs twice: inline, and with RMA transfer threads
//! (`SmConfig::rma_threads`), where transfers to this process stay on the
//! caller's thread, checked the same way (`rma_offloaded` stays 0).

use std::collections::VecDeque;

use na_core::{
    Access, Completion, MemHandle, NaError, OpId, Plugin, PluginId, RemoteMem, RemoteSegment, Rma,
};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

fn forged(addr: *const u8, len: usize) -> RemoteMem {
    let seg = RemoteSegment {
        addr: addr as u64,
        len: len as u64,
        key: 0,
    };
    RemoteMem::new(vec![seg], Access::ReadWrite).unwrap()
}

fn refused(r: na_core::Result<()>) {
    match r {
        Err(NaError::Rma { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied, "{source}");
            assert!(source.to_string().contains("forged or stale"), "{source}");
        }
        other => panic!("a transfer outside exposed memory was not refused: {other:?}"),
    }
}

/// A plugin in `dir` with `threads` RMA transfer threads.
fn plugin_with(dir: &std::path::Path, threads: usize) -> SmPlugin {
    SmPlugin::new(
        PluginId(1),
        SmConfig {
            rma_threads: Some(threads),
            ..SmConfig::default()
        }
        .with_dir(dir),
    )
    .unwrap()
}

fn completions(p: &mut SmPlugin) -> Vec<Completion> {
    p.progress().unwrap();
    let mut out = VecDeque::new();
    p.take_completions(&mut out);
    out.into_iter().collect()
}

fn transfers_to_self_stay_inside_registered_memory_with(threads: usize) {
    let dir = private_dir("self-rma");
    let mut p = plugin_with(&dir, threads);
    let me = p.self_addr();
    let source = MemHandle::new(vec![vec![0xab; 64]], Access::ReadWrite);
    let sink = MemHandle::zeroed(64, Access::ReadWrite);
    p.mem_register(&source).unwrap();
    p.mem_register(&sink).unwrap();

    // A put and a get into plain heap memory: refused, nothing moved.
    let canary = Box::new([0x5au8; 64]);
    let fake = forged(canary.as_ptr(), canary.len());
    refused(p.rma(&me, &[Rma::put(&source, 0, &fake, 0, 64, OpId(1))]));
    refused(p.rma(&me, &[Rma::get(&sink, 0, &fake, 0, 64, OpId(2))]));
    assert!(canary.iter().all(|&b| b == 0x5a), "the canary was written");
    assert!(sink.to_vec().iter().all(|&b| b == 0), "the canary was read");
    // One forged transfer refuses the whole batch.
    let target = MemHandle::zeroed(64, Access::ReadWrite);
    p.mem_register(&target).unwrap();
    let honest = p.mem_describe(&target).unwrap();
    refused(p.rma(
        &me,
        &[
            Rma::put(&source, 0, &honest, 0, 8, OpId(3)),
            Rma::put(&source, 0, &fake, 0, 8, OpId(4)),
        ],
    ));
    assert!(
        target.to_vec().iter().all(|&b| b == 0),
        "part of a refused batch moved"
    );

    // A range that starts inside exposed memory and runs past it.
    let start = target.segments_raw().next().unwrap().0;
    let big = MemHandle::new(vec![vec![0xab; 65]], Access::ReadOnly);
    p.mem_register(&big).unwrap();
    refused(p.rma(
        &me,
        &[Rma::put(&big, 0, &forged(start as *const u8, 65), 0, 65, OpId(5))],
    ));

    // The honest descriptor works, both ways.
    p.rma(&me, &[Rma::put(&source, 0, &honest, 8, 16, OpId(6))])
        .unwrap();
    let c = completions(&mut p);
    assert!(c.iter().any(|c| c.op == OpId(6) && c.status.is_ok()), "{c:?}");
    let data = target.to_vec();
    assert!(data[8..24].iter().all(|&b| b == 0xab) && data[..8].iter().all(|&b| b == 0));
    p.rma(&me, &[Rma::get(&sink, 0, &honest, 8, 16, OpId(7))])
        .unwrap();
    let c = completions(&mut p);
    assert!(c.iter().any(|c| c.op == OpId(7) && c.status.is_ok()), "{c:?}");
    assert!(sink.to_vec()[..16].iter().all(|&b| b == 0xab));

    // Access as registered, not as the descriptor claims: a read-only
    // handle described as writable.
    let ro = MemHandle::zeroed(64, Access::ReadOnly);
    p.mem_register(&ro).unwrap();
    let ro_start = ro.segments_raw().next().unwrap().0;
    refused(p.rma(
        &me,
        &[Rma::put(
            &source,
            0,
            &forged(ro_start as *const u8, 64),
            0,
            64,
            OpId(8),
        )],
    ));
    assert!(ro.to_vec().iter().all(|&b| b == 0));

    // Deregistered: its old descriptor is refused (the memory may be reused).
    p.mem_deregister(&target).unwrap();
    refused(p.rma(&me, &[Rma::put(&source, 0, &honest, 0, 8, OpId(9))]));
    // Every refusal counted (the batch once), the honest transfers not.
    let st = p.stats();
    assert_eq!(st.self_rma_refused, 6, "the 6 refusals above: {st:?}");
    assert_eq!(st.rma_offloaded, 0, "transfers to this process stay inline");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Exposed memory is reachable only through its own registration's
/// descriptor: a hostile server that knows where a buffer the client lent
/// to another server lies (addresses are no secret: it may have guessed,
/// or been told by a colluding peer) forges a descriptor of it with no
/// key, or with the key of a handle the client lent to *it*, and hands it
/// back as its own "bulk handle": the client's push is refused.
fn exposed_memory_is_reached_only_through_its_own_descriptor_with(threads: usize) {
    let dir = private_dir("self-rma-key");
    let mut p = plugin_with(&dir, threads);
    let me = p.self_addr();
    let source = MemHandle::new(vec![vec![0xee; 64]], Access::ReadOnly);
    let lent_elsewhere = MemHandle::zeroed(64, Access::WriteOnly);
    let lent_to_attacker = MemHandle::zeroed(64, Access::WriteOnly);
    for h in [&source, &lent_elsewhere, &lent_to_attacker] {
        p.mem_register(h).unwrap();
    }
    let honest = p.mem_describe(&lent_elsewhere).unwrap();
    let attackers = p.mem_describe(&lent_to_attacker).unwrap();
    let key = honest.segments()[0].key;
    assert_ne!(key, 0, "a registered handle's descriptor carries a key");
    assert_ne!(
        key,
        attackers.segments()[0].key,
        "each registration has its own key"
    );

    let with_key = |key: u64| {
        let seg = RemoteSegment {
            key,
            ..honest.segments()[0]
        };
        RemoteMem::new(vec![seg], Access::WriteOnly).unwrap()
    };
    for (n, wrong) in [0, 1, attackers.segments()[0].key, key.wrapping_add(1)]
        .into_iter()
        .enumerate()
    {
        refused(p.rma(
            &me,
            &[Rma::put(&source, 0, &with_key(wrong), 0, 64, OpId(n as u64))],
        ));
    }
    assert!(
        lent_elsewhere.to_vec().iter().all(|&b| b == 0),
        "a forged descriptor wrote into a buffer lent to someone else"
    );
    // A descriptor carried through bytes (as a peer returns it) keeps its key.
    let returned = RemoteMem::from_bytes(&honest.to_bytes()).unwrap();
    p.rma(&me, &[Rma::put(&source, 0, &returned, 0, 64, OpId(10))])
        .unwrap();
    let c = completions(&mut p);
    assert!(c.iter().any(|c| c.op == OpId(10) && c.status.is_ok()), "{c:?}");
    assert!(lent_elsewhere.to_vec().iter().all(|&b| b == 0xee));
    assert_eq!(p.stats().self_rma_refused, 4, "the 4 forged keys");
    assert_eq!(
        p.stats().rma_offloaded,
        0,
        "transfers to this process stay inline"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same check for a second sm instance of this process: its pid is
/// ours, so the kernel checks nothing there either. What either instance
/// registered may be moved between them (two engines of one process);
/// anything else is refused.
fn transfers_to_another_instance_of_this_process_are_checked_too_with(threads: usize) {
    let dir = private_dir("self-rma-2");
    let mut a = SmPlugin::new(
        PluginId(1),
        SmConfig {
            rma_threads: Some(threads),
            ..SmConfig::listening()
        }
        .with_dir(&dir),
    )
    .unwrap();
    let mut b = SmPlugin::new(
        PluginId(2),
        SmConfig {
            rma_threads: Some(threads),
            ..SmConfig::default()
        }
        .with_dir(&dir),
    )
    .unwrap();
    let to_a = b.lookup(a.self_addr().uri()).unwrap();
    let source = MemHandle::new(vec![vec![0xcd; 64]], Access::ReadWrite);
    b.mem_register(&source).unwrap();
    let canary = Box::new([0x5au8; 64]);
    let fake = forged(canary.as_ptr(), canary.len());
    // The peer must be connected for a transfer: drive the handshake.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let _ = a.progress();
        let _ = b.progress();
        match b.rma(&to_a, &[Rma::put(&source, 0, &fake, 0, 64, OpId(1))]) {
            Err(NaError::Rma { source, .. }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied, "{source}");
                break;
            }
            Err(NaError::PeerGone { .. }) if std::time::Instant::now() < end => continue,
            other => panic!("a forged transfer to another instance was not refused: {other:?}"),
        }
    }
    assert!(canary.iter().all(|&x| x == 0x5a), "the canary was written");
    // A's registered memory, and B's own, are fair game.
    let target = MemHandle::zeroed(64, Access::ReadWrite);
    a.mem_register(&target).unwrap();
    let desc = a.mem_describe(&target).unwrap();
    b.rma(&to_a, &[Rma::put(&source, 0, &desc, 0, 64, OpId(2))])
        .unwrap();
    let c = completions(&mut b);
    assert!(c.iter().any(|c| c.op == OpId(2) && c.status.is_ok()), "{c:?}");
    assert!(target.to_vec().iter().all(|&x| x == 0xcd));
    // Counted by the instance that refused it (the sender).
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(
        (sa.self_rma_refused, sb.self_rma_refused),
        (0, 1),
        "{sa:?} {sb:?}"
    );
    assert_eq!(sb.rma_offloaded, 0, "transfers to this process stay inline");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn transfers_to_self_stay_inside_registered_memory() {
    transfers_to_self_stay_inside_registered_memory_with(0);
}

#[test]
fn transfers_to_self_stay_inside_registered_memory_on_transfer_threads() {
    transfers_to_self_stay_inside_registered_memory_with(2);
}

#[test]
fn exposed_memory_is_reached_only_through_its_own_descriptor() {
    exposed_memory_is_reached_only_through_its_own_descriptor_with(0);
}

#[test]
fn exposed_memory_is_reached_only_through_its_own_descriptor_on_transfer_threads() {
    exposed_memory_is_reached_only_through_its_own_descriptor_with(2);
}

#[test]
fn transfers_to_another_instance_of_this_process_are_checked_too() {
    transfers_to_another_instance_of_this_process_are_checked_too_with(0);
}

#[test]
fn transfers_to_another_instance_of_this_process_are_checked_too_on_transfer_threads() {
    transfers_to_another_instance_of_this_process_are_checked_too_with(2);
}
