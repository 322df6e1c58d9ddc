//! A request whose send fails at its completion, not at the send call:
//! na-verbs queues a message sent before its connection's hello, and
//! fails it alone with `MessageTooLarge` when the hello says the peer's
//! buffer is smaller. The connection stays up, so the engine's watch on
//! the peer never fires: only the send's failed completion can end the
//! call. It must end it at once with that error, not leave it waiting
//! for a deadline (here: none, so forever).
//!
//! The peer is a bare na-verbs endpoint (an engine refuses a limit under
//! `MIN_EAGER_SIZE`, and before the hello an engine sends eagerly up to
//! it: two engines never meet this case).

use std::time::{Duration, Instant};

use hg_rpc::{Engine, RpcError, MIN_EAGER_SIZE};
use na_core::NaError;
use serde_bytes::ByteBuf;

use super::eager_limits::verbs_endpoint;
use super::rpcs::{fill_pattern, Digest};
use super::{client_state, rdma_spec, T};

/// The bare peer's message limit: under what an engine sends eagerly
/// before the hello.
const PEER_MAX: usize = 256;

/// A call (no deadline) whose request was queued before the hello and is
/// too large for the peer ends with the send's `MessageTooLarge`, and the
/// failure is counted. (Before: the failed send was only logged and the
/// call never ended.)
#[test]
fn a_request_send_failing_at_completion_ends_its_call_over_verbs() {
    let Some(spec) = rdma_spec("a_request_send_failing_at_completion_ends_its_call_over_verbs") else {
        return;
    };
    let (mut peer, pid) = verbs_endpoint(&spec, true, PEER_MAX);
    let uri = peer.self_addr(pid).expect("peer address").uri().to_owned();
    let (ep, id) = verbs_endpoint(&spec, false, 4096);
    let mut c = Engine::new(ep, id).expect("engine");
    let s = c.endpoint().lookup(&uri).expect("lookup");
    // Eager (under MIN_EAGER_SIZE, header included) but past the peer's limit.
    let input = ByteBuf::from(fill_pattern(512, 1));
    assert!(input.len() + 64 < MIN_EAGER_SIZE && input.len() > PEER_MAX);
    let call = c
        .forward::<Digest>(&s, &input)
        .expect("forward: queued before the hello");
    let end = Instant::now() + T;
    let outcome = loop {
        if let Some(r) = c.take_response::<Digest>(call) {
            break r;
        }
        assert!(
            Instant::now() < end,
            "the call did not end within {T:?} although its request's send failed; {}",
            client_state(&mut c)
        );
        c.progress(Some(Duration::from_millis(1))).expect("progress");
        c.trigger().expect("trigger");
        peer.progress(Some(Duration::from_millis(1)))
            .expect("peer progress");
        while peer.pop_completion().is_some() {}
    };
    match outcome {
        Err(RpcError::Transport(NaError::MessageTooLarge { max, .. })) => assert_eq!(max, PEER_MAX),
        Err(e) => panic!(
            "the call ended with {}, not the send's MessageTooLarge",
            na_core::ErrorChain(&e)
        ),

        Ok(v) => panic!("the call succeeded ({v:?}) with no server"),
    }
    let st = c.stats();
    assert_eq!(st.sends_failed, 1, "{st:?}");
    assert_eq!(st.in_flight, 0, "{st:?}");
}
