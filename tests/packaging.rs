//! The packaging checks: man pages and shell completions generated from the
//! CLI's own definitions (`kspeed man`, `kspeed completions`), and the
//! systemd unit in packaging/systemd passing `systemd-analyze verify`.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

/// The visible subcommands (the hidden packaging ones are left out of both).
const SUBCOMMANDS: [&str; 13] = [
    "gen",
    "catalog",
    "preload",
    "rebalance",
    "unload",
    "inspect",
    "verify",
    "ls",
    "cat",
    "read",
    "serve",
    "audit",
    "agent",
];

#[test]
fn man_pages_cover_every_subcommand() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("man1");
    let out = ok(&["man", s(&dir)]);
    assert!(out.contains("wrote man pages"), "{out}");
    let top = std::fs::read_to_string(dir.join("kspeed.1")).unwrap();
    assert!(top.contains(".TH kspeed 1"), "{top}");
    for sub in SUBCOMMANDS {
        assert!(
            top.contains(&format!("kspeed\\-{sub}(1)")),
            "kspeed.1 lacks {sub}"
        );
        let page = std::fs::read_to_string(dir.join(format!("kspeed-{sub}.1")))
            .unwrap_or_else(|e| panic!("kspeed-{sub}.1: {e}"));
        assert!(page.contains(&format!(".TH kspeed-{sub} 1")), "{page}");
    }
    let read = std::fs::read_to_string(dir.join("kspeed-read.1")).unwrap();
    assert!(
        read.contains("nodes\\-dns") && read.contains("nodelist"),
        "{read}"
    );
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), SUBCOMMANDS.len() + 1, "{names:?}");
    assert!(!names
        .iter()
        .any(|n| n.contains("completions") || n.contains("man.")));
    // man(1) can render them where it is installed.
    if Command::new("man").arg("--version").output().is_ok() {
        let o = Command::new("man")
            .arg("-l")
            .arg(dir.join("kspeed-serve.1"))
            .env("MANPAGER", "cat")
            .env("MANWIDTH", "100")
            .output()
            .unwrap();
        let t = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && t.contains("token-file"),
            "{}",
            text(&o)
        );
    }
}

#[test]
fn completions_name_the_subcommands_and_options() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = ok(&["completions", shell]);
        for sub in SUBCOMMANDS {
            assert!(out.contains(sub), "{shell} completion lacks {sub}");
        }
        assert!(
            out.contains("nodes-dns") && out.contains("token-file"),
            "{shell}"
        );
    }
    // bash parses what it is given.
    if Command::new("bash").arg("--version").output().is_ok() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("kspeed.bash");
        std::fs::write(&f, ok(&["completions", "bash"])).unwrap();
        let o = Command::new("bash").args(["-n", s(&f)]).output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
        let o = Command::new("bash")
            .args(["-c", &format!(". {} && complete -p kspeed", s(&f))])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    let e = fails(&["completions", "tcsh"], 2);
    assert!(e.contains("tcsh"), "{e}");
}

#[test]
fn systemd_unit_verifies() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/systemd/kspeed-serve.service");
    let text_unit = std::fs::read_to_string(&unit).unwrap();
    for line in [
        "LimitMEMLOCK=infinity",
        "Restart=on-failure",
        "LoadCredential=token:/etc/kspeed/token",
        "--token-file %d/token",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "DeviceAllow=char-infiniband_verbs rw",
    ] {
        assert!(text_unit.contains(line), "the unit lacks {line}");
    }
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        skip("systemd-analyze is not installed");
        return;
    }
    // verify checks that ExecStart's program exists: point it at the binary
    // under test; the unit is otherwise the packaged one.
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("kspeed-serve.service");
    assert!(text_unit.contains("ExecStart=/usr/bin/kspeed serve"));
    std::fs::write(
        &copy,
        text_unit.replace(
            "ExecStart=/usr/bin/kspeed",
            &format!("ExecStart={}", kspeed_bin()),
        ),
    )
    .unwrap();
    let o = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    // It exits 0 on unknown keys and bad values too, warning on stderr: any
    // warning about the unit is a failure. (Without a booted systemd it
    // notes that sysinit.target is missing: not about this unit.)
    let err = String::from_utf8_lossy(&o.stderr);
    let about_unit: Vec<&str> = err
        .lines()
        .filter(|l| !l.contains("Unit sysinit.target not found"))
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert!(o.status.success() && about_unit.is_empty(), "{}", text(&o));
    // And it does catch a broken one.
    std::fs::write(
        &copy,
        std::fs::read_to_string(&copy)
            .unwrap()
            .replace("NoNewPrivileges=", "NoNewPrivilegez="),
    )
    .unwrap();
    let o = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("NoNewPrivilegez"),
        "{}",
        text(&o)
    );
}

/// The agent's unit (packaging/systemd/kspeed-agent.service) passes
/// `systemd-analyze verify` with no warning about it, and its ExecStart is
/// a command line `kspeed agent` accepts.
#[test]
fn agent_systemd_unit_verifies() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/systemd/kspeed-agent.service");
    let text_unit = std::fs::read_to_string(&unit).unwrap();
    for line in [
        "RuntimeDirectory=kspeed",
        "--socket /run/kspeed/agent.sock",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "RestrictAddressFamilies=AF_UNIX",
    ] {
        assert!(text_unit.contains(line), "the unit lacks {line}");
    }
    // The flags parse (a missing space fails with a usage error, status 2,
    // before anything is opened).
    let exec = text_unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart=/usr/bin/kspeed "))
        .expect("ExecStart");
    let args: Vec<&str> = exec
        .split_whitespace()
        .map(|a| {
            if a == "${KSPEED_SPACE}" {
                "/nonexistent"
            } else {
                a
            }
        })
        .filter(|a| !a.starts_with('$') && !a.starts_with("--progress"))
        .collect();
    let e = fails(&args, 1);
    assert!(e.contains("/nonexistent"), "{e}");
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        skip("systemd-analyze is not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("kspeed-agent.service");
    std::fs::write(
        &copy,
        text_unit.replace(
            "ExecStart=/usr/bin/kspeed",
            &format!("ExecStart={}", kspeed_bin()),
        ),
    )
    .unwrap();
    let o = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    let about_unit: Vec<&str> = err
        .lines()
        .filter(|l| !l.contains("Unit sysinit.target not found"))
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert!(o.status.success() && about_unit.is_empty(), "{}", text(&o));
}
