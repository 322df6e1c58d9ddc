//! Helpers shared by na-sm's integration tests.

pub mod sys;

/// A new, empty socket directory private to this user (mode 0700, as sm
/// requires), named by `tag` and this process; the caller removes it.
pub fn private_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("qs-sm-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    dir
}

/// A command prefix that runs a program as pid 1 of a new PID namespace
/// (in a new user namespace, so without privileges; `/proc` its own).
#[allow(dead_code)]
pub const UNSHARE_PID: [&str; 5] = ["unshare", "--pid", "--fork", "--map-root-user", "--mount-proc"];

/// Set (to anything) to let tests that need PID namespaces pass, saying
/// so, where `unshare` cannot make them.
#[allow(dead_code)]
pub const SKIP_UNSHARE_ENV: &str = "QS_SM_SKIP_UNSHARE";

/// `unshare` could not run what a test needs (`why`): returns (the test
/// is skipped, and says so) if `$QS_SM_SKIP_UNSHARE` is set, else panics.
#[allow(dead_code)]
pub fn without_namespaces(why: &str) {
    if std::env::var_os(SKIP_UNSHARE_ENV).is_some() {
        eprintln!("!!! SKIPPED (${SKIP_UNSHARE_ENV} is set): {why}");
        return;
    }
    panic!("{why}\n(set ${SKIP_UNSHARE_ENV}=1 to skip this test where namespaces are unavailable)");
}

/// A pipe: (read end, write end).
#[allow(dead_code)]
pub fn pipe() -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY (test): pipe writes two fresh descriptors into `fds`.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY (test): both are ours alone.
    unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    }
}

/// Kills (`SIGKILL`) a process the test made, however the test ends; a
/// child is not reaped (one no longer ours is reaped by init).
#[allow(dead_code)]
pub struct KillOnDrop(pub libc::pid_t);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY (test): signals a process this test made.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

/// The child's exit status, or None if it had not ended within `limit`
/// (then it is killed and reaped).
#[allow(dead_code)]
pub fn wait_child(pid: libc::pid_t, limit: std::time::Duration) -> Option<i32> {
    let end = std::time::Instant::now() + limit;
    let mut status = 0;
    loop {
        // SAFETY (test): polls our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            assert!(libc::WIFEXITED(status), "child ended by a signal: {status:#x}");
            return Some(libc::WEXITSTATUS(status));
        }
        if std::time::Instant::now() > end {
            // SAFETY (test): kills and reaps our own hung child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
