//! Fixed-size pools of the data path: a `slab::Slab` sized once at start
//! that never grows. Running out is back-pressure (an insert hands the
//! value back), never a heap fallback: the pollers' operations, read
//! groups, staging slots and connections live in these.

use std::ops::{Index, IndexMut};

use slab::Slab;

/// A slab of at most `limit` entries, allocated whole at construction.
/// Keys are below `limit`, so they can index memory sized the same way (a
/// staging slot's chunk, an io_uring `user_data` field).
#[derive(Debug)]
pub(crate) struct Pool<T> {
    slab: Slab<T>,
    /// Entries it may hold; fixed at construction.
    limit: usize,
    /// The slab's capacity at construction; it must never change.
    capacity: usize,
}

impl<T> Pool<T> {
    /// A pool for `limit` entries, allocated now.
    pub(crate) fn with_limit(limit: usize) -> Self {
        let slab = Slab::with_capacity(limit);
        let capacity = slab.capacity();
        Pool {
            slab,
            limit,
            capacity,
        }
    }

    /// Entries it may hold.
    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Entries it holds now.
    pub(crate) fn len(&self) -> usize {
        self.slab.len()
    }

    /// Whether every entry is taken (the caller waits: back-pressure).
    pub(crate) fn is_full(&self) -> bool {
        self.slab.len() >= self.limit
    }

    /// The key the next [`Pool::insert`] returns, unless the pool is full.
    pub(crate) fn vacant_key(&self) -> Option<usize> {
        (!self.is_full()).then(|| self.slab.vacant_key())
    }

    /// Stores `value`, returning its key; a full pool hands it back.
    pub(crate) fn insert(&mut self, value: T) -> Result<usize, T> {
        if self.is_full() {
            return Err(value);
        }
        let key = self.slab.insert(value);
        self.check();
        Ok(key)
    }

    /// Takes the entry at `key` out. Panics if there is none (a key freed
    /// twice is a bug of the caller's bookkeeping).
    pub(crate) fn remove(&mut self, key: usize) -> T {
        self.slab.remove(key)
    }

    /// Takes the entry at `key` out, if there is one.
    pub(crate) fn try_remove(&mut self, key: usize) -> Option<T> {
        self.slab.try_remove(key)
    }

    /// The entry at `key`, if there is one.
    pub(crate) fn get(&self, key: usize) -> Option<&T> {
        self.slab.get(key)
    }

    /// The entry at `key`, if there is one.
    pub(crate) fn get_mut(&mut self, key: usize) -> Option<&mut T> {
        self.slab.get_mut(key)
    }

    /// Whether `key` holds an entry.
    pub(crate) fn contains(&self, key: usize) -> bool {
        self.slab.contains(key)
    }

    /// Every entry, with its key (walks every slot, taken or not: not for
    /// per-tick loops).
    // Used by the pollers' debug-build invariant checks only.
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub(crate) fn iter(&self) -> slab::Iter<'_, T> {
        self.slab.iter()
    }

    /// Empties it; the memory stays.
    pub(crate) fn clear(&mut self) {
        self.slab.clear();
        self.check();
    }

    /// The slab's capacity now (the same as at construction).
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.slab.capacity()
    }

    /// Checks (in debug builds) that the slab has not grown since
    /// construction: every insert stays within `limit`, so it cannot.
    pub(crate) fn check(&self) {
        debug_assert_eq!(
            self.slab.capacity(),
            self.capacity,
            "a fixed pool grew after start"
        );
    }
}

impl<T> Index<usize> for Pool<T> {
    type Output = T;
    fn index(&self, key: usize) -> &T {
        &self.slab[key]
    }
}

impl<T> IndexMut<usize> for Pool<T> {
    fn index_mut(&mut self, key: usize) -> &mut T {
        &mut self.slab[key]
    }
}

#[cfg(test)]
mod tests {
    use super::Pool;

    #[test]
    fn full_pool_refuses_and_never_grows() {
        let mut p = Pool::with_limit(4);
        let cap = p.capacity();
        assert!(cap >= 4);
        for i in 0..4 {
            assert_eq!(p.vacant_key(), Some(i));
            assert_eq!(p.insert(i * 10), Ok(i));
        }
        assert!(p.is_full());
        assert_eq!(p.vacant_key(), None);
        // Back-pressure: the value comes back, nothing is allocated.
        assert_eq!(p.insert(99), Err(99));
        assert_eq!(p.capacity(), cap);
        assert_eq!(p.len(), 4);
    }

    #[test]
    fn churn_keeps_keys_below_the_limit_and_capacity_fixed() {
        let limit = 8;
        let mut p = Pool::with_limit(limit);
        let cap = p.capacity();
        let mut held = Vec::new();
        // A deterministic mix of inserts past the limit and removals.
        let mut x = 12345u64;
        for _ in 0..10_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if !(x >> 33).is_multiple_of(3) {
                match p.insert(x) {
                    Ok(k) => {
                        assert!(k < limit, "key {k} past the limit");
                        held.push(k);
                    }
                    Err(v) => {
                        assert_eq!(v, x);
                        assert_eq!(held.len(), limit);
                    }
                }
            } else if !held.is_empty() {
                let k = held.swap_remove((x >> 40) as usize % held.len());
                p.remove(k);
            }
            assert_eq!(p.capacity(), cap, "the pool grew");
            assert_eq!(p.len(), held.len());
        }
        p.clear();
        assert_eq!(p.len(), 0);
        assert_eq!(p.capacity(), cap);
    }

    #[test]
    fn freed_keys_are_reused_last_in_first_out() {
        let mut p = Pool::with_limit(3);
        for i in 0..3 {
            p.insert(i).unwrap();
        }
        p.remove(0);
        p.remove(2);
        assert_eq!(p.vacant_key(), Some(2));
        assert_eq!(p.insert(7), Ok(2));
        assert_eq!(p.insert(8), Ok(0));
        assert!(p.contains(1) && p.get(1) == Some(&1));
        assert_eq!(p.try_remove(5), None);
    }
}
