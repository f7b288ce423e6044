//! The attach layer across real processes (issue 28, docs/AGENT.md): one
//! process plays the node's agent, a re-executed copy of this test binary
//! (`KSPEED_ATTACH_ROLE` picks its role) plays the rank, or the other way
//! round. They attach over the Unix socket with the ring and segment
//! memfds passed by SCM_RIGHTS, both map them, and batches cross through
//! ready words, release marks and shared futexes. Every wait on a child
//! has a deadline, and every child gives up on its own after one too.
//! (Why this file is over ~800 lines: one test binary per contract, as tests/cluster.rs;
//! the roles share the publish/take loops defined once here.)

mod common;

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use kspeed::agent::attach::{attach, AttachConn, AttachListener, ListenerConfig};
use kspeed::agent::msg::{decode_reply, AttachRequest, AttachedReply};
use kspeed::agent::segment::{
    decode_release, in_flight, is_ready, ready_word, release_mark, segment_bytes, AgentSide,
    BatchDesc, BatchReads, Generation, Liveness, RankSide, Segment, SEQ_MASK,
};
use kspeed::agent::shm::RingMap;
use kspeed::Error;
use proptest::prelude::*;

const ROLE: &str = "KSPEED_ATTACH_ROLE";
const SOCKET: &str = "KSPEED_ATTACH_SOCKET";
const SLOTS: u32 = 8;
/// Each slot owns a fixed area of the ring this big.
const SLOT_BYTES: u64 = 4096;
/// Batches per attach generation. The short middle one leaves words of
/// sequences 0..5 in the slots, the very sequences the next generation
/// starts with: only the generation bits tell them apart.
const ROUND_BATCHES: [u64; 3] = [3000, 5, 3000];
/// How long any child may live: it exits with a failure after this.
const CHILD_LIFE: Duration = Duration::from_secs(60);

/// For the data-path test: sleeps long enough that a timed-out sleep
/// means a lost wake, not a slow peer.
fn live_long() -> Liveness {
    Liveness {
        slice: Duration::from_secs(2),
        silence_limit: Duration::from_secs(5),
    }
}

fn live() -> Liveness {
    Liveness {
        slice: Duration::from_millis(20),
        // Generous: the 20-run check keeps both cores busy.
        silence_limit: Duration::from_secs(1),
    }
}

fn batch_len(seq: u64) -> usize {
    16 + (kspeed::hash::mix64(seq) % (SLOT_BYTES - 16)) as usize
}

/// The bytes of batch `seq` of generation `gen`: its identity first, so a
/// stale batch shows as the wrong identity, then a pattern of both.
fn fill(gen: Generation, seq: u64, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&u64::from(gen.get()).to_le_bytes());
    let mut z = kspeed::hash::mix64(seq ^ (u64::from(gen.get()) << 48));
    while out.len() < batch_len(seq) {
        z = kspeed::hash::mix64(z);
        out.push(z as u8);
    }
}

fn request(seg: &Segment, ring: &RingMap) -> AttachRequest {
    AttachRequest {
        generation: seg.generation().unwrap(),
        dataset_id: 0x5eed,
        seed: 42,
        rank: 0,
        world: 1,
        batch_size: 1,
        slots: seg.slots(),
        start_epoch: 0,
        start_index: 0,
        ring_bytes: ring.len(),
        segment_bytes: segment_bytes(seg.slots()),
        flags: 0,
        end_epoch: None,
        job: None,
        local: None,
        shuffle_block: 0,
        mix: None,
    }
}

fn new_rank() -> (RingMap, Segment) {
    let ring = RingMap::create(u64::from(SLOTS) * SLOT_BYTES).unwrap();
    let seg = Segment::create(SLOTS, ring.len()).unwrap();
    (ring, seg)
}

fn spawn(test: &str, role: &str, sock: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture"])
        .env(ROLE, role)
        .env(SOCKET, sock)
        .spawn()
        .unwrap()
}

/// Waits for the child to exit, killing it and failing past `within`.
fn wait_child(child: &mut Child, within: Duration) -> ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child {} still running after {within:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Accepts one attach, failing when none comes before the deadline or the
/// child exits first.
fn accept_one(l: &AttachListener, child: &mut Child) -> kspeed::agent::attach::Incoming {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(inc) = l.accept_attach(Duration::from_millis(50)).unwrap() {
            return inc;
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!("child exited ({st}) before attaching");
        }
        assert!(Instant::now() < deadline, "no attach within 20 s");
    }
}

