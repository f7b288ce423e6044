//! Least-recently-used eviction, the policy of the page cache and of the
//! loaders that evict at all (Mosaic Streaming's `cache_limit`, LitData's
//! `max_cache_size`): the reference the next-use policy is measured
//! against. Every read sample is admitted; the least recently read go
//! until it fits. O(log n) per read; for models and tests, not the data
//! path (it allocates as it goes).

use std::collections::{BTreeMap, HashMap};

/// An LRU cache over a byte budget.
#[derive(Debug, Default)]
pub struct Lru {
    capacity_bytes: u64,
    used_bytes: u64,
    /// id -> (last read, bytes).
    by_id: HashMap<u64, (u64, u64)>,
    /// last read -> id.
    by_time: BTreeMap<u64, u64>,
    clock: u64,
}

impl Lru {
    /// A cache of `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> Self {
        Lru {
            capacity_bytes,
            ..Default::default()
        }
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// A read of `id` (`bytes` long): whether it was held. It is held
    /// afterwards unless larger than the whole cache.
    pub fn read(&mut self, id: u64, bytes: u64) -> bool {
        self.clock += 1;
        if let Some((last, _)) = self.by_id.get_mut(&id) {
            self.by_time.remove(last);
            *last = self.clock;
            self.by_time.insert(self.clock, id);
            return true;
        }
        if bytes > self.capacity_bytes {
            return false;
        }
        while self.used_bytes + bytes > self.capacity_bytes {
            let (_, old) = self.by_time.pop_first().expect("bytes held");
            let (_, b) = self.by_id.remove(&old).expect("indexed");
            self.used_bytes -= b;
        }
        self.by_id.insert(id, (self.clock, bytes));
        self.by_time.insert(self.clock, id);
        self.used_bytes += bytes;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recent_goes_first() {
        let mut c = Lru::new(3);
        for id in [1, 2, 3] {
            assert!(!c.read(id, 1));
        }
        assert!(c.read(1, 1));
        assert!(!c.read(4, 1)); // evicts 2
        assert!(!c.read(2, 1)); // evicts 3
        assert!(c.read(1, 1));
        assert!(c.read(4, 1));
        assert!(!c.read(3, 1));
        assert_eq!(c.used_bytes(), 3);
    }
}
