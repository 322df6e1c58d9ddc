//! Threads and the scheduler: thread ids, [sched_setaffinity(2)],
//! [sched_setscheduler(2)], thread states from `/proc`.
//!
//! [sched_setaffinity(2)]: https://man7.org/linux/man-pages/man2/sched_setaffinity.2.html
//! [sched_setscheduler(2)]: https://man7.org/linux/man-pages/man2/sched_setscheduler.2.html

use std::io;

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
