//! Gives libkspeed.so a soname carrying the C ABI version, so programs
//! linked against one ABI refuse to load an incompatible library.
fn main() {
    // Keep in step with capi::KSP_ABI_VERSION.
    let abi = 5;
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkspeed.so.{abi}");
    println!("cargo:rerun-if-changed=build.rs");
}
