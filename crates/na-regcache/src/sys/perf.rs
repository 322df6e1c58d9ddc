//! A synchronous, system-call-free "did this process map anything?" stamp,
//! built on the side-band records of [perf_event_open(2)].
//!
//! A software `PERF_COUNT_SW_DUMMY` event with `mmap` and `mmap_data` set
//! counts nothing but makes the kernel append a `PERF_RECORD_MMAP` record
//! to the event's ring buffer whenever a monitored thread creates or
//! changes a mapping (`mmap`, `brk` growth, `mprotect`, `shmat`; **not**
//! `mremap`, which writes no record, so the watch is opt-in: see
//! `monitor::uffd`, "Skipping the probe"). The record is written, and the ring's
//! `data_head` advanced, by the mapping thread itself before its system
//! call returns. Summing `data_head` over the rings therefore gives a
//! stamp that has moved by the time any thread can use memory newly mapped
//! at a reused address by any of those calls. One ring per online CPU, mapped read-only (the
//! kernel then overwrites old records, so `data_head` never stalls):
//!
//! * the process's main thread gets one event per CPU with `inherit` set
//!   (a per-task event with an mmap'ed ring must be per-CPU), so every
//!   thread it creates later is monitored and writes into the same rings;
//! * threads that already exist get their own per-CPU events, redirected
//!   into those rings (`PERF_EVENT_IOC_SET_OUTPUT`); `/proc/self/task` is
//!   listed again until a pass finds no thread left to attach, so every
//!   thread alive at the end is monitored and every later one descends
//!   from a monitored thread;
//! * `inherit_thread` keeps child *processes* out (kernels before 5.13
//!   lack it and then children also write records: harmless extra stamps).
//!
//! Threads that exist before `open` cost one descriptor per CPU each (at
//! most [`MAX_TAPS`] in all, else `open` fails): open the watch early.
//! Unprivileged processes may open these events for themselves under
//! `perf_event_paranoid` up to 2 (Debian's default 3, or a seccomp
//! profile, refuses them: [`MapWatch::open`] then fails and the caller
//! falls back to its system call). A CPU brought online after `open` has no
//! ring: hot-plugging CPUs is not supported while a watch is open.
//!
//! [perf_event_open(2)]: https://man7.org/linux/man-pages/man2/perf_event_open.2.html

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use super::mem::page_size;
use super::syscall;

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_DUMMY: u64 = 9;
/// `PERF_ATTR_SIZE_VER0`: the first 64 bytes of `struct perf_event_attr`.
const ATTR_SIZE: u32 = 64;
const FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// `_IO('$', 5)`.
const IOC_SET_OUTPUT: libc::c_ulong = 0x2405;
/// Most descriptors spent on threads that existed before `open` (one per
/// thread and CPU); beyond that `open` fails rather than crowd out the
/// process's other descriptors. Threads created later cost nothing.
const MAX_TAPS: usize = 512;
/// Offset of `data_head` in `struct perf_event_mmap_page`.
const DATA_HEAD: usize = 1024;

// Bits of the attribute's flag word.
const INHERIT: u64 = 1 << 1;
const EXCLUDE_KERNEL: u64 = 1 << 5;
const EXCLUDE_HV: u64 = 1 << 6;
const MMAP: u64 = 1 << 8;
const MMAP_DATA: u64 = 1 << 17;
const INHERIT_THREAD: u64 = 1 << 35;

/// `struct perf_event_attr` up to `PERF_ATTR_SIZE_VER0`.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const _: () = assert!(std::mem::size_of::<PerfEventAttr>() == ATTR_SIZE as usize);

/// One CPU's ring: the event and its read-only mapping (a metadata page and
/// one data page).
struct Ring {
    _event: OwnedFd,
    page: NonNull<u8>,
    len: usize,
}

/// The rings of every online CPU plus the events of threads that existed
/// when it was opened. See the module docs.
pub struct MapWatch {
    rings: Vec<Ring>,
    _taps: Vec<OwnedFd>,
}

