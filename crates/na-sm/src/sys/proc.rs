//! Process identity and liveness: [getpid(2)], [getuid(2)], [kill(2)] with
//! signal 0, [pidfd_open(2)] and a pidfd's exit ([poll(2)]), [prctl(2)]
//! `PR_SET_PTRACER`, and process start times from [proc(5)].
//!
//! [getpid(2)]: https://man7.org/linux/man-pages/man2/getpid.2.html
//! [getuid(2)]: https://man7.org/linux/man-pages/man2/getuid.2.html
//! [kill(2)]: https://man7.org/linux/man-pages/man2/kill.2.html
//! [pidfd_open(2)]: https://man7.org/linux/man-pages/man2/pidfd_open.2.html
//! [poll(2)]: https://man7.org/linux/man-pages/man2/poll.2.html
//! [prctl(2)]: https://man7.org/linux/man-pages/man2/prctl.2.html
//! [proc(5)]: https://man7.org/linux/man-pages/man5/proc.5.html

use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

/// Our process id.
pub fn pid() -> u32 {
    std::process::id()
}

/// Our real user id.
pub fn uid() -> u32 {
    // SAFETY: getuid takes no arguments and cannot fail.
    unsafe { libc::getuid() }
}

/// Whether process `pid` exists: `kill(pid, 0)` succeeds or fails with
/// `EPERM` (exists, other owner). `ESRCH` means it is gone.
pub fn is_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 performs only the existence and permission check.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// [pidfd_open(2)] (close-on-exec): a descriptor of process `pid` that
/// becomes readable when it exits. Names whatever process has the pid
/// now: call it while the process is known to be the one meant.
///
/// [pidfd_open(2)]: https://man7.org/linux/man-pages/man2/pidfd_open.2.html
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: pidfd_open takes integers only; a successful return is a new
    // descriptor owned by nobody else, so OwnedFd may take it.
    unsafe {
        let fd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = libc::c_int::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// Whether the process of pidfd `fd` has exited: the pidfd is readable
/// ([pidfd_open(2)], [poll(2)] with a zero timeout). A process that has
/// not exited still holds its pid, so nothing read about that pid before
/// this says "no" can be about another process.
///
/// [pidfd_open(2)]: https://man7.org/linux/man-pages/man2/pidfd_open.2.html
/// [poll(2)]: https://man7.org/linux/man-pages/man2/poll.2.html
pub fn pidfd_exited(fd: BorrowedFd<'_>) -> io::Result<bool> {
    Ok(super::poll::revents_now(fd, libc::POLLIN)? & libc::POLLIN != 0)
}

/// Start time of `pid` in clock ticks since boot (field 22 of
/// `/proc/<pid>/stat`, [proc(5)]), which with the pid names one process
/// for all time. `ENOENT` if no process has the pid.
///
/// [proc(5)]: https://man7.org/linux/man-pages/man5/proc.5.html
pub fn start_time(pid: u32) -> io::Result<u64> {
    // Bytes: the command name is the process's own choice, not always UTF-8.
    let stat = std::fs::read(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unparsable /proc/<pid>/stat"))
}

/// Field 22 of a `/proc/<pid>/stat` line; the command name (field 2) may
/// contain any byte but NUL and `/` (spaces and parentheses too), so count
/// from the last `)`.
pub fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let at = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[at + 1..]).ok()?;
    // After ")" come fields 3, 4, ...; field 22 is the 20th of them.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The pid `pid` (of our PID namespace) has in its own, innermost one:
/// the last `NSpid` field of `/proc/<pid>/status` (Linux 4.1+); `None` if
/// that cannot be read.
pub fn innermost_pid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_innermost_pid(&status)
}

/// The last pid of the `NSpid:` line of a `/proc/<pid>/status` text.
pub fn parse_innermost_pid(status: &str) -> Option<u32> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_ascii_whitespace().last()?.parse().ok()
}

/// Lets any process of our uid attach with ptrace-class access (and so use
/// `process_vm_readv`/`writev` on us) when Yama's `ptrace_scope` is 1.
/// Harmless (`EINVAL`) where Yama is absent.
pub fn allow_any_ptracer() -> io::Result<()> {
    // SAFETY: PR_SET_PTRACER takes integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    if r == -1 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINVAL) {
            return Ok(());
        }
        return Err(e);
    }
    Ok(())
}

/// Real processes for tests.
#[cfg(test)]
pub(crate) mod testing {
    /// A `sleep 30` whose command name is `name` (it runs through a
    /// symlink of that name: the kernel names a process after the file it
    /// executes); killed and reaped when dropped.
    pub(crate) struct Named {
        pub child: std::process::Child,
        dir: std::path::PathBuf,
    }

