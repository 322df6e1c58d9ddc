//! A release notice whose send fails at its completion while its
//! connection stays up (na-verbs: a post error; the client's plugin fails
//! one message over a size as one would, `VerbsConfig::debug_fail_msgs_over`
//! and `debug_fail_msgs_count`, and gives it back in the completion as for
//! a real one). The origin recognises the returned notice and sends it
//! again through its notice queue, so the target releases the spilled
//! output at once. (Before: the failure was only logged, and the target
//! kept the output exposed, and a drain waited, for its 60 s TTL.)

use std::time::{Duration, Instant};

use hg_rpc::Engine;
use na_core::{Endpoint, Plugin, ProgressMode};

use super::rpcs::{fill_pattern, Fill};
use super::{client_state, rdma_spec, T};

/// A client on `spec` whose plugin fails the first `count` messages
/// longer than `fail_over` bytes at their completion.
fn failing_client(spec: &str, fail_over: usize, count: usize) -> Engine {
    let mut cfg = na_verbs::VerbsFactory::default()
        .config_for(spec, false)
        .expect("verbs config");
    cfg.debug_fail_msgs_over = Some(fail_over);
    cfg.debug_fail_msgs_count = Some(count);
    let mut ep = Endpoint::new(ProgressMode::default()).expect("endpoint");
    let id = ep
        .add_plugin(|id| Ok(Box::new(na_verbs::VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .expect("verbs plugin");
    Engine::new(ep, id).expect("client engine")
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
    srv.register::<Fill>(|(len, seed)| Ok(fill_pattern(len, seed)))
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
