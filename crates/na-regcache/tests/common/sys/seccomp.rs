//! Fault injection by the kernel: a [seccomp(2)] filter on the calling
//! thread.
//!
//! [seccomp(2)]: https://man7.org/linux/man-pages/man2/seccomp.2.html

use std::io;

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
