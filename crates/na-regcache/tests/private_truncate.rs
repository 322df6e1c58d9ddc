//! The documented remedy for the one change no monitor sees (a file
//! mapped `MAP_PRIVATE` and truncated under the registration, the
//! `file_private_truncate` row of the corruption table, ✘ everywhere):
//! `Cache::invalidate` of the mapping after the truncation. The next
//! transfer then goes to the pages the mapping shows, and a handle held
//! across the truncation reads invalid. Real pins (io_uring fixed
//! buffers), real userfaultfd.

mod common;

use common::sys::{self, PAGE};
use common::{Outcome, Rig};
use na_regcache::{Access, MonitorChoice};

const LEN: usize = 4 * PAGE;

#[test]
fn invalidating_a_truncated_private_file_mapping_by_hand_serves_its_new_pages() {
    common::require_io_uring();
    let rig = Rig::new(MonitorChoice::Uffd);
    let f = sys::memfd(LEN).expect("memfd");
    let a = sys::map_private_fd(LEN, &f).expect("mmap");
    sys::touch(a, LEN, 0xEE);
    rig.prime(a, LEN);
    let held = rig.cache.get(a, LEN, Access::LOCAL_WRITE).expect("get");
    assert!(held.is_cached(), "a private file mapping is cached");
    sys::truncate(&f, 0).expect("ftruncate");
    sys::truncate(&f, LEN).expect("ftruncate");
    assert!(held.is_valid_now(), "no monitor sees it: that is the limitation");
    rig.cache.invalidate(a, LEN);
    assert!(!held.is_valid(), "the handle held across the truncation");
    drop(held);
    sys::touch(a, LEN, 0xEE);
    let o = rig.transfer(a, LEN).expect("transfer");
    assert_eq!(o, Outcome::CLEAN, "after Cache::invalidate");
    sys::unmap(a, LEN).expect("munmap");
}
