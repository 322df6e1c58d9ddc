//! Addresses belong to the endpoint that looked them up: one used on
//! another endpoint of the same process (another context, say) is an
//! error, never a message to whichever peer its token names there.

use std::time::{Duration, Instant};

use na_core::{Endpoint, NaError, OpId, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

fn endpoint(dir: &std::path::Path, listen: bool) -> Endpoint {
    let base = if listen {
        SmConfig::listening()
    } else {
        SmConfig::default()
    };
    let cfg = base.with_dir(dir);
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    ep.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    ep
}

#[test]
fn an_address_of_another_endpoint_is_refused_not_sent_to_the_peer_it_happens_to_name() {
    let dir = private_dir("foreign");
    let (mut a, mut b) = (endpoint(&dir, true), endpoint(&dir, true));
    let (mut c1, mut c2) = (endpoint(&dir, false), endpoint(&dir, false));
    let a_uri = a.self_addr(a.plugin_ids().next().unwrap()).unwrap();
    let b_uri = b.self_addr(b.plugin_ids().next().unwrap()).unwrap();
    // Each client's first peer: the same slot of the same kind of table.
    let to_a = c1.lookup(a_uri.uri()).unwrap();
    let to_b = c2.lookup(b_uri.uri()).unwrap();
    assert_eq!(to_a.token(), to_b.token(), "the case this test is about");
    assert_ne!(
        to_a.plugin(),
        to_b.plugin(),
        "plugin ids are unique in the process"
    );
    assert_ne!(to_a, to_b);
    // c2 given c1's address of A: refused, whatever c2's table holds.
    match c2.send_unexpected(&to_a, 5, b"for A", OpId(1)) {
        Err(NaError::InvalidAddress { uri, reason }) => {
            assert_eq!(uri, a_uri.uri());
            assert!(reason.contains("another endpoint"), "{reason}");
        }
        other => panic!("expected InvalidAddress, got {other:?}"),
    }
    // Nothing reached B (nor A); c2's own address of B still works.
    let (bid, aid) = (b.plugin_ids().next().unwrap(), a.plugin_ids().next().unwrap());
    b.post_recv_unexpected(bid, Vec::new(), OpId(10)).unwrap();
    a.post_recv_unexpected(aid, Vec::new(), OpId(10)).unwrap();
    c2.send_unexpected(&to_b, 6, b"for B", OpId(2)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let got = loop {
        assert!(Instant::now() < end, "B got nothing");
        for ep in [&mut a, &mut c2] {
            ep.progress(Some(Duration::ZERO)).unwrap();
        }
        b.progress(Some(Duration::from_millis(1))).unwrap();
        if let Some(c) = b.pop_completion() {
            break c;
        }
    };
    assert_eq!((got.tag, got.buf.as_deref()), (6, Some(&b"for B"[..])));
    // Nothing can reach A later either, so A is checked now rather than
    // after a wait: a client counts a message as it sends it (it is in the
    // peer's ring when the call returns, or queued), and c1, A's only
    // peer, sent nothing; c2 sent one, the one B took, and knows no peer
    // but B.
    let sent = |ep: &Endpoint| {
        let s = ep.plugin(ep.plugin_ids().next().unwrap()).unwrap().stats();
        (s.msgs_sent, s.sends_queued, s.peer_entries)
    };
    assert_eq!(sent(&c1), (0, 0, 1), "c1 sent something (sent, queued, peers)");
    assert_eq!(
        sent(&c2),
        (1, 0, 1),
        "c2 sent more than B's message (sent, queued, peers)"
    );
    a.progress(Some(Duration::ZERO)).unwrap();
    assert!(a.pop_completion().is_none(), "A got a message");
    assert_eq!(a.plugin(aid).unwrap().stats().msgs_received, 0, "A got a message");
    // The plugin-level check holds too: a plugin given another's address.
    let c2_id = c2.plugin_ids().next().unwrap();
    let e = c2
        .plugin_mut(c2_id)
        .unwrap()
        .send_unexpected(&to_a, 7, b"x", OpId(3))
        .unwrap_err();
    assert!(
        matches!(e, NaError::InvalidAddress { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
    drop((c1, c2, a, b));
    let _ = std::fs::remove_dir_all(&dir);
}
