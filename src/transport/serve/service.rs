//! The node service's lifecycle: opening the space, starting the acceptor,
//! pollers and metrics server, stopping them, and `kspeed serve`'s signals.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::owner_rdma::open_owner_rdma;
use super::poller::ServePoller;
use super::served::Served;
use super::staging::Staging;
use super::{accept, metrics, Accepted, Common, ServeConfig, ServeStats};
use crate::error::{Error, Result};
use crate::ring::{Uring, UringOptions};
use crate::transport::proto;

/// A running node service. Dropping it stops it.
pub struct NodeService {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    common: Arc<Common>,
    threads: Vec<JoinHandle<()>>,
    /// Held shared while serving: unload and preload --refresh refuse, naming this pid.
    _space_locks: Vec<crate::dataset::preload::SpaceLock>,
}

impl NodeService {
    /// Opens the space, binds, and starts the acceptor and the pollers.
    ///
    /// Should a poller panic (a bug), the whole service stops: its
    /// consumers see their connections close and fail over, it accepts no
    /// more, and the panic is logged as an error naming the poller.
    pub fn start(cfg: ServeConfig) -> Result<NodeService> {
        Self::start_with(cfg, false)
    }

    /// [`NodeService::start`]; with `signal_on_failure`, a poller's panic
    /// also sends the process SIGTERM, so [`serve_until_signal`]'s wait
    /// ends and it returns the failure.
    fn start_with(cfg: ServeConfig, signal_on_failure: bool) -> Result<NodeService> {
        cfg.validate()?;
        crate::sys::raise_open_files_limit();
        let paths = cfg.spaces();
        let space_locks = paths
            .iter()
            .map(|p| crate::dataset::preload::SpaceLock::shared(p))
            .collect::<Result<Vec<_>>>()?;
        let space = Served::open(&paths)?;
        let align = space.align_bytes();
        let chunk = cfg
            .chunk_bytes
            .clamp(align, proto::MAX_DATA_BYTES)
            .next_multiple_of(align);
        let mut cfg = cfg;
        cfg.chunk_bytes = chunk;
        if cfg.max_handshakes == 0 {
            cfg.max_handshakes = auto_max_handshakes(space.params().placement.nodes);
        }
        cfg.max_conns_per_poller = cfg.consumers_per_poller(space.params().placement.nodes);
        cfg.max_grants = cfg.grants_per_consumer(space.params().placement.nodes);
        if cfg.staging_bytes < chunk as u64 {
            return Err(Error::InvalidConfig(format!(
                "staging bytes {} hold no whole {chunk}-byte chunk (chunk bytes rounded up to the space's {align}-byte alignment)",
                cfg.staging_bytes
            )));
        }
        let mut extents = Vec::new();
        let mut warned = false;
        let extent_paths = space.extent_paths();
        for path in &extent_paths {
            let (f, direct) =
                crate::sys::open_direct(path).map_err(|e| Error::io("open", path, e))?;
            if !direct && !cfg.page_cache && !std::mem::replace(&mut warned, true) {
                // Not silent: every read then goes through the page cache.
                log::warn!(
                    "{}: the file system refuses O_DIRECT; the node service reads through the page cache",
                    path.display()
                );
            }
            extents.push(f);
        }
        let mut maps = Vec::new();
        if cfg.page_cache {
            for path in &extent_paths {
                let f = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
                maps.push(
                    crate::sys::ReadOnlyMap::new(&f).map_err(|e| Error::io("mmap", path, e))?,
                );
            }
        }
        let rdma = match &cfg.rdma {
            None => None,
            Some(opts) => Some(open_owner_rdma(opts, &maps, cfg.pollers)?),
        };
        let listener = listen(&cfg.listen)
            .map_err(|e| Error::Serve(format!("cannot listen on {}: {e}", cfg.listen)))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Serve(format!("local address: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Serve(format!("listener: {e}")))?;
        let common = Arc::new(Common {
            space,
            extents,
            maps,
            stop: AtomicBool::new(false),
            stats: ServeStats::default(),
            rdma,
            load: (0..cfg.pollers).map(|_| AtomicUsize::new(0)).collect(),
            metrics: metrics::Metrics::new(cfg.pollers, cfg.slots() as u64),
            failure: std::sync::Mutex::new(None),
            signal_on_failure,
            notices: Arc::new(crate::transport::notices::NodeNotices::new()),
            cfg,
        });
        let metrics_server = match &common.cfg.metrics {
            None => None,
            Some(a) => Some(metrics::MetricsListener::bind(a)?),
        };
        let metrics_addr = metrics_server.as_ref().map(|s| s.local_addr());
        // Everything that can fail is made before the first thread starts;
        // should spawning fail anyway, the threads already running are
        // stopped and joined (none is left behind).
        let mut parts = Vec::with_capacity(common.cfg.pollers);
        for _ in 0..common.cfg.pollers {
            let (sq, cq, _) = common.cfg.ring_entries();
            let ring = Uring::with_cq_entries(
                UringOptions {
                    entries: sq,
                    sqpoll_idle_ms: None,
                },
                cq,
            )?;
            let fds: Vec<i32> = common.extents.iter().map(|f| f.as_raw_fd()).collect();
            if !fds.is_empty() {
                ring.register_files(&fds)?;
            }
            parts.push((ring, Staging::new(&common)?));
        }
        let mut svc = NodeService {
            addr,
            metrics_addr,
            common: common.clone(),
            threads: Vec::new(),
            _space_locks: space_locks,
        };
        let mut senders = Vec::new();
        for (i, (ring, staging)) in parts.into_iter().enumerate() {
            // Room for every consumer the poller may have: the acceptor
            // reserved each one's place at HELLO (`Common::load`), so the
            // hand-off after WELCOME never fails for capacity.
            let (tx, rx) = crossbeam_channel::bounded::<Accepted>(common.cfg.max_conns_per_poller);
            senders.push(tx);
            let c = common.clone();
            let t = std::thread::Builder::new()
                .name(format!("kspeed-serve-{i}"))
                .spawn(move || {
                    use std::panic::{catch_unwind, AssertUnwindSafe};
                    let c2 = c.clone();
                    let fail = |p: Box<dyn std::any::Any + Send>| {
                        let what = crate::error::panic_text(&*p);
                        c2.fail(format!(
                            "poller {i} panicked (a bug; please report it): {what}"
                        ));
                    };
                    let made = catch_unwind(AssertUnwindSafe(move || {
                        ServePoller::new(c, i, ring, staging, rx)
                    }));
                    let mut poller = match made {
                        Ok(p) => p,
                        Err(p) => return fail(p),
                    };
                    match catch_unwind(AssertUnwindSafe(|| poller.run())) {
                        Ok(()) => drop(poller),
                        Err(p) => {
                            fail(p);
                            // Its ring may still be reading into staging.
                            poller.abandon();
                        }
                    }
                })
                .map_err(|e| Error::Serve(format!("spawn poller {i}: {e}")))?;
            svc.threads.push(t);
        }
        let c = common.clone();
        let t = std::thread::Builder::new()
            .name("kspeed-accept".into())
            .spawn(move || {
                use std::panic::{catch_unwind, AssertUnwindSafe};
                let c2 = c.clone();
                // A panic (a bug) must not leave the service half-running:
                // without the acceptor nobody new gets in, so the service
                // fails as a whole, as for a poller.
                if let Err(p) = catch_unwind(AssertUnwindSafe(move || {
                    accept::Acceptor::new(c, listener, senders).run()
                })) {
                    let what = crate::error::panic_text(&*p);
                    c2.fail(format!(
                        "the acceptor panicked (a bug; please report it): {what}"
                    ));
                }
            })
            .map_err(|e| Error::Serve(format!("spawn acceptor: {e}")))?;
        svc.threads.push(t);
        if let Some(server) = metrics_server {
            let c = common.clone();
            let t = std::thread::Builder::new()
                .name("kspeed-metrics".into())
                .spawn(move || metrics::serve_http(c, server))
                .map_err(|e| Error::Serve(format!("spawn metrics server: {e}")))?;
            svc.threads.push(t);
        }
        log::info!(
            "serving {} ({} of {} samples, node {} of {}) on {addr}",
            Served::describe(&common.cfg.spaces()),
            common.space.held_samples(),
            common.space.len(),
            common.space.params().node_index,
            common.space.params().placement.nodes
        );
        // The limits resolved from the placement, which an operator sizing
        // a node's memory (or reading a refusal) needs to see.
        log::info!(
            "{} pollers x {} consumers, {} grants outstanding per consumer ({} KiB reserved each), {} handshakes pending at most",
            common.cfg.pollers,
            common.cfg.max_conns_per_poller,
            common.cfg.max_grants,
            common
                .cfg
                .grant_bytes_per_consumer(common.space.params().placement.nodes)
                / 1024,
            common.cfg.max_handshakes
        );
        Ok(svc)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Why the service stopped by itself (a poller panicked), if it did.
    pub(crate) fn failure(&self) -> Option<String> {
        self.common
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Counters.
    pub fn stats(&self) -> &ServeStats {
        &self.common.stats
    }

    /// Where the Prometheus metrics are served, with `metrics` set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Adds `series` to every later scrape (once; a second call is
    /// ignored): the node agent's own, next to the service's.
    pub(crate) fn add_metrics(&self, series: Arc<dyn prometheus_client::collector::Collector>) {
        let _ = self.common.metrics.extra.set(series);
    }

    /// Where the agent's consumer side posts node-down notices for this
    /// service to send to the consumers that ask for them.
    pub(crate) fn notices(&self) -> Arc<crate::transport::notices::NodeNotices> {
        self.common.notices.clone()
    }

    /// The metrics as Prometheus text (what `GET /metrics` returns).
    pub fn metrics_text(&self) -> String {
        metrics::render(&self.common)
    }

    /// Logs the statistics (what SIGUSR1 does to `kspeed serve`).
    pub fn log_stats(&self, why: &str) {
        metrics::log_stats(&self.common, why)
    }

    /// Stops accepting, closes every connection, and waits for the threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// [`NodeService::stop`], then logs the totals.
    pub fn stop_with_stats(mut self) {
        self.shutdown();
        self.log_stats("exit");
    }

    pub(super) fn shutdown(&mut self) {
        self.common.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for NodeService {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Runs `start` with SIGINT and SIGTERM blocked (so every service thread
/// inherits the mask), then waits for one of them and stops the service:
/// what `kspeed serve` does. `on_start` sees the running service (to print
/// its address).
pub fn serve_until_signal(cfg: ServeConfig, on_start: impl FnOnce(&NodeService)) -> Result<()> {
    let signals = crate::sys::TermSignals::block_with_usr1();
    let svc = NodeService::start_with(cfg, true)?;
    on_start(&svc);
    loop {
        let sig = signals.wait();
        if sig == libc::SIGUSR1 {
            svc.log_stats("SIGUSR1");
            continue;
        }
        if svc.failure().is_none() {
            log::info!("signal {sig}: stopping");
        }
        break;
    }
    let failure = svc.failure();
    svc.stop_with_stats();
    match failure {
        Some(why) => Err(Error::Serve(format!("the node service failed: {why}"))),
        None => Ok(()),
    }
}

/// The default `--max-handshakes` for a space placed over `nodes` nodes:
/// at job start every rank of every other node connects at once (8 ranks
/// a node is the common case), plus 64 for stragglers and restarts.
pub(super) fn auto_max_handshakes(nodes: u32) -> usize {
    let others = nodes.saturating_sub(1) as u64;
    (64 + 8 * others).min(super::config::MAX_HANDSHAKES) as usize
}

/// Binds `addr` and listens with a backlog of `SOMAXCONN` (the kernel caps
/// it at `net.core.somaxconn`): std's `TcpListener::bind` asks for 128,
/// and a job's start sends a node 8 x (nodes - 1) connections at once;
/// beyond the backlog the kernel drops SYNs and the consumer's connect
/// waits for a retransmission (1 s, then 3 s...).
fn listen(addr: &str) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let mut last = None;
    for sa in addr.to_socket_addrs()? {
        let sock = Socket::new(Domain::for_address(sa), Type::STREAM, Some(Protocol::TCP))?;
        // As std's bind does: a restarted node can listen again at once.
        sock.set_reuse_address(true)?;
        match sock
            .bind(&sa.into())
            .and_then(|_| sock.listen(libc::SOMAXCONN))
        {
            Ok(()) => return Ok(sock.into()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolves to nothing",
        )
    }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn pending_handshakes_are_sized_from_the_cluster() {
        // A job's start: 8 ranks on each other node connect at once.
        assert_eq!(super::auto_max_handshakes(1), 64);
        assert_eq!(super::auto_max_handshakes(10), 64 + 72);
        assert_eq!(super::auto_max_handshakes(100), 64 + 8 * 99);
        assert_eq!(super::auto_max_handshakes(512), 4096);
        assert_eq!(super::auto_max_handshakes(u32::MAX), 4096);
    }
}
