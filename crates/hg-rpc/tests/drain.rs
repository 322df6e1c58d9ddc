//! Draining before a shutdown (`begin_drain`, `drained`): a server stops
//! taking requests, answers the ones it took, and says when nothing is
//! left in its hands. Engines of this process over na-sm (real shared
//! memory, CMA and sockets between them).

use std::sync::Arc;
use std::time::Duration;

use hg_rpc::{Engine, Rpc, RpcError};
use serde_bytes::ByteBuf;
use tokio::sync::Notify;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;

mod common;

const T: Duration = Duration::from_secs(10);

/// Answers its input plus one once the test lets it.
struct Slow;
impl Rpc for Slow {
    const NAME: &'static str = "drain.slow";
    type Input = u64;
    type Output = u64;
}

/// `r` is the refusal of a draining server.
fn assert_refused_draining<T: std::fmt::Debug>(r: Result<T, RpcError>) {
    match r {
        Err(RpcError::Busy { reason, .. }) => assert!(reason.contains("draining"), "{reason}"),
        other => panic!("expected a busy answer from a draining server, got {other:?}"),
    }
}

/// A draining server refuses new requests (a spilled input too, before
/// its pull), answers the one its async handler holds, and is drained
/// only once that answer went: not while the handler still runs, however
/// long one waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_server_answers_what_it_took_and_refuses_the_rest() {
    let d = common::dir("drain-async");
    let srv = Arc::new(common::async_engine(&d, true));
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (s2, r2) = (started.clone(), release.clone());
    srv.register_async::<Slow, _, _>(move |x| {
        let (started, release) = (s2.clone(), r2.clone());
        async move {
            started.notify_one();
            release.notified().await;
            Ok(x + 1)
        }
    })
    .unwrap();
    srv.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    srv.register::<Echo>(Ok).unwrap();
    let c = Arc::new(common::async_engine(&d, false));
    let s = c.lookup(srv.self_addr().uri()).await.unwrap();
    assert_eq!(c.call::<Add>(&s, &(1, 2), T).await.unwrap(), 3);
    assert!(
        !srv.drained(Duration::ZERO).await.unwrap(),
        "drained before begin_drain"
    );

    let (c2, s2) = (c.clone(), s.clone());
    let slow = tokio::spawn(async move { c2.call::<Slow>(&s2, &41, T).await });
    started.notified().await;
    srv.begin_drain().unwrap();
    assert_refused_draining(c.call::<Add>(&s, &(1, 2), T).await);
    // 1 MiB: a spilled input, refused before the server pulls it.
    assert_refused_draining(c.call::<Echo>(&s, &ByteBuf::from(vec![7u8; 1 << 20]), T).await);
    assert_eq!(c.stats().abandoned_inputs, 0, "the refused input is still held");
    assert!(
        !srv.drained(Duration::from_millis(200)).await.unwrap(),
        "drained with a request its handler has not answered"
    );
    assert_eq!(srv.stats().deferred_in_flight, 1);

    release.notify_one();
    assert!(srv.drained(T).await.unwrap(), "not drained after the last answer");
    assert_eq!(slow.await.unwrap().unwrap(), 42);
    assert_eq!(srv.stats().refused_draining, 2);
    // Its own calls still work: the client side is not drained.
    let other = common::async_engine(&d, true);
    other.register::<Add>(|(a, b)| Ok(a * b)).unwrap();
    let o = srv.lookup(other.self_addr().uri()).await.unwrap();
    assert_eq!(srv.call::<Add>(&o, &(6, 7), T).await.unwrap(), 42);
}

