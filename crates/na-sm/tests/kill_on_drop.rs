//! The tests' own killer of the processes they fork ([`KillOnDrop`], in
//! `common`): once dropped, the process has ended and is reaped if it was
//! our child, so nothing it held open outlives the test (the test
//! runner waits on the output pipes a forked peer inherits: one still
//! held by a dying peer made nextest call a test "leaky"). Each peer here
//! holds the write end of a pipe of ours, which is at end of file as soon
//! as the killer is dropped.

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

mod common;
use common::{pipe, sys, KillOnDrop};

/// Held by each test while it forks and looks at its pipes: a child
/// forked by another test of this binary (run on threads of one process
/// by `cargo test`) would hold a copy of them too.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// [`SERIAL`], whatever another test did while holding it.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether the read end `r` of a pipe is at end of file now (every
/// writer gone): readable at once, with nothing to read.
fn at_eof(r: &mut std::fs::File) -> bool {
    let (n, _) = sys::poll_one(r.as_raw_fd(), libc::POLLIN, 0);
    n == 1 && matches!(r.read(&mut [0u8; 1]), Ok(0))
}

/// Forks a child that holds `holder` (a pipe's write end) and sleeps
/// until it is killed; returns its pid.
fn fork_sleeper(holder: &std::fs::File) -> libc::pid_t {
    let pid = sys::fork();
    assert!(pid >= 0, "fork");
    if pid == 0 {
        // Only sleeps, holding its copy of `holder`, and ends with
        // `exit_now` (never reached: it is killed).
        let _ = holder;
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    pid
}

/// A child: once its killer is dropped it is no child of ours any more
/// (reaped: `waitpid` says `ECHILD`), and the pipe it held is at end of
/// file. (Checked: with the kill alone, as before, `waitpid` finds it,
/// a zombie or still dying, and this fails.)
#[test]
fn a_dropped_killer_leaves_no_zombie_and_no_pipe_held() {
    let _serial = serial();
    let (mut r, w) = pipe();
    let pid = fork_sleeper(&w);
    drop(w);
    let kill = KillOnDrop::new(pid);
    assert_eq!(kill.pid(), pid);
    assert!(!at_eof(&mut r), "the child holds the pipe while it lives");
    drop(kill);
    let mut status = 0;
    let r_wait = sys::waitpid(pid, &mut status, libc::WNOHANG);
    let err = std::io::Error::last_os_error();
    assert_eq!(
        (r_wait, err.raw_os_error()),
        (-1, Some(libc::ECHILD)),
        "the killed child was not reaped (status {status:#x})"
    );
    assert!(at_eof(&mut r), "the killed child still holds the pipe");
}

/// A grandchild (its parent, our child, gone: init or a subreaper has
/// it): not ours to reap, but the killer still waits until it has ended,
/// so the pipe it held is at end of file once the killer is dropped.
/// (Checked: with the kill alone, as before, the pipe is still held just
/// after the drop, and this fails.)
#[test]
fn a_dropped_killer_of_a_grandchild_waits_until_it_has_ended() {
    let _serial = serial();
    let (mut r, w) = pipe();
    let (mut said_r, said_w) = pipe();
    let child = sys::fork();
    assert!(child >= 0, "fork");
    if child == 0 {
        // Forks the grandchild, says its pid, and ends with `exit_now`.
        drop(said_r);
        let g = fork_sleeper(&w);
        sys::write(said_w.as_fd(), &g.to_le_bytes());
        sys::exit_now(0);
    }
    drop((w, said_w));
    let mut g = [0u8; 4];
    said_r.read_exact(&mut g).expect("the child says its child's pid");
    let g = libc::pid_t::from_le_bytes(g);
    let kill = KillOnDrop::new(g);
    let mut status = 0;
    assert_eq!(sys::waitpid(child, &mut status, 0), child);
    assert!(!at_eof(&mut r), "the grandchild holds the pipe while it lives");
    drop(kill);
    assert!(at_eof(&mut r), "the killed grandchild still holds the pipe");
}

/// A child that ended and was reaped before its killer is dropped (by a
/// `wait` of the test's own): the drop neither waits for it nor fails.
#[test]
fn a_killer_of_a_child_reaped_already_does_nothing() {
    let _serial = serial();
    let pid = sys::fork();
    assert!(pid >= 0, "fork");
    if pid == 0 {
        sys::exit_now(7);
    }
    let kill = KillOnDrop::new(pid);
    let mut status = 0;
    assert_eq!(sys::waitpid(pid, &mut status, 0), pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7);
    let t0 = std::time::Instant::now();
    drop(kill);
    // (Not a timing claim: a drop that waited for the process would wait
    // its whole bound, 20 s.)
    assert!(
        t0.elapsed() < common::REAP_BOUND / 2,
        "the drop waited for a process reaped already"
    );
}
