//! The network thread's grant table: one entry per sample the ring holds,
//! from the moment flow control lets it be granted until it is published.
//! Placing a grant with the sample's next live holder, failing it over
//! (ERROR, CRC32C mismatch, a dead node, a local read the pollers handed
//! over), the last-resort read from the source, demotion, and publishing.

use std::sync::atomic::Ordering;

use super::super::schedule::{Geometry, Placed};
use super::super::shared::{
    via_peer, CODE_TIER, SPLIT_NONE, VIA_DISK, VIA_FAILOVER, VIA_SOURCE, VIA_TIER,
};
use super::super::stall_causes::phase_split;
use super::super::CODE_OK;
use super::{Landed, Receive, State, Thread, DEMOTE_AFTER_ERRORS, DEMOTE_WINDOW};
use crate::error::Error;
use crate::ring::IoBackend;
use crate::transport::proto::{self, Code, GrantEntry, Header};

/// No window, node or entry.
pub(crate) const NONE: u32 = u32::MAX;

/// Whether a GRANT frame holding `entries` is full at `max_entries` (its
/// stored size; never the Vec's capacity, which may exceed what was asked).
fn frame_full(entries: u32, max_entries: u32) -> bool {
    debug_assert!(entries <= max_entries, "a GRANT frame past its size");
    entries >= max_entries
}

/// One outstanding remote sample.
#[derive(Clone, Copy)]
pub(super) struct GSlot {
    pub(super) live: bool,
    pub(super) g: u64,
    pub(super) id: u64,
    pub(super) len: u32,
    pub(super) phys: u64,
    pub(super) node: u32,
    pub(super) received: u32,
    /// Replica indices tried (bit r; `Placement::new` caps replicas at
    /// `MAX_REPLICAS` = 64, so every r fits).
    pub(super) tried: u64,
    /// The local pollers failed to read it (handed over); the error is in
    /// `NetThread::local_errors`.
    pub(super) local: bool,
    /// RDMA windows mode: the memory window of its node's connection that
    /// opens its range, `NONE` when none is bound.
    pub(super) mw: u32,
    /// Done with its node (all bytes in, or ERROR): waiting for its window's
    /// invalidation before it is published (or checked) or failed over.
    pub(super) after_inv: AfterInv,
    /// When it was granted to `node` (put in a GRANT frame).
    pub(super) granted_at: Option<std::time::Instant>,
    /// The node's times from its DATA headers (`proto::parse_data_times`),
    /// in microseconds: the slowest chunk's read, and how long the grant
    /// had been at the node when its latest frame was posted. `timed`:
    /// some frame carried them (not over RDMA, nor from older nodes).
    pub(super) node_read_us: u32,
    pub(super) node_us: u32,
    pub(super) timed: bool,
}

/// The GRANT id of the sample at sequence number `g`: its low 31 bits, so
/// that an id is never `proto::CONNECTION` (`0xFFFFFFFF`, which an ERROR
/// uses for the whole connection; the low 32 bits alone reach it once every
/// 2^32 samples). The table index (`g & mask`, a table of at most 2^31
/// entries) is in those bits, and an id names one sequence number among
/// the 2^31 around it, far more than are ever outstanding.
pub(super) fn grant_id(g: u64) -> u32 {
    (g as u32) & 0x7FFF_FFFF
}

impl GSlot {
    /// A live entry for sample `p`, not yet given to a node: `tried` marks
    /// the replicas already out of the question, `local` a sample the
    /// local pollers handed over.
    pub(super) fn open(p: &Placed, geo: &Geometry, tried: u64, local: bool) -> Self {
        GSlot {
            live: true,
            g: p.g,
            id: p.id,
            len: p.len as u32,
            phys: p.phys(geo),
            node: NONE,
            received: 0,
            tried,
            local,
            ..GSlot::FREE
        }
    }

    /// Whether it is grant `grant`, outstanding with `node`: live, given to
    /// that node, and not over (a grant waiting for its window's
    /// invalidation takes nothing more from the node).
    pub(super) fn outstanding_with(&self, node: u32) -> bool {
        self.live && self.node == node && self.after_inv == AfterInv::Nothing
    }
}

