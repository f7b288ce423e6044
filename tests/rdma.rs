//! RDMA tests. They need a verbs device: outside one they skip with a
//! message. CI (and you) run them inside the soft-RoCE VM:
//!
//! ```sh
//! cargo test --test rdma --no-run
//! ../shared/rdma-vm/run-in-vm.sh -- target/debug/deps/rdma-<hash>
//! ```
//! (scripts/test.sh does exactly this.)

#![cfg(feature = "rdma")]

fn have_device() -> bool {
    std::path::Path::new("/dev/infiniband/uverbs0").exists()
}

#[test]
fn device_probe_lists_the_device() {
    if !have_device() {
        eprintln!(
            "skipping device_probe_lists_the_device: no RDMA device here; \
             run it in the soft-RoCE VM (../shared/rdma-vm/run-in-vm.sh, see scripts/test.sh)"
        );
        return;
    }
    let names = kspeed::transport::rdma::device_names();
    assert!(
        !names.is_empty(),
        "uverbs0 exists but libibverbs lists no device"
    );
    if let Ok(want) = std::env::var("RDMA_VM_DEVICE") {
        assert!(names.contains(&want), "{names:?} lacks {want}");
    }
}
