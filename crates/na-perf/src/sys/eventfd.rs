//! The eventfds ([eventfd(2)]) of the wake-up floor: na-core's wrapper of
//! the system calls, [`EventFd`], made with na-perf's rules ([`new`]: a
//! counter at 0, non-blocking, inheritable by the peer process on
//! request). The floor writes and reads counts ([`EventFd::write`],
//! [`EventFd::read`]); the peer takes its inherited copies with
//! [`EventFd::from_owned`] after [`super::fd::take_inherited`] checked
//! what they are.
//!
//! [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html

use std::io;

pub use na_core::sys::eventfd::EventFd;

/// [eventfd(2)] with `EFD_NONBLOCK` and a counter of 0. With `inheritable`
/// the descriptor is *not* close-on-exec, so that a child started next
/// inherits it.
///
/// [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html
pub fn new(inheritable: bool) -> io::Result<EventFd> {
    let flags = libc::EFD_NONBLOCK | if inheritable { 0 } else { libc::EFD_CLOEXEC };
    EventFd::with_counter(0, flags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, AsRawFd};

    /// Whether the descriptor is close-on-exec (`/proc/self/fdinfo`).
    fn cloexec(e: &EventFd) -> bool {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", e.as_raw_fd())).unwrap();
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).unwrap();
        i32::from_str_radix(flags.trim(), 8).unwrap() & libc::O_CLOEXEC != 0
    }

    #[test]
    fn inheritable_only_on_request_and_counts_add_up() {
        assert!(cloexec(&new(false).unwrap()));
        let e = new(true).unwrap();
        assert!(!cloexec(&e), "an inheritable one is not close-on-exec");
        assert_eq!(e.read().unwrap(), None, "made at 0");
        e.write(1).unwrap();
        e.write(41).unwrap();
        assert_eq!(e.read().unwrap(), Some(42));
        let peer = EventFd::from_owned(e.as_fd().try_clone_to_owned().unwrap());
        peer.write(7).unwrap();
        assert_eq!(e.read().unwrap(), Some(7), "one counter behind both");
    }
}
