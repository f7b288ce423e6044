//! What an attached rank gets from `kspeed agent` beyond its samples,
//! with real rank processes: `verify_crc32c` done by the agent, its ring on
//! its NUMA node, the agent's read latencies in its stats, the agent's
//! reads through the page cache on a warm node, a block shuffle, and a rank written from
//! docs/AGENT.md alone (tests/foreign/attach_rank.py) reading exactly.
//! Every wait is on a condition with a deadline.

mod agent_support;
mod common;

use std::process::Command;
use std::time::Duration;

use agent_support::*;
use common::{s, text};

/// An attached rank's `verify_crc32c` (`kspeed read --verify`) is done by
/// the agent, which reads into the rank's ring: a byte flipped on disk is
/// the named `SampleCorrupt` naming the sample and its extent, as an
/// embedded rank's is, while a rank that does not ask reads the epoch
/// (the flag reaches the agent; before, it was dropped on the way).
#[test]
fn an_attached_rank_s_crc_check_is_done_by_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 300);
    let space = kspeed::dataset::Space::open(&sp).unwrap();
    let victim = 137;
    let loc = space.location(victim).unwrap();
    let ext = space.extent_path(loc.extent);
    drop(space);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&ext)
        .unwrap();
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, loc.offset + 10).unwrap();
    b[0] ^= 0x40;
    std::os::unix::fs::FileExt::write_all_at(&f, &b, loc.offset + 10).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let named = |o: &std::process::Output, how: &str| {
        assert_eq!(o.status.code(), Some(1), "{how}: {}", text(o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains(&format!("sample {victim} from {}", ext.display()))
                && err.contains("does not match the catalog's"),
            "{how}: {err}"
        );
        err.to_string()
    };
    let verify = |mut args: Vec<String>| {
        args.push("--verify".into());
        wait_output(spawn_read(&args), Duration::from_secs(60))
    };
    let err = named(&verify(attached_args(&sp, &sock, 0, 1, 1)), "attached");
    assert!(err.contains("SampleCorrupt"), "{err}");
    named(
        &verify(read_args(&sp, 0, 1, 1, &["--agent", "off"])),
        "embedded",
    );
    // Without --verify the agent does not check: the epoch is read whole.
    let (n, _) = finish(spawn_read(&attached_args(&sp, &sock, 0, 1, 1)));
    assert_eq!(n, 300);
}

/// An attached rank's ring is bound to its NUMA node (`numa_node`, or the
/// GPU's at `gpu_pci`) as an embedded ring is: the rank binds the memfd's
/// mapping before it faults the pages in, so they come from that node
/// (`/proc/self/numa_maps` says `bind:0` for the ring's memfd), and reads
/// stay exact; a node that cannot be bound is the named `Numa` error.
#[test]
fn an_attached_rank_s_ring_is_on_its_numa_node() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let built = kspeed::loader::LoaderBuilder::space(&sp)
        .agent(kspeed::loader::AgentMode::Required)
        .agent_socket(Some(sock.clone()))
        .batch_size(16)
        .landing(common::test_ring(1 << 20).numa_node(Some(0)))
        .build();
    let mut l = match built {
        Err(kspeed::Error::Numa { reason, .. }) if reason.contains("not permitted") => {
            return common::skip(&format!("mbind is not allowed here: {reason}"));
        }
        r => r.unwrap(),
    };
    // The ring's mapping: the one holding the first batch's bytes (other
    // tests in this process map attach rings of their own).
    let at = {
        let b = l.next_batch().unwrap().expect("a batch");
        b.get(0).bytes.as_ptr() as usize
    };
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let start = maps
        .lines()
        .find_map(|m| {
            let (lo, hi) = m.split_whitespace().next()?.split_once('-')?;
            let (lo, hi) = (
                usize::from_str_radix(lo, 16).ok()?,
                usize::from_str_radix(hi, 16).ok()?,
            );
            (lo <= at && at < hi).then_some(lo)
        })
        .expect("the batch's mapping");
    let numa = std::fs::read_to_string("/proc/self/numa_maps").unwrap();
    let ring = numa
        .lines()
        .find(|m| m.starts_with(&format!("{start:x} ")))
        .expect("the ring in numa_maps");
    assert!(
        ring.contains("kspeed-attach-ring") && ring.contains("bind:0"),
        "{ring}"
    );
    drop(l);
    let mut args = attached_args(&sp, &sock, 0, 1, 1);
    args.extend(["--numa-node".into(), "0".into(), "-v".into()]);
    let o = wait_output(spawn_read(&args), Duration::from_secs(60));
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("bound to NUMA node 0"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    assert_eq!(
        (
            v["samples"].as_u64().unwrap(),
            v["digest"].as_str().unwrap().to_string()
        ),
        embedded(&sp, 0, 1, 1)
    );
    // A node the machine does not have.
    let mut args = attached_args(&sp, &sock, 0, 1, 1);
    args.extend(["--numa-node".into(), "1000".into()]);
    let o = wait_output(spawn_read(&args), Duration::from_secs(60));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("cannot bind the landing ring to NUMA node 1000"),
        "{err}"
    );
}