/// Connects to the child's agent once its socket answers.
fn attach_when_up(sock: &Path, ring: &RingMap, seg: &Segment) -> (AttachConn, AttachedReply) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match attach(sock, &request(seg, ring), ring, seg, Duration::from_secs(5)) {
            Ok((conn, reply, _)) => return (conn, reply),
            Err(Error::Io { op: "connect", .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("attach: {e}"),
        }
    }
}

fn child_deadline() -> Option<Instant> {
    Some(Instant::now() + CHILD_LIFE)
}

/// The agent's loop: publish batches `0..count` of the attach's generation,
/// each into its slot's area of the ring, waiting (futex) for room.
/// `pause_every` makes the rank run dry now and then so it sleeps.
fn agent_publish(
    live: &Liveness,
    a: &mut AgentSide,
    ring: &RingMap,
    conn: Option<&AttachConn>,
    count: u64,
    pause_every: u64,
) -> kspeed::Result<()> {
    let gen = a.segment().generation().unwrap();
    let mut buf = Vec::with_capacity(SLOT_BYTES as usize);
    let deadline = child_deadline();
    for seq in 0..count {
        if !a.has_room()? {
            a.wait_room(live, deadline, &mut || match conn {
                Some(c) if c.peer_closed() => Err(Error::AttachPeerGone {
                    peer: "rank",
                    pid: c.peer().pid,
                    silent_ms: 0,
                    closed: true,
                }),
                _ => Ok(()),
            })?;
        }
        fill(gen, seq, &mut buf);
        let off = (seq % u64::from(SLOTS)) * SLOT_BYTES;
        ring.write_at(off, &buf);
        a.publish(&BatchDesc {
            ring_offset: off,
            bytes: buf.len() as u64,
            epoch: seq / 1000,
            batch_in_epoch: seq % 1000,
            samples: 1,
            reads: reads_of(seq),
        })?;
        if seq % 64 == 0 {
            a.beat();
        }
        if pause_every > 0 && seq % pause_every == pause_every - 1 {
            spin(Duration::from_millis(2));
        }
    }
    Ok(())
}

/// The read counts the agent's loop sends with batch `seq` (distinct per
/// field, so a swapped or dropped field shows).
fn reads_of(seq: u64) -> BatchReads {
    let base = (seq % 1_000_000) as u32 * 4;
    BatchReads {
        disk_reads: base,
        tier_hits: base + 1,
        remote_samples: base + 2,
        source_reads: u32::MAX - base,
        failovers: base + 3,
        cache_hits: base + 8,
        read_latency: std::array::from_fn(|k| (base as u16).wrapping_add(9 + k as u16)),
        waits: kspeed::agent::segment::BatchWaits {
            disk_us: base + 4,
            tier_us: base + 5,
            source_us: base + 6,
            peers_us: u32::MAX - base - 1,
            failover_us: base + 7,
        },
    }
}

/// The rank's loop: take batches `0..count`, check every byte, release.
fn rank_take(
    live: &Liveness,
    r: &mut RankSide,
    ring: &RingMap,
    count: u64,
    pause_every: u64,
) -> kspeed::Result<()> {
    let gen = r.generation();
    let mut want = Vec::with_capacity(SLOT_BYTES as usize);
    let deadline = child_deadline();
    for seq in 0..count {
        let d = r.wait_take(live, deadline, &mut || Ok(()))?;
        fill(gen, seq, &mut want);
        assert_eq!(
            (d.ring_offset, d.bytes, d.epoch, d.batch_in_epoch, d.reads),
            (
                (seq % u64::from(SLOTS)) * SLOT_BYTES,
                want.len() as u64,
                seq / 1000,
                seq % 1000,
                reads_of(seq)
            ),
            "descriptor of batch {seq} in generation {}",
            gen.get()
        );
        // SAFETY: batch `seq` is taken and not yet released.
        let got = unsafe { ring.slice(d.ring_offset, d.bytes as usize) };
        assert!(
            got == want.as_slice(),
            "bytes of batch {seq} in generation {}",
            gen.get()
        );
        r.release(seq + 1);
        if seq % 64 == 0 {
            r.beat();
        }
        if pause_every > 0 && seq % pause_every == pause_every / 2 {
            spin(Duration::from_millis(2));
        }
    }
    Ok(())
}

