//! A client that sends and exits before the server reads its hello: its
//! sends completed (they are in the ring it made), so they count, with
//! either kind of wake-up, and the client is gone, not a violator. With a
//! pipe, the server opens its own end of the client's pipe through /proc
//! after the last reader closed: for an anonymous pipe that succeeds (the
//! `ENXIO` of a write-only, non-blocking open without readers is for
//! named FIFOs only), and the first wake-up's `EPIPE` says "gone".

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use na_core::{OpId, Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin, WakeKind};

mod common;
use common::private_dir;

#[test]
fn messages_of_a_client_that_exited_before_its_hello_was_read_count() {
    for wake in [WakeKind::EventFd, WakeKind::Pipe] {
        sends_then_exits(wake);
    }
}

fn sends_then_exits(wake: WakeKind) {
    let dir = private_dir(&format!("exited-{}", wake.name()));
    let mut srv = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    assert!(srv.pull_unexpected().unwrap());
    let uri = srv.self_addr().uri().to_owned();
    {
        let mut cfg = SmConfig::default().with_dir(&dir);
        cfg.wake = Some(wake);
        let mut client = SmPlugin::new(PluginId(2), cfg).unwrap();
        let to = client.lookup(&uri).unwrap();
        for i in 0..3u64 {
            client.send_unexpected(&to, 7, &i.to_le_bytes(), OpId(i)).unwrap();
        }
        let mut done = VecDeque::new();
        client.progress().unwrap();
        client.take_completions(&mut done);
        assert!(done.iter().all(|c| c.status.is_ok()), "{done:?}");
        // Dropped: its socket and both ends of its pipe close, as at exit.
    }
    let (mut got, mut buf, end) = (Vec::new(), Vec::new(), Instant::now() + Duration::from_secs(10));
    while got.len() < 3 {
        assert!(
            Instant::now() < end,
            "{}: {} of 3 messages of the exited client came ({:?})",
            wake.name(),
            got.len(),
            srv.stats()
        );
        srv.progress().unwrap();
        while let Some((_, tag)) = srv.take_unexpected(&mut buf).unwrap() {
            assert_eq!(tag, 7);
            got.push(u64::from_le_bytes(buf[..8].try_into().unwrap()));
        }
    }
    assert_eq!(got, [0, 1, 2]);
    let st = srv.stats();
    assert_eq!(
        (st.protocol_errors, st.violations),
        (0, 0),
        "{}: {st:?}",
        wake.name()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
