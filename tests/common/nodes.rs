//! Node processes for the cluster tests: `kspeed serve` (one space or
//! several side by side, in a network namespace when given) and network
//! namespaces joined to this one by veth pairs. Included with
//! `#[path = "common/nodes.rs"] mod nodes;` next to `mod common;`.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use super::common::{kspeed_bin, s, skip};

/// A `kspeed serve` process (in a namespace when given); killed on drop.
pub struct Serve {
    pub child: Child,
    /// The address it printed in its "serving … on ADDR" line.
    pub addr: String,
}

impl Serve {
    /// `kspeed serve --space SPACE --listen LISTEN` with one poller
    /// (`--rdma` outside a namespace under `KSPEED_TEST_RDMA`); returns once it
    /// printed its "serving" line (the read ends at its exit at the
    /// latest: a refused start is an empty address and a panic here).
    pub fn start(space: &Path, listen: &str, token: &Path, netns: Option<&str>) -> Serve {
        Serve::start_with(&[space], listen, token, netns, &[])
    }

    /// [`Serve::start`] serving every space of `spaces` side by side, with
    /// `extra` arguments.
    pub fn start_with(
        spaces: &[&Path],
        listen: &str,
        token: &Path,
        netns: Option<&str>,
        extra: &[&str],
    ) -> Serve {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, kspeed_bin()]);
                c
            }
            None => Command::new(kspeed_bin()),
        };
        cmd.arg("serve");
        for sp in spaces {
            cmd.args(["--space", s(sp)]);
        }
        let mut child = cmd
            .args(["--listen", listen])
            .args(["--token-file", s(token), "--pollers", "1"])
            .args(extra)
            // In the soft-RoCE VM (scripts/vm_rdma_tests.sh) nodes outside
            // a namespace offer RDMA.
            .args(
                if std::env::var_os("KSPEED_TEST_RDMA").is_some() && netns.is_none() {
                    &["--rdma"][..]
                } else {
                    &[]
                },
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kspeed serve");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            out.read_line(&mut line).unwrap();
            if line.is_empty() || line.starts_with("serving") {
                break;
            }
        }
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .unwrap_or_default()
            .to_string();
        assert!(addr.contains(':'), "serve printed {line:?}");
        Serve { child, addr }
    }

    /// SIGKILL, then reaps it.
    pub fn kill9(mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Network namespaces joined to this one by veth pairs (namespace i has
/// 10.77.<i>.2, this side 10.77.<i>.1); removed on drop. Holds
/// /tmp/kspeed-netns.lock as tests/cluster.rs does: the addresses are
/// fixed.
pub struct Netns {
    pub names: Vec<String>,
    _lock: std::fs::File,
}

impl Netns {
    /// `n` namespaces, or None (with a skip message) where they cannot be
    /// made (not root, no `ip`).
    pub fn create(n: usize) -> Option<Netns> {
        let tag = std::process::id() % 100_000;
        let path = "/tmp/kspeed-netns.lock";
        let lock = std::fs::File::open(path)
            .or_else(|_| {
                std::os::unix::fs::OpenOptionsExt::mode(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .truncate(false)
                        .write(true),
                    0o666,
                )
                .open(path)
            })
            .ok()?;
        lock.lock().ok()?;
        let mut ns = Netns {
            names: Vec::new(),
            _lock: lock,
        };
        for i in 0..n {
            let name = format!("ksr{tag}n{i}");
            let host = format!("krh{tag}{i}");
            let peer = format!("krp{tag}{i}");
            let (a1, a2) = (format!("10.77.{i}.1/24"), format!("10.77.{i}.2/24"));
            let cmds: Vec<Vec<&str>> = vec![
                vec!["netns", "add", &name],
                vec!["link", "add", &host, "type", "veth", "peer", "name", &peer],
                vec!["link", "set", &peer, "netns", &name],
                vec!["addr", "add", &a1, "dev", &host],
                vec!["link", "set", &host, "up"],
                vec!["-n", &name, "addr", "add", &a2, "dev", &peer],
                vec!["-n", &name, "link", "set", &peer, "up"],
                vec!["-n", &name, "link", "set", "lo", "up"],
            ];
            for (k, c) in cmds.iter().enumerate() {
                let ok = Command::new("ip")
                    .args(c)
                    .status()
                    .is_ok_and(|s| s.success());
                if k == 0 && ok {
                    ns.names.push(name.clone());
                }
                if !ok {
                    skip(&format!("`ip {}` failed", c.join(" ")));
                    return None;
                }
            }
        }
        Some(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}
