//! The documented remedy for a SysV segment attached over registered
//! memory (`shmat` with `SHM_REMAP`, the `shmat_remap` row of the
//! corruption table, ✘ everywhere: the kernel sends userfaultfd no event):
//! `Cache::invalidate` of the range after the attach. The next transfer
//! then goes to the segment's pages, and a handle held across the attach
//! reads invalid. Real pins (io_uring fixed buffers), real userfaultfd.

mod common;

use common::sys::{self, PAGE};
use common::{Outcome, Rig};
use na_regcache::{Access, MonitorChoice};

const LEN: usize = 4 * PAGE;

#[test]
fn invalidating_a_range_a_segment_was_attached_over_serves_its_pages() {
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    let a = sys::map_anon(None, LEN).expect("mmap");
    sys::touch(a, LEN, 0xEE);
    rig.prime(a, LEN);
    let held = rig.cache.get(a, LEN, Access::LOCAL_WRITE).expect("get");
    assert!(held.is_cached(), "private anonymous memory is cached");
    sys::shm_attach_over(a, LEN).expect("shmat");
    assert!(held.is_valid_now(), "no monitor sees it: that is the limitation");
    rig.cache.invalidate(a, LEN);
    assert!(!held.is_valid(), "the handle held across the attach");
    drop(held);
    sys::touch(a, LEN, 0xEE);
    let o = rig.transfer(a, LEN).expect("transfer");
    assert_eq!(o, Outcome::CLEAN, "after Cache::invalidate");
    sys::shm_detach(a).expect("shmdt");
}
