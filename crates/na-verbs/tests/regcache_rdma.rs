//! The registration cache with the real `ibv_reg_mr` registrar, proven with
//! real RDMA on the soft-RoCE device: a buffer is registered through the
//! cache, then its address range is remapped (free and re-mmap at the same
//! address, mremap away and re-mmap, madvise DONTNEED), then looked up again
//! and used for an RDMA READ (the device writes into the registration's
//! pages) and an RDMA WRITE (the device reads them). With monitor `none` the
//! cache hands back the old registration and the transfers hit the old
//! pages: the test sees stale data, proof that it can fail. With `uffd` the
//! cache must never do so.
//!
//! Without an RDMA device the RDMA part cannot run: the test says so loudly
//! and asserts that opening a device fails with the clear "no RDMA device" error.

mod common;

use std::sync::Arc;

use common::*;
use na_regcache::{Access, Cache, CacheConfig, MonitorChoice};
use na_verbs::sys::*;

const LEN: usize = 4 * 4096;

/// mmap/munmap/mremap/madvise for the scenarios (the calls themselves in
/// `common::sys`).
mod mm {
    use super::common::sys;

    pub fn map(at: Option<usize>, len: usize) -> usize {
        let p = sys::mmap_anon(at, len);
        assert_ne!(p, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        if let Some(a) = at {
            assert_eq!(p as usize, a, "mmap did not map at the hinted address");
        }
        p as usize
    }

    pub fn unmap(addr: usize, len: usize) {
        assert_eq!(sys::munmap(addr, len), 0);
    }

    /// Moves the pages at `from` to a new address and returns it.
    pub fn remap_away(from: usize, len: usize) -> usize {
        let to = map(None, len);
        let p = sys::mremap_fixed(from, len, to);
        assert_eq!(p as usize, to, "mremap: {}", std::io::Error::last_os_error());
        to
    }

    pub fn dontneed(addr: usize, len: usize) {
        assert_eq!(sys::madvise_dontneed(addr, len), 0);
    }

    pub fn fill(addr: usize, len: usize, byte: u8) {
        sys::fill(addr, len, byte)
    }

    pub fn read(addr: usize, len: usize) -> Vec<u8> {
        sys::read(addr, len)
    }
}

#[derive(Clone, Copy, Debug)]
enum Change {
    FreeAndRemapSameAddress,
    MremapAwayAndRemap,
    MadviseDontneed,
}

/// A loopback RC pair: `qp` reads from and writes to `remote` (on `peer`).
struct Rig {
    pd: Arc<ProtectionDomain>,
    comp: Arc<CompletionChannel>,
    cq: Arc<CompletionQueue>,
    qp: QueuePair,
    _peer: QueuePair,
    remote: MemoryRegion,
}

fn rig(env: &RdmaEnv) -> Rig {
    let ctx = Context::open(Some(&env.device)).expect("open device");
    let port = ctx.query_port(1).expect("query_port");
    let gid_index = (0..port.gid_tbl_len.min(16))
        .find(|&i| ctx.query_gid(1, i).ok().and_then(|g| g.ipv4()) == Some(env.ip))
        .expect("an IPv4-mapped GID for the rxe address");
    let gid = ctx.query_gid(1, gid_index).expect("query_gid");
    let pd = ProtectionDomain::new(&ctx).expect("pd");
    let comp = CompletionChannel::new(&ctx).expect("completion channel");
    let cq = CompletionQueue::new(&ctx, 16, Some(&comp)).expect("cq");
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let attr = QpInitAttr {
        send_cq: &cq,
        recv_cq: &cq,
        srq: None,
        caps,
    };
    let qp = QueuePair::new_rc(&pd, attr).expect("qp");
    let attr = QpInitAttr {
        send_cq: &cq,
        recv_cq: &cq,
        srq: None,
        caps,
    };
    let peer = QueuePair::new_rc(&pd, attr).expect("peer qp");
    for q in [&qp, &peer] {
        q.to_init(1, AccessFlags::ALL_RMA).expect("to INIT");
    }
    let rtr = |dest: &QueuePair| RtrAttr {
        dest_qp_num: dest.qp_num(),
        rq_psn: 7,
        path_mtu: port.active_mtu,
        dgid: gid,
        sgid_index: gid_index as u8,
        port: 1,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
    };
    let rts = RtsAttr {
        sq_psn: 7,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
    };
    qp.to_rtr(&rtr(&peer)).expect("RTR");
    peer.to_rtr(&rtr(&qp)).expect("peer RTR");
    qp.to_rts(&rts).expect("RTS");
    peer.to_rts(&rts).expect("peer RTS");
    let remote = MemoryRegion::allocate(&pd, LEN, AccessFlags::ALL_RMA).expect("remote mr");
    Rig {
        pd,
        comp,
        cq,
        qp,
        _peer: peer,
        remote,
    }
}

/// What one scenario observed.
#[derive(Debug, Default, PartialEq, Eq)]
struct Seen {
    /// The RDMA READ's data did not appear at the buffer's address.
    stale_read: bool,
    /// The RDMA WRITE did not carry what the buffer's address holds now.
    stale_write: bool,
}

fn scenario(r: &Rig, cache: &Cache<IbvRegistrar>, change: Change, round: u8) -> Seen {
    let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let a = mm::map(None, LEN);
    mm::fill(a, LEN, 0x11);
    drop(cache.get(a, LEN, access).expect("first registration"));
    let mut leftovers = Vec::new();
    match change {
        Change::FreeAndRemapSameAddress => {
            mm::unmap(a, LEN);
            mm::map(Some(a), LEN);
        }
        Change::MremapAwayAndRemap => {
            leftovers.push(mm::remap_away(a, LEN));
            mm::map(Some(a), LEN);
        }
        Change::MadviseDontneed => mm::dontneed(a, LEN),
    }
    mm::fill(a, LEN, 0xEE);
    let reg = cache.get(a, LEN, access).expect("second lookup");
    let sge = reg
        .region()
        .sge(a - reg.region().addr() as usize, LEN)
        .expect("sge");
    // RDMA READ: the device writes the remote pattern into the registration's pages.
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7) as u8 ^ round).collect();
    r.remote.write_at(0, &pattern).expect("fill remote");
    let region = r.remote.remote(0, LEN).expect("remote region");
    r.qp.post_send(1, SendOp::RdmaRead(region), &[sge], true)
        .expect("post READ");
    assert_ok(&wait_wc(&r.cq, &r.comp, 1, "read"), "read");
    let stale_read = mm::read(a, LEN) != pattern;
    // RDMA WRITE: the device sends what the registration's pages hold.
    let now: Vec<u8> = (0..LEN).map(|i| (i * 13) as u8 ^ round).collect();
    mm::fill(a, LEN, 0);
    common::sys::write(a, &now[..LEN]);
    r.qp.post_send(2, SendOp::RdmaWrite(region), &[sge], true)
        .expect("post WRITE");
    assert_ok(&wait_wc(&r.cq, &r.comp, 1, "write"), "write");
    let mut sent = vec![0u8; LEN];
    r.remote.read_at(0, &mut sent).expect("read remote");
    let stale_write = sent != now;
    drop(reg);
    mm::unmap(a, LEN);
    for l in leftovers {
        mm::unmap(l, LEN);
    }
    Seen {
        stale_read,
        stale_write,
    }
}

