//! `ksp_loader`: create and free a loader, move between epochs, save and
//! restore its position, read its statistics and its catalog. Batches are
//! in [`super::batch`].

use std::mem::offset_of;

use super::config::ksp_config;
use super::errors::{guard, ksp_status, Fail};
use super::ffi::{Handle, Out, OutBytes, SizedOut};
use kspeed::loader::Loader;

/// A loader. Opaque; one thread at a time.
pub struct ksp_loader {
    pub(super) loader: Loader,
    /// The held batch's `ksp_sample` array, laid out with the caller's
    /// `sample_size` stride (8-byte words; see `ksp_loader_next_batch`).
    /// Sized for a whole batch at creation; a larger caller stride grows it
    /// once.
    pub(super) samples: Vec<u64>,
    /// The process that created the loader. After `fork()` the child has a
    /// copy of this struct but none of the pollers, no ring (it is mapped
    /// `MADV_DONTFORK`), and shares the parent's descriptors: every call
    /// from another pid is refused (`KSP_ERR_FORKED`) and
    /// `ksp_loader_free` leaks it there.
    pub(super) pid: u32,
}

impl Handle for ksp_loader {
    const WHAT: &'static str = "loader";

    fn check_process(&self) -> Result<(), Fail> {
        super::ffi::same_process("loader", self.pid)
    }
}

/// Creates a loader from `cfg` (which stays owned by the caller and may be
/// freed right after). Opens the space, maps and locks the ring, starts the
/// pollers (and connects to the cluster's nodes in cluster mode). Free it
/// with [`ksp_loader_free`].
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG` (settings,
/// a sample larger than the ring); `KSP_ERR_IO` / `KSP_ERR_DATA` (the space
/// or source); `KSP_ERR_RESOURCE` (memlock limit, io_uring); `KSP_ERR_NETWORK`
/// (a node refused; the node agent missing or refusing the rank). The
/// caller owns `*out`.
///
/// Fork: the loader belongs to the process that created it. A `fork()`ed
/// child gets a copy of the handle but none of the loader's threads and
/// none of its ring (mapped `MADV_DONTFORK`), so every call on the handle
/// in the child returns `KSP_ERR_FORKED` ("this loader was created by pid
/// X; a forked child (pid Y) cannot use it...") without doing or writing
/// anything, and [`ksp_loader_free`] there leaks the child's copy of the
/// handle rather than stop the parent's threads. The parent's loader is
/// unaffected. A child that needs data creates its own loader.
///
/// Thread safety: any thread; `cfg` is only read (but not while another
/// thread calls [`super::ksp_config_set`] on it).
///
/// # Safety
/// `cfg` is a live configuration; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_new(
    cfg: *const ksp_config,
    out: *mut *mut ksp_loader,
) -> ksp_status {
    guard(|| {
        // SAFETY: live configuration; out writable (contract).
        let (c, out) = unsafe { (ksp_config::try_ref(cfg)?, Out::new(out, "out")?) };
        let loader = c.loader_builder()?.build()?;
        let words = loader.batch_size() * std::mem::size_of::<super::ksp_sample>() / 8;
        ksp_loader {
            samples: Vec::with_capacity(words),
            loader,
            pid: std::process::id(),
        }
        .give(out);
        Ok(())
    })
}

/// Stops the loader's threads and frees it and its ring. NULL is a no-op;
/// every pointer from its batches dies with it. In a forked child (a
/// process other than the one that created it) it frees nothing: the
/// child's copy of the handle is leaked, and the parent's loader is left
/// alone (see [`ksp_loader_new`] on fork).
///
/// Thread safety: no other call on `l` may run or follow.
///
/// # Safety
/// `l` is NULL or came from [`ksp_loader_new`] and was not freed.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_free(l: *mut ksp_loader) {
    // SAFETY: per the contract.
    unsafe { ksp_loader::free(l) }
}

/// Moves to `epoch` (like PyTorch's `sampler.set_epoch`); releases a held batch.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_NETWORK` (cluster mode:
/// reconnecting failed); a loader that failed earlier returns its first
/// error's status. After a failure here the loader stays failed, but its
/// catalog, statistics and position can still be read.
///
/// Thread safety: one call on `l` at a time (serialise every call on one
/// loader); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_set_epoch(l: *mut ksp_loader, epoch: u64) -> ksp_status {
    guard(|| {
        // SAFETY: live loader, one thread at a time (contract).
        let h = unsafe { ksp_loader::try_mut(l)? };
        h.samples.clear();
        h.loader.set_epoch(epoch)?;
        Ok(())
    })
}

