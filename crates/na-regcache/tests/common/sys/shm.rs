//! SysV shared memory: [shmat(2)] over a range, [shmdt(2)].
//!
//! [shmat(2)]: https://man7.org/linux/man-pages/man2/shmat.2.html
//! [shmdt(2)]: https://man7.org/linux/man-pages/man2/shmdt.2.html

use std::io;

/// A new private SysV shared memory segment of `len` bytes attached over
/// whatever is at `at` ([shmat(2)] with `SHM_REMAP`); the segment is marked
/// for removal at once, so it goes with its last detach.
///
/// [shmat(2)]: https://man7.org/linux/man-pages/man2/shmat.2.html
pub fn shm_attach_over(at: usize, len: usize) -> io::Result<usize> {
    // SAFETY: shmget takes integers only.
    let id = unsafe { libc::shmget(libc::IPC_PRIVATE, len, libc::IPC_CREAT | 0o600) };
    if id < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `at` is a mapping the scenario owns and no Rust reference
    // points into it; SHM_REMAP replaces it, as MAP_FIXED would.
    let p = unsafe { libc::shmat(id, at as *const _, libc::SHM_REMAP) };
    let attached = if p as isize == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(p as usize)
    };
    // SAFETY: IPC_RMID on the segment made above; a null buffer is allowed.
    unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
    attached
}

/// [shmdt(2)]: detaches the SysV segment attached at `addr`.
///
/// [shmdt(2)]: https://man7.org/linux/man-pages/man2/shmdt.2.html
pub fn shm_detach(addr: usize) -> io::Result<()> {
    // SAFETY: the scenario attached the segment at `addr` and holds no
    // Rust reference into it.
    if unsafe { libc::shmdt(addr as *const _) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
