//! A response whose send fails at its completion while its connection
//! stays up (na-verbs: a post error; soft-RoCE offers no way to provoke
//! one, so the server's plugin fails every message over a size as one
//! would, `VerbsConfig::debug.fail_msgs_over`, and gives the message and
//! its destination back in the completion as for a real one). The
//! caller's watch never fires, so only the target can tell it: it sends
//! a short `ResponseNotSent` error in the response's place, and the call
//! (no deadline) ends with it at once. (Before: the failed send was only
//! counted and logged, and the call waited for ever.) If that error
//! fails too, it is counted and nothing more is sent; a spilled output
//! the lost response described is let go. An answer from no handler
//! (busy here) goes again with its status instead, once.

use std::time::{Duration, Instant};

use hg_rpc::{CallId, Engine, Rpc, RpcError, RpcStats};
use na_core::{Endpoint, Plugin, ProgressMode};

use super::eager_limits::call_within;
use super::rpcs::{fill_output, Add, Fill, Sleep};
use super::{rdma_spec, T};

/// A listening server on `spec` whose plugin fails every message longer
/// than `fail_over` bytes at its completion, serving [`Add`] and [`Fill`].
fn failing_server(spec: &str, fail_over: usize) -> Engine {
    failing_server_counted(spec, fail_over, None)
}

