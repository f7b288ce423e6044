//! The simulator's handle on a node service (tests only): the real
//! pollers, each on a ring the simulator gives it (an in-memory network),
//! sharing one `Common` built from an opened space without sockets,
//! extent descriptors or threads. The simulator (`crate::sim::serve`)
//! hands them connections as the acceptor would after WELCOME, steps each
//! with [`ServePoller::tick`], and checks the poller's bookkeeping after
//! every step through [`SimNode::check`]; the pollers' internals stay
//! private to this module tree.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;

use super::conn::{UD_KIND, UD_READ};
use super::poller::ServePoller;
use super::served::Served;
use super::staging::Staging;
use super::{metrics, Accepted, Common, ServeConfig, ServeStats};
use crate::dataset::Space;
use crate::ring::IoBackend;
use crate::transport::proto::{self, Hello};

/// A node service of `rings.len()` pollers, run by the simulator.
pub(crate) struct SimNode<R: IoBackend> {
    c: Arc<Common>,
    pollers: Vec<ServePoller<R>>,
    senders: Vec<Sender<Accepted>>,
    finished: Vec<bool>,
}

impl<R: IoBackend> SimNode<R> {
    /// Builds the service as `NodeService::start` does (the chunk rounded
    /// to the space's alignment), one poller per ring. The extents are
    /// read through each ring's fixed files (`Target::Fixed(extent)`).
    pub(crate) fn new(space: Space, mut cfg: ServeConfig, rings: Vec<R>) -> Self {
        let align = space.params().align_bytes;
        // Resolved as `NodeService::start` does (0: from the placement).
        cfg.max_grants = cfg.grants_per_consumer(space.params().placement.nodes);
        let space = Served::new(vec![space], &[cfg.space.clone()]).expect("one space");
        cfg.chunk_bytes = cfg
            .chunk_bytes
            .clamp(align, proto::MAX_DATA_BYTES)
            .next_multiple_of(align);
        cfg.staging_bytes = cfg.staging_bytes.max(cfg.chunk_bytes as u64);
        cfg.pollers = rings.len();
        cfg.validate().expect("the simulator's service settings");
        let c = Arc::new(Common {
            space,
            extents: Vec::new(),
            maps: Vec::new(),
            stop: AtomicBool::new(false),
            stats: ServeStats::default(),
            rdma: None,
            load: (0..cfg.pollers).map(|_| AtomicUsize::new(0)).collect(),
            metrics: metrics::Metrics::new(cfg.pollers, cfg.slots() as u64),
            failure: std::sync::Mutex::new(None),
            signal_on_failure: false,
            notices: Arc::new(crate::transport::notices::NodeNotices::new()),
            cfg,
        });
        let mut pollers = Vec::new();
        let mut senders = Vec::new();
        for (i, ring) in rings.into_iter().enumerate() {
            let (tx, rx) = crossbeam_channel::bounded(c.cfg.max_conns_per_poller);
            let staging = Staging::new(&c).expect("staging without RDMA");
            pollers.push(ServePoller::new(c.clone(), i, ring, staging, rx));
            senders.push(tx);
        }
        SimNode {
            finished: vec![false; pollers.len()],
            c,
            pollers,
            senders,
        }
    }

    /// The settings in force (the chunk rounded).
    pub(crate) fn cfg(&self) -> &ServeConfig {
        &self.c.cfg
    }

    /// Counters.
    pub(crate) fn stats(&self) -> &ServeStats {
        &self.c.stats
    }

    /// The node-down notices its pollers send (the simulation posts them,
    /// as an agent's network threads do).
    pub(crate) fn notices(&self) -> &crate::transport::notices::NodeNotices {
        &self.c.notices
    }

    /// Hands poller `p` a consumer whose connection is `fd`, as the
    /// acceptor does after WELCOME (its place reserved in `Common::load`);
    /// false when the poller is full (the acceptor would refuse at HELLO).
    pub(crate) fn connect(&self, p: usize, fd: RawFd, hello: Hello) -> bool {
        if self.c.load[p].load(Ordering::Relaxed) >= self.c.cfg.max_conns_per_poller {
            return false;
        }
        self.c.load[p].fetch_add(1, Ordering::Relaxed);
        let acc = Accepted {
            fd,
            sock: None,
            peer: SocketAddr::from(([10, 0, 0, 1], fd as u16)),
            hello,
            #[cfg(feature = "rdma")]
            rdma: None,
        };
        self.senders[p]
            .try_send(acc)
            .expect("a poller's queue holds all its consumers");
        true
    }

    /// One iteration of poller `p`; true once it has finished (stopped,
    /// every connection gone).
    pub(crate) fn tick(&mut self, p: usize) -> bool {
        if !self.finished[p] {
            self.finished[p] = self.pollers[p].tick();
        }
        self.finished[p]
    }

    /// Stops the service (as `NodeService::stop`): each poller closes its
    /// connections and finishes.
    pub(crate) fn stop(&self) {
        self.c.stop.store(true, Ordering::Release);
    }

    /// Poller `p`'s ring.
    pub(crate) fn ring(&self, p: usize) -> &R {
        &self.pollers[p].ring
    }

