//! How a consumer finds the nodes: a cluster file, or the launcher's
//! environment.
//!
//! A cluster file has one node per line, `<index> <host:port>`, indices
//! 0..N-1 each exactly once; `#` starts a comment. Example:
//!
//! ```text
//! # kspeed cluster: 3 nodes
//! 0 10.0.0.1:7400
//! 1 10.0.0.2:7400
//! 2 10.0.0.3:7400
//! ```
//!
//! From the environment ([`Cluster::from_env`]): the launcher's variables
//! (torchrun, Open MPI, MPICH/PMI or SLURM, read by [`crate::launcher`])
//! give this process's rank and node; `KSPEED_NODES` lists the node
//! services' addresses in node order (comma-separated). torchrun gives only
//! `MASTER_ADDR`, so without `KSPEED_NODES` a one-node job uses
//! `MASTER_ADDR:KSPEED_PORT` (default port 7400) and a multi-node job is a
//! named error. See docs/PROTOCOL.md ("Describing a cluster").
//!
//! Why this file is over ~800 lines: half of it is unit tests (cluster
//! files, every launcher's variables, the node lists' precedence).

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::launcher::Launcher;

/// One node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Node index (the placement's node number).
    pub index: u32,
    /// The node service's address as written (`host:port`).
    pub addr: String,
}

/// The node services' port where none is given (`KSPEED_PORT`,
/// `--node-port`): `kspeed serve`'s default (`--listen 0.0.0.0:7400`).
pub const DEFAULT_PORT: u16 = 7400;

impl Node {
    /// Resolves the address.
    pub fn resolve(&self) -> std::io::Result<SocketAddr> {
        self.addr.to_socket_addrs()?.next().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "address resolves to nothing")
        })
    }
}

/// The nodes, indexed by node index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    /// `nodes[i].index == i`.
    pub nodes: Vec<Node>,
}

/// The launcher's view of this process: the one [`Launcher`] every path
/// reads (the former name, kept for callers).
pub type LaunchEnv = Launcher;