/// An attached rank's read latencies are the agent's disk reads for it,
/// sent with each batch by power of two of µs (segment layout version 5):
/// as many as its disk reads, each at the middle of its power of two, in
/// order; they were all 0 before.
#[test]
fn an_attached_rank_reports_the_agent_s_read_latencies() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 600);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let o = wait_output(
        spawn_read(&attached_args(&sp, &sock, 0, 1, 2)),
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    let lat = &v["read_latency_us"];
    let n = |k: &str| lat[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
    assert_eq!(n("count"), v["disk_reads"].as_u64().unwrap(), "{v}");
    assert_eq!(n("count"), 1200, "{v}");
    assert!(
        n("p50") >= 1 && n("p50") <= n("p99") && n("p99") <= n("max"),
        "{v}"
    );
    // A bucket's middle: 1, or 3 x 2^j (to the histogram's 2 digits).
    let middle = |x: u64| {
        x == 1
            || (0..20).any(|j| {
                let m = 3u64 << j;
                x.abs_diff(m) * 100 <= m
            })
    };
    for k in ["p50", "p99", "max"] {
        assert!(middle(n(k)), "{k} {} is no bucket's middle: {v}", n(k));
    }
}

/// A rank that shuffles in blocks (`shuffle_block`) is served by the agent
/// (before, `auto` kept it embedded and `required` refused it): its ATTACH
/// is version 6, which carries the block, and the two ranks of a world of
/// 2 read, over two epochs and through the node tier, exactly what embedded
/// ranks do, which is not the whole-dataset shuffle's order.
#[test]
fn an_attached_rank_shuffles_in_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 600);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &["--tier-bytes", "64MiB", "--no-mlock"]);
    let block = |mut args: Vec<String>| {
        args.extend(["--shuffle-block".into(), "32".into()]);
        args
    };
    for rank in 0..2 {
        let (n, digest) = finish(spawn_read(&block(attached_args(&sp, &sock, rank, 2, 2))));
        let embedded_blocks = finish(spawn_read(&block(read_args(
            &sp,
            rank,
            2,
            2,
            &["--agent", "off"],
        ))));
        assert_eq!((n, digest.clone()), embedded_blocks, "rank {rank}");
        assert_eq!(n, 600, "rank {rank}");
        let (_, whole) = embedded(&sp, rank, 2, 2);
        assert_ne!(
            digest, whole,
            "rank {rank}: the block shuffle was not applied"
        );
    }
}

/// An agent from before a feature, played by a socket at `sock` that
/// takes `conns` attaches one after the other, reads each ATTACH (within
/// 30 s) and answers it with `answer(message)` (a REFUSED as that agent
/// would send it). Returns the messages it read.
fn play_old_agent(
    sock: &std::path::Path,
    conns: usize,
    answer: fn(&[u8]) -> Vec<u8>,
) -> std::thread::JoinHandle<Vec<Vec<u8>>> {
    let l = socket2::Socket::new(
        socket2::Domain::UNIX,
        socket2::Type::from(libc::SOCK_SEQPACKET),
        None,
    )
    .unwrap();
    l.bind(&socket2::SockAddr::unix(sock).unwrap()).unwrap();
    l.listen(4).unwrap();
    std::thread::spawn(move || {
        (0..conns)
            .map(|_| {
                let (c, _) = l.accept().unwrap();
                c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 512];
                let n = c.recv(&mut buf).unwrap();
                // SAFETY: recv initialised the first n bytes.
                let got: Vec<u8> = buf[..n]
                    .iter()
                    .map(|b| unsafe { b.assume_init() })
                    .collect();
                c.send(&answer(&got)).unwrap();
                got
            })
            .collect()
    })
}

