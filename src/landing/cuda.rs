//! CUDA, loaded at run time: pins the landing ring as page-locked host memory
//! so a `cudaMemcpyAsync` from it is a direct DMA. Tries the runtime library
//! (`libcudart.so*`, `cudaHostRegister`) first, then the driver library
//! (`libcuda.so.1`, `cuMemHostRegister_v2` in the primary context of device
//! 0). CUDA is never a build dependency.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use libloading::Library;

const RUNTIME_LIBS: &[&str] = &["libcudart.so", "libcudart.so.12", "libcudart.so.11.0"];
const DRIVER_LIBS: &[&str] = &["libcuda.so.1", "libcuda.so"];
/// `cudaHostRegisterPortable` / `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context.
const PORTABLE: c_uint = 1;

type CudartRegister = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int;
type CudartUnregister = unsafe extern "C" fn(*mut c_void) -> c_int;
type CudartCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CudartErrStr = unsafe extern "C" fn(c_int) -> *const c_char;
type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type CuCtxRelease = unsafe extern "C" fn(c_int) -> c_int;
type CuCtxPush = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuCtxPop = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type CuRegister = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int;
type CuUnregister = unsafe extern "C" fn(*mut c_void) -> c_int;

fn open_first(names: &[&str]) -> Result<(Library, &'static str), String> {
    for &n in names {
        // SAFETY: loading a CUDA library runs its initialisers, which is what
        // every CUDA program does; the names are fixed system library names.
        if let Ok(lib) = unsafe { Library::new(n) } {
            let name: &'static str = RUNTIME_LIBS
                .iter()
                .chain(DRIVER_LIBS)
                .find(|&&x| x == n)
                .copied()
                .unwrap_or("cuda");
            return Ok((lib, name));
        }
    }
    Err(format!("none of {} could be loaded", names.join(", ")))
}

enum Kind {
    Runtime,
    /// The primary context retained for the registration (made current
    /// around unregistering too: the driver needs one).
    Driver {
        device: c_int,
        ctx: *mut c_void,
    },
}

/// A live registration; unregisters on drop.
pub(crate) struct Registration {
    lib: Library,
    name: &'static str,
    ptr: *mut c_void,
    kind: Kind,
}

// SAFETY: the registration is a handle to process-wide CUDA state; CUDA's
// register/unregister calls are thread-safe.
unsafe impl Send for Registration {}
// SAFETY: no method mutates through &self.
unsafe impl Sync for Registration {}

/// Whether a CUDA library and at least one device are present, and which library.
pub(crate) fn probe() -> Result<&'static str, String> {
    if let Ok((lib, name)) = open_first(RUNTIME_LIBS) {
        // SAFETY: symbol type matches cudaGetDeviceCount's C signature.
        let count: libloading::Symbol<CudartCount> =
            unsafe { lib.get(b"cudaGetDeviceCount\0") }.map_err(|e| e.to_string())?;
        let mut n = 0;
        // SAFETY: valid out pointer.
        let rc = unsafe { count(&mut n) };
        return if rc == 0 && n > 0 {
            Ok(name)
        } else {
            Err(format!("{name} loaded but reports no device (error {rc})"))
        };
    }
    let (lib, name) =
        open_first(DRIVER_LIBS).map_err(|e| format!("no CUDA runtime or driver library: {e}"))?;
    // SAFETY: symbol types match the driver API's C signatures.
    unsafe {
        let init: libloading::Symbol<CuInit> = lib.get(b"cuInit\0").map_err(|e| e.to_string())?;
        let count: libloading::Symbol<CuCount> =
            lib.get(b"cuDeviceGetCount\0").map_err(|e| e.to_string())?;
        let rc = init(0);
        if rc != 0 {
            return Err(format!("{name}: cuInit failed with error {rc}"));
        }
        let mut n = 0;
        let rc = count(&mut n);
        if rc != 0 || n == 0 {
            return Err(format!("{name}: no CUDA device (error {rc})"));
        }
    }
    Ok(name)
}

