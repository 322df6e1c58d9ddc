//! A peer that exits while another process keeps its connection open (a
//! child it forked inherited the socket) gives no end-of-file: its exit
//! is seen through a pidfd of its process, and it is disconnected as
//! gone. Without that, its pid, once reused by some other process of
//! ours or of the same user, would be the target of transfers meant for
//! the peer.
//!
//! Each case runs twice: with the kernel's pidfd of the peer
//! (`SO_PEERPIDFD`), and by pid (`SmConfig::debug.pidfd_by_pid`: `pidfd_open`
//! checked against the start time read at connection time, all there is
//! on kernels before 6.5). Either way the peer is served while it lives.

use std::fs::File;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

use na_core::{Addr, NaError, OpId, Plugin, PluginId};
use na_sm::{SmConfig, SmConfigHooks, SmPlugin};

mod common;
use common::{pipe, private_dir, sys, KillOnDrop};

#[test]
fn a_peer_whose_socket_outlives_it_is_gone_when_its_process_exits() {
    connector_exits(false);
}

#[test]
fn a_peer_whose_socket_outlives_it_is_gone_when_its_process_exits_watched_by_pid() {
    connector_exits(true);
}

#[test]
fn a_listener_whose_sockets_outlive_it_is_gone_when_its_process_exits() {
    listener_exits(false);
}

#[test]
fn a_listener_whose_sockets_outlive_it_is_gone_when_its_process_exits_watched_by_pid() {
    listener_exits(true);
}

