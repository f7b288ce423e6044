//! The node service's metrics: counters the pollers bump with relaxed
//! atomics (no lock, no allocation on the data path), read at scrape time
//! by a `prometheus-client` collector and served as Prometheus text by a
//! small HTTP/1.1 server on one thread (`--metrics ADDR`, `GET /metrics`;
//! bounded connections, each with a deadline: see [`serve_http`]); the same
//! numbers go to the log on SIGUSR1 and at exit.
//!
//! Why this file is over ~800 lines: the series and the small server that
//! answers for them are one idea, what a scrape sees and how it is served
//! within its bounds (tests/cluster.rs drives both through real
//! processes); split, each half would need the other's internals.

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
    /// Its frames' time from their post to the link's completion, in
    /// microseconds, and the frames: the slowest links by mean.
    pub(crate) send_us: AtomicU64,
    pub(crate) sends: AtomicU64,
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
            send_us: AtomicU64::new(0),
            sends: AtomicU64::new(0),
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

/// How many of the consumers with the slowest links a scrape names.
pub(crate) const SLOWEST_CONSUMERS: usize = 4;

/// Upper bounds of the latency histograms' buckets, in nanoseconds
/// (integer compares when recording; a scrape shows them in seconds).
const LATENCY_BOUNDS_NS: [u64; 14] = [
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
];

/// A poller's read latencies (submission to completion of each O_DIRECT
/// read of a chunk), in fixed buckets of atomics.
#[derive(Debug, Default)]
pub(crate) struct LatencyHist {
    /// Per bound of [`LATENCY_BOUNDS_NS`], then one for "above".
    buckets: [AtomicU64; LATENCY_BOUNDS_NS.len() + 1],
    sum_ns: AtomicU64,
}

