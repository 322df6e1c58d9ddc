//! # hg-bulk: bulk handles and one-sided transfers
//!
//! A [`Bulk`] names memory for one-sided transfers. Created locally with
//! [`Bulk::expose`] it owns its segments (scatter/gather) and keeps them
//! exposed exactly as long as it lives; serialized inside RPC arguments
//! (`#[derive(Serialize)]` on a struct holding one) it travels as a
//! [`BulkDesc`]: the owner's address, the plugin's memory descriptor and,
//! for small read-only handles, the data itself, so a pull needs no RMA.
//! Deserialized on the peer it is a remote handle, the target of
//! [`start`]: `Push` (local to remote) or `Pull` (remote to local) over any
//! NA plugin, with no plugin-specific code in the caller. [`start_batch`]
//! starts many spans of the same two handles at once, which a plugin may
//! merge (na-sm moves them with one system call).
//!
//! The owner reads and writes a local handle's memory by copy
//! ([`Bulk::read_at`], [`Bulk::write_at`], [`Bulk::to_vec`]: a peer may
//! write it at any time) and takes its buffers back with
//! [`Bulk::try_into_buffers`], which says why it cannot
//! ([`BulkError::InUse`] while another clone or a transfer holds the
//! memory, [`BulkError::NotLocal`] for a remote handle).
//! `From<BulkError> for String` lets an hg-rpc handler, whose error is a
//! `String`, use `?` on these.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod lent;
pub use lent::collect_lent;

use na_core::rma::check_distinct_ids;
use na_core::{
    scheme_of, Access, Addr, Endpoint, MemHandle, NaError, OpId, PluginId, RemoteMem, Rma,
    MAX_REMOTE_SEGMENTS,
};
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

/// Read-only handles up to this size carry their data inline.
pub const INLINE_MAX: usize = 1024;

/// Errors of bulk handles and transfers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BulkError {
    /// The NA layer refused or failed (the [`NaError`] is the
    /// `source()`, not part of the message: print the chain,
    /// [`na_core::ErrorChain`]).
    #[error("bulk transfer failed")]
    Na(#[from] NaError),
    /// A remote handle was given where a local one is needed.
    #[error("the local side of a transfer must be a handle created here")]
    NotLocal,
    /// A received descriptor is inconsistent.
    #[error("malformed bulk descriptor: {0}")]
    Malformed(String),
    /// [`Bulk::expose`] was given more buffers than a descriptor can
    /// name (peers refuse more than [`MAX_REMOTE_SEGMENTS`]).
    #[error("cannot expose {count} buffers as one bulk handle: at most {max} segments")]
    TooManySegments {
        /// The buffers given.
        count: usize,
        /// [`MAX_REMOTE_SEGMENTS`].
        max: usize,
    },
    /// [`Bulk::try_into_buffers`] was called while the memory is still in
    /// use: another clone of the handle lives (one inside an RPC input
    /// the caller still holds, one an origin's engine keeps for a call
    /// until its target answers, see [`collect_lent`]) or a transfer in
    /// flight holds it. The handle comes back unchanged: drop the other
    /// holders (or wait for the call or transfer to end) and try again.
    #[error(
        "the bulk handle's memory is still in use ({holders} other holders: clones of the handle, \
         such as one in an RPC input still held or kept for a call in flight, or transfers in flight)"
    )]
    InUse {
        /// The handle, unchanged.
        handle: Box<Bulk>,
        /// Other holders of its memory: clones of the handle and
        /// transfers in flight (each holds a clone).
        holders: usize,
    },
}

/// Lets a handler of `hg-rpc` (whose error is a `String`) use `?` on a
/// [`Bulk`] call ([`Bulk::read_at`], [`Bulk::try_into_buffers`], ...):
/// the message is what its caller receives, so it is the whole chain
/// ([`na_core::ErrorChain`]: the error and each cause).
impl From<BulkError> for String {
    fn from(e: BulkError) -> String {
        na_core::ErrorChain(&e).to_string()
    }
}

