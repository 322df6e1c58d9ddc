//! The tokio front end over na-sm with a separate server process: calls,
//! handlers and the driver at work. How the engine behaves when its driver
//! stops, its runtime shuts down or it is used from outside its runtime:
//! `async_stop.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{AsyncEngine, Engine, RpcError};
use na_core::{Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;

mod common;

const T: Duration = Duration::from_secs(60);

/// The tests of this file run one at a time: `idle_driver_uses_no_cpu`
/// measures the whole process's CPU time, which a busy test running
/// alongside it under `cargo test` (threads, not processes) would count.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_timeouts_and_cancel_by_drop() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let (srv, engine) = common::async_setup("calls", ProgressMode::default(), Duration::ZERO);
    let engine = Arc::new(engine);
    let s = engine.lookup(&srv.server.uri).await.unwrap();
    assert_eq!(engine.call::<Add>(&s, &(2, 3), T).await.unwrap(), 5);

    // 1,000 calls in flight at once, one task each.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1000u64 {
        let (e, s) = (engine.clone(), s.clone());
        tasks.spawn(async move { (e.call::<Add>(&s, &(i, 1000), T).await.unwrap(), i + 1000) });
    }
    let mut total = 0;
    while let Some(r) = tasks.join_next().await {
        let (got, want) = r.unwrap();
        assert_eq!(got, want);
        total += 1;
    }
    assert_eq!(total, 1000);

    // Timeout, then the engine still works.
    match engine.call::<Sleep>(&s, &500, Duration::from_millis(100)).await {
        Err(RpcError::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    // Cancel by drop: the future is dropped before the response.
    tokio::select! {
        _ = engine.call::<Sleep>(&s, &300, T) => panic!("the sleep cannot win"),
        _ = tokio::time::sleep(Duration::from_millis(50)) => {}
    }
    assert_eq!(engine.call::<Add>(&s, &(7, 8), T).await.unwrap(), 15);
    // Both abandoned calls leave nothing in flight once their late
    // responses were discarded.
    let end = Instant::now() + T;
    while engine.stats().in_flight != 0 {
        assert!(
            Instant::now() < end,
            "calls stayed in flight: {:?}",
            engine.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Handler errors come through as their own kind.
    assert!(matches!(
        engine.call::<Fail>(&s, &"no".into(), T).await,
        Err(RpcError::Handler { .. })
    ));
}

fn cpu_time() -> Duration {
    let ru = common::sys::getrusage_self().expect("getrusage(2)");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_driver_uses_no_cpu() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let (srv, engine) = common::async_setup("idle", ProgressMode::default(), Duration::ZERO);
    let s = engine.lookup(&srv.server.uri).await.unwrap();
    assert_eq!(engine.call::<Add>(&s, &(1, 1), T).await.unwrap(), 2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (c0, t0) = (cpu_time(), Instant::now());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let used = cpu_time() - c0;
    let share = used.as_secs_f64() / t0.elapsed().as_secs_f64();
    assert!(share < 0.05, "idle engine used {:.1}% of a CPU", share * 100.0);
    // And it still answers afterwards.
    assert_eq!(engine.call::<Add>(&s, &(2, 2), T).await.unwrap(), 4);
}

/// A driver with a spin window sees responses that come within it
/// without going to sleep (no kernel wake-up per call), and once the
/// window has passed it sleeps and uses no CPU. The window is far longer
/// than a round trip on the slowest host; a driver without one sleeps
/// between calls. On a loaded machine a gap between two responses can
/// still outlast the window (the client, its driver or the server
/// descheduled for it), and the driver may then rightly sleep: each call
/// that took half the window or more (a gap of a whole window spans at
/// most two calls, so one of them took half) excuses one sleep. A driver
/// that does not spin sleeps on calls far faster than that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_driver_sees_back_to_back_responses_without_sleeping() {
    let _serial = ONE_AT_A_TIME.lock().await;
    const CALLS: u64 = 200;

    // The driver's sleeps during `CALLS` back-to-back calls (after a first
    // one that connects), and how many of those calls took `slow` or more
    // (from the end of the one before).
    async fn sleeps_in_calls(
        engine: &AsyncEngine,
        srv: &common::ServerInDir,
        slow: Duration,
    ) -> (na_core::Addr, u64, u64) {
        let s = engine.lookup(&srv.server.uri).await.unwrap();
        assert_eq!(engine.call::<Add>(&s, &(1, 1), T).await.unwrap(), 2);
        let before = engine.stats().driver_sleeps;
        let mut slow_calls = 0;
        let mut last = Instant::now();
        for i in 0..CALLS {
            assert_eq!(engine.call::<Add>(&s, &(i, 1), T).await.unwrap(), i + 1);
            let now = Instant::now();
            slow_calls += u64::from(now.duration_since(last) >= slow);
            last = now;
        }
        (s, engine.stats().driver_sleeps - before, slow_calls)
    }

    // Without a window the driver sleeps between calls (not before every
    // response: the test peer spins, so some come before it sleeps).
    let (srv, engine) = common::async_setup("spin-none", ProgressMode::default(), Duration::ZERO);
    let (_, slept, _) = sleeps_in_calls(&engine, &srv, Duration::MAX).await;
    assert!(
        slept >= 10,
        "a driver without a spin window slept {slept} times in {CALLS} calls"
    );
    drop((engine, srv));

    // With a window of 300 ms: no sleep between the calls, but for the
    // ones a descheduling excuses.
    let spin = Duration::from_millis(300);
    let (srv, engine) = common::async_setup("spin-300ms", ProgressMode::default(), spin);
    let (s, slept, slow_calls) = sleeps_in_calls(&engine, &srv, spin / 2).await;
    assert!(
        slept <= 2 + slow_calls,
        "a driver spinning for {spin:?} slept {slept} times in {CALLS} back-to-back calls, \
         {slow_calls} of which took {:?} or more",
        spin / 2
    );

    // Once the window has passed, the driver sleeps (within a generous
    // deadline: under load it may be late to see the window pass), and
    // then uses no CPU.
    let before = engine.stats().driver_sleeps;
    tokio::time::sleep(spin + Duration::from_millis(200)).await;
    let end = Instant::now() + T;
    while engine.stats().driver_sleeps == before {
        assert!(
            Instant::now() < end,
            "the driver did not go to sleep after its window"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (c0, t0) = (cpu_time(), Instant::now());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let share = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64();
    assert!(
        share < 0.05,
        "an idle spinning engine used {:.1}% of a CPU",
        share * 100.0
    );
    // And it still answers afterwards.
    assert_eq!(engine.call::<Add>(&s, &(2, 2), T).await.unwrap(), 4);
}

/// Async handlers: each request runs as its own task. Ten requests wait on
/// a barrier of ten inside the handler, so they can only finish if all ten
/// handlers run at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_handlers_run_concurrently_and_self_forward_works() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-handlers");
    let make = |listen: bool| {
        let mut ep = Endpoint::new(ProgressMode::default()).unwrap();
        let cfg = SmConfig {
            listen,
            ..SmConfig::default()
        }
        .with_dir(&*dir);
        let id = ep
            .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
            .unwrap();
        AsyncEngine::spawn(Engine::new(ep, id).unwrap()).unwrap()
    };
    let server = make(true);
    let barrier = Arc::new(tokio::sync::Barrier::new(10));
    let b = barrier.clone();
    server
        .register_async::<Sleep, _, _>(move |_ms| {
            let b = b.clone();
            async move {
                b.wait().await;
                Ok(())
            }
        })
        .unwrap();
    server
        .register_async::<Add, _, _>(|(a, b)| async move {
            a.checked_add(b).ok_or_else(|| "overflow".to_string())
        })
        .unwrap();
    let client = Arc::new(make(false));
    let s = client.lookup(&server.self_addr().to_string()).await.unwrap();
    // The server is an AsyncEngine too: its driver must notice the new
    // connection (a regression: na-sm's try_wait once left fd events
    // unharvested, and an edge-triggered waiter slept through them).
    assert_eq!(client.call::<Add>(&s, &(1, 1), T).await.unwrap(), 2);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let (c, s) = (client.clone(), s.clone());
        tasks.spawn(async move { c.call::<Sleep>(&s, &0, T).await });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap().expect("all ten handlers must have run at once");
    }
    assert_eq!(client.call::<Add>(&s, &(20, 22), T).await.unwrap(), 42);
    assert!(matches!(
        client.call::<Add>(&s, &(u64::MAX, 1), T).await,
        Err(RpcError::Handler { .. })
    ));
    // A handler that panics, in its future or before it makes one: the
    // caller gets a handler error at once, not a timeout, and the server
    // keeps serving.
    server
        .register_async::<Fail, _, _>(|msg: String| {
            if msg == "early" {
                panic!("before the future: {msg}");
            }
            async move {
                tokio::task::yield_now().await;
                panic!("inside the future: {msg}")
            }
        })
        .unwrap();
    for (msg, said) in [
        ("late", "inside the future: late"),
        ("early", "before the future: early"),
    ] {
        let t0 = Instant::now();
        match client.call::<Fail>(&s, &msg.to_string(), T).await {
            Err(RpcError::Handler { message, .. }) => {
                assert!(
                    message.contains("panicked") && message.contains(said),
                    "{message}"
                )
            }
            other => panic!("a panicking handler answered {other:?}"),
        }
        assert!(t0.elapsed() < T / 2, "answered only after {:?}", t0.elapsed());
    }
    assert_eq!(client.call::<Add>(&s, &(2, 2), T).await.unwrap(), 4);
    // A self-forward to an async handler.
    let me = server.self_addr();
    assert_eq!(server.call::<Add>(&me, &(1, 2), T).await.unwrap(), 3);
    // An async handler gets a spilled 1 MiB input whole, and its 1 MiB
    // output spills back.
    server
        .register_async::<Echo, _, _>(|data| async move {
            Ok(ByteBuf::from(data.into_iter().rev().collect::<Vec<u8>>()))
        })
        .unwrap();
    let big = ByteBuf::from((0..1u32 << 20).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let back = client.call::<Echo>(&s, &big, T).await.unwrap();
    assert_eq!(back.len(), big.len());
    assert!(back.iter().rev().eq(big.iter()), "echoed data differs");
}

/// Responses sent by handler tasks, and calls made by caller tasks, while
/// the drivers sleep: when the ring is full they wait in the plugin's
/// backlog, and the sleeping driver must still be woken to send them
/// (200 calls whose 6 KiB answers come at about the same time, far more
/// than a ring holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_queued_while_the_driver_sleeps_still_go() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-backlog");
    let make = |listen: bool| {
        let ep = Endpoint::new(ProgressMode::default()).unwrap();
        let cfg = SmConfig {
            listen,
            ..SmConfig::default()
        }
        .with_dir(&*dir);
        let mut ep = ep;
        let id = ep
            .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
            .unwrap();
        AsyncEngine::spawn(Engine::new(ep, id).unwrap()).unwrap()
    };
    let server = make(true);
    server
        .register_async::<Echo, _, _>(|data| async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            Ok(ByteBuf::from(data.repeat(6 << 10)))
        })
        .unwrap();
    let client = Arc::new(make(false));
    let s = client.lookup(&server.self_addr().to_string()).await.unwrap();
    for round in 0..3 {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..200u32 {
            let (c, s) = (client.clone(), s.clone());
            tasks.spawn(async move { (i, c.call::<Echo>(&s, &ByteBuf::from(vec![i as u8]), T).await) });
        }
        while let Some(r) = tasks.join_next().await {
            let (i, r) = r.unwrap();
            let out = r.unwrap_or_else(|e| panic!("round {round}, call {i}: {}", na_core::ErrorChain(&e)));

            assert_eq!(out, vec![i as u8; 6 << 10]);
        }
    }
}

/// An engine used with the blocking API before it is spawned: its plugin
/// was disarmed by that use (a peer writing a response sends no signal),
/// so the driver must arm it before its first sleep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_used_before_it_was_spawned_still_gets_responses() {
    let _serial = ONE_AT_A_TIME.lock().await;
    for mode in [
        ProgressMode::Blocking,
        ProgressMode::Busy,
        ProgressMode::default(),
    ] {
        let (srv, engine) = common::async_setup("used-before", mode, Duration::ZERO);
        drop(engine);
        let (ep, id) = common::endpoint(&srv.dir, false);
        let mut blocking = Engine::new(ep, id).unwrap();
        let s = blocking.endpoint().lookup(&srv.server.uri).unwrap();
        assert_eq!(blocking.call::<Add>(&s, &(1, 2), T).unwrap(), 3);
        let engine = AsyncEngine::spawn(blocking).unwrap();
        let r = engine.call::<Add>(&s, &(3, 4), Duration::from_secs(3)).await;
        assert_eq!(r.unwrap(), 7, "{mode:?}");
    }
}

/// Under the tokio driver a panicking plain handler answers its caller
/// with a handler error, and the driver keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_does_not_stop_the_driver() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-panic");
    let server = common::async_engine(&dir, true);
    server.register::<Sleep>(|_| panic!("handler bug")).unwrap();
    server.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    let client = common::async_engine(&dir, false);
    let s = client.lookup(&server.self_addr().to_string()).await.unwrap();
    match client.call::<Sleep>(&s, &1, T).await {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("handler bug"), "{message}"),
        other => panic!("expected a handler error, got {other:?}"),
    }
    assert_eq!(client.call::<Add>(&s, &(5, 6), T).await.unwrap(), 11);
}

