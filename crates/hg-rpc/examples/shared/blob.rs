//! The blob store's RPCs, shared by `blobstore.rs` (blocking) and
//! `blobstore_async.rs` (tokio): the same service, driven two ways.

use hg_rpc::{Bulk, Rpc};

/// The largest blob the store takes (256 MiB): a put of a bigger one is
/// refused before the server allocates anything, so a descriptor that
/// claims terabytes cannot make it abort.
pub const MAX_BLOB: u64 = 256 << 20;

/// `size` as a length to allocate, or the handler's error if it is more
/// than [`MAX_BLOB`].
pub fn checked_size(size: u64) -> Result<usize, String> {
    match usize::try_from(size) {
        Ok(n) if size <= MAX_BLOB => Ok(n),
        _ => Err(format!(
            "a blob of {size} bytes is larger than the maximum of {MAX_BLOB} bytes"
        )),
    }
}

/// Stores a blob (at most [`MAX_BLOB`] bytes): the server pulls it from
/// the client's handle and answers its checksum.
pub struct Put;
impl Rpc for Put {
    const NAME: &'static str = "blob.put";
    type Input = (String, Bulk);
    type Output = u64;
}

/// Reads a blob: the server pushes it into the client's handle and
/// answers its length.
pub struct Get;
impl Rpc for Get {
    const NAME: &'static str = "blob.get";
    type Input = (String, Bulk);
    type Output = u64;
}

/// A blob's length and checksum, if it is stored.
pub struct Stat;
impl Rpc for Stat {
    const NAME: &'static str = "blob.stat";
    type Input = String;
    type Output = Option<(u64, u64)>;
}

/// Deletes a blob; answers whether it was there.
pub struct Delete;
impl Rpc for Delete {
    const NAME: &'static str = "blob.delete";
    type Input = String;
    type Output = bool;
}

/// Makes the server exit.
pub struct Quit;
impl Rpc for Quit {
    const NAME: &'static str = "blob.quit";
    type Input = ();
    type Output = ();
}

/// FNV-1a 64 of `data`.
pub fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}
