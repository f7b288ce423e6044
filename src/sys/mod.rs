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
        Ok(EventFd {
            fd: unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) },
        })
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

/// A heap buffer aligned for `O_DIRECT` (address, and the caller keeps
/// lengths and offsets to multiples of the same alignment).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like a Box<[u8]>), so
// moving it to another thread or sharing `&AlignedBuf` is as safe as for Vec.
unsafe impl Send for AlignedBuf {}
// SAFETY: see Send; shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    pub fn new(len: usize, align: usize) -> Self {
        let layout = Layout::from_size_align(len.max(align), align)
            .expect("alignment is a power of two and the size fits isize");
        // SAFETY: the layout has a non-zero size (at least `align` bytes).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }

    /// The length in bytes (never zero: at least the alignment).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() initialised (zeroed) bytes and
        // the borrow of self keeps it alive and unaliased by &mut.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was returned by alloc_zeroed with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
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
