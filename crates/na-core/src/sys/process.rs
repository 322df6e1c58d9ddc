//! Tying a helper process's life to its parent ([prctl(2)]
//! `PR_SET_PDEATHSIG`).
//!
//! [prctl(2)]: https://man7.org/linux/man-pages/man2/prctl.2.html

use std::io;

/// Makes the kernel send `SIGKILL` to this process when the thread that
/// started it exits, then checks that `parent` is still our parent: if it
/// died before the request took effect we were already re-parented, and
/// this returns an error instead of leaving an orphan behind.
///
/// Meant for benchmark and test peers that spin: without it, a parent
/// killed mid-run (by `timeout`, say) leaves a peer burning a core forever.
pub fn exit_with_parent(parent: u32) -> io::Result<()> {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and reads no memory;
    // the unused arguments are zero as prctl(2) asks.
    unsafe {
        crate::syscall!(prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong
        ))?
    };
    // SAFETY: getppid(2) has no arguments and cannot fail.
    let now = unsafe { libc::getppid() };
    if u32::try_from(now).ok() != Some(parent) {
        return Err(io::Error::other(format!(
            "parent process {parent} is gone (our parent is now {now})"
        )));
    }
    Ok(())
}
