//! A mixture of datasets read through `kspeed agent`: an agent given
//! several spaces (`--space A --space B`) serves ranks that mix exactly
//! those spaces, in that order, with any weights (ATTACH version 6 carries
//! each dataset's count per epoch and where the mixed order starts). Real
//! agent processes; every wait is on a condition with a deadline.

mod agent_support;
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use agent_support::*;
use common::{gen, ok, s, text};
use kspeed::dataset::Catalog;
use kspeed::loader::{AgentMode, Loader, LoaderBuilder};
use kspeed::sampler::Weight;

/// Two spaces of other sizes (so other catalogs): 300 and 130 samples.
fn two_spaces(dir: &Path) -> (PathBuf, PathBuf, Vec<Catalog>) {
    spaces_aligned(dir, [4096, 4096])
}

/// [`two_spaces`] with these `align_bytes`.
fn spaces_aligned(dir: &Path, align: [u32; 2]) -> (PathBuf, PathBuf, Vec<Catalog>) {
    let mut out = Vec::new();
    for ((name, n), a) in [("a", 300u64), ("b", 130)].into_iter().zip(align) {
        let src = dir.join(format!("src-{name}"));
        gen("tiny", n, &src);
        let sp = dir.join(format!("space-{name}"));
        let a = a.to_string();
        ok(&[
            "preload",
            "--source",
            s(&src),
            "--space",
            s(&sp),
            "--align-bytes",
            &a,
        ]);
        out.push(sp);
    }
    let cats = out
        .iter()
        .map(|sp| Catalog::open(&sp.join("catalog.ksc")).unwrap())
        .collect();
    (out[0].clone(), out[1].clone(), cats)
}

fn mix(a: &Path, b: &Path, w: [Weight; 2], agent: Option<&Path>) -> LoaderBuilder {
    let l = LoaderBuilder::mix([(s(a), w[0]), (s(b), w[1])])
        .batch_size(16)
        .seed(5)
        .landing(common::test_ring(1 << 20));
    match agent {
        Some(sock) => l
            .agent(AgentMode::Required)
            .agent_socket(Some(sock.to_path_buf())),
        None => l.agent(AgentMode::Off),
    }
}

/// (dataset, id) of every sample to the end of the current epoch, each
/// checked byte for byte against its dataset's catalog.
fn rest_of_epoch(l: &mut Loader, cats: &[Catalog]) -> Vec<(u32, u64)> {
    let offsets = l.dataset_offsets().to_vec();
    let mut got = Vec::new();
    while let Some(b) = l.next_batch().unwrap() {
        for smp in b.iter() {
            let d = smp.dataset as usize;
            let c = cats[d].sample(smp.id - offsets[d]);
            assert_eq!(
                crc32c::crc32c(smp.bytes),
                c.crc32c,
                "dataset {d} id {}",
                smp.id
            );
            got.push((smp.dataset, smp.id));
        }
    }
    got
}

fn epochs(l: &mut Loader, from: u64, n: u64, cats: &[Catalog]) -> Vec<(u32, u64)> {
    let mut all = Vec::new();
    for e in from..from + n {
        l.set_epoch(e).unwrap();
        all.extend(rest_of_epoch(l, cats));
    }
    all
}

/// Each rank of a world of 2 reads, through an agent serving both spaces,
/// exactly what an embedded rank reads over two epochs (proportions with
/// an epoch size, then repeat/choose counts: the agent fixes the spaces,
/// not the weights), byte-exact, and it is attached.
#[test]
fn a_mixture_is_read_through_the_agent_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, cats) = two_spaces(dir.path());
    let sock = dir.path().join("agent.sock");
    let agent = Agent::start(&a, &sock, &["--space", s(&b)]);
    for (w, size) in [
        (
            [Weight::Proportion(0.7), Weight::Proportion(0.3)],
            Some(200),
        ),
        ([Weight::Choose(50), Weight::Repeat(2.0)], None),
    ] {
        for rank in 0..2 {
            let build = |agent: Option<&Path>| {
                let l = mix(&a, &b, w, agent).rank(rank, 2);
                match size {
                    Some(n) => l.mix_epoch_size(n),
                    None => l,
                }
                .build()
                .unwrap()
            };
            let mut attached = build(Some(&sock));
            assert!(attached.attached());
            let got = epochs(&mut attached, 1, 2, &cats);
            let mut embedded = build(None);
            assert!(!embedded.attached());
            let want = epochs(&mut embedded, 1, 2, &cats);
            assert_eq!(got, want, "rank {rank}, weights {w:?}");
            let per_epoch = size.unwrap_or(50 + 260);
            assert_eq!(got.len() as u64, 2 * per_epoch.div_ceil(2), "{w:?}");
            assert!(got.iter().any(|x| x.0 == 0) && got.iter().any(|x| x.0 == 1));
        }
    }
    drop(agent);
}

