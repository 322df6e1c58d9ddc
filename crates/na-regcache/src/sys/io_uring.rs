//! Thin safe wrappers over the raw io_uring system calls
//! ([io_uring_setup(2)], [io_uring_register(2)], [io_uring_enter(2)]): just
//! enough for fixed buffers (`IORING_REGISTER_BUFFERS2` sparse table plus
//! `IORING_REGISTER_BUFFERS_UPDATE`, which pin pages long-term exactly as
//! `ibv_reg_mr` does) and one synchronous `READ_FIXED` at a time.
//!
//! [io_uring_setup(2)]: https://man7.org/linux/man-pages/man2/io_uring_setup.2.html
//! [io_uring_register(2)]: https://man7.org/linux/man-pages/man2/io_uring_register.2.html
//! [io_uring_enter(2)]: https://man7.org/linux/man-pages/man2/io_uring_enter.2.html

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

const IORING_OFF_SQ_RING: libc::off_t = 0;
const IORING_OFF_CQ_RING: libc::off_t = 0x800_0000;
const IORING_OFF_SQES: libc::off_t = 0x1000_0000;
const IORING_ENTER_GETEVENTS: u32 = 1;
const IORING_OP_READ_FIXED: u8 = 4;
const IORING_REGISTER_BUFFERS2: u32 = 15;
const IORING_REGISTER_BUFFERS_UPDATE: u32 = 16;
const IORING_RSRC_REGISTER_SPARSE: u32 = 1;

#[repr(C)]
#[derive(Default)]
struct SqringOffsets {
    head: u32,
    tail: u32,
    ring_mask: u32,
    ring_entries: u32,
    flags: u32,
    dropped: u32,
    array: u32,
    resv1: u32,
    user_addr: u64,
}

#[repr(C)]
#[derive(Default)]
struct CqringOffsets {
    head: u32,
    tail: u32,
    ring_mask: u32,
    ring_entries: u32,
    overflow: u32,
    cqes: u32,
    flags: u32,
    resv1: u32,
    user_addr: u64,
}

#[repr(C)]
#[derive(Default)]
struct Params {
    sq_entries: u32,
    cq_entries: u32,
    flags: u32,
    sq_thread_cpu: u32,
    sq_thread_idle: u32,
    features: u32,
    wq_fd: u32,
    resv: [u32; 3],
    sq_off: SqringOffsets,
    cq_off: CqringOffsets,
}

#[repr(C)]
#[derive(Default)]
struct Sqe {
    opcode: u8,
    flags: u8,
    ioprio: u16,
    fd: i32,
    off: u64,
    addr: u64,
    len: u32,
    rw_flags: u32,
    user_data: u64,
    buf_index: u16,
    personality: u16,
    splice_fd_in: i32,
    addr3: u64,
    pad2: u64,
}

#[repr(C)]
struct Cqe {
    user_data: u64,
    res: i32,
    flags: u32,
}

#[repr(C)]
struct RsrcRegister {
    nr: u32,
    flags: u32,
    resv2: u64,
    data: u64,
    tags: u64,
}

#[repr(C)]
struct RsrcUpdate2 {
    offset: u32,
    resv: u32,
    data: u64,
    tags: u64,
    nr: u32,
    resv2: u32,
}

const _: () = assert!(std::mem::size_of::<Params>() == 120);
const _: () = assert!(std::mem::size_of::<Sqe>() == 64);
const _: () = assert!(std::mem::size_of::<Cqe>() == 16);
const _: () = assert!(std::mem::size_of::<RsrcRegister>() == 32);
const _: () = assert!(std::mem::size_of::<RsrcUpdate2>() == 32);

/// One `mmap`ed region of the ring.
struct Region {
    ptr: NonNull<u8>,
    len: usize,
}

impl Region {
    fn map(fd: RawFd, len: usize, offset: libc::off_t) -> io::Result<Region> {
        // SAFETY: a new shared mapping of the ring descriptor at a documented
        // offset; no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(io::Error::last_os_error)?;
        Ok(Region { ptr, len })
    }

