#!/usr/bin/env python3
"""Independent consumer of `kspeed serve` (TCP, protocol version 2).

Written from docs/PROTOCOL.md and docs/FORMAT.md ALONE (no kspeed source
was read).  Standard library only.

Written on 2026-12-07 by a reader who had the docs and the `kspeed` binary
but not src/: a second implementation of the consumer's side of the push
protocol (and of the catalog, manifest, owner functions and sampler), kept
so that the docs and the node service cannot drift apart
(tests/serve_foreign.rs `a_consumer_written_from_the_docs_alone_reads_exactly`
runs it against real `kspeed serve` nodes). Its negative probes
(--negative, --stall, --rate-limit, --admission) found the owner taking
ERROR frames of any code from a consumer as keepalives, and several gaps
in PROTOCOL.md, fixed the same day.

What it does
  * parses the catalog (FORMAT.md "Common envelope", "Catalog") and, when
    given, each node's manifest (FORMAT.md "Manifest") to know who holds what;
  * implements CRC32C, mix64, the owner functions (scaled, jump) and the
    sampler (FORMAT.md "Sampler"), and checks them against the doc's check
    values before doing anything else;
  * connects to every node given with --node HOST:PORT (in node-index order),
    sends HELLO, reads WELCOME, asks for heartbeats with a keepalive, then
    grants the samples of rank R of world W for (seed, epoch) in sampler
    order, each to its owner node, into a landing ring (--ring-bytes, a
    circular buffer; a range is granted only when it is free), never more
    than the WELCOME's limit outstanding per node;
  * checks each DATA header against the outstanding grant before reading its
    body, receives the body straight into the ring at the named offset,
    verifies every completed sample's CRC32C against the catalog (and, with
    --check-source, against the source file's bytes);
  * sends keepalives after each second in which it sent nothing;
  * with --negative, runs the negative-path probes (wrong token, impossible
    HELLO fields, unheld / out-of-range / oversized grants, too many grants,
    silence in the handshake and after it, bad frames, heartbeats, probes)
    and reports what the server did against what the docs say;
  * prints a JSON summary as the last line of output.

Usage (exact session; run from /work/tmp/stranger2/work):
  K=../bin/kspeed
  $K gen --profile tiny --count 600 --out src --threads 2
  $K catalog --source src --out cat.ksc --threads 2
  $K preload --source src --catalog cat.ksc --space sp1 --threads 2
  $K preload --source src --catalog cat.ksc --space sp2_0 --nodes 2 --node-index 0
  $K preload --source src --catalog cat.ksc --space sp2_1 --nodes 2 --node-index 1
  printf 'secret-token-123\n' > token; chmod 600 token
  # one node, small grant limit and idle timeout so the limits can be probed
  $K -v serve --space sp1 --listen 127.0.0.1:17401 --token-file token \
      --max-grants 64 --idle-timeout-ms 3000 --handshake-timeout-ms 2000 --pollers 1 &
  # two nodes (jump placement, 1 copy)
  $K -v serve --space sp2_0 --listen 127.0.0.1:17402 --token-file token --pollers 1 &
  $K -v serve --space sp2_1 --listen 127.0.0.2:17402 --token-file token --pollers 1 &

  timeout 300 python3 ../serve_consumer.py --catalog cat.ksc --token-file token \
      --node 127.0.0.1:17401 --manifest sp1/manifest.ksm --check-source \
      --negative --idle-timeout-ms 3000 --handshake-wait 4
  timeout 120 python3 ../serve_consumer.py --catalog cat.ksc --token-file token \
      --node 127.0.0.1:17402 --node 127.0.0.2:17402 \
      --manifest sp2_0/manifest.ksm --manifest sp2_1/manifest.ksm \
      --seed 7 --epoch 3 --rank 1 --world 2 --ring-bytes 65536 --check-source
  (add --negative against 127.0.0.1:17402 with --manifest sp2_0/manifest.ksm for NotHeld;
   --stall 14 for the stall timeout; --rate-limit for the wrong-token throttle;
   --admission against a node started with --pollers 1 --max-consumers-per-poller 1
   --max-handshakes 1; --skip-run to do only the probes.)
Options: --seed/--epoch/--rank/--world pick the sampler sequence; --ring-bytes the
landing ring (circular); --limit N grants only the first N samples; --watch-idle S
keeps the connections idle S seconds afterwards to watch heartbeats.
"""

import argparse
import collections
import json
import os
import random
import select
import socket
import struct
import sys
import time

M64 = (1 << 64) - 1
CONN = 0xFFFFFFFF

# ---------------------------------------------------------------- CRC32C
_CRC_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC_TABLE.append(_c)


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    t = _CRC_TABLE
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------- frozen functions
def mix64(z):
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def h_owner(i):
    return mix64(i ^ 0x6B73706565646F77)


def jump(key, n):
    b, j = 0, 0
    while j < n:
        b = j
        key = (key * 2862933555777941757 + 1) & M64
        j = ((b + 1) << 31) // ((key >> 33) + 1)
    return b


def owner(i, n, fn):
    if fn == 0:
        return (h_owner(i) * n) >> 64
    return jump(h_owner(i), n)


class Perm:
    """FORMAT.md "Sampler": the Feistel permutation with cycle walking."""

    def __init__(self, n, seed, epoch):
        self.n = n
        b = max(2, (n - 1).bit_length())
        self.hi = b // 2
        self.lo = b - self.hi
        base = mix64(mix64(seed ^ 0x6B73706565647065) ^ epoch)
        self.keys = [mix64((base + i + 1) & M64) for i in range(6)]

    def F(self, x):
        wl, wr = self.hi, self.lo
        L, R = x >> self.lo, x & ((1 << self.lo) - 1)
        for k in self.keys:
            f = mix64(R ^ k) & ((1 << wl) - 1)
            L, R = R, L ^ f
            wl, wr = wr, wl
        return (L << wr) | R

    def __call__(self, j):
        x = self.F(j)
        while x >= self.n:
            x = self.F(x)
        return x


