//! The wait of an async call for room for its spilled input: refused
//! for the inputs held for abandoned calls (`RpcError::InputsHeld`, bound
//! by `Engine::set_max_abandoned_bytes`), `AsyncEngine::call` and
//! `AsyncEngine::call_one_way_within` wait within their timeout, woken by
//! the driver when held bytes come back (a target answers or goes away, a
//! TTL ends), and end with the driver's stop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{AsyncEngine, Engine, RpcError};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;

mod common;
use common::TestDir;

const T: Duration = Duration::from_secs(10);

/// A call whose spilled input would pass the bound of inputs held for
/// abandoned calls waits for room within its timeout instead of failing
/// at once: here the room comes when a silent target's abandoned input
/// reaches its TTL, and the waiting call then goes to a live server and
/// is answered. A call whose timeout passes first fails with `InputsHeld`
/// (why it never went), not `Timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_for_held_inputs_waits_for_room() {
    // Bound whole: a field left out would be dropped here (the live
    // engine, the socket directory).
    let Held {
        engine,
        s,
        live: _live,
        to_live,
        records: _,
        big,
        silent,
        _dir,
    } = held_input("async-room", Duration::from_millis(500)).await;
    // No room before the TTL: a short call gives up with the reason.
    let errors = engine.stats().errors;
    let r = engine
        .call::<Echo>(&to_live, &big, Duration::from_millis(50))
        .await;
    assert!(matches!(r, Err(RpcError::InputsHeld { .. })), "{r:?}");
    assert_eq!(engine.stats().errors, errors + 1, "counted once");
    // A longer one waits: the TTL (500 ms, swept within a second) frees
    // the room, and it is answered.
    let refused = engine.stats().inputs_refused;
    let got = engine.call::<Echo>(&to_live, &big, T).await;
    match got {
        Ok(v) => assert!(v == big, "the echo differs"),
        Err(e) => panic!("the waiting call: {}", na_core::ErrorChain(&e)),
    }
    let st = engine.stats();
    assert!(st.inputs_refused > refused, "it was refused first: {st:?}");
    assert!(
        st.inputs_refused <= refused + 5,
        "it polled instead of waiting: {st:?}"
    );
    assert_eq!((st.in_flight, st.abandoned_inputs), (0, 0), "{st:?}");
    // A wait for room ends when the driver stops, with its error (a
    // stopped driver sweeps nothing: only the stop can end it before the
    // call's own timeout).
    let r = engine.call::<Echo>(&s, &big, Duration::from_millis(100)).await;
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    let engine = Arc::new(engine);
    let waiting = {
        let engine = engine.clone();
        let (to_live, big) = (to_live.clone(), big.clone());
        tokio::spawn(async move { engine.call::<Echo>(&to_live, &big, 3 * T).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    engine.shutdown().unwrap();
    let r = tokio::time::timeout(T, waiting)
        .await
        .expect("the wait ended")
        .unwrap();
    assert!(matches!(r, Err(RpcError::DriverStopped { .. })), "{r:?}");
    drop(silent);
}

/// An engine whose inputs held for abandoned calls leave no room for
/// another spilled input (`big`): a call to a silent target `s` (it takes
/// the connection, reads nothing, stays alive) was given up on, and its
/// input is kept until its TTL (`ttl`) ends; the bound is 100 KiB, `big`
/// 64 KiB. `live` answers `Echo` and counts the `RecordBlob`s it gets.
struct Held {
    engine: AsyncEngine,
    s: na_core::Addr,
    live: AsyncEngine,
    to_live: na_core::Addr,
    records: Arc<std::sync::atomic::AtomicUsize>,
    big: ByteBuf,
    silent: common::SilentTarget,
    _dir: TestDir,
}

async fn held_input(tag: &str, ttl: Duration) -> Held {
    let dir = common::dir(tag);
    let silent = common::SilentTarget::start(&dir);
    let x_uri = silent.uri.clone();
    let live = common::async_engine(&dir, true);
    live.register::<Echo>(Ok).unwrap();
    let records = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = records.clone();
    live.register::<RecordBlob>(move |_| {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    })
    .unwrap();
    let (ep, id) = common::endpoint(&dir, false);
    let mut e = Engine::new(ep, id).unwrap();
    e.set_abandoned_input_ttl(ttl);
    e.set_max_abandoned_bytes(100 << 10);
    let engine = AsyncEngine::spawn(e).unwrap();
    let s = engine.lookup(&x_uri).await.unwrap();
    let to_live = engine.lookup(&live.self_addr().to_string()).await.unwrap();
    let big = ByteBuf::from(vec![7u8; 64 << 10]);
    let r = engine.call::<Echo>(&s, &big, Duration::from_millis(100)).await;
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert_eq!(engine.stats().abandoned_inputs, 1, "{:?}", engine.stats());
    Held {
        engine,
        s,
        live,
        to_live,
        records,
        big,
        silent,
        _dir: dir,
    }
}

/// A one-way call whose spilled input finds no room (see [`held_input`]):
/// `call_one_way` refuses it at once, `call_one_way_within` waits for
/// room within its timeout (`InputsHeld` if none came, not a send), woken
/// when the TTL gives the held input back, and the request then reaches
/// the target. A wait dropped before room came (a call's or a one-way
/// call's) leaves nothing behind: no call in flight, no error counted, and
/// nothing sent once room comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_way_call_waits_for_room_and_a_dropped_wait_leaves_nothing() {
    let Held {
        engine,
        s,
        live: _live,
        to_live,
        records,
        big,
        silent: _silent,
        _dir,
    } = held_input("async-room-1w", Duration::from_millis(1500)).await;
    let r = engine.call_one_way::<RecordBlob>(&to_live, &big);
    assert!(matches!(r, Err(RpcError::InputsHeld { .. })), "{r:?}");
    let errors = engine.stats().errors;
    let r = engine
        .call_one_way_within::<RecordBlob>(&to_live, &big, Duration::from_millis(50))
        .await;
    assert!(matches!(r, Err(RpcError::InputsHeld { .. })), "{r:?}");
    assert_eq!(engine.stats().errors, errors + 1, "counted once");
    // Dropped while they wait: nothing in flight, the kept input alone.
    let call = engine.call::<Echo>(&to_live, &big, T);
    let r = tokio::time::timeout(Duration::from_millis(50), call).await;
    assert!(r.is_err(), "the call did not wait: {r:?}");
    let one_way = engine.call_one_way_within::<RecordBlob>(&to_live, &big, T);
    let r = tokio::time::timeout(Duration::from_millis(50), one_way).await;
    assert!(r.is_err(), "the one-way call did not wait: {r:?}");
    let st = engine.stats();
    assert_eq!(
        (st.in_flight, st.abandoned_inputs, st.errors),
        (0, 1, errors + 1),
        "{st:?}"
    );
    // Room comes with the TTL (1.5 s, swept within a second): a waiting
    // one-way call is sent, and the target gets it (and only it).
    let refused = st.inputs_refused;
    let r = engine.call_one_way_within::<RecordBlob>(&to_live, &big, T).await;
    assert!(r.is_ok(), "{r:?}");
    let st = engine.stats();
    assert!(
        st.inputs_refused <= refused + 5,
        "it polled instead of waiting: {st:?}"
    );
    let end = Instant::now() + T;
    while records.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(Instant::now() < end, "the one-way call never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        records.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "a dropped wait sent its request"
    );
    let st = engine.stats();
    assert_eq!(st.errors, errors + 1, "{st:?}");
    // A wait for room ends when the driver stops, with its error: the
    // silent target now holds a one-way input it never acknowledges.
    engine.call_one_way::<RecordBlob>(&s, &big).unwrap();
    let engine = Arc::new(engine);
    let waiting = {
        let engine = engine.clone();
        let (to_live, big) = (to_live.clone(), big.clone());
        tokio::spawn(async move {
            engine
                .call_one_way_within::<RecordBlob>(&to_live, &big, 3 * T)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "no room: it waits");
    engine.shutdown().unwrap();
    let r = tokio::time::timeout(T, waiting)
        .await
        .expect("the wait ended")
        .unwrap();
    assert!(matches!(r, Err(RpcError::DriverStopped { .. })), "{r:?}");
}

/// A wait for room ends when the target of a held input answers, long
/// before that input's TTL (a minute here): here the target is an async
/// handler held at a gate, and a call given up on while it waits holds
/// the room. A call whose wait was dropped first sends nothing once the
/// room comes: the server handles the given-up call and the waiting one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_room_ends_when_the_held_input_is_answered() {
    let dir = common::dir("async-room-answer");
    let server = common::async_engine(&dir, true);
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    server
        .register_async::<Echo, _, _>(move |v| {
            let g = g.clone();
            async move {
                g.acquire().await.map_err(|e| e.to_string())?.forget();
                Ok(v)
            }
        })
        .unwrap();
    let (ep, id) = common::endpoint(&dir, false);
    let mut e = Engine::new(ep, id).unwrap();
    e.set_abandoned_input_ttl(Duration::from_secs(60));
    e.set_max_abandoned_bytes(100 << 10);
    let client = Arc::new(AsyncEngine::spawn(e).unwrap());
    let to = client.lookup(&server.self_addr().to_string()).await.unwrap();
    let big = ByteBuf::from(vec![7u8; 64 << 10]);
    // Given up on while its handler waits at the gate: its input is held.
    let r = client.call::<Echo>(&to, &big, Duration::from_millis(100)).await;
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert_eq!(client.stats().abandoned_inputs, 1, "{:?}", client.stats());
    let dropped = tokio::time::timeout(Duration::from_millis(50), client.call::<Echo>(&to, &big, T)).await;
    assert!(dropped.is_err(), "the call did not wait: {dropped:?}");
    let other = vec![9u8; 64 << 10];
    let waiting = wait_for_room(&client, &to, &other).await;
    // The given-up call's handler, then the waiting call's.
    gate.add_permits(2);
    ends_with_echo(waiting, &client, &other).await;
    assert_eq!(server.stats().handled, 2, "{:?}", server.stats());
}

/// A wait for room ends when the target of the held input goes away (its
/// calls fail, and their inputs are let go), long before that input's TTL
/// (a minute here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_room_ends_when_the_target_of_the_held_input_goes_away() {
    let Held {
        engine,
        s: _,
        live: _live,
        to_live,
        records: _,
        big,
        silent,
        _dir,
    } = held_input("async-room-gone", Duration::from_secs(60)).await;
    let engine = Arc::new(engine);
    let waiting = wait_for_room(&engine, &to_live, &big).await;
    // The target's thread ends, and its endpoint with it.
    drop(silent);
    ends_with_echo(waiting, &engine, &big).await;
}

/// An echo of `input` to `to`, on its own task, checked to be waiting for
/// room after 50 ms.
async fn wait_for_room(
    engine: &Arc<AsyncEngine>,
    to: &hg_rpc::Addr,
    input: &[u8],
) -> tokio::task::JoinHandle<Result<ByteBuf, RpcError>> {
    let (engine, to, input) = (engine.clone(), to.clone(), ByteBuf::from(input));
    let waiting = tokio::spawn(async move { engine.call::<Echo>(&to, &input, T).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "no room: it waits");
    waiting
}

/// `waiting` ends, within `T`, with the echo of `input`, and `engine` is
/// left with no call in flight and no input kept.
async fn ends_with_echo(
    waiting: tokio::task::JoinHandle<Result<ByteBuf, RpcError>>,
    engine: &AsyncEngine,
    input: &[u8],
) {
    let got = tokio::time::timeout(T, waiting)
        .await
        .expect("the waiting call did not end")
        .expect("the waiting task panicked");
    match got {
        Ok(v) => assert!(v == input, "the echo differs"),
        Err(e) => panic!("the waiting call: {}", na_core::ErrorChain(&e)),
    }
    let st = engine.stats();
    assert_eq!(
        (st.in_flight, st.abandoned_inputs, st.abandoned_bytes),
        (0, 0, 0),
        "{st:?}"
    );
}
