//! A forked child that drops its copy of a listening plugin (it returns
//! from `main`, say) leaves the parent's socket and owner files alone:
//! the parent's listener stays reachable.

use std::time::{Duration, Instant};

use na_core::{Endpoint, OpId, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[test]
fn a_forked_child_dropping_the_plugin_keeps_the_parents_socket() {
    let dir = std::env::temp_dir().join(format!("qs-sm-forked-drop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = |listen| {
        SmConfig {
            listen,
            ..SmConfig::default()
        }
        .with_dir(&dir)
    };
    let mut srv = Endpoint::new(ProgressMode::Blocking).unwrap();
    let sid = srv
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg(true))?) as Box<dyn Plugin>))
        .unwrap();
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let files = || std::fs::read_dir(&dir).unwrap().count();
    let before = files();
    assert!(before >= 2, "a socket and an owner file");
    // SAFETY (test): the child only drops the endpoint and exits at once.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        drop(srv);
        // SAFETY (test): ends the child without running the parent's
        // atexit handlers or test harness.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY (test): waits for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert_eq!(files(), before, "the child removed the parent's files");
    // Still reachable: a client connects and its message arrives.
    let mut c = Endpoint::new(ProgressMode::Blocking).unwrap();
    c.add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg(false))?) as Box<dyn Plugin>))
        .unwrap();
    let to = c.lookup(&uri).unwrap();
    srv.post_recv_unexpected(sid, Vec::new(), OpId(1)).unwrap();
    c.send_unexpected(&to, 0, b"still here", OpId(2)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < end, "the message never arrived");
        c.progress(Some(Duration::from_millis(1))).unwrap();
        srv.progress(Some(Duration::from_millis(1))).unwrap();
        if let Some(k) = std::iter::from_fn(|| srv.pop_completion()).find(|k| k.op == OpId(1)) {
            assert_eq!(k.buf.as_deref(), Some(&b"still here"[..]));
            break;
        }
    }
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}