/// The scenarios unmap and re-map fixed addresses: one test at a time, or
/// the other test's mmap may take the address in between.
static ADDRESS_SPACE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(test: &str, monitor: MonitorChoice) -> Option<Vec<(Change, Seen)>> {
    let env = rdma_env(test)?;
    let _one_at_a_time = ADDRESS_SPACE.lock().unwrap_or_else(|p| p.into_inner());
    let r = rig(&env);
    let cfg = CacheConfig {
        monitor,
        ..CacheConfig::default()
    };
    // The cache only ever registers the scenario's own mappings, which the
    // test accesses only by raw copies (`mm::fill`/`mm::read`).
    let registrar = common::sys::ibv_registrar(&r.pd);
    let cache = Cache::new(registrar, cfg).expect("cache");
    let changes = [
        Change::FreeAndRemapSameAddress,
        Change::MremapAwayAndRemap,
        Change::MadviseDontneed,
    ];
    let seen: Vec<(Change, Seen)> = changes
        .iter()
        .enumerate()
        .map(|(i, &c)| (c, scenario(&r, &cache, c, i as u8)))
        .collect();
    eprintln!("{test}: {seen:?}; cache {}", cache.stats());
    Some(seen)
}

#[test]
fn monitor_none_shows_stale_registrations_with_real_rdma() {
    let Some(seen) = run(
        "monitor_none_shows_stale_registrations_with_real_rdma",
        MonitorChoice::None,
    ) else {
        return;
    };
    for (change, s) in seen {
        assert!(
            s.stale_read && s.stale_write,
            "{change:?}: monitor none must show stale data, saw {s:?}"
        );
    }
}

#[test]
fn monitor_uffd_never_uses_a_stale_registration_with_real_rdma() {
    let Some(seen) = run(
        "monitor_uffd_never_uses_a_stale_registration_with_real_rdma",
        MonitorChoice::Uffd,
    ) else {
        return;
    };
    for (change, s) in seen {
        assert_eq!(
            s,
            Seen::default(),
            "{change:?}: uffd let a stale registration through"
        );
    }
}
