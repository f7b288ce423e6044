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
/// 10.77.<i>.2, this side 10.77.<i>.1); removed on drop (deleting a
/// namespace deletes its veth end and so the pair). Holds an exclusive
/// flock on /tmp/kspeed-netns.lock until the namespaces are gone (fields
/// drop after `Drop::drop`): the addresses are fixed, so two test runs on
/// one machine would otherwise route into each other's namespaces.
pub struct Netns {
    pub names: Vec<String>,
    /// What the names carry: this process's id mod 100,000.
    tag: u32,
    _lock: std::fs::File,
}

/// `ip ARGS`, its output read with a deadline (`timeout 30`: a wedged
/// netlink call fails the read instead of hanging the test).
pub fn ip_output(args: &[&str]) -> std::io::Result<std::process::Output> {
    Command::new("timeout")
        .arg("30")
        .arg("ip")
        .args(args)
        .output()
}

/// Removes every kspeed test namespace (`ksr*`) and host-side veth end
/// (`krh*`) there is. Called with the lock held, when no test of any run
/// holds namespaces, so whatever is there was left by a run killed before
/// its `Drop` (a CI run stopped mid-test): its veth ends would keep
/// 10.77.<i>.1/24 routes and make this run's nodes unreachable.
fn remove_stale() {
    let names = |args: &[&str]| -> Vec<String> {
        ip_output(args)
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                // `ip -o link show`: "12: krh123450@if11: <...>";
                // `ip netns list`: "ksr12345n0 (id: 3)".
                let name = if args[0] == "-o" {
                    l.split(": ").nth(1)?.split('@').next()?
                } else {
                    l.split_whitespace().next()?
                };
                Some(name.to_string())
            })
            .collect()
    };
    for link in names(&["-o", "link", "show"]) {
        if link.starts_with("krh") {
            eprintln!("removing {link}, a veth end a killed test run left");
            let _ = Command::new("ip").args(["link", "del", &link]).status();
        }
    }
    for ns in names(&["netns", "list"]) {
        if ns.starts_with("ksr") {
            eprintln!("removing namespace {ns}, which a killed test run left");
            let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        }
    }
}

impl Netns {
    /// `n` namespaces, or None (with a skip message) where they cannot be
    /// made (not root, no `ip`).
    pub fn create(n: usize) -> Option<Netns> {
        Netns::create_tagged(n, std::process::id() % 100_000)
    }

