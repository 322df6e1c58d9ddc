//! Who a peer's bounds are counted for: its process, where the transport
//! vouches for it, else its address.
//!
//! The bounds that keep one greedy origin from starving the others (its
//! share of the pull budget, its deferred requests, its exposed outputs)
//! were counted per address, and one process may hold many addresses (na-sm
//! lets it open up to `SmConfig::max_conns_per_process` connections, each
//! under an instance name of its own): two of its connections took the
//! whole pull budget, eight the whole deferred bound, four the whole
//! exposure bound, and every other origin was answered busy. Keyed by
//! [`Origin`], all of one process's connections share one of each.

use na_core::{Addr, PeerProcess, Plugin};

/// The unit a per-origin bound counts: a process the transport vouches for
/// ([`Plugin::peer_process`]), else a peer address (its token).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Origin {
    /// Every address of this process.
    Process(PeerProcess),
    /// One address, whose process the transport cannot name.
    Addr(u64),
}

impl Origin {
    /// The origin of `src`, a peer address of `plugin`.
    pub(crate) fn of(plugin: Option<&dyn Plugin>, src: &Addr) -> Origin {
        match plugin.and_then(|p| p.peer_process(src)) {
            Some(p) => Origin::Process(p),
            None => Origin::Addr(src.token()),
        }
    }
}
