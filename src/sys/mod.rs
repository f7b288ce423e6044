//! Thin wrappers over the operating system calls that std does not offer.
//! This is one of the few modules allowed `unsafe`: it owns raw memory
//! (aligned buffers, read-only maps) and calls libc directly.

use std::alloc::{self, Layout};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;

/// Opens a file read-only with `O_DIRECT` so reads bypass the page cache; on
/// file systems that refuse `O_DIRECT` (tmpfs, some overlays) it falls back to
/// a buffered open and says so through the returned flag.
pub fn open_direct(path: &Path) -> io::Result<(File, bool)> {
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            Ok((std::fs::OpenOptions::new().read(true).open(path)?, false))
        }
        Err(e) => Err(e),
    }
}

/// Bytes available to an unprivileged writer on the file system holding `path`.
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path that outlives the call and `st`
    // points to writable memory of the right size for statvfs to fill.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised the whole struct.
    let st = unsafe { st.assume_init() };
    // The field types differ between libc targets (u32 on some 32-bit ones).
    #[allow(clippy::unnecessary_cast)]
    let bytes = st.f_bavail as u64 * st.f_frsize as u64;
    Ok(bytes)
}

/// Frees the blocks of `len` bytes at `offset` in `file` without changing
/// its length (`fallocate(PUNCH_HOLE | KEEP_SIZE)`): the range reads as
/// zeros afterwards. Rebalance uses it to give back the samples a node no
/// longer holds while every other sample keeps its offset. A file system
/// that cannot punch holes answers `EOPNOTSUPP`.
pub fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let (off, n) = match (libc::off_t::try_from(offset), libc::off_t::try_from(len)) {
        (Ok(o), Ok(n)) => (o, n),
        _ => return Err(io::Error::from(io::ErrorKind::InvalidInput)),
    };
    // SAFETY: fallocate only reads its integer arguments and acts on the
    // descriptor `file` owns for the duration of the call.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            n,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reserves `len` bytes of blocks for `file` from its start
/// (`posix_fallocate`), so that running out of disk shows now, named,
/// instead of as a failed write later. A file system that cannot
/// preallocate answers `EOPNOTSUPP` (the caller may go on sparse).
pub fn allocate(file: &File, len: u64) -> io::Result<()> {
    let Ok(n) = libc::off_t::try_from(len) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    // SAFETY: posix_fallocate only reads its integer arguments and acts on
    // the descriptor `file` owns for the duration of the call.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, n) };
    if rc != 0 {
        // posix_fallocate returns the error instead of setting errno.
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Opens (creating it, mode 0600) a file for reading and writing with
/// `O_DIRECT`; where the file system refuses `O_DIRECT`, buffered, which
/// the returned flag says (as [`open_direct`]).
pub fn open_direct_rw(path: &Path) -> io::Result<(File, bool)> {
    let open = |flags| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(flags)
            .open(path)
    };
    match open(libc::O_DIRECT) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((open(0)?, false)),
        Err(e) => Err(e),
    }
}

/// An anonymous file in memory (`memfd_create`, close-on-exec) of `len`
/// bytes, unsealed: the cache area kept in memory (`cache_dir=":memory:"`)
/// reads and writes its slots through it as through a file, and its pages
/// go back to the system when the last descriptor closes.
pub fn memfd(name: &std::ffi::CStr, len: u64) -> io::Result<File> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: memfd_create reads the NUL-terminated name and returns a new
    // descriptor or -1; it touches no other memory of ours.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len)?;
    Ok(file)
}

/// Tells the kernel we will not read `len` bytes at `offset` again soon, so
/// a preload does not push the trainer's own page cache out. Advisory only.
pub fn drop_cache(file: &File, offset: u64, len: u64) {
    // SAFETY: posix_fadvise only reads its integer arguments; an invalid fd or
    // range yields an error code, which is ignored because the call is advice.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

/// Sleeps while `word` holds `expected`, for at most `timeout` (a futex
/// wait; returns at once if the value already differs).
pub fn futex_wait(
    word: &std::sync::atomic::AtomicU32,
    expected: u32,
    timeout: std::time::Duration,
) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the futex word is a live, aligned u32 owned by the caller for
    // the duration of the call; the timespec outlives it; FUTEX_WAIT only
    // reads both. Spurious returns and EAGAIN are fine: callers re-check.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes one thread sleeping in [`futex_wait`] on `word`.
pub fn futex_wake(word: &std::sync::atomic::AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; the word is live.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            1,
        );
    }
}