/// A message's version (bytes 4-5) and an ATTACH's flags (bytes 80-83).
fn version_and_flags(m: &[u8]) -> (u16, u32) {
    (
        u16::from_le_bytes([m[4], m[5]]),
        u32::from_le_bytes(m[80..84].try_into().unwrap()),
    )
}

/// An agent that speaks version 5 only (one from before the block
/// shuffle) refuses a block-shuffling rank's version 6 ATTACH by its
/// version; the rank's `NoAgent` says the agent predates it and what to do.
/// A version 5 agent is played by a socket that answers as one does.
#[test]
fn an_agent_that_predates_block_shuffles_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 100);
    let sock = dir.path().join("old-agent.sock");
    let old = play_old_agent(&sock, 1, |m| {
        let version = version_and_flags(m).0;
        let reason = format!("message version {version}, this build speaks version 5");
        kspeed::agent::msg::encode_refused(5, kspeed::agent::msg::RefuseCode::Version, &reason)
            .to_vec()
    });
    let built = kspeed::loader::LoaderBuilder::space(&sp)
        .agent(kspeed::loader::AgentMode::Required)
        .agent_socket(Some(sock.clone()))
        .shuffle_block(16)
        .batch_size(8)
        .build();
    let seen = old.join().unwrap();
    assert_eq!((version_and_flags(&seen[0]).0, seen[0].len()), (6, 144));
    match built {
        Err(kspeed::Error::NoAgent { reason, .. }) => assert!(
            reason.contains("refused (version)")
                && reason.contains("predates shuffle_block in the agent"),
            "{reason}"
        ),
        r => panic!("{:?}", r.map(|_| ())),
    }
}

/// An old agent played by [`play_old_agent`]: it knows the ATTACH flags
/// in `known` and refuses any other bit as such an agent does (protocol,
/// "unknown flags"); an ATTACH it would take it refuses as busy, so the
/// test needs no real agent.
fn refuse_unknown(m: &[u8], known: u32) -> Vec<u8> {
    let (version, flags) = version_and_flags(m);
    let (code, reason) = if flags & !known != 0 {
        let r = format!(
            "unknown flags {:#x} in a version {version} ATTACH",
            flags & !known
        );
        (kspeed::agent::msg::RefuseCode::Protocol, r)
    } else {
        (
            kspeed::agent::msg::RefuseCode::Agent,
            "test agent: busy".to_string(),
        )
    };
    kspeed::agent::msg::encode_refused(version, code, &reason).to_vec()
}

/// The ATTACHes an old agent read: (version, flags 8, 16 and 32), each
/// checked to announce the segment those flags make (layout 8 with flag
/// 32, else 7 with flag 16, else 6 with flag 8, else 5): a fallback
/// attach sends a fresh one.
fn versions_and_new_flags(seen: Vec<Vec<u8>>) -> Vec<(u16, u32)> {
    let u32_at = |m: &[u8], at: usize| u32::from_le_bytes(m[at..at + 4].try_into().unwrap());
    seen.iter()
        .map(|m| {
            let (v, f) = version_and_flags(m);
            let (batch, slots) = (u32_at(m, 40), u32_at(m, 44));
            let segment_bytes = u64::from_le_bytes(m[72..80].try_into().unwrap());
            let views = if f & 8 != 0 { batch } else { 0 };
            let peer_waits = if f & 16 != 0 { 4 } else { 0 };
            let extras = if f & 32 != 0 { 12 } else { 0 };
            assert_eq!(
                segment_bytes,
                kspeed::agent::segment::segment_bytes_with(slots, views, peer_waits, extras),
                "flags {f:#x}"
            );
            (v, f & 56)
        })
        .collect()
}

/// An agent from before tier views (and peer waits) refuses a rank that
/// asks for them by the unknown ATTACH flags (protocol); the rank attaches
/// again at once without peer waits (and the extra words, which need
/// them), then without views (the samples then come in its ring): the
/// first ATTACH the old agent receives is version 5 with flags 8, 16 and
/// 32, the second with 8, the third with none, which this one refuses as
/// busy; the rank's error is that last refusal.
#[test]
fn an_agent_that_predates_tier_views_is_attached_without_them() {
    let seen = attach_to_an_old_agent(3, |m| refuse_unknown(m, 7));
    assert_eq!(seen, [(5, 56), (5, 8), (5, 0)]);
}

