//! Stalling a thread of this process in a signal handler
//! ([sigaction(2)], [tgkill(2)]).
//!
//! [sigaction(2)]: https://man7.org/linux/man-pages/man2/sigaction.2.html
//! [tgkill(2)]: https://man7.org/linux/man-pages/man2/tgkill.2.html

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
