//! A peer cannot stall a listener with a descriptor of a file system it
//! serves itself. Every descriptor a hello (or any message on a peer's
//! socket) carries is screened before it is kept: only a memfd, an
//! eventfd or a pipe may stay. That screening must not ask the file's
//! file system anything: `fstatfs` or `fstat` of a file on a FUSE mount
//! is a request to its daemon, which the peer is, and which waits
//! (killable only) for an answer that need never come. A peer may mount
//! one without privileges (`fusermount`, or a user namespace); here a
//! forked child mounts one in a mount namespace of its own
//! ([`fork_fuse_peer`]) and passes the `O_PATH` descriptor of its root
//! in its hello.
//!
//! Each test runs alone in a process of its own ([`jam::alone`]): the
//! closing threads and their queue are the process's.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use na_core::Plugin;

mod common;
mod jam;
use common::fuse_peer::fork_fuse_peer;
use common::sys;
use jam::{alone, listener, serves_an_honest_client};

/// How long a progress call may take (generous: a loaded box; one that
/// waits on the peer's daemon never comes back at all).
const BOUND: Duration = Duration::from_secs(10);

/// The hostile connector's part (in the forked FUSE peer, once its file
/// system is mounted): sends a hello carrying the descriptor of the
/// mount's root (twice: the count a hello has) to the listener's socket
/// `path`.
fn send_fuse_hello(path: &std::path::Path, root: &OwnedFd) -> Result<(), i32> {
    let Ok(sock) = UnixStream::connect(path) else {
        return Err(2);
    };
    let hello = na_sm::conn::encode_hello(&format!("{}-fuse", std::process::id()));
    let fd = root.as_raw_fd();
    if sys::send_fds(sock.as_fd(), &hello, &[fd, fd]).is_err() {
        return Err(3);
    }
    Ok(())
}

#[test]
fn a_descriptor_of_the_peers_own_fuse_mount_does_not_stall_the_listener() {
    alone(
        "a_descriptor_of_the_peers_own_fuse_mount_does_not_stall_the_listener",
        || {
            let (dir, srv, uri, path) = listener("fuse-fds");
            let peer = fork_fuse_peer("fuse", "fuse_fds", |_, (_dev, root)| send_fuse_hello(&path, root));
            let Some(peer) = peer else {
                let _ = std::fs::remove_dir_all(&dir);
                return;
            };
            // Progress on a thread of its own: a call held by the daemon
            // shows as one that does not come back.
            let (done, answer) = mpsc::channel();
            let server = std::thread::spawn(move || {
                let mut srv = srv;
                // Until the hello is refused (or BOUND: a loaded box may run
                // this thread late), then a little longer: refused once.
                let end = Instant::now() + BOUND;
                while srv.stats().handshakes_refused == 0 && Instant::now() < end {
                    srv.progress().unwrap();
                }
                let end = Instant::now() + Duration::from_millis(50);
                while Instant::now() < end {
                    srv.progress().unwrap();
                }
                let _ = done.send(srv.stats().handshakes_refused);
                srv
            });
            let refused = answer.recv_timeout(BOUND);
            // Ends the daemon, which lets a held call go, so the test ends.
            drop(peer);
            let mut srv = server.join().unwrap();
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
