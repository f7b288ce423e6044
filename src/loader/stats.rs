//! Counters and the [`Stats`] a loader reports.

use std::sync::atomic::Ordering;
use std::time::Duration;

use hdrhistogram::Histogram;

use super::Shared;
use crate::sampler::{EpochDigest, RankPosition};

#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Counters {
    pub(super) samples: u64,
    pub(super) bytes: u64,
    pub(super) stall: Duration,
    pub(super) stall_waits: u64,
}

/// What the pollers and the network thread counted, summed over runs.
#[derive(Clone)]
pub(super) struct Totals {
    pub(super) disk_reads: u64,
    pub(super) tier_hits: u64,
    pub(super) retries: u64,
    pub(super) loop_stalls: u64,
    pub(super) remote_samples: u64,
    pub(super) failovers: u64,
    pub(super) source_reads: u64,
    pub(super) source_bytes: u64,
    /// Samples read ahead that a restart or the end threw away.
    pub(super) discarded: u64,
    /// An attached rank: samples the agent read from its cache area.
    pub(super) agent_cache_hits: u64,
    pub(super) latency: Histogram<u64>,
    /// Disk reads by latency bucket, as `PollerStats::latency_buckets`.
    pub(super) latency_buckets: [u64; crate::agent::segment::LATENCY_BUCKETS],
}

impl Totals {
    pub(super) fn new() -> Self {
        Totals {
            disk_reads: 0,
            tier_hits: 0,
            retries: 0,
            loop_stalls: 0,
            remote_samples: 0,
            failovers: 0,
            source_reads: 0,
            source_bytes: 0,
            discarded: 0,
            agent_cache_hits: 0,
            latency: Histogram::new_with_bounds(1, 60_000_000, 2).expect("valid bounds"),
            latency_buckets: Default::default(),
        }
    }

    /// Adds what one run counted (`next_g`: the consumer's next sample).
    pub(super) fn add_run(&mut self, sh: &Shared, next_g: u64) {
        self.add_counters(sh);
        // Once per run (at its end): what it read ahead and nobody took.
        self.discarded += sh.ready_from(next_g);
    }

    /// Adds one run's counters and latency: O(pollers).
    pub(super) fn add_counters(&mut self, sh: &Shared) {
        for s in &sh.stats {
            self.disk_reads += s.disk_reads.load(Ordering::Relaxed);
            self.source_reads += s.source_reads.load(Ordering::Relaxed);
            self.source_bytes += s.source_bytes.load(Ordering::Relaxed);
            self.tier_hits += s.tier_hits.load(Ordering::Relaxed);
            self.retries += s.retries.load(Ordering::Relaxed);
            self.loop_stalls += s.loop_stalls.load(Ordering::Relaxed);
            let _ = self
                .latency
                .add(&*s.latency.lock().unwrap_or_else(|e| e.into_inner()));
            for (t, b) in self.latency_buckets.iter_mut().zip(&s.latency_buckets) {
                *t += b.load(Ordering::Relaxed);
            }
        }
        if let Some(n) = &sh.net {
            self.remote_samples += n.remote_samples.load(Ordering::Relaxed);
            self.tier_hits += n.tier_hits.load(Ordering::Relaxed);
            self.failovers += n.failovers.load(Ordering::Relaxed);
            self.source_reads += n.source_reads.load(Ordering::Relaxed);
            self.source_bytes += n.source_bytes.load(Ordering::Relaxed);
            self.loop_stalls += n.loop_stalls.load(Ordering::Relaxed);
        }
    }
}
/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct Latency {
    /// Reads measured.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 90th percentile.
    pub p90_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Largest.
    pub max_us: u64,
}

