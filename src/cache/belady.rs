//! Belady's MIN with bypass, incrementally: the cache keeps what is read
//! soonest. On a read of a sample not held, the sample is admitted only if
//! something held is read later than it (that is evicted, farthest first,
//! until the sample fits); otherwise it is not kept (bypass). With samples
//! of one size this is exactly MIN, the optimal policy (checked against a
//! brute force over the future in the tests); with sizes it is the usual
//! farthest-first generalisation.
//!
//! O(log n) per read and no allocation after [`Belady::new`]: held samples
//! live in a pool of entries sized at start (`max_entries`), an indexed
//! max-heap orders them by next read, and a map sized at start finds a
//! sample's entry. Running out of entries is like running out of bytes.

use std::collections::HashMap;

use crate::sampler::NEVER;

/// What a read did to the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The sample was held (its next read updated).
    Hit,
    /// Not held, and now admitted (after the evictions reported).
    Admit,
    /// Not held, and not kept: everything held is read sooner.
    Bypass,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    id: u64,
    /// The next read's time ([`NEVER`]: none known).
    next: u64,
    bytes: u64,
    /// Where this entry is in the heap.
    heap_at: u32,
}

/// Belady's MIN over a byte budget (module doc).
#[derive(Debug)]
pub struct Belady {
    capacity_bytes: u64,
    used_bytes: u64,
    max_entries: usize,
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Entry indices; a max-heap on (next, id).
    heap: Vec<u32>,
    by_id: HashMap<u64, u32>,
}

impl Belady {
    /// A cache of `capacity_bytes` holding at most `max_entries` samples.
    pub fn new(capacity_bytes: u64, max_entries: usize) -> Self {
        Belady {
            capacity_bytes,
            used_bytes: 0,
            max_entries,
            entries: Vec::with_capacity(max_entries),
            free: Vec::with_capacity(max_entries),
            heap: Vec::with_capacity(max_entries),
            by_id: HashMap::with_capacity(max_entries),
        }
    }

    /// Samples held.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Bytes held (never above the capacity).
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Whether `id` is held.
    pub fn holds(&self, id: u64) -> bool {
        self.by_id.contains_key(&id)
    }

    /// A read of sample `id` (`bytes` long) whose next read after this one
    /// is at `next` ([`NEVER`]: none). `evicted` is called with every
    /// sample evicted to make room.
    pub fn read(
        &mut self,
        id: u64,
        bytes: u64,
        next: u64,
        mut evicted: impl FnMut(u64),
    ) -> Decision {
        if let Some(&e) = self.by_id.get(&id) {
            self.entries[e as usize].next = next;
            let at = self.entries[e as usize].heap_at as usize;
            self.sift_up(at);
            let at = self.entries[e as usize].heap_at as usize;
            self.sift_down(at);
            return Decision::Hit;
        }
        if next == NEVER || bytes > self.capacity_bytes || self.max_entries == 0 {
            return Decision::Bypass;
        }
        let full = |s: &Self| {
            s.used_bytes + bytes > s.capacity_bytes
                || (s.free.is_empty() && s.entries.len() == s.max_entries)
        };
        while full(self) {
            let top = self.entries[self.heap[0] as usize];
            if (top.next, top.id) < (next, id) {
                // Everything held is read before this sample: keep them.
                return Decision::Bypass;
            }
            self.remove_top();
            evicted(top.id);
        }
        self.hold(id, bytes, next);
        Decision::Admit
    }

