//! The landing ring: one contiguous region of GPU-adjacent host memory into
//! which samples are read (or, remotely, written) in sampler order.
//!
//! - huge pages (2 MiB, `MAP_HUGETLB`) when the system has them reserved;
//!   otherwise normal pages with transparent huge pages requested, and the
//!   fallback is reported;
//! - `mlock`ed as its pages are first written (`MLOCK_ONFAULT`), so the
//!   kernel never pages it out under the NIC or the GPU and building it
//!   does not fault in memory the first batches do not use; failing that,
//!   a named error gives `RLIMIT_MEMLOCK` and the bytes needed;
//! - bound to a NUMA node (`mbind`), chosen by config or derived from a GPU's
//!   PCI address (`/sys/bus/pci/devices/ADDR/numa_node`);
//! - registered with CUDA as pinned host memory when a CUDA runtime or driver
//!   library can be loaded at run time ([`cuda`]); never a build dependency.
//!
//! This module owns the raw memory and is one of the few allowed `unsafe`.

pub mod cuda;

use std::path::Path;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// How to treat CUDA registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudaMode {
    /// Register when a CUDA library loads and a device is present; otherwise go on.
    #[default]
    Auto,
    /// Never try.
    Off,
    /// Fail when registration is not possible.
    Require,
}

/// Landing ring settings.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LandingOptions {
    /// Size in bytes (rounded up to whole pages). 0 (the default): the
    /// loader sizes it from the batch and the dataset
    /// ([`LoaderBuilder::ring_bytes`](crate::loader::LoaderBuilder::ring_bytes));
    /// a ring made directly needs a size.
    pub ring_bytes: u64,
    /// Try 2 MiB huge pages first.
    pub huge_pages: bool,
    /// Lock the memory (recommended; required for RDMA and CUDA pinning).
    pub mlock: bool,
    /// Bind to this NUMA node.
    pub numa_node: Option<u32>,
    /// Or: bind to the NUMA node of this PCI device (a GPU), e.g. `0000:3b:00.0`.
    pub gpu_pci: Option<String>,
    /// CUDA registration.
    pub cuda: CudaMode,
}

impl LandingOptions {
    /// The NUMA node the ring's memory is bound to: `numa_node`, else the
    /// node of the GPU at `gpu_pci` (None where sysfs reports none: a
    /// single-node machine), else none.
    pub(crate) fn bind_node(&self) -> Result<Option<u32>> {
        Ok(match (&self.gpu_pci, self.numa_node) {
            (_, Some(n)) => Some(n),
            (Some(pci), None) => {
                // The same sysfs tree the placement reads (KSPEED_SYSFS_ROOT
                // in tests and containers that mount sysfs elsewhere).
                let n = pci_numa_node(&crate::placement::sysfs_root(), pci)?;
                if n.is_none() {
                    log::info!(
                        "GPU {pci}: no NUMA node reported (single-node machine); not binding"
                    );
                }
                n
            }
            (None, None) => None,
        })
    }
}

impl Default for LandingOptions {
    fn default() -> Self {
        LandingOptions {
            ring_bytes: 0,
            huge_pages: true,
            mlock: true,
            numa_node: None,
            gpu_pci: None,
            cuda: CudaMode::Auto,
        }
    }
}

setters!(LandingOptions {
    ring_bytes: u64,
    huge_pages: bool,
    mlock: bool,
    numa_node: Option<u32>,
    gpu_pci: Option<String>,
    cuda: CudaMode,
});

/// What the landing ring ended up with.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LandingInfo {
    /// Bytes mapped.
    pub bytes: u64,
    /// Backed by explicit 2 MiB huge pages.
    pub huge_pages: bool,
    /// Locked in memory.
    pub locked: bool,
    /// NUMA node it is bound to.
    pub numa_node: Option<u32>,
    /// "registered with CUDA (libcudart.so.12)", "CUDA not present: ...".
    pub cuda: String,
    /// Registered with the pollers' io_urings as fixed buffers (reads
    /// skip the per-read page pinning).
    pub io_registered: bool,
    /// How the pollers read into it: "registered once, shared by 4
    /// pollers", "registered by each of 2 pollers", or why it is not
    /// registered.
    pub io: String,
    /// Reads bypass the page cache (O_DIRECT); false when the file system
    /// refused it, or when reading source files.
    pub direct_io: bool,
}

