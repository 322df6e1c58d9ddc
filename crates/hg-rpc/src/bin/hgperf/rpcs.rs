//! The RPCs hg-perf measures.

use hg_rpc::{Bulk, Rpc};
use serde_bytes::ByteBuf;

/// Takes a payload, answers nothing: the RPC rate test.
pub struct Noop;
impl Rpc for Noop {
    const NAME: &'static str = "hgperf.noop";
    type Input = ByteBuf;
    type Output = ();
}

/// The server pulls `count` transfers of `len` bytes from consecutive
/// regions of the client's handle (a bulk write).
pub struct BulkWrite;
impl Rpc for BulkWrite {
    const NAME: &'static str = "hgperf.bulk_write";
    type Input = (Bulk, u64, u64);
    /// The first and last byte the server holds after the transfer.
    type Output = (u8, u8);
}

/// The server pushes `count` transfers of `len` bytes into consecutive
/// regions of the client's handle (a bulk read).
pub struct BulkRead;
impl Rpc for BulkRead {
    const NAME: &'static str = "hgperf.bulk_read";
    type Input = (Bulk, u64, u64);
    /// The first and last byte the server holds after the transfer.
    type Output = (u8, u8);
}

/// The server's own `BW_SPAN`-byte buffer (exposed once, read-write):
/// what `bw --mode tokio` moves data with from the client's side.
pub struct Exposed;
impl Rpc for Exposed {
    const NAME: &'static str = "hgperf.exposed";
    type Input = ();
    type Output = Bulk;
}

/// Stops the server.
pub struct Quit;
impl Rpc for Quit {
    const NAME: &'static str = "hgperf.quit";
    type Input = ();
    type Output = ();
}
