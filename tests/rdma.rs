//! RDMA tests. They need a verbs device: outside one they skip with a
//! message. CI (and you) run them inside the soft-RoCE VM:
//!
//! ```sh
//! cargo test --test rdma --no-run
//! ../shared/rdma-vm/run-in-vm.sh -- target/debug/deps/rdma-<hash>
//! ```
//! (scripts/test.sh does exactly this, with `--test-threads 1`: the leak
//! test counts the process's open descriptors.)

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

use std::sync::Arc;
use std::time::{Duration, Instant};

use kspeed::transport::rdma::{Access, Context, Cq, Mr, Pd, Qp, WorkCompletion};
use kspeed::Error;

fn open() -> Option<Arc<Context>> {
    if !have_device() {
        eprintln!("skipping: no RDMA device here; run in the soft-RoCE VM (scripts/test.sh does)");
        return None;
    }
    let gid: u8 = std::env::var("RDMA_VM_GID_INDEX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let dev = std::env::var("RDMA_VM_DEVICE").ok();
    Some(Context::open(dev.as_deref(), 1, Some(gid)).expect("open the RDMA device"))
}

/// Polls `cq` until `n` completions arrived or 5 s passed.
fn wait(cq: &Cq, n: usize) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let mut buf = [WorkCompletion::default(); 16];
    let t0 = Instant::now();
    while got.len() < n && t0.elapsed() < Duration::from_secs(5) {
        let k = cq.poll(&mut buf).unwrap();
        got.extend_from_slice(&buf[..k]);
    }
    got
}

/// Owner QP `a` and consumer QP `b` on one device, connected to each other.
struct Pair {
    pd: Arc<Pd>,
    cq_a: Arc<Cq>,
    cq_b: Arc<Cq>,
    a: Qp,
    b: Qp,
}