/// The serialized form of a [`Bulk`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkDesc {
    /// The owner's address (URI).
    pub owner: String,
    /// The owner plugin's memory descriptor ([`RemoteMem`] bytes).
    pub mem: ByteBuf,
    /// The contents, for small read-only handles.
    pub inline: Option<ByteBuf>,
}

/// A bulk handle: local (owns exposed memory) or remote (a peer's).
#[derive(Clone, Debug)]
pub struct Bulk {
    local: Option<MemHandle>,
    /// The plugin a local handle was exposed through: transfers with it
    /// go through that plugin (and can be cancelled there).
    plugin: Option<PluginId>,
    desc: BulkDesc,
    remote: RemoteMem,
    /// Where a remote handle's owner is reached without a lookup, if that
    /// is its address (see [`Bulk::reached_through`]). Never serialized.
    reach_via: Option<Addr>,
}

impl Bulk {
    /// Exposes `buffers` (in order, as one handle) through `plugin` of
    /// `ep`: registers them and builds the descriptor peers will use.
    pub fn expose(
        ep: &mut Endpoint,
        plugin: PluginId,
        buffers: Vec<Vec<u8>>,
        access: Access,
    ) -> Result<Bulk, BulkError> {
        if buffers.len() > MAX_REMOTE_SEGMENTS {
            return Err(BulkError::TooManySegments {
                count: buffers.len(),
                max: MAX_REMOTE_SEGMENTS,
            });
        }
        let mem = MemHandle::new(buffers, access);
        let p = ep.plugin_mut(plugin)?;
        p.mem_register(&mem)?;
        let remote = p.mem_describe(&mem)?;
        // Inline data is read when the handle is serialized (see
        // `desc`), so it is what the memory holds then.
        let desc = BulkDesc {
            owner: p.self_addr().uri().to_owned(),
            mem: ByteBuf::from(remote.to_bytes()),
            inline: None,
        };
        Ok(Bulk {
            local: Some(mem),
            plugin: Some(plugin),
            desc,
            remote,
            reach_via: None,
        })
    }

    /// A remote handle from a received descriptor; checks it.
    pub fn from_desc(desc: BulkDesc) -> Result<Bulk, BulkError> {
        let remote = RemoteMem::from_bytes(&desc.mem)
            .map_err(|e| BulkError::Malformed(na_core::ErrorChain(&e).to_string()))?;
        if let Some(data) = &desc.inline {
            if data.len() as u64 != remote.size() || remote.access() != Access::ReadOnly {
                return Err(BulkError::Malformed(format!(
                    "{} inline bytes for a {:?} handle of {} bytes",
                    data.len(),
                    remote.access(),
                    remote.size()
                )));
            }
        }
        Ok(Bulk {
            local: None,
            plugin: None,
            desc,
            remote,
            reach_via: None,
        })
    }

    /// This remote handle, to be reached through `source` (the address a
    /// request or response from its owner came from) instead of a lookup
    /// of the owner the descriptor names: the transfers of [`start`] and
    /// [`start_batch`] (and everything built on them) then go over the
    /// connection that message came on. That is how code outside a
    /// handler (a deferred request answered later, a worker thread)
    /// moves data with a peer that does not listen (a client-only verbs
    /// plugin cannot be connected to), and without a second connection to
    /// one that does. Handlers' contexts do this on their own.
    ///
    /// Used only while the descriptor's owner is exactly `source`'s URI,
    /// as [`start_batch_via`] says: a descriptor that names anyone else is
    /// looked up as usual, so a peer cannot borrow another's connection.
    /// Kept by clones; not serialized (it means nothing to another process).
    pub fn reached_through(mut self, source: &Addr) -> Bulk {
        self.reach_via = Some(source.clone());
        self
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.remote.size()
    }

    /// Access mode.
    pub fn access(&self) -> Access {
        self.remote.access()
    }

