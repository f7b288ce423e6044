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
    let mut out = Vec::new();
    for (name, n) in [("a", 300u64), ("b", 130)] {
        let src = dir.join(format!("src-{name}"));
        gen("tiny", n, &src);
        let sp = dir.join(format!("space-{name}"));
        ok(&["preload", "--source", s(&src), "--space", s(&sp)]);
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
    let mut job = None;
    for rank in 0..2 {
        let mut l = mix(&a, &b, weights_a, None).rank(rank, 2).build().unwrap();
        l.set_epoch(1).unwrap();
        for _ in 0..2 {
            assert!(l.next_batch().unwrap().is_some());
        }
        l.release_batch();
        job = Some(l.save_job_position());
    }
    let job = job.unwrap();
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

/// What an agent serving a mixture cannot do is named: a rank of one of
/// its spaces alone, or of its spaces in another order, is refused by the
/// agent (the dataset it reads is not the one served); a mixture with a
/// catalog is refused by the rank (`agent = required`); an agent given
/// several spaces with a node tier or a cache area does not start.
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
    for (flag, needle) in [
        (["--tier-bytes", "1MiB"], "--tier-bytes"),
        (["--cache-bytes", "1MiB"], "--cache-dir"),
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