/// The node tier over a mixture's spaces (`kspeed agent --space A --space
/// B --tier-bytes`; it was refused at the agent's start): a job whose
/// weights draw the 130-sample space 4 times an epoch on 2 ranks of this
/// node has the tier chosen by the node's draws (that space first: the
/// tier holds it and about one more sample), so after rank 0's three
/// epochs rank 1 reads only the other space from disk and every draw of
/// the upsampled one comes from the tier; both ranks byte-exact and in
/// order against embedded ranks.
#[test]
fn the_node_tier_holds_what_a_mixture_draws_again() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, cats) = two_spaces(dir.path());
    let b_bytes: u64 = (0..cats[1].len())
        .map(|i| u64::from(cats[1].sample(i).len).next_multiple_of(64))
        .sum();
    // The members chosen again fit in the slots' bytes taken at the start
    // (in id order: A's samples, which may leave up to a slot unused).
    let a_largest = (0..cats[0].len())
        .map(|i| u64::from(cats[0].sample(i).len))
        .max();
    let sock = dir.path().join("agent.sock");
    let tier = (b_bytes + a_largest.unwrap().next_multiple_of(64)).to_string();
    let agent = Agent::start(
        &a,
        &sock,
        &["--space", s(&b), "--tier-bytes", &tier, "--no-mlock"],
    );
    let w = [Weight::Choose(50), Weight::Repeat(4.0)];
    for rank in 0..2 {
        let build = |agent: Option<&Path>| {
            mix(&a, &b, w, agent)
                .rank(rank, 2)
                .local_rank(rank, 2)
                .end_epoch(Some(3))
                .build()
                .unwrap()
        };
        let mut attached = build(Some(&sock));
        assert!(attached.attached());
        let got = epochs(&mut attached, 0, 3, &cats);
        let st = attached.stats();
        drop(attached);
        let want = epochs(&mut build(None), 0, 3, &cats);
        assert_eq!(got, want, "rank {rank}");
        let drawn_b = got.iter().filter(|x| x.0 == 1).count() as u64;
        let drawn_a = got.len() as u64 - drawn_b;
        assert_eq!(
            st.disk_reads + st.tier_hits,
            got.len() as u64,
            "rank {rank}: every sample read or a tier hit"
        );
        if rank == 0 {
            // Each of B's samples is read once to fill its member (or a
            // few times, while its first read is in flight).
            assert!(
                st.tier_hits >= drawn_b - 2 * cats[1].len(),
                "rank 0: {} tier hits of {drawn_b} draws of B",
                st.tier_hits
            );
        } else {
            assert!(
                st.disk_reads <= drawn_a && st.disk_reads >= drawn_a / 2,
                "rank 1: {} disk reads, {} tier hits: only A ({drawn_a} draws) from disk, \
                 every draw of B ({drawn_b}) from the tier",
                st.disk_reads,
                st.tier_hits
            );
        }
    }
    agent.log.wait_for(
        &["node memory tier chosen by the reads of ranks 0..2 of 2"],
        Duration::from_secs(10),
    );
    drop(agent);
}