impl Registration {
    /// Pins `len` bytes at `ptr` with CUDA.
    pub fn register(ptr: *mut u8, len: usize) -> Result<Registration, String> {
        probe()?;
        if let Ok((lib, name)) = open_first(RUNTIME_LIBS) {
            // SAFETY: symbol types match the runtime API; ptr/len describe
            // memory the caller owns for the registration's lifetime.
            unsafe {
                let reg: libloading::Symbol<CudartRegister> =
                    lib.get(b"cudaHostRegister\0").map_err(|e| e.to_string())?;
                let rc = reg(ptr.cast(), len, PORTABLE);
                if rc != 0 {
                    let msg = lib
                        .get::<CudartErrStr>(b"cudaGetErrorString\0")
                        .ok()
                        .map(|f| CStr::from_ptr(f(rc)).to_string_lossy().into_owned())
                        .unwrap_or_default();
                    return Err(format!("{name}: cudaHostRegister failed: error {rc} {msg}"));
                }
            }
            return Ok(Registration {
                lib,
                name,
                ptr: ptr.cast(),
                kind: Kind::Runtime,
            });
        }
        let (lib, name) = open_first(DRIVER_LIBS)?;
        // SAFETY: symbol types match the driver API; the primary context is
        // retained for the registration's lifetime and released on drop.
        unsafe {
            // probe() initialised the driver through a handle it has closed
            // since; cuInit again (idempotent) rather than count on the
            // library having stayed loaded.
            let init: libloading::Symbol<CuInit> =
                lib.get(b"cuInit\0").map_err(|e| e.to_string())?;
            let release: libloading::Symbol<CuCtxRelease> = lib
                .get(b"cuDevicePrimaryCtxRelease_v2\0")
                .map_err(|e| e.to_string())?;
            let get: libloading::Symbol<CuDeviceGet> =
                lib.get(b"cuDeviceGet\0").map_err(|e| e.to_string())?;
            let retain: libloading::Symbol<CuCtxRetain> = lib
                .get(b"cuDevicePrimaryCtxRetain\0")
                .map_err(|e| e.to_string())?;
            let push: libloading::Symbol<CuCtxPush> = lib
                .get(b"cuCtxPushCurrent_v2\0")
                .map_err(|e| e.to_string())?;
            let pop: libloading::Symbol<CuCtxPop> = lib
                .get(b"cuCtxPopCurrent_v2\0")
                .map_err(|e| e.to_string())?;
            let reg: libloading::Symbol<CuRegister> = lib
                .get(b"cuMemHostRegister_v2\0")
                .map_err(|e| e.to_string())?;
            let mut dev = 0;
            let mut ctx = std::ptr::null_mut();
            let rc = init(0);
            if rc != 0 {
                return Err(format!("{name}: cuInit failed with error {rc}"));
            }
            if get(&mut dev, 0) != 0 || retain(&mut ctx, dev) != 0 {
                return Err(format!("{name}: cannot retain device 0's primary context"));
            }
            if push(ctx) != 0 {
                release(dev);
                return Err(format!(
                    "{name}: cannot make device 0's primary context current"
                ));
            }
            let rc = reg(ptr.cast(), len, PORTABLE);
            let mut popped = std::ptr::null_mut();
            pop(&mut popped);
            if rc != 0 {
                release(dev);
                return Err(format!("{name}: cuMemHostRegister failed with error {rc}"));
            }
            Ok(Registration {
                lib,
                name,
                ptr: ptr.cast(),
                kind: Kind::Driver { device: dev, ctx },
            })
        }
    }

    /// The library that did the registration.
    pub fn library(&self) -> &'static str {
        self.name
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: symbol types match; ptr was registered by this value and is
        // still mapped (the ring drops the registration before unmapping).
        unsafe {
            match self.kind {
                Kind::Runtime => {
                    if let Ok(f) = self.lib.get::<CudartUnregister>(b"cudaHostUnregister\0") {
                        f(self.ptr);
                    }
                }
                Kind::Driver { device, ctx } => {
                    let push = self.lib.get::<CuCtxPush>(b"cuCtxPushCurrent_v2\0");
                    let pop = self.lib.get::<CuCtxPop>(b"cuCtxPopCurrent_v2\0");
                    if let (Ok(push), Ok(pop), Ok(unregister)) = (
                        push,
                        pop,
                        self.lib.get::<CuUnregister>(b"cuMemHostUnregister\0"),
                    ) {
                        if push(ctx) == 0 {
                            unregister(self.ptr);
                            let mut popped = std::ptr::null_mut();
                            pop(&mut popped);
                        }
                    }
                    if let Ok(f) = self
                        .lib
                        .get::<CuCtxRelease>(b"cuDevicePrimaryCtxRelease_v2\0")
                    {
                        f(device);
                    }
                }
            }
        }
    }
}

type CuMemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type CuMemFree = unsafe extern "C" fn(u64) -> c_int;
type CuMemcpyHtoD = unsafe extern "C" fn(u64, *const c_void, usize) -> c_int;
type CuMemcpyDtoH = unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int;
type CuGetHandle = unsafe extern "C" fn(*mut c_void, u64, usize, c_int, u64) -> c_int;
type CuPointerSetAttribute = unsafe extern "C" fn(*const c_void, c_int, u64) -> c_int;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
const DMA_BUF_FD: c_int = 1;
/// `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`: memory operations on the range are
/// synchronous, as a NIC writing it behind CUDA's back requires.
const SYNC_MEMOPS: c_int = 6;
/// Allocations are rounded to 2 MiB (the GPU's page size), which also makes
/// them page-aligned for a dma-buf export.
const DEVICE_PAGE: usize = 2 << 20;

/// GPU memory from the CUDA driver: `cuMemAlloc` in device `ordinal`'s
/// primary context (retained while it lives), with synchronous memory
/// operations set, freed on drop. The CPU cannot dereference [`addr`]; it
/// reaches the memory through [`DeviceMemory::copy_from_host`] /
/// [`DeviceMemory::copy_to_host`], and a NIC through a dma-buf
/// ([`DeviceMemory::export_dmabuf`]).
///
/// [`addr`]: DeviceMemory::addr
pub struct DeviceMemory {
    lib: Library,
    name: &'static str,
    device: c_int,
    ctx: *mut c_void,
    addr: u64,
    len: usize,
}

