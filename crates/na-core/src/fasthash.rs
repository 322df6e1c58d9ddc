//! A fast hasher for small integer keys (operation ids, peer tokens, tags,
//! call cookies), seeded per process so a peer cannot precompute colliding
//! keys.
//!
//! Per-message paths (plugins, the RPC engine) look keys up in a few maps;
//! SipHash (std's default) costs more there than the rest of the lookup. Keys are at most a few
//! integers, so a seeded multiply-xorshift mix per word is enough.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// Builds [`SeededHasher`]s with the process-wide random seed.
#[derive(Clone, Copy, Debug)]
pub struct SeededState {
    seed: u64,
}

impl Default for SeededState {
    fn default() -> Self {
        // An atomic, not a `OnceLock`: nothing ever waits for another
        // thread's initialisation (a child forked during one would wait
        // for ever). Racing first calls agree through the exchange.
        static SEED: AtomicU64 = AtomicU64::new(0);
        let mut seed = SEED.load(Ordering::Relaxed);
        if seed == 0 {
            let fresh = RandomState::new().hash_one(0x5153_u64) | 1;
            seed = match SEED.compare_exchange(0, fresh, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => fresh,
                Err(won) => won,
            };
        }
        SeededState { seed }
    }
}

impl BuildHasher for SeededState {
    type Hasher = SeededHasher;

    fn build_hasher(&self) -> SeededHasher {
        SeededHasher { h: self.seed }
    }
}

/// Hasher state of [`SeededState`].
#[derive(Clone, Copy, Debug)]
pub struct SeededHasher {
    h: u64,
}

impl SeededHasher {
    #[inline]
    fn mix(&mut self, w: u64) {
        let x = (self.h ^ w).wrapping_mul(K);
        self.h = x ^ (x >> 29);
    }
}

impl Hasher for SeededHasher {
    #[inline]
    fn finish(&self) -> u64 {
        let x = self.h.wrapping_mul(K);
        x ^ (x >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(w));
        }
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.mix(u64::from(n));
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }
}

/// A `HashMap` with [`SeededState`].
pub type FastMap<K, V> = std::collections::HashMap<K, V, SeededState>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn distinct_small_keys_spread() {
        let s = SeededState::default();
        let hashes: HashSet<u64> = (0..10_000u32).map(|t| s.hash_one((7u64, t)) >> 52).collect();
        // 10,000 keys over 4,096 top-12-bit buckets: a uniform hash fills
        // about 3,740 of them; a weak mix (or none) piles keys up.
        assert!(hashes.len() > 3_600, "only {} buckets used", hashes.len());
        let m: FastMap<u64, u32> = (0..100).map(|i| (i, i as u32)).collect();
        assert_eq!(m.get(&42), Some(&42));
    }
}
