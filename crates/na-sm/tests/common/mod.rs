//! Helpers shared by na-sm's integration tests (each test binary uses
//! some of them). Their system calls are in [`sys`].

#![allow(dead_code)]

pub mod fuse_peer;
pub mod sys;

/// A busy endpoint with one sm plugin in `dir`, listening or not.
pub fn busy_endpoint(dir: &std::path::Path, listen: bool) -> (na_core::Endpoint, na_core::PluginId) {
    endpoint_with(dir, listen, None)
}

/// A busy endpoint as [`busy_endpoint`], with `rma_threads` RMA transfer
/// threads (`SmConfig::rma_threads`).
pub fn rma_endpoint(
    dir: &std::path::Path,
    listen: bool,
    rma_threads: usize,
) -> (na_core::Endpoint, na_core::PluginId) {
    endpoint_with(dir, listen, Some(rma_threads))
}

/// [`rma_endpoint`] (listening) and a probe of its plugin's transfer-thread
/// pool (`SmPlugin::debug_rma_pool`, taken before the plugin goes into
/// the endpoint: the probe shares the pool's state, the endpoint the
/// plugin).
pub fn probed_rma_endpoint(
    dir: &std::path::Path,
    rma_threads: usize,
) -> (na_core::Endpoint, na_core::PluginId, na_sm::RmaPoolProbe) {
    let cfg = na_sm::SmConfig {
        listen: true,
        rma_threads: Some(rma_threads),
        ..na_sm::SmConfig::default()
    }
    .with_dir(dir);
    let mut ep = na_core::Endpoint::new(na_core::ProgressMode::Busy).unwrap();
    let mut probe = None;
    let id = ep
        .add_plugin(|id| {
            let mut p = na_sm::SmPlugin::new(id, cfg)?;
            probe = Some(p.debug_rma_pool()?);
            Ok(Box::new(p) as Box<dyn na_core::Plugin>)
        })
        .unwrap();
    (ep, id, probe.expect("the plugin was made"))
}

/// [`busy_endpoint`] with `SmConfig::rma_threads` as given.
fn endpoint_with(
    dir: &std::path::Path,
    listen: bool,
    rma_threads: Option<usize>,
) -> (na_core::Endpoint, na_core::PluginId) {
    let cfg = na_sm::SmConfig {
        listen,
        rma_threads,
        ..na_sm::SmConfig::default()
    }
    .with_dir(dir);
    let mut ep = na_core::Endpoint::new(na_core::ProgressMode::Busy).unwrap();
    let id = ep
        .add_plugin(|id| Ok(Box::new(na_sm::SmPlugin::new(id, cfg)?) as Box<dyn na_core::Plugin>))
        .unwrap();
    (ep, id)
}

/// A hostile RMA peer (a forked child): a page of memory that stalls every
/// access, described to the listener at `uri` in an unexpected message;
/// says on `status` whether it could (`U`: no userfaultfd here, `S`:
/// sent), then drives its endpoint until it is killed.
pub fn stalling_peer(dir: &std::path::Path, uri: &str, status: std::fs::File) -> i32 {
    use std::os::fd::AsFd;
    let Ok((_uffd, addr)) = sys::stalling_memory(4096) else {
        sys::write(status.as_fd(), b"U");
        return 0;
    };
    let (mut ep, _) = busy_endpoint(dir, false);
    let Ok(to) = ep.lookup(uri) else { return 2 };
    let seg = na_core::RemoteSegment {
        addr: addr as u64,
        len: 4096,
        key: 0,
    };
    let Ok(desc) = na_core::RemoteMem::new(vec![seg], na_core::Access::ReadOnly) else {
        return 3;
    };
    if ep
        .send_unexpected(&to, 0, &desc.to_bytes(), na_core::OpId(1))
        .is_err()
    {
        return 4;
    }
    sys::write(status.as_fd(), b"S");
    loop {
        let _ = ep.progress(Some(std::time::Duration::from_millis(10)));
        while ep.pop_completion().is_some() {}
    }
}

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
pub const UNSHARE_PID: [&str; 5] = ["unshare", "--pid", "--fork", "--map-root-user", "--mount-proc"];

/// Set (to anything) to let tests that need PID namespaces pass, saying
/// so, where `unshare` cannot make them.
pub const SKIP_UNSHARE_ENV: &str = "QS_SM_SKIP_UNSHARE";

