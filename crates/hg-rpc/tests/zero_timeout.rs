//! A zero timeout means the same to `Engine::call` and
//! `AsyncEngine::call`: no wait. The request goes out and the call
//! answers only if its answer is there already (a call to the engine's
//! own address that a plain handler answered in place); otherwise it
//! fails at once with `RpcError::Timeout`, counted in `errors`, and the
//! engine goes on serving.

use std::time::Duration;

use hg_rpc::{Engine, RpcError};
use serde_bytes::ByteBuf;

mod common;
use common::{async_engine, client, dir, endpoint, Server};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::{Add, Echo};

/// Generous, for a loaded 2-core machine.
const T: Duration = Duration::from_secs(60);
const ZERO: Duration = Duration::ZERO;

#[test]
fn a_blocking_zero_timeout_takes_only_an_answer_already_there() {
    let d = dir("zero-timeout");
    // A call of its own address, answered in place by a plain handler.
    let (ep, id) = endpoint(&d, true);
    let mut me = Engine::new(ep, id).unwrap();
    me.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    let own = me.self_addr().clone();
    assert_eq!(me.call::<Add>(&own, &(2, 3), ZERO).unwrap(), 5);
    // A server process: its answer cannot be there yet.
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.lookup(&srv.uri).unwrap();
    assert_eq!(c.call::<Echo>(&s, &ByteBuf::from(vec![1]), T).unwrap(), vec![1]);
    for i in 0..20u8 {
        match c.call::<Echo>(&s, &ByteBuf::from(vec![i]), ZERO) {
            Err(RpcError::Timeout { millis: 0, .. }) => {}
            other => panic!("call {i}: expected a timeout at once, got {other:?}"),
        }
    }
    assert_eq!(c.call::<Echo>(&s, &ByteBuf::from(vec![2]), T).unwrap(), vec![2]);
    let st = c.stats();
    assert_eq!((st.succeeded, st.errors), (2, 20), "{st:?}");
}

/// On a current-thread runtime the driver cannot file the server's answer
/// between the request and the call's look at it: a zero timeout is a
/// timeout every time (before, the call waited for the tokio timer's next
/// tick, and the answer, a few microseconds away, usually came first).
#[tokio::test(flavor = "current_thread")]
async fn an_async_zero_timeout_takes_only_an_answer_already_there() {
    let d = dir("zero-timeout-async");
    let me = async_engine(&d, true);
    me.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    let own = me.self_addr();
    assert_eq!(me.call::<Add>(&own, &(2, 3), ZERO).await.unwrap(), 5);
    let srv = Server::start(&d);
    let c = async_engine(&d, false);
    let s = c.lookup(&srv.uri).await.unwrap();
    assert_eq!(
        c.call::<Echo>(&s, &ByteBuf::from(vec![1]), T).await.unwrap(),
        vec![1]
    );
    for i in 0..20u8 {
        match c.call::<Echo>(&s, &ByteBuf::from(vec![i]), ZERO).await {
            Err(RpcError::Timeout { millis: 0, .. }) => {}
            other => panic!("call {i}: expected a timeout at once, got {other:?}"),
        }
    }
    assert_eq!(
        c.call::<Echo>(&s, &ByteBuf::from(vec![2]), T).await.unwrap(),
        vec![2]
    );
    let st = c.stats();
    assert_eq!((st.succeeded, st.errors), (2, 20), "{st:?}");
}
