//! The [`Plugin`] trait of [`SmPlugin`], and the send entry points its
//! send calls share.

use std::collections::hash_map::Entry;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use na_core::hint::cold_path;
use na_core::msgbuf::check_buf_size;
use na_core::{
    Addr, Completion, MsgBuf, NaError, OpId, PeerProcess, Plugin, PluginId, PluginStats, Report, Result, Rma,
    Tag,
};

use crate::channel::{MsgKind, BUF_SIZE};
use crate::connect::ConnectWait;
use crate::matching::OpPlace;
use crate::send_ops::{dup, op_in_flight, Outgoing};

use super::SmPlugin;

impl SmPlugin {
    /// Sends a message buffer's bytes (copied into the ring or backlog)
    /// and keeps the buffer for the next `alloc_msg_buf`.
    fn send_from_buf(&mut self, dest: &Addr, kind: MsgKind, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        let r = self.send(dest, kind, tag, &[buf.as_slice()], op, Report::All);
        self.msg_bufs.recycle(buf);
        r
    }

    /// Sends the concatenation of `parts`, written straight into the ring
    /// slot (or reserved buffer): no message buffer, no joining copy.
    #[inline(always)]
    fn send(
        &mut self,
        dest: &Addr,
        kind: MsgKind,
        tag: Tag,
        parts: &[&[u8]],
        op: OpId,
        report: Report,
    ) -> Result<()> {
        // Two parts (an RPC's header and payload) and one (an NA message)
        // are the usual cases: a plain add, not the vectorized sum's set-up.
        // (Two slices, each at most isize::MAX bytes, cannot overflow a
        // usize; more can, and are summed checked.)
        let len = match parts {
            [a, b] => a.len() + b.len(),
            [a] => a.len(),
            _ => sum_lens(parts)?,
        };
        if len > BUF_SIZE {
            cold_path();
            return Err(kind.too_large(len));
        }
        self.check_dest(dest)?;
        self.ensure_connected(dest)?;
        match self.send_on(
            dest.token(),
            Outgoing {
                kind,
                tag,
                parts,
                len,
            },
            op,
            report,
        ) {
            Some(sent) => sent,
            None => {
                cold_path();
                Err(self.gone(dest, "not connected (it disconnected earlier)"))
            }
        }
    }
}

/// The total length of `parts`, checked (out of line: a send of more than
/// two parts is neither the RPC layer's nor na-perf's).
#[inline(never)]
fn sum_lens(parts: &[&[u8]]) -> Result<usize> {
    na_core::msgbuf::parts_len(parts)
}

/// `take_completions`' move, out of line so that the empty check stays a
/// few instructions on every turn of a busy loop.
#[inline(never)]
fn move_all(from: &mut VecDeque<Completion>, to: &mut VecDeque<Completion>) {
    to.append(from);
}