/// Busy for `d`: a slow consumer or producer (not a wait for anything).
fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn temp_socket() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("run/kspeed/agent.sock");
    (dir, sock)
}

fn role() -> Option<(String, PathBuf)> {
    let r = std::env::var(ROLE).ok()?;
    Some((r, std::env::var_os(SOCKET).unwrap().into()))
}

// ---- batches across processes and generations ---------------------------

#[test]
fn batches_cross_processes_and_generations() {
    const NAME: &str = "batches_cross_processes_and_generations";
    if let Some((_, sock)) = role() {
        // The rank: one ring and segment, attached three times, each in a
        // new generation (the ready words of the last stay in the slots).
        let (ring, mut seg) = new_rank();
        for (round, &count) in ROUND_BATCHES.iter().enumerate() {
            if round > 0 {
                seg.begin_generation();
            }
            let mut r = RankSide::new(seg).unwrap();
            // The last generation's ready words are still in the slots.
            assert_eq!(
                r.try_take(),
                None,
                "a ready word of the last generation was taken"
            );
            let (conn, reply, _) = attach(
                &sock,
                &request(r.segment(), &ring),
                &ring,
                r.segment(),
                Duration::from_secs(5),
            )
            .unwrap();
            assert_eq!(reply.generation, r.generation());
            rank_take(&live_long(), &mut r, &ring, count, 500).unwrap();
            let st = r.segment().stats();
            println!("rank round {round}: {st:?}");
            // Every sleep ended in a wake from the agent's process.
            assert_eq!(r.sleep_timeouts(), 0, "rank sleeps with no wake");
            drop(conn);
            seg = r.into_segment();
        }
        return;
    }
    let (_dir, sock) = temp_socket();
    let l = AttachListener::bind(&sock, ListenerConfig::default()).unwrap();
    let mut child = spawn(NAME, "rank", &sock);
    let (mut agent_sleeps, mut rank_sleeps, mut wakes) = (0, 0, 0);
    let mut gens = Vec::new();
    for &count in &ROUND_BATCHES {
        let mut inc = accept_one(&l, &mut child).accept(20, None).unwrap();
        assert_eq!(inc.conn.peer().pid, child.id());
        gens.push(inc.request.generation.get());
        let a = &mut inc.side;
        agent_publish(&live_long(), a, &inc.ring, Some(&inc.conn), count, 700).unwrap();
        assert_eq!(a.sleep_timeouts(), 0, "agent sleeps with no wake");
        let st = a.segment().stats();
        assert_eq!(st.published, count);
        (agent_sleeps, rank_sleeps, wakes) = (
            st.agent_sleeps,
            st.rank_sleeps,
            st.agent_wakes + st.rank_wakes,
        );
    }
    let st = wait_child(&mut child, Duration::from_secs(60));
    assert!(st.success(), "rank child: {st}");
    assert_eq!(gens, [1, 2, 3]);
    // Both sides slept on the shared futexes and were woken across the
    // process boundary (counters are the segment's, over all rounds).
    assert!(
        agent_sleeps > 0 && rank_sleeps > 0 && wakes > 0,
        "agent sleeps {agent_sleeps}, rank sleeps {rank_sleeps}, wakes {wakes}"
    );
    eprintln!(
        "{} batches in {} generations; agent slept {agent_sleeps}, rank {rank_sleeps}, wakes {wakes}",
        ROUND_BATCHES.iter().sum::<u64>(),
        ROUND_BATCHES.len()
    );
}

// ---- kill -9 of either side is seen through the heartbeat ----------------

