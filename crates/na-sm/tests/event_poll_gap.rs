//! The socket events (a new connection on the listener, a peer's
//! hang-up) are polled by a busy plugin's progress calls at least every
//! `EVENT_POLL_MAX_GAP`, not only every `EVENT_POLL_INTERVAL` (1,024)
//! calls: a caller whose calls come slowly (one that does other work
//! between them, or whose every call gives up the core while transfers
//! run on the RMA threads, on a loaded box) has them seen within a few
//! dozen calls. (Counted in calls alone, a departed peer whose transfer
//! was stuck went unnoticed for ten seconds and more on a loaded box.)
//!
//! The calls here are spaced out by a sleep longer than the gap, and the
//! tests count calls, not time: with the count alone, what they wait for
//! came only at the next multiple of 1,024 calls.

use std::time::Duration;

use na_core::{OpId, Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin, EVENT_POLL_MAX_GAP};

mod common;
use common::private_dir;

/// How many spaced-out progress calls the listener may take: more than
/// the calls between two looks at the clock (64, twice over), far fewer than
/// `EVENT_POLL_INTERVAL`.
const CALLS: usize = 128;

/// A listener and a client in `dir`.
fn pair(dir: &std::path::Path) -> (SmPlugin, SmPlugin, String) {
    let srv = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(dir)).unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let c = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(dir)).unwrap();
    (srv, c, uri)
}

/// Calls `srv.progress()` up to [`CALLS`] times, each after a pause longer
/// than `EVENT_POLL_MAX_GAP` (and `c`'s progress, if given, between),
/// until `done` holds; returns the calls made, or `None` if it never did.
fn slow_calls_until(
    srv: &mut SmPlugin,
    mut c: Option<&mut SmPlugin>,
    done: impl Fn(&SmPlugin) -> bool,
) -> Option<usize> {
    for call in 1..=CALLS {
        std::thread::sleep(EVENT_POLL_MAX_GAP * 2);
        if let Some(c) = c.as_deref_mut() {
            c.progress().unwrap();
        }
        srv.progress().unwrap();
        if done(srv) {
            return Some(call);
        }
    }
    None
}

#[test]
fn a_listener_called_slowly_accepts_within_a_few_dozen_calls() {
    let dir = private_dir("event-gap-accept");
    let (mut srv, mut c, uri) = pair(&dir);
    let to = c.lookup(&uri).unwrap();
    c.send_unexpected(&to, 1, b"hi", OpId(1)).unwrap();
    let calls = slow_calls_until(&mut srv, Some(&mut c), |s| s.stats().peers == 1);
    assert!(
        calls.is_some(),
        "the connection was not accepted in {CALLS} progress calls {:?} apart: {:?}",
        EVENT_POLL_MAX_GAP * 2,
        srv.stats()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_peer_that_hangs_up_is_noticed_within_a_few_dozen_slow_calls() {
    let dir = private_dir("event-gap-hangup");
    let (mut srv, mut c, uri) = pair(&dir);
    let to = c.lookup(&uri).unwrap();
    srv.post_recv_unexpected(Vec::new(), OpId(10)).unwrap();
    c.send_unexpected(&to, 1, b"hi", OpId(1)).unwrap();
    // Connected, both ways: the message arrived.
    let end = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        c.progress().unwrap();
        srv.progress().unwrap();
        if std::iter::from_fn(|| srv.pop_completion()).any(|k| k.op == OpId(10)) {
            break;
        }
        assert!(std::time::Instant::now() < end, "the message never arrived");
    }
    assert_eq!(srv.stats().peers, 1, "{:?}", srv.stats());
    drop(c);
    let calls = slow_calls_until(&mut srv, None, |s| s.stats().peers == 0);
    assert!(
        calls.is_some(),
        "the hang-up was not noticed in {CALLS} progress calls {:?} apart: {:?}",
        EVENT_POLL_MAX_GAP * 2,
        srv.stats()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