/// CPU seconds (user + system) used by this process so far, all threads.
pub fn process_cpu_seconds() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage fills the struct we pass; RUSAGE_SELF covers every thread.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if rc != 0 {
        return 0.0;
    }
    // SAFETY: getrusage returned 0, so it initialised the struct.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// An eventfd: a counter one thread bumps to wake another that waits on it
/// (here: through a read queued in its io_uring).
pub struct EventFd {
    fd: std::os::fd::OwnedFd,
}

impl EventFd {
    /// Creates a non-blocking eventfd.
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a negative result is an error.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        let fd = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    /// The descriptor.
    pub fn raw(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.fd)
    }

    /// Wakes the waiter.
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our descriptor. A full
        // counter (EAGAIN) means a wake-up is already pending: fine.
        unsafe { libc::write(self.raw(), (&one as *const u64).cast(), 8) };
    }

    /// Resets the counter (the descriptor is non-blocking: nothing to read
    /// is no wait).
    pub fn drain(&self) {
        let mut n: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64 from our descriptor.
        unsafe { libc::read(self.raw(), (&mut n as *mut u64).cast(), 8) };
    }
}

/// Waits until one of `fds` is ready or `timeout_ms` passes (`poll(2)`);
/// the number of ready descriptors (their `revents` are set). EINTR counts as
/// a time-out.
pub fn poll_fds(fds: &mut [libc::pollfd], timeout_ms: i32) -> std::io::Result<usize> {
    // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()`
    // pollfd structs for the duration of the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(n as usize)
}

