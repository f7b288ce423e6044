//! The loader's one options table (`kspeed::loader::options`) against every
//! front end: for each key with a range, Rust (`LoaderOptions::set` and the
//! typed `set_value`), the C ABI (`ksp_config_set` and `ksp_last_error`)
//! and `kspeed read` (its flag's value parser) accept the smallest and
//! largest value and refuse one below, one above and a value of the wrong
//! type with the same message; so does the C++ wrapper (ffi/cpp/kspeed.hpp,
//! its `Config::set` overloads, in tests/c/options_test.cpp). The DALI
//! operator sets the loader through that wrapper: its source is read to
//! check that its arguments map onto table keys and that every other key is
//! listed in ffi/dali/README.md as not exposed. (Python:
//! ffi/python/tests/test_options.py.) Also checks that the docs generated
//! from the table (the README's option table and `ksp_config_set`'s doc
//! comment, hence kspeed.h) are up to date; `KSPEED_UPDATE_DOCS=1`
//! rewrites them.

mod common;

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;
use std::process::Command;

use kspeed::loader::options::{markdown_table, OptionKind, OptionSpec, OptionValue, OPTIONS};
use kspeed::loader::LoaderOptions;
use kspeed_capi::*;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The calling thread's last C ABI message.
fn last_error() -> String {
    let mut buf = vec![0 as c_char; 4096];
    let mut n = 0usize;
    // SAFETY: buf is writable for its length; n writable.
    unsafe { ksp_last_error(buf.as_mut_ptr(), buf.len(), &mut n) };
    // SAFETY: ksp_last_error NUL-terminated it.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// `ksp_config_set` on a fresh configuration: `Ok` or the message.
fn c_set(k: &str, v: &str) -> Result<(), String> {
    let mut cfg: *mut ksp_config = std::ptr::null_mut();
    // SAFETY: cfg is writable.
    assert_eq!(unsafe { ksp_config_new(&mut cfg) }, ksp_status::KSP_OK);
    let (ck, cv) = (CString::new(k).unwrap(), CString::new(v).unwrap());
    // SAFETY: a live configuration and two C strings.
    let st = unsafe { ksp_config_set(cfg, ck.as_ptr(), cv.as_ptr()) };
    let r = if st == ksp_status::KSP_OK {
        Ok(())
    } else {
        assert_eq!(st, ksp_status::KSP_ERR_INVALID_ARG, "{k}={v}");
        Err(last_error())
    };
    // SAFETY: freed once, not used afterwards.
    unsafe { ksp_config_free(cfg) };
    r
}

fn rust_set(k: &str, v: &str) -> Result<(), String> {
    LoaderOptions::new().set(k, v).map_err(|e| e.to_string())
}

/// Values to try: (value, accepted).
fn cases(o: &OptionSpec) -> Vec<(String, bool)> {
    let mut v = Vec::new();
    match o.kind {
        OptionKind::Int { min, max }
        | OptionKind::IntOrAuto { min, max }
        | OptionKind::Bytes { min, max }
        | OptionKind::BytesOrAuto { min, max } => {
            v.push((min.to_string(), true));
            v.push((max.to_string(), true));
            if min > 0 {
                v.push(((min - 1).to_string(), false));
            }
            // A size above u64::MAX is no size at all: nothing to test.
            if max < u64::MAX
                || !matches!(
                    o.kind,
                    OptionKind::Bytes { .. } | OptionKind::BytesOrAuto { .. }
                )
            {
                v.push(((max as u128 + 1).to_string(), false));
            }
            v.push(("x".into(), false));
            if matches!(
                o.kind,
                OptionKind::IntOrAuto { .. } | OptionKind::BytesOrAuto { .. }
            ) {
                v.push(("auto".into(), true));
                v.push(("autox".into(), false));
            }
        }
        OptionKind::Seconds { min_ms, max_ms } => {
            v.push(((min_ms as f64 / 1000.0).to_string(), true));
            v.push(((max_ms as f64 / 1000.0).to_string(), true));
            v.push(("0".into(), false));
            v.push(((max_ms as f64 / 1000.0 + 1.0).to_string(), false));
            v.push(("x".into(), false));
        }
        OptionKind::Bool => {
            v.push(("true".into(), true));
            v.push(("false".into(), true));
            v.push(("x".into(), false));
        }
        OptionKind::Choice(words) => {
            v.extend(words.iter().map(|w| (w.to_string(), true)));
            v.push(("yes".into(), false));
        }
        _ => v.push(("a:1".into(), true)),
    }
    v
}

#[test]
fn rust_and_the_c_abi_accept_and_refuse_the_same_values_with_the_same_message() {
    let mut checked = 0;
    for o in OPTIONS {
        for (v, ok) in cases(o) {
            let r = rust_set(o.name, &v);
            assert_eq!(r.is_ok(), ok, "{}={v}: {r:?}", o.name);
            assert_eq!(c_set(o.name, &v), r, "{}={v}: C and Rust differ", o.name);
            if let Err(m) = &r {
                assert!(
                    m.starts_with(&format!("option {}: ", o.name)) && m.contains(&o.kind.allowed()),
                    "the message names the key, the value and the range: {m}"
                );
            }
            // The typed path (Python's) words a range error the same way.
            if let (
                Ok(n),
                OptionKind::Int { .. } | OptionKind::Bytes { .. } | OptionKind::BytesOrAuto { .. },
            ) = (v.parse::<i128>(), o.kind)
            {
                let t = LoaderOptions::new()
                    .set_value(o.name, OptionValue::Int(n))
                    .map_err(|e| e.to_string());
                assert_eq!(t, r, "{}={v}: typed and string differ", o.name);
            }
            checked += 1;
        }
    }
    assert!(checked > 150, "{checked}");
    // Unknown keys: named with their value, the same way.
    let r = rust_set("ring_byts", "1GiB");
    assert!(r.as_ref().unwrap_err().contains("\"ring_byts\""), "{r:?}");
    assert_eq!(c_set("ring_byts", "1GiB"), r);
}

/// Every option whose `kspeed read` flag takes a number parses it through
/// the table: the same values are refused with the same message.
#[test]
fn kspeed_read_flags_take_the_table_s_ranges_and_messages() {
    let bin = common::kspeed_bin();
    let mut flags = 0;
    for o in OPTIONS.iter().filter(|o| !o.cli.is_empty()) {
        if !matches!(
            o.kind,
            OptionKind::Int { .. }
                | OptionKind::Bytes { .. }
                | OptionKind::BytesOrAuto { .. }
                | OptionKind::IntOrAuto { .. }
        ) {
            continue;
        }
        flags += 1;
        for (v, ok) in cases(o) {
            let out = Command::new(bin)
                .args(["read", "--space", "/nonexistent/kspeed-options-test"])
                .arg(format!("--{}", o.cli))
                .arg(&v)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{}={v}: {err}", o.cli);
            match rust_set(o.name, &v) {
                Ok(()) => assert!(
                    ok && !err.contains("invalid value"),
                    "--{} {v} is accepted: {err}",
                    o.cli
                ),
                Err(m) => assert!(
                    !ok && err.contains(&m),
                    "--{} {v} is refused with the table's message {m:?}: {err}",
                    o.cli
                ),
            }
        }
    }
    assert!(flags >= 20, "{flags}");
}

/// Replaces the lines between `begin` and `end` markers (each on a line
/// of its own, with `prefix`) by `body`, each line with `prefix`.
fn splice(text: &str, prefix: &str, body: &str) -> String {
    let begin = format!("{prefix}<!-- options:begin -->\n");
    let end = format!("{prefix}<!-- options:end -->\n");
    let b = text.find(&begin).expect("begin marker") + begin.len();
    let e = text.find(&end).expect("end marker");
    let mut lines = String::new();
    for l in body.lines() {
        lines.push_str(prefix.trim_end());
        if !l.is_empty() {
            lines.push_str(&prefix[prefix.trim_end().len()..]);
            lines.push_str(l);
        }
        lines.push('\n');
    }
    format!("{}{}{}", &text[..b], lines, &text[e..])
}

#[test]
fn generated_option_docs_are_up_to_date() {
    let table = markdown_table();
    let update = std::env::var_os("KSPEED_UPDATE_DOCS").is_some();
    let mut stale = Vec::new();
    for (path, prefix) in [("README.md", ""), ("capi/src/config.rs", "/// ")] {
        let p = root().join(path);
        let text = std::fs::read_to_string(&p).unwrap();
        let want = splice(&text, prefix, &table);
        if want != text {
            if update {
                std::fs::write(&p, want).unwrap();
            } else {
                stale.push(path);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "{stale:?} are out of date with kspeed::loader::options: run \
         `KSPEED_UPDATE_DOCS=1 cargo nextest run --test options generated` \
         then scripts/gen_header.sh"
    );
}

/// The C++ wrapper (ffi/cpp/kspeed.hpp, which the DALI operator uses):
/// tests/c/options_test.cpp sets every case of every key through
/// `kspeed::Config::set` (the string and `const char*` overloads, and the
/// integer and bool ones where the value is one) and prints what happened;
/// each must be Rust's answer, a refusal a `kspeed::Error` with status
/// `KSP_ERR_INVALID_ARG` and Rust's message.
#[test]
fn the_cpp_wrapper_accepts_and_refuses_the_same_values_with_the_same_message() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(bin) = common::compile_with(
        "g++",
        "-std=c++17",
        "tests/c/options_test.cpp",
        &tmp.path().join("options_test"),
        &[],
    ) else {
        return;
    };
    // (mode, key, value, Rust's answer)
    let mut all = Vec::new();
    for o in OPTIONS {
        for (v, _) in cases(o) {
            let want = rust_set(o.name, &v);
            let mut modes = vec!["string", "cstr"];
            if v.parse::<u64>().is_ok() {
                modes.push("u64");
            }
            if v.parse::<i64>().is_ok() {
                modes.push("i64");
            }
            if matches!(o.kind, OptionKind::Bool) && (v == "true" || v == "false") {
                modes.push("bool");
            }
            for m in modes {
                all.push((m, o.name, v.clone(), want.clone()));
            }
        }
    }
    all.push((
        "string",
        "ring_byts",
        "1GiB".into(),
        rust_set("ring_byts", "1GiB"),
    ));
    let input: String = all
        .iter()
        .map(|(m, k, v, _)| format!("{m}\t{k}\t{v}\n"))
        .collect();
    let mut child = Command::new(&bin)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        stdin.write_all(input.as_bytes()).unwrap();
    });
    let o = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    let got: Vec<&str> = out.lines().collect();
    assert_eq!(got.len(), all.len(), "one answer per case: {out}");
    let invalid = ksp_status::KSP_ERR_INVALID_ARG as i32;
    for ((m, k, v, want), got) in all.iter().zip(got) {
        let want_line = match want {
            Ok(()) => "ok".to_string(),
            Err(msg) => format!("err\t{invalid}\t{msg}"),
        };
        assert_eq!(got, want_line, "C++ Config::set({k:?}, {v:?}) [{m}]");
    }
    assert!(all.len() > 300, "{}", all.len());
}

