//! A peer that closed its wake-up pipe (its wake-ups fail with `EPIPE`,
//! which reads as "it exited") but keeps writing and keeps asking to be
//! woken. Dropping a departed peer first drains what it published, past the
//! queued-message bound (sends that completed must not be lost); that
//! drain publishes how far it read, the wake-up fails again, and the peer
//! is found gone again. That second failure must wait for the first, not
//! start another drain inside it: otherwise every message the peer adds
//! meanwhile buys another drain past the bound and another stack frame,
//! until the process runs out of memory or stack. Two real plugins, the
//! hostile one in a thread writing as fast as it can.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use na_core::{OpId, Plugin, PluginId};
use na_sm::channel::RING_SLOTS;
use na_sm::{SmConfig, SmPlugin, WakeKind};

mod common;
use common::private_dir;

/// Rounds: whether the writer keeps up with the drains is a race, so the
/// scenario runs several times (each round takes milliseconds).
const ROUNDS: usize = 12;

#[test]
fn a_deaf_peer_that_keeps_writing_is_drained_once() {
    for round in 0..ROUNDS {
        deaf_writer_round(round);
    }
}

fn deaf_writer_round(round: usize) {
    let dir = private_dir(&format!("deaf-writer-{round}"));
    let mut victim = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    // Pull mode: the application takes each message (so the victim keeps
    // publishing and keeps trying to wake the peer); a departing peer's
    // messages are held for it to take, past any bound.
    assert!(victim.pull_unexpected().unwrap());
    let uri = victim.self_addr().uri().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let accepted = Arc::new(AtomicBool::new(false));

    let (hdir, hstop, haccepted) = (dir.clone(), stop.clone(), accepted.clone());
    let hostile = std::thread::spawn(move || {
        let mut cfg = SmConfig::default().with_dir(&hdir);
        cfg.wake = Some(WakeKind::Pipe);
        let mut h = SmPlugin::new(PluginId(2), cfg).unwrap();
        let to = h.lookup(&uri).unwrap();
        let (mut sent, mut sink, mut deaf) = (0u64, VecDeque::new(), false);
        while !hstop.load(Ordering::Relaxed) {
            // Once accepted (the handshake reopens the pipe, which needs
            // its read end): deaf, and asking to be woken, every time (a
            // wake-up attempt lowers the flag).
            if !deaf && haccepted.load(Ordering::Relaxed) {
                h.debug_deafen(&to).unwrap();
                deaf = true;
            }
            if deaf {
                let _ = h.debug_want_wake(&to);
            }
            if h.send_unexpected(&to, 7, &[0u8; 8], OpId(sent)).is_ok() {
                sent += 1;
            }
            let _ = h.progress();
            h.take_completions(&mut sink);
            sink.clear();
        }
        sent
    });

    let (mut seen, mut most, end) = (false, 0u64, Instant::now() + Duration::from_secs(20));
    let (mut sink, mut buf, mut taken) = (VecDeque::new(), Vec::new(), 0u64);
    loop {
        assert!(Instant::now() < end, "the deaf peer was never dropped");
        victim.progress().unwrap();
        victim.take_completions(&mut sink);
        sink.clear();
        let st = victim.stats();
        // Held after a progress call, before the application takes them.
        most = most.max(st.queued_arrivals);
        while victim.take_unexpected(&mut buf).unwrap().is_some() {
            taken += 1;
        }
        seen |= st.peers == 1;
        accepted.store(seen, Ordering::Relaxed);
        if seen && st.peers == 0 {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let sent = hostile.join().unwrap();
    // Held: one ring's worth, drained at departure.
    let limit = RING_SLOTS as u64;
    assert!(
        most <= limit,
        "round {round}: {most} messages of a departed peer held at once (limit {limit}; it sent {sent}, {taken} taken): drained more than once"
    );
    assert!(taken > 0, "nothing was taken: nothing tested");
    assert_eq!(victim.stats().protocol_errors, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
