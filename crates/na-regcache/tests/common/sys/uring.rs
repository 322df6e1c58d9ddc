//! io_uring transfers through the cache's fixed buffers.

use std::io;
use std::os::fd::AsRawFd;

/// `READ_FIXED` (`UringRegistrar::read_fixed`) of `len` bytes of `fd` at
/// `offset` into `[addr, addr+len)` through `buf`.
pub fn read_fixed(
    reg: &na_regcache::UringRegistrar,
    buf: &na_regcache::FixedBuffer,
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    addr: usize,
    len: usize,
) -> io::Result<usize> {
    // SAFETY: the scenarios transfer into this module's raw mappings
    // (`map_anon` and the like), which the tests reach only through its raw
    // copies (`touch`, `all_equal`), never through Rust references; `fd`
    // is borrowed for the call.
    unsafe { reg.read_fixed(buf, fd.as_raw_fd(), offset, addr, len) }
}