/// The DALI operator's arguments, each with the table key it is handed to
/// `ksp_config_set` under (None: the operator's own, with no loader
/// option). ffi/dali/README.md's argument table documents the same.
const DALI_ARGUMENTS: &[(&str, Option<&str>)] = &[
    ("space", Some("space")),
    ("shard_id", Some("rank")),
    ("num_shards", Some("world")),
    ("random_shuffle", Some("shuffle")),
    // DALI's own random-seed argument (AddRandomSeedArg).
    ("seed", Some("seed")),
    // A DALI reader's padding of its last batch: the operator does it.
    ("pad_last_batch", None),
    ("prefetch_samples", Some("lookahead")),
    ("ring_bytes", Some("ring_bytes")),
    ("tier_bytes", Some("tier_bytes")),
    ("tier_views", Some("tier_views")),
    ("pollers", Some("pollers")),
    ("mlock", Some("mlock")),
    ("cluster_file", Some("cluster_file")),
    ("token", Some("token")),
    ("rdma", Some("rdma")),
    ("s3_endpoint_url", Some("s3_endpoint_url")),
    ("s3_profile", Some("s3_profile")),
    // Which members of a tar sample are outputs: the operator's, from the
    // catalog (no loader option).
    ("members", None),
    ("cache_dir", Some("cache_dir")),
    ("cache_bytes", Some("cache_bytes")),
    ("cache_policy", Some("cache_policy")),
    ("cache_memory_bytes", Some("cache_memory_bytes")),
];

