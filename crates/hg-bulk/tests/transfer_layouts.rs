//! Transfers straddling segments on both sides,
//! forged descriptors, inline data, zero-length spans, access modes, and
//! a local handle exposed on another endpoint. Real sm plugins; the
//! owner is an endpoint on a thread of this process (so sm's self-process
//! checks are exercised too).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_bulk::{start_batch, Bulk, BulkDesc, BulkError, BulkOp, Span, Started};
use na_core::{Access, Endpoint, NaError, OpId, ProgressMode, RemoteMem};

mod common;
use common::add_sm;

use na_core::testing::TestRng;

/// Owner thread: exposes `handles`, sends their descriptors and a way to
/// read their contents, makes progress until stopped.
struct Owner {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    descs: Vec<BulkDesc>,
    /// Clones of the owner's memory, to compare against.
    mems: Vec<na_core::MemHandle>,
}

impl Owner {
    fn start(dir: &std::path::Path, handles: Vec<(Vec<Vec<u8>>, Access)>) -> Owner {
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let (dir, stop) = (dir.to_path_buf(), stop.clone());
            move || {
                let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
                let p = add_sm(&mut ep, &dir, true);
                let exposed: Vec<Bulk> = handles
                    .into_iter()
                    .map(|(b, a)| Bulk::expose(&mut ep, p, b, a).unwrap())
                    .collect();
                let out: Vec<(BulkDesc, na_core::MemHandle)> = exposed
                    .iter()
                    .map(|b| (b.desc().into_owned(), b.local().unwrap().clone()))
                    .collect();
                tx.send(out).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    ep.progress(Some(Duration::from_millis(5))).unwrap();
                    while ep.pop_completion().is_some() {}
                }
                drop(exposed);
            }
        });
        let (descs, mems) = rx.recv().unwrap().into_iter().unzip();
        Owner {
            stop,
            thread: Some(thread),
            descs,
            mems,
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("hg-bulk-layouts-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    dir
}

/// Starts `spans` and waits for their completions; returns their statuses.
fn run(
    ep: &mut Endpoint,
    op: BulkOp,
    remote: &Bulk,
    local: &Bulk,
    spans: &[(Span, OpId)],
) -> Result<Vec<Result<(), NaError>>, BulkError> {
    match start_batch(ep, op, remote, local, spans)? {
        Started::Done => Ok(spans.iter().map(|_| Ok(())).collect()),
        Started::Posted(_) => {
            let mut out: Vec<Option<Result<(), NaError>>> = spans.iter().map(|_| None).collect();
            let end = Instant::now() + Duration::from_secs(10);
            while out.iter().any(Option::is_none) {
                assert!(Instant::now() < end, "no completion");
                ep.progress(Some(Duration::from_millis(5))).unwrap();
                while let Some(c) = ep.pop_completion() {
                    if let Some(i) = spans.iter().position(|s| s.1 == c.op) {
                        out[i] = Some(c.status);
                    }
                }
            }
            Ok(out.into_iter().map(Option::unwrap).collect())
        }
    }
}

#[test]
fn straddling_spans_on_both_sides_match_a_model() {
    let dir = dir("straddle");
    let mut r = TestRng::new(1);
    let rlens = [7usize, 0, 13, 100, 1, 50, 0, 29];
    let rbufs: Vec<Vec<u8>> = rlens
        .iter()
        .map(|&l| (0..l).map(|_| r.next_u64() as u8).collect())
        .collect();
    let owner = Owner::start(&dir, vec![(rbufs.clone(), Access::ReadWrite)]);
    let remote = Bulk::from_desc(owner.descs[0].clone()).unwrap();
    let mut rmodel = rbufs.concat();
    let rsize = rmodel.len() as u64;
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let p = add_sm(&mut ep, &dir, false);
    let llens = [3usize, 40, 0, 90, 38, 1, 28];
    let lbufs: Vec<Vec<u8>> = llens
        .iter()
        .map(|&l| (0..l).map(|_| r.next_u64() as u8).collect())
        .collect();
    let mut lmodel = lbufs.concat();
    let lsize = lmodel.len() as u64;
    let local = Bulk::expose(&mut ep, p, lbufs, Access::ReadWrite).unwrap();
    let mut id = 0u64;
    for round in 0..300 {
        let op = if r.below(2) == 0 {
            BulkOp::Pull
        } else {
            BulkOp::Push
        };
        // Spans of one batch that do not overlap on the destination side
        // (the order of a batch's transfers is unspecified).
        let n = 1 + r.below(4) as usize;
        let mut spans = Vec::new();
        let mut taken: Vec<(u64, u64)> = Vec::new();
        while spans.len() < n {
            let len = r.below(60);
            let ro = r.below(rsize - len + 1);
            let lo = r.below(lsize - len + 1);
            let dst = if op == BulkOp::Pull { lo } else { ro };
            if taken.iter().any(|&(a, l)| dst < a + l && a < dst + len) {
                continue;
            }
            taken.push((dst, len));
            id += 1;
            spans.push((
                Span {
                    remote_offset: ro,
                    local_offset: lo,
                    len,
                },
                OpId(id),
            ));
        }
        let st = run(&mut ep, op, &remote, &local, &spans).unwrap();
        for s in &st {
            s.as_ref().unwrap();
        }
        // The model: all sources read before any destination is written
        // (sources and destinations are in different handles).
        let (rsnap, lsnap) = (rmodel.clone(), lmodel.clone());
        for (s, _) in &spans {
            let (ro, lo, len) = (s.remote_offset as usize, s.local_offset as usize, s.len as usize);
            match op {
                BulkOp::Pull => lmodel[lo..lo + len].copy_from_slice(&rsnap[ro..ro + len]),
                BulkOp::Push => rmodel[ro..ro + len].copy_from_slice(&lsnap[lo..lo + len]),
            }
        }
        assert_eq!(local.local().unwrap().to_vec(), lmodel, "round {round} local");
        assert_eq!(owner.mems[0].to_vec(), rmodel, "round {round} remote");
    }
    // Zero-length spans at the very end of both handles.
    id += 1;
    let z = [(
        Span {
            remote_offset: rsize,
            local_offset: lsize,
            len: 0,
        },
        OpId(id),
    )];
    for op in [BulkOp::Pull, BulkOp::Push] {
        let st = run(&mut ep, op, &remote, &local, &z).unwrap();
        assert!(st[0].is_ok(), "{op:?} zero-length at the end: {:?}", st[0]);
    }
    // One past the end: refused, nothing moves.
    let past = [(
        Span {
            remote_offset: rsize,
            local_offset: 0,
            len: 1,
        },
        OpId(id + 1),
    )];
    assert!(run(&mut ep, BulkOp::Pull, &remote, &local, &past).is_err());
    drop(owner);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn forged_and_mismatched_descriptors() {
    let dir = dir("forged");
    let owner = Owner::start(
        &dir,
        vec![
            (vec![vec![1u8; 2000], vec![2u8; 100]], Access::ReadOnly),
            (vec![vec![3u8; 5], vec![4u8; 7]], Access::ReadOnly), // inline
            (vec![vec![5u8; 64]], Access::WriteOnly),
        ],
    );
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let p = add_sm(&mut ep, &dir, false);
    let local = Bulk::expose(&mut ep, p, vec![vec![9u8; 3000]], Access::ReadWrite).unwrap();
    // 1. A read-only handle whose access a third party flipped to
    //    read-write: a push into it must not write the owner's memory.
    let mut flipped = owner.descs[0].clone();
    assert!(flipped.inline.is_none());
    flipped.mem[3] = 3;
    let forged = Bulk::from_desc(flipped).expect("decodes: the bytes are well-formed");
    assert_eq!(forged.access(), Access::ReadWrite);
    let span = [(
        Span {
            remote_offset: 1990,
            local_offset: 0,
            len: 20,
        },
        OpId(1),
    )];
    let r = run(&mut ep, BulkOp::Push, &forged, &local, &span);
    println!("push into a flipped read-only handle: {r:?}");
    assert!(r.is_err() || r.as_ref().unwrap()[0].is_err());
    assert_eq!(
        owner.mems[0].to_vec()[1990..2010],
        [1u8; 10]
            .iter()
            .chain([2u8; 10].iter())
            .copied()
            .collect::<Vec<_>>()[..]
    );
    // 2. One segment forged to span both of the owner's segments (they
    //    are separate allocations): refused.
    let rm = RemoteMem::from_bytes(&owner.descs[0].mem).unwrap();
    let segs = rm.segments().to_vec();
    let mut joined = segs.clone();
    joined[0].len += 100;
    joined.truncate(1);
    let jm = RemoteMem::new(joined, Access::ReadOnly).unwrap();
    let jd = BulkDesc {
        mem: serde_bytes::ByteBuf::from(jm.to_bytes()),
        ..owner.descs[0].clone()
    };
    let jb = Bulk::from_desc(jd).unwrap();
    let span = [(
        Span {
            remote_offset: 1990,
            local_offset: 0,
            len: 20,
        },
        OpId(2),
    )];
    let r = run(&mut ep, BulkOp::Pull, &jb, &local, &span);
    println!("pull across a forged joined segment: {r:?}");
    // 3. Inline: straddling pull served from the inline bytes.
    let inl = &owner.descs[1];
    assert_eq!(
        inl.inline.as_deref().map(|v| v.to_vec()),
        Some([vec![3u8; 5], vec![4u8; 7]].concat())
    );
    let ib = Bulk::from_desc(inl.clone()).unwrap();
    let span = [(
        Span {
            remote_offset: 3,
            local_offset: 2990,
            len: 6,
        },
        OpId(3),
    )];
    assert_eq!(
        start_batch(&mut ep, BulkOp::Pull, &ib, &local, &span).unwrap(),
        Started::Done
    );
    assert_eq!(local.local().unwrap().to_vec()[2990..2996], [3, 3, 4, 4, 4, 4]);
    let mut short = inl.clone();
    short.inline.as_mut().unwrap().pop();
    assert!(Bulk::from_desc(short).is_err());
    let mut long = inl.clone();
    long.inline.as_mut().unwrap().push(0);
    assert!(Bulk::from_desc(long).is_err());
    // Push into the inline (read-only) handle: refused.
    let span = [(
        Span {
            remote_offset: 0,
            local_offset: 0,
            len: 4,
        },
        OpId(4),
    )];
    assert!(matches!(
        start_batch(&mut ep, BulkOp::Push, &ib, &local, &span),
        Err(BulkError::Na(NaError::AccessDenied { what: "remote", .. }))
    ));
    // 4. Write-only remote: pull refused, push allowed.
    let wo = Bulk::from_desc(owner.descs[2].clone()).unwrap();
    let span = [(
        Span {
            remote_offset: 0,
            local_offset: 0,
            len: 4,
        },
        OpId(5),
    )];
    assert!(matches!(
        start_batch(&mut ep, BulkOp::Pull, &wo, &local, &span),
        Err(BulkError::Na(NaError::AccessDenied { what: "remote", .. }))
    ));
    let st = run(&mut ep, BulkOp::Push, &wo, &local, &[(span[0].0, OpId(6))]).unwrap();
    st[0].as_ref().unwrap();
    assert_eq!(owner.mems[2].to_vec()[..4], [9, 9, 9, 9]);
    // Write-only remote flipped to read-write: pull must not read it.
    let mut wflip = owner.descs[2].clone();
    wflip.mem[3] = 3;
    let wf = Bulk::from_desc(wflip).unwrap();
    let r = run(&mut ep, BulkOp::Pull, &wf, &local, &[(span[0].0, OpId(7))]);
    println!("pull from a flipped write-only handle: {r:?}");
    assert!(r.is_err() || r.as_ref().unwrap()[0].is_err());
    // 5. Local write-only handle: push from it refused; pull into it fine.
    let lwo = Bulk::expose(&mut ep, p, vec![vec![0u8; 16]], Access::WriteOnly).unwrap();
    let rb = Bulk::from_desc(owner.descs[0].clone()).unwrap();
    assert!(matches!(
        start_batch(&mut ep, BulkOp::Push, &wo, &lwo, &[(span[0].0, OpId(8))]),
        Err(BulkError::Na(NaError::AccessDenied { what: "local", .. }))
    ));
    let st = run(&mut ep, BulkOp::Pull, &rb, &lwo, &[(span[0].0, OpId(9))]).unwrap();
    st[0].as_ref().unwrap();
    drop(owner);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A local handle exposed on another endpoint of this process (another
/// engine's), used as the local side of a transfer on this one.
#[test]
fn local_handle_of_another_endpoint() {
    let dir = dir("foreign");
    let owner = Owner::start(&dir, vec![(vec![vec![7u8; 4096]], Access::ReadOnly)]);
    let remote = Bulk::from_desc(owner.descs[0].clone()).unwrap();
    let mut other = Endpoint::new(ProgressMode::Blocking).unwrap();
    let po = add_sm(&mut other, &dir, false);
    let foreign = Bulk::expose(&mut other, po, vec![vec![0u8; 4096]], Access::ReadWrite).unwrap();
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let _p = add_sm(&mut ep, &dir, false);
    let span = [(
        Span {
            remote_offset: 0,
            local_offset: 0,
            len: 4096,
        },
        OpId(1),
    )];
    let r = run(&mut ep, BulkOp::Pull, &remote, &foreign, &span);
    drop(owner);
    let _ = std::fs::remove_dir_all(&dir);
    let st = r.expect("a handle of this process exposed elsewhere works as the local side");
    assert!(st[0].is_ok(), "the pull failed: {:?}", st[0]);
    assert_eq!(
        foreign.local().unwrap().to_vec(),
        vec![7u8; 4096],
        "the pulled data"
    );
}

/// More buffers than a descriptor may name are refused at expose with an
/// error that says so (it used to read as a malformed descriptor); the
/// most a descriptor may name is exposed.
#[test]
fn exposing_more_segments_than_a_descriptor_names_is_refused_clearly() {
    let dir = dir("segments");
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let p = add_sm(&mut ep, &dir, false);
    let max = na_core::MAX_REMOTE_SEGMENTS;
    let err = Bulk::expose(&mut ep, p, vec![Vec::new(); max + 1], Access::ReadOnly).unwrap_err();
    assert!(
        matches!(err, BulkError::TooManySegments { count, max: m } if count == max + 1 && m == max),
        "{err:?}"
    );
    let most = Bulk::expose(&mut ep, p, vec![vec![1u8]; max], Access::ReadOnly).unwrap();
    assert_eq!(most.local().unwrap().to_vec().len(), max);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A batch that names one id twice is refused whole, with the same error,
/// whichever way it would go: an RMA batch through the plugin, a copy in
/// memory (the "remote" handle was exposed by this process) and a pull of
/// inline data. Nothing moves; the same spans under distinct ids then go
/// the way they were meant to (so each case did reach its path).
#[test]
fn a_batch_naming_one_id_twice_is_refused_on_every_path() {
    let dir = dir("dup-ids");
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 5) as u8).collect();
    let owner = Owner::start(
        &dir,
        vec![
            (vec![data.clone()], Access::ReadWrite),
            (vec![data[..24].to_vec()], Access::ReadOnly),
        ],
    );
    let by_rma = Bulk::from_desc(owner.descs[0].clone()).unwrap();
    let inline = Bulk::from_desc(owner.descs[1].clone()).unwrap();
    assert!(
        owner.descs[1].inline.is_some(),
        "small read-only data travels inline"
    );
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let p = add_sm(&mut ep, &dir, true);
    let here = Bulk::expose(&mut ep, p, vec![data.clone()], Access::ReadWrite).unwrap();
    let span = |at: u64| Span {
        remote_offset: at,
        local_offset: at,
        len: 8,
    };
    let twice = [(span(0), OpId(7)), (span(8), OpId(8)), (span(16), OpId(7))];
    let distinct = [(span(0), OpId(7)), (span(8), OpId(8)), (span(16), OpId(9))];
    let cases: [(&str, BulkOp, &Bulk, bool); 4] = [
        ("rma pull", BulkOp::Pull, &by_rma, false),
        ("copy in memory, pull", BulkOp::Pull, &here, true),
        ("copy in memory, push", BulkOp::Push, &here, true),
        ("inline pull", BulkOp::Pull, &inline, true),
    ];
    let mut errors = Vec::new();
    for (name, op, remote, done_at_once) in cases {
        let local = Bulk::expose(&mut ep, p, vec![vec![0u8; 64]], Access::ReadWrite).unwrap();
        let here_before = here.local().unwrap().to_vec();
        match start_batch(&mut ep, op, remote, &local, &twice) {
            Err(e @ BulkError::Na(NaError::OpInFlight(7))) => {
                errors.push(na_core::ErrorChain(&e).to_string())
            }
            other => panic!("{name}: expected the repeated id 7 refused, got {other:?}"),
        }
        assert!(
            local.local().unwrap().to_vec() == [0u8; 64],
            "{name}: bytes moved"
        );
        assert!(
            here.local().unwrap().to_vec() == here_before,
            "{name}: bytes moved"
        );
        let st = run(&mut ep, op, remote, &local, &distinct).unwrap();
        assert!(st.iter().all(Result::is_ok), "{name}: {st:?}");
        let started_at_once = !matches!(
            start_batch(&mut ep, op, remote, &local, &[(span(0), OpId(50))]),
            Ok(Started::Posted(_))
        );
        assert_eq!(started_at_once, done_at_once, "{name}: not the path meant");
        if !done_at_once {
            // Let the posted one finish before the handle goes.
            let end = Instant::now() + Duration::from_secs(10);
            while std::iter::from_fn(|| ep.pop_completion()).all(|c| c.op != OpId(50)) {
                assert!(Instant::now() < end, "{name}: no completion");
                ep.progress(Some(Duration::from_millis(5))).unwrap();
            }
        }
        let moved = match op {
            BulkOp::Pull => local.local().unwrap().to_vec(),
            BulkOp::Push => here.local().unwrap().to_vec(),
        };
        let want = match op {
            BulkOp::Pull => &data[..24],
            BulkOp::Push => &[0u8; 24][..],
        };
        assert!(
            moved[..24] == *want,
            "{name}: the distinct ids did not move the data"
        );
    }
    // Every path refuses the batch with the same error, cause and all (the
    // chain: `BulkError::Na`'s own message leaves the cause to `source()`).
    assert!(
        errors.len() == 4 && errors.windows(2).all(|w| w[0] == w[1]),
        "different errors: {errors:?}"
    );
    assert!(errors[0].contains('7'), "the chain names no op id: {errors:?}");
    drop(owner);
    let _ = std::fs::remove_dir_all(&dir);
}