/// What a grant does once its window is invalidated.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterInv {
    Nothing,
    /// All its bytes arrived: check (CRC32C) and publish.
    Done,
    /// Its node answered ERROR: fail over.
    FailOver,
}

impl GSlot {
    /// A free entry.
    pub(super) const FREE: GSlot = GSlot {
        live: false,
        g: 0,
        id: 0,
        len: 0,
        phys: 0,
        node: NONE,
        received: 0,
        tried: 0,
        local: false,
        mw: NONE,
        after_inv: AfterInv::Nothing,
        granted_at: None,
        node_read_us: 0,
        node_us: 0,
        timed: false,
    };
}

impl<R: Receive, I: IoBackend> Thread<R, I> {
    /// Window `m` of connection `i`, which opened entry `idx`, is closed
    /// (invalidated): its grant is over now.
    pub(super) fn on_window_closed(&mut self, i: usize, m: u32, idx: u32) {
        let node = self.conns[i].node;
        if idx == NONE || !self.activate(idx as usize >> self.lane_shift) {
            return;
        }
        let idx = self.activate_entry(idx as usize);
        let Some(s) = self.l.table.get(idx).copied() else {
            return;
        };
        if !s.live || s.mw != m || s.node != node {
            return;
        }
        self.l.table[idx].mw = NONE;
        let then = std::mem::replace(&mut self.l.table[idx].after_inv, AfterInv::Nothing);
        self.grant_closed(i, idx, then);
    }

    /// Grant `idx` of connection `i` is over (`then` says how): with a
    /// window, invalidate it first and act once that completes (nothing the
    /// node writes after can land); else act now.
    pub(super) fn grant_over(&mut self, i: usize, idx: usize, then: AfterInv) {
        if self.l.table[idx].mw != NONE {
            let m = self.l.table[idx].mw;
            let d = self.conns[i]
                .data
                .as_mut()
                .expect("a window means a data path");
            match d.close(m) {
                Ok(()) => {
                    self.l.table[idx].after_inv = then;
                    let c = &mut self.conns[i];
                    if !c.closing {
                        c.closing = true;
                        self.closing.push(i);
                    }
                }
                // The connection goes; its grants (this one too) fail over
                // once its QP is gone.
                Err(e) => self.kill(i, e.to_string()),
            }
            return;
        }
        self.grant_closed(i, idx, then);
    }

    /// Grant `idx` no longer counts against connection `i` (its window, if
    /// any, is invalidated): publish it or fail it over. Only now does the
    /// node get credit for another grant, so a GRANT frame sent after this
    /// tells it that the grant's key opens nothing any more.
    pub(super) fn grant_closed(&mut self, i: usize, idx: usize, then: AfterInv) {
        self.conns[i].outstanding -= 1;
        match then {
            AfterInv::Done => self.finish_sample(i, idx),
            AfterInv::FailOver => self.fail_over(i, idx),
            AfterInv::Nothing => {}
        }
    }

    /// What a receive on connection `i`'s data path carried: bytes written
    /// into a granted range (RDMA: immediate = grant id), or an ERROR for a
    /// grant.
    pub(super) fn on_landed(&mut self, i: usize, what: Landed) {
        match what {
            Landed::Violation(why) => self.violation(i, why),
            Landed::Wrote { grant, bytes } => {
                let lane_ok = self.activate(self.lane_of(grant));
                let idx = grant as usize & self.l.mask;
                let s = self.l.table[idx];
                if !lane_ok
                    || self.grant_id(s.g) != grant
                    || !s.outstanding_with(self.conns[i].node)
                {
                    return self.violation(
                        i,
                        format!(
                            "RDMA write for grant {grant} that is not outstanding with this node"
                        ),
                    );
                }
                if bytes > s.len - s.received {
                    return self.violation(
                        i,
                        format!(
                            "RDMA write of {} bytes for grant {grant} overruns it ({} of {} bytes left)",
                            bytes,
                            s.len - s.received,
                            s.len
                        ),
                    );
                }
                self.l.table[idx].received += bytes;
                if self.l.table[idx].received == s.len {
                    self.sample_done(i, idx);
                }
            }
            Landed::Error { grant, code, msg } => {
                let h = Header::error(grant, Code::from_u32(code), 0);
                self.on_error(i, h, &msg);
            }
        }
    }

