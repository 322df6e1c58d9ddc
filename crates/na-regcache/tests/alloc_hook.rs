//! The allocator hook invalidates on dealloc/realloc of large blocks and
//! never allocates while doing so: an outer global allocator flags any
//! allocation made from inside a deallocation.

mod common;

use std::alloc::System;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::sys::{self, AllocCall, AllocObserver, Observed};
use na_regcache::{
    Access, AllocMonitor, Cache, CacheConfig, InvalidatingAlloc, MonitorChoice, UringRegistrar,
};

thread_local! {
    static IN_DEALLOC: Cell<bool> = const { Cell::new(false) };
}
static ALLOCS_INSIDE_DEALLOC: AtomicUsize = AtomicUsize::new(0);

/// Counts allocations that happen while a deallocation (and so the
/// invalidation hook) is running. The thread-local flag is
/// const-initialized and has no destructor, so touching it never allocates.
struct Watchdog;

impl AllocObserver for Watchdog {
    fn before(&self, call: AllocCall) -> bool {
        match call {
            AllocCall::Alloc | AllocCall::AllocZeroed => {
                if IN_DEALLOC.with(Cell::get) {
                    ALLOCS_INSIDE_DEALLOC.fetch_add(1, Ordering::Relaxed);
                }
                false
            }
            AllocCall::Dealloc | AllocCall::Realloc => IN_DEALLOC.with(|f| f.replace(true)),
        }
    }
    fn after(&self, call: AllocCall, outer: bool) {
        if matches!(call, AllocCall::Dealloc | AllocCall::Realloc) {
            IN_DEALLOC.with(|f| f.set(outer));
        }
    }
}

/// Forwards to `InvalidatingAlloc<System>`, watched by [`Watchdog`].
#[global_allocator]
static ALLOC: Observed<InvalidatingAlloc<System>, Watchdog> = Observed {
    inner: InvalidatingAlloc::new(System),
    observer: Watchdog,
};

#[test]
fn hook_invalidates_on_free_and_realloc_without_allocating() {
    common::require_io_uring();
    assert!(AllocMonitor::installed());
    let reg = UringRegistrar::new(64, false).unwrap();
    let cfg = CacheConfig {
        max_count: 64,
        max_bytes: 1 << 30,
        monitor: MonitorChoice::Alloc,
        fork_guard: true,
        consistency: Default::default(),
        map_watch: true,
    };
    let cache = Cache::new(reg, cfg).unwrap();
    for round in 0..50 {
        let mut v = vec![1u8; 256 << 10];
        let h = cache
            .get(v.as_ptr() as usize, v.len(), Access::LOCAL_WRITE)
            .unwrap();
        assert!(h.is_valid());
        if round % 2 == 0 {
            drop(v); // dealloc
        } else {
            v.reserve_exact(1 << 20); // realloc
        }
        assert!(
            !h.is_valid(),
            "round {round}: the hook must invalidate before the block is released"
        );
    }
    // Small blocks (below the threshold) do not invalidate.
    let small = vec![1u8; 512];
    let h = cache
        .get(small.as_ptr() as usize, small.len(), Access::LOCAL_WRITE)
        .unwrap();
    drop(small);
    assert!(h.is_valid(), "{} byte threshold", AllocMonitor::threshold());
    let s = cache.stats();
    assert_eq!(s.invalidations, 50, "{s}");
    assert_eq!(
        ALLOCS_INSIDE_DEALLOC.load(Ordering::Relaxed),
        0,
        "the hook allocated"
    );
}