/// With the blocking API, a spilled output keeps a drained engine
/// waiting until its origin pulled it and said so; a one-way request
/// sent while draining gets no answer and is counted, unless its input
/// was spilled: then the busy answer lets its origin release the input.
#[test]
fn a_spilled_output_is_pulled_before_the_engine_is_drained() {
    let d = common::dir("drain-blocking");
    let (ep, id) = common::endpoint(&d, true);
    let mut srv = Engine::new(ep, id).unwrap();
    srv.register::<Echo>(Ok).unwrap();
    srv.register::<Record>(|_| Ok(())).unwrap();
    let (ep, id) = common::endpoint(&d, false);
    let mut c = Engine::new(ep, id).unwrap();
    let s = c.endpoint().lookup(srv.self_addr().uri()).unwrap();
    // A short wait, not only a poll: a new connection's socket events are
    // read when the engine would sleep.
    let turn = |e: &mut Engine| {
        e.progress(Some(Duration::from_millis(1))).unwrap();
        e.trigger().unwrap();
    };

    let data = ByteBuf::from((0..2usize << 20).map(|i| (i % 253) as u8).collect::<Vec<u8>>());
    let call = c.forward::<Echo>(&s, &data).unwrap();
    // The server pulls the input, runs the handler and exposes the output.
    for _ in 0..1000 {
        turn(&mut srv);
        if srv.stats().exposed_outputs == 1 {
            break;
        }
        turn(&mut c);
    }
    assert_eq!(srv.stats().exposed_outputs, 1, "the output was not spilled");
    srv.begin_drain();
    turn(&mut srv);
    assert!(!srv.drained(), "drained with a spilled output not yet pulled");

    // A one-way request: no answer, counted.
    c.forward_one_way::<Record>(&s, &5).unwrap();
    // The client pulls the output and tells the server, which then has
    // nothing left.
    let mut out = None;
    for _ in 0..1000 {
        turn(&mut c);
        turn(&mut srv);
        if out.is_none() {
            out = c.take_response::<Echo>(call);
        }
        if out.is_some() && srv.drained() {
            break;
        }
    }
    assert!(
        out.expect("no response").unwrap() == data,
        "the echoed output differs"
    );
    assert!(srv.drained(), "not drained after the output was pulled");
    assert_eq!(srv.stats().refused_draining, 1);
    assert_eq!(srv.stats().exposed_outputs, 0);

    // A one-way request with a spilled input: its origin keeps the input
    // until the target answers; the draining target answers busy at once
    // (nothing pulled), and the origin lets the input go.
    c.forward_one_way::<Echo>(&s, &ByteBuf::from(vec![1u8; 1 << 20]))
        .unwrap();
    assert_eq!(c.stats().abandoned_inputs, 1, "the spilled input is not held");
    for _ in 0..1000 {
        turn(&mut srv);
        turn(&mut c);
        if c.stats().abandoned_inputs == 0 {
            break;
        }
    }
    assert_eq!(
        c.stats().abandoned_inputs,
        0,
        "the refused one-way input is still held"
    );
    assert_eq!(srv.stats().refused_draining, 2);
    assert!(srv.drained());
}

/// `drained` on an engine whose driver stopped (its runtime shut down)
/// with a spilled output its origin has not pulled: nothing will ever
/// move (the origin's release would need the driver), so it is
/// `DriverStopped` at once, not a wait through the whole grace period.
#[test]
fn drained_on_a_stopped_driver_says_so_at_once() {
    let d = common::dir("drain-stopped");
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let srv = first.block_on(async {
        let srv = common::async_engine(&d, true);
        srv.register::<Echo>(Ok).unwrap();
        srv
    });
    // A blocking client that never pulls the output.
    let mut c = common::client(&d);
    let s = c.lookup(srv.self_addr().uri()).unwrap();
    let id = c
        .forward::<Echo>(&s, &ByteBuf::from(vec![3u8; 64 << 10]))
        .unwrap();
    let end = std::time::Instant::now() + T;
    while srv.stats().exposed_outputs == 0 {
        assert!(std::time::Instant::now() < end, "the output was never exposed");
        // (The handshake's end and the queued request need our turns.)
        c.progress(Some(Duration::from_millis(1))).unwrap();
    }
    srv.begin_drain().unwrap();
    // The driver stops with its runtime.
    drop(first);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t0 = std::time::Instant::now();
    let r = second.block_on(srv.drained(T));
    assert!(
        matches!(r, Err(RpcError::DriverStopped { .. })),
        "expected DriverStopped, got {r:?}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "drained waited {:?} on a stopped driver",
        t0.elapsed()
    );
    c.abandon(id);
}

/// A server's runtime shuts down while an async handler is running (the
/// AsyncEngine itself lives on): the handler's task is dropped, and its
/// caller is answered with a handler error saying so at once, instead of
/// silence until its timeout.
#[test]
fn an_async_handler_dropped_with_its_runtime_answers_its_caller() {
    let d = common::dir("drain-dropped-handler");
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (started, never) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let srv = first.block_on(async {
        let srv = common::async_engine(&d, true);
        let (s2, n2) = (started.clone(), never.clone());
        srv.register_async::<Slow, _, _>(move |x| {
            let (started, never) = (s2.clone(), n2.clone());
            async move {
                started.notify_one();
                never.notified().await;
                Ok(x + 1)
            }
        })
        .unwrap();
        srv
    });
    let mut c = common::client(&d);
    let s = c.lookup(srv.self_addr().uri()).unwrap();
    let id = c.forward::<Slow>(&s, &1).unwrap();
    // The handler's task runs (not only its request admitted) before the
    // runtime goes.
    let (tx, rx) = std::sync::mpsc::channel();
    let s3 = started.clone();
    first.spawn(async move {
        s3.notified().await;
        let _ = tx.send(());
    });
    let end = std::time::Instant::now() + T;
    while rx.try_recv().is_err() {
        assert!(std::time::Instant::now() < end, "the handler never started");
        c.progress(Some(Duration::from_millis(1))).unwrap();
    }
    drop(first);
    let end = std::time::Instant::now() + Duration::from_secs(3);
    let r = loop {
        assert!(
            std::time::Instant::now() < end,
            "no answer within 3 s of the handler's task being dropped: {:?}",
            srv.stats()
        );
        c.progress(Some(Duration::from_millis(5))).unwrap();
        c.trigger().unwrap();
        if let Some(r) = c.take_response::<Slow>(id) {
            break r;
        }
    };
    match r {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("dropped"), "{message}"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    drop(never);
}