    /// Takes the local samples the pollers handed over (their reads
    /// failed): each becomes an outstanding entry with this node's copy
    /// marked tried, queued (in sequence order) for its next holder or the
    /// source. Its table entry is free: the sample is inside the
    /// flow-control window and unpublished, and the window never holds two
    /// samples with the same entry (see `NetShared::local_failed`).
    pub(super) fn take_local_failures(&mut self) {
        let local = self.setup.local_node;
        let placement = self.placement;
        while let Ok((p, e)) = self.net().local_failed.1.try_recv() {
            let idx = p.g as usize & self.l.mask;
            debug_assert!(!self.l.table[idx].live, "local failover onto a live entry");
            let mut tried = self.l.sh.unheld_copies(p.id);
            let placed = self.l.sh.input.placed_id(p.id);
            for r in 0..placement.replicas {
                if Some(placement.holder(placed, r)) == local {
                    tried |= 1 << r;
                }
            }
            self.l.table[idx] = GSlot::open(&p, &self.l.sh.geo, tried, true);
            let demoted = self.net().local_demoted(p.pos.epoch).is_some();
            if !demoted {
                // A failed read (a demoted sample was not read: it goes to
                // the next holder without a word, like a demoted node's).
                log::warn!(
                    "this node's copy of sample {} failed ({e}); it fails over to a replica or the source",
                    p.id
                );
                self.net().failovers.fetch_add(1, Ordering::Relaxed);
                self.local_failed_once(p.pos.epoch, &e);
            }
            self.l
                .local_errors
                .push((p.g, format!("this node's own copy: {e}")));
            let table = &self.l.table;
            let at = self.l.regrant.partition_point(|&i| table[i].g < p.g);
            self.l.regrant.insert(at, idx);
        }
    }

    /// Counts a failed read of this node's own copy; after
    /// [`DEMOTE_AFTER_ERRORS`] within [`DEMOTE_WINDOW`] the local copies
    /// are demoted for the rest of `epoch`: the pollers hand their samples
    /// over unread, to the next holder or the source, said once.
    fn local_failed_once(&mut self, epoch: u64, e: &Error) {
        let now = self.ring.now();
        if now.saturating_duration_since(self.l.local_errors_since) > DEMOTE_WINDOW {
            self.l.local_error_count = 0;
            self.l.local_errors_since = now;
        }
        self.l.local_error_count += 1;
        if self.l.local_error_count >= DEMOTE_AFTER_ERRORS {
            self.l.local_error_count = 0;
            log::warn!(
                "this node's own copies failed {DEMOTE_AFTER_ERRORS} times within {} s (latest: {e}); \
                 no more local reads in epoch {epoch}, its samples go to replicas or the source",
                DEMOTE_WINDOW.as_secs()
            );
            self.net().demote_local(epoch, e.clone());
        }
    }

    /// Forgets the local error of entry `idx` once it is served or failed.
    pub(super) fn local_done(&mut self, idx: usize) -> Option<String> {
        let s = &mut self.l.table[idx];
        if !s.local {
            return None;
        }
        s.local = false;
        let g = s.g;
        let at = self.l.local_errors.iter().position(|e| e.0 == g)?;
        Some(self.l.local_errors.swap_remove(at).1)
    }

    /// Grants what flow control allows, lane by lane.
    pub(super) fn fill(&mut self) {
        for k in 0..self.lane_places() {
            if self.activate(k) && !self.l.leaving {
                self.fill_lane();
            }
        }
    }

