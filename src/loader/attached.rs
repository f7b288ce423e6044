//! The loader's *attached* mode (issue 28, docs/AGENT.md): the rank starts
//! no poller; the node's `kspeed agent` reads the rank's samples into the
//! rank's own ring (a sealed memfd passed at attach) and publishes whole
//! batches through the attach segment. Per batch only a ready word and a
//! release mark cross the process boundary.
//!
//! The rank still computes its schedule itself (the same cursor the agent
//! runs), so every batch's sample ids, lengths and ring offsets are known
//! here without a per-sample message; the agent's descriptor is checked
//! against them. Also here: the agent-side inputs a loader built inside
//! the agent takes instead of opening the space and mapping a ring itself.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::stall_causes::BATCH_PEERS;
use crate::agent::attach::{attach, AttachConn};
use crate::agent::msg::{
    AttachRequest, FLAG_DROP_LAST, FLAG_PEER_WAITS, FLAG_SHUFFLE, FLAG_SLOT_EXTRAS,
    FLAG_TIER_VIEWS, FLAG_VERIFY_CRC32C,
};
use crate::agent::segment::{
    decode_peer_wait, segment_bytes_with, BatchDesc, Liveness, RankSide, Segment, Side,
    EXTRAS_PER_SLOT, MAX_SLOTS, PEER_WAITS_PER_SLOT,
};
use crate::agent::shm::{RingMap, RingPages};
use crate::agent::tier_map::TierMap;
use crate::dataset::Space;
use crate::error::{Error, Result};
use crate::sampler::Position;

/// Whether a loader reads through the node's agent (`agent` option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AgentMode {
    /// Never: the loader runs its own pollers (embedded).
    Off,
    /// The default. In cluster mode where the agent can serve the loader
    /// (its socket exists; no tier or GPU ring of its own, a mixture only
    /// of the spaces the agent serves): attached;
    /// otherwise (or when the attach fails or the agent refuses the rank,
    /// with one WARN) embedded. The README's single-node first command is
    /// therefore unchanged.
    #[default]
    Auto,
    /// Always attached; no agent is [`Error::NoAgent`].
    Required,
}

impl AgentMode {
    /// Parses `off`, `auto` or `required`.
    pub fn parse(s: &str) -> Option<AgentMode> {
        match s {
            "off" => Some(AgentMode::Off),
            "auto" => Some(AgentMode::Auto),
            "required" => Some(AgentMode::Required),
            _ => None,
        }
    }
}

/// The agent's socket when none is given: `$KSPEED_AGENT_SOCKET`, else
/// `/run/kspeed/agent.sock`.
pub fn default_agent_socket() -> PathBuf {
    std::env::var_os("KSPEED_AGENT_SOCKET")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/kspeed/agent.sock"))
}

/// How a `NoAgent` for a node tier this rank could not map starts.
const TIER_MAP_FAILED: &str = "mapping the agent's node tier for tier views: ";

/// How long the rank waits for the agent to answer its ATTACH.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);

