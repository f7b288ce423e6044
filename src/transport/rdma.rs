//! RDMA verbs (rdma-sys). So far: the device probe that RDMA tests and
//! `kspeed inspect --devices` use to tell whether verbs hardware (or a
//! soft-RoCE device) is present. Queue pairs and memory regions come with the
//! RDMA transport issue.

use std::ffi::CStr;

use rdma_sys::{ibv_free_device_list, ibv_get_device_list, ibv_get_device_name};

/// Names of the RDMA devices libibverbs can see (`rxe0`, `mlx5_0`, ...).
/// Empty when there are none, or when the kernel has no RDMA support.
pub fn device_names() -> Vec<String> {
    let mut count: std::os::raw::c_int = 0;
    // SAFETY: ibv_get_device_list writes the count through a valid pointer and
    // returns a NULL-terminated array we own until ibv_free_device_list.
    let list = unsafe { ibv_get_device_list(&mut count) };
    if list.is_null() {
        return Vec::new();
    }
    let mut names = Vec::with_capacity(count.max(0) as usize);
    for i in 0..count.max(0) as usize {
        // SAFETY: i < count, so list[i] is a valid device pointer in the array.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: dev is a live device from the list; the returned name is a
        // NUL-terminated string owned by the device, copied before the free.
        let name = unsafe { ibv_get_device_name(dev) };
        if !name.is_null() {
            // SAFETY: name is non-null and NUL-terminated (see above).
            names.push(
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    // SAFETY: list came from ibv_get_device_list and is freed exactly once,
    // after the last use of its devices.
    unsafe { ibv_free_device_list(list) };
    names
}