def rank_sequence(n, seed, epoch, rank, world, shuffle=True, drop_last=False):
    p = Perm(n, seed, epoch) if shuffle else (lambda j: j)
    steps = n // world if drop_last else -(-n // world)
    return [p((rank + k * world) % n) for k in range(steps)]


def mixture_identity(ids):
    h = mix64(len(ids))
    for i in ids:
        h = mix64(h ^ i)
    return (h ^ (h >> 32)) & 0xFFFFFFFF


def self_test():
    out = {}
    out["crc32c_123456789"] = crc32c(b"123456789") == 0xE3069283
    out["scaled_n7"] = [owner(i, 7, 0) for i in range(10)] == [1, 2, 1, 4, 0, 1, 0, 6, 4, 3]
    out["jump_n7"] = [owner(i, 7, 1) for i in range(10)] == [4, 2, 0, 1, 0, 3, 2, 5, 6, 0]
    out["jump_n1000"] = [owner(i, 1000, 1) for i in range(10)] == [299, 368, 125, 154, 538, 411, 299, 874, 522, 989]
    out["jump_raw"] = [jump(k, 4294967295) for k in range(5)] == [2147483648, 3094789146, 2616496271, 1315363102, 1713570006]
    out["sampler_n10"] = rank_sequence(10, 1, 0, 0, 1) == [4, 7, 6, 3, 2, 1, 5, 0, 8, 9]
    out["mixture_identity"] = mixture_identity([0x11111111, 0x22222222]) == 0x5F6A1EE6
    return out


# ---------------------------------------------------------------- catalog / manifest
def read_envelope(path, magic):
    data = open(path, "rb").read()
    if data[:8] != magic:
        raise ValueError("%s: bad magic %r" % (path, data[:8]))
    version, header_len, body_len, body_crc, header_crc = struct.unpack_from("<IIQII", data, 8)
    hdr = bytearray(data[:header_len])
    hdr[28:32] = b"\0\0\0\0"
    if crc32c(bytes(hdr)) != header_crc:
        raise ValueError("%s: header checksum" % path)
    body = data[header_len:header_len + body_len]
    if len(body) != body_len or crc32c(body) != body_crc:
        raise ValueError("%s: body checksum/truncated" % path)
    nf = (header_len - 32) // 8
    fields = list(struct.unpack_from("<%dQ" % nf, data, 32))
    return version, fields, body, body_crc


class Catalog:
    def __init__(self, path):
        self.version, f, body, self.identity = read_envelope(path, b"KSPDCAT\0")
        self.kind, self.n, self.nfiles, self.nclasses, self.total = f[0], f[1], f[2], f[3], f[4]
        so, fo, co, sto, stl = f[5], f[6], f[7], f[8], f[9]
        self.strings = body[sto:sto + stl]
        src_off, src_len = f[10], f[11]
        self.source = self.strings[src_off:src_off + src_len]
        self.largest = f[13]
        self.samples = []  # (file, label, len, crc, offset)
        for i in range(self.n):
            self.samples.append(struct.unpack_from("<IIIIQ", body, so + 24 * i))
        self.files = []
        for i in range(self.nfiles):
            name_off, size, mtime, name_len, tag_len = struct.unpack_from("<QQqII", body, fo + 32 * i)
            self.files.append(self.strings[name_off:name_off + name_len])
        assert sum(s[2] for s in self.samples) == self.total, "total bytes"

    def source_root(self):
        kind, _, path = self.source.partition(b":")
        return kind.decode(), path

    def source_bytes(self, sid):
        f, _, ln, _, off = self.samples[sid]
        kind, root = self.source_root()
        name = self.files[f]
        if kind == "list":
            root = os.path.dirname(root)
        p = name if name.startswith(b"/") else os.path.join(root, name)
        with open(p, "rb") as fh:
            fh.seek(off)
            return fh.read(ln)


class Manifest:
    def __init__(self, path, n):
        self.version, f, body, _ = read_envelope(path, b"KSPDMAN\0")
        self.identity, self.count, self.nodes, self.node_index, self.replicas = f[0], f[1], f[2], f[3], f[4]
        self.owner_fn = f[7 + 4] if self.version >= 2 and len(f) > 11 else 0
        x = f[7]
        held = []
        for i in range(n):
            ext, off = struct.unpack_from("<IQ", body, 8 * x + 12 * i)
            if ext != 0xFFFFFFFF:
                held.append(i)
        self.held = set(held)


# ---------------------------------------------------------------- frames
HELLO, WELCOME, GRANT, DATA, ERROR, RDMA_EP = 1, 2, 3, 4, 5, 6
CODES = {0: "keepalive", 1: "BadToken", 2: "BadVersion", 3: "WrongDataset", 4: "NotHeld", 5: "ReadFailed",
         6: "Violation", 7: "TooManyGrants", 8: "ShuttingDown", 9: "TransportFailed", 10: "NodeFull",
         11: "Busy", 12: "RateLimited", 13: "NodeDown"}
BODY_LIMIT = {HELLO: 56 + 1024, WELCOME: 16, GRANT: 32 * 4096, DATA: None, ERROR: 4096, RDMA_EP: 16}


def header(typ, body_len, a, b, c, flags=0, magic=0x534B):
    return struct.pack("<HBBIIIQ", magic, typ, flags, body_len, a, b, c)