const HUGE_PAGE: u64 = 2 << 20;

/// The ring's memory.
pub(crate) struct LandingRing {
    ptr: NonNull<u8>,
    len: usize,
    info: LandingInfo,
    cuda: Option<cuda::Registration>,
    /// A ring in GPU memory: `ptr` is then the device address, which the CPU
    /// must not dereference (see [`LandingRing::new_gpu`]).
    device: Option<cuda::DeviceMemory>,
    /// A ring shared with another process (the node agent's attach, a
    /// sealed memfd mapped `MAP_SHARED`): the mapping is the `RingMap`'s,
    /// unmapped when it drops (see [`LandingRing::shared`]).
    shared: Option<crate::agent::shm::RingMap>,
    /// Bytes from the start of the ring faulted in by
    /// [`LandingRing::populate_to`]; `u64::MAX` once there is nothing
    /// left to do (all of it, or a ring it does not apply to, or a kernel
    /// without `MADV_POPULATE_WRITE`).
    populated: std::sync::atomic::AtomicU64,
}

// SAFETY: the ring is plain memory owned by this value; which bytes may be
// read or written concurrently is governed by the loader's protocol (see
// `slice` and `as_mut_ptr`), not by thread identity.
unsafe impl Send for LandingRing {}
// SAFETY: as above; &LandingRing hands out only raw pointers and, through the
// unsafe `slice`, shared views of bytes the caller guarantees are not written.
unsafe impl Sync for LandingRing {}

/// RLIMIT_MEMLOCK's soft limit, in bytes (u64::MAX for unlimited).
pub fn memlock_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the valid struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    if rc != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        r.rlim_cur
    }
}

/// The NUMA node of a PCI device, from sysfs; `None` when the platform has
/// no NUMA information (the file says -1) or the device is unknown.
pub fn pci_numa_node(sysfs: &Path, pci: &str) -> Result<Option<u32>> {
    let p = sysfs.join("bus/pci/devices").join(pci).join("numa_node");
    let text = std::fs::read_to_string(&p).map_err(|e| Error::io("read", &p, e))?;
    let v: i64 = text.trim().parse().map_err(|_| {
        Error::InvalidConfig(format!(
            "{}: {:?} is not a node number",
            p.display(),
            text.trim()
        ))
    })?;
    Ok(u32::try_from(v).ok())
}

impl LandingRing {
    /// Maps, locks, binds and registers the ring as `opts` says.
    pub fn new(opts: &LandingOptions) -> Result<Self> {
        if opts.ring_bytes == 0 {
            return Err(Error::InvalidConfig(
                "ring_bytes 0 (sized from the batch) is for a loader; a ring made on its own needs a size"
                    .into(),
            ));
        }
        let numa_node = opts.bind_node()?;
        let (ptr, len, huge) = map(opts.ring_bytes, opts.huge_pages)?;
        let mut ring = LandingRing {
            ptr,
            len,
            info: LandingInfo {
                bytes: len as u64,
                huge_pages: huge,
                locked: false,
                numa_node: None,
                cuda: String::new(),
                io_registered: false,
                io: String::new(),
                direct_io: true,
            },
            cuda: None,
            device: None,
            shared: None,
            populated: std::sync::atomic::AtomicU64::new(0),
        };
        if let Some(node) = numa_node {
            ring.bind(node)?;
            ring.info.numa_node = Some(node);
        }
        if opts.mlock {
            lock_on_fault(ptr, len)?;
            ring.info.locked = true;
        }
        // No page is touched here: the first reads into a page fault it in
        // (and the NUMA binding applies then), so building a loader costs
        // what its first batches touch, not the whole ring. Faulting 256
        // MiB in takes 25 ms on bare metal and up to 0.6 s in a VM whose
        // host backs freed guest memory again on first touch; that was
        // the time to the first batch of every start and resume. The
        // pollers register the ring with io_uring once they have written
        // it all (`loader/registration.rs`), when pinning costs no faults.
        // CUDA's registration below pins (and so faults in) the whole
        // ring now, where a CUDA library and a device are present.
        match opts.cuda {
            CudaMode::Off => ring.info.cuda = "CUDA registration off".into(),
            mode => match cuda::Registration::register(ptr.as_ptr(), len) {
                Ok(reg) => {
                    ring.info.cuda = format!("registered with CUDA ({})", reg.library());
                    ring.cuda = Some(reg);
                }
                Err(why) if mode == CudaMode::Require => {
                    return Err(Error::Cuda(why));
                }
                Err(why) => ring.info.cuda = format!("CUDA not used: {why}"),
            },
        }
        if !huge && opts.huge_pages {
            log::info!("landing ring: no 2 MiB huge pages reserved (vm.nr_hugepages); using normal pages with THP advice");
        }
        Ok(ring)
    }