    /// The owner's address.
    pub fn owner(&self) -> &str {
        &self.desc.owner
    }

    /// The local memory, for handles created here.
    pub fn local(&self) -> Option<&MemHandle> {
        self.local.as_ref()
    }

    /// The local memory, or [`BulkError::NotLocal`] for a remote handle.
    fn local_mem(&self) -> Result<&MemHandle, BulkError> {
        self.local.as_ref().ok_or(BulkError::NotLocal)
    }

    /// Copies `dst.len()` bytes at `offset` of a handle created here into
    /// `dst` (what a peer pushed into it, say). A remote handle is
    /// [`BulkError::NotLocal`]; a range past the end,
    /// [`NaError::OutOfBounds`] (as [`BulkError::Na`]). Copies, because a
    /// peer may write the memory at any time.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), BulkError> {
        Ok(self.local_mem()?.read_at(offset, dst)?)
    }

    /// Copies `src` into a handle created here at `offset`, whatever its
    /// access mode (which says what peers may do). Errors as
    /// [`read_at`](Self::read_at)'s.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), BulkError> {
        Ok(self.local_mem()?.write_at(offset, src)?)
    }

    /// The whole contents of a handle created here, as one vector (a
    /// remote handle is [`BulkError::NotLocal`]).
    pub fn to_vec(&self) -> Result<Vec<u8>, BulkError> {
        Ok(self.local_mem()?.to_vec())
    }

    /// [`into_buffers`](Self::into_buffers) with an error that says why:
    /// [`BulkError::NotLocal`] for a remote handle (it has no buffers), or
    /// [`BulkError::InUse`], which gives the handle back and counts what
    /// still holds its memory.
    pub fn try_into_buffers(self) -> Result<Vec<Vec<u8>>, BulkError> {
        if self.local.is_none() {
            return Err(BulkError::NotLocal);
        }
        self.into_buffers().map_err(|handle| {
            // Itself aside; 0 when only a registration held elsewhere
            // keeps the memory (see `MemHandle::into_buffers`).
            let holders = handle.local.as_ref().map_or(0, MemHandle::holders);
            BulkError::InUse { handle, holders }
        })
    }

    /// The descriptor peers receive. For a small read-only handle created
    /// here it carries the memory's contents as they are now (as when the
    /// handle is serialized: changes made after exposing travel too).
    pub fn desc(&self) -> std::borrow::Cow<'_, BulkDesc> {
        match &self.local {
            Some(mem) if mem.access() == Access::ReadOnly && mem.size() as usize <= INLINE_MAX => {
                std::borrow::Cow::Owned(BulkDesc {
                    inline: Some(ByteBuf::from(mem.to_vec())),
                    ..self.desc.clone()
                })
            }
            _ => std::borrow::Cow::Borrowed(&self.desc),
        }
    }

    /// Gives the buffers back if this is the last clone of a local handle
    /// and no transfer holds the memory; a remote handle, or one still in
    /// use, is returned unchanged. Every clone counts: one inside an RPC
    /// input the caller still holds (drop it first), or one an origin's
    /// engine keeps for a call until its target answers (see
    /// [`collect_lent`]).
    pub fn into_buffers(self) -> Result<Vec<Vec<u8>>, Box<Bulk>> {
        let Bulk {
            local,
            plugin,
            desc,
            remote,
            reach_via,
        } = self;
        let back = |local| {
            Box::new(Bulk {
                local,
                plugin,
                desc,
                remote,
                reach_via,
            })
        };
        match local.map(MemHandle::into_buffers) {
            Some(Ok(bufs)) => Ok(bufs),
            Some(Err(mem)) => Err(back(Some(mem))),
            None => Err(back(None)),
        }
    }
}

