//! What maps an address range: whether any of its mappings is shared
//! (`MAP_SHARED`: memfd, shmem, hugetlbfs or other files, shared
//! anonymous memory) and the largest page size among them. Asked with the
//! `PROCMAP_QUERY` ioctl on `/proc/self/maps` (Linux 6.11+, one call per
//! mapping, no text), else by reading [proc_pid_maps(5)] (no page sizes).
//!
//! [proc_pid_maps(5)]: https://man7.org/linux/man-pages/man5/proc_pid_maps.5.html

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use super::mem::page_size;
use super::syscall;

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = 0xc068_6611;
/// Out: the mapping is shared (`VM_MAYSHARE`).
const QUERY_VMA_SHARED: u64 = 0x08;
/// In: the mapping covering the address, or else the next one.
const QUERY_COVERING_OR_NEXT_VMA: u64 = 0x10;

/// `struct procmap_query` (`linux/fs.h`).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

const _: () = assert!(std::mem::size_of::<ProcmapQuery>() == 104);

/// The mappings of a range, in short.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backing {
    /// Some mapping of the range is shared.
    pub shared: bool,
    /// The largest page size among its mappings (the base page size when
    /// unknown: `/proc/self/maps` does not say).
    pub page: usize,
}

/// Queries of this process's mappings.
#[derive(Debug)]
pub struct Vmas {
    /// `/proc/self/maps` of the process that opened it.
    maps: File,
    /// `PROCMAP_QUERY` not refused yet.
    ioctl: AtomicBool,
}

impl Vmas {
    /// Opens `/proc/self/maps` (of the calling process, for good).
    pub fn open() -> io::Result<Vmas> {
        Ok(Vmas {
            maps: File::open("/proc/self/maps")?,
            ioctl: AtomicBool::new(true),
        })
    }

    /// What maps `[start, end)` (only the mappings overlapping it count).
    pub fn backing(&self, start: usize, end: usize) -> io::Result<Backing> {
        if self.ioctl.load(Relaxed) {
            match self.query(start, end) {
                // Before Linux 6.11 the file has no ioctls.
                Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => self.ioctl.store(false, Relaxed),
                r => return r,
            }
        }
        Self::parse(start, end)
    }

    fn query(&self, start: usize, end: usize) -> io::Result<Backing> {
        let mut b = Backing {
            shared: false,
            page: page_size(),
        };
        let mut at = start;
        while at < end {
            let mut q = ProcmapQuery {
                size: std::mem::size_of::<ProcmapQuery>() as u64,
                query_flags: QUERY_COVERING_OR_NEXT_VMA,
                query_addr: at as u64,
                ..ProcmapQuery::default()
            };
            // SAFETY: PROCMAP_QUERY reads and writes one `struct
            // procmap_query` of the size given in it; `q` has that layout
            // and outlives the call. Name and build-id sizes are zero, so
            // the kernel writes nothing else.
            match unsafe {
                syscall!(ioctl(
                    self.maps.as_raw_fd(),
                    PROCMAP_QUERY,
                    &mut q as *mut ProcmapQuery
                ))
            } {
                Ok(_) => {}
                // Nothing mapped at or after `at`.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
                Err(e) => return Err(e),
            }
            if q.vma_start as usize >= end {
                break;
            }
            b.shared |= q.vma_flags & QUERY_VMA_SHARED != 0;
            b.page = b.page.max(q.vma_page_size as usize);
            if q.vma_end as usize <= at {
                return Err(io::Error::other("PROCMAP_QUERY went backwards"));
            }
            at = q.vma_end as usize;
        }
        Ok(b)
    }

    /// The same from the text of `/proc/self/maps` (read afresh), without
    /// page sizes.
    fn parse(start: usize, end: usize) -> io::Result<Backing> {
        let text = std::fs::read_to_string("/proc/self/maps")?;
        let mut shared = false;
        for line in text.lines() {
            let mut fields = line.split_whitespace();
            let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
                continue;
            };
            let Some((s, e)) = range.split_once('-') else {
                continue;
            };
            let (Ok(s), Ok(e)) = (usize::from_str_radix(s, 16), usize::from_str_radix(e, 16)) else {
                continue;
            };
            if s >= end {
                break;
            }
            if e > start && perms.as_bytes().get(3) == Some(&b's') {
                shared = true;
            }
        }
        Ok(Backing {
            shared,
            page: page_size(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::mem::Scratch;

    #[test]
    fn private_and_shared_mappings_are_told_apart_by_both_ways() {
        let page = page_size();
        let private = Scratch::new(2 * page).unwrap();
        // SAFETY (test): a fresh shared anonymous mapping, unmapped below.
        let shared = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(shared, libc::MAP_FAILED);
        let shared = shared as usize;
        let v = Vmas::open().unwrap();
        let (p, s) = (private.addr(), shared);
        let want = |shared| Backing { shared, page };
        assert_eq!(v.backing(p, p + 2 * page).unwrap(), want(false));
        assert_eq!(v.backing(s, s + page).unwrap(), want(true));
        assert_eq!(Vmas::parse(p, p + 2 * page).unwrap(), want(false));
        assert_eq!(Vmas::parse(s, s + page).unwrap(), want(true));
        match v.query(p, p + page) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => {
                eprintln!("no PROCMAP_QUERY (Linux 6.11+): only the parse was checked")
            }
            r => {
                assert_eq!(r.unwrap(), want(false));
                assert_eq!(v.query(s, s + page).unwrap(), want(true));
            }
        }
        // SAFETY (test): our mapping from above.
        unsafe { libc::munmap(shared as *mut libc::c_void, page) };
    }
}