    fn bind(&self, node: u32) -> Result<()> {
        // SAFETY: our own live mapping, page-aligned.
        unsafe { crate::sys::bind_numa(self.ptr.as_ptr(), self.len, node) }.map_err(|e| {
            Error::Numa {
                node,
                reason: e.to_string(),
            }
        })
    }

    /// A ring in the memory of GPU `ordinal` (CUDA driver, loaded at run
    /// time), for RDMA writes straight into the GPU (GPUDirect RDMA). The CPU
    /// cannot read it: [`LandingRing::as_mut_ptr`] is the device address,
    /// [`LandingRing::slice`] must not be called, and host code reaches the
    /// bytes only through [`LandingRing::device`]'s copies.
    pub fn new_gpu(ordinal: u32, ring_bytes: u64) -> Result<Self> {
        if ring_bytes == 0 {
            return Err(Error::InvalidConfig(
                "ring_bytes 0 (sized from the batch) is for a loader; a ring made on its own needs a size"
                    .into(),
            ));
        }
        let mem = cuda::DeviceMemory::alloc(ordinal, ring_bytes as usize)
            .map_err(|e| Error::InvalidConfig(format!("GPU ring on device {ordinal}: {e}")))?;
        let ptr = NonNull::new(mem.addr() as *mut u8).ok_or_else(|| {
            Error::InvalidConfig(format!("GPU ring on device {ordinal}: null device address"))
        })?;
        let len = mem.len();
        Ok(LandingRing {
            ptr,
            len,
            info: LandingInfo {
                bytes: len as u64,
                huge_pages: false,
                locked: false,
                numa_node: None,
                cuda: format!("GPU memory on device {ordinal} (CUDA driver)"),
                io_registered: false,
                io: "GPU memory: written by the NIC only".into(),
                direct_io: true,
            },
            cuda: None,
            device: Some(mem),
            shared: None,
            // GPU memory: nothing for the CPU to fault in.
            populated: std::sync::atomic::AtomicU64::new(u64::MAX),
        })
    }

    /// The node agent's memory tier in a shared mapping (a sealed memfd
    /// that ranks asking for tier views map read-only), locked as its
    /// pages are first written where `mlock` (`RLIMIT_MEMLOCK` checked for
    /// the whole mapping, [`Error::Memlock`] naming it).
    pub(crate) fn shared_tier(map: crate::agent::shm::RingMap, mlock: bool) -> Result<Self> {
        let mut r = Self::shared(map);
        if mlock {
            lock_on_fault(r.ptr, r.len)?;
            r.info.locked = true;
        }
        r.info.io = "the node tier (a sealed memfd ranks may map read-only)".into();
        Ok(r)
    }

    /// The shared mapping under a ring made by [`LandingRing::shared`] or
    /// [`LandingRing::shared_tier`].
    pub(crate) fn shared_map(&self) -> Option<&crate::agent::shm::RingMap> {
        self.shared.as_ref()
    }

