//! The driver's sleep and work done outside its turn (an async handler's
//! answer, on the handler's task): when that work brings the engine's
//! next expiry forward, the sleeping driver is woken to sleep until it
//! instead. Real sm engines; the state that makes the answer queue a
//! notice (a spilled output that waits for pull budget but no call
//! wants, from a target whose send backlog is full) is set up with
//! `engine::test_support`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use na_core::{NaError, ProgressMode};
use tokio::sync::oneshot;

use super::{AsyncEngine, NO_DEADLINE};
use crate::engine::test_support::queue_unwanted_output;
use crate::engine::Engine;
use crate::error::RpcError;
use crate::rpc::Rpc;

/// One-way messages that fill the send backlog to the target.
struct Fill;
impl Rpc for Fill {
    const NAME: &'static str = "wake_tests::fill";
    type Input = Vec<u8>;
    type Output = ();
}

/// The async handler whose answer the test holds back.
struct Held;
impl Rpc for Held {
    const NAME: &'static str = "wake_tests::held";
    type Input = u32;
    type Output = u32;
}

const T: Duration = Duration::from_secs(10);

/// Polls `cond` (every 5 ms) until it holds, at most [`T`].
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + T;
    while !cond() {
        assert!(Instant::now() < end, "{what}: not within {T:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An async handler answers while the driver sleeps with no deadline;
/// the answer gives pull budget back, which releases a waiting spilled
/// output no call wants, and the release finds the send backlog to its
/// target full: it waits in the notices for a retry, which brings the
/// engine's next expiry forward without more data kept. The driver must
/// wake for that retry (and keep retrying while the target reads
/// nothing), not sleep until the next traffic (the target would keep the
/// output until its 60 s TTL).
#[test]
fn an_async_handler_s_answer_that_leaves_a_release_waiting_wakes_the_sleeping_driver() {
    let dir = std::env::temp_dir().join(format!("hg-rpc-wake-release-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // The target never drives its endpoint, so it never acknowledges the
    // client's connection: at twice the client's handshake timeout after
    // the lookup (10 s by default) the client's na-sm fails that peer
    // ("no acknowledgement of the connection ... the listener is not
    // serving"), its deadline timer (a timerfd in the endpoint's epoll
    // set) waking the driver, and the release, retried, meets `PeerGone`
    // and is dropped. That was what woke the driver at about 10 s when
    // the wake-up below was missing: correct (a listener that never
    // acknowledges is gone), and measured: with a 2 s handshake timeout
    // the release went at 4.1 s, with 5 s at 10.05 s. Here the deadline
    // lies past any run of the test, so that a slow run cannot see the
    // release go for that reason before the test looks.
    let cfg = |listen, max_backlog_bytes| {
        na_sm::SmConfig {
            listen,
            max_backlog_bytes,
            handshake_timeout: Duration::from_secs(600),
            ..na_sm::SmConfig::default()
        }
        .with_dir(&dir)
    };
    // The target: never driven, it reads nothing.
    let target = Engine::shared_memory(
        cfg(true, na_sm::SmConfig::default().max_backlog_bytes),
        ProgressMode::Busy,
    )
    .unwrap();
    let mut c = Engine::shared_memory(cfg(false, 4096), ProgressMode::default()).unwrap();
    let t = c.endpoint().lookup(target.self_addr().uri()).unwrap();
    // One-way messages fill the ring to the target, then the backlog, to
    // less than a message with no data (smaller than a release) from its
    // bound.
    for len in [512, 0] {
        let full = (0..100_000).any(|_| match c.forward_one_way::<Fill>(&t, &vec![7u8; len]) {
            Ok(()) => false,
            Err(RpcError::Transport(NaError::SendBacklogFull { .. })) => true,
            Err(e) => panic!("filling the backlog: {}", na_core::ErrorChain(&e)),
        });
        assert!(full, "the send backlog to the target never filled");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ae = AsyncEngine::spawn(c).unwrap();
        let go = Arc::new(Mutex::new(None::<oneshot::Receiver<()>>));
        let (go_tx, go_rx) = oneshot::channel();
        *go.lock().unwrap() = Some(go_rx);
        ae.register_async::<Held, _, _>(move |x| {
            let go = go.lock().unwrap().take();
            async move {
                if let Some(go) = go {
                    let _ = go.await;
                }
                Ok(x + 1)
            }
        })
        .unwrap();
        let me = ae.self_addr();
        let steps = async {
            // The handler runs, held back; the driver sleeps with no
            // deadline (nothing kept, no notice waiting) and stays asleep.
            until("the handler's request", || ae.stats().deferred_in_flight == 1).await;
            let asleep = || ae.shared.sleeps_until.load(Ordering::Acquire) == NO_DEADLINE;
            until("the driver asleep with no deadline", asleep).await;
            let (mut sleeps, end) = (ae.stats().driver_sleeps, Instant::now() + T);
            loop {
                assert!(Instant::now() < end, "the driver never stayed asleep for 200 ms");
                tokio::time::sleep(Duration::from_millis(200)).await;
                let now = ae.stats().driver_sleeps;
                if now == sleeps && asleep() {
                    break;
                }
                sleeps = now;
            }
            // The next pull budget given back releases this output.
            queue_unwanted_output(&mut ae.shared.engine(), &t, 0x5eed);
            let _ = go_tx.send(());
            sleeps
        };
        let (answer, sleeps) = tokio::join!(ae.call::<Held>(&me, &1, T), steps);
        assert_eq!(answer.unwrap(), 2);
        // The release waits (the target reads nothing): the driver wakes
        // for its retries, one every RETRY_EVERY (100 ms). (Without that
        // wake-up the driver would sleep until the acknowledgement
        // deadline above.)
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let (now, waiting) = {
                let e = ae.shared.engine();
                (ae.shared.sleeps.load(Ordering::Relaxed), e.notices_waiting())
            };
            assert_eq!(waiting, 1, "the release does not wait: the test did not test it");
            if now >= sleeps + 3 {
                break;
            }
            assert!(
                Instant::now() < end,
                "the driver slept on (no deadline) while a release waited for its retry: {} sleeps since",
                now - sleeps
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(ae);
    });
    drop(target);
    let _ = std::fs::remove_dir_all(&dir);
}
