//! The target's side of spills: a spilled request's input pulled (within
//! the pull budget) and checked before its handler runs, an output over
//! the eager limit exposed for its origin to pull, and the large buffers
//! kept for reuse by both.

use na_core::hint::cold_path;
use na_core::{Access, Addr, MemHandle, NaError};

use super::{logged_at, response_header, Engine, Handler, OpRole, PendingPull};
use crate::codec::Codec;
use crate::deferred::DeferredTicket;
use crate::header::{Header, Status, FLAG_CHECKSUM, FLAG_SPILL, HEADER_LEN};
use crate::spill;

/// Spare buffers an engine keeps for reuse.
const SPARE_BUFFERS_KEPT: usize = 16;

/// Why [`Engine::start_pull`] did not start a pull.
pub(super) struct PullRefused {
    /// What went wrong, for the answer or the error.
    pub(super) reason: String,
    /// Which kind of refusal it is.
    pub(super) why: Refusal,
}

/// The kinds of [`PullRefused`].
pub(super) enum Refusal {
    /// No room in the pull budget now: the same pull may fit once pulls
    /// in flight end (or deferred requests holding pulled inputs are
    /// answered).
    NoRoom,
    /// Larger than this engine ever pulls: `len` bytes, past `max`, the
    /// bound that `setting` raises. No retry can fit it.
    TooLarge {
        /// Bytes of the data.
        len: u64,
        /// The bound.
        max: u64,
        /// The setting of the bound.
        setting: &'static str,
    },
    /// The descriptor failed a check (an input's: also one the transport
    /// refused as the pull started, see `descriptor_fault`).
    Malformed,
    /// The transport refused the pull (the peer gone among others: its
    /// death, not its data, is then a call's outcome; an output's
    /// descriptor the transport refused is one too, as a pull of it that
    /// fails later is).
    Transport(NaError),
}

impl PullRefused {
    /// The status a request gets for it: `Busy` when the pull budget has
    /// no room now, `DecodeError` otherwise.
    pub(super) fn status(&self) -> Status {
        match self.why {
            Refusal::NoRoom => Status::Busy,
            _ => Status::DecodeError,
        }
    }
}

/// Whether `e`, a transport's refusal to start a get from a peer's
/// descriptor, is that descriptor's fault: a remote range out of its
/// bounds or an access it does not grant (`spill::parse` checks both, so
/// only a change there lets them through), a descriptor the transport
/// cannot read, or one that names the puller's own process outside the
/// memory it exposes (na-sm's and na-verbs' self-transfer check, an
/// [`NaError::Rma`] of kind `PermissionDenied`, the only `Rma` error
/// either returns at a start rather than in a completion). Anything else
/// (the peer gone, a full queue, a system call) is the transport's.
fn descriptor_fault(e: &NaError) -> bool {
    match e {
        NaError::OutOfBounds { what, .. } | NaError::AccessDenied { what, .. } => *what == "remote",
        NaError::Malformed { .. } => true,
        NaError::Rma { source, .. } => source.kind() == std::io::ErrorKind::PermissionDenied,
        _ => false,
    }
}

/// The bytes a finished pull wrote into `mem` (one of `pull_buffer`'s),
/// taken back without a copy when no other clone of the handle is left.
pub(super) fn pulled_bytes(mem: MemHandle) -> Vec<u8> {
    match mem.into_buffers() {
        Ok(mut bufs) if bufs.len() == 1 => bufs.pop().unwrap_or_default(),
        Ok(bufs) => bufs.concat(),
        Err(mem) => mem.to_vec(),
    }
}

