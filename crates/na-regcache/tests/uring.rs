//! `UringRegistrar` undoes a registration whose bookkeeping fails after
//! the pin: with PFN tracking, reading `/proc/self/pagemap` comes after
//! the kernel pinned the pages and took a fixed-buffer slot, and a failed
//! read must give both back. The read is made to fail by the kernel (a
//! seccomp filter on the registering thread), on a real ring and real
//! memory.

mod common;

use common::sys::{self, PAGE};
use na_regcache::{Access, Registrar, UringRegistrar};

#[test]
fn a_failed_pagemap_read_gives_the_pin_and_the_slot_back() {
    common::require_io_uring();
    // One slot: a leaked one leaves none for the next registration.
    let reg = UringRegistrar::new(1, true).expect("io_uring registrar with PFN tracking");
    let buf = sys::map_anon(None, 4 * PAGE).expect("mmap");
    sys::touch(buf, 4 * PAGE, 0x5A);
    let failed = std::thread::scope(|s| {
        s.spawn(|| {
            sys::fail_pread_in_this_thread(libc::EIO)?;
            Ok::<_, std::io::Error>(reg.register(buf, 4 * PAGE, Access::LOCAL_WRITE))
        })
        .join()
        .expect("registering thread")
    });
    let failed = match failed {
        Ok(r) => r,
        Err(e) => {
            na_core::testing::report_not_run(&format!(
                "na-regcache a_failed_pagemap_read_gives_the_pin_and_the_slot_back: \
                 no seccomp filter to make the pagemap read fail ({e})"
            ));
            return;
        }
    };
    let err = failed.expect_err("the pagemap read failed: so must the registration");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // The only slot is free again: a registration in an unfiltered thread
    // gets it, with the frames this time.
    let again = reg
        .register(buf, 4 * PAGE, Access::LOCAL_WRITE)
        .expect("the failed registration gave its slot back");
    assert_eq!(again.pfns.len(), 4);
    reg.deregister(again).expect("deregister");
    sys::unmap(buf, 4 * PAGE).expect("munmap");
}
