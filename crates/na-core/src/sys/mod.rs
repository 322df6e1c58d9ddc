//! All OS-facing code of `na-core`: every `unsafe` block of the crate lives
//! under this module, one file per facility.

pub mod affinity;
pub mod epoll;
pub mod eventfd;
pub mod process;
pub mod segment;
pub mod timer;

/// Calls a libc function and turns a `-1` return into `io::Error::last_os_error()`.
///
/// Must be invoked inside an `unsafe` block whose `// SAFETY:` comment covers
/// the call's arguments.
#[macro_export]
macro_rules! syscall {
    ($fn:ident ( $($arg:expr),* $(,)? )) => {{
        let res = libc::$fn($($arg),*);
        if res == -1 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(res)
        }
    }};
}