impl<C: Codec> Engine<C> {
    /// A request whose input spilled: answered at once if it cannot be
    /// served, else its input is pulled first.
    #[inline(never)]
    pub(super) fn on_spilled_request(&mut self, src: &Addr, h: &Header, payload: &[u8]) {
        if !self.handlers.contains_key(&h.rpc_id) {
            // Answered before anything is pulled: an unknown RPC must not
            // make us allocate and copy its (up to `max_spill`) input.
            self.stats.handled += 1;
            self.respond(src, response_header(h, Status::UnknownRpc), Vec::new());
            return;
        }
        let mut ticket = None;
        if matches!(self.handlers.get(&h.rpc_id), Some(Handler { run: None, .. })) {
            // Its place is taken now, kept through the pull; busy is
            // answered before anything is pulled (a one-way request
            // too: the answer lets its origin drop the input).
            match self.admit_deferred(self.origin_of(src)) {
                Ok(t) => ticket = Some(t),
                Err(why) => {
                    self.stats.handled += 1;
                    self.respond(src, response_header(h, Status::Busy), why.into_bytes());
                    return;
                }
            }
        }
        if let Err(refused) = self.start_pull(src, h, payload, false, ticket) {
            match refused.why {
                Refusal::NoRoom => self.stats.pulls_refused += 1,
                // A descriptor that fails its checks (write-only, bad
                // lengths) or that the transport refuses at the start
                // (`descriptor_fault`) is malformed, as garbage is:
                // answered (status 3) and counted.
                Refusal::Malformed => {
                    cold_path();
                    self.stats.malformed += 1;
                    if logged_at(self.stats.malformed) {
                        tracing::warn!(peer = %src, reason = %refused.reason, malformed = self.stats.malformed, "malformed spilled input");
                    }
                }
                Refusal::TooLarge { .. } | Refusal::Transport(_) => {}
            }
            self.respond(
                src,
                response_header(h, refused.status()),
                refused.reason.into_bytes(),
            );
        }
    }

    /// Starts pulling spilled data described by `payload` (length, then
    /// the peer's memory descriptor) from `src`: a request's input, or (with
    /// `output`) a response's output. Everything in it is checked first.
    /// A refusal says why (see [`Refusal`]); a request gets `Busy` for
    /// no room in the pull budget now, `DecodeError` otherwise (an input
    /// larger than the whole budget included: it never fits).
    pub(super) fn start_pull(
        &mut self,
        src: &Addr,
        h: &Header,
        payload: &[u8],
        output: bool,
        ticket: Option<DeferredTicket>,
    ) -> std::result::Result<(), PullRefused> {
        let what = if output { "output" } else { "input" };
        let refuse = |why, reason| PullRefused { reason, why };
        // The length is checked against `max_spill` here, not by `parse`,
        // to tell a refusal that can never succeed apart.
        let spill::Spilled {
            len,
            remote,
            seal,
            crc,
        } = spill::parse(payload, u64::MAX, h.flags & FLAG_CHECKSUM != 0)
            .map_err(|e| refuse(Refusal::Malformed, format!("{what}: {e}")))?;
        let too_large = |max, setting| {
            refuse(
                Refusal::TooLarge { len, max, setting },
                format!("{what}: spilled data of {len} bytes exceeds the limit of {max}"),
            )
        };
        if len > self.max_spill {
            return Err(too_large(self.max_spill, "Engine::set_max_spill"));
        }
        if len > self.max_pull_bytes {
            // Busy would be a lie: no retry can ever fit.
            let mut r = too_large(self.max_pull_bytes, "Engine::set_max_pull_bytes");
            r.reason = format!(
                "{what}: {len} bytes exceed the {} bytes of spilled data this engine pulls at once",
                self.max_pull_bytes
            );
            return Err(r);
        }
        let held = self.pull_bytes + self.deferred_bytes.load(std::sync::atomic::Ordering::Relaxed);
        if held.saturating_add(len) > self.max_pull_bytes && !(output && self.output_within_floor(len)) {
            return Err(refuse(
                Refusal::NoRoom,
                format!(
                    "{what}: {len} more bytes would exceed the {} bytes of spilled data this engine \
                     pulls and holds at once ({held} now); try again later",
                    self.max_pull_bytes
                ),
            ));
        }
        // One origin's share too (a greedy one must not starve others):
        // per process, where the transport names it (see `Origin`).
        let origin = if output {
            None
        } else {
            let origin = self.origin_of(src);
            self.admit_input_pull(origin, len)
                .map_err(|reason| refuse(Refusal::NoRoom, reason))?;
            Some(origin)
        };
        // The data and its seal (`parse` checked that they add up).
        let mem = MemHandle::new(
            vec![self.pull_buffer((len + spill::SEAL_LEN) as usize)],
            Access::ReadWrite,
        );
        let op = self.op();
        self.ep
            .plugin_mut(self.plugin)
            .and_then(|p| p.mem_register(&mem))
            .and_then(|()| self.ep.get(&mem, 0, &remote, 0, len + spill::SEAL_LEN, src, op))
            .map_err(|e| {
                // An input's descriptor is the origin's word: a transport
                // that refuses it at the start (see `descriptor_fault`)
                // refuses malformed peer input, as `parse` does.
                if !output && descriptor_fault(&e) {
                    cold_path();
                    refuse(
                        Refusal::Malformed,
                        format!(
                            "{what}: the peer's descriptor was refused: {}",
                            na_core::ErrorChain(&e)
                        ),
                    )
                } else {
                    let reason = format!("pulling the spilled {what} failed: {}", na_core::ErrorChain(&e));
                    refuse(Refusal::Transport(e), reason)
                }
            })?;
        let role = if output {
            OpRole::PullOutput(op.0, h.cookie)
        } else {
            OpRole::Pull(op.0)
        };
        self.ops.insert(op, role);
        self.pull_bytes += len;
        match origin {
            Some(origin) => self.charge_input_pull(origin, len),
            None => self.output_pull_bytes += len,
        }
        self.pulls.insert(
            op.0,
            PendingPull {
                src: src.clone(),
                header: *h,
                mem,
                seal,
                crc,
                ticket,
                origin,
            },
        );
        Ok(())
    }

