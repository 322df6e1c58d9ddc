//! The tokio front end when its driver stops, its runtime shuts down or
//! it is used from outside its runtime: calls fail at once (never at their
//! timeout), engines are released, and futures polled elsewhere still
//! work. Real server processes over na-sm.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{AsyncEngine, Engine, RpcError};
use na_core::ProgressMode;
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;

mod common;

const T: Duration = Duration::from_secs(10);

/// The tests of this file run one at a time under `cargo test` (threads,
/// not processes): some shut runtimes down or count the process's sockets.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Dropping the AsyncEngine while an async handler still runs releases
/// the engine (its listening socket goes) instead of keeping it until the
/// handler ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_engine_does_not_wait_for_running_handlers() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-drop");
    let server = common::async_engine(&dir, true);
    server
        .register_async::<Sleep, _, _>(|_| std::future::pending())
        .unwrap();
    let client = common::async_engine(&dir, false);
    let s = client.lookup(&server.self_addr().to_string()).await.unwrap();
    let r = client.call::<Sleep>(&s, &0, Duration::from_millis(200)).await;
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    let sockets = || {
        std::fs::read_dir(&*dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "sock")
            })
            .count()
    };
    assert_eq!(sockets(), 1, "the server's socket");
    drop(server);
    let end = Instant::now() + Duration::from_secs(3);
    while sockets() > 0 {
        assert!(Instant::now() < end, "the dropped engine's socket is still there");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `.sock` files in `dir` (a listening engine's socket).
fn sockets(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "sock")
        })
        .count()
}

