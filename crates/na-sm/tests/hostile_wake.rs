//! A peer holds the eventfd it wakes us on (its copy shares our open file
//! description) and the one we wake it on, and may do anything to either:
//! bring the counter to its maximum (0xfffffffffffffffe: every write of 1
//! or more then fails with `EAGAIN`, or blocks without `O_NONBLOCK`),
//! read it down to 0, clear `O_NONBLOCK`, write in a storm. Each
//! connection has its own eventfd per direction, so that touches only the
//! hostile peer's own wake-ups; our wake-up write (a write of 0) can
//! neither block nor fail; and our fd, edge-triggered, stays quiet once
//! the writes stop, whatever the counter. Three real plugins (a victim
//! listening, an honest client, a hostile one) over real eventfds; the
//! victim sleeps for real, and a lost wake-up shows as a sleep that never
//! ends (bounded by the test's wait, far above any honest wake-up).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use na_core::{Addr, OpId, Plugin, PluginId};
use na_sm::sys::eventfd::WakeTamper;
use na_sm::{SmConfig, SmPlugin, WakeKind};

mod common;
use common::private_dir;

/// Far above any honest wake-up or handshake, even on a loaded box.
const T: Duration = Duration::from_secs(60);

/// A victim listening in pull mode, an honest client and a hostile one,
/// all on eventfd wake-ups, connected and acknowledged.
struct Three {
    dir: std::path::PathBuf,
    victim: SmPlugin,
    honest: SmPlugin,
    hostile: SmPlugin,
    /// The victim's address, as each client knows it.
    h_to_v: Addr,
    x_to_v: Addr,
}

fn config(dir: &std::path::Path, listening: bool) -> SmConfig {
    let mut cfg = if listening {
        SmConfig::listening()
    } else {
        SmConfig::default()
    };
    cfg = cfg.with_dir(dir);
    cfg.wake = Some(WakeKind::EventFd);
    cfg
}

fn three(tag: &str) -> Three {
    let dir = private_dir(tag);
    let mut victim = SmPlugin::new(PluginId(1), config(&dir, true)).unwrap();
    assert!(victim.pull_unexpected().unwrap());
    let uri = victim.self_addr().uri().to_owned();
    let mut honest = SmPlugin::new(PluginId(2), config(&dir, false)).unwrap();
    let mut hostile = SmPlugin::new(PluginId(3), config(&dir, false)).unwrap();
    let h_to_v = honest.lookup(&uri).unwrap();
    let x_to_v = hostile.lookup(&uri).unwrap();
    // Acknowledged once a client holds the victim's eventfd (a pulse, one
    // write of 1, is harmless: an extra wake-up).
    let end = Instant::now() + T;
    loop {
        assert!(Instant::now() < end, "the handshakes never ended");
        victim.progress().unwrap();
        honest.progress().unwrap();
        hostile.progress().unwrap();
        if victim.stats().peers == 2
            && honest.debug_tamper_peer_wake(&h_to_v, WakeTamper::Pulse).is_ok()
            && hostile.debug_tamper_peer_wake(&x_to_v, WakeTamper::Pulse).is_ok()
        {
            break;
        }
    }
    // Settle the pulses' events.
    victim.progress().unwrap();
    Three {
        dir,
        victim,
        honest,
        hostile,
        h_to_v,
        x_to_v,
    }
}

/// Takes every waiting unexpected message; returns their tags.
fn take_all(p: &mut SmPlugin) -> Vec<u32> {
    let mut buf = Vec::new();
    let mut tags = Vec::new();
    while let Some((_, tag)) = p.take_unexpected(&mut buf).unwrap() {
        tags.push(tag);
    }
    tags
}