/// We listen; a child connects and sends a message, then (told to) forks
/// a grandchild that keeps the connection and exits.
fn connector_exits(by_pid: bool) {
    let dir = private_dir(&format!("peer-exit-{by_pid}"));
    let cfg = SmConfig {
        debug: SmConfigHooks {
            pidfd_by_pid: by_pid,
            ..SmConfigHooks::default()
        },
        ..SmConfig::listening().with_dir(&dir)
    };
    let mut srv = SmPlugin::new(PluginId(1), cfg).unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let child = fork_peer(|| {
        let mut c = SmPlugin::new(PluginId(2), SmConfig::default().with_dir(&dir)).ok()?;
        let to = c.lookup(&uri).ok()?;
        c.send_unexpected(&to, 7, b"hello", OpId(1)).ok()?;
        let end = Instant::now() + Duration::from_secs(10);
        while !std::iter::from_fn(|| c.pop_completion()).any(|k| k.op == OpId(1)) {
            if Instant::now() > end {
                return None;
            }
            c.progress().ok()?;
        }
        Some(c)
    });
    // The message arrives: the peer is connected.
    srv.post_recv_unexpected(Vec::new(), OpId(10)).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let from = loop {
        assert!(Instant::now() < end, "the child's message never arrived");
        srv.progress().unwrap();
        if let Some(k) = std::iter::from_fn(|| srv.pop_completion()).find(|k| k.op == OpId(10)) {
            break k.source.expect("an unexpected message names its sender");
        }
    };
    child.served_then_exits(&mut srv, &from);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A child listens; we connect and send, then it (told to) forks a
/// grandchild that keeps its sockets and exits.
fn listener_exits(by_pid: bool) {
    let dir = private_dir(&format!("listener-exit-{by_pid}"));
    let (uri_rx, mut uri_tx) = pipe();
    let child = fork_peer(|| {
        let s = SmPlugin::new(PluginId(2), SmConfig::listening().with_dir(&dir)).ok()?;
        writeln!(uri_tx, "{}", s.self_addr().uri()).ok()?;
        Some(s)
    });
    let mut uri = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(uri_rx), &mut uri).expect("the child's address");
    let cfg = SmConfig {
        debug: SmConfigHooks {
            pidfd_by_pid: by_pid,
            ..SmConfigHooks::default()
        },
        ..SmConfig::default().with_dir(&dir)
    };
    let mut c = SmPlugin::new(PluginId(1), cfg).unwrap();
    let to = c.lookup(uri.trim()).unwrap();
    child.served_then_exits(&mut c, &to);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A forked peer process (see [`fork_peer`]), killed and reaped when
/// dropped unless it was reaped already.
struct Peer {
    pid: libc::pid_t,
    go: File,
    grandchild_rx: File,
}

/// Forks a child that runs `setup` (which makes its plugin and connects
/// or listens), then drives that plugin until it is told to go, when it
/// forks a grandchild that only sleeps (holding every descriptor), reports
/// the grandchild's pid and ends with `_exit`.
fn fork_peer(setup: impl FnOnce() -> Option<SmPlugin>) -> Peer {
    let (go_rx, go) = pipe();
    let (grandchild_rx, grandchild_tx) = pipe();
    // The child runs the plugin and ends with `exit_now`.
    let pid = sys::fork();
    assert!(pid >= 0, "fork");
    if pid == 0 {
        drop(go);
        let code = (|| {
            let mut plugin = setup()?;
            let end = Instant::now() + Duration::from_secs(20);
            while !readable(&go_rx) {
                if Instant::now() > end {
                    return None;
                }
                plugin.progress().ok()?;
                plugin.sleep(Some(Duration::from_millis(5))).ok()?;
            }
            // The grandchild sleeps and ends with `exit_now`.
            let grandchild = sys::fork();
            if grandchild == 0 {
                std::thread::sleep(Duration::from_secs(60));
                sys::exit_now(0);
            }
            let mut tx = grandchild_tx;
            tx.write_all(&grandchild.to_le_bytes()).ok()
        })();
        sys::exit_now(if code.is_some() { 0 } else { 2 });
    }
    drop(grandchild_tx);
    Peer {
        pid,
        go,
        grandchild_rx,
    }
}

impl Peer {
    /// `us` serves `peer` (the child) while it lives, and finds it gone
    /// within 5 s of its exit, though the grandchild holds its sockets.
    fn served_then_exits(mut self, us: &mut SmPlugin, peer: &Addr) {
        // Served: a send goes, and nothing fails it, for a while.
        let end = Instant::now() + Duration::from_millis(200);
        let mut op = 20;
        while Instant::now() < end {
            us.progress().unwrap();
            op += 1;
            if let Err(e) = us.send_unexpected(peer, 0, b"still there?", OpId(op)) {
                panic!("the live peer was failed: {}", na_core::ErrorChain(&e));
            }
            if let Some(k) = std::iter::from_fn(|| us.pop_completion()).find(|k| k.status.is_err()) {
                panic!("the live peer was failed: {:?}", k.status);
            }
            us.sleep(Some(Duration::from_millis(10))).unwrap();
        }
        self.go.write_all(b"go").unwrap();
        let mut grandchild = [0u8; 4];
        self.grandchild_rx
            .read_exact(&mut grandchild)
            .expect("the child reports its grandchild");
        let _grandchild = KillOnDrop::new(i32::from_le_bytes(grandchild));
        let mut status = 0;
        let pid = std::mem::replace(&mut self.pid, 0);
        assert_eq!(sys::waitpid(pid, &mut status, 0), pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child failed: {status:#x}"
        );
        // The grandchild still holds the connection: no end-of-file. The
        // child's exit alone must end the peer.
        let end = Instant::now() + Duration::from_secs(5);
        let mut op = 100;
        let gone = loop {
            us.progress().unwrap();
            op += 1;
            match us.send_unexpected(peer, 0, b"are you there", OpId(op)) {
                Err(e @ NaError::PeerGone { .. }) => break Some(e),
                Err(e) => panic!("unexpected error: {}", na_core::ErrorChain(&e)),
                Ok(()) => {}
            }
            let failed = std::iter::from_fn(|| us.pop_completion())
                .filter(|k| k.op.0 > 100)
                .find_map(|k| k.status.err());
            if let Some(e) = failed {
                break Some(e);
            }
            if Instant::now() > end {
                break None;
            }
            // Sleeps on the plugin's events, as a blocking caller does.
            us.sleep(Some(Duration::from_millis(20))).unwrap();
        };
        let e = gone
            .expect("a peer whose process exited was still reachable 5 s later (its socket is held open)");
        assert!(
            matches!(e, NaError::PeerGone { .. }),
            "{}",
            na_core::ErrorChain(&e)
        );
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if self.pid > 0 {
            // Kills and reaps our own child.
            sys::kill(self.pid, libc::SIGKILL);
            sys::waitpid(self.pid, &mut 0, 0);
        }
    }
}

/// Whether `f` has something to read (or its writer is gone).
fn readable(f: &File) -> bool {
    na_sm::sys::poll::revents_now(std::os::fd::AsFd::as_fd(f), libc::POLLIN).is_ok_and(|r| r != 0)
}