    /// A ring in a shared mapping (a sealed memfd): the attached loader's
    /// ring, written by the node agent's pollers, or the agent's view of a
    /// rank's ring. Not locked, bound or registered with CUDA here (the
    /// rank creates the memfd; binding it is left to the rank).
    pub(crate) fn shared(map: crate::agent::shm::RingMap) -> Self {
        let ptr = NonNull::new(map.as_mut_ptr()).expect("a mapping is non-null");
        let len = map.len() as usize;
        LandingRing {
            ptr,
            len,
            info: LandingInfo {
                bytes: len as u64,
                huge_pages: map.pages() == crate::agent::shm::RingPages::Hugetlb,
                locked: false,
                numa_node: map.numa_node(),
                cuda: "CUDA registration off (a ring shared with the node agent)".into(),
                io_registered: false,
                io: "shared with the node agent (a sealed memfd)".into(),
                direct_io: true,
            },
            cuda: None,
            device: None,
            shared: Some(map),
            // The rank populated its shared ring when it mapped it.
            populated: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }

    /// The GPU memory behind a ring made by [`LandingRing::new_gpu`].
    pub fn device(&self) -> Option<&cuda::DeviceMemory> {
        self.device.as_ref()
    }

    /// What was set up.
    pub fn info(&self) -> &LandingInfo {
        &self.info
    }

    /// Records how the loader reads into the ring (see [`LandingInfo`]).
    /// (Whether the ring is registered with io_uring is the loader's to
    /// say: `Loader::landing_info`.)
    pub(crate) fn set_io_info(&mut self, how: String, direct_io: bool) {
        self.info.io = how;
        self.info.direct_io = direct_io;
    }

    /// Faults in, writable, the ring's pages up to `end` bytes from its
    /// start (rounded up to 2 MiB), where earlier calls have not: the
    /// pollers call it before their first lap's reads, so that no read
    /// lands in a page that is not there. A read into a missing page
    /// faults in the kernel's copy or pinning, and io_uring then hands it
    /// to a worker thread instead of finishing it inline (measured: the
    /// first lap of a warm epoch took twice as long). Populating changes
    /// no contents, so pollers may race here: the ranges overlap, no byte
    /// changes. One atomic load once the ring is populated; a no-op for
    /// GPU and shared rings and on kernels without `MADV_POPULATE_WRITE`
    /// (before 5.14), whose reads fault as they go.
    pub(crate) fn populate_to(&self, end: u64) {
        use std::sync::atomic::Ordering;
        const CHUNK: u64 = 2 << 20;
        let done = self.populated.load(Ordering::Relaxed);
        if end <= done {
            return;
        }
        let len = self.len as u64;
        let upto = end.next_multiple_of(CHUNK).min(len);
        // SAFETY: done < upto <= len: a range of our own live mapping;
        // MADV_POPULATE_WRITE faults pages in and changes no contents, so
        // bytes a read or the consumer uses at the same time are not
        // touched.
        let rc = unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(done as usize).cast(),
                (upto - done) as usize,
                libc::MADV_POPULATE_WRITE,
            )
        };
        let next = if rc != 0 || upto == len {
            u64::MAX
        } else {
            upto
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                // A kernel before 5.14: the reads fault the pages.
                log::debug!("landing ring: no MADV_POPULATE_WRITE ({e}); the first lap's reads fault its pages");
            } else {
                // No memory to be had (a cgroup's memory.max, a full NUMA
                // node under the binding): the reads will meet it too.
                log::warn!(
                    "landing ring: faulting in bytes {done}..{upto} of {len} failed ({e}); \
                     reads into them may fail or the process be killed for memory: \
                     lower ring_bytes or raise the memory limit"
                );
            }
        }
        self.populated.fetch_max(next, Ordering::Relaxed);
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Base pointer for I/O into the ring (io_uring, memcpy from the tier).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// A shared view of `len` bytes at `off`.
    ///
    /// # Safety
    /// `off + len <= self.len()`, and nothing may write those bytes while the
    /// returned slice lives (the loader guarantees this for delivered,
    /// unreleased samples: pollers write only outside the consumer's window).
    pub unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(self.device.is_none(), "the landing ring is GPU memory");
        debug_assert!(off + len <= self.len);
        // SAFETY: in bounds per the contract; no concurrent writer per the contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }
}