/// Sends `bytes` on socket `fd` without ever blocking (`MSG_DONTWAIT`) and
/// without SIGPIPE: the number of bytes the kernel took (possibly fewer, or
/// an error such as `WouldBlock` when the peer does not read).
pub fn send_nonblocking(fd: std::os::fd::RawFd, bytes: &[u8]) -> std::io::Result<usize> {
    // SAFETY: reads `bytes.len()` bytes from a live slice; fd is the
    // caller's open socket (a closed or wrong one is an error return).
    let n = unsafe {
        libc::send(
            fd,
            bytes.as_ptr().cast(),
            bytes.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Shuts both directions of socket `fd` (`shutdown(SHUT_RDWR)`), ignoring
/// errors: the descriptor stays open (its owner closes it), but receives
/// and sends on it end and the peer reads EOF.
pub fn shutdown_socket(fd: std::os::fd::RawFd) {
    // SAFETY: shutdown takes a descriptor number and touches no memory; a
    // closed or wrong one is an error return, which is ignored.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// Sets TCP_USER_TIMEOUT on socket `fd`: data the peer has not
/// acknowledged for `timeout` (a peer whose host died, or that keeps a
/// zero window) fails the connection with ETIMEDOUT, instead of after
/// the kernel's ~15 minutes of retransmissions.
pub fn set_tcp_user_timeout(
    fd: std::os::fd::RawFd,
    timeout: std::time::Duration,
) -> std::io::Result<()> {
    let ms: libc::c_uint = timeout.as_millis().clamp(1, libc::c_uint::MAX as u128) as _;
    // SAFETY: passes a live c_uint by pointer with its size; fd is the
    // caller's open socket (a closed or wrong one is an error return).
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            (&ms as *const libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// SIGINT and SIGTERM blocked in this thread (and every thread it starts
/// afterwards), to be taken synchronously with [`TermSignals::wait`].
pub struct TermSignals {
    set: libc::sigset_t,
}

impl TermSignals {
    /// Blocks SIGINT and SIGTERM; call before starting other threads.
    pub fn block() -> Self {
        // SAFETY: sigset_t is plain data that sigemptyset initialises; the
        // calls only read and write the set we own and this thread's mask.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            TermSignals { set }
        }
    }

    /// [`TermSignals::block`], and SIGUSR1 too (taken by
    /// [`TermSignals::wait`] like the others: `kspeed serve` logs its
    /// statistics on it).
    pub fn block_with_usr1() -> Self {
        let t = Self::block();
        // SAFETY: as in `block`: our own set, this thread's mask.
        unsafe {
            let mut set = t.set;
            libc::sigaddset(&mut set, libc::SIGUSR1);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            TermSignals { set }
        }
    }

    /// Waits for one of the signals; returns its number.
    pub fn wait(&self) -> i32 {
        let mut sig = 0;
        // SAFETY: sigwait reads our initialised set and writes one int.
        unsafe { libc::sigwait(&self.set, &mut sig) };
        sig
    }
}

/// Lets a write to a closed stdout end the process quietly (the default
/// SIGPIPE action), as `kspeed inspect | head` expects, instead of Rust's
/// ignored SIGPIPE turning it into a panic. Sockets are unaffected: they
/// send with MSG_NOSIGNAL.
pub fn default_sigpipe() {
    // SAFETY: resetting one signal's disposition to the default, before
    // any other thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// A buffer aligned for `O_DIRECT` (address, and the caller keeps lengths
/// and offsets to multiples of the same alignment): its own anonymous
/// mapping, zero-filled, marked `MADV_DONTFORK` so a process that forks
/// (a trainer's data-loader workers) does not copy it into the child, where
/// nothing may use it anyway.
pub struct AlignedBuf {
    /// The aligned start.
    ptr: NonNull<u8>,
    /// Usable bytes from `ptr`.
    len: usize,
    /// The whole mapping (for munmap): it starts at or before `ptr`.
    map: NonNull<u8>,
    map_len: usize,
}

// SAFETY: AlignedBuf owns its mapping exclusively (like a Box<[u8]>), so
// moving it to another thread or sharing `&AlignedBuf` is as safe as for Vec.
unsafe impl Send for AlignedBuf {}
// SAFETY: see Send; shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

/// The page size the mappings here are aligned to.
const PAGE_BYTES: usize = 4096;

impl AlignedBuf {
    /// Maps `len` zeroed bytes aligned to `align` (a power of two).
    ///
    /// # Panics
    /// When `align` is not a power of two or the memory cannot be mapped
    /// (like an allocation failure).
    pub fn new(len: usize, align: usize) -> Self {
        assert!(
            align.is_power_of_two(),
            "alignment {align} is not a power of two"
        );
        let len = len.max(align);
        // A mapping is page-aligned; a larger alignment needs the slack.
        let slack = align.saturating_sub(PAGE_BYTES);
        let map_len = (len + slack).next_multiple_of(PAGE_BYTES);
        // SAFETY: an anonymous private mapping; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let layout = Layout::from_size_align(map_len, PAGE_BYTES).expect("a valid layout");
            alloc::handle_alloc_error(layout);
        }
        // SAFETY: advice on our own mapping; if the kernel refuses, a fork
        // copies the buffer, which is only slower. (Miri has no madvise;
        // the advice changes nothing it checks.)
        #[cfg(not(miri))]
        unsafe {
            libc::madvise(p, map_len, libc::MADV_DONTFORK)
        };
        let map = NonNull::new(p.cast::<u8>()).expect("mmap returned non-null");
        let skip = (align - (p as usize) % align) % align;
        // SAFETY: skip <= slack, so ptr..ptr+len lies inside the mapping.
        let ptr = unsafe { NonNull::new_unchecked(map.as_ptr().add(skip)) };
        AlignedBuf {
            ptr,
            len,
            map,
            map_len,
        }
    }

    /// The length in bytes (never zero: at least the alignment).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// The start, for writes through a raw pointer (io_uring reads, a
    /// frame built in place): derived from the owning pointer, not from a
    /// shared slice, so writing through it is sound while no slice of the
    /// buffer is alive.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zero-filled) bytes and
        // the borrow of self keeps it alive and unaliased by &mut.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by new() with exactly this length and
        // nothing refers to it once self is dropped.
        unsafe { libc::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
}

/// A read-only memory map of a whole file.
pub struct ReadOnlyMap {
    map: Option<memmap2::Mmap>,
}

impl ReadOnlyMap {
    /// Maps `file` read-only. An empty file maps to an empty slice.
    ///
    /// kspeed's own files (catalog, manifest) are written once to a temporary
    /// name and renamed into place, never modified in place, which is what
    /// makes mapping them sound in practice; a third party truncating the
    /// file under us could still raise SIGBUS, as with any mapped file.
    pub fn new(file: &File) -> io::Result<Self> {
        if file.metadata()?.len() == 0 {
            return Ok(ReadOnlyMap { map: None });
        }
        // SAFETY: the map is read-only and kspeed never writes these files in
        // place (see above); the Mmap owns the mapping and unmaps on drop.
        let map = unsafe { memmap2::MmapOptions::new().map(file)? };
        Ok(ReadOnlyMap { map: Some(map) })
    }

    /// The mapped bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// The soft limit on open files (`RLIMIT_NOFILE`; 0 if it cannot be read).
pub fn open_files_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 0;
    }
    // rlim_t is u64 on Linux targets but not on every libc target.
    #[allow(clippy::unnecessary_cast)]
    let cur = lim.rlim_cur as u64;
    cur
}

/// Raises the soft limit on open files to the hard limit, as servers do: a
/// space keeps one descriptor per extent open while it is served or read, and
/// the usual soft limit (1024) is far below what large spaces need. Returns
/// the soft limit in force afterwards (0 if it cannot be read). Idempotent.
pub fn raise_open_files_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 0;
    }
    if lim.rlim_cur < lim.rlim_max {
        let want = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `want` is a valid rlimit that outlives the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    // rlim_t is u64 on Linux targets but not on every libc target.
    #[allow(clippy::unnecessary_cast)]
    let cur = lim.rlim_cur as u64;
    cur
}

/// Copies `len` bytes from `src` to `dst` through the kernel
/// (`process_vm_readv` on this process), so that a page that cannot be
/// faulted in (a hugetlb page a peer punched out of a memfd both map, with
/// no huge page left to replace it) fails the copy with `EFAULT` instead
/// of killing the process with SIGBUS. Returns whether every byte was
/// copied. For memory another process can change under us (an attached
/// rank's ring); one system call per copy. Where the call is not allowed
/// (`EPERM` or `ENOSYS`: a seccomp profile without `process_vm_readv`)
/// the bytes are copied in place instead, said once at WARN: that
/// process is then open to the SIGBUS this function guards against.
///
/// # Safety
/// `dst..dst+len` must be writable memory of this process that nothing
/// else reads or writes during the call; `src..src+len` must be mapped
/// (its pages may fail to fault: that is what this function is for).
pub unsafe fn copy_faultable(dst: *mut u8, src: *const u8, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let local = libc::iovec {
        iov_base: dst.cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: src as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: both iovecs describe memory of this process per the
    // contract; the kernel copies through its own page walk and reports a
    // fault as an error. The iovecs live for the call.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if n == len as isize {
        return true;
    }
    let errno = io::Error::last_os_error().raw_os_error();
    if n < 0 && matches!(errno, Some(libc::EPERM) | Some(libc::ENOSYS)) {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            log::warn!(
                "process_vm_readv is not allowed here ({}): copies out of memory another \
                 process maps (an attached rank's ring) are made in place, and a page it \
                 takes away can kill this process with SIGBUS",
                io::Error::from_raw_os_error(errno.unwrap_or(0))
            )
        });
        // SAFETY: per the contract; the one risk is the fault above.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return true;
    }
    false
}

/// [`copy_faultable`] between two slices: `dst` gets `src`'s bytes, or
/// false when a page of either faulted (`dst` is then partly written).
/// Lengths must match.
#[cfg(feature = "s3")]
pub fn copy_slice_faultable(dst: &mut [u8], src: &[u8]) -> bool {
    assert_eq!(dst.len(), src.len(), "copy_slice_faultable lengths");
    // SAFETY: two live slices of this process, `dst` exclusively ours.
    unsafe { copy_faultable(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// Binds the `len` bytes at `ptr` to NUMA node `node` (`mbind`,
/// `MPOL_BIND`; private pages already faulted in move): pages faulted from
/// now on come from that node. On a shared memory memfd the policy is the
/// file's (every process that maps it faults from that node); on a
/// hugetlb memfd only this mapping's, so the process that binds must be
/// the one that faults the pages in (the attached rank, which populates
/// its ring).
///
/// # Safety
/// `ptr..ptr + len` is a mapping of this process (page-aligned `ptr`).
pub unsafe fn bind_numa(ptr: *mut u8, len: usize, node: u32) -> io::Result<()> {
    const MPOL_BIND: libc::c_long = 2;
    const MPOL_MF_MOVE: libc::c_ulong = 2;
    const MAX_NODES: u32 = 1024;
    if node >= MAX_NODES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NUMA node {node} is out of range (at most {MAX_NODES} nodes)"),
        ));
    }
    let mut mask = [0u64; MAX_NODES as usize / 64];
    mask[(node / 64) as usize] |= 1 << (node % 64);
    // SAFETY: mbind reads `mask` (1024 bits, maxnode 1025) and applies a
    // policy to the caller's mapping per the contract; no memory is written.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr,
            len,
            MPOL_BIND,
            mask.as_ptr(),
            libc::c_ulong::from(MAX_NODES + 1),
            MPOL_MF_MOVE,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Pages per window [`sample_resident_pages`] checks with one `mincore`.
pub const RESIDENT_WINDOW_PAGES: u64 = 16;

/// How much of `file` (its first `len_bytes`) is in the page cache,
/// sampled: `windows` evenly spaced runs of up to 16 pages each are
/// checked with `mincore`, so the cost is bounded whatever the file's
/// size (about a microsecond per window). The check stops early once
/// more than `max_missing` of the pages checked are not cached (a caller
/// that wants a share cached knows its answer by then). Returns
/// (resident pages, pages checked); (0, 0) for an empty file.
pub fn sample_resident_pages(
    file: &File,
    len_bytes: u64,
    windows: u64,
    max_missing: u64,
) -> io::Result<(u64, u64)> {
    // SAFETY: sysconf has no preconditions.
    let page_bytes = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let pages = len_bytes.div_ceil(page_bytes);
    if pages == 0 || windows == 0 {
        return Ok((0, 0));
    }
    let map_len = usize::try_from(pages * page_bytes)
        .map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    // SAFETY: a fresh read-only shared mapping of the file that nothing
    // else refers to; its bytes are never read (mincore only asks the
    // kernel which of its pages are cached), so a concurrent truncation
    // cannot fault here. Unmapped below on every path.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let runs = windows.min(pages.div_ceil(RESIDENT_WINDOW_PAGES));
    let stride_pages = pages / runs;
    let mut vec = [0u8; RESIDENT_WINDOW_PAGES as usize];
    let (mut resident, mut checked) = (0u64, 0u64);
    let mut result = Ok(());
    for w in 0..runs {
        let first = w * stride_pages;
        let n = RESIDENT_WINDOW_PAGES.min(pages - first);
        // SAFETY: [first, first + n) pages lie inside the mapping made
        // above, and `vec` has room for one byte per page of the run.
        let rc = unsafe {
            libc::mincore(
                map.cast::<u8>().add((first * page_bytes) as usize).cast(),
                (n * page_bytes) as usize,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            result = Err(io::Error::last_os_error());
            break;
        }
        resident += vec[..n as usize].iter().filter(|b| **b & 1 != 0).count() as u64;
        checked += n;
        if checked - resident > max_missing {
            break;
        }
    }
    // SAFETY: the mapping made above, exactly this long, unused from here.
    unsafe { libc::munmap(map, map_len) };
    result.map(|()| (resident, checked))
}

#[cfg(test)]
mod tests {
    use super::AlignedBuf;

    /// A file just written is in the page cache; after dropping its pages
    /// (POSIX_FADV_DONTNEED, once flushed) it is not, and the sample says so.
    #[test]
    fn resident_pages_follow_the_page_cache() {
        use std::io::Write;
        // Beside the sources, on a disk: /tmp may be tmpfs, whose pages
        // are always resident.
        let mut f = tempfile::tempfile_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        f.write_all(&vec![7u8; 8 << 20]).unwrap();
        let (resident, checked) = super::sample_resident_pages(&f, 8 << 20, 64, u64::MAX).unwrap();
        assert!(checked >= 64, "{checked} pages checked");
        assert_eq!(resident, checked, "a file just written");
        f.sync_all().unwrap();
        super::drop_cache(&f, 0, 8 << 20);
        let (after, _) = super::sample_resident_pages(&f, 8 << 20, 64, u64::MAX).unwrap();
        assert!(
            after < checked / 2,
            "{after} of {checked} pages still resident after DONTNEED"
        );
        // Told that 16 missing pages settle it, the check stops within
        // the window that passes them, not after all 64.
        let (_, stopped_at) = super::sample_resident_pages(&f, 8 << 20, 64, 16).unwrap();
        assert!(
            stopped_at < checked / 2,
            "{stopped_at} of {checked} pages checked with max_missing 16"
        );
        assert_eq!(super::sample_resident_pages(&f, 0, 64, 0).unwrap(), (0, 0));
    }

    /// Runs under Miri too (scripts/test.sh): the alignment slack, writes
    /// through `as_mut_ptr` and reads through slices stay inside the
    /// mapping and follow the pointer's provenance.
    #[test]
    fn aligned_buf_is_aligned_zeroed_and_writable_through_its_pointer() {
        for (len, align) in [(1, 512), (4096, 4096), (10_000, 8192), (3, 1 << 16)] {
            let mut b = AlignedBuf::new(len, align);
            assert_eq!(b.as_mut_ptr() as usize % align, 0);
            assert!(b.len() >= len.max(align));
            assert!(b.as_slice().iter().all(|&x| x == 0));
            let n = b.len();
            // SAFETY: n bytes from the start are ours; no slice is alive.
            unsafe { std::ptr::write_bytes(b.as_mut_ptr(), 0xa5, n) };
            assert!(b.as_slice().iter().all(|&x| x == 0xa5));
            b.as_mut_slice()[n - 1] = 1;
            assert_eq!(b.as_slice()[n - 1], 1);
        }
    }
}