impl Cluster {
    /// Parses a cluster file.
    pub fn from_file(path: &Path) -> Result<Cluster> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses cluster-file text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Cluster> {
        let mut nodes: Vec<Option<Node>> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: String| Error::BadCluster {
                origin: format!("{origin}:{}", i + 1),
                reason,
            };
            let mut parts = line.split_whitespace();
            let (Some(idx), Some(addr), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad(format!(
                    "expected `<node index> <host:port>`, found {line:?}"
                )));
            };
            let index: u32 = idx
                .parse()
                .map_err(|_| bad(format!("node index {idx:?} is not a number")))?;
            if !addr.contains(':') {
                return Err(bad(format!("address {addr:?} has no port")));
            }
            if index as usize >= 1 << 16 {
                return Err(bad(format!("node index {index} is too large")));
            }
            if nodes.len() <= index as usize {
                nodes.resize(index as usize + 1, None);
            }
            if nodes[index as usize].is_some() {
                return Err(bad(format!("node {index} is listed twice")));
            }
            nodes[index as usize] = Some(Node {
                index,
                addr: addr.to_string(),
            });
        }
        if nodes.is_empty() {
            return Err(Error::BadCluster {
                origin: origin.to_string(),
                reason: "no nodes listed".into(),
            });
        }
        let mut out = Vec::with_capacity(nodes.len());
        for (i, n) in nodes.into_iter().enumerate() {
            out.push(n.ok_or_else(|| Error::BadCluster {
                origin: origin.to_string(),
                reason: format!("node {i} is missing (indices must be 0..N-1)"),
            })?);
        }
        Ok(Cluster { nodes: out })
    }

    /// One node per address (`host:port`), in node order; `origin` names
    /// where the list came from in errors.
    pub fn from_addrs<S: AsRef<str>>(addrs: &[S], origin: &str) -> Result<Cluster> {
        let text: String = addrs
            .iter()
            .map(|a| a.as_ref().trim())
            .filter(|a| !a.is_empty())
            .enumerate()
            .map(|(i, a)| format!("{i} {a}\n"))
            .collect();
        Self::parse(&text, origin)
    }

    /// The hosts of a SLURM hostlist (`gpu[01-04,07]`, see
    /// `transport::hostlist`), in the order it names them, each at `port`:
    /// node `i` is the `i`-th host, which is also SLURM's node index
    /// (`SLURM_NODEID`) when the list is `SLURM_JOB_NODELIST`.
    pub fn from_hostlist(list: &str, port: u16) -> Result<Cluster> {
        let hosts = super::hostlist::expand(list)?;
        let addrs: Vec<String> = hosts.iter().map(|h| format!("{h}:{port}")).collect();
        Self::from_addrs(&addrs, &format!("hostlist {list:?}"))
    }

    /// `nodes` addresses from a pattern where `{i}` stands for the node
    /// index 0..nodes-1: a Kubernetes headless service's per-pod names,
    /// `kspeed-{i}.kspeed.ns.svc:7400`. A pattern without `:port` gets
    /// `port`. Names are resolved when the loader connects, not here.
    pub fn from_dns_pattern(pattern: &str, nodes: u32, port: u16) -> Result<Cluster> {
        let bad = |reason: String| Error::BadCluster {
            origin: format!("node name pattern {pattern:?}"),
            reason,
        };
        if !pattern.contains("{i}") {
            return Err(bad(
                "has no `{i}` (where the node index goes, e.g. kspeed-{i}.kspeed.ns.svc:7400)"
                    .into(),
            ));
        }
        let rest = pattern.replace("{i}", "");
        if rest.contains('{') || rest.contains('}') {
            return Err(bad("`{i}` is the only placeholder".into()));
        }
        if rest.chars().any(char::is_whitespace) || rest.contains(',') {
            return Err(bad("contains whitespace or `,`".into()));
        }
        if nodes == 0 || nodes > 1 << 16 {
            return Err(bad(format!(
                "node count {nodes} is out of range (1 to 65536)"
            )));
        }
        let with_port = |a: String| {
            if a.contains(':') {
                a
            } else {
                format!("{a}:{port}")
            }
        };
        let addrs: Vec<String> = (0..nodes)
            .map(|i| with_port(pattern.replace("{i}", &i.to_string())))
            .collect();
        Self::from_addrs(&addrs, &format!("node name pattern {pattern:?}"))
    }

    /// The cluster and this process's place in it from the environment.
    ///
    /// This process: [`Launcher::from_vars`] (torchrun, Open MPI, MPICH/PMI
    /// or SLURM, innermost first; see [`crate::launcher`]); a launcher
    /// must have given the rank and world.
    ///
    /// The nodes, the first of these that is set:
    /// 1. `KSPEED_NODES`: the node services' `host:port`, comma-separated,
    ///    in node order;
    /// 2. `KSPEED_NODES_DNS`: a name pattern with `{i}` (see
    ///    [`Cluster::from_dns_pattern`]) for `KSPEED_NODE_COUNT` nodes
    ///    (default: the launcher's node count, [`Launcher::nodes`]);
    /// 3. the launcher's node list, `SLURM_JOB_NODELIST` (or
    ///    `SLURM_NODELIST`): a SLURM hostlist;
    /// 4. `MASTER_ADDR`, for a one-node job only.
    ///
    /// Where a list has no port, `KSPEED_PORT` (default [`DEFAULT_PORT`]).
    pub fn from_env() -> Result<(Cluster, Launcher)> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`Cluster::from_env`] over any variable lookup (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<(Cluster, Launcher)> {
        let env = launched(&var)?;
        let node_count = env.node_count();
        let port = env_port(&var)?;
        let cluster = if let Some(list) = var("KSPEED_NODES") {
            let addrs: Vec<&str> = list.split(',').collect();
            Self::from_addrs(&addrs, "environment variable KSPEED_NODES")?
        } else if let Some(pattern) = var("KSPEED_NODES_DNS") {
            let n = match var("KSPEED_NODE_COUNT") {
                Some(v) => v.trim().parse().map_err(|_| Error::BadCluster {
                    origin: "environment variable KSPEED_NODE_COUNT".into(),
                    reason: format!("{v:?} is not a number"),
                })?,
                None => node_count,
            };
            Self::from_dns_pattern(&pattern, n, port)?
        } else if let Some(list) = &env.nodelist {
            Self::from_hostlist(list, port)?
        } else {
            if node_count > 1 {
                return Err(Error::BadCluster {
                    origin: "environment".into(),
                    reason: format!(
                        "{node_count} nodes but none of KSPEED_NODES, KSPEED_NODES_DNS or SLURM_JOB_NODELIST is set: list the node services' addresses (torchrun only gives MASTER_ADDR)"
                    ),
                });
            }
            let master = var("MASTER_ADDR").ok_or_else(|| Error::BadCluster {
                origin: "environment variable MASTER_ADDR".into(),
                reason: "not set".into(),
            })?;
            Self::parse(&format!("0 {master}:{port}\n"), "environment")?
        };
        env.check_nodes(&cluster)?;
        Ok((cluster, env))
    }
}