def hello_frame(identity, rank, world, n, seed, ring_len, token, transport=0, version=2,
                ring_addr=0, rkey=0, token_len=None):
    body = struct.pack("<IIIIQQQQII", identity, rank, world, transport, n, seed, ring_addr, ring_len,
                       rkey, len(token) if token_len is None else token_len) + token
    return header(HELLO, len(body), version, 0, 0) + body


def grant_frame(entries, n_override=None):
    body = b"".join(struct.pack("<IIQQII", gid, ln, sid, off, 0, 0) for gid, ln, sid, off in entries)
    return header(GRANT, len(body), len(entries) if n_override is None else n_override, 0, 0) + body


def keepalive(c=0, code=0, body=b""):
    return header(ERROR, len(body), CONN, code, c) + body


class Closed(Exception):
    pass


class Conn:
    """A TCP connection with deadline-bounded exact reads."""

    def __init__(self, addr, timeout=5.0):
        host, port = addr.rsplit(":", 1)
        self.addr = addr
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.buf = bytearray()
        self.last_sent = time.monotonic()

    def send(self, data, deadline=5.0):
        mv = memoryview(data)
        end = time.monotonic() + deadline
        while mv:
            try:
                k = self.sock.send(mv)
                mv = mv[k:]
            except BlockingIOError:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError("send timed out")
                select.select([], [self.sock], [], left)
        self.last_sent = time.monotonic()

    def fill(self, need, deadline):
        """Make self.buf hold >= need bytes before the monotonic deadline."""
        while len(self.buf) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("read timed out with %d of %d bytes" % (len(self.buf), need))
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                continue
            try:
                d = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionResetError:
                raise Closed("reset")
            if not d:
                raise Closed("eof")
            self.buf += d

    def take(self, n):
        d = bytes(self.buf[:n])
        del self.buf[:n]
        return d

    def read_frame(self, timeout=5.0, max_body=1 << 24):
        dl = time.monotonic() + timeout
        self.fill(24, dl)
        magic, typ, flags, blen, a, b, c = struct.unpack_from("<HBBIIIQ", self.buf, 0)
        if magic != 0x534B or flags != 0 or typ not in BODY_LIMIT:
            raise ValueError("bad header magic=%#x type=%d flags=%d" % (magic, typ, flags))
        if blen > max_body:
            raise ValueError("body too long: %d" % blen)
        self.fill(24 + blen, dl)
        self.take(24)
        return typ, a, b, c, self.take(blen)

    def read_until_close(self, timeout=5.0):
        """Frames until EOF (returns (frames, how_it_ended, seconds))."""
        t0 = time.monotonic()
        frames = []
        try:
            while True:
                frames.append(self.read_frame(max(0.01, timeout - (time.monotonic() - t0))))
        except Closed as e:
            return frames, str(e), time.monotonic() - t0
        except TimeoutError:
            return frames, "timeout", time.monotonic() - t0
        except ValueError as e:
            return frames, "bad frame: %s" % e, time.monotonic() - t0

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def describe(fr):
    typ, a, b, c, body = fr
    if typ == ERROR:
        return {"type": "ERROR", "grant": "conn" if a == CONN else a, "code": CODES.get(b, b),
                "c": c, "msg": body.decode("utf-8", "replace")}
    if typ == WELCOME:
        return {"type": "WELCOME", "version": a, "node": b, "max_grants": c}
    return {"type": typ, "a": a, "b": b, "c": c, "body_len": len(body)}


# ---------------------------------------------------------------- the node session
class Node:
    def __init__(self, index, addr, cat, args, token):
        self.index, self.addr, self.cat, self.args, self.token = index, addr, cat, args, token
        self.out = collections.OrderedDict()  # gid -> [sid, off, len, got, t_granted]
        self.heartbeats = 0
        self.hb_idle_ms = None
        self.hb_times = []
        self.last_heard = time.monotonic()
        self.errors = []
        self.times_seen = 0

    def connect(self, identity):
        backoff = 0
        deadline = time.monotonic() + 10
        while True:
            self.c = Conn(self.addr)
            self.c.send(hello_frame(identity, self.args.rank, self.args.world, self.cat.n,
                                    self.args.seed, self.args.ring_bytes, self.token))
            fr = self.c.read_frame(6.0)
            typ, a, b, c, body = fr
            if typ == ERROR and b in (10, 11, 12):  # NodeFull, Busy, RateLimited: retry
                self.c.close()
                bnd = min(0.1 * 2 ** backoff, 2.0)
                w = random.uniform(bnd / 2, bnd)
                if time.monotonic() + w > deadline:
                    raise RuntimeError("node %s: gave up: %s" % (self.addr, describe(fr)))
                time.sleep(max(w, 0.05))
                backoff += 1
                continue
            if typ != WELCOME:
                raise RuntimeError("node %s refused: %s" % (self.addr, describe(fr)))
            nodes, copies_word, max_data, transport = struct.unpack("<IIII", body)
            self.welcome = {"version": a, "node_index": b, "max_grants": c, "nodes": nodes,
                            "replicas": copies_word & 0xFFFF, "owner_fn": copies_word >> 16,
                            "max_data": max_data, "transport": transport}
            self.max_grants = c
            self.max_data = max_data
            # first frame after the handshake: keepalive asking for heartbeats (bit0) + slow idle (bit1)
            self.c.send(keepalive(c=0b11))
            self.last_heard = time.monotonic()
            return self.welcome