/// A forked child that frees a large block in a cache's range, checks a
/// registration and drops the cache never touches the parent cache's locks
/// (a parent thread may have held them at the fork: the child would hang).
#[test]
fn a_forked_child_never_waits_on_the_parents_cache() {
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;
    let cfg = CacheConfig {
        max_count: 64,
        monitor: MonitorChoice::Alloc,
        ..CacheConfig::default()
    };
    let cache = Cache::new(common::NoopRegistrar, cfg).unwrap();
    let victim = vec![1u8; 64 << 10];
    let (vp, vl) = (victim.as_ptr() as usize, victim.len());
    let kept = cache.get(vp, vl, Access::LOCAL_WRITE).unwrap();
    let other = vec![1u8; 64 << 10];
    let op = other.as_ptr() as usize;
    drop(cache.get(op, 4096, Access::LOCAL_WRITE).unwrap());
    let stop = AtomicBool::new(false);
    let mut hung = 0;
    std::thread::scope(|s| {
        // Holds the cache's lock (invalidate, then reap) most of the time.
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                cache.invalidate(op + 8192, 1);
            }
        });
        for _ in 0..40 {
            // The child only frees, checks and drops, then leaves with _exit.
            let pid = sys::fork();
            if pid == 0 {
                // Frees the victim's block in the child's copy.
                sys::free_block_in_child(vp, vl);
                let valid = kept.is_valid_now();
                // Leaves the child at once.
                sys::exit_now(if valid { 3 } else { 0 });
            }
            match exit_status_within(pid, Duration::from_secs(2)) {
                Some(st) => assert_eq!(st, 0, "a parent's registration claimed valid in the child"),
                None => hung += 1,
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    drop(kept);
    drop((victim, other));
    assert_eq!(hung, 0, "forked children hung on the parent cache's lock");
}

/// No method of a cache or of its handles takes the cache's lock in a
/// forked child (a parent thread may have held it at the fork: the child
/// would hang): `stats`, `log_stats`, `invalidate`, `evict_idle`, and
/// `is_valid` of a handle for peers made past the 4,096th (which, when
/// the tracking slots were a fixed 4,096, was checked against the table's
/// history under the lock). Each child calls one of them (so a hang
/// names its method), checks the documented answer and leaves.
#[test]
fn no_method_waits_on_the_parents_cache_in_a_forked_child() {
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;
    let cfg = CacheConfig {
        max_count: 64,
        monitor: MonitorChoice::Alloc,
        ..CacheConfig::default()
    };
    let cache = Cache::new(common::NoopRegistrar, cfg).unwrap();
    let block = vec![1u8; 64 << 10];
    let bp = block.as_ptr() as usize;
    let idle = cache.get(bp, 4096, Access::LOCAL_WRITE).unwrap();
    assert!(idle.is_cached());
    drop(idle);
    // 4,096 handles for peers, then one more: until 2026-11-28 the
    // tracking slots were 4,096 and that one found none, so its `is_valid`
    // read-locked the table's history once the generation moved. The
    // slots grow now and it is tracked like the others; a child must
    // still answer without a look at the cache.
    let slotted: Vec<_> = (0..4096)
        .map(|_| cache.get_unshared(bp, 4096, Access::LOCAL_WRITE).unwrap())
        .collect();
    let last = cache.get_unshared(bp + 8192, 4096, Access::LOCAL_WRITE).unwrap();
    let other = vec![1u8; 64 << 10];
    let op = other.as_ptr() as usize;
    drop(cache.get(op, 4096, Access::LOCAL_WRITE).unwrap());
    cache.invalidate(op + 8192, 1);
    assert!(last.is_valid(), "an invalidation of another range");
    const CALLS: [&str; 5] = ["stats", "log_stats", "invalidate", "evict_idle", "is_valid"];
    let stop = AtomicBool::new(false);
    let (mut hung, mut wrong) = ([0; CALLS.len()], [0; CALLS.len()]);
    std::thread::scope(|s| {
        // Holds the cache's lock (invalidate, then reap) most of the time,
        // and moves the generation.
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                cache.invalidate(op + 8192, 1);
            }
        });
        for i in 0..15 * CALLS.len() {
            let call = i % CALLS.len();
            // The child makes one call on the cache and leaves with _exit.
            let pid = sys::fork();
            if pid == 0 {
                let right = match call {
                    0 => cache.stats() == na_regcache::CacheStats::default(),
                    1 => {
                        cache.log_stats();
                        true
                    }
                    2 => {
                        cache.invalidate(bp, 4096);
                        true
                    }
                    3 => cache.evict_idle() == 0,
                    _ => !last.is_valid(),
                };
                // Leaves the child at once.
                sys::exit_now(if right { 0 } else { 3 });
            }
            // (No assertion in this scope: its thread would never stop.)
            match exit_status_within(pid, Duration::from_secs(2)) {
                Some(0) => {}
                Some(_) => wrong[call] += 1,
                None => hung[call] += 1,
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    // The parent's cache is untouched by its children, and the parent's
    // own invalidations of another range (thousands) leave `last` valid.
    assert!(
        slotted.iter().all(|h| h.is_valid()),
        "a child's invalidate reached the parent"
    );
    assert!(last.is_valid(), "invalid after unrelated invalidations");
    assert_eq!(cache.stats().entries, 2);
    drop((slotted, last));
    drop((block, other));
    assert_eq!(
        hung,
        [0; CALLS.len()],
        "forked children hung on the parent cache's lock, per call {CALLS:?}"
    );
    assert_eq!(
        wrong,
        [0; CALLS.len()],
        "forked children got an answer other than the documented one, per call {CALLS:?}"
    );
}

/// A forked child's large free never waits on the allocator hook's sink
/// list, which a parent thread attaching and detaching caches may hold
/// (or queue for) at the fork; and the child cannot attach to it.
#[test]
fn a_forked_child_never_waits_on_the_hooks_sink_list() {
    use na_regcache::{InvalidationSink, Monitor};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;
    struct Quiet;
    impl InvalidationSink for Quiet {
        fn invalidate(&self, _start: usize, _end: usize) {}
    }
    let m = AllocMonitor::global();
    let sink: Arc<dyn InvalidationSink> = Arc::new(Quiet);
    // One attached all along, so that the hook dispatches.
    let kept = m.attach(sink.clone()).unwrap();
    let stop = AtomicBool::new(false);
    let mut hung = 0;
    std::thread::scope(|s| {
        // Takes the list's write lock most of the time.
        for _ in 0..2 {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let id = m.attach(sink.clone()).unwrap();
                    m.detach(id);
                }
            });
        }
        for _ in 0..40 {
            let block = vec![1u8; 64 << 10];
            let (bp, bl) = (block.as_ptr() as usize, block.len());
            // The child only frees, tries an attach, and leaves with _exit.
            let pid = sys::fork();
            if pid == 0 {
                // Frees the block in the child's copy.
                sys::free_block_in_child(bp, bl);
                let refused = m.attach(Arc::new(Quiet)).is_err();
                // Leaves the child at once.
                sys::exit_now(if refused { 0 } else { 3 });
            }
            drop(block);
            match exit_status_within(pid, Duration::from_secs(2)) {
                Some(st) => assert_eq!(st, 0, "the child could attach to the inherited list"),
                None => hung += 1,
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    m.detach(kept);
    assert_eq!(hung, 0, "forked children hung on the hook's sink list");
}

/// The exit status of child `pid` if it exits within `limit`; else kills
/// and reaps it and returns `None` (it hung).
fn exit_status_within(pid: libc::pid_t, limit: std::time::Duration) -> Option<i32> {
    sys::wait_within(pid, limit)
}
