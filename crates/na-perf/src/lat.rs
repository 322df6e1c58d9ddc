//! `na-perf lat`: one-way message latency (round trip / 2) of the
//! shared-memory plugin, per progress mode, message kind (expected,
//! unexpected, or `pulled`: unexpected on hg-rpc's pull path) and size, next to
//! the shared-memory flag floor (busy, adaptive) or the eventfd floor
//! (blocking).

use na_core::ProgressMode;

use crate::cli::{LatArgs, ModeArg, MsgKind};
use crate::error::Result;
use crate::floors;
use crate::report::{FloorKind, Floors, Record, Reporter, NS};
use crate::run::Setup;

/// Default message sizes.
pub const SIZES: [usize; 6] = [8, 64, 256, 1024, 2048, 4096];

/// The floor a mode is compared with.
pub fn floor_kind(mode: ProgressMode) -> FloorKind {
    match mode {
        ProgressMode::Blocking => FloorKind::EventFd,
        _ => FloorKind::ShmFlag,
    }
}

fn kind_name(k: MsgKind) -> &'static str {
    match k {
        MsgKind::Expected => "expected",
        MsgKind::Unexpected => "unexpected",
        MsgKind::Pulled => "pulled",
    }
}

/// Runs `na-perf lat`.
pub fn run(args: &LatArgs) -> Result<()> {
    let c = &args.common;
    let plan = c.plan();
    let modes = c.modes(&[ModeArg::Busy, ModeArg::Adaptive, ModeArg::Blocking]);
    let kinds = if args.kind.is_empty() {
        vec![MsgKind::Expected, MsgKind::Unexpected]
    } else {
        args.kind.clone()
    };
    let sizes = if c.sizes.is_empty() {
        SIZES.to_vec()
    } else {
        c.sizes.clone()
    };
    if kinds.contains(&MsgKind::Pulled) {
        if let Some(uri) = &c.peer {
            return Err(crate::error::PerfError::Arg {
                name: "--kind pulled",
                reason: format!("needs the peer process that na-perf starts itself; drop --peer {uri}"),
            });
        }
    }
    let mut setup = Setup::start(c)?;
    let mut rep = Reporter::new(c.json);
    let mut fl = Floors::default();
    if c.floors {
        let peer = setup.local_peer()?;
        for &size in &sizes {
            let s = floors::measure_shm_flag(peer, &plan, size)?;
            fl.insert(FloorKind::ShmFlag, size, 1, s.median_ns);
            rep.emit(&lat_record("floor_shm_flag_lat", "shm_flag", "busy", size, s))?;
            let s = floors::measure_eventfd(peer, &plan, size)?;
            fl.insert(FloorKind::EventFd, size, 1, s.median_ns);
            rep.emit(&lat_record("floor_eventfd_lat", "eventfd", "blocking", size, s))?;
        }
    }
    // Pulled pings need both sides in pull mode from the start: a session
    // of their own, after the others.
    let posted: Vec<MsgKind> = kinds.iter().copied().filter(|&k| k != MsgKind::Pulled).collect();
    let groups = [(false, posted), (true, vec![MsgKind::Pulled])];
    for (pull, group) in groups {
        if !kinds.iter().any(|k| group.contains(k)) {
            continue;
        }
        let mut session = setup.connect(modes[0], pull)?;
        run_session(&mut session, &modes, &group, &sizes, &plan, &fl, &mut rep)?;
        setup.end_session(session)?;
    }
    Ok(())
}

/// Every ping-pong of `kinds` in one session, for each mode and size.
fn run_session(
    session: &mut crate::sm_client::Session,
    modes: &[ProgressMode],
    kinds: &[MsgKind],
    sizes: &[usize],
    plan: &crate::stats::Plan,
    fl: &Floors,
    rep: &mut Reporter,
) -> Result<()> {
    for &mode in modes {
        session.set_mode(mode)?;
        for &kind in kinds {
            let max = session.max_size(kind)?;
            session.start_pings(kind)?;
            for &size in sizes {
                if size > max {
                    eprintln!(
                        "na-perf: skipping {} messages of {size} B: the plugin's limit is {max} B",
                        kind_name(kind)
                    );
                    continue;
                }
                let data = vec![0xabu8; size];
                let s = crate::stats::measure(plan, || session.ping(kind, &data))?.scaled(2.0);
                let mode_name = mode.to_string();
                let r = lat_record("lat", kind_name(kind), &mode_name, size, s);
                rep.emit(&r.with_floor(fl.get(floor_kind(mode), size, 1)))?;
            }
            session.stop_pings(kind)?;
        }
    }
    Ok(())
}

fn lat_record(test: &str, op: &str, mode: &str, size: usize, s: crate::stats::Summary) -> Record {
    Record {
        test: test.into(),
        op: op.into(),
        mode: mode.into(),
        size,
        segments: 1,
        median: s.median_ns,
        p99: s.p99_ns,
        p50: s.p50_ns,
        unit: NS,
        floor: None,
        ratio_to_floor: None,
        iters: s.iters,
    }
}
