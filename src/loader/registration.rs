//! Registering the landing ring with the pollers' io_urings once they have
//! written all of it.
//!
//! Registration pins every page of the ring and faults in those not yet
//! touched. Done when the loader was built, that was the whole ring before
//! the first batch: 25 ms for 256 MiB on bare metal, up to 0.6 s in a VM
//! whose host backs freed guest memory again on first touch, paid by every
//! start and resume (BENCHMARKS.md, issue 32). So the pollers read their
//! first lap with plain reads (the kernel pins each read's pages itself,
//! which costs nothing measurable against the device: BENCHMARKS.md), and
//! each registers when it first places a sample in the ring's second lap,
//! when the pages are resident and pinning them takes 0.3-0.5 ms for
//! 256 MiB (strace, this VM).
//! Where the kernel shares a buffer table (6.12+) the first poller's table
//! is shared with the others, so the ring is pinned and charged to
//! `RLIMIT_MEMLOCK` once, not once per poller.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Mutex, PoisonError};

use super::schedule::Geometry;
use crate::landing::LandingRing;
use crate::ring::IoBackend;

/// A poller's backend and whether the ring is registered with it; kept
/// across the loader's restarts (a backend registers once in its life).
pub(crate) struct PollerIo {
    pub(crate) io: Box<dyn IoBackend>,
    /// The ring is this backend's fixed buffers (reads name `buf_index`).
    pub(crate) registered: bool,
}

impl PollerIo {
    pub(crate) fn new(io: Box<dyn IoBackend>) -> Self {
        PollerIo {
            io,
            registered: false,
        }
    }
}

/// The loader's registrations, shared by its pollers across restarts.
pub(crate) struct RingRegistration {
    /// Registration was asked for and can be done (a host ring read by
    /// io_uring, `registered_buffers` on).
    wanted: bool,
    pollers: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The io_uring of the first registration, whose table later
    /// pollers share; dropped once every poller has it.
    first: Option<OwnedFd>,
    /// The kernel refused to share a table: each poller registers its own.
    no_sharing: bool,
    /// Backends that registered their own table, and that share one.
    own: usize,
    shared: usize,
    /// The first registration error (the rest read with plain reads).
    error: Option<String>,
}

impl RingRegistration {
    pub(crate) fn new(wanted: bool, pollers: usize) -> Self {
        RingRegistration {
            wanted,
            pollers,
            state: Mutex::new(State::default()),
        }
    }

    /// Whether the pollers register the ring once it is written.
    pub(crate) fn wanted(&self) -> bool {
        self.wanted
    }

    /// Registers the ring with `io` (sharing the first poller's table
    /// where the kernel can); true when `io` may now read into it with
    /// fixed buffers. Called once per backend, by its poller, outside any
    /// per-sample path.
    pub(crate) fn register(
        &self,
        io: &mut dyn IoBackend,
        ring: &LandingRing,
        geo: &Geometry,
    ) -> bool {
        if !self.wanted {
            return false;
        }
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.error.is_some() {
            // One failure said why; a second attempt would fail alike.
            return false;
        }
        if let Some(first) = st.first.as_ref().filter(|_| !st.no_sharing) {
            match io.share_buffers(first.as_fd()) {
                Ok(()) => {
                    st.shared += 1;
                    if st.own + st.shared >= self.pollers {
                        st.first = None;
                    }
                    return true;
                }
                Err(e) => {
                    log::info!("{e}; registering the ring per poller");
                    st.no_sharing = true;
                    st.first = None;
                }
            }
        }
        let seg = geo.segment() as usize;
        let regions: Vec<(*mut u8, usize)> = (0..ring.len())
            .step_by(seg)
            .map(|off| {
                (
                    // SAFETY: off < ring.len(), inside the mapping.
                    unsafe { ring.as_mut_ptr().add(off) },
                    seg.min(ring.len() - off),
                )
            })
            .collect();
        // SAFETY: the ring outlives every backend: the Loader drops its
        // backends, then this table's duplicate descriptor (`release`),
        // then the ring.
        match unsafe { io.register_buffers(&regions) } {
            Ok(()) => {
                st.own += 1;
                if !st.no_sharing && st.own == 1 && self.pollers > 1 {
                    st.first = io.uring_fd();
                }
                true
            }
            Err(e) => {
                // Not silent: reads then pin pages one by one.
                log::warn!(
                    "the landing ring cannot be registered with io_uring ({e}); reading \
                     without fixed buffers. Pollers not sharing one registration (kernels \
                     before 6.12) pin the ring once each against RLIMIT_MEMLOCK: raise the \
                     limit (ulimit -l) or use a kernel of 6.12 or later"
                );
                st.error = Some(e.to_string());
                false
            }
        }
    }

    /// Drops the shared table's descriptor (before the ring goes).
    pub(crate) fn release(&self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .first = None;
    }

    /// Whether any poller reads into the ring with fixed buffers now.
    pub(crate) fn any(&self) -> bool {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.own + st.shared > 0
    }

    /// How the pollers read into the ring now (`LandingInfo::io`).
    pub(crate) fn describe(&self) -> String {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let n = self.pollers;
        match (&st.error, st.own, st.shared) {
            (Some(e), 0, 0) => format!("not registered: {e}"),
            (Some(e), own, shared) => {
                format!("registered by {} of {n} pollers, then: {e}", own + shared)
            }
            (None, 0, 0) => "plain reads until the pollers have written the whole ring once, \
                             then registered"
                .to_string(),
            (None, 1, 0) if n == 1 => "registered (1 poller)".to_string(),
            (None, 1, shared) if shared + 1 == n => {
                format!("registered once, shared by {n} pollers")
            }
            (None, own, 0) if own == n => format!("registered by each of {n} pollers"),
            (None, own, shared) if own + shared >= n => {
                format!("registered by all {n} pollers ({own} tables)")
            }
            (None, own, shared) => format!(
                "registered by {} of {n} pollers so far (the others after their first lap)",
                own + shared
            ),
        }
    }
}
