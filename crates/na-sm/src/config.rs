//! Plugin configuration and the socket directory.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{SmError, SmResult};
pub use crate::sys::wake::WakeKind;

mod hooks;
pub use hooks::SmConfigHooks;

/// Environment variable that overrides the default socket directory.
pub const SOCKET_DIR_ENV: &str = "QS_SM_DIR";

/// Environment variable choosing the wake-up primitive: `eventfd` or `pipe`.
pub const WAKE_ENV: &str = "QS_SM_WAKE";

/// Environment variable choosing how peers' exits are watched: `socket`
/// (the default: the pidfd `SO_PEERPIDFD` gives, else as `pid`) or `pid`
/// (`pidfd_open` of the peer's pid, checked against its start time, as on
/// kernels before 6.5). `pid` is for testing that path where the kernel is
/// newer.
pub const PIDFD_ENV: &str = "QS_SM_PIDFD";

/// Environment variable choosing how many transfer threads move RMA data
/// when [`SmConfig::rma_threads`] is `None`: a number, `0` (the default)
/// for none (RMA moves inside the `rma` call, on the caller's thread).
/// See [`SmConfig::rma_threads`] for when to set it.
pub const RMA_THREADS_ENV: &str = "QS_SM_RMA_THREADS";

/// Most transfer threads [`SmConfig::rma_threads`] (or
/// [`RMA_THREADS_ENV`]) may ask for.
pub const MAX_RMA_THREADS: usize = 64;

/// Most transfer jobs (a job: up to `IOV_MAX` transfers of one direction
/// from one batch) that may wait for one peer in the transfer-thread pool;
/// a batch that would pass it is refused whole, nothing started.
pub const RMA_QUEUE_PER_PEER: usize = 1024;

/// While transfers are with the transfer threads but none started or
/// ended for a second, a busy owner's spin still gives up its core once
/// per this gap (and not once per progress call, as while jobs come and
/// go). A transfer thread inherits the owner's CPU set and scheduling
/// policy: where the owner is pinned to one core with `SCHED_FIFO` or
/// `SCHED_RR`, a thread whose job slept (a page-in of slow file-backed
/// memory, say) and woke ready to go on runs only when the owner yields,
/// so a busy owner that never yielded to a quiet pool held a healthy
/// transfer forever.
pub const RMA_QUIET_YIELD_EVERY: Duration = Duration::from_millis(100);

/// Longest instance name accepted in `sm://<name>` and in addresses.
pub const MAX_NAME_LEN: usize = 64;

