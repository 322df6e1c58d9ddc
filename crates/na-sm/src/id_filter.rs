//! A counting filter over operation ids: "certainly not here" in a few
//! instructions, so that refusing a duplicate id costs no hash-table
//! insert and remove per message. No I/O.

use na_core::OpId;

const BUCKETS: usize = 1024;

/// How many ids of a set fall in each of [`BUCKETS`] buckets. A bucket at 0
/// means no id of the set hashes there; otherwise the caller checks the
/// set itself.
pub(crate) struct IdFilter {
    counts: Box<[u32; BUCKETS]>,
}

impl Default for IdFilter {
    fn default() -> Self {
        IdFilter {
            counts: Box::new([0; BUCKETS]),
        }
    }
}

fn bucket(op: OpId) -> usize {
    // Fibonacci hashing: the top 10 bits of the product.
    (op.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - BUCKETS.trailing_zeros())) as usize
}

impl IdFilter {
    /// `op` joined the set.
    pub fn insert(&mut self, op: OpId) {
        let c = &mut self.counts[bucket(op)];
        *c = c.saturating_add(1);
    }

    /// `op` left the set (it was inserted before).
    pub fn remove(&mut self, op: OpId) {
        let c = &mut self.counts[bucket(op)];
        debug_assert!(*c > 0, "removing an id that was never inserted");
        *c = c.saturating_sub(1);
    }

    /// False if `op` is certainly not in the set.
    pub fn may_contain(&self, op: OpId) -> bool {
        self.counts[bucket(op)] != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_false_negatives_and_empties_back_to_zero() {
        let mut f = IdFilter::default();
        let ids: Vec<OpId> = (0..5000u64).map(|i| OpId(i * 7 + (1 << 62))).collect();
        for &op in &ids {
            f.insert(op);
        }
        assert!(ids.iter().all(|&op| f.may_contain(op)));
        for &op in &ids {
            f.remove(op);
        }
        assert!(f.counts.iter().all(|&c| c == 0));
        assert!(ids.iter().all(|&op| !f.may_contain(op)));
        // Sequential ids with flag bits (what the RPC layer posts) spread out.
        for i in 0..64u64 {
            f.insert(OpId(i | 1 << 62));
        }
        let hits = (64..10_064u64)
            .filter(|&i| f.may_contain(OpId(i | 1 << 62)))
            .count();
        assert!(hits < 2000, "{hits} false hits of 10000");
    }
}