/// Spaces of other alignments (4096 and 512 bytes) mixed, in either
/// order: the ring's slots take the largest, and each space is read in
/// blocks of its own, so its last sample is not read past its extent's
/// end (it was: `ShortRead` on the 512-byte space's last sample, embedded
/// as attached); every sample of two epochs byte-exact, attached as
/// embedded.
#[test]
fn spaces_of_other_alignments_mix() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, _) = spaces_aligned(dir.path(), [4096, 512]);
    let cat = |sp: &Path| Catalog::open(&sp.join("catalog.ksc")).unwrap();
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&a, &sock, &["--space", s(&b)]);
    let sock2 = dir.path().join("agent2.sock");
    let _agent2 = Agent::start(&b, &sock2, &["--space", s(&a)]);
    let w = [Weight::Repeat(1.0), Weight::Repeat(2.0)];
    for (first, second, sock) in [(&a, &b, &sock), (&b, &a, &sock2)] {
        let cats = [cat(first), cat(second)];
        let mut attached = mix(first, second, w, Some(sock)).build().unwrap();
        let got = epochs(&mut attached, 1, 2, &cats);
        let mut embedded = mix(first, second, w, None).build().unwrap();
        let want = epochs(&mut embedded, 1, 2, &cats);
        assert_eq!(got, want);
        let per_epoch = if first == &a { 300 + 260 } else { 130 + 600 };
        assert_eq!(got.len(), 2 * per_epoch);
    }
}

/// The job position (`KSPDMIX1`) of a world of 2 embedded ranks that
/// each took two batches of epoch 1 with weights `w`.
fn two_batches_of_epoch_1(a: &Path, b: &Path, w: [Weight; 2]) -> Vec<u8> {
    let mut job = None;
    for rank in 0..2 {
        let mut l = mix(a, b, w, None).rank(rank, 2).build().unwrap();
        l.set_epoch(1).unwrap();
        for _ in 0..2 {
            assert!(l.next_batch().unwrap().is_some());
        }
        l.release_batch();
        job = Some(l.save_job_position());
    }
    job.unwrap()
}

/// A job that read part of epoch 1 with weights A on 2 ranks resumes its
/// job position (`KSPDMIX1`) on 3 ranks with weights B: attached ranks
/// deal the rest of the epoch as embedded ones (each dataset going on from
/// what A used: the skips travel in ATTACH), then the next epoch; and a
/// rank position saved by an attached rank resumes in a fresh attached
/// loader where the embedded one does.
#[test]
fn a_mixture_resumed_under_new_weights_through_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, cats) = two_spaces(dir.path());
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&a, &sock, &["--space", s(&b)]);
    let weights_a = [Weight::Choose(120), Weight::Choose(60)];
    let weights_b = [Weight::Choose(200), Weight::Choose(100)];
    let job = two_batches_of_epoch_1(&a, &b, weights_a);
    for rank in 0..3 {
        let run = |agent: Option<&Path>| {
            let mut l = mix(&a, &b, weights_b, agent).rank(rank, 3).build().unwrap();
            l.restore_job_position(&job).unwrap();
            let mut got = rest_of_epoch(&mut l, &cats);
            got.extend(epochs(&mut l, 2, 1, &cats));
            got
        };
        let (got, want) = (run(Some(&sock)), run(None));
        assert_eq!(got, want, "rank {rank}");
        assert!(!got.is_empty());
    }
    // A rank position one batch into the rest under B, saved attached.
    let saved = {
        let mut l = mix(&a, &b, weights_b, Some(&sock))
            .rank(1, 3)
            .build()
            .unwrap();
        l.restore_job_position(&job).unwrap();
        assert!(l.next_batch().unwrap().is_some());
        l.release_batch();
        l.save_position()
    };
    let run = |agent: Option<&Path>| {
        let mut l = mix(&a, &b, weights_b, agent).rank(1, 3).build().unwrap();
        l.restore_job_position(&job).unwrap();
        l.restore_position(&saved).unwrap();
        rest_of_epoch(&mut l, &cats)
    };
    let (got, want) = (run(Some(&sock)), run(None));
    assert_eq!(got, want);
    assert!(!got.is_empty());
}