    /// A read as [`read`](Self::read), except that a sample not held
    /// replaces a held one only when the write gains a hit (docs/CACHE.md,
    /// "Writes"). MIN replaces whenever the new sample is read sooner than
    /// the farthest held (at `far`), trading that one's hit at `far` for
    /// the new one's at `next`: the same count, one write more, and another
    /// when the evicted one is read and kept again. The trade gains only if
    /// the slot's time it frees, `next..far`, is used again: surely when
    /// the held one is never read again (`far` is [`NEVER`]) or the new one
    /// is read twice before it (`second`, the read after `next`, is before
    /// `far`), likely when `far - next` exceeds `horizon`
    /// ([`NextUse::swap_horizon`](crate::sampler::NextUse::swap_horizon)).
    /// Otherwise it is a bypass. With free room this is `read`. Only the
    /// first (farthest) eviction is weighed: a sample larger than that
    /// one may evict more after it, as `read` does (the cache area's
    /// planner counts every slot as one unit, so evicts one).
    pub fn read_weighing_writes(
        &mut self,
        id: u64,
        bytes: u64,
        next: u64,
        second: impl FnOnce() -> u64,
        horizon: u64,
        evicted: impl FnMut(u64),
    ) -> Decision {
        let full = self.used_bytes + bytes > self.capacity_bytes
            || (self.free.is_empty() && self.entries.len() == self.max_entries);
        if full && !self.by_id.contains_key(&id) && next != NEVER {
            if let Some(&top) = self.heap.first() {
                let far = self.entries[top as usize].next;
                let gains = far == NEVER
                    || (next < far && (next.saturating_add(horizon) < far || second() < far));
                if !gains {
                    return Decision::Bypass;
                }
            }
        }
        self.read(id, bytes, next, evicted)
    }