/// Loader statistics since it was built, cumulative over its life
/// (restarts by `set_epoch` or `restore_position` included). `samples` and
/// `bytes` count what was delivered; the read counters (`disk_reads`,
/// `tier_hits`, `remote_samples`, `source_reads`, `cache.hits`,
/// `cache_memory.hits`) also count samples read
/// ahead, which are either still waiting (`read_ahead`) or were thrown away
/// (`read_ahead_discarded`): their sum is `samples + read_ahead +
/// read_ahead_discarded` (empty and failed samples aside). With
/// [`LoaderBuilder::end_epoch`](super::LoaderBuilder::end_epoch) nothing is
/// read past the last epoch, so after a run that consumed every epoch both
/// read-ahead counters are 0 and the read counters add up to `samples`.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Stats {
    /// Samples delivered.
    pub samples: u64,
    /// Bytes delivered.
    pub bytes: u64,
    /// Time since the loader was built.
    pub elapsed: Duration,
    /// Time the caller waited inside `next_batch`.
    pub stall: Duration,
    /// Times the caller waited inside `next_batch` (for a sample, or an
    /// attached rank's batch, not yet in): with `stall`, the mean wait.
    /// Where every sample comes from this node's disk a wait lasts until
    /// the rest of its batch is in, about one per batch at most; elsewhere
    /// each wait is for one sample, charged to its path (`stall_causes`).
    pub stall_waits: u64,
    /// `stall` charged to its causes: the sample waited for and how it
    /// came (disk, tier, source, which peer, failover; the agent).
    pub stall_causes: super::StallCauses,
    /// How long before the caller asked for them the samples that came
    /// from the source (a partial space's others, a bucket read directly,
    /// the source after a failover) were in the ring: the prefetch's lead
    /// over the need (0 for a sample the caller waited for). Not counted
    /// for a rank attached to the node agent (its samples come in whole
    /// batches).
    pub source_lead: LeadTime,
    /// Samples read from disk: the space's extents, or a source read
    /// directly (`source`: its files, or its objects in a bucket); a
    /// partial space's others are `source_reads`.
    pub disk_reads: u64,
    /// Samples served from the memory tier.
    pub tier_hits: u64,
    /// Reads retried (short or interrupted).
    pub retries: u64,
    /// Ticks of the pollers' and the network thread's loops that took
    /// longer than the stall threshold (`KSPEED_STALL_MS`, default 50 ms;
    /// each is logged, at most once per 10 s per loop, with what the tick
    /// was doing): blocking work on a thread that must not block.
    pub loop_stalls: u64,
    /// Per-sample read latency (submission to completion) of disk reads.
    pub read_latency: Latency,
    /// Samples pushed by other nodes (cluster mode).
    pub remote_samples: u64,
    /// Grants moved to another holder or the source after a node failed.
    pub failovers: u64,
    /// Samples read from the source: those a partial space does not hold
    /// (`kspeed preload --max-bytes`), and in cluster mode those no holder
    /// could serve.
    pub source_reads: u64,
    /// Their bytes (what the source gave the loader).
    pub source_bytes: u64,
    /// The cache area (`cache_dir`; all 0 without one): its hits are
    /// samples that would have come from the source, or, for an area in
    /// memory, from the source or the space (they are not in `disk_reads`
    /// or `source_reads`, and join the read counters' sum).
    pub cache: crate::cache::CacheStats,
    /// The memory level above the cache area (`cache_memory_bytes`; all 0
    /// without one): an area in memory read before `cache`, so its hits
    /// are not in `cache.hits` (nor in `disk_reads` or `source_reads`).
    pub cache_memory: crate::cache::CacheStats,
    /// Samples read ahead of the consumer and waiting in the ring now
    /// (counted in `disk_reads`, `tier_hits` or `remote_samples`, not yet
    /// in `samples`). A rank attached to the node agent: 0; the agent's
    /// reads for it count with the batch it publishes after them, so at an
    /// epoch's end the read counters may include its first reads of the
    /// next epoch.
    pub read_ahead: u64,
    /// Samples read ahead and then thrown away unconsumed: by a
    /// `set_epoch` to another epoch, a `restore_position`, or the end (for
    /// example the next epoch's first samples when the job stops).
    pub read_ahead_discarded: u64,
    /// Where the pollers run (the core lists: [`Loader::placement`](super::Loader::placement)).
    pub placement: PlacementStats,
    /// The exactly-once digest of the ids delivered in the epoch of the
    /// last delivered sample ([`Loader::digest`](super::Loader::digest)).
    pub digest: EpochDigest,
    /// Where this rank stood in `digest.epoch` when the digest was taken.
    pub digest_at: RankPosition,
}

/// The pollers' placement in [`Stats`] (counts; [`Loader::placement`](super::Loader::placement) has
/// the cores themselves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlacementStats {
    /// This loader's rank among the node's ranks.
    pub local_rank: u32,
    /// Ranks on the node.
    pub local_world: u32,
    /// The NUMA node the slice was taken from, if any.
    pub numa_node: Option<u32>,
    /// Cores in this rank's slice (0: pollers not pinned).
    pub slice_cores: u32,
    /// The slice is shared with other ranks (more ranks than cores).
    pub shared: bool,
    /// Poller threads.
    pub pollers: u32,
    /// Pollers the kernel pinned to a core of the slice.
    pub pinned_pollers: u32,
}

