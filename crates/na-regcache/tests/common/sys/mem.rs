//! Raw reads and writes of the scenarios' mappings (never through Rust
//! references: the kernel and the device change them under the test),
//! and the static buffer of the "static memory" scenario.

use super::PAGE;

/// Writes `byte` to every page of the range (faults pages in).
pub fn touch(addr: usize, len: usize, byte: u8) {
    // SAFETY: the range is mapped read-write by the scenario.
    unsafe { std::ptr::write_bytes(addr as *mut u8, byte, len) };
}

/// True when every byte of the range equals `byte`.
pub fn all_equal(addr: usize, len: usize, byte: u8) -> bool {
    // SAFETY: the range is mapped and readable; read with volatile loads so
    // the compiler does not assume it unchanged by the kernel's DMA-like write.
    (0..len).all(|i| unsafe { std::ptr::read_volatile((addr + i) as *const u8) } == byte)
}

/// A page-aligned static buffer (the "static memory" scenario).
#[repr(C, align(4096))]
pub struct StaticPages(pub [u8; 4 * PAGE]);

static mut STATIC_PAGES: StaticPages = StaticPages([0; 4 * PAGE]);

/// Address of the static buffer.
pub fn static_pages() -> usize {
    // Only the address is taken; no reference to the static mut is created.
    std::ptr::addr_of_mut!(STATIC_PAGES) as usize
}