/// What a loader built inside the agent is given instead of opening the
/// space and mapping a ring: the space the agent opened and checked once,
/// its extent files (opened once, shared by every rank's pollers) and the
/// rank's ring.
#[derive(Clone)]
pub(crate) struct AgentInput {
    pub(crate) space: Arc<Space>,
    pub(crate) extents: Arc<[std::fs::File]>,
    pub(crate) direct_io: bool,
    /// Taken by the build (a builder is Clone; the ring is not).
    pub(crate) ring: Arc<Mutex<Option<RingMap>>>,
    /// The node's memory tier, shared by every rank the agent serves
    /// (a checked tier: [`super::tier::Tier::new_checked`]).
    pub(crate) tier: Option<Arc<super::tier::Tier>>,
    /// In a cluster over TCP: the agent's one network thread, which the
    /// loader joins as a lane instead of connecting to every node itself
    /// (one link per pair of nodes, `net/hub.rs`).
    pub(crate) net_hub: Option<Arc<super::net::NetHub>>,
    /// The node's poller threads, which take turns for this rank's
    /// pollers (None: a thread per poller, `kspeed agent --node-pollers 0`).
    pub(crate) node_pollers: Option<Arc<super::node_pollers::NodePollers>>,
    /// The agent's own lane of a shared network thread, which keeps the
    /// thread and its links up while the agent runs (`agent/cluster.rs`,
    /// `KeptLinks`): a run with nothing to read (its end epoch is its
    /// start epoch), so it grants nothing and its pollers read nothing.
    pub(crate) links_only: bool,
    /// The shared network thread to join (None: the one with the fewest
    /// lanes): each of the agent's own lanes goes to its own thread.
    pub(crate) net_hub_slot: Option<usize>,
    /// An agent serving a mixture's spaces side by side (`kspeed agent
    /// --space A --space B`): every space with its extents, in order,
    /// `space` and `extents` being the first's; empty for one space.
    pub(crate) mix_parts: Vec<(Arc<Space>, Arc<[std::fs::File]>)>,
    /// The agent's waits over every rank it serves (its metrics): the
    /// loader adds each of its waits there too.
    pub(crate) stall_totals: Option<Arc<super::stall_totals::StallTotals>>,
    /// The agent's node-down notices (with a node service): its network
    /// threads post there the nodes they judge dead.
    pub(crate) node_notices: Option<Arc<crate::transport::notices::NodeNotices>>,
    /// The node's cache area and its planner for the node's ranks
    /// (`kspeed agent --cache-scope node`), this rank's lane of it.
    pub(crate) node_cache: Option<super::cache_node::NodeCacheLease>,
}

impl std::fmt::Debug for AgentInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentInput")
            .field("space", &self.space.dir())
            .field("extents", &self.extents.len())
            .finish()
    }
}

/// The rank's settings an attach sends (the agent computes the schedule
/// from them).
#[derive(Debug, Clone)]
pub(crate) struct AttachSettings {
    pub(crate) socket: PathBuf,
    pub(crate) dataset_id: u64,
    pub(crate) seed: u64,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) batch_size: u32,
    pub(crate) shuffle: bool,
    /// The sampler's shuffle block (0: the whole dataset; sent only when it
    /// shuffles in blocks, in an ATTACH of version 6).
    pub(crate) shuffle_block: u64,
    pub(crate) drop_last: bool,
    /// The agent checks each sample's CRC32C (`verify_crc32c`).
    pub(crate) verify_crc32c: bool,
    /// Samples the agent serves from its node tier come as read-only
    /// views of the tier, not copies in the ring (`tier_views`).
    pub(crate) tier_views: bool,
    /// The agent names, with each batch, the nodes it waited for longest
    /// (ATTACH flag 16, segment layout 7), so the rank's stall is split by
    /// node too.
    pub(crate) peer_waits: bool,
    /// With peer waits, the extra words (ATTACH flag 32, segment layout
    /// 8): the source bytes and the peers' waits by phase, so the rank's
    /// `source_bytes` and `peer_read`/`peer_send`/`peer_link` are counted.
    pub(crate) slot_extras: bool,
    /// The NUMA node each attach's ring is bound to (`numa_node`, or the
    /// GPU's at `gpu_pci`), as an embedded ring would be.
    pub(crate) numa_node: Option<u32>,
    /// Batch slots of the segment: as many batches as the ring can hold.
    pub(crate) slots: u32,
    /// The loader's end epoch: the agent reads nothing from it on.
    pub(crate) end_epoch: Option<u64>,
    /// Local rank and ranks on the node, when a launcher or the options
    /// said (the agent chooses the node tier's members by the node's
    /// reads).
    pub(crate) local: Option<(u16, u16)>,
    /// How long to wait for a restarted agent (`agent_restart_wait_ms`).
    pub(crate) restart_wait: Duration,
}

/// What a refusal of ATTACH flag 16 turns into (the start of
/// [`Error::NoAgent`]'s reason), for [`RankAttach::connect`] to attach
/// again without peer waits.
const PEER_WAITS_UNKNOWN: &str = "the agent predates peer waits";
/// The same for the extra words (ATTACH flag 32).
const SLOT_EXTRAS_UNKNOWN: &str = "the agent predates extra words";

