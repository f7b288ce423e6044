//! The node agent's memory tier and its rings in huge pages, with real
//! agent and rank processes (`kspeed read --agent required`): one tier for
//! every rank of one user, byte-exact against embedded reads.

mod agent_support;
mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use agent_support::*;
use common::{kspeed_bin, text};

/// The agent's node tier is one for all its ranks: after rank 0 and rank
/// 1 of 2 each read their half in epoch 1 (filling the tier with the whole
/// dataset), rank 0's epoch 2, which holds samples rank 1 read, comes from
/// the tier alone (per-rank tiers would have read about half of it from
/// disk), byte-exact; and the agent's read counts reach the rank's stats.
#[test]
fn the_node_tier_serves_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let count = 600u64;
    let sp = space(dir.path(), count);
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&sp, &sock, &["--tier-bytes", "64MiB", "--no-mlock"]);
    let share = count / 2;
    for rank in 0..2u32 {
        let args = one_epoch(attached_args(&sp, &sock, rank, 2, 1), 1);
        let child = spawn_read(&args);
        let pid = child.id();
        let (n, digest, disk, tier) = report(child);
        // One epoch asked (ATTACH's end_epoch): the agent published its
        // 19 batches (300 samples, 16 a batch) and read nothing past them.
        agent.log.wait_for(
            &[&format!("(pid {pid}) ended after 19 batches")],
            Duration::from_secs(10),
        );
        let want = embedded_epoch(&sp, rank, 2, 1);
        assert_eq!((n, digest), want, "rank {rank}, epoch 1");
        // Every delivered sample was read for it, from disk in the main:
        // no other rank had read any of this rank's epoch-1 samples.
        assert!(
            disk + tier >= share,
            "rank {rank}: {disk} disk reads, {tier} tier hits"
        );
        assert!(
            disk >= share / 2,
            "rank {rank}: {disk} disk reads in epoch 1"
        );
    }
    let args = one_epoch(attached_args(&sp, &sock, 0, 2, 1), 2);
    let (n, digest, disk, tier) = report(spawn_read(&args));
    assert_eq!((n, digest), embedded_epoch(&sp, 0, 2, 2), "rank 0, epoch 2");
    assert_eq!(
        disk, 0,
        "epoch 2 of rank 0 read from disk although the node tier holds every sample"
    );
    assert!(tier >= share, "{tier} tier hits for {share} samples");
}

/// Tier views through the agent (`--tier-views`, an attached rank's
/// `tier_views`): the agent hands the node tier's samples out in place,
/// as read-only views of the tier's memfd, instead of copying them into
/// the rank's ring. After ranks 0 and 1 of 2 fill the tier in epoch 1,
/// rank 0's epoch 2 is every sample a view (0 disk reads), byte-exact
/// against an embedded read; the same epoch without views, copies,
/// delivers the same digest.
#[test]
fn tier_views_hand_out_the_node_tier_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let count = 600u64;
    let sp = space(dir.path(), count);
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&sp, &sock, &["--tier-bytes", "64MiB", "--no-mlock"]);
    let with_views = |rank: u32, epoch: u64| {
        let mut args = one_epoch(attached_args(&sp, &sock, rank, 2, 1), epoch);
        args.push("--tier-views".into());
        args
    };
    let json = |child| -> serde_json::Value {
        let o = wait_output(child, Duration::from_secs(120));
        assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
        serde_json::from_slice(&o.stdout).expect("json report")
    };
    let sums = |v: &serde_json::Value| {
        (
            v["samples"].as_u64().unwrap(),
            v["digest"].as_str().unwrap().to_string(),
        )
    };
    for rank in 0..2u32 {
        let child = spawn_read(&with_views(rank, 1));
        let pid = child.id();
        let v = json(child);
        agent.log.wait_for(
            &[&format!("(pid {pid}) ended after 19 batches")],
            Duration::from_secs(10),
        );
        assert_eq!(
            sums(&v),
            embedded_epoch(&sp, rank, 2, 1),
            "rank {rank}, epoch 1"
        );
    }
    let child = spawn_read(&with_views(0, 2));
    let pid = child.id().to_string();
    let v = json(child);
    let want = embedded_epoch(&sp, 0, 2, 2);
    assert_eq!(sums(&v), want, "rank 0, epoch 2, tier views");
    assert_eq!(v["disk_reads"].as_u64(), Some(0), "{v}");
    assert_eq!(
        v["tier_views"].as_u64(),
        Some(count / 2),
        "every sample of epoch 2 is in the node tier: each one a view\n{v}"
    );
    agent.log.wait_for(
        &[&format!("(pid {pid}) ended after 19 batches")],
        Duration::from_secs(10),
    );
    // The same epoch with copies into the ring: the same bytes in order.
    let v = json(spawn_read(&one_epoch(
        attached_args(&sp, &sock, 0, 2, 1),
        2,
    )));
    assert_eq!(sums(&v), want, "rank 0, epoch 2, copies");
    assert!(v.get("tier_views").is_none(), "{v}");
}

