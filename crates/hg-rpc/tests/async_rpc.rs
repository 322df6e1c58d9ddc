//! The tokio front end over na-sm with a separate server process.

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{AsyncEngine, Engine, RpcError};
use na_core::{Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;

mod common;
use common::TestDir;

const T: Duration = Duration::from_secs(10);

/// The tests of this file run one at a time: `idle_driver_uses_no_cpu`
/// measures the whole process's CPU time, which a busy test running
/// alongside it under `cargo test` (threads, not processes) would count.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The server process (killed when dropped), its address, and the socket
/// directory (removed after it).
struct Server(Child, String, #[allow(dead_code)] TestDir);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn setup(tag: &str, mode: ProgressMode) -> (Server, AsyncEngine) {
    let dir = common::dir(&format!("async-{tag}"));
    let mut child = common::testpeer()
        .env("QS_SM_DIR", &dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let uri = line.trim().strip_prefix("ADDR ").unwrap().to_owned();
    let mut ep = Endpoint::new(mode).unwrap();
    let cfg = SmConfig::default().with_dir(&*dir);
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let engine = AsyncEngine::spawn(Engine::new(ep, id).unwrap()).unwrap();
    (Server(child, uri, dir), engine)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_timeouts_and_cancel_by_drop() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let (srv, engine) = setup("calls", ProgressMode::default());
    let engine = Arc::new(engine);
    let s = engine.lookup(&srv.1).unwrap();
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
    // SAFETY: rusage is plain old data (all-zero is valid), and getrusage
    // writes only into the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_driver_uses_no_cpu() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let (srv, engine) = setup("idle", ProgressMode::default());
    let s = engine.lookup(&srv.1).unwrap();
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
    let s = client.lookup(&server.self_addr().to_string()).unwrap();
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
        .register_async::<Echo, _, _>(|data| async move { Ok(data.into_iter().rev().collect()) })
        .unwrap();
    let big: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
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
            Ok(data.repeat(6 << 10))
        })
        .unwrap();
    let client = Arc::new(make(false));
    let s = client.lookup(&server.self_addr().to_string()).unwrap();
    for round in 0..3 {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..200u32 {
            let (c, s) = (client.clone(), s.clone());
            tasks.spawn(async move { (i, c.call::<Echo>(&s, &vec![i as u8], T).await) });
        }
        while let Some(r) = tasks.join_next().await {
            let (i, r) = r.unwrap();
            let out = r.unwrap_or_else(|e| panic!("round {round}, call {i}: {e}"));
            assert_eq!(out, vec![i as u8; 6 << 10]);
        }
    }
}