/// The bits of an agent's "unknown flags 0x…" refusal (0 when the reason
/// names none).
fn unknown_flags(reason: &str) -> u32 {
    reason
        .split("unknown flags 0x")
        .nth(1)
        .and_then(|rest| {
            let hex: String = rest.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
            u32::from_str_radix(&hex, 16).ok()
        })
        .unwrap_or(0)
}

/// How long an attached rank waits for an agent whose heartbeat stopped
/// while its socket stays open (stopped, hung, or starved of CPU) before
/// it is `AgentGone`: a dead agent's socket hangs up, which ends the wait
/// at once; a silent one that is alive may only be slow.
const STALLED_AGENT: Duration = Duration::from_secs(10);

/// Slots for a ring of `table_len` sample slots and batches of
/// `batch_size`: the most batches the ring can hold at once (a power of
/// two, at most [`MAX_SLOTS`]).
pub(crate) fn slots_for(table_len: u64, batch_size: usize) -> u32 {
    let batches = (table_len / batch_size as u64).max(1) + 1;
    batches.next_power_of_two().min(u64::from(MAX_SLOTS)) as u32
}

/// One attach of a rank to the agent: the connection (its hang-up tells
/// the agent the rank is gone), the rank's side of the segment, and the
/// batches taken and not yet released.
pub(crate) struct RankAttach {
    socket: PathBuf,
    conn: AttachConn,
    side: RankSide,
    live: Liveness,
    /// First sequence number (g) of every batch taken and not released,
    /// oldest first (at most `slots`; allocated once).
    out: VecDeque<u64>,
    /// Batches released (the release mark).
    released: u64,
    slots: u32,
    /// The node tier, mapped read-only, when the agent shared it (tier
    /// views).
    tier: Option<Arc<TierMap>>,
    /// A peer-wait word naming no node was logged.
    bad_peer_wait_said: std::cell::Cell<bool>,
    /// Likewise for an extra word out of its range.
    bad_extras_said: std::cell::Cell<bool>,
}

impl std::fmt::Debug for RankAttach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankAttach")
            .field("socket", &self.socket)
            .finish()
    }
}

impl RankAttach {
    /// Attaches `ring` at `start`: a fresh segment, the ATTACH, the reply.
    /// Any failure is [`Error::NoAgent`] naming the socket.
    ///
    /// An agent that predates tier views refuses a rank asking for them
    /// (ATTACH flag 8): the rank attaches again without them, with one
    /// WARN, and takes every sample in its ring (DALI asks for views by
    /// default; a mixed-version node must not cost it the agent).
    ///
    /// Likewise an agent that predates peer waits (ATTACH flag 16): the
    /// rank attaches again without them (one INFO line), and its stall is
    /// split by cause but not by node.
    pub(crate) fn connect(
        s: &AttachSettings,
        ring: &RingMap,
        start: Position,
        job: Option<crate::sampler::JobPosition>,
        mix: Option<crate::agent::msg::MixAttach>,
    ) -> Result<Self> {
        // Each retry turns one feature off: at most four attaches.
        let mut s = s.clone();
        loop {
            match Self::connect_once(&s, ring, start, job, mix.clone()) {
                Err(Error::NoAgent { reason, .. })
                    if s.peer_waits && reason.starts_with(PEER_WAITS_UNKNOWN) =>
                {
                    log::info!(
                        "the kspeed agent at {} predates peer waits: this rank's stall is split by cause, not by node",
                        s.socket.display()
                    );
                    s.peer_waits = false;
                    s.slot_extras = false;
                }
                Err(Error::NoAgent { reason, .. })
                    if s.slot_extras && reason.starts_with(SLOT_EXTRAS_UNKNOWN) =>
                {
                    log::info!(
                        "the kspeed agent at {} predates extra words: this rank counts no source bytes, and its waits for peers are not split by phase",
                        s.socket.display()
                    );
                    s.slot_extras = false;
                }
                Err(Error::NoAgent { reason, .. })
                    if s.tier_views
                        && (reason.contains("predates tier views through the agent")
                            || reason.starts_with(TIER_MAP_FAILED)) =>
                {
                    log::warn!(
                        "the kspeed agent at {}: no tier views ({reason}); taking every sample in the ring",
                        s.socket.display()
                    );
                    s.tier_views = false;
                }
                r => return r,
            }
        }
    }

