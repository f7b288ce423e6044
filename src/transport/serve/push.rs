//! The serve poller's data path: reading granted chunks into staging (or
//! pointing into the mapped extents), and sending them in grant order.

use std::sync::atomic::Ordering;

use super::conn::{ud, HEARTBEAT_WR, UD_READ};
use super::conns::Conns;
use super::poller::ServePoller;
use super::staging::{Slot, Staging};
use crate::error::errno_name;
use crate::ring::{IoBackend, ReadOp, Target};
use crate::transport::proto::{self, Code, GrantEntry};
use crate::transport::Done;

/// Reads of a chunk submitted at most, as the loader's poller: a transient
/// failure (EAGAIN, EINTR, a short read) is retried, the same read into
/// the same slot, before it becomes an ERROR frame (and the consumer's
/// failover; enough of them demote the node for the epoch).
pub(super) const MAX_READ_ATTEMPTS: u32 = 4;

impl<R: IoBackend> ServePoller<R> {
    pub(super) fn issue_reads(&mut self) {
        // Fair shares among the connections with work (grants queued or
        // slots held), rounded up; and never more than 3/4 of the slots, so
        // a consumer that arrives while another has stopped reading still
        // finds some (slots held in a send cannot be taken back).
        // (Every such connection is in the work list: `SConn::active`.)
        let busy = self
            .conns
            .iter_work()
            .filter(|(_, c)| !c.closing && (c.held > 0 || !c.grants.is_empty()))
            .count()
            .max(1);
        let n = self.staging.limit();
        self.quota = n.div_ceil(busy).min(n - n / 4).max(1);
        let n = self.conns.work_len();
        let mut idle_rounds = 0;
        while !self.staging.is_full() && idle_rounds < n {
            let ci = self.conns.work(self.rr % n);
            self.rr = self.rr.wrapping_add(1);
            let progressed = self.issue_one(ci);
            idle_rounds = if progressed { 0 } else { idle_rounds + 1 };
        }
    }

    /// Starts the next chunk of connection `ci`'s oldest grant.
    pub(super) fn issue_one(&mut self, ci: u32) -> bool {
        let Some(c) = self.conns.get_mut(ci) else {
            return false;
        };
        // Its share of staging: a consumer that does not drain keeps at
        // most this many slots (read, queued or being sent), the rest stay
        // with the others.
        if c.closing || c.held as usize >= self.quota {
            return false;
        }
        let Some(w) = c.grants.front().copied() else {
            return false;
        };
        let Some(slot) = self.staging.vacant() else {
            return false;
        };
        let e = w.e;
        let space = &self.c.space;
        let loc = space.location(e.sample);
        let Some((loc, align)) = loc else {
            // Not held here: an ERROR frame for this grant.
            c.grants.pop_front();
            let s = Slot::new(ci, e.grant, self.ring.now()).granted(w.at, w.serial);
            take_slot(&mut self.staging, &mut self.conns, ci, slot, s);
            let msg = format!(
                "node {} does not hold sample {}",
                space.params().node_index,
                e.sample
            );
            self.fill_error(slot, e.grant, Code::NotHeld, &msg);
            let c = self.conns.get_mut(ci).expect("live");
            c.sendq.push_back(slot);
            return true;
        };
        let align = align as u64;
        let slot_len = (e.len as u64).next_multiple_of(align);
        let off = u64::from(w.next);
        let payload = self.chunk.min(e.len as u64 - off) as u32;
        let read_len = self.chunk.min(slot_len - off) as u32;
        let from_maps = !c.link.is_rdma() || self.c.rdma_maps();
        if let Some(map) = self.c.maps.get(loc.extent as usize).filter(|_| from_maps) {
            // Page-cache mode: no read; the frame points into the mapping.
            let bytes = map.as_slice();
            let at = (loc.offset + off) as usize;
            // The mapping keeps the length the extent had at start; a file
            // cut shorter since would fail the send (EFAULT) in the middle
            // of a DATA frame, where no ERROR can follow. So each grant's
            // first chunk checks the file's length now (one fstat per
            // sample, page-cache mode only) and answers ERROR instead.
            let end = loc.offset + e.len as u64;
            let cut = off == 0
                && self.c.extents[loc.extent as usize]
                    .metadata()
                    .is_ok_and(|m| m.len() < end);
            if cut || at + payload as usize > bytes.len() {
                let s = Slot::new(ci, e.grant, self.ring.now()).granted(w.at, w.serial);
                take_slot(&mut self.staging, &mut self.conns, ci, slot, s);
                let msg = format!(
                    "node {}: extent {} is shorter than its manifest says (sample {} needs bytes up to {end}; truncated?)",
                    space.params().node_index,
                    loc.extent,
                    e.sample
                );
                if self.warns.allow(self.ring.now()) {
                    log::warn!("{msg}");
                }
                let c = self.conns.get_mut(ci).expect("live");
                c.grants.pop_front();
                self.fill_error(slot, e.grant, Code::ReadFailed, &msg);
                self.conns.get_mut(ci).expect("live").sendq.push_back(slot);
                return true;
            }
            let s = Slot::new(ci, e.grant, self.ring.now()).granted(w.at, w.serial);
            take_slot(&mut self.staging, &mut self.conns, ci, slot, s);
            self.queue_chunk(ci, slot, &e, off, payload, Some(bytes[at..].as_ptr()));
            return true;
        }
        // The ring's completion queue must hold everything in flight: past
        // its bound (only with more slots than it holds) reads wait.
        let (_, _, max_ops) = self.c.cfg.ring_entries();
        let reserve = 2 * self.c.cfg.max_conns_per_poller + 1;
        if self.ring.in_flight() + reserve >= max_ops {
            return false;
        }
        let op = ReadOp {
            user_data: ud(UD_READ, ci, slot),
            target: Target::Fixed(loc.extent),
            buf: self.staging.ptr(slot),
            len: read_len,
            offset: loc.offset + off,
            buf_index: self.fixed_staging.then_some(0),
        };
        // SAFETY: the staging slot is ours (taken from the pool below)
        // until its send completes.
        if !unsafe { self.ring.push(&op) } {
            return false;
        }
        let mut s = Slot::new(ci, e.grant, self.ring.now()).granted(w.at, w.serial);
        s.read_extent = loc.extent;
        s.read_offset = loc.offset + off;
        s.read_len = read_len;
        s.attempts = 1;
        take_slot(&mut self.staging, &mut self.conns, ci, slot, s);
        self.conns.get_mut(ci).expect("live").ops += 1;
        self.queue_chunk(ci, slot, &e, off, payload, None);
        true
    }

