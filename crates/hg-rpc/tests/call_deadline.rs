//! The deadline of a blocking call ([`hg_rpc::Engine::call`]), with a
//! server process (`hg-rpc-testpeer`) over na-sm whose handler answers
//! far too late: the call gives up within a small margin of its timeout,
//! whether nothing else comes (the wait for the response is bounded by
//! the time left) or other traffic keeps its engine busy all along (the
//! deadline is looked at between turns that found work too).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, endpoint, Server};

const T: Duration = Duration::from_secs(30);

#[test]
fn a_blocking_call_times_out_on_time_while_other_traffic_keeps_its_engine_busy() {
    let d = dir("call-deadline");
    let srv = Server::start(&d);
    // The client listens: a peer of its own sends it requests all along.
    let (ep, id) = endpoint(&d, true);
    let mut c = Engine::new(ep, id).unwrap();
    c.register::<Record>(|_| Ok(())).unwrap();
    let c_uri = c.self_addr().uri().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let flooder = std::thread::spawn({
        let (stop, d) = (stop.clone(), d.to_path_buf());
        move || {
            let mut f = client(&d);
            let to = f.lookup(&c_uri).unwrap();
            // At most 10 s: a call that never looks at its deadline while
            // traffic comes then returns late instead of hanging the test.
            let end = Instant::now() + Duration::from_secs(10);
            while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                for i in 0..16 {
                    // A full send backlog refuses some: they are not needed.
                    let _ = f.forward_one_way::<Record>(&to, &i);
                }
                f.progress(Some(Duration::from_millis(1))).unwrap();
                f.trigger().unwrap();
            }
        }
    });
    let s = c.lookup(&srv.uri).unwrap();
    // The traffic flows before the call starts.
    let end = Instant::now() + T;
    while c.stats().handled < 100 {
        assert!(Instant::now() < end, "no traffic: {:?}", c.stats());
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
    let before = c.stats().handled;
    // The server's handler sleeps 20 s: no answer comes in time.
    let start = Instant::now();
    let r = c.call::<Sleep>(&s, &20_000, Duration::from_millis(200));
    let took = start.elapsed();
    let handled = c.stats().handled - before;
    stop.store(true, Ordering::Relaxed);
    flooder.join().unwrap();
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?} after {took:?}");
    assert!(
        took < Duration::from_secs(2),
        "a 200 ms call returned after {took:?}"
    );
    assert!(
        handled > 0,
        "no traffic while the call waited: the test did not test it"
    );
}

#[test]
fn a_blocking_call_to_a_silent_handler_times_out_on_time() {
    let d = dir("call-deadline-idle");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.lookup(&srv.uri).unwrap();
    c.call::<Add>(&s, &(1, 2), T).unwrap();
    // Nothing else comes: the wait for the response is bounded by the
    // call's own deadline.
    let start = Instant::now();
    let r = c.call::<Sleep>(&s, &20_000, Duration::from_millis(200));
    let took = start.elapsed();
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?} after {took:?}");
    assert!(
        took < Duration::from_secs(2),
        "a 200 ms call returned after {took:?}"
    );
}
