//! A serve poller's connection table: its connections in a fixed pool
//! (`max_conns_per_poller`, allocated at start, never grown), the dense
//! list of the occupied keys (walked only at the periodic sweeps, a slice
//! at a time), and the work list: the connections a tick has something to
//! do for ([`SConn::active`]), which every per-tick loop walks, so a
//! tick's work follows what happened, not how many consumers are
//! connected (4,095 idle consumer links cost a tick nothing).

use super::conn::SConn;
use crate::pool::Pool;

pub(super) struct Conns {
    pool: Pool<SConn>,
    /// The keys of the occupied entries, in the order they were adopted.
    /// A removed connection stays listed until [`Conns::prune`] (at the
    /// next tick's start), so that a loop over [`Conns::live_len`] may
    /// close and reap connections as it goes; its key is reused only by an
    /// adopt, which comes after the prune.
    live: Vec<u32>,
    /// The keys of the connections marked since they were last found
    /// inactive, each once (`SConn::in_work`): at most the pool's limit,
    /// so it never grows past its start capacity.
    work: Vec<u32>,
}

impl Conns {
    /// A table for `limit` connections, allocated now.
    pub(super) fn with_limit(limit: usize) -> Self {
        Conns {
            pool: Pool::with_limit(limit),
            live: Vec::with_capacity(limit),
            work: Vec::with_capacity(limit),
        }
    }

    /// Connections it may hold.
    #[cfg(test)]
    pub(super) fn limit(&self) -> usize {
        self.pool.limit()
    }

    /// Connections it holds now.
    pub(super) fn len(&self) -> usize {
        self.pool.len()
    }

    /// The key the next [`Conns::adopt`] takes, unless the table is full.
    pub(super) fn vacant_key(&self) -> Option<u32> {
        self.pool.vacant_key().map(|k| k as u32)
    }

    /// Stores connection `c` under `ci`, the [`Conns::vacant_key`] it was
    /// built for (its ring operations carry that key).
    pub(super) fn adopt(&mut self, ci: u32, c: SConn) {
        self.live.push(ci);
        let taken = self.pool.insert(c);
        debug_assert!(
            matches!(taken, Ok(k) if k == ci as usize),
            "adopt: the vacant key"
        );
    }

    /// Takes connection `ci` out (it stays listed in the live list until
    /// the next [`Conns::prune`]). Panics if there is none.
    pub(super) fn remove(&mut self, ci: u32) -> SConn {
        self.pool.remove(ci as usize)
    }

    /// Drops the removed connections from the live list; before any adopt
    /// (a removed key may be reused right after).
    pub(super) fn prune(&mut self) {
        let pool = &self.pool;
        self.live.retain(|&ci| pool.contains(ci as usize));
        self.work.retain(|&ci| pool.contains(ci as usize));
    }

    /// Puts connection `ci` in the work list (once), if it is there.
    pub(super) fn mark(&mut self, ci: u32) {
        if let Some(c) = self.pool.get_mut(ci as usize) {
            if !c.in_work {
                c.in_work = true;
                self.work.push(ci);
            }
        }
    }

    /// Drops from the work list the connections with nothing to do (after
    /// [`Conns::prune`]); an event marks them again.
    pub(super) fn settle_work(&mut self) {
        let pool = &mut self.pool;
        self.work.retain(|&ci| match pool.get_mut(ci as usize) {
            Some(c) if c.active() => true,
            Some(c) => {
                c.in_work = false;
                false
            }
            None => false,
        });
    }

    /// Entries of the work list: per-tick loops walk `0..work_len()` with
    /// [`Conns::work`], its length read once (a connection may be removed
    /// meanwhile: look it up with `get`; one marked during the loop waits
    /// for the next loop that walks the list).
    pub(super) fn work_len(&self) -> usize {
        self.work.len()
    }

    /// The key at place `k` of the work list.
    pub(super) fn work(&self, k: usize) -> u32 {
        self.work[k]
    }

    /// Entries of the live list (a removed connection counts until the
    /// next prune): loops walk `0..live_len()` with [`Conns::live`].
    pub(super) fn live_len(&self) -> usize {
        self.live.len()
    }

    /// The key at place `k` of the live list (its connection may have
    /// been removed since the last prune: look it up with `get`).
    pub(super) fn live(&self, k: usize) -> u32 {
        self.live[k]
    }

    /// The connections of the live list that are still there, with their
    /// keys.
    pub(super) fn iter_live(&self) -> impl Iterator<Item = (u32, &SConn)> + '_ {
        self.live
            .iter()
            .filter_map(|&ci| self.pool.get(ci as usize).map(|c| (ci, c)))
    }

    /// The connections of the work list that are still there, with their
    /// keys.
    pub(super) fn iter_work(&self) -> impl Iterator<Item = (u32, &SConn)> + '_ {
        self.work
            .iter()
            .filter_map(|&ci| self.pool.get(ci as usize).map(|c| (ci, c)))
    }

    /// Connection `ci`, if it is there.
    pub(super) fn get(&self, ci: u32) -> Option<&SConn> {
        self.pool.get(ci as usize)
    }

    /// Connection `ci`, if it is there.
    pub(super) fn get_mut(&mut self, ci: u32) -> Option<&mut SConn> {
        self.pool.get_mut(ci as usize)
    }

    /// Every connection, with its key (walks the whole pool: not for
    /// per-tick loops).
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &SConn)> + '_ {
        self.pool.iter()
    }

    /// Checks (debug builds) that the pool has not grown since start and
    /// the live list holds every connection, within the limit.
    pub(super) fn check(&self) {
        self.pool.check();
        debug_assert!(self.live.len() <= self.pool.limit());
        debug_assert!(self.live.len() >= self.pool.len());
        debug_assert!(self.work.len() <= self.pool.limit());
        // Every connection a tick has work for is in the work list: one
        // left out would wait for an event that may never come (a grant
        // never read, a frame never flushed).
        // (A walk of every connection at every tick: only for tables of
        // up to 512, the tests' and the simulator's.)
        #[cfg(debug_assertions)]
        for (ci, c) in self.iter_live().take_while(|_| self.pool.len() <= 512) {
            assert!(
                !c.active() || c.in_work,
                "connection {ci} has work (grants {}, held {}, receive posted {}, link pending {}) but is not in the work list",
                c.grants.len(),
                c.held,
                c.rx.inflight(),
                c.link.pending()
            );
        }
    }
}