/// A one-way call to our own address with an async handler runs the
/// handler with no other traffic to wake the driver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_way_self_call_to_an_async_handler_runs() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-self-one-way");
    let engine = common::async_engine(&dir, false);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    engine
        .register_async::<Record, _, _>(move |n| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(n);
                Ok(())
            }
        })
        .unwrap();
    engine.call_one_way::<Record>(&engine.self_addr(), &42).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(2), rx.recv()).await;
    assert_eq!(got.expect("the handler never ran"), Some(42));
    // From a thread outside the runtime (the call is not async): the
    // handler's task still starts, on the engine's runtime.
    let engine = Arc::new(engine);
    let caller = {
        let engine = engine.clone();
        std::thread::spawn(move || engine.call_one_way::<Record>(&engine.self_addr(), &43))
    };
    caller.join().expect("the call panicked").unwrap();
    let got = tokio::time::timeout(Duration::from_secs(2), rx.recv()).await;
    assert_eq!(got.expect("the handler never ran"), Some(43));
}

/// The async API counts timeouts and failed sends in `errors`, as the
/// blocking `call` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_timeouts_count_as_errors() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let (srv, engine) = common::async_setup("async-errors", ProgressMode::default(), Duration::ZERO);
    let s = engine.lookup(&srv.server.uri).await.unwrap();
    let r = engine.call::<Sleep>(&s, &500, Duration::from_millis(50)).await;
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert_eq!(engine.stats().errors, 1, "{:?}", engine.stats());
}

