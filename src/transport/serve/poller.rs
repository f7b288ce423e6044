//! The serve poller: one thread, one io_uring, its connections. Each tick
//! adopts new consumers, posts receives, issues reads within each
//! consumer's share of staging, sends what is ready in grant order, and
//! reaps completions (io_uring's, and the RDMA links' CQs).

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;

use super::conn::{ud, ud_conn, ud_slot, SConn, HEARTBEAT_WR, UD_CHAN, UD_KIND, UD_READ};
use super::conn::{UD_RECV, UD_SEND};
use super::conns::Conns;
use super::link::ConnLink;
use super::owner_rdma::PollerChannel;
use super::staging::Staging;
use super::warn_limit::WarnLimit;
use super::{encode_error, metrics, Accepted, Common, ERROR_FRAME_MAX};
use crate::error::errno_name;
use crate::ring::{Completion, IoBackend, Uring};
use crate::stall::Phase;
use crate::transport::proto::{self, Code};
use crate::transport::stream_rx::StreamRx;
use crate::transport::tcp::TcpLink;

/// A sweep looks at this fraction of all connections (besides those with
/// work): each is looked at every 8 sweeps of 125 ms, once a second.
const SWEEP_SLICES: usize = 8;

/// The shortest stall timeout the node's TCP_USER_TIMEOUT on a consumer's
/// connection is built on (it is the stall timeout, at least this, plus
/// [`USER_TIMEOUT_MARGIN`]): below it ordinary retransmissions on a busy
/// network could end a live connection.
const USER_TIMEOUT_MIN: Duration = Duration::from_secs(1);
/// Added to the stall timeout, so that a consumer that takes no data is
/// dropped by the stall check, which names the reason, before the kernel
/// ends its connection.
const USER_TIMEOUT_MARGIN: Duration = Duration::from_secs(2);

/// One node-service poller, generic over its I/O backend: `Uring` in
/// production (monomorphised, so no call is indirect), `Faulty` or an
/// in-memory network in tests.
pub(super) struct ServePoller<R: IoBackend = Uring> {
    pub(super) c: Arc<Common>,
    pub(super) ring: R,
    pub(super) incoming: Receiver<Accepted>,
    /// Its connections (at most `max_conns_per_poller`, allocated at start).
    pub(super) conns: Conns,
    /// After `conns`: links (queue pairs) go before the memory they send
    /// from. Its slots are allocated at start too.
    pub(super) staging: Staging,
    pub(super) fixed_staging: bool,
    pub(super) chunk: u64,
    pub(super) completions: Vec<Completion>,
    /// Round-robin start for reads, so one busy consumer cannot starve others.
    pub(super) rr: usize,
    /// Staging slots one connection may hold now (fair share).
    pub(super) quota: usize,
    /// Where the next sweep's slice of the live list starts.
    pub(super) sweep_at: usize,
    /// This poller's number (its entry in `Common::load`).
    pub(super) index: usize,
    /// Ticks longer than the stall threshold (`crate::stall`).
    pub(super) stall: crate::stall::Stall,
    /// RDMA: this poller's completion channel, whether a poll of it is in
    /// the ring, and since when the poller has spun without a completion.
    pub(super) channel: PollerChannel,
    pub(super) chan_inflight: bool,
    pub(super) spin_since: Option<std::time::Instant>,
    /// When the next sweep runs ([`ServePoller::sweep`]): each tick
    /// compares this one time.
    pub(super) next_beat: std::time::Instant,
    /// Rate limit of read-error WARN lines.
    pub(super) warns: WarnLimit,
    /// The node-down notices posted when the last sweep looked
    /// (`notify.rs`).
    pub(super) notices_seen: u64,
    /// Connections with notices still to send, sized for every
    /// connection the poller may hold.
    pub(super) notice_due: Vec<u32>,
    /// Test builds only (`test-panic`): read completions still to be turned
    /// into a transient failure (`KSPEED_TEST_SERVE_READ_FAULTS`), cycling
    /// through EAGAIN, a short read and EINTR.
    #[cfg(feature = "test-panic")]
    pub(super) read_faults: u32,
}

