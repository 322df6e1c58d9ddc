//! Process identity and liveness: [getpid(2)], [getuid(2)], [kill(2)] with
//! signal 0, [pidfd_open(2)], [prctl(2)] `PR_SET_PTRACER`, and process
//! start times from [proc(5)].
//!
//! [getpid(2)]: https://man7.org/linux/man-pages/man2/getpid.2.html
//! [getuid(2)]: https://man7.org/linux/man-pages/man2/getuid.2.html
//! [kill(2)]: https://man7.org/linux/man-pages/man2/kill.2.html
//! [pidfd_open(2)]: https://man7.org/linux/man-pages/man2/pidfd_open.2.html
//! [prctl(2)]: https://man7.org/linux/man-pages/man2/prctl.2.html
//! [proc(5)]: https://man7.org/linux/man-pages/man5/proc.5.html

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

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

/// Start time of `pid` in clock ticks since boot (field 22 of
/// `/proc/<pid>/stat`), which with the pid names one process for all time.
pub fn start_time(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unparsable /proc/<pid>/stat"))
}

/// Field 22 of a `/proc/<pid>/stat` line; the command name (field 2) may
/// contain spaces and parentheses, so count from the last `)`.
pub fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_and_start_time() {
        assert!(is_alive(pid()));
        assert!(!is_alive(0));
        let t = start_time(pid()).unwrap();
        assert_eq!(start_time(pid()).unwrap(), t);
        let weird = "12 (a) b) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 777 19";
        assert_eq!(parse_start_time(weird), Some(777));
        assert_eq!(parse_start_time("garbage"), None);
        allow_any_ptracer().unwrap();
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