impl Stats {
    /// Samples per second.
    pub fn samples_per_sec(&self) -> f64 {
        self.samples as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Bytes per second.
    pub fn bytes_per_sec(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Fraction of the time spent waiting for data.
    pub fn stall_fraction(&self) -> f64 {
        self.stall.as_secs_f64() / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Where a loader's samples came from so far, read without a lock or an
/// allocation (O(pollers)): what the node agent's feeder sends a rank with
/// each batch ([`crate::agent::segment::BatchReads`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ReadCounts {
    pub(crate) disk_reads: u64,
    pub(crate) tier_hits: u64,
    pub(crate) remote_samples: u64,
    pub(crate) source_reads: u64,
    pub(crate) failovers: u64,
    pub(crate) cache_hits: u64,
    pub(crate) source_bytes: u64,
    /// Disk reads by latency bucket (`agent::segment::latency_bucket`).
    pub(crate) read_latency: [u64; crate::agent::segment::LATENCY_BUCKETS],
}

impl ReadCounts {
    /// Adds one run's live counters.
    pub(super) fn add_run(&mut self, sh: &Shared) {
        for s in &sh.stats {
            self.disk_reads += s.disk_reads.load(Ordering::Relaxed);
            self.source_reads += s.source_reads.load(Ordering::Relaxed);
            self.source_bytes += s.source_bytes.load(Ordering::Relaxed);
            self.tier_hits += s.tier_hits.load(Ordering::Relaxed);
            for (t, b) in self.read_latency.iter_mut().zip(&s.latency_buckets) {
                *t += b.load(Ordering::Relaxed);
            }
        }
        if let Some(n) = &sh.net {
            self.remote_samples += n.remote_samples.load(Ordering::Relaxed);
            self.tier_hits += n.tier_hits.load(Ordering::Relaxed);
            self.source_reads += n.source_reads.load(Ordering::Relaxed);
            self.source_bytes += n.source_bytes.load(Ordering::Relaxed);
            self.failovers += n.failovers.load(Ordering::Relaxed);
        }
    }

    /// What was counted since `earlier`, per counter, and `earlier`
    /// moved on by it. Counters only grow;
    /// between two of a feeder's publishes they grow by at most the
    /// samples a ring holds, which fits a u32 by far (a larger step is a
    /// bug, and panics rather than being cut). A latency bucket's 16 bits
    /// take at most 65,535 reads: the rest stays in `earlier`, sent with
    /// a later batch.
    pub(crate) fn since(&self, earlier: &mut ReadCounts) -> crate::agent::segment::BatchReads {
        let mut read_latency = [0u16; crate::agent::segment::LATENCY_BUCKETS];
        for ((out, &now), then) in read_latency
            .iter_mut()
            .zip(&self.read_latency)
            .zip(&mut earlier.read_latency)
        {
            let sent = (now - *then).min(u64::from(u16::MAX));
            *out = sent as u16;
            *then += sent;
        }
        let step = |now: u64, then: u64| {
            u32::try_from(now - then).expect("reads between two publishes fit a u32")
        };
        let reads = crate::agent::segment::BatchReads {
            disk_reads: step(self.disk_reads, earlier.disk_reads),
            tier_hits: step(self.tier_hits, earlier.tier_hits),
            remote_samples: step(self.remote_samples, earlier.remote_samples),
            source_reads: step(self.source_reads, earlier.source_reads),
            failovers: step(self.failovers, earlier.failovers),
            cache_hits: step(self.cache_hits, earlier.cache_hits),
            read_latency,
            waits: Default::default(),
        };
        let latency = earlier.read_latency;
        *earlier = ReadCounts {
            read_latency: latency,
            ..*self
        };
        reads
    }
}

/// A summary of prefetch lead times ([`Stats::source_lead`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeadTime {
    /// Samples counted.
    pub count: u64,
    /// Of them, those the caller waited for (no lead).
    pub late: u64,
    /// The 10th percentile (the short-lead tail: samples that nearly
    /// stalled).
    pub p10: Duration,
    /// The median.
    pub p50: Duration,
}

/// The consumer's record of lead times (microseconds, 3 significant
/// digits; allocated once, nothing per sample).
#[derive(Debug, Clone)]
pub(super) struct LeadTimes {
    hist: Histogram<u64>,
    late: u64,
}

impl Default for LeadTimes {
    fn default() -> Self {
        LeadTimes {
            hist: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds"),
            late: 0,
        }
    }
}

impl LeadTimes {
    pub(super) fn record(&mut self, lead: Duration) {
        if lead.is_zero() {
            self.late += 1;
        }
        // 0 is below the histogram's lowest bound: counted as 1 µs; a lead
        // past an hour saturates.
        self.hist
            .saturating_record((lead.as_micros() as u64).max(1));
    }

    pub(super) fn summary(&self) -> LeadTime {
        if self.hist.is_empty() {
            return LeadTime::default();
        }
        let at = |q: f64| Duration::from_micros(self.hist.value_at_quantile(q));
        LeadTime {
            count: self.hist.len(),
            late: self.late,
            p10: at(0.1),
            p50: at(0.5),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReadCounts;

    /// A latency bucket's 16 bits carry at most 65,535 reads a batch; the
    /// rest goes with the next ones, none lost, and the other counters
    /// step as usual.
    #[test]
    fn latency_counts_over_16_bits_are_carried() {
        let mut sent = ReadCounts::default();
        let mut now = ReadCounts {
            disk_reads: 70_000,
            ..Default::default()
        };
        now.read_latency[3] = 70_000;
        now.read_latency[5] = 7;
        let a = now.since(&mut sent);
        assert_eq!(
            (a.disk_reads, a.read_latency[3], a.read_latency[5]),
            (70_000, 65_535, 7)
        );
        let b = now.since(&mut sent);
        assert_eq!(
            (b.disk_reads, b.read_latency[3], b.read_latency[5]),
            (0, 4_465, 0)
        );
        now.read_latency[3] += 10;
        now.disk_reads += 10;
        let c = now.since(&mut sent);
        assert_eq!((c.disk_reads, c.read_latency[3]), (10, 10));
        assert_eq!(sent, now);
    }
}