class Consumer:
    def __init__(self, args):
        self.args = args
        self.cat = Catalog(args.catalog)
        tok = open(args.token_file, "rb").read()
        self.token = tok.rstrip(b" \t\r\n\v\f")
        self.nodes = [Node(i, a, self.cat, args, self.token) for i, a in enumerate(args.node)]
        self.manifests = [Manifest(m, self.cat.n) for m in args.manifest] if args.manifest else []
        self.notes = []
        self.errors = []

    def holder_of(self, sid):
        if self.manifests:
            for i, m in enumerate(self.manifests):
                if sid in m.held:
                    return i
            return None
        w = self.nodes[0].welcome
        return owner(sid, w["nodes"], w["owner_fn"])

    def run(self):
        a = self.args
        welcomes = [n.connect(self.cat.identity) for n in self.nodes]
        for i, w in enumerate(welcomes):
            if w["node_index"] != i:
                self.errors.append("node %d's WELCOME says index %d" % (i, w["node_index"]))
            if (w["nodes"], w["replicas"], w["owner_fn"]) != (welcomes[0]["nodes"], welcomes[0]["replicas"], welcomes[0]["owner_fn"]):
                self.errors.append("placements differ")
            if w["nodes"] != len(self.nodes):
                self.notes.append("WELCOME says %d nodes, %d given" % (w["nodes"], len(self.nodes)))
        # manifest vs owner function
        if self.manifests:
            w = welcomes[0]
            for i, m in enumerate(self.manifests):
                calc = {s for s in range(self.cat.n)
                        if any((owner(s, w["nodes"], w["owner_fn"]) + r) % w["nodes"] == i for r in range(w["replicas"]))}
                if calc != m.held:
                    self.errors.append("node %d: manifest holds %d samples, owner function says %d" % (i, len(m.held), len(calc)))
        seq = rank_sequence(self.cat.n, a.seed, a.epoch, a.rank, a.world)
        if a.limit:
            seq = seq[:a.limit]
        ring = bytearray(a.ring_bytes)
        RL = a.ring_bytes
        # virtual positions: pending[i] = (sid, vstart, len)
        layout = []
        v = 0
        for sid in seq:
            ln = self.cat.samples[sid][2]
            if ln > RL:
                raise RuntimeError("sample %d (%d B) larger than the ring" % (sid, ln))
            if v % RL + ln > RL:
                v += RL - v % RL
            layout.append((sid, v, ln))
            v += ln
        nxt = 0            # next layout index to grant
        consumed = 0       # next layout index to consume (hand to the "trainer")
        complete = {}      # layout index -> True
        gid_of = {}        # layout idx -> (node, gid)
        stats = {"samples": 0, "bytes": 0, "crc_ok": 0, "crc_bad": 0, "src_ok": 0, "src_bad": 0,
                 "data_frames": 0, "grant_frames": 0, "per_node": [0] * len(self.nodes), "zero_len": 0}
        t0 = time.monotonic()
        idle_deadline = t0 + a.run_timeout
        by_sock = {n.c.sock.fileno(): n for n in self.nodes}
        while consumed < len(layout):
            now = time.monotonic()
            if now > idle_deadline:
                raise RuntimeError("run timed out: consumed %d of %d" % (consumed, len(layout)))
            # grant what fits: ring free behind the oldest unconsumed sample, and per-node limits
            batches = collections.defaultdict(list)
            oldest_v = layout[consumed][1] if consumed < len(layout) else v
            while nxt < len(layout):
                sid, vs, ln = layout[nxt]
                if vs + ln - oldest_v > RL:
                    break
                h = self.holder_of(sid)
                if h is None:
                    raise RuntimeError("no node holds sample %d" % sid)
                node = self.nodes[h]
                if len(node.out) + len(batches[h]) >= node.max_grants:
                    break
                if ln == 0:
                    complete[nxt] = True
                    stats["zero_len"] += 1
                    nxt += 1
                    continue
                gid = nxt & 0x7FFFFFFF
                batches[h].append((gid, ln, sid, vs % RL))
                node.out[gid] = [sid, vs % RL, ln, 0, time.monotonic(), nxt]
                nxt += 1
                if len(batches[h]) >= a.grants_per_frame:
                    break
            for h, ents in batches.items():
                self.nodes[h].c.send(grant_frame(ents))
                stats["grant_frames"] += 1
            # keepalives
            for n in self.nodes:
                if time.monotonic() - n.c.last_sent >= 1.0:
                    n.c.send(keepalive(c=0b11))
                # owner judged dead?
                silent = time.monotonic() - n.last_heard
                if n.out and n.heartbeats and silent > 2.0:
                    raise RuntimeError("node %s silent %.1fs with %d grants out" % (n.addr, silent, len(n.out)))
            # receive
            r, _, _ = select.select([n.c.sock for n in self.nodes], [], [], 0.25)
            for s in r:
                node = by_sock[s.fileno()]
                try:
                    d = s.recv(1 << 20)
                except BlockingIOError:
                    continue
                if not d:
                    raise RuntimeError("node %s closed the connection (outstanding %d)" % (node.addr, len(node.out)))
                node.c.buf += d
                node.last_heard = time.monotonic()
                self.parse(node, ring, stats, complete)
            # consume in order
            while consumed < len(layout) and complete.get(consumed):
                sid, vs, ln = layout[consumed]
                off = vs % RL
                got = bytes(ring[off:off + ln])
                if crc32c(got) == self.cat.samples[sid][3]:
                    stats["crc_ok"] += 1
                else:
                    stats["crc_bad"] += 1
                    self.errors.append("CRC mismatch sample %d" % sid)
                if a.check_source:
                    if self.cat.source_bytes(sid) == got:
                        stats["src_ok"] += 1
                    else:
                        stats["src_bad"] += 1
                        self.errors.append("source mismatch sample %d" % sid)
                stats["samples"] += 1
                stats["bytes"] += ln
                del complete[consumed]
                consumed += 1
        stats["seconds"] = round(time.monotonic() - t0, 3)
        # watch heartbeats on the now-idle connections for a while
        if a.watch_idle > 0:
            end = time.monotonic() + a.watch_idle
            while time.monotonic() < end:
                for n in self.nodes:
                    if time.monotonic() - n.c.last_sent >= 1.0:
                        n.c.send(keepalive(c=0b11))
                r, _, _ = select.select([n.c.sock for n in self.nodes], [], [], 0.2)
                for s in r:
                    node = by_sock[s.fileno()]
                    d = s.recv(1 << 20)
                    if not d:
                        self.errors.append("node %s closed while idle" % node.addr)
                        end = 0
                        break
                    node.c.buf += d
                    self.parse(node, ring, stats, complete)
        stats["heartbeats"] = [n.heartbeats for n in self.nodes]
        stats["heartbeat_idle_timeout_ms"] = [n.hb_idle_ms for n in self.nodes]
        gaps = []
        for n in self.nodes:
            g = [round(b - a_, 3) for a_, b in zip(n.hb_times, n.hb_times[1:])]
            gaps.append(g[-5:])
        stats["last_heartbeat_gaps_s"] = gaps
        stats["data_frames_with_times"] = [n.times_seen for n in self.nodes]
        stats["welcomes"] = welcomes
        for n in self.nodes:
            n.c.close()
        return stats

    def parse(self, node, ring, stats, complete):
        c = node.c
        while len(c.buf) >= 24:
            magic, typ, flags, blen, a, b, cc = struct.unpack_from("<HBBIIIQ", c.buf, 0)
            if magic != 0x534B or flags != 0:
                raise RuntimeError("ProtocolViolation: bad header from %s" % node.addr)
            if typ == DATA:
                g = node.out.get(a)
                if g is None:
                    raise RuntimeError("ProtocolViolation: DATA for grant %d not outstanding" % a)
                sid, goff, ln, got, tg, li = g
                if cc != goff + got:
                    raise RuntimeError("ProtocolViolation: DATA offset %d, expected %d" % (cc, goff + got))
                if blen == 0 or blen > ln - got or blen > node.max_data:
                    raise RuntimeError("ProtocolViolation: DATA body %d, grant lacks %d" % (blen, ln - got))
                if len(c.buf) < 24 + blen:
                    return
                ring[cc:cc + blen] = c.buf[24:24 + blen]
                del c.buf[:24 + blen]
                stats["data_frames"] += 1
                if b & 0x80000000:
                    node.times_seen += 1
                    ready, posted = b & 0x7FFF, (b >> 16) & 0x7FFF
                    dec = lambda v: (v & 0x7FF) << (v >> 11)
                    if b & 0x8000:
                        self.errors.append("DATA b bit 15 set: %#x" % b)
                    if dec(ready) > dec(posted):
                        self.notes.append("ready %d us > posted %d us" % (dec(ready), dec(posted)))
                g[3] += blen
                if g[3] == ln:
                    del node.out[a]
                    complete[li] = True
                    stats["per_node"][node.index] += 1
            elif typ == ERROR:
                if blen > 4096:
                    raise RuntimeError("ProtocolViolation: ERROR body %d" % blen)
                if len(c.buf) < 24 + blen:
                    return
                body = bytes(c.buf[24:24 + blen])
                del c.buf[:24 + blen]
                if a == CONN and b == 0 and blen == 0:
                    node.heartbeats += 1
                    node.hb_times.append(time.monotonic())
                    node.hb_idle_ms = cc >> 32
                    continue
                if a == CONN and b == 13 and blen == 0:
                    continue  # node-down notice (we did not ask)
                msg = describe((typ, a, b, cc, body))
                if a == CONN:
                    raise RuntimeError("node %s ended the connection: %s" % (node.addr, msg))
                self.errors.append(msg)
                node.out.pop(a, None)
                raise RuntimeError("grant failed (no failover in this client): %s" % msg)
            else:
                raise RuntimeError("ProtocolViolation: frame type %d after handshake" % typ)


