//! The corruption scenarios: each registers memory through the cache, makes
//! the mapping change under the registration the way a program would, then
//! transfers through whatever the cache returns for the same range.

use std::io;

use super::sys::{self, PAGE};
use super::{Outcome, Rig};

const LEN: usize = 4 * PAGE;
const FILL: u8 = 0xEE;

/// Every scenario, in table order.
pub const ALL: &[&str] = &[
    "heap",
    "stack",
    "static_mem",
    "mmap",
    "mremap",
    "madv_dontneed",
    "madv_free",
    "partial_unmap",
    "map_fixed",
    "shmat_remap",
    "brk",
    "fork",
    "file",
    "file_punch_hole",
    "file_truncate",
    "file_madv_remove",
    "file_private_truncate",
    "thp",
    "unaligned",
];

/// Runs scenario `name` on `rig`.
pub fn run(name: &str, rig: &Rig) -> io::Result<Outcome> {
    match name {
        "heap" => heap(rig),
        "stack" => stack(rig),
        "static_mem" => static_mem(rig),
        "mmap" => mmap(rig),
        "mremap" => mremap(rig),
        "madv_dontneed" => madvise(rig, libc::MADV_DONTNEED),
        "madv_free" => madvise(rig, libc::MADV_FREE),
        "partial_unmap" => partial_unmap(rig),
        "map_fixed" => map_fixed(rig),
        "shmat_remap" => shmat_remap(rig),
        "brk" => brk(rig),
        "fork" => fork(rig),
        "file" => file(rig),
        "file_punch_hole" => file_changed(rig, FileChange::PunchHole),
        "file_truncate" => file_changed(rig, FileChange::Truncate),
        "file_madv_remove" => file_changed(rig, FileChange::RemoveElsewhere),
        "file_private_truncate" => file_private_truncate(rig),
        "thp" => thp(rig),
        "unaligned" => unaligned(rig),
        "hugetlb" => hugetlb(rig),
        other => Err(io::Error::other(format!("unknown scenario {other}"))),
    }
}

fn fresh(len: usize) -> io::Result<usize> {
    let a = sys::map_anon(None, len)?;
    sys::touch(a, len, FILL);
    Ok(a)
}

/// munmap + mmap of new anonymous pages at the same address.
fn replace(a: usize, len: usize) -> io::Result<()> {
    sys::unmap(a, len)?;
    sys::map_anon(Some(a), len)?;
    sys::touch(a, len, FILL);
    Ok(())
}

/// A Rust heap block freed (the allocator unmaps it) and the address reused.
fn heap(rig: &Rig) -> io::Result<Outcome> {
    sys::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    let v = vec![FILL; 1 << 20];
    let base = (v.as_ptr() as usize + PAGE - 1) & !(PAGE - 1);
    rig.prime(base, LEN);
    drop(v);
    sys::map_anon(Some(base), LEN)?;
    sys::touch(base, LEN, FILL);
    rig.transfer(base, LEN)
}

/// A buffer on a thread's stack; the thread exits (glibc drops the unused
/// stack pages below its last frame with MADV_DONTNEED) and the memory is
/// used again.
fn stack(rig: &Rig) -> io::Result<Outcome> {
    #[inline(never)]
    fn with_buffer(rig: &Rig) -> usize {
        let mut buf = [FILL; 5 * PAGE];
        std::hint::black_box(&mut buf);
        let base = (buf.as_ptr() as usize + PAGE - 1) & !(PAGE - 1);
        rig.prime(base, 2 * PAGE);
        std::hint::black_box(&mut buf);
        base
    }
    let base = std::thread::scope(|s| {
        std::thread::Builder::new()
            .stack_size(512 << 10)
            .spawn_scoped(s, || {
                // Push the buffer well below the frames alive at thread exit.
                let mut pad = [0u8; 96 << 10];
                std::hint::black_box(&mut pad);
                let base = with_buffer(rig);
                std::hint::black_box(&mut pad);
                base
            })
            .map(|h| h.join().expect("stack thread"))
    })?;
    rig.transfer(base, 2 * PAGE)
}

/// A static buffer whose pages are dropped with MADV_DONTNEED.
fn static_mem(rig: &Rig) -> io::Result<Outcome> {
    let a = sys::static_pages();
    sys::touch(a, LEN, FILL);
    rig.prime(a, LEN);
    sys::advise(a, LEN, libc::MADV_DONTNEED)?;
    sys::touch(a, LEN, FILL);
    rig.transfer(a, LEN)
}

