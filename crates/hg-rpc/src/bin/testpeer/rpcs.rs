//! RPC definitions shared by `hg-rpc-testpeer` and the integration tests.
//!
//! The payloads that may be megabytes (`Echo`'s, `Digest`'s and
//! `RecordBlob`'s inputs, `Echo`'s and `Fill`'s outputs) are
//! `serde_bytes::ByteBuf`s, which serde encodes as one byte string: a
//! `Vec<u8>` goes element by element, through the codec (and its guard)
//! once per byte, which made the tests that move megabytes through them
//! slow in a debug build. Postcard writes the same bytes either way (a
//! length, then the data), so messages written by hand are unchanged.

use hg_rpc::Rpc;
use serde_bytes::ByteBuf;

/// Adds two numbers.
pub struct Add;
impl Rpc for Add {
    const NAME: &'static str = "test.add";
    type Input = (u64, u64);
    type Output = u64;
}

/// Returns its input.
pub struct Echo;
impl Rpc for Echo {
    const NAME: &'static str = "test.echo";
    type Input = ByteBuf;
    type Output = ByteBuf;
}

/// Always fails with the given message.
pub struct Fail;
impl Rpc for Fail {
    const NAME: &'static str = "test.fail";
    type Input = String;
    type Output = ();
}

/// Sleeps for the given milliseconds, then answers.
pub struct Sleep;
impl Rpc for Sleep {
    const NAME: &'static str = "test.sleep";
    type Input = u64;
    type Output = ();
}

/// One-way: records a number.
pub struct Record;
impl Rpc for Record {
    const NAME: &'static str = "test.record";
    type Input = u64;
    type Output = ();
}

/// Returns how many `Record`s arrived and their sum.
pub struct Count;
impl Rpc for Count {
    const NAME: &'static str = "test.count";
    type Input = ();
    type Output = (u64, u64);
}

/// Makes the server exit.
pub struct Quit;
impl Rpc for Quit {
    const NAME: &'static str = "test.quit";
    type Input = ();
    type Output = ();
}

/// Returns the length and FNV-1a hash of its input (for spilled inputs).
pub struct Digest;
impl Rpc for Digest {
    const NAME: &'static str = "test.digest";
    type Input = ByteBuf;
    type Output = (u64, u64);
}

/// One-way: records a blob's length into the `Record` counters.
pub struct RecordBlob;
impl Rpc for RecordBlob {
    const NAME: &'static str = "test.record_blob";
    type Input = ByteBuf;
    type Output = ();
}

/// FNV-1a 64 of `data`.
pub fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Stores a blob (at most 64 MiB: a larger handle is refused before
/// anything is allocated): the server pulls it from the client's bulk
/// handle and answers its FNV-1a hash.
pub struct BlobPut;
impl Rpc for BlobPut {
    const NAME: &'static str = "test.blob_put";
    type Input = (String, hg_rpc::Bulk);
    type Output = u64;
}

/// Stores a blob like [`BlobPut`], pulled in chunks of the given size that
/// the server starts as one batch, last chunk first (at most 2^20 chunks:
/// more are refused before any is listed); answers the hash.
pub struct BlobPutChunked;
impl Rpc for BlobPutChunked {
    const NAME: &'static str = "test.blob_put_chunked";
    type Input = (String, hg_rpc::Bulk, u64);
    type Output = u64;
}

/// Reads a blob: the server pushes it into the client's handle at the given
/// offset and answers its length.
pub struct BlobGet;
impl Rpc for BlobGet {
    const NAME: &'static str = "test.blob_get";
    type Input = (String, hg_rpc::Bulk, u64);
    type Output = u64;
}

/// Exposes a copy of a blob for the client to read and write, in
/// segments of the given size (at most `MAX_REMOTE_SEGMENTS` of them:
/// more are refused first), and answers the handle (kept until the
/// server exits).
pub struct BlobExpose;
impl Rpc for BlobExpose {
    const NAME: &'static str = "test.blob_expose";
    type Input = (String, u64);
    type Output = hg_rpc::Bulk;
}

/// The length and FNV-1a hash of what a `BlobExpose` handle holds now.
pub struct BlobExposedDigest;
impl Rpc for BlobExposedDigest {
    const NAME: &'static str = "test.blob_exposed_digest";
    type Input = String;
    type Output = (u64, u64);
}

/// Answers the index of the server context that ran it.
pub struct WhoAmI;
impl Rpc for WhoAmI {
    const NAME: &'static str = "test.whoami";
    type Input = u64;
    type Output = (u64, u64);
}

/// Answers the server's `HG_TESTPEER_MARKER` (empty if unset) and its
/// process id: which of several servers, perhaps at one address, answered.
pub struct Marker;
impl Rpc for Marker {
    const NAME: &'static str = "test.marker";
    type Input = ();
    type Output = (String, u32);
}

/// Answers `len` bytes of [`fill_pattern`] from `seed` (a large output
/// for a small input).
pub struct Fill;
impl Rpc for Fill {
    const NAME: &'static str = "test.fill";
    type Input = (u64, u64);
    type Output = ByteBuf;
}

/// Returns how many `Fill` calls the server has answered with an output
/// (not refused for their length). Each answer is
/// sent as its handler returns, before the server handles another
/// request: a count of `n` says that `n` responses have gone out, which
/// tests that need responses to arrive together (not driven meanwhile)
/// wait for instead of a fixed time.
pub struct FillsAnswered;
impl Rpc for FillsAnswered {
    const NAME: &'static str = "test.fills_answered";
    type Input = ();
    type Output = u64;
}

/// Returns how many `Echo` calls the server has answered and how many
/// spilled outputs it keeps exposed (`RpcStats::exposed_outputs`), both
/// as they stood together after the same earlier turn of its loop: tests
/// that need a spilled output answered and then let go (its TTL passed,
/// the sweep ran) wait for `(n, 0)` with `n` at least 1, from an engine
/// of their own, instead of sleeping a fixed time.
pub struct EchoOutputs;
impl Rpc for EchoOutputs {
    const NAME: &'static str = "test.echo_outputs";
    type Input = ();
    type Output = (u64, u64);
}

/// `len` bytes that repeat every 251, shifted by `seed`: what `Fill` answers.
pub fn fill_pattern(len: u64, seed: u64) -> Vec<u8> {
    (0..len).map(|i| ((i + seed) % 251) as u8).collect()
}

/// [`fill_pattern`] as `Fill`'s output, for its handlers.
pub fn fill_output(len: u64, seed: u64) -> ByteBuf {
    ByteBuf::from(fill_pattern(len, seed))
}