/// The victim sleeps (blocking, no timeout) on its own thread; once it
/// has armed (the honest client sees its sleep flag) the honest client
/// sends `tag`: the victim must wake and take it. Returns the victim.
fn honest_wakes_sleeping_victim(mut t: Three, tag: u32, what: &str) -> Three {
    let mut victim = t.victim;
    let (tx, rx) = std::sync::mpsc::channel();
    let sleeper = std::thread::spawn(move || {
        let end = Instant::now() + T;
        let mut got = Vec::new();
        while !got.contains(&tag) && Instant::now() < end {
            // Plugin::sleep arms (raising the sleep flags) and waits on
            // the plugin's epoll set, with no timeout: only an event ends it.
            victim.sleep(None).unwrap();
            victim.progress().unwrap();
            got.extend(take_all(&mut victim));
        }
        let _ = tx.send(got);
        victim
    });
    let end = Instant::now() + T;
    while !t.honest.debug_peer_sleeps(&t.h_to_v).unwrap() {
        assert!(Instant::now() < end, "{what}: the victim never armed for a sleep");
        std::thread::sleep(Duration::from_millis(1));
    }
    t.honest
        .send_unexpected(&t.h_to_v, tag, b"honest", OpId(tag as u64))
        .unwrap();
    let got = rx.recv_timeout(T).unwrap_or_else(|_| {
        panic!("{what}: the victim asleep was never woken by the honest client's message")
    });
    assert!(
        got.contains(&tag),
        "{what}: took {got:?}, not the honest message {tag}"
    );
    t.victim = sleeper.join().unwrap();
    t
}

/// The hostile client brings the victim's eventfd for its connection to
/// the counter's maximum, then reads it down to 0: the honest client's
/// wake-ups of the victim, on an eventfd of their own, still wake it.
#[test]
fn a_saturated_or_emptied_wake_eventfd_costs_no_other_peer_its_wake_ups() {
    let mut t = three("hostile-wake-others");
    t.hostile
        .debug_tamper_peer_wake(&t.x_to_v, WakeTamper::Saturate)
        .unwrap();
    t = honest_wakes_sleeping_victim(t, 1, "counter saturated");
    t.hostile
        .debug_tamper_peer_wake(&t.x_to_v, WakeTamper::Empty)
        .unwrap();
    t = honest_wakes_sleeping_victim(t, 2, "counter emptied");
    // The hostile client is not taken for gone or faulty: it only spoiled
    // its own wake-ups.
    let st = t.victim.stats();
    assert_eq!((st.peers, st.protocol_errors), (2, 0));
    let _ = std::fs::remove_dir_all(&t.dir);
}

/// The hostile client saturates the eventfd the victim wakes it on and
/// clears `O_NONBLOCK` on it (the description is shared), then asks to
/// be woken when the victim frees room and sends: the victim's wake-up
/// write must return (a write of 1 would block for good), without
/// failing the hostile client, and the victim keeps serving the honest one.
#[test]
fn a_peer_blocking_and_saturating_its_own_eventfd_cannot_hang_us() {
    let mut t = three("hostile-wake-block");
    t.hostile
        .debug_tamper_own_wake(&t.x_to_v, WakeTamper::Saturate)
        .unwrap();
    t.hostile
        .debug_tamper_own_wake(&t.x_to_v, WakeTamper::Blocking)
        .unwrap();
    let signals_before = t.victim.stats().signals_sent;
    let mut victim = t.victim;
    let (tx, rx) = std::sync::mpsc::channel();
    let (x, xa) = (&mut t.hostile, t.x_to_v.clone());
    for round in 0..3u64 {
        // Waiting for room: the victim writes its eventfd once it took
        // the message and published how far it read.
        x.debug_want_wake(&xa).unwrap();
        x.send_unexpected(&xa, 9, b"hostile", OpId(100 + round)).unwrap();
        x.progress().unwrap();
        let victim_thread = std::thread::spawn({
            let tx = tx.clone();
            move || {
                let end = Instant::now() + T;
                let mut got = Vec::new();
                while got.is_empty() && Instant::now() < end {
                    victim.progress().unwrap();
                    got.extend(take_all(&mut victim));
                }
                // The take's read position is published by the next call,
                // which wakes the waiting sender.
                victim.progress().unwrap();
                let _ = tx.send(got);
                victim
            }
        });
        let got = rx
            .recv_timeout(T)
            .expect("the victim hung writing the hostile peer's eventfd");
        assert_eq!(got, vec![9], "round {round}");
        victim = victim_thread.join().unwrap();
        let st = victim.stats();
        assert_eq!(
            (st.peers, st.protocol_errors),
            (2, 0),
            "round {round}: the hostile peer was failed for what it did to its own eventfd"
        );
    }
    assert!(
        victim.stats().signals_sent > signals_before,
        "the victim never wrote the hostile peer's eventfd: nothing tested"
    );
    t.victim = victim;
    let t = honest_wakes_sleeping_victim(t, 3, "after the hostile peer's tampering");
    let _ = std::fs::remove_dir_all(&t.dir);
}