/// An attached rank's tier views are the node tier itself, mapped
/// read-only: a sample handed out in place cannot be made writable
/// (`mprotect(PROT_WRITE)` fails with EACCES: the agent passed the memfd
/// opened `O_RDONLY`), so no rank can spoil the tier its node's other
/// ranks read; and every sample, view or copy, is the embedded read's.
#[test]
fn a_rank_s_tier_views_are_read_only() {
    use kspeed::loader::{AgentMode, LoaderBuilder};
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &["--tier-bytes", "64MiB", "--no-mlock"]);
    let build = |mode: AgentMode| {
        LoaderBuilder::space(&sp)
            .agent(mode)
            .agent_socket(Some(sock.clone()))
            .batch_size(16)
            .seed(5)
            .end_epoch(Some(2))
            .tier_views(true)
            .landing(common::test_ring(1 << 20))
            .build()
            .unwrap()
    };
    let epoch = |l: &mut kspeed::loader::Loader, e: u64, probe: bool| {
        l.set_epoch(e).unwrap();
        let (mut got, mut views, mut probed) = (Vec::new(), 0u64, false);
        while let Some(b) = l.next_batch().unwrap() {
            for s in b.iter() {
                got.push((s.id, s.bytes.to_vec()));
                if !s.in_tier {
                    continue;
                }
                views += 1;
                if probe && !probed {
                    probed = true;
                    let page = (s.bytes.as_ptr() as usize) & !4095;
                    // SAFETY: mprotect on a page of a live mapping; it fails
                    // (the point of the test) or changes only its protection.
                    let rc = unsafe {
                        libc::mprotect(
                            page as *mut libc::c_void,
                            4096,
                            libc::PROT_READ | libc::PROT_WRITE,
                        )
                    };
                    let errno = std::io::Error::last_os_error().raw_os_error();
                    assert_eq!(
                        (rc, errno),
                        (-1, Some(libc::EACCES)),
                        "a tier view's page could be made writable"
                    );
                }
            }
        }
        (got, views)
    };
    let mut attached = build(AgentMode::Required);
    assert!(attached.attached());
    let (first, _) = epoch(&mut attached, 0, false);
    let (second, views) = epoch(&mut attached, 1, true);
    // Nor can the memfd, opened again read-write through /proc (its mode
    // allows it), be mapped writable: the agent sealed it against future
    // writes (F_SEAL_FUTURE_WRITE, EPERM) once it had mapped it itself.
    let tier_fds: Vec<_> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let p = e.ok()?.path();
            let to = std::fs::read_link(&p).ok()?;
            to.to_string_lossy()
                .contains("memfd:kspeed-node-tier")
                .then_some(p)
        })
        .collect();
    assert!(!tier_fds.is_empty(), "the rank holds the node tier's memfd");
    for p in &tier_fds {
        let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).open(p) else {
            continue; // not even opened read-write: as good
        };
        use std::os::fd::AsRawFd;
        // SAFETY: asks for a new shared mapping of a file we hold; it is
        // unmapped at once if the kernel grants it (the test then fails).
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        let errno = std::io::Error::last_os_error().raw_os_error();
        if m != libc::MAP_FAILED {
            // SAFETY: the mapping just made, 4096 bytes.
            unsafe { libc::munmap(m, 4096) };
        }
        assert_eq!(
            (m == libc::MAP_FAILED, errno),
            (true, Some(libc::EPERM)),
            "the node tier reopened read-write could be mapped writable"
        );
    }
    drop(attached);
    let mut embedded = build(AgentMode::Off);
    let (want0, _) = epoch(&mut embedded, 0, false);
    let (want1, _) = epoch(&mut embedded, 1, false);
    assert!(first == want0, "epoch 0 differs from the embedded read");
    assert!(second == want1, "epoch 1 differs from the embedded read");
    // Epoch 0 filled the tier with every sample; epoch 1's are views but
    // for those read ahead while epoch 0 was still filling it.
    assert!(views >= 300, "{views} of 400 samples of epoch 1 were views");
}

