//! Batches through the C ABI: `ksp_batch` and its `ksp_sample` array,
//! `ksp_loader_next_batch` and `ksp_loader_release_batch`.

use std::mem::{offset_of, size_of};

use super::errors::{guard, ksp_status};
use super::ffi::{check_size, Handle, SizedOut};
use super::loader::ksp_loader;

/// One sample of a batch. `data` points into the landing ring: host memory,
/// or, with the `gpu_ring` config key, a CUDA device pointer (a
/// `CUdeviceptr` value) the CPU must not dereference.
///
/// Extensible: the `samples` array of a batch is laid out with the stride
/// the caller gives in `ksp_batch.sample_size` (its `sizeof(ksp_sample)`),
/// so `samples[i]` indexes correctly for the layout the caller was compiled
/// with. New fields are only ever appended.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ksp_sample {
    /// The sample's bytes (valid until the batch is released).
    pub data: *const u8,
    /// Its length in bytes.
    pub len: usize,
    /// Sample id (catalog index).
    pub id: u64,
    /// Label, or -1 when the source has none.
    pub label: i64,
    /// Which dataset of a mixture (the `mix` config key) the sample came
    /// from: its index in the order the datasets were given; 0 without a
    /// mixture. Appended after the first layout: written only when the
    /// caller's `sample_size` covers it.
    pub dataset: u32,
    /// Zero (reserved; keeps the layout a multiple of 8 bytes).
    pub reserved: u32,
}

/// Smallest `ksp_batch.sample_size` accepted: the first layout of
/// `ksp_sample` (up to `label`).
pub const KSP_SAMPLE_MIN_SIZE: usize = offset_of!(ksp_sample, dataset);

/// A batch: `count` samples in order, plus the contiguous span(s) of the
/// ring holding them (alignment padding included). With the `tier_views`
/// config key, a batch with any sample served in place from the memory
/// tier has no span: `span` and `wrap` are NULL and their lengths 0, and
/// each sample's `data` points to its own bytes (in the tier or the ring);
/// callers that copy a batch as one span leave `tier_views` off. Everything it points to
/// is owned by the loader and valid until this batch is released: by
/// [`ksp_loader_release_batch`] with its `seq`, by the next
/// [`ksp_loader_next_batch`] (a loader holds one batch at a time), by
/// [`super::ksp_loader_set_epoch`] / [`super::ksp_loader_restore_position`],
/// or by [`super::ksp_loader_free`]. With `gpu_ring`, `span`, `wrap` and
/// every sample's `data` are CUDA device pointers (copy or use them on the
/// GPU; `samples` itself is host memory).
///
/// Every batch but an epoch's last has exactly `batch_size` samples, and
/// every rank of a job gets the same number of batches per epoch
/// ([`super::ksp_loader_batches_per_epoch`]): a batch is never cut short by
/// ring space, because [`super::ksp_loader_new`] refuses a `ring_bytes`
/// that cannot hold the largest possible batch (`KSP_ERR_INVALID_ARG`,
/// naming the size needed).
///
/// Extensible: the caller sets `struct_size` and `sample_size` before
/// calling [`ksp_loader_next_batch`] (`ksp_batch b = KSP_BATCH_INIT;`); see
/// there. New fields are only ever appended.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ksp_batch {
    /// Set by the caller: `sizeof(ksp_batch)` as it was compiled.
    pub struct_size: usize,
    /// Set by the caller: `sizeof(ksp_sample)` as it was compiled; the
    /// stride of `samples`.
    pub sample_size: usize,
    /// Samples in the batch; 0 at the end of the epoch.
    pub count: usize,
    /// `count` samples, `sample_size` bytes apart.
    pub samples: *const ksp_sample,
    /// The batch's bytes from its first sample's start (NULL when some
    /// samples are memory-tier views: `tier_views`).
    pub span: *const u8,
    /// Length of `span`.
    pub span_len: usize,
    /// The rest when the batch wraps around the ring's end (else NULL).
    pub wrap: *const u8,
    /// Length of `wrap` (0 when it does not wrap).
    pub wrap_len: usize,
    /// The epoch this batch belongs to.
    pub epoch: u64,
    /// The batch's identity: 1 for the loader's first batch, then 2, 3...
    /// (0 when `count` is 0). Pass it to [`ksp_loader_release_batch`].
    pub seq: u64,
}

