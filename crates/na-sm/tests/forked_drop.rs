//! A forked child that drops its copy of a listening plugin (it returns
//! from `main`, say) leaves the parent's socket and owner files alone:
//! the parent's listener stays reachable.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use na_core::{Endpoint, OpId, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::{connection_ends, listener_path, sys};

/// A blocking endpoint with one sm plugin in `dir`, listening or not.
fn endpoint(dir: &std::path::Path, listen: bool) -> (Endpoint, na_core::PluginId) {
    let cfg = SmConfig {
        listen,
        ..SmConfig::default()
    }
    .with_dir(dir);
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    (ep, id)
}

#[test]
fn a_forked_child_dropping_the_plugin_keeps_the_parents_socket() {
    let dir = std::env::temp_dir().join(format!("qs-sm-forked-drop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut srv, sid) = endpoint(&dir, true);
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let files = || std::fs::read_dir(&dir).unwrap().count();
    let before = files();
    assert!(before >= 2, "a socket and an owner file");
    // The child only drops the endpoint and exits at once.
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        drop(srv);
        // Without running the parent's atexit handlers or test harness.
        sys::exit_now(0);
    }
    let mut status = 0;
    assert_eq!(sys::waitpid(child, &mut status, 0), child);
    assert_eq!(files(), before, "the child removed the parent's files");
    // Still reachable: a client connects and its message arrives.
    let (mut c, _) = endpoint(&dir, false);
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

/// Children forked while another thread creates and drops instances (so
/// some forks happen while that thread holds the process's instance-name
/// registry) can still create an instance of their own: none hangs.
#[test]
fn a_child_forked_while_names_are_taken_can_create_an_instance() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let dir = std::env::temp_dir().join(format!("qs-sm-forked-names-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (stop, dir) = (stop.clone(), dir.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let cfg = SmConfig::default()
                    .with_dir(&dir)
                    .with_name(format!("churn{}", n % 4));
                drop(SmPlugin::new(na_core::PluginId(1), cfg));
                n += 1;
            }
            n
        })
    };
    const CHILDREN: usize = 100;
    let mut hung = 0;
    for i in 0..CHILDREN {
        // The child creates one plugin and ends with `exit_now`.
        let child = sys::fork();
        assert!(child >= 0, "fork");
        if child == 0 {
            let cfg = SmConfig::default().with_dir(&dir).with_name(format!("child{i}"));
            let ok = SmPlugin::new(na_core::PluginId(1), cfg).is_ok();
            sys::exit_now(if ok { 0 } else { 3 });
        }
        let end = Instant::now() + Duration::from_secs(10);
        let mut status = 0;
        loop {
            let r = sys::waitpid(child, &mut status, libc::WNOHANG);
            if r == child {
                assert!(
                    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                    "child {i} could not create its instance: status {status:#x}"
                );
                break;
            }
            if Instant::now() > end {
                hung += 1;
                // Kills and reaps our own hung child.
                sys::kill(child, libc::SIGKILL);
                sys::waitpid(child, &mut status, 0);
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let made = churn.join().unwrap();
    assert_eq!(
        hung, 0,
        "{hung} of {CHILDREN} children hung creating an instance ({made} made meanwhile)"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A forked child that drops its copy of a plugin with a live connection
/// leaves that connection alone: closing a connection's socket shuts it
/// for reading first, which acts on the socket the parent shares, so an
/// inherited one must only be closed. The parent's peer stays connected
/// and its next message arrives.
#[test]
fn a_forked_child_dropping_the_plugin_keeps_the_parents_connections() {
    let dir = std::env::temp_dir().join(format!("qs-sm-forked-drop-conn-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut srv, sid) = endpoint(&dir, true);
    let uri = srv.self_addr(sid).unwrap().uri().to_owned();
    let (mut c, _) = endpoint(&dir, false);
    let to = c.lookup(&uri).unwrap();
    let exchange = |c: &mut Endpoint, srv: &mut Endpoint, op: u64, what: &[u8]| {
        srv.post_recv_unexpected(sid, Vec::new(), OpId(op)).unwrap();
        c.send_unexpected(&to, 0, what, OpId(op + 1)).unwrap();
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            assert!(Instant::now() < end, "{what:?} never arrived");
            c.progress(Some(Duration::from_millis(1))).unwrap();
            srv.progress(Some(Duration::from_millis(1))).unwrap();
            if let Some(k) = std::iter::from_fn(|| srv.pop_completion()).find(|k| k.op == OpId(op)) {
                assert_eq!(k.buf.as_deref(), Some(what));
                break;
            }
        }
        let sent = std::iter::from_fn(|| c.pop_completion()).find(|k| k.op == OpId(op + 1));
        if let Some(k) = sent {
            k.status.expect("the send");
        }
    };
    exchange(&mut c, &mut srv, 1, b"connected");
    // Our own copies of the connection's two ends (the plugins' sockets).
    let (connector, acceptor) = connection_ends(&listener_path(&dir, &uri));
    // The child only drops the endpoints and exits at once.
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        drop(srv);
        drop(c);
        // Without running the parent's atexit handlers or test harness.
        sys::exit_now(0);
    }
    let mut status = 0;
    assert_eq!(sys::waitpid(child, &mut status, 0), child);
    // The child has exited: its drops are done. A shutdown of the shared
    // sockets (how a wrongly closed inherited socket cuts the parent off)
    // would show on the ends now, whatever the plugins have looked at yet.
    for (who, end) in [("connector", &connector), ("acceptor", &acceptor)] {
        let (_, revents) = sys::poll_one(end.as_raw_fd(), libc::POLLRDHUP, 0);
        assert_eq!(
            revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR),
            0,
            "the child cut the {who}'s end of the parent's connection (revents {revents:#x})"
        );
    }
    drop((connector, acceptor));
    exchange(&mut c, &mut srv, 3, b"still connected");
    drop((c, srv));
    let _ = std::fs::remove_dir_all(&dir);
}
