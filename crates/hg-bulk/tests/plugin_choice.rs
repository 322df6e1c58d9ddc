//! Which plugin a transfer goes through: the one its local handle was
//! exposed on (when it speaks the owner's scheme), and `start_batch` says
//! which, so that a caller cancels it there. Real sm plugins, two in one
//! endpoint, and an owner endpoint served by a thread of this process.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hg_bulk::{start_batch, start_batch_via, Bulk, BulkOp, Span, Started};
use na_core::{Access, Endpoint, OpId, ProgressMode};

mod common;
use common::add_sm;

#[test]
fn a_posted_transfer_names_the_plugin_of_its_local_handle() {
    let dir = std::env::temp_dir().join(format!("hg-bulk-plugin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    // The owner: exposes `data` and makes progress until told to stop.
    let (desc_tx, desc_rx) = std::sync::mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let owner = std::thread::spawn({
        let (dir, data, stop) = (dir.clone(), data.clone(), stop.clone());
        move || {
            let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
            let p = add_sm(&mut ep, &dir, true);
            let exposed = Bulk::expose(&mut ep, p, vec![data], Access::ReadOnly).unwrap();
            desc_tx.send(exposed.desc().into_owned()).unwrap();
            while !stop.load(Ordering::Relaxed) {
                ep.progress(Some(Duration::from_millis(5))).unwrap();
                while ep.pop_completion().is_some() {}
            }
            drop(exposed);
        }
    });
    let remote = Bulk::from_desc(desc_rx.recv().unwrap()).unwrap();
    let mut ep = Endpoint::new(ProgressMode::Blocking).unwrap();
    let first = add_sm(&mut ep, &dir, false);
    let second = add_sm(&mut ep, &dir, false);
    for (round, via) in [second, first, second].into_iter().enumerate() {
        let local = Bulk::expose(&mut ep, via, vec![vec![0u8; 4096]], Access::ReadWrite).unwrap();
        let spans = [(
            Span {
                remote_offset: 100,
                local_offset: 10,
                len: 3000,
            },
            OpId(round as u64 + 1),
        )];
        let started = start_batch(&mut ep, BulkOp::Pull, &remote, &local, &spans).unwrap();
        assert_eq!(started, Started::Posted(via), "round {round}");
        let end = Instant::now() + Duration::from_secs(10);
        let done = loop {
            assert!(Instant::now() < end, "round {round}: no completion");
            ep.progress(Some(Duration::from_millis(5))).unwrap();
            if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == spans[0].1) {
                break c;
            }
        };
        done.status.unwrap();
        let got = local.into_buffers().unwrap().concat();
        assert_eq!(&got[10..3010], &data[100..3100], "round {round}");
    }
    // A source address stands for the owner only through the plugin the
    // transfer goes through: `first`'s address of the owner is not used
    // for a handle exposed on `second` (its own lookup is), `second`'s is.
    let of_first = ep.plugin_mut(first).unwrap().lookup(remote.owner()).unwrap();
    let of_second = ep.plugin_mut(second).unwrap().lookup(remote.owner()).unwrap();
    assert_eq!(of_first.uri(), remote.owner());
    for (round, via) in [(10u64, &of_first), (11, &of_second)] {
        let local = Bulk::expose(&mut ep, second, vec![vec![0u8; 64]], Access::ReadWrite).unwrap();
        let span = Span {
            remote_offset: 0,
            local_offset: 0,
            len: 64,
        };
        let started = start_batch_via(
            &mut ep,
            BulkOp::Pull,
            &remote,
            &local,
            &[(span, OpId(round))],
            Some(via),
            None,
        )
        .unwrap();
        assert_eq!(started, Started::Posted(second), "round {round}");
        let end = Instant::now() + Duration::from_secs(10);
        let done = loop {
            assert!(Instant::now() < end, "round {round}: no completion");
            ep.progress(Some(Duration::from_millis(5))).unwrap();
            if let Some(c) = std::iter::from_fn(|| ep.pop_completion()).find(|c| c.op == OpId(round)) {
                break c;
            }
        };
        done.status.unwrap();
        assert_eq!(
            local.into_buffers().unwrap().concat(),
            data[..64],
            "round {round}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    owner.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
