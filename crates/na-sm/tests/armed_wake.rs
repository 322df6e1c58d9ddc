//! A plugin whose owner sleeps on its fd (armed by `try_wait`) while
//! another thread uses it: a call that takes the fd's pending events (an
//! RMA's harvest after a gap) leaves the fd readable, so the owner still
//! wakes for the message that arrived. Two real plugins in one process.

use std::time::{Duration, Instant};

use na_core::{Access, MemHandle, OpId, Plugin, PluginId, Rma};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::{private_dir, sys};

const T: Duration = Duration::from_secs(10);

/// Whether `fd` turns readable within a second: a wake-up through the
/// deadline timer (set to now) fires a moment after it is set.
fn readable_soon(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let (n, revents) = sys::poll_one(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::POLLIN, 1000);
    n == 1 && revents & libc::POLLIN != 0
}

/// Whether `fd` is readable now.
fn readable(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let (n, revents) = sys::poll_one(std::os::fd::AsRawFd::as_raw_fd(&fd), libc::POLLIN, 0);
    n == 1 && revents & libc::POLLIN != 0
}

#[test]
fn an_rma_while_the_owner_sleeps_keeps_its_wake_up() {
    let dir = private_dir("armed-wake");
    let (mut a, mut b, to_a, to_b) = connected(&dir, SmConfig::listening());
    // B's memory, for A's transfer.
    let theirs = MemHandle::new(vec![vec![5u8; 4096]], Access::ReadWrite);
    b.mem_register(&theirs).unwrap();
    let remote = b.mem_describe(&theirs).unwrap();
    let ours = MemHandle::new(vec![vec![0u8; 4096]], Access::ReadWrite);
    a.mem_register(&ours).unwrap();
    for round in 0..20 {
        // A's owner goes to sleep on its fd.
        while a.pop_completion().is_some() {}
        let end = Instant::now() + T;
        while !a.try_wait().unwrap() {
            assert!(Instant::now() < end, "A never became idle");
            a.progress().unwrap();
            while a.pop_completion().is_some() {}
        }
        assert!(
            !readable(a.poll_fd().unwrap()),
            "round {round}: readable while idle"
        );
        // B's message wakes it.
        a.post_recv_unexpected(Vec::new(), OpId(100 + round)).unwrap();
        b.send_unexpected(&to_a, 2, b"wake", OpId(100 + round)).unwrap();
        let end = Instant::now() + T;
        while !readable(a.poll_fd().unwrap()) {
            assert!(Instant::now() < end, "round {round}: B's message did not wake A");
            b.progress().unwrap();
        }
        // Another thread's RMA (the owner still asleep), after the gap
        // that makes it harvest A's events first.
        std::thread::sleep(Duration::from_millis(3));
        a.rma(&to_b, &[Rma::get(&ours, 0, &remote, 0, 64, OpId(1000 + round))])
            .unwrap();
        assert!(
            readable_soon(a.poll_fd().unwrap()),
            "round {round}: the RMA took A's wake-up and left its fd quiet"
        );
        // The owner wakes and finds the message (and the transfer's end).
        let end = Instant::now() + T;
        let mut got = false;
        while !got {
            assert!(Instant::now() < end, "round {round}: the message never arrived");
            a.progress().unwrap();
            while let Some(c) = a.pop_completion() {
                got |= c.op == OpId(100 + round);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A receive posted (from another thread) while the owner sleeps, that
/// matches a message already queued, completes at once: the owner's fd
/// turns readable so that it takes the completion.
#[test]
fn a_receive_completed_while_the_owner_sleeps_wakes_it() {
    let dir = private_dir("armed-post");
    let mut a = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    let mut b = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let to_a = b.lookup(a.self_addr().uri()).unwrap();
    // A message arrives with no receive posted: queued by A's progress.
    b.send_unexpected(&to_a, 3, b"early", OpId(1)).unwrap();
    let end = Instant::now() + T;
    while a.stats().queued_arrivals == 0 {
        assert!(Instant::now() < end, "the message never arrived: {:?}", a.stats());
        b.progress().unwrap();
        a.progress().unwrap();
    }
    let end = Instant::now() + T;
    while !a.try_wait().unwrap() {
        assert!(Instant::now() < end, "A never became idle");
        a.progress().unwrap();
    }
    assert!(!readable(a.poll_fd().unwrap()));
    a.post_recv_unexpected(Vec::new(), OpId(7)).unwrap();
    assert!(
        readable_soon(a.poll_fd().unwrap()),
        "a receive completed at once while A slept, and its fd stayed quiet"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A connected pair (A listening, B connected to it), with B's address as
/// A sees it: B's first message arrived in a posted receive.
fn connected(dir: &std::path::Path, a_cfg: SmConfig) -> (SmPlugin, SmPlugin, na_core::Addr, na_core::Addr) {
    let mut a = SmPlugin::new(PluginId(1), a_cfg.with_dir(dir)).unwrap();
    let mut b = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(dir)).unwrap();
    let to_a = b.lookup(a.self_addr().uri()).unwrap();
    a.post_recv_unexpected(Vec::new(), OpId(1)).unwrap();
    b.send_unexpected(&to_a, 1, b"hello", OpId(1)).unwrap();
    let end = Instant::now() + T;
    let to_b = loop {
        assert!(Instant::now() < end, "the first message never arrived");
        b.progress().unwrap();
        a.progress().unwrap();
        if let Some(c) = a.pop_completion() {
            break c.source.expect("a received message names its source");
        }
    };
    while b.pop_completion().is_some() {}
    (a, b, to_a, to_b)
}

/// Puts A's owner to sleep: progress until `try_wait` says it may, then
/// checks that its fd is quiet.
fn sleep_owner(a: &mut SmPlugin, what: &str) {
    let end = Instant::now() + T;
    while !a.try_wait().unwrap() {
        assert!(Instant::now() < end, "{what}: A never became idle");
        a.progress().unwrap();
        while a.pop_completion().is_some() {}
    }
    assert!(!readable(a.poll_fd().unwrap()), "{what}: readable while idle");
}

/// Calls from another thread that complete something at once, while the
/// owner sleeps, make its fd readable: a send that reports its success,
/// a cancel, an RMA (with no gap before it, so no event harvest wakes the
/// owner on the side). Each used to leave the completion unseen until an
/// unrelated event.
#[test]
fn completions_queued_while_the_owner_sleeps_wake_it() {
    let dir = private_dir("armed-completions");
    let (mut a, mut b, _to_a, to_b) = connected(&dir, SmConfig::listening());
    let theirs = MemHandle::new(vec![vec![5u8; 4096]], Access::ReadWrite);
    b.mem_register(&theirs).unwrap();
    let remote = b.mem_describe(&theirs).unwrap();
    let ours = MemHandle::new(vec![vec![0u8; 4096]], Access::ReadWrite);
    a.mem_register(&ours).unwrap();
    for round in 0..5u64 {
        sleep_owner(&mut a, "send");
        a.send_unexpected(&to_b, 2, b"reported", OpId(100 + round))
            .unwrap();
        assert!(
            readable_soon(a.poll_fd().unwrap()),
            "round {round}: a completed send left A's fd quiet"
        );
        a.post_recv_unexpected(Vec::new(), OpId(200 + round)).unwrap();
        sleep_owner(&mut a, "cancel");
        a.cancel(OpId(200 + round)).unwrap();
        assert!(
            readable_soon(a.poll_fd().unwrap()),
            "round {round}: a cancel left A's fd quiet"
        );
        sleep_owner(&mut a, "rma");
        a.rma(&to_b, &[Rma::get(&ours, 0, &remote, 0, 64, OpId(300 + round))])
            .unwrap();
        assert!(
            readable_soon(a.poll_fd().unwrap()),
            "round {round}: an RMA left A's fd quiet"
        );
        // B takes A's messages, so A's ring does not fill.
        let end = Instant::now() + Duration::from_millis(20);
        while Instant::now() < end {
            b.progress().unwrap();
        }
        while b.pop_completion().is_some() {}
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A ring whose next message the flow bound holds back lets the owner
/// sleep (only a receive for that message releases it); a receive posted
/// for it from another thread then wakes the owner, which used to sleep
/// on with a deliverable message and a receive waiting for it.
#[test]
fn a_receive_for_a_held_message_posted_while_the_owner_sleeps_wakes_it() {
    let dir = private_dir("armed-held");
    let cfg = SmConfig {
        max_queued_per_peer: 1,
        ..SmConfig::listening()
    };
    let (mut a, mut b, to_a, to_b) = connected(&dir, cfg);
    // Tag 1 is queued (nobody asked for it); tag 2 waits in the ring.
    b.send_expected(&to_a, 1, b"first", OpId(10)).unwrap();
    b.send_expected(&to_a, 2, b"second", OpId(11)).unwrap();
    let end = Instant::now() + T;
    while a.stats().queued_arrivals == 0 {
        assert!(
            Instant::now() < end,
            "the first message never arrived: {:?}",
            a.stats()
        );
        b.progress().unwrap();
        a.progress().unwrap();
    }
    for _ in 0..20 {
        b.progress().unwrap();
        a.progress().unwrap();
    }
    sleep_owner(&mut a, "held");
    a.post_recv_expected(&to_b, 2, Vec::new(), OpId(20)).unwrap();
    assert!(
        readable_soon(a.poll_fd().unwrap()),
        "a receive for the held message left A's fd quiet"
    );
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "the held message never arrived");
        a.progress().unwrap();
        if let Some(c) = std::iter::from_fn(|| a.pop_completion()).find(|c| c.op == OpId(20)) {
            assert_eq!(c.buf.as_deref(), Some(&b"second"[..]));
            break;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A wake-up of the owner (a receive completed at once from another
/// thread) is not put off by a later timer update of another call (a
/// lookup that starts a handshake sets the acknowledgement deadline).
#[test]
fn a_wake_up_survives_a_later_timer_update() {
    let dir = private_dir("armed-timer");
    let mut a = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    let mut b = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).unwrap();
    let c = SmPlugin::new(PluginId(3), SmConfig::listening().with_dir(&dir)).unwrap();
    let to_a = b.lookup(a.self_addr().uri()).unwrap();
    b.send_unexpected(&to_a, 3, b"early", OpId(1)).unwrap();
    let end = Instant::now() + T;
    while a.stats().queued_arrivals == 0 {
        assert!(Instant::now() < end, "the message never arrived: {:?}", a.stats());
        b.progress().unwrap();
        a.progress().unwrap();
    }
    sleep_owner(&mut a, "timer");
    a.post_recv_unexpected(Vec::new(), OpId(7)).unwrap();
    let _to_c = a.lookup(c.self_addr().uri()).unwrap();
    assert!(
        readable_soon(a.poll_fd().unwrap()),
        "the lookup's timer update put off A's wake-up"
    );
    drop(c);
    let _ = std::fs::remove_dir_all(&dir);
}