// SAFETY: the mappings are read-only, live as long as the `MapWatch`, and
// are only read through atomic loads, from any thread.
unsafe impl Send for MapWatch {}
// SAFETY: as for `Send`: shared access is atomic loads only.
unsafe impl Sync for MapWatch {}

/// [perf_event_open(2)] of a dummy side-band event on thread `tid`, CPU `cpu`.
///
/// [perf_event_open(2)]: https://man7.org/linux/man-pages/man2/perf_event_open.2.html
fn open_event(tid: libc::pid_t, cpu: i32, flags: u64) -> io::Result<OwnedFd> {
    let attr = PerfEventAttr {
        kind: PERF_TYPE_SOFTWARE,
        size: ATTR_SIZE,
        config: PERF_COUNT_SW_DUMMY,
        flags: flags | EXCLUDE_KERNEL | EXCLUDE_HV | MMAP | MMAP_DATA,
        ..Default::default()
    };
    // SAFETY: the kernel reads `attr.size` bytes of `attr`, which has the
    // layout of that many bytes of `struct perf_event_attr` (size asserted)
    // and outlives the call; the other arguments are plain integers.
    let fd = unsafe {
        syscall!(syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            tid,
            cpu,
            -1,
            FLAG_FD_CLOEXEC
        ))
    }?;
    // SAFETY: the call returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Maps the ring of `event` read-only ([mmap(2)]: overwrite mode).
///
/// [mmap(2)]: https://man7.org/linux/man-pages/man2/mmap.2.html
fn map_ring(event: OwnedFd) -> io::Result<Ring> {
    let len = 2 * page_size();
    // SAFETY: maps a perf ring (a metadata page and one data page, a power
    // of two) of a descriptor we own; no existing memory is touched.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            event.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let page = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
    Ok(Ring {
        _event: event,
        page,
        len,
    })
}

/// The online CPUs ([sysfs] `/sys/devices/system/cpu/online`: `0-3,6,8-9`).
///
/// [sysfs]: https://www.kernel.org/doc/Documentation/ABI/stable/sysfs-devices-system-cpu
fn online_cpus() -> io::Result<Vec<i32>> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online")?;
    let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("cpu list {:?}", text.trim()));
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (i32, i32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        if a > b || b > 1 << 16 {
            return Err(bad());
        }
        cpus.extend(a..=b);
    }
    if cpus.is_empty() {
        return Err(bad());
    }
    Ok(cpus)
}

/// The thread ids of this process ([proc(5)] `/proc/self/task`).
///
/// [proc(5)]: https://man7.org/linux/man-pages/man5/proc.5.html
fn threads() -> io::Result<Vec<libc::pid_t>> {
    let mut tids = Vec::new();
    for e in std::fs::read_dir("/proc/self/task")? {
        if let Some(tid) = e?.file_name().to_str().and_then(|s| s.parse().ok()) {
            tids.push(tid);
        }
    }
    Ok(tids)
}