// SAFETY: a device allocation is process-wide CUDA state; every call made
// through it pushes the primary context first, which any thread may do.
unsafe impl Send for DeviceMemory {}
// SAFETY: no method mutates the value; CUDA's calls are thread-safe.
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    /// Allocates at least `len` bytes on device `ordinal`.
    pub fn alloc(ordinal: u32, len: usize) -> Result<DeviceMemory, String> {
        let (lib, name) = open_first(DRIVER_LIBS)
            .map_err(|e| format!("GPU memory needs the CUDA driver library: {e}"))?;
        let len = len.max(1).next_multiple_of(DEVICE_PAGE);
        // SAFETY: symbol types match the driver API's C signatures; the
        // context is retained here and released on drop or on failure.
        unsafe {
            let init: libloading::Symbol<CuInit> =
                lib.get(b"cuInit\0").map_err(|e| e.to_string())?;
            let get: libloading::Symbol<CuDeviceGet> =
                lib.get(b"cuDeviceGet\0").map_err(|e| e.to_string())?;
            let retain: libloading::Symbol<CuCtxRetain> = lib
                .get(b"cuDevicePrimaryCtxRetain\0")
                .map_err(|e| e.to_string())?;
            let rc = init(0);
            if rc != 0 {
                return Err(format!("{name}: cuInit failed with error {rc}"));
            }
            let mut device = 0;
            let rc = get(&mut device, ordinal as c_int);
            if rc != 0 {
                return Err(format!("{name}: no CUDA device {ordinal} (error {rc})"));
            }
            let mut ctx = std::ptr::null_mut();
            let rc = retain(&mut ctx, device);
            if rc != 0 {
                return Err(format!(
                    "{name}: cannot retain device {ordinal}'s primary context (error {rc})"
                ));
            }
            let mut mem = DeviceMemory {
                lib,
                name,
                device,
                ctx,
                addr: 0,
                len,
            };
            // From here on, dropping `mem` releases the context (and frees
            // the allocation once addr is set).
            let mut addr = 0u64;
            mem.in_context("cuMemAlloc_v2", |lib| {
                let alloc: libloading::Symbol<CuMemAlloc> =
                    lib.get(b"cuMemAlloc_v2\0").map_err(|e| e.to_string())?;
                Ok(alloc(&mut addr, len))
            })
            .map_err(|e| format!("{e} ({len} bytes on device {ordinal})"))?;
            mem.addr = addr;
            let one: u32 = 1;
            mem.in_context("cuPointerSetAttribute(SYNC_MEMOPS)", |lib| {
                let set: libloading::Symbol<CuPointerSetAttribute> = lib
                    .get(b"cuPointerSetAttribute\0")
                    .map_err(|e| e.to_string())?;
                Ok(set((&one as *const u32).cast(), SYNC_MEMOPS, addr))
            })?;
            Ok(mem)
        }
    }

    /// Runs one driver call with the primary context current; a non-zero
    /// CUresult becomes an error naming `what`.
    fn in_context(
        &self,
        what: &str,
        call: impl FnOnce(&Library) -> Result<c_int, String>,
    ) -> Result<(), String> {
        // SAFETY: symbol types match the driver API; the context is retained
        // by self, and popped again whatever the call returned.
        unsafe {
            let push: libloading::Symbol<CuCtxPush> = self
                .lib
                .get(b"cuCtxPushCurrent_v2\0")
                .map_err(|e| e.to_string())?;
            let pop: libloading::Symbol<CuCtxPop> = self
                .lib
                .get(b"cuCtxPopCurrent_v2\0")
                .map_err(|e| e.to_string())?;
            let rc = push(self.ctx);
            if rc != 0 {
                return Err(format!(
                    "{}: cannot make the primary context current (error {rc})",
                    self.name
                ));
            }
            let rc = call(&self.lib);
            let mut popped = std::ptr::null_mut();
            pop(&mut popped);
            match rc? {
                0 => Ok(()),
                rc => Err(format!("{}: {what} failed with error {rc}", self.name)),
            }
        }
    }

    /// The device address (not dereferenceable by the CPU).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Bytes allocated (the request rounded up to 2 MiB).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty (allocations are at least 2 MiB).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The whole allocation as a dma-buf file descriptor, for a NIC to
    /// register (`rdma::Mr::register_dmabuf`, offset 0, iova = [`addr`]).
    ///
    /// [`addr`]: DeviceMemory::addr
    pub fn export_dmabuf(&self) -> Result<std::os::fd::OwnedFd, String> {
        let mut fd: c_int = -1;
        self.in_context("cuMemGetHandleForAddressRange(DMA_BUF_FD)", |lib| {
            // SAFETY: the symbol type matches; `fd` is a valid out pointer
            // for a DMA_BUF_FD handle (an int).
            unsafe {
                let get: libloading::Symbol<CuGetHandle> = lib
                    .get(b"cuMemGetHandleForAddressRange\0")
                    .map_err(|e| format!("dma-buf export needs CUDA 11.7 or later: {e}"))?;
                Ok(get(
                    (&mut fd as *mut c_int).cast(),
                    self.addr,
                    self.len,
                    DMA_BUF_FD,
                    0,
                ))
            }
        })?;
        if fd < 0 {
            return Err(format!(
                "{}: the dma-buf export returned no descriptor",
                self.name
            ));
        }
        // SAFETY: the driver handed us a new descriptor, owned from here.
        Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    }

    /// Copies `src` to `offset` (synchronous).
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<(), String> {
        self.check_range(offset, src.len())?;
        self.in_context("cuMemcpyHtoD_v2", |lib| {
            // SAFETY: the symbol type matches; the range is inside the
            // allocation (checked) and src is readable.
            unsafe {
                let copy: libloading::Symbol<CuMemcpyHtoD> =
                    lib.get(b"cuMemcpyHtoD_v2\0").map_err(|e| e.to_string())?;
                Ok(copy(
                    self.addr + offset as u64,
                    src.as_ptr().cast(),
                    src.len(),
                ))
            }
        })
    }

    /// Copies `dst.len()` bytes from `offset` into `dst` (synchronous).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        self.check_range(offset, dst.len())?;
        self.in_context("cuMemcpyDtoH_v2", |lib| {
            // SAFETY: the symbol type matches; the range is inside the
            // allocation (checked) and dst is writable.
            unsafe {
                let copy: libloading::Symbol<CuMemcpyDtoH> =
                    lib.get(b"cuMemcpyDtoH_v2\0").map_err(|e| e.to_string())?;
                Ok(copy(
                    dst.as_mut_ptr().cast(),
                    self.addr + offset as u64,
                    dst.len(),
                ))
            }
        })
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), String> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(format!(
                "{} bytes at offset {offset} lie outside the {}-byte GPU allocation",
                len, self.len
            ));
        }
        Ok(())
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.addr != 0 {
            let addr = self.addr;
            let r = self.in_context("cuMemFree_v2", |lib| {
                // SAFETY: the symbol type matches; addr was allocated by
                // this value and is freed once.
                unsafe {
                    let free: libloading::Symbol<CuMemFree> =
                        lib.get(b"cuMemFree_v2\0").map_err(|e| e.to_string())?;
                    Ok(free(addr))
                }
            });
            if let Err(e) = r {
                log::warn!("GPU memory: {e}");
            }
        }
        // SAFETY: the symbol type matches; releases the context retained in
        // alloc().
        unsafe {
            if let Ok(f) = self
                .lib
                .get::<CuCtxRelease>(b"cuDevicePrimaryCtxRelease_v2\0")
            {
                f(self.device);
            }
        }
    }
}
