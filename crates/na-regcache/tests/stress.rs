//! Multithreaded stress: mutator threads unmap, remap, madvise, free and
//! reallocate buffers while transfer threads look them up and write through
//! the registrations. Per-buffer locks order each mutation before the next
//! transfer, so every transfer must see zero stale data or frames. Bounded
//! iterations; a watchdog turns a deadlock into a failure.

mod common;

use std::alloc::System;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::Duration;

use common::sys::{self, PAGE};
use common::Rig;
use na_regcache::{InvalidatingAlloc, MonitorChoice, UffdMonitor};

#[global_allocator]
static ALLOC: InvalidatingAlloc<System> = InvalidatingAlloc::new(System);

const BUFFERS: usize = 8;
const MUTATIONS: usize = 300;
const TRANSFERS: usize = 500;
const DEADLOCK_TIMEOUT: Duration = Duration::from_secs(90);

enum Buf {
    Map { addr: usize, len: usize },
    Heap(Vec<u8>),
}

impl Buf {
    fn range(&self) -> (usize, usize) {
        match self {
            Buf::Map { addr, len } => (*addr, *len),
            Buf::Heap(v) => (v.as_ptr() as usize, v.len()),
        }
    }
}

struct XorShift(u64);
impl XorShift {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn mutate_map(b: &mut Buf, rng: &mut XorShift) {
    let Buf::Map { addr, len } = b else { unreachable!() };
    match rng.next(4) {
        0 => {
            sys::unmap(*addr, *len).unwrap();
            // Same address when free, elsewhere otherwise.
            *addr = sys::map_anon(Some(*addr), *len)
                .or_else(|_| sys::map_anon(None, *len))
                .unwrap();
        }
        1 => sys::advise(*addr, *len, libc::MADV_DONTNEED).unwrap(),
        2 => {
            let to = sys::map_anon(None, *len).unwrap();
            sys::remap_to(*addr, *len, to).unwrap();
            *addr = sys::map_anon(Some(*addr), *len)
                .or_else(|_| sys::map_anon(None, *len))
                .unwrap();
            sys::unmap(to, *len).unwrap();
        }
        _ => sys::map_anon_overlay(*addr, *len).map(drop).unwrap(),
    }
    sys::touch(*addr, *len, 0xEE);
}

fn mutate_heap(b: &mut Buf, rng: &mut XorShift) {
    let Buf::Heap(v) = b else { unreachable!() };
    match rng.next(2) {
        0 => {
            let len = v.len();
            *v = Vec::new();
            *v = vec![0xEE; len];
        }
        _ => {
            v.reserve_exact(v.len() + PAGE);
            v.resize(v.capacity().min(1 << 20), 0xEE);
            v.truncate(256 << 10);
            v.shrink_to_fit();
        }
    }
}

fn stress(monitor: MonitorChoice) -> usize {
    common::require_io_uring();
    sys::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    let rig = Rig::new(monitor);
    let bufs: Vec<Mutex<Buf>> = (0..BUFFERS)
        .map(|_| {
            Mutex::new(match monitor {
                MonitorChoice::Alloc => Buf::Heap(vec![0xEE; 256 << 10]),
                _ => {
                    let len = 4 * PAGE;
                    let addr = sys::map_anon(None, len).unwrap();
                    sys::touch(addr, len, 0xEE);
                    Buf::Map { addr, len }
                }
            })
        })
        .collect();
    let transfers = AtomicUsize::new(0);
    let corrupt = AtomicUsize::new(0);
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let (rig, bufs, transfers, corrupt) = (&rig, &bufs, &transfers, &corrupt);
        for t in 0..2u64 {
            let done = done_tx.clone();
            s.spawn(move || {
                let mut rng = XorShift(0x9E37_79B9 + t);
                for _ in 0..MUTATIONS {
                    let mut b = bufs[rng.next(BUFFERS)].lock().unwrap();
                    match monitor {
                        MonitorChoice::Alloc => mutate_heap(&mut b, &mut rng),
                        _ => mutate_map(&mut b, &mut rng),
                    }
                }
                drop(done);
            });
            let done = done_tx.clone();
            s.spawn(move || {
                let mut rng = XorShift(0xC0FF_EE00 + t);
                for _ in 0..TRANSFERS {
                    let b = bufs[rng.next(BUFFERS)].lock().unwrap();
                    let (addr, len) = b.range();
                    let o = rig.transfer(addr, len).unwrap();
                    if o.corrupt() {
                        // Which check tripped, and where: the evidence a
                        // rare failure needs.
                        eprintln!("corrupt transfer at {addr:#x}+{len}: {o:?}");
                        corrupt.fetch_add(1, Ordering::Relaxed);
                    }
                    transfers.fetch_add(1, Ordering::Relaxed);
                }
                drop(done);
            });
        }
        drop(done_tx);
        // Every sender dropped => all workers finished.
        match done_rx.recv_timeout(DEADLOCK_TIMEOUT) {
            Err(mpsc::RecvTimeoutError::Disconnected) => {}
            other => {
                eprintln!("stress: workers stuck after {DEADLOCK_TIMEOUT:?} ({other:?}): deadlock");
                std::process::abort();
            }
        }
    });
    let stats = rig.cache.stats();
    eprintln!(
        "stress/{}: {} transfers, {stats}",
        rig.cache.monitor_name(),
        transfers.load(Ordering::Relaxed)
    );
    if monitor == MonitorChoice::Uffd {
        // How often a lookup had to wait for a change still in flight.
        eprintln!("stress/uffd: {:?}", UffdMonitor::global().unwrap().counters());
    }
    assert_eq!(transfers.load(Ordering::Relaxed), 2 * TRANSFERS);
    assert!(stats.hits > 0, "stress exercised hits: {stats}");
    for b in bufs {
        if let Buf::Map { addr, len } = b.into_inner().unwrap() {
            sys::unmap(addr, len).unwrap();
        }
    }
    let corrupt = corrupt.load(Ordering::Relaxed);
    eprintln!("stress/{}: {corrupt} corrupt transfers", rig.cache.monitor_name());
    corrupt
}

#[test]
fn stress_uffd() {
    assert_eq!(
        stress(MonitorChoice::Uffd),
        0,
        "uffd: stale registrations under stress"
    );
}

#[test]
fn stress_alloc() {
    assert_eq!(
        stress(MonitorChoice::Alloc),
        0,
        "alloc: stale registrations under stress"
    );
}

/// Proof the stress can fail: without a monitor the same workload corrupts.
#[test]
fn stress_none_corrupts() {
    assert!(
        stress(MonitorChoice::None) > 0,
        "monitor none must show stale registrations"
    );
}