/// How an [`SmPlugin`](crate::SmPlugin) is set up. Start from
/// [`SmConfig::default`] (client-only, default directory) and change fields.
#[derive(Clone, Debug)]
pub struct SmConfig {
    /// Create a listening socket so that peers can look us up.
    pub listen: bool,
    /// Socket directory; `None`: `$QS_SM_DIR`, else `/tmp/qs-sm-<uid>`.
    pub dir: Option<PathBuf>,
    /// Instance name (`sm://<pid>-<name>`); `None`: a per-process counter.
    pub name: Option<String>,
    /// Remove stale files of dead processes from the directory when a
    /// listening instance starts (see [`crate::cleanup_stale`]).
    pub cleanup_on_start: bool,
    /// Let same-uid processes use CMA on us under Yama `ptrace_scope` 1
    /// (`prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`).
    pub allow_any_ptracer: bool,
    /// How long an accepted connection may take to send its hello; also
    /// bounds `lookup`'s connect (and the retries of `try_lookup`, counted
    /// from the caller's first attempt), and a connector whose peer has
    /// not acknowledged within twice this fails it with `PeerGone`.
    pub handshake_timeout: Duration,
    /// Most messages from one peer kept while no receive is posted for
    /// them (each at most 8 KiB). Past it we stop draining that peer's ring:
    /// its messages wait in shared memory and its sends back up, so a peer
    /// that floods us cannot grow our memory.
    pub max_queued_per_peer: usize,
    /// Most messages queued over all peers, twice over. Connected peers':
    /// at it we stop draining every ring whose next message would be
    /// queued (as for one peer above). Departed peers' (a departing peer's
    /// ring is taken whole, in pull mode too, so that what it sent is not
    /// lost): at it the listener stops accepting connections (they wait in
    /// the kernel's queue) until the application takes some, so a peer
    /// that reconnects again and again cannot grow our memory either.
    /// Connected peers that hold messages nobody takes therefore never
    /// stop new clients from connecting.
    pub max_queued_total: usize,
    /// How long expected messages of a peer that went away stay queued for
    /// a receive naming it (what it sent before it went is not lost at
    /// once); after that they are dropped, so a peer that comes and goes
    /// cannot pile them up.
    pub departed_hold: Duration,
    /// The descriptor peers write to wake us: `None` means `$QS_SM_WAKE`,
    /// else an eventfd (a pipe where the kernel has none).
    pub wake: Option<WakeKind>,
    /// Most bytes of sends queued for one peer whose ring is full (each
    /// send charged its payload plus 64). A send past it fails at once
    /// with `NaError::SendBacklogFull` and is not queued, so a peer that
    /// never reads cannot grow our memory. Default
    /// [`na_core::DEFAULT_MAX_BACKLOG_BYTES`] (64 MiB).
    pub max_backlog_bytes: usize,
    /// Most bytes of sends queued for all peers together (the peer names
    /// a process claims are its own choice: one process can pose as many
    /// peers). Default [`na_core::DEFAULT_MAX_BACKLOG_TOTAL`] (256 MiB).
    pub max_backlog_total: usize,
    /// Most connections one process (by its kernel-reported pid) may have
    /// made to this listener and still hold (ours to it are not counted);
    /// its handshakes past it are refused, with the reason. Each costs 3
    /// descriptors and a ~540 KiB mapping here, so a client that leaks
    /// plugin instances (or claims many names) cannot exhaust our
    /// descriptors. Default [`DEFAULT_MAX_CONNS_PER_PROCESS`].
    pub max_conns_per_process: usize,
    /// Transfer threads for RMA: `None` means `$QS_SM_RMA_THREADS`
    /// ([`RMA_THREADS_ENV`]), else 0.
    ///
    /// 0 (the default): each batch moves inside the `rma` call, on the
    /// caller's thread, which is the fastest (no hand-off). But the kernel
    /// faults the peer's pages in on that thread, and a peer whose memory
    /// stalls every access (a mapping of a file on a FUSE or network file
    /// system whose server hangs, a range registered with a userfaultfd
    /// whose handler deadlocked) then holds it, killable only, for as long
    /// as the stall lasts: with it the whole engine.
    ///
    /// N > 0 (at most [`MAX_RMA_THREADS`]): `rma` checks the batch and
    /// returns at once; up to N threads (`qs-sm-rma-K`, each started when
    /// a peer's jobs find none free) move it, at most one job per peer at a time, so a stalled peer
    /// holds one thread and its own queue only, and the caller never
    /// waits. Completions arrive through progress as usual; cancel
    /// completes a transfer at once (see `na_sm`'s crate docs). The
    /// hand-off costs a few microseconds per batch: turn it on where peers'
    /// exposed memory may be backed by something that can hang.
    /// Transfers to this process itself stay on the caller's thread.
    pub rma_threads: Option<usize>,
    /// Test hooks: with the `test-hooks` feature, the exit-watch
    /// overrides (`debug.pidfd_by_pid`: watch peers' exits by pid, as on
    /// kernels without `SO_PEERPIDFD`; `debug.exits_by_eof_only`: by
    /// their sockets' end-of-file only, as on kernels without pidfds);
    /// without it, nothing (an empty value a user's build cannot name or
    /// set). Leave it at its default.
    #[doc(hidden)]
    pub debug: SmConfigHooks,
}

/// Default of [`SmConfig::max_conns_per_process`].
pub const DEFAULT_MAX_CONNS_PER_PROCESS: usize = 256;

/// Default of [`SmConfig::max_queued_per_peer`].
pub const DEFAULT_MAX_QUEUED_PER_PEER: usize = 256;

