//! The error type of the verbs plugin: one variant per failing operation.

use std::io;

/// Result alias of this crate.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

/// Everything that can fail in the verbs plugin and its `sys` layer.
///
/// Each variant names the failing operation, carries the OS error (libibverbs
/// and librdmacm report through `errno` or a returned errno value) and a
/// context string that says which object was involved. The OS error is the
/// variant's `source()`, not part of its message: print the chain
/// ([`na_core::ErrorChain`]) to see both.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// libibverbs lists no RDMA device at all on this host.
    #[error(
        "no RDMA device found ({reason}). To use RDMA verbs: install rdma-core's user-space \
         providers (Debian/Ubuntu: `apt-get install ibverbs-providers libibverbs1 librdmacm1`), \
         load the kernel driver of your NIC, or for software RoCE load `rdma_rxe` and create a \
         device (`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <netdev>`), and check \
         that /dev/infiniband/uverbs* exists. Without kernel RDMA support, run the tests inside \
         the soft-RoCE VM: tools/rxe-vm/run-in-rxe-vm.sh"
    )]
    NoDevice {
        /// What the probe of sysfs and libibverbs found.
        reason: String,
    },
    /// A device was requested by name but does not exist.
    #[error("RDMA device `{name}` not found; available devices: {available}")]
    DeviceNotFound {
        /// The requested device name.
        name: String,
        /// Comma-separated names of the devices that exist.
        available: String,
    },
    /// The device has no port with the requested number.
    #[error(
        "RDMA device `{device}` has no port {port} (it has {count}); use verbs://{device}:<1..={count}>/..."
    )]
    NoPort {
        /// Device name.
        device: String,
        /// Requested port.
        port: u8,
        /// Ports the device has.
        count: u8,
    },
    /// The requested port is not active (link down), or no device has an active port.
    #[error("RDMA port {device}:{port} is not active (link down; check `ibv_devinfo -d {device}`)")]
    PortDown {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
    },
    /// No IP address to bind was given and the port has no IPv4-mapped GID.
    #[error(
        "RDMA port {device}:{port} has no IPv4 address (no IPv4-mapped GID); give one: \
         verbs://{device}:{port}/<ip>:<port>"
    )]
    NoAddress {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
    },
    /// The bind address belongs to another device than the one requested.
    #[error("address {addr} belongs to RDMA device `{actual}`, not the requested `{requested}`")]
    WrongDevice {
        /// The address.
        addr: String,
        /// The device RDMA CM bound it to.
        actual: String,
        /// The device that was asked for.
        requested: String,
    },
    /// The bind address belongs to another port than the one requested.
    #[error("address {addr} belongs to port {actual} of RDMA device `{device}`, not the requested port {requested}")]
    WrongPort {
        /// The address.
        addr: String,
        /// The device RDMA CM bound it to.
        device: String,
        /// The port RDMA CM bound it to.
        actual: u8,
        /// The port that was asked for.
        requested: u8,
    },
    /// `ibv_get_device_list` failed.
    #[error("ibv_get_device_list failed")]
    DeviceList {
        /// The OS error.
        source: io::Error,
    },
    /// `ibv_open_device` failed.
    #[error("ibv_open_device({device}) failed")]
    OpenDevice {
        /// Device name.
        device: String,
        /// The OS error.
        source: io::Error,
    },
    /// `ibv_query_device`, `ibv_query_port` or `ibv_query_gid` failed.
    #[error("{op}({context}) failed")]
    Query {
        /// The query function.
        op: &'static str,
        /// Device/port/index that was queried.
        context: String,
        /// The OS error.
        source: io::Error,
    },
    /// Allocating a verbs resource (PD, completion channel, CQ, SRQ, QP) failed.
    #[error("{op} failed ({context})")]
    Create {
        /// The verbs function (`ibv_alloc_pd`, `ibv_create_cq`, ...).
        op: &'static str,
        /// Sizes or parent objects involved.
        context: String,
        /// The OS error.
        source: io::Error,
    },
    /// `ibv_reg_mr` failed.
    #[error("ibv_reg_mr(addr {addr:#x}, len {len}) failed")]
    RegisterMemory {
        /// Start of the region.
        addr: usize,
        /// Length of the region in bytes.
        len: usize,
        /// The OS error.
        source: io::Error,
    },
    /// Allocating the memory behind an owned memory region failed.
    #[error("mmap of {len} bytes for a memory region failed")]
    AllocateMemory {
        /// Requested length.
        len: usize,
        /// The OS error.
        source: io::Error,
    },
    /// `ibv_modify_qp` (a QP state transition) failed.
    #[error("ibv_modify_qp(qpn {qpn}, to {to}) failed")]
    ModifyQp {
        /// QP number.
        qpn: u32,
        /// Target state.
        to: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// `ibv_post_send`, `ibv_post_recv` or `ibv_post_srq_recv` failed.
    #[error("{op}(qpn {qpn}, wr_id {wr_id}) failed")]
    Post {
        /// The post function.
        op: &'static str,
        /// QP number (0 for an SRQ).
        qpn: u32,
        /// Work request id.
        wr_id: u64,
        /// The OS error (`ENOMEM`: the queue is full).
        source: io::Error,
    },
    /// `ibv_post_send` of a chain failed without naming the work request
    /// that failed (no `bad_wr`, or not one of the chain's): any of the
    /// chain's `count` work requests may have been posted. The caller
    /// counts them all as posted and moves the QP to the error state,
    /// which flushes those the device has.
    #[error("{op}(qpn {qpn}, a chain of {count}) failed without naming the work request")]
    PostUnsure {
        /// The post function.
        op: &'static str,
        /// QP number.
        qpn: u32,
        /// Work requests in the chain.
        count: usize,
        /// The OS error.
        source: io::Error,
    },
    /// Polling, arming or reading events of a completion queue failed.
    #[error("{op} failed")]
    Completion {
        /// `ibv_poll_cq`, `ibv_req_notify_cq` or `ibv_get_cq_event`.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// An RDMA CM call failed.
    #[error("{op}({context}) failed")]
    Cm {
        /// The librdmacm function.
        op: &'static str,
        /// Address or id involved.
        context: String,
        /// The OS error.
        source: io::Error,
    },
    /// An argument was out of range (offset/length outside a region, too many SGEs, ...).
    #[error("invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
}

impl VerbsError {
    /// The underlying OS error, if this error carries one.
    pub fn io_error(&self) -> Option<&io::Error> {
        match self {
            VerbsError::DeviceList { source }
            | VerbsError::OpenDevice { source, .. }
            | VerbsError::Query { source, .. }
            | VerbsError::Create { source, .. }
            | VerbsError::RegisterMemory { source, .. }
            | VerbsError::AllocateMemory { source, .. }
            | VerbsError::ModifyQp { source, .. }
            | VerbsError::Post { source, .. }
            | VerbsError::PostUnsure { source, .. }
            | VerbsError::Completion { source, .. }
            | VerbsError::Cm { source, .. } => Some(source),
            VerbsError::NoDevice { .. }
            | VerbsError::DeviceNotFound { .. }
            | VerbsError::NoPort { .. }
            | VerbsError::PortDown { .. }
            | VerbsError::NoAddress { .. }
            | VerbsError::WrongDevice { .. }
            | VerbsError::WrongPort { .. }
            | VerbsError::InvalidArgument { .. } => None,
        }
    }

    /// True if the operation would block (a nonblocking fd had nothing to read).
    pub fn is_would_block(&self) -> bool {
        self.io_error()
            .is_some_and(|e| e.kind() == io::ErrorKind::WouldBlock)
    }
}

impl From<VerbsError> for na_core::NaError {
    /// Verbs failures seen through the NA API: device problems keep their
    /// full message (what to install, which ports exist); failed calls keep
    /// their OS error's kind in the source, whose text is the whole chain
    /// (the failed call and the OS error).
    fn from(e: VerbsError) -> Self {
        let message = na_core::ErrorChain(&e).to_string();
        match e.io_error() {
            Some(io) => na_core::NaError::Sys {
                op: "verbs",
                source: io::Error::new(io.kind(), message),
            },
            None => na_core::NaError::Plugin {
                plugin: "verbs",
                message,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::VerbsError;
    use na_core::{ErrorChain, NaError};
    use std::io;

    #[test]
    fn display_leaves_the_os_error_to_the_chain_and_na_error_keeps_the_chain() {
        let reg = || VerbsError::RegisterMemory {
            addr: 0x1000,
            len: 4096,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let os = io::Error::from_raw_os_error(libc::ENOMEM).to_string();
        let e = reg();
        assert!(!e.to_string().contains(&os), "{e}");
        assert_eq!(
            ErrorChain(&e).to_string(),
            format!("ibv_reg_mr(addr 0x1000, len 4096) failed: {os}")
        );
        // Through the NA API: the OS error's kind, and the whole chain once.
        let na = NaError::from(reg());
        let chain = ErrorChain(&na).to_string();
        assert!(
            matches!(&na, NaError::Sys { source, .. } if source.kind() == io::ErrorKind::OutOfMemory),
            "{na:?}"
        );
        assert_eq!(chain.matches(&os).count(), 1, "{chain}");
        assert!(
            chain.contains("ibv_reg_mr(addr 0x1000, len 4096) failed"),
            "{chain}"
        );
    }
}
