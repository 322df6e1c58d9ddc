//! The identity check against real processes (children running `sleep`)
//! and real sockets.

use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use na_core::NaError;

use super::*;
use crate::sys::proc::testing::Named;

fn sleeper(tag: &str) -> Named {
    Named::spawn(tag, OsStr::new("qs-sm-peer"))
}

/// The pid a pidfd names (`Pid:` of its fdinfo).
fn pid_of(fd: &OwnedFd) -> u32 {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).unwrap();
    let line = info.lines().find_map(|l| l.strip_prefix("Pid:")).unwrap();
    line.trim().parse().unwrap()
}

#[test]
fn a_live_process_with_the_start_time_read_is_watched() {
    let mut child = sleeper("identity-live");
    let t = proc::start_time(child.pid()).unwrap();
    let fd = open_checked(child.pid(), t, "peer")
        .unwrap()
        .expect("pidfd_open is there");
    assert_eq!(pid_of(&fd), child.pid());
    assert!(!proc::pidfd_exited(fd.as_fd()).unwrap());
    child.kill_unreaped();
    assert!(proc::pidfd_exited(fd.as_fd()).unwrap(), "it watches that process");
}

#[test]
fn a_live_process_with_another_start_time_is_not_taken_for_the_peer() {
    let child = sleeper("identity-other");
    let t = proc::start_time(child.pid()).unwrap();
    for wrong in [t - 1, t + 1, 0] {
        match open_checked(child.pid(), wrong, "sm://1-x") {
            Err(SmError::PidReused {
                peer,
                pid,
                expected,
                found,
            }) => assert_eq!(
                (peer.as_str(), pid, expected, found),
                ("sm://1-x", child.pid(), wrong, t)
            ),
            other => panic!("start time {wrong} (the process's is {t}): {other:?}"),
        }
    }
    // What the application sees: the peer is gone, and why.
    let e = NaError::from(open_checked(child.pid(), t + 1, "sm://1-x").unwrap_err());
    match e {
        NaError::PeerGone { peer, reason } => {
            assert_eq!(peer, "sm://1-x");
            assert!(reason.contains("now names another process"), "{reason}");
        }
        e => panic!("{e}"),
    }
}

#[test]
fn an_exited_process_is_gone_reaped_or_not() {
    let mut child = sleeper("identity-exited");
    let (pid, t) = (child.pid(), proc::start_time(child.pid()).unwrap());
    // A zombie still has its pid and start time: only the pidfd tells.
    child.kill_unreaped();
    assert_eq!(proc::start_time(pid).unwrap(), t);
    let gone = |r: SmResult<Option<OwnedFd>>| matches!(r, Err(SmError::PeerGone { ref reason, .. }) if reason == &format!("process {pid} exited"));
    assert!(gone(open_checked(pid, t, "peer")), "a zombie is gone");
    child.child.wait().unwrap();
    assert!(gone(open_checked(pid, t, "peer")), "a reaped process is gone");
}

/// The start time is taken only while the other end of the socket is
/// open: once every copy of it is closed, the process may have exited
/// and its pid be another's.
#[test]
fn the_start_time_is_known_only_while_the_connection_proves_the_peer_there() {
    let me = proc::pid();
    let mine = proc::start_time(me).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    assert_eq!(PeerStart::read(a.as_fd(), me), PeerStart::Known(mine));
    let copy = b.try_clone().unwrap();
    drop(b);
    assert_eq!(
        PeerStart::read(a.as_fd(), me),
        PeerStart::Known(mine),
        "a copy holds it"
    );
    drop(copy);
    match PeerStart::read(a.as_fd(), me) {
        PeerStart::Unknown(why) => assert!(why.contains("closed the connection"), "{why}"),
        known => panic!("closed, yet {known:?}"),
    }
    match PeerStart::read(a.as_fd(), u32::MAX) {
        PeerStart::Unknown(why) => assert!(why.contains("/proc/4294967295/stat"), "{why}"),
        known => panic!("no such process, yet {known:?}"),
    }
}