impl<R: IoBackend> ServePoller<R> {
    pub(super) fn new(
        c: Arc<Common>,
        index: usize,
        mut ring: R,
        staging: Staging,
        incoming: Receiver<Accepted>,
    ) -> Self {
        let chunk = c.cfg.chunk_bytes as u64;
        let n = c.cfg.slots();
        // SAFETY: the staging slab lives in this struct, dropped after the
        // ring is done with it (run() drains every op before returning).
        let fixed_staging = match unsafe { ring.register_buffers(&[staging.slab()]) } {
            Ok(()) => true,
            Err(e) => {
                // Not silent: reads then pin their pages one by one.
                log::warn!(
                    "node service poller {index}: staging cannot be registered with io_uring \
                         ({e}); reading without fixed buffers (raise RLIMIT_MEMLOCK: each poller \
                         pins --staging-bytes)"
                );
                false
            }
        };
        // Both pools (staging's slots, made with it, and the connections)
        // are allocated whole at start and never grow (check_pools): a
        // full one is back-pressure.
        let conns = Conns::with_limit(c.cfg.max_conns_per_poller);
        let notice_due = Vec::with_capacity(c.cfg.max_conns_per_poller);
        let now = ring.now();
        ServePoller {
            incoming,
            staging,
            fixed_staging,
            chunk,
            conns,
            completions: vec![Completion::default(); 1024],
            rr: 0,
            quota: n,
            sweep_at: 0,
            index,
            stall: crate::stall::Stall::new("node service poller", index),
            channel: PollerChannel::new(&c, index),
            chan_inflight: false,
            spin_since: None,
            next_beat: now,
            warns: WarnLimit::new(now),
            notices_seen: c.notices.posted(),
            notice_due,
            #[cfg(feature = "test-panic")]
            read_faults: std::env::var("KSPEED_TEST_SERVE_READ_FAULTS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            c,
            ring,
        }
    }

    /// The descriptor of this poller's RDMA completion channel, when the
    /// service offers RDMA.
    pub(super) fn channel_fd(&self) -> Option<i32> {
        self.channel.fd()
    }

    /// After a panic in [`ServePoller::run`] (a bug): shuts every
    /// consumer's socket, so its peer sees the connection end and fails
    /// over at once, and leaks the rest. The ring may still have reads and
    /// receives in flight into staging and the sockets: freeing that memory
    /// could let the kernel write into whatever reuses it.
    pub(super) fn abandon(mut self) {
        for (_, c) in self.conns.iter_live() {
            self.ring.shutdown(c.fd);
        }
        // The hand-off queue is not leaked with the rest: dropped, it
        // disconnects, so the acceptor answers later consumers ShuttingDown
        // instead of queueing them where nobody takes them. Those queued
        // (welcomed, nothing in flight) are told why and closed.
        let incoming = std::mem::replace(&mut self.incoming, crossbeam_channel::never());
        while let Ok(acc) = incoming.try_recv() {
            let m = format!(
                "the node service is stopping (poller {} failed)",
                self.index
            );
            send_error_now(
                &mut self.ring,
                acc.fd,
                proto::CONNECTION,
                Code::ShuttingDown,
                &m,
            );
        }
        drop(incoming);
        std::mem::forget(self);
    }

    /// The ring is sized so its completion queue holds everything in
    /// flight (`ServeConfig::ring_entries`); a completion the kernel
    /// dropped all the same would leave its slot taken and its connection
    /// open forever (shutdown would hang): fail the service, naming it.
    fn check_cq_overflow(&mut self) {
        let lost = self.ring.lost_completions();
        if lost != 0 {
            let (sq, cq, _) = self.c.cfg.ring_entries();
            panic!(
                "io_uring completion queue overflow: {lost} completions dropped \
                 (ring of {sq}/{cq} entries, {} slots, {} in flight)",
                self.staging.limit(),
                self.ring.in_flight()
            );
        }
    }

    /// Runs until the service stops and every connection is gone (then
    /// nothing is in flight in the ring).
    pub(super) fn run(&mut self) {
        self.stall.resume();
        while !self.tick() {}
    }

    /// One iteration of the loop (the simulator steps it): true once the
    /// service stops and every connection is gone.
    pub(super) fn tick(&mut self) -> bool {
        // Drop the reaped from the dense list before anyone is adopted
        // (a reaped index may be reused right after).
        self.conns.prune();
        self.conns.settle_work();
        let stopping = self.c.stop.load(Ordering::Acquire);
        if stopping {
            // Consumers handed over but not adopted (welcomed just before
            // the stop): told why and closed, their places given back
            // (they used to stay queued, uncounted and open, until the
            // service was dropped).
            while let Ok(acc) = self.incoming.try_recv() {
                self.c.load[self.index].fetch_sub(1, Ordering::Relaxed);
                if acc.has_rdma() {
                    self.c.stats.rdma_qps.fetch_sub(1, Ordering::Relaxed);
                }
                let m = "the node service is stopping";
                send_error_now(
                    &mut self.ring,
                    acc.fd,
                    proto::CONNECTION,
                    Code::ShuttingDown,
                    m,
                );
                self.ring.shutdown(acc.fd);
            }
            for k in 0..self.conns.live_len() {
                let ci = self.conns.live(k);
                if self.conns.get(ci).is_some_and(|c| !c.closing) {
                    self.close(ci, None);
                }
            }
            if self.conns.len() == 0 {
                return true;
            }
        } else {
            while let Ok(acc) = self.incoming.try_recv() {
                self.adopt(acc);
            }
        }
        self.stall.phase(Phase::Conns);
        self.post_recvs();
        self.sweep();
        self.stall.phase(Phase::Submit);
        self.issue_reads();
        // Start the reads before posting sends: posting RDMA writes can
        // take a while (soft-RoCE does the whole transfer inside the
        // post), and the disk should be busy meanwhile.
        if let Err(e) = self.ring.submit_pending() {
            log::warn!("node service poller: io_uring: {e}");
        }
        self.stall.phase(Phase::Send);
        self.issue_sends();
        // RDMA completions arrive on the links' CQs, not the ring: while
        // writes are in flight, poll instead of sleeping.
        // (Polling without a system call: io_uring completions are
        // read from the shared ring either way.)
        self.stall.lap(&self.c.stats.loop_stalls);
        let st = &self.c.stats;
        st.poller_ticks.fetch_add(1, Ordering::Relaxed);
        let busy = self.stall.last_busy().as_nanos().min(u64::MAX as u128) as u64;
        st.poller_busy_ns.fetch_add(busy, Ordering::Relaxed);
        let res = if self.rdma_should_spin() {
            self.ring.submit_pending()
        } else {
            let r = self.ring.submit_wait_timeout(Duration::from_millis(50));
            self.stall.resume();
            r
        };
        if let Err(e) = res {
            log::error!("node service poller: io_uring: {e}");
            std::thread::sleep(Duration::from_millis(10));
        }
        let n = self.ring.drain(&mut self.completions);
        self.stall.phase(Phase::Reap);
        self.check_cq_overflow();
        for i in 0..n {
            let c = self.completions[i];
            self.complete(c);
        }
        self.check_pools();
        false
    }

    /// Checks (debug builds) that no pool grew after start: the staging
    /// slots and connections stay within what `new` allocated.
    pub(super) fn check_pools(&self) {
        self.staging.check();
        self.conns.check();
    }

    pub(super) fn adopt(&mut self, mut acc: Accepted) {
        // Tests of what a poller's panic does (tests/cluster.rs): only in
        // builds with the `test-panic` feature.
        #[cfg(feature = "test-panic")]
        if std::env::var_os("KSPEED_TEST_POLLER_PANIC").is_some() {
            panic!(
                "KSPEED_TEST_POLLER_PANIC is set: poller {} panics on adopting a consumer",
                self.index
            );
        }
        let Some(ci) = self.conns.vacant_key() else {
            // Not reached: the acceptor reserved a place on this poller at
            // HELLO (`Common::load`); kept as a refusal, not a panic.
            self.c.load[self.index].fetch_sub(1, Ordering::Relaxed);
            if acc.has_rdma() {
                self.c.stats.rdma_qps.fetch_sub(1, Ordering::Relaxed);
            }
            send_error_now(
                &mut self.ring,
                acc.fd,
                proto::CONNECTION,
                Code::NodeFull,
                "this poller serves as many consumers as it was configured for",
            );
            return;
        };
        let max = self.c.cfg.max_grants as usize;
        let fd = acc.fd;
        // A consumer whose host died leaves its heartbeats unacknowledged:
        // the kernel fails the connection a little after the stall timeout
        // instead of retransmitting for many minutes (TCP_USER_TIMEOUT).
        let user_timeout = self.c.cfg.stall_timeout.max(USER_TIMEOUT_MIN) + USER_TIMEOUT_MARGIN;
        if let Err(e) = self.ring.set_user_timeout(fd, user_timeout) {
            log::debug!("{}: TCP_USER_TIMEOUT: {e}", acc.peer);
        }
        let link = match acc.take_rdma_link(self.staging.mr(), self.c.cfg.slots()) {
            Some(rdma) => rdma,
            None => ConnLink::Tcp(TcpLink::new(fd, self.staging.limit(), ud(UD_SEND, ci, 0))),
        };
        let m = Arc::new(metrics::ConnMetrics::new(
            acc.peer.to_string(),
            acc.hello.rank,
            acc.hello.world,
            if link.is_rdma() { "rdma" } else { "tcp" },
        ));
        self.c.metrics.add(m.clone());
        let now = self.ring.now();
        self.conns.adopt(
            ci,
            SConn {
                fd,
                _sock: acc.sock,
                peer: acc.peer,
                hello: acc.hello,
                // A GRANT frame holds at most `max_grants` entries (more
                // is refused at its header), so its buffer holds no more:
                // 8 KiB per consumer at 256 grants, not 128 KiB.
                rx: StreamRx::new(super::config::grant_body_bytes(max as u32)),
                grants: VecDeque::with_capacity(max),
                sendq: VecDeque::with_capacity(self.staging.limit()),
                link,
                ops: 0,
                closing: false,
                failed_grant: None,
                grants_read: 0,
                held: 0,
                last_drained: now,
                metrics: m,
                last_rx: now,
                heartbeats: false,
                slow_idle: false,
                last_beat: None,
                notices_from: None,
                warned_grant: None,
                in_work: false,
            },
        );
        // Its first receive goes at this tick.
        self.conns.mark(ci);
    }

    /// Every half busy heartbeat interval (125 ms): looks at the work
    /// list's connections (heartbeats after [`proto::HEARTBEAT_INTERVAL`]
    /// of silence, the stall check) and at one [`SWEEP_SLICES`]th of all
    /// connections (idle ones: a heartbeat after
    /// [`proto::IDLE_HEARTBEAT_INTERVAL`], the idle timeout, an idle RDMA
    /// link's failure), so every connection is looked at at least once a
    /// second and a sweep costs the connections with work plus an eighth
    /// of the others, not all of them. Per tick it is one comparison with
    /// `next_beat`.
    pub(super) fn sweep(&mut self) {
        let now = self.ring.now();
        if now < self.next_beat {
            return;
        }
        self.next_beat = now + proto::HEARTBEAT_INTERVAL / 2;
        self.warns.roll(now);
        for k in 0..self.conns.work_len() {
            let ci = self.conns.work(k);
            self.look_at(ci, now);
        }
        let n = self.conns.live_len();
        for _ in 0..n.div_ceil(SWEEP_SLICES) {
            let ci = self.conns.live(self.sweep_at % n);
            self.sweep_at = self.sweep_at.wrapping_add(1);
            self.look_at(ci, now);
        }
        self.send_notices();
    }

    /// One connection in a sweep: dropped when it stalled or idled too
    /// long; else a heartbeat when one is due.
    ///
    /// Stalled: its link finished nothing for `stall_timeout` while a send
    /// was in flight (over TCP a socket that takes no bytes; over RDMA
    /// writes that do not complete, e.g. a stopped consumer that reposts
    /// no receives for its WRITE_WITH_IMMs): its staging slots go back to
    /// the others. Until then its fair share bounds what it holds. Idle:
    /// it sent nothing for `idle_timeout` with nothing queued for it.
    ///
    /// Heartbeats go to a consumer that asked for them and was sent
    /// nothing (no frame finished, no heartbeat) for
    /// [`proto::HEARTBEAT_INTERVAL`], or for
    /// [`proto::IDLE_HEARTBEAT_INTERVAL`] when the node has nothing for it
    /// (no grant queued, no staging slot held, no send in flight) and it
    /// said it restarts its clock at a grant (`SLOW_IDLE_HEARTBEATS`): a
    /// consumer with nothing granted judges the node's silence by its node
    /// timeout (at least 15 s), so thousands of idle consumers cost a frame
    /// each every 5-6 s, not 4 a second. Each heartbeat carries the node's
    /// idle timeout, so a consumer that reads it may keep alive as rarely
    /// as a quarter of it. A busy consumer hears from a live node at least
    /// every 1.5 busy intervals, and nothing is added per sample: a
    /// connection that is sending needs no heartbeat. Over TCP the frame
    /// goes in the link's queue, between DATA frames, only while no
    /// `sendmsg` is in flight (one was then finished recently); over RDMA
    /// it is written on the control socket, where the node sends nothing
    /// else after the handshake.
    fn look_at(&mut self, ci: u32, now: std::time::Instant) {
        let Some(c) = self.conns.get(ci) else {
            return;
        };
        if c.closing {
            return;
        }
        if c.link.is_rdma() {
            // An idle link's queue pair failing is seen here (a busy one's
            // at every tick, `reap_rdma`).
            self.reap_link(ci);
            let c = self.conns.get(ci).expect("live");
            if let Some(why) = c.link.failure() {
                log::warn!("{}: RDMA link failed: {why}", c.peer);
                self.close(ci, Some((Code::TransportFailed, why)));
                return;
            }
        }
        let c = self.conns.get(ci).expect("live");
        let idle_timeout = self.c.cfg.idle_timeout;
        if !c.link.busy() {
            if c.nothing_queued() && now.duration_since(c.last_rx) > idle_timeout {
                let m = format!(
                    "idle: no frame for {} ms with nothing to send (--idle-timeout-ms)",
                    idle_timeout.as_millis()
                );
                self.close(ci, Some((Code::ShuttingDown, m)));
                return;
            }
        } else if now.duration_since(c.last_drained) > self.c.cfg.stall_timeout {
            let m = format!(
                "took no data for {} ms with {} staging slots held (--stall-timeout-ms)",
                self.c.cfg.stall_timeout.as_millis(),
                c.held
            );
            self.c.stats.stalled.fetch_add(1, Ordering::Relaxed);
            self.close(ci, Some((Code::Violation, m)));
            return;
        }
        if !c.heartbeats {
            return;
        }
        if let Some(last) = c.last_beat {
            let idle = c.slow_idle && c.nothing_queued();
            let every = if idle {
                proto::IDLE_HEARTBEAT_INTERVAL
            } else {
                proto::HEARTBEAT_INTERVAL
            };
            if now.duration_since(last.max(c.last_drained)) < every {
                return;
            }
        }
        let beat = proto::Header::heartbeat(idle_timeout);
        let c = self.conns.get_mut(ci).expect("live");
        if !c.link.is_rdma() {
            if c.link.busy() || !c.link.post_heartbeat(HEARTBEAT_WR, beat) {
                return;
            }
            c.last_beat = Some(now);
            // Queued on its link: the tick's sends flush it.
            self.conns.mark(ci);
            return;
        }
        match self.ring.send_now(c.fd, &beat.encode()) {
            Ok(n) if n == proto::HEADER_BYTES => c.last_beat = Some(now),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            // A frame cut short cannot be finished later: the consumer
            // left its control socket unread for thousands of them.
            Ok(_) | Err(_) => self.close(ci, None),
        }
    }

    /// With RDMA writes in flight: true to poll again at once (a completion
    /// came, or the poller has spun less than `rdma_spin`); false to sleep
    /// in the ring, after arming the busy links' CQs and queueing a poll of
    /// the completion channel so the next completion wakes the poller.
    pub(super) fn rdma_should_spin(&mut self) -> bool {
        let taken = self.staging.len();
        let busy = self.reap_rdma();
        if !busy {
            self.spin_since = None;
            return false;
        }
        if self.staging.len() != taken {
            self.spin_since = None;
            return true;
        }
        let now = self.ring.now();
        let since = *self.spin_since.get_or_insert(now);
        if now.duration_since(since) < self.c.cfg.rdma_spin {
            return true;
        }
        let Some(fd) = self.channel_fd() else {
            return true;
        };
        for k in 0..self.conns.work_len() {
            let ci = self.conns.work(k);
            let Some(c) = self.conns.get(ci) else {
                continue;
            };
            if c.link.is_rdma() && c.link.busy() {
                if let Err(e) = c.link.arm() {
                    log::warn!("{}: {e}", c.peer);
                    return true;
                }
            }
        }
        // A completion that came in before arming raises no event.
        if self.reap_rdma() && self.staging.len() != taken {
            self.spin_since = None;
            return true;
        }
        if !self.chan_inflight && self.ring.push_poll_in(UD_CHAN, fd) {
            self.chan_inflight = true;
        }
        self.spin_since = None;
        false
    }

    /// Polls every RDMA link's completions; closes a link whose QP failed.
    /// True while any has writes in flight.
    pub(super) fn reap_rdma(&mut self) -> bool {
        let mut busy = false;
        for k in 0..self.conns.work_len() {
            let ci = self.conns.work(k);
            let Some(c) = self.conns.get(ci) else {
                continue;
            };
            if !c.link.is_rdma() {
                continue;
            }
            self.reap_link(ci);
            let c = self.conns.get(ci).expect("live");
            if !c.closing {
                if let Some(why) = c.link.failure() {
                    // Its QP is in error: nothing more can reach the consumer.
                    log::warn!("{}: RDMA link failed: {why}", c.peer);
                    self.close(ci, Some((Code::TransportFailed, why)));
                }
            }
            self.maybe_reap(ci);
            busy |= self.conns.get(ci).is_some_and(|c| c.link.busy());
        }
        busy
    }

    pub(super) fn complete(&mut self, comp: Completion) {
        let kind = comp.user_data & UD_KIND;
        if kind == UD_CHAN {
            self.chan_inflight = false;
            self.channel.drain();
            return;
        }
        let ci = ud_conn(comp.user_data);
        let slot = ud_slot(comp.user_data);
        // Whatever completed, the next tick has something to do for it
        // (a receive to post again, a frame to send, slots to reap).
        self.conns.mark(ci);
        let Some(c) = self.conns.get_mut(ci) else {
            log::error!("node service: completion for a closed connection");
            return;
        };
        c.ops -= 1;
        match kind {
            UD_RECV => {
                c.rx.returned();
                self.on_recv(ci, comp.result);
            }
            UD_READ => self.on_read(ci, slot, comp.result),
            UD_SEND => {
                #[allow(irrefutable_let_patterns)] // without the rdma feature
                if let ConnLink::Tcp(l) = &mut c.link {
                    l.on_send(comp.result);
                }
                if comp.result > 0 {
                    c.last_drained = self.ring.now();
                }
                if comp.result <= 0 && !c.closing {
                    if comp.result == -libc::EFAULT {
                        // Page-cache mode: an extent was cut shorter after
                        // its grant's check; the frame cannot be finished,
                        // so no ERROR can follow it on this stream.
                        log::warn!(
                            "{}: sending from the mapped extents failed (EFAULT: an extent shrank while served); dropping the consumer",
                            c.peer
                        );
                    } else {
                        log::debug!("{}: send failed: {}", c.peer, errno_name(-comp.result));
                    }
                    self.close(ci, None);
                }
                self.reap_link(ci);
            }
            _ => log::error!("node service: unknown completion {:#x}", comp.user_data),
        }
        self.maybe_reap(ci);
    }

    /// Closes a connection: optionally tells the peer why, shuts the socket
    /// (so in-flight receives and sends end), frees what is not in flight.
    pub(super) fn close(&mut self, ci: u32, why: Option<(Code, String)>) {
        let c = self.conns.get_mut(ci).expect("live");
        if c.closing {
            return;
        }
        if let Some((code, msg)) = why {
            log::warn!("dropping consumer {}: {}: {msg}", c.peer, code.name());
            self.c.stats.violations.fetch_add(1, Ordering::Relaxed);
            // Only between frames: a send in flight, or the rest of a
            // frame a send took part of, would interleave with it (an RDMA
            // connection's socket carries no frames from here). `busy()`
            // alone let an ERROR into the middle of a partly sent DATA
            // frame (found by the simulator).
            #[allow(irrefutable_let_patterns)] // without the rdma feature
            let between_frames = if let ConnLink::Tcp(l) = &c.link {
                !l.mid_frame()
            } else {
                true
            };
            if between_frames {
                send_error_now(&mut self.ring, c.fd, proto::CONNECTION, code, &msg);
            }
        }
        c.closing = true;
        self.ring.shutdown(c.fd);
        c.grants.clear();
        // Frames posted but not in flight fail now (their slots come back
        // through reap_link), those in flight when their send returns; of
        // the frames not posted, those whose read is done are free now and
        // the others come back through their read completions.
        c.link.close();
        let mut keep = VecDeque::new();
        std::mem::swap(&mut keep, &mut c.sendq);
        for slot in keep.drain(..) {
            if !self.staging[slot].ready {
                c.sendq.push_back(slot);
            } else {
                self.staging.free(slot);
                c.release();
            }
        }
        self.reap_link(ci);
        self.maybe_reap(ci);
        // What it still has in flight is reaped from the work list.
        self.conns.mark(ci);
    }

    pub(super) fn maybe_reap(&mut self, ci: u32) {
        self.reap_link(ci);
        if self
            .conns
            .get(ci)
            .is_some_and(|c| c.closing && c.ops == 0 && !c.link.busy())
        {
            // Out of `live` at the next tick's start; its key is free for
            // the next adopt (which comes after that).
            let c = self.conns.remove(ci);
            self.c.load[self.index].fetch_sub(1, Ordering::Relaxed);
            self.c.metrics.remove(&c.metrics);
            log::info!(
                "consumer {} (rank {} of {}) disconnected: {}",
                c.peer,
                c.hello.rank,
                c.hello.world,
                c.metrics.totals()
            );
            for &slot in &c.sendq {
                self.staging.free(slot);
            }
            if c.link.is_rdma() {
                // Dropping the link destroys its QP, then its CQ.
                drop(c);
                self.c.stats.rdma_qps.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Sends an ERROR frame on `fd` through the ring, best effort and never
/// blocking (as `super::send_error` does for the acceptor's sockets): the
/// connection is closed right after, so what the socket does not take is
/// dropped.
fn send_error_now<R: IoBackend>(ring: &mut R, fd: RawFd, grant: u32, code: Code, msg: &str) {
    let mut f = [0u8; ERROR_FRAME_MAX];
    let n = encode_error(&mut f, grant, code, msg);
    let _ = ring.send_now(fd, &f[..n]);
}
