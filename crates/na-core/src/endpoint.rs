//! The endpoint: a set of plugin instances driven by one poll set.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::addr::{split_uri, Addr, PluginId};
use crate::error::{ErrorChain, NaError, Result};
use crate::mem::{MemHandle, RemoteMem};
use crate::msgbuf::MsgBuf;
use crate::op::{Completion, OpId, Report, Tag};
use crate::plugin::{Plugin, PluginRegistry};
use crate::progress::{deadline_after, ProgressMode};
use crate::rma::Rma;
use crate::sys::epoll::Epoll;
use crate::waker::Waker;

/// The token of the [`Waker`]'s eventfd in the epoll set (plugins' tokens
/// are their ids, which fit in 32 bits).
const WAKER_TOKEN: u64 = u64::MAX;

/// How many polls the spin phase of [`Endpoint::progress`] makes between
/// two reads of the clock.
pub const CLOCK_EVERY: u32 = 64;

/// Any number of plugin instances (several of one scheme allowed) and one
/// epoll set that holds all their poll fds.
///
/// # Call order
/// 1. [`Endpoint::new`], then [`add_plugin`](Self::add_plugin) (or
///    [`add_from_spec`](Self::add_from_spec)) once per transport.
/// 2. Look up peers, post operations: each call is routed to the plugin the
///    address (or the explicit [`PluginId`]) belongs to.
/// 3. Call [`progress`](Self::progress) and drain
///    [`pop_completion`](Self::pop_completion); or register
///    [`as_fd`](AsFd::as_fd) with your own event loop (tokio `AsyncFd`,
///    `poll(2)`), call [`try_wait`](Self::try_wait) before sleeping on it and
///    [`progress_now`](Self::progress_now) when it is readable.
///
/// Another thread ends the sleep with a [`Waker`]
/// ([`waker`](Self::waker)).
pub struct Endpoint {
    plugins: Vec<Box<dyn Plugin>>,
    /// This endpoint's number, unique in the process: the high bits of
    /// its plugins' ids (the low 8 are the plugin's index).
    tag: u32,
    poll: Epoll,
    mode: ProgressMode,
    completions: VecDeque<Completion>,
    tokens: Vec<u64>,
    recently_active: bool,
    /// Plugins in pull mode (indices), whose waiting unexpected messages
    /// count as work.
    pulling: Vec<usize>,
    /// The cross-thread wake-up, once [`waker`](Self::waker) made it
    /// (its eventfd is then in `poll`).
    waker: Option<Waker>,
}

/// What [`Endpoint::try_wait`] found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum MaySleep {
    /// Every plugin armed, nothing pending: sleep on the epoll set.
    Yes,
    /// Work is pending (completions, a message to pull, a plugin's).
    Work,
    /// A [`Waker`] woke the endpoint (taken now).
    Woken,
}

impl Endpoint {
    /// An endpoint with no plugins yet.
    pub fn new(mode: ProgressMode) -> Result<Self> {
        Ok(Endpoint {
            plugins: Vec::new(),
            tag: next_endpoint_tag()?,
            poll: Epoll::new().map_err(|e| NaError::sys("epoll_create1", e))?,
            mode,
            completions: VecDeque::new(),
            tokens: Vec::with_capacity(32),
            recently_active: false,
            pulling: Vec::new(),
            waker: None,
        })
    }

    /// Adds a plugin built by `make` with the id it is given. Ids are
    /// unique in the process, not only in this endpoint: an address or a
    /// memory registration of another endpoint's plugin names no plugin
    /// here (an error), instead of the plugin that happens to have the
    /// same place in this endpoint (which would send to whichever peer
    /// its token names there).
    pub fn add_plugin(&mut self, make: impl FnOnce(PluginId) -> Result<Box<dyn Plugin>>) -> Result<PluginId> {
        let index = self.plugins.len();
        if index >= MAX_PLUGINS {
            return Err(NaError::Plugin {
                plugin: "endpoint",
                message: format!("an endpoint takes at most {MAX_PLUGINS} plugins"),
            });
        }
        let id = self.id_at(index);
        let plugin = make(id)?;
        if plugin.id() != id {
            return Err(NaError::Plugin {
                plugin: plugin.scheme(),
                message: format!("plugin reports id {:?}, was given {id:?}", plugin.id()),
            });
        }
        if let Some(fd) = plugin.poll_fd() {
            self.poll
                .add(fd, u64::from(id.0))
                .map_err(|e| NaError::sys("epoll_ctl add plugin fd", e))?;
        }
        tracing::debug!(plugin = plugin.scheme(), id = id.0, addr = %plugin.self_addr(), "plugin added");
        self.plugins.push(plugin);
        Ok(id)
    }

