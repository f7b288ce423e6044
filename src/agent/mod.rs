//! The node agent's attach layer (issue 28, docs/AGENT.md): how a training
//! rank's loader in *attached* mode hands its landing ring to the node's
//! one kspeed agent and then exchanges, per batch, only a ready word and a
//! release mark through shared memory.
//!
//! - [`segment`]: the attach segment's layout (ready words with a
//!   generation, the release mark, futex words, error slots, stats,
//!   heartbeats); its child `sides` holds each side's view
//!   ([`segment::AgentSide`], [`segment::RankSide`]) and the wait loop;
//! - [`shm`]: sealed memfds, the ring's mapping ([`shm::RingMap`]), the
//!   shared futex, the monotonic clock;
//! - [`msg`]: the ATTACH / ATTACHED / REFUSED messages (fixed
//!   little-endian layouts);
//! - [`attach`]: the agent's Unix socket (`SOCK_SEQPACKET`,
//!   `SO_PEERCRED`, the two memfds passed with `SCM_RIGHTS`);
//! - [`tier_map`]: the rank's read-only mapping of the node tier (tier
//!   views through the agent).
//!
//! - `metrics`: the agent's own series in its node service's Prometheus
//!   scrape (its ranks, and what its loaders waited for);
//! - [`node`]: `kspeed agent` itself (first slice: one node, a local
//!   space): the socket, one loader producer per attached rank reading
//!   into the rank's ring, a feeder publishing its batches.
//!
//! The loader's attached mode (`agent = required|auto`) is the rank side.
//! Hidden from the documented API while the agent is one slice.

pub mod attach;
pub mod cluster;
mod metrics;
pub mod msg;
pub mod node;
mod node_cache;
mod node_tier;
pub mod segment;
pub mod shm;
mod sock_lock;
pub mod tier_map;
