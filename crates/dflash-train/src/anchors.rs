//! Anchor sampling: block starts drawn uniformly among supervised positions.
//!
//! Invariants: candidates are positions `p` with `loss_mask[p]` and `p + 1 < len` (at least one
//! label after the anchor); at most `n` distinct anchors, sorted; deterministic for a given RNG.

use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

pub fn sample_anchors(loss_mask: &[bool], n: usize, rng: &mut ChaCha8Rng) -> Vec<u32> {
    let len = loss_mask.len();
    let mut candidates: Vec<u32> = (0..len.saturating_sub(1))
        .filter(|&p| loss_mask[p])
        .map(|p| p as u32)
        .collect();
    candidates.shuffle(rng);
    candidates.truncate(n);
    candidates.sort_unstable();
    candidates
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn anchors_are_supervised_distinct_sorted_and_reproducible() {
        let mask: Vec<bool> = (0..40).map(|i| i >= 10).collect();
        let a = sample_anchors(&mask, 8, &mut ChaCha8Rng::seed_from_u64(1));
        let b = sample_anchors(&mask, 8, &mut ChaCha8Rng::seed_from_u64(1));
        assert_eq!(a, b);
        assert_eq!(a.len(), 8);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert!(a.iter().all(|p| (10..39).contains(p)));
        assert_eq!(
            sample_anchors(&mask, 100, &mut ChaCha8Rng::seed_from_u64(2)).len(),
            29
        );
    }
}
