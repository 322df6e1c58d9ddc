//! Devices and device contexts: `ibv_get_device_list(3)`, `ibv_open_device(3)`,
//! `ibv_query_device(3)`, `ibv_query_port(3)`, `ibv_query_gid(3)`.

use std::io;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::*;

use super::{c_array_to_string, errno_rc, null_error, CmId};
use crate::error::{Result, VerbsError};

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that rdma-sys does not export).
const LINK_LAYER_ETHERNET: u8 = 2;

/// Name and identity of one RDMA device, as listed by libibverbs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// Kernel device name (`rxe0`, `mlx5_0`, ...).
    pub name: String,
    /// Node GUID in host byte order.
    pub guid: u64,
}

/// The device list of libibverbs; freed on drop (`ibv_free_device_list`).
struct DeviceList {
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList> {
        let mut n: libc::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the returned array is owned by us
        // until ibv_free_device_list (in Drop).
        let raw = unsafe { ibv_get_device_list(&mut n) };
        match NonNull::new(raw) {
            Some(list) => Ok(DeviceList {
                list,
                len: n.max(0) as usize,
            }),
            None => {
                let e = null_error();
                // ENOSYS: the kernel has no uverbs support at all.
                if e.raw_os_error() == Some(libc::ENOSYS) {
                    Err(VerbsError::NoDevice {
                        reason: no_device_reason(Some(&e)),
                    })
                } else {
                    Err(VerbsError::DeviceList { source: e })
                }
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = NonNull<ibv_device>> + '_ {
        (0..self.len).filter_map(move |i| {
            // SAFETY: the array holds `len` valid entries (plus a NULL terminator)
            // and lives as long as `self`.
            NonNull::new(unsafe { *self.list.as_ptr().add(i) })
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(self.list.as_ptr()) };
    }
}

fn device_info(dev: NonNull<ibv_device>) -> DeviceInfo {
    // SAFETY: `dev` is an entry of a live device list; `name` is a fixed array.
    let name = c_array_to_string(unsafe { &(*dev.as_ptr()).name });
    // SAFETY: as above; ibv_get_device_guid only reads sysfs for this device.
    let guid = u64::from_be(unsafe { ibv_get_device_guid(dev.as_ptr()) });
    DeviceInfo { name, guid }
}

/// Explains why no device is visible, from what sysfs and /dev show.
fn no_device_reason(err: Option<&io::Error>) -> String {
    let sys = Path::new("/sys/class/infiniband");
    let kernel_devs: Vec<String> = std::fs::read_dir(sys)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    let mut reason = match err {
        Some(e) => format!("ibv_get_device_list: {e}; "),
        None => String::from("libibverbs lists 0 devices; "),
    };
    if kernel_devs.is_empty() {
        reason.push_str(
            "the kernel has no RDMA device (/sys/class/infiniband is empty or missing: no RDMA \
             driver loaded, or no CONFIG_INFINIBAND)",
        );
    } else {
        reason.push_str(&format!(
            "the kernel has {} but libibverbs cannot use it: the user-space provider \
             (package `ibverbs-providers`) is missing or /dev/infiniband/uverbs* is not accessible",
            kernel_devs.join(", ")
        ));
    }
    reason
}

/// Lists the RDMA devices of this host.
///
/// Returns [`VerbsError::NoDevice`] (with what to install or load) when there is none.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let list = DeviceList::get()?;
    let out: Vec<DeviceInfo> = list.iter().map(device_info).collect();
    if out.is_empty() {
        return Err(VerbsError::NoDevice {
            reason: no_device_reason(None),
        });
    }
    Ok(out)
}

/// An open device context (`struct ibv_context`), the root of all verbs objects.
pub struct Context {
    raw: NonNull<ibv_context>,
    name: String,
    /// `None`: opened by us and closed on drop. `Some(id)`: the context that
    /// librdmacm opened for the device of `id`; librdmacm owns and closes it,
    /// and keeping `id` alive keeps its device reference count above zero.
    cm_owner: Option<Arc<CmId>>,
}

// SAFETY: libibverbs contexts are thread-safe (all verbs on one context may be
// called concurrently); the pointer is only dereferenced through libibverbs.
unsafe impl Send for Context {}
// SAFETY: see `Send`; `&Context` exposes only thread-safe verbs.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device named `name`, or the first device when `name` is `None`.
    pub fn open(name: Option<&str>) -> Result<Arc<Context>> {
        let list = DeviceList::get()?;
        let all: Vec<(NonNull<ibv_device>, DeviceInfo)> = list.iter().map(|d| (d, device_info(d))).collect();
        if all.is_empty() {
            return Err(VerbsError::NoDevice {
                reason: no_device_reason(None),
            });
        }
        let (dev, info) = match name {
            None => &all[0],
            Some(n) => all
                .iter()
                .find(|(_, i)| i.name == n)
                .ok_or_else(|| VerbsError::DeviceNotFound {
                    name: n.to_owned(),
                    available: all
                        .iter()
                        .map(|(_, i)| i.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                })?,
        };
        // SAFETY: `dev` is an entry of the live list; the opened context stays
        // valid after the list is freed (ibv_open_device(3)).
        let raw = unsafe { ibv_open_device(dev.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| VerbsError::OpenDevice {
            device: info.name.clone(),
            source: null_error(),
        })?;
        tracing::debug!(device = %info.name, "opened RDMA device");
        Ok(Arc::new(Context {
            raw,
            name: info.name.clone(),
            cm_owner: None,
        }))
    }

    /// Wraps the context librdmacm uses for the device `id` is bound to.
    pub(crate) fn from_cm_id(raw: NonNull<ibv_context>, id: Arc<CmId>) -> Arc<Context> {
        // SAFETY: `raw` is `id->verbs`, a live context owned by librdmacm; its
        // `device` pointer and name array are valid while the context is.
        let name = c_array_to_string(unsafe { &(*(*raw.as_ptr()).device).name });
        Arc::new(Context {
            raw,
            name,
            cm_owner: Some(id),
        })
    }

    /// The raw `ibv_context` (for the sys layer's own use).
    pub(crate) fn as_ptr(&self) -> *mut ibv_context {
        self.raw.as_ptr()
    }

    /// Device name (`rxe0`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Device capabilities (`ibv_query_device`).
    pub fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: ibv_device_attr is plain old data; all-zero is a valid value.
        let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is live and `a` is a valid out-pointer.
        errno_rc(unsafe { ibv_query_device(self.as_ptr(), &mut a) }).map_err(|source| VerbsError::Query {
            op: "ibv_query_device",
            context: self.name.clone(),
            source,
        })?;
        let nn = |v: libc::c_int| v.max(0) as u32;
        Ok(DeviceAttr {
            fw_ver: c_array_to_string(&a.fw_ver),
            max_mr_size: a.max_mr_size,
            max_qp: nn(a.max_qp),
            max_qp_wr: nn(a.max_qp_wr),
            max_sge: nn(a.max_sge),
            max_sge_rd: nn(a.max_sge_rd),
            max_cq: nn(a.max_cq),
            max_cqe: nn(a.max_cqe),
            max_mr: nn(a.max_mr),
            max_pd: nn(a.max_pd),
            max_qp_rd_atom: nn(a.max_qp_rd_atom),
            max_qp_init_rd_atom: nn(a.max_qp_init_rd_atom),
            max_srq: nn(a.max_srq),
            max_srq_wr: nn(a.max_srq_wr),
            max_srq_sge: nn(a.max_srq_sge),
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    /// Port attributes (`ibv_query_port`); ports are numbered from 1.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        // SAFETY: ibv_port_attr is plain old data; all-zero is a valid value.
        let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is live and `a` is a valid, correctly sized out-pointer.
        errno_rc(unsafe { ___ibv_query_port(self.as_ptr(), port, &mut a) }).map_err(|source| {
            VerbsError::Query {
                op: "ibv_query_port",
                context: format!("{} port {port}", self.name),
                source,
            }
        })?;
        Ok(PortAttr {
            active: a.state == ibv_port_state::IBV_PORT_ACTIVE,
            active_mtu: 128u32 << a.active_mtu.clamp(1, 5),
            max_msg_sz: a.max_msg_sz,
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
            lid: a.lid,
            is_ethernet: a.link_layer == LINK_LAYER_ETHERNET,
        })
    }

    /// GID `index` of `port` (`ibv_query_gid`).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        // SAFETY: ibv_gid is a 16-byte union of plain data; all-zero is valid.
        let mut g: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is live and `g` is a valid out-pointer.
        errno_rc(unsafe { ibv_query_gid(self.as_ptr(), port, index as libc::c_int, &mut g) }).map_err(
            |source| VerbsError::Query {
                op: "ibv_query_gid",
                context: format!("{} port {port} index {index}", self.name),
                source,
            },
        )?;
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(Gid(unsafe { g.raw }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if self.cm_owner.is_none() {
            // SAFETY: we opened this context, every child holds an Arc to it,
            // so none is left; closed exactly once.
            let rc = unsafe { ibv_close_device(self.raw.as_ptr()) };
            if rc != 0 {
                tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
            }
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name)
            .field("from_cm", &self.cm_owner.is_some())
            .finish()
    }
}

/// Device limits, from `ibv_query_device` (negative values read as 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Largest registrable region in bytes.
    pub max_mr_size: u64,
    /// Maximum number of QPs.
    pub max_qp: u32,
    /// Maximum outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Maximum scatter/gather entries per send/recv work request.
    pub max_sge: u32,
    /// Maximum scatter/gather entries per RDMA READ.
    pub max_sge_rd: u32,
    /// Maximum number of CQs.
    pub max_cq: u32,
    /// Maximum entries per CQ.
    pub max_cqe: u32,
    /// Maximum number of memory regions.
    pub max_mr: u32,
    /// Maximum number of protection domains.
    pub max_pd: u32,
    /// Maximum outstanding RDMA READ/atomic as target, per QP.
    pub max_qp_rd_atom: u32,
    /// Maximum outstanding RDMA READ/atomic as initiator, per QP.
    pub max_qp_init_rd_atom: u32,
    /// Maximum number of SRQs.
    pub max_srq: u32,
    /// Maximum work requests per SRQ.
    pub max_srq_wr: u32,
    /// Maximum SGEs per SRQ work request.
    pub max_srq_sge: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

/// Port state and limits, from `ibv_query_port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    /// The port is `PORT_ACTIVE`.
    pub active: bool,
    /// Active MTU in bytes (256..4096).
    pub active_mtu: u32,
    /// Largest message size.
    pub max_msg_sz: u32,
    /// Number of GID table entries.
    pub gid_tbl_len: u32,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// Link layer is Ethernet (RoCE) rather than InfiniBand.
    pub is_ethernet: bool,
}

/// A 128-bit GID, in network byte order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`, RoCEv2), if it is one.
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        let g = &self.0;
        (g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff)
            .then(|| std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_ipv4_mapping() {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&[10, 77, 0, 1]);
        assert_eq!(Gid(g).ipv4(), Some(std::net::Ipv4Addr::new(10, 77, 0, 1)));
        g[0] = 0xfe;
        assert_eq!(Gid(g).ipv4(), None, "a link-local GID is not IPv4-mapped");
    }

    #[test]
    fn no_device_error_says_what_to_install() {
        let msg = VerbsError::NoDevice {
            reason: no_device_reason(None),
        }
        .to_string();
        for needle in [
            "no RDMA device found",
            "ibverbs-providers",
            "modprobe rdma_rxe",
            "rdma link add",
        ] {
            assert!(msg.contains(needle), "missing `{needle}` in: {msg}");
        }
    }
}
