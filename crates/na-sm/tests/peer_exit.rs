//! A peer that exits while another process keeps its connection open (a
//! child it forked inherited the socket) gives no end-of-file: its exit
//! is seen through a pidfd of its process, and it is disconnected as
//! gone. Without that, its pid, once reused by some other process of
//! ours or of the same user, would be the target of transfers meant for
//! the peer.

use std::io::Read;
use std::os::fd::FromRawFd;
use std::time::{Duration, Instant};

use na_core::{NaError, OpId, Plugin, PluginId};
use na_sm::{SmConfig, SmPlugin};

mod common;
use common::private_dir;

#[test]
fn a_peer_whose_socket_outlives_it_is_gone_when_its_process_exits() {
    let dir = private_dir("peer-exit");
    let mut srv = SmPlugin::new(PluginId(1), SmConfig::listening().with_dir(&dir)).unwrap();
    let uri = srv.self_addr().uri().to_owned();
    let mut fds = [0; 2];
    // SAFETY (test): pipe writes two fresh descriptors into `fds`.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY (test): the child connects with a new instance, sends one
    // message, forks a grandchild that only sleeps (holding the
    // connection), reports its pid and ends with `_exit`.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        let code = (|| {
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
            // SAFETY (test): the grandchild sleeps and ends with `_exit`.
            let grandchild = unsafe { libc::fork() };
            if grandchild == 0 {
                std::thread::sleep(Duration::from_secs(60));
                // SAFETY (test): ends the grandchild.
                unsafe { libc::_exit(0) };
            }
            let bytes = grandchild.to_le_bytes();
            // SAFETY (test): writes 4 bytes from a live array to our pipe.
            let n = unsafe { libc::write(fds[1], bytes.as_ptr().cast(), bytes.len()) };
            (n == 4).then_some(())
        })();
        // SAFETY (test): ends the child at once.
        unsafe { libc::_exit(if code.is_some() { 0 } else { 2 }) };
    }
    // SAFETY (test): our write end; the read end is ours alone.
    unsafe { libc::close(fds[1]) };
    let mut rx = unsafe { std::fs::File::from_raw_fd(fds[0]) };

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
    let mut pid = [0u8; 4];
    rx.read_exact(&mut pid).expect("the child reports its grandchild");
    let _grandchild = KillOnDrop(i32::from_le_bytes(pid));
    let mut status = 0;
    // SAFETY (test): waits for our own child.
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child failed: {status:#x}"
    );

    // The grandchild still holds the connection: no end-of-file. The
    // child's exit alone must end the peer.
    let end = Instant::now() + Duration::from_secs(5);
    let mut op = 100;
    let gone = loop {
        srv.progress().unwrap();
        op += 1;
        match srv.send_unexpected(&from, 0, b"are you there", OpId(op)) {
            Err(e @ NaError::PeerGone { .. }) => break Some(e),
            Err(e) => panic!("unexpected error: {e}"),
            Ok(()) => {}
        }
        let failed = std::iter::from_fn(|| srv.pop_completion())
            .filter(|k| k.op.0 > 100)
            .find_map(|k| k.status.err());
        if let Some(e) = failed {
            break Some(e);
        }
        if Instant::now() > end {
            break None;
        }
        // Sleeps on the plugin's events, as a blocking caller does.
        srv.sleep(Some(Duration::from_millis(20))).unwrap();
    };
    let e =
        gone.expect("a peer whose process exited was still reachable 5 s later (its socket is held open)");
    assert!(matches!(e, NaError::PeerGone { .. }), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Kills the grandchild (no longer our child: init reaps it) however the
/// test ends.
struct KillOnDrop(libc::pid_t);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY (test): signals the grandchild this test made.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}
