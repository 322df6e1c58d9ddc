//! What a fork leaves a child of na-sm's process-wide state: an inherited
//! instance refuses to work (its rings and peers are its parent's), the
//! child draws its own registration tokens, no descriptor from before the
//! fork reaches it, and a fork while another thread held the exposed set
//! does not leave the child's set locked.
//!
//! Each child reports through its exit status (0: as expected; other
//! values name what went wrong) and ends with `_exit`.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use na_core::{Access, MemHandle, OpId, Plugin, PluginId, Rma};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::{pipe, private_dir, sys, wait_child};

/// Forks; the child runs `child` and exits with its status. Returns the
/// child's pid.
fn fork_child(child: impl FnOnce() -> i32) -> libc::pid_t {
    // The child runs `child` (plugin calls, no locks held by threads it
    // does not have but the ones the fork handlers cover) and ends with
    // `exit_now`, never returning into the test harness.
    let pid = sys::fork();
    assert!(pid >= 0, "fork");
    if pid == 0 {
        let code = child();
        sys::exit_now(code);
    }
    pid
}

#[test]
fn an_inherited_instance_refuses_to_work_and_a_new_one_does() {
    let dir = private_dir("fork-inherited");
    let mut p = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    let me = p.self_addr();
    let child = fork_child(|| {
        // Every way in refuses, naming the fork.
        let says_fork = |r: na_core::Result<()>| matches!(r, Err(e) if na_core::ErrorChain(&e).to_string().contains("fork"));
        if !says_fork(p.progress().map(drop)) {
            return 2;
        }
        if !says_fork(p.lookup(me.uri()).map(drop)) {
            return 3;
        }
        if !says_fork(p.send_unexpected(&me, 0, b"x", OpId(1))) {
            return 4;
        }
        if !says_fork(p.post_recv_unexpected(Vec::new(), OpId(2))) {
            return 5;
        }
        if !says_fork(p.try_wait().map(drop)) {
            return 6;
        }
        // A new instance works, and can talk to itself.
        let Ok(mut mine) = SmPlugin::new(PluginId(2), SmConfig::listening().with_dir(&dir)) else {
            return 7;
        };
        let to_self = mine.self_addr();
        if mine.post_recv_unexpected(Vec::new(), OpId(3)).is_err()
            || mine.send_unexpected(&to_self, 0, b"mine", OpId(4)).is_err()
        {
            return 8;
        }
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if mine.progress().is_err() {
                return 9;
            }
            if std::iter::from_fn(|| mine.pop_completion()).any(|c| c.op == OpId(3)) {
                return 0;
            }
        }
        10
    });
    assert_eq!(wait_child(child, Duration::from_secs(20)), Some(0));
    // The parent's instance is untouched.
    p.progress().unwrap();
    p.post_recv_unexpected(Vec::new(), OpId(5)).unwrap();
    p.send_unexpected(&me, 0, b"parent", OpId(6)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < end, "the parent's message never arrived");
        p.progress().unwrap();
        if let Some(c) = std::iter::from_fn(|| p.pop_completion()).find(|c| c.op == OpId(5)) {
            assert_eq!(c.buf.as_deref(), Some(&b"parent"[..]));
            break;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The registrations a parent and its child make after a fork carry
/// different tokens (drawn from the kernel, not from state the fork
/// copied), and a descriptor made before the fork does not reach the
/// child's copy of the memory.
#[test]
fn a_child_draws_its_own_tokens_and_old_descriptors_do_not_reach_it() {
    let dir = private_dir("fork-tokens");
    let mut p = SmPlugin::new(PluginId(1), SmConfig::default().with_dir(&dir)).unwrap();
    let before = MemHandle::zeroed(64, Access::ReadWrite);
    p.mem_register(&before).unwrap();
    let old = p.mem_describe(&before).unwrap();
    let (mut rx, mut tx) = pipe();
    let child = fork_child(|| {
        let Ok(mut mine) = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)) else {
            return 2;
        };
        let keys: Vec<u64> = (0..4)
            .map(|_| {
                let h = MemHandle::zeroed(64, Access::ReadWrite);
                mine.mem_register(&h).ok();
                let key = mine.mem_describe(&h).map(|d| d.segments()[0].key).unwrap_or(0);
                std::mem::forget(h);
                key
            })
            .collect();
        let bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        if tx.write_all(&bytes).is_err() {
            return 3;
        }
        // The descriptor of `before` (our copy of it is still at that
        // address, registered by the parent before the fork): refused.
        let source = MemHandle::new(vec![vec![0xee; 64]], Access::ReadOnly);
        if mine.mem_register(&source).is_err() {
            return 4;
        }
        let me = mine.self_addr();
        match mine.rma(&me, &[Rma::put(&source, 0, &old, 0, 64, OpId(1))]) {
            Err(e) if na_core::ErrorChain(&e).to_string().contains("forged or stale") => {}
            _ => return 5,
        }
        if before.to_vec().iter().any(|&b| b != 0) {
            return 6;
        }
        0
    });
    drop(tx);
    let parent_keys: Vec<u64> = (0..4)
        .map(|_| {
            let h = MemHandle::zeroed(64, Access::ReadWrite);
            p.mem_register(&h).unwrap();
            let key = p.mem_describe(&h).unwrap().segments()[0].key;
            std::mem::forget(h);
            key
        })
        .collect();
    let mut bytes = Vec::new();
    rx.read_to_end(&mut bytes).unwrap();
    assert_eq!(wait_child(child, Duration::from_secs(20)), Some(0));
    let child_keys: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(child_keys.len(), 4);
    assert!(child_keys.iter().all(|&k| k != 0));
    for k in &child_keys {
        assert!(
            !parent_keys.contains(k),
            "parent and child drew the same token {k:#x}: {parent_keys:x?} {child_keys:x?}"
        );
    }
    // The parent's own old descriptor still works in the parent.
    let source = MemHandle::new(vec![vec![0xab; 64]], Access::ReadOnly);
    p.mem_register(&source).unwrap();
    let me = p.self_addr();
    p.rma(&me, &[Rma::put(&source, 0, &old, 0, 64, OpId(9))]).unwrap();
    assert!(before.to_vec().iter().all(|&b| b == 0xab));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Children forked while another thread registers and drops handles (so
/// some forks happen while it holds the process's exposed set) can
/// register and drop handles of their own: none hangs.
#[test]
fn a_child_forked_while_the_exposed_set_is_held_can_use_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let dir = private_dir("fork-exposed");
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (stop, dir) = (stop.clone(), dir.clone());
        std::thread::spawn(move || {
            let mut p = SmPlugin::new(PluginId(1), SmConfig::default().with_dir(&dir)).unwrap();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let h = MemHandle::new(vec![vec![0; 64]; 64], Access::ReadWrite);
                p.mem_register(&h).unwrap();
                drop(h);
                n += 1;
            }
            n
        })
    };
    const CHILDREN: usize = 100;
    let mut hung = 0;
    for i in 0..CHILDREN {
        let dir = dir.clone();
        let child = fork_child(move || {
            let cfg = SmConfig::default().with_dir(&dir).with_name(format!("child{i}"));
            let Ok(mut p) = SmPlugin::new(PluginId(2), cfg) else {
                return 2;
            };
            let h = MemHandle::zeroed(64, Access::ReadWrite);
            if p.mem_register(&h).is_err() {
                return 3;
            }
            drop(h);
            0
        });
        match wait_child(child, Duration::from_secs(10)) {
            Some(code) => assert_eq!(code, 0, "child {i}"),
            None => hung += 1,
        }
    }
    stop.store(true, Ordering::Relaxed);
    let made = churn.join().unwrap();
    assert_eq!(
        hung, 0,
        "{hung} of {CHILDREN} children hung ({made} handles made meanwhile)"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