#[test]
fn killed_agent_is_noticed_by_the_rank() {
    const NAME: &str = "killed_agent_is_noticed_by_the_rank";
    if let Some((_, sock)) = role() {
        // The agent: serve one rank until killed (or past its own life).
        let l = AttachListener::bind(&sock, ListenerConfig::default()).unwrap();
        let t = Instant::now();
        let inc = loop {
            if let Some(i) = l.accept_attach(Duration::from_millis(50)).unwrap() {
                break i;
            }
            assert!(t.elapsed() < CHILD_LIFE);
        };
        let mut inc = inc.accept(20, None).unwrap();
        let e = agent_publish(
            &live(),
            &mut inc.side,
            &inc.ring,
            Some(&inc.conn),
            u64::MAX,
            0,
        )
        .unwrap_err();
        panic!("agent child: {e}");
    }
    let (_dir, sock) = temp_socket();
    let mut child = spawn(NAME, "agent", &sock);
    let (ring, seg) = new_rank();
    let mut r = RankSide::new(seg).unwrap();
    let (_conn, reply) = attach_when_up(&sock, &ring, r.segment());
    assert_eq!(reply.agent_pid, child.id());
    rank_take(&live(), &mut r, &ring, 200, 0).unwrap();
    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    // Batches published before the kill are still taken; then the wait
    // ends on the agent's silence (no socket check: the heartbeat alone).
    let e = loop {
        match r.wait_take(&live(), Some(killed + Duration::from_secs(10)), &mut || {
            Ok(())
        }) {
            Ok(_) => r.release(r.taken()),
            Err(e) => break e,
        }
    };
    let after = killed.elapsed();
    match e {
        Error::AttachPeerGone {
            peer: "agent",
            pid,
            closed: false,
            silent_ms,
        } => {
            assert_eq!(pid, child.id());
            assert!(silent_ms >= 1000, "{silent_ms}");
        }
        e => panic!("expected AttachPeerGone from the agent, got {e}"),
    }
    assert!(after < Duration::from_secs(3), "noticed after {after:?}");
    eprintln!("rank noticed the killed agent after {after:?}");
}

#[test]
fn killed_rank_is_noticed_by_the_agent() {
    const NAME: &str = "killed_rank_is_noticed_by_the_agent";
    if let Some((_, sock)) = role() {
        let (ring, seg) = new_rank();
        let mut r = RankSide::new(seg).unwrap();
        let (_conn, _, _) = attach(
            &sock,
            &request(r.segment(), &ring),
            &ring,
            r.segment(),
            Duration::from_secs(5),
        )
        .unwrap();
        let e = rank_take(&live(), &mut r, &ring, u64::MAX, 0).unwrap_err();
        panic!("rank child: {e}");
    }
    let (_dir, sock) = temp_socket();
    let l = AttachListener::bind(&sock, ListenerConfig::default()).unwrap();
    let mut child = spawn(NAME, "rank", &sock);
    let mut inc = accept_one(&l, &mut child).accept(20, None).unwrap();
    agent_publish(&live(), &mut inc.side, &inc.ring, None, 200, 0).unwrap();
    child.kill().unwrap();
    let killed = Instant::now();
    child.wait().unwrap();
    // The ring fills; the wait for room ends on the rank's silence.
    let e = agent_publish(&live(), &mut inc.side, &inc.ring, None, u64::MAX, 0).unwrap_err();
    let after = killed.elapsed();
    match e {
        Error::AttachPeerGone {
            peer: "rank",
            pid,
            closed: false,
            ..
        } => assert_eq!(pid, child.id()),
        e => panic!("expected AttachPeerGone from the rank, got {e}"),
    }
    assert!(after < Duration::from_secs(3), "noticed after {after:?}");
    // The socket says so too (what a real agent checks first).
    assert!(inc.conn.peer_closed());
    eprintln!("agent noticed the killed rank after {after:?}");
}

// ---- who may attach --------------------------------------------------------