    /// Grants what flow control allows the active lane: re-grants first,
    /// then new samples.
    fn fill_lane(&mut self) {
        self.take_local_failures();
        while let Some(&idx) = self.l.regrant.front() {
            if !self.place(idx) {
                return;
            }
            self.l.regrant.pop_front();
        }
        loop {
            let p = match self.l.pending.take() {
                Some(p) => p,
                None => {
                    let input = &self.l.sh.input;
                    let p = self.l.cursor.next_with(|id| input.sample(id).len as u64);
                    self.new_epoch(p.pos.epoch);
                    p
                }
            };
            // Flow control bounds the walk over local samples too: with
            // every sample local (one node, replicas = nodes) the thread
            // must sleep here, not walk the endless schedule.
            if !self.l.sh.writable(&p) {
                self.l.pending = Some(p);
                let net = self.net();
                net.sleeping.store(true, Ordering::SeqCst);
                // Re-check after announcing: a release in between would
                // otherwise find `sleeping` unset and not wake us.
                if self.l.sh.writable(&p) {
                    net.sleeping.store(false, Ordering::SeqCst);
                    continue;
                }
                return;
            }
            if self.l.sh.is_local(p.id) {
                continue; // the local pollers read it
            }
            if p.len == 0 {
                // Nothing to wait for: charged to no peer.
                self.l.sh.publish(p.g, CODE_OK, VIA_DISK);
                continue;
            }
            if self.serve_from_tier(&p) {
                continue;
            }
            let idx = p.g as usize & self.l.mask;
            debug_assert!(
                !self.l.table[idx].live,
                "grant table entry reused while live"
            );
            // Copies whose partial space does not hold it are not asked.
            let unheld = self.l.sh.unheld_copies(p.id);
            self.l.table[idx] = GSlot::open(&p, &self.l.sh.geo, unheld, false);
            if !self.place(idx) {
                // The chosen node has no credit or frame space now.
                self.l.table[idx].live = false;
                self.l.pending = Some(p);
                return;
            }
        }
    }

    /// A remote sample the memory tier holds (an earlier push filled it) is
    /// served from there, with no grant: this thread alone decides where a
    /// remote sample comes from, so a member filled meanwhile can never be
    /// both granted and copied. False (grant it) when it is not in the tier
    /// or the copy fails (a rank's ring page gone, in the agent).
    fn serve_from_tier(&mut self, p: &Placed) -> bool {
        let Some(tier) = self.l.sh.tier.as_ref().filter(|t| t.is_filled(p.id)) else {
            return false;
        };
        if self.l.sh.cfg.tier_views {
            // Handed out in place (the consumer reads the tier).
            self.net().tier_hits.fetch_add(1, Ordering::Relaxed);
            self.l.sh.publish(p.g, CODE_TIER, VIA_TIER);
            return true;
        }
        if p.v < self.l.sh.geo.ring_bytes {
            self.l.sh.ring.populate_to(p.v_end);
        }
        let dst = self.ring_ptr(p.phys(&self.l.sh.geo));
        // SAFETY: dst..dst+len is this sample's slot, inside the ring and
        // outside the consumer's window (flow control checked by the caller).
        if !unsafe { tier.copy_out(p.id, p.len as usize, dst) } {
            return false;
        }
        self.net().tier_hits.fetch_add(1, Ordering::Relaxed);
        self.l.sh.publish(p.g, CODE_OK, VIA_TIER);
        true
    }

    /// A new epoch's first sample: demoted nodes get grants again.
    pub(super) fn new_epoch(&mut self, epoch: u64) {
        if self.l.epoch == Some(epoch) {
            return;
        }
        self.l.epoch = Some(epoch);
        for c in &mut self.conns {
            if c.demoted {
                c.demoted = false;
                c.errors = 0;
                log::info!(
                    "node {} ({}) gets grants again in epoch {epoch}",
                    c.node,
                    c.addr
                );
            }
        }
    }