    /// [`Netns::create`] with names tagged `tag` instead of this process's.
    pub fn create_tagged(n: usize, tag: u32) -> Option<Netns> {
        // flock works on a read-only descriptor, so a lock file another
        // user created (0644; fs.protected_regular refuses create-opens of
        // it in /tmp even for root) is opened as it is.
        let path = "/tmp/kspeed-netns.lock";
        let lock = match std::fs::File::open(path).or_else(|_| {
            std::os::unix::fs::OpenOptionsExt::mode(
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true),
                0o666,
            )
            .open(path)
        }) {
            Ok(f) => f,
            Err(e) => {
                skip(&format!(
                    "cannot open {path} to serialize namespace tests: {e}"
                ));
                return None;
            }
        };
        // Blocking is what is wanted: another run's namespaces are
        // short-lived.
        if let Err(e) = lock.lock() {
            skip(&format!("flock {path}: {e}"));
            return None;
        }
        remove_stale();
        let mut ns = Netns {
            names: Vec::new(),
            tag,
            _lock: lock,
        };
        for i in 0..n {
            let name = format!("ksr{tag}n{i}");
            let host = ns.host_end(i);
            let peer = ns.peer(i);
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

impl Netns {
    /// Namespace `i`'s end of its veth pair.
    fn peer(&self, i: usize) -> String {
        format!("krp{}{i}", self.tag)
    }

    /// The host-side end of namespace `i`'s veth pair.
    pub fn host_end(&self, i: usize) -> String {
        format!("krh{}{i}", self.tag)
    }

    /// Releases the lock and leaves the namespaces and veth pairs in
    /// place, as a run killed mid-test does (its `Drop` never runs); their
    /// names.
    pub fn abandon(mut self) -> Vec<String> {
        std::mem::take(&mut self.names)
    }

    /// Cuts namespace `i` off as if its host had died: its veth end goes
    /// down, so nothing more arrives from it (not even a FIN or RST when
    /// its processes are then killed) and nothing sent to it is answered.
    pub fn cut(&self, i: usize) {
        let peer = self.peer(i);
        let ok = Command::new("ip")
            .args(["-n", &self.names[i], "link", "set", &peer, "down"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "could not take {peer} down");
    }
}

impl Netns {
    /// Limits what namespace `i` sends to `rate` (a `tc` rate such as
    /// `4mbit`: a token bucket on its veth end, the `tbf` qdisc): a slow
    /// link from that node. False (with a skip message) where the kernel
    /// has no `tbf`.
    pub fn throttle(&self, i: usize, rate: &str) -> bool {
        let peer = self.peer(i);
        let out = Command::new("tc")
            .args([
                "-n",
                &self.names[i],
                "qdisc",
                "add",
                "dev",
                &peer,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "16kb",
                "latency",
                "2s",
            ])
            .output();
        match out {
            Ok(o) if o.status.success() => true,
            Ok(o) => {
                skip(&format!(
                    "tc tbf on {peer}: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
                false
            }
            Err(e) => {
                skip(&format!("tc: {e}"));
                false
            }
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for (i, n) in self.names.iter().enumerate() {
            // The host end first: deleting it deletes the pair at once,
            // while a deleted namespace is torn down later by the kernel
            // (a deferred work item). Until then its veth would keep
            // 10.77.<i>.1 here after the lock is released, and the next
            // test's route to 10.77.<i>.0/24 could take the stale, down
            // one ("No route to host").
            let _ = Command::new("ip")
                .args(["link", "del", &self.host_end(i)])
                .stderr(std::process::Stdio::null())
                .status();
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// A cluster file's text for the nodes at `addrs` (`<index> <host:port>`
/// per line, node i at `addrs[i]`).
pub fn cluster_text<S: AsRef<str>>(addrs: &[S]) -> String {
    addrs
        .iter()
        .enumerate()
        .map(|(i, a)| format!("{i} {}\n", a.as_ref()))
        .collect()
}

/// The [`kspeed::transport::Cluster`] of the nodes at `addrs`.
pub fn cluster_of<S: AsRef<str>>(addrs: &[S]) -> kspeed::transport::Cluster {
    kspeed::transport::Cluster::parse(&cluster_text(addrs), "test").unwrap()
}

/// `kspeed preload` of `src` (catalog `catalog`) into `nodes` spaces
/// `dir/node<i>`, node `i` of `nodes`, with `extra` arguments (copies,
/// `--max-bytes`).
pub fn preload_nodes(
    src: &Path,
    catalog: &Path,
    dir: &Path,
    nodes: usize,
    extra: &[&str],
) -> Vec<std::path::PathBuf> {
    (0..nodes)
        .map(|i| {
            let sp = dir.join(format!("node{i}"));
            let (n, i) = (nodes.to_string(), i.to_string());
            let mut args = vec!["preload", "--source", s(src), "--catalog", s(catalog)];
            args.extend(["--space", s(&sp), "--nodes", &n, "--node-index", &i]);
            args.extend(extra);
            super::common::ok(&args);
            sp
        })
        .collect()
}

/// A `kspeed serve` of `spaces[i]` in namespace `ns.names[i]` at
/// 10.77.`i`.2 for each space; their addresses.
pub fn serve_in_namespaces(
    spaces: &[std::path::PathBuf],
    ns: &Netns,
    token: &Path,
) -> (Vec<Option<Serve>>, Vec<String>) {
    let serves: Vec<Option<Serve>> = spaces
        .iter()
        .enumerate()
        .map(|(i, sp)| {
            Some(Serve::start(
                sp,
                &format!("10.77.{i}.2:0"),
                token,
                Some(&ns.names[i]),
            ))
        })
        .collect();
    let addrs = serves
        .iter()
        .map(|sv| sv.as_ref().expect("just started").addr.clone())
        .collect();
    (serves, addrs)
}
