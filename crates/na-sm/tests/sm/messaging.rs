//! Lookup error texts, two instances on one poll set, the socket dir env.

use std::time::Duration;

use na_core::{NaError, OpId, PluginRegistry, ProgressMode};
use na_sm::SmFactory;

use crate::common::{test_dir, Node, PeerProc};

const T: Duration = Duration::from_secs(10);

#[test]
fn lookup_errors_name_the_cause_and_sizes_are_4_kib() {
    let dir = test_dir("lookup-errors");
    let mut server = PeerProc::spawn(&dir, &["server"]);
    let mut n = Node::new(&dir, ProgressMode::default(), false);
    let e = n.ep.lookup("sm://999999-nope").unwrap_err();
    assert!(
        matches!(e, NaError::Lookup { .. }) && e.to_string().contains("no socket"),
        "{e}"
    );
    assert!(matches!(
        n.ep.lookup("sm://abc").unwrap_err(),
        NaError::InvalidAddress { .. }
    ));
    let addr = n.ep.lookup(&server.uri).unwrap();
    let p = n.ep.plugin(n.id).unwrap();
    assert_eq!((p.max_unexpected_size(), p.max_expected_size()), (4096, 4096));
    assert_eq!(n.request(&addr, 1, b"eping"), b"eping");
    // The dead server's socket file is left behind: lookup says it is stale.
    server.kill();
    let end = std::time::Instant::now() + T;
    while n.stats().peers > 0 {
        assert!(
            std::time::Instant::now() < end,
            "the server's death went unnoticed"
        );
        n.pump(Duration::from_millis(20));
    }
    let e = n.ep.lookup(&server.uri).unwrap_err();
    assert!(e.to_string().contains("nobody listens"), "{e}");
}

#[test]
fn two_instances_driven_by_one_poll_set() {
    let dir = test_dir("two");
    let mut reg = PluginRegistry::new();
    reg.register(Box::new(SmFactory::new(
        na_sm::SmConfig::default().with_dir(dir.to_path_buf()),
    )));
    let mut ep = na_core::Endpoint::new(ProgressMode::Blocking).unwrap();
    let a = ep.add_from_spec(&reg, "sm://alpha", true).unwrap();
    let b = ep.add_from_spec(&reg, "sm://beta", true).unwrap();
    let b_uri = ep.self_addr(b).unwrap().uri().to_owned();
    assert_eq!(b_uri, format!("sm://{}-beta", std::process::id()));
    let b_from_a = ep.plugin_mut(a).unwrap().lookup(&b_uri).unwrap();
    let mut stash = std::collections::HashMap::new();
    let mut wait = |ep: &mut na_core::Endpoint, op: OpId| {
        let end = std::time::Instant::now() + T;
        loop {
            if let Some(c) = stash.remove(&op) {
                return c;
            }
            assert!(std::time::Instant::now() < end, "timed out on {op:?}");
            ep.progress(Some(Duration::from_millis(100))).unwrap();
            while let Some(c) = ep.pop_completion() {
                stash.insert(c.op, c);
            }
        }
    };
    for i in 0..100u64 {
        ep.post_recv_unexpected(b, Vec::new(), OpId(10 * i)).unwrap();
        ep.post_recv_expected(&b_from_a, i as u32, Vec::new(), OpId(10 * i + 1))
            .unwrap();
        ep.send_unexpected(&b_from_a, i as u32, &i.to_le_bytes(), OpId(10 * i + 2))
            .unwrap();
        let c = wait(&mut ep, OpId(10 * i));
        let a_from_b = c.source.unwrap();
        assert_eq!(a_from_b.plugin(), b);
        assert_eq!(c.buf.unwrap(), i.to_le_bytes());
        ep.send_expected(&a_from_b, i as u32, b"pong", OpId(10 * i + 3))
            .unwrap();
        assert_eq!(wait(&mut ep, OpId(10 * i + 1)).buf.unwrap(), b"pong");
        wait(&mut ep, OpId(10 * i + 2)).status.unwrap();
        wait(&mut ep, OpId(10 * i + 3)).status.unwrap();
    }
    // Each instance also talks to its own server process: in blocking mode
    // the replies arrive while the endpoint sleeps in its one epoll set, so
    // only the plugins' poll fds (woken by the servers' eventfd writes) can
    // end the wait.
    let s1 = PeerProc::spawn(&dir, &["server"]);
    let s2 = PeerProc::spawn(&dir, &["server"]);
    let s1a = ep.plugin_mut(a).unwrap().lookup(&s1.uri).unwrap();
    let s2b = ep.plugin_mut(b).unwrap().lookup(&s2.uri).unwrap();
    for i in 0..50u64 {
        for (k, srv) in [&s1a, &s2b].into_iter().enumerate() {
            let base = 10_000 + 10 * i + 5 * k as u64;
            ep.post_recv_expected(srv, i as u32, Vec::new(), OpId(base))
                .unwrap();
            ep.send_unexpected(srv, i as u32, &[b'e', i as u8], OpId(base + 1))
                .unwrap();
            assert_eq!(wait(&mut ep, OpId(base)).buf.unwrap(), [b'e', i as u8]);
            wait(&mut ep, OpId(base + 1)).status.unwrap();
        }
    }
    let (sa, sb) = (ep.plugin(a).unwrap().stats(), ep.plugin(b).unwrap().stats());
    assert_eq!((sa.msgs_sent, sa.msgs_received), (150, 150), "{sa:?}");
    assert_eq!((sb.msgs_sent, sb.msgs_received), (150, 150), "{sb:?}");
}

#[test]
fn invalid_socket_dir_env_is_a_clear_error() {
    let out = std::process::Command::new(crate::common::TESTPEER)
        .arg("envcheck")
        .env("QS_SM_DIR", "relative/dir")
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.starts_with("ERR") && s.contains("QS_SM_DIR") && s.contains("absolute"),
        "{s}"
    );
    use std::os::unix::ffi::OsStrExt;
    let out = std::process::Command::new(crate::common::TESTPEER)
        .arg("envcheck")
        .env("QS_SM_DIR", std::ffi::OsStr::from_bytes(b"/tmp/\xff\xfe"))
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.starts_with("ERR") && s.contains("QS_SM_DIR") && s.contains("UTF-8"),
        "{s}"
    );
}