impl Serialize for Bulk {
    /// Serializes the descriptor; a local handle serialized inside
    /// [`collect_lent`] is recorded as lent, unless its data travels
    /// inline (small and read-only: a target has no use for the memory).
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let desc = self.desc();
        if let (Some(mem), None) = (&self.local, &desc.inline) {
            lent::record(mem);
        }
        desc.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Bulk {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let desc = BulkDesc::deserialize(d)?;
        Bulk::from_desc(desc).map_err(serde::de::Error::custom)
    }
}

/// Direction of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BulkOp {
    /// Local memory to the remote handle (NA put).
    Push,
    /// The remote handle to local memory (NA get).
    Pull,
}

/// What [`start`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Started {
    /// Finished already (a pull served from inline data): no completion follows.
    Done,
    /// Posted through this plugin of the endpoint: a completion follows
    /// for each op id, and a cancel must go to this plugin (the one the
    /// local handle was exposed on when it speaks the owner's scheme).
    Posted(PluginId),
}

/// One piece of a batched transfer: `len` bytes at `remote_offset` of the
/// remote handle and `local_offset` of the local one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Offset into the remote handle.
    pub remote_offset: u64,
    /// Offset into the local handle.
    pub local_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

/// Starts a transfer of `len` bytes between `remote` at `remote_offset`
/// and the local handle `local` at `local_offset`. Bounds and access are
/// checked on both sides before anything moves.
#[allow(clippy::too_many_arguments)]
pub fn start(
    ep: &mut Endpoint,
    op: BulkOp,
    remote: &Bulk,
    remote_offset: u64,
    local: &Bulk,
    local_offset: u64,
    len: u64,
    id: OpId,
) -> Result<Started, BulkError> {
    let span = Span {
        remote_offset,
        local_offset,
        len,
    };
    start_batch(ep, op, remote, local, &[(span, id)])
}

/// Checks that `local` is a handle of this process and that every span is
/// within both handles; returns the local memory.
pub fn check_spans<'a, 's>(
    remote: &Bulk,
    local: &'a Bulk,
    spans: impl IntoIterator<Item = &'s Span>,
) -> Result<&'a MemHandle, BulkError> {
    let mem = local.local.as_ref().ok_or(BulkError::NotLocal)?;
    for s in spans {
        mem.check_range(s.local_offset, s.len)?;
        remote.remote.check_range(s.remote_offset, s.len)?;
    }
    Ok(mem)
}

/// Starts one transfer per span between `remote` and `local`, all in the
/// same direction, each completing under its own id. Every span is checked
/// (bounds and access, both sides) before anything moves; the plugin gets
/// them as one batch, which it may move with fewer system calls or work
/// request posts than one transfer at a time. Either every span is
/// [`Started::Done`] (served from inline data or from this process's own
/// memory) or every span is [`Started::Posted`] through the same plugin.
/// A batch that names one [`OpId`] twice is refused whole, whichever way
/// it would go ([`NaError::OpInFlight`], as a plugin refuses it).
///
/// Looking up the owner a remote handle names may connect to it, and that
/// may wait, boundedly (see [`Endpoint::lookup`]): a caller that must not
/// block uses [`try_start_batch`].
pub fn start_batch(
    ep: &mut Endpoint,
    op: BulkOp,
    remote: &Bulk,
    local: &Bulk,
    spans: &[(Span, OpId)],
) -> Result<Started, BulkError> {
    start_batch_via(ep, op, remote, local, spans, None, None)
}

/// [`start_batch`] whose lookup of the owner never waits (see
/// [`Endpoint::try_lookup`]): where `start_batch` would wait to connect to
/// the owner, this fails at once with [`NaError::WouldBlock`] and starts
/// nothing; try again later with the same `since` (the first attempt's
/// time). Once the plugin's bound has passed since `since`, the failure is
/// the blocking lookup's own (a timeout naming the owner).
pub fn try_start_batch(
    ep: &mut Endpoint,
    op: BulkOp,
    remote: &Bulk,
    local: &Bulk,
    spans: &[(Span, OpId)],
    since: std::time::Instant,
) -> Result<Started, BulkError> {
    start_batch_via(ep, op, remote, local, spans, None, Some(since))
}

