//! Raw memory operations the scenarios perform on purpose (all the test
//! suite's `unsafe` lives here).
#![allow(unsafe_code, dead_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub const PAGE: usize = 4096;

fn check(ptr: *mut libc::c_void) -> io::Result<usize> {
    if ptr == libc::MAP_FAILED {
        Err(io::Error::last_os_error())
    } else {
        Ok(ptr as usize)
    }
}

/// Anonymous private mapping of `len` bytes, at `at` if given
/// (`MAP_FIXED_NOREPLACE`: fails instead of clobbering).
pub fn map_anon(at: Option<usize>, len: usize) -> io::Result<usize> {
    let (hint, extra) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; a null
    // hint lets the kernel choose. No Rust object is affected.
    let p = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra,
            -1,
            0,
        )
    };
    let got = check(p).inspect_err(|_| {
        if let Some(a) = at {
            dump_maps_near(a);
        }
    })?;
    if at.is_some_and(|a| a != got) {
        unmap(got, len)?;
        return Err(io::Error::from(io::ErrorKind::AddrInUse));
    }
    Ok(got)
}

/// Prints the /proc/self/maps lines around `addr` (diagnostics for EEXIST).
pub fn dump_maps_near(addr: usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    for line in maps.lines() {
        let range = line.split_whitespace().next().unwrap_or("");
        let mut it = range
            .split('-')
            .map(|h| usize::from_str_radix(h, 16).unwrap_or(0));
        let (s, e) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
        if s < addr + (1 << 20) && e + (1 << 20) > addr {
            eprintln!("maps near {addr:#x}: {line}");
        }
    }
}

/// Anonymous 2 MiB hugetlbfs mapping, at `at` if given (`MAP_FIXED_NOREPLACE`).
pub fn map_hugetlb(at: Option<usize>, len: usize) -> io::Result<usize> {
    let (hint, extra) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_HUGE_2MB | extra;
    // SAFETY: as map_anon; huge pages come from the reserved pool.
    let p = unsafe { libc::mmap(hint, len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
    let got = check(p)?;
    if at.is_some_and(|a| a != got) {
        unmap(got, len)?;
        return Err(io::Error::from(io::ErrorKind::AddrInUse));
    }
    Ok(got)
}

/// `MAP_FIXED` anonymous mapping over whatever is at `at` (the overlay scenario).
pub fn map_anon_overlay(at: usize, len: usize) -> io::Result<usize> {
    // SAFETY: `at` is a mapping the scenario owns; no Rust reference points into it.
    let p = unsafe {
        libc::mmap(
            at as *mut _,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    check(p)
}

/// A new private SysV shared memory segment of `len` bytes attached over
/// whatever is at `at` ([shmat(2)] with `SHM_REMAP`); the segment is marked
/// for removal at once, so it goes with its last detach.
///
/// [shmat(2)]: https://man7.org/linux/man-pages/man2/shmat.2.html
pub fn shm_attach_over(at: usize, len: usize) -> io::Result<usize> {
    // SAFETY: shmget takes integers only.
    let id = unsafe { libc::shmget(libc::IPC_PRIVATE, len, libc::IPC_CREAT | 0o600) };
    if id < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `at` is a mapping the scenario owns and no Rust reference
    // points into it; SHM_REMAP replaces it, as MAP_FIXED would.
    let p = unsafe { libc::shmat(id, at as *const _, libc::SHM_REMAP) };
    let attached = if p as isize == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(p as usize)
    };
    // SAFETY: IPC_RMID on the segment made above; a null buffer is allowed.
    unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
    attached
}

/// Shared mapping of `fd` (a memfd), at `at` if given (`MAP_FIXED_NOREPLACE`).
pub fn map_shared_fd(at: Option<usize>, len: usize, fd: &OwnedFd) -> io::Result<usize> {
    let (hint, extra) = match at {
        Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: as map_anon; the descriptor is valid for the call.
    let p = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | extra,
            fd.as_raw_fd(),
            0,
        )
    };
    let got = check(p)?;
    if at.is_some_and(|a| a != got) {
        unmap(got, len)?;
        return Err(io::Error::from(io::ErrorKind::AddrInUse));
    }
    Ok(got)
}

/// Private (copy-on-write) mapping of `fd` (a memfd) from offset 0.
pub fn map_private_fd(len: usize, fd: &OwnedFd) -> io::Result<usize> {
    // SAFETY: a fresh mapping chosen by the kernel; the descriptor is
    // valid for the call.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            fd.as_raw_fd(),
            0,
        )
    };
    check(p)
}

