//! An `AsyncEngine`'s driver while a spilled output of its own call waits
//! for room in the pull budget that a deferred request's pulled input
//! holds (a server process, `hg-rpc-testpeer`, over na-sm): the driver
//! sleeps until something brings room back, instead of waking every
//! 10 ms (the recheck it once had), and no such wake-up is lost: the
//! request dropped unanswered on another thread, or the output at the
//! head of the queue given up on (those behind it may fit), lets the
//! waiting output be pulled. One test pins the path every test here
//! takes: the deferred handler registered before the engine was spawned,
//! so that the request's return wakes the driver through the endpoint's
//! `Waker` (an eventfd in the epoll set it sleeps on), not its own
//! `Notify`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::{AsyncEngine, DeferredRequest, RpcError};

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{dir, Server};
mod held_budget;
use held_budget::{budget_held, HeldParts};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(30);

/// A client engine whose pull budget (1.5 MiB) is held by a 1 MiB input
/// it pulled for a deferred handler of its own, the request in hand
/// (taken with the blocking API, then the engine moved behind a driver),
/// and the thread of the peer that sent it (its engine, and so its
/// connection, kept until told to end).
struct Held {
    c: Arc<AsyncEngine>,
    srv: Server,
    req: Option<DeferredRequest>,
    end_holder: std::sync::mpsc::Sender<()>,
    holder: std::thread::JoinHandle<hg_rpc::Result<(u64, u64)>>,
}

/// Made outside the runtime (blocking progress), spawned inside it.
fn held_budget(d: &std::path::Path, rt: &tokio::runtime::Runtime) -> Held {
    let HeldParts {
        c,
        srv,
        req,
        end_holder,
        holder,
    } = budget_held(d);
    let c = Arc::new(rt.block_on(async { AsyncEngine::spawn(c) }).unwrap());
    Held {
        c,
        srv,
        req: Some(req),
        end_holder,
        holder,
    }
}