# ---------------------------------------------------------------- negative probes
def hello_answer(addr, frame, timeout=6.0, pre_delay=0.0):
    c = Conn(addr)
    try:
        if pre_delay:
            time.sleep(pre_delay)
        if frame:
            c.send(frame)
        frames, how, secs = c.read_until_close(timeout)
        return {"frames": [describe(f) for f in frames], "end": how, "seconds": round(secs, 2)}
    finally:
        c.close()


def welcomed(addr, cat, token, ring_len=1 << 20, ask=0b11):
    c = Conn(addr)
    c.send(hello_frame(cat.identity, 0, 1, cat.n, 1, ring_len, token))
    fr = c.read_frame(6.0)
    if fr[0] != WELCOME:
        raise RuntimeError("not welcomed: %s" % describe(fr))
    if ask is not None:
        c.send(keepalive(c=ask))
    return c, fr


def after_welcome(c, frame, timeout=4.0, skip_heartbeats=True):
    if frame:
        c.send(frame)
    frames, how, secs = c.read_until_close(timeout)
    out = []
    hb = 0
    for f in frames:
        if skip_heartbeats and f[0] == ERROR and f[1] == CONN and f[2] == 0 and not f[4]:
            hb += 1
            continue
        out.append(describe(f) if f[0] != DATA else {"type": "DATA", "grant": f[1], "off": f[3], "len": len(f[4])})
    c.close()
    return {"frames": out, "heartbeats": hb, "end": how, "seconds": round(secs, 2)}