/// Starts reading now rather than at the first batch. A local loader's
/// pollers wait for the first `ksp_loader_next_batch`, so that a
/// `ksp_loader_restore_position` right after `ksp_loader_new` throws no
/// read away; call this (after restoring, if you restore) to have the ring
/// filled while the program does other work first. A no-op once reading,
/// and in cluster mode and attached, where reading starts with the loader.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_FORKED` (a forked
/// child's copy of the handle).
///
/// Thread safety: one call on `l` at a time (serialise every call on one
/// loader); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_start_reading(l: *mut ksp_loader) -> ksp_status {
    guard(|| {
        // SAFETY: live loader, one thread at a time (contract).
        let h = unsafe { ksp_loader::try_mut(l)? };
        h.loader.start_reading();
        Ok(())
    })
}

/// Samples per epoch for this rank, in `*out` (the same on every rank;
/// with `drop_last`, whole batches only).
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_epoch_len(l: *const ksp_loader, out: *mut u64) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; out writable (contract).
        let (h, out) = unsafe { (ksp_loader::try_ref(l)?, Out::new(out, "out")?) };
        out.set(h.loader.epoch_len());
        Ok(())
    })
}

/// Batches per epoch for this rank, in `*out`: the same on every rank of
/// the job (`ceil(epoch_len / batch_size)`; with `drop_last` every batch is
/// whole and the tail is dropped), so DDP ranks stay in lock-step.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_batches_per_epoch(
    l: *const ksp_loader,
    out: *mut u64,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; out writable (contract).
        let (h, out) = unsafe { (ksp_loader::try_ref(l)?, Out::new(out, "out")?) };
        out.set(h.loader.batches_per_epoch());
        Ok(())
    })
}

/// The position of the next sample `ksp_loader_next_batch` delivers: its
/// epoch and its step within the epoch.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `epoch` and `index` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_position(
    l: *const ksp_loader,
    epoch: *mut u64,
    index: *mut u64,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; outputs writable (contract).
        let (h, epoch, index) = unsafe {
            (
                ksp_loader::try_ref(l)?,
                Out::new(epoch, "epoch")?,
                Out::new(index, "index")?,
            )
        };
        let p = h.loader.position();
        epoch.set(p.epoch);
        index.set(p.index);
        Ok(())
    })
}

/// Writes the current position (`KSP_POSITION_BYTES` bytes, `KSPDPOS3`; a
/// loader reading a mixture writes a `KSPDPOS4` of `120 + 24·D` bytes for
/// D datasets, which `ksp_audit` audits from the files alone) to `buf` and
/// its length to `*out_len`. `KSP_ERR_BUFFER_TOO_SMALL` (with `*out_len`
/// set: call again with that much) when `buf_len` is less.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_BUFFER_TOO_SMALL`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `buf` writable for `buf_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_save_position(
    l: *const ksp_loader,
    buf: *mut u8,
    buf_len: usize,
    out_len: *mut usize,
) -> ksp_status {
    guard(|| {
        // SAFETY: write_loader_bytes needs a live loader, `buf` writable for
        // `buf_len` bytes and `out_len` writable: this function's own
        // contract, which its caller keeps.
        unsafe { write_loader_bytes(l, buf, buf_len, out_len, |l| l.save_position()) }
    })
}

/// Writes `bytes(loader)` of the live loader `l` (a saved position, say)
/// to the caller's buffer `buf` and its length to `*out_len`:
/// `KSP_ERR_BUFFER_TOO_SMALL` (with `*out_len` set) when `buf_len` is less.
///
/// # Safety
/// `l` is a live loader; `buf` writable for `buf_len` bytes; `out_len`
/// writable.
pub(super) unsafe fn write_loader_bytes(
    l: *const ksp_loader,
    buf: *mut u8,
    buf_len: usize,
    out_len: *mut usize,
    bytes: impl FnOnce(&kspeed::loader::Loader) -> Vec<u8>,
) -> Result<(), Fail> {
    // SAFETY: live loader; buf writable for buf_len bytes, out_len writable
    // (contract).
    let (h, out) = unsafe {
        (
            ksp_loader::try_ref(l)?,
            OutBytes::new(buf, buf_len, out_len)?,
        )
    };
    out.write(&bytes(&h.loader))
}

