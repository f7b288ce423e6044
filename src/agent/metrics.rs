//! The node agent's own series in its Prometheus metrics (`kspeed agent
//! --listen ADDR --metrics ADDR`, docs/AGENT.md "Metrics"), next to its
//! node service's: the ranks it serves, and what its loaders for them
//! waited for, by cause and for the few nodes waited for longest (a few
//! series per node, whatever the number of ranks or nodes).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::loader::stall_totals::{StallTotals, CAUSES};

/// How many of the peer nodes waited for longest a scrape names.
pub(crate) const SLOWEST_NODES: usize = 4;

/// What a scrape reads: counters the agent's main loop sets and the
/// totals every rank's loader adds its waits to.
#[derive(Debug)]
pub(crate) struct AgentMetrics {
    pub(crate) stalls: Arc<StallTotals>,
    /// Ranks being served now (attached, or their loader being built).
    ranks: AtomicU64,
    /// Ranks served and gone since the agent started.
    ended: AtomicU64,
    /// Attaches refused since the agent started.
    refused: AtomicU64,
    /// The cluster's node addresses by index, for the labels.
    node_addrs: Vec<String>,
}

impl AgentMetrics {
    pub(crate) fn new(stalls: Arc<StallTotals>, node_addrs: Vec<String>) -> Self {
        AgentMetrics {
            stalls,
            ranks: AtomicU64::new(0),
            ended: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            node_addrs,
        }
    }

    /// The main loop's counts after an accept or a reap: ranks served
    /// now, ranks ended and attaches refused so far.
    pub(crate) fn set(&self, ranks: usize, ended: u64, refused: u64) {
        self.ranks.store(ranks as u64, Ordering::Relaxed);
        self.refused.store(refused, Ordering::Relaxed);
        // Last, with Release: a scrape that reads `ended` (Acquire) first
        // sees at least the `ranks` stored with it.
        self.ended.store(ended, Ordering::Release);
    }
}

impl Collector for AgentMetrics {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let ended = self.ended.load(Ordering::Acquire);
        let g = ConstGauge::new(r(&self.ranks) as i64);
        g.encode(e.encode_descriptor(
            "kspeed_agent_ranks",
            "ranks the agent serves now (attached, or being attached)",
            None,
            g.metric_type(),
        )?)?;
        let c = ConstCounter::new(ended);
        c.encode(e.encode_descriptor(
            "kspeed_agent_ranks_ended",
            "ranks served and gone (detached, exited, killed, or failed by the agent)",
            None,
            c.metric_type(),
        )?)?;
        let c = ConstCounter::new(r(&self.refused));
        c.encode(e.encode_descriptor(
            "kspeed_agent_attaches_refused",
            "attaches refused (another dataset, a bad request, a loader that could not be built)",
            None,
            c.metric_type(),
        )?)?;

        let causes = self.stalls.causes();
        let mut fam = e.encode_descriptor(
            "kspeed_agent_wait_seconds",
            "time the agent's loaders waited for the samples of their ranks' batches, by the path of the sample waited for",
            None,
            MetricType::Counter,
        )?;
        for (name, (waited, _)) in CAUSES.iter().zip(causes) {
            ConstCounter::new(waited.as_secs_f64())
                .encode(fam.encode_family(&[("cause", *name)])?)?;
        }
        let mut fam = e.encode_descriptor(
            "kspeed_agent_waits",
            "times the agent's loaders waited for a sample, by its path",
            None,
            MetricType::Counter,
        )?;
        for (name, (_, waits)) in CAUSES.iter().zip(causes) {
            ConstCounter::new(waits).encode(fam.encode_family(&[("cause", *name)])?)?;
        }

        // A few series whatever the cluster's size: the nodes waited for
        // longest so far.
        let slow = self.stalls.slowest(SLOWEST_NODES);
        let label = |n: u32| {
            [
                ("node", n.to_string()),
                (
                    "addr",
                    escape_label(self.node_addrs.get(n as usize).map_or("", |a| a)),
                ),
            ]
        };
        let mut fam = e.encode_descriptor(
            "kspeed_agent_slowest_node_wait_seconds",
            "time the agent's loaders waited for samples a node served or that failed over from it (this node too, for its own reads that failed over), for the 4 nodes waited for longest",
            None,
            MetricType::Gauge,
        )?;
        for w in &slow {
            ConstGauge::new(w.stall.as_secs_f64()).encode(fam.encode_family(&label(w.node))?)?;
        }
        let mut fam = e.encode_descriptor(
            "kspeed_agent_slowest_node_waits",
            "times the agent's loaders waited for a sample of that node, for the same 4 nodes",
            None,
            MetricType::Gauge,
        )?;
        for w in &slow {
            ConstGauge::new(w.waits as i64).encode(fam.encode_family(&label(w.node))?)?;
        }
        Ok(())
    }
}

/// `v` as a label value of the text format: a backslash, a double quote
/// and a line feed escaped (prometheus-client writes label values as
/// given, and a node list's address may hold any of them).
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn label_values_are_escaped() {
        assert_eq!(super::escape_label("10.0.0.1:7400"), "10.0.0.1:7400");
        assert_eq!(super::escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