    /// Pulled spilled `data` (with its seal after it), checked against
    /// the seal and the CRC-32C (if any) its message carried, and the seal
    /// cut off. A mismatch counts as malformed; the buffer is kept as a
    /// spare and the reason returned.
    pub(super) fn checked_pull(
        &mut self,
        mut data: Vec<u8>,
        seal: u64,
        crc: Option<u32>,
    ) -> std::result::Result<Vec<u8>, String> {
        match spill::unseal(&mut data, seal).and_then(|()| spill::verify(&data, crc)) {
            Ok(()) => Ok(data),
            Err(why) => {
                cold_path();
                self.stats.malformed += 1;
                if logged_at(self.stats.malformed) {
                    tracing::warn!(%why, malformed = self.stats.malformed, "spilled data failed its seal or checksum");
                }
                self.keep_spare_buffer(data);
                Err(why)
            }
        }
    }

    /// A buffer of `len` bytes for a pull to fill: a kept one if one is
    /// large enough. Its old bytes are left in place (the pull overwrites
    /// all of them, and a failed pull's buffer is never read), so only
    /// growth is zero-filled. At a few KiB a fresh zero-filled buffer per
    /// pull, copied out afterwards, cost about as much as the pull itself
    /// (hg-perf rate, 4 KiB, 1 in flight).
    pub(super) fn pull_buffer(&mut self, len: usize) -> Vec<u8> {
        let mut buf = match self.spare_bufs.iter().position(|b| b.capacity() >= len) {
            Some(i) => self.spare_bufs.swap_remove(i),
            None => Vec::new(),
        };
        buf.resize(len, 0);
        buf
    }

    /// Whether a message of `len` bytes (header included) to `dest` goes
    /// out eagerly: within `eager_floor` (every peer takes it) without
    /// asking; else within [`limit_to`](Self::limit_to).
    #[inline(always)]
    pub(super) fn fits_eager(&self, dest: &Addr, len: usize) -> bool {
        if len <= self.eager_floor {
            return true;
        }
        cold_path();
        len <= self.limit_to(dest)
    }

    /// The largest message (header included) `dest` is known to accept:
    /// the smaller of our limit and the peer's (na-verbs: from its
    /// hello), never below `eager_floor` (what every peer takes, also
    /// one whose limit is not known yet).
    #[inline(never)]
    pub(super) fn limit_to(&self, dest: &Addr) -> usize {
        let peer = match self.ep.plugin(self.plugin) {
            Ok(p) => p.max_unexpected_size_to(dest),
            Err(_) => self.eager_floor,
        };
        self.max_msg.min(peer).max(self.eager_floor)
    }

