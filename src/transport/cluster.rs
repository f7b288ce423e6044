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
//! From the environment ([`Cluster::from_env`]): torchrun's `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` and `GROUP_RANK` give this
//! process's rank and node; `KSPEED_NODES` lists the node services'
//! addresses in node order (comma-separated). torchrun gives only
//! `MASTER_ADDR`, so without `KSPEED_NODES` a one-node job uses
//! `MASTER_ADDR:KSPEED_PORT` (default port 7400) and a multi-node job is a
//! named error. See docs/PROTOCOL.md ("Describing a cluster").

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;

use crate::error::{Error, Result};

/// One node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Node index (the placement's node number).
    pub index: u32,
    /// The node service's address as written (`host:port`).
    pub addr: String,
}

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

/// The launcher's view of this process (torchrun's variables).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank (`RANK`).
    pub rank: u32,
    /// Ranks in the job (`WORLD_SIZE`).
    pub world: u32,
    /// Rank on this node (`LOCAL_RANK`).
    pub local_rank: u32,
    /// Ranks per node (`LOCAL_WORLD_SIZE`, default 1).
    pub local_world: u32,
    /// This node's index (`GROUP_RANK`, or `RANK / LOCAL_WORLD_SIZE`).
    pub node: u32,
}

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

    /// The cluster and this process's place in it from the environment:
    /// `KSPEED_NODES` (comma-separated `host:port`, in node order) plus
    /// torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
    /// `GROUP_RANK`; without `KSPEED_NODES`, `MASTER_ADDR` with
    /// `KSPEED_PORT` (default 7400) when there is one node.
    pub fn from_env() -> Result<(Cluster, LaunchEnv)> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`Cluster::from_env`] over any variable lookup (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<(Cluster, LaunchEnv)> {
        let num = |k: &str, default: Option<u32>| -> Result<u32> {
            match var(k) {
                Some(v) => v.trim().parse().map_err(|_| Error::BadCluster {
                    origin: format!("environment variable {k}"),
                    reason: format!("{v:?} is not a number"),
                }),
                None => default.ok_or_else(|| Error::BadCluster {
                    origin: format!("environment variable {k}"),
                    reason: "not set (is this process started by torchrun?)".into(),
                }),
            }
        };
        let rank = num("RANK", None)?;
        let world = num("WORLD_SIZE", None)?;
        let local_rank = num("LOCAL_RANK", Some(0))?;
        let local_world = num("LOCAL_WORLD_SIZE", Some(1))?.max(1);
        if rank >= world {
            return Err(Error::BadCluster {
                origin: "environment variable RANK".into(),
                reason: format!("rank {rank} is not below WORLD_SIZE {world}"),
            });
        }
        let node = num("GROUP_RANK", Some(rank / local_world))?;
        let node_count = world.div_ceil(local_world);
        let env = LaunchEnv {
            rank,
            world,
            local_rank,
            local_world,
            node,
        };
        let cluster = match var("KSPEED_NODES") {
            Some(list) => {
                let text: String = list
                    .split(',')
                    .map(str::trim)
                    .filter(|a| !a.is_empty())
                    .enumerate()
                    .map(|(i, a)| format!("{i} {a}\n"))
                    .collect();
                Self::parse(&text, "environment variable KSPEED_NODES")?
            }
            None => {
                if node_count > 1 {
                    return Err(Error::BadCluster {
                        origin: "environment".into(),
                        reason: format!(
                            "{node_count} nodes but KSPEED_NODES is not set: list the node services' addresses there (torchrun only gives MASTER_ADDR)"
                        ),
                    });
                }
                let master = var("MASTER_ADDR").ok_or_else(|| Error::BadCluster {
                    origin: "environment variable MASTER_ADDR".into(),
                    reason: "not set".into(),
                })?;
                let port = num("KSPEED_PORT", Some(7400))?;
                Self::parse(&format!("0 {master}:{port}\n"), "environment")?
            }
        };
        if cluster.nodes.len() as u32 != node_count {
            return Err(Error::BadCluster {
                origin: "environment".into(),
                reason: format!(
                    "KSPEED_NODES lists {} nodes but WORLD_SIZE / LOCAL_WORLD_SIZE = {node_count}",
                    cluster.nodes.len()
                ),
            });
        }
        Ok((cluster, env))
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
            ("LOCAL_WORLD_SIZE", "2"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("KSPEED_NODES"), "{e}");
    }
}