def negatives(args, cat, token, held, not_held):
    addr = args.node[0]
    R = collections.OrderedDict()
    s0 = held[0]
    ln0 = cat.samples[s0][2]
    ident, n = cat.identity, cat.n
    H = lambda **kw: hello_frame(kw.get("identity", ident), kw.get("rank", 0), kw.get("world", 1), kw.get("n", n),
                                 1, kw.get("ring", 1 << 20), kw.get("token", token), transport=kw.get("transport", 0),
                                 version=kw.get("version", 2), ring_addr=kw.get("ring_addr", 0),
                                 token_len=kw.get("token_len"))
    R["wrong_token"] = hello_answer(addr, H(token=b"not-the-token"))
    R["bad_version_1"] = hello_answer(addr, H(version=1))
    R["wrong_identity"] = hello_answer(addr, H(identity=ident ^ 1))
    R["wrong_count"] = hello_answer(addr, H(n=n + 1))
    R["mixture_identity_of_one"] = hello_answer(addr, H(identity=mixture_identity([ident])), timeout=1.0)
    R["rank_ge_world"] = hello_answer(addr, H(rank=2, world=2))
    R["world_0"] = hello_answer(addr, H(world=0))
    R["ring_len_0"] = hello_answer(addr, H(ring=0))
    R["transport_2"] = hello_answer(addr, H(transport=2))
    R["transport_1_rdma_on_tcp_node"] = hello_answer(addr, H(transport=1, ring_addr=0x10000), timeout=1.5)
    R["empty_token"] = hello_answer(addr, H(token=b""))
    R["token_len_mismatch"] = hello_answer(addr, H(token_len=5))
    R["token_1025_bytes"] = hello_answer(addr, H(token=b"x" * 1025))
    R["wrong_token_and_world_0"] = hello_answer(addr, H(token=b"nope", world=0))
    R["bad_magic_hello"] = hello_answer(addr, b"XX" + H()[2:])
    R["nonzero_flags_hello"] = hello_answer(addr, H()[:3] + b"\x01" + H()[4:])
    R["grant_as_first_frame"] = hello_answer(addr, grant_frame([(1, ln0, s0, 0)]))
    R["silent_handshake"] = hello_answer(addr, b"", timeout=args.handshake_wait)
    R["half_hello_then_silent"] = hello_answer(addr, H()[:30], timeout=args.handshake_wait)

    # after WELCOME
    c, w = welcomed(addr, cat, token)
    R["welcome"] = describe(w)
    maxg = w[3]
    R["grant_ok_single"] = after_welcome(c, grant_frame([(7, ln0, s0, 100)]), timeout=1.0)
    if not_held is not None:
        c, _ = welcomed(addr, cat, token)
        lnx = cat.samples[not_held][2]
        c.send(grant_frame([(9, lnx, not_held, 0)]))
        c.send(grant_frame([(10, ln0, s0, 65536)]))
        R["grant_not_held_then_held"] = after_welcome(c, None, timeout=1.5)
    c, _ = welcomed(addr, cat, token)
    R["grant_id_past_catalog"] = after_welcome(c, grant_frame([(1, ln0, n, 0)]))
    c, _ = welcomed(addr, cat, token)
    R["grant_wrong_length"] = after_welcome(c, grant_frame([(1, ln0 + 1, s0, 0)]))
    c, _ = welcomed(addr, cat, token, ring_len=ln0 + 10)
    R["grant_past_ring"] = after_welcome(c, grant_frame([(1, ln0, s0, 11)]))
    c, _ = welcomed(addr, cat, token)
    R["grant_id_ffffffff"] = after_welcome(c, grant_frame([(CONN, ln0, s0, 0)]))
    c, _ = welcomed(addr, cat, token)
    R["grant_n_0"] = after_welcome(c, header(GRANT, 0, 0, 0, 0))
    c, _ = welcomed(addr, cat, token)
    R["grant_n_mismatch_body"] = after_welcome(c, grant_frame([(1, ln0, s0, 0)], n_override=2))
    c, _ = welcomed(addr, cat, token)
    R["grant_n_4097_header_only"] = after_welcome(c, header(GRANT, 32 * 4097, 4097, 0, 0))
    c, _ = welcomed(addr, cat, token, ring_len=1 << 30)
    ents = [(i + 1, ln0, s0, i * 8192) for i in range(maxg + 1)]
    R["too_many_grants_one_frame_%d" % (maxg + 1)] = after_welcome(c, grant_frame(ents))
    c, _ = welcomed(addr, cat, token, ring_len=1 << 30)
    ents = [(i + 1, ln0, s0, i * 8192) for i in range(maxg)]
    R["exactly_max_grants_%d" % maxg] = after_welcome(c, grant_frame(ents), timeout=2.0)
    R["exactly_max_grants_%d" % maxg]["frames"] = "%d DATA frames, others: %s" % (
        sum(1 for f in R["exactly_max_grants_%d" % maxg]["frames"] if f["type"] == "DATA"),
        [f for f in R["exactly_max_grants_%d" % maxg]["frames"] if f["type"] != "DATA"])
    # two frames, together over the limit, sent back to back (second arrives before first is served?)
    c, _ = welcomed(addr, cat, token, ring_len=1 << 30)
    half = maxg // 2 + 1
    c.send(grant_frame([(i + 1, ln0, s0, i * 8192) for i in range(half)]) +
           grant_frame([(1000 + i, ln0, s0, (half + i) * 8192) for i in range(half)]))
    res = after_welcome(c, None, timeout=2.0)
    res["frames"] = "%d DATA, others: %s" % (sum(1 for f in res["frames"] if f["type"] == "DATA"),
                                               [f for f in res["frames"] if f["type"] != "DATA"])
    R["two_frames_%d_plus_%d_back_to_back" % (half, half)] = res
    # duplicate grant ids
    c, _ = welcomed(addr, cat, token)
    res = after_welcome(c, grant_frame([(5, ln0, s0, 0), (5, ln0, s0, 16384)]), timeout=1.0)
    R["duplicate_grant_ids"] = res
    # bad frames after welcome
    c, _ = welcomed(addr, cat, token)
    R["keepalive_with_body"] = after_welcome(c, keepalive(body=b"hi"))
    c, _ = welcomed(addr, cat, token)
    R["conn_error_code_6_from_consumer"] = after_welcome(c, keepalive(code=6))
    c, _ = welcomed(addr, cat, token)
    R["unknown_type_9"] = after_welcome(c, header(9, 0, 0, 0, 0))
    c, _ = welcomed(addr, cat, token)
    R["welcome_from_consumer"] = after_welcome(c, header(WELCOME, 16, 2, 0, 0) + bytes(16))
    c, _ = welcomed(addr, cat, token)
    R["second_hello"] = after_welcome(c, H())
    c, _ = welcomed(addr, cat, token)
    R["data_from_consumer"] = after_welcome(c, header(DATA, 4, 1, 0, 0) + b"abcd")
    c, _ = welcomed(addr, cat, token, ask=None)
    R["conn_error_code_6_only"] = after_welcome(c, keepalive(code=6), timeout=1.0)
    c, _ = welcomed(addr, cat, token, ask=None)
    R["conn_error_code_13_from_consumer"] = after_welcome(c, keepalive(code=13), timeout=1.0)
    c, _ = welcomed(addr, cat, token, ask=None)
    R["grant_error_code_0_from_consumer"] = after_welcome(c, header(ERROR, 0, 5, 0, 0), timeout=1.0)
    c, _ = welcomed(addr, cat, token, ask=None)
    R["grant_error_code_6_from_consumer"] = after_welcome(c, header(ERROR, 0, 5, 6, 0), timeout=1.0)
    c, _ = welcomed(addr, cat, token, ask=None)
    R["rdma_endpoint_from_consumer_on_tcp"] = after_welcome(c, header(RDMA_EP, 16, 1, 1, 0) + bytes(16), timeout=1.0)
    c = Conn(addr)
    c.send(H(transport=1, ring_addr=0x10000))
    f = c.read_frame(3.0)
    R["transport_1_welcome_body"] = list(struct.unpack("<IIII", f[4])) if f[0] == WELCOME else describe(f)
    c.close()
    c, _ = welcomed(addr, cat, token)
    R["keepalive_reserved_bits_c"] = after_welcome(c, keepalive(c=0xFF00), timeout=1.0)
    # heartbeat cadence without asking for slow idle beats, and a probe
    c, _ = welcomed(addr, cat, token, ask=0b1)
    t0 = time.monotonic()
    times = []
    try:
        while time.monotonic() - t0 < 1.6:
            f = c.read_frame(2.0)
            times.append((round(time.monotonic() - t0, 3), describe(f)["code"], f[3] >> 32))
    except (TimeoutError, Closed) as e:
        times.append(str(e))
    c.close()
    R["heartbeats_fast_idle_first_1.6s"] = times
    c, _ = welcomed(addr, cat, token, ask=0b11)
    times = []
    t0 = time.monotonic()
    try:
        f = c.read_frame(2.0)
        times.append(("first", round(time.monotonic() - t0, 3)))
        c.send(keepalive(c=0b1111))  # probe
        t1 = time.monotonic()
        f = c.read_frame(2.0)
        times.append(("probe answer", round(time.monotonic() - t1, 3), describe(f)["code"]))
    except (TimeoutError, Closed) as e:
        times.append(str(e))
    c.close()
    R["slow_idle_heartbeat_then_probe"] = times
    # no heartbeat asked: nothing should come
    c, _ = welcomed(addr, cat, token, ask=None)
    R["no_keepalive_no_heartbeats_1s"] = after_welcome(c, None, timeout=1.0, skip_heartbeats=False)
    # silence after WELCOME: idle timeout
    if args.idle_timeout_ms:
        c, _ = welcomed(addr, cat, token, ask=None)
        R["silent_after_welcome"] = after_welcome(c, None, timeout=args.idle_timeout_ms / 1000 + 4, skip_heartbeats=False)
        c, _ = welcomed(addr, cat, token, ask=0b11)
        R["silent_after_welcome_asked_heartbeats"] = after_welcome(c, None, timeout=args.idle_timeout_ms / 1000 + 4)
    return R