/// Continues from a position saved by [`ksp_loader_save_position`] with
/// the same dataset (the position records the catalog's identity), seed,
/// shuffle, rank, world and drop_last (`KSP_ERR_INVALID_ARG` otherwise,
/// naming what differs). Releases a held batch.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG` (not a
/// position of this loader's job or dataset); a loader that failed earlier
/// returns its first error's status.
///
/// Thread safety: one call on `l` at a time (serialise every call on one
/// loader); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `buf` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_restore_position(
    l: *mut ksp_loader,
    buf: *const u8,
    len: usize,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader, one thread at a time (contract).
        let h = unsafe { ksp_loader::try_mut(l)? };
        if buf.is_null() {
            return Err(Fail::Null("buf"));
        }
        // SAFETY: buf readable for len bytes (contract).
        let bytes = unsafe { std::slice::from_raw_parts(buf, len) };
        h.samples.clear();
        h.loader.restore_position(bytes)?;
        Ok(())
    })
}

/// Loader statistics, cumulative over the loader's life (restarts by
/// set_epoch or restore_position included). `samples` and `bytes` count
/// what was delivered; the read counters also count read-ahead.
///
/// Extensible: set `struct_size` to `sizeof(ksp_stats)` before the call
/// (`ksp_stats s = KSP_STATS_INIT;`). The library fills the fields that fit
/// in `struct_size` and leaves the rest of a smaller (older) layout
/// untouched; a larger (newer) layout's unknown fields are zeroed. New
/// fields are only ever appended. `struct_size` below
/// `KSP_STATS_MIN_SIZE` (the layout that ended at `read_ahead_discarded`)
/// is `KSP_ERR_STRUCT_SIZE`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ksp_stats {
    /// Set by the caller: `sizeof(ksp_stats)` as it was compiled.
    pub struct_size: usize,
    /// Samples delivered.
    pub samples: u64,
    /// Bytes delivered.
    pub bytes: u64,
    /// Seconds since the loader was created.
    pub elapsed_s: f64,
    /// Seconds the caller waited inside next_batch.
    pub stall_s: f64,
    /// Samples read from disk: the space's extents, or a source read
    /// directly (`source`: its files, or its objects in a bucket); a
    /// partial space's others are `source_reads`.
    pub disk_reads: u64,
    /// Samples served from the memory tier.
    pub tier_hits: u64,
    /// Reads retried.
    pub retries: u64,
    /// Read latency (submission to completion of disk reads), median, in
    /// microseconds.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Samples pushed by other nodes (cluster mode).
    pub remote_samples: u64,
    /// Grants moved to another node or the source.
    pub failovers: u64,
    /// Samples read from the source: those a partial space does not hold,
    /// and in cluster mode those no node could serve.
    pub source_reads: u64,
    /// Samples read ahead and waiting in the ring (counted in the read
    /// counters above, not yet in `samples`). A rank attached to the node
    /// agent: 0; the agent's reads for it count with the batch the agent
    /// publishes after them, so at an epoch's end the counters above may
    /// include its first reads of the next epoch.
    pub read_ahead: u64,
    /// Samples read ahead and thrown away unconsumed (a jump to another
    /// epoch, a restored position, the end).
    pub read_ahead_discarded: u64,
    // --- appended after the first layout (KSP_STATS_MIN_SIZE) ---
    /// Read latency, 90th percentile, in microseconds.
    pub p90_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Largest.
    pub max_us: u64,
    /// Reads the latency figures are computed from.
    pub latency_reads: u64,
    /// Ticks of the pollers' and the network thread's loops that took
    /// longer than the stall threshold (`KSPEED_STALL_MS`, default 50 ms):
    /// blocking work on a thread that must not block. Each is logged, at
    /// most once per 10 s per loop.
    pub loop_stalls: u64,
    /// The exactly-once digest (ABI 5): the epoch of the last sample
    /// delivered, the ids delivered in it and the wrapping sum of their
    /// keyed hashes (docs/FORMAT.md, "Exactly-once digest"); the saved
    /// position carries them for `ksp_audit`.
    pub digest_epoch: u64,
    /// Ids folded into the digest.
    pub digest_count: u64,
    /// Wrapping sum of the ids' keyed hashes.
    pub digest_sum: u64,
    /// Bytes of the `source_reads` samples (appended in ABI 5).
    pub source_bytes: u64,
    /// `stall_s` charged to its causes (appended after `source_bytes`):
    /// each wait goes to the sample waited for and how it came. Seconds
    /// waiting for samples read from this node's disk (the space's
    /// extents, or source files read directly).
    pub stall_disk_s: f64,
    /// For samples copied from the memory tier.
    pub stall_tier_s: f64,
    /// For samples read from the source (a partial space's, a bucket, or
    /// the last resort of cluster mode).
    pub stall_source_s: f64,
    /// For samples other nodes served as their first holder.
    pub stall_peers_s: f64,
    /// For samples that failed over from their first holder (or from this
    /// node's own read) to another replica or the source. The six causes
    /// are disjoint and add up to `stall_s`.
    pub stall_failover_s: f64,
    /// An attached rank: waiting for the node agent's next batch beyond
    /// what the rank's loader inside the agent was itself waiting for
    /// (that part is charged to the causes above).
    pub stall_agent_s: f64,
    /// The nodes with the most stall (served as first holder, or failed
    /// over from), most first: node index, seconds and waits; entries
    /// with 0 waits are empty.
    pub slowest_peer_node: [u32; 4],
    /// Seconds charged to `slowest_peer_node[i]`.
    pub slowest_peer_stall_s: [f64; 4],
    /// Waits charged to `slowest_peer_node[i]`.
    pub slowest_peer_waits: [u64; 4],
    /// Samples from the source (a partial space's others, a bucket, the
    /// source after a failover) handed out so far, and how long before
    /// they were asked for they were in the ring: the prefetch's lead
    /// (0 for a rank attached to the node agent: its samples come in whole
    /// batches).
    pub source_lead_count: u64,
    /// Of them, those the caller waited for (no lead).
    pub source_lead_late: u64,
    /// The lead's 10th percentile, in seconds (the short-lead tail).
    pub source_lead_p10_s: f64,
    /// The lead's median, in seconds.
    pub source_lead_p50_s: f64,
    /// Times the caller waited for a sample (or an attached rank's batch)
    /// not yet in: with `stall_s`, the mean wait (appended after
    /// `source_lead_p50_s`). Where every sample comes from this node's
    /// disk a wait lasts until the rest of its batch is in.
    pub stall_waits: u64,
    /// `stall_peers_s` by where each waited-for sample's grant spent its
    /// time (appended after `stall_waits`): at the node until the bytes
    /// were ready (a staging slot, then the read), at the node after that
    /// (behind the connection's earlier frames), the link (the grant's way
    /// there and the data's way back). Each wait is split in its grant's
    /// proportions. Only waits for samples from nodes that report their
    /// times are split (over TCP, from this release on; not over RDMA; a
    /// rank attached to the node agent too, from an agent that sends the
    /// split: segment layout 8), so the three add up to at most
    /// `stall_peers_s`.
    pub stall_peer_read_s: f64,
    /// See `stall_peer_read_s`: at the node after the read (behind the
    /// connection's earlier frames; a link slower than the node backs up
    /// into this and into `stall_peer_read_s`, docs/PROTOCOL.md "DATA").
    pub stall_peer_send_s: f64,
    /// See `stall_peer_read_s`: the link (the rest of the grant's time).
    pub stall_peer_link_s: f64,
    /// The share of `slowest_peer_stall_s[i]` for samples node
    /// `slowest_peer_node[i]` served as first holder, split as
    /// `stall_peer_read_s`, `_send_s` and `_link_s` split
    /// `stall_peers_s`; failovers charged to the node are not split, so
    /// the three add up to at most `slowest_peer_stall_s[i]`.
    pub slowest_peer_read_s: [f64; 4],
    /// See `slowest_peer_read_s`.
    pub slowest_peer_send_s: [f64; 4],
    /// See `slowest_peer_read_s`.
    pub slowest_peer_link_s: [f64; 4],
    /// The NVMe cache area (`cache_dir`; appended after
    /// `slowest_peer_link_s`; all 0 without one): samples read from the
    /// area instead of the source (not in `disk_reads` or `source_reads`).
    /// A rank attached to the node agent (`kspeed agent --cache-dir`) has
    /// only this one: the area is the agent's, and its other counters are
    /// in the agent's log.
    pub cache_hits: u64,
    /// Their bytes.
    pub cache_hit_bytes: u64,
    /// Samples written into the area (durable and journalled).
    pub cache_writes: u64,
    /// Samples the policy kept but the writer could not take (behind).
    pub cache_skipped: u64,
    /// Reads from the area that failed the catalog's CRC (read from the
    /// source instead; the slot emptied).
    pub cache_corrupt: u64,
    /// Samples the area holds now, or is writing (a slot taken by a write
    /// still in flight counts; `cache_writes` only once it is durable).
    pub cache_held: u64,
    /// Slots in the area.
    pub cache_slots: u64,
    /// Reads the policy planned as hits (appended after `cache_slots`;
    /// with `cache_policy=min` Belady's MIN's hits on this rank's order):
    /// `cache_hits` falls short of it where a write had not landed by the
    /// read (or was skipped), or a slot failed its check.
    pub cache_planned_hits: u64,
    /// The bytes of `cache_writes`.
    pub cache_write_bytes: u64,
    /// Writes into the area that failed (each logged with its errno; the
    /// slot stays empty and the sample is read from the source next time).
    pub cache_write_errors: u64,
    /// The area's bytes on disk (`cache.data`, within `cache_bytes`).
    pub cache_area_bytes: u64,
    /// The memory level above the area (`cache_memory_bytes`; appended
    /// after `cache_area_bytes`; all 0 without one): samples read from it,
    /// before the area (not in `cache_hits`, `disk_reads` or
    /// `source_reads`).
    pub cache_memory_hits: u64,
    /// Their bytes.
    pub cache_memory_hit_bytes: u64,
    /// Reads the policy planned as the memory level's hits.
    pub cache_memory_planned_hits: u64,
    /// Samples written into the memory level.
    pub cache_memory_writes: u64,
    /// Samples the policy kept there but its writer could not take.
    pub cache_memory_skipped: u64,
    /// Samples the memory level holds now, or is writing.
    pub cache_memory_held: u64,
    /// The memory level's bytes (within `cache_memory_bytes`).
    pub cache_memory_area_bytes: u64,
}