impl MapWatch {
    /// Opens a ring per online CPU and attaches every thread of the process.
    pub fn open() -> io::Result<MapWatch> {
        let cpus = online_cpus()?;
        // Pids fit in pid_t (the kernel's limit is 2^22).
        let pid = std::process::id() as libc::pid_t;
        let mut flags = INHERIT | INHERIT_THREAD;
        let mut rings = Vec::with_capacity(cpus.len());
        for &cpu in &cpus {
            let event = match open_event(pid, cpu, flags) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && flags & INHERIT_THREAD != 0 => {
                    flags &= !INHERIT_THREAD;
                    open_event(pid, cpu, flags)?
                }
                r => r?,
            };
            rings.push(map_ring(event)?);
        }
        let mut taps = Vec::new();
        let mut attached: HashSet<libc::pid_t> = HashSet::from([pid]);
        loop {
            let new: Vec<_> = threads()?.into_iter().filter(|t| !attached.contains(t)).collect();
            if new.is_empty() {
                break;
            }
            if (taps.len() + new.len() * rings.len()) > MAX_TAPS {
                return Err(io::Error::other(format!(
                    "{} threads x {} CPUs would take more than {MAX_TAPS} descriptors",
                    attached.len() + new.len(),
                    rings.len()
                )));
            }
            for tid in new {
                for (ring, &cpu) in rings.iter().zip(&cpus) {
                    let tap = match open_event(tid, cpu, flags) {
                        // The thread exited meanwhile.
                        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => break,
                        r => r?,
                    };
                    // SAFETY: SET_OUTPUT takes the target descriptor as its
                    // integer argument; both descriptors are ours and open.
                    unsafe { syscall!(ioctl(tap.as_raw_fd(), IOC_SET_OUTPUT, ring._event.as_raw_fd())) }?;
                    taps.push(tap);
                }
                attached.insert(tid);
            }
        }
        Ok(MapWatch { rings, _taps: taps })
    }

    /// The sum of every ring's `data_head`: it grows whenever a thread of
    /// this process maps memory, before that thread's call returns.
    /// Allocation-free, one load per CPU.
    pub fn stamp(&self) -> u64 {
        self.rings.iter().fold(0u64, |sum, r| {
            // SAFETY: `data_head` is an aligned u64 inside the mapped
            // metadata page, which lives as long as `self`; the kernel
            // updates it while we read, so it is read atomically.
            let head = unsafe { AtomicU64::from_ptr(r.page.as_ptr().add(DATA_HEAD).cast::<u64>()) };
            sum.wrapping_add(head.load(Ordering::Acquire))
        })
    }

    /// Number of rings (online CPUs when opened).
    pub fn rings(&self) -> usize {
        self.rings.len()
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map_ring`; nothing
        // borrows it past the owning `MapWatch`.
        unsafe {
            libc::munmap(self.page.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moved(w: &MapWatch, f: impl FnOnce()) -> bool {
        let s = w.stamp();
        f();
        w.stamp() != s
    }

    /// A fresh private anonymous mapping of `len` bytes.
    fn anon(len: usize, prot: libc::c_int) -> usize {
        crate::sys::mem::map_private_anon(len, prot).expect("mmap") as usize
    }

    fn unmap(p: usize, len: usize) {
        // SAFETY: unmaps a mapping made by `anon` that nothing uses any more.
        assert_eq!(unsafe { libc::munmap(p as *mut libc::c_void, len) }, 0);
    }

    #[test]
    fn stamp_moves_on_every_new_mapping_in_any_thread() {
        let w = match MapWatch::open() {
            Ok(w) => w,
            Err(e) => panic!("perf_event_open side-band events unavailable here: {e}"),
        };
        assert!(w.rings() >= 1);
        let len = 1 << 20;
        let mut p = 0;
        assert!(moved(&w, || p = anon(len, libc::PROT_NONE)), "mmap");
        // SAFETY: the first half of our PROT_NONE mapping becomes read-write;
        // nothing references it.
        let rc = || unsafe {
            libc::mprotect(
                p as *mut libc::c_void,
                len / 2,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        assert!(moved(&w, || assert_eq!(rc(), 0)), "mprotect");
        // A thread that exists before `open`, and one created afterwards.
        let go = std::sync::Arc::new(std::sync::Barrier::new(2));
        let g = go.clone();
        let early = std::thread::spawn(move || {
            g.wait();
            g.wait();
            let q = anon(4096, libc::PROT_READ);
            g.wait();
            unmap(q, 4096);
            // A thread created by a thread that was attached, not inherited.
            g.wait();
            g.wait();
            std::thread::spawn(|| unmap(anon(4096, libc::PROT_READ), 4096))
                .join()
                .unwrap();
            g.wait();
        });
        go.wait();
        let w2 = MapWatch::open().unwrap();
        let both = || {
            go.wait();
            go.wait();
        };
        assert!(moved(&w2, both), "a thread that existed before open is watched");
        go.wait();
        assert!(moved(&w2, both), "a thread created by such a thread is watched");
        early.join().unwrap();
        let late = || {
            std::thread::spawn(|| unmap(anon(4096, libc::PROT_READ), 4096))
                .join()
                .unwrap()
        };
        assert!(moved(&w2, late), "a thread created after open is watched");
        unmap(p, len);
    }
}