def rate_limit_probe(addr, cat, token, count=20):
    """FORMAT: 16 wrong tokens in 10 s answered at once, later ones 1 s late; a right token admitted."""
    out = []
    for i in range(count):
        r = hello_answer(addr, hello_frame(cat.identity, 0, 1, cat.n, 1, 1 << 20, b"wrong%d" % i), timeout=4.0)
        out.append((i + 1, r["seconds"], r["frames"][0]["msg"] if r["frames"] else r["end"]))
    t0 = time.monotonic()
    c, w = welcomed(addr, cat, token)
    c.close()
    return {"wrong_tokens": out, "then_right_token_welcomed_in_s": round(time.monotonic() - t0, 3)}


def stall_probe(addr, cat, token, held, grants, wait):
    """Grant much more than the socket buffers hold and read nothing."""
    c = Conn(addr)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.send(hello_frame(cat.identity, 0, 1, cat.n, 1, 1 << 40, token))
    fr = c.read_frame(5.0)
    assert fr[0] == WELCOME, describe(fr)
    c.send(keepalive(c=0b11))
    ents = []
    off = 0
    for i in range(min(grants, fr[3])):
        sid = held[i % len(held)]
        ln = cat.samples[sid][2]
        ents.append((i + 1, ln, sid, off))
        off += ln
    for k in range(0, len(ents), 4096):
        c.send(grant_frame(ents[k:k + 4096]), deadline=10)
    t0 = time.monotonic()
    # read nothing for `wait` seconds (keepalives only), then drain
    while time.monotonic() - t0 < wait:
        time.sleep(0.5)
        try:
            c.send(keepalive(c=0b11), deadline=0.5)
        except (TimeoutError, OSError) as e:
            break
    frames, how, secs = c.read_until_close(5.0)
    data = sum(1 for f in frames if f[0] == DATA)
    others = [describe(f) for f in frames if f[0] != DATA and not (f[0] == ERROR and f[2] == 0 and f[1] == CONN)]
    c.close()
    return {"granted": len(ents), "bytes_granted": off, "waited_s": wait, "data_frames_drained": data,
            "other_frames": others, "end": how}


