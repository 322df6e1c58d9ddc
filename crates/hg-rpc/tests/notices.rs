//! Notices a peer holds memory for, refused by a full send backlog and
//! sent again: here a target's acknowledgement of a spilled one-way
//! request it pulled (the origin keeps the input exposed until it comes).
//! The releases of pulled outputs are in `failure_paths`.

use std::time::{Duration, Instant};

use hg_rpc::Engine;

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

/// The origin stops reading, so the target's backlog to it fills and a
/// response is dropped; then the target pulls a spilled one-way request
/// of that origin. Its acknowledgement waits, and goes once the origin
/// reads again: the origin lets the input go seconds later, not after
/// its 60 s TTL.
#[test]
fn an_acknowledgement_refused_by_a_full_backlog_is_sent_again() {
    let d = dir("ack-again");
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
    c.forward_one_way::<Echo>(&s, &vec![3u8; 64 << 10]).unwrap();
    assert_eq!(c.stats().abandoned_inputs, 1, "{:?}", c.stats());
    // The target pulls it (behind the calls still queued): its ack finds
    // the backlog full, and waits (the only notice a target sends).
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
    // Both run again: the ack goes once the origin reads.
    let end = Instant::now() + Duration::from_secs(5);
    while c.stats().abandoned_inputs > 0 {
        assert!(
            Instant::now() < end,
            "the origin still holds the input 5 s later (the ack was lost): {:?} / {:?}",
            c.stats(),
            srv.stats()
        );
        turn(&mut c);
        turn(&mut srv);
    }
    assert_eq!(c.stats().abandoned_bytes, 0, "{:?}", c.stats());
    assert_eq!(srv.notices_waiting(), 0);
}