    /// Adds a plugin from a spec string such as `"sm://"`, using the factory
    /// of its scheme in `registry`.
    pub fn add_from_spec(&mut self, registry: &PluginRegistry, spec: &str, listen: bool) -> Result<PluginId> {
        let (scheme, _) = split_uri(spec)?;
        let factory = registry.get(scheme)?;
        self.add_plugin(|id| factory.create(id, spec, listen))
    }

    /// A [`Waker`] for this endpoint: [`Waker::wake`], from any thread,
    /// ends its sleep (a [`progress`](Self::progress) call returns; a
    /// sleep of your own on [`as_fd`](AsFd::as_fd) ends, and the next
    /// [`try_wait`](Self::try_wait) says false), or the next one if none
    /// is under way. All wakers of an endpoint are clones of one.
    ///
    /// The first call makes it: an eventfd added to the endpoint's epoll
    /// set (the error if that fails). From then on an endpoint with a
    /// single plugin sleeps on its epoll set rather than on the plugin's
    /// own primitive ([`Plugin::sleep`], which no other descriptor can
    /// end): one more level of epoll nesting per wake-up, one `read(2)`
    /// of the eventfd in each [`try_wait`](Self::try_wait), and before
    /// each sleep the plugin's own [`Plugin::try_wait`], which its
    /// `sleep` may do more cheaply (na-sm's harvests its socket events
    /// first: one more `epoll_wait`).
    /// Busy progress, which never sleeps, reads a flag of the waker every
    /// [`CLOCK_EVERY`] polls, with the clock, and no system call.
    pub fn waker(&mut self) -> Result<Waker> {
        if let Some(w) = &self.waker {
            return Ok(w.clone());
        }
        let w = Waker::new()?;
        self.poll
            .add(w.fd(), WAKER_TOKEN)
            .map_err(|e| NaError::sys("epoll_ctl add waker eventfd", e))?;
        self.waker = Some(w.clone());
        Ok(w)
    }

    /// Takes a wake-up posted through the [`Waker`], if there is one:
    /// true if one was posted since the last take.
    fn take_wake(&mut self) -> Result<bool> {
        match &self.waker {
            Some(w) => w.take(),
            None => Ok(false),
        }
    }

    /// The progress mode.
    pub fn mode(&self) -> ProgressMode {
        self.mode
    }

    /// Changes the progress mode.
    pub fn set_mode(&mut self, mode: ProgressMode) {
        self.mode = mode;
    }

    /// The id of the plugin at `index`: this endpoint's tag in the high
    /// 24 bits, the index in the low 8.
    fn id_at(&self, index: usize) -> PluginId {
        PluginId(self.tag << 8 | index as u32)
    }

    /// Where plugin `id` is in `plugins` (the inverse of `id_at`): a shift
    /// and two compares.
    #[inline]
    fn index_of(&self, id: PluginId) -> Option<usize> {
        let i = (id.0 & 0xff) as usize;
        (id.0 >> 8 == self.tag && i < self.plugins.len()).then_some(i)
    }

    /// The plugin with id `id`.
    pub fn plugin(&self, id: PluginId) -> Result<&dyn Plugin> {
        let i = self.index_of(id).ok_or_else(|| no_such(id))?;
        Ok(self.plugins[i].as_ref())
    }

    /// The plugin with id `id`, mutably. (Switch a plugin to pull mode
    /// with [`pull_unexpected`](Self::pull_unexpected), not through this:
    /// see [`Plugin::pull_unexpected`].)
    pub fn plugin_mut(&mut self, id: PluginId) -> Result<&mut (dyn Plugin + 'static)> {
        let i = self.index_of(id).ok_or_else(|| no_such(id))?;
        Ok(self.plugins[i].as_mut())
    }