/// Bytes [`LandingRing::crc32c`] copies through the kernel at a time (on
/// the caller's stack) where reading the ring directly could fault.
const FAULTABLE_CRC_CHUNK: usize = 32 << 10;

impl LandingRing {
    /// Whether this process reads the ring's bytes through the kernel
    /// ([`crate::sys::copy_faultable`]): a ring mapped from another
    /// process's hugetlb memfd (the node agent's view of a rank's ring),
    /// whose pages that process can take away.
    pub(crate) fn reads_through_kernel(&self) -> bool {
        self.shared.is_some() && self.info.huge_pages
    }

    /// The CRC32C of the `len` bytes at offset `off`, or `None` when
    /// reading them faulted. A ring this process maps from another's memfd
    /// in hugetlb pages (the node agent's view of a rank's ring) is read
    /// through the kernel ([`crate::sys::copy_faultable`], a chunk at a
    /// time): a page the rank punched out with no huge page left to
    /// replace it fails the read there instead of killing the agent with
    /// SIGBUS. Any other ring is read in place.
    ///
    /// # Safety
    /// `off + len <= self.len()`, the ring is host memory, and nothing
    /// writes those bytes during the call.
    pub(crate) unsafe fn crc32c(&self, off: usize, len: usize) -> Option<u32> {
        assert!(self.device.is_none(), "the landing ring is GPU memory");
        debug_assert!(off + len <= self.len);
        // SAFETY: in bounds per the contract.
        let at = unsafe { self.ptr.as_ptr().add(off) };
        if !self.reads_through_kernel() {
            // SAFETY: in bounds and not written meanwhile, per the
            // contract; memory this process owns or a shmem page that a
            // hole refills.
            return Some(crc32c::crc32c(unsafe {
                std::slice::from_raw_parts(at, len)
            }));
        }
        // SAFETY: in bounds per the contract.
        unsafe { crc32c_faultable(at, len) }
    }
}

/// The CRC32C of the `len` bytes at `at`, read through the kernel a chunk
/// at a time; `None` when a page of them faults.
///
/// # Safety
/// `at..at + len` is an address range of this process (its pages may be
/// missing or inaccessible: that is the point), not written meanwhile.
unsafe fn crc32c_faultable(at: *const u8, len: usize) -> Option<u32> {
    let mut chunk = std::mem::MaybeUninit::<[u8; FAULTABLE_CRC_CHUNK]>::uninit();
    let buf = chunk.as_mut_ptr().cast::<u8>();
    let mut crc = 0;
    let mut done = 0;
    while done < len {
        let n = (len - done).min(FAULTABLE_CRC_CHUNK);
        // SAFETY: `buf` has room for n bytes; the source range is this
        // process's per the contract; a fault is reported, not raised.
        if !unsafe { crate::sys::copy_faultable(buf, at.add(done), n) } {
            return None;
        }
        // SAFETY: copy_faultable wrote all n bytes at `buf`.
        crc = crc32c::crc32c_append(crc, unsafe { std::slice::from_raw_parts(buf, n) });
        done += n;
    }
    Some(crc)
}

/// Locks `len` bytes at `ptr` as their pages are first faulted in
/// (`mlock2(MLOCK_ONFAULT)`, Linux 4.4+), or at once with `mlock` where the
/// kernel has no `mlock2`. `RLIMIT_MEMLOCK` is checked against the whole
/// range either way, so a ring over the limit is refused here, by name.
fn lock_on_fault(ptr: NonNull<u8>, len: usize) -> Result<()> {
    const MLOCK_ONFAULT: libc::c_ulong = 1;
    // SAFETY: ptr/len describe our own live mapping; mlock2 only changes
    // its locking, no memory is read or written by the call.
    let mut rc = unsafe { libc::syscall(libc::SYS_mlock2, ptr.as_ptr(), len, MLOCK_ONFAULT) };
    let mut err = std::io::Error::last_os_error();
    if rc != 0 && matches!(err.raw_os_error(), Some(libc::ENOSYS) | Some(libc::EINVAL)) {
        // SAFETY: as above.
        rc = unsafe { libc::mlock(ptr.as_ptr().cast(), len) } as libc::c_long;
        err = std::io::Error::last_os_error();
    }
    if rc != 0 {
        return Err(Error::Memlock {
            needed: len as u64,
            limit: memlock_limit(),
            errno: err.raw_os_error().unwrap_or(0),
        });
    }
    Ok(())
}