impl Plugin for SmPlugin {
    fn scheme(&self) -> &'static str {
        "sm"
    }

    fn id(&self) -> PluginId {
        self.id
    }

    fn self_addr(&self) -> Addr {
        self.peers
            .get(self.self_tok)
            .map(|p| p.addr.clone())
            .unwrap_or_else(|| Addr::new(self.name.uri(), self.id, self.self_tok, true))
    }

    fn lookup(&mut self, uri: &str) -> Result<Addr> {
        self.check_not_inherited()?;
        Ok(self.lookup_uri(uri, ConnectWait::Bounded)?)
    }

    fn try_lookup(&mut self, uri: &str, since: std::time::Instant) -> Result<Addr> {
        self.check_not_inherited()?;
        Ok(self.lookup_uri(uri, ConnectWait::Never { since })?)
    }

    fn max_unexpected_size(&self) -> usize {
        BUF_SIZE
    }

    fn max_expected_size(&self) -> usize {
        BUF_SIZE
    }

    fn max_tag(&self) -> Tag {
        Tag::MAX
    }

    /// The kernel's pid of the peer (`SO_PEERCRED`, which the name in its
    /// hello had to match) and the start time we read for that pid as the
    /// connection was made (see `identity`); so every connection of one
    /// process, under any of its instance names, has one answer, and a
    /// later process with a reused pid another. `None` for an address of
    /// another plugin or of a departed peer, and for a peer whose start
    /// time we could not read (our failure, not its) until a later
    /// connection under its name reads it (`PeerTable::may_join`): the
    /// answer for one address may go from `None` to `Some` (never back,
    /// nor to another `Some`), so a caller that keys state by it keeps
    /// the key it used (as hg-rpc's per-origin bounds do).
    fn peer_process(&self, dest: &Addr) -> Option<PeerProcess> {
        if dest.plugin() != self.id {
            return None;
        }
        let p = self.peers.get(dest.token())?;
        Some(PeerProcess {
            pid: p.pid,
            started: p.start?,
        })
    }

    fn send_unexpected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()> {
        self.send(dest, MsgKind::Unexpected, tag, &[data], op, Report::All)
    }

    fn send_unexpected_parts(
        &mut self,
        dest: &Addr,
        tag: Tag,
        parts: &[&[u8]],
        op: OpId,
        report: Report,
    ) -> Result<()> {
        self.send(dest, MsgKind::Unexpected, tag, parts, op, report)
    }

    fn send_expected(&mut self, dest: &Addr, tag: Tag, data: &[u8], op: OpId) -> Result<()> {
        self.send(dest, MsgKind::Expected, tag, &[data], op, Report::All)
    }

    /// Heap buffers from a free list: the ring lives in memory the peer
    /// can write, so a message is built privately and copied in either way.
    fn alloc_msg_buf(&mut self, size: usize) -> Result<MsgBuf> {
        check_buf_size(size, BUF_SIZE)?;
        Ok(self.msg_bufs.alloc(BUF_SIZE))
    }

    fn send_unexpected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        self.send_from_buf(dest, MsgKind::Unexpected, tag, buf, op)
    }

    fn send_expected_buf(&mut self, dest: &Addr, tag: Tag, buf: MsgBuf, op: OpId) -> Result<()> {
        self.send_from_buf(dest, MsgKind::Expected, tag, buf, op)
    }

    fn post_recv_unexpected(&mut self, buf: Vec<u8>, op: OpId) -> Result<()> {
        self.check_not_inherited()?;
        if self.pull {
            return Err(NaError::Unsupported {
                plugin: "sm",
                op: "posting unexpected receives in pull mode",
            });
        }
        // Posted unexpected receives are kept out of `ops` (the matcher
        // tracks their ids): one lookup here instead of an insert here and
        // a removal on delivery.
        if op_in_flight(&self.ops, &self.matcher, op) {
            return Err(dup(op));
        }
        self.matcher.post_unexpected(op, buf, &mut self.completions);
        self.resume_if_queued_taken();
        self.wake_owner_if_work();
        self.wake_owner_if_held();
        Ok(())
    }

    fn post_recv_expected(&mut self, source: &Addr, tag: Tag, buf: Vec<u8>, op: OpId) -> Result<()> {
        self.check_dest(source)?;
        let tok = source.token();
        if self.peers.get(tok).is_none() && !self.matcher.has_arrived_expected(tok, tag) {
            return Err(self.gone(source, "not connected (it disconnected earlier)"));
        }
        // The entry refuses an id in `ops`; the matcher one of a posted
        // unexpected receive (what `op_in_flight` checks, in one lookup).
        let Entry::Vacant(slot) = self.ops.entry(op) else {
            return Err(dup(op));
        };
        if self.matcher.has_posted_unexpected(op) {
            return Err(dup(op));
        }
        if self
            .matcher
            .post_expected(source, tag, op, buf, &mut self.completions)
        {
            slot.insert(OpPlace::RecvExpected(tok, tag));
        }
        self.resume_if_queued_taken();
        self.wake_owner_if_work();
        self.wake_owner_if_held();
        Ok(())
    }

    fn rma(&mut self, dest: &Addr, ops: &[Rma<'_>]) -> Result<()> {
        self.check_dest(dest)?;
        let r = self.rma_batch(dest, ops);
        // Its completions are queued already (see `wake_owner_if_work`).
        self.wake_owner_if_work();
        r
    }

    /// Records the handle's segments as exposed (see `exposed`): a
    /// transfer to this process's own address may touch only those. Peers
    /// need no registration (`process_vm_readv/writev` reach any address).
    fn mem_register(&mut self, mem: &na_core::MemHandle) -> Result<()> {
        crate::exposed::register(self.id, mem)
    }

    /// Addresses and lengths, keyed with the registration's token (see
    /// `exposed`): the key is what a transfer to this process's own
    /// address must show; other processes ignore it.
    fn mem_describe(&self, mem: &na_core::MemHandle) -> Result<na_core::RemoteMem> {
        crate::exposed::describe(self.id, mem)
    }

    fn spin_wait(&mut self, max: u32) -> u32 {
        if self.check_not_inherited().is_err() {
            return 0;
        }
        self.spin_for_work(max)
    }

    fn pull_unexpected(&mut self) -> Result<bool> {
        if self.matcher.posted_unexpected() > 0 || self.matcher.has_arrived_unexpected() {
            return Err(NaError::Plugin {
                plugin: "sm",
                message: "pull mode must be chosen before unexpected receives are posted or messages arrive"
                    .into(),
            });
        }
        self.pull = true;
        Ok(true)
    }

    fn take_unexpected(&mut self, buf: &mut Vec<u8>) -> Result<Option<(Addr, Tag)>> {
        self.check_not_inherited()?;
        Ok(self.take_pulled(buf))
    }

    fn unexpected_ready(&self) -> bool {
        self.pull_ready()
    }

    fn cancel(&mut self, op: OpId) -> Result<()> {
        let r = self.cancel_op(op);
        self.wake_owner_if_work();
        r
    }

    fn poll_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.poll.as_fd())
    }

    fn try_wait(&mut self) -> Result<bool> {
        // Harvest fd events first (connections, hang-ups, handshake bytes):
        // a caller that waits on our fd edge-triggered (tokio's AsyncFd)
        // would not be told about them again. One epoll_wait(0) per sleep.
        self.check_not_inherited()?;
        self.poll_events()?;
        // A hello that harvest handled added a wake-up eventfd after its
        // wait: its report would make our descriptor readable at once.
        self.harvest_primed()?;
        Ok(self.arm())
    }

    /// Arms without the harvest `try_wait` makes (the wait below returns
    /// pending events at once) and waits on the internal epoll set itself.
    fn sleep(&mut self, timeout: Option<Duration>) -> Result<bool> {
        self.check_not_inherited()?;
        // A wake-up eventfd added since the last wait would end the wait
        // below at once, for nothing (see `connect::poll_add_wake`): take
        // its report (and whatever else is there) now, as `try_wait` does
        // before every sleep.
        self.harvest_primed()?;
        if self.arm() {
            self.wait_events(timeout)?;
        }
        Ok(true)
    }

    fn progress(&mut self) -> Result<usize> {
        self.check_not_inherited()?;
        self.make_progress()
    }

    fn pop_completion(&mut self) -> Option<Completion> {
        self.completions.pop_front()
    }

    fn take_completions(&mut self, out: &mut VecDeque<Completion>) {
        // Called on every turn of a busy loop: skip append's reserve and
        // copy calls when there is nothing to move.
        if !self.completions.is_empty() {
            move_all(&mut self.completions, out);
        }
    }

    fn stats(&self) -> PluginStats {
        let peers = self
            .peers
            .iter()
            .filter(|p| p.addr.token() != self.self_tok)
            .count() as u64;
        // `PluginStats` is non-exhaustive: no struct expression out of na-core.
        let mut stats = self.stats;
        stats.in_flight = (self.ops.len() + self.matcher.posted_unexpected()) as u64;
        stats.queued_arrivals = self.held_total() as u64;
        stats.peers = peers;
        stats.peer_entries = peers;
        stats.backlog_bytes = self.backlog_total.bytes() as u64;
        if let Some(pool) = &self.rma_pool {
            (stats.rma_jobs_waiting, stats.rma_jobs_running) = pool.counts();
        }
        stats
    }
}