    /// A grant of connection `i` failed (ERROR, CRC mismatch): counts it
    /// and demotes the node after [`DEMOTE_AFTER_ERRORS`] in a window.
    pub(super) fn grant_failed(&mut self, i: usize) {
        let epoch = self.l.epoch;
        let now = self.ring.now();
        let c = &mut self.conns[i];
        c.last_done = now;
        if now.saturating_duration_since(c.errors_since) > DEMOTE_WINDOW {
            c.errors = 0;
            c.errors_since = now;
        }
        c.errors += 1;
        if c.errors >= DEMOTE_AFTER_ERRORS && !c.demoted {
            c.demoted = true;
            log::warn!(
                "node {} ({}): {} failed grants within {} s (latest: {}); no more grants to it in epoch {}, its samples go to replicas or the source",
                c.node,
                c.addr,
                c.errors,
                DEMOTE_WINDOW.as_secs(),
                c.last_error,
                epoch.unwrap_or(0)
            );
        }
    }

    /// Gives table entry `idx` to its next untried live holder (in the
    /// failover order, `Placement::try_copy`), or reads it
    /// from the source, or fails it. False: the holder has no room now, or
    /// every holder is gone and one of them is being dialled again (the
    /// entry waits for it: `redial.rs`).
    pub(super) fn place(&mut self, idx: usize) -> bool {
        let s = self.l.table[idx];
        let placement = self.placement;
        let now = self.ring.now();
        let placed = self.l.sh.input.placed_id(s.id);
        let (entry, grant, lane) = (self.entry(idx), self.grant_id(s.g), self.active);
        let offset = match self.lane_regs.get(lane).and_then(Option::as_ref) {
            Some(reg) => R::wire_offset(reg, s.phys),
            None => s.phys,
        };
        // Copies in the failover order: the owner, then the replicas in
        // an order drawn from the id, so a dead node's samples spread over
        // all its surviving copies (`Placement::try_copy`).
        for k in 0..placement.replicas {
            let r = placement.try_copy(placed, k);
            if s.tried & (1 << r) != 0 {
                continue;
            }
            let node = placement.holder(placed, r) as usize;
            let Some(c) = self.conns.get_mut(node) else {
                continue;
            };
            if c.state != State::Live || c.demoted {
                continue;
            }
            if c.outstanding >= c.max_grants || frame_full(c.fill_entries, c.fill_max_entries) {
                return false;
            }
            // RDMA windows mode: a window for exactly this range, bound
            // (with the rest of the frame's) before the frame goes out.
            let Some((rkey, mw)) = c
                .data
                .as_mut()
                .expect("live")
                .open(entry, lane, s.phys, s.len)
            else {
                return false;
            };
            if mw != NONE {
                self.l.table[idx].mw = mw;
            }
            let mut e = [0u8; proto::GRANT_ENTRY_BYTES];
            GrantEntry {
                grant,
                len: s.len,
                sample: s.id,
                offset,
                rkey,
            }
            .encode_into(&mut e);
            c.fill.extend_from_slice(&e);
            c.fill_entries += 1;
            if c.outstanding == 0 {
                c.last_rx = now;
                c.last_done = now;
                // A slow-beating node with nothing granted beats only
                // every 5 s: its silence with grants outstanding counts
                // from here (unless it was silent for long already).
                self.beats[node].granted_after_idle(now);
                // Its clocks are short now: looked at every 100 ms.
                self.sweep.mark_busy(node);
            }
            let c = &mut self.conns[node];
            c.outstanding += 1;
            let t = &mut self.l.table[idx];
            t.node = node as u32;
            t.tried |= 1 << r;
            t.received = 0;
            t.granted_at = Some(now);
            t.timed = false;
            t.node_read_us = 0;
            t.node_us = 0;
            self.mark_ready(node);
            return true;
        }
        self.read_from_source(idx)
    }