impl Default for SmConfig {
    fn default() -> Self {
        SmConfig {
            listen: false,
            dir: None,
            name: None,
            cleanup_on_start: true,
            allow_any_ptracer: true,
            handshake_timeout: Duration::from_secs(5),
            max_queued_per_peer: DEFAULT_MAX_QUEUED_PER_PEER,
            max_queued_total: 32 * DEFAULT_MAX_QUEUED_PER_PEER,
            departed_hold: Duration::from_secs(10),
            wake: None,
            max_backlog_bytes: na_core::DEFAULT_MAX_BACKLOG_BYTES,
            max_backlog_total: na_core::DEFAULT_MAX_BACKLOG_TOTAL,
            max_conns_per_process: DEFAULT_MAX_CONNS_PER_PROCESS,
            rma_threads: None,
            debug: SmConfigHooks::default(),
        }
    }
}

impl SmConfig {
    /// A listening configuration with defaults otherwise.
    pub fn listening() -> Self {
        SmConfig {
            listen: true,
            ..Self::default()
        }
    }

    /// Sets the socket directory.
    pub fn with_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// Sets the instance name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The wake-up primitive this configuration uses.
    pub fn resolve_wake(&self) -> SmResult<WakeKind> {
        if let Some(k) = self.wake {
            return Ok(k);
        }
        match env_string(WAKE_ENV)? {
            None => Ok(WakeKind::EventFd),
            Some(v) => {
                WakeKind::parse(&v).ok_or_else(|| config_error(WAKE_ENV, v, "expected eventfd or pipe"))
            }
        }
    }

    /// How many RMA transfer threads this configuration asks for:
    /// [`rma_threads`](Self::rma_threads), else [`RMA_THREADS_ENV`]
    /// (a decimal number), else 0. More than [`MAX_RMA_THREADS`], or a
    /// value that is not a number, is an error naming it.
    pub fn resolve_rma_threads(&self) -> SmResult<usize> {
        let too_many = |n: usize| n > MAX_RMA_THREADS;
        if let Some(n) = self.rma_threads {
            if too_many(n) {
                return Err(config_error(
                    "SmConfig::rma_threads",
                    n.to_string(),
                    &format!("at most {MAX_RMA_THREADS} transfer threads"),
                ));
            }
            return Ok(n);
        }
        let Some(v) = env_string(RMA_THREADS_ENV)? else {
            return Ok(0);
        };
        match v.trim().parse::<usize>() {
            Ok(n) if !too_many(n) => Ok(n),
            Ok(_) => Err(config_error(
                RMA_THREADS_ENV,
                v,
                &format!("at most {MAX_RMA_THREADS} transfer threads"),
            )),
            Err(_) => Err(config_error(
                RMA_THREADS_ENV,
                v,
                "expected a number of RMA transfer threads (0: none, transfers on the caller's thread)",
            )),
        }
    }

    /// Whether peers' exits are watched by pid only: [`PIDFD_ENV`] set to
    /// `pid` (or, with the `test-hooks` feature, `debug.pidfd_by_pid`).
    pub fn resolve_pidfd_by_pid(&self) -> SmResult<bool> {
        if self.debug.by_pid() {
            return Ok(true);
        }
        match env_string(PIDFD_ENV)?.as_deref() {
            None | Some("socket") => Ok(false),
            Some("pid") => Ok(true),
            Some(v) => Err(config_error(PIDFD_ENV, v.to_owned(), "expected socket or pid")),
        }
    }

    /// How peers' exits are watched: by end-of-file only
    /// (`debug.exits_by_eof_only`, `test-hooks` builds), by pid
    /// ([`resolve_pidfd_by_pid`](Self::resolve_pidfd_by_pid)), or through
    /// the socket's pidfd.
    pub(crate) fn resolve_exit_watch(&self) -> SmResult<crate::identity::ExitWatch> {
        use crate::identity::ExitWatch;
        Ok(if self.debug.eof_only() {
            ExitWatch::EofOnly
        } else if self.resolve_pidfd_by_pid()? {
            ExitWatch::ByPid
        } else {
            ExitWatch::Socket
        })
    }

