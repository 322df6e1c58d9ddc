//! The registrar: what actually pins memory (`ibv_reg_mr` in the verbs
//! plugin, io_uring fixed buffers in this crate's tests).

use std::fmt;
use std::ops::BitOr;

/// Access rights of a registration, mirroring the verbs access flags. A
/// cached registration serves a request whose access is a subset of its own.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// Local read only (always implied).
    pub const LOCAL_READ: Access = Access(0);
    /// The local device may write the memory (`IBV_ACCESS_LOCAL_WRITE`).
    pub const LOCAL_WRITE: Access = Access(1);
    /// A peer may write the memory (`IBV_ACCESS_REMOTE_WRITE`).
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    /// A peer may read the memory (`IBV_ACCESS_REMOTE_READ`).
    pub const REMOTE_READ: Access = Access(1 << 2);
    /// A peer may run atomics on the memory (`IBV_ACCESS_REMOTE_ATOMIC`).
    pub const REMOTE_ATOMIC: Access = Access(1 << 3);

    /// Builds access rights from raw bits.
    pub const fn from_bits(bits: u32) -> Access {
        Access(bits)
    }

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// True when every right in `other` is also in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Access({:#x})", self.0)
    }
}

/// Registers and deregisters memory with a device.
///
/// The cache calls both methods without holding any of its locks and never
/// from a monitor's thread or hook, so an implementation may block, allocate
/// and free memory. `deregister` receives the value `register` returned,
/// exactly once, in the process that registered it (never in a forked child).
pub trait Registrar: Send + Sync + 'static {
    /// What a registration is: for verbs an RAII `ibv_mr` wrapper carrying
    /// lkey/rkey; handles expose it through `Registration::region`.
    type Region: Send + Sync + 'static;
    /// Why a registration failed.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Registers (pins) `[addr, addr+len)` with `access`.
    fn register(&self, addr: usize, len: usize, access: Access) -> Result<Self::Region, Self::Error>;

    /// Deregisters (unpins) a region returned by [`Registrar::register`].
    fn deregister(&self, region: Self::Region) -> Result<(), Self::Error>;
}