/// By pid, the start time decides; where it is unknown the peer is gone.
/// By socket, the kernel's pidfd is taken (where it has one) whatever the
/// start time says.
#[test]
fn peer_pidfd_by_pid_checks_the_start_time_and_by_socket_asks_the_kernel() {
    let me = proc::pid();
    let mine = proc::start_time(me).unwrap();
    let (a, _b) = UnixStream::pair().unwrap();
    let fd = peer_pidfd(a.as_fd(), me, &PeerStart::Known(mine), ExitWatch::ByPid, "peer").unwrap();
    assert_eq!(fd.map(|fd| pid_of(&fd)), Some(me));
    let wrong = PeerStart::Known(mine + 1);
    assert!(matches!(
        peer_pidfd(a.as_fd(), me, &wrong, ExitWatch::ByPid, "peer"),
        Err(SmError::PidReused { .. })
    ));
    let unknown = PeerStart::Unknown("test".into());
    match peer_pidfd(a.as_fd(), me, &unknown, ExitWatch::ByPid, "peer") {
        Err(SmError::PeerGone { reason, .. }) => {
            assert!(reason.contains("could not be identified"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    match socket::peer_pidfd(a.as_fd()) {
        Ok(_) => {
            let fd = peer_pidfd(a.as_fd(), me, &wrong, ExitWatch::Socket, "peer").unwrap();
            assert_eq!(fd.map(|fd| pid_of(&fd)), Some(me));
        }
        Err(e) => na_core::testing::report_not_run(&format!(
            "na-sm identity test: SO_PEERPIDFD unavailable here ({e}); the by-pid path is all there is"
        )),
    }
}

/// A start time we failed to read (out of descriptors, say) says nothing
/// of the peer: it is watched by end-of-file only, not taken as gone;
/// only "no such process" or "no such file" say it is gone.
#[test]
fn a_failure_of_ours_to_read_a_start_time_is_not_the_peers_death() {
    let child = sleeper("identity-unreadable");
    let (a, _b) = UnixStream::pair().unwrap();
    let why = PeerStart::Unreadable("reading /proc/N/stat: Too many open files".into());
    let r = peer_pidfd(a.as_fd(), child.pid(), &why, ExitWatch::ByPid, "peer");
    assert!(matches!(r, Ok(None)), "{r:?}");
    let gone = PeerStart::Unknown("reading /proc/N/stat: No such file or directory".into());
    assert!(peer_pidfd(a.as_fd(), child.pid(), &gone, ExitWatch::ByPid, "peer").is_err());
    for (errno, gone) in [
        (libc::ENOENT, true),
        (libc::ESRCH, true),
        (libc::EMFILE, false),
        (libc::ENFILE, false),
        (libc::ENOMEM, false),
        (libc::EACCES, false),
    ] {
        assert_eq!(
            says_gone(&std::io::Error::from_raw_os_error(errno)),
            gone,
            "errno {errno}"
        );
    }
}

/// Watched by end-of-file only, a peer identified by its start time gets
/// no pidfd (even a wrong start time is not checked: nothing is opened),
/// and one that could not be identified is still gone.
#[test]
fn by_end_of_file_only_no_pidfd_is_opened() {
    let me = proc::pid();
    let mine = proc::start_time(me).unwrap();
    let (a, _b) = UnixStream::pair().unwrap();
    for start in [mine, mine + 1] {
        let r = peer_pidfd(
            a.as_fd(),
            me,
            &PeerStart::Known(start),
            ExitWatch::EofOnly,
            "peer",
        );
        assert!(matches!(r, Ok(None)), "{r:?}");
    }
    let unknown = PeerStart::Unknown("test".into());
    assert!(matches!(
        peer_pidfd(a.as_fd(), me, &unknown, ExitWatch::EofOnly, "peer"),
        Err(SmError::PeerGone { .. })
    ));
}