/// The double-quoted word after each `needle` in `text`.
fn quoted_after<'a>(text: &'a str, needle: &str) -> Vec<&'a str> {
    text.match_indices(needle)
        .map(|(i, _)| {
            let rest = &text[i + needle.len()..];
            &rest[..rest.find('"').expect("closing quote")]
        })
        .collect()
}

/// The words in backticks between `<!-- NAME:begin -->` and
/// `<!-- NAME:end -->` in `text`.
fn listed(text: &str, name: &str) -> Vec<String> {
    let b = text
        .find(&format!("<!-- {name}:begin -->"))
        .unwrap_or_else(|| panic!("{name}:begin marker"));
    let e = text
        .find(&format!("<!-- {name}:end -->"))
        .unwrap_or_else(|| panic!("{name}:end marker"));
    text[b..e]
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The DALI operator (ffi/dali/kspeed_reader.cc), read as source: it sets
/// the loader through the C++ wrapper's `Config::set`, hence
/// `ksp_config_set` and the table (whose values and messages the C++ test
/// above checks). Every key it sets is a table key; every argument of its
/// schema is in [`DALI_ARGUMENTS`] with the key it maps to, and each such
/// key is set; every table key is either set by the operator or listed in
/// ffi/dali/README.md as not exposed (so a new option fails here until it
/// is given a DALI argument or listed there).
#[test]
fn the_dali_operator_maps_its_arguments_onto_table_keys() {
    let src = std::fs::read_to_string(root().join("ffi/dali/kspeed_reader.cc")).unwrap();
    let readme = std::fs::read_to_string(root().join("ffi/dali/README.md")).unwrap();
    let names: std::collections::BTreeSet<&str> = OPTIONS.iter().map(|o| o.name).collect();

    let set: std::collections::BTreeSet<&str> = quoted_after(&src, ".set(\"").into_iter().collect();
    for k in &set {
        assert!(
            names.contains(k),
            "the operator sets {k:?}, not a table key"
        );
    }
    let schema = src
        .split("DALI_SCHEMA(")
        .nth(1)
        .expect("the operator's schema");
    let mut args: Vec<&str> = quoted_after(schema, "AddArg(\"");
    args.extend(quoted_after(schema, "AddOptionalArg(\""));
    if schema.contains(".AddRandomSeedArg()") {
        args.push("seed");
    }
    args.sort();
    let mut known: Vec<&str> = DALI_ARGUMENTS.iter().map(|(a, _)| *a).collect();
    known.sort();
    assert_eq!(
        args, known,
        "the operator's arguments against DALI_ARGUMENTS (give a new one its key)"
    );
    let mut mapped: std::collections::BTreeSet<&str> =
        DALI_ARGUMENTS.iter().filter_map(|(_, k)| *k).collect();
    // The pipeline's max_batch_size, not an argument of the operator.
    mapped.insert("batch_size");
    assert_eq!(set, mapped, "each argument's key is set, and only those");
    for (a, _) in DALI_ARGUMENTS {
        assert!(
            readme.contains(&format!("`{a}`")),
            "ffi/dali/README.md documents `{a}`"
        );
    }

    let hidden = listed(&readme, "dali-not-exposed");
    for k in &hidden {
        assert!(
            names.contains(k.as_str()),
            "README lists {k:?}, not a table key"
        );
        assert!(
            !set.contains(k.as_str()),
            "README lists {k:?} as not exposed, but it is"
        );
    }
    let missing: Vec<&str> = names
        .iter()
        .filter(|k| !set.contains(*k) && !hidden.iter().any(|h| h == *k))
        .copied()
        .collect();
    assert!(
        missing.is_empty(),
        "table keys neither a DALI argument nor listed as not exposed in \
         ffi/dali/README.md: {missing:?}"
    );
}
