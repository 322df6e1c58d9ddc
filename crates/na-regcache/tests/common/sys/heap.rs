//! The program break and glibc's malloc tuning: [sbrk(2)], [mallopt(3)].
//!
//! [sbrk(2)]: https://man7.org/linux/man-pages/man2/sbrk.2.html
//! [mallopt(3)]: https://man7.org/linux/man-pages/man3/mallopt.3.html

use std::io;

/// sbrk(2); returns the previous break.
pub fn sbrk(delta: isize) -> io::Result<usize> {
    // SAFETY: the brk scenario runs in its own process and coordinates with
    // malloc through mallopt (no trimming, large top pad).
    let p = unsafe { libc::sbrk(delta) };
    if p as isize == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(p as usize)
}

/// mallopt(3).
pub fn mallopt(param: libc::c_int, value: libc::c_int) {
    // SAFETY: plain integer parameters.
    unsafe { libc::mallopt(param, value) };
}