    impl Named {
        /// Starts one (`tag` names its temporary directory).
        pub fn spawn(tag: &str, name: &std::ffi::OsStr) -> Named {
            let dir = std::env::temp_dir().join(format!("qs-sm-proc-{tag}-{}", super::pid()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let link = dir.join(name);
            std::os::unix::fs::symlink("/bin/sleep", &link).unwrap();
            let child = std::process::Command::new(&link).arg("30").spawn().unwrap();
            let named = Named { child, dir };
            named.await_name(name);
            named
        }

        /// Waits until the kernel shows the child under `name`: `spawn`
        /// returns as soon as the exec is under way (its close-on-exec
        /// descriptors closed, or its vfork parent released), before
        /// the exec renames the process, so `/proc/PID/comm` may still
        /// say the parent's name for a moment.
        fn await_name(&self, name: &std::ffi::OsStr) {
            use std::os::unix::ffi::OsStrExt;
            // The kernel keeps at most 15 bytes of it.
            let want = &name.as_bytes()[..name.len().min(15)];
            let path = format!("/proc/{}/comm", self.pid());
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            loop {
                let comm = std::fs::read(&path).unwrap();
                if comm.strip_suffix(b"\n") == Some(want) {
                    return;
                }
                assert!(
                    std::time::Instant::now() < end,
                    "the child still shows as {:?} 5 s after its spawn",
                    String::from_utf8_lossy(&comm)
                );
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }

        /// Its pid.
        pub fn pid(&self) -> u32 {
            self.child.id()
        }

        /// Kills it and waits until it has exited (a zombie, not reaped).
        pub fn kill_unreaped(&mut self) {
            self.child.kill().unwrap();
            let fd = super::pidfd_open(self.pid()).unwrap();
            let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while !super::pidfd_exited(std::os::fd::AsFd::as_fd(&fd)).unwrap() {
                assert!(std::time::Instant::now() < end, "killed 5 s ago, still running");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    impl Drop for Named {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::Named;
    use super::*;

    #[test]
    fn liveness_and_start_time() {
        assert!(is_alive(pid()));
        assert!(!is_alive(0));
        let t = start_time(pid()).unwrap();
        assert_eq!(start_time(pid()).unwrap(), t);
        let weird = b"12 (a) b) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 19";
        assert_eq!(parse_start_time(weird), Some(777));
        assert_eq!(parse_start_time(b"garbage"), None);
        allow_any_ptracer().unwrap();
    }

    /// A real process whose command name has spaces, parentheses, a `) `
    /// followed by what looks like fields, and a byte that is not UTF-8:
    /// its start time is read from the right field, is later than ours
    /// (it started 30 ms after this test did) and does not change.
    #[test]
    fn start_time_of_a_process_with_a_hostile_name() {
        use std::os::unix::ffi::OsStrExt;
        let mine = start_time(pid()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let name = b"q\xff) S 1 (2) 3";
        let child = Named::spawn("hostile-name", std::ffi::OsStr::from_bytes(name));
        let comm = std::fs::read(format!("/proc/{}/comm", child.pid())).unwrap();
        assert_eq!(&comm[..], &[&name[..], b"\n"].concat()[..], "the name under test");
        let theirs = start_time(child.pid()).unwrap();
        assert!(
            theirs > mine,
            "child started at {theirs}, we at {mine} (clock ticks)"
        );
        // Field 22 is what the kernel says it is: at most now, in ticks.
        // SAFETY (test): sysconf takes an integer only.
        let ticks = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap();
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY (test): `now` is a live timespec.
        assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) }, 0);
        let now_ticks = now.tv_sec as u64 * ticks + now.tv_nsec as u64 * ticks / 1_000_000_000;
        assert!(
            theirs <= now_ticks && now_ticks - theirs < 10 * ticks,
            "{theirs} vs now {now_ticks}"
        );
        assert_eq!(start_time(child.pid()).unwrap(), theirs, "stable");
        assert_eq!(start_time(pid()).unwrap(), mine, "stable");
    }

    /// A pidfd is not readable while its process runs, is once it has
    /// exited (before it is reaped too), and stays so; a reaped pid has no
    /// pidfd and no start time.
    #[test]
    fn pidfd_exited_follows_the_process() {
        let mut child = Named::spawn("pidfd-exit", std::ffi::OsStr::new("sleeper"));
        let fd = pidfd_open(child.pid()).unwrap();
        assert!(!pidfd_exited(std::os::fd::AsFd::as_fd(&fd)).unwrap(), "running");
        let t = start_time(child.pid()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            !pidfd_exited(std::os::fd::AsFd::as_fd(&fd)).unwrap(),
            "still running"
        );
        // (Fails the test if the pidfd never says so.)
        child.kill_unreaped();
        assert!(pidfd_exited(std::os::fd::AsFd::as_fd(&fd)).unwrap(), "exited");
        assert_eq!(
            start_time(child.pid()).unwrap(),
            t,
            "a zombie keeps its pid and start time"
        );
        child.child.wait().unwrap();
        assert!(pidfd_exited(std::os::fd::AsFd::as_fd(&fd)).unwrap(), "reaped");
        let gone = pidfd_open(child.pid()).unwrap_err();
        assert_eq!(gone.raw_os_error(), Some(libc::ESRCH), "{gone}");
        let e = start_time(child.pid()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }

    #[test]
    fn innermost_pid_reads_the_last_nspid() {
        assert_eq!(innermost_pid(pid()), Some(pid()), "our own, in one namespace");
        let nested = "Name:\tx\nTgid:\t334\nNSpid:\t334\t1\nNSsid:\t1\n";
        assert_eq!(parse_innermost_pid(nested), Some(1));
        assert_eq!(parse_innermost_pid("Name:\tx\n"), None, "no NSpid line");
        assert_eq!(parse_innermost_pid("NSpid:\n"), None);
    }
}
