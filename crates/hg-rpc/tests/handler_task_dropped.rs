//! An async handler's task dropped before it answered (its runtime shut
//! down, or the task was aborted): the caller is answered at once with a
//! handler error that says so, not left to its timeout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_rpc::RpcError;
use serde_bytes::ByteBuf;

#[path = "../src/bin/testpeer/rpcs.rs"]
#[allow(dead_code)]
mod rpcs;
use rpcs::*;
mod common;
use common::{async_engine, client, dir};

const T: Duration = Duration::from_secs(10);

/// The target's runtime shuts down while its handler waits: the handler's
/// task is dropped, and its guard answers the caller (a plain engine in
/// another thread, calling with a 20 s timeout) within seconds.
#[test]
fn a_caller_is_answered_at_once_when_the_handlers_task_is_dropped() {
    let d = dir("handler-dropped");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = {
        let _in = rt.enter();
        async_engine(&d, true)
    };
    let started = Arc::new(AtomicBool::new(false));
    let flag = started.clone();
    server
        .register_async::<Echo, _, _>(move |_| {
            flag.store(true, Ordering::SeqCst);
            // Never answers on its own.
            std::future::pending::<Result<ByteBuf, String>>()
        })
        .unwrap();
    let uri = server.self_addr().uri().to_owned();
    let caller = std::thread::spawn(move || {
        let mut c = client(&d);
        let s = c.endpoint().lookup(&uri).unwrap();
        let t0 = Instant::now();
        let r = c.call::<Echo>(&s, &ByteBuf::from(vec![1, 2, 3]), Duration::from_secs(20));
        (r, t0.elapsed(), d)
    });
    let end = Instant::now() + T;
    while !started.load(Ordering::SeqCst) {
        assert!(Instant::now() < end, "the handler never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    let (r, took, _d) = caller.join().unwrap();
    match r {
        Err(RpcError::Handler { rpc, message }) => {
            assert_eq!(rpc, "test.echo");
            assert!(message.contains("dropped before it answered"), "{message}");
        }
        other => panic!("expected the dropped handler's error, got {other:?}"),
    }
    assert!(took < Duration::from_secs(5), "answered only after {took:?}");
    drop(server);
}
