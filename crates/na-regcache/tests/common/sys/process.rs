//! Child processes: [fork(2)], [_exit(2)], [waitpid(2)].
//!
//! [fork(2)]: https://man7.org/linux/man-pages/man2/fork.2.html
//! [_exit(2)]: https://man7.org/linux/man-pages/man2/_exit.2.html
//! [waitpid(2)]: https://man7.org/linux/man-pages/man2/waitpid.2.html

use std::io;

/// fork(2); the child runs `child` and `_exit`s with its return value.
pub fn fork_run(child: impl FnOnce() -> i32) -> io::Result<i32> {
    // SAFETY: the child only runs `child`, then _exits. `child` touches no
    // state another thread may have held at the fork except the allocator,
    // which glibc's fork handlers leave consistent in the child.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // A panic must not unwind into the parent's code (the test
        // harness) running on in the child: it becomes exit code 101.
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
        // SAFETY: _exit skips destructors on purpose (they belong to the parent).
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    if unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if libc::WIFEXITED(status) {
        Ok(libc::WEXITSTATUS(status))
    } else {
        Err(io::Error::other(format!("child died: status {status:#x}")))
    }
}

/// [`fork(2)`](https://man7.org/linux/man-pages/man2/fork.2.html): the
/// raw result (0 in the child, the child's pid in the parent, -1 on
/// error). The child must leave with [`exit_now`] and call nothing that a
/// parent thread may have held a lock of at the fork, except what the test
/// checks on purpose (the cache's fork guard, with a timeout in the
/// parent: [`wait_within`]).
pub fn fork() -> libc::pid_t {
    // SAFETY: the tests' children only free blocks of their copy of the
    // heap, call the cache or monitor under test, and leave with
    // `exit_now` (no destructor, no return into the test harness).
    unsafe { libc::fork() }
}

/// [`_exit(2)`](https://man7.org/linux/man-pages/man2/_exit.2.html): ends
/// a forked child at once with `code`, running no destructor (they belong
/// to the parent).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit ends the process; nothing of it is used afterwards.
    unsafe { libc::_exit(code) }
}

/// [`waitpid(2)`](https://man7.org/linux/man-pages/man2/waitpid.2.html)
/// for child `pid`, without blocking: its exit code once it exited,
/// polling every millisecond; `None` if it has not exited within `limit`
/// (then it is killed, [`kill(2)`](https://man7.org/linux/man-pages/man2/kill.2.html),
/// and reaped).
pub fn wait_within(pid: libc::pid_t, limit: std::time::Duration) -> Option<i32> {
    let t0 = std::time::Instant::now();
    let mut st = 0;
    loop {
        // SAFETY: reaps our own child into a local status word.
        if unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) } == pid {
            return Some(libc::WEXITSTATUS(st));
        }
        if t0.elapsed() > limit {
            // SAFETY: kills and reaps our own hung child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut st, 0);
            }
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