// The C layout names 4 slowest peers: the library's count must agree.
const _: () = assert!(kspeed::loader::SLOWEST_PEERS == 4);

impl Default for ksp_stats {
    /// Zeroes with this build's `struct_size` (`KSP_STATS_INIT`).
    fn default() -> Self {
        ksp_stats {
            struct_size: std::mem::size_of::<ksp_stats>(),
            samples: 0,
            bytes: 0,
            elapsed_s: 0.0,
            stall_s: 0.0,
            disk_reads: 0,
            tier_hits: 0,
            retries: 0,
            p50_us: 0,
            p99_us: 0,
            remote_samples: 0,
            failovers: 0,
            source_reads: 0,
            read_ahead: 0,
            read_ahead_discarded: 0,
            p90_us: 0,
            p999_us: 0,
            max_us: 0,
            latency_reads: 0,
            loop_stalls: 0,
            digest_epoch: 0,
            digest_count: 0,
            digest_sum: 0,
            source_bytes: 0,
            stall_disk_s: 0.0,
            stall_tier_s: 0.0,
            stall_source_s: 0.0,
            stall_peers_s: 0.0,
            stall_failover_s: 0.0,
            stall_agent_s: 0.0,
            slowest_peer_node: [0; 4],
            slowest_peer_stall_s: [0.0; 4],
            slowest_peer_waits: [0; 4],
            source_lead_count: 0,
            source_lead_late: 0,
            source_lead_p10_s: 0.0,
            source_lead_p50_s: 0.0,
            stall_waits: 0,
            stall_peer_read_s: 0.0,
            stall_peer_send_s: 0.0,
            stall_peer_link_s: 0.0,
            slowest_peer_read_s: [0.0; 4],
            slowest_peer_send_s: [0.0; 4],
            slowest_peer_link_s: [0.0; 4],
            cache_hits: 0,
            cache_hit_bytes: 0,
            cache_writes: 0,
            cache_skipped: 0,
            cache_corrupt: 0,
            cache_held: 0,
            cache_slots: 0,
            cache_planned_hits: 0,
            cache_write_bytes: 0,
            cache_write_errors: 0,
            cache_area_bytes: 0,
            cache_memory_hits: 0,
            cache_memory_hit_bytes: 0,
            cache_memory_planned_hits: 0,
            cache_memory_writes: 0,
            cache_memory_skipped: 0,
            cache_memory_held: 0,
            cache_memory_area_bytes: 0,
        }
    }
}

