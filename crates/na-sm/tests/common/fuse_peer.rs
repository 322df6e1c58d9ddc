//! A forked peer that serves a FUSE file system which never answers
//! (mounted in a mount namespace of its own: [`sys::unanswered_fuse`]),
//! for the tests that check a peer's own file system cannot stall us
//! (`fuse_fds.rs`, `planted_socket.rs`).

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{sys, KillOnDrop};

/// The forked peer, killed (`SIGKILL`, which ends its daemon and so
/// every request still waiting on it) and reaped, then its mount point
/// removed, when dropped (its fields go in that order).
pub struct FusePeer {
    /// The peer's pid.
    pub pid: libc::pid_t,
    /// Kills and reaps it (see [`KillOnDrop`]).
    _kill: KillOnDrop,
    /// Removes the mount point.
    _mnt: MountPoint,
}

/// A mount point directory, removed when dropped.
struct MountPoint(PathBuf);

impl Drop for MountPoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Forks the peer: it mounts a FUSE file system that never answers at a
/// fresh directory named by `tag`, runs `then` with the mount point and
/// the descriptors `unanswered_fuse` gave (`Err(code)`: it exits with
/// `code`), says so, and waits to be killed. `None` (the test is then
/// reported as not run, under `test`'s name) where this process may not
/// mount a FUSE file system.
pub fn fork_fuse_peer(
    tag: &str,
    test: &str,
    then: impl FnOnce(&Path, &(OwnedFd, OwnedFd)) -> Result<(), i32>,
) -> Option<FusePeer> {
    let mnt = std::env::temp_dir().join(format!("qs-sm-{tag}-mnt-{}", std::process::id()));
    let _ = std::fs::remove_dir(&mnt);
    std::fs::create_dir_all(&mnt).unwrap();
    let (mut status_r, status_w) = super::pipe();
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        drop(status_r);
        // `U`: it may not mount here; `S`: mounted and `then` done.
        let code = match sys::unanswered_fuse(&mnt) {
            Err(_) => {
                sys::write(status_w.as_fd(), b"U");
                0
            }
            Ok(fds) => match then(&mnt, &fds) {
                Err(code) => code,
                Ok(()) => {
                    sys::write(status_w.as_fd(), b"S");
                    loop {
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
            },
        };
        sys::exit_now(code);
    }
    let peer = FusePeer {
        pid: child,
        _kill: KillOnDrop::new(child),
        _mnt: MountPoint(mnt),
    };
    drop(status_w);
    let mut said = [0u8; 1];
    status_r
        .read_exact(&mut said)
        .expect("the FUSE peer said nothing");
    if said[0] == b'U' {
        na_core::testing::report_not_run(&format!(
            "na-sm {test}: this process may not mount a FUSE file system \
             (no CAP_SYS_ADMIN, no /dev/fuse)"
        ));
        return None;
    }
    Some(peer)
}
