//! A registrar that really pins pages: io_uring fixed buffers.
//!
//! `IORING_REGISTER_BUFFERS_UPDATE` takes the same long-term pin
//! (`FOLL_LONGTERM`) as `ibv_reg_mr`, so a stale registration behaves like a
//! stale MR: a `READ_FIXED` through it writes the *old* physical pages,
//! whatever the virtual address maps to now. Used by the corruption suite
//! and the benchmark; also handy for other crates' tests.

use std::io;
use std::os::fd::RawFd;
use std::sync::Mutex;

use crate::registrar::{Access, Registrar};
use crate::sys::io_uring::Ring;
use crate::sys::mem::{page_size, Pagemap};

/// One registered fixed buffer.
#[derive(Debug)]
pub struct FixedBuffer {
    /// Slot in the ring's buffer table (`buf_index` of `READ_FIXED`).
    pub slot: u16,
    /// Registered start address.
    pub addr: usize,
    /// Registered length.
    pub len: usize,
    /// Page frame numbers at registration time, one per page, when PFN
    /// tracking is on and `/proc/self/pagemap` shows them (root).
    pub pfns: Vec<Option<u64>>,
}

/// io_uring fixed-buffer registrar (a sparse table of `slots` buffers).
pub struct UringRegistrar {
    ring: Mutex<Ring>,
    free: Mutex<Vec<u16>>,
    pagemap: Option<Pagemap>,
}

impl UringRegistrar {
    /// Creates a ring with a sparse table of `slots` (≤ 16384) fixed buffers.
    /// With `track_pfns`, every registration records its pages' frames.
    pub fn new(slots: u16, track_pfns: bool) -> io::Result<UringRegistrar> {
        let ring = Ring::new(8)?;
        ring.register_sparse_buffers(u32::from(slots))?;
        let pagemap = if track_pfns { Some(Pagemap::open()?) } else { None };
        Ok(UringRegistrar {
            ring: Mutex::new(ring),
            free: Mutex::new((0..slots).rev().collect()),
            pagemap,
        })
    }

    /// `READ_FIXED` of `len` bytes from `fd` at `offset` into `addr`
    /// through `buf`'s pinned pages. `[addr, addr+len)` must lie in `buf`.
    ///
    /// # Safety
    /// The kernel writes the file's bytes into this process's memory: the
    /// pages pinned for `[addr, addr+len)` when the buffer in slot
    /// `buf.slot` was registered (what `addr` maps to now does not
    /// matter). It checks only that the range lies in that registration,
    /// and a [`FixedBuffer`] is plain data (it may be forged, and
    /// [`Registrar::register`] registers any mapped range), so the caller
    /// promises that no Rust reference (`&`/`&mut`) covers that memory
    /// during the call: memory reached only through raw pointers, as the
    /// corruption tests' mappings are. `fd` must be open for the call.
    //
    // An `unsafe fn` outside `sys`: it declares the contract and forwards
    // to the ring (no `unsafe` block here).
    #[allow(unsafe_code)]
    pub unsafe fn read_fixed(
        &self,
        buf: &FixedBuffer,
        fd: RawFd,
        offset: u64,
        addr: usize,
        len: usize,
    ) -> io::Result<usize> {
        if addr < buf.addr || addr.saturating_add(len) > buf.addr + buf.len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "range outside the fixed buffer",
            ));
        }
        let len = u32::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.read_fixed(fd, offset, addr, len, buf.slot)
    }

    /// The frame currently behind `addr` (None without PFN tracking or root).
    pub fn current_pfn(&self, addr: usize) -> io::Result<Option<u64>> {
        match &self.pagemap {
            Some(p) => p.pfn(addr),
            None => Ok(None),
        }
    }

    /// Pages of `[addr, addr+len)` whose frame differs from the one `buf`
    /// pinned (0 when frames are not visible, and for an empty range). A
    /// range that starts below the page of the buffer's start, or whose end
    /// overflows, is an `InvalidInput` error; pages past the buffer's last
    /// one are not counted.
    pub fn stale_pages(&self, buf: &FixedBuffer, addr: usize, len: usize) -> io::Result<usize> {
        let page = page_size();
        if len == 0 {
            return Ok(0);
        }
        let base = buf.addr & !(page - 1);
        let (Some(from), Some(to)) = (
            addr.checked_sub(base),
            addr.checked_add(len - 1).and_then(|e| e.checked_sub(base)),
        ) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "range {addr:#x}+{len} is not within the buffer at {:#x}",
                    buf.addr
                ),
            ));
        };
        let (first, last) = (from / page, to / page);
        // No frames recorded (pagemap not readable): none is known stale.
        let Some(last_pinned) = buf.pfns.len().checked_sub(1) else {
            return Ok(0);
        };
        let mut stale = 0;
        for i in first..=last.min(last_pinned) {
            let va = base + i * page;
            if let (Some(then), now) = (buf.pfns[i], self.current_pfn(va)?) {
                if now != Some(then) {
                    stale += 1;
                }
            }
        }
        Ok(stale)
    }
}

impl UringRegistrar {
    /// The frames behind the pages of `[addr, addr+len)`, one per page
    /// (none without PFN tracking).
    fn pinned_frames(&self, addr: usize, len: usize) -> io::Result<Vec<Option<u64>>> {
        let Some(pm) = &self.pagemap else {
            return Ok(Vec::new());
        };
        let page = page_size();
        let end = addr
            .checked_add(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "range end overflows"))?;
        let mut pfns = Vec::new();
        let mut va = addr & !(page - 1);
        while va < end {
            pfns.push(pm.pfn(va)?);
            va += page;
        }
        Ok(pfns)
    }
}

impl Registrar for UringRegistrar {
    type Region = FixedBuffer;
    type Error = io::Error;

    fn register(&self, addr: usize, len: usize, _access: Access) -> io::Result<FixedBuffer> {
        let slot = self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or_else(|| io::Error::new(io::ErrorKind::OutOfMemory, "no free fixed-buffer slot"))?;
        let res =
            self.ring
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .update_buffer(u32::from(slot), addr, len);
        if let Err(e) = res {
            self.free.lock().unwrap_or_else(|p| p.into_inner()).push(slot);
            return Err(e);
        }
        let mut buf = FixedBuffer {
            slot,
            addr,
            len,
            pfns: Vec::new(),
        };
        match self.pinned_frames(addr, len) {
            Ok(pfns) => {
                buf.pfns = pfns;
                Ok(buf)
            }
            // The pages are pinned and the slot taken: both go back, or
            // every failed read of the pagemap would leak a slot for good.
            Err(e) => {
                if let Err(undo) = self.deregister(buf) {
                    tracing::warn!(error = %crate::error::Chain(&undo), slot, "uring registrar: undoing a registration failed");
                }
                Err(e)
            }
        }
    }

    fn deregister(&self, buf: FixedBuffer) -> io::Result<()> {
        let res =
            self.ring
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .update_buffer(u32::from(buf.slot), 0, 0);
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(buf.slot);
        res
    }
}