    /// Gives a slot back (its connection, if still there, holds one less).
    pub(super) fn free_slot(&mut self, slot: u32) {
        let s = self.staging.free(slot);
        if let Some(c) = self.conns.get_mut(s.conn) {
            c.release();
        }
    }

    /// Describes chunk `off..off+payload` of grant `e` in `slot` (sent from
    /// `src` when the bytes are already there, else from the slot's staging
    /// once its read completes), queues it for sending in order, and moves
    /// the grant on.
    pub(super) fn queue_chunk(
        &mut self,
        ci: u32,
        slot: u32,
        e: &GrantEntry,
        off: u64,
        payload: u32,
        src: Option<*const u8>,
    ) {
        let s = &mut self.staging[slot];
        s.offset = e.offset + off;
        s.rkey = e.rkey;
        s.payload = payload;
        s.last = off + payload as u64 >= e.len as u64;
        s.src = src.unwrap_or(std::ptr::null());
        s.ready = src.is_some();
        let c = self.conns.get_mut(ci).expect("live");
        c.sendq.push_back(slot);
        let front = c.grants.front_mut().expect("non-empty");
        front.next += payload;
        if front.next >= e.len {
            c.grants.pop_front();
        }
    }

    pub(super) fn fill_error(&mut self, slot: u32, grant: u32, code: Code, msg: &str) {
        let m = &msg.as_bytes()[..msg.len().min(proto::MAX_MESSAGE_BYTES)];
        let dst = self.staging.ptr(slot);
        let n = m.len().min(self.chunk as usize);
        // SAFETY: the slot is ours and at least `chunk` bytes; n <= chunk.
        unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), dst, n) };
        let s = &mut self.staging[slot];
        s.code = code;
        s.payload = n as u32;
        s.grant = grant;
        s.error = true;
        s.ready = true;
        s.src = std::ptr::null();
        let ci = s.conn;
        self.c.stats.errors.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = self.conns.get(ci) {
            c.metrics.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Per connection: posts the ready frames at the front of its queue, in
    /// order, to its link, then flushes the link (one `sendmsg` for many).
    pub(super) fn issue_sends(&mut self) {
        // One clock read per call, not per frame: the frames' times (for
        // the DATA headers and the histograms) need a tick's precision.
        let now = self.ring.now();
        for k in 0..self.conns.work_len() {
            let ci = self.conns.work(k);
            let Some(c) = self.conns.get_mut(ci) else {
                continue;
            };
            if c.closing {
                continue;
            }
            while let Some(&slot) = c.sendq.front() {
                let s = &self.staging[slot];
                if !s.ready {
                    break;
                }
                if c.failed_grant == Some(s.serial) {
                    // A later chunk of a grant already answered with ERROR:
                    // its data, or its own read error, is not sent (one
                    // ERROR per grant; a second would be a protocol
                    // violation for the consumer).
                    c.sendq.pop_front();
                    self.staging.free(slot);
                    c.release();
                    continue;
                }
                let src = if s.src.is_null() {
                    self.staging.ptr(slot).cast_const()
                } else {
                    s.src
                };
                // Reading: from the GRANT frame to the bytes in staging
                // (waiting for a slot, then the disk); the rest of its time
                // here, until this post, is sending.
                let read = s.ready_at.saturating_duration_since(s.granted_at);
                let at_node = now.saturating_duration_since(s.granted_at);
                let times = proto::data_times(read.as_micros() as u64, at_node.as_micros() as u64);
                // SAFETY: the slot's bytes (staging or mapped extent) stay
                // untouched until the link reports this wr_id done.
                let posted = unsafe {
                    if s.error {
                        c.link
                            .post_error(slot as u64, s.grant, s.code, src, s.payload)
                    } else {
                        c.link.post_data(
                            slot as u64,
                            src,
                            s.payload,
                            s.offset,
                            s.grant,
                            s.rkey,
                            times,
                        )
                    }
                };
                if !posted {
                    break;
                }
                if !s.error {
                    let m = &self.c.metrics;
                    m.grant_wait[self.index]
                        .record(s.issued.saturating_duration_since(s.granted_at));
                    m.send_wait[self.index].record(now.saturating_duration_since(s.ready_at));
                }
                self.staging[slot].posted_at = now;
                let s = &self.staging[slot];
                if s.error {
                    c.failed_grant = Some(s.serial);
                }
                c.sendq.pop_front();
            }
            let was_busy = c.link.busy();
            if let Err(e) = c.link.flush(&mut self.ring) {
                if c.link.is_rdma() {
                    let m = format!("posting RDMA writes: {e}");
                    self.close(ci, Some((Code::TransportFailed, m)));
                    continue;
                }
                return; // submission queue full: next tick
            }
            if !was_busy && c.link.busy() {
                c.last_drained = self.ring.now();
                // A TCP link's sendmsg in flight is an op of the ring.
                if !c.link.is_rdma() {
                    c.ops += 1;
                }
            }
        }
    }

    /// Frees the slots whose frames the link finished.
    pub(super) fn reap_link(&mut self, ci: u32) {
        let mut done = [Done::default(); 32];
        loop {
            let Some(c) = self.conns.get_mut(ci) else {
                return;
            };
            let n = c.link.poll(&mut done);
            if n == 0 {
                return;
            }
            let (mut bytes, mut samples, mut send_us, mut sends) = (0, 0, 0, 0);
            let now = self.ring.now();
            for d in &done[..n] {
                if d.wr_id == HEARTBEAT_WR {
                    continue;
                }
                let s = &self.staging[d.wr_id as u32];
                if d.ok && !s.error {
                    bytes += s.payload as u64;
                    samples += s.last as u64;
                    let took = now.saturating_duration_since(s.posted_at);
                    self.c.metrics.send[self.index].record(took);
                    send_us += took.as_micros() as u64;
                    sends += 1;
                }
                self.free_slot(d.wr_id as u32);
            }
            let c = self.conns.get_mut(ci).expect("live");
            c.last_drained = self.ring.now();
            let st = &self.c.stats;
            st.bytes.fetch_add(bytes, Ordering::Relaxed);
            st.samples.fetch_add(samples, Ordering::Relaxed);
            c.metrics.bytes.fetch_add(bytes, Ordering::Relaxed);
            c.metrics.samples.fetch_add(samples, Ordering::Relaxed);
            c.metrics.send_us.fetch_add(send_us, Ordering::Relaxed);
            c.metrics.sends.fetch_add(sends, Ordering::Relaxed);
        }
    }

    pub(super) fn on_read(&mut self, ci: u32, slot: u32, res: i32) {
        let closing = self.conns.get(ci).expect("live").closing;
        if closing {
            self.drop_slot(ci, slot);
            return;
        }
        #[cfg(feature = "test-panic")]
        let res = self.injected_read_fault(slot, res);
        let s = &self.staging[slot];
        let transient =
            res == -libc::EAGAIN || res == -libc::EINTR || (res >= 0 && (res as u32) < s.payload);
        if transient && s.attempts < MAX_READ_ATTEMPTS && self.retry_read(ci, slot) {
            return;
        }
        let s = &self.staging[slot];
        let now = self.ring.now();
        let latency = now.saturating_duration_since(s.issued);
        self.c.metrics.read_latency[self.index].record(latency);
        if res < 0 || (res as u32) < s.payload {
            let (ring_offset, grant, serial) = (s.offset, s.grant, s.serial);
            let msg = if res < 0 {
                format!(
                    "node {}: reading ring offset {ring_offset} of grant {grant}: {}",
                    self.c.space.params().node_index,
                    errno_name(-res),
                )
            } else {
                format!(
                    "node {}: short read of grant {grant}: {res} of {} bytes (extent truncated?)",
                    self.c.space.params().node_index,
                    s.payload
                )
            };
            // One line per grant (its later chunks fail alike), and at most
            // `WARNS_PER_WINDOW` per window: a dying disk must not flood
            // the log.
            let c = self.conns.get_mut(ci).expect("live");
            // The grant is answered (its later chunks would be dropped
            // unsent): it leaves the queue now, so it no longer counts
            // against `max_grants`. The consumer takes the ERROR as the
            // grant's end and may grant another at once; counting this one
            // until its last chunk was issued dropped a consumer that kept
            // its window (TooManyGrants; found by the simulator).
            // (By its serial: a consumer may reuse a finished grant's id.)
            if c.grants.front().is_some_and(|w| w.serial == serial) {
                c.grants.pop_front();
            }
            if c.warned_grant != Some(serial) {
                c.warned_grant = Some(serial);
                if self.warns.allow(self.ring.now()) {
                    log::warn!("{msg}");
                }
            }
            self.fill_error(slot, grant, Code::ReadFailed, &msg);
            return;
        }
        let s = &mut self.staging[slot];
        s.ready = true;
        s.ready_at = now;
    }

    /// Submits `slot`'s read again, as it was issued; false when the
    /// submission queue is full (the failure then stands).
    fn retry_read(&mut self, ci: u32, slot: u32) -> bool {
        let s = &self.staging[slot];
        let op = ReadOp {
            user_data: ud(UD_READ, ci, slot),
            target: Target::Fixed(s.read_extent),
            buf: self.staging.ptr(slot),
            len: s.read_len,
            offset: s.read_offset,
            buf_index: self.fixed_staging.then_some(0),
        };
        // SAFETY: the staging slot is still ours (taken at the first
        // attempt, freed only after its send).
        if !unsafe { self.ring.push(&op) } {
            return false;
        }
        self.staging[slot].attempts += 1;
        self.conns.get_mut(ci).expect("live").ops += 1;
        self.c.stats.read_retries.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Test builds: turns the next read completions into transient
    /// failures while `KSPEED_TEST_SERVE_READ_FAULTS` lasts.
    #[cfg(feature = "test-panic")]
    fn injected_read_fault(&mut self, slot: u32, res: i32) -> i32 {
        // First attempts only: each fault then costs exactly one retry.
        if self.read_faults == 0 || res <= 0 || self.staging[slot].attempts > 1 {
            return res;
        }
        self.read_faults -= 1;
        match self.read_faults % 3 {
            0 => -libc::EAGAIN,
            1 => (self.staging[slot].payload / 2) as i32,
            _ => -libc::EINTR,
        }
    }

    /// Frees a slot of a closing connection (its read or send completed).
    pub(super) fn drop_slot(&mut self, ci: u32, slot: u32) {
        let c = self.conns.get_mut(ci).expect("live");
        if let Some(i) = c.sendq.iter().position(|&s| s == slot) {
            c.sendq.remove(i);
        }
        self.free_slot(slot);
    }
}

/// Takes staging slot `slot` (the vacant one) for connection `ci`, which
/// holds one more, described by `s` (a function of the two fields, so
/// callers may hold other borrows of the poller).
fn take_slot(staging: &mut Staging, conns: &mut Conns, ci: u32, slot: u32, s: Slot) {
    staging.take(slot, s);
    if let Some(c) = conns.get_mut(ci) {
        c.hold();
    }
}
