//! What a [fork(2)] does to this crate's process-wide state, handled with
//! [pthread_atfork(3)]:
//!
//! * a generation number, one higher in every child than in its parent:
//!   a plugin compares it with the one it was created in, so a child that
//!   uses an instance it inherited (whose rings, peers and address belong
//!   to its parent) gets an error, not its parent's traffic;
//! * the locks of the exposed-memory set (`exposed`) and of the closing
//!   thread's queue (`closer`), held across the fork (taken just before,
//!   let go in both processes just after), so a child forked while another
//!   thread of its parent held one does not find it locked forever.
//! * in the child, the closing threads' state that was its parent's: the
//!   count of descriptors queued to them, and the flag of a failing
//!   thread start (so the child says when its own starts fail).
//!
//! The handlers run in whichever thread calls `fork` (not for
//! `posix_spawn`, `vfork` or `clone`, which copy no Rust state a child
//! goes on using).
//!
//! [fork(2)]: https://man7.org/linux/man-pages/man2/fork.2.html
//! [pthread_atfork(3)]: https://man7.org/linux/man-pages/man3/pthread_atfork.3.html

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Where the handlers stand: `NOT_INSTALLED`, `INSTALLED`, or the pid
/// (plus one) of the process whose thread is installing them. Not a
/// `OnceLock`: a child forked while another thread of its parent was
/// inside its initialisation would wait for that thread for ever.
static STATE: AtomicU64 = AtomicU64::new(NOT_INSTALLED);
const NOT_INSTALLED: u64 = 0;
const INSTALLED: u64 = u64::MAX;

/// Installs the handlers once per process (inherited by children). Call
/// before anything that [`generation`] or the locks' fork safety must
/// cover.
pub fn install() -> io::Result<()> {
    let me = u64::from(std::process::id()) + 1;
    loop {
        let seen = STATE.load(Ordering::Acquire);
        if seen == INSTALLED {
            return Ok(());
        }
        if seen == me {
            // Another thread of ours is installing them: a moment.
            std::thread::yield_now();
            continue;
        }
        // Not installed, or being installed by the process we were forked
        // from when it forked: glibc orders pthread_atfork and fork, so
        // that thread had not registered them yet (the child handler sets
        // INSTALLED when it had). Ours to do.
        if STATE
            .compare_exchange(seen, me, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        // SAFETY: the three handlers are `extern "C"` functions with the
        // signature pthread_atfork expects and live for the whole program.
        // They do only what is allowed between fork and exec in a
        // multi-threaded process's child for state they own: atomic
        // stores, and taking or letting go of locks that the prepare
        // handler took in this same thread (a panic in them would abort,
        // not unwind into C).
        let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        // pthread_atfork returns the error number (ENOMEM) rather than -1.
        if rc != 0 {
            STATE.store(NOT_INSTALLED, Ordering::Release);
            let e = io::Error::from_raw_os_error(rc);
            return Err(io::Error::new(e.kind(), format!("pthread_atfork: {e}")));
        }
        STATE.store(INSTALLED, Ordering::Release);
        return Ok(());
    }
}

/// How many forks separate this process from the one that first called
/// [`install`] (0 there, 1 in its children, ...).
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

extern "C" fn prepare() {
    crate::closer::hold_across_fork();
    crate::exposed::hold_across_fork();
}

extern "C" fn parent() {
    crate::exposed::release_after_fork();
    crate::closer::release_after_fork();
}

extern "C" fn child() {
    // Registered, so installed (the parent's installing thread may not
    // have said so before the fork).
    STATE.store(INSTALLED, Ordering::Release);
    GENERATION.fetch_add(1, Ordering::AcqRel);
    crate::exposed::release_after_fork();
    crate::closer::release_after_fork();
    crate::closer::reset_count_in_child();
    crate::closer::reset_spawn_failing_in_child();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child forked while the closing pool's "cannot start a closing
    /// thread" flag is set starts with it cleared (the failing spell was
    /// its parent's: the child would otherwise never say that its own
    /// starts fail). Alone in its process ([`crate::debug_run_alone`]), and the parent's flag is
    /// checked still set once the child has exited: the flag is the
    /// process's, and a closing thread started meanwhile (another test's,
    /// under `cargo test`) would clear it before the fork, so that the
    /// child's cleared flag would prove nothing.
    #[test]
    fn a_forked_child_does_not_inherit_a_failing_closing_thread_start() {
        crate::debug_run_alone(
            "sys::fork::tests::a_forked_child_does_not_inherit_a_failing_closing_thread_start",
            child_starts_without_the_parents_failing_spell,
        );
    }

    fn child_starts_without_the_parents_failing_spell() {
        install().unwrap();
        crate::closer::set_spawn_failing(true);
        // SAFETY: the child only loads an atomic and ends with `_exit`
        // (both async-signal-safe), never returning into the test harness,
        // whose other threads it does not have.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork: {}", io::Error::last_os_error());
        if child == 0 {
            let code = i32::from(crate::closer::spawn_failing());
            // SAFETY: ends the child at once, running no exit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child; `status` is a live int.
        let r = unsafe { libc::waitpid(child, &mut status, 0) };
        let kept = crate::closer::spawn_failing();
        crate::closer::set_spawn_failing(false);
        assert_eq!(r, child, "waitpid: {}", io::Error::last_os_error());
        assert!(
            kept,
            "the parent's flag was cleared meanwhile: the child was not forked with it set"
        );
        assert!(libc::WIFEXITED(status), "the child did not exit: {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "the child inherited the flag");
    }
}