/// Rank positions around a job resumed inside an epoch under the same
/// weights: the rank's deal starts at its job position while the mixed
/// order keeps the epoch it resumed in, and the agent deals the same (it
/// took the mixed order's start for the job position: a fresh loader's
/// `restore_position` got the epoch from its first entry, and a later
/// epoch's position was refused). Each case attached against embedded:
/// a fresh loader restoring a rank position, a fresh loader restoring it
/// as a job position, and a resumed loader restoring a position of the
/// next epoch.
#[test]
fn rank_positions_of_a_resumed_mixture_through_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, cats) = two_spaces(dir.path());
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&a, &sock, &["--space", s(&b)]);
    let w = [Weight::Choose(120), Weight::Choose(60)];
    let job = two_batches_of_epoch_1(&a, &b, w);
    // Rank 1 of 3 one batch into the rest of epoch 1, and one batch into
    // epoch 2.
    let (in_epoch_1, in_epoch_2) = {
        let mut l = mix(&a, &b, w, None).rank(1, 3).build().unwrap();
        l.restore_job_position(&job).unwrap();
        assert!(l.next_batch().unwrap().is_some());
        l.release_batch();
        let one = l.save_position();
        rest_of_epoch(&mut l, &cats);
        l.set_epoch(2).unwrap();
        assert!(l.next_batch().unwrap().is_some());
        l.release_batch();
        (one, l.save_position())
    };
    type Case<'a> = (&'a str, &'a dyn Fn(&mut Loader));
    let cases: [Case; 3] = [
        ("restore_position", &|l| {
            l.restore_position(&in_epoch_1).unwrap()
        }),
        ("a rank position as the job's", &|l| {
            l.restore_job_position(&in_epoch_1).unwrap()
        }),
        ("the next epoch's position after a resume", &|l| {
            l.restore_job_position(&job).unwrap();
            l.restore_position(&in_epoch_2).unwrap();
        }),
    ];
    for (what, restore) in cases {
        let run = |agent: Option<&Path>| {
            let mut l = mix(&a, &b, w, agent).rank(1, 3).build().unwrap();
            restore(&mut l);
            let e = l.position().epoch;
            let mut got = rest_of_epoch(&mut l, &cats);
            got.extend(epochs(&mut l, e + 1, 1, &cats));
            got
        };
        let (got, want) = (run(Some(&sock)), run(None));
        assert!(!want.is_empty(), "{what}");
        assert_eq!(got, want, "{what}");
    }
}

