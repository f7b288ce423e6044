//! The loader's one options table (`kspeed::loader::options`) against every
//! front end: for each key with a range, Rust (`LoaderOptions::set` and the
//! typed `set_value`), the C ABI (`ksp_config_set` and `ksp_last_error`)
//! and `kspeed read` (its flag's value parser) accept the smallest and
//! largest value and refuse one below, one above and a value of the wrong
//! type with the same message. (Python: ffi/python/tests/test_options.py;
//! DALI goes through `ksp_config_set`.) Also checks that the docs generated
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
        | OptionKind::Bytes { min, max } => {
            v.push((min.to_string(), true));
            v.push((max.to_string(), true));
            if min > 0 {
                v.push(((min - 1).to_string(), false));
            }
            // A size above u64::MAX is no size at all: nothing to test.
            if max < u64::MAX || !matches!(o.kind, OptionKind::Bytes { .. }) {
                v.push(((max as u128 + 1).to_string(), false));
            }
            v.push(("x".into(), false));
            if matches!(o.kind, OptionKind::IntOrAuto { .. }) {
                v.push(("auto".into(), true));
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
            if let (Ok(n), OptionKind::Int { .. } | OptionKind::Bytes { .. }) =
                (v.parse::<i128>(), o.kind)
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
            OptionKind::Int { .. } | OptionKind::Bytes { .. } | OptionKind::IntOrAuto { .. }
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