/// Shared mapping of `fd` (from offset 0) over whatever is at `at`
/// (`MAP_FIXED`).
pub fn map_shared_fd_fixed(at: usize, len: usize, fd: &OwnedFd) -> io::Result<usize> {
    // SAFETY: `at` is a mapping the caller owns and replaces on purpose;
    // no Rust reference points into it.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            0,
        )
    };
    check(p)
}

/// munmap(2) of a range the scenario owns.
pub fn unmap(addr: usize, len: usize) -> io::Result<()> {
    // SAFETY: the scenario owns the range and holds no Rust reference into it.
    if unsafe { libc::munmap(addr as *mut _, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// [shmdt(2)]: detaches the SysV segment attached at `addr`.
///
/// [shmdt(2)]: https://man7.org/linux/man-pages/man2/shmdt.2.html
pub fn shm_detach(addr: usize) -> io::Result<()> {
    // SAFETY: the scenario attached the segment at `addr` and holds no
    // Rust reference into it.
    if unsafe { libc::shmdt(addr as *const _) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// mremap(2) moving `[from, from+len)` to `to` (MREMAP_MAYMOVE|MREMAP_FIXED).
pub fn remap_to(from: usize, len: usize, to: usize) -> io::Result<usize> {
    // SAFETY: both ranges belong to the scenario; `to` is replaced on purpose.
    let p = unsafe {
        libc::mremap(
            from as *mut _,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to as *mut libc::c_void,
        )
    };
    check(p)
}

/// madvise(2) on a range the scenario owns.
pub fn advise(addr: usize, len: usize, advice: libc::c_int) -> io::Result<()> {
    // SAFETY: the scenario owns the range; the advice may drop its contents,
    // which no Rust reference observes.
    if unsafe { libc::madvise(addr as *mut _, len, advice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

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

/// A memfd of `len` bytes.
pub fn memfd(len: usize) -> io::Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated literal.
    let fd = unsafe { libc::memfd_create(c"qs-regcache-test".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: new descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain ftruncate on our descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// fallocate(2) `PUNCH_HOLE|KEEP_SIZE` of `[offset, offset+len)` in `fd`:
/// the file's pages there are dropped (from every mapping of it).
pub fn punch_hole(fd: &OwnedFd, offset: usize, len: usize) -> io::Result<()> {
    // SAFETY: plain fallocate on our descriptor; mappings of the range lose
    // their pages, which no Rust reference observes.
    let r = unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// ftruncate(2) of `fd` to `len` bytes (shrinking drops the file's pages
/// beyond `len` from every mapping of it).
pub fn truncate(fd: &OwnedFd, len: usize) -> io::Result<()> {
    // SAFETY: plain ftruncate on our descriptor; the scenario touches no
    // mapping of the dropped range before it grows the file again.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// sbrk(2); returns the previous break.
pub fn sbrk(delta: isize) -> io::Result<usize> {
    // SAFETY: the brk scenario runs in its own process and coordinates with
    // malloc through mallopt (no trimming, large top pad).
    let p = unsafe { libc::sbrk(delta) };
    if p as isize == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(p as usize)
}

/// mallopt(3).
pub fn mallopt(param: libc::c_int, value: libc::c_int) {
    // SAFETY: plain integer parameters.
    unsafe { libc::mallopt(param, value) };
}

/// fork(2); the child runs `child` and `_exit`s with its return value.
pub fn fork_run(child: impl FnOnce() -> i32) -> io::Result<i32> {
    // SAFETY: the child only runs `child`, then _exits. `child` touches no
    // state another thread may have held at the fork except the allocator,
    // which glibc's fork handlers leave consistent in the child.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // A panic must not unwind into the parent's code (the test
        // harness) running on in the child: it becomes exit code 101.
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
        // SAFETY: _exit skips destructors on purpose (they belong to the parent).
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    if unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if libc::WIFEXITED(status) {
        Ok(libc::WEXITSTATUS(status))
    } else {
        Err(io::Error::other(format!("child died: status {status:#x}")))
    }
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

/// Like [`map_anon`] at `at` (`MAP_FIXED_NOREPLACE`), without the
/// diagnostics: for callers that poll until the range is free.
pub fn try_map_anon_at(at: usize, len: usize) -> io::Result<usize> {
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    let got = check(p)?;
    if got != at {
        unmap(got, len)?;
        return Err(io::Error::from(io::ErrorKind::AddrInUse));
    }
    Ok(got)
}

/// The kernel thread id of this process's thread named `name` (its `comm`).
pub fn thread_named(name: &str) -> Option<libc::pid_t> {
    std::fs::read_dir("/proc/self/task")
        .ok()?
        .flatten()
        .find_map(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            (comm.trim_end() == name)
                .then(|| t.file_name().to_str()?.parse().ok())
                .flatten()
        })
}

static STALL_ENTERED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static STALL_RELEASE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static STALL_MAX_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

extern "C" fn stall_handler(_sig: libc::c_int) {
    use std::sync::atomic::Ordering::SeqCst;
    // Async-signal-safe only: atomics, clock_gettime, nanosleep.
    STALL_ENTERED.store(true, SeqCst);
    let deadline = monotonic_ms() + STALL_MAX_MS.load(SeqCst);
    while !STALL_RELEASE.load(SeqCst) && monotonic_ms() < deadline {
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 200_000,
        };
        // SAFETY: nanosleep reads one timespec; the remainder pointer may be null.
        unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
    }
}

/// Stalls thread `tid` of this process: a `SIGUSR1` handler keeps it busy
/// until [`stall_release`] or `max` elapsed. Returns once the thread is
/// inside the handler (false if it did not get there within a second).
/// One stall at a time per process.
pub fn stall_thread(tid: libc::pid_t, max: std::time::Duration) -> bool {
    use std::sync::atomic::Ordering::SeqCst;
    STALL_ENTERED.store(false, SeqCst);
    STALL_RELEASE.store(false, SeqCst);
    STALL_MAX_MS.store(max.as_millis() as u64, SeqCst);
    // SAFETY: a zeroed sigaction is valid; we install a handler that only
    // calls async-signal-safe functions (no SA_RESTART: the stalled
    // thread's blocking call returns EINTR afterwards).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = stall_handler as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()) != 0 {
            return false;
        }
        if libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, libc::SIGUSR1) != 0 {
            return false;
        }
    }
    let t0 = std::time::Instant::now();
    while !STALL_ENTERED.load(SeqCst) {
        if t0.elapsed() > std::time::Duration::from_secs(1) {
            return false;
        }
        std::thread::yield_now();
    }
    true
}

/// Ends the stall started by [`stall_thread`].
pub fn stall_release() {
    STALL_RELEASE.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// The calling thread's kernel id.
pub fn gettid() -> libc::pid_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Pins thread `tid` of this process (0: the caller) to `cpu`, or lets it
/// run anywhere with `None` (sched_setaffinity(2)).
pub fn pin_thread(tid: libc::pid_t, cpu: Option<usize>) -> io::Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes inside it
    // (indices below CPU_SETSIZE); sched_setaffinity reads
    // `size_of::<cpu_set_t>()` bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        match cpu {
            Some(c) => libc::CPU_SET(c, &mut set),
            None => (0..cpus.min(libc::CPU_SETSIZE as usize)).for_each(|c| libc::CPU_SET(c, &mut set)),
        }
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes the calling thread `SCHED_FIFO` at priority 1 (needs CAP_SYS_NICE).
pub fn make_current_fifo() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler reads one sched_param we own.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The scheduler state letter of thread `tid` of this process (`R`, `S`, `D`, ...).
pub fn thread_state(tid: libc::pid_t) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    // "tid (comm) S ...": the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Makes every `pread64` of the *calling thread* (and of threads it starts
/// later) fail with `errno` from now on: a seccomp filter installed without
/// `SECCOMP_FILTER_FLAG_TSYNC`, so the process's other threads are not
/// affected. Fault injection by the kernel itself, for error paths (a read
/// of `/proc/self/pagemap`) that cannot be made to fail otherwise. Errors
/// when seccomp filters are unavailable.
pub fn fail_pread_in_this_thread(errno: i32) -> io::Result<()> {
    const RET_ALLOW: u32 = 0x7fff_0000; // SECCOMP_RET_ALLOW
    const RET_ERRNO: u32 = 0x0005_0000; // SECCOMP_RET_ERRNO
    let stmt = |code: u16, k: u32| libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let ld_w_abs = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    let jeq_k = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    let ret_k = (libc::BPF_RET | libc::BPF_K) as u16;
    // seccomp_data: nr at offset 0 (native syscall numbers only: the test
    // thread makes no foreign-ABI calls).
    let mut prog = [
        stmt(ld_w_abs, 0),
        libc::sock_filter {
            code: jeq_k,
            jt: 0,
            jf: 1,
            k: libc::SYS_pread64 as u32,
        },
        stmt(ret_k, RET_ERRNO | (errno as u32 & 0xffff)),
        stmt(ret_k, RET_ALLOW),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fprog` points at `prog`, a valid classic-BPF program that
    // outlives the call (the kernel copies it).
    if unsafe { libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &fprog) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// [`mincore(2)`](https://man7.org/linux/man-pages/man2/mincore.2.html) of
/// the page at `addr`: true while it is mapped (the call fails with
/// `ENOMEM` on an unmapped address).
pub fn page_mapped(addr: usize) -> bool {
    let mut v = [0u8; 1];
    // SAFETY: mincore writes one byte per page of the range, here one page
    // into a one-byte buffer; it reads no memory of the range.
    unsafe { libc::mincore(addr as *mut libc::c_void, PAGE, v.as_mut_ptr()) == 0 }
}

/// [`mremap(2)`](https://man7.org/linux/man-pages/man2/mremap.2.html)
/// like [`remap_to`], returning the raw result (`to`, or `MAP_FAILED`).
pub fn mremap_fixed(from: usize, len: usize, to: usize) -> *mut libc::c_void {
    // SAFETY: both ranges belong to the test (`to` freed or its own);
    // what is mapped at `to` is replaced on purpose, and no Rust reference
    // points into either range.
    unsafe {
        libc::mremap(
            from as *mut libc::c_void,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to as *mut libc::c_void,
        )
    }
}

/// [`fork(2)`](https://man7.org/linux/man-pages/man2/fork.2.html): the
/// raw result (0 in the child, the child's pid in the parent, -1 on
/// error). The child must leave with [`exit_now`] and call nothing that a
/// parent thread may have held a lock of at the fork, except what the test
/// checks on purpose (the cache's fork guard, with a timeout in the
/// parent: [`wait_within`]).
pub fn fork() -> libc::pid_t {
    // SAFETY: the tests' children only free blocks of their copy of the
    // heap, call the cache or monitor under test, and leave with
    // `exit_now` (no destructor, no return into the test harness).
    unsafe { libc::fork() }
}

/// [`_exit(2)`](https://man7.org/linux/man-pages/man2/_exit.2.html): ends
/// a forked child at once with `code`, running no destructor (they belong
/// to the parent).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit ends the process; nothing of it is used afterwards.
    unsafe { libc::_exit(code) }
}

/// Frees, in a forked child, the heap block of `len` bytes at `addr`: the
/// child's copy of a `Vec<u8>` (or boxed slice) whose capacity is `len`,
/// which the child never touches again (it leaves with [`exit_now`]).
/// Through the global allocator, so its hooks run
/// ([`dealloc`](https://doc.rust-lang.org/std/alloc/fn.dealloc.html)).
pub fn free_block_in_child(addr: usize, len: usize) {
    let Ok(layout) = std::alloc::Layout::from_size_align(len, 1) else {
        exit_now(102)
    };
    // SAFETY: `addr` was allocated by the global allocator for a byte
    // buffer of `len` bytes (alignment 1) and, in this child, is freed once
    // and never used again (the child's copy of its owner is never dropped).
    unsafe { std::alloc::dealloc(addr as *mut u8, layout) }
}

/// [`waitpid(2)`](https://man7.org/linux/man-pages/man2/waitpid.2.html)
/// for child `pid`, without blocking: its exit code once it exited,
/// polling every millisecond; `None` if it has not exited within `limit`
/// (then it is killed, [`kill(2)`](https://man7.org/linux/man-pages/man2/kill.2.html),
/// and reaped).
pub fn wait_within(pid: libc::pid_t, limit: std::time::Duration) -> Option<i32> {
    let t0 = std::time::Instant::now();
    let mut st = 0;
    loop {
        // SAFETY: reaps our own child into a local status word.
        if unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) } == pid {
            return Some(libc::WEXITSTATUS(st));
        }
        if t0.elapsed() > limit {
            // SAFETY: kills and reaps our own hung child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut st, 0);
            }
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Which call an [`Observed`] allocator reports to its observer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocCall {
    /// `alloc`.
    Alloc,
    /// `alloc_zeroed`.
    AllocZeroed,
    /// `dealloc`.
    Dealloc,
    /// `realloc`.
    Realloc,
}

/// Told of every call of an [`Observed`] allocator, before and after it is
/// forwarded. Runs inside the global allocator: it must not allocate,
/// except behind a re-entrancy guard of its own.
pub trait AllocObserver: Sync {
    /// Before `call` is forwarded; the value is handed to [`after`](Self::after).
    fn before(&self, call: AllocCall) -> bool;
    /// After `call` returned, with what [`before`](Self::before) returned.
    fn after(&self, call: AllocCall, state: bool);
}

/// A global allocator forwarding every call unchanged to `inner` and
/// telling `observer` about it (see
/// [`GlobalAlloc`](https://doc.rust-lang.org/std/alloc/trait.GlobalAlloc.html);
/// the system allocator is glibc's
/// [`malloc(3)`](https://man7.org/linux/man-pages/man3/malloc.3.html)).
pub struct Observed<A, O> {
    /// The allocator doing the work.
    pub inner: A,
    /// Told of each call.
    pub observer: O,
}

// SAFETY: every method forwards its arguments unchanged to `inner` and
// returns its result; the observer's calls touch no memory of the call.
unsafe impl<A: std::alloc::GlobalAlloc, O: AllocObserver> std::alloc::GlobalAlloc for Observed<A, O> {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let s = self.observer.before(AllocCall::Alloc);
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner.alloc(layout) };
        self.observer.after(AllocCall::Alloc, s);
        p
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        let s = self.observer.before(AllocCall::AllocZeroed);
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner.alloc_zeroed(layout) };
        self.observer.after(AllocCall::AllocZeroed, s);
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        let s = self.observer.before(AllocCall::Dealloc);
        // SAFETY: forwarded contract.
        unsafe { self.inner.dealloc(ptr, layout) };
        self.observer.after(AllocCall::Dealloc, s);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        let s = self.observer.before(AllocCall::Realloc);
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        self.observer.after(AllocCall::Realloc, s);
        p
    }
}

/// `READ_FIXED` (`UringRegistrar::read_fixed`) of `len` bytes of `fd` at
/// `offset` into `[addr, addr+len)` through `buf`.
pub fn read_fixed(
    reg: &na_regcache::UringRegistrar,
    buf: &na_regcache::FixedBuffer,
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    addr: usize,
    len: usize,
) -> io::Result<usize> {
    // SAFETY: the scenarios transfer into this module's raw mappings
    // (`map_anon` and the like), which the tests reach only through its raw
    // copies (`touch`, `all_equal`), never through Rust references; `fd`
    // is borrowed for the call.
    unsafe { reg.read_fixed(buf, fd.as_raw_fd(), offset, addr, len) }
}
