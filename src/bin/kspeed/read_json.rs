//! `kspeed read --json`: the final report as one JSON object on stdout
//! (exact numbers, no human units), for scripts and dashboards.

use kspeed::loader::Stats;
use kspeed::placement::PollerPlacement;
use serde_json::json;

/// What the report needs beyond the loader's statistics.
pub(crate) struct Run {
    pub(crate) epochs: u64,
    pub(crate) wall_secs: f64,
    pub(crate) cpu_secs: f64,
    pub(crate) setup_cpu_secs: f64,
    /// `--idle-ms`: CPU used while idle with the ring full, in cores.
    pub(crate) idle_core_fraction: Option<f64>,
    pub(crate) cluster: Option<&'static str>,
    /// `--digest`: CRC32C over every sample's id and bytes in order.
    pub(crate) digest: Option<u32>,
    /// `--tier-views`: samples handed out in place in the memory tier (the
    /// node tier, attached), not copied into the ring.
    pub(crate) tier_views: Option<u64>,
    /// Each epoch's own figures, in order.
    pub(crate) per_epoch: Vec<EpochReport>,
}

/// One epoch of a read: what it delivered, how long it took, and where its
/// samples came from (the counters' growth over the epoch; read-ahead
/// counts where it was read).
pub(crate) struct EpochReport {
    pub(crate) epoch: u64,
    pub(crate) samples: u64,
    pub(crate) bytes: u64,
    pub(crate) seconds: f64,
    pub(crate) disk_reads: u64,
    pub(crate) tier_hits: u64,
    /// A partial space's samples read from its source, and their bytes.
    pub(crate) source_reads: u64,
    pub(crate) source_bytes: u64,
    /// The cache area's hits and writes (`--cache-dir`).
    pub(crate) cache_hits: u64,
    pub(crate) cache_planned_hits: u64,
    pub(crate) cache_writes: u64,
    /// The memory level's hits above the area (`--cache-memory-bytes`).
    pub(crate) cache_memory_hits: u64,
}

impl EpochReport {
    /// The epoch `epoch` between the stats at its start and at its end.
    pub(crate) fn between(epoch: u64, start: &Stats, end: &Stats, seconds: f64) -> Self {
        EpochReport {
            epoch,
            samples: end.samples - start.samples,
            bytes: end.bytes - start.bytes,
            seconds,
            disk_reads: end.disk_reads - start.disk_reads,
            tier_hits: end.tier_hits - start.tier_hits,
            source_reads: end.source_reads - start.source_reads,
            source_bytes: end.source_bytes - start.source_bytes,
            cache_hits: end.cache.hits - start.cache.hits,
            cache_planned_hits: end.cache.planned_hits - start.cache.planned_hits,
            cache_writes: end.cache.writes - start.cache.writes,
            cache_memory_hits: end.cache_memory.hits - start.cache_memory.hits,
        }
    }
}

/// `Stats::stall_causes` in seconds; the slowest peers without the empty
/// entries.
fn stall_causes_json(c: &kspeed::loader::StallCauses) -> serde_json::Value {
    json!({
        "disk_seconds": c.disk.as_secs_f64(),
        "tier_seconds": c.tier.as_secs_f64(),
        "source_seconds": c.source.as_secs_f64(),
        "peers_seconds": c.peers.as_secs_f64(),
        "failover_seconds": c.failover.as_secs_f64(),
        "agent_seconds": c.agent.as_secs_f64(),
        "peer_read_seconds": c.peer_read.as_secs_f64(),
        "peer_send_seconds": c.peer_send.as_secs_f64(),
        "peer_link_seconds": c.peer_link.as_secs_f64(),
        "slowest_peers": c
            .slowest_peers
            .iter()
            .filter(|p| p.waits > 0)
            .map(|p| json!({
                "node": p.node,
                "seconds": p.stall.as_secs_f64(),
                "waits": p.waits,
                "read_seconds": p.read.as_secs_f64(),
                "send_seconds": p.send.as_secs_f64(),
                "link_seconds": p.link.as_secs_f64(),
            }))
            .collect::<Vec<_>>(),
    })
}

