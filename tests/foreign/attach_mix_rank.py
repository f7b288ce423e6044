#!/usr/bin/env python3
"""An independent attached rank reading a MIXTURE of datasets through
`kspeed agent --space A --space B`, written from docs/AGENT.md ("The attach
protocol", ATTACH version 6; "A mixture through the agent") and docs/FORMAT.md
("Sampler", "Mixing datasets", the catalog and manifest). Standard library
only. Derived from tests/foreign/attach_rank.py (the one-dataset rank), whose
unchanged pieces it imports.

Usage: attach_mix_rank.py --socket S --space A --space B
           --weights choose=50,choose=40 | repeat=1,repeat=2 | 0.7,0.3 [--epoch-size N]
           [--rank r --world w --batch 16 --seed 42 --slots 8 --ring-bytes 4MiB
            --epoch 1 --epochs 2 --no-shuffle --drop-last]
       attach_mix_rank.py --selftest      (FORMAT.md's check values)
Prints a JSON report on the last line; `digest_candidates.u64` is meant to be
`kspeed read --mix ... --digest` (README: CRC32C of each sample's id as u64 LE
then its bytes, chained in delivery order; the id of a mixture's sample is
taken to be its global id, `u64_local` is the same with the dataset's own id).
"""
import argparse, array, ctypes, errno, fcntl, json, mmap, os, select, socket
import struct, sys, time

# The one-dataset rank's pieces that a mixture's rank uses unchanged: the
# CRC, the sampler's permutation, the catalog, the segment, futexes and the
# batch wait.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attach_rank import (  # noqa: E402
    SEG_MAGIC, SEG_VERSION, PeerError, SPIN, Segment, Timespec, crc32c, digest_h, fence,
    futex_wait, futex_wake, mix64, mono_ns, parse_reply, parse_size, perm_fn, read_catalog,
    wait_take)

PAGE = mmap.PAGESIZE
M64 = (1 << 64) - 1

# ---------------------------------------------------------------- FORMAT.md: "Mixing datasets"
def mixture_identity(identities):
    h = mix64(len(identities))
    for c in identities:
        h = mix64(h ^ c)
    return (h ^ (h >> 32)) & 0xFFFFFFFF


def counts_hash(counts):
    h = mix64(len(counts) ^ 0x6B7370656564636E)  # "kspeedcn"
    for c in counts:
        h = mix64(h ^ c)
    return h


