//! Fuzzes na-sm's screen of the descriptors a peer passes
//! (`sys::screen`): the judgement of what statx (a file system's device
//! and a mode) or, where statx is missing, statfs and stat (a magic
//! number and a mode) say of a descriptor, and of its name in
//! `/proc/self/fd`. Only a memfd's regular file, a pipe and an eventfd
//! pass; permission bits never matter; the system calls behind the
//! closures (`/proc/self/fd`, `F_GET_SEALS`) are made only where they
//! decide; never a panic.
#![no_main]

use std::cell::Cell;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use na_sm::sys::screen::{harmless_by_magic, is_eventfd_link, InternalDevices};

const TMPFS_MAGIC: u32 = 0x0102_1994;
const ANON_INODE_FS_MAGIC: u32 = 0x0904_1934;
const PIPEFS_MAGIC: u32 = 0x5049_5045;
const EVENTFD: &[u8] = b"anon_inode:[eventfd]";

/// A device: mostly one of a few (so that the fuzzer meets the internal
/// ones), sometimes any.
fn dev(u: &mut Unstructured<'_>) -> Result<(u32, u32)> {
    Ok(if u.ratio(3, 4)? {
        (0, u.int_in_range(0..=3)?)
    } else {
        (u.arbitrary()?, u.arbitrary()?)
    })
}

/// A mode: a file type (any of the 16 values of the type bits) with
/// arbitrary permission bits.
fn mode(u: &mut Unstructured<'_>) -> Result<u32> {
    let ty: u32 = u.int_in_range(0..=15)?;
    Ok((ty << 12) | (u.arbitrary::<u32>()? & !libc::S_IFMT))
}

fn magic(u: &mut Unstructured<'_>) -> Result<u32> {
    Ok(match u.int_in_range(0..=3)? {
        0 => TMPFS_MAGIC,
        1 => ANON_INODE_FS_MAGIC,
        2 => PIPEFS_MAGIC,
        _ => u.arbitrary()?,
    })
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let devs = InternalDevices {
        pipe: dev(u)?,
        anon: dev(u)?,
        memfd: dev(u)?,
    };
    // By statx: the device and the mode.
    let (fs, m, is_ev) = (dev(u)?, mode(u)?, u.arbitrary::<bool>()?);
    let asked = Cell::new(0u32);
    let verdict = devs.harmless(fs, m, || {
        asked.set(asked.get() + 1);
        is_ev
    });
    let ty = m & libc::S_IFMT;
    let expect = if fs == devs.memfd {
        ty == libc::S_IFREG
    } else if fs == devs.pipe {
        ty == libc::S_IFIFO
    } else {
        fs == devs.anon && is_ev
    };
    assert_eq!(verdict, expect, "{devs:?} fs {fs:?} mode {m:o} eventfd {is_ev}");
    let decides = fs == devs.anon && fs != devs.memfd && fs != devs.pipe;
    assert_eq!(
        asked.get(),
        u32::from(decides),
        "/proc/self/fd read where it does not decide"
    );
    // Permission bits never change the verdict.
    assert_eq!(devs.harmless(fs, ty, || is_ev), verdict);
    // Only an anonymous inode is judged by its name (the kernel's, from
    // the subsystem that made it), whatever its type bits; any other file
    // by its type.
    if !(fs == devs.anon && is_ev)
        && matches!(
            ty,
            libc::S_IFSOCK | libc::S_IFCHR | libc::S_IFBLK | libc::S_IFDIR | libc::S_IFLNK
        )
    {
        assert!(!verdict, "a socket, device node, directory or link passed");
    }

    // By statfs and stat: the magic number and the mode.
    let (f_type, m, sealable, is_ev) = (
        magic(u)?,
        mode(u)?,
        u.arbitrary::<bool>()?,
        u.arbitrary::<bool>()?,
    );
    let (sealed_asked, ev_asked) = (Cell::new(0u32), Cell::new(0u32));
    let verdict = harmless_by_magic(
        f_type,
        m,
        || {
            sealed_asked.set(sealed_asked.get() + 1);
            sealable
        },
        || {
            ev_asked.set(ev_asked.get() + 1);
            is_ev
        },
    );
    let ty = m & libc::S_IFMT;
    let expect = match f_type {
        TMPFS_MAGIC => ty == libc::S_IFREG && sealable,
        PIPEFS_MAGIC => ty == libc::S_IFIFO,
        ANON_INODE_FS_MAGIC => is_ev,
        _ => false,
    };
    assert_eq!(verdict, expect, "magic {f_type:#x} mode {m:o}");
    assert_eq!(
        sealed_asked.get(),
        u32::from(f_type == TMPFS_MAGIC && ty == libc::S_IFREG),
        "F_GET_SEALS where it does not decide"
    );
    assert_eq!(ev_asked.get(), u32::from(f_type == ANON_INODE_FS_MAGIC));
    assert_eq!(harmless_by_magic(f_type, ty, || sealable, || is_ev), verdict);

    // The name in /proc/self/fd: only an eventfd's, exactly.
    let link = u.bytes(u.len())?;
    assert_eq!(is_eventfd_link(OsStr::from_bytes(link)), link == EVENTFD);
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
