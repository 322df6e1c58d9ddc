//! Random bytes from the kernel: [getrandom(2)].
//!
//! [getrandom(2)]: https://man7.org/linux/man-pages/man2/getrandom.2.html

use std::io;

/// Fills `buf` from the kernel's random source (blocking only until it is
/// first initialised at boot), retrying on `EINTR` and short reads.
pub fn fill(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the pointer and length describe `rest`, a live, writable
        // part of `buf` that nothing else touches during the call.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(io::Error::new(e.kind(), format!("getrandom: {e}")));
        }
        done += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn fills_the_whole_buffer_with_something_other_each_time() {
        let (mut a, mut b) = ([0u8; 4096], [0u8; 4096]);
        super::fill(&mut a).unwrap();
        super::fill(&mut b).unwrap();
        assert_ne!(a, b);
        // 4 KiB of zeros (or any one value) from a random source: no.
        assert!(a.iter().any(|&x| x != a[0]));
    }
}