    /// Ids of all plugins, in the order they were added.
    pub fn plugin_ids(&self) -> impl Iterator<Item = PluginId> + '_ {
        (0..self.plugins.len()).map(|i| self.id_at(i))
    }

    /// The plugin `addr` belongs to; an address of another endpoint (or of
    /// a plugin since removed) is an error.
    fn route(&mut self, addr: &Addr) -> Result<&mut (dyn Plugin + 'static)> {
        let i = self.index_of(addr.plugin()).ok_or_else(|| foreign_addr(addr))?;
        Ok(self.plugins[i].as_mut())
    }

    /// Our address on plugin `id`.
    pub fn self_addr(&self, id: PluginId) -> Result<Addr> {
        Ok(self.plugin(id)?.self_addr())
    }

    /// Looks up `uri` on the first plugin of its scheme. This may wait
    /// for a connection's set-up, boundedly (see [`Plugin::lookup`]);
    /// [`try_lookup`](Self::try_lookup) never does.
    pub fn lookup(&mut self, uri: &str) -> Result<Addr> {
        self.plugin_for(uri)?.lookup(uri)
    }

    /// [`lookup`](Self::lookup) without waiting: [`NaError::WouldBlock`]
    /// where `lookup` would wait, until the plugin's bound has passed
    /// since `since` (the first attempt); then `lookup`'s error for a
    /// wait that ran out. See [`Plugin::try_lookup`].
    pub fn try_lookup(&mut self, uri: &str, since: std::time::Instant) -> Result<Addr> {
        self.plugin_for(uri)?.try_lookup(uri, since)
    }

    /// The first plugin of `uri`'s scheme.
    fn plugin_for(&mut self, uri: &str) -> Result<&mut (dyn Plugin + 'static)> {
        let (scheme, _) = split_uri(uri)?;
        let available = self
            .plugins
            .iter()
            .map(|p| p.scheme())
            .collect::<Vec<_>>()
            .join(", ");
        let plugin = self
            .plugins
            .iter_mut()
            .find(|p| p.scheme() == scheme)
            .ok_or_else(|| NaError::NoPlugin {
                scheme: scheme.to_owned(),
                available,
            })?;
        Ok(plugin.as_mut())
    }

    /// Decodes an address that travelled as bytes ([`Addr::to_bytes`]).
    pub fn addr_from_bytes(&mut self, bytes: &[u8]) -> Result<Addr> {
        let uri = std::str::from_utf8(bytes).map_err(|_| NaError::Malformed {
            what: "address",
            reason: "not UTF-8".into(),
        })?;
        self.lookup(uri)
    }

    /// See [`Plugin::send_unexpected`].
    pub fn send_unexpected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()> {
        self.route(dest)?.send_unexpected(dest, tag, data, op)
    }

    /// See [`Plugin::send_expected`].
    pub fn send_expected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()> {
        self.route(dest)?.send_expected(dest, tag, data, op)
    }

    /// See [`Plugin::alloc_msg_buf`]: a buffer for messages to `dest`.
    pub fn alloc_msg_buf(&mut self, dest: &Addr, size: usize) -> Result<MsgBuf> {
        self.route(dest)?.alloc_msg_buf(size)
    }

    /// See [`Plugin::send_unexpected_buf`].
    pub fn send_unexpected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        self.route(dest)?.send_unexpected_buf(dest, tag, buf, op)
    }

    /// See [`Plugin::send_unexpected_parts`].
    pub fn send_unexpected_parts(
        &mut self,
        dest: &Addr,
        tag: Tag,
        parts: &[&[u8]],
        op: OpId,
        report: Report,
    ) -> Result<()> {
        self.route(dest)?
            .send_unexpected_parts(dest, tag, parts, op, report)
    }

    /// See [`Plugin::send_expected_buf`].
    pub fn send_expected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        self.route(dest)?.send_expected_buf(dest, tag, buf, op)
    }

    /// See [`Plugin::post_recv_unexpected`]; the plugin is named explicitly.
    pub fn post_recv_unexpected(&mut self, plugin: PluginId, buf: Vec<u8>, op: OpId) -> Result<()> {
        self.plugin_mut(plugin)?.post_recv_unexpected(buf, op)
    }

    /// See [`Plugin::post_recv_expected`].
    pub fn post_recv_expected(&mut self, source: &Addr, tag: Tag, buf: Vec<u8>, op: OpId) -> Result<()> {
        self.route(source)?.post_recv_expected(source, tag, buf, op)
    }

    /// Copies `len` bytes from `local` at `local_offset` into `remote` at
    /// `remote_offset` on peer `dest` (a batch of one, see [`Plugin::rma`]).
    #[allow(clippy::too_many_arguments)]
    pub fn put(
        &mut self,
        local: &MemHandle,
        local_offset: u64,
        remote: &RemoteMem,
        remote_offset: u64,
        len: u64,
        dest: &Addr,
        op: OpId,
    ) -> Result<()> {
        let r = Rma::put(local, local_offset, remote, remote_offset, len, op);
        self.route(dest)?.rma(dest, &[r])
    }

    /// Copies `len` bytes from `remote` at `remote_offset` on peer `dest`
    /// into `local` at `local_offset` (a batch of one, see [`Plugin::rma`]).
    #[allow(clippy::too_many_arguments)]
    pub fn get(
        &mut self,
        local: &MemHandle,
        local_offset: u64,
        remote: &RemoteMem,
        remote_offset: u64,
        len: u64,
        dest: &Addr,
        op: OpId,
    ) -> Result<()> {
        let r = Rma::get(local, local_offset, remote, remote_offset, len, op);
        self.route(dest)?.rma(dest, &[r])
    }

    /// See [`Plugin::rma`].
    pub fn rma(&mut self, dest: &Addr, ops: &[Rma<'_>]) -> Result<()> {
        self.route(dest)?.rma(dest, ops)
    }

    /// Switches plugin `plugin` to pull mode (see
    /// [`Plugin::pull_unexpected`]); `Ok(false)` if it has none. From then
    /// on [`progress`](Self::progress) and
    /// [`progress_now`](Self::progress_now) count a waiting unexpected
    /// message as work, and [`try_wait`](Self::try_wait) refuses to sleep
    /// while one waits: take them with
    /// [`take_unexpected`](Self::take_unexpected).
    pub fn pull_unexpected(&mut self, plugin: PluginId) -> Result<bool> {
        let i = self.index_of(plugin).ok_or_else(|| no_such(plugin))?;
        let on = self.plugins[i].pull_unexpected()?;
        if on && !self.pulling.contains(&i) {
            self.pulling.push(i);
        }
        Ok(on)
    }

    /// See [`Plugin::take_unexpected`].
    pub fn take_unexpected(&mut self, plugin: PluginId, buf: &mut Vec<u8>) -> Result<Option<(Addr, Tag)>> {
        self.plugin_mut(plugin)?.take_unexpected(buf)
    }

    /// Plugins in pull mode with an unexpected message waiting.
    fn pull_ready(&self) -> usize {
        self.pulling
            .iter()
            .filter(|&&i| self.plugins[i].unexpected_ready())
            .count()
    }

    /// Cancels `op` on plugin `plugin` (see [`Plugin::cancel`]: an op that
    /// already completed gives `UnknownOp`, and its completion stands).
    pub fn cancel(&mut self, plugin: PluginId, op: OpId) -> Result<()> {
        self.plugin_mut(plugin)?.cancel(op)
    }

    /// Polls every plugin once without blocking and moves their completions
    /// into the endpoint's queue. Returns how many completions are queued,
    /// plus the number of plugins in pull mode with an unexpected message
    /// waiting (see [`pull_unexpected`](Self::pull_unexpected)).
    #[inline(always)]
    pub fn progress_now(&mut self) -> Result<usize> {
        // The common case, one plugin that progressed, takes no error
        // bookkeeping (this runs once per message in busy mode).
        if let [only] = self.plugins.as_mut_slice() {
            let r = only.progress();
            only.take_completions(&mut self.completions);
            let ready = self.completions.len() + self.pull_ready();
            return match r {
                Err(e) => progress_failed(self.plugins[0].scheme(), e, ready),
                Ok(_) => Ok(ready),
            };
        }
        let mut first_err = None;
        for p in &mut self.plugins {
            if let Err(e) = p.progress() {
                tracing::warn!(plugin = p.scheme(), error = %ErrorChain(&e), "plugin progress failed");
                first_err.get_or_insert(e);
            }
            p.take_completions(&mut self.completions);
        }
        let ready = self.completions.len() + self.pull_ready();
        match first_err {
            Some(e) if ready == 0 => Err(e),
            _ => Ok(ready),
        }
    }

    /// True if every plugin agrees that the caller may sleep on the poll fd
    /// now (see [`Plugin::try_wait`]). Call it right before sleeping. A
    /// plugin's failure to arm is returned (the first one; the caller must
    /// not sleep then). Until the sleeper wakes, other threads may post
    /// and cancel operations but not progress the endpoint (see
    /// [`Plugin::try_wait`]).
    ///
    /// A wake-up posted through the endpoint's [`Waker`] since the last
    /// call is taken here: false (once), so the caller looks at what the
    /// waking thread changed before it sleeps; one posted after this call
    /// makes the fd readable, and the sleep ends at once.
    pub fn try_wait(&mut self) -> Result<bool> {
        Ok(self.may_sleep()? == MaySleep::Yes)
    }

    /// [`try_wait`](Self::try_wait), telling a wake-up from other work.
    fn may_sleep(&mut self) -> Result<MaySleep> {
        if !self.completions.is_empty() || self.pull_ready() > 0 {
            return Ok(MaySleep::Work);
        }
        // Before the plugins arm: a wake-up after this take writes the
        // eventfd, which ends the sleep that follows.
        if self.waker.is_some() && self.take_wake()? {
            return Ok(MaySleep::Woken);
        }
        // Every plugin must be asked (each arms its wake-up), and each must
        // be able to sleep.
        let mut ok = true;
        for p in &mut self.plugins {
            ok &= p.poll_fd().is_some() && p.try_wait()?;
        }
        Ok(if ok { MaySleep::Yes } else { MaySleep::Work })
    }

    /// Waits, as the mode says, until at least one completion is queued (or
    /// an unexpected message waits to be pulled), `timeout` passes
    /// (`None`: no limit), or the endpoint's [`Waker`] wakes it (one
    /// posted before the call included). Returns the number queued (see
    /// [`progress_now`](Self::progress_now)): 0 after a timeout or a
    /// wake-up with nothing ready.
    ///
    /// The spin phase reads the clock only every [`CLOCK_EVERY`] polls (and
    /// first after that many), so a busy or adaptive loop spends its time
    /// polling the transports, not timing itself; the timeout and the spin
    /// window count from that first read. Adaptive mode spins only if the
    /// previous call that waited (or found work) found work: an idle
    /// endpoint goes straight to sleep. A zero-timeout call that finds
    /// nothing leaves that as it is, so a poll between a send and the wait
    /// for its answer does not turn the wait into a sleep; an idle caller
    /// that only ever polls with a zero timeout and then waits spins one
    /// window first.
    pub fn progress(&mut self, timeout: Option<Duration>) -> Result<usize> {
        let n = self.progress_now()?;
        if n > 0 {
            self.recently_active = true;
            return Ok(n);
        }
        if timeout == Some(Duration::ZERO) {
            return Ok(0);
        }
        // The clock is first read after CLOCK_EVERY empty polls (busy and
        // adaptive) or right before sleeping: a reply that comes within the
        // first polls, the common case under load, costs no clock read. The
        // timeout and the spin window start then, up to CLOCK_EVERY polls
        // (about a microsecond) late.
        let spin = match self.mode {
            ProgressMode::Busy => Some(None),
            ProgressMode::Adaptive { spin } if self.recently_active => Some(Some(spin)),
            _ => None,
        };
        self.recently_active = false;
        let mut deadline = None;
        if let Some(spin) = spin {
            let mut polls = 0u32;
            let mut spin_until = None;
            let mut started = false;
            loop {
                // A lone plugin watches for new work itself, far more cheaply
                // than a progress call per turn (Plugin::spin_wait); a turn
                // that finds work starts sooner after the work arrives.
                if let [only] = self.plugins.as_mut_slice() {
                    let left = CLOCK_EVERY - polls % CLOCK_EVERY;
                    let checks = only.spin_wait(left);
                    // An unexpected message waiting to be taken (pull
                    // mode) is the work, and no progress call is due
                    // before its take (see Plugin::spin_wait).
                    if checks < left && !self.pulling.is_empty() && only.unexpected_ready() {
                        self.recently_active = true;
                        return Ok(self.completions.len() + 1);
                    }
                    polls = polls.wrapping_add(checks.min(left - 1));
                }
                let n = self.progress_now()?;
                if n > 0 {
                    self.recently_active = true;
                    return Ok(n);
                }
                polls = polls.wrapping_add(1);
                if polls.is_multiple_of(CLOCK_EVERY) {
                    let now = Instant::now();
                    if !started {
                        started = true;
                        deadline = timeout.map(deadline_after);
                        spin_until = spin.map(deadline_after);
                    }
                    if deadline.is_some_and(|d| now >= d) {
                        return Ok(0);
                    }
                    // A wake-up from another thread ends the spin too (a
                    // flag read, with the clock's: none on the busy path).
                    if self.waker.as_ref().is_some_and(Waker::posted) {
                        self.take_wake()?;
                        return Ok(self.completions.len());
                    }
                    if spin_until.is_some_and(|d| now >= d) {
                        break;
                    }
                }
                std::hint::spin_loop();
            }
        } else {
            deadline = timeout.map(deadline_after);
        }
        loop {
            let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // A lone plugin sleeps on its own primitive (Plugin::sleep),
            // unless a waker's eventfd must be able to end the sleep.
            let slept = match self.plugins.as_mut_slice() {
                [only] if self.completions.is_empty() && self.waker.is_none() => only.sleep(left())?,
                _ => false,
            };
            let mut woken = false;
            if !slept {
                match self.may_sleep()? {
                    MaySleep::Yes => {
                        self.tokens.clear();
                        self.poll
                            .wait(&mut self.tokens, left())
                            .map_err(|e| NaError::sys("epoll_wait", e))?;
                        if self.tokens.contains(&WAKER_TOKEN) {
                            // Taken now, so the next sleep sleeps.
                            self.take_wake()?;
                            woken = true;
                        }
                    }
                    MaySleep::Woken => woken = true,
                    MaySleep::Work => {}
                }
            }
            let n = self.progress_now()?;
            if n > 0 {
                self.recently_active = true;
                return Ok(n);
            }
            if woken {
                return Ok(0);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(0);
            }
        }
    }

    /// Takes the oldest completion.
    pub fn pop_completion(&mut self) -> Option<Completion> {
        self.completions.pop_front()
    }

    /// Number of completions waiting to be popped.
    pub fn pending_completions(&self) -> usize {
        self.completions.len()
    }
}