    fn connect_once(
        s: &AttachSettings,
        ring: &RingMap,
        start: Position,
        job: Option<crate::sampler::JobPosition>,
        mix: Option<crate::agent::msg::MixAttach>,
    ) -> Result<Self> {
        let no_agent = |e: Error| Error::NoAgent {
            socket: s.socket.clone(),
            reason: e.to_string(),
        };
        let views = if s.tier_views { s.batch_size } else { 0 };
        let peer_waits = if s.peer_waits { PEER_WAITS_PER_SLOT } else { 0 };
        let extras = s.peer_waits && s.slot_extras;
        let seg = Segment::create_with(s.slots, ring.len(), views, s.peer_waits, extras)
            .map_err(no_agent)?;
        let side = RankSide::new(seg).map_err(no_agent)?;
        let req = AttachRequest {
            generation: side.generation(),
            dataset_id: s.dataset_id,
            seed: s.seed,
            rank: s.rank,
            world: s.world,
            batch_size: s.batch_size,
            slots: s.slots,
            start_epoch: start.epoch,
            start_index: start.index,
            ring_bytes: ring.len(),
            segment_bytes: segment_bytes_with(
                s.slots,
                views,
                peer_waits,
                if extras { EXTRAS_PER_SLOT } else { 0 },
            ),
            flags: if s.shuffle { FLAG_SHUFFLE } else { 0 }
                | if s.drop_last { FLAG_DROP_LAST } else { 0 }
                | if s.verify_crc32c {
                    FLAG_VERIFY_CRC32C
                } else {
                    0
                }
                | if s.tier_views { FLAG_TIER_VIEWS } else { 0 }
                | if s.peer_waits { FLAG_PEER_WAITS } else { 0 }
                | if extras { FLAG_SLOT_EXTRAS } else { 0 },
            end_epoch: s.end_epoch,
            job,
            local: s.local,
            shuffle_block: if s.shuffle { s.shuffle_block } else { 0 },
            mix,
        };
        let (conn, reply, tier_fd) = attach(&s.socket, &req, ring, side.segment(), ATTACH_TIMEOUT)
            .map_err(|e| match e {
                // An agent from before peer waits refuses flag 16 (with
                // any other it does not know): attached again without it.
                Error::AttachRefused { ref reason, .. }
                    if s.peer_waits && unknown_flags(reason) & FLAG_PEER_WAITS != 0 =>
                {
                    Error::NoAgent {
                        socket: s.socket.clone(),
                        reason: format!("{PEER_WAITS_UNKNOWN}: {e}"),
                    }
                }
                // One from before the extra words refuses flag 32.
                Error::AttachRefused { ref reason, .. }
                    if extras && unknown_flags(reason) & FLAG_SLOT_EXTRAS != 0 =>
                {
                    Error::NoAgent {
                        socket: s.socket.clone(),
                        reason: format!("{SLOT_EXTRAS_UNKNOWN}: {e}"),
                    }
                }
                // An agent from before a flag refuses the bit: say which.
                Error::AttachRefused { ref reason, .. } if reason.contains("unknown flags") => {
                    let what = if reason.contains("unknown flags 0x4") {
                        "verify_crc32c in the agent: upgrade it, or read with verify_crc32c off or agent = off"
                    } else if reason.contains("unknown flags 0x8") {
                        "tier views through the agent: upgrade it, or read with tier_views off"
                    } else {
                        "verify_crc32c and tier views in the agent: upgrade it, or read with both off or agent = off"
                    };
                    Error::NoAgent {
                        socket: s.socket.clone(),
                        reason: format!("{e} (this agent predates {what})"),
                    }
                }
                // An agent from before version 6 refuses a block shuffle's
                // or a mixture's ATTACH by its version (or, a large
                // mixture's, as longer than it reads): say why.
                Error::AttachRefused { code, .. }
                    if (code == "version" || code == "protocol") && req.version() > 5 =>
                {
                    let what = if req.mix.is_some() {
                        "mixtures"
                    } else {
                        "shuffle_block"
                    };
                    Error::NoAgent {
                        socket: s.socket.clone(),
                        reason: format!(
                            "{e} ({} {what} in the agent, ATTACH version {}: upgrade it, or read with agent = off)",
                            if code == "version" {
                                "this agent predates"
                            } else {
                                "if this agent is older than"
                            },
                            req.version()
                        ),
                    }
                }
                e => no_agent(e),
            })?;
        let tier = match tier_fd {
            // Not mapped (ENOMEM, the map count): attached again without
            // views by `connect`.
            Some(fd) => Some(Arc::new(TierMap::open(fd, reply.tier_bytes).map_err(
                |e| Error::NoAgent {
                    socket: s.socket.clone(),
                    reason: format!("{TIER_MAP_FAILED}{e}"),
                },
            )?)),
            None => None,
        };
        if s.tier_views {
            match &tier {
                Some(t) => log::info!(
                    "tier views: the agent's node tier ({} bytes) is mapped read-only; samples served from it are not copied into the ring",
                    t.len()
                ),
                None => log::info!(
                    "tier views: the agent gave no node tier (it has none, or holds another user's samples); every sample comes in the ring"
                ),
            }
        }
        let beat = Duration::from_millis(u64::from(reply.heartbeat_ms.max(1)));
        log::info!(
            "attached to the kspeed agent at {} (pid {}, heartbeat {} ms); ring of {} bytes in {}{}",
            s.socket.display(),
            reply.agent_pid,
            reply.heartbeat_ms,
            ring.len(),
            ring.pages().describe(),
            match ring.numa_node() {
                Some(n) => format!(", bound to NUMA node {n}"),
                None => String::new(),
            }
        );
        if ring.pages() == RingPages::Normal {
            log::info!(
                "the agent reads into 4 KiB pages, which costs it CPU per read: reserve 2 MiB pages \
                 (vm.nr_hugepages, a ring that is a multiple of 2 MiB) or set shared-memory THP to \
                 advise (docs/DEPLOY.md, \"Huge pages for attached rings\")"
            );
        }
        Ok(RankAttach {
            socket: s.socket.clone(),
            conn,
            side,
            // Gone after 3 heartbeats without one.
            live: Liveness {
                slice: beat,
                silence_limit: beat * 3,
            },
            out: VecDeque::with_capacity(s.slots as usize),
            released: 0,
            slots: s.slots,
            tier,
            bad_peer_wait_said: std::cell::Cell::new(false),
            bad_extras_said: std::cell::Cell::new(false),
        })
    }