def _round_half_away(x):
    # "round(...)": taken as round half away from zero (Rust's f64::round), a guess
    import math
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def parse_weights(spec, lengths, epoch_size=None):
    """'choose=N', 'repeat=R', a proportion '0.7', or '' (repeat=1), comma-separated."""
    items = [w.strip() for w in spec.split(",")]
    if len(items) != len(lengths):
        raise ValueError("%d weights for %d datasets" % (len(items), len(lengths)))
    props = [w for w in items if w and "=" not in w]
    if props and len(props) != len(items):
        raise ValueError("every dataset gives a proportion, or none does")
    if props:
        E = epoch_size if epoch_size else sum(lengths)
        w = [_round_half_away(float(p) * 2 ** 32) for p in props]
        W = sum(w)
        c = [E * wd // W for wd in w]
        rem = [(E * wd) % W for wd in w]
        left = E - sum(c)
        # the largest remainders, ties: lower d first
        for d in sorted(range(len(w)), key=lambda d: (-rem[d], d))[:left]:
            c[d] += 1
        return c
    if epoch_size:
        raise ValueError("--epoch-size divides proportions only")
    out = []
    for w, n in zip(items, lengths):
        if not w:
            w = "repeat=1"
        k, v = w.split("=", 1)
        if k == "choose":
            out.append(int(v))
        elif k == "repeat":
            out.append(n * _round_half_away(float(v) * 2 ** 32) >> 32)
        else:
            raise ValueError("weight %r" % w)
    if not any(out):
        raise ValueError("all counts 0")
    return out


class Mixture:
    """The mixed epoch: position j -> (dataset d, its k-th slot) -> local id."""

    def __init__(self, lengths, counts, seed, shuffle=True, skips=None):
        self.lengths, self.counts, self.seed, self.shuffle = lengths, counts, seed, shuffle
        self.D = len(lengths)
        self.skips = skips or [0] * self.D
        self.T = sum(counts)
        self.offsets = [sum(lengths[:d]) for d in range(self.D)]
        self.seeds = [seed] + [mix64(seed ^ mix64(d ^ 0x6B73706565646473)) for d in range(1, self.D)]
        self._perms = {}

    def locate(self, j):
        a, b, n, i = 0, self.D, self.T, j
        while b - a > 1:
            m = a + -(-(b - a) // 2)
            nl = sum(self.counts[a:m])
            x = i * nl // n
            if (i + 1) * nl // n > x:
                b, n, i = m, nl, x
            else:
                a, n, i = m, n - nl, i - x
        return a, i

    def local_id(self, d, k, epoch):
        n = self.lengths[d]
        s = self.skips[d] + k
        pss, idx = divmod(s, n)
        if not self.shuffle:
            return idx
        key = epoch if pss == 0 else mix64(mix64(epoch ^ 0x6B73706565647073) ^ pss)  # "kspeedps"
        p = self._perms.get((d, key))
        if p is None:
            p = self._perms[(d, key)] = perm_fn(n, self.seeds[d], key)
        return p(idx)

    def position(self, j, epoch):
        d, k = self.locate(j)
        lid = self.local_id(d, k, epoch)
        return d, lid, self.offsets[d] + lid

    def rank_steps(self, epoch, rank, world, batch, drop_last=False):
        T = self.T
        if drop_last:
            steps = (T // world) // batch * batch
        else:
            steps = -(-T // world)
        return [self.position((rank + k * world) % T, epoch) for k in range(steps)]


def selftest():
    errs = []
    m = Mixture([10, 6, 4], parse_weights("0.5,0.3,0.2", [10, 6, 4]), 1)
    if m.counts != [10, 6, 4]:
        errs.append("counts %r" % m.counts)
    pos = [m.position(j, 0) for j in range(20)]
    if [p[0] for p in pos] != [2, 1, 0, 1, 0, 2, 0, 1, 0, 0, 2, 1, 0, 1, 0, 2, 0, 1, 0, 0]:
        errs.append("datasets %r" % [p[0] for p in pos])
    if [p[2] for p in pos] != [16, 12, 4, 11, 7, 19, 6, 10, 3, 2, 18, 13, 1, 15, 5, 17, 0, 14, 8, 9]:
        errs.append("ids %r" % [p[2] for p in pos])
    if counts_hash([10, 6, 4]) != 0x89E08085E547C159:
        errs.append("counts hash %x" % counts_hash([10, 6, 4]))
    m = Mixture([4], parse_weights("repeat=2", [4]), 1)
    got = [m.position(j, 2)[2] for j in range(m.T)]
    if got != [3, 2, 1, 0, 0, 3, 1, 2]:
        errs.append("repeat=2 %r" % got)
    if digest_h(0, 0) != 0xFDBF42A88AC50F27:
        errs.append("h(0,0)")
    return errs


# ---------------------------------------------------------------- FORMAT.md: catalog


def read_manifest_align(space):
    """manifest.ksm: common envelope, header fields from 32; align_bytes at field 40."""
    d = open(os.path.join(space, "manifest.ksm"), "rb").read(128)
    assert d[:8] == b"KSPDMAN\0", d[:8]
    return struct.unpack_from("<Q", d, 32 + 40)[0]


# ---------------------------------------------------------------- futex
libc = ctypes.CDLL(None, use_errno=True)
SYS_futex = 202  # x86_64
SYS_getpid = 39
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # no FUTEX_PRIVATE_FLAG (AGENT.md "Orderings")


# ---------------------------------------------------------------- the segment (AGENT.md "The attach segment")


# ---------------------------------------------------------------- the attach protocol (AGENT.md, versions 5 and 6)
KSAT = b"KSAT"


def build_attach6(generation, dataset_id, seed, rank, world, batch, slots, start_epoch, start_index,
                  ring_bytes, seg_bytes, flags, counts, skips=None, local_rank=0, local_world=0,
                  end_epoch=0, job_epoch=0, job_consumed=0, shuffle_block=0,
                  mix_start_epoch=0, mix_start_consumed=0):
    D = len(counts)
    skips = skips or [0] * D
    length = 144 + 16 * D
    m = struct.pack("<4sHHI I QQ IIII QQQQ I HH QQQ Q II QQ", KSAT, 6, 1, length,
                    generation, dataset_id, seed, rank, world, batch, slots,
                    start_epoch, start_index, ring_bytes, seg_bytes, flags,
                    local_rank, local_world, end_epoch, job_epoch, job_consumed,
                    shuffle_block, D, 0, mix_start_epoch, mix_start_consumed)
    assert len(m) == 144, len(m)
    for c, s in zip(counts, skips):
        m += struct.pack("<QQ", c, s)
    assert len(m) == length
    return m


def attach(sock_path, msg, fds, timeout=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)  # connect, send and the reply all bounded
    s.connect(sock_path)
    s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    data, anc, flags, _ = s.recvmsg(512, socket.CMSG_SPACE(8 * 4))
    for lvl, typ, blob in anc:  # the agent sends none; close any so none leak
        if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            for fd in array.array("i", blob[:len(blob) - len(blob) % 4]):
                os.close(fd)
    return s, data


def make_ring(ring_bytes):
    fd = os.memfd_create("kspeed-foreign-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, ring_bytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    mm = mmap.mmap(fd, ring_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    for o in range(0, ring_bytes, PAGE):  # the rank faults its ring's pages in itself
        mm[o] = 0
    return fd, mm


class Placer:
    """AGENT.md "A batch in the ring", 3: a running offset v over the attach."""

    def __init__(self, ring_bytes, align):
        self.R, self.A, self.S, self.v = ring_bytes, align, min(ring_bytes, 1 << 30), 0

    def place(self, ln):
        A, R, S = self.A, self.R, self.S
        slot = max(-(-ln // A) * A, A)
        p = self.v % R
        if p % S + slot > S or p + slot > R:
            self.v += min((p // S + 1) * S, R) - p
        off = self.v % R
        self.v += slot
        return off


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket")
    ap.add_argument("--space", action="append", default=[], help="each dataset, in the agent's order")
    ap.add_argument("--weights", default=None, help="choose=N,repeat=R or proportions, one per --space")
    ap.add_argument("--epoch-size", type=int, default=None, help="the epoch proportions divide")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ring-bytes", default="4MiB")
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--end-epoch", type=int, default=None, help="default epoch+epochs; 0 = none")
    ap.add_argument("--no-shuffle", action="store_true")
    ap.add_argument("--drop-last", action="store_true")
    ap.add_argument("--verify", action="store_true", help="ATTACH flag 4: the agent checks CRC32C")
    ap.add_argument("--align", type=int, default=None, help="default: the largest space's align_bytes")
    ap.add_argument("--source-check", action="store_true", help="also compare with the source files")
    ap.add_argument("--wait-s", type=float, default=10.0, help="deadline for each batch")
    ap.add_argument("--dump", action="store_true")
    ap.add_argument("--selftest", action="store_true")
    a = ap.parse_args()

    if a.selftest:
        errs = selftest()
        return dict(ok=not errs, samples=0, digest_candidates={}, errors=errs)
    if not a.socket or len(a.space) < 1:
        ap.error("--socket and at least one --space are needed")

    cats = [read_catalog(os.path.join(s, "catalog.ksc")) for s in a.space]
    aligns = [read_manifest_align(s) for s in a.space]
    lengths = [c["n"] for c in cats]
    counts = parse_weights(a.weights or ",".join("" for _ in cats), lengths, a.epoch_size)
    shuffle = not a.no_shuffle
    mix = Mixture(lengths, counts, a.seed, shuffle)
    ident = mixture_identity([c["identity"] for c in cats])
    align = a.align or max(aligns)
    ring_bytes = parse_size(a.ring_bytes)
    seg = Segment(a.slots, ring_bytes, generation=1)
    ring_fd, ring = make_ring(ring_bytes)
    flags = (1 if shuffle else 0) | (2 if a.drop_last else 0) | (4 if a.verify else 0)
    end_epoch = a.epoch + a.epochs if a.end_epoch is None else a.end_epoch
    msg = build_attach6(seg.generation, ident, a.seed, a.rank, a.world, a.batch, a.slots,
                        a.epoch, 0, ring_bytes, seg.total, flags, counts, end_epoch=end_epoch)
    report = dict(ok=False, samples=0, digest_candidates={}, errors=[],
                  mixture=dict(identity="%08x" % ident, lengths=lengths, counts=counts,
                               T=mix.T, aligns=aligns, align_used=align))
    errors = report["errors"]
    sock = None
    try:
        try:
            sock, reply = attach(a.socket, msg, [ring_fd, seg.fd])
        except OSError as e:
            errors.append("attach: %s: %s" % (type(e).__name__, e))
            return report
        rep = parse_reply(reply)
        report["reply"] = rep
        print("reply:", rep, file=sys.stderr)
        if rep.get("kind") != "ATTACHED":
            errors.append("not attached: %r" % rep)
            return report
        sock.settimeout(0.5)

        delivered = []  # (epoch, dataset, local id, global id, bytes)
        placer = Placer(ring_bytes, align)
        seq = 0
        orders = {}
        for ep in range(a.epoch, a.epoch + a.epochs):
            order = mix.rank_steps(ep, a.rank, a.world, a.batch, a.drop_last)
            orders[ep] = order
            nb = -(-len(order) // a.batch)
            for k in range(nb):
                b = wait_take(seg, seq, sock, deadline_s=a.wait_s)
                if a.dump:
                    print("batch", b, file=sys.stderr)
                steps = order[k * a.batch:(k + 1) * a.batch]
                if b["epoch"] != ep or b["samples"] != len(steps) or b["batch_in_epoch"] != k:
                    errors.append("descriptor of seq %d: %r, want epoch %d batch %d samples %d"
                                  % (seq, b, ep, k, len(steps)))
                offs = []
                for d, lid, gid in steps:
                    s = cats[d]["samples"][lid]
                    off = placer.place(s["len"])
                    offs.append(off)
                    got = bytes(ring[off:off + s["len"]])
                    if crc32c(got) != s["crc"]:
                        errors.append("crc: seq %d dataset %d id %d (global %d) at %d"
                                      % (seq, d, lid, gid, off))
                    if a.source_check:
                        root = cats[d]["source"].split(":", 1)[1]
                        want = open(os.path.join(root, cats[d]["files"][s["file"]]), "rb").read()
                        if got != want:
                            errors.append("source: seq %d dataset %d id %d" % (seq, d, lid))
                    delivered.append((ep, d, lid, gid, got))
                last = cats[steps[-1][0]]["samples"][steps[-1][1]]["len"]
                e = offs[-1] + last
                span = e - offs[0] if e >= offs[0] else (ring_bytes - offs[0]) + e
                if b["ring_offset"] != offs[0] or b["bytes"] != span:
                    errors.append("place of seq %d: agent (%d, %d bytes), computed (%d, %d bytes)"
                                  % (seq, b["ring_offset"], b["bytes"], offs[0], span))
                seq += 1
                seg.release(seq)
        report.update(batches=seq, samples=len(delivered))
        report["per_epoch"] = {}
        for ep in sorted(orders):
            e_items = [x for x in delivered if x[0] == ep]
            per_d = [sum(1 for x in e_items if x[1] == d) for d in range(mix.D)]
            report["per_epoch"][ep] = dict(
                samples=len(e_items), per_dataset=per_d,
                exactly_once_digest="count %d sum 0x%016x"
                % (len(e_items), sum(digest_h(ep, x[3]) for x in e_items) & M64))
        cands = {}
        for name, fmt, idx in (("u64", "<Q", 3), ("u64_local", "<Q", 2), ("u32", "<I", 3)):
            c = 0
            for x in delivered:
                c = crc32c(x[4], crc32c(struct.pack(fmt, x[idx]), c))
            cands[name] = "%08x" % c
        report["digest_candidates"] = cands
        report["agent_block"] = seg.agent()
        # after end_epoch the agent publishes nothing more
        if a.end_epoch != 0:
            try:
                extra = wait_take(seg, seq, sock, deadline_s=0.5)
                errors.append("a batch after the end epoch: %r" % extra)
            except TimeoutError:
                pass
        for er in seg.errors():
            errors.append("segment error: %r" % er)
        report["ok"] = not errors and len(delivered) == sum(len(o) for o in orders.values())
        return report
    except Exception as e:
        errors.append("%s: %s" % (type(e).__name__, e))
        for er in seg.errors():
            errors.append("segment error: %r" % er)
        report["agent_block"] = seg.agent()
        return report
    finally:
        seg.close()
        if sock:
            sock.close()


if __name__ == "__main__":
    r = main()
    print(json.dumps(r, default=str))
    sys.exit(0 if r.get("ok") else 1)
