//! A "big reader" lock: one reader-writer lock per stripe, readers take the
//! stripe of their thread, writers take every stripe. Concurrent readers on
//! different threads then touch different cache lines (a plain `RwLock`
//! bounces its state word between cores on every read lock), at the price
//! of writers acquiring `STRIPES` locks, which only the slow paths (miss,
//! eviction, invalidation) do.

use std::cell::{Cell, UnsafeCell};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Maximum number of stripes (and of striped counters, see `crate::stats`).
pub const STRIPES: usize = 8;

/// Stripes in use: the machine's parallelism, clamped to `2..=STRIPES`
/// (writers lock only these).
fn active_stripes() -> usize {
    static ACTIVE: OnceLock<usize> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(STRIPES, |n| n.get())
            .clamp(2, STRIPES)
    })
}

/// The calling thread's stripe (assigned round-robin on first use).
#[inline]
pub fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % active_stripes();
    }
    STRIPE.with(|s| *s)
}

thread_local! {
    /// Guards of any `BrLock` the thread holds (audited builds only).
    static HELD: Cell<usize> = const { Cell::new(0) };
}

/// True when guards are counted: feature `lock-audit` in a build with
/// debug assertions.
const AUDIT: bool = cfg!(all(feature = "lock-audit", debug_assertions));

/// The number of `BrLock` guards (the cache locks) the calling thread
/// holds, or `None` when they are not counted (see [`AUDIT`]). Touches
/// only a const-initialized thread-local without destructor: callable
/// from inside a global allocator.
#[cfg_attr(not(feature = "lock-audit"), allow(dead_code))]
pub fn held() -> Option<usize> {
    AUDIT.then(|| HELD.try_with(Cell::get).unwrap_or(0))
}

/// Counts one guard of the calling thread while it lives (audited builds).
struct Held;

impl Held {
    #[inline]
    fn new() -> Held {
        if AUDIT {
            let _ = HELD.try_with(|h| h.set(h.get() + 1));
        }
        Held
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        if AUDIT {
            let _ = HELD.try_with(|h| h.set(h.get() - 1));
        }
    }
}

/// Aligns its content to its own cache lines (128 bytes: adjacent-line prefetch).
#[repr(align(128))]
#[derive(Default)]
pub struct Padded<T>(pub T);

/// A big-reader lock protecting a `T`.
pub struct BrLock<T> {
    stripes: [Padded<RwLock<()>>; STRIPES],
    data: UnsafeCell<T>,
}

// SAFETY: access to `data` is mediated by the stripe locks exactly as
// `RwLock<T>` mediates it (shared for readers, exclusive for writers), so
// the same bounds as `RwLock<T>` apply.
unsafe impl<T: Send> Send for BrLock<T> {}
// SAFETY: as above: `&BrLock<T>` hands out `&T` to many threads (needs Sync)
// and `&mut T` to one (needs Send).
unsafe impl<T: Send + Sync> Sync for BrLock<T> {}

/// Shared access through one stripe.
pub struct ReadGuard<'a, T> {
    _stripe: RwLockReadGuard<'a, ()>,
    data: &'a T,
    _held: Held,
}

/// Exclusive access: every active stripe held.
pub struct WriteGuard<'a, T> {
    _stripes: [Option<RwLockWriteGuard<'a, ()>>; STRIPES],
    data: &'a mut T,
    _held: Held,
}

impl<T> BrLock<T> {
    /// Wraps `value`.
    pub fn new(value: T) -> BrLock<T> {
        BrLock {
            stripes: std::array::from_fn(|_| Padded(RwLock::new(()))),
            data: UnsafeCell::new(value),
        }
    }

    /// Shared access (locks the calling thread's stripe).
    #[inline]
    pub fn read(&self) -> ReadGuard<'_, T> {
        let g = self.stripes[stripe()].0.read().unwrap_or_else(|p| p.into_inner());
        // SAFETY: a stripe is read-locked, so no writer (which needs every
        // stripe write-locked) exists while this shared borrow lives.
        ReadGuard {
            _stripe: g,
            data: unsafe { &*self.data.get() },
            _held: Held::new(),
        }
    }

    /// Exclusive access (locks every active stripe, in index order: no
    /// lock-order inversion between writers).
    pub fn write(&self) -> WriteGuard<'_, T> {
        let active = active_stripes();
        let guards = std::array::from_fn(|i| {
            (i < active).then(|| self.stripes[i].0.write().unwrap_or_else(|p| p.into_inner()))
        });
        // SAFETY: every active stripe is write-locked, and readers only ever
        // lock active stripes (`stripe()` < `active_stripes()`, fixed for the
        // process): no reader and no other writer can exist meanwhile.
        WriteGuard {
            _stripes: guards,
            data: unsafe { &mut *self.data.get() },
            _held: Held::new(),
        }
    }
}

impl<T> Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.data
    }
}

impl<T> Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.data
    }
}

impl<T> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.data
    }
}