/// A call with a spilled input to a target that takes it and never
/// answers: after the call timed out, the input stays exposed only for
/// the abandoned-input TTL, even with no traffic to wake the driver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_driver_still_lets_abandoned_inputs_go() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-idle-sweep");
    let silent = common::SilentTarget::start(&dir);
    let (ep, id) = common::endpoint(&dir, false);
    let mut e = Engine::new(ep, id).unwrap();
    e.set_abandoned_input_ttl(Duration::from_millis(300));
    let engine = AsyncEngine::spawn(e).unwrap();
    let s = engine.lookup(&silent.uri).await.unwrap();
    let r = engine
        .call::<Echo>(
            &s,
            &ByteBuf::from(vec![7u8; 64 << 10]),
            Duration::from_millis(100),
        )
        .await;
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    assert_eq!(engine.stats().abandoned_inputs, 1, "{:?}", engine.stats());
    // TTL 300 ms, sweeps at most once a second: well within 3 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = engine.stats();
    assert_eq!(stats.abandoned_inputs, 0, "kept while idle: {stats:?}");
    // A spilled one-way call is kept from the start (until acknowledged):
    // made outside the driver, its TTL must still wake it.
    engine
        .call_one_way::<Echo>(&s, &ByteBuf::from(vec![8u8; 64 << 10]))
        .unwrap();
    assert_eq!(engine.stats().abandoned_inputs, 1, "{:?}", engine.stats());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = engine.stats();
    drop(silent);
    assert_eq!(
        stats.abandoned_inputs, 0,
        "one-way input kept while idle: {stats:?}"
    );
    assert_eq!(stats.abandoned_bytes, 0, "{stats:?}");
}