def admission_probe(addr, cat, token):
    """For a node started with --pollers 1 --max-consumers-per-poller 1 --max-handshakes 1."""
    R = {}
    c1, _ = welcomed(addr, cat, token)
    R["second_consumer"] = hello_answer(addr, hello_frame(cat.identity, 0, 1, cat.n, 1, 1 << 20, token), timeout=2.0)
    c1.close()
    time.sleep(0.3)
    R["after_first_left"] = hello_answer(addr, hello_frame(cat.identity, 0, 1, cat.n, 1, 1 << 20, token), timeout=1.0)
    # Busy: one connection that never sends HELLO, then another one
    a = Conn(addr)
    time.sleep(0.2)
    b = Conn(addr)
    time.sleep(0.2)
    fa, how_a, _ = a.read_until_close(1.5)
    b.send(hello_frame(cat.identity, 0, 1, cat.n, 1, 1 << 20, token))
    fb, how_b, _ = b.read_until_close(1.0)
    R["busy_oldest_silent"] = {"first": [describe(f) for f in fa], "first_end": how_a,
                               "second": [describe(f) for f in fb], "second_end": how_b}
    a.close(); b.close()
    return R


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--node", action="append", required=True, help="HOST:PORT, in node-index order")
    ap.add_argument("--manifest", action="append", help="each node's manifest.ksm, in node order (optional)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--ring-bytes", type=int, default=256 * 1024)
    ap.add_argument("--grants-per-frame", type=int, default=32)
    ap.add_argument("--limit", type=int, default=0, help="grant only the first N samples of the sequence")
    ap.add_argument("--check-source", action="store_true")
    ap.add_argument("--negative", action="store_true")
    ap.add_argument("--idle-timeout-ms", type=int, default=0, help="the node's --idle-timeout-ms, to test silence")
    ap.add_argument("--handshake-wait", type=float, default=7.0)
    ap.add_argument("--watch-idle", type=float, default=0.0, help="seconds to watch heartbeats after the run")
    ap.add_argument("--rate-limit", action="store_true", help="probe the wrong-token rate limit")
    ap.add_argument("--stall", type=float, default=0, help="probe the stall timeout: seconds to read nothing")
    ap.add_argument("--admission", action="store_true", help="probe NodeFull/Busy (node with 1 consumer, 1 handshake)")
    ap.add_argument("--skip-run", action="store_true")
    ap.add_argument("--run-timeout", type=float, default=120.0)
    args = ap.parse_args()
    summary = {"self_test": self_test()}
    if not all(summary["self_test"].values()):
        summary["error"] = "self test failed"
        print(json.dumps(summary))
        sys.exit(2)
    cons = Consumer(args)
    summary["catalog"] = {"identity": "%08x" % cons.cat.identity, "samples": cons.cat.n,
                          "total_bytes": cons.cat.total, "source": cons.cat.source.decode("utf-8", "replace")}
    rc = 0
    try:
        if not args.skip_run:
            summary["run"] = cons.run()
    except Exception as e:  # report, not crash
        summary["run_failed"] = "%s: %s" % (type(e).__name__, e)
        rc = 1
    if args.negative:
        held = sorted(cons.manifests[0].held) if cons.manifests else list(range(cons.cat.n))
        not_held = None
        if cons.manifests and len(cons.manifests[0].held) < cons.cat.n:
            not_held = min(set(range(cons.cat.n)) - cons.manifests[0].held)
        summary["negative"] = negatives(args, cons.cat, cons.token, held, not_held)
    held = sorted(cons.manifests[0].held) if cons.manifests else list(range(cons.cat.n))
    if args.rate_limit:
        summary["rate_limit"] = rate_limit_probe(args.node[0], cons.cat, cons.token)
    if args.stall:
        summary["stall"] = stall_probe(args.node[0], cons.cat, cons.token, held, 1 << 20, args.stall)
    if args.admission:
        summary["admission"] = admission_probe(args.node[0], cons.cat, cons.token)
    run = summary.get("run", {})
    summary["result"] = {
        "samples_received": run.get("samples", 0),
        "bytes": run.get("bytes", 0),
        "all_crcs_ok": bool(run) and run.get("crc_bad", 1) == 0 and run.get("samples", 0) > 0,
        "source_bytes_ok": (run.get("src_bad", 0) == 0) if args.check_source else None,
        "errors": cons.errors + ([summary["run_failed"]] if "run_failed" in summary else []),
        "notes": cons.notes,
    }
    print(json.dumps(summary))
    sys.exit(rc)


if __name__ == "__main__":
    main()