/// [`failing_server`] whose plugin fails only the first `count` such
/// messages (`None`: all).
fn failing_server_counted(spec: &str, fail_over: usize, count: Option<usize>) -> Engine {
    let mut cfg = na_verbs::VerbsFactory::default()
        .config_for(spec, true)
        .expect("verbs config");
    cfg.debug.fail_msgs_over = Some(fail_over);
    cfg.debug.fail_msgs_count = count;
    let mut ep = Endpoint::new(ProgressMode::default()).expect("endpoint");
    let id = ep
        .add_plugin(|id| Ok(Box::new(na_verbs::VerbsPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .expect("verbs plugin");
    let mut srv = Engine::new(ep, id).expect("server engine");
    srv.register::<Add>(|(a, b)| Ok(a + b)).expect("register");
    srv.register::<Fill>(|(len, seed)| Ok(fill_output(len, seed)))
        .expect("register");
    srv
}

/// Drives both engines for `turns` rounds.
fn drive(c: &mut Engine, srv: &mut Engine, turns: usize) {
    for _ in 0..turns {
        for e in [&mut *c, &mut *srv] {
            e.progress(Some(Duration::from_millis(1))).expect("progress");
            e.trigger().expect("trigger");
        }
    }
}

/// Drives both engines until the server counted two failed sends
/// (within [`T`]; `what` names the two in the failure message), then
/// more turns, and asserts that nothing else was sent for them: two sends
/// failed, one response replaced, one dropped. Returns the server's stats.
fn two_sends_fail_and_no_more(c: &mut Engine, srv: &mut Engine, what: &str) -> RpcStats {
    let end = Instant::now() + T;
    while srv.stats().sends_failed < 2 {
        assert!(
            Instant::now() < end,
            "{what} did not both fail; server {:?}",
            srv.stats()
        );
        drive(c, srv, 1);
    }
    // More turns: nothing else is sent for them.
    drive(c, srv, 200);
    let st = srv.stats();
    assert_eq!(
        (st.sends_failed, st.responses_replaced, st.responses_dropped),
        (2, 1, 1),
        "{st:?}"
    );
    st
}

/// Asserts that call `id` (of RPC `R`) has not ended, and abandons it.
fn assert_call_never_ended<R: Rpc>(c: &mut Engine, id: CallId) {
    assert!(
        c.take_response::<R>(id).is_none(),
        "the call ended although nothing reached it"
    );
    c.abandon(id);
}

/// A response over the server's failing size (an eager output) fails at
/// its completion; the call, with no deadline, ends with
/// `ResponseNotSent` naming the post error, well within 30 s. The
/// connection stands: small calls go on.
#[test]
fn a_response_failing_at_completion_ends_its_call_with_response_not_sent_over_verbs() {
    let Some(spec) =
        rdma_spec("a_response_failing_at_completion_ends_its_call_with_response_not_sent_over_verbs")
    else {
        return;
    };
    let mut srv = failing_server(&spec, 512);
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    let bound = Duration::from_secs(30);
    assert_eq!(
        call_within::<Add>(&mut c, &mut srv, &s, &(1, 2), bound).expect("add"),
        3
    );
    // 600 bytes: eager (under any engine's floor), over the failing size.
    match call_within::<Fill>(&mut c, &mut srv, &s, &(600, 3), bound) {
        Err(RpcError::ResponseNotSent { rpc, reason }) => {
            assert_eq!(rpc, "test.fill");
            assert!(
                reason.contains("debug.fail_msgs_over") && reason.contains("bytes"),
                "the reason does not say what failed: {reason}"
            );
        }
        other => panic!("expected ResponseNotSent, got {other:?}"),
    }
    let st = srv.stats();
    assert_eq!(
        (st.sends_failed, st.responses_replaced, st.responses_dropped),
        (1, 1, 0),
        "{st:?}"
    );
    for i in 0..20u64 {
        assert_eq!(
            call_within::<Add>(&mut c, &mut srv, &s, &(i, 1), T).expect("add after the lost response"),
            i + 1
        );
    }
    assert_eq!(c.stats().in_flight, 0);
}

/// Every message of the server fails (its error in the response's place
/// too): the error goes after the lost response once (counted as a
/// replacement), its own failure counts the response as dropped, and
/// nothing else is sent (no loop); the spilled output
/// the lost response described is let go, not kept for its TTL. The
/// call, given a deadline here, times out.
#[test]
fn a_lost_error_in_place_is_counted_once_and_a_lost_spilled_output_is_let_go_over_verbs() {
    let Some(spec) =
        rdma_spec("a_lost_error_in_place_is_counted_once_and_a_lost_spilled_output_is_let_go_over_verbs")
    else {
        return;
    };
    let mut srv = failing_server(&spec, 16);
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    // An output past the eager limit: exposed, and described by a
    // response that fails.
    let id = c.forward::<Fill>(&s, &(20_000, 5)).expect("forward");
    let st = two_sends_fail_and_no_more(&mut c, &mut srv, "the response and its error");
    assert_eq!(
        (st.exposed_outputs, st.exposed_bytes),
        (0, 0),
        "the lost response's output is still exposed: {st:?}"
    );
    assert_call_never_ended::<Fill>(&mut c, id);
}

/// A server that answers every call of [`Sleep`] busy (a deferred handler
/// with no room), whose plugin fails the first `count` messages over 16
/// bytes (`None`: all) at their completion.
fn busy_server(spec: &str, count: Option<usize>) -> Engine {
    let mut srv = failing_server_counted(spec, 16, count);
    srv.register_deferred::<Sleep>().expect("register");
    srv.set_max_deferred(0, 0);
    srv
}

/// A busy answer that fails at its completion goes again with its status
/// (not `ResponseNotSent`: nothing ran, and the caller's retry policy is
/// keyed on busy), and the call ends with `Busy`.
#[test]
fn a_busy_answer_failing_at_completion_goes_again_as_busy_over_verbs() {
    let Some(spec) = rdma_spec("a_busy_answer_failing_at_completion_goes_again_as_busy_over_verbs") else {
        return;
    };
    let mut srv = busy_server(&spec, Some(1));
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    match call_within::<Sleep>(&mut c, &mut srv, &s, &1, Duration::from_secs(30)) {
        Err(RpcError::Busy { reason, .. }) => assert!(reason.starts_with("target busy"), "{reason}"),
        other => panic!("expected Busy, got {other:?}"),
    }
    let st = srv.stats();
    assert_eq!(
        (st.sends_failed, st.responses_replaced, st.responses_dropped),
        (1, 1, 0),
        "{st:?}"
    );
}

/// Every message of the server fails: the busy answer goes again once,
/// and when that fails too nothing more is sent, although its status is
/// busy, not `ResponseNotSent` (its send's id marks it as sent in a lost
/// answer's place: no loop).
#[test]
fn a_busy_answer_sent_again_is_not_sent_a_third_time_over_verbs() {
    let Some(spec) = rdma_spec("a_busy_answer_sent_again_is_not_sent_a_third_time_over_verbs") else {
        return;
    };
    let mut srv = busy_server(&spec, None);
    let mut c = Engine::from_spec(&spec, false, ProgressMode::default()).expect("client engine");
    let s = c.endpoint().lookup(srv.self_addr().uri()).expect("lookup");
    let id = c.forward::<Sleep>(&s, &1).expect("forward");
    two_sends_fail_and_no_more(&mut c, &mut srv, "the busy answer and its second try");
    assert_call_never_ended::<Sleep>(&mut c, id);
}