/// A rank written from docs/AGENT.md and docs/FORMAT.md alone, in Python
/// with the standard library (tests/foreign/attach_mix_rank.py: its own
/// version 6 ATTACH, mixture identity and mixing function), reads a
/// mixture through the agent over two epochs that wrap a small ring, each
/// rank of 2 with two kinds of weights: every sample's bytes are its
/// catalog's, in the mixing function's order, and its digest is `kspeed
/// read --mix`'s embedded one. It checks FORMAT.md's check values first.
#[test]
fn a_mixture_rank_written_from_the_docs_alone_reads_exactly() {
    if Command::new("python3").arg("--version").output().is_err() {
        return common::skip("python3 is not installed");
    }
    let dir = tempfile::tempdir().unwrap();
    let (a, b, _) = two_spaces(dir.path());
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&a, &sock, &["--space", s(&b)]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/foreign/attach_mix_rank.py");
    let run = |args: &[&str]| {
        let child = Command::new("python3")
            .arg(&script)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn python3");
        let o = wait_output(child, Duration::from_secs(120));
        let out = String::from_utf8_lossy(&o.stdout);
        let last = out.lines().last().unwrap_or_default().to_string();
        (o, last)
    };
    let (o, _) = run(&["--selftest"]);
    assert!(o.status.success(), "selftest: {}", text(&o));
    for (weights, mix) in [
        (
            "choose=50,choose=40",
            format!("{}:choose=50,{}:choose=40", s(&a), s(&b)),
        ),
        (
            "repeat=1,repeat=2",
            format!("{}:repeat=1,{}:repeat=2", s(&a), s(&b)),
        ),
    ] {
        for rank in ["0", "1"] {
            let (o, last) = run(&[
                "--socket",
                s(&sock),
                "--space",
                s(&a),
                "--space",
                s(&b),
                "--weights",
                weights,
                "--rank",
                rank,
                "--world",
                "2",
                "--batch",
                "8",
                "--seed",
                "11",
                "--ring-bytes",
                "256KiB",
                "--epoch",
                "1",
                "--epochs",
                "2",
            ]);
            let r: serde_json::Value =
                serde_json::from_str(&last).unwrap_or_else(|e| panic!("{e}: {}", text(&o)));
            assert!(o.status.success() && r["ok"] == true, "{r}\n{}", text(&o));
            let read = Command::new(common::kspeed_bin())
                .args([
                    "read",
                    "--progress=none",
                    "--json",
                    "--digest",
                    "--agent",
                    "off",
                ])
                .args([
                    "--mix", &mix, "--rank", rank, "--world", "2", "--seed", "11",
                ])
                .args(["--batch-size", "8", "--ring-bytes", "256KiB"])
                .args(["--epochs", "2", "--start-epoch", "1"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let e = wait_output(read, Duration::from_secs(60));
            assert!(e.status.success(), "{}", text(&e));
            let v: serde_json::Value = serde_json::from_slice(&e.stdout).unwrap();
            assert_eq!(r["samples"], v["samples"], "{weights} rank {rank}: {r}");
            assert_eq!(
                r["digest_candidates"]["u64"], v["digest"],
                "{weights} rank {rank}: {r}"
            );
        }
    }
}

/// What an agent serving a mixture cannot do is named: a rank of one of
/// its spaces alone, or of its spaces in another order, is refused by the
/// agent (the dataset it reads is not the one served); a mixture with a
/// catalog is refused by the rank (`agent = required`); an agent given
/// several spaces with a cache area or a partial space does not start.
#[test]
fn what_an_agent_serving_a_mixture_refuses_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, _) = two_spaces(dir.path());
    let sock = dir.path().join("agent.sock");
    let _agent = Agent::start(&a, &sock, &["--space", s(&b)]);
    let refused = |built: kspeed::Result<Loader>, needle: &str| match built {
        Err(kspeed::Error::NoAgent { reason, .. }) => {
            assert!(reason.contains(needle), "{reason}")
        }
        r => panic!("{:?}", r.map(|_| ())),
    };
    refused(
        LoaderBuilder::space(&a)
            .agent(AgentMode::Required)
            .agent_socket(Some(sock.clone()))
            .batch_size(8)
            .build(),
        "a mixture of 2 spaces",
    );
    let w = [Weight::Repeat(1.0); 2];
    refused(
        LoaderBuilder::mix([(s(&b), w[0]), (s(&a), w[1])])
            .agent(AgentMode::Required)
            .agent_socket(Some(sock.clone()))
            .batch_size(8)
            .build(),
        "a mixture of 2 spaces",
    );
    let cat = dir.path().join("b.ksc");
    std::fs::copy(b.join("catalog.ksc"), &cat).unwrap();
    match LoaderBuilder::mix([(s(&a), w[0]), (s(&cat), w[1])])
        .agent(AgentMode::Required)
        .agent_socket(Some(sock.clone()))
        .batch_size(8)
        .build()
    {
        Err(kspeed::Error::InvalidConfig(why)) => {
            assert!(why.contains("a mixture of spaces"), "{why}")
        }
        r => panic!("{:?}", r.map(|_| ())),
    }
    // A partial space (the rest in its source) among them.
    let partial = dir.path().join("partial");
    ok(&[
        "preload",
        "--source",
        s(&dir.path().join("src-b")),
        "--space",
        s(&partial),
        "--max-bytes",
        "64KiB",
    ]);
    let p = s(&partial);
    for (flag, needle) in [
        (["--cache-bytes", "1MiB"], "--cache-dir"),
        (["--space", p], "a partial space"),
    ] {
        let mut cmd = Command::new(common::kspeed_bin());
        cmd.args(["agent", "--space", s(&a), "--space", s(&b)])
            .args(["--socket", s(&dir.path().join("other.sock"))])
            .args(flag);
        if needle == "--cache-dir" {
            cmd.args(["--cache-dir", s(&dir.path().join("cache"))]);
        }
        let child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let o = wait_output(child, Duration::from_secs(30));
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains(needle) && err.contains("mixture"),
            "{needle}: {err}"
        );
    }
}

/// docs/FORMAT.md's check value for a mixture's identity (a rank written
/// from the docs sends it as its ATTACH's dataset_id).
#[test]
fn the_mixture_identity_check_value_is_the_docs() {
    assert_eq!(
        kspeed::dataset::mixture_identity(&[0x1111_1111, 0x2222_2222]),
        0x5f6a_1ee6
    );
}
