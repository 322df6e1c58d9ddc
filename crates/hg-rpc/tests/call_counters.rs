//! Every call an origin counts in `RpcStats::calls` ends in one counter:
//! `succeeded`, `errors` or `abandoned` (the identity
//! `tests/user_story.rs` checks on a crowd of calls), here one call of
//! each kind at a time, through the blocking API and an `AsyncEngine`.

use std::time::Duration;

use hg_rpc::RpcError;
use serde_bytes::ByteBuf;

mod common;
use common::{client, dir, endpoint, Server};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod testpeer_rpcs;

/// Generous, for a loaded 2-core machine.
const T: Duration = Duration::from_secs(60);

/// The blocking API's side of the identity the story checks: a call
/// abandoned counts once in `abandoned` (again, or after its answer was
/// taken, not at all), a timed-out one in `errors` only, and a refusal
/// before anything went out in `errors` but not `calls`.
#[test]
fn every_call_ends_in_one_counter() {
    use testpeer_rpcs::{Echo, Fail, Sleep};
    let d = dir("user-story-counted");
    let srv = Server::start(&d);
    let mut c = client(&d);
    let s = c.lookup(&srv.uri).unwrap();
    // One of each end.
    assert_eq!(
        c.call::<Echo>(&s, &ByteBuf::from(vec![1, 2, 3]), T).unwrap(),
        vec![1, 2, 3]
    );
    assert!(c.call::<Fail>(&s, &"no".into(), T).is_err());
    assert!(matches!(
        c.call::<Sleep>(&s, &3000, Duration::from_millis(100)),
        Err(RpcError::Timeout { .. })
    ));
    let slow = c.forward::<Sleep>(&s, &2000).unwrap();
    c.abandon(slow);
    c.abandon(slow);
    // The single-threaded server answers it only after both sleeps (5 s of
    // them): wait with the generous deadline, not `common::wait`'s 10 s.
    let taken = c.forward::<Echo>(&s, &ByteBuf::from(vec![4])).unwrap();
    assert_eq!(wait_long::<Echo>(&mut c, taken).unwrap(), vec![4]);
    c.abandon(taken);
    let st = c.stats();
    assert_eq!(st.calls, 5, "{st:?}");
    assert_eq!((st.succeeded, st.errors, st.abandoned), (2, 2, 1), "{st:?}");
    assert_eq!(st.calls, st.succeeded + st.errors + st.abandoned, "{st:?}");
    // A call refused before its request went out: an error, no call.
    let foreign = {
        let (mut other, _) = endpoint(&d, false);
        other.lookup(&srv.uri).unwrap()
    };
    assert!(c.forward::<Echo>(&foreign, &ByteBuf::from(vec![5])).is_err());
    assert!(c.call::<Echo>(&foreign, &ByteBuf::from(vec![5]), T).is_err());
    let st2 = c.stats();
    assert_eq!((st2.calls, st2.succeeded, st2.abandoned), (5, 2, 1), "{st2:?}");
    // `forward`'s caller has its error; `call` counts it.
    assert_eq!(st2.errors, 3, "{st2:?}");
}

/// The result of call `id` on `c`, driving it for at most [`T`].
fn wait_long<R: hg_rpc::Rpc>(c: &mut hg_rpc::Engine, id: hg_rpc::CallId) -> hg_rpc::Result<R::Output> {
    let end = std::time::Instant::now() + T;
    loop {
        if let Some(r) = c.take_response::<R>(id) {
            return r;
        }
        assert!(std::time::Instant::now() < end, "no result within {T:?}");
        c.progress(Some(Duration::from_millis(20))).unwrap();
        c.trigger().unwrap();
    }
}

/// The same over an `AsyncEngine`: a call that times out counts in
/// `errors` only; a future dropped mid-flight in `abandoned` only.
#[test]
fn async_timeouts_are_errors_and_drops_are_abandoned() {
    use testpeer_rpcs::{Echo, Sleep};
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (srv, e) = common::async_setup("user-story", hg_rpc::ProgressMode::default(), Duration::ZERO);
        let s = e.lookup(&srv.server.uri).await.unwrap();
        assert_eq!(
            e.call::<Echo>(&s, &ByteBuf::from(vec![1]), T).await.unwrap(),
            vec![1]
        );
        assert!(matches!(
            e.call::<Sleep>(&s, &3000, Duration::from_millis(100)).await,
            Err(RpcError::Timeout { .. })
        ));
        let mut dropped = Box::pin(e.call::<Sleep>(&s, &3000, T));
        assert!(
            common::poll_once(&mut dropped).await.is_none(),
            "answered at once"
        );
        drop(dropped);
        let st = e.stats();
        assert_eq!(st.calls, 3, "{st:?}");
        assert_eq!((st.succeeded, st.errors, st.abandoned), (1, 1, 1), "{st:?}");
    });
}