    /// Last resort: starts reading the sample from the source files
    /// (`source.rs`). False: every source read slot is busy now, or the
    /// source cannot be opened while a holder that went away is being
    /// dialled again (the entry waits for it: `redial.rs`).
    pub(super) fn read_from_source(&mut self, idx: usize) -> bool {
        let Some(slot) = self.l.sources.free_slot() else {
            return false;
        };
        let s = self.l.table[idx];
        let placement = self.placement;
        let mut tried = String::new();
        let local_error = self.local_done(idx);
        let placed = self.l.sh.input.placed_id(s.id);
        // Copies no node holds (a partial space's) were never tried: the
        // source is their path, and nothing is said of them.
        let unheld = self.l.sh.unheld_copies(s.id);
        for r in (0..placement.replicas).filter(|r| unheld & (1 << r) == 0) {
            let node = placement.holder(placed, r) as usize;
            if let Some(c) = self.conns.get(node) {
                let why = if let Some(e) = local_error
                    .as_deref()
                    .filter(|_| Some(node as u32) == self.setup.local_node)
                {
                    e
                } else if s.tried & (1 << r) != 0
                    && !c.last_error.is_empty()
                    && c.state == State::Live
                {
                    c.last_error.as_str()
                } else if c.reason.is_empty() {
                    "no answer"
                } else {
                    c.reason.as_str()
                };
                tried.push_str(&format!("node {node} ({}): {why}; ", c.addr));
            }
        }
        self.start_source_read(slot, idx, tried)
    }

    pub(super) fn on_error(&mut self, i: usize, h: Header, msg: &str) {
        let code = Code::from_u32(h.b);
        if h.a == proto::CONNECTION {
            let why = format!("{}: {msg}", code.name());
            return self.kill(i, why);
        }
        let lane_ok = self.activate(self.lane_of(h.a));
        let idx = h.a as usize & self.l.mask;
        let s = self.l.table[idx];
        if !lane_ok || self.grant_id(s.g) != h.a || !s.outstanding_with(self.conns[i].node) {
            return self.violation(
                i,
                format!(
                    "ERROR for grant {} that is not outstanding with this node",
                    h.a
                ),
            );
        }
        let c = &mut self.conns[i];
        c.last_error = format!("{}: {msg}", code.name());
        log::warn!(
            "node {} ({}) cannot serve sample {}: {}",
            c.node,
            c.addr,
            s.id,
            c.last_error
        );
        self.grant_over(i, idx, AfterInv::FailOver);
    }

    /// How sample `s` came, for the stall it caused (`VIA_*`), served by
    /// node `served_by` (None: the source). A failover (the local pollers
    /// handed it over, or it came from other than its first holder that
    /// holds it) is charged to the holder that failed: this node for a
    /// hand-over, else the first holder, the first copy that holds it in
    /// the order `place` tries them (`Placement::try_copy`).
    pub(super) fn via_of(&self, s: &GSlot, served_by: Option<u32>) -> u32 {
        let unheld = self.l.sh.unheld_copies(s.id);
        let placed = self.l.sh.input.placed_id(s.id);
        let first = (0..self.placement.replicas)
            .map(|k| self.placement.try_copy(placed, k))
            .find(|r| unheld & (1 << r) == 0)
            .map(|r| self.placement.holder(placed, r));
        match (s.local, self.setup.local_node, first) {
            (true, Some(me), _) => via_peer(me, true),
            (_, _, Some(f)) if Some(f) != served_by => via_peer(f, true),
            (_, _, Some(f)) => via_peer(f, false),
            // No node holds it: the source is its path, not a failover.
            (_, _, None) => VIA_SOURCE,
        }
    }

    /// Grant `idx` failed on connection `i`: it goes back in line for its
    /// next holder (or the source), and the node's failure is counted.
    pub(super) fn fail_over(&mut self, i: usize, idx: usize) {
        self.requeue(idx);
        self.grant_failed(i);
    }

    /// Grant `idx` goes back in line for its next holder (or the source),
    /// counted as a failover.
    pub(super) fn requeue(&mut self, idx: usize) {
        self.net().failovers.fetch_add(1, Ordering::Relaxed);
        let t = &mut self.l.table[idx];
        t.node = NONE;
        t.received = 0;
        self.l.regrant.push_back(idx);
    }

    pub(super) fn sample_done(&mut self, i: usize, idx: usize) {
        self.conns[i].last_done = self.ring.now();
        self.grant_over(i, idx, AfterInv::Done);
    }

