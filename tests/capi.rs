//! The C ABI from C: tests/c/capi_test.c (and sized_structs_test.c,
//! elastic_test.c, elastic_cpp.cpp, batch_lifetime.cpp), compiled against include/kspeed.h
//! and the freshly built libkspeed.so, run plainly, under AddressSanitizer
//! and under valgrind (each skipped with a message when the tool is missing).

mod agent_support;
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Compiles the C test; None (with a message) when gcc is missing. With
/// the `test-panic` feature (scripts/test.sh enables it) the library
/// exports `ksp_test_panic` and the test checks the panic boundary.
fn compile(out: &Path, extra: &[&str]) -> Option<PathBuf> {
    let mut flags = extra.to_vec();
    if cfg!(feature = "test-panic") {
        flags.push("-DKSP_TEST_PANIC");
    }
    compile_with("gcc", "-std=c11", "tests/c/capi_test.c", out, &flags)
}

struct Data {
    _tmp: tempfile::TempDir,
    space: PathBuf,
    src: PathBuf,
    work: PathBuf,
}

fn data() -> Data {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 200, &src);
    let space = tmp.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&space)]);
    let work = tmp.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    Data {
        _tmp: tmp,
        space,
        src,
        work,
    }
}

fn run(prog: &[&str], bin: &Path, d: &Data, env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(prog[0]);
    cmd.args(&prog[1..])
        .arg(bin)
        .arg(&d.space)
        .arg(&d.src)
        .arg(&d.work);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the C test")
}

fn assert_passed(o: &std::process::Output, what: &str) {
    let text = format!(
        "{what}: status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{text}");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("all checks passed"),
        "{text}"
    );
}

/// The C++ wrapper's batches release only their own batch:
/// `while ((b = loader.next_batch()))` and holding an older Batch past the
/// next next_batch(), with a ring just big enough for a batch and a CRC32C
/// check of every sample (tests/c/batch_lifetime.cpp).
#[test]
fn cpp_batches_release_only_their_own() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    gen("tiny", 600, &src);
    let space = tmp.path().join("space");
    ok(&["preload", "--source", s(&src), "--space", s(&space)]);
    let Some(bin) = compile_with(
        "g++",
        "-std=c++17",
        "tests/c/batch_lifetime.cpp",
        &tmp.path().join("batch_lifetime"),
        &[],
    ) else {
        return;
    };
    let o = Command::new(&bin).arg(&space).output().unwrap();
    assert_passed(&o, "C++ batch lifetimes");
}

/// Compiles `tests/c/{src}` under AddressSanitizer and UBSan and runs it on
/// the test space (`detect_leaks` as given); `None` when the compiler is
/// missing (`compile_with` says so).
fn run_under_asan(
    d: &Data,
    cc: &str,
    std: &str,
    src: &str,
    detect_leaks: bool,
) -> Option<std::process::Output> {
    let stem = src.rsplit_once('.').map_or(src, |(s, _)| s);
    let bin = compile_with(
        cc,
        std,
        &format!("tests/c/{src}"),
        &d.work.join(stem),
        &["-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
    )?;
    let leaks = u8::from(detect_leaks);
    Some(
        Command::new(&bin)
            .arg(&d.space)
            .env(
                "ASAN_OPTIONS",
                format!("detect_leaks={leaks}:abort_on_error=0:exitcode=23"),
            )
            .output()
            .unwrap(),
    )
}

/// A C++ `kspeed::Batch` may outlive its `kspeed::Loader`
/// (tests/c/batch_outlives_loader.cpp, under AddressSanitizer with leak
/// checking): the batch's bytes stay valid and byte-exact after the
/// Loader's destructor, its release touches no freed memory, and the C
/// loader is freed with the last batch (no leak).
#[test]
fn cpp_batch_outlives_its_loader() {
    let d = data();
    let Some(o) = run_under_asan(&d, "g++", "-std=c++17", "batch_outlives_loader.cpp", true) else {
        return;
    };
    assert_passed(&o, "C++ batch outliving its loader");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("ERROR: AddressSanitizer"), "{err}");
}