/// Handlers that hold their own engine (an `Arc`, to make nested calls)
/// make a reference cycle, which `shutdown` breaks: it takes the handlers
/// out, so dropping the engine afterwards releases it (its socket goes).
/// Calls, registrations, lookups and `expose` after it fail, saying so
/// (lookups and `expose` need no driver, and still work once a driver
/// stopped otherwise: see `calls_fail_at_once_when_the_driver_stops` and
/// `a_driver_dropped_before_it_ever_ran_fails_calls_at_once`); from a plain
/// handler it is a reentry error that changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_an_engine_whose_handlers_hold_it() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let dir = common::dir("async-shutdown");
    let server = Arc::new(common::async_engine(&dir, true));
    server.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    // A plain handler holding the engine, which tries to shut it down.
    let me = server.clone();
    server
        .register::<Fail>(move |_| match me.shutdown() {
            Err(e) => Err(na_core::ErrorChain(&e).to_string()),

            Ok(()) => Ok(()),
        })
        .unwrap();
    // An async handler holding the engine, for a nested call on it.
    let me = server.clone();
    server
        .register_async::<Echo, _, _>(move |data| {
            let me = me.clone();
            async move {
                let n = me
                    .call::<Add>(&me.self_addr(), &(data.len() as u64, 1), T)
                    .await?;
                Ok(ByteBuf::from(vec![n as u8]))
            }
        })
        .unwrap();
    let client = common::async_engine(&dir, false);
    let s = client.lookup(&server.self_addr().to_string()).await.unwrap();
    assert_eq!(
        client
            .call::<Echo>(&s, &ByteBuf::from(vec![0; 3]), T)
            .await
            .unwrap(),
        vec![4]
    );
    match client.call::<Fail>(&s, &String::new(), T).await {
        Err(RpcError::Handler { message, .. }) => {
            assert!(message.contains("AsyncEngine::shutdown"), "{message}")
        }
        other => panic!("expected the reentry error, got {other:?}"),
    }
    // Unchanged: it serves on.
    assert_eq!(
        client
            .call::<Echo>(&s, &ByteBuf::from(vec![0; 5]), T)
            .await
            .unwrap(),
        vec![6]
    );
    assert_eq!(sockets(&dir), 1, "the server's socket");
    // Work that needs no driver works while it runs.
    let own_uri = server.self_addr().to_string();
    server.lookup(&own_uri).await.unwrap();
    server
        .expose(vec![vec![0; 64]], na_core::Access::ReadOnly)
        .unwrap();

    server.shutdown().unwrap();
    server.shutdown().unwrap();
    let stopped = |r: RpcError| match r {
        RpcError::DriverStopped { reason, .. } => {
            assert!(reason.contains("AsyncEngine::shutdown"), "{reason}")
        }
        other => panic!("expected DriverStopped, got {other:?}"),
    };
    stopped(
        server
            .call::<Add>(&server.self_addr(), &(1, 2), T)
            .await
            .unwrap_err(),
    );
    stopped(server.register::<Count>(|()| Ok((0, 0))).unwrap_err());
    // And work that needs none is refused the same way: the engine is
    // done for good.
    stopped(server.lookup(&own_uri).await.unwrap_err());
    stopped(
        server
            .expose(vec![vec![0; 64]], na_core::Access::ReadOnly)
            .unwrap_err(),
    );
    stopped(
        server
            .register_async::<Count, _, _>(|()| async { Ok((0, 0)) })
            .unwrap_err(),
    );
    drop(server);
    let end = Instant::now() + Duration::from_secs(3);
    while sockets(&dir) > 0 {
        assert!(
            Instant::now() < end,
            "the engine's socket is still there: its handlers keep it alive"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The driver task can stop while calls wait (here its tokio runtime shuts
/// down; an error waiting on the endpoint's fd ends it too): the waiting
/// call fails at once with `DriverStopped` instead of at its timeout, and
/// later calls and one-way calls are refused at once.
#[test]
fn calls_fail_at_once_when_the_driver_stops() {
    let _serial = ONE_AT_A_TIME.blocking_lock();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (srv, engine) = {
        let _in = rt.enter();
        common::async_setup("driver-stops", ProgressMode::default(), Duration::ZERO)
    };
    let engine = Arc::new(engine);
    let s = rt.block_on(engine.lookup(&srv.server.uri)).unwrap();
    assert_eq!(rt.block_on(engine.call::<Add>(&s, &(2, 3), T)).unwrap(), 5);
    // A call the target answers only after a minute, from a thread with a
    // runtime of its own; its timeout is 20 s.
    let (e, s2) = (engine.clone(), s.clone());
    let waiting = std::thread::spawn(move || {
        let own = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let t0 = Instant::now();
        let r = own.block_on(e.call::<Sleep>(&s2, &60_000, Duration::from_secs(20)));
        (r, t0.elapsed())
    });
    // It waits once forwarded (the waiter is registered under the same
    // lock as the count).
    let end = Instant::now() + T;
    while engine.stats().calls < 2 {
        assert!(Instant::now() < end, "{:?}", engine.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    rt.shutdown_timeout(Duration::from_secs(1));
    let (r, took) = waiting.join().unwrap();
    match r {
        Err(RpcError::DriverStopped { rpc, reason }) => {
            assert_eq!(rpc, "test.sleep");
            assert!(reason.contains("runtime shut down"), "{reason}");
        }
        other => panic!("expected DriverStopped, got {other:?}"),
    }
    assert!(took < Duration::from_secs(5), "failed only after {took:?}");
    // Later calls fail at once, and say why.
    a_call_fails_at_once_as_the_runtime_shut_down(&engine, &s);
    assert!(matches!(
        engine.call_one_way::<Record>(&s, &7),
        Err(RpcError::DriverStopped { .. })
    ));
    assert_eq!(engine.stats().errors, 3, "{:?}", engine.stats());
    // A bulk transfer is refused too, and is no call: not an error.
    let local = engine
        .expose(vec![vec![0; 64]], na_core::Access::ReadWrite)
        .unwrap();
    let remote = engine
        .expose(vec![vec![1; 64]], na_core::Access::ReadOnly)
        .unwrap();
    let own = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = own.block_on(engine.bulk(hg_rpc::BulkOp::Pull, &remote, 0, &local, 0, 64, T));
    assert!(matches!(r, Err(RpcError::DriverStopped { .. })), "{r:?}");
    assert_eq!(engine.stats().errors, 3, "{:?}", engine.stats());
}

/// A transport that breaks for good (here the sm plugin's own epoll set:
/// its descriptor is made to name /dev/null, as a program that closes or
/// reuses a descriptor it does not own would) stops the driver within
/// `DRIVER_FAILURE_LIMIT` and a few turns: calls fail with
/// `DriverStopped` naming the cause, instead of the driver spinning on
/// the failure for ever (its fd never readable, every turn failing) while
/// calls answer or time out as if nothing were wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_that_keeps_failing_stops_the_driver_with_its_cause() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let (srv, _) = common::async_setup("broken-epoll", ProgressMode::default(), Duration::ZERO);
    let (ep, id) = common::endpoint(&srv.dir, false);
    let fd = std::os::fd::AsRawFd::as_raw_fd(&ep.plugin(id).unwrap().poll_fd().expect("sm has a poll fd"));
    let engine = AsyncEngine::spawn(Engine::new(ep, id).unwrap()).unwrap();
    let s = engine.lookup(&srv.server.uri).await.unwrap();
    assert_eq!(engine.call::<Add>(&s, &(2, 3), T).await.unwrap(), 5);
    // The epoll set itself stays open through a second descriptor, so it
    // stays in the endpoint's set and wakes the driver as before; only the
    // plugin's own calls on `fd` fail.
    // `fd` is the plugin's epoll set, open as long as the engine; the new
    // descriptor is `_kept`'s.
    let _kept = common::sys::dup(fd).unwrap_or_else(|e| panic!("dup: {e}"));
    let null = std::fs::File::open("/dev/null").unwrap();
    // dup2 makes `fd` name /dev/null: the plugin's epoll calls then fail
    // with EINVAL, and it closes `fd` once, when dropped, as before.
    assert_eq!(
        common::sys::dup2(std::os::fd::AsFd::as_fd(&null), fd).expect("dup2(2)"),
        fd
    );
    let t0 = Instant::now();
    let reason = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "calls still answered 10 s after the transport broke: {:?}",
            engine.stats()
        );
        match engine.call::<Add>(&s, &(2, 3), T).await {
            Ok(5) => {}
            Err(RpcError::DriverStopped { reason, .. }) => break reason,
            other => panic!("expected 5 or DriverStopped, got {other:?}"),
        }
    };
    assert!(
        reason.contains("kept failing") && reason.contains("epoll"),
        "{reason}"
    );
    // Later calls fail at once, with the same cause.
    let t1 = Instant::now();
    match engine.call::<Add>(&s, &(2, 3), T).await {
        Err(RpcError::DriverStopped { reason, .. }) => assert!(reason.contains("kept failing"), "{reason}"),
        other => panic!("expected DriverStopped, got {other:?}"),
    }
    assert!(t1.elapsed() < Duration::from_secs(1), "{:?}", t1.elapsed());
}

/// A driver task dropped before it was ever polled (its runtime shut down
/// right after the spawn) fails calls at once too: the guard is made at
/// the spawn, not in the task's body.
#[test]
fn a_driver_dropped_before_it_ever_ran_fails_calls_at_once() {
    let _serial = ONE_AT_A_TIME.blocking_lock();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (srv, engine) = {
        let _in = rt.enter();
        common::async_setup("driver-never-ran", ProgressMode::default(), Duration::ZERO)
    };
    // Never `block_on`: the driver task never runs.
    drop(rt);
    // On a runtime of its own (the engine's is gone): a lookup of a
    // listening peer needs no driver.
    let s = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(engine.lookup(&srv.server.uri))
        .unwrap();
    a_call_fails_at_once_as_the_runtime_shut_down(&engine, &s);
}

/// A call (from a runtime of its own) fails with `DriverStopped` naming the
/// runtime's shutdown, well within its 20 s timeout.
fn a_call_fails_at_once_as_the_runtime_shut_down(engine: &AsyncEngine, s: &na_core::Addr) {
    let own = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t0 = Instant::now();
    match own.block_on(engine.call::<Add>(s, &(1, 1), Duration::from_secs(20))) {
        Err(RpcError::DriverStopped { reason, .. }) => {
            assert!(reason.contains("runtime shut down"), "{reason}")
        }
        other => panic!("expected DriverStopped, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// `AsyncEngine::spawn` outside a tokio runtime is an error saying so, not
/// a panic.
#[test]
fn spawning_outside_a_runtime_is_an_error() {
    let d = common::dir("spawn-outside");
    let (ep, id) = common::endpoint(&d, false);
    let engine = hg_rpc::Engine::new(ep, id).unwrap();
    match hg_rpc::AsyncEngine::spawn(engine) {
        Err(e) => assert!(e.to_string().contains("inside a tokio runtime"), "{e}"),
        Ok(_) => panic!("spawned outside a runtime"),
    }
}

/// In a runtime built without the I/O or the time driver, `spawn` is an
/// error naming the missing one, not a panic (at registration, or in the
/// driver task at its first sleep, which would leave calls failing with
/// "the driver task panicked").
#[test]
fn spawning_in_a_runtime_without_io_or_time_is_an_error() {
    let d = common::dir("spawn-no-driver");
    for (what, rt) in [
        (
            "I/O",
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build(),
        ),
        (
            "time",
            tokio::runtime::Builder::new_current_thread().enable_io().build(),
        ),
    ] {
        let rt = rt.unwrap();
        let _in = rt.enter();
        let (ep, id) = common::endpoint(&d, false);
        let engine = hg_rpc::Engine::new(ep, id).unwrap();
        match hg_rpc::AsyncEngine::spawn(engine) {
            Err(e) => assert!(e.to_string().contains(&format!("with {what}")), "{e}"),
            Ok(_) => panic!("spawned in a runtime without {what}"),
        }
    }
    // With both: it works.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _in = rt.enter();
    let (ep, id) = common::endpoint(&d, false);
    assert!(hg_rpc::AsyncEngine::spawn(hg_rpc::Engine::new(ep, id).unwrap()).is_ok());
}

/// Polls `f` to its end on this thread, with no tokio runtime around it:
/// the smallest executor (the waker unparks the thread).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// An engine's futures (a call with its timeout, `drained`, a transfer)
/// may be polled outside the engine's runtime: from a runtime built with
/// I/O only (no timers), or with no runtime at all. Their timers are
/// made on the engine's runtime, which runs them; tokio would otherwise
/// panic as the timer is made ("timers are disabled", "no reactor
/// running").
#[test]
fn futures_polled_outside_the_engines_runtime_work() {
    let _serial = ONE_AT_A_TIME.blocking_lock();
    let dir = common::dir("async-foreign-executor");
    let (_rt, server, client, gate) = gated_pair(&dir);
    server.register::<Add>(|(a, b)| Ok(a + b)).unwrap();
    let io_only = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let s = block_on(client.lookup(&server.self_addr().to_string())).unwrap();

    // Calls with a timeout, from both executors.
    assert_eq!(io_only.block_on(client.call::<Add>(&s, &(2, 3), T)).unwrap(), 5);
    assert_eq!(block_on(client.call::<Add>(&s, &(4, 5), T)).unwrap(), 9);
    // The timeout itself fires.
    let r = block_on(client.call::<Sleep>(&s, &0, Duration::from_millis(100)));
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");

    // A transfer: the client pulls the server's memory.
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let remote = server
        .expose(vec![data.clone()], na_core::Access::ReadOnly)
        .unwrap();
    let local = client
        .expose(vec![vec![0; data.len()]], na_core::Access::ReadWrite)
        .unwrap();
    io_only
        .block_on(client.bulk(hg_rpc::BulkOp::Pull, &remote, 0, &local, 0, data.len() as u64, T))
        .unwrap();
    assert!(local.local().unwrap().to_vec() == data, "pulled data differs");

    // Draining, while the handler of the timed-out call still waits.
    let end = Instant::now() + T;
    while server.stats().deferred_in_flight < 1 {
        assert!(Instant::now() < end, "{:?}", server.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    server.begin_drain().unwrap();
    assert!(!io_only
        .block_on(server.drained(Duration::from_millis(50)))
        .unwrap());
    gate.add_permits(1);
    assert!(block_on(server.drained(T)).unwrap(), "{:?}", server.stats());
}

/// A `drained` awaited on another executor while the engine's runtime
/// shuts down ends (drained, or `DriverStopped`) without a panic: its
/// timer lives on the engine's runtime, and polling it after that
/// runtime's time driver went panics, so a stop now ends the wait first.
/// (A guard only: it passes without that notification too, since here
/// the dropped handler's answer wakes the wait before the timer is
/// polled; forcing the other order needs control over tokio's shutdown.)
#[test]
fn drained_awaited_elsewhere_ends_when_the_engines_runtime_shuts_down() {
    let _serial = ONE_AT_A_TIME.blocking_lock();
    let dir = common::dir("async-drained-shutdown");
    let (rt, server, client, gate) = gated_pair(&dir);
    let server = Arc::new(server);
    let s = block_on(client.lookup(&server.self_addr().to_string())).unwrap();
    // A request whose handler waits: the engine is not drained.
    let r = block_on(client.call::<Sleep>(&s, &0, Duration::from_millis(100)));
    assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    let end = Instant::now() + T;
    while server.stats().deferred_in_flight < 1 {
        assert!(Instant::now() < end, "{:?}", server.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    server.begin_drain().unwrap();
    let waiter = {
        let server = Arc::clone(&server);
        std::thread::spawn(move || block_on(server.drained(Duration::from_secs(30))))
    };
    std::thread::sleep(Duration::from_millis(200));
    drop(rt);
    // Drained (the runtime dropped the handler's task, whose request is
    // then answered) or stopped: either, but no panic.
    let r = waiter.join().expect("the waiting thread panicked");
    assert!(
        matches!(r, Ok(true) | Err(RpcError::DriverStopped { .. })),
        "{r:?}"
    );
    drop(gate);
}

/// A one-worker runtime with a server and a client engine on it; the
/// server's async `Sleep` handler waits for a permit of the returned gate.
fn gated_pair(
    dir: &std::path::Path,
) -> (
    tokio::runtime::Runtime,
    AsyncEngine,
    AsyncEngine,
    Arc<tokio::sync::Semaphore>,
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (server, client) = {
        let _in = rt.enter();
        (common::async_engine(dir, true), common::async_engine(dir, false))
    };
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    server
        .register_async::<Sleep, _, _>(move |_| {
            let g = g.clone();
            async move {
                g.acquire().await.map_err(|e| e.to_string())?.forget();
                Ok(())
            }
        })
        .unwrap();
    (rt, server, client, gate)
}
