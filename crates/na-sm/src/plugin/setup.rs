//! Making an instance: its name, directory, timer and epoll set, and
//! the listening socket under a claimed name.

use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering;
use std::time::Instant;

use na_core::fasthash::FastMap;
use na_core::sys::epoll::Epoll;
use na_core::sys::timer::Timer;
use na_core::{MsgBufPool, PluginId, PluginStats};

use crate::addr::{NameClaim, PeerTable, SmName};
use crate::config::{check_name, ensure_dir, SmConfig};
use crate::error::{SmError, SmResult};
use crate::heads::HeadList;
use crate::matching::Matcher;
use crate::sys::cma::IovLists;
use crate::sys::proc;

use super::{SmPlugin, LISTENER_TOKEN, NEXT_INSTANCE, TIMER_TOKEN};

impl SmPlugin {
    /// Creates an instance: with `config.listen`, binds
    /// `<dir>/<pid>-<instance>.sock` (dir created 0700, socket 0600).
    pub fn new(id: PluginId, config: SmConfig) -> SmResult<SmPlugin> {
        if config.handshake_timeout.is_zero() {
            // The socket layer reads zero as "no limit": a connect to a
            // listener whose queue is full would block for good.
            return Err(SmError::Config {
                name: "SmConfig::handshake_timeout".into(),
                value: "0".into(),
                reason: "must be above zero (zero would mean no limit on connect and handshake)".into(),
            });
        }
        // What the screen of peer-passed descriptors compares them with,
        // learned now: a handshake may find our descriptors run out, and
        // learning takes four (`sys::screen`).
        if crate::sys::screen::internal_devices().is_none() {
            tracing::debug!("sm: the kernel's pipe, eventfd and memfd devices are not known yet");
        }
        let dir = config.resolve_dir()?;
        let wake_kind = config.resolve_wake()?;
        let exit_watch = config.resolve_exit_watch()?;
        let rma_threads = config.resolve_rma_threads()?;
        let named = |instance| SmName {
            pid: proc::pid(),
            instance,
        };
        let (name, name_claim) = match &config.name {
            Some(n) => {
                check_name(n).map_err(|reason| SmError::Config {
                    name: "sm instance name".into(),
                    value: n.clone(),
                    reason,
                })?;
                let name = named(n.clone());
                let Some(claim) = NameClaim::take(&name) else {
                    tracing::warn!(name = %name.uri(), "sm instance name already used in this process: refused");
                    return Err(SmError::NameInUse { uri: name.uri() });
                };
                (name, claim)
            }
            None => loop {
                let name = named(NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed).to_string());
                if let Some(claim) = NameClaim::take(&name) {
                    break (name, claim);
                }
            },
        };
        if config.allow_any_ptracer {
            proc::allow_any_ptracer().map_err(|e| SmError::sys("prctl(PR_SET_PTRACER)", e))?;
        }
        crate::sys::fork::install().map_err(|e| SmError::sys("pthread_atfork", e))?;
        let generation = crate::sys::fork::generation();
        let poll = Epoll::new().map_err(|e| SmError::sys("epoll_create1", e))?;
        let timer = Timer::new().map_err(|e| SmError::sys("timerfd_create", e))?;
        poll.add(timer.as_fd(), TIMER_TOKEN)
            .map_err(|e| SmError::sys("epoll_ctl add timer", e))?;
        let mut peers = PeerTable::default();
        // Our own start time: what `peer_process` answers for our own
        // address, as for any connection of ours from another instance.
        let own_start = proc::start_time(proc::pid()).ok();
        let self_tok = peers.insert(id, name.clone(), proc::pid(), own_start, true);
        let mut plugin = SmPlugin {
            id,
            cfg: config,
            dir,
            name,
            _name_claim: name_claim,
            owner_file: None,
            self_tok,
            uid: proc::uid(),
            failures_queued: VecDeque::new(),
            failing: false,
            listener: None,
            poll,
            peers,
            pending: HashMap::new(),
            accept_pause: None,
            listener_hooks: crate::connect::ListenerHooks::new(),
            timer,
            timer_fired: false,
            events_at: Instant::now(),
            awaiting_ack: 0,
            next_serial: 16,
            matcher: Matcher::default(),
            ops: FastMap::default(),
            completions: VecDeque::new(),
            stats: PluginStats::default(),
            armed: false,
            rings_held: false,
            owner_woken: false,
            tick: 0,
            events_owed: false,
            wake_primed: false,
            wakeups: 0,
            side_work: 0,
            backlog_total: na_core::BacklogTotal::default(),
            tokens: Vec::with_capacity(32),
            wake_kind,
            exit_watch,
            msg_bufs: MsgBufPool::default(),
            iov_lists: IovLists::default(),
            rma_threads,
            rma_pool: None,
            pull: false,
            pull_heads: 0,
            pull_last: None,
            spin_found: None,
            pull_next: 0,
            pulled_late: VecDeque::new(),
            heads: HeadList::default(),
            ring_scratch: Vec::new(),
            generation,
        };
        if plugin.cfg.listen {
            plugin.listen()?;
        }
        tracing::info!(addr = %plugin.name.uri(), listen = plugin.cfg.listen, wake = wake_kind.name(), "sm plugin created");
        Ok(plugin)
    }

    fn listen(&mut self) -> SmResult<()> {
        ensure_dir(&self.dir)?;
        // On NFS, flock is emulated with POSIX locks, which belong to the
        // process: our own cleanup would take a sibling instance's lock for
        // free and remove its files. Other processes' locks still hold.
        let per_process_locks = std::fs::File::open(&self.dir)
            .and_then(|d| crate::sys::lock::lock_is_per_process(&d))
            .unwrap_or(false);
        if per_process_locks && self.cfg.cleanup_on_start {
            tracing::warn!(dir = %self.dir.display(), "sm: the socket directory is on NFS, whose locks are per process: \
                stale-file cleanup at start skipped (run qs-sm-cleanup from another process)");
        }
        if self.cfg.cleanup_on_start && !per_process_locks {
            match crate::cleanup::cleanup_stale(&self.dir) {
                Ok(r) if !r.removed.is_empty() => {
                    tracing::info!(removed = r.removed.len(), dir = %self.dir.display(), "removed stale sm files")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %na_core::ErrorChain(&e), "stale-file cleanup failed"),
            }
        }
        // The name is ours once our locked owner file is in place (never
        // over a live owner's: see `cleanup::claim_name`); only then are
        // files under it ours to replace.
        let owner = crate::cleanup::claim_name(&self.dir, &self.name)?;
        let path = self.name.socket_path(&self.dir);
        match self.bind_claimed(&path) {
            Ok(listener) => {
                self.listener = Some(listener);
                self.owner_file = Some(owner);
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(self.name.owner_path(&self.dir));
                Err(e)
            }
        }
    }

    /// Binds the socket of a name we hold: a socket file already there was
    /// left by a dead owner of the name.
    fn bind_claimed(&self, path: &std::path::Path) -> SmResult<UnixListener> {
        let err = |source| SmError::Listen {
            path: path.to_owned(),
            source,
        };
        match std::fs::remove_file(path) {
            Ok(()) => tracing::info!(path = %path.display(), "removed a dead owner's socket file"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        let listener = UnixListener::bind(path).map_err(err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
        listener.set_nonblocking(true).map_err(err)?;
        self.poll
            .add(listener.as_fd(), LISTENER_TOKEN)
            .map_err(|e| SmError::sys("epoll_ctl add listener", e))?;
        Ok(listener)
    }

    /// The socket directory in use.
    pub fn socket_dir(&self) -> &std::path::Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A listen under a name a live instance holds (one of this process
    /// here; in practice one in another PID namespace with our pid) is
    /// refused with `AddrInUse`: the live instance's owner file and socket
    /// are neither rewritten nor removed, and nothing connects to it.
    #[test]
    fn listen_under_a_live_instances_name_refuses_and_leaves_it_alone() {
        let dir = std::env::temp_dir().join(format!("qs-sm-plugin-taken-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = |listen, name: &str| {
            SmConfig {
                listen,
                ..SmConfig::default()
            }
            .with_dir(&dir)
            .with_name(name)
        };
        let live = SmPlugin::new(PluginId(1), cfg(true, "taken")).unwrap();
        let (owner, sock) = (live.name.owner_path(&dir), live.name.socket_path(&dir));
        let state = || {
            let (o, s) = (
                std::fs::metadata(&owner).unwrap(),
                std::fs::metadata(&sock).unwrap(),
            );
            (std::fs::read(&owner).unwrap(), o.ino(), o.mtime_nsec(), s.ino())
        };
        let before = state();
        let mut other = SmPlugin::new(PluginId(2), cfg(false, "other")).unwrap();
        // The same name, as a process with our pid in another PID
        // namespace would have it (this process's registry would refuse
        // it before any file is looked at).
        other.name = live.name.clone();
        let e = other.listen().unwrap_err();
        let SmError::Listen { source, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse, "{e}");
        let chain = na_core::ErrorChain(&e).to_string();
        assert!(chain.contains("by a live process"), "{chain}");
        assert!(other.listener.is_none());
        drop(other);
        assert_eq!(state(), before, "the live instance's files changed");
        let accepted = live.listener.as_ref().unwrap().accept();
        assert!(
            matches!(&accepted, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "the refused listen connected to the live instance: {accepted:?}"
        );
        drop(live);
        assert!(!owner.exists() && !sock.exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