/// A rank asking for tier views attaches to an old agent that reads
/// `conns` attaches and answers each with `answer` (the last: busy); the
/// ATTACHes it read ([`versions_and_new_flags`]), the rank's error checked
/// to be that last refusal.
fn attach_to_an_old_agent(conns: usize, answer: fn(&[u8]) -> Vec<u8>) -> Vec<(u16, u32)> {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 100);
    let sock = dir.path().join("old-agent.sock");
    let old = play_old_agent(&sock, conns, answer);
    let built = kspeed::loader::LoaderBuilder::space(&sp)
        .agent(kspeed::loader::AgentMode::Required)
        .agent_socket(Some(sock.clone()))
        .tier_views(true)
        .batch_size(8)
        .build();
    let seen = versions_and_new_flags(old.join().unwrap());
    match built {
        Err(kspeed::Error::NoAgent { reason, .. }) => {
            assert!(reason.contains("test agent: busy"), "{reason}")
        }
        r => panic!("{:?}", r.map(|_| ())),
    }
    seen
}

/// An agent that knows tier views but not peer waits (ATTACH flag 16,
/// segment layout 7): the rank attaches again without them and the extra
/// words, keeping its views (the second ATTACH has flag 8 alone).
#[test]
fn an_agent_that_predates_peer_waits_is_attached_without_them() {
    let seen = attach_to_an_old_agent(2, |m| refuse_unknown(m, 15));
    assert_eq!(seen, [(5, 56), (5, 8)]);
}

/// An agent that knows peer waits but not the extra words (ATTACH flag
/// 32, segment layout 8): the rank attaches again with layout 7, keeping
/// its views and peer waits (the second ATTACH has flags 8 and 16).
#[test]
fn an_agent_that_predates_extra_words_is_attached_without_them() {
    let seen = attach_to_an_old_agent(2, |m| refuse_unknown(m, 31));
    assert_eq!(seen, [(5, 56), (5, 24)]);
}

/// Runs tests/foreign/attach_rank.py (a rank written from docs/AGENT.md
/// alone) against the agent at `sock` with seed 11, a 256 KiB ring and
/// epochs 1 and 2, plus `more`; returns its JSON report, checked `ok`.
fn foreign_rank(sock: &std::path::Path, sp: &std::path::Path, more: &[&str]) -> serde_json::Value {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/foreign/attach_rank.py");
    let child = std::process::Command::new("python3")
        .arg(&script)
        .args(["--socket", s(sock), "--space", s(sp), "--seed", "11"])
        .args(["--ring-bytes", "256KiB", "--epoch", "1", "--epochs", "2"])
        .args(more)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn python3");
    let o = wait_output(child, Duration::from_secs(120));
    let out = String::from_utf8_lossy(&o.stdout);
    let last = out.lines().last().unwrap_or_default();
    let r: serde_json::Value =
        serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
    assert!(o.status.success() && r["ok"] == true, "{r}\n{}", text(&o));
    r
}

/// A rank written from docs/AGENT.md alone, in Python with the standard
/// library (tests/foreign/attach_rank.py: its own memfds, seals, segment,
/// ready words, release marks and futexes, its own sampler from
/// docs/FORMAT.md), attaches to the agent and reads two epochs whose
/// batches wrap a small ring: every sample's bytes are the catalog's, in
/// the sampler's order, each once, and its digest is `kspeed read`'s
/// embedded one. A layout or a rule the docs do not say fails here.
#[test]
fn a_rank_written_from_the_docs_alone_reads_exactly() {
    if Command::new("python3").arg("--version").output().is_err() {
        return common::skip("python3 is not installed");
    }
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 300);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let r = foreign_rank(&sock, &sp, &["--rank", "1", "--world", "2", "--batch", "7"]);
    assert_eq!(r["samples"], 300, "{r}");
    let mut args = read_args(&sp, 1, 2, 2, &["--agent", "off"]);
    let at = args.iter().position(|a| a == "--batch-size").unwrap() + 1;
    args[at] = "7".into();
    let (n, digest) = finish(spawn_read(&args));
    assert_eq!(n, 300);
    assert_eq!(r["digest_candidates"]["u64"], digest.as_str(), "{r}");
}