/// [`start_batch`] (`since` none: a lookup that may wait) or
/// [`try_start_batch`] (`since` the first attempt's time), with the
/// address `via` of the peer on whose behalf the transfer is made, if any:
/// where a received request (or response) came from.
///
/// When `remote`'s owner is exactly `via`'s URI (the canonical one the
/// transport gave the source address) and `via` belongs to the plugin the
/// transfer goes through, the transfer goes to `via` as it is, with no
/// lookup: over the connection the request came on. That is how a server
/// moves data with a client that does not listen (a client-only verbs
/// plugin cannot be connected to), and without a second connection to
/// one that does (na-verbs files an incoming connection under a peer of
/// its own, which no lookup finds: see its `connect` module). Otherwise
/// the owner is looked up as [`start_batch`] does.
///
/// A peer that names, in its descriptor, an address that is not its own
/// never gets anyone else's connection: the owner then differs from `via`
/// and is looked up (a real connection to the listener at that address),
/// and a peer that names its own address gets its own connection.
#[allow(clippy::too_many_arguments)]
pub fn start_batch_via(
    ep: &mut Endpoint,
    op: BulkOp,
    remote: &Bulk,
    local: &Bulk,
    spans: &[(Span, OpId)],
    via: Option<&Addr>,
    since: Option<std::time::Instant>,
) -> Result<Started, BulkError> {
    let mem = check_spans(remote, local, spans.iter().map(|(s, _)| s))?;
    // Every path below (a copy in memory, inline data, an RMA batch) takes
    // the same batches: two spans under one id are refused here, for all of
    // them, with the error a plugin gives (`NaError::OpInFlight`).
    check_distinct_ids(spans.iter().map(|&(_, id)| id))?;
    if spans.is_empty() {
        // Nothing to move, and nothing to check: not a reason to look up
        // (connect to) the owner a descriptor names.
        return Ok(Started::Done);
    }
    if let Some(theirs) = &remote.local {
        // The "remote" handle was exposed by this process: copy in memory
        // (its current contents), which works on every transport (a
        // client-only verbs plugin cannot connect to itself).
        for (s, _) in spans {
            copy_local(op, theirs, s.remote_offset, mem, s.local_offset, s.len)?;
        }
        return Ok(Started::Done);
    }
    if op == BulkOp::Pull {
        if let Some(data) = &remote.desc.inline {
            if !mem.access().can_write() {
                return Err(NaError::AccessDenied {
                    what: "local",
                    has: mem.access(),
                    needs: "write",
                }
                .into());
            }
            for (s, _) in spans {
                let (a, b) = (s.remote_offset as usize, (s.remote_offset + s.len) as usize);
                mem.write_at(s.local_offset, &data[a..b])?;
            }
            return Ok(Started::Done);
        }
    }
    let rma = |&(s, id): &(Span, OpId)| match op {
        BulkOp::Push => Rma::put(mem, s.local_offset, &remote.remote, s.remote_offset, s.len, id),
        BulkOp::Pull => Rma::get(mem, s.local_offset, &remote.remote, s.remote_offset, s.len, id),
    };
    let ops: Vec<Rma> = spans.iter().map(rma).collect();
    // Checked (access and bounds, as the plugin will again) before the
    // owner is looked up: a lookup may connect, and wait for a handshake,
    // to whatever address the descriptor names. (The ids were checked
    // above, for every path.)
    ops.iter().try_for_each(Rma::check)?;
    // Through the plugin the local handle was exposed on, when it speaks
    // the owner's scheme (so the caller knows where to cancel); otherwise
    // the endpoint's first plugin of that scheme.
    let owner = &remote.desc.owner;
    let through = match local.plugin {
        // (A handle exposed on another endpoint names a plugin this one
        // does not have: the endpoint's own plugin serves it.)
        Some(p) if ep.plugin(p).is_ok_and(|pl| scheme_of(owner) == Some(pl.scheme())) => Some(p),
        _ => None,
    };
    // The caller's source address, else the one the handle was given
    // (`Bulk::reached_through`).
    let via = via.or(remote.reach_via.as_ref());
    if let Some(src) = via.filter(|a| source_fits(ep, a, owner, through)) {
        ep.rma(src, &ops)?;
        return Ok(Started::Posted(src.plugin()));
    }
    let dest = match (through, since) {
        (Some(p), since) => {
            let plugin = ep.plugin_mut(p)?;
            match since {
                None => plugin.lookup(owner)?,
                Some(t) => plugin.try_lookup(owner, t)?,
            }
        }
        (_, None) => ep.lookup(owner)?,
        (_, Some(t)) => ep.try_lookup(owner, t)?,
    };
    ep.rma(&dest, &ops)?;
    Ok(Started::Posted(dest.plugin()))
}

