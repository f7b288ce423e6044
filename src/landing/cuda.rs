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
pub struct Registration {
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
pub fn probe() -> Result<&'static str, String> {
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
