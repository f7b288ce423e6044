//! The node service's metrics: counters the pollers bump with relaxed
//! atomics (no lock, no allocation on the data path), read at scrape time
//! by a `prometheus-client` collector and served as Prometheus text by a
//! small HTTP server (`--metrics ADDR`, `GET /metrics`); the same numbers
//! go to the log on SIGUSR1 and at exit.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::Common;

/// One consumer's counters, shared by its poller (writer) and the scrape.
#[derive(Debug)]
pub(crate) struct ConnMetrics {
    pub(crate) peer: String,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) transport: &'static str,
    pub(crate) since: Instant,
    /// Payload bytes sent (DATA frames or RDMA writes completed).
    pub(crate) bytes: AtomicU64,
    /// Samples pushed whole.
    pub(crate) samples: AtomicU64,
    /// Grant entries received.
    pub(crate) grants: AtomicU64,
    /// Grants answered with ERROR.
    pub(crate) errors: AtomicU64,
    /// Staging slots it holds now.
    pub(crate) staging_slots: AtomicU64,
}

impl ConnMetrics {
    pub(crate) fn new(peer: String, rank: u32, world: u32, transport: &'static str) -> Self {
        ConnMetrics {
            peer,
            rank,
            world,
            transport,
            since: Instant::now(),
            bytes: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            grants: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            staging_slots: AtomicU64::new(0),
        }
    }

    /// "N samples, B bytes, G grants, E errors in S s" (for the log).
    pub(crate) fn totals(&self) -> String {
        format!(
            "{} samples, {} bytes, {} grants, {} errors in {:.1} s",
            self.samples.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
            self.grants.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.since.elapsed().as_secs_f64()
        )
    }
}

/// Upper bounds (seconds) of the read-latency histogram's buckets.
pub(crate) const LATENCY_BOUNDS_S: [f64; 14] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    1.0,
];

/// A poller's read latencies (submission to completion of each O_DIRECT
/// read of a chunk), in fixed buckets of atomics.
#[derive(Debug, Default)]
pub(crate) struct LatencyHist {
    /// Per bound of [`LATENCY_BOUNDS_S`], then one for "above".
    buckets: [AtomicU64; LATENCY_BOUNDS_S.len() + 1],
    sum_ns: AtomicU64,
}

impl LatencyHist {
    pub(crate) fn record(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = LATENCY_BOUNDS_S
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(LATENCY_BOUNDS_S.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// (sum in seconds, count, per-bucket counts: the encoder makes them
    /// cumulative; `f64::MAX` is its "+Inf").
    fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let mut acc = 0;
        let mut out = Vec::with_capacity(LATENCY_BOUNDS_S.len() + 1);
        for (i, b) in self.buckets.iter().enumerate() {
            let n = b.load(Ordering::Relaxed);
            acc += n;
            let bound = LATENCY_BOUNDS_S.get(i).copied().unwrap_or(f64::MAX);
            out.push((bound, n));
        }
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (sum, acc, out)
    }
}

/// Everything a scrape reports.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    /// The consumers connected now (added at adoption, removed when their
    /// connection is gone).
    pub(crate) conns: Mutex<Vec<Arc<ConnMetrics>>>,
    /// Per poller.
    pub(crate) read_latency: Box<[LatencyHist]>,
    /// Per poller: staging slots in all.
    pub(crate) staging_slots: u64,
}

impl Metrics {
    pub(crate) fn new(pollers: usize, staging_slots: u64) -> Self {
        Metrics {
            conns: Mutex::new(Vec::new()),
            read_latency: (0..pollers).map(|_| LatencyHist::default()).collect(),
            staging_slots,
        }
    }

    pub(crate) fn add(&self, m: Arc<ConnMetrics>) {
        self.conns.lock().expect("not poisoned").push(m);
    }

    pub(crate) fn remove(&self, m: &Arc<ConnMetrics>) {
        let mut v = self.conns.lock().expect("not poisoned");
        if let Some(i) = v.iter().position(|x| Arc::ptr_eq(x, m)) {
            v.swap_remove(i);
        }
    }
}

/// A per-consumer series: name, help, type, how to read it.
type PerConn = (
    &'static str,
    &'static str,
    MetricType,
    fn(&ConnMetrics) -> u64,
);

