//! RDMA tests. They need a verbs device: outside one they skip with a
//! message. CI (and you) run them inside the soft-RoCE VM:
//!
//! ```sh
//! cargo test --test rdma --no-run
//! ../shared/rdma-vm/run-in-vm.sh -- target/debug/deps/rdma-<hash>
//! ```
//! (scripts/test.sh does exactly this, with `--test-threads 1`: the leak
//! test counts the process's open descriptors.)
//!
//! Why this file is over ~800 lines: it is the one binary the soft-RoCE VM
//! runs (`scripts/test.sh`); splitting it would mean another VM boot per
//! binary.

#![cfg(feature = "rdma")]

fn have_device() -> bool {
    std::path::Path::new("/dev/infiniband/uverbs0").exists()
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn device_probe_lists_the_device() {
    if !have_device() {
        common::skip("no RDMA device here; run it in the soft-RoCE VM (scripts/vm_rdma_tests.sh)");
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
        common::skip("no RDMA device here; run in the soft-RoCE VM (scripts/vm_rdma_tests.sh)");
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
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
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
    // SAFETY: the buffer outlives its registration and the writes into it.
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
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
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
    // SAFETY: the buffer outlives its registration and the writes into it.
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

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn dmabuf_registration_failure_is_a_named_error() {
    // GPU memory lands through a dma-buf registration. No dma-buf exporter
    // exists in the VM (no GPU, no udmabuf, no DMA heaps), so this offers a
    // memfd, which is not a dma-buf: a driver without dma-buf support
    // (soft-RoCE) refuses with EOPNOTSUPP, one with it refuses the fd; both
    // must come back as a named error naming the fd, never a crash.
    let Some(ctx) = open() else { return };
    let pd = Pd::new(&ctx).unwrap();
    // SAFETY: plain memfd_create with a constant name.
    let fd = unsafe { libc::memfd_create(c"kspeed-not-a-dmabuf".as_ptr(), 0) };
    assert!(fd >= 0);
    // SAFETY: fd is ours; 1 MiB.
    assert_eq!(unsafe { libc::ftruncate(fd, 1 << 20) }, 0);
    // SAFETY: the fd outlives the (failed) registration.
    let r = unsafe { Mr::register_dmabuf(&pd, fd, 0, 1 << 20, 0x7000_0000, Access::RemoteWrite) };
    match r {
        Err(Error::Rdma { op, detail }) => {
            assert_eq!(op, "register dma-buf MR");
            assert!(detail.contains(&format!("dma-buf fd {fd}")), "{detail}");
            eprintln!("as expected: {op}: {detail}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a memfd was registered as a dma-buf"),
    }
    // SAFETY: closed once.
    unsafe { libc::close(fd) };
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
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
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
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
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
    // SAFETY: the buffer outlives its registration and the writes into it.
    let rmr =
        unsafe { Mr::register(&pd, ring.as_mut_ptr(), ring.len(), Access::RemoteWrite) }.unwrap();
    // SAFETY: as above.
    let imr = unsafe { Mr::register(&pd, inbox.as_mut_ptr(), inbox.len(), Access::Local) }.unwrap();
    let (mut sges, mut rwrs) = (Vec::new(), Vec::new());
    b.post_recvs_into(0, 64, Some((&imr, imr.addr(), 256)), &mut sges, &mut rwrs)
        .unwrap();
    let regions = kspeed::transport::rdma::SendRegions::new(&[&smr]);
    let mut link = RdmaLink::new(a, cq_a.clone(), regions, rmr.addr(), 64);
    let write = |link: &mut RdmaLink, id: u64| {
        let src = staging[id as usize * 2000..].as_ptr();
        // SAFETY: the source lies in the staging region, alive until polled.
        assert!(unsafe { link.post_write(id, src, 2000, id * 4096, 100 + id as u32, rmr.rkey()) });
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
    assert!(unsafe { link.post_write(20, staging.as_ptr(), 64, 1 << 16, 1, rmr.rkey()) });
    // SAFETY: the buffer outlives its registration and the writes into it.
    assert!(unsafe { link.post_write(21, staging.as_ptr(), 64, 0, 2, rmr.rkey()) });
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
    let taken = unsafe { link.post_write(22, staging.as_ptr(), 64, 0, 3, rmr.rkey()) };
    assert!(!taken, "a failed link takes nothing");
    drop(link);
    drop(b);
    drop((smr, rmr, imr));
}

/// The fault wrapper over the real verbs: a send chain it refuses
/// part-way really posted the requests before `bad_wr` (they land and
/// complete, the rest do not), and a send it makes fail fails at the
/// device, which moves the QP to error and flushes what follows.
#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn faulty_queue_over_real_verbs_refuses_part_way_and_fails_at_the_device() {
    use kspeed::transport::rdma::{
        FaultyQueue, QueueFaults, SendOp, SendWr, VerbsQueue, WorkQueue,
    };
    let Some(ctx) = open() else { return };
    let Pair {
        pd,
        cq_a,
        cq_b,
        a,
        b,
    } = pair(&ctx);
    let mut staging: Vec<u8> = (0..1 << 14).map(|i| (i % 251) as u8 + 1).collect();
    let mut ring = vec![0u8; 1 << 14];
    // SAFETY: the buffers outlive their regions and the writes into them
    // (dropped at the end, after the QPs).
    let smr =
        unsafe { Mr::register(&pd, staging.as_mut_ptr(), staging.len(), Access::Local) }.unwrap();
    // SAFETY: as above.
    let rmr =
        unsafe { Mr::register(&pd, ring.as_mut_ptr(), ring.len(), Access::RemoteWrite) }.unwrap();
    let (mut sges, mut rwrs) = (Vec::new(), Vec::new());
    b.post_recvs_into(0, 64, None, &mut sges, &mut rwrs)
        .unwrap();
    let write = |i: u64| SendWr {
        wr_id: i,
        op: SendOp::WriteWithImm,
        local_addr: smr.addr() + i * 256,
        len: 256,
        lkey: smr.lkey(),
        inline: false,
        remote_addr: rmr.addr() + i * 256,
        rkey: rmr.rkey(),
        imm: i as u32,
        signaled: true,
    };
    let poll_n = |q: &mut FaultyQueue<VerbsQueue>, n: usize| {
        let mut got = Vec::new();
        let mut buf = [WorkCompletion::default(); 16];
        let t0 = Instant::now();
        while got.len() < n && t0.elapsed() < Duration::from_secs(5) {
            let k = q.poll(&mut buf).unwrap();
            got.extend_from_slice(&buf[..k]);
        }
        got
    };
    // Every chain refused somewhere; the seed picks where.
    let faults = QueueFaults::default().seed(3).send_refuse_ppm(1_000_000);
    let mut q = FaultyQueue::new(VerbsQueue::new(a, cq_a.clone(), 64), faults);
    let chain: Vec<SendWr> = (0..8).map(write).collect();
    // SAFETY: staging outlives the requests (polled below).
    let e = unsafe { q.post_send(&chain) }.unwrap_err();
    let k = e.posted;
    eprintln!("the chain of 8 was refused at {k}");
    assert!(k < 8);
    assert_eq!(e.error.raw_os_error(), Some(libc::ENOMEM));
    let done = poll_n(&mut q, k);
    assert_eq!(done.len(), k, "{done:?}");
    assert!(done.iter().all(|c| c.status == 0));
    let got = wait(&cq_b, k);
    assert_eq!(got.len(), k);
    for i in 0..8usize {
        let (at, landed) = (i * 256, &ring[i * 256..i * 256 + 256]);
        if i < k {
            assert_eq!(landed, &staging[at..at + 256], "request {i} was posted");
        } else {
            assert!(landed.iter().all(|&x| x == 0), "request {i} was not posted");
        }
    }
    // Now one request of each chain fails at the device.
    q.set_faults(QueueFaults::default().seed(3).wc_error_ppm(1_000_000));
    let chain: Vec<SendWr> = (8..16).map(write).collect();
    // SAFETY: as above.
    unsafe { q.post_send(&chain) }.unwrap();
    let done = poll_n(&mut q, 8);
    assert_eq!(done.len(), 8, "{done:?}");
    let j = done
        .iter()
        .position(|c| c.status != 0)
        .expect("one request failed");
    // A local protection error on mlx5 (and MemNic); soft-RoCE reports
    // IBV_WC_LOC_QP_OP_ERR.
    let st = done[j].status;
    eprintln!("request {j} of 8 failed with status {st}");
    assert!(
        st != rdma_sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
        "the first error is the request's own: {done:?}"
    );
    assert!(
        done[j + 1..]
            .iter()
            .all(|c| c.status == rdma_sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR),
        "{done:?}"
    );
    assert!(done[..j].iter().all(|c| c.status == 0));
    let stats = q.stats();
    assert_eq!((stats.wc_errors, stats.flushed), (1, (7 - j) as u64));
    drop(q);
    drop(b);
    drop((smr, rmr, cq_b));
}

/// Binds a type 2 window over 4 KiB at offset 8 KiB of a windows-only ring
/// on a fresh pair, optionally invalidates it, then writes `len` bytes at
/// ring offset `off` from the other end under the window's rkey (or, with
/// `use_mr_rkey`, the ring region's own) and returns the write's status.
/// Also returns whether any byte landed outside the window.
fn window_write(
    ctx: &Arc<Context>,
    off: u64,
    len: u32,
    invalidate: bool,
    use_mr_rkey: bool,
) -> (u32, bool) {
    use kspeed::transport::rdma::{next_rkey, Mw, WindowOp};
    let p = pair(ctx);
    let mut staging = vec![0x5Au8; 1 << 16];
    let mut ring = vec![0u8; 1 << 16];
    // SAFETY: both buffers outlive their regions (dropped at the end).
    let smr =
        unsafe { Mr::register(&p.pd, staging.as_mut_ptr(), staging.len(), Access::Local) }.unwrap();
    // SAFETY: the buffer outlives its registration and the writes into it.
    let rmr =
        unsafe { Mr::register(&p.pd, ring.as_mut_ptr(), ring.len(), Access::WindowsOnly) }.unwrap();
    let mw = Mw::new(&p.pd).unwrap();
    let rkey = next_rkey(mw.rkey());
    let mut wrs = Vec::new();
    p.b.post_window_ops(
        &[(
            1,
            true,
            WindowOp::Bind {
                mw: &mw,
                mr: &rmr,
                addr: rmr.addr() + 8192,
                len: 4096,
                rkey,
            },
        )],
        &mut wrs,
    )
    .unwrap();
    let bound = wait(&p.cq_b, 1);
    assert_eq!(bound.len(), 1);
    assert_eq!(
        bound[0].status,
        0,
        "{}",
        kspeed::transport::rdma::wc_status_name(bound[0].status)
    );
    if invalidate {
        p.b.post_window_ops(&[(2, true, WindowOp::Invalidate { rkey })], &mut wrs)
            .unwrap();
        let inv = wait(&p.cq_b, 1);
        assert_eq!(inv[0].status, 0);
    }
    let mut rwrs = Vec::new();
    p.b.post_recvs(100, 4, &mut rwrs).unwrap();
    let key = if use_mr_rkey { rmr.rkey() } else { rkey };
    let (mut sges, mut swrs) = (Vec::new(), Vec::new());
    // SAFETY: the source lies in `smr`; staging outlives the completion.
    unsafe {
        p.a.post_writes(
            &smr,
            key,
            &[(9, staging.as_ptr(), len, rmr.addr() + off, 77)],
            &mut sges,
            &mut swrs,
        )
    }
    .unwrap();
    let done = wait(&p.cq_a, 1);
    assert_eq!(done.len(), 1, "the write completed one way or the other");
    let landed_outside = ring[..8192].iter().chain(&ring[12288..]).any(|&b| b != 0);
    drop((mw, smr, rmr));
    (done[0].status, landed_outside)
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn memory_windows_open_nothing_once_invalidated_and_the_region_key_opens_nothing() {
    let Some(ctx) = open() else { return };
    use kspeed::transport::rdma::wc_status_name as name;
    let refused = |(st, landed): (u32, bool)| {
        assert!(!landed, "a refused write left bytes behind");
        name(st)
    };
    // Inside the window: lands.
    let (st, outside) = window_write(&ctx, 8192, 4096, false, false);
    assert_eq!((name(st), outside), ("IBV_WC_SUCCESS", false));
    // The region's own rkey gives no remote access at all.
    assert_eq!(
        refused(window_write(&ctx, 8192, 4096, false, true)),
        "IBV_WC_REM_ACCESS_ERR"
    );
    // After invalidation the window's rkey opens nothing.
    assert_eq!(
        refused(window_write(&ctx, 8192, 4096, true, false)),
        "IBV_WC_REM_ACCESS_ERR"
    );
    // Past the window's end but inside the region: the verbs spec (and
    // hardware) refuse it; soft-RoCE (rxe, Linux 6.1) checks a window's
    // rkey, QP and state but the range only against the region, so the
    // write lands there. Reported, not asserted: this is the device's
    // behaviour (docs/PROTOCOL.md, "Over RDMA", says what it leaves open).
    let (st, landed) = window_write(&ctx, 8193, 4096, false, false);
    eprintln!(
        "{}: a write one byte past a bound window: {}, bytes outside the window: {landed}",
        ctx.name(),
        name(st)
    );
}

/// Memory-window requests through `WorkQueue` on the real verbs
/// (`VerbsQueue` with a window): a bind opens its range (a write there
/// lands), an invalidation closes it, and the window binds again under
/// the next key (the queue records each posted bind's key, without which
/// the device refuses a window's second bind); a request naming a window
/// the queue does not have is refused whole; and `FaultyQueue` makes a
/// bind or invalidation fail at the device, the rest of its chain flushed.
#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn memory_window_requests_through_the_work_queue_and_their_faults() {
    use kspeed::transport::rdma::{
        next_rkey, wc_status_name as name, FaultyQueue, Mw, MwOp, MwWr, QueueFaults, RecvWr,
        VerbsQueue, WorkQueue,
    };
    let Some(ctx) = open() else { return };
    let p = pair(&ctx);
    let mut staging = vec![0x5Au8; 1 << 16];
    let mut ring = vec![0u8; 1 << 16];
    // SAFETY: both buffers outlive their regions (dropped at the end, after
    // the queues).
    let smr =
        unsafe { Mr::register(&p.pd, staging.as_mut_ptr(), staging.len(), Access::Local) }.unwrap();
    // SAFETY: as above.
    let rmr = Arc::new(
        unsafe { Mr::register(&p.pd, ring.as_mut_ptr(), ring.len(), Access::WindowsOnly) }.unwrap(),
    );
    let mw = Mw::new(&p.pd).unwrap();
    let k1 = next_rkey(mw.rkey());
    let mut q = VerbsQueue::new(p.b, p.cq_b.clone(), 64).with_windows(rmr.clone(), vec![mw]);
    let bind = |wr_id, len, rkey| MwWr {
        wr_id,
        op: MwOp::Bind {
            region: 0,
            window: 0,
            addr: rmr.addr() + 8192,
            len,
            rkey,
        },
        signaled: true,
    };
    let inv = |wr_id, rkey| MwWr {
        wr_id,
        op: MwOp::Invalidate { rkey },
        signaled: true,
    };
    let poll_n = |q: &mut dyn WorkQueue, n: usize| {
        let mut got = Vec::new();
        let mut buf = [WorkCompletion::default(); 16];
        let t0 = Instant::now();
        while got.len() < n && t0.elapsed() < Duration::from_secs(5) {
            let k = q.poll(&mut buf).unwrap();
            got.extend_from_slice(&buf[..k]);
        }
        got
    };
    let write = |key: u32, id: u64| {
        let (mut sges, mut swrs) = (Vec::new(), Vec::new());
        // SAFETY: the source lies in `smr`; staging outlives the completion.
        unsafe {
            p.a.post_writes(
                &smr,
                key,
                &[(id, staging.as_ptr(), 4096, rmr.addr() + 8192, 7)],
                &mut sges,
                &mut swrs,
            )
        }
        .unwrap();
        let done = wait(&p.cq_a, 1);
        assert_eq!(done.len(), 1);
        done[0].status
    };
    q.post_mw(&[bind(1, 4096, k1)]).unwrap();
    let c = poll_n(&mut q, 1);
    assert_eq!((c[0].wr_id, name(c[0].status)), (1, "IBV_WC_SUCCESS"));
    let recv = RecvWr {
        wr_id: 100,
        ..RecvWr::default()
    };
    // SAFETY: no buffer.
    unsafe { q.post_recv(&[recv, recv, recv]) }.unwrap();
    assert_eq!(name(write(k1, 9)), "IBV_WC_SUCCESS");
    assert_eq!(&ring[8192..12288], &staging[..4096]);
    poll_n(&mut q, 1); // the write's receive
                       // Invalidate, and bind again under the next key: the second bind
                       // names the window by the key the first gave it.
    let k2 = next_rkey(k1);
    q.post_mw(&[inv(2, k1), bind(3, 4096, k2)]).unwrap();
    let c = poll_n(&mut q, 2);
    let got: Vec<(u64, &str)> = c.iter().map(|w| (w.wr_id, name(w.status))).collect();
    assert_eq!(got, [(2, "IBV_WC_SUCCESS"), (3, "IBV_WC_SUCCESS")]);
    ring[8192..12288].fill(0);
    assert_eq!(name(write(k2, 10)), "IBV_WC_SUCCESS");
    assert_eq!(&ring[8192..12288], &staging[..4096]);
    poll_n(&mut q, 1);
    // A window the queue does not have: nothing of the chain is posted.
    let e = q
        .post_mw(&[
            inv(4, k2),
            MwWr {
                op: MwOp::Bind {
                    region: 0,
                    window: 1,
                    addr: rmr.addr(),
                    len: 64,
                    rkey: 0,
                },
                ..inv(5, 0)
            },
        ])
        .unwrap_err();
    assert_eq!((e.posted, e.error.raw_os_error()), (0, Some(libc::EINVAL)));
    // One request of the chain fails at the device (seeded: which), the
    // rest is flushed.
    let faults = QueueFaults::default().seed(5).wc_error_ppm(1_000_000);
    let mut fq = FaultyQueue::new(q, faults);
    let k3 = next_rkey(k2);
    fq.post_mw(&[inv(6, k2), bind(7, 4096, k3)]).unwrap();
    // The QP errs: its last receive is flushed too.
    let mut c = poll_n(&mut fq, 3);
    c.retain(|w| w.wr_id != 100);
    let got: Vec<(u64, &str)> = c.iter().map(|w| (w.wr_id, name(w.status))).collect();
    eprintln!(
        "{}: a window chain with a request made to fail: {got:?}",
        ctx.name()
    );
    let j = c.iter().position(|w| w.status != 0).expect("one failed");
    assert_ne!(got[j].1, "IBV_WC_WR_FLUSH_ERR", "{got:?}");
    assert!(
        got[j + 1..].iter().all(|g| g.1 == "IBV_WC_WR_FLUSH_ERR"),
        "{got:?}"
    );
    assert_eq!(fq.stats().mw_errors, 1);
    drop(fq);
    drop(p.a);
    drop((smr, rmr));
}

// --- end to end over RDMA: a real node service, a real loader -------------

#[path = "common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};

use kspeed::dataset::Catalog;
use kspeed::landing::{CudaMode, LandingOptions};
use kspeed::loader::LoaderBuilder;
use kspeed::sampler::{Sampler, SamplerConfig};
use kspeed::transport::proto::{self, GrantEntry, Kind, Welcome};
use kspeed::transport::{Cluster, NodeService, RdmaOptions, ServeConfig};

const TOKEN: &[u8] = b"rdma-job";

/// The VM's address on the RDMA interface, and a second one when
/// scripts/vm_rdma_tests.sh added it.
fn vm_ip(i: usize) -> String {
    let base = std::env::var("RDMA_VM_IP").unwrap_or_else(|_| "10.77.0.1".into());
    if i == 0 {
        return base;
    }
    let other = "10.77.0.2".to_string();
    if TcpListener::bind(format!("{other}:0")).is_ok() {
        other
    } else {
        base
    }
}

struct Data {
    _tmp: tempfile::TempDir,
    src: PathBuf,
    catalog: PathBuf,
    spaces: Vec<PathBuf>,
}

/// `count` tiny samples preloaded onto `nodes` spaces, each holding all.
fn data(count: u64, nodes: u32) -> Data {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    common::gen("tiny", count, &src);
    let catalog = tmp.path().join("cat.ksc");
    common::ok(&[
        "catalog",
        "--source",
        common::s(&src),
        "--out",
        common::s(&catalog),
    ]);
    let mut spaces = Vec::new();
    for i in 0..nodes {
        let sp = tmp.path().join(format!("n{i}"));
        common::ok(&[
            "preload",
            "--source",
            common::s(&src),
            "--catalog",
            common::s(&catalog),
            "--space",
            common::s(&sp),
            "--nodes",
            &nodes.to_string(),
            "--node-index",
            &i.to_string(),
            "--replicas",
            &nodes.to_string(),
        ]);
        spaces.push(sp);
    }
    Data {
        _tmp: tmp,
        src,
        catalog,
        spaces,
    }
}

fn rdma_node(space: &Path, ip: &str) -> NodeService {
    let mut cfg = ServeConfig::new(space, &format!("{ip}:0"), TOKEN);
    cfg.pollers = 1;
    cfg.staging_bytes = 1 << 20;
    cfg.chunk_bytes = 16 << 10;
    cfg.rdma = Some(RdmaOptions::default());
    NodeService::start(cfg).unwrap()
}

fn consumer(d: &Data, addrs: &[String]) -> LoaderBuilder {
    let text: String = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{i} {a}\n"))
        .collect();
    LoaderBuilder::source(common::s(&d.src))
        .catalog(&d.catalog)
        .cluster(Cluster::parse(&text, "test").unwrap())
        .token(TOKEN)
        .seed(3)
        .batch_size(16)
        .pollers(1)
        .pin(false)
        .node_timeout(Duration::from_secs(5))
        .landing(
            LandingOptions::default()
                .ring_bytes(1 << 20)
                .huge_pages(false)
                .mlock(false)
                .numa_node(None)
                .gpu_pci(None)
                .cuda(CudaMode::Off),
        )
        .rdma(Some(RdmaOptions::default()))
}

/// Reads `epochs` and checks every sample's id and CRC32C; returns the count.
fn read_exact(l: &mut kspeed::loader::Loader, cat: &Catalog, epochs: u64) -> u64 {
    let sampler = Sampler::new(
        SamplerConfig::single(cat.len(), 3)
            .rank_world(0, 1)
            .shuffle(true)
            .drop_last(false),
    )
    .unwrap();
    let mut n = 0;
    for e in 0..epochs {
        l.set_epoch(e).unwrap();
        let mut k = 0;
        while let Some(b) = l.next_batch().unwrap() {
            for smp in b.iter() {
                assert_eq!(smp.id, sampler.sample(e, k), "epoch {e} step {k}");
                assert_eq!(
                    crc32c::crc32c(smp.bytes),
                    cat.sample(smp.id).crc32c,
                    "sample {}",
                    smp.id
                );
                k += 1;
                n += 1;
            }
        }
    }
    n
}

#[derive(Clone, Copy, Debug)]
enum RdmaMisdeed {
    /// A write into the granted range carrying another grant id.
    ForeignGrantId,
    /// A write past the end of the consumer's registered ring.
    OutsideTheRing,
    /// A write into the granted range under the HELLO's key (the whole
    /// ring's without windows, 0 with them) instead of the grant's.
    RingKey,
    /// The first grant written (junk, so the consumer's CRC32C check fails
    /// it over), then, once the next GRANT frame shows the consumer closed
    /// it (the node allows one grant outstanding), the same range again
    /// under the first grant's (now invalidated) key.
    StaleWindowKey,
}

/// A node that speaks the handshake and sets up a real QP, then misbehaves
/// on the first grant. Returns its address and, when joined, the status of
/// its write's completion.
fn hostile_rdma_node(
    misdeed: RdmaMisdeed,
    ip: &str,
) -> (String, std::thread::JoinHandle<Option<u32>>) {
    let l = TcpListener::bind(format!("{ip}:0")).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let (_, body) = common::read_frame(&mut c).unwrap();
        let (hello, _) = proto::Hello::decode(&body).unwrap();
        assert_eq!(hello.transport, proto::TRANSPORT_RDMA);
        let w = Welcome {
            node_index: 1,
            nodes: 2,
            replicas: 2,
            owner_fn: 1,
            max_data_bytes: 1 << 20,
            // One grant at a time: a GRANT frame is then a sign that the
            // previous grant is closed (its window invalidated).
            max_grants: if matches!(misdeed, RdmaMisdeed::StaleWindowKey) {
                1
            } else {
                4096
            },
            transport: proto::TRANSPORT_RDMA,
        };
        c.write_all(&w.encode()).unwrap();
        let (h, gid) = common::read_frame(&mut c).unwrap();
        let theirs = proto::RdmaEndpoint::decode(&h, &gid).unwrap();
        let ctx = Context::open(None, 1, None).unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let cq = Cq::new(&ctx, 64).unwrap();
        let mut qp = Qp::new(&pd, &cq, &cq, 32, 0).unwrap();
        let (i, g) = ctx.gid_for_ip(c.local_addr().unwrap().ip()).unwrap();
        qp.use_gid(i, g);
        qp.connect(&theirs).unwrap();
        c.write_all(&qp.endpoint().encode()).unwrap();
        let mut junk = vec![0xEEu8; 1 << 16];
        // SAFETY: junk outlives the region (dropped after it, at the end).
        let mr =
            unsafe { Mr::register(&pd, junk.as_mut_ptr(), junk.len(), Access::Local) }.unwrap();
        // The first GRANT frame (after the keepalive that asks for
        // heartbeats, which this node, like an older one, ignores).
        let body = loop {
            let Ok((h, body)) = common::read_frame(&mut c) else {
                return None;
            };
            if h.kind == Kind::Grant {
                break body;
            }
            assert!(h.kind == Kind::Error && h.body_len == 0, "{h:?}");
        };
        let e = GrantEntry::decode(&body, 0);
        let len = e.len.clamp(1, 1 << 16);
        let at = hello.ring_addr + e.offset;
        let (mut sges, mut wrs) = (Vec::new(), Vec::new());
        let mut write = |id: u64, rkey: u32, remote: u64, imm: u32| {
            // SAFETY: the source lies in `mr`, alive until the completion
            // waited for below.
            unsafe {
                qp.post_writes(
                    &mr,
                    rkey,
                    &[(id, junk.as_ptr(), len, remote, imm)],
                    &mut sges,
                    &mut wrs,
                )
            }
            .unwrap();
            wait(&cq, 1)
        };
        let got = match misdeed {
            RdmaMisdeed::ForeignGrantId => write(1, e.rkey, at, e.grant.wrapping_add(7777)),
            RdmaMisdeed::OutsideTheRing => {
                write(1, e.rkey, hello.ring_addr + hello.ring_len, e.grant)
            }
            RdmaMisdeed::RingKey => write(1, hello.rkey, at, e.grant),
            RdmaMisdeed::StaleWindowKey => {
                assert_eq!(len, e.len, "tiny samples fit the junk buffer");
                let first = write(1, e.rkey, at, e.grant);
                assert_eq!(
                    first.first().map(|w| w.status),
                    Some(0),
                    "the granted write"
                );
                // The next GRANT frame (keepalives are ERROR frames).
                let next = loop {
                    let Ok((h, body)) = common::read_frame(&mut c) else {
                        return None;
                    };
                    if h.kind == Kind::Grant {
                        break GrantEntry::decode(&body, 0);
                    }
                };
                // Under the first grant's key, whatever key the next one
                // has (with the whole-ring key, KSPEED_RDMA_WINDOWS=0, they
                // are the same, and this write lands).
                write(2, e.rkey, at, next.grant)
            }
        };
        // Keep the control connection until the consumer drops it.
        let mut sink = [0u8; 4096];
        while matches!(c.read(&mut sink), Ok(n) if n > 0) {}
        got.first().map(|w| w.status)
    });
    (addr, h)
}

/// Node 0 serves every sample; node 1 is the hostile one. The consumer
/// checks CRC32C (the stale-key node's first write is junk).
fn hostile_rdma_node_case(misdeed: RdmaMisdeed) -> (kspeed::loader::Stats, Option<u32>) {
    // The loader's and node's log (RUST_LOG) says why a node was dropped.
    let _ = env_logger::builder().is_test(true).try_init();
    let d = data(400, 2);
    let node0 = rdma_node(&d.spaces[0], &vm_ip(0));
    let (bad, h) = hostile_rdma_node(misdeed, &vm_ip(1));
    let cat = Catalog::open(&d.catalog).unwrap();
    // A silence timeout far longer than the read: the hostile node must be
    // caught by what it did, not by going quiet afterwards.
    let t0 = Instant::now();
    let mut l = consumer(&d, &[node0.local_addr().to_string(), bad])
        .node_timeout(Duration::from_secs(120))
        .verify_crc32c(true)
        .build()
        .unwrap();
    assert_eq!(read_exact(&mut l, &cat, 2), 800, "{misdeed:?}");
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(60), "{misdeed:?}: took {took:?}");
    let stats = l.finish();
    (stats, h.join().unwrap())
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn rdma_foreign_grant_id_drops_the_node_and_fails_over() {
    if open().is_none() {
        return;
    }
    let (stats, status) = hostile_rdma_node_case(RdmaMisdeed::ForeignGrantId);
    // The write itself is allowed by the NIC (it lands in a granted range);
    // the consumer refuses its grant id, drops the node, and node 0 pushes
    // every one of its grants again: every byte checked above is node 0's.
    assert_eq!(status, Some(0), "the hostile write completed at the NIC");
    assert!(stats.failovers > 0, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "{stats:?}");
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn rdma_write_outside_the_ring_is_refused_by_the_nic() {
    if open().is_none() {
        return;
    }
    let (stats, status) = hostile_rdma_node_case(RdmaMisdeed::OutsideTheRing);
    // The ring is registered for exactly its range: the NIC refuses the
    // write (the peer's QP and ours go to error), nothing lands, and the
    // node's grants fail over to node 0.
    assert_eq!(
        status.map(kspeed::transport::rdma::wc_status_name),
        Some("IBV_WC_REM_ACCESS_ERR")
    );
    assert!(stats.failovers > 0, "{stats:?}");
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn rdma_write_under_the_ring_key_is_refused_by_the_nic() {
    if open().is_none() {
        return;
    }
    let (stats, status) = hostile_rdma_node_case(RdmaMisdeed::RingKey);
    // With per-grant windows the ring's own registration opens nothing
    // remotely (HELLO carries key 0): the write lands nowhere, the node's
    // QP breaks and its grants fail over to node 0. (Without windows,
    // KSPEED_RDMA_WINDOWS=0, the whole-ring key lets it land.)
    assert_eq!(
        status.map(kspeed::transport::rdma::wc_status_name),
        Some("IBV_WC_REM_ACCESS_ERR")
    );
    assert!(stats.failovers > 0, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "{stats:?}");
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn rdma_write_under_a_closed_grants_key_is_refused_by_the_nic() {
    if open().is_none() {
        return;
    }
    let (stats, status) = hostile_rdma_node_case(RdmaMisdeed::StaleWindowKey);
    // The first grant's window was invalidated before the consumer checked
    // (and failed over) its junk and before it granted the node anything
    // else: writing that range again under its key is refused by the NIC,
    // lands nowhere, and the node is dropped; node 0 serves everything.
    assert_eq!(
        status.map(kspeed::transport::rdma::wc_status_name),
        Some("IBV_WC_REM_ACCESS_ERR")
    );
    assert!(stats.failovers > 0, "{stats:?}");
    assert_eq!(stats.source_reads, 0, "{stats:?}");
}

/// The node's live RDMA queue pairs once they reach 0, or after `limit`.
fn qps_after(node: &NodeService, limit: Duration) -> u64 {
    use std::sync::atomic::Ordering;
    let t0 = Instant::now();
    loop {
        let n = node.stats().rdma_qps.load(Ordering::Relaxed);
        if n == 0 || t0.elapsed() >= limit {
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn consumers_that_leave_mid_epoch_leave_no_queue_pair_behind() {
    if open().is_none() {
        return;
    }
    use std::sync::atomic::Ordering;
    let d = data(300, 1);
    let node = rdma_node(&d.spaces[0], &vm_ip(0));
    let addr = node.local_addr().to_string();
    let cat = Catalog::open(&d.catalog).unwrap();
    let mut fds0 = 0;
    for cycle in 0..20 {
        let mut l = consumer(&d, std::slice::from_ref(&addr)).build().unwrap();
        // A batch or two, then the rank goes away mid-epoch.
        let b = l.next_batch().unwrap().expect("a batch");
        assert_eq!(crc32c::crc32c(b.iter().next().unwrap().bytes), {
            let id = b.iter().next().unwrap().id;
            cat.sample(id).crc32c
        });
        drop(b);
        drop(l);
        assert_eq!(
            qps_after(&node, Duration::from_secs(5)),
            0,
            "cycle {cycle}: the node still holds the departed consumer's QP"
        );
        if cycle == 2 {
            fds0 = open_fds();
        }
    }
    assert!(
        open_fds() <= fds0 + 2,
        "descriptors grew: {fds0} -> {}",
        open_fds()
    );
    assert_eq!(node.stats().connections.load(Ordering::Relaxed), 20);
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn an_rdma_consumer_refuses_a_node_that_only_speaks_tcp() {
    if open().is_none() {
        return;
    }
    let d = data(50, 1);
    let mut cfg = ServeConfig::new(&d.spaces[0], &format!("{}:0", vm_ip(0)), TOKEN);
    cfg.pollers = 1;
    let node = NodeService::start(cfg).unwrap();
    match consumer(&d, &[node.local_addr().to_string()]).build() {
        Err(kspeed::Error::BadCluster { origin, reason }) => {
            assert!(origin.contains("node 0"), "{origin}");
            assert!(reason.contains("--rdma"), "{reason}");
        }
        Err(e) => panic!("expected BadCluster, got {e}"),
        Ok(_) => panic!("an RDMA consumer accepted a TCP-only node"),
    }
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn inspect_devices_lists_ports_and_the_addresses_to_listen_on() {
    if open().is_none() {
        return;
    }
    let out = common::ok(&["inspect", "--devices"]);
    let dev = std::env::var("RDMA_VM_DEVICE").unwrap_or_else(|_| "rxe0".into());
    assert!(out.contains(&format!("{dev} port 1: active")), "{out}");
    assert!(
        out.contains(&format!("{} (RoCE v2)", vm_ip(0))),
        "the VM's address is a RoCE v2 GID: {out}"
    );
}

/// `kspeed read --rdma` of `d`'s source through the nodes in `cluster`.
fn cli_read(d: &Data, cluster: &Path, token: &Path) -> std::process::Command {
    let mut c = std::process::Command::new(common::kspeed_bin());
    c.args([
        "read",
        "--progress=none",
        "--rdma",
        "--source",
        common::s(&d.src),
    ])
    .args([
        "--catalog",
        common::s(&d.catalog),
        "--cluster",
        common::s(cluster),
    ])
    .args(["--token-file", common::s(token)]);
    c
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn a_killed_consumer_process_leaves_no_queue_pair_on_the_node() {
    if open().is_none() {
        return;
    }
    use std::process::Stdio;
    use std::sync::atomic::Ordering;
    let d = data(2000, 1);
    let node = rdma_node(&d.spaces[0], &vm_ip(0));
    let cluster = d.spaces[0].parent().unwrap().join("cluster");
    std::fs::write(&cluster, format!("0 {}\n", node.local_addr())).unwrap();
    let token = d.spaces[0].parent().unwrap().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let mut child = cli_read(&d, &cluster, &token)
        .args(["--epochs", "1000", "--ring-bytes", "1MiB", "--no-mlock"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until it is being served over RDMA, then kill it mid-epoch.
    let t0 = Instant::now();
    while node.stats().samples.load(Ordering::Relaxed) < 100 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the consumer never got going"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the consumer exited early"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(node.stats().rdma_qps.load(Ordering::Relaxed), 1);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        qps_after(&node, Duration::from_secs(10)),
        0,
        "the node still holds the killed consumer's QP after 10 s"
    );
    // And it serves the next consumer as before.
    let cat = Catalog::open(&d.catalog).unwrap();
    let mut l = consumer(&d, &[node.local_addr().to_string()])
        .build()
        .unwrap();
    assert_eq!(read_exact(&mut l, &cat, 1), 2000);
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn a_gpu_ring_takes_rdma_writes_through_the_cuda_driver() {
    // No GPU anywhere here: the CUDA driver is the stand-in, whose "device
    // memory" is host memory the CPU cannot reach except through its copy
    // calls, as with a GPU. Everything else is real: the ring comes from
    // cuMemAlloc, its dma-buf export is offered to the NIC (soft-RoCE
    // refuses dma-buf MRs), the fallback registers it by address (as
    // nvidia-peermem allows for real GPU memory), the node's RDMA writes land
    // in it, and `--verify` copies every sample back out with cuMemcpyDtoH
    // and checks its CRC32C.
    if open().is_none() {
        return;
    }
    let d = data(800, 1);
    let lib = d.spaces[0].parent().unwrap().join("fakecuda");
    std::fs::create_dir_all(&lib).unwrap();
    if common::build_fake_cuda(&lib, "-DFAKE_DRIVER", "libcuda.so.1").is_none() {
        return;
    }
    let node = rdma_node(&d.spaces[0], &vm_ip(0));
    let dir = d.spaces[0].parent().unwrap();
    let cluster = dir.join("cluster");
    std::fs::write(&cluster, format!("0 {}\n", node.local_addr())).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let log = lib.join("calls.log");
    let o = cli_read(&d, &cluster, &token)
        .args([
            "--epochs",
            "2",
            "--gpu-ring",
            "0",
            "--verify",
            "--ring-bytes",
            "2MiB",
            "-v",
        ])
        .env("LD_LIBRARY_PATH", &lib)
        .env("FAKE_CUDA_LOG", &log)
        .output()
        .unwrap();
    let calls = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(o.status.success(), "{}\n{calls}", common::text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("read 1600 samples"), "{out}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("GPU memory on device 0"), "{err}");
    assert!(
        err.contains("GPU ring registered for RDMA by address (peer memory)")
            && err.contains("cannot register dma-buf memory"),
        "dma-buf offered first, then the address:\n{err}"
    );
    assert!(calls.contains("export "), "{calls}");
    assert!(
        calls.contains("set attribute 6 = 1"),
        "SYNC_MEMOPS:\n{calls}"
    );
    assert_eq!(
        calls.lines().rfind(|l| l.starts_with("exit ")),
        Some("exit registered=0 retained=0 allocated=0"),
        "the ring freed and the context released:\n{calls}"
    );
    // Read-ahead may have pushed some of a third epoch too.
    let line = out
        .lines()
        .find(|l| l.starts_with("cluster (RDMA)"))
        .unwrap_or("");
    let pushed: u64 = line
        .split(": ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        pushed >= 1600 && line.ends_with("0 failed over, 0 read from the source"),
        "every sample came over RDMA:\n{out}"
    );
    // Samples no live node holds come from the source: read and checked on
    // the host, then copied into the GPU ring. Node 1 of a one-copy,
    // two-node space is down (nothing listens at its address).
    let half = dir.join("half");
    common::ok(&[
        "preload",
        "--source",
        common::s(&d.src),
        "--catalog",
        common::s(&d.catalog),
        "--space",
        common::s(&half),
        "--nodes",
        "2",
        "--node-index",
        "0",
        "--replicas",
        "1",
    ]);
    let node0 = rdma_node(&half, &vm_ip(0));
    let dead = TcpListener::bind(format!("{}:0", vm_ip(0))).unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    std::fs::write(
        &cluster,
        format!("0 {}\n1 {dead_addr}\n", node0.local_addr()),
    )
    .unwrap();
    let o = cli_read(&d, &cluster, &token)
        .args([
            "--epochs",
            "1",
            "--gpu-ring",
            "0",
            "--verify",
            "--ring-bytes",
            "2MiB",
        ])
        .env("LD_LIBRARY_PATH", &lib)
        .env("FAKE_CUDA_LOG", &log)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", common::text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("read 800 samples"), "{out}");
    let line = out
        .lines()
        .find(|l| l.starts_with("cluster (RDMA)"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        !line.ends_with(" 0 read from the source") && !line.contains(": 0 samples pushed"),
        "some samples over RDMA, some from the source: {line}"
    );
}

#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/vm_rdma_tests.sh)"]
fn slow_rdma_handshakes_past_welcome_are_never_evicted() {
    let Some(ctx) = open() else {
        return;
    };
    use std::sync::atomic::Ordering;
    let d = data(50, 1);
    // The default limits: 64 handshakes not yet admitted on a 1-node space.
    let node = rdma_node(&d.spaces[0], &vm_ip(0));
    let addr = node.local_addr();
    let cat = Catalog::open(&d.catalog).unwrap();
    let mut hello = Vec::new();
    proto::Hello {
        catalog_identity: cat.identity(),
        rank: 0,
        world: 1,
        catalog_samples: cat.len(),
        seed: 3,
        // Never written: no grant is sent.
        ring_addr: 0x10000,
        ring_len: 1 << 20,
        rkey: 1,
        transport: proto::TRANSPORT_RDMA,
    }
    .encode(TOKEN, &mut hello);
    // 80 consumers (a 10-node job's 8 x 9, and then some) send HELLO back
    // to back and are welcomed...
    let mut socks = Vec::new();
    for _ in 0..80 {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c.write_all(&hello).unwrap();
        socks.push(c);
    }
    for (k, c) in socks.iter_mut().enumerate() {
        let (h, body) = common::read_frame(c).unwrap();
        assert_eq!(
            h.kind,
            Kind::Welcome,
            "consumer {k}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    // ...then take a while before sending their endpoints (setting up
    // their queue pairs, a loaded host): about 200 ms.
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 256).unwrap();
    let t0 = Instant::now();
    let mut qps = Vec::new();
    for c in &socks {
        let mut qp = Qp::new(&pd, &cq, &cq, 16, 0).unwrap();
        let (i, g) = ctx.gid_for_ip(c.local_addr().unwrap().ip()).unwrap();
        qp.use_gid(i, g);
        qps.push(qp);
    }
    // A consumer this slow, not a wait for the node.
    std::thread::sleep(Duration::from_millis(200).saturating_sub(t0.elapsed()));
    for (c, qp) in socks.iter_mut().zip(&qps) {
        c.write_all(&qp.endpoint().encode()).unwrap();
    }
    // Every one is served: the node's endpoint, no ERROR (the old code
    // evicted 16 of them, "handshake not complete while 64 newer
    // connections waited").
    for (k, c) in socks.iter_mut().enumerate() {
        let (h, body) = common::read_frame(c).unwrap();
        assert_eq!(
            h.kind,
            Kind::RdmaEndpoint,
            "consumer {k}: {:?} {}",
            proto::Code::from_u32(h.b),
            String::from_utf8_lossy(&body)
        );
    }
    assert_eq!(node.stats().evicted.load(Ordering::Relaxed), 0);
    // Each is counted once the node has handed it to its poller, just
    // after its endpoint went out.
    let t0 = Instant::now();
    while node.stats().connections.load(Ordering::Relaxed) < 80 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{} of 80 consumers handed to the poller",
            node.stats().connections.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