    /// The node tier this attach mapped for views, if the agent shared it.
    pub(crate) fn tier(&self) -> Option<Arc<TierMap>> {
        self.tier.clone()
    }

    /// View word `i` of the batch taken last (0: in the ring).
    pub(crate) fn view(&self, i: usize) -> u64 {
        self.side.taken_view(i)
    }

    /// The batch taken last's peer waits: (node, µs), (0, 0) for an empty
    /// entry (all empty without a peer-wait table). They are statistics:
    /// a row with a word that names no node is taken as empty, with one
    /// WARN for the attach (its stall is then split by cause only).
    pub(crate) fn peer_waits(&self) -> [(u32, u32); BATCH_PEERS] {
        let mut out = [(0, 0); BATCH_PEERS];
        for (i, e) in out.iter_mut().enumerate() {
            match decode_peer_wait(self.side.taken_peer_wait(i)) {
                Ok(Some(w)) => *e = w,
                Ok(None) => {}
                Err(what) => {
                    if !self.bad_peer_wait_said.replace(true) {
                        log::warn!(
                            "the kspeed agent at {}: {what}; this batch's wait is not split by node",
                            self.socket.display()
                        );
                    }
                    return [(0, 0); BATCH_PEERS];
                }
            }
        }
        out
    }

    /// The batch taken last's extra words (all zero without an extras
    /// table). Statistics as the peer waits are: a row with a word out of
    /// its range is taken as zero, with one WARN for the attach.
    pub(crate) fn extras(&self) -> crate::agent::segment::BatchExtras {
        match self.side.taken_extras() {
            Ok(e) => e,
            Err(what) => {
                if !self.bad_extras_said.replace(true) {
                    log::warn!(
                        "the kspeed agent at {}: {what}; this batch's source bytes and peer phases are not counted",
                        self.socket.display()
                    );
                }
                Default::default()
            }
        }
    }