/// Reads the service's counters at each scrape.
#[derive(Debug)]
struct ServeCollector(Arc<Common>);

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let g = ConstGauge::new(v as i64);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for ServeCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let c = &self.0;
        let s = &c.stats;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut e,
            "kspeed_serve_connections",
            "consumers accepted past HELLO",
            r(&s.connections),
        )?;
        counter(
            &mut e,
            "kspeed_serve_refused",
            "connections refused or closed before their handshake completed",
            r(&s.refused),
        )?;
        counter(
            &mut e,
            "kspeed_serve_handshake_timeouts",
            "handshakes closed at their deadline",
            r(&s.handshake_timeouts),
        )?;
        counter(
            &mut e,
            "kspeed_serve_handshakes_evicted",
            "pending handshakes closed to make room for newer connections",
            r(&s.evicted),
        )?;
        counter(
            &mut e,
            "kspeed_serve_accept_errors",
            "accept failures for lack of descriptors or memory",
            r(&s.accept_errors),
        )?;
        counter(
            &mut e,
            "kspeed_serve_violations",
            "consumers dropped for breaking the protocol or stalling",
            r(&s.violations),
        )?;
        counter(
            &mut e,
            "kspeed_serve_stalled",
            "consumers dropped for taking no data",
            r(&s.stalled),
        )?;
        counter(
            &mut e,
            "kspeed_serve_samples",
            "samples pushed whole",
            r(&s.samples),
        )?;
        counter(
            &mut e,
            "kspeed_serve_bytes",
            "payload bytes pushed",
            r(&s.bytes),
        )?;
        counter(
            &mut e,
            "kspeed_serve_errors",
            "grants answered with ERROR",
            r(&s.errors),
        )?;
        gauge(
            &mut e,
            "kspeed_serve_handshakes_pending",
            "handshakes pending now",
            r(&s.handshakes_pending),
        )?;
        gauge(
            &mut e,
            "kspeed_serve_consumers",
            "consumers connected now",
            c.consumers() as u64,
        )?;
        gauge(
            &mut e,
            "kspeed_serve_staging_slots",
            "staging slots per poller",
            c.metrics.staging_slots,
        )?;

        let conns = c.metrics.conns.lock().expect("not poisoned").clone();
        let per_conn: [PerConn; 5] = [
            (
                "kspeed_consumer_bytes",
                "payload bytes pushed to this consumer",
                MetricType::Counter,
                |m| m.bytes.load(Ordering::Relaxed),
            ),
            (
                "kspeed_consumer_samples",
                "samples pushed whole to this consumer",
                MetricType::Counter,
                |m| m.samples.load(Ordering::Relaxed),
            ),
            (
                "kspeed_consumer_grants",
                "grant entries received from this consumer",
                MetricType::Counter,
                |m| m.grants.load(Ordering::Relaxed),
            ),
            (
                "kspeed_consumer_errors",
                "this consumer's grants answered with ERROR",
                MetricType::Counter,
                |m| m.errors.load(Ordering::Relaxed),
            ),
            (
                "kspeed_consumer_staging_slots",
                "staging slots this consumer holds now",
                MetricType::Gauge,
                |m| m.staging_slots.load(Ordering::Relaxed),
            ),
        ];
        for (name, help, ty, get) in per_conn {
            let mut fam = e.encode_descriptor(name, help, None, ty)?;
            for m in &conns {
                let labels = [
                    ("peer", m.peer.clone()),
                    ("rank", m.rank.to_string()),
                    ("world", m.world.to_string()),
                    ("transport", m.transport.to_string()),
                ];
                let me = fam.encode_family(&labels)?;
                match ty {
                    MetricType::Counter => ConstCounter::new(get(m)).encode(me)?,
                    _ => ConstGauge::new(get(m) as i64).encode(me)?,
                }
            }
        }

        let mut fam = e.encode_descriptor(
            "kspeed_serve_read_latency_seconds",
            "time from submitting an O_DIRECT read of a chunk to its completion, per poller",
            None,
            MetricType::Histogram,
        )?;
        for (i, h) in c.metrics.read_latency.iter().enumerate() {
            let (sum, count, buckets) = h.snapshot();
            let labels = [("poller", i.to_string())];
            fam.encode_family(&labels)?
                .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                    sum, count, &buckets, None,
                )?;
        }
        Ok(())
    }
}

/// The text a scrape returns.
pub(crate) fn render(c: &Arc<Common>) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(ServeCollector(c.clone())));
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &reg) {
        log::error!("encoding metrics: {e}");
    }
    out
}

/// Serves `GET /metrics` on `server` until the service stops.
pub(crate) fn serve_http(c: Arc<Common>, server: tiny_http::Server) {
    while !c.stop.load(Ordering::Acquire) {
        let req = match server.recv_timeout(Duration::from_millis(100)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(e) => {
                log::warn!("metrics endpoint: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let path = req.url().split('?').next().unwrap_or("");
        let res = if *req.method() == tiny_http::Method::Get && (path == "/metrics" || path == "/")
        {
            let ct = tiny_http::Header::from_bytes(
                &b"Content-Type"[..],
                &b"text/plain; version=0.0.4; charset=utf-8"[..],
            )
            .expect("a valid header");
            req.respond(tiny_http::Response::from_string(render(&c)).with_header(ct))
        } else {
            req.respond(
                tiny_http::Response::from_string("not found: GET /metrics\n").with_status_code(404),
            )
        };
        if let Err(e) = res {
            log::debug!("metrics endpoint: answering: {e}");
        }
    }
}

/// The statistics line set (SIGUSR1, exit).
pub(crate) fn log_stats(c: &Common, why: &str) {
    let s = &c.stats;
    let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
    log::warn!(
        "statistics ({why}): {} consumers now, {} accepted, {} refused ({} handshake timeouts, {} evicted, {} accept errors), {} dropped ({} stalled); {} samples, {} bytes pushed, {} grants answered with ERROR",
        c.consumers(),
        r(&s.connections),
        r(&s.refused),
        r(&s.handshake_timeouts),
        r(&s.evicted),
        r(&s.accept_errors),
        r(&s.violations),
        r(&s.stalled),
        r(&s.samples),
        r(&s.bytes),
        r(&s.errors)
    );
    for m in c.metrics.conns.lock().expect("not poisoned").iter() {
        log::warn!(
            "statistics ({why}): consumer {} (rank {} of {}, {}): {}, {} staging slots held",
            m.peer,
            m.rank,
            m.world,
            m.transport,
            m.totals(),
            m.staging_slots.load(Ordering::Relaxed)
        );
    }
}
