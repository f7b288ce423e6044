//! Job positions (resume at another world size; a mixture's also under
//! new weights) and the exactly-once audit: `ksp_loader_job_position`,
//! `ksp_loader_job_position_at`, `ksp_loader_restore_job_position`,
//! `ksp_audit`. A rank's own position is in [`super::loader`].

use std::ffi::c_char;

use super::errors::{guard, ksp_status, Fail};
use super::ffi::{Handle, Out};
use super::loader::{ksp_loader, write_loader_bytes};
use kspeed::sampler::{audit_positions, JobPosition, SavedPosition};

/// Writes the job's position (`KSP_JOB_POSITION_BYTES` bytes, `KSPDJOB1`;
/// a loader reading a mixture writes a `KSPDMIX1` of `48 + 16·D` bytes for
/// D datasets, which resumes under other weights too) to `buf` and its
/// length to `*out_len`: what the whole job has consumed of the epoch,
/// from this rank's position, valid for any world size when the job is in
/// lock-step (every rank at the same step, as DDP training is between
/// steps). Restore it on any number of ranks with
/// [`ksp_loader_restore_job_position`]. `*epoch` and `*consumed` (either
/// may be NULL) get its epoch and the entries of the epoch's order
/// consumed. `KSP_ERR_BUFFER_TOO_SMALL` (with `*out_len` set: call again
/// with that much) when `buf_len` is less.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_BUFFER_TOO_SMALL`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader; a read must not overlap `ksp_loader_next_batch`
/// on another thread); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `buf` writable for `buf_len` bytes; `out_len`
/// writable; `epoch` and `consumed` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_job_position(
    l: *const ksp_loader,
    buf: *mut u8,
    buf_len: usize,
    out_len: *mut usize,
    epoch: *mut u64,
    consumed: *mut u64,
) -> ksp_status {
    guard(|| {
        let mut job = None;
        // SAFETY: the contract above.
        unsafe {
            write_loader_bytes(l, buf, buf_len, out_len, |l| {
                job = Some(l.job_position());
                l.save_job_position()
            })?
        };
        let job = job.expect("set on success");
        // SAFETY: NULL or writable (contract).
        unsafe {
            if let Some(e) = epoch.as_mut() {
                *e = job.epoch;
            }
            if let Some(c) = consumed.as_mut() {
                *c = job.consumed;
            }
        }
        Ok(())
    })
}

/// Writes the job position `(epoch, consumed)` of this loader's job (the
/// job's place in the middle of a batch, say: `base + steps · world` from
/// this rank's [`super::ksp_loader_save_position`] layout) to `buf` as
/// [`ksp_loader_job_position`] does, its length to `*out_len`.
/// `KSP_ERR_BUFFER_TOO_SMALL` (with `*out_len` set) when `buf_len` is less.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_BUFFER_TOO_SMALL`.
///
/// Thread safety: one call on `l` at a time, reads included (serialise
/// every call on one loader); other loaders may be used from other threads
/// at once.
///
/// # Safety
/// `l` is a live loader; `buf` writable for `buf_len` bytes; `out_len`
/// writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_job_position_at(
    l: *const ksp_loader,
    epoch: u64,
    consumed: u64,
    buf: *mut u8,
    buf_len: usize,
    out_len: *mut usize,
) -> ksp_status {
    guard(|| {
        // SAFETY: the contract above.
        unsafe {
            write_loader_bytes(l, buf, buf_len, out_len, |l| {
                l.encode_job_position(JobPosition { epoch, consumed })
            })
        }
    })
}

/// Continues the job from a job position at this loader's rank and world
/// (any world size): the rest of the epoch, each sample not yet consumed
/// exactly once across the ranks, then ordinary epochs. `buf` holds a job
/// position ([`ksp_loader_job_position`]) or any rank's saved position
/// ([`super::ksp_loader_save_position`], whose job position is taken). A
/// position of another dataset, seed, shuffle or drop_last is
/// `KSP_ERR_INVALID_ARG`, naming what differs. A mixture's `KSPDMIX1` may
/// come from other weights: the rest of the epoch then follows this
/// loader's, nothing the job delivered in the epoch coming again
/// (docs/FORMAT.md, "Mixing datasets"). A loader attached to the
/// node agent (`agent`) resumes the same way (the agent deals the rest of
/// the epoch from the job position). Releases a held batch.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG`; a loader
/// that failed earlier returns its first error's status.
///
/// Thread safety: one call on `l` at a time (serialise every call on one
/// loader); other loaders may be used from other threads at once.
///
/// # Safety
/// `l` is a live loader; `buf` readable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ksp_loader_restore_job_position(
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
        h.loader.restore_job_position(bytes)?;
        Ok(())
    })
}

/// Audits a job from its ranks' saved positions (`count` buffers
/// `positions[i]` of `lens[i]` bytes, from `ksp_loader_save_position`: the
/// last one of every rank of every world that dealt the epochs, across
/// resumes at other world sizes, and a mixture's across resumes under
/// other weights too), as `kspeed audit` does. On success the
/// report, one line per epoch ("epoch 3: 1,281,167 samples, each exactly
/// once"), NUL-terminated, goes to `report` and its length without the NUL
/// to `*out_len` (`KSP_ERR_BUFFER_TOO_SMALL`, with `*out_len` set and
/// nothing written to `report`, when `report_len` is less than that + 1).
/// A sample skipped or delivered twice is `KSP_ERR_DATA` and
/// `ksp_last_error()` names the first difference; a buffer that is not a
/// position is `KSP_ERR_INVALID_ARG`.
///
/// Status: `KSP_OK`; `KSP_ERR_NULL_ARG`; `KSP_ERR_INVALID_ARG`;
/// `KSP_ERR_DATA`; `KSP_ERR_BUFFER_TOO_SMALL`.
///
/// Thread safety: any thread.
///
/// # Safety
/// `positions` and `lens` readable for `count` entries, each
/// `positions[i]` readable for `lens[i]` bytes; `report` writable for
/// `report_len` bytes; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn ksp_audit(
    positions: *const *const u8,
    lens: *const usize,
    count: usize,
    report: *mut c_char,
    report_len: usize,
    out_len: *mut usize,
) -> ksp_status {
    guard(|| {
        if positions.is_null() || lens.is_null() {
            return Err(Fail::Null(if positions.is_null() {
                "positions"
            } else {
                "lens"
            }));
        }
        if report.is_null() {
            return Err(Fail::Null("report"));
        }
        // SAFETY: out_len writable (contract).
        let out_len = unsafe { Out::new(out_len, "out_len")? };
        let mut saved = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: both arrays readable for count entries (contract).
            let (p, n) = unsafe { (*positions.add(i), *lens.add(i)) };
            if p.is_null() {
                return Err(Fail::Null("positions[i]"));
            }
            // SAFETY: positions[i] readable for lens[i] bytes (contract).
            let bytes = unsafe { std::slice::from_raw_parts(p, n) };
            saved.push(
                SavedPosition::decode(bytes)
                    .map_err(|e| Fail::Invalid(format!("position {i}: {e}")))?,
            );
        }
        let text: String = audit_positions(&saved)?
            .iter()
            .map(|r| format!("{r}\n"))
            .collect();
        out_len.set(text.len());
        if report_len < text.len() + 1 {
            return Err(Fail::Small);
        }
        // SAFETY: report has at least text.len() + 1 bytes (checked).
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), report.cast::<u8>(), text.len());
            *report.add(text.len()) = 0;
        }
        Ok(())
    })
}