/// A forked child cannot use its parent's loader (tests/c/fork_test.c):
/// every call in the child is `KSP_ERR_FORKED` naming both pids with
/// nothing written, `ksp_loader_free` there leaves the parent alone, and
/// the parent reads its held batch and the rest of the epoch byte-exact.
/// The same for a node service: `ksp_node_service_port` is
/// `KSP_ERR_FORKED` in the child and `ksp_node_service_stop` there returns
/// at once (it used to join threads the child does not have: a hang).
/// Run under AddressSanitizer.
#[test]
fn forked_child_is_refused_and_the_parent_goes_on() {
    let d = data();
    // The child leaks its copy of the loader by design: no leak check.
    let Some(o) = run_under_asan(&d, "gcc", "-std=c11", "fork_test.c", false) else {
        return;
    };
    assert_passed(&o, "fork");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.lines().any(|l| l == "child: all checks passed"),
        "{out}"
    );
    assert!(out.contains("service child: all checks passed"), "{out}");
}

/// A mixture from C (tests/c/mix_test.c): the `mix` key, each dataset's
/// exact count, `ksp_sample.dataset` and bytes, under AddressSanitizer;
/// the rank's position is a `KSPDPOS4` (a `KSP_POSITION_BYTES` buffer is
/// too small, naming the size) that `ksp_audit` audits alone, and a digest
/// one sample short is `KSP_ERR_DATA` ("some skipped"); with a memory tier
/// over the mixture (`tier_bytes`), the second epoch's repeats come from
/// it (`ksp_stats.tier_hits`).
#[test]
fn c_mixture_counts_and_labels_datasets() {
    let d = data();
    let Some(bin) = compile_with(
        "gcc",
        "-std=c11",
        "tests/c/mix_test.c",
        &d.work.join("mix_test"),
        &["-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
    ) else {
        return;
    };
    let o = run(
        &["env"],
        &bin,
        &d,
        &[(
            "ASAN_OPTIONS",
            "detect_leaks=1:abort_on_error=0:exitcode=23",
        )],
    );
    assert_passed(&o, "mix");
    assert!(String::from_utf8_lossy(&o.stdout).contains("mix: all checks passed"));
}

/// Tier views through the node agent from C (tests/c/agent_views_test.c):
/// the `agent`, `agent_socket` and `tier_views` keys against a real
/// `kspeed agent --tier-bytes`; epoch 1's samples come as read-only views
/// of the agent's node tier (batches without a span, pages that refuse
/// `PROT_WRITE`), every sample's bytes the catalog's; no agent at a socket is
/// `KSP_ERR_NETWORK` naming it; under AddressSanitizer.
#[test]
fn c_tier_views_through_the_agent() {
    let d = data();
    let Some(bin) = compile_with(
        "gcc",
        "-std=c11",
        "tests/c/agent_views_test.c",
        &d.work.join("agent_views_test"),
        &["-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
    ) else {
        return;
    };
    let sock = d.work.join("agent.sock");
    let _agent =
        agent_support::Agent::start(&d.space, &sock, &["--tier-bytes", "16MiB", "--no-mlock"]);
    let o = Command::new(&bin)
        .arg(&d.space)
        .arg(&sock)
        .env(
            "ASAN_OPTIONS",
            "detect_leaks=1:abort_on_error=0:exitcode=23",
        )
        .output()
        .expect("run the C test");
    assert_passed(&o, "agent views");
}

#[test]
fn c_test_passes() {
    let d = data();
    let Some(bin) = compile(&d.work.join("capi_test"), &[]) else {
        return;
    };
    let o = run(&["env"], &bin, &d, &[]);
    assert_passed(&o, "plain");
    if cfg!(feature = "test-panic") {
        assert!(String::from_utf8_lossy(&o.stdout).contains("panic boundary checked"));
    } else {
        skip("the panic boundary (ksp_test_panic) is checked with --features test-panic");
    }
}

/// The C++ wrapper's job positions and audit (tests/c/elastic_cpp.cpp):
/// 2 ranks, then 3 from the job position; `kspeed::audit` reports every
/// sample once and throws `KSP_ERR_DATA` naming a missing rank.
#[test]
fn cpp_resumes_at_another_world_size_and_audits() {
    let d = data();
    let Some(bin) = compile_with(
        "g++",
        "-std=c++17",
        "tests/c/elastic_cpp.cpp",
        &d.work.join("elastic_cpp"),
        &[],
    ) else {
        return;
    };
    let o = Command::new(&bin).arg(&d.space).output().unwrap();
    assert_passed(&o, "C++ job positions");
}

/// Resume at another world size and the exactly-once audit from C
/// (tests/c/elastic_test.c): 4 ranks take 3 batches, 3 ranks resume from
/// the job position (and from a rank's saved position) and finish the
/// epoch, every sample byte-checked; the union of ids is the epoch once
/// plus the padding duplicate; `ksp_audit` passes on the 7 positions and
/// names a missing rank; a rank position of another world is refused.
#[test]
fn c_resumes_at_another_world_size_and_audits() {
    let d = data();
    let Some(bin) = compile_with(
        "gcc",
        "-std=c11",
        "tests/c/elastic_test.c",
        &d.work.join("elastic_test"),
        &[],
    ) else {
        return;
    };
    assert_passed(&run(&["env"], &bin, &d, &[]), "elastic");
}

/// The extensible structs (tests/c/sized_structs_test.c): a caller built
/// with the first layout of `ksp_stats` (struct_size KSP_STATS_MIN_SIZE),
/// of `ksp_catalog_sample` and of `ksp_batch`/`ksp_sample` still works and nothing past its struct
/// is written; a newer, larger layout gets zeroes for unknown fields; a
/// size below the first layout, unaligned or never set is
/// `KSP_ERR_STRUCT_SIZE` with nothing written or consumed. `loop_stalls`
/// is filled for a layout that has it (and counts a blocked tick, with the
/// test hook) and not written for the layout before it.
#[test]
fn extensible_structs_accept_old_and_new_sizes_and_name_bad_ones() {
    let d = data();
    let Some(bin) = compile_with(
        "gcc",
        "-std=c11",
        "tests/c/sized_structs_test.c",
        &d.work.join("sized_structs_test"),
        &["-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
    ) else {
        return;
    };
    // With the test hook, the poller's first tick blocks for 120 ms: at
    // least one loop stall for ksp_stats.loop_stalls to show.
    let mut cmd = Command::new(&bin);
    cmd.arg(&d.space)
        .env(
            "ASAN_OPTIONS",
            "detect_leaks=0:abort_on_error=0:exitcode=23",
        )
        .env_remove("KSPEED_TEST_STALL_MS")
        .env_remove("KSPEED_STALL_MS");
    if cfg!(feature = "test-panic") {
        cmd.arg("1").env("KSPEED_TEST_STALL_MS", "120");
    }
    let o = cmd.output().unwrap();
    assert_passed(&o, "sized structs");
}

/// The cache area's counters appended after `cache_slots`
/// (tests/c/cache_stats_test.c): a C loader reading a source three times
/// its `cache_dir` area for 3 epochs, exact, sees its writes, their bytes,
/// the plan's hits, no write error and the area's size within the budget.
#[test]
fn the_cache_area_s_counters_reach_c() {
    let d = data();
    let Some(bin) = compile_with(
        "gcc",
        "-std=c11",
        "tests/c/cache_stats_test.c",
        &d.work.join("cache_stats_test"),
        &["-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
    ) else {
        return;
    };
    let catalog = d.work.join("src.ksc");
    ok(&["catalog", "--source", s(&d.src), "--out", s(&catalog)]);
    let cat = kspeed::dataset::Catalog::open(&catalog).unwrap();
    let total: u64 = (0..cat.len()).map(|i| cat.sample(i).len as u64).sum();
    let budget = (total / 3).max(64 << 10);
    let o = Command::new(&bin)
        .arg(&d.src)
        .arg(&catalog)
        .arg(d.work.join("cache"))
        .arg(budget.to_string())
        .arg("3")
        .env(
            "ASAN_OPTIONS",
            "detect_leaks=0:abort_on_error=0:exitcode=23",
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let o = agent_support::wait_output(o, std::time::Duration::from_secs(120));
    assert_passed(&o, "cache stats");
}

#[test]
fn c_test_under_address_sanitizer() {
    let d = data();
    let Some(bin) = compile(
        &d.work.join("capi_test_asan"),
        &["-fsanitize=address,undefined", "-fno-omit-frame-pointer"],
    ) else {
        return;
    };
    // Leak checking covers the C side and every allocation kspeed makes
    // through malloc; kspeed's process-wide logger and thread-locals are
    // freed at exit by design, so only "definitely lost" blocks count.
    let o = run(
        &["env"],
        &bin,
        &d,
        &[(
            "ASAN_OPTIONS",
            "detect_leaks=1:abort_on_error=0:exitcode=23",
        )],
    );
    assert_passed(&o, "AddressSanitizer");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("ERROR: AddressSanitizer"), "{err}");
}

#[test]
fn c_test_under_valgrind() {
    if Command::new("valgrind").arg("--version").output().is_err() {
        skip("valgrind not installed (apt-get install valgrind)");
        return;
    }
    let d = data();
    let Some(bin) = compile(&d.work.join("capi_test_vg"), &[]) else {
        return;
    };
    let o = run(
        &[
            "valgrind",
            "--error-exitcode=33",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
            "--quiet",
        ],
        &bin,
        &d,
        // The node service part is run plainly and under ASan only (see
        // the comment in capi_test.c).
        &[("CAPI_TEST_NO_SERVICE", "1")],
    );
    assert_passed(&o, "valgrind");
}

#[test]
fn header_constants_match_the_library() {
    let h = std::fs::read_to_string(root().join("include/kspeed.h")).unwrap();
    assert!(h.contains(&format!(
        "#define KSP_ABI_VERSION {}",
        kspeed_capi::KSP_ABI_VERSION
    )));
    assert!(h.contains(&format!(
        "#define KSP_POSITION_BYTES {}\n",
        kspeed_capi::KSP_POSITION_BYTES
    )));
    assert!(h.contains(&format!(
        "#define KSP_JOB_POSITION_BYTES {}\n",
        kspeed_capi::KSP_JOB_POSITION_BYTES
    )));
    for (name, v) in [
        ("KSP_BATCH_MIN_SIZE", kspeed_capi::KSP_BATCH_MIN_SIZE),
        ("KSP_SAMPLE_MIN_SIZE", kspeed_capi::KSP_SAMPLE_MIN_SIZE),
        ("KSP_STATS_MIN_SIZE", kspeed_capi::KSP_STATS_MIN_SIZE),
        (
            "KSP_CATALOG_SAMPLE_MIN_SIZE",
            kspeed_capi::KSP_CATALOG_SAMPLE_MIN_SIZE,
        ),
        ("KSP_MAX_STRUCT_SIZE", kspeed_capi::KSP_MAX_STRUCT_SIZE),
    ] {
        assert!(
            h.contains(&format!("#define {name} {v}\n")),
            "{name} is {v}"
        );
    }
    let build = std::fs::read_to_string(root().join("capi/build.rs")).unwrap();
    assert!(
        build.contains(&format!("let abi = {};", kspeed_capi::KSP_ABI_VERSION)),
        "capi/build.rs's soname version follows KSP_ABI_VERSION"
    );
}

/// The C library exports exactly the functions include/kspeed.h declares
/// (`ksp_test_panic` only with the `test-panic` feature), and the soname
/// carries the ABI version: what moving the C ABI into its own crate
/// (kspeed-capi) must keep.
#[test]
fn the_library_exports_exactly_the_header_s_functions() {
    let lib = built_library();
    let nm = match Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
    {
        Ok(o) => o,
        Err(e) => return skip(&format!("nm not available ({e})")),
    };
    assert!(
        nm.status.success(),
        "{}",
        String::from_utf8_lossy(&nm.stderr)
    );
    let exported: std::collections::BTreeSet<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|sym| sym.starts_with("ksp_"))
        .map(str::to_string)
        .collect();
    let h = std::fs::read_to_string(root().join("include/kspeed.h")).unwrap();
    // Declarations start a line: `ksp_status ksp_x(...`, `void ksp_x(`.
    let declared: std::collections::BTreeSet<String> = h
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with("//") && !l.starts_with("#"))
        .filter_map(|l| {
            let name = l.split('(').next()?.rsplit([' ', '*']).next()?;
            (name.starts_with("ksp_") && l.contains('(')).then(|| name.to_string())
        })
        .filter(|name| cfg!(feature = "test-panic") || name != "ksp_test_panic")
        .collect();
    assert!(declared.len() >= 30, "{declared:?}");
    assert_eq!(
        exported, declared,
        "exported ksp_* symbols vs include/kspeed.h"
    );
    let readelf = Command::new("readelf").arg("-d").arg(&lib).output();
    match readelf {
        Ok(o) => assert!(
            String::from_utf8_lossy(&o.stdout).contains(&format!(
                "Library soname: [libkspeed.so.{}]",
                kspeed_capi::KSP_ABI_VERSION
            )),
            "{}",
            String::from_utf8_lossy(&o.stdout)
        ),
        Err(e) => skip(&format!("readelf not available ({e})")),
    }
}

/// The calling thread's last C ABI message.
fn last_error() -> String {
    use kspeed_capi::ksp_last_error;
    let mut buf = vec![0 as std::ffi::c_char; 4096];
    let mut n = 0usize;
    // SAFETY: buf is writable for its length; n writable.
    unsafe { ksp_last_error(buf.as_mut_ptr(), buf.len(), &mut n) };
    // SAFETY: ksp_last_error NUL-terminated it.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// `ksp_config_set(cfg, key, value)` from Rust.
fn config_set(cfg: *mut kspeed_capi::ksp_config, k: &str, v: &str) -> kspeed_capi::ksp_status {
    let (k, v) = (
        std::ffi::CString::new(k).unwrap(),
        std::ffi::CString::new(v).unwrap(),
    );
    // SAFETY: a live configuration and two C strings.
    unsafe { kspeed_capi::ksp_config_set(cfg, k.as_ptr(), v.as_ptr()) }
}

/// The C ABI's messages say what kspeed.h promises: an unknown key names
/// the key and its value; a sample too large for the ring is described by
/// its own size and slot, not the largest sample's (sample 0 is 10,000
/// bytes, sample 1 300,000: the message used to say "sample 0 (10000
/// bytes, 303104 with alignment)").
#[test]
fn c_messages_name_the_key_value_and_the_sample_s_own_size() {
    use kspeed_capi::*;
    let mut cfg: *mut ksp_config = std::ptr::null_mut();
    // SAFETY: cfg is writable.
    assert_eq!(unsafe { ksp_config_new(&mut cfg) }, ksp_status::KSP_OK);

    let st = config_set(cfg, "ring_byts", "1GiB");
    let msg = last_error();
    assert_eq!(st, ksp_status::KSP_ERR_INVALID_ARG, "{msg}");
    assert!(
        msg.contains("\"ring_byts\"") && msg.contains("\"1GiB\""),
        "the message names the key and the value: {msg}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    put(&src, "c/a.bin", &bytes_for(0, 10_000));
    put(&src, "c/b.bin", &bytes_for(1, 300_000));
    for (k, v) in [
        ("source", s(&src)),
        ("ring_bytes", "8KiB"),
        ("batch_size", "1"),
        ("mlock", "false"),
        ("huge_pages", "false"),
        ("pin", "false"),
    ] {
        assert_eq!(
            config_set(cfg, k, v),
            ksp_status::KSP_OK,
            "{k}: {}",
            last_error()
        );
    }
    let mut l: *mut ksp_loader = std::ptr::null_mut();
    // SAFETY: a live configuration; l writable.
    let st = unsafe { ksp_loader_new(cfg, &mut l) };
    let msg = last_error();
    // SAFETY: freed once, not used afterwards.
    unsafe { ksp_config_free(cfg) };
    assert_eq!(st, ksp_status::KSP_ERR_INVALID_ARG, "{msg}");
    assert!(l.is_null());
    let slot: u64 = msg
        .strip_prefix("sample 0 (10000 bytes, ")
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the message names sample 0 and its size: {msg}"));
    assert!(
        (10_000..300_000).contains(&slot),
        "sample 0's own slot, not the largest sample's: {msg}"
    );
}