impl AsFd for Endpoint {
    /// The endpoint's epoll fd: readable when any plugin has work, or a
    /// [`Waker`] of the endpoint woke it. Call [`Endpoint::try_wait`]
    /// before sleeping on it.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.poll.as_fd()
    }
}

impl AsRawFd for Endpoint {
    fn as_raw_fd(&self) -> RawFd {
        self.poll.as_raw_fd()
    }
}

/// A lone plugin's failed progress: logged, and returned only if no work
/// is ready (as with several plugins).
#[cold]
#[inline(never)]
fn progress_failed(scheme: &str, e: NaError, ready: usize) -> Result<usize> {
    tracing::warn!(plugin = scheme, error = %ErrorChain(&e), "plugin progress failed");
    if ready == 0 {
        Err(e)
    } else {
        Ok(ready)
    }
}

#[cold]
fn no_such(id: PluginId) -> NaError {
    NaError::Plugin {
        plugin: "endpoint",
        message: format!(
            "no plugin with id {} in this endpoint (one of another endpoint?)",
            id.0
        ),
    }
}

#[cold]
fn foreign_addr(addr: &Addr) -> NaError {
    NaError::InvalidAddress {
        uri: addr.uri().into(),
        reason: format!(
            "it belongs to plugin {}, which is not in this endpoint (an address of another endpoint?)",
            addr.plugin().0
        ),
    }
}

/// Most plugins in one endpoint (the low 8 bits of a plugin id).
const MAX_PLUGINS: usize = 256;

/// The next endpoint tag: unique in the process, so that plugin ids are
/// (see `Endpoint::add_plugin`); 2^24 endpoints per process.
fn next_endpoint_tag() -> Result<u32> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
        (n < (1 << 24) - 1).then_some(n + 1)
    })
    .map_err(|_| NaError::Plugin {
        plugin: "endpoint",
        message: "this process has made 2^24 endpoints: their plugin ids would repeat".into(),
    })
}
