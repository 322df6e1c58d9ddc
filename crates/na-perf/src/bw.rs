//! `na-perf bw`: put and get bandwidth of the shared-memory plugin per
//! transfer size and segment count (both handles split into the same number
//! of segments), next to the `process_vm_readv` (get) and `process_vm_writev`
//! (put) floors with as many iovecs.

use na_core::{Access, MemHandle};

use crate::cli::{BwArgs, ModeArg, RmaOp};
use crate::error::{PerfError, Result};
use crate::floors::{self, alloc_segments};
use crate::report::{FloorKind, Floors, Record, Reporter, MIB_S};
use crate::run::Setup;
use crate::stats::{measure, mib_per_s, Summary};
use crate::sys::cma::CmaDir;

/// The floor of each operation: a get is compared with `process_vm_readv`,
/// a put with `process_vm_writev`.
const FLOORS: [(CmaDir, FloorKind, &str, RmaOp); 2] = [
    (CmaDir::Read, FloorKind::CmaRead, "floor_cma_read_bw", RmaOp::Get),
    (
        CmaDir::Write,
        FloorKind::CmaWrite,
        "floor_cma_write_bw",
        RmaOp::Put,
    ),
];

/// Default transfer sizes: 4 KiB to 16 MiB.
pub const SIZES: [usize; 7] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20];

/// Runs `na-perf bw`.
pub fn run(args: &BwArgs) -> Result<()> {
    let c = &args.common;
    let plan = c.plan();
    let modes = c.modes(&[ModeArg::Adaptive]);
    let ops = if args.op.is_empty() {
        vec![RmaOp::Put, RmaOp::Get]
    } else {
        args.op.clone()
    };
    let sizes = if c.sizes.is_empty() {
        SIZES.to_vec()
    } else {
        c.sizes.clone()
    };
    if let Some(&bad) = args.segments.iter().find(|&&s| s == 0 || s > 1024) {
        return Err(PerfError::Arg {
            name: "--segments",
            reason: format!("{bad}: want 1 to 1024"),
        });
    }
    let mut setup = Setup::start(c)?;
    let mut rep = Reporter::new(c.json);
    let mut fl = Floors::default();
    if c.floors {
        let peer = setup.local_peer()?;
        for &segs in &args.segments {
            for &size in &sizes {
                for (dir, kind, test, op) in FLOORS {
                    if !ops.contains(&op) {
                        continue;
                    }
                    let s = floors::measure_cma(peer, &plan, dir, size, segs)?;
                    fl.insert(kind, size, segs, mib_per_s(size, s.median_ns));
                    let name = if dir == CmaDir::Read { "read" } else { "write" };
                    rep.emit(&bw_record(test, name, "n/a", size, segs, s))?;
                }
            }
        }
        // Free the floor buffers in the peer.
        peer.request("cma 0 1")?;
    }
    let mut session = setup.connect(modes[0], false)?;
    for &mode in &modes {
        session.set_mode(mode)?;
        for &segs in &args.segments {
            for &size in &sizes {
                let local = MemHandle::new(alloc_segments(size, segs, 0x77), Access::ReadWrite);
                session.register(&local)?;
                let remote = session.remote_mem(size, segs)?;
                for &op in &ops {
                    let s = measure(&plan, || session.rma(op, &local, &remote, size as u64))?;
                    let name = if op == RmaOp::Put { "put" } else { "get" };
                    let r = bw_record("bw", name, &mode.to_string(), size, segs, s);
                    let kind = if op == RmaOp::Put {
                        FloorKind::CmaWrite
                    } else {
                        FloorKind::CmaRead
                    };
                    rep.emit(&r.with_floor(fl.get(kind, size, segs)))?;
                }
            }
        }
    }
    setup.finish(session)
}

fn bw_record(test: &str, op: &str, mode: &str, size: usize, segments: usize, s: Summary) -> Record {
    Record {
        test: test.into(),
        op: op.into(),
        mode: mode.into(),
        size,
        segments,
        median: mib_per_s(size, s.median_ns),
        p99: mib_per_s(size, s.p99_ns),
        p50: mib_per_s(size, s.p50_ns),
        unit: MIB_S,
        floor: None,
        ratio_to_floor: None,
        iters: s.iters,
    }
}
