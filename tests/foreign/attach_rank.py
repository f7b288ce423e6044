#!/usr/bin/env python3
"""An independent attached rank for `kspeed agent`, written from docs/AGENT.md
(+ docs/FORMAT.md for the catalog and sampler). Standard library only.

Written on 2026-12-06 by a reader who had the docs and the `kspeed` binary
but not src/: a second implementation of the attach protocol (memfds and
seals, SCM_RIGHTS, the segment, ready words, release marks, futexes) and of
the sampler, kept so that the docs and the agent cannot drift apart
(tests/agent_rank.rs `a_rank_written_from_the_docs_alone_reads_exactly`). Its
report's `digest_candidates.u64` is `kspeed read --digest` (README).

Usage: foreign_rank.py --socket S --space SPACE [--rank r --world w --batch 16
                        --seed 42 --slots 8 --ring-bytes 4MiB --epoch 0]
                        [--tier-views]
Prints a JSON report on the last line.

--tier-views (added 2026-12-07, from AGENT.md "Tier views" and "View table"
alone): ATTACH flag 8, a layout 6 segment with a view table, the node tier's
memfd taken with ATTACHED and mapped read-only; each sample is read from the
ring or the tier as its view word says, and the report adds `tier_bytes`
(ATTACHED's) and `tier_views` (samples read from the tier).
"""
import argparse, array, ctypes, errno, fcntl, json, mmap, os, select, socket
import struct, sys, time

PAGE = mmap.PAGESIZE
M64 = (1 << 64) - 1

# ---------------------------------------------------------------- CRC32C
_T = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    _T.append(c)


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    t = _T
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------- FORMAT.md: mix64, sampler
def mix64(z):
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def perm_fn(n, seed, epoch):
    b = max(2, (n - 1).bit_length())
    hi = b // 2
    lo = b - hi
    base = mix64(mix64(seed ^ 0x6B73706565647065) ^ epoch)
    keys = [mix64((base + i + 1) & M64) for i in range(6)]

    def F(x):
        wl, wr = hi, lo
        L, R = x >> lo, x & ((1 << lo) - 1)
        for k in keys:
            f = mix64(R ^ k) & ((1 << wl) - 1)
            L, R = R, L ^ f
            wl, wr = wr, wl
        return (L << wr) | R

    def p(j):
        x = F(j)
        while x >= n:
            x = F(x)
        return x
    return p


def rank_order(n, seed, epoch, rank, world, shuffle=True, drop_last=False):
    p = perm_fn(n, seed, epoch) if shuffle else (lambda j: j)
    steps = n // world if drop_last else -(-n // world)
    return [p((rank + k * world) % n) for k in range(steps)]


def digest_h(e, i):
    return mix64(mix64(e ^ 0x6B73706565646467) ^ i)


# ---------------------------------------------------------------- FORMAT.md: catalog
def read_catalog(path):
    d = open(path, "rb").read()
    magic, ver, hlen, blen, bcrc, hcrc = struct.unpack_from("<8sIIQII", d, 0)
    assert magic == b"KSPDCAT\0", magic
    body = d[hlen:hlen + blen]
    assert crc32c(body) == bcrc, "body crc"
    f = struct.unpack_from("<18Q", d, 32)
    kind, n, nfiles, ncls, total = f[0], f[1], f[2], f[3], f[4]
    off_samples, off_files, off_cls, off_str, str_len = f[5], f[6], f[7], f[8], f[9]
    src_off, src_len = f[10], f[11]
    strings = body[off_str:off_str + str_len]
    source = strings[src_off:src_off + src_len].decode()
    samples = []
    for i in range(n):
        fi, label, ln, crc, off = struct.unpack_from("<IIIIQ", body, off_samples + 24 * i)
        samples.append(dict(file=fi, label=label, len=ln, crc=crc, offset=off))
    files = []
    for i in range(nfiles):
        no, size, mt, nl, tl = struct.unpack_from("<QQqII", body, off_files + 32 * i)
        files.append(strings[no:no + nl].decode())
    return dict(identity=bcrc, n=n, samples=samples, files=files, source=source,
                max_len=f[13])