#[test]
fn another_uid_is_refused_unless_a_root_agent_allows_it() {
    const NAME: &str = "another_uid_is_refused_unless_a_root_agent_allows_it";
    if let Some((role, sock)) = role() {
        // SAFETY: plain system calls with integer arguments, in a child
        // process running only this test.
        unsafe {
            assert_eq!(libc::setgid(65534), 0);
            assert_eq!(libc::setuid(65534), 0);
        }
        let (ring, seg) = new_rank();
        let r = attach(
            &sock,
            &request(&seg, &ring),
            &ring,
            &seg,
            Duration::from_secs(5),
        );
        match (role.as_str(), r) {
            (
                "refused",
                Err(Error::AttachRefused {
                    code: "peer_uid",
                    reason,
                }),
            ) => {
                println!("refused: {reason}")
            }
            ("allowed", Ok(_)) => println!("attached"),
            (role, r) => panic!("{role}: {:?}", r.map(|_| ())),
        }
        return;
    }
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        common::skip("switching the rank to another uid needs root");
        return;
    }
    let (dir, _) = temp_socket();
    // The rank (uid 65534) must reach the socket.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for (role, allow) in [("refused", false), ("allowed", true)] {
        let sock = dir.path().join(format!("{role}/agent.sock"));
        let cfg = ListenerConfig {
            mode: 0o666,
            allow_other_uids: allow,
            ..ListenerConfig::default()
        };
        let l = AttachListener::bind(&sock, cfg).unwrap();
        assert_eq!(
            std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
            0o666
        );
        let mut child = spawn(NAME, role, &sock);
        let deadline = Instant::now() + Duration::from_secs(20);
        let got = loop {
            match l.accept_attach(Duration::from_millis(50)) {
                Ok(None) => assert!(Instant::now() < deadline, "no attach"),
                r => break r,
            }
        };
        match (allow, got) {
            (
                false,
                Err(Error::AttachRefused {
                    code: "peer_uid",
                    reason,
                }),
            ) => {
                assert!(reason.contains("uid 65534"), "{reason}")
            }
            (true, Ok(Some(inc))) => {
                assert_eq!(inc.conn.peer().uid, 65534);
                inc.accept(20, None).unwrap();
            }
            (_, r) => panic!("allow {allow}: {:?}", r.map(|_| ())),
        }
        let st = wait_child(&mut child, Duration::from_secs(20));
        assert!(st.success(), "{role} child: {st}");
    }
}

// ---- malformed attaches and silent peers -----------------------------------

/// Runs `client` on a thread against a fresh listener and returns what
/// `accept_attach` said and what the client got.
fn exchange<T: Send + 'static>(
    cfg: ListenerConfig,
    client: impl FnOnce(PathBuf) -> T + Send + 'static,
) -> (kspeed::Result<Option<kspeed::agent::attach::Incoming>>, T) {
    let (_dir, sock) = temp_socket();
    let l = AttachListener::bind(&sock, cfg).unwrap();
    let path = sock.clone();
    let t = std::thread::spawn(move || client(path));
    let deadline = Instant::now() + Duration::from_secs(20);
    let got = loop {
        match l.accept_attach(Duration::from_millis(50)) {
            Ok(None) => assert!(Instant::now() < deadline, "no connection"),
            r => break r,
        }
    };
    (got, t.join().unwrap())
}

/// How many descriptors of this process refer to the same file as `fd`.
fn fds_on(fd: &impl AsFd) -> usize {
    let me = std::fs::File::from(fd.as_fd().try_clone_to_owned().unwrap());
    let ino = me.metadata().unwrap().ino();
    let own = me.as_raw_fd();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let n: i32 = e.file_name().to_str()?.parse().ok()?;
            (n != own).then_some(())?;
            let m = std::fs::metadata(e.path()).ok()?;
            (m.ino() == ino).then_some(())
        })
        .count()
}

#[test]
fn wrong_version_magic_and_descriptor_count_are_refused() {
    // Version 1 (an older rank), then a bad magic: the agent's error and the REFUSED code.
    for (byte, value, code, needle) in [
        (4usize, 1u8, "version", "version 1"),
        (0, b'X', "protocol", "magic"),
    ] {
        let (got, reply) = exchange(ListenerConfig::default(), move |sock| {
            let (ring, seg) = new_rank();
            let mut b = request(&seg, &ring).encode();
            b[byte] = value;
            let c = AttachConn::connect(&sock, Duration::from_secs(5)).unwrap();
            c.send(&b, &[ring.fd(), seg.fd()]).unwrap();
            let (bytes, _) = c.recv("reply").unwrap();
            decode_reply(&bytes).map(|_| ())
        });
        match got {
            Err(Error::AttachProtocol { what }) => assert!(what.contains(needle), "{what}"),
            r => panic!("{:?}", r.map(|_| ())),
        }
        match reply {
            Err(Error::AttachRefused { code: c, .. }) => assert_eq!(c, code),
            r => panic!("{r:?}"),
        }
    }
    // 0, 1 and 3 descriptors: refused, and every one received is closed
    // (only the client's own descriptor of the ring is left).
    for n in [0usize, 1, 3] {
        let (got, (reply, left)) = exchange(ListenerConfig::default(), move |sock| {
            let (ring, seg) = new_rank();
            let devnull = std::fs::File::open("/dev/null").unwrap();
            let all = [ring.fd(), seg.fd(), devnull.as_fd()];
            let c = AttachConn::connect(&sock, Duration::from_secs(5)).unwrap();
            c.send(&request(&seg, &ring).encode(), &all[..n]).unwrap();
            let (bytes, _) = c.recv("reply").unwrap();
            // The agent closed what it received before it answered.
            let left = (fds_on(&ring.fd()), fds_on(&seg.fd()));
            (decode_reply(&bytes).map(|_| ()), left)
        });
        match got {
            Err(Error::AttachProtocol { what }) => {
                assert!(what.contains(&format!("carried {n} descriptors")), "{what}")
            }
            r => panic!("{n} fds: {:?}", r.map(|_| ())),
        }
        assert!(
            matches!(
                reply,
                Err(Error::AttachRefused {
                    code: "protocol",
                    ..
                })
            ),
            "{reply:?}"
        );
        assert_eq!(
            left,
            (1, 1),
            "{n} fds: descriptors of the ring and segment left open"
        );
    }
    // A message too short for its kind.
    let (got, _) = exchange(ListenerConfig::default(), move |sock| {
        let (ring, seg) = new_rank();
        let b = request(&seg, &ring).encode();
        let c = AttachConn::connect(&sock, Duration::from_secs(5)).unwrap();
        c.send(&b[..b.len() - 8], &[ring.fd(), seg.fd()]).unwrap();
        let _ = c.recv("reply");
    });
    assert!(matches!(got, Err(Error::AttachProtocol { .. })));
}