/// The hostile client writes the victim's eventfd in a storm: the victim
/// still serves the honest client meanwhile, and once the storm ends
/// (the counter left at its maximum) its fd is quiet: a harvest, and
/// nothing is ready any more (no busy loop for a huge counter).
#[test]
fn a_storm_of_wake_ups_starves_nobody_and_stops_with_the_storm() {
    let Three {
        dir,
        mut victim,
        mut honest,
        mut hostile,
        h_to_v,
        x_to_v,
    } = three("hostile-wake-storm");
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let storm = std::thread::spawn({
        let (stop, writes) = (stop.clone(), writes.clone());
        move || {
            while !stop.load(Ordering::Relaxed) {
                hostile
                    .debug_tamper_peer_wake(&x_to_v, WakeTamper::Pulse)
                    .unwrap();
                writes.fetch_add(1, Ordering::Relaxed);
            }
            hostile
                .debug_tamper_peer_wake(&x_to_v, WakeTamper::Saturate)
                .unwrap();
            hostile
        }
    });
    let end = Instant::now() + T;
    while writes.load(Ordering::Relaxed) < 1000 {
        assert!(Instant::now() < end, "the storm never started");
        std::thread::yield_now();
    }
    const MESSAGES: u32 = 200;
    let mut got = Vec::new();
    let mut seen = writes.load(Ordering::Relaxed);
    for i in 0..MESSAGES {
        // Interleaved by construction: storm writes between any two
        // honest messages.
        while writes.load(Ordering::Relaxed) == seen {
            assert!(Instant::now() < end, "the storm stopped");
            victim.progress().unwrap();
            std::thread::yield_now();
        }
        seen = writes.load(Ordering::Relaxed);
        honest
            .send_unexpected(&h_to_v, i, b"honest", OpId(i as u64))
            .unwrap();
        while got.len() <= i as usize {
            assert!(
                Instant::now() < end,
                "only {} of {MESSAGES} honest messages taken during the storm",
                got.len()
            );
            victim.progress().unwrap();
            got.extend(take_all(&mut victim));
            honest.progress().unwrap();
        }
    }
    assert_eq!(got, (0..MESSAGES).collect::<Vec<_>>());
    stop.store(true, Ordering::Relaxed);
    let _hostile = storm.join().unwrap();
    // The storm's last events and the saturating write: harvested by one
    // progress call, after which the victim may sleep and its fd is quiet.
    victim.progress().unwrap();
    assert!(
        victim.try_wait().unwrap(),
        "the victim may not sleep after the storm"
    );
    let fd = std::os::fd::AsRawFd::as_raw_fd(&victim.poll_fd().unwrap());
    let (n, ready) = common::sys::poll_one(fd, libc::POLLIN, 0);
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    assert_eq!(
        ready & libc::POLLIN,
        0,
        "the victim's fd stays ready with the counter at its maximum: a busy loop"
    );
    let st = victim.stats();
    assert_eq!((st.peers, st.protocol_errors), (2, 0));
    let _ = std::fs::remove_dir_all(&dir);
}