/// `unshare` could not run what a test needs (`why`): returns (the test
/// is skipped, and says so) if `$QS_SM_SKIP_UNSHARE` is set, else panics.
pub fn without_namespaces(why: &str) {
    if std::env::var_os(SKIP_UNSHARE_ENV).is_some() {
        eprintln!("!!! SKIPPED (${SKIP_UNSHARE_ENV} is set): {why}");
        return;
    }
    panic!("{why}\n(set ${SKIP_UNSHARE_ENV}=1 to skip this test where namespaces are unavailable)");
}

/// Runs this test binary's test `helper` (which reads the socket directory
/// from `$helper_env`) as pid 1 of a new PID namespace, in a fresh private
/// directory named by `tag`, and asserts the line it prints: `OK ...`
/// passes, `ERR ...` fails with the helper's stderr. A helper that never
/// printed either (no namespaces here) goes to [`without_namespaces`].
pub fn run_in_pid_namespace(tag: &str, helper: &str, helper_env: &str) {
    let dir = private_dir(tag);
    let out = std::process::Command::new(UNSHARE_PID[0])
        .args(&UNSHARE_PID[1..])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", helper, "--nocapture", "--test-threads=1"])
        .env(helper_env, &dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run unshare: {e}"));
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let result = stdout
        .lines()
        .find_map(|l| l.find("OK ").or_else(|| l.find("ERR ")).map(|at| &l[at..]));
    let Some(result) = result else {
        return without_namespaces(&format!(
            "`{}` could not run the helper: {stderr}",
            UNSHARE_PID.join(" ")
        ));
    };
    assert!(
        result.starts_with("OK "),
        "{result}\n--- helper's stderr:\n{stderr}"
    );
    eprintln!("{result}");
}

/// A pipe: (read end, write end).
pub fn pipe() -> (std::fs::File, std::fs::File) {
    let pipe = sys::pipe();
    assert!(pipe.is_ok());
    let (r, w) = pipe.unwrap();
    (r.into(), w.into())
}

/// Copies (`dup`) of the two ends of the connection made to the listener
/// at `path`: (the connector's end, the acceptor's end). Found among our
/// open sockets by their addresses: the connector's names `path` as its
/// peer, the acceptor's names it as its own (and, unlike the listener,
/// has a peer).
pub fn connection_ends(
    path: &std::path::Path,
) -> (std::os::unix::net::UnixStream, std::os::unix::net::UnixStream) {
    let (mut connector, mut acceptor) = (Vec::new(), Vec::new());
    // Listed before any copy is made (a listing read on would find the
    // copies too).
    let entries: Vec<std::fs::DirEntry> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for entry in entries {
        let Ok(link) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !link.to_string_lossy().starts_with("socket:") {
            continue;
        }
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // A descriptor closed since (by the closing thread) makes the dup
        // fail.
        let Ok(dup) = sys::dup_number(fd) else {
            continue;
        };
        let sock = std::os::unix::net::UnixStream::from(dup);
        let named = |a: std::io::Result<std::os::unix::net::SocketAddr>| {
            a.ok()
                .and_then(|a| a.as_pathname().map(std::path::Path::to_path_buf))
                == Some(path.to_path_buf())
        };
        if named(sock.peer_addr()) {
            connector.push(sock);
        } else if named(sock.local_addr()) && sock.peer_addr().is_ok() {
            acceptor.push(sock);
        }
    }
    assert_eq!(
        (connector.len(), acceptor.len()),
        (1, 1),
        "expected one connection to {}",
        path.display()
    );
    (connector.remove(0), acceptor.remove(0))
}

/// A copy (`dup`) of this process's listening socket bound to `path`
/// (found among our open descriptors): readable while connections wait
/// in its accept queue.
pub fn listener_copy(path: &std::path::Path) -> std::os::fd::OwnedFd {
    use std::os::fd::AsFd;
    let entries: Vec<std::fs::DirEntry> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for entry in entries {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(dup) = sys::dup_number(fd) else {
            continue;
        };
        if na_sm::sys::socket::unix_socket_kind(dup.as_fd()) != Some((libc::SOCK_STREAM, true)) {
            continue;
        }
        let sock = std::os::unix::net::UnixListener::from(dup);
        if sock
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(std::path::Path::to_path_buf))
            == Some(path.to_path_buf())
        {
            return std::os::fd::OwnedFd::from(sock);
        }
    }
    panic!("no listening socket bound to {}", path.display())
}

/// The socket of listener `uri` (`sm://<name>`) in `dir`.
pub fn listener_path(dir: &std::path::Path, uri: &str) -> std::path::PathBuf {
    dir.join(format!("{}.sock", uri.trim_start_matches("sm://")))
}

/// How long a [`KillOnDrop`] waits for its process to end after the kill
/// (generous: a loaded box; a killed process ends in microseconds).
pub const REAP_BOUND: std::time::Duration = std::time::Duration::from_secs(20);