    /// Holds `id` (the caller checked it fits): an entry from the pool, in
    /// the heap by its next read.
    fn hold(&mut self, id: u64, bytes: u64, next: u64) {
        let e = Entry {
            id,
            next,
            bytes,
            heap_at: self.heap.len() as u32,
        };
        let idx = match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = e;
                i
            }
            None => {
                self.entries.push(e);
                (self.entries.len() - 1) as u32
            }
        };
        self.heap.push(idx);
        self.by_id.insert(id, idx);
        self.used_bytes += bytes;
        self.sift_up(self.heap.len() - 1);
    }

    fn key(&self, heap_at: usize) -> (u64, u64) {
        let e = &self.entries[self.heap[heap_at] as usize];
        (e.next, e.id)
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.entries[self.heap[a] as usize].heap_at = a as u32;
        self.entries[self.heap[b] as usize].heap_at = b as u32;
    }

    /// Holds `id` (`bytes` long, next read at `next`) without a read: what
    /// a cache kept from before starts with. False, and nothing held, when
    /// it is held already or does not fit beside what is.
    pub fn insert(&mut self, id: u64, bytes: u64, next: u64) -> bool {
        if self.by_id.contains_key(&id)
            || self.used_bytes + bytes > self.capacity_bytes
            || (self.free.is_empty() && self.entries.len() == self.max_entries)
        {
            return false;
        }
        self.hold(id, bytes, next);
        true
    }

    fn sift_up(&mut self, mut at: usize) {
        while at > 0 {
            let parent = (at - 1) / 2;
            if self.key(parent) >= self.key(at) {
                break;
            }
            self.swap(parent, at);
            at = parent;
        }
    }

    fn sift_down(&mut self, mut at: usize) {
        loop {
            let (l, r) = (2 * at + 1, 2 * at + 2);
            let mut big = at;
            if l < self.heap.len() && self.key(l) > self.key(big) {
                big = l;
            }
            if r < self.heap.len() && self.key(r) > self.key(big) {
                big = r;
            }
            if big == at {
                return;
            }
            self.swap(at, big);
            at = big;
        }
    }

    fn remove_top(&mut self) {
        let idx = self.heap[0];
        let last = self.heap.len() - 1;
        self.swap(0, last);
        self.heap.pop();
        if !self.heap.is_empty() {
            self.sift_down(0);
        }
        let e = self.entries[idx as usize];
        self.by_id.remove(&e.id);
        self.used_bytes -= e.bytes;
        self.free.push(idx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MIN with bypass by brute force: at a miss with the cache full, the
    /// candidate (held or the new one) read farthest in the future (ties:
    /// the larger id) is not kept. Returns each read's hit and the
    /// evictions in order.
    fn brute_force(seq: &[u64], capacity: usize) -> (Vec<bool>, Vec<u64>) {
        let next_after = |id: u64, i: usize| -> u64 {
            seq[i + 1..]
                .iter()
                .position(|&x| x == id)
                .map_or(NEVER, |p| (i + 1 + p) as u64)
        };
        let mut held: Vec<u64> = Vec::new();
        let (mut hits, mut evictions) = (Vec::new(), Vec::new());
        for (i, &id) in seq.iter().enumerate() {
            if held.contains(&id) {
                hits.push(true);
                continue;
            }
            hits.push(false);
            let n = next_after(id, i);
            if n == NEVER {
                continue;
            }
            if held.len() < capacity {
                held.push(id);
                continue;
            }
            let (far_at, far_key) = held
                .iter()
                .enumerate()
                .map(|(k, &h)| (k, (next_after(h, i), h)))
                .max_by_key(|&(_, key)| key)
                .unwrap();
            if far_key > (n, id) {
                evictions.push(held[far_at]);
                held[far_at] = id;
            }
        }
        (hits, evictions)
    }

    fn belady(seq: &[u64], capacity: usize) -> (Vec<bool>, Vec<u64>) {
        let mut c = Belady::new(capacity as u64, capacity);
        let (mut hits, mut evictions) = (Vec::new(), Vec::new());
        for (i, &id) in seq.iter().enumerate() {
            let next = seq[i + 1..]
                .iter()
                .position(|&x| x == id)
                .map_or(NEVER, |p| (i + 1 + p) as u64);
            let d = c.read(id, 1, next, |e| evictions.push(e));
            hits.push(d == Decision::Hit);
            assert!(c.used_bytes() <= capacity as u64);
            assert_eq!(c.len() as u64, c.used_bytes());
        }
        (hits, evictions)
    }

    #[test]
    fn same_hits_and_evictions_as_brute_force_min() {
        let mut state = 12345u64;
        for case in 0..200 {
            state = crate::hash::mix64(state ^ case);
            let ids = 2 + state % 30;
            let len = 20 + (state >> 8) % 200;
            let capacity = 1 + ((state >> 16) % ids) as usize;
            let seq: Vec<u64> = (0..len)
                .map(|i| crate::hash::mix64(state ^ (i + 1)) % ids)
                .collect();
            assert_eq!(
                belady(&seq, capacity),
                brute_force(&seq, capacity),
                "case {case}: {ids} ids, capacity {capacity}"
            );
        }
    }

    #[test]
    fn sizes_and_entry_limits_are_respected() {
        let mut c = Belady::new(100, 3);
        assert_eq!(c.read(1, 60, 10, |_| panic!()), Decision::Admit);
        // Does not fit next to 1, and 1 is read sooner: not kept.
        assert_eq!(c.read(2, 50, 20, |_| panic!()), Decision::Bypass);
        // Read sooner than 1: 1 goes.
        let mut out = Vec::new();
        assert_eq!(c.read(3, 50, 5, |e| out.push(e)), Decision::Admit);
        assert_eq!(out, vec![1]);
        assert_eq!(c.read(4, 10, 6, |_| panic!()), Decision::Admit);
        assert_eq!(c.read(5, 10, 7, |_| panic!()), Decision::Admit);
        // Three entries at most: the farthest (5) goes.
        out.clear();
        assert_eq!(c.read(6, 1, 1, |e| out.push(e)), Decision::Admit);
        assert_eq!(out, vec![5]);
        assert!(c.used_bytes() <= 100 && c.len() <= 3);
        // Larger than the whole cache, or never read again: not kept.
        assert_eq!(c.read(7, 101, 1, |_| panic!()), Decision::Bypass);
        assert_eq!(c.read(8, 1, NEVER, |_| panic!()), Decision::Bypass);
        // A hit moves its next read.
        assert_eq!(c.read(6, 1, 1000, |_| panic!()), Decision::Hit);
        out.clear();
        assert_eq!(c.read(9, 1, 8, |e| out.push(e)), Decision::Admit);
        assert_eq!(out, vec![6]);
    }
}
