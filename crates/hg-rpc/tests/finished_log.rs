//! `Engine::log_finished` / `take_finished`: which calls finished, without
//! asking each call in flight (what the tokio driver wakes its callers by).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use hg_rpc::{CallId, Engine};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, Server};

const T: Duration = Duration::from_secs(10);

/// Drives `c` until `want` more finished calls were logged; returns them.
fn drive_until_logged(c: &mut Engine, want: usize) -> Vec<CallId> {
    let mut got = Vec::new();
    let end = Instant::now() + T;
    while got.len() < want {
        assert!(Instant::now() < end, "only {} of {want} calls logged", got.len());
        c.progress(Some(Duration::from_millis(100))).unwrap();
        c.trigger().unwrap();
        c.take_finished(&mut got);
    }
    got
}

#[test]
fn the_log_names_each_finished_call_once_and_only_when_asked() {
    let d = dir("finished-log");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();

    // Off by default: finished calls leave nothing to take.
    let id = c.forward::<Add>(&s, &(1, 1)).unwrap();
    while !c.is_finished(id) {
        c.progress(Some(Duration::from_millis(100))).unwrap();
        c.trigger().unwrap();
    }
    let mut none = Vec::new();
    c.take_finished(&mut none);
    assert!(none.is_empty(), "logged while off: {none:?}");
    assert_eq!(c.take_response::<Add>(id).unwrap().unwrap(), 2);

    c.log_finished();
    // 300 calls at once: each is logged exactly once, answered or failed.
    let mut sent = HashSet::new();
    for i in 0..300u64 {
        let id = if i % 50 == 7 {
            c.forward::<Fail>(&s, &format!("no {i}")).unwrap()
        } else {
            c.forward::<Add>(&s, &(i, 1)).unwrap()
        };
        sent.insert(id);
    }
    let logged = drive_until_logged(&mut c, sent.len());
    let unique: HashSet<CallId> = logged.iter().copied().collect();
    assert_eq!(unique.len(), logged.len(), "a call was logged twice");
    assert_eq!(unique, sent);
    for id in &logged {
        assert!(c.is_finished(*id));
    }
    // Taking the log empties it.
    let mut again = Vec::new();
    c.take_finished(&mut again);
    assert!(again.is_empty(), "{again:?}");

    // An abandoned call is not logged when its late response comes (the
    // server answers it first); the call after it is.
    let stray_before = c.stats().stray_responses;
    let slow = c.forward::<Sleep>(&s, &100).unwrap();
    c.abandon(slow);
    let next = c.forward::<Add>(&s, &(2, 2)).unwrap();
    assert_eq!(drive_until_logged(&mut c, 1), vec![next]);
    let end = Instant::now() + T;
    while c.stats().stray_responses == stray_before {
        assert!(Instant::now() < end, "the abandoned call's response never came");
        c.progress(Some(Duration::from_millis(100))).unwrap();
        c.trigger().unwrap();
    }
    c.take_finished(&mut again);
    assert!(again.is_empty(), "the abandoned call was logged: {again:?}");

    // A self-forward finishes at once, and is logged at once.
    c.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    let me = c.self_addr().clone();
    let own = c.forward::<Add>(&me, &(3, 4)).unwrap();
    c.take_finished(&mut again);
    assert_eq!(again, vec![own]);
    assert_eq!(c.take_response::<Add>(own).unwrap().unwrap(), 7);
}