# ---------------------------------------------------------------- futex
libc = ctypes.CDLL(None, use_errno=True)
SYS_futex = 202  # x86_64
SYS_getpid = 39
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # no FUTEX_PRIVATE_FLAG (doc line 206)


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_wait(addr, seen, timeout_s):
    ts = Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    r = libc.syscall(ctypes.c_long(SYS_futex), ctypes.c_void_p(addr), ctypes.c_int(FUTEX_WAIT),
                     ctypes.c_uint32(seen), ctypes.byref(ts), None, ctypes.c_int(0))
    return r, ctypes.get_errno()


def futex_wake(addr, n=0x7FFFFFFF):
    return libc.syscall(ctypes.c_long(SYS_futex), ctypes.c_void_p(addr), ctypes.c_int(FUTEX_WAKE),
                        ctypes.c_int(n), None, None, ctypes.c_int(0))


def fence():
    # No mfence in pure Python: a system call is a full barrier on x86 (and the
    # interpreter's own locked ops around it). Plain aligned 8-byte loads/stores
    # via ctypes are single moves, which x86-TSO makes acquire/release.
    libc.syscall(ctypes.c_long(SYS_getpid))


def mono_ns():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# ---------------------------------------------------------------- the segment (AGENT.md lines 61-155)
SEG_MAGIC = b"KSPATSEG"
SEG_VERSION = 5
SEG_VERSION_VIEWS = 6  # with a view table ("View table")
SEG_VERSION_EXTRAS = 8  # with the peer-wait and extras tables ("Extras table")
PEER_WAITS_PER_SLOT, EXTRAS_PER_SLOT = 4, 12
VIEW_IN_TIER = 1 << 63