fn pair(ctx: &Arc<Context>) -> Pair {
    let pd = Pd::new(ctx).unwrap();
    let (cq_a, cq_b) = (Cq::new(ctx, 256).unwrap(), Cq::new(ctx, 256).unwrap());
    let a = Qp::new(&pd, &cq_a, &cq_a, 128, 64).unwrap();
    let b = Qp::new(&pd, &cq_b, &cq_b, 128, 64).unwrap();
    a.connect(&b.endpoint()).unwrap();
    b.connect(&a.endpoint()).unwrap();
    Pair {
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

#[test]
fn write_with_imm_lands_in_granted_ranges_and_carries_the_grant_id() {
    let Some(ctx) = open() else { return };
    let p = pair(&ctx);
    let mut staging = vec![0u8; 1 << 20];
    let mut ring = vec![0u8; 1 << 20];
    for (i, b) in staging.iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    // SAFETY: both buffers outlive their regions (dropped at the end).
    let smr =
        unsafe { Mr::register(&p.pd, staging.as_mut_ptr(), staging.len(), Access::Local) }.unwrap();
    let rmr =
        unsafe { Mr::register(&p.pd, ring.as_mut_ptr(), ring.len(), Access::RemoteWrite) }.unwrap();
    let mut rwrs = Vec::new();
    p.b.post_recvs(0, 64, &mut rwrs).unwrap();
    // 16 "samples" of 4000 bytes from staging, granted to every other 8 KiB
    // slot of the ring; the immediate is the grant id.
    let writes: Vec<(u64, *const u8, u32, u64, u32)> = (0..16u32)
        .map(|g| {
            let src = staging[g as usize * 4000..].as_ptr();
            (g as u64, src, 4000, rmr.addr() + g as u64 * 16384, 1000 + g)
        })
        .collect();
    let (mut sges, mut wrs) = (Vec::new(), Vec::new());
    // SAFETY: sources lie in `smr`; staging outlives the completion below.
    unsafe {
        p.a.post_writes(&smr, rmr.rkey(), &writes, &mut sges, &mut wrs)
    }
    .unwrap();
    let done = wait(&p.cq_a, 1);
    assert_eq!(done.len(), 1, "one signalled completion for the chain");
    assert_eq!(
        done[0].status,
        0,
        "{}",
        kspeed::transport::rdma::wc_status_name(done[0].status)
    );
    let landed = wait(&p.cq_b, 16);
    assert_eq!(landed.len(), 16);
    let mut imms: Vec<u32> = landed
        .iter()
        .map(|wc| {
            wc.check().unwrap();
            assert_eq!(wc.byte_len, 4000);
            wc.imm.expect("WRITE_WITH_IMM carries the grant id")
        })
        .collect();
    imms.sort();
    assert_eq!(imms, (1000..1016).collect::<Vec<_>>());
    for g in 0..16usize {
        let at = g * 16384;
        assert_eq!(
            &ring[at..at + 4000],
            &staging[g * 4000..g * 4000 + 4000],
            "grant {g}"
        );
        assert!(
            ring[at + 4000..at + 16384].iter().all(|&b| b == 0),
            "bytes outside grant {g}"
        );
    }
    drop((smr, rmr));
}

#[test]
fn write_outside_the_registered_range_is_refused_by_the_nic() {
    let Some(ctx) = open() else { return };
    let p = pair(&ctx);
    let mut staging = vec![0xabu8; 8192];
    let mut buf = vec![0u8; 3 << 16];
    // Only the middle 64 KiB is registered for remote write: the landing
    // range. The rest of the buffer plays guard bytes.
    let mid = buf[1 << 16..].as_mut_ptr();
    // SAFETY: both buffers outlive their regions.
    let smr =
        unsafe { Mr::register(&p.pd, staging.as_mut_ptr(), staging.len(), Access::Local) }.unwrap();
    let rmr = unsafe { Mr::register(&p.pd, mid, 1 << 16, Access::RemoteWrite) }.unwrap();
    let mut rwrs = Vec::new();
    p.b.post_recvs(0, 4, &mut rwrs).unwrap();
    let outside = rmr.addr() + (1 << 16); // just past the region
    let (mut sges, mut wrs) = (Vec::new(), Vec::new());
    // SAFETY: the source lies in `smr`.
    unsafe {
        p.a.post_writes(
            &smr,
            rmr.rkey(),
            &[(7, staging.as_ptr(), 4096, outside, 1)],
            &mut sges,
            &mut wrs,
        )
    }
    .unwrap();
    let done = wait(&p.cq_a, 1);
    assert_eq!(done.len(), 1);
    let e = kspeed::transport::rdma::completion_error(&done[0]);
    assert!(
        matches!(&e, Error::RdmaCompletion { wr_id: 7, status, .. } if *status == "IBV_WC_REM_ACCESS_ERR"),
        "{e}"
    );
    assert!(buf.iter().all(|&b| b == 0), "nothing was written anywhere");
    drop((smr, rmr));
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[test]
fn hundred_connect_disconnect_cycles_do_not_leak() {
    let Some(ctx) = open() else { return };
    let mut staging = vec![1u8; 1 << 16];
    let mut ring = vec![0u8; 1 << 16];
    let cycle = |staging: &mut Vec<u8>, ring: &mut Vec<u8>| {
        let p = pair(&ctx);
        // SAFETY: the buffers outlive the regions (dropped in this closure).
        let smr =
            unsafe { Mr::register(&p.pd, staging.as_mut_ptr(), staging.len(), Access::Local) }
                .unwrap();
        // SAFETY: as above.
        let rmr =
            unsafe { Mr::register(&p.pd, ring.as_mut_ptr(), ring.len(), Access::RemoteWrite) }
                .unwrap();
        let mut rwrs = Vec::new();
        p.b.post_recvs(0, 1, &mut rwrs).unwrap();
        let (mut sges, mut wrs) = (Vec::new(), Vec::new());
        // SAFETY: the source lies in `smr`.
        unsafe {
            p.a.post_writes(
                &smr,
                rmr.rkey(),
                &[(1, staging.as_ptr(), 1024, rmr.addr(), 9)],
                &mut sges,
                &mut wrs,
            )
        }
        .unwrap();
        assert_eq!(wait(&p.cq_a, 1).len(), 1);
        assert_eq!(wait(&p.cq_b, 1).len(), 1);
        // Drop order is the owner's business: MRs and QPs keep their PD and
        // CQs alive, so teardown follows creation in reverse anyway.
        drop(p);
        drop((smr, rmr));
    };
    for _ in 0..5 {
        cycle(&mut staging, &mut ring);
    }
    let (fds, rss) = (open_fds(), rss_kib());
    for _ in 0..100 {
        cycle(&mut staging, &mut ring);
    }
    let (fds2, rss2) = (open_fds(), rss_kib());
    assert_eq!(fds2, fds, "file descriptors leaked over 100 cycles");
    assert!(
        rss2 < rss + 8 * 1024,
        "RSS grew from {rss} to {rss2} KiB over 100 cycles"
    );
}

#[test]
fn rdma_link_pushes_writes_and_errors_in_order_through_the_link_trait() {
    use kspeed::transport::proto::Code;
    use kspeed::transport::rdma::RdmaLink;
    use kspeed::transport::{Done, Link};
    let Some(ctx) = open() else { return };
    let Pair {
        pd,
        cq_a,
        cq_b,
        a,
        b,
    } = pair(&ctx);
    let mut staging = vec![0u8; 1 << 16];
    for (i, x) in staging.iter_mut().enumerate() {
        *x = (i % 253) as u8;
    }
    let mut ring = vec![0u8; 1 << 16];
    let mut inbox = vec![0u8; 64 * 256];
    // SAFETY: the buffers outlive their regions (dropped at the end).
    let smr =
        unsafe { Mr::register(&pd, staging.as_mut_ptr(), staging.len(), Access::Local) }.unwrap();
    let rmr =
        unsafe { Mr::register(&pd, ring.as_mut_ptr(), ring.len(), Access::RemoteWrite) }.unwrap();
    // SAFETY: as above.
    let imr = unsafe { Mr::register(&pd, inbox.as_mut_ptr(), inbox.len(), Access::Local) }.unwrap();
    let (mut sges, mut rwrs) = (Vec::new(), Vec::new());
    b.post_recvs_into(0, 64, Some((&imr, imr.addr(), 256)), &mut sges, &mut rwrs)
        .unwrap();
    let regions = kspeed::transport::rdma::SendRegions::new(&[&smr]);
    let mut link = RdmaLink::new(a, cq_a.clone(), regions, rmr.addr(), rmr.rkey(), 64);
    let write = |link: &mut RdmaLink, id: u64| {
        let src = staging[id as usize * 2000..].as_ptr();
        // SAFETY: the source lies in the staging region, alive until polled.
        assert!(unsafe { link.post_write(id, src, 2000, id * 4096, 100 + id as u32) });
    };
    for id in 0..10 {
        write(&mut link, id);
    }
    let msg = b"node 3 does not hold sample 42";
    // SAFETY: msg is readable for its length.
    assert!(unsafe { link.post_error(10, 555, Code::NotHeld, msg.as_ptr(), msg.len() as u32) });
    for id in 11..14 {
        write(&mut link, id);
    }
    link.flush(&mut ()).unwrap();
    for id in 14..16 {
        write(&mut link, id);
    }
    link.flush(&mut ()).unwrap();
    let mut done = Vec::new();
    let mut buf = [Done::default(); 8];
    let t0 = Instant::now();
    while done.len() < 16 && t0.elapsed() < Duration::from_secs(5) {
        let n = link.poll(&mut buf);
        done.extend_from_slice(&buf[..n]);
    }
    assert_eq!(done.len(), 16, "{done:?}");
    assert!(done.iter().all(|d| d.ok));
    let mut ids: Vec<u64> = done.iter().map(|d| d.wr_id).collect();
    ids.sort();
    assert_eq!(ids, (0..16).collect::<Vec<_>>());
    // The consumer side: 15 writes and the error, in post order.
    let got = wait(&cq_b, 16);
    assert_eq!(got.len(), 16);
    let err_at = got
        .iter()
        .position(|c| c.imm == Some(555))
        .expect("the ERROR arrived");
    assert_eq!(
        err_at, 10,
        "the ERROR stays behind the writes posted before it"
    );
    let e = got[err_at];
    e.check().unwrap();
    let slot = &inbox[e.wr_id as usize * 256..e.wr_id as usize * 256 + e.byte_len as usize];
    assert_eq!(
        u32::from_le_bytes(slot[..4].try_into().unwrap()),
        Code::NotHeld as u32
    );
    assert_eq!(&slot[4..], msg);
    for id in (0..16u64).filter(|&i| i != 10) {
        let at = id as usize * 4096;
        assert_eq!(
            &ring[at..at + 2000],
            &staging[id as usize * 2000..id as usize * 2000 + 2000]
        );
    }
    // A write outside the peer's registration fails the link, and with it
    // everything outstanding, as a named error.
    // SAFETY: the source lies in the staging region.
    assert!(unsafe { link.post_write(20, staging.as_ptr(), 64, 1 << 16, 1) });
    assert!(unsafe { link.post_write(21, staging.as_ptr(), 64, 0, 2) });
    link.flush(&mut ()).unwrap();
    let mut failed = Vec::new();
    let t0 = Instant::now();
    while failed.len() < 2 && t0.elapsed() < Duration::from_secs(5) {
        let n = link.poll(&mut buf);
        failed.extend_from_slice(&buf[..n]);
    }
    assert_eq!(failed.len(), 2);
    assert!(failed.iter().all(|d| !d.ok));
    assert!(
        matches!(link.error(), Some(Error::RdmaCompletion { status, .. }) if *status == "IBV_WC_REM_ACCESS_ERR"),
        "{:?}",
        link.error().map(|e| e.to_string())
    );
    // SAFETY: the source lies in the staging region.
    assert!(
        !unsafe { link.post_write(22, staging.as_ptr(), 64, 0, 3) },
        "a failed link takes nothing"
    );
    drop(link);
    drop(b);
    drop((smr, rmr, imr));
}
