//! Caches handed back after a generation and handed out again for the next, so that their
//! buffers — and, on CUDA, the step graphs captured over those buffers (`step_graph`) — outlive
//! one answer. Without it every answer re-ran each step shape eagerly and captured it again (a
//! drafter has one shape per number of newly committed rows), which an evaluation of hundreds of
//! answers paid on every one.
//!
//! Invariants:
//! - A cache comes out of the pool empty (length 0) with at least the capacity asked for; its
//!   buffers and graphs are the ones it went in with (graphs read every length from device
//!   metadata, so they replay at any length).
//! - New caches get [`pooled_capacity`] positions (the request rounded up), so answers of
//!   similar lengths share one cache; the rounding never exceeds the request by more than
//!   [`CAPACITY_STEP`] past [`CAPACITY_POW2_MAX`].
//! - A cloned pool is empty (a clone of a model may differ in what its graphs bake in).
//! - The pool keeps at most [`MAX_SPARE`] caches (the largest ones: they serve every request a
//!   smaller one would), so idle memory stays bounded.

use std::sync::Mutex;

/// Spare caches a pool keeps.
pub const MAX_SPARE: usize = 2;
/// Requests up to this many positions round up to a power of two.
pub const CAPACITY_POW2_MAX: usize = 8192;
/// Larger requests round up to a multiple of this.
pub const CAPACITY_STEP: usize = 4096;
/// The smallest capacity a pooled cache is made with.
pub const CAPACITY_MIN: usize = 256;

/// The capacity a new pooled cache gets for a request of `requested` positions.
pub fn pooled_capacity(requested: usize) -> usize {
    if requested <= CAPACITY_POW2_MAX {
        requested.max(CAPACITY_MIN).next_power_of_two()
    } else {
        requested.div_ceil(CAPACITY_STEP) * CAPACITY_STEP
    }
}

/// What a pool needs of a cache.
pub trait PooledCache {
    fn capacity(&self) -> usize;
    /// Forgets every committed position (no reallocation).
    fn clear(&mut self);
}

/// Spare caches of one model (see the module invariants).
pub struct CachePool<T> {
    spare: Mutex<Vec<T>>,
}

impl<T> Default for CachePool<T> {
    fn default() -> Self {
        Self {
            spare: Mutex::new(Vec::new()),
        }
    }
}

/// A clone starts empty: a model cloned to run with other settings (another RoPE, say) must not
/// replay graphs captured for the original's.
impl<T> Clone for CachePool<T> {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl<T> std::fmt::Debug for CachePool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.spare.lock().map(|s| s.len()).unwrap_or(0);
        f.debug_struct("CachePool").field("spare", &n).finish()
    }
}

impl<T: PooledCache> CachePool<T> {
    /// The smallest spare cache holding at least `capacity` positions, emptied; `None` when no
    /// spare is large enough (the caller makes one with [`pooled_capacity`]).
    pub fn take(&self, capacity: usize) -> Option<T> {
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        let best = spare
            .iter()
            .enumerate()
            .filter(|(_, c)| c.capacity() >= capacity)
            .min_by_key(|(_, c)| c.capacity())
            .map(|(i, _)| i)?;
        let mut c = spare.swap_remove(best);
        c.clear();
        Some(c)
    }

    /// Hands `cache` back for a later [`CachePool::take`].
    pub fn give(&self, cache: T) {
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        spare.push(cache);
        if spare.len() > MAX_SPARE {
            let smallest = spare
                .iter()
                .enumerate()
                .min_by_key(|(_, c)| c.capacity())
                .map(|(i, _)| i)
                .expect("non-empty");
            spare.swap_remove(smallest);
        }
    }

    /// Spare caches held now.
    pub fn spare(&self) -> usize {
        self.spare.lock().map(|s| s.len()).unwrap_or(0)
    }
}

impl PooledCache for crate::SequenceCache {
    fn capacity(&self) -> usize {
        crate::SequenceCache::capacity(self)
    }
    fn clear(&mut self) {
        self.crop(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(usize, usize);
    impl PooledCache for Fake {
        fn capacity(&self) -> usize {
            self.0
        }
        fn clear(&mut self) {
            self.1 = 0;
        }
    }

    #[test]
    fn capacities_round_up_to_shared_sizes() {
        assert_eq!(pooled_capacity(1), 256);
        assert_eq!(pooled_capacity(300), 512);
        assert_eq!(pooled_capacity(512), 512);
        assert_eq!(pooled_capacity(8192), 8192);
        assert_eq!(pooled_capacity(8193), 12288);
        assert_eq!(pooled_capacity(40_000), 40_960);
    }

    #[test]
    fn take_gives_the_smallest_adequate_spare_emptied_and_keeps_the_largest() {
        let pool = CachePool::default();
        assert!(pool.take(10).is_none());
        pool.give(Fake(512, 7));
        pool.give(Fake(1024, 9));
        assert!(pool.take(2000).is_none());
        let c = pool.take(300).expect("512 fits");
        assert_eq!((c.0, c.1), (512, 0));
        pool.give(c);
        pool.give(Fake(256, 1));
        assert_eq!(pool.spare(), MAX_SPARE); // the 256 one went
        assert!(pool.take(10).is_some_and(|c| c.0 == 512));
        assert!(pool.take(10).is_some_and(|c| c.0 == 1024));
        assert!(pool.take(10).is_none());
    }
}