fn map(bytes: u64, huge: bool) -> Result<(NonNull<u8>, usize, bool)> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    if huge {
        let len = bytes.next_multiple_of(HUGE_PAGE) as usize;
        // SAFETY: an anonymous mapping request; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                flags | libc::MAP_HUGETLB,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            dontfork(p, len);
            return Ok((
                NonNull::new(p.cast()).expect("mmap returned non-null"),
                len,
                true,
            ));
        }
    }
    let len = bytes.next_multiple_of(4096) as usize;
    // SAFETY: as above, without huge pages.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::io(
            "mmap landing ring",
            "<anonymous>",
            std::io::Error::last_os_error(),
        ));
    }
    if huge {
        // SAFETY: advice on our own mapping; failure is harmless.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
    }
    dontfork(p, len);
    Ok((
        NonNull::new(p.cast()).expect("mmap returned non-null"),
        len,
        false,
    ))
}

/// Keeps the mapping out of forked children: a trainer that forks
/// data-loader workers after building a loader must not copy (or, locked,
/// pin twice) the ring or the tier, which the child cannot use anyway.
fn dontfork(p: *mut libc::c_void, len: usize) {
    // SAFETY: advice on a mapping of ours; if refused, a fork copies it,
    // which is only slower.
    if unsafe { libc::madvise(p, len, libc::MADV_DONTFORK) } != 0 {
        log::warn!(
            "MADV_DONTFORK refused on the landing ring ({}); forked children will copy it",
            std::io::Error::last_os_error()
        );
    }
}