    /// All of grant `idx`'s bytes are in and nothing more can land there:
    /// checks them (`verify_crc32c`) and publishes the sample.
    pub(super) fn finish_sample(&mut self, i: usize, idx: usize) {
        let s = self.l.table[idx];
        if self.l.sh.cfg.verify_crc32c {
            let want = self.l.sh.input.sample(s.id).crc32c;
            // SAFETY: every byte of the slot was received and it is
            // unpublished (a ring the CPU reads: `verify_crc32c` is
            // refused with a GPU ring).
            let got = unsafe { self.l.sh.ring.crc32c(s.phys as usize, s.len as usize) };
            if got != Some(want) {
                // Like an ERROR for the grant: the next holder, then the
                // source (which is checked too) serve it again in full.
                let c = &mut self.conns[i];
                c.last_error = match got {
                    Some(got) => format!(
                        "sample {} arrived with CRC32C {got:08x}, the catalog says {want:08x}",
                        s.id
                    ),
                    None => format!(
                        "sample {} arrived in ring bytes that fault when read (the rank took their pages away)",
                        s.id
                    ),
                };
                log::warn!("node {} ({}): {}", c.node, c.addr, c.last_error);
                if got.is_none() {
                    // The rank's own ring, not the node: not counted
                    // against a link other ranks share.
                    self.requeue(idx);
                } else {
                    self.fail_over(i, idx);
                }
                return;
            }
        }
        self.l.table[idx].live = false;
        self.local_done(idx);
        if let Some(tier) = &self.l.sh.tier {
            // A member pushed by its owner fills the tier as a local read
            // would, so the next rank or epoch that needs it copies it
            // from memory instead of asking again.
            // SAFETY: every byte of the slot was received, nothing more
            // lands there, and it is unpublished.
            unsafe { tier.fill(s.id, s.len as usize, self.ring_ptr(s.phys)) };
        }
        let now = self.ring.now();
        self.conns[i].last_done = now;
        self.net().remote_samples.fetch_add(1, Ordering::Relaxed);
        let via = self.via_of(&s, Some(s.node));
        let split = match s.granted_at {
            Some(at) if s.timed && via & VIA_FAILOVER == 0 => phase_split(
                now.saturating_duration_since(at),
                s.node_read_us as u64,
                s.node_us as u64,
            ),
            _ => SPLIT_NONE,
        };
        self.l.sh.set_split(s.g, split);
        self.l.sh.publish(s.g, CODE_OK, via);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::proto::CONNECTION;

    /// No sequence number gives the connection's id, and the id keeps the
    /// bits the table index is taken from.
    #[test]
    fn a_grant_id_is_never_the_connection_id() {
        for g in [
            0xFFFF_FFFFu64,
            0x1_FFFF_FFFF,
            u64::MAX,
            0x7FFF_FFFF,
            0x8000_0000,
        ] {
            assert_ne!(grant_id(g), CONNECTION, "sequence {g:#x}");
            let mask = (1usize << 31) - 1;
            assert_eq!(grant_id(g) as usize & mask, g as usize & mask);
        }
    }

    /// A frame for 3 entries is full at 3, however much capacity its Vec
    /// got (here more than asked): fullness was `len == capacity()`, which
    /// over-filled a frame whose Vec had spare capacity.
    #[test]
    fn a_grant_frame_is_full_at_its_stored_size_not_its_capacity() {
        let entries = 3usize;
        let mut fill: Vec<u8> =
            Vec::with_capacity(proto::HEADER_BYTES + (entries + 5) * proto::GRANT_ENTRY_BYTES);
        fill.resize(proto::HEADER_BYTES, 0);
        let mut n = 0u32;
        while !frame_full(n, entries as u32) {
            fill.extend_from_slice(&[0u8; proto::GRANT_ENTRY_BYTES]);
            n += 1;
        }
        assert_eq!(n, 3);
        assert_eq!(
            fill.len(),
            proto::HEADER_BYTES + entries * proto::GRANT_ENTRY_BYTES
        );
        assert!(
            fill.len() < fill.capacity(),
            "the old check would not stop here"
        );
    }
}
