//! A peer cannot stall a listener with a descriptor of a file system it
//! serves itself. Every descriptor a hello (or any message on a peer's
//! socket) carries is screened before it is kept: only a memfd, an
//! eventfd or a pipe may stay. That screening must not ask the file's
//! file system anything: `fstatfs` or `fstat` of a file on a FUSE mount
//! is a request to its daemon, which the peer is, and which waits
//! (killable only) for an answer that need never come. A peer may mount
//! one without privileges (`fusermount`, or a user namespace); here a
//! forked child mounts one in a mount namespace of its own and passes
//! the `O_PATH` descriptor of its root in its hello.
//!
//! Each test runs alone in a process of its own ([`jam::alone`]): the
//! closing threads and their queue are the process's.

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::Plugin;

mod common;
mod jam;
use common::{sys, KillOnDrop};
use jam::{alone, listener, serves_an_honest_client};

/// How long a progress call may take (generous: a loaded box; one that
/// waits on the peer's daemon never comes back at all).
const BOUND: Duration = Duration::from_secs(10);

/// The hostile connector (a forked child): mounts a FUSE file system
/// that never answers at `mnt`, sends a hello carrying its root's
/// descriptor (twice: the count a hello has) to the listener's socket
/// `path`, says on `status` whether it could (`U`: it may not mount
/// here, `S`: sent), then waits to be killed (its death closes the
/// daemon's end, which ends every request still waiting).
fn hostile_connector(mnt: &std::path::Path, path: &std::path::Path, status: std::fs::File) -> i32 {
    let (_dev, root) = match sys::unanswered_fuse(mnt) {
        Ok(fds) => fds,
        Err(_) => {
            sys::write(status.as_fd(), b"U");
            return 0;
        }
    };
    let Ok(sock) = UnixStream::connect(path) else {
        return 2;
    };
    let hello = na_sm::conn::encode_hello(&format!("{}-fuse", std::process::id()));
    let fd = root.as_raw_fd();
    if sys::send_fds(sock.as_fd(), &hello, &[fd, fd]).is_err() {
        return 3;
    }
    sys::write(status.as_fd(), b"S");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn a_descriptor_of_the_peers_own_fuse_mount_does_not_stall_the_listener() {
    alone(
        "a_descriptor_of_the_peers_own_fuse_mount_does_not_stall_the_listener",
        || {
            let (dir, srv, uri, path) = listener("fuse-fds");
            let mnt = std::env::temp_dir().join(format!("qs-sm-fuse-mnt-{}", std::process::id()));
            let _ = std::fs::remove_dir(&mnt);
            std::fs::create_dir_all(&mnt).unwrap();
            let (mut status_r, status_w) = common::pipe();
            let child = sys::fork();
            assert!(child >= 0, "fork");
            if child == 0 {
                drop(status_r);
                let code = hostile_connector(&mnt, &path, status_w);
                sys::exit_now(code);
            }
            let kill = KillOnDrop(child);
            drop(status_w);
            let mut said = [0u8; 1];
            status_r
                .read_exact(&mut said)
                .expect("the connector said nothing");
            if said[0] == b'U' {
                na_core::testing::report_not_run(
                    "na-sm fuse_fds: this process may not mount a FUSE file system \
                     (no CAP_SYS_ADMIN, no /dev/fuse)",
                );
                let _ = std::fs::remove_dir(&mnt);
                let _ = std::fs::remove_dir_all(&dir);
                return;
            }
            // Progress on a thread of its own: a call held by the daemon
            // shows as one that does not come back.
            let (done, answer) = mpsc::channel();
            let server = std::thread::spawn(move || {
                let mut srv = srv;
                let end = Instant::now() + Duration::from_millis(500);
                while Instant::now() < end {
                    srv.progress().unwrap();
                }
                let _ = done.send(srv.stats().handshakes_refused);
                srv
            });
            let refused = answer.recv_timeout(BOUND);
            // Ends the daemon, which lets a held call go, so the test ends.
            drop(kill);
            let mut srv = server.join().unwrap();
            let _ = std::fs::remove_dir(&mnt);
            let Ok(refused) = refused else {
                let _ = std::fs::remove_dir_all(&dir);
                panic!(
                    "a progress call of the listener waited {BOUND:?} on the daemon of the \
                     peer's FUSE mount (screening the descriptors of its hello)"
                );
            };
            assert_eq!(refused, 1, "the hello carrying a FUSE descriptor was not refused");
            serves_an_honest_client(&mut srv, &dir, &uri);
            drop(srv);
            let _ = std::fs::remove_dir_all(&dir);
        },
    );
}