/// `KSPEED_PORT`, or [`DEFAULT_PORT`].
fn env_port(var: &impl Fn(&str) -> Option<String>) -> Result<u16> {
    match var("KSPEED_PORT") {
        Some(v) => v.trim().parse().map_err(|_| Error::BadCluster {
            origin: "environment variable KSPEED_PORT".into(),
            reason: format!("{v:?} is not a port number"),
        }),
        None => Ok(DEFAULT_PORT),
    }
}

/// The launcher's view of this process, which must have a rank and world
/// (cluster mode reads every rank's own sequence).
fn launched(var: &impl Fn(&str) -> Option<String>) -> Result<Launcher> {
    let env = Launcher::from_vars(var)?;
    if !env.is_launched() {
        return Err(Error::BadCluster {
            origin: "environment".into(),
            reason: "no launcher's rank and world (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE, PMI_RANK/PMI_SIZE or SLURM_PROCID/SLURM_NTASKS): is this process started by torchrun, mpirun or srun?".into(),
        });
    }
    Ok(env)
}

impl Launcher {
    /// Checks that `cluster` has one node service per node of the job.
    pub fn check_nodes(&self, cluster: &Cluster) -> Result<()> {
        let n = self.node_count();
        if cluster.nodes.len() as u32 != n {
            return Err(Error::BadCluster {
                origin: "environment".into(),
                reason: format!(
                    "the node list names {} nodes but {} = {n}",
                    cluster.nodes.len(),
                    self.nodes_from
                ),
            });
        }
        Ok(())
    }
}

/// Where the node list comes from, as a command line, a C ABI
/// configuration or a binding collects it. At most one of `file`,
/// `addrs`, `hostlist` and `dns` is given; with none of them, `env` takes
/// the node list from the launcher's environment ([`Cluster::from_env`]).
///
/// Precedence: an explicit source (option, flag, configuration key) wins
/// over the environment; with `env` set as well, the environment still
/// gives this process's rank and world, and the explicit list must have
/// one node per node of the job. The port for `hostlist` and a `dns`
/// pattern without one: `port`, else `KSPEED_PORT`, else [`DEFAULT_PORT`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterSpec {
    /// A cluster file.
    pub file: Option<PathBuf>,
    /// The node services' addresses in node order.
    pub addrs: Option<Vec<String>>,
    /// A SLURM hostlist.
    pub hostlist: Option<String>,
    /// A name pattern with `{i}`.
    pub dns: Option<String>,
    /// Nodes for `dns` (with `env`: default `WORLD_SIZE / LOCAL_WORLD_SIZE`).
    pub nodes: Option<u32>,
    /// Port for `hostlist` / `dns`.
    pub port: Option<u16>,
    /// Read the launcher's environment.
    pub env: bool,
}

impl ClusterSpec {
    /// Whether any source is given (cluster mode).
    pub fn is_set(&self) -> bool {
        self.file.is_some()
            || self.addrs.is_some()
            || self.hostlist.is_some()
            || self.dns.is_some()
            || self.env
    }

