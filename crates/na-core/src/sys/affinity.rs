//! CPU affinity ([sched_setaffinity(2)]).
//!
//! [sched_setaffinity(2)]: https://man7.org/linux/man-pages/man2/sched_setaffinity.2.html

use std::io;

/// The CPUs this process may run on, in increasing order
/// ([sched_getaffinity(2)]).
///
/// [sched_getaffinity(2)]: https://man7.org/linux/man-pages/man2/sched_getaffinity.2.html
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a writable cpu_set_t and we pass its exact size.
    unsafe {
        crate::syscall!(sched_getaffinity(
            0,
            std::mem::size_of::<libc::cpu_set_t>(),
            &mut set
        ))?
    };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: CPU_ISSET only reads `set`, and every index is below its capacity.
    Ok((0..max)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Pins the calling thread to `cpu`.
pub fn pin_to(cpu: usize) -> io::Result<()> {
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    if cpu >= max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cpu {cpu} is beyond the {max} CPUs a cpu_set_t holds"),
        ));
    }
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below the set's capacity (checked above).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t and we pass its exact size.
    unsafe { crate::syscall!(sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set))? };
    Ok(())
}