/// Whether source address `src` may stand for `owner` (see
/// [`start_batch_via`]): the same URI, of a plugin of the owner's scheme
/// (the one the transfer goes through, `through`, if the local handle's
/// plugin speaks that scheme).
fn source_fits(ep: &Endpoint, src: &Addr, owner: &str, through: Option<PluginId>) -> bool {
    if src.uri() != owner || src.is_self() {
        return false;
    }
    match through {
        Some(p) => src.plugin() == p,
        None => ep
            .plugin(src.plugin())
            .is_ok_and(|pl| scheme_of(owner) == Some(pl.scheme())),
    }
}

/// A transfer between two handles of this process, with the access checks
/// an RMA would make, in bounded chunks.
fn copy_local(
    op: BulkOp,
    remote: &MemHandle,
    remote_offset: u64,
    local: &MemHandle,
    local_offset: u64,
    len: u64,
) -> Result<(), BulkError> {
    let deny = |what, h: &MemHandle, needs| NaError::AccessDenied {
        what,
        has: h.access(),
        needs,
    };
    let (src, src_off, dst, dst_off) = match op {
        BulkOp::Pull => (remote, remote_offset, local, local_offset),
        BulkOp::Push => (local, local_offset, remote, remote_offset),
    };
    let (src_name, dst_name) = if op == BulkOp::Pull {
        ("remote", "local")
    } else {
        ("local", "remote")
    };
    if !src.access().can_read() {
        return Err(deny(src_name, src, "read").into());
    }
    if !dst.access().can_write() {
        return Err(deny(dst_name, dst, "write").into());
    }
    const CHUNK: u64 = 1 << 20;
    // Within one handle, a destination ahead of an overlapping source is
    // copied from the end (as `copy_within` does), or a later chunk would
    // read bytes an earlier one already overwrote.
    let backwards = src.same_as(dst) && dst_off > src_off && dst_off - src_off < len;
    let mut buf = vec![0u8; len.min(CHUNK) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK);
        let at = if backwards { len - done - n } else { done };
        let piece = &mut buf[..n as usize];
        src.read_at(src_off + at, piece)?;
        dst.write_at(dst_off + at, piece)?;
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_overlapping_copy_within_one_handle_is_a_memmove() {
        const MIB: usize = 1 << 20;
        let data: Vec<u8> = (0..3 * MIB).map(|i| (i * 7 % 251) as u8).collect();
        for (from, to, len) in [(0, MIB / 2, 2 * MIB), (MIB / 2, 0, 2 * MIB), (0, 3, MIB + 10)] {
            let h = MemHandle::new(
                vec![data[..MIB].to_vec(), data[MIB..].to_vec()],
                Access::ReadWrite,
            );
            copy_local(BulkOp::Pull, &h, from as u64, &h, to as u64, len as u64).unwrap();
            let mut want = data.clone();
            want.copy_within(from..from + len, to);
            assert!(
                h.to_vec() == want,
                "copy {from}..+{len} to {to} differs from copy_within"
            );
        }
    }
    use super::*;
    use na_core::RemoteSegment;

    fn desc(size: u64, access: Access, inline: Option<Vec<u8>>) -> BulkDesc {
        let r = RemoteMem::new(
            vec![RemoteSegment {
                addr: 4096,
                len: size,
                key: 0,
            }],
            access,
        )
        .unwrap();
        BulkDesc {
            owner: "sm://1-0".into(),
            mem: ByteBuf::from(r.to_bytes()),
            inline: inline.map(ByteBuf::from),
        }
    }

    /// A transfer the remote handle's access forbids is refused before
    /// its owner is looked up (a lookup may connect to whatever address
    /// the descriptor names): here no plugin could even reach the owner.
    #[test]
    fn access_is_checked_before_the_owner_is_looked_up() {
        let mut ep = Endpoint::new(na_core::ProgressMode::Blocking).unwrap();
        let remote = Bulk::from_desc(desc(2048, Access::ReadOnly, None)).unwrap();
        let local = Bulk {
            local: Some(MemHandle::zeroed(2048, Access::ReadWrite)),
            plugin: None,
            desc: desc(2048, Access::ReadWrite, None),
            remote: RemoteMem::new(Vec::new(), Access::ReadWrite).unwrap(),
            reach_via: None,
        };
        let span = Span {
            remote_offset: 0,
            local_offset: 0,
            len: 16,
        };
        match start_batch(&mut ep, BulkOp::Push, &remote, &local, &[(span, OpId(1))]) {
            Err(BulkError::Na(NaError::AccessDenied {
                what: "remote",
                needs: "write",
                ..
            })) => {}
            other => panic!("expected the remote handle's access refused, got {other:?}"),
        }
        // A read-only local handle cannot take a pull either.
        let ro = Bulk {
            local: Some(MemHandle::zeroed(2048, Access::ReadOnly)),
            ..local
        };
        match start_batch(&mut ep, BulkOp::Pull, &remote, &ro, &[(span, OpId(2))]) {
            Err(BulkError::Na(NaError::AccessDenied {
                what: "local",
                needs: "write",
                ..
            })) => {}
            other => panic!("expected the local handle's access refused, got {other:?}"),
        }
        // An empty batch moves nothing and looks nothing up either.
        for op in [BulkOp::Push, BulkOp::Pull] {
            match start_batch(&mut ep, op, &remote, &ro, &[]) {
                Ok(Started::Done) => {}
                other => panic!("{op:?}: expected nothing done, got {other:?}"),
            }
        }
    }

    /// `BulkError::Na` leaves the NA error to `source()`: its message
    /// does not repeat it, the chain and the `String` a handler's `?`
    /// makes of it (all its caller sees) say it once.
    #[test]
    fn the_na_error_is_the_source_and_the_string_carries_the_chain() {
        let na = || NaError::Rma {
            op: "get",
            len: 8,
            peer: "sm://7-0".into(),
            source: std::io::Error::other("no such process"),
        };
        let e = BulkError::from(na());
        assert!(!e.to_string().contains("no such process"), "{e}");
        assert!(!e.to_string().contains("RMA get"), "{e}");
        let chain = na_core::ErrorChain(&e).to_string();
        assert_eq!(
            chain,
            "bulk transfer failed: RMA get of 8 bytes to sm://7-0 failed: no such process"
        );
        assert_eq!(String::from(BulkError::from(na())), chain);
    }

    /// `into_buffers` refuses while any clone lives (as its doc says: an
    /// RPC input that still holds one, say), and gives the buffers back
    /// once the last one went.
    #[test]
    fn a_clone_keeps_the_buffers_until_it_is_dropped() {
        let local = Bulk {
            local: Some(MemHandle::new(vec![vec![1, 2], vec![3]], Access::ReadWrite)),
            plugin: None,
            desc: desc(3, Access::ReadWrite, None),
            remote: RemoteMem::new(Vec::new(), Access::ReadWrite).unwrap(),
            reach_via: None,
        };
        let copy = local.clone();
        let local = *local.into_buffers().expect_err("a clone holds the memory");
        drop(copy);
        assert_eq!(local.into_buffers().unwrap(), vec![vec![1, 2], vec![3]]);
    }

    /// `read_at`, `write_at` and `to_vec` reach a local handle's memory
    /// and say why not for a remote one or a range past the end;
    /// `try_into_buffers` says what still holds the memory and gives the
    /// handle back.
    #[test]
    fn local_memory_is_read_and_given_back_with_errors_that_say_why() {
        let local = Bulk {
            local: Some(MemHandle::new(vec![vec![1, 2], vec![3]], Access::ReadOnly)),
            plugin: None,
            desc: desc(3, Access::ReadOnly, None),
            remote: RemoteMem::new(Vec::new(), Access::ReadOnly).unwrap(),
            reach_via: None,
        };
        // Writes go through whatever peers may do (read-only to them).
        local.write_at(1, &[9, 8]).unwrap();
        let mut two = [0; 2];
        local.read_at(0, &mut two).unwrap();
        assert_eq!(two, [1, 9]);
        assert_eq!(local.to_vec().unwrap(), [1, 9, 8]);
        match local.read_at(2, &mut two) {
            Err(BulkError::Na(NaError::OutOfBounds { .. })) => {}
            other => panic!("expected out of bounds, got {other:?}"),
        }
        assert!(matches!(
            local.write_at(3, &[0]),
            Err(BulkError::Na(NaError::OutOfBounds { .. }))
        ));
        let remote = Bulk::from_desc(desc(3, Access::ReadOnly, None)).unwrap();
        assert!(matches!(remote.read_at(0, &mut two), Err(BulkError::NotLocal)));
        assert!(matches!(remote.write_at(0, &[0]), Err(BulkError::NotLocal)));
        assert!(matches!(remote.to_vec(), Err(BulkError::NotLocal)));
        assert!(matches!(remote.try_into_buffers(), Err(BulkError::NotLocal)));
        // Two clones besides the one given: counted, and the handle back.
        let (a, b) = (local.clone(), local.clone());
        let local = match local.try_into_buffers() {
            Err(e @ BulkError::InUse { holders: 2, .. }) => {
                assert!(e.to_string().contains("still in use (2 other holders"), "{e}");
                let BulkError::InUse { handle, .. } = e else {
                    unreachable!()
                };
                *handle
            }
            other => panic!("expected the memory in use by two clones, got {other:?}"),
        };
        drop((a, b));
        assert_eq!(local.try_into_buffers().unwrap(), vec![vec![1, 9], vec![8]]);
    }

    #[test]
    fn descriptors_are_checked_on_the_way_in() {
        let ok = Bulk::from_desc(desc(3, Access::ReadOnly, Some(vec![1, 2, 3]))).unwrap();
        assert_eq!(ok.size(), 3);
        assert!(Bulk::from_desc(desc(4, Access::ReadOnly, Some(vec![1, 2, 3]))).is_err());
        assert!(Bulk::from_desc(desc(3, Access::ReadWrite, Some(vec![1, 2, 3]))).is_err());
        let mut bad = desc(3, Access::ReadOnly, None);
        bad.mem = ByteBuf::from(b"junk".to_vec());
        assert!(Bulk::from_desc(bad).is_err());
        // Through serde as well.
        let bytes = postcard::to_allocvec(&ok).unwrap();
        let back: Bulk = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back.desc(), ok.desc());
        assert!(back.local().is_none());
        assert!(
            back.into_buffers().is_err(),
            "a remote handle has no buffers to give back"
        );
        let mut junk = bytes.clone();
        let n = junk.len();
        junk[n - 1] ^= 0xff;
        let _ = postcard::from_bytes::<Bulk>(&junk); // may or may not decode; never panics
    }
}