impl Default for ksp_batch {
    /// An empty batch with this build's `struct_size` and `sample_size`
    /// (`KSP_BATCH_INIT`), ready for [`ksp_loader_next_batch`].
    fn default() -> Self {
        ksp_batch {
            struct_size: size_of::<ksp_batch>(),
            sample_size: size_of::<ksp_sample>(),
            count: 0,
            samples: std::ptr::null(),
            span: std::ptr::null(),
            span_len: 0,
            wrap: std::ptr::null(),
            wrap_len: 0,
            epoch: 0,
            seq: 0,
        }
    }
}

/// Smallest `ksp_batch.struct_size` accepted: the first layout, which
/// ended at `seq`.
pub const KSP_BATCH_MIN_SIZE: usize = offset_of!(ksp_batch, seq) + size_of::<u64>();

/// Waits for the next batch of the current epoch and describes it in
/// `*out`; `out->count == 0` at the epoch's end (call
/// [`super::ksp_loader_set_epoch`] to go on). A batch still held is
/// released first (its pointers die). Returns a loader error as its status
/// (`KSP_ERR_IO` naming the sample and file..., `KSP_ERR_NETWORK` for a
/// node agent that is gone); after one, the loader
/// stays failed: every later call returns that first error's status again,
/// with a message that starts "the loader stopped after an earlier error".
///
/// The caller sets `out->struct_size` (`sizeof(ksp_batch)`) and
/// `out->sample_size` (`sizeof(ksp_sample)`) first; `KSP_BATCH_INIT` does
/// both. The library fills the fields that fit in `struct_size` (zeroing
/// any it does not know of a newer, larger layout) and lays `samples` out
/// `sample_size` bytes apart (zeroing unknown tail fields of each).
/// `struct_size` below `KSP_BATCH_MIN_SIZE` or `sample_size` below
/// `KSP_SAMPLE_MIN_SIZE` (or either not a multiple of 8, or over
/// `KSP_MAX_STRUCT_SIZE`) is `KSP_ERR_STRUCT_SIZE`, with nothing waited for
/// or written.
///
/// Thread safety: one call on `l` at a time (serialise every call on one
/// loader); it blocks the calling thread until the batch is read. Other
/// loaders may be used from other threads at once. The batch's bytes may be
/// read from any thread until it is released.
///
/// # Safety
/// `l` is a live loader; `out` points to a `ksp_batch` of the layout its
/// `struct_size` says, writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_next_batch(
    l: *mut ksp_loader,
    out: *mut ksp_batch,
) -> ksp_status {
    guard(|| {
        // SAFETY: live loader, one thread at a time; out sized by its
        // struct_size (contract).
        let (h, out) = unsafe {
            (
                ksp_loader::try_mut(l)?,
                SizedOut::new(out, "out", KSP_BATCH_MIN_SIZE)?,
            )
        };
        // SAFETY: out is non-NULL and aligned with struct_size >=
        // KSP_BATCH_MIN_SIZE bytes, sample_size among them (SizedOut::new
        // checked; contract).
        let stride = unsafe { (*out.ptr()).sample_size };
        check_size::<ksp_sample>(stride, KSP_SAMPLE_MIN_SIZE, "out->sample_size")?;
        let n = h.loader.acquire_batch()?;
        let words = stride / 8;
        h.samples.clear();
        // Sized for a batch of the library's own stride at creation: grows
        // (once) only for a caller compiled with a larger ksp_sample.
        h.samples.resize(n * words, 0);
        let mut batch = ksp_batch {
            struct_size: 0, // not written: the caller's
            sample_size: stride,
            count: n,
            samples: std::ptr::null(),
            span: std::ptr::null(),
            span_len: 0,
            wrap: std::ptr::null(),
            wrap_len: 0,
            epoch: h.loader.position().epoch,
            seq: h.loader.held_seq().unwrap_or(0),
        };
        if n > 0 {
            // With a GPU ring every pointer is a device address, never
            // dereferenced here.
            let gpu = h.loader.landing_device().is_some();
            for i in 0..n {
                let (data, len, id, label, dataset, epoch) = if gpu {
                    let s = h.loader.held_device_sample(i);
                    let p = s.addr as *const u8;
                    (p, s.len, s.id, s.label, s.dataset, s.position.epoch)
                } else {
                    let s = h.loader.held_sample(i);
                    let (p, l) = (s.bytes.as_ptr(), s.bytes.len());
                    (p, l, s.id, s.label, s.dataset, s.position.epoch)
                };
                if i == 0 {
                    batch.epoch = epoch;
                }
                let s = ksp_sample {
                    data,
                    len,
                    id,
                    label: label.map_or(-1, |x| x as i64),
                    dataset,
                    reserved: 0,
                };
                let slot = h.samples[i * words..].as_mut_ptr().cast::<u8>();
                // As much of this layout as the caller's stride holds: an
                // older caller's (the first layout) ends before `dataset`.
                let n = stride.min(size_of::<ksp_sample>());
                // SAFETY: slot has words * 8 = stride >= n bytes left in
                // the vector (the stride was checked against the minimum),
                // and s is a plain value of at least n bytes; the tail of a
                // larger stride stays zero from the resize.
                unsafe {
                    std::ptr::copy_nonoverlapping((&s as *const ksp_sample).cast::<u8>(), slot, n)
                };
            }
            let ((span, span_len), wrap) = if gpu {
                let ((a, l), w) = h.loader.held_device_spans();
                ((a as *const u8, l), w.map(|(a, l)| (a as *const u8, l)))
            } else if !h.loader.held_in_ring() {
                // Some samples are views into the memory tier (tier_views):
                // the batch is not one span of the ring.
                ((std::ptr::null(), 0), None)
            } else {
                let (sp, w) = h.loader.held_spans();
                ((sp.as_ptr(), sp.len()), w.map(|w| (w.as_ptr(), w.len())))
            };
            batch.samples = h.samples.as_ptr().cast();
            batch.span = span;
            batch.span_len = span_len;
            if let Some((w, wl)) = wrap {
                batch.wrap = w;
                batch.wrap_len = wl;
            }
        }
        out.set(batch);
        Ok(())
    })
}

/// Releases batch `seq` (its `ksp_batch.seq`): returns its ring space;
/// its pointers are invalid afterwards. A batch that was released already
/// (by an earlier call, the next [`ksp_loader_next_batch`],
/// [`super::ksp_loader_set_epoch`] or [`super::ksp_loader_restore_position`])
/// is left alone and the call does nothing, so a late release never frees a
/// newer batch: a wrapper that releases its batch in a destructor is safe in
/// any order.
///
/// Status: `KSP_OK` (released, or already released); `KSP_ERR_NULL_ARG`;
/// `KSP_ERR_INVALID_ARG` (`seq` was never handed out by this loader).
///
/// Thread safety: one call on `l` at a time (a batch may be released from
/// another thread than the one that got it, if calls on `l` are
/// serialised).
///
/// # Safety
/// `l` is a live loader.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_release_batch(l: *mut ksp_loader, seq: u64) -> ksp_status {
    guard(|| {
        // SAFETY: live loader, one thread at a time (contract).
        let h = unsafe { ksp_loader::try_mut(l)? };
        if h.loader.release_batch_seq(seq)? {
            h.samples.clear();
        }
        Ok(())
    })
}