fn mmap(rig: &Rig) -> io::Result<Outcome> {
    let a = fresh(LEN)?;
    rig.prime(a, LEN);
    replace(a, LEN)?;
    let o = rig.transfer(a, LEN);
    sys::unmap(a, LEN)?;
    o
}

fn mremap(rig: &Rig) -> io::Result<Outcome> {
    let a = fresh(2 * LEN)?;
    rig.prime(a, LEN);
    sys::remap_to(a, LEN, a + LEN)?;
    sys::map_anon(Some(a), LEN)?;
    sys::touch(a, LEN, FILL);
    let o = rig.transfer(a, LEN);
    sys::unmap(a, 2 * LEN)?;
    o
}

fn madvise(rig: &Rig, advice: libc::c_int) -> io::Result<Outcome> {
    let a = fresh(LEN)?;
    rig.prime(a, LEN);
    sys::advise(a, LEN, advice)?;
    if advice == libc::MADV_FREE {
        // Force reclaim of the lazily freed pages (the kernel keeps pinned ones).
        sys::advise(a, LEN, libc::MADV_PAGEOUT)?;
    } else {
        sys::touch(a, LEN, FILL);
    }
    let o = rig.transfer(a, LEN);
    sys::unmap(a, LEN)?;
    o
}

fn partial_unmap(rig: &Rig) -> io::Result<Outcome> {
    let a = fresh(LEN)?;
    rig.prime(a, LEN);
    replace(a + PAGE, PAGE)?;
    let o = rig.transfer(a, LEN);
    sys::unmap(a, LEN)?;
    o
}

fn map_fixed(rig: &Rig) -> io::Result<Outcome> {
    let a = fresh(LEN)?;
    rig.prime(a, LEN);
    sys::map_anon_overlay(a, LEN)?;
    sys::touch(a, LEN, FILL);
    let o = rig.transfer(a, LEN);
    sys::unmap(a, LEN)?;
    o
}

/// A SysV segment attached over registered pages (`shmat` with
/// `SHM_REMAP`): the kernel replaces the mapping without the unmap event
/// `MAP_FIXED` sends to userfaultfd. Detached (`shmdt`) at the end.
fn shmat_remap(rig: &Rig) -> io::Result<Outcome> {
    let a = fresh(LEN)?;
    rig.prime(a, LEN);
    sys::shm_attach_over(a, LEN)?;
    sys::touch(a, LEN, FILL);
    let o = rig.transfer(a, LEN);
    sys::shm_detach(a)?;
    o
}

/// Heap grown with sbrk, shrunk, grown again. Runs in its own process; the
/// allocator is told never to trim and to keep a large top pad so it does
/// not move the break meanwhile.
fn brk(rig: &Rig) -> io::Result<Outcome> {
    sys::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    sys::mallopt(libc::M_TOP_PAD, 64 << 20);
    drop(std::hint::black_box(vec![0u8; 4096]));
    let cur = sys::sbrk(0)?;
    let pad = ((cur + PAGE - 1) & !(PAGE - 1)) - cur;
    sys::sbrk((pad + LEN) as isize)?;
    let a = cur + pad;
    sys::touch(a, LEN, FILL);
    rig.prime(a, LEN);
    sys::sbrk(-(LEN as isize))?;
    sys::sbrk(LEN as isize)?;
    sys::touch(a, LEN, FILL);
    let o = rig.transfer(a, LEN);
    sys::sbrk(-((pad + LEN) as isize))?;
    o
}

/// A forked child must never use the parent's cache: with the fork guard it
/// gets an error; without, its transfer goes to the parent's pinned pages.
fn fork(rig: &Rig) -> io::Result<Outcome> {
    let a = fresh(LEN)?;
    rig.prime(a, LEN);
    let code = sys::fork_run(|| match rig.transfer(a, LEN) {
        Err(e) if e.to_string().contains("forked child") => 0,
        Ok(o) if !o.stale_data => 0,
        Ok(_) => 1,
        Err(_) => 2,
    })?;
    let parent = rig.transfer(a, LEN)?;
    sys::unmap(a, LEN)?;
    match code {
        0 => Ok(parent),
        1 => Ok(Outcome {
            stale_data: true,
            ..parent
        }),
        c => Err(io::Error::other(format!("fork child failed ({c})"))),
    }
}