/// Kills (`SIGKILL`) a process the test made, however the test ends, and
/// waits (at most [`REAP_BOUND`]) until it has ended, reaping it if it is
/// a child of ours: no zombie of it, and nothing it held open (the
/// test's output pipes, which the test runner waits on), outlives the
/// value. A process that ended before (reaped by a `wait` of the test's
/// own, or, a grandchild, by its parent or init) is fine.
///
/// The process is held through a pidfd taken when the value is made, so
/// neither the kill nor the wait reaches another process that took its
/// pid since (one of ours reaped by the test; a grandchild reaped by
/// init). Where the kernel has no pidfds, by pid: killed, and reaped if
/// ours.
pub struct KillOnDrop {
    /// The process's pid.
    pid: libc::pid_t,
    /// Its pidfd; `ESRCH`: it was gone already when the value was made;
    /// another error: no pidfds here.
    pidfd: std::io::Result<std::os::fd::OwnedFd>,
}

impl KillOnDrop {
    /// The killer of process `pid` (one this test made, or its child's).
    pub fn new(pid: libc::pid_t) -> KillOnDrop {
        KillOnDrop {
            pid,
            pidfd: sys::pidfd_open(pid),
        }
    }

    /// The process's pid.
    pub fn pid(&self) -> libc::pid_t {
        self.pid
    }

    /// Its pidfd (`None` where there is none: see the type's docs).
    pub fn pidfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.pidfd.as_ref().ok().map(std::os::fd::AsFd::as_fd)
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let end = std::time::Instant::now() + REAP_BOUND;
        match &self.pidfd {
            Ok(fd) => kill_and_reap_pidfd(self.pid, std::os::fd::AsFd::as_fd(fd), end),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(_) => kill_and_reap_pid(self.pid, end),
        }
    }
}

/// [`KillOnDrop`] through pidfd `fd` of process `pid`: kills it, waits
/// (until `end`) for the pidfd to be readable (the process has ended: a
/// zombie, or reaped already), then reaps it if it is our child.
fn kill_and_reap_pidfd(pid: libc::pid_t, fd: std::os::fd::BorrowedFd<'_>, end: std::time::Instant) {
    use std::os::fd::AsRawFd;
    // (A process this test made; ESRCH once it has ended.)
    sys::pidfd_send_signal(fd, libc::SIGKILL);
    loop {
        let left = end.saturating_duration_since(std::time::Instant::now());
        let (n, _) = sys::poll_one(fd.as_raw_fd(), libc::POLLIN, left.as_millis() as libc::c_int);
        if n > 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        if n == 0 {
            eprintln!("!!! KillOnDrop: pid {pid} had not ended {REAP_BOUND:?} after SIGKILL");
            return;
        }
        if err.kind() != std::io::ErrorKind::Interrupted {
            eprintln!("!!! KillOnDrop: cannot wait for pid {pid} to end: {err}");
            return;
        }
    }
    // Ended: reaped now if ours (ECHILD if not, or reaped already).
    loop {
        match sys::waitid_pidfd(fd) {
            Ok(false) if std::time::Instant::now() < end => {
                std::thread::sleep(std::time::Duration::from_millis(1))
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => return,
        }
    }
}

/// [`KillOnDrop`] without pidfds: kills `pid` and reaps it if it is our
/// child (`ECHILD`: not ours, or reaped already), waiting until `end`.
fn kill_and_reap_pid(pid: libc::pid_t, end: std::time::Instant) {
    // (A process this test made.)
    sys::kill(pid, libc::SIGKILL);
    let mut status = 0;
    loop {
        match sys::waitpid(pid, &mut status, libc::WNOHANG) {
            0 if std::time::Instant::now() < end => std::thread::sleep(std::time::Duration::from_millis(1)),
            -1 if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => return,
        }
    }
}

/// The child's exit status, or None if it had not ended within `limit`
/// (then it is killed and reaped).
pub fn wait_child(pid: libc::pid_t, limit: std::time::Duration) -> Option<i32> {
    let end = std::time::Instant::now() + limit;
    let mut status = 0;
    loop {
        // (Our own child.)
        let r = sys::waitpid(pid, &mut status, libc::WNOHANG);
        if r == pid {
            assert!(libc::WIFEXITED(status), "child ended by a signal: {status:#x}");
            return Some(libc::WEXITSTATUS(status));
        }
        if std::time::Instant::now() > end {
            // Kills and reaps our own hung child.
            sys::kill(pid, libc::SIGKILL);
            sys::waitpid(pid, &mut status, 0);
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