    /// Keeps `buf` as a spare if it is larger than a message (one that
    /// fits a message is cheap to make again).
    #[inline]
    pub(super) fn keep_if_large(&mut self, buf: Vec<u8>) {
        if buf.capacity() > self.max_msg {
            self.keep_spare_buffer(buf);
        }
    }

    /// Keeps the buffer of a handle nobody else holds any more (a spilled
    /// input the target finished with, an output its origin released) as
    /// a spare; a handle of several buffers, or still shared, is dropped.
    pub(super) fn recycle(&mut self, mem: MemHandle) {
        // An exposed input let go before its target pulled it (the target
        // died, say): a pull still to come must fail its seal check, not
        // take what the spare holds next. (Harmless on a pulled buffer.)
        spill::break_seal(&mem);
        if let Ok(bufs) = mem.into_buffers() {
            // One buffer, or a spilled payload's data and its seal.
            if let Some(buf) = bufs.into_iter().next() {
                self.keep_spare_buffer(buf);
            }
        }
    }

    /// `buf`, or an exact copy of it if it holds over twice its length
    /// (see [`spill::fit_to_len`]; the large buffer is kept as a spare):
    /// what a spilled payload is exposed in.
    pub(super) fn fit_for_exposure(&mut self, buf: Vec<u8>) -> Vec<u8> {
        let (buf, spare) = spill::fit_to_len(buf);
        if let Some(spare) = spare {
            self.keep_spare_buffer(spare);
        }
        buf
    }

    /// Keeps a buffer for the next pull or spilled input: at most
    /// [`SPARE_BUFFERS_KEPT`], holding at most `spare_bytes` together
    /// (see [`Engine::set_spare_bytes`]).
    pub(super) fn keep_spare_buffer(&mut self, buf: Vec<u8>) {
        let kept: usize = self.spare_bufs.iter().map(Vec::capacity).sum();
        if self.spare_bufs.len() < SPARE_BUFFERS_KEPT && kept + buf.capacity() <= self.spare_bytes {
            self.spare_bufs.push(buf);
        }
    }

    /// An output over the eager limit: exposed and described (the origin
    /// pulls it, then releases it); an error message is cut to fit
    /// instead, and an output the exposure bound refuses becomes an
    /// error.
    #[inline(never)]
    pub(super) fn fit_output(&mut self, src: &Addr, h: Header, mut out: Vec<u8>) -> (Header, Vec<u8>) {
        if h.status != Status::Ok {
            truncate_message(&mut out, self.limit_to(src).saturating_sub(HEADER_LEN));
            return (h, out);
        }
        let origin = self.origin_of(src);
        if let Err(why) = self.exposed.admit(origin, out.len() as u64) {
            cold_path();
            self.stats.outputs_refused += 1;
            let refused = self.stats.outputs_refused;
            if logged_at(refused) {
                tracing::warn!(peer = %src, %why, refused, "spilled output refused");
            }
            let h = Header {
                status: Status::HandlerError,
                ..h
            };
            let mut msg = why.into_bytes();
            truncate_message(&mut msg, self.limit_to(src).saturating_sub(HEADER_LEN));
            (h, msg)
        } else {
            let len = out.len() as u64;
            let out = self.fit_for_exposure(out);
            let seal = self.next_seal();
            match spill::expose(&mut self.ep, self.plugin, out, h.flags & FLAG_CHECKSUM != 0, seal) {
                Ok((mem, payload)) => {
                    self.exposed.insert((src.token(), h.cookie), origin, mem, len);
                    self.watch_origin(src);
                    (
                        Header {
                            flags: h.flags | FLAG_SPILL,
                            ..h
                        },
                        payload,
                    )
                }
                Err(e) => (
                    Header {
                        status: Status::HandlerError,
                        ..h
                    },
                    format!("cannot expose the large output: {}", na_core::ErrorChain(&e)).into_bytes(),
                ),
            }
        }
    }
}