    /// The next batch: its descriptor once the agent published it (no
    /// system call while batches are ahead); `first_g` is its first
    /// sample's sequence number, kept until it is released. With the time
    /// waited for it (zero when it was already there).
    pub(crate) fn take(&mut self, first_g: u64) -> Result<(BatchDesc, Duration)> {
        let mut waited = Duration::ZERO;
        let desc = match self.side.try_take() {
            Some(d) => d,
            None => {
                let t0 = std::time::Instant::now();
                let conn = &self.conn;
                let socket = &self.socket;
                let mut hung_up = false;
                let mut check = || {
                    if conn.peer_closed() {
                        hung_up = true;
                        return Err(Error::AttachSocket {
                            path: socket.clone(),
                            what: "hung up".into(),
                        });
                    }
                    Ok(())
                };
                let mut r = self.side.wait_take(&self.live, None, &mut check);
                if let Err(Error::AttachPeerGone {
                    closed: false,
                    silent_ms,
                    ..
                }) = r
                {
                    if !conn.peer_closed() {
                        // Silent for 3 heartbeats, but its socket is open:
                        // the agent process is alive, stopped or starved
                        // of CPU (a loaded node, a throttled cgroup), not
                        // dead (a dead one's socket hangs up at once). It
                        // gets STALLED_AGENT_MS in all before it is gone.
                        log::warn!(
                            "the kspeed agent at {}: its heartbeat has been silent for \
                             {silent_ms} ms but its socket is open (stopped or starved of \
                             CPU?): waiting up to {} s for it",
                            socket.display(),
                            STALLED_AGENT.as_secs()
                        );
                        let stalled = Liveness {
                            slice: self.live.slice,
                            silence_limit: STALLED_AGENT,
                        };
                        r = self.side.wait_take(&stalled, None, &mut check);
                    }
                }
                waited = t0.elapsed();
                match r {
                    Ok(d) => d,
                    Err(e) => return Err(self.gone(e, hung_up)),
                }
            }
        };
        // The agent publishes at most `slots` batches past the release
        // mark, so more out than that is a bug on one side.
        assert!(
            self.out.len() < self.slots as usize,
            "more batches out than the segment's {} slots",
            self.slots
        );
        self.out.push_back(first_g);
        Ok((desc, waited))
    }

    /// The agent-gone error for a failed wait.
    fn gone(&self, e: Error, hung_up: bool) -> Error {
        let (_, pid, silent_ns) = self.side.segment().side_status(Side::Agent);
        let why = match e {
            Error::AttachPeerGone { closed: true, .. } => "it detached".to_string(),
            Error::AttachPeerGone { .. } => "its heartbeat stopped".to_string(),
            _ if hung_up => "its socket hung up".to_string(),
            other => return other,
        };
        Error::AgentGone {
            socket: self.socket.clone(),
            pid,
            last_heartbeat_ms: silent_ns / 1_000_000,
            why,
        }
    }

    /// Releases every batch whose first sample comes before `g` (the
    /// loader's released mark moved to sample `g`).
    pub(crate) fn release_before(&mut self, g: u64) {
        let before = self.released;
        while self.out.front().is_some_and(|&first| first < g) {
            self.out.pop_front();
            self.released += 1;
        }
        if self.released != before {
            self.side.release(self.released);
        }
    }
}

impl Drop for RankAttach {
    fn drop(&mut self) {
        // A clean detach: the agent stops this rank's pollers, lets their
        // reads land and unmaps (the connection's hang-up says the same).
        self.side.close();
    }
}