/// The same rank written from the docs alone asking for the extra words
/// (`--extras`: ATTACH flags 16 and 32, a version 8 segment with the
/// peer-wait and extras tables at the offsets docs/AGENT.md gives): over
/// a partial space (a third held, the rest read from its source), its two
/// epochs are exact, and the source bytes its batches' extra words add up
/// to are the embedded read's `source_bytes`, with the same source reads.
#[test]
fn a_rank_written_from_the_docs_alone_takes_the_extra_words() {
    if Command::new("python3").arg("--version").output().is_err() {
        return common::skip("python3 is not installed");
    }
    let dir = tempfile::tempdir().unwrap();
    let (sp, _) = partial_space(dir.path());
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &[]);
    let r = foreign_rank(&sock, &sp, &["--extras"]);
    assert_eq!(r["samples"], 1200, "{r}");
    let o = wait_output(
        spawn_read(&read_args(&sp, 0, 1, 2, &["--agent", "off"])),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json report");
    assert!(v["source_bytes"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(
        (&r["source_reads"], &r["source_bytes"]),
        (&v["source_reads"], &v["source_bytes"]),
        "the foreign rank's {r}"
    );
    assert_eq!(r["digest_candidates"]["u64"], v["digest"], "{r}");
}

/// The same rank written from the docs alone, with tier views
/// (tests/foreign/attach_rank.py `--tier-views`: ATTACH flag 8, a version 6
/// segment with a view table, the node tier's read-only memfd taken with
/// ATTACHED and mapped, each sample read from the ring or the tier as its
/// view word says): against an agent with a node tier, two epochs, every
/// sample's bytes the catalog's, the second epoch mostly from the tier,
/// and the digest the embedded read's.
#[test]
fn a_rank_written_from_the_docs_alone_takes_tier_views() {
    if Command::new("python3").arg("--version").output().is_err() {
        return common::skip("python3 is not installed");
    }
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 300);
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&sp, &sock, &["--tier-bytes", "64MiB", "--no-mlock"]);
    let r = foreign_rank(
        &sock,
        &sp,
        &[
            "--rank",
            "0",
            "--world",
            "1",
            "--batch",
            "16",
            "--tier-views",
        ],
    );
    assert_eq!(r["samples"], 600, "{r}");
    assert!(r["tier_bytes"].as_u64().unwrap_or(0) > 0, "{r}");
    // Epoch 1 filled the tier: epoch 2 is views but for what was read
    // ahead before its member was filled.
    let views = r["tier_views"].as_u64().unwrap_or(0);
    assert!(views >= 250, "{views} views in {r}");
    let args = read_args(&sp, 0, 1, 2, &["--agent", "off"]);
    let (n, digest) = finish(spawn_read(&args));
    assert_eq!(n, 600);
    assert_eq!(r["digest_candidates"]["u64"], digest.as_str(), "{r}");
}

/// The agent reads a rank's samples through the page cache when the space
/// is cached as the rank attaches (`--read-page-cache auto`, the default, as an
/// embedded loader's `page_cache`), with O_DIRECT when it is not, and
/// always with O_DIRECT under `--read-page-cache off`; byte-exact each way.
#[test]
fn the_agent_reads_a_cached_space_through_the_page_cache() {
    let dir = tempfile::tempdir().unwrap();
    let sp = space(dir.path(), 400);
    let extents: Vec<std::fs::File> = std::fs::read_dir(sp.join("extents"))
        .unwrap()
        .map(|e| std::fs::File::open(e.unwrap().path()).unwrap())
        .collect();
    let cache = |keep: bool| {
        for f in &extents {
            if keep {
                std::io::copy(&mut &*f, &mut std::io::sink()).unwrap();
            } else {
                use std::os::fd::AsRawFd;
                // SAFETY: a valid descriptor; advice only.
                let rc =
                    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
                assert_eq!(rc, 0);
            }
        }
    };
    let want = embedded(&sp, 0, 1, 1);
    let sock = dir.path().join("agent.sock");
    // One epoch attached, exact, and the agent's line on how it read it.
    let read_saying = |agent: &Agent, line: &str| {
        assert_eq!(
            finish(spawn_read(&attached_args(&sp, &sock, 0, 1, 1))),
            want
        );
        agent.log.wait_for(&[line], Duration::from_secs(10));
    };
    let agent = Agent::start(&sp, &sock, &[]);
    cache(true);
    read_saying(
        &agent,
        "agent: rank 0 reads through the page cache (page_cache auto: 100% of",
    );
    cache(false);
    read_saying(
        &agent,
        "agent: rank 0 reads with O_DIRECT (page_cache auto:",
    );
    drop(agent);
    let agent = Agent::start(&sp, &sock, &["--read-page-cache", "off"]);
    cache(true);
    read_saying(&agent, "agent: rank 0 reads with O_DIRECT (page_cache off)");
}
