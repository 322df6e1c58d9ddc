//! Whole-file advisory locks ([flock(2)]). A listening instance holds one
//! on its owner file for its whole life, so any process sharing the socket
//! directory, in whatever PID namespace, can tell a live owner from a dead
//! one without going by a pid.
//!
//! A lock belongs to the open file description: a forked child shares its
//! parent's (the lock lives until both have closed it), and a second
//! `open` of the same file, in this process or another, conflicts with it.
//!
//! On NFS the Linux client emulates `flock` with whole-file POSIX locks,
//! which belong to the process: two instances of one process would not
//! see each other's locks. [`lock_is_per_process`] tells such a directory
//! apart ([statfs(2)]), so that a listener can say so.
//!
//! [flock(2)]: https://man7.org/linux/man-pages/man2/flock.2.html
//! [statfs(2)]: https://man7.org/linux/man-pages/man2/statfs.2.html

use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// `NFS_SUPER_MAGIC` of `<linux/magic.h>`.
const NFS_SUPER_MAGIC: i64 = 0x6969;

/// True if `file` (an owner file, or the socket directory) is on NFS, where
/// `flock` locks are emulated per process (see the module docs).
pub fn lock_is_per_process(file: &impl AsFd) -> io::Result<bool> {
    // SAFETY: an all-zero `statfs` is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let fd = file.as_fd().as_raw_fd();
    // SAFETY: `fd` is borrowed from `file` (open for the call) and `st` is
    // a writable `statfs` that outlives the call.
    unsafe { super::syscall!(fstatfs(fd, &mut st))? };
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64 == NFS_SUPER_MAGIC)
}

/// Tries to take an exclusive lock on `file` without blocking:
/// `flock(fd, LOCK_EX | LOCK_NB)`. `Ok(true)`: we hold it now, until every
/// descriptor of this open file description is closed; `Ok(false)`:
/// another open file description holds a lock on the file.
pub fn try_lock_exclusive(file: &impl AsFd) -> io::Result<bool> {
    let fd = file.as_fd().as_raw_fd();
    loop {
        // SAFETY: flock takes a descriptor and flags, no pointers; `fd` is
        // borrowed from `file`, so it stays open for the whole call.
        match unsafe { super::syscall!(flock(fd, libc::LOCK_EX | libc::LOCK_NB)) } {
            Ok(_) => return Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_open_file_description_sees_the_lock_until_the_first_closes() {
        let path = std::env::temp_dir().join(format!("qs-sm-lock-unit-{}", std::process::id()));
        std::fs::write(&path, b"x").unwrap();
        let first = std::fs::File::open(&path).unwrap();
        let second = std::fs::File::open(&path).unwrap();
        assert!(try_lock_exclusive(&first).unwrap());
        assert!(try_lock_exclusive(&first).unwrap(), "ours already: taken again");
        assert!(!try_lock_exclusive(&second).unwrap());
        drop(first);
        assert!(try_lock_exclusive(&second).unwrap());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_local_directory_has_real_flock_locks() {
        let dir = std::fs::File::open(std::env::temp_dir()).unwrap();
        // (This host's temporary directory is local; on NFS it would say so.)
        assert!(!lock_is_per_process(&dir).unwrap());
    }
}