    /// The cluster, and with `env` this process's place; `None` when no
    /// source is given.
    pub fn resolve(&self) -> Result<Option<(Cluster, Option<Launcher>)>> {
        self.resolve_with(|k| std::env::var(k).ok())
    }

    /// [`ClusterSpec::resolve`] over any variable lookup (for tests).
    pub fn resolve_with(
        &self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<(Cluster, Option<Launcher>)>> {
        let bad = |reason: &str| Error::BadCluster {
            origin: "cluster options".into(),
            reason: reason.into(),
        };
        let explicit = [
            self.file.is_some(),
            self.addrs.is_some(),
            self.hostlist.is_some(),
            self.dns.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if explicit > 1 {
            return Err(bad(
                "give one node list: a cluster file, an address list, a hostlist or a name pattern",
            ));
        }
        if self.nodes.is_some() && self.dns.is_none() {
            return Err(bad("a node count is for a name pattern (--nodes-dns)"));
        }
        if self.port.is_some() && self.hostlist.is_none() && self.dns.is_none() {
            return Err(bad("a port is for a hostlist or a name pattern"));
        }
        if explicit == 0 {
            if !self.env {
                return Ok(None);
            }
            let (c, e) = Cluster::from_vars(var)?;
            return Ok(Some((c, Some(e))));
        }
        let launch = if self.env {
            Some(launched(&var)?)
        } else {
            None
        };
        let port = match self.port {
            Some(p) => p,
            None => env_port(&var)?,
        };
        let cluster = if let Some(f) = &self.file {
            Cluster::from_file(f)?
        } else if let Some(a) = &self.addrs {
            Cluster::from_addrs(a, "the node address list")?
        } else if let Some(h) = &self.hostlist {
            Cluster::from_hostlist(h, port)?
        } else {
            let pattern = self.dns.as_deref().unwrap_or_default();
            let n = match (self.nodes, &launch) {
                (Some(n), _) => n,
                (None, Some(e)) => e.node_count(),
                (None, None) => {
                    return Err(bad(
                        "a name pattern (--nodes-dns) needs a node count (--nodes)",
                    ))
                }
            };
            Cluster::from_dns_pattern(pattern, n, port)?
        };
        if let Some(e) = &launch {
            e.check_nodes(&cluster)?;
        }
        Ok(Some((cluster, launch)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_files_and_names_bad_lines() {
        let c = Cluster::parse("# x\n1 127.0.0.2:7400\n0 127.0.0.1:7400 # first\n", "f").unwrap();
        assert_eq!(c.nodes[0].addr, "127.0.0.1:7400");
        assert_eq!(c.nodes[1].index, 1);
        let e = Cluster::parse("0 a:1\n0 b:2\n", "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("f:2") && e.contains("twice"), "{e}");
        let e = Cluster::parse("0 a:1\n2 b:2\n", "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("node 1 is missing"), "{e}");
        let e = Cluster::parse("x a:1\n", "f").unwrap_err().to_string();
        assert!(e.contains("not a number"), "{e}");
        assert!(Cluster::parse("", "f").is_err());
    }

    #[test]
    fn reads_torchrun_variables() {
        let vars = |list: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                list.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let (c, env) = Cluster::from_vars(vars(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "6"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("KSPEED_NODES", "a:1, b:1,c:1"),
        ]))
        .unwrap();
        assert_eq!(env.node, 2);
        assert_eq!(c.nodes.len(), 3);
        let (c, _) = Cluster::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "10.1.1.1"),
        ]))
        .unwrap();
        assert_eq!(c.nodes[0].addr, "10.1.1.1:7400");
        let e = Cluster::from_vars(vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("KSPEED_NODES"), "{e}");
    }
    fn lookup(list: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = list
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    fn addrs(c: &Cluster) -> Vec<&str> {
        c.nodes.iter().map(|n| n.addr.as_str()).collect()
    }

    #[test]
    fn slurm_nodelist_with_port_and_slurm_ranks() {
        // Plain srun (no torchrun): 2 nodes x 4 tasks, this is task 6.
        let (c, env) = Cluster::from_vars(lookup(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_NODEID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("KSPEED_PORT", "7500"),
        ]))
        .unwrap();
        assert_eq!(addrs(&c), ["gpu07:7500", "gpu08:7500"]);
        assert_eq!(
            (
                env.rank,
                env.world,
                env.local_rank,
                env.local_world,
                env.node
            ),
            (6, 8, 2, 4, 1)
        );
        // torchrun under SLURM: torchrun's variables win; default port.
        let (c, env) = Cluster::from_vars(lookup(&[
            ("RANK", "9"),
            ("WORLD_SIZE", "32"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NODELIST", "a[1-2],b[01-02]"),
        ]))
        .unwrap();
        assert_eq!(addrs(&c), ["a1:7400", "a2:7400", "b01:7400", "b02:7400"]);
        assert_eq!((env.rank, env.world, env.node), (9, 32, 1));
        // Bad grammar is the named hostlist error.
        let e = Cluster::from_vars(lookup(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("SLURM_JOB_NODELIST", "gpu[1-"),
        ]))
        .unwrap_err();
        assert!(matches!(e, Error::BadHostlist { at: 3, .. }), "{e}");
        // A list that does not match the job's node count.
        let e = Cluster::from_vars(lookup(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("SLURM_JOB_NODELIST", "gpu[1-3]"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("names 3 nodes") && e.contains("= 2"), "{e}");
        let e = Cluster::from_vars(lookup(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("KSPEED_PORT", "http"),
            ("SLURM_JOB_NODELIST", "gpu1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("KSPEED_PORT"), "{e}");
    }

    #[test]
    fn dns_pattern_and_precedence() {
        let c = Cluster::from_dns_pattern("kspeed-{i}.kspeed.ns.svc:7401", 3, 1).unwrap();
        assert_eq!(
            addrs(&c),
            [
                "kspeed-0.kspeed.ns.svc:7401",
                "kspeed-1.kspeed.ns.svc:7401",
                "kspeed-2.kspeed.ns.svc:7401"
            ]
        );
        let c = Cluster::from_dns_pattern("n{i}", 2, 9000).unwrap();
        assert_eq!(addrs(&c), ["n0:9000", "n1:9000"]);
        for (p, n, what) in [
            ("kspeed.ns.svc:7400", 2, "has no `{i}`"),
            ("k-{i}-{j}:1", 2, "only placeholder"),
            ("k-{i}:1", 0, "out of range"),
            ("k {i}:1", 2, "whitespace"),
        ] {
            let e = Cluster::from_dns_pattern(p, n, 1).unwrap_err().to_string();
            assert!(e.contains(what), "{p}: {e}");
        }
        // Environment: KSPEED_NODES > KSPEED_NODES_DNS > SLURM > MASTER_ADDR.
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "8"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            Cluster::from_vars(lookup(&v)).map(|(c, _)| c)
        };
        let dns = ("KSPEED_NODES_DNS", "k-{i}.s:7400");
        let slurm = ("SLURM_JOB_NODELIST", "g[1-2]");
        let list = ("KSPEED_NODES", "x:1,y:1");
        assert_eq!(addrs(&with(&[dns, slurm, list]).unwrap()), ["x:1", "y:1"]);
        assert_eq!(
            addrs(&with(&[dns, slurm]).unwrap()),
            ["k-0.s:7400", "k-1.s:7400"]
        );
        assert_eq!(addrs(&with(&[slurm]).unwrap()), ["g1:7400", "g2:7400"]);
        // KSPEED_NODE_COUNT overrides the count from WORLD_SIZE, and is checked.
        let e = with(&[dns, ("KSPEED_NODE_COUNT", "3")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("names 3 nodes"), "{e}");
    }

    #[test]
    fn spec_explicit_beats_environment() {
        let env = lookup(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("KSPEED_NODES", "a:1,b:1"),
            ("KSPEED_PORT", "7600"),
        ]);
        // Nothing chosen: not cluster mode.
        assert_eq!(ClusterSpec::default().resolve_with(&env).unwrap(), None);
        // Environment only.
        let spec = ClusterSpec {
            env: true,
            ..Default::default()
        };
        let (c, e) = spec.resolve_with(&env).unwrap().unwrap();
        assert_eq!(addrs(&c), ["a:1", "b:1"]);
        assert_eq!(e.unwrap().node, 1);
        // An explicit hostlist wins over KSPEED_NODES; KSPEED_PORT applies.
        let spec = ClusterSpec {
            hostlist: Some("h[1-2]".into()),
            env: true,
            ..Default::default()
        };
        let (c, e) = spec.resolve_with(&env).unwrap().unwrap();
        assert_eq!(addrs(&c), ["h1:7600", "h2:7600"]);
        assert_eq!(e.unwrap().rank, 3);
        // The pattern's node count from the job, an explicit port over KSPEED_PORT.
        let spec = ClusterSpec {
            dns: Some("k-{i}.svc".into()),
            port: Some(7401),
            env: true,
            ..Default::default()
        };
        let (c, _) = spec.resolve_with(&env).unwrap().unwrap();
        assert_eq!(addrs(&c), ["k-0.svc:7401", "k-1.svc:7401"]);
        // Without the environment a pattern needs --nodes.
        let spec = ClusterSpec {
            dns: Some("k-{i}.svc:1".into()),
            ..Default::default()
        };
        let e = spec.resolve_with(&env).unwrap_err().to_string();
        assert!(e.contains("needs a node count"), "{e}");
        // Two explicit lists, or options that belong to another source.
        let two = ClusterSpec {
            hostlist: Some("h1".into()),
            addrs: Some(vec!["a:1".into()]),
            ..Default::default()
        };
        assert!(two
            .resolve_with(&env)
            .unwrap_err()
            .to_string()
            .contains("one node list"));
        let stray = ClusterSpec {
            addrs: Some(vec!["a:1".into()]),
            nodes: Some(2),
            ..Default::default()
        };
        assert!(stray.resolve_with(&env).is_err());
        // Explicit list checked against the job's node count.
        let spec = ClusterSpec {
            hostlist: Some("h[1-3]".into()),
            env: true,
            ..Default::default()
        };
        assert!(spec
            .resolve_with(&env)
            .unwrap_err()
            .to_string()
            .contains("names 3 nodes"));
    }

    /// Every launcher's variables, as that launcher sets them for rank 5 of
    /// 8 on 2 nodes of 4 (local rank 1, node 1).
    const LAUNCHERS: &[(&str, &[(&str, &str)])] = &[
        (
            "torchrun",
            &[
                ("RANK", "5"),
                ("WORLD_SIZE", "8"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "4"),
                ("GROUP_RANK", "1"),
                ("GROUP_WORLD_SIZE", "2"),
            ],
        ),
        (
            "openmpi",
            &[
                ("OMPI_COMM_WORLD_RANK", "5"),
                ("OMPI_COMM_WORLD_SIZE", "8"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ],
        ),
        (
            "mpich",
            &[
                ("PMI_RANK", "5"),
                ("PMI_SIZE", "8"),
                ("MPI_LOCALRANKID", "1"),
                ("MPI_LOCALNRANKS", "4"),
            ],
        ),
        (
            "slurm",
            &[
                ("SLURM_PROCID", "5"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_LOCALID", "1"),
                ("SLURM_TASKS_PER_NODE", "4(x2)"),
                ("SLURM_NODEID", "1"),
                ("SLURM_NNODES", "2"),
            ],
        ),
        (
            // mpirun inside a SLURM allocation: the batch step's SLURM
            // variables are there too, and Open MPI's win.
            "openmpi",
            &[
                ("OMPI_COMM_WORLD_RANK", "5"),
                ("OMPI_COMM_WORLD_SIZE", "8"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_NTASKS_PER_NODE", "1"),
            ],
        ),
        (
            // torchrun started by srun, one task per node.
            "torchrun",
            &[
                ("RANK", "5"),
                ("WORLD_SIZE", "8"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "4"),
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_TASKS_PER_NODE", "1(x2)"),
                ("SLURM_NODEID", "1"),
            ],
        ),
    ];

    #[test]
    fn every_launcher_gives_cluster_and_placement_the_same_answer() {
        for (name, vars) in LAUNCHERS {
            let mut v = vars.to_vec();
            v.push(("KSPEED_NODES", "a:1,b:1"));
            let (c, env) = Cluster::from_vars(lookup(&v)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(addrs(&c), ["a:1", "b:1"], "{name}");
            assert_eq!(env.kind.name(), *name);
            assert_eq!(
                (
                    env.rank,
                    env.world,
                    env.local_rank,
                    env.local_world,
                    env.node,
                    env.nodes
                ),
                (5, 8, 1, 4, 1, 2),
                "{name}: {env:?}"
            );
            let local = crate::placement::LocalRank::from_vars(lookup(vars)).unwrap();
            assert_eq!(
                (local.rank, local.size, local.origin.as_str()),
                (env.local_rank, env.local_world, env.local_from.as_str()),
                "{name}"
            );
            // The same through a cluster spec with an explicit list.
            let spec = ClusterSpec {
                addrs: Some(vec!["x:1".into(), "y:1".into()]),
                env: true,
                ..Default::default()
            };
            let (_, e) = spec.resolve_with(lookup(vars)).unwrap().unwrap();
            assert_eq!(e.as_ref(), Some(&env), "{name}");
        }
    }

    #[test]
    fn mpirun_variables_give_the_cluster_path_its_rank() {
        // Open MPI's mpirun: before the one launcher type, placement read
        // OMPI_COMM_WORLD_LOCAL_RANK but the cluster path found no rank.
        let (c, env) = Cluster::from_vars(lookup(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("KSPEED_NODES", "a:1,b:1"),
        ]))
        .unwrap();
        assert_eq!(c.nodes.len(), 2);
        assert_eq!((env.rank, env.world, env.node), (3, 4, 1));
        // MPICH's Hydra, one node: MASTER_ADDR is torchrun's, so a list.
        let (c, env) = Cluster::from_vars(lookup(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
            ("KSPEED_NODES", "a:1"),
        ]))
        .unwrap();
        assert_eq!(c.nodes.len(), 1);
        assert_eq!((env.rank, env.world, env.node), (1, 2, 0));
        // No launcher at all is still the named cluster error.
        let e = Cluster::from_vars(lookup(&[("KSPEED_NODES", "a:1")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("torchrun, mpirun or srun"), "{e}");
    }

    #[test]
    fn core_binding_override_and_pmi2_keep_the_job_s_node_count() {
        // mpirun with KSPEED_LOCAL_RANK=0 KSPEED_LOCAL_WORLD_SIZE=1 (the
        // core-binding override of docs/LOCAL_PATH.md): before, node 5 of
        // 8 against a 2-node list.
        let (c, env) = Cluster::from_vars(lookup(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("KSPEED_LOCAL_RANK", "0"),
            ("KSPEED_LOCAL_WORLD_SIZE", "1"),
            ("KSPEED_NODES", "a:1,b:1"),
        ]))
        .unwrap();
        assert_eq!(c.nodes.len(), 2);
        assert_eq!((env.node, env.nodes), (1, 2));
        assert_eq!((env.local_rank, env.local_world), (0, 1));
        // srun --mpi=pmi2 over 4 + 3 tasks: before, 6 / 3 = node 2 of 3.
        let (c, env) = Cluster::from_vars(lookup(&[
            ("PMI_RANK", "6"),
            ("PMI_SIZE", "7"),
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_TASKS_PER_NODE", "4,3"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NNODES", "2"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
        ]))
        .unwrap();
        assert_eq!(c.nodes.len(), 2);
        assert_eq!((env.rank, env.node, env.nodes), (6, 1, 2));
    }
}