pub(crate) fn print(st: &Stats, placement: &PollerPlacement, r: &Run) {
    let wall = r.wall_secs.max(1e-9);
    let mut v = json!({
        "epochs": r.epochs,
        "samples": st.samples,
        "bytes": st.bytes,
        "seconds": r.wall_secs,
        "samples_per_sec": st.samples as f64 / wall,
        "bytes_per_sec": st.bytes as f64 / wall,
        "read_latency_us": {
            "count": st.read_latency.count,
            "p50": st.read_latency.p50_us,
            "p90": st.read_latency.p90_us,
            "p99": st.read_latency.p99_us,
            "p999": st.read_latency.p999_us,
            "max": st.read_latency.max_us,
        },
        "disk_reads": st.disk_reads,
        "source_reads": st.source_reads,
        "source_bytes": st.source_bytes,
        "source_lead": {
            "count": st.source_lead.count,
            "late": st.source_lead.late,
            "p10_ms": st.source_lead.p10.as_secs_f64() * 1e3,
            "p50_ms": st.source_lead.p50.as_secs_f64() * 1e3,
        },
        "tier_hits": st.tier_hits,
        "retries": st.retries,
        "loop_stalls": st.loop_stalls,
        "stall_seconds": st.stall.as_secs_f64(),
        "stall_waits": st.stall_waits,
        "stall_fraction": st.stall.as_secs_f64() / wall,
        "stall_causes": stall_causes_json(&st.stall_causes),
        "cpu_seconds": r.cpu_secs,
        "setup_cpu_seconds": r.setup_cpu_secs,
        "placement": {
            "local_rank": placement.plan.local.rank,
            "local_world_size": placement.plan.local.size,
            "local_rank_from": placement.plan.local.origin,
            "numa_node": placement.plan.numa_node,
            "slice_cores": placement.plan.slice,
            "shared": placement.plan.shared,
            "pollers": placement.pollers,
            "pinned_cores": placement.pinned,
            "warnings": placement.plan.warnings,
        },
    });
    v["per_epoch"] = r
        .per_epoch
        .iter()
        .map(|e| {
            json!({
                "epoch": e.epoch,
                "samples": e.samples,
                "bytes": e.bytes,
                "seconds": e.seconds,
                "samples_per_sec": e.samples as f64 / e.seconds.max(1e-9),
                "disk_reads": e.disk_reads,
                "tier_hits": e.tier_hits,
                "source_reads": e.source_reads,
                "source_bytes": e.source_bytes,
                "cache_hits": e.cache_hits,
                "cache_planned_hits": e.cache_planned_hits,
                "cache_writes": e.cache_writes,
                "cache_memory_hits": e.cache_memory_hits,
            })
        })
        .collect();
    if st.cache.slots == 0 && st.cache.hits > 0 {
        // Attached: the hits of the node agent's area for this rank
        // (its other counters are the agent's, in its log).
        v["cache"] = json!({ "hits": st.cache.hits, "in_agent": true });
    }
    for (key, c) in [("cache", &st.cache), ("cache_memory", &st.cache_memory)] {
        if c.slots == 0 {
            continue;
        }
        v[key] = json!({
            "hits": c.hits,
            "hit_bytes": c.hit_bytes,
            "planned_hits": c.planned_hits,
            "writes": c.writes,
            "write_bytes": c.write_bytes,
            "skipped": c.skipped,
            "corrupt": c.corrupt,
            "write_errors": c.write_errors,
            "held": c.held,
            "slots": c.slots,
            "area_bytes": c.area_bytes,
        });
    }
    if let Some(d) = r.digest {
        v["digest"] = json!(format!("{d:08x}"));
    }
    if let Some(n) = r.tier_views {
        v["tier_views"] = json!(n);
    }
    if let Some(f) = r.idle_core_fraction {
        v["idle_core_fraction"] = json!(f);
    }
    if let Some(transport) = r.cluster {
        v["cluster"] = json!({
            "transport": transport,
            "remote_samples": st.remote_samples,
            "failovers": st.failovers,
            "source_reads": st.source_reads,
        });
    }
    println!("{v}");
}