/// The node tier is shared by the ranks of one user only (a CRC does not
/// stop a rank that forges the bytes it is filled from): after root's two
/// ranks filled it, a rank of another user (`nobody`) finds it emptied for
/// it and reads from disk; and a root rank that attaches while `nobody`'s
/// rank holds the tier reads without it. Both byte-exact. Root only (the
/// agent serves another uid only as root).
#[test]
fn the_node_tier_is_shared_by_one_user_at_a_time() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !common::is_root() {
        return common::skip("running a rank as another user needs root");
    }
    let dir = tempfile::tempdir().unwrap();
    // `nobody` reads the catalog: the test's directory must be open to it.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let count = 600u64;
    let sp = space(dir.path(), count);
    // A space is private to its preloader; this one is open to `nobody`.
    let mut todo = vec![sp.clone()];
    while let Some(p) = todo.pop() {
        let dir = p.is_dir();
        let mode = if dir { 0o755 } else { 0o644 };
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        if dir {
            todo.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        }
    }
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(
        &sp,
        &sock,
        &[
            "--tier-bytes",
            "64MiB",
            "--no-mlock",
            "--allow-other-uids",
            "--socket-mode",
            "666",
        ],
    );
    for rank in 0..2u32 {
        let args = one_epoch(attached_args(&sp, &sock, rank, 2, 1), 1);
        let child = spawn_read(&args);
        let pid = child.id();
        report(child);
        // Root's ranks hold the tier until the agent has seen them end.
        agent.log.wait_for(
            &[&format!("(pid {pid}) ended after")],
            Duration::from_secs(10),
        );
    }
    // nobody's rank 0, epoch 2: root's samples were dropped for it.
    let mut args = one_epoch(attached_args(&sp, &sock, 0, 2, 1), 2);
    args.extend(["--compute-us", "100000"].map(String::from));
    let nobody = Command::new(kspeed_bin())
        .args(&args)
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kspeed read as nobody");
    let nobody_pid = nobody.id().to_string();
    agent.log.wait_for(
        &["rank 0", &nobody_pid, "attached"],
        Duration::from_secs(30),
    );
    // Meanwhile root's rank 1, epoch 2: nobody's rank holds the tier.
    let args = one_epoch(attached_args(&sp, &sock, 1, 2, 1), 2);
    let root_rank = spawn_read(&args);
    let root_pid = root_rank.id().to_string();
    let (n, digest, disk, tier) = report(root_rank);
    assert_eq!(
        (n, digest),
        embedded_epoch(&sp, 1, 2, 2),
        "root's rank 1, epoch 2"
    );
    assert_eq!(
        tier, 0,
        "root's rank read from the tier nobody's rank holds"
    );
    assert!(disk >= count / 2, "{disk} disk reads");
    agent.log.wait_for(
        &[&root_pid, "uid 0", "reads without the node tier"],
        Duration::from_secs(10),
    );
    let (n, digest, disk, _) = report(nobody);
    assert_eq!(
        (n, digest),
        embedded_epoch(&sp, 0, 2, 2),
        "nobody's rank 0, epoch 2"
    );
    // Root's ranks had filled every sample; emptied for nobody, so its
    // epoch came from disk (the shared tier would have given 0 reads).
    assert!(
        disk >= count / 4,
        "nobody's rank read {disk} samples from disk"
    );
}

/// Reserves `pages` more 2 MiB huge pages for the test's life (root
/// only): the count goes back to what it was when dropped.
struct HugePages {
    before: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

impl HugePages {
    fn reserve(pages: u64) -> Option<HugePages> {
        let before: u64 = std::fs::read_to_string(NR_HUGEPAGES)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        std::fs::write(NR_HUGEPAGES, (before + pages).to_string()).ok()?;
        let now: u64 = std::fs::read_to_string(NR_HUGEPAGES)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let guard = HugePages { before };
        // The kernel may find fewer free 2 MiB blocks than asked.
        (now >= before + pages).then_some(guard)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.before.to_string());
    }
}

/// With 2 MiB pages reserved, an attached rank's ring (a multiple of 2 MiB)
/// is a hugetlb memfd, which the agent maps and reads into, byte-exact
/// against an embedded read; the rank says which pages its ring got.
#[test]
fn an_attached_ring_in_huge_pages_is_exact() {
    if !common::is_root() {
        return common::skip("reserving huge pages needs root");
    }
    // 4 MiB rings: the rank's, and the one it replaces at a restart.
    let Some(_pages) = HugePages::reserve(8) else {
        return common::skip("the kernel could not reserve 8 more 2 MiB pages");
    };
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let big_ring = |mut v: Vec<String>| {
        let at = v.iter().position(|a| a == "--ring-bytes").expect("flag") + 1;
        v[at] = "4MiB".into();
        v
    };
    let mut args = big_ring(attached_args(&sp, &sock, 0, 1, 2));
    args.push("-v".into());
    let o = wait_output(spawn_read(&args), Duration::from_secs(120));
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("ring of 4194304 bytes in 2 MiB huge pages (hugetlb)"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let embedded_args = big_ring(read_args(&sp, 0, 1, 2, &["--agent", "off"]));
    let want = finish(spawn_read(&embedded_args));
    assert_eq!(
        (
            v["samples"].as_u64().unwrap(),
            v["digest"].as_str().unwrap().to_string()
        ),
        want
    );
    // The agent checks each sample's CRC32C in the rank's hugetlb ring
    // through the kernel (a page the rank took away fails that read, not
    // the agent): exact too.
    let mut args = big_ring(attached_args(&sp, &sock, 0, 1, 2));
    args.extend(["--verify".into(), "-v".into()]);
    let o = wait_output(spawn_read(&args), Duration::from_secs(120));
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("(hugetlb)"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    assert_eq!(
        (
            v["samples"].as_u64().unwrap(),
            v["digest"].as_str().unwrap().to_string()
        ),
        want
    );
}