class Segment:
    def __init__(self, slots, ring_bytes, generation=1, views_per_slot=0, extras=False):
        assert slots & (slots - 1) == 0 and 1 <= slots <= 65536
        assert 0 <= views_per_slot <= 65536
        self.slots = slots
        self.views = views_per_slot  # 0: version 5, no table
        self.table = 1216 + 128 * slots  # the view table's first byte (version 6)
        # version 8: the peer-wait table after the view table, the extras
        # table after that ("Peer-wait table", "Extras table")
        self.extras = extras
        pw = PEER_WAITS_PER_SLOT if extras else 0
        ex = EXTRAS_PER_SLOT if extras else 0
        self.peer_table = self.table + 8 * slots * views_per_slot
        self.extras_table = self.peer_table + 8 * slots * pw
        self.total = 1216 + 128 * slots + 8 * slots * (views_per_slot + pw + ex)
        self.mapped = -(-self.total // PAGE) * PAGE
        self.fd = os.memfd_create("kspeed-foreign-seg", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.mapped)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self.mm = mmap.mmap(self.fd, self.mapped, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.generation = generation
        # header: written before the magic, magic last (line 74)
        version = (SEG_VERSION_EXTRAS if extras
                   else SEG_VERSION_VIEWS if views_per_slot else SEG_VERSION)
        struct.pack_into("<IIQIIQIIIII4s", self.mm, 8, version, 64, self.total,
                         slots, 4, ring_bytes, generation, os.getpid(), views_per_slot,
                         pw, ex, b"\0" * 4)
        # rank block
        self.st64(136, mono_ns())
        self.st32(144, os.getpid())
        self.st32(148, 1)  # running
        self.st64(128, generation << 48)  # nothing released
        self.mm[0:8] = SEG_MAGIC  # "stored last, with Release"

    def u64(self, off):
        return ctypes.c_uint64.from_address(self.base + off)

    def u32(self, off):
        return ctypes.c_uint32.from_address(self.base + off)

    def ld64(self, off):
        return self.u64(off).value

    def ld32(self, off):
        return self.u32(off).value

    def st64(self, off, v):
        self.u64(off).value = v

    def st32(self, off, v):
        self.u32(off).value = v

    # agent block
    def agent(self):
        return dict(heartbeat_ns=self.ld64(64), pid=self.ld32(72), state=self.ld32(76),
                    ready_futex=self.ld32(80), room_waiters=self.ld32(84), published=self.ld64(88),
                    published_bytes=self.ld64(96), wakes=self.ld64(104), sleeps=self.ld64(112),
                    errors_dropped=self.ld64(120))

    def rank(self):
        return dict(release=self.ld64(128), heartbeat_ns=self.ld64(136), pid=self.ld32(144),
                    state=self.ld32(148), room_futex=self.ld32(152), ready_waiters=self.ld32(156),
                    taken=self.ld64(160), wakes=self.ld64(168), sleeps=self.ld64(176))

    def errors(self):
        out = []
        for i in range(4):
            o = 192 + 256 * i
            st, side, cls, mlen = struct.unpack_from("<IIII", self.mm, o)
            if st:
                kind = bytes(self.mm[o + 16:o + 48]).rstrip(b"\0").decode(errors="replace")
                msg = bytes(self.mm[o + 48:o + 48 + min(mlen, 208)]).decode(errors="replace")
                out.append(dict(slot=i, state=st, side=side, cls=cls, kind=kind, message=msg))
        return out

    def slot_off(self, seq):
        return 1216 + 128 * (seq % self.slots)

    def ready_word(self, seq):
        return (self.generation << 48) | (seq % (1 << 48))

    def try_take(self, seq):
        o = self.slot_off(seq)
        if self.ld64(o) != self.ready_word(seq):  # Acquire (x86: plain load)
            return None
        ring_off, nbytes, epoch, bie, samples, failovers = struct.unpack_from("<QQQQII", self.mm, o + 8)
        counts = struct.unpack_from("<4I6I", self.mm, o + 48)
        self.st64(160, self.ld64(160) + 1)  # taken (stats)
        b = dict(seq=seq, ring_offset=ring_off, bytes=nbytes, epoch=epoch, batch_in_epoch=bie,
                 samples=samples, failovers=failovers,
                 disk_reads=counts[0], tier_hits=counts[1], remote_samples=counts[2],
                 source_reads=counts[3], disk_wait_us=counts[4], tier_wait_us=counts[5],
                 source_wait_us=counts[6], peers_wait_us=counts[7], failover_wait_us=counts[8],
                 cache_hits=counts[9])
        if self.views:
            # the batch's row, read after the ready word (Acquire), valid until
            # its release; words past `samples` are not the batch's
            row = self.table + 8 * self.views * (seq % self.slots)
            b["views"] = list(struct.unpack_from("<%dQ" % min(samples, self.views), self.mm, row))
        if self.extras:
            # peer waits: (node + 1) << 32 | us, 0 empty; extras: source
            # bytes, reserved, then read | send << 32 and link per split
            row = self.peer_table + 8 * PEER_WAITS_PER_SLOT * (seq % self.slots)
            b["peer_waits"] = [((w >> 32) - 1, w & 0xFFFFFFFF)
                               for w in struct.unpack_from("<4Q", self.mm, row) if w]
            row = self.extras_table + 8 * EXTRAS_PER_SLOT * (seq % self.slots)
            w = struct.unpack_from("<12Q", self.mm, row)
            if w[1] != 0 or any(w[k] >> 32 for k in range(3, 12, 2)):
                raise AttachProtocol("batch %d: extra words %r break the documented ranges" % (seq, w))
            b["source_bytes"] = w[0]
            b["peer_split_us"] = [(w[k] & 0xFFFFFFFF, w[k] >> 32, w[k + 1]) for k in range(2, 12, 2)]
        return b

    def release(self, released):
        """released = batches released so far (a count)."""
        self.st64(128, (self.generation << 48) | (released % (1 << 48)))  # Release
        fence()
        if self.ld32(84) > 0:  # room_waiters
            self.st32(152, (self.ld32(152) + 1) & 0xFFFFFFFF)
            futex_wake(self.base + 152)
            self.st64(168, self.ld64(168) + 1)

    def close(self):
        self.st32(148, 2)  # closed
        for off in (80, 152):  # both futex words, from either side (line 56)
            self.st32(off, (self.ld32(off) + 1) & 0xFFFFFFFF)
            futex_wake(self.base + off)


class PeerError(Exception):
    pass


class AttachProtocol(Exception):
    pass


SPIN = 200


def wait_take(seg, seq, sock, deadline_s, silence_ms=300, stopped_wait_s=10.0, log=None):
    """Spin, then sleep on ready_futex with 100 ms slices, checking the agent between sleeps."""
    t_end = time.monotonic() + deadline_s
    b = seg.try_take(seq)
    if b:
        return b
    for _ in range(SPIN):
        b = seg.try_take(seq)
        if b:
            return b
    silent_since = None
    while True:
        seg.st32(156, seg.ld32(156) + 1)  # ready_waiters += 1
        seen = seg.ld32(80)
        fence()
        b = seg.try_take(seq)
        if b is None:
            seg.st64(176, seg.ld64(176) + 1)
            futex_wait(seg.base + 80, seen, 0.1)
        seg.st32(156, seg.ld32(156) - 1)
        seg.st64(136, mono_ns())  # beat at every wake-up
        if b is None:
            b = seg.try_take(seq)
        if b:
            return b
        a = seg.agent()
        if a["state"] == 3:
            raise PeerError("agent failed: %r" % seg.errors())
        if a["state"] == 2:
            raise PeerError("agent closed the segment")
        age_ms = (mono_ns() - a["heartbeat_ns"]) / 1e6
        if age_ms > silence_ms:
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > stopped_wait_s:
                raise PeerError("agent heartbeat silent %.0f ms" % age_ms)
        else:
            silent_since = None
        r, _, _ = select.select([sock], [], [], 0)
        if r:
            try:
                data = sock.recv(512, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            except BlockingIOError:
                data = b"x"
            except OSError as e:
                raise PeerError("socket error %r" % e)
            if data == b"":
                raise PeerError("agent hung up the socket")
        if time.monotonic() > t_end:
            raise TimeoutError("no batch seq %d within %.1fs; agent=%r rank=%r errors=%r"
                               % (seq, deadline_s, a, seg.rank(), seg.errors()))


# ---------------------------------------------------------------- the attach protocol (lines 232-319)
KSAT = b"KSAT"
MSG_VERSION = 5


def build_attach(generation, dataset_id, seed, rank, world, batch, slots, start_epoch, start_index,
                 ring_bytes, seg_bytes, flags, local_rank=0, local_world=0, end_epoch=0,
                 job_epoch=0, job_consumed=0, length=112, version=MSG_VERSION, kind=1):
    m = struct.pack("<4sHHI I QQ IIII QQQQ I HH QQQ", KSAT, version, kind, length,
                    generation, dataset_id, seed, rank, world, batch, slots,
                    start_epoch, start_index, ring_bytes, seg_bytes, flags,
                    local_rank, local_world, end_epoch, job_epoch, job_consumed)
    assert len(m) == 112, len(m)
    return m


def attached_tier(m, fds, asked):
    """ATTACHED bytes 24..31 and its descriptors ("Tier views"): (tier_bytes, fd or None).
    A descriptor not asked for, or a count that does not match, is AttachProtocol."""
    tier_bytes = struct.unpack_from("<Q", m, 24)[0]
    want = 1 if asked and tier_bytes else 0
    if len(fds) != want or (tier_bytes and not asked):
        for fd in fds:
            os.close(fd)
        raise AttachProtocol("ATTACHED: tier_bytes %d with %d descriptors (tier views %s)"
                             % (tier_bytes, len(fds), "asked" if asked else "not asked"))
    return tier_bytes, (fds[0] if fds else None)


def map_tier(fd, tier_bytes):
    """The node tier, PROT_READ, MAP_SHARED: a memfd sealed against shrinking, at least
    tier_bytes long, else the attach fails. Returns (mapping, read_only_checks)."""
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if not seals & fcntl.F_SEAL_SHRINK:
        raise AttachProtocol("the node tier's memfd is not sealed against shrinking (seals 0x%x)"
                             % seals)
    size = os.fstat(fd).st_size
    if size < tier_bytes:
        raise AttachProtocol("the node tier's memfd is %d bytes, ATTACHED says %d" % (size, tier_bytes))
    mm = mmap.mmap(fd, tier_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
    checks = dict(memfd_bytes=size, seals=seals,
                  o_rdonly=(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) == os.O_RDONLY)
    try:  # "The mapping cannot be made writable" (EACCES)
        mmap.mmap(fd, min(tier_bytes, PAGE), mmap.MAP_SHARED,
                  mmap.PROT_READ | mmap.PROT_WRITE).close()
        checks["writable_mmap"] = "allowed"
    except OSError as e:
        checks["writable_mmap"] = errno.errorcode.get(e.errno, str(e.errno))
    return mm, checks


def parse_reply(m):
    if len(m) < 12:
        return dict(kind="short", raw=m.hex())
    magic, ver, kind, ln = struct.unpack_from("<4sHHI", m)
    r = dict(magic=magic.decode(errors="replace"), version=ver, kind_code=kind, length=ln, got=len(m))
    if kind == 2:
        g, pid, hb, _ = struct.unpack_from("<IIIQ", m, 12)
        r.update(kind="ATTACHED", generation=g, agent_pid=pid, heartbeat_ms=hb)
    elif kind == 3:
        code, rl = struct.unpack_from("<II", m, 12)
        r.update(kind="REFUSED", code=code,
                 reason=m[20:20 + min(rl, 236)].decode(errors="replace"))
    else:
        r.update(kind="?")
    return r


def attach(sock_path, msg, fds, timeout=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.connect(sock_path)
    s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
    data, anc, flags, _ = s.recvmsg(512, socket.CMSG_SPACE(8 * 4), socket.MSG_CMSG_CLOEXEC)
    got = array.array("i")
    for level, typ, d in anc:  # ATTACHED's descriptor, if any ("Tier views")
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            got.frombytes(d[:len(d) - len(d) % got.itemsize])
    if flags & socket.MSG_CTRUNC:
        for fd in got:
            os.close(fd)
        raise AttachProtocol("ATTACHED's descriptors were cut (MSG_CTRUNC)")
    return s, data, list(got)


def make_ring(ring_bytes, seal=True):
    fd = os.memfd_create("kspeed-foreign-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, ring_bytes)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    mm = mmap.mmap(fd, ring_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    # "The rank faults its ring's pages in itself" (line 560): touch every page
    for o in range(0, ring_bytes, PAGE):
        mm[o] = 0
    return fd, mm


def parse_size(s):
    s = s.strip()
    for suf, mul in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if s.endswith(suf):
            return int(float(s[:-len(suf)]) * mul)
    return int(s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--space", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ring-bytes", default="4MiB")
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--end-epoch", type=int, default=None, help="default epoch+epochs; 0 = none")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--spin", type=int, default=200)
    ap.add_argument("--slow-ms", type=float, default=0, help="hold each batch this long (agent must sleep for room)")
    ap.add_argument("--no-shuffle", action="store_true")
    ap.add_argument("--align", type=int, default=4096)
    ap.add_argument("--dump", action="store_true")
    ap.add_argument("--cat", default=None, help="kspeed binary: also compare with `kspeed cat`")
    ap.add_argument("--tier-views", action="store_true",
                    help="ATTACH flag 8: take the node tier's samples in place (segment layout 6)")
    ap.add_argument("--extras", action="store_true",
                    help="ATTACH flags 16 and 32: peer waits and extra words (segment layout 8)")
    a = ap.parse_args()

    cat = read_catalog(os.path.join(a.space, "catalog.ksc"))
    ring_bytes = parse_size(a.ring_bytes)
    seg = Segment(a.slots, ring_bytes, generation=1, views_per_slot=a.batch if a.tier_views else 0,
                  extras=a.extras)
    ring_fd, ring = make_ring(ring_bytes)
    shuffle = not a.no_shuffle
    flags = (1 if shuffle else 0) | (8 if a.tier_views else 0) | (48 if a.extras else 0)
    global SPIN
    SPIN = a.spin
    end_epoch = a.epoch + a.epochs if a.end_epoch is None else a.end_epoch
    msg = build_attach(seg.generation, cat["identity"], a.seed, a.rank, a.world, a.batch, a.slots,
                       a.epoch, 0, ring_bytes, seg.total, flags, end_epoch=end_epoch)
    report = dict(ok=False)
    sock = None
    tier_fd, tier = None, None
    try:
        sock, reply, fds = attach(a.socket, msg, [ring_fd, seg.fd])
        rep = parse_reply(reply)
        report["reply"] = rep
        print("reply:", rep, file=sys.stderr)
        if rep.get("kind") != "ATTACHED":
            for fd in fds:
                os.close(fd)
            return report
        tier_bytes, tier_fd = attached_tier(reply, fds, a.tier_views)
        if a.tier_views:
            report["tier_bytes"] = tier_bytes
            if tier_fd is not None:
                tier, report["tier_checks"] = map_tier(tier_fd, tier_bytes)
            else:
                print("the agent gives no tier views (tier_bytes 0): every sample in the ring",
                      file=sys.stderr)
        tier_views = {}  # epoch -> samples read from the tier
        source = dict(reads=0, bytes=0)  # from the slots and the extras table
        sock.settimeout(0.5)

        delivered = []
        mismatches = []
        layout_notes = set()
        seq = 0
        src_root = cat["source"].split(":", 1)[1]
        orders = {}
        for ep in range(a.epoch, a.epoch + a.epochs):
            order = rank_order(cat["n"], a.seed, ep, a.rank, a.world, shuffle)
            orders[ep] = order
            nb = -(-len(order) // a.batch)
            for k in range(nb):
                b = wait_take(seg, seq, sock, deadline_s=10.0)
                source["reads"] += b["source_reads"]
                source["bytes"] += b.get("source_bytes", 0)
                if a.dump:
                    print("batch", b, file=sys.stderr)
                ids = order[b["batch_in_epoch"] * a.batch:(b["batch_in_epoch"] + 1) * a.batch]
                if b["epoch"] != ep or b["samples"] != len(ids) or b["batch_in_epoch"] != k:
                    mismatches.append(("descriptor", b, len(ids)))
                # Layout (docs/AGENT.md, "A batch in the ring"): samples in order from
                # ring_offset, each taking round_up(len, align); a sample that
                # would run past the ring's end starts at 0 instead (the skipped
                # tail counts in `bytes`). `bytes` = from the first byte to the
                # last sample's last byte, along the ring, wrap included.
                cur = b["ring_offset"]
                spanned = 0
                for j, sid in enumerate(ids):
                    s = cat["samples"][sid]
                    pad = -(-s["len"] // a.align) * a.align
                    if cur + pad > ring_bytes:
                        spanned += ring_bytes - cur
                        cur = 0
                        layout_notes.add("wrapped")
                    # "View table": 0, in the ring at its scheduled place; bit 63,
                    # in the node tier at word & (2^63 - 1). A tier sample keeps
                    # its (unwritten) place in the ring, so `cur` moves on alike.
                    view = b["views"][j] if a.tier_views and j < len(b["views"]) else 0
                    where = cur
                    if view == 0:
                        got = bytes(ring[cur:cur + s["len"]])
                    elif view & VIEW_IN_TIER:
                        t_off = view & (VIEW_IN_TIER - 1)
                        if tier is None or t_off + s["len"] > tier_bytes:
                            raise AttachProtocol(
                                "batch %d sample %d (id %d, %d bytes): tier offset %d past the "
                                "tier's %d bytes" % (seq, j, sid, s["len"], t_off,
                                                     tier_bytes if tier is not None else 0))
                        got = bytes(tier[t_off:t_off + s["len"]])
                        where = "tier+%d" % t_off
                        tier_views[ep] = tier_views.get(ep, 0) + 1
                    else:
                        raise AttachProtocol("batch %d sample %d (id %d): view word 0x%x is neither 0 "
                                             "nor in the tier" % (seq, j, sid, view))
                    if crc32c(got) != s["crc"]:
                        mismatches.append(("crc", seq, sid, where))
                    want = open(os.path.join(src_root, cat["files"][s["file"]]), "rb").read()
                    if got != want:
                        mismatches.append(("source", seq, sid, where))
                    delivered.append((ep, sid, got))
                    last_len = s["len"]
                    spanned += pad
                    cur += pad
                spanned = spanned - (-(-last_len // a.align) * a.align) + last_len
                if spanned != b["bytes"]:
                    layout_notes.add("span %d != computed %d (batch %d)" % (b["bytes"], spanned, seq))
                if a.slow_ms:
                    time.sleep(a.slow_ms / 1000)
                seq += 1
                seg.release(seq)
        nb = seq
        order = [i for ep in sorted(orders) for i in orders[ep]]
        report.update(batches=seq, expected_batches=nb, samples=len(delivered))
        if a.extras:
            report["source_reads"], report["source_bytes"] = source["reads"], source["bytes"]
        if a.tier_views:
            report["tier_views"] = sum(tier_views.values())
            report["tier_views_per_epoch"] = {ep: tier_views.get(ep, 0) for ep in sorted(orders)}
        ids = [d[1] for d in delivered]
        report["order_equals_sampler"] = ids == order
        report["per_epoch"] = {}
        for ep in sorted(orders):
            e_ids = [d[1] for d in delivered if d[0] == ep]
            report["per_epoch"][ep] = dict(
                samples=len(e_ids), distinct=len(set(e_ids)),
                each_once=(len(e_ids) == len(set(e_ids)) == len(orders[ep])
                           and (a.world > 1 or len(e_ids) == cat["n"])),
                exactly_once_digest="count %d sum 0x%016x" % (len(e_ids), sum(digest_h(ep, i) for i in e_ids) & M64))
        report["each_once"] = all(v["each_once"] for v in report["per_epoch"].values())
        report["mismatches"] = mismatches[:20]
        report["n_mismatches"] = len(mismatches)
        report["layout_notes"] = sorted(layout_notes)[:5]
        if a.cat:
            import subprocess
            bad = 0
            for _, sid, got in delivered:
                out = subprocess.run([a.cat, "cat", "--space", a.space, "--id", str(sid)],
                                     capture_output=True, timeout=10).stdout
                bad += out != got
            report["kspeed_cat_mismatches"] = bad
        # candidate --digest forms (README: CRC32C over id and bytes, chained)
        cands = {}
        for name, fmt in (("u64", "<Q"), ("u32", "<I")):
            c = 0
            for _, sid, got in delivered:
                c = crc32c(struct.pack(fmt, sid) + got, c)
            cands[name] = "%08x" % c
        report["digest_candidates"] = cands
        report["agent_block"] = seg.agent()
        report["rank_block"] = seg.rank()
        # After the end epoch the agent "publishes nothing more": check that
        try:
            extra = wait_take(seg, seq, sock, deadline_s=0.5)
            report["extra_batch_after_end"] = extra
        except TimeoutError:
            report["extra_batch_after_end"] = None
        report["errors"] = seg.errors()
        report["ok"] = (not mismatches and report["order_equals_sampler"] and report["each_once"]
                        and report.get("kspeed_cat_mismatches", 0) == 0)
        return report
    except Exception as e:
        report["exception"] = "%s: %s" % (type(e).__name__, e)
        report["errors"] = seg.errors()
        report["agent_block"] = seg.agent()
        return report
    finally:
        seg.close()
        if sock:
            sock.close()
        if tier is not None:
            tier.close()
        if tier_fd is not None:
            os.close(tier_fd)


if __name__ == "__main__":
    r = main()
    print(json.dumps(r, default=str))
    sys.exit(0 if r.get("ok") else 1)
