//! Shared-memory primitives of the attach layer: sealed memfds (the only
//! kind a peer's descriptor is mapped from), the ring's mapping, the
//! futex on a word in a shared mapping, and the monotonic clock both
//! processes read for heartbeats.
//!
//! This module owns raw shared memory and calls the kernel directly, so
//! it is allowed `unsafe`.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use memmap2::MmapRaw;

use crate::error::{Error, Result};

fn seg_err(what: String) -> Error {
    Error::AttachSegment { what }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock both processes read for
/// heartbeats (one clock per boot; processes in different time
/// namespaces would disagree, docs/AGENT.md).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own; the clock id
    // is a constant the kernel always supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

// ---- the layout (docs/AGENT.md has the byte tables) ----------------------

pub(super) fn io_err(op: &'static str, what: &str, e: std::io::Error) -> Error {
    Error::io(op, format!("<{what}>"), e)
}

/// Creates a sealed memfd of `bytes` (rounded up to a page): it can grow
/// no more and never shrink, so a peer mapping it can trust its size.
pub(super) fn sealed_memfd(name: &std::ffi::CStr, bytes: u64) -> Result<File> {
    sealed_memfd_with(name, bytes, 0, 4096, true)
}

/// [`sealed_memfd`] with extra `memfd_create` flags (`MFD_HUGETLB`...) and
/// the page size the length is rounded up to; `last` adds `F_SEAL_SEAL`
/// (no seal after these), else the caller adds more first.
pub(super) fn sealed_memfd_with(
    name: &std::ffi::CStr,
    bytes: u64,
    flags: libc::c_uint,
    page_bytes: u64,
    last: bool,
) -> Result<File> {
    // SAFETY: memfd_create reads the NUL-terminated name and returns a new
    // descriptor or -1; it touches no memory of ours otherwise.
    let fd = unsafe {
        libc::memfd_create(
            name.as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | flags,
        )
    };
    if fd < 0 {
        return Err(io_err(
            "memfd_create",
            "attach",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fd is a fresh descriptor nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let len = bytes.div_ceil(page_bytes) * page_bytes;
    file.set_len(len)
        .map_err(|e| io_err("ftruncate", "attach memfd", e))?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | if last { libc::F_SEAL_SEAL } else { 0 };
    // SAFETY: fcntl on a descriptor we own with an integer argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io_err(
            "F_ADD_SEALS",
            "attach memfd",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(file)
}

/// Checks that `file` is a memfd sealed against shrinking and at least
/// `need` bytes long: what makes mapping a peer's memory safe.
pub(super) fn check_sealed(file: &File, need: u64, what: &str) -> Result<()> {
    // SAFETY: fcntl F_GET_SEALS on a descriptor we own; no pointer.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(seg_err(format!(
            "the {what} is not a memfd sealed against shrinking (seals {seals:#x}); a peer could truncate it under the mapping"
        )));
    }
    let len = file.metadata().map_err(|e| io_err("fstat", what, e))?.len();
    if len < need {
        return Err(seg_err(format!("the {what} is {len} bytes, needs {need}")));
    }
    Ok(())
}