/// Smallest `ksp_stats.struct_size` accepted: the first layout, which
/// ended at `read_ahead_discarded`.
pub const KSP_STATS_MIN_SIZE: usize = offset_of!(ksp_stats, p90_us);

/// Statistics so far, in `*out` (set `out->struct_size` first; see
/// [`ksp_stats`]).
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_STRUCT_SIZE`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `out` points to a `ksp_stats` of the layout its
/// `struct_size` says, writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_stats(l: *const ksp_loader, out: *mut ksp_stats) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; out sized by its struct_size (contract).
        let (h, out) = unsafe {
            (
                ksp_loader::try_ref(l)?,
                SizedOut::new(out, "out", KSP_STATS_MIN_SIZE)?,
            )
        };
        let s = h.loader.stats();
        let c = &s.stall_causes;
        let top = &c.slowest_peers;
        out.set(ksp_stats {
            struct_size: 0, // not written: the caller's
            samples: s.samples,
            bytes: s.bytes,
            elapsed_s: s.elapsed.as_secs_f64(),
            stall_s: s.stall.as_secs_f64(),
            disk_reads: s.disk_reads,
            tier_hits: s.tier_hits,
            retries: s.retries,
            p50_us: s.read_latency.p50_us,
            p99_us: s.read_latency.p99_us,
            remote_samples: s.remote_samples,
            failovers: s.failovers,
            source_reads: s.source_reads,
            read_ahead: s.read_ahead,
            read_ahead_discarded: s.read_ahead_discarded,
            p90_us: s.read_latency.p90_us,
            p999_us: s.read_latency.p999_us,
            max_us: s.read_latency.max_us,
            latency_reads: s.read_latency.count,
            loop_stalls: s.loop_stalls,
            digest_epoch: s.digest.epoch,
            digest_count: s.digest.count,
            digest_sum: s.digest.sum,
            source_bytes: s.source_bytes,
            stall_disk_s: c.disk.as_secs_f64(),
            stall_tier_s: c.tier.as_secs_f64(),
            stall_source_s: c.source.as_secs_f64(),
            stall_peers_s: c.peers.as_secs_f64(),
            stall_failover_s: c.failover.as_secs_f64(),
            stall_agent_s: c.agent.as_secs_f64(),
            slowest_peer_node: std::array::from_fn(|i| top[i].node),
            slowest_peer_stall_s: std::array::from_fn(|i| top[i].stall.as_secs_f64()),
            slowest_peer_waits: std::array::from_fn(|i| top[i].waits),
            source_lead_count: s.source_lead.count,
            source_lead_late: s.source_lead.late,
            source_lead_p10_s: s.source_lead.p10.as_secs_f64(),
            source_lead_p50_s: s.source_lead.p50.as_secs_f64(),
            stall_waits: s.stall_waits,
            stall_peer_read_s: c.peer_read.as_secs_f64(),
            stall_peer_send_s: c.peer_send.as_secs_f64(),
            stall_peer_link_s: c.peer_link.as_secs_f64(),
            slowest_peer_read_s: std::array::from_fn(|i| top[i].read.as_secs_f64()),
            slowest_peer_send_s: std::array::from_fn(|i| top[i].send.as_secs_f64()),
            slowest_peer_link_s: std::array::from_fn(|i| top[i].link.as_secs_f64()),
            cache_hits: s.cache.hits,
            cache_hit_bytes: s.cache.hit_bytes,
            cache_writes: s.cache.writes,
            cache_skipped: s.cache.skipped,
            cache_corrupt: s.cache.corrupt,
            cache_held: s.cache.held,
            cache_slots: s.cache.slots,
            cache_planned_hits: s.cache.planned_hits,
            cache_write_bytes: s.cache.write_bytes,
            cache_write_errors: s.cache.write_errors,
            cache_area_bytes: s.cache.area_bytes,
            cache_memory_hits: s.cache_memory.hits,
            cache_memory_hit_bytes: s.cache_memory.hit_bytes,
            cache_memory_planned_hits: s.cache_memory.planned_hits,
            cache_memory_writes: s.cache_memory.writes,
            cache_memory_skipped: s.cache_memory.skipped,
            cache_memory_held: s.cache_memory.held,
            cache_memory_area_bytes: s.cache_memory.area_bytes,
        });
        Ok(())
    })
}

/// What the catalog says about one sample.
///
/// Extensible like [`ksp_stats`]: set `struct_size` to
/// `sizeof(ksp_catalog_sample)` before the call
/// (`ksp_catalog_sample c = KSP_CATALOG_SAMPLE_INIT;`). The library fills
/// the fields that fit in `struct_size` and writes nothing past it; a
/// larger (newer) layout's unknown fields are zeroed. New fields are only
/// ever appended. `struct_size` below `KSP_CATALOG_SAMPLE_MIN_SIZE` (the
/// first layout, ending at `label`) is `KSP_ERR_STRUCT_SIZE`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ksp_catalog_sample {
    /// Set by the caller: `sizeof(ksp_catalog_sample)` as it was compiled.
    pub struct_size: usize,
    /// Length in bytes.
    pub len: u64,
    /// CRC32C of its bytes.
    pub crc32c: u32,
    /// Always 0 (keeps every field on an 8-byte boundary).
    pub reserved: u32,
    /// Label, or -1 when the source has none.
    pub label: i64,
}

impl Default for ksp_catalog_sample {
    /// Zeroes with this build's `struct_size` (`KSP_CATALOG_SAMPLE_INIT`).
    fn default() -> Self {
        ksp_catalog_sample {
            struct_size: std::mem::size_of::<ksp_catalog_sample>(),
            len: 0,
            crc32c: 0,
            reserved: 0,
            label: 0,
        }
    }
}

/// Smallest `ksp_catalog_sample.struct_size` accepted: the first layout,
/// which ended at `label`.
pub const KSP_CATALOG_SAMPLE_MIN_SIZE: usize =
    offset_of!(ksp_catalog_sample, label) + size_of::<i64>();

/// Samples in the loader's catalog (the whole dataset), in `*out`.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_catalog_len(l: *const ksp_loader, out: *mut u64) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; out writable (contract).
        let (h, out) = unsafe { (ksp_loader::try_ref(l)?, Out::new(out, "out")?) };
        out.set(h.loader.catalog().len());
        Ok(())
    })
}

/// The catalog's record of sample `id` (length, CRC32C, label), in `*out`
/// (set `out->struct_size` first; see [`ksp_catalog_sample`]);
/// `KSP_ERR_INVALID_ARG` when `id` is past the catalog.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_STRUCT_SIZE`;
/// `KSP_ERR_INVALID_ARG`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `out` points to a `ksp_catalog_sample` of the
/// layout its `struct_size` says, writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_catalog_sample(
    l: *const ksp_loader,
    id: u64,
    out: *mut ksp_catalog_sample,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader; out sized by its struct_size (contract).
        let (h, out) = unsafe {
            (
                ksp_loader::try_ref(l)?,
                SizedOut::new(out, "out", KSP_CATALOG_SAMPLE_MIN_SIZE)?,
            )
        };
        let cat = h.loader.catalog();
        if id >= cat.len() {
            return Err(Fail::Invalid(format!(
                "sample {id} is past the catalog's {} samples",
                cat.len()
            )));
        }
        let s = cat.sample(id);
        out.set(ksp_catalog_sample {
            struct_size: 0, // not written: the caller's
            len: s.len as u64,
            crc32c: s.crc32c,
            reserved: 0,
            label: s.label.map_or(-1, |x| x as i64),
        });
        Ok(())
    })
}
