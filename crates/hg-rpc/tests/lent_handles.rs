//! Bulk handles a call's input lends to its target stay alive and exposed
//! until the target is done with them, even after the caller gave up: a
//! caller whose call timed out cannot take its buffers back (and free or
//! reuse them) while a slow but honest target may still write into them.
//! Real processes and real sm plugins.

use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError};
use na_core::Access;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{client, dir, Server};

const T: Duration = Duration::from_secs(10);

/// Drives `c` until its abandoned calls are gone (their late responses
/// came), at most 10 s.
fn until_nothing_abandoned(c: &mut Engine) {
    let end = Instant::now() + T;
    while c.stats().abandoned_inputs > 0 {
        assert!(Instant::now() < end, "abandoned calls kept: {:?}", c.stats());
        c.progress(Some(Duration::from_millis(10))).unwrap();
        c.trigger().unwrap();
    }
}

#[test]
fn a_handle_lent_to_a_call_that_timed_out_is_kept_until_the_target_answers() {
    let d = dir("lent");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.endpoint().lookup(&srv.uri).unwrap();
    let blob: Vec<u8> = (0..32 * 1024u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let put = c.expose(vec![blob.clone()], Access::ReadOnly).unwrap();
    c.call::<BlobPut>(&s, &("k".into(), put.clone()), T).unwrap();
    // Once answered, a call lends nothing any more.
    let _ = put
        .into_buffers()
        .expect("the answered call let go of its handle");
    // The single-threaded server is busy for a while: the next call waits
    // behind this one (on the same connection), past its own timeout.
    let busy = c.forward::<Sleep>(&s, &400).unwrap();
    let into = c.expose(vec![vec![0u8; blob.len()]], Access::ReadWrite).unwrap();
    let r = c.call::<BlobGet>(&s, &("k".into(), into.clone(), 0), Duration::from_millis(50));
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    // The caller gave up, but the target will still push into `into`: its
    // memory is kept, and the buffers cannot be taken back yet.
    assert_eq!(c.stats().abandoned_inputs, 1, "{:?}", c.stats());
    let into = *into
        .into_buffers()
        .expect_err("buffers taken back while the target may still write them");
    // The late response says the target is done: the handle is free, and
    // holds what the target wrote while it was kept.
    until_nothing_abandoned(&mut c);
    let got = into
        .into_buffers()
        .expect("the handle is let go after the answer");
    assert_eq!(got.concat(), blob);
    assert_eq!(c.stats().stray_responses, 1);
    // The call ahead of it finished meanwhile.
    c.take_response::<Sleep>(busy).expect("answered first").unwrap();
}

/// A target that dies, or never answers, does not keep a lent handle
/// forever: its end lets go at once, and the abandoned-input TTL bounds
/// the rest.
#[test]
fn a_lent_handle_is_let_go_when_the_target_dies_or_the_ttl_ends() {
    let d = dir("lent-end");
    for kill in [true, false] {
        let mut srv = Server::start(&d);
        let mut c = client(&d);
        c.set_abandoned_input_ttl(Duration::from_millis(300));
        let s = c.endpoint().lookup(&srv.uri).unwrap();
        // The server sleeps far longer than the test waits.
        let busy = c.forward::<Sleep>(&s, &5_000).unwrap();
        let into = c.expose(vec![vec![0u8; 4096]], Access::ReadWrite).unwrap();
        let r = c.call::<BlobGet>(&s, &("none".into(), into.clone(), 0), Duration::from_millis(50));
        assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
        let into = *into.into_buffers().expect_err("kept for the target");
        // An event loop of its own learns when to wake for the TTL (no
        // sooner than the engine's next sweep, at most a second away).
        let at = c.next_expiry().expect("a deadline for the kept handle");
        assert!(at <= Instant::now() + Duration::from_millis(1100), "{at:?}");
        if kill {
            srv.child.kill().unwrap();
        }
        c.abandon(busy);
        until_nothing_abandoned(&mut c);
        assert!(into.into_buffers().is_ok(), "kill {kill}: still held");
    }
}

/// A self-call whose input lends a handle, to a deferred handler, given
/// up on before the handler answers: the call (and the handle) is kept
/// until the answer, which then counts as stray, like any late answer.
#[test]
fn a_late_self_answer_to_a_call_that_lent_a_handle_is_stray_and_lets_it_go() {
    let d = dir("lent-self");
    let mut c = client(&d);
    c.register_deferred::<BlobGet>().unwrap();
    let me = c.self_addr().clone();
    let into = c.expose(vec![vec![0u8; 64]], Access::ReadWrite).unwrap();
    let id = c.forward::<BlobGet>(&me, &("k".into(), into.clone(), 0)).unwrap();
    let req = c.take_deferred().expect("the deferred request");
    c.abandon(id);
    let into = *into.into_buffers().expect_err("kept for the handler");
    assert_eq!(c.stats().abandoned_inputs, 1, "{:?}", c.stats());
    c.respond_deferred(req, Ok(postcard::to_allocvec(&0u64).unwrap()));
    let st = c.stats();
    assert_eq!(
        (st.stray_responses, st.abandoned_inputs, st.in_flight),
        (1, 0, 0),
        "{st:?}"
    );
    assert!(into.into_buffers().is_ok(), "still held after the answer");
}