impl LatencyHist {
    pub(crate) fn record(&self, d: Duration) {
        // A poller records a few of these per frame.
        let ns = d.as_nanos() as u64;
        let i = LATENCY_BOUNDS_NS
            .iter()
            .position(|&b| ns <= b)
            .unwrap_or(LATENCY_BOUNDS_NS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// (sum in seconds, count, per-bucket counts: the encoder makes them
    /// cumulative; `f64::MAX` is its "+Inf").
    fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let mut acc = 0;
        let mut out = Vec::with_capacity(LATENCY_BOUNDS_NS.len() + 1);
        for (i, b) in self.buckets.iter().enumerate() {
            let n = b.load(Ordering::Relaxed);
            acc += n;
            let bound = LATENCY_BOUNDS_NS
                .get(i)
                .map_or(f64::MAX, |&ns| ns as f64 / 1e9);
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
    /// Per poller, a grant's other phases at this node (each chunk's):
    /// from its GRANT frame to its staging slot (waiting for a slot or the
    /// consumer's share of them), from its bytes being there to its post
    /// to the link (behind the connection's earlier frames), and from the
    /// post to the link's completion (the socket took the bytes; over
    /// RDMA, the write was acknowledged).
    pub(crate) grant_wait: Box<[LatencyHist]>,
    pub(crate) send_wait: Box<[LatencyHist]>,
    pub(crate) send: Box<[LatencyHist]>,
    /// Per poller: staging slots in all.
    pub(crate) staging_slots: u64,
    /// More series from the process the service runs in, served in the
    /// same scrape: the node agent's (`agent/metrics.rs`).
    pub(crate) extra: std::sync::OnceLock<Arc<dyn Collector>>,
}

impl Metrics {
    pub(crate) fn new(pollers: usize, staging_slots: u64) -> Self {
        Metrics {
            conns: Mutex::new(Vec::new()),
            read_latency: (0..pollers).map(|_| LatencyHist::default()).collect(),
            grant_wait: (0..pollers).map(|_| LatencyHist::default()).collect(),
            send_wait: (0..pollers).map(|_| LatencyHist::default()).collect(),
            send: (0..pollers).map(|_| LatencyHist::default()).collect(),
            staging_slots,
            extra: std::sync::OnceLock::new(),
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
            "kspeed_serve_node_notices_sent",
            "node-down notices sent to consumers (the agent's consumer side judged a node dead)",
            r(&s.node_notices_sent),
        )?;
        counter(
            &mut e,
            "kspeed_serve_probes",
            "probes from consumers told this node is down, each answered with a heartbeat",
            r(&s.probes),
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
        counter(
            &mut e,
            "kspeed_serve_read_retries",
            "reads submitted again after EAGAIN, EINTR or a short read",
            r(&s.read_retries),
        )?;
        counter(
            &mut e,
            "kspeed_serve_loop_stalls",
            "poller and acceptor ticks longer than the stall threshold (KSPEED_STALL_MS)",
            r(&s.loop_stalls),
        )?;
        counter(
            &mut e,
            "kspeed_serve_poller_ticks",
            "ticks of the pollers' loops",
            r(&s.poller_ticks),
        )?;
        let busy = ConstCounter::new(r(&s.poller_busy_ns) as f64 / 1e9);
        busy.encode(e.encode_descriptor(
            "kspeed_serve_poller_busy_seconds",
            "time the pollers' ticks spent busy, from waking to the next wait (0 with KSPEED_STALL_MS=0)",
            None,
            busy.metric_type(),
        )?)?;
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

        // The slowest links: the consumers whose frames took longest from
        // their post to the link's completion, by mean (a few series
        // whatever the number of consumers).
        let mut slow: Vec<(f64, &Arc<ConnMetrics>)> = conns
            .iter()
            .filter_map(|m| {
                let n = m.sends.load(Ordering::Relaxed);
                (n > 0).then(|| (m.send_us.load(Ordering::Relaxed) as f64 / n as f64 / 1e6, m))
            })
            .collect();
        slow.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut fam = e.encode_descriptor(
            "kspeed_serve_slowest_consumer_send_seconds",
            "mean time from posting a frame to the link's completion, for the consumers with the slowest links (at most 4)",
            None,
            MetricType::Gauge,
        )?;
        for (mean_s, m) in slow.iter().take(SLOWEST_CONSUMERS) {
            let labels = [
                ("peer", m.peer.clone()),
                ("rank", m.rank.to_string()),
                ("world", m.world.to_string()),
            ];
            ConstGauge::new(*mean_s).encode(fam.encode_family(&labels)?)?;
        }

        let phases: [(&str, &str, &[LatencyHist]); 4] = [
            (
                "kspeed_serve_read_latency_seconds",
                "time from submitting an O_DIRECT read of a chunk to its completion, per poller",
                &c.metrics.read_latency,
            ),
            (
                "kspeed_serve_grant_wait_seconds",
                "time from reading a grant to taking a staging slot for its chunk (slots busy, or the consumer's share of them held), per poller",
                &c.metrics.grant_wait,
            ),
            (
                "kspeed_serve_send_wait_seconds",
                "time from a chunk's bytes being there to posting it to the link (behind the connection's earlier frames), per poller",
                &c.metrics.send_wait,
            ),
            (
                "kspeed_serve_send_seconds",
                "time from posting a chunk to the link's completion (the socket took it; over RDMA, the write was acknowledged), per poller",
                &c.metrics.send,
            ),
        ];
        for (name, help, hists) in phases {
            let mut fam = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
            for (i, h) in hists.iter().enumerate() {
                let (sum, count, buckets) = h.snapshot();
                let labels = [("poller", i.to_string())];
                fam.encode_family(&labels)?
                    .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                        sum, count, &buckets, None,
                    )?;
            }
        }
        Ok(())
    }
}

/// [`Metrics::extra`] registered for one scrape.
#[derive(Debug)]
struct Extra(Arc<dyn Collector>);

impl Collector for Extra {
    fn encode(&self, e: DescriptorEncoder) -> std::fmt::Result {
        self.0.encode(e)
    }
}

/// The text a scrape returns.
pub(crate) fn render(c: &Arc<Common>) -> String {
    let mut reg = Registry::default();
    reg.register_collector(Box::new(ServeCollector(c.clone())));
    if let Some(x) = c.metrics.extra.get() {
        reg.register_collector(Box::new(Extra(x.clone())));
    }
    encode(&reg)
}

/// `reg` as OpenMetrics text.
fn encode(reg: &Registry) -> String {
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, reg) {
        log::error!("encoding metrics: {e}");
    }
    out
}

/// What a metrics port serves ([`serve_http`]): the node service's series
/// (with the agent's, when it runs one), or an agent's alone (`kspeed
/// agent --metrics` without `--listen`).
pub(crate) trait MetricsSource {
    /// The text a scrape returns.
    fn render(&self) -> String;
    /// The server stops once this is true.
    fn stopping(&self) -> bool;
}

impl MetricsSource for Arc<Common> {
    fn render(&self) -> String {
        render(self)
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// An agent's series alone, served until `stop` (no node service).
pub(crate) struct SeriesOnly {
    pub(crate) series: Arc<dyn Collector>,
    pub(crate) stop: Arc<std::sync::atomic::AtomicBool>,
}

impl MetricsSource for SeriesOnly {
    fn render(&self) -> String {
        let mut reg = Registry::default();
        reg.register_collector(Box::new(Extra(self.series.clone())));
        encode(&reg)
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// Metrics connections served at once. A scraper needs one; a newer
/// connection beyond this closes the oldest that has sent nothing yet (so
/// silent connections cannot hold the port), never one that sent part of
/// its request or is being answered: with none to close, new connections
/// wait in the listen backlog until a slot frees (at most
/// [`METRICS_CONN_TIMEOUT`]).
pub(crate) const METRICS_MAX_CONNS: usize = 16;

/// A metrics connection's whole life, from accept to the answer written:
/// a connection that has not sent its request, or not read the answer, by
/// then is closed.
pub(crate) const METRICS_CONN_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest request head (request line and headers) read; a longer one
/// is answered 431.
const METRICS_MAX_REQUEST_BYTES: usize = 8192;

/// The metrics port's listener, bound when the service starts (so a port in
/// use fails the start); [`serve_http`] serves it on one thread.
pub(crate) struct MetricsListener {
    listener: std::net::TcpListener,
    addr: std::net::SocketAddr,
}

impl MetricsListener {
    /// Binds `addr` (`HOST:PORT`; port 0 picks one).
    pub(crate) fn bind(addr: &str) -> crate::error::Result<Self> {
        let fail = |e: std::io::Error| {
            crate::error::Error::Serve(format!("cannot serve metrics on {addr}: {e}"))
        };
        let listener = std::net::TcpListener::bind(addr).map_err(fail)?;
        listener.set_nonblocking(true).map_err(fail)?;
        let addr = listener.local_addr().map_err(fail)?;
        Ok(MetricsListener { listener, addr })
    }

    /// The address it listens on.
    pub(crate) fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

/// Where a metrics connection is.
enum HttpStage {
    /// Reading the request head.
    Request,
    /// Writing the answer (`sent` bytes of `out` so far).
    Answer { out: Vec<u8>, sent: usize },
    /// Answer written and our side shut: reading until the client closes,
    /// so unread request bytes do not turn the close into a reset that
    /// could discard the answer.
    Drain,
}

/// One metrics connection.
struct HttpConn {
    sock: std::net::TcpStream,
    deadline: Instant,
    /// The request head so far (a buffer from the pool).
    buf: Box<[u8]>,
    have: usize,
    stage: HttpStage,
}

/// The answer to a request head: status line, content type, body (HEAD:
/// the same status and headers, no body).
fn answer(c: &impl MetricsSource, head: &[u8]) -> Vec<u8> {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = std::str::from_utf8(line).unwrap_or("").trim_end();
    let mut parts = line.split(' ');
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let head_only = method == "HEAD";
    let (status, ctype, body) = if !parts.next().is_some_and(|v| v.starts_with("HTTP/")) {
        (
            "400 Bad Request",
            "text/plain",
            "bad request: expected GET /metrics HTTP/1.1\n".to_string(),
        )
    } else if (method == "GET" || head_only) && (path == "/metrics" || path == "/") {
        (
            "200 OK",
            // What prometheus-client writes: OpenMetrics text (counters'
            // samples named `_total`, a final `# EOF`), so labelled as such.
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            c.render(),
        )
    } else {
        (
            "404 Not Found",
            "text/plain",
            "not found: GET /metrics\n".to_string(),
        )
    };
    let mut out = http_response(status, ctype, &body);
    if head_only {
        // The headers GET would get (Content-Length included), no body.
        out.truncate(out.len() - body.len());
    }
    out
}

fn http_response(status: &str, ctype: &str, body: &str) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

impl HttpConn {
    /// Moves the connection on as far as it goes without blocking; true
    /// when it is finished (answered and closed by the client, or failed).
    fn step(&mut self, c: &impl MetricsSource) -> bool {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        loop {
            match &mut self.stage {
                HttpStage::Request => {
                    let n = match self.sock.read(&mut self.buf[self.have..]) {
                        Ok(0) => return true,
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => return true,
                    };
                    // Look for the blank line from where it could start.
                    let from = self.have.saturating_sub(3);
                    self.have += n;
                    let head = &self.buf[..self.have];
                    let end = head[from..]
                        .windows(4)
                        .position(|w| w == b"\r\n\r\n")
                        .or_else(|| head[from..].windows(2).position(|w| w == b"\n\n"));
                    let out = if end.is_some() {
                        answer(c, head)
                    } else if self.have == self.buf.len() {
                        http_response(
                            "431 Request Header Fields Too Large",
                            "text/plain",
                            "request head too large\n",
                        )
                    } else {
                        continue;
                    };
                    self.stage = HttpStage::Answer { out, sent: 0 };
                }
                HttpStage::Answer { out, sent } => {
                    match crate::sys::send_nonblocking(self.sock.as_raw_fd(), &out[*sent..]) {
                        Ok(n) => *sent += n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => return true,
                    }
                    if *sent == out.len() {
                        let _ = self.sock.shutdown(std::net::Shutdown::Write);
                        self.stage = HttpStage::Drain;
                    }
                }
                HttpStage::Drain => match self.sock.read(&mut self.buf) {
                    Ok(0) => return true,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return true,
                },
            }
        }
    }

    /// May be closed to make room: it has sent nothing yet.
    fn evictable(&self) -> bool {
        matches!(self.stage, HttpStage::Request) && self.have == 0
    }

    fn events(&self) -> i16 {
        match self.stage {
            HttpStage::Answer { .. } => libc::POLLOUT,
            _ => libc::POLLIN,
        }
    }
}

/// Serves `GET /metrics` on `server` until the service stops, on the
/// calling thread alone: at most [`METRICS_MAX_CONNS`] connections at once
/// (a newer one closes the oldest that sent nothing yet, else waits in the
/// backlog), each closed at
/// [`METRICS_CONN_TIMEOUT`] after its accept, one answer per connection.
/// The port costs this one thread and at most that many descriptors,
/// however many connections arrive.
pub(crate) fn serve_http(c: impl MetricsSource, server: MetricsListener) {
    use std::os::fd::AsRawFd;
    let mut conns: Vec<HttpConn> = Vec::with_capacity(METRICS_MAX_CONNS);
    let mut spare: Vec<Box<[u8]>> = (0..METRICS_MAX_CONNS)
        .map(|_| vec![0u8; METRICS_MAX_REQUEST_BYTES].into_boxed_slice())
        .collect();
    let mut pollfds: Vec<libc::pollfd> = Vec::with_capacity(METRICS_MAX_CONNS + 1);
    // After an accept failure for lack of descriptors: no accepting before this.
    let mut paused_until: Option<Instant> = None;
    let mut evicted = 0u64;
    while !c.stopping() {
        let now = Instant::now();
        // Expired connections close (their buffers go back to the pool).
        conns.retain_mut(|h| {
            let live = h.deadline > now;
            if !live {
                spare.push(std::mem::take(&mut h.buf));
            }
            live
        });
        if paused_until.is_some_and(|t| now >= t) {
            paused_until = None;
        }
        // Full, with no connection that may be closed to make room: new
        // ones wait in the backlog (a scrape is delayed, not aborted).
        let room = conns.len() < METRICS_MAX_CONNS || conns.iter().any(|h| h.evictable());
        pollfds.clear();
        pollfds.push(libc::pollfd {
            fd: server.listener.as_raw_fd(),
            events: if paused_until.is_none() && room {
                libc::POLLIN
            } else {
                0
            },
            revents: 0,
        });
        for h in &conns {
            pollfds.push(libc::pollfd {
                fd: h.sock.as_raw_fd(),
                events: h.events(),
                revents: 0,
            });
        }
        // Wake for the stop flag, the oldest deadline and the pause.
        let mut wake = now + Duration::from_millis(100);
        if let Some(h) = conns.first() {
            wake = wake.min(h.deadline);
        }
        if let Some(t) = paused_until {
            wake = wake.min(t);
        }
        let ms = wake.saturating_duration_since(now).as_millis() as i32 + 1;
        if let Err(e) = crate::sys::poll_fds(&mut pollfds, ms) {
            log::error!("metrics endpoint: poll: {e}");
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        // Connections in order (a finished one is removed and its pollfd
        // skipped), then new ones.
        let (mut i, mut fd_i) = (0, 1);
        while i < conns.len() {
            let ready = pollfds[fd_i].revents != 0;
            fd_i += 1;
            if ready && conns[i].step(&c) {
                let mut h = conns.remove(i);
                spare.push(std::mem::take(&mut h.buf));
                continue;
            }
            i += 1;
        }
        if pollfds[0].revents == 0 {
            continue;
        }
        for _ in 0..64 {
            if conns.len() >= METRICS_MAX_CONNS && !conns.iter().any(|h| h.evictable()) {
                break;
            }
            let sock = match server.listener.accept() {
                Ok((sock, _)) => sock,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                    ) =>
                {
                    log::warn!("metrics endpoint: accept: {e}; pausing 100 ms");
                    paused_until = Some(Instant::now() + Duration::from_millis(100));
                    break;
                }
                Err(e) => {
                    // That one connection is gone (ECONNABORTED...).
                    log::debug!("metrics endpoint: accept: {e}");
                    continue;
                }
            };
            if sock.set_nonblocking(true).is_err() {
                continue;
            }
            if conns.len() >= METRICS_MAX_CONNS {
                // Checked before the accept: one has sent nothing yet.
                let k = conns
                    .iter()
                    .position(|h| h.evictable())
                    .expect("a connection that sent nothing");
                let mut old = conns.remove(k);
                spare.push(std::mem::take(&mut old.buf));
                evicted += 1;
                if evicted.is_power_of_two() {
                    log::info!(
                        "metrics endpoint: {evicted} connections that sent nothing closed to make room for newer ones (at most {METRICS_MAX_CONNS} at once)"
                    );
                }
            }
            let mut h = HttpConn {
                sock,
                deadline: Instant::now() + METRICS_CONN_TIMEOUT,
                buf: spare.pop().expect("a spare buffer per connection"),
                have: 0,
                stage: HttpStage::Request,
            };
            // The request usually came with the connection: try it now.
            if h.step(&c) {
                spare.push(std::mem::take(&mut h.buf));
            } else {
                conns.push(h);
            }
        }
    }
}

/// The statistics line set (SIGUSR1, exit).
pub(crate) fn log_stats(c: &Common, why: &str) {
    let s = &c.stats;
    let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
    log::warn!(
        "statistics ({why}): {} consumers now, {} accepted, {} refused ({} handshake timeouts, {} evicted, {} accept errors), {} dropped ({} stalled); {} samples, {} bytes pushed, {} grants answered with ERROR, {} reads retried, {} loop stalls",
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
        r(&s.errors),
        r(&s.read_retries),
        r(&s.loop_stalls)
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