    /// The u32 at byte offset `off` (ring indices are u32 shared with the kernel).
    fn u32_at(&self, off: u32) -> &AtomicU32 {
        assert!(off as usize + 4 <= self.len);
        // SAFETY: in bounds (checked), 4-aligned by the kernel's layout, and the
        // mapping lives as long as `self`; the kernel accesses it atomically too.
        unsafe { &*self.ptr.as_ptr().add(off as usize).cast::<AtomicU32>() }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; no reference outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A minimal io_uring instance: submission and completion are synchronous
/// (one request in flight), callers serialize access (`&mut self`).
pub struct Ring {
    sq: Region,
    cq: Region,
    sqes: Region,
    p: Params,
    fd: OwnedFd,
}

// SAFETY: the ring memory is only touched through &mut self or atomics.
unsafe impl Send for Ring {}

impl Ring {
    /// [io_uring_setup(2)] with `entries` submission slots.
    ///
    /// [io_uring_setup(2)]: https://man7.org/linux/man-pages/man2/io_uring_setup.2.html
    pub fn new(entries: u32) -> io::Result<Ring> {
        let mut p = Params::default();
        // SAFETY: io_uring_setup reads/writes one `struct io_uring_params`;
        // `p` has that layout (size asserted) and outlives the call.
        let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, entries, &mut p as *mut Params) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: freshly returned descriptor, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let sq_len = p.sq_off.array as usize + p.sq_entries as usize * 4;
        let cq_len = p.cq_off.cqes as usize + p.cq_entries as usize * 16;
        let sq = Region::map(fd.as_raw_fd(), sq_len, IORING_OFF_SQ_RING)?;
        let cq = Region::map(fd.as_raw_fd(), cq_len, IORING_OFF_CQ_RING)?;
        let sqes = Region::map(fd.as_raw_fd(), p.sq_entries as usize * 64, IORING_OFF_SQES)?;
        Ok(Ring { sq, cq, sqes, p, fd })
    }

    fn register(&self, opcode: u32, arg: *const libc::c_void, nr: u32) -> io::Result<i64> {
        // SAFETY: callers pass an `arg` pointing at the structure `opcode`
        // documents, alive for the call.
        let r = unsafe { libc::syscall(libc::SYS_io_uring_register, self.fd.as_raw_fd(), opcode, arg, nr) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// `IORING_REGISTER_BUFFERS2` with a sparse table of `slots` empty entries.
    pub fn register_sparse_buffers(&self, slots: u32) -> io::Result<()> {
        let reg = RsrcRegister {
            nr: slots,
            flags: IORING_RSRC_REGISTER_SPARSE,
            resv2: 0,
            data: 0,
            tags: 0,
        };
        let size = std::mem::size_of::<RsrcRegister>() as u32;
        self.register(
            IORING_REGISTER_BUFFERS2,
            (&reg as *const RsrcRegister).cast(),
            size,
        )?;
        Ok(())
    }

    /// `IORING_REGISTER_BUFFERS_UPDATE` of one slot: pins `[addr, addr+len)`
    /// long-term (or, with `len == 0`, drops the slot's pin).
    pub fn update_buffer(&self, slot: u32, addr: usize, len: usize) -> io::Result<()> {
        let iov = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len,
        };
        let upd = RsrcUpdate2 {
            offset: slot,
            resv: 0,
            data: &iov as *const libc::iovec as u64,
            tags: 0,
            nr: 1,
            resv2: 0,
        };
        let size = std::mem::size_of::<RsrcUpdate2>() as u32;
        let n = self.register(
            IORING_REGISTER_BUFFERS_UPDATE,
            (&upd as *const RsrcUpdate2).cast(),
            size,
        )?;
        if n != 1 {
            return Err(io::Error::other(format!("buffer update touched {n} slots")));
        }
        Ok(())
    }

    /// Submits one `READ_FIXED` of `len` bytes from `fd` at `offset` into
    /// `addr` through fixed buffer `slot`, and waits for it. The kernel writes
    /// the physical pages pinned in the slot, whatever `addr` maps to now.
    pub fn read_fixed(
        &mut self,
        fd: RawFd,
        offset: u64,
        addr: usize,
        len: u32,
        slot: u16,
    ) -> io::Result<usize> {
        let off = &self.p.sq_off;
        let tail = self.sq.u32_at(off.tail).load(Ordering::Acquire);
        let mask = self.sq.u32_at(off.ring_mask).load(Ordering::Relaxed);
        let index = tail & mask;
        let sqe = Sqe {
            opcode: IORING_OP_READ_FIXED,
            fd,
            off: offset,
            addr: addr as u64,
            len,
            user_data: u64::from(tail),
            buf_index: slot,
            ..Sqe::default()
        };
        assert!((index as usize + 1) * 64 <= self.sqes.len);
        // SAFETY: `index` is within the SQE array (asserted); the slot is
        // ours until we publish the new tail (single submitter: &mut self).
        unsafe {
            self.sqes
                .ptr
                .as_ptr()
                .cast::<Sqe>()
                .add(index as usize)
                .write(sqe)
        };
        self.sq
            .u32_at(off.array + index * 4)
            .store(index, Ordering::Relaxed);
        self.sq
            .u32_at(off.tail)
            .store(tail.wrapping_add(1), Ordering::Release);
        loop {
            // SAFETY: io_uring_enter on our ring with no signal mask pointer.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_io_uring_enter,
                    self.fd.as_raw_fd(),
                    1u32,
                    1u32,
                    IORING_ENTER_GETEVENTS,
                    std::ptr::null::<libc::c_void>(),
                    0usize,
                )
            };
            if r >= 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        self.reap()
    }

    fn reap(&mut self) -> io::Result<usize> {
        let off = &self.p.cq_off;
        let head = self.cq.u32_at(off.head).load(Ordering::Relaxed);
        let tail = self.cq.u32_at(off.tail).load(Ordering::Acquire);
        if head == tail {
            return Err(io::Error::other("io_uring: no completion after enter"));
        }
        let mask = self.cq.u32_at(off.ring_mask).load(Ordering::Relaxed);
        let at = off.cqes as usize + (head & mask) as usize * 16;
        assert!(at + 16 <= self.cq.len);
        // SAFETY: in bounds (asserted); the kernel published this CQE before
        // the tail we acquired.
        let res = unsafe { self.cq.ptr.as_ptr().add(at).cast::<Cqe>().read().res };
        self.cq
            .u32_at(off.head)
            .store(head.wrapping_add(1), Ordering::Release);
        if res < 0 {
            Err(io::Error::from_raw_os_error(-res))
        } else {
            Ok(res as usize)
        }
    }
}