    /// Poller `p`'s connections (and consumers handed to it, not adopted).
    pub(crate) fn load(&self, p: usize) -> usize {
        self.c.load[p].load(Ordering::Relaxed)
    }

    /// Checks poller `p`'s bookkeeping after a step; `pending` lists the
    /// memory its ring's operations in flight reference (`each` calls
    /// `f(user_data, fd, writes, ptr, len)` per piece):
    /// - no pool grew; the slots taken are within the pool; each belongs
    ///   to a live connection, which counts it in `held`;
    /// - a staging slot referenced by an operation in flight is taken, by
    ///   the connection on that socket: a read (at most one) into a slot
    ///   not yet ready, a send only from a slot whose read is done (never
    ///   freed, reused or still being read while the ring sends it).
    pub(crate) fn check(
        &self,
        p: usize,
        each: impl FnOnce(&mut dyn FnMut(u64, RawFd, bool, *const u8, usize)),
    ) {
        let pl = &self.pollers[p];
        pl.check_pools();
        assert!(
            pl.staging.len() <= pl.staging.limit(),
            "slots beyond the pool"
        );
        let mut held = vec![0u32; pl.conns.limit()];
        for (k, s) in pl.staging.iter() {
            let c = pl.conns.get(s.conn).unwrap_or_else(|| {
                panic!(
                    "staging slot {k} belongs to connection {}, which is gone",
                    s.conn
                )
            });
            let _ = c;
            held[s.conn as usize] += 1;
        }
        for (ci, c) in pl.conns.iter() {
            assert_eq!(
                c.held, held[ci],
                "connection {ci}: held {} but {} slots are its",
                c.held, held[ci]
            );
        }
        let (slab, slab_len) = pl.staging.slab();
        let base = slab as usize;
        let end = base + slab_len;
        let chunk = pl.staging.chunk_bytes();
        let mut reading = vec![false; pl.staging.limit()];
        each(&mut |ud, fd, writes, ptr, len| {
            let at = ptr as usize;
            if at < base || at >= end {
                return;
            }
            let k = (at - base) / chunk;
            assert!(
                at + len <= base + (k + 1) * chunk,
                "an operation spans staging slots {k} and beyond"
            );
            let s = pl.staging.get(k).unwrap_or_else(|| {
                panic!("staging slot {k} is free while an operation in flight uses it (ud {ud:#x})")
            });
            let c = pl.conns.get(s.conn).expect("checked above");
            if writes {
                assert_eq!(ud & UD_KIND, UD_READ, "a receive into staging");
                assert_eq!(ud as u32 as usize, k, "a read into another slot's memory");
                assert!(
                    !s.ready,
                    "staging slot {k} is ready (may be sent) while read into"
                );
                assert!(!reading[k], "two reads in flight into staging slot {k}");
                reading[k] = true;
            } else {
                assert!(s.ready, "staging slot {k} sent while its read is in flight");
                assert_eq!(c.fd, fd, "staging slot {k} sent on another connection");
            }
        });
        let queued = self.senders[p].len();
        assert_eq!(
            pl.conns.len() + queued,
            self.load(p),
            "poller {p}: load counts {} but it has {} connections and {queued} queued",
            self.load(p),
            pl.conns.len()
        );
    }

    /// Poller `p`'s state, for a failure message.
    pub(crate) fn describe(&self, p: usize) -> String {
        let pl = &self.pollers[p];
        let mut out = format!(
            "poller {p}: {} slots of {} taken, {} in flight, quota {}; ",
            pl.staging.len(),
            pl.staging.limit(),
            pl.ring.in_flight(),
            pl.quota
        );
        for (ci, c) in pl.conns.iter() {
            out += &format!(
                "conn {ci} (fd {}): {} grants queued (front {:?}), held {}, sendq {} (front {:?}), ops {}, closing {}, link busy {}; ",
                c.fd,
                c.grants.len(),
                c.grants.front().map(|w| (w.e.grant, w.e.sample, w.e.len, w.next)),
                c.held,
                c.sendq.len(),
                c.sendq.iter().take(8).collect::<Vec<_>>(),
                c.ops,
                c.closing,
                c.link.busy()
            );
        }
        for (k, s) in pl.staging.iter().take(16) {
            out += &format!(
                "slot {k}: conn {} grant {} ready {} error {} attempts {}; ",
                s.conn, s.grant, s.ready, s.error, s.attempts
            );
        }
        out
    }

    /// The teardown invariants, once every poller has finished: every
    /// connection reaped, no slot taken, nothing in flight, every place
    /// given back.
    pub(crate) fn check_teardown(&self) {
        for (p, pl) in self.pollers.iter().enumerate() {
            assert!(self.finished[p], "poller {p} has not finished");
            assert_eq!(pl.conns.len(), 0, "poller {p}: connections left");
            assert_eq!(pl.staging.len(), 0, "poller {p}: staging slots taken");
            assert_eq!(pl.ring.in_flight(), 0, "poller {p}: operations in flight");
            assert_eq!(self.load(p), 0, "poller {p}: load not given back");
        }
    }
}
