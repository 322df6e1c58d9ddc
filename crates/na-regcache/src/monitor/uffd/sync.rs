//! The lookup side of the monitor's guarantee (see the module docs of
//! [`super`], "Why lookups can never see a stale registration"): a sync
//! waits for the reader's round and, in flight, probes the kernel's count
//! of changes whose event was not read yet; and the start-up check that
//! this kernel's probe sees such a change.

use std::io;
use std::sync::atomic::{fence, Ordering::SeqCst};

use super::Shared;
use crate::sys::mem::{page_size, Scratch};
use crate::sys::uffd::{self, Uffd, UffdEvent, UffdMsg};

impl Shared {
    /// [`Monitor::sync`](crate::monitor::Monitor::sync) (`in_flight` false) or
    /// [`Monitor::sync_in_flight`](crate::monitor::Monitor::sync_in_flight).
    /// Afterwards, if a REMOVE range (perhaps marked in the round just
    /// waited for) waits for its settle time to start, probes and starts it:
    /// the flag and the mark serial are loaded before the probe, so a quiet
    /// probe proves the advising threads of the ranges marked by then
    /// awake (and only theirs: a REMOVE read during the probe waits for
    /// the next sync).
    pub(super) fn sync(&self, in_flight: bool) {
        if in_flight {
            self.wait_in_flight();
        }
        self.wait_rounds();
        if self.settle_unarmed.load(SeqCst) {
            let upto = self.marks();
            self.counters[8].fetch_add(1, SeqCst);
            self.wait_changes_read();
            self.arm_settling(upto);
        }
    }

    /// Waits for the reader round that was running (or the last one started)
    /// to finish.
    pub(super) fn wait_rounds(&self) {
        // Pairs with the kernel's ordering of the read that dequeued the
        // last counted event before the count dropped (module docs).
        fence(SeqCst);
        let target = self.started.load(SeqCst);
        let mut spins = 0u32;
        while self.finished.load(SeqCst) < target {
            if spins < 64 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Step (a) of an in-flight sync: probes, unless the map watch shows
    /// that nothing was mapped since a probe that found no change in
    /// flight (see the module docs, "Skipping the probe").
    pub(super) fn wait_in_flight(&self) {
        let Some(watch) = &self.map_watch else {
            self.counters[8].fetch_add(1, SeqCst);
            self.wait_changes_read();
            return;
        };
        // Stored plus one, so that 0 means "no quiet probe yet".
        let stamp = watch.stamp().wrapping_add(1);
        if self.clean_stamp.load(SeqCst) == stamp {
            return;
        }
        self.counters[8].fetch_add(1, SeqCst);
        if self.wait_changes_read() {
            // The quiet probe came after the stamp was loaded.
            self.clean_stamp.fetch_max(stamp, SeqCst);
        }
    }

    /// Waits until no change of a registered range is in flight in the
    /// kernel (see the module docs).
    /// Returns false if the probe failed.
    pub(super) fn wait_changes_read(&self) -> bool {
        let mut spins = 0u32;
        loop {
            match self.uffd.changes_in_flight() {
                Ok(false) => return true,
                Ok(true) => {
                    if spins == 0 {
                        self.counters[5].fetch_add(1, SeqCst);
                    }
                    // The reader (and the changing thread, to leave the
                    // kernel) must run: yield soon, this may take a while.
                    if spins < 8 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                    spins = spins.saturating_add(1);
                }
                Err(_) => {
                    // Not expected (the probe is checked in `new`): count it
                    // and fall back to the reader's rounds alone.
                    self.counters[6].fetch_add(1, SeqCst);
                    return false;
                }
            }
        }
    }
}

/// Proves on this kernel that [`Uffd::changes_in_flight`] sees a change
/// whose event was not read yet: a helper thread unmaps a registered scratch
/// page, and its `munmap` cannot return before we read the UNMAP event.
pub(super) fn check_in_flight_probe(fd: &Uffd) -> io::Result<()> {
    let unsupported = |what: &str| io::Error::new(io::ErrorKind::Unsupported, format!("userfaultfd: {what}"));
    let page = page_size();
    let scratch = Scratch::new(page)?;
    fd.register(scratch.addr(), page, uffd::MODE_WP)?;
    if fd.changes_in_flight()? {
        return Err(unsupported("in-flight change reported while idle"));
    }
    let helper = std::thread::Builder::new()
        .name("qs-uffd-check".into())
        .spawn(move || scratch.unmap())?;
    // The event is queued (the descriptor turns readable) only after the
    // kernel counted the change, and stays counted until it is read.
    let mut queued = false;
    for _ in 0..100 {
        if uffd::poll_readable(fd.as_raw_fd(), -1, 100)?.0 {
            queued = true;
            break;
        }
    }
    if !queued {
        // Not joined: whatever keeps it is released with the descriptor.
        return Err(unsupported("no UNMAP event for a registered page"));
    }
    let during = fd.changes_in_flight();
    let mut buf = [UffdMsg::default(); 4];
    let mut released = false;
    for _ in 0..100 {
        match fd.read_events(&mut buf) {
            Ok(n) => {
                released = buf[..n]
                    .iter()
                    .any(|m| matches!(m.decode(), UffdEvent::Unmap { .. }))
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // Dropping the descriptor (caller) releases the helper.
            Err(e) => return Err(e),
        }
        if released {
            break;
        }
        uffd::poll_readable(fd.as_raw_fd(), -1, 100)?;
    }
    if !released {
        return Err(unsupported(
            "the UNMAP event of a registered page could not be read",
        ));
    }
    helper
        .join()
        .map_err(|_| io::Error::other("userfaultfd check thread panicked"))??;
    let after = fd.changes_in_flight()?;
    match (during?, after) {
        (true, false) => Ok(()),
        (false, _) => Err(unsupported(
            "UFFDIO_ZEROPAGE does not report in-flight changes (EAGAIN)",
        )),
        (true, true) => Err(unsupported(
            "in-flight change still reported after its event was read",
        )),
    }
}
