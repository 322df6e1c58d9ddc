//! A release notice whose send fails at its completion while its
//! connection stays up (na-verbs: a post error; the client's plugin fails
//! one message over a size as one would, `VerbsConfig::debug.fail_msgs_over`
//! and `debug.fail_msgs_count`, and gives it back in the completion as for
//! a real one). The origin recognises the returned notice and sends it
//! again through its notice queue, so the target releases the spilled
//! output at once. (Before: the failure was only logged, and the target
//! kept the output exposed, and a drain waited, for its 60 s TTL.)
//! The same for a target's acknowledgement of a pulled spilled one-way
//! request: sent again, so the origin lets the input go at once. (Before:
//! it was taken for a response and answered with a `ResponseNotSent`
//! error in its place; when that failed too, the origin kept the input
//! exposed for its 60 s TTL.)

use std::time::{Duration, Instant};

use hg_rpc::Engine;
use na_core::{Endpoint, Plugin, ProgressMode};
use serde_bytes::ByteBuf;

use super::rpcs::{fill_output, fill_pattern, Fill, RecordBlob};
use super::{client_state, rdma_spec, T};

/// A client on `spec` whose plugin fails the first `count` messages
/// longer than `fail_over` bytes at their completion.
fn failing_client(spec: &str, fail_over: usize, count: usize) -> Engine {
    failing_engine(spec, false, fail_over, count)
}

/// An engine on `spec` (listening if `listen`) whose plugin fails the
/// first `count` messages longer than `fail_over` bytes at their
/// completion.
fn failing_engine(spec: &str, listen: bool, fail_over: usize, count: usize) -> Engine {
    let mut cfg = na_verbs::VerbsFactory::default()
        .config_for(spec, listen)
        .expect("verbs config");
    cfg.debug.fail_msgs_over = Some(fail_over);
    cfg.debug.fail_msgs_count = Some(count);
    let mut ep = Endpoint::new(ProgressMode::default()).expect("endpoint");
    let id = ep
        .add_plugin(|id| Ok(Box::new(na_verbs::VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .expect("verbs plugin");
    Engine::new(ep, id).expect("engine")
}

fn turn(c: &mut Engine, srv: &mut Engine) {
    for e in [&mut *c, &mut *srv] {
        e.progress(Some(Duration::from_millis(1))).expect("progress");
        e.trigger().expect("trigger");
    }
}

/// The release of a pulled spilled output fails once at its completion:
/// it goes again, and the server lets the output go well before its TTL
/// (60 s; the bound here is 30 s).
#[test]
fn a_release_notice_failing_at_completion_is_sent_again_over_verbs() {
    let Some(spec) = rdma_spec("a_release_notice_failing_at_completion_is_sent_again_over_verbs") else {
        return;
    };
    let mut srv = Engine::from_spec(&spec, true, ProgressMode::default()).expect("server engine");
    srv.register::<Fill>(|(len, seed)| Ok(fill_output(len, seed)))
        .expect("register");
    // 39 bytes: the request (a 32-byte header and 4 bytes of input)
    // passes; the release (the header and an 8-byte cookie) fails, once.
    let mut c = failing_client(&spec, 39, 1);
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    // An output past the eager limit: exposed, pulled, then released.
    let id = c.forward::<Fill>(&s, &(20_000, 5)).expect("forward");
    let end = Instant::now() + T;
    let out = loop {
        if let Some(r) = c.take_response::<Fill>(id) {
            break r.expect("fill");
        }
        assert!(
            Instant::now() < end,
            "the call did not end; {}",
            client_state(&mut c)
        );
        turn(&mut c, &mut srv);
    };
    assert_eq!(out, fill_pattern(20_000, 5));
    let end = Instant::now() + Duration::from_secs(30);
    while srv.stats().exposed_outputs > 0 || c.stats().sends_failed == 0 {
        assert!(
            Instant::now() < end,
            "the output is still exposed 30 s on (its release was not sent again); server {:?}, client {:?}",
            srv.stats(),
            c.stats()
        );
        turn(&mut c, &mut srv);
    }
    let (cs, ss) = (c.stats(), srv.stats());
    assert_eq!(cs.sends_failed, 1, "the release failed once: {cs:?}");
    assert_eq!((ss.exposed_outputs, ss.exposed_bytes), (0, 0), "{ss:?}");
    assert_eq!(c.notices_waiting(), 0);
}

/// The acknowledgement of a pulled spilled one-way request fails at its
/// completion, twice (its first send and its first retry): it goes again
/// through the notice queue (not taken for a response: no
/// `ResponseNotSent` error in its place), and the origin lets the input
/// go well before its TTL (60 s; the bound here is 30 s).
#[test]
fn an_acknowledgement_failing_at_completion_is_sent_again_over_verbs() {
    let Some(spec) = rdma_spec("an_acknowledgement_failing_at_completion_is_sent_again_over_verbs") else {
        return;
    };
    // 31 bytes: the server sends nothing but the acknowledgement (a
    // 32-byte header), which fails twice.
    let mut srv = failing_engine(&spec, true, 31, 2);
    let got = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = got.clone();
    srv.register::<RecordBlob>(move |blob| {
        seen.store(blob.len(), std::sync::atomic::Ordering::SeqCst);
        Ok(())
    })
    .expect("register");
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    // An input past the eager limit: exposed, pulled, then acknowledged.
    let big = ByteBuf::from(vec![9u8; 64 << 10]);
    c.forward_one_way::<RecordBlob>(&s, &big)
        .expect("forward one-way");
    assert_eq!(c.stats().abandoned_inputs, 1, "{:?}", c.stats());
    let end = Instant::now() + Duration::from_secs(30);
    while c.stats().abandoned_inputs > 0 || srv.stats().sends_failed < 2 {
        assert!(
            Instant::now() < end,
            "the input is still exposed 30 s on (its acknowledgement was not sent again); server {:?}, client {:?}",
            srv.stats(),
            c.stats()
        );
        turn(&mut c, &mut srv);
    }
    assert_eq!(
        got.load(std::sync::atomic::Ordering::SeqCst),
        big.len(),
        "the handler ran"
    );
    let (cs, ss) = (c.stats(), srv.stats());
    assert_eq!(ss.sends_failed, 2, "the acknowledgement failed twice: {ss:?}");
    assert_eq!(
        (ss.responses_replaced, ss.responses_dropped),
        (0, 0),
        "an acknowledgement is no response: {ss:?}"
    );
    assert_eq!(
        (cs.abandoned_inputs, cs.abandoned_bytes, cs.in_flight),
        (0, 0, 0),
        "{cs:?}"
    );
    assert_eq!((cs.malformed, cs.stray_responses), (0, 0), "{cs:?}");
    assert_eq!(srv.notices_waiting(), 0);
}