impl Drop for LandingRing {
    fn drop(&mut self) {
        if self.device.take().is_some() {
            // GPU memory: freed by DeviceMemory; nothing was mapped here.
            return;
        }
        if self.shared.take().is_some() {
            // The RingMap owned the mapping and unmapped it as it dropped.
            return;
        }
        // Reverse order of setup: CUDA registration, lock, mapping.
        self.cuda.take();
        // SAFETY: ptr/len are our live mapping, unmapped exactly once here;
        // munmap also drops the lock, munlock first keeps the order explicit.
        unsafe {
            if self.info.locked {
                libc::munlock(self.ptr.as_ptr().cast(), self.len);
            }
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_and_writes() {
        let r = LandingRing::new(&LandingOptions {
            ring_bytes: 3 << 20,
            cuda: CudaMode::Off,
            ..Default::default()
        })
        .unwrap();
        assert!(r.len() >= 3 << 20);
        // SAFETY: in bounds, and nothing else touches this fresh ring.
        unsafe {
            r.as_mut_ptr().add(12345).write(7);
            assert_eq!(r.slice(12345, 1), &[7]);
        }
        assert!(r.info().locked);
    }

    /// Resident 4 KiB pages of the ring (mincore).
    fn resident_pages(r: &LandingRing) -> usize {
        let mut vec = vec![0u8; r.len().div_ceil(4096)];
        // SAFETY: the ring's own mapping, whole; mincore writes one byte
        // per page into `vec`, which has one per page.
        let rc = unsafe { libc::mincore(r.as_mut_ptr().cast(), r.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    /// No page is faulted in when the ring is made (that was the whole
    /// time to a first batch); `populate_to` faults in what the pollers
    /// are about to read into, in 2 MiB steps, once.
    #[test]
    fn pages_are_faulted_in_ahead_of_reads_not_at_construction() {
        use std::sync::atomic::Ordering;
        let ring_bytes = 16 << 20;
        let opts = |mlock| LandingOptions {
            ring_bytes,
            huge_pages: false,
            mlock,
            cuda: CudaMode::Off,
            ..Default::default()
        };
        // Locked where the limit (or CAP_IPC_LOCK, as root in CI) allows:
        // locking must fault nothing in either.
        let r = LandingRing::new(&opts(true))
            .or_else(|_| LandingRing::new(&opts(false)))
            .unwrap();
        assert_eq!(resident_pages(&r), 0);
        r.populate_to(3 << 20);
        if r.populated.load(Ordering::Relaxed) == u64::MAX {
            // A kernel without MADV_POPULATE_WRITE (before 5.14): the
            // reads fault the pages instead. In CI a skip is a failure.
            assert!(
                std::env::var("KSPEED_REQUIRE").map_or(true, |v| v != "all"),
                "MADV_POPULATE_WRITE refused and KSPEED_REQUIRE=all"
            );
            eprintln!("skipped: MADV_POPULATE_WRITE refused");
            return;
        }
        // Up to the next 2 MiB boundary (and, where the kernel gives
        // transparent huge pages to every mapping, up to one more).
        let n = resident_pages(&r);
        assert!((1024..=1536).contains(&n), "{n} pages resident");
        r.populate_to(1 << 20);
        assert_eq!(resident_pages(&r), n);
        r.populate_to(ring_bytes);
        assert_eq!(resident_pages(&r), 4096);
        assert_eq!(r.populated.load(Ordering::Relaxed), u64::MAX);
    }

    #[test]
    fn numa_node_from_fake_sysfs() {
        let d = tempfile::tempdir().unwrap();
        let dev = d.path().join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        assert_eq!(pci_numa_node(d.path(), "0000:3b:00.0").unwrap(), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(pci_numa_node(d.path(), "0000:3b:00.0").unwrap(), None);
        assert!(pci_numa_node(d.path(), "0000:00:00.0").is_err());
    }

    /// The CRC read through the kernel matches the plain one over several
    /// chunks and a ragged end, and a page that faults gives `None`
    /// instead of a signal.
    #[test]
    fn crc32c_through_the_kernel_matches_and_survives_a_fault() {
        let bytes: Vec<u8> = (0..3 * FAULTABLE_CRC_CHUNK + 1234)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for len in [0, 1, FAULTABLE_CRC_CHUNK, bytes.len()] {
            // SAFETY: a live slice of this process.
            let got = unsafe { crc32c_faultable(bytes.as_ptr(), len) };
            assert_eq!(got, Some(crc32c::crc32c(&bytes[..len])), "{len} bytes");
        }
        // Two pages, the second inaccessible: reading across it faults.
        // SAFETY: a fresh anonymous mapping of our own.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        // SAFETY: the mapping's second page; the first stays readable.
        let rc =
            unsafe { libc::mprotect(map.cast::<u8>().add(4096).cast(), 4096, libc::PROT_NONE) };
        assert_eq!(rc, 0);
        let at = map.cast::<u8>().cast_const();
        // SAFETY: our mapping; the fault is the case under test.
        unsafe {
            assert_eq!(crc32c_faultable(at, 4096), Some(crc32c::crc32c(&[0; 4096])));
            assert_eq!(crc32c_faultable(at, 8192), None);
            libc::munmap(map, 8192);
        }
    }

    #[test]
    fn cuda_not_present_is_reported_not_fatal() {
        let r = LandingRing::new(&LandingOptions {
            ring_bytes: 1 << 20,
            ..Default::default()
        })
        .unwrap();
        // On machines with a GPU this says "registered"; here it explains why not.
        assert!(!r.info().cuda.is_empty());
        if cuda::probe().is_err() {
            assert!(
                r.info().cuda.starts_with("CUDA not used"),
                "{}",
                r.info().cuda
            );
            let e = LandingRing::new(&LandingOptions {
                ring_bytes: 1 << 20,
                cuda: CudaMode::Require,
                ..Default::default()
            });
            assert!(matches!(e, Err(Error::Cuda(_))));
        }
    }
}
