//! Poller placement across a node's ranks, with real `kspeed read`
//! processes: 8 loaders started together with LOCAL_RANK 0..7 and
//! LOCAL_WORLD_SIZE 8 (as torchrun starts them), a fake two-socket sysfs
//! layout (KSPEED_SYSFS_ROOT) and affinity masks restricted with `taskset`.
//! Each reports its placement (`--json`), and the poller threads' affinity
//! is read back from /proc while they run.
//!
//! This machine has 2 cores, so the masks hold at most CPUs 0 and 1: with
//! 8 ranks the slices are shared (rank r gets CPU r mod 2, one poller each,
//! pinned), with 2 ranks they are disjoint. The 64-core cases (8 ranks on
//! one socket of a 2-socket machine) are the unit tests in src/placement/plan.rs.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A dataset and its catalog, shared by every run of a test.
struct Data {
    _dir: tempfile::TempDir,
    src: PathBuf,
    cat: PathBuf,
}

fn data() -> Data {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    gen("tiny", 64, &src);
    let cat = d.path().join("cat.ksc");
    ok(&["catalog", "--source", s(&src), "--out", s(&cat)]);
    Data { _dir: d, src, cat }
}

/// A fake 2-socket, 64-CPU sysfs: node 0 holds the even CPUs, node 1 the
/// odd ones (so the real CPUs 0 and 1 sit on different nodes), CPU c and
/// c+32 are hyperthread siblings.
fn fake_sysfs(dir: &Path) {
    let w = |rel: &str, text: &str| {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    w("devices/system/cpu/online", "0-63\n");
    let list = |odd: u32| {
        (0..64)
            .filter(|c| c % 2 == odd)
            .map(|c: u32| c.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    w("devices/system/node/node0/cpulist", &(list(0) + "\n"));
    w("devices/system/node/node1/cpulist", &(list(1) + "\n"));
    for c in 0..64u32 {
        let base = c % 32;
        w(
            &format!("devices/system/cpu/cpu{c}/topology/thread_siblings_list"),
            &format!("{},{}\n", base, base + 32),
        );
    }
}

/// Whether CPUs 0 and 1 can be used (taskset works and both are online).
fn two_cpus() -> bool {
    let o = Command::new("taskset").args(["-c", "0,1", "true"]).output();
    matches!(o, Ok(o) if o.status.success())
}

/// Starts `kspeed read --json` for one local rank under `taskset -c mask`.
fn start_rank(d: &Data, sysfs: &Path, mask: &str, env: &[(&str, String)], extra: &[&str]) -> Child {
    let mut c = Command::new("taskset");
    c.args([
        "-c",
        mask,
        kspeed_bin(),
        "read",
        "--json",
        "--progress=none",
    ])
    .args(["--source", s(&d.src), "--catalog", s(&d.cat)])
    .args(["--ring-bytes", "1MiB", "--no-mlock"])
    .args(extra)
    .env("KSPEED_SYSFS_ROOT", sysfs)
    .env("RUST_LOG", "warn")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for v in [
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "KSPEED_LOCAL_RANK",
        "KSPEED_LOCAL_WORLD_SIZE",
        // The rest of the launchers' variables (src/launcher.rs reads them
        // all, and checks them against each other).
        "RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_NODEID",
        "SLURM_NNODES",
    ] {
        c.env_remove(v);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("run taskset kspeed read")
}

fn torchrun(rank: u32, size: u32) -> Vec<(&'static str, String)> {
    vec![
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", size.to_string()),
    ]
}

/// One rank's result: its JSON placement and stderr.
struct Report {
    placement: serde_json::Value,
    stderr: String,
}

impl Report {
    fn cores(&self, key: &str) -> Vec<u32> {
        self.placement[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key} in {}", self.placement))
            .iter()
            .filter_map(|v| v.as_u64().map(|c| c as u32))
            .collect()
    }
}

fn finish(child: Child) -> Report {
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "kspeed read failed:\n{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out.lines().last().unwrap_or_default();
    let v: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    Report {
        placement: v["placement"].clone(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn run_ranks(d: &Data, sysfs: &Path, mask: &str, size: u32, extra: &[&str]) -> Vec<Report> {
    let children: Vec<Child> = (0..size)
        .map(|r| start_rank(d, sysfs, mask, &torchrun(r, size), extra))
        .collect();
    children.into_iter().map(finish).collect()
}

/// The one CPU the kernel lets thread `name` of process `pid` run on, read
/// from /proc once the thread has pinned itself; `None` if the process
/// ended first.
fn thread_cpus(pid: u32, name: &str, deadline: Instant) -> Option<Vec<u32>> {
    let task = PathBuf::from(format!("/proc/{pid}/task"));
    while Instant::now() < deadline {
        let Ok(dir) = std::fs::read_dir(&task) else {
            return None;
        };
        for t in dir.flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            if comm.trim() != name {
                continue;
            }
            let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
            let list = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
                .trim()
                .to_string();
            let cpus = kspeed::placement::parse_cpulist(&list).unwrap();
            // The thread pins itself as it starts: wait for that (the
            // mask it inherited has both CPUs).
            if cpus.len() == 1 {
                return Some(cpus);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("no thread {name} pinned to one CPU in process {pid} before the deadline");
}

#[test]
fn eight_local_ranks_share_two_cores_evenly_and_pin_there() {
    if !two_cpus() {
        return skip("needs CPUs 0 and 1 (taskset -c 0,1)");
    }
    let d = data();
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path());
    // The pollers idle ~9 s with the ring full, long enough to read their
    // affinity back from /proc while all 8 processes run.
    let children: Vec<Child> = (0..8)
        .map(|r| {
            start_rank(
                &d,
                sys.path(),
                "0,1",
                &torchrun(r, 8),
                &["--idle-ms", "6000"],
            )
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let seen: Vec<Option<Vec<u32>>> = children
        .iter()
        .map(|c| thread_cpus(c.id(), "kspeed-poller-0", deadline))
        .collect();
    let reports: Vec<Report> = children.into_iter().map(finish).collect();
    let mut per_core = [0; 2];
    let mut total_pollers = 0;
    for (r, rep) in reports.iter().enumerate() {
        let p = &rep.placement;
        assert_eq!(p["local_rank"], r as u64, "{p}");
        assert_eq!(p["local_world_size"], 8, "{p}");
        assert_eq!(p["local_rank_from"], "LOCAL_RANK/LOCAL_WORLD_SIZE", "{p}");
        // Fewer cores than ranks: each rank gets CPU r mod 2, shared.
        assert_eq!(rep.cores("slice_cores"), [r as u32 % 2], "{p}");
        assert_eq!(p["shared"], true, "{p}");
        assert_eq!(p["pollers"], 1, "{p}");
        assert_eq!(rep.cores("pinned_cores"), [r as u32 % 2], "{p}");
        assert!(p["warnings"].as_array().unwrap().is_empty(), "{p}");
        per_core[r % 2] += 1;
        total_pollers += p["pollers"].as_u64().unwrap();
        // The kernel's view of the poller thread.
        assert_eq!(
            seen[r].as_deref(),
            Some(&[r as u32 % 2][..]),
            "rank {r}'s poller runs elsewhere (or was not seen)"
        );
    }
    assert_eq!(per_core, [4, 4], "ranks spread evenly over the 2 cores");
    assert_eq!(
        total_pollers, 8,
        "one poller per rank (not a quarter of the cores each)"
    );
}

#[test]
fn two_local_ranks_get_disjoint_slices_within_the_mask() {
    if !two_cpus() {
        return skip("needs CPUs 0 and 1 (taskset -c 0,1)");
    }
    let d = data();
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path());
    let reports = run_ranks(&d, sys.path(), "0,1", 2, &[]);
    let s0 = reports[0].cores("slice_cores");
    let s1 = reports[1].cores("slice_cores");
    assert_eq!((s0.as_slice(), s1.as_slice()), (&[0][..], &[1][..]));
    let mut total = 0;
    for rep in &reports {
        assert_eq!(rep.placement["shared"], false, "{}", rep.placement);
        assert_eq!(rep.cores("pinned_cores"), rep.cores("slice_cores"));
        total += rep.placement["pollers"].as_u64().unwrap();
    }
    assert!(total <= 2, "{total} pollers on 2 cores");
}

#[test]
fn slices_come_from_the_numa_node_within_the_mask() {
    if !two_cpus() {
        return skip("needs CPUs 0 and 1 (taskset -c 0,1)");
    }
    let d = data();
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path());
    // Node 1 (odd CPUs): of the mask 0,1 only CPU 1; all 8 ranks share it.
    for rep in run_ranks(&d, sys.path(), "0,1", 8, &["--poller-numa-node", "1"]) {
        assert_eq!(rep.placement["numa_node"], 1, "{}", rep.placement);
        assert_eq!(rep.cores("slice_cores"), [1]);
        assert_eq!(rep.cores("pinned_cores"), [1]);
    }
    // The ring's node is the default: a ring bound to (real) node 0 puts
    // the pollers on node 0's CPUs of the fake layout.
    if Path::new("/sys/devices/system/node/node0").exists() {
        let rep = finish(start_rank(
            &d,
            sys.path(),
            "0,1",
            &torchrun(3, 8),
            &["--numa-node", "0"],
        ));
        assert_eq!(rep.placement["numa_node"], 0, "{}", rep.placement);
        assert_eq!(rep.cores("slice_cores"), [0]);
    }
    // Node 1 has no CPU in the mask: the whole mask, with a WARN.
    let rep = finish(start_rank(
        &d,
        sys.path(),
        "0",
        &torchrun(0, 8),
        &["--poller-numa-node", "1"],
    ));
    assert_eq!(rep.placement["numa_node"], serde_json::Value::Null);
    assert_eq!(rep.cores("slice_cores"), [0]);
    assert!(
        rep.stderr.contains("WARN") && rep.stderr.contains("NUMA node 1 has none"),
        "{}",
        rep.stderr
    );
}

#[test]
fn cgroup_cpuset_narrows_and_an_empty_slice_is_not_pinned() {
    if !two_cpus() {
        return skip("needs CPUs 0 and 1 (taskset -c 0,1)");
    }
    let d = data();
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path());
    let cg = sys.path().join("fs/cgroup/cpuset.cpus.effective");
    std::fs::create_dir_all(cg.parent().unwrap()).unwrap();
    std::fs::write(&cg, "1\n").unwrap();
    for rep in run_ranks(&d, sys.path(), "0,1", 2, &[]) {
        assert_eq!(rep.cores("slice_cores"), [1], "{}", rep.placement);
    }
    // No CPU of the mask in the cpuset: nothing to pin to.
    std::fs::write(&cg, "40-47\n").unwrap();
    let rep = finish(start_rank(&d, sys.path(), "0,1", &torchrun(0, 1), &[]));
    assert!(rep.cores("slice_cores").is_empty(), "{}", rep.placement);
    assert!(rep.cores("pinned_cores").is_empty(), "{}", rep.placement);
    assert_eq!(rep.placement["pollers"], 1);
    assert!(
        rep.stderr.contains("WARN") && rep.stderr.contains("not pinned"),
        "{}",
        rep.stderr
    );
}

#[test]
fn launchers_and_options_set_the_local_rank() {
    if !two_cpus() {
        return skip("needs CPUs 0 and 1 (taskset -c 0,1)");
    }
    let d = data();
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path());
    // (environment, extra flags, (local rank, local size, where from))
    type Case = (
        Vec<(&'static str, String)>,
        &'static [&'static str],
        (u64, u64, &'static str),
    );
    let cases: [Case; 6] = [
        (
            vec![
                ("MPI_LOCALRANKID", "1".into()),
                ("MPI_LOCALNRANKS", "2".into()),
            ],
            &[],
            (1, 2, "MPI_LOCALRANKID/MPI_LOCALNRANKS"),
        ),
        (
            vec![
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1".into()),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
            ],
            &[],
            (
                1,
                2,
                "OMPI_COMM_WORLD_LOCAL_RANK/OMPI_COMM_WORLD_LOCAL_SIZE",
            ),
        ),
        (
            vec![
                ("SLURM_LOCALID", "1".into()),
                ("SLURM_NTASKS_PER_NODE", "2".into()),
            ],
            &[],
            (1, 2, "SLURM_LOCALID/SLURM_NTASKS_PER_NODE"),
        ),
        (
            // torchrun started by srun: torchrun's variables win.
            vec![
                ("SLURM_LOCALID", "0".into()),
                ("SLURM_NTASKS_PER_NODE", "1".into()),
                ("LOCAL_RANK", "1".into()),
                ("LOCAL_WORLD_SIZE", "2".into()),
            ],
            &[],
            (1, 2, "LOCAL_RANK/LOCAL_WORLD_SIZE"),
        ),
        (
            torchrun(0, 8),
            &["--local-rank", "1", "--local-world-size", "2"],
            (1, 2, "option"),
        ),
        (
            // kspeed's own variables override the launcher's.
            vec![
                ("LOCAL_RANK", "0".into()),
                ("LOCAL_WORLD_SIZE", "8".into()),
                ("KSPEED_LOCAL_RANK", "1".into()),
                ("KSPEED_LOCAL_WORLD_SIZE", "2".into()),
            ],
            &[],
            (1, 2, "KSPEED_LOCAL_RANK/KSPEED_LOCAL_WORLD_SIZE"),
        ),
    ];
    for (env, extra, (rank, size, from)) in cases {
        let rep = finish(start_rank(&d, sys.path(), "0,1", &env, extra));
        let p = &rep.placement;
        assert_eq!(
            (p["local_rank"].as_u64(), p["local_world_size"].as_u64()),
            (Some(rank), Some(size)),
            "{p}"
        );
        assert_eq!(p["local_rank_from"], from, "{p}");
        assert_eq!(rep.cores("slice_cores"), [1], "{p}");
    }
}

/// A one-node loader reads only the local variables: a launcher's rank,
/// world or node variables it does not use do not fail it. Before, the
/// core placement ran the whole launcher parse and each of these was a
/// `BadLauncher` error.
#[test]
fn global_launcher_variables_do_not_fail_a_one_node_loader() {
    if !two_cpus() {
        return skip("needs CPUs 0 and 1 (taskset -c 0,1)");
    }
    let d = data();
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path());
    let cases: [(Vec<(&'static str, String)>, &str); 3] = [
        // RANK without WORLD_SIZE.
        (
            vec![
                ("RANK", "1".into()),
                ("LOCAL_RANK", "1".into()),
                ("LOCAL_WORLD_SIZE", "2".into()),
            ],
            "LOCAL_RANK/LOCAL_WORLD_SIZE",
        ),
        // An sbatch script without -n: SLURM_PROCID, no SLURM_NTASKS.
        (
            vec![
                ("SLURM_PROCID", "0".into()),
                ("SLURM_LOCALID", "1".into()),
                ("SLURM_TASKS_PER_NODE", "2".into()),
                ("SLURM_NODEID", "0".into()),
                ("SLURM_NNODES", "1".into()),
            ],
            "SLURM_LOCALID/SLURM_TASKS_PER_NODE",
        ),
        // A node index that is not a number.
        (
            vec![
                ("RANK", "1".into()),
                ("WORLD_SIZE", "2".into()),
                ("LOCAL_RANK", "1".into()),
                ("LOCAL_WORLD_SIZE", "2".into()),
                ("GROUP_RANK", "first".into()),
            ],
            "LOCAL_RANK/LOCAL_WORLD_SIZE",
        ),
    ];
    for (env, from) in cases {
        let p = finish(start_rank(&d, sys.path(), "0,1", &env, &[])).placement;
        assert_eq!(
            (p["local_rank"].as_u64(), p["local_world_size"].as_u64()),
            (Some(1), Some(2)),
            "{env:?}: {p}"
        );
        assert_eq!(p["local_rank_from"], from, "{p}");
    }
}

#[test]
fn bad_local_ranks_and_topology_are_named_errors() {
    if !two_cpus() {
        return skip("needs CPUs 0 and 1 (taskset -c 0,1)");
    }
    let d = data();
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path());
    let fails_with = |env: Vec<(&str, String)>, extra: &[&str], want: &str| {
        let o = start_rank(&d, sys.path(), "0,1", &env, extra)
            .wait_with_output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "wanted {want:?}:\n{}", text(&o));
    };
    fails_with(
        torchrun(8, 8),
        &[],
        "launcher environment (LOCAL_RANK=8, LOCAL_WORLD_SIZE=8): local rank 8 is not below local world size 8",
    );
    fails_with(
        vec![("LOCAL_RANK", "2".into())],
        &[],
        "launcher environment (LOCAL_RANK=2): LOCAL_WORLD_SIZE is not set while LOCAL_RANK is",
    );
    fails_with(
        vec![
            ("SLURM_LOCALID", "one".into()),
            ("SLURM_NTASKS_PER_NODE", "2".into()),
        ],
        &[],
        "launcher environment (SLURM_LOCALID=\"one\"): not a number",
    );
    fails_with(
        vec![],
        &["--local-rank", "4", "--local-world-size", "4"],
        "core placement local rank option: local rank 4 is not below local world size 4",
    );
    std::fs::write(
        sys.path().join("devices/system/node/node1/cpulist"),
        "1-x\n",
    )
    .unwrap();
    fails_with(vec![], &[], "node1/cpulist: \"x\" is not a CPU number");
}

/// The Rust API: builder options, `Stats::placement` and
/// `Loader::placement` agree, in process.
#[test]
fn rust_api_reports_the_placement_in_stats() {
    let d = data();
    let sys = tempfile::tempdir().unwrap();
    fake_sysfs(sys.path());
    let mask = kspeed::placement::affinity();
    let loader = kspeed::loader::LoaderBuilder::source(s(&d.src))
        .catalog(&d.cat)
        .ring_bytes(1 << 20)
        .local_rank(0, 1)
        .sysfs_root(sys.path())
        .poller_numa_node(Some(1))
        .build()
        .unwrap();
    let p = loader.placement().clone();
    let st = loader.finish().placement;
    assert_eq!((st.local_rank, st.local_world), (0, 1));
    assert_eq!(p.plan.local.origin, "option");
    // Node 1 of the fake layout is the odd CPUs: those of the mask, or the
    // whole mask (with a warning) when it has none.
    let odd: Vec<u32> = mask.iter().copied().filter(|c| c % 2 == 1).collect();
    if odd.is_empty() {
        assert_eq!(st.numa_node, None);
        assert_eq!(p.plan.warnings.len(), 1, "{:?}", p.plan.warnings);
    } else {
        assert_eq!(st.numa_node, Some(1));
        let mut slice = p.plan.slice.clone();
        slice.sort_unstable();
        assert_eq!(slice, odd);
    }
    assert_eq!(st.slice_cores as usize, p.plan.slice.len());
    assert_eq!(st.pollers as usize, p.pollers);
    assert_eq!(st.pollers as usize, p.pinned.len());
    assert_eq!(
        st.pinned_pollers as usize,
        p.pinned.iter().flatten().count()
    );
    assert_eq!(st.pinned_pollers, st.pollers, "every poller pinned: {p:?}");
    for c in p.pinned.iter().flatten() {
        assert!(p.plan.slice.contains(c) && mask.contains(c), "{p:?}");
    }
    // A local rank not below its size is a named error at build.
    let e = kspeed::loader::LoaderBuilder::source(s(&d.src))
        .catalog(&d.cat)
        .local_rank(2, 2)
        .build()
        .err()
        .expect("rank 2 of 2 is refused");
    assert!(matches!(e, kspeed::Error::BadPlacement { .. }), "{e}");
}