impl<C: Codec> Engine<C> {
    /// Watches origin `src`, which now has an output exposed here (see
    /// `Engine::watches`): if it dies before it pulls and releases the
    /// output, the watch fails and [`release_outputs_of`](Self::release_outputs_of)
    /// lets the output go then, not at its TTL. One watch per peer, posted
    /// once (the spill path only: a lookup when it is there already). A
    /// watch that cannot be posted leaves the TTL to end the output (a
    /// peer known gone already fails the response's send, which releases
    /// it).
    fn watch_origin(&mut self, src: &Addr) {
        if self.watches.contains_key(&src.token()) {
            return;
        }
        if let Err(e) = self.watch(src) {
            cold_path();
            tracing::debug!(peer = %src, error = %na_core::ErrorChain(&e), "cannot watch the origin of a spilled output");
        }
    }

    /// Origin `token` went away (its watch failed): the outputs exposed
    /// for it, which it will never pull or release, are let go now instead
    /// of at their TTL (counted in `RpcStats::outputs_origin_gone`). Its
    /// token is never another peer's (transports give a departed peer's
    /// slot a new generation), so a process that comes back under the
    /// same name keeps its own outputs.
    pub(super) fn release_outputs_of(&mut self, token: u64, peer: &str) {
        let (outputs, bytes) = self.exposed.remove_peer(token);
        if outputs > 0 {
            self.stats.outputs_origin_gone += outputs as u64;
            tracing::debug!(%peer, outputs, bytes, "origin gone; released the spilled outputs it never pulled");
        }
    }
}

/// Cuts the UTF-8 error message `msg` to at most `max` bytes, at a
/// character boundary, saying how long it was.
pub(super) fn truncate_message(msg: &mut Vec<u8>, max: usize) {
    let note = format!(" [... cut from {} bytes]", msg.len());
    let mut keep = max.saturating_sub(note.len());
    while keep > 0 && msg.get(keep).is_some_and(|b| b & 0xc0 == 0x80) {
        keep -= 1;
    }
    msg.truncate(keep);
    if note.len() <= max {
        msg.extend_from_slice(note.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::truncate_message;
    use crate::engine::test_support::sm_pair;
    use crate::Rpc;

    struct Note;
    impl Rpc for Note {
        const NAME: &'static str = "test.note";
        type Input = u32;
        type Output = ();
    }

    /// One-way requests (over the network and to ourselves) leave the
    /// spare buffers where they were: their handler's output buffer, a
    /// spare, is kept again, not dropped with the answer nobody gets.
    #[test]
    fn one_way_requests_leave_the_spare_buffers_in_place() {
        let (dir, mut srv, mut c, s) = sm_pair("spares");
        srv.register::<Note>(|_| Ok(())).unwrap();
        for _ in 0..4 {
            srv.keep_spare_buffer(Vec::with_capacity(1 << 20));
        }
        let me = srv.self_addr().clone();
        // The first request's encoding takes a spare for its scratch
        // buffer, for good.
        srv.forward_one_way::<Note>(&me, &0).unwrap();
        let spares = srv.spare_bufs.len();
        assert!(spares > 0);
        for i in 0..8 {
            srv.forward_one_way::<Note>(&me, &i).unwrap();
        }
        assert_eq!(srv.spare_bufs.len(), spares, "self-forwarded");
        for i in 0..8 {
            c.forward_one_way::<Note>(&s, &i).unwrap();
        }
        let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while srv.stats().handled < 17 {
            assert!(std::time::Instant::now() < end, "{:?}", srv.stats());
            c.progress_now().unwrap();
            srv.progress_now().unwrap();
            srv.trigger().unwrap();
        }
        assert_eq!(srv.spare_bufs.len(), spares, "over the network");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_cut_message_fits_stays_utf8_and_says_how_long_it_was() {
        for max in [0, 5, 30, 31, 32, 100] {
            let mut m = "é".repeat(100).into_bytes();
            truncate_message(&mut m, max);
            assert!(m.len() <= max, "{max}: {}", m.len());
            let s = String::from_utf8(m).expect("valid UTF-8");
            if max >= 40 {
                assert!(s.starts_with('é') && s.ends_with("cut from 200 bytes]"), "{s}");
            }
        }
    }
}