#[test]
fn a_silent_peer_ends_in_a_timeout_on_either_side() {
    // A rank that connects and never sends ATTACH.
    let cfg = ListenerConfig {
        io_timeout: Duration::from_millis(300),
        ..ListenerConfig::default()
    };
    let t0 = Instant::now();
    let (got, ()) = exchange(cfg, |sock| {
        let c = AttachConn::connect(&sock, Duration::from_secs(5)).unwrap();
        // Hold the connection open, silent, until the agent gives up.
        let _ = c.recv("anything");
    });
    match got {
        Err(Error::AttachTimeout {
            what: "ATTACH message",
            ..
        }) => {}
        r => panic!("{:?}", r.map(|_| ())),
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
    // An agent that listens and never answers.
    let (_dir, sock) = temp_socket();
    let _l = AttachListener::bind(&sock, ListenerConfig::default()).unwrap();
    let (ring, seg) = new_rank();
    let t0 = Instant::now();
    match attach(
        &sock,
        &request(&seg, &ring),
        &ring,
        &seg,
        Duration::from_millis(300),
    ) {
        Err(Error::AttachTimeout {
            what: "ATTACHED reply",
            waited_ms,
        }) => {
            assert!(waited_ms >= 250, "{waited_ms}")
        }
        r => panic!("{:?}", r.map(|_| ())),
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn stale_socket_is_replaced_and_a_live_one_is_not() {
    let (_dir, sock) = temp_socket();
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    // A socket file nobody listens on (an agent killed without cleanup).
    {
        let s = socket2::Socket::new(
            socket2::Domain::UNIX,
            socket2::Type::from(libc::SOCK_SEQPACKET),
            None,
        )
        .unwrap();
        s.bind(&socket2::SockAddr::unix(&sock).unwrap()).unwrap();
    }
    assert!(sock.exists());
    let l = AttachListener::bind(&sock, ListenerConfig::default()).unwrap();
    assert_eq!(
        std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
        0o660
    );
    assert_eq!(
        std::fs::metadata(sock.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
    // A second agent on the same path: refused (the lock), socket kept.
    match AttachListener::bind(&sock, ListenerConfig::default()) {
        Err(Error::AttachSocket { what, .. }) => assert!(what.contains("another agent"), "{what}"),
        r => panic!("{r:?}"),
    }
    let lock = sock.with_extension("sock.lock");
    assert!(lock.exists(), "{} while the agent runs", lock.display());
    drop(l);
    assert!(!sock.exists());
    assert!(!lock.exists(), "{} after the agent stopped", lock.display());
    // A lock file a killed agent left (nobody holds its flock): locked again.
    std::fs::write(&lock, b"").unwrap();
    let l = AttachListener::bind(&sock, ListenerConfig::default()).unwrap();
    drop(l);
    assert!(!lock.exists() && !sock.exists());
    // A live listener that holds no lock (another program): it answers,
    // so its socket is not removed.
    let s = socket2::Socket::new(
        socket2::Domain::UNIX,
        socket2::Type::from(libc::SOCK_SEQPACKET),
        None,
    )
    .unwrap();
    s.bind(&socket2::SockAddr::unix(&sock).unwrap()).unwrap();
    s.listen(4).unwrap();
    match AttachListener::bind(&sock, ListenerConfig::default()) {
        Err(Error::AttachSocket { what, .. }) => assert!(what.contains("answers"), "{what}"),
        r => panic!("{r:?}"),
    }
    assert!(sock.exists());
    // Not a socket: never removed.
    drop(s);
    std::fs::remove_file(&sock).unwrap();
    std::fs::write(&sock, b"x").unwrap();
    assert!(matches!(
        AttachListener::bind(&sock, ListenerConfig::default()),
        Err(Error::AttachSocket { .. })
    ));
    assert_eq!(std::fs::read(&sock).unwrap(), b"x");
}

#[test]
fn a_segment_that_is_not_a_sealed_memfd_is_refused() {
    let (got, reply) = exchange(ListenerConfig::default(), |sock| {
        let (ring, seg) = new_rank();
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 16).unwrap();
        let c = AttachConn::connect(&sock, Duration::from_secs(5)).unwrap();
        c.send(&request(&seg, &ring).encode(), &[ring.fd(), f.as_fd()])
            .unwrap();
        let (bytes, _) = c.recv("reply").unwrap();
        decode_reply(&bytes).map(|_| ())
    });
    assert!(
        matches!(got, Err(Error::AttachSegment { .. })),
        "{:?}",
        got.map(|_| ())
    );
    assert!(matches!(
        reply,
        Err(Error::AttachRefused {
            code: "segment",
            ..
        })
    ));
}

// ---- the ready-word encoding -------------------------------------------------

fn gen() -> impl Strategy<Value = Generation> {
    (1u16..=u16::MAX).prop_map(|g| Generation::new(g).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    /// A word of generation k is never ready in another generation
    /// (k + 1 in particular), whatever the sequences.
    #[test]
    fn no_word_of_one_generation_is_ready_in_another(g in gen(), seq in any::<u64>(), seq2 in any::<u64>(), step in 1u16..=u16::MAX) {
        // `step` generations later (mod the 65,535 generations).
        let g2 = Generation::new(((u32::from(g.get()) - 1 + u32::from(step)) % 65535 + 1) as u16).unwrap();
        prop_assume!(g2 != g);
        prop_assert!(!is_ready(ready_word(g, seq), g2, seq2));
        prop_assert!(!is_ready(ready_word(g, seq), g.next(), seq));
        prop_assert_eq!(decode_release(release_mark(g, seq), g2), None);
    }

    /// Within a generation, only the exact batch counts: the word the
    /// slot held one lap earlier (seq - slots) is never ready, across the
    /// 2^48 wrap of the sequence too; no word is 0 (a zeroed slot).
    #[test]
    fn only_the_exact_batch_is_ready(g in gen(), seq in any::<u64>(), slots_log2 in 0u32..=16, near_wrap in any::<bool>()) {
        let slots = 1u64 << slots_log2;
        let seq = if near_wrap { SEQ_MASK - (seq % (2 * slots)) } else { seq };
        prop_assert!(is_ready(ready_word(g, seq), g, seq));
        prop_assert!(!is_ready(ready_word(g, seq.wrapping_sub(slots)), g, seq));
        prop_assert!(!is_ready(ready_word(g, seq), g, seq.wrapping_add(slots)));
        prop_assert_ne!(ready_word(g, seq), 0);
        prop_assert_eq!(decode_release(release_mark(g, seq), g), Some(seq & SEQ_MASK));
    }

    /// The in-flight count survives the wrap of both counters.
    #[test]
    fn in_flight_survives_the_wrap(released in any::<u64>(), k in 0u64..=65536) {
        let r = released & SEQ_MASK;
        let p = (r + k) & SEQ_MASK;
        prop_assert_eq!(in_flight(p, r), k);
    }
}

#[test]
fn generations_wrap_past_zero() {
    let last = Generation::new(u16::MAX).unwrap();
    assert_eq!(last.next(), Generation::FIRST);
    assert_eq!(Generation::new(0), None);
    let mut g = Generation::FIRST;
    for _ in 0..70_000 {
        let n = g.next();
        assert_ne!(n.get(), 0);
        assert_ne!(n, g);
        g = n;
    }
}