    /// The socket directory this configuration uses (not created).
    pub fn resolve_dir(&self) -> SmResult<PathBuf> {
        if let Some(d) = &self.dir {
            return Ok(d.clone());
        }
        default_dir()
    }
}

/// `$QS_SM_DIR` if set (must be valid UTF-8, non-empty and absolute), else
/// `/tmp/qs-sm-<uid>`.
pub fn default_dir() -> SmResult<PathBuf> {
    match env_string(SOCKET_DIR_ENV)? {
        Some(v) if v.is_empty() => Err(config_error(
            SOCKET_DIR_ENV,
            v,
            "empty; unset it or give an absolute directory",
        )),
        Some(v) if !Path::new(&v).is_absolute() => {
            Err(config_error(SOCKET_DIR_ENV, v, "must be an absolute path"))
        }
        Some(v) => Ok(PathBuf::from(v)),
        None => Ok(PathBuf::from(format!("/tmp/qs-sm-{}", crate::sys::proc::uid()))),
    }
}

/// The value of environment variable `name`, if set; not UTF-8 is an error.
fn env_string(name: &str) -> SmResult<Option<String>> {
    na_core::env_var(name, |value, reason| config_error(name, value, reason))
}

fn config_error(name: &str, value: String, reason: &str) -> SmError {
    SmError::Config {
        name: name.into(),
        value,
        reason: reason.into(),
    }
}

/// Checks an instance name: 1 to 64 of `[A-Za-z0-9_.-]`.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(format!("instance name must have 1 to {MAX_NAME_LEN} characters"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
    {
        return Err("instance name may only contain A-Z a-z 0-9 _ . -".into());
    }
    Ok(())
}

/// Creates `dir` with mode 0700 if missing (parents as needed), and checks
/// that it is a directory owned by us that nobody else can enter.
pub fn ensure_dir(dir: &Path) -> SmResult<()> {
    let err = |source| SmError::SocketDir {
        path: dir.to_owned(),
        source,
    };
    if let Some(parent) = dir.parent() {
        if !parent.as_os_str().is_empty() && !parent.exists() {
            std::fs::create_dir_all(parent).map_err(err)?;
        }
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err(e)),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(err)?;
    let insecure = |reason: String| SmError::InsecureDir {
        path: dir.to_owned(),
        reason,
    };
    if !meta.is_dir() {
        return Err(insecure("not a directory (or a symlink)".into()));
    }
    if meta.uid() != crate::sys::proc::uid() {
        return Err(insecure(format!(
            "owned by uid {}, we are uid {}",
            meta.uid(),
            crate::sys::proc::uid()
        )));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(insecure(format!(
            "mode {mode:o} lets others in; expected 700 (chmod 700 it)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(check_name("srv-1.a_b").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name("a/b").is_err());
        assert!(check_name(&"x".repeat(65)).is_err());
    }

    /// The field wins over the environment; 0 and small numbers pass; too
    /// many threads is refused naming the field. (The environment variable
    /// itself is read in `tests/rma_threads_env.rs`, a process of its own.)
    #[test]
    fn rma_threads_from_the_field() {
        let cfg = |n| SmConfig {
            rma_threads: Some(n),
            ..SmConfig::default()
        };
        assert_eq!(cfg(0).resolve_rma_threads().unwrap(), 0);
        assert_eq!(cfg(2).resolve_rma_threads().unwrap(), 2);
        assert_eq!(
            cfg(MAX_RMA_THREADS).resolve_rma_threads().unwrap(),
            MAX_RMA_THREADS
        );
        let e = cfg(MAX_RMA_THREADS + 1)
            .resolve_rma_threads()
            .unwrap_err()
            .to_string();
        assert!(e.contains("SmConfig::rma_threads") && e.contains("65"), "{e}");
        assert_eq!(
            SmConfig::default().rma_threads,
            None,
            "the default reads the environment"
        );
    }

    #[test]
    fn dir_checks() {
        let base = std::env::temp_dir().join(format!("qs-sm-cfg-test-{}", std::process::id()));
        let d = base.join("sock");
        ensure_dir(&d).unwrap();
        ensure_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = ensure_dir(&d).unwrap_err();
        assert!(e.to_string().contains("chmod 700"), "{e}");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