/// Pulled inputs that async handlers still hold count against the pull
/// budget until answered: a slow handler cannot make the server hold any
/// number of large inputs (they were counted only while being pulled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_held_by_async_handlers_count_against_the_pull_budget() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-held-budget");
    let (ep, id) = common::endpoint(&dir, true);
    let mut e = Engine::new(ep, id).unwrap();
    e.set_max_pull_bytes(5 << 19); // room for two 1 MiB inputs, not three
                                   // The budget is what this test is about, with one client: its share
                                   // (half the budget by default) is the whole budget here (the share
                                   // itself: tests/pull_shares.rs).
    e.set_max_pull_bytes_per_peer(5 << 19);
    let server = AsyncEngine::spawn(e).unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    server
        .register_async::<Digest, _, _>(move |data| {
            let g = g.clone();
            async move {
                g.acquire().await.map_err(|e| e.to_string())?.forget();
                Ok((data.len() as u64, fnv(&data)))
            }
        })
        .unwrap();
    let client = Arc::new(common::async_engine(&dir, false));
    let s = client.lookup(&server.self_addr().to_string()).await.unwrap();
    let call = |i: u8| {
        let (c, s) = (client.clone(), s.clone());
        tokio::spawn(async move { c.call::<Digest>(&s, &ByteBuf::from(vec![i; 1 << 20]), T).await })
    };
    let (a, b) = (call(1), call(2));
    let end = Instant::now() + T;
    while server.stats().handled < 2 {
        assert!(Instant::now() < end, "{:?}", server.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Both inputs are held by waiting handlers: a third does not fit.
    match call(3).await.unwrap() {
        Err(RpcError::Busy { reason, .. }) => assert!(reason.contains("would exceed"), "{reason}"),
        other => panic!("expected the budget's refusal, got {other:?}"),
    }
    gate.add_permits(3);
    assert_eq!(a.await.unwrap().unwrap(), (1 << 20, fnv(&[1; 1 << 20])));
    assert_eq!(b.await.unwrap().unwrap(), (1 << 20, fnv(&[2; 1 << 20])));
    // Answered: the budget is free again.
    assert_eq!(call(4).await.unwrap().unwrap(), (1 << 20, fnv(&[4; 1 << 20])));
}

/// Requests for async handlers that wait (on a gate here, on I/O in a real
/// server) are bounded per caller and in all: past a bound a call is
/// answered "busy" at once (a small call and a spilled one alike), never
/// queued; once handlers finish, calls go again. A caller is a process:
/// two client engines of this one share its bound, and the other caller
/// is a process of its own (`hg-rpc-testpeer` as a stalled client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_for_async_handlers_are_bounded_per_caller_and_in_all() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-deferred-bound");
    let (ep, id) = common::endpoint(&dir, true);
    let mut e = Engine::new(ep, id).unwrap();
    e.set_max_deferred(3, 5);
    let server = AsyncEngine::spawn(e).unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    server
        .register_async::<Echo, _, _>(move |data| {
            let g = g.clone();
            async move {
                g.acquire().await.map_err(|e| e.to_string())?.forget();
                Ok(data)
            }
        })
        .unwrap();
    let g = gate.clone();
    server
        .register_async::<Digest, _, _>(move |data| {
            let g = g.clone();
            async move {
                g.acquire().await.map_err(|e| e.to_string())?.forget();
                Ok((data.len() as u64, fnv(&data)))
            }
        })
        .unwrap();
    let uri = server.self_addr().to_string();
    let (c1, c2) = (
        Arc::new(common::async_engine(&dir, false)),
        Arc::new(common::async_engine(&dir, false)),
    );
    // Each client with its address of the server.
    let c1 = (c1.clone(), c1.lookup(&uri).await.unwrap());
    let c2 = (c2.clone(), c2.lookup(&uri).await.unwrap());
    let call = |c: &(Arc<AsyncEngine>, na_core::Addr), v: Vec<u8>| {
        let (c, s) = c.clone();
        tokio::spawn(async move { c.call::<Echo>(&s, &ByteBuf::from(v), T).await })
    };
    let wait_in_flight = |n: u64| {
        let server = &server;
        async move {
            let end = Instant::now() + T;
            while server.stats().deferred_in_flight < n {
                assert!(Instant::now() < end, "{:?}", server.stats());
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let busy = |r: hg_rpc::Result<ByteBuf>, what: &str| match r {
        Err(RpcError::Busy { reason, .. }) => assert!(reason.contains(what), "{reason}"),
        other => panic!("expected busy ({what}), got {other:?}"),
    };
    let mut held = Vec::new();
    for i in 0..3u8 {
        held.push((vec![i], call(&c1, vec![i])));
    }
    wait_in_flight(3).await;
    // The first caller has its 3; a 4th, small or spilled, is refused.
    busy(call(&c1, vec![9]).await.unwrap(), "3 requests from this caller");
    busy(
        call(&c1, vec![9; 1 << 20]).await.unwrap(),
        "3 requests from this caller",
    );
    // Another client of this process is the same caller.
    busy(call(&c2, vec![9]).await.unwrap(), "3 requests from this caller");
    // Another process gets the 2 left of 5 in all, and its third spilled
    // call is refused (its stalled client takes no answer: counted).
    let _other = common::Server::with_envs(&[
        ("QS_SM_DIR", dir.as_os_str()),
        ("HG_TESTPEER_STALLED_CALL", std::ffi::OsStr::new(&uri)),
        ("HG_TESTPEER_STALLED_INPUTS", std::ffi::OsStr::new("3")),
    ]);
    wait_in_flight(5).await;
    let end = Instant::now() + T;
    while server.stats().deferred_refused < 4 {
        assert!(Instant::now() < end, "{:?}", server.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let st = server.stats();
    assert_eq!((st.deferred_refused, st.deferred_in_flight), (4, 5), "{st:?}");
    gate.add_permits(5);
    for (want, h) in held {
        assert_eq!(h.await.unwrap().unwrap(), want);
    }
    let end = Instant::now() + T;
    while server.stats().deferred_in_flight > 0 {
        assert!(Instant::now() < end, "{:?}", server.stats());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gate.add_permits(1);
    assert_eq!(call(&c1, vec![7]).await.unwrap().unwrap(), vec![7]);
}

/// A plain handler runs with its engine locked: one that calls its own
/// `AsyncEngine` gets an error (or, from `stats`, a panic its caller sees
/// as a handler error) instead of waiting on itself forever with the
/// driver stuck, and the engine serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_handler_calling_its_own_engine_gets_an_error_not_a_hang() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-reentry");
    let server = Arc::new(common::async_engine(&dir, true));
    let me = server.self_addr();
    let weak = Arc::downgrade(&server);
    let (w, to) = (weak.clone(), me.clone());
    server
        .register::<Echo>(move |v| {
            let e = w.upgrade().ok_or("engine gone")?;
            e.call_one_way::<Record>(&to, &1)?;
            Ok(v)
        })
        .unwrap();
    server
        .register::<Add>(move |(a, b)| {
            let e = weak.upgrade().ok_or("engine gone")?;
            Ok(e.stats().calls + a + b)
        })
        .unwrap();
    let client = common::async_engine(&dir, false);
    let s = client.lookup(&me.to_string()).await.unwrap();
    for _ in 0..2 {
        match client.call::<Echo>(&s, &ByteBuf::from(vec![1]), T).await {
            Err(RpcError::Handler { message, .. }) => assert!(
                message.contains("AsyncEngine::call_one_way was called from a plain handler"),
                "{message}"
            ),
            other => panic!("expected the reentry error, got {other:?}"),
        }
        match client.call::<Add>(&s, &(1, 2), T).await {
            Err(RpcError::Handler { message, .. }) => {
                assert!(
                    message.contains("panicked") && message.contains("AsyncEngine::stats"),
                    "{message}"
                )
            }
            other => panic!("expected the reentry panic, got {other:?}"),
        }
    }
    // The driver was never stuck: it served all four, and the engine is
    // usable from outside its handlers.
    assert_eq!(server.stats().handled, 4);
}

/// A call answered at once (a self-call to a plain handler here; a refusal
/// such as `InputsHeld` alike) still yields to the runtime now and then:
/// on a current-thread runtime, a loop of them must let other tasks (the
/// driver, timers, whoever frees what the caller waits for) run.
#[tokio::test(flavor = "current_thread")]
async fn calls_answered_at_once_still_let_other_tasks_run() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-yield");
    let (ep, id) = common::endpoint(&dir, true);
    let mut e = Engine::new(ep, id).unwrap();
    e.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    let engine = AsyncEngine::spawn(e).unwrap();
    let me = engine.self_addr();
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = ran.clone();
    tokio::spawn(async move { flag.store(true, std::sync::atomic::Ordering::SeqCst) });
    let mut n = 0u64;
    while !ran.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(
            n < 100_000,
            "{n} calls answered at once never let another task run"
        );
        assert_eq!(engine.call::<Add>(&me, &(n, 1), T).await.unwrap(), n + 1);
        n += 1;
    }
}

/// A self-call to an async handler that its caller gave up on: the late
/// answer is discarded and counted in `stray_responses`, as a late answer
/// from the network is. A one-way call refused before it is sent counts
/// as an error, as a refused call does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_self_answers_are_stray_and_refused_one_way_calls_are_errors() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-late-self");
    let (ep, id) = common::endpoint(&dir, true);
    let mut e = Engine::new(ep, id).unwrap();
    e.set_max_abandoned_bytes(0);
    let engine = AsyncEngine::spawn(e).unwrap();
    engine
        .register_async::<Sleep, _, _>(|ms| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(())
        })
        .unwrap();
    let me = engine.self_addr();
    let r = engine.call::<Sleep>(&me, &200, Duration::from_millis(30)).await;
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    let end = Instant::now() + T;
    while engine.stats().stray_responses == 0 {
        assert!(
            Instant::now() < end,
            "the late answer was never counted: {:?}",
            engine.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(engine.stats().stray_responses, 1);
    // A spilled one-way input larger than the bound of inputs held
    // (0 here): refused.
    let errors = engine.stats().errors;
    let peer = common::async_engine(&dir, true);
    let to = engine.lookup(&peer.self_addr().to_string()).await.unwrap();
    let r = engine.call_one_way::<RecordBlob>(&to, &ByteBuf::from(vec![1u8; 1 << 20]));
    assert!(matches!(r, Err(RpcError::TooLarge { .. })), "{r:?}");
    assert_eq!(engine.stats().errors, errors + 1);
}