/// What pages back a shared ring. Direct reads into 4 KiB pages cost the
/// kernel a page per 4 KiB of every read (pinning, the I/O's segment
/// list): on this project's test machine one rank read 0.65x as many
/// 133 KB samples per second into normal pages as into huge ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingPages {
    /// Explicit 2 MiB pages (`MFD_HUGETLB`: the node has `vm.nr_hugepages`
    /// reserved, or the pod requests `hugepages-2Mi`), reserved for the
    /// whole ring when it is mapped.
    Hugetlb,
    /// Shared memory with transparent huge pages advised, where
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` lets the kernel
    /// honour the advice (`advise`, `within_size`, `always`); whether every
    /// page got one is the kernel's to decide.
    ShmemThp,
    /// 4 KiB pages: no huge pages reserved and shared-memory THP off
    /// (`never`, the usual default).
    Normal,
}

impl RingPages {
    /// How the pages are described in logs.
    pub fn describe(self) -> &'static str {
        match self {
            RingPages::Hugetlb => "2 MiB huge pages (hugetlb)",
            RingPages::ShmemThp => "shared memory with transparent huge pages advised",
            RingPages::Normal => "normal 4 KiB pages",
        }
    }
}

const HUGE_PAGE_BYTES: u64 = 2 << 20;

/// Whether the kernel gives shared memory transparent huge pages when a
/// mapping asks (`MADV_HUGEPAGE`): the selected word of `shmem_enabled`.
fn shmem_thp_on() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .ok()
        .and_then(|t| {
            let open = t.find('[')?;
            let close = t[open..].find(']')? + open;
            Some(matches!(
                &t[open + 1..close],
                "always" | "within_size" | "advise" | "force"
            ))
        })
        .unwrap_or(false)
}

/// Faults every page of a mapping in, writable, now (`MADV_POPULATE_WRITE`,
/// Linux 5.14): in the rank, so that the ring's memory (hugetlb pages
/// included) is charged to the rank's memory cgroup rather than to the
/// agent's, which would otherwise touch it first, and so that a page the
/// rank cannot have fails here, with a fallback, not in the agent. False
/// when the kernel refused (an older kernel, no page to be had).
fn populate(map: &MmapRaw) -> bool {
    // SAFETY: madvise on a mapping we own, for its whole length; populating
    // changes no contents (the pages are zero until written).
    unsafe {
        libc::madvise(
            map.as_mut_ptr().cast(),
            map.len(),
            libc::MADV_POPULATE_WRITE,
        ) == 0
    }
}

/// Binds a mapping's pages to `node` before they are faulted in (nothing
/// for None).
fn bind(map: &MmapRaw, node: Option<u32>) -> Result<()> {
    let Some(node) = node else { return Ok(()) };
    // SAFETY: our own mapping, for its whole length.
    unsafe { crate::sys::bind_numa(map.as_mut_ptr(), map.len(), node) }.map_err(|e| Error::Numa {
        node,
        reason: e.to_string(),
    })
}

/// Asks for transparent huge pages on a shared mapping (ignored where the
/// kernel does not give them; see [`RingPages::ShmemThp`]).
fn advise_huge(map: &MmapRaw) {
    // SAFETY: madvise on a mapping we own, for its whole length; the advice
    // changes no contents.
    unsafe {
        libc::madvise(map.as_mut_ptr().cast(), map.len(), libc::MADV_HUGEPAGE);
    }
}

/// The landing ring as a shared mapping (a sealed memfd).
pub struct RingMap {
    map: MmapRaw,
    file: File,
    pages: RingPages,
    /// The NUMA node this process bound the pages to before faulting them
    /// in ([`RingMap::create_on`]).
    numa_node: Option<u32>,
}

// SAFETY: the mapping is plain shared memory reached through raw-pointer
// copies (`write_at`/`read_at`) or `unsafe` slices whose callers follow
// the ready/release protocol.
unsafe impl Send for RingMap {}
// SAFETY: as above.
unsafe impl Sync for RingMap {}

impl std::fmt::Debug for RingMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMap")
            .field("bytes", &self.len())
            .finish()
    }
}

impl RingMap {
    /// Creates a ring of `bytes` (rounded up to a page) as a sealed memfd:
    /// in 2 MiB hugetlb pages when `bytes` is a multiple of 2 MiB and the
    /// node has them free (mapping it reserves them all, so a later touch
    /// never faults for want of one), else in shared memory with huge pages
    /// advised ([`RingPages`]). Its pages are faulted in here, by the rank
    /// ([`populate`]).
    pub fn create(bytes: u64) -> Result<RingMap> {
        Self::create_on(bytes, None)
    }

    /// As [`RingMap::create`], the pages bound to NUMA node `numa_node`
    /// (`mbind` before they are faulted in, so they come from that node:
    /// the rank's GPU's, as an embedded ring's are). A node that cannot be
    /// bound is [`Error::Numa`].
    pub fn create_on(bytes: u64, numa_node: Option<u32>) -> Result<RingMap> {
        if bytes.is_multiple_of(HUGE_PAGE_BYTES) {
            match Self::create_hugetlb(bytes, numa_node) {
                Err(e @ Error::Numa { .. }) => return Err(e),
                Ok(r) => return Ok(r),
                Err(e) => {
                    // No huge pages reserved is the usual case: said only
                    // where the node has some (then it is worth knowing).
                    let reserved = std::fs::read_to_string("/proc/sys/vm/nr_hugepages")
                        .ok()
                        .and_then(|t| t.trim().parse::<u64>().ok())
                        .unwrap_or(0);
                    if reserved > 0 {
                        // Bound to a NUMA node, only that node's pool counts.
                        let on_node = numa_node.map_or(String::new(), |n| {
                            let free = std::fs::read_to_string(format!(
                                "/sys/devices/system/node/node{n}/hugepages/hugepages-2048kB/free_hugepages"
                            ));
                            match free.ok().and_then(|t| t.trim().parse::<u64>().ok()) {
                                Some(f) => format!(", {f} free on NUMA node {n}, where the ring is bound"),
                                None => format!(", the ring bound to NUMA node {n}"),
                            }
                        });
                        log::info!(
                            "attach ring: {bytes} bytes of 2 MiB pages not to be had ({e}; {reserved} reserved on the machine, some in use{on_node}); shared memory instead"
                        );
                    }
                }
            }
        }
        let file = sealed_memfd(c"kspeed-attach-ring", bytes)?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "attach ring", e))?;
        advise_huge(&map);
        bind(&map, numa_node)?;
        // Shared memory is charged to the memory cgroup of whoever touches
        // it first (and, unlike hugetlb, a failure here leaves nothing to
        // fall back to: the agent's touch would fail the same way).
        populate(&map);
        let pages = if shmem_thp_on() {
            RingPages::ShmemThp
        } else {
            RingPages::Normal
        };
        Ok(RingMap {
            map,
            file,
            pages,
            numa_node,
        })
    }

    /// A ring in shared memory that nothing faults in here: the agent's
    /// own lane (`agent/cluster.rs`), whose ring never takes a sample, so
    /// it takes no huge page and no memory beyond its page tables.
    pub(crate) fn create_untouched(bytes: u64) -> Result<RingMap> {
        let file = sealed_memfd(c"kspeed-agent-lane", bytes)?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "agent lane ring", e))?;
        Ok(RingMap {
            map,
            file,
            pages: RingPages::Normal,
            numa_node: None,
        })
    }

    /// The agent's node tier as a sealed memfd, so that ranks asking for
    /// tier views can map it read-only ([`RingMap::read_only_fd`]): in
    /// 2 MiB hugetlb pages where the node has enough free (`bytes` rounded
    /// up to 2 MiB; a shared hugetlb mapping reserves them all at `mmap`,
    /// so no later touch faults for want of one), else in shared memory
    /// with huge pages advised. Nothing is faulted in here: a member's
    /// pages are when it is first filled, charged to the agent.
    pub(crate) fn create_node_tier(bytes: u64) -> Result<RingMap> {
        let huge = sealed_memfd_with(
            c"kspeed-node-tier",
            bytes,
            libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            HUGE_PAGE_BYTES,
            false,
        )
        .and_then(|file| {
            let map = MmapRaw::map_raw(&file)
                .map_err(|e| io_err("mmap", "node tier in hugetlb pages", e))?;
            Ok((file, map))
        });
        let (file, map, pages) = match huge {
            Ok((file, map)) => (file, map, RingPages::Hugetlb),
            Err(e) => {
                log::debug!("node tier: no 2 MiB pages ({e}); shared memory instead");
                let file = sealed_memfd_with(c"kspeed-node-tier", bytes, 0, 4096, false)?;
                let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "node tier", e))?;
                advise_huge(&map);
                let pages = if shmem_thp_on() {
                    RingPages::ShmemThp
                } else {
                    RingPages::Normal
                };
                (file, map, pages)
            }
        };
        // The agent's mapping is the only writable one there will ever be:
        // F_SEAL_FUTURE_WRITE (Linux 5.1) refuses any later writable shared
        // mapping or write(), whoever opens the memfd (a rank could open
        // its descriptor again O_RDWR through /proc). Older kernels: the
        // O_RDONLY descriptor alone keeps honest ranks out.
        let seal = |seals: libc::c_int| {
            // SAFETY: fcntl on a descriptor we own with an integer argument.
            unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) }
        };
        if seal(libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL) != 0 {
            let e = std::io::Error::last_os_error();
            log::info!(
                "node tier: this kernel refuses F_SEAL_FUTURE_WRITE ({e}); ranks get it through a read-only descriptor only"
            );
            if seal(libc::F_SEAL_SEAL) != 0 {
                return Err(io_err(
                    "F_ADD_SEALS",
                    "node tier memfd",
                    std::io::Error::last_os_error(),
                ));
            }
        }
        Ok(RingMap {
            map,
            file,
            pages,
            numa_node: None,
        })
    }

    /// A read-only descriptor of the same memfd (a new open file
    /// description, `O_RDONLY`, through `/proc/self/fd`): what the agent
    /// passes a rank for its tier views. A shared mapping of it cannot be
    /// made writable (`mmap` or `mprotect` with `PROT_WRITE` fail with
    /// EACCES), nor, with the future-write seal, one of the memfd opened
    /// again read-write (EPERM), so a rank can read the tier but never
    /// spoil it for the others.
    pub(crate) fn read_only_fd(&self) -> Result<OwnedFd> {
        let path = format!("/proc/self/fd/{}", self.file.as_raw_fd());
        let f = std::fs::OpenOptions::new()
            .read(true)
            .open(&path)
            .map_err(|e| io_err("open O_RDONLY", "node tier memfd", e))?;
        Ok(OwnedFd::from(f))
    }

    fn create_hugetlb(bytes: u64, numa_node: Option<u32>) -> Result<RingMap> {
        let file = sealed_memfd_with(
            c"kspeed-attach-ring",
            bytes,
            libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            HUGE_PAGE_BYTES,
            true,
        )?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "attach ring", e))?;
        bind(&map, numa_node)?;
        // The pages are charged to the cgroup that faults them: the rank's
        // (whose hugetlb limit may be 0: then this fails, and the ring is
        // shared memory instead).
        if !populate(&map) {
            return Err(io_err(
                "madvise(MADV_POPULATE_WRITE)",
                "attach ring in hugetlb pages",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(RingMap {
            map,
            file,
            pages: RingPages::Hugetlb,
            numa_node,
        })
    }

    /// Maps a ring a peer passed, checking it is a sealed memfd of at
    /// least `bytes`.
    pub fn open(fd: OwnedFd, bytes: u64) -> Result<RingMap> {
        let file = File::from(fd);
        check_sealed(&file, bytes, "attach ring")?;
        let map = MmapRaw::map_raw(&file).map_err(|e| io_err("mmap", "attach ring", e))?;
        // A hugetlb memfd lives on hugetlbfs (its st_blksize is the huge
        // page size); shared memory is advised as the rank's mapping is,
        // because the agent's registration may fault the pages in first.
        let huge = file
            .metadata()
            .map(|m| std::os::unix::fs::MetadataExt::blksize(&m) >= HUGE_PAGE_BYTES)
            .unwrap_or(false);
        let pages = if huge {
            RingPages::Hugetlb
        } else {
            advise_huge(&map);
            if shmem_thp_on() {
                RingPages::ShmemThp
            } else {
                RingPages::Normal
            }
        };
        // The rank faulted the pages in (charged to it); this fills the
        // agent's own page tables for them now, so its pollers' reads and
        // its network thread's receives take no fault per page on the
        // ring's first lap (measured: the agent's receives into a 4 KiB
        // shared-memory ring spent a tenth of their time faulting). A
        // failure (a page the rank punched out, no huge page left) is the
        // fault the read into it would meet anyway, named there.
        populate(&map);
        Ok(RingMap {
            map,
            file,
            pages,
            numa_node: None,
        })
    }

    /// What pages back the ring.
    pub fn pages(&self) -> RingPages {
        self.pages
    }

    /// The NUMA node its pages were bound to, where this process made it
    /// bound ([`RingMap::create_on`]); None otherwise.
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// The memfd, to pass to the agent.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The mapping's first byte (for the loader's landing ring, which
    /// reads into and hands out views of it under the ready/release
    /// protocol).
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The mapped bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether the ring is empty (never, once created).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn check(&self, offset: u64, len: usize) {
        assert!(
            offset
                .checked_add(len as u64)
                .is_some_and(|e| e <= self.len()),
            "ring access {offset}+{len} past {} bytes",
            self.len()
        );
    }

    /// Copies `data` into the ring at `offset` (the agent's side, into a
    /// slot the rank released).
    pub fn write_at(&self, offset: u64, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: in bounds (checked); the destination is shared memory no
        // Rust reference of this process covers while the slot is free; a
        // peer breaking the protocol can only see torn bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(offset as usize),
                data.len(),
            );
        }
    }

    /// A view of `len` bytes at `offset` (the rank's side, a batch taken
    /// and not yet released).
    ///
    /// # Safety
    /// The bytes must belong to a batch this side took and has not
    /// released, so the agent does not write them while the view lives.
    pub unsafe fn slice(&self, offset: u64, len: usize) -> &[u8] {
        self.check(offset, len);
        // SAFETY: in bounds (checked); the caller guarantees no writer for
        // the view's life; the mapping outlives `&self`.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset as usize), len) }
    }
}

/// FUTEX_WAIT on a word in shared memory (not _PRIVATE: the key must be
/// the page, not this process's address), for at most `timeout`; true
/// when it slept the whole timeout (no wake came).
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the word is a live, aligned u32 in a mapping `&word` keeps
    // alive; the timespec outlives the call; FUTEX_WAIT only reads both.
    // EAGAIN, EINTR and ETIMEDOUT are all fine: callers re-check.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
    rc != 0 && io_errno() == libc::ETIMEDOUT
}

fn io_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// FUTEX_WAKE of every sleeper on a shared word (one rank thread and one
/// agent thread at most per word, but waking all costs nothing more).
pub(super) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE uses the address only as a key; the word is live.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}