fn file(rig: &Rig) -> io::Result<Outcome> {
    let f1 = sys::memfd(LEN)?;
    let a = sys::map_shared_fd(None, LEN, &f1)?;
    sys::touch(a, LEN, FILL);
    rig.prime(a, LEN);
    sys::unmap(a, LEN)?;
    let f2 = sys::memfd(LEN)?;
    sys::map_shared_fd(Some(a), LEN, &f2)?;
    sys::touch(a, LEN, FILL);
    let o = rig.transfer(a, LEN);
    sys::unmap(a, LEN)?;
    o
}

/// How a shared file's pages are dropped without touching the registered
/// mapping itself (no munmap, madvise or mremap of it).
#[derive(Clone, Copy)]
enum FileChange {
    /// `fallocate(PUNCH_HOLE)` through the descriptor.
    PunchHole,
    /// `ftruncate` to 0 and back.
    Truncate,
    /// `madvise(MADV_REMOVE)` through a second mapping of the file.
    RemoveElsewhere,
}

/// A `MAP_SHARED` memfd mapping whose file loses its pages under the
/// registration: the mapping now shows new (zeroed, then filled) pages,
/// the registration pins the old ones.
fn file_changed(rig: &Rig, how: FileChange) -> io::Result<Outcome> {
    let f = sys::memfd(LEN)?;
    let a = sys::map_shared_fd(None, LEN, &f)?;
    sys::touch(a, LEN, FILL);
    rig.prime(a, LEN);
    match how {
        FileChange::PunchHole => sys::punch_hole(&f, 0, LEN)?,
        FileChange::Truncate => {
            sys::truncate(&f, 0)?;
            sys::truncate(&f, LEN)?;
        }
        FileChange::RemoveElsewhere => {
            let b = sys::map_shared_fd(None, LEN, &f)?;
            sys::advise(b, LEN, libc::MADV_REMOVE)?;
            sys::unmap(b, LEN)?;
        }
    }
    sys::touch(a, LEN, FILL);
    let o = rig.transfer(a, LEN);
    sys::unmap(a, LEN)?;
    o
}

/// A `MAP_PRIVATE` memfd mapping, written (so its pages are private
/// copies), whose file is truncated to 0 and grown back: the kernel zaps
/// the mapping's pages past the new end, private copies included
/// (`unmap_mapping_range(even_cows)`), and sends no userfaultfd event;
/// the mapping then shows the file's new pages, the registration pins the
/// old copies.
fn file_private_truncate(rig: &Rig) -> io::Result<Outcome> {
    let f = sys::memfd(LEN)?;
    let a = sys::map_private_fd(LEN, &f)?;
    sys::touch(a, LEN, FILL);
    rig.prime(a, LEN);
    sys::truncate(&f, 0)?;
    sys::truncate(&f, LEN)?;
    sys::touch(a, LEN, FILL);
    let o = rig.transfer(a, LEN);
    sys::unmap(a, LEN)?;
    o
}

/// Transparent huge pages (madvise mode); hugetlbfs has no pages reserved here.
fn thp(rig: &Rig) -> io::Result<Outcome> {
    const HUGE: usize = 2 << 20;
    let raw = sys::map_anon(None, 3 * HUGE)?;
    let a = (raw + HUGE - 1) & !(HUGE - 1);
    sys::advise(a, HUGE, libc::MADV_HUGEPAGE)?;
    sys::touch(a, HUGE, FILL);
    rig.prime(a, HUGE);
    sys::unmap(a, HUGE)?;
    sys::map_anon(Some(a), HUGE)?;
    sys::advise(a, HUGE, libc::MADV_HUGEPAGE)?;
    sys::touch(a, HUGE, FILL);
    let o = rig.transfer(a, HUGE);
    sys::unmap(raw, 3 * HUGE)?;
    o
}

/// A registration that starts and ends inside pages.
fn unaligned(rig: &Rig) -> io::Result<Outcome> {
    let a = fresh(LEN)?;
    let (s, l) = (a + 100, 2 * PAGE + 50);
    rig.prime(s, l);
    replace(a, LEN)?;
    let o = rig.transfer(s, l);
    sys::unmap(a, LEN)?;
    o
}

/// hugetlbfs pages (needs `vm.nr_hugepages` >= 2).
fn hugetlb(rig: &Rig) -> io::Result<Outcome> {
    const HUGE: usize = 2 << 20;
    let a = sys::map_hugetlb(None, HUGE)?;
    sys::touch(a, HUGE, FILL);
    rig.prime(a, HUGE);
    sys::unmap(a, HUGE)?;
    sys::map_hugetlb(Some(a), HUGE)?;
    sys::touch(a, HUGE, FILL);
    let o = rig.transfer(a, HUGE);
    sys::unmap(a, HUGE)?;
    o
}