impl Held {
    /// Waits until `n` outputs in all have waited for room.
    async fn outputs_waited(&self, n: u64) {
        let end = Instant::now() + T;
        while self.c.stats().outputs_waited < n {
            let st = self.c.stats();
            assert_eq!(st.errors, 0, "calls failed instead of waiting for room: {st:?}");
            assert!(Instant::now() < end, "the output did not wait: {st:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The peer whose request was never answered timed out.
    fn end(self) {
        let _ = self.end_holder.send(());
        let r = self.holder.join().unwrap();
        assert!(matches!(r, Err(RpcError::Timeout { .. })), "{r:?}");
    }
}

/// Calls `Fill` with `input` (length, seed) from `c` to `s` on a task of
/// its own, with `timeout`.
fn spawn_fill(
    c: &Arc<AsyncEngine>,
    s: &hg_rpc::Addr,
    input: (u64, u64),
    timeout: Duration,
) -> tokio::task::JoinHandle<Result<serde_bytes::ByteBuf, RpcError>> {
    let (c, s) = (c.clone(), s.clone());
    tokio::spawn(async move { c.call::<Fill>(&s, &input, timeout).await })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Idle for 2 s with an output waiting for room a deferred request holds:
/// the driver sleeps a handful of times at most (it slept every 10 ms,
/// about 200 times, before it was woken by the request's drop). Then the
/// request, dropped unanswered on another thread, wakes it, and the
/// output is pulled intact.
#[test]
fn the_driver_sleeps_while_an_output_waits_and_wakes_when_a_dropped_request_gives_room_back() {
    let d = dir("driver-idle-wakes");
    let rt = runtime();
    let mut h = held_budget(&d, &rt);
    rt.block_on(async {
        let s = h.c.lookup(&h.srv.uri).await.unwrap();
        let call = spawn_fill(&h.c, &s, (MIB, 7), T);
        h.outputs_waited(1).await;
        // Settled (the turns around the response are over), then idle.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let before = h.c.stats().driver_sleeps;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let st = h.c.stats();
        let slept = st.driver_sleeps - before;
        assert!(
            slept <= 10,
            "the driver woke {slept} times in 2 s while an output waited and nothing happened: {st:?}"
        );
        assert!(!call.is_finished(), "the output did not wait: {st:?}");
        let req = h.req.take();
        std::thread::spawn(move || drop(req)).join().unwrap();
        let out = call.await.unwrap().unwrap();
        assert!(out == fill_pattern(MIB, 7), "corrupted");
        let st = h.c.stats();
        assert_eq!((st.in_flight, st.errors, st.outputs_waited), (0, 0, 1), "{st:?}");
    });
    h.end();
}

/// Waits (at most [`T`]) until the driver has slept `at_least` times in
/// all and its count then stayed put for [`SETTLE`]: asleep, with nothing
/// due to wake it. Returns the count.
async fn asleep(c: &AsyncEngine, at_least: u64) -> u64 {
    let end = Instant::now() + T;
    loop {
        let before = c.stats().driver_sleeps;
        tokio::time::sleep(SETTLE).await;
        let st = c.stats();
        if before >= at_least && st.driver_sleeps == before {
            return before;
        }
        assert!(Instant::now() < end, "the driver never settled asleep: {st:?}");
    }
}

/// How long the driver's sleep count must stay put to count as asleep.
const SETTLE: Duration = Duration::from_millis(300);

/// The hook a deferred request's return calls is set once: by the first
/// `Engine::register_deferred` (the endpoint's `Waker`) when it comes
/// before `AsyncEngine::spawn`, as here (`budget_held`), else by `spawn`
/// (the driver's `Notify`). With the driver asleep (no deadline: nothing
/// else would wake it) and an output waiting for the room the request
/// holds, the request is dropped on another thread: its return must wake
/// the driver through the eventfd, and the output be pulled, well within
/// 20 s (a lost wake-up leaves the driver asleep until the call's own
/// timeout, a minute later), with a handful of sleeps in between (no
/// recheck loop), and the driver asleep again after. (Had
/// `register_deferred` set no hook, `spawn`'s `Notify` would wake the
/// driver instead and this test would pass: what it catches is a hook
/// set that wakes nothing the driver sleeps on.)
#[test]
fn a_request_deferred_before_spawn_wakes_the_sleeping_driver_through_the_endpoint_waker() {
    let d = dir("driver-wake-before-spawn");
    let rt = runtime();
    let mut h = held_budget(&d, &rt);
    rt.block_on(async {
        let s = h.c.lookup(&h.srv.uri).await.unwrap();
        let call = spawn_fill(&h.c, &s, (MIB, 7), Duration::from_secs(60));
        h.outputs_waited(1).await;
        let before = asleep(&h.c, 1).await;
        assert!(!call.is_finished(), "the output did not wait: {:?}", h.c.stats());
        let req = h.req.take();
        std::thread::spawn(move || drop(req)).join().unwrap();
        let out = match tokio::time::timeout(Duration::from_secs(20), call).await {
            Ok(out) => out
                .unwrap()
                .unwrap_or_else(|e| panic!("the call: {}", na_core::ErrorChain(&e))),
            Err(_) => panic!(
                "the dropped request's return did not wake the sleeping driver: {:?}",
                h.c.stats()
            ),
        };
        assert!(out == fill_pattern(MIB, 7), "corrupted");
        let st = h.c.stats();
        let slept = st.driver_sleeps - before;
        assert!(
            slept <= 10,
            "the driver slept {slept} times between the drop and the answer: {st:?}"
        );
        assert_eq!((st.in_flight, st.errors, st.outputs_waited), (0, 0, 1), "{st:?}");
        // Not left turning: it sleeps again.
        asleep(&h.c, before + 1).await;
    });
    h.end();
}

/// Two outputs wait: a 1 MiB head, which finds no room while the request
/// holds its input, and a 256 KiB one behind it, which would fit. The
/// head's call times out: the one behind it is pulled then, while the
/// request still holds its room (no 10 ms recheck moves it: the head's
/// release, sent as it leaves the queue, wakes the driver by its send
/// completion, and the driver's `try_wait` tries the outputs again).
#[test]
fn an_output_behind_a_head_given_up_on_is_pulled_without_a_recheck() {
    let d = dir("driver-idle-head");
    let rt = runtime();
    let mut h = held_budget(&d, &rt);
    rt.block_on(async {
        let s = h.c.lookup(&h.srv.uri).await.unwrap();
        let head = spawn_fill(&h.c, &s, (MIB, 7), Duration::from_secs(3));
        h.outputs_waited(1).await;
        let behind = spawn_fill(&h.c, &s, (MIB / 4, 8), Duration::from_secs(20));
        h.outputs_waited(2).await;
        match head.await.unwrap() {
            Err(RpcError::Timeout { .. }) => {}
            other => panic!("expected a timeout, got {:?}", other.map(|v| v.len())),
        }
        let out = behind.await.unwrap().unwrap_or_else(|e| {
            panic!(
                "the output behind the head given up on: {}",
                na_core::ErrorChain(&e)
            )
        });

        assert!(out == fill_pattern(MIB / 4, 8), "corrupted");
        let st = h.c.stats();
        assert_eq!((st.in_flight, st.errors, st.outputs_waited), (0, 1, 2), "{st:?}");
    });
    drop(h.req.take());
    h.end();
}
