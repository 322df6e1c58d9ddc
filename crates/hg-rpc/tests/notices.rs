//! Notices a peer holds memory for, refused by a full send backlog and
//! sent again: here a target's acknowledgement of a spilled one-way
//! request it pulled (the origin keeps the input exposed until it comes).
//! The releases of pulled outputs are in `failure_paths`.

use std::time::{Duration, Instant};

use hg_rpc::Engine;
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, small_backlog_engine};

const T: Duration = Duration::from_secs(10);

fn turn(e: &mut Engine) {
    e.progress_now().unwrap();
    e.trigger().unwrap();
}

/// A target (`srv`, whose backlog to its callers holds 4 KiB) and an
/// origin (`c`) that stopped reading, so that the target's backlog to it
/// filled and a response was dropped; then the target pulled a spilled
/// one-way request of that origin, and its acknowledgement waits (the
/// only notice a target sends).
fn an_ack_waits(tag: &str) -> (common::TestDir, Engine, Engine) {
    let d = dir(tag);
    let mut srv = small_backlog_engine(&d, true);
    srv.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    srv.register::<Echo>(Ok).unwrap();
    let mut c = client(&d);
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    // Calls the origin never reads the answers of, until the target's
    // backlog to it is full.
    let end = Instant::now() + T;
    while srv.stats().responses_dropped == 0 {
        assert!(
            Instant::now() < end,
            "the backlog never filled: {:?}",
            srv.stats()
        );
        c.forward::<Add>(&s, &(1, 2)).unwrap();
        // Its sends go out (its backlog flushes), nothing is taken in.
        c.progress_now().unwrap();
        turn(&mut srv);
    }
    // A spilled one-way request: its input stays exposed until the ack.
    c.forward_one_way::<Echo>(&s, &ByteBuf::from(vec![3u8; 64 << 10]))
        .unwrap();
    assert_eq!(c.stats().abandoned_inputs, 1, "{:?}", c.stats());
    // The target pulls it (behind the calls still queued): its ack finds
    // the backlog full, and waits.
    let end = Instant::now() + T;
    while srv.notices_waiting() == 0 {
        assert!(
            Instant::now() < end,
            "no ack waits (the one-way request never ran, or its ack was dropped): {:?}",
            srv.stats()
        );
        c.progress_now().unwrap();
        turn(&mut srv);
    }
    assert_eq!(srv.notices_waiting(), 1, "{:?}", srv.stats());
    (d, srv, c)
}

/// Drives both engines until the origin `c` holds no input (within 5 s:
/// far under its 60 s TTL, so the ack came).
fn the_input_is_let_go(c: &mut Engine, srv: &mut Engine) {
    let end = Instant::now() + Duration::from_secs(5);
    while c.stats().abandoned_inputs > 0 {
        assert!(
            Instant::now() < end,
            "the origin still holds the input 5 s later (the ack was lost): {:?} / {:?}",
            c.stats(),
            srv.stats()
        );
        turn(c);
        turn(srv);
    }
    assert_eq!(c.stats().abandoned_bytes, 0, "{:?}", c.stats());
    assert_eq!(srv.notices_waiting(), 0);
}

/// The origin stops reading, so the target's backlog to it fills and a
/// response is dropped; then the target pulls a spilled one-way request
/// of that origin. Its acknowledgement waits, and goes once the origin
/// reads again: the origin lets the input go seconds later, not after
/// its 60 s TTL.
#[test]
fn an_acknowledgement_refused_by_a_full_backlog_is_sent_again() {
    let (_d, mut srv, mut c) = an_ack_waits("ack-again");
    // Both run again: the ack goes once the origin reads.
    the_input_is_let_go(&mut c, &mut srv);
}

/// An acknowledgement is retried for as long as an origin keeps the
/// input (the abandoned-input TTL, 60 s here), not for the outputs' TTL:
/// a target whose outputs' TTL is short (100 ms) still sends it after
/// that, and the origin lets the input go at once (before, the target
/// dropped it after 100 ms and the origin held the input for its 60 s).
#[test]
fn an_acknowledgement_outlives_the_targets_outputs_ttl() {
    let ttl = Duration::from_millis(100);
    let (_d, mut srv, mut c) = an_ack_waits("ack-ttl");
    srv.set_spilled_output_ttl(ttl);
    // Three outputs' TTLs of retries while the origin does not read.
    let end = Instant::now() + 3 * ttl;
    while Instant::now() < end {
        c.progress_now().unwrap();
        turn(&mut srv);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        srv.notices_waiting(),
        1,
        "the ack was given up: {:?}",
        srv.stats()
    );
    the_input_is_let_go(&mut c, &mut srv);
}
