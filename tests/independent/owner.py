#!/usr/bin/env python3
"""Minimal kspeed owner (node service), protocol version 2, TCP only.

Written from docs/PROTOCOL.md and docs/FORMAT.md alone, by someone who did
not read kspeed's sources: tests/independent_owner.rs runs kspeed's real
consumer against it, so the consumer is checked against an owner that is
not kspeed's own, and the docs against what they promise. Serves every sample
of a catalog (placement: 1 node, 1 copy, scaled owner function) from the
source files the catalog names.

  owner.py --catalog C --token-file F --listen 127.0.0.1:PORT
           [--ready-delay-ms 20] [--hold-ms 0] [--chunk-bytes 262144]

--ready-delay-ms: per grant, the bytes are "ready" this long after the GRANT
  frame was read (timers run concurrently, like a disk with deep queue).
--hold-ms: per grant, the frame is held this long after its times were
  computed (posted is stamped before the hold) and before it is written.
"""
import argparse, hmac, os, queue, socket, struct, sys, threading, time

MAGIC = 0x534B
HELLO, WELCOME, GRANT, DATA, ERROR, RDMA_ENDPOINT = 1, 2, 3, 4, 5, 6
VERSION = 2
CONN = 0xFFFFFFFF
BadToken, BadVersion, WrongDataset, NotHeld, ReadFailed, Violation, TooManyGrants = 1, 2, 3, 4, 5, 6, 7
HDR = struct.Struct("<HBBIIIQ")  # magic type flags body_len a b c  (24 bytes)
assert HDR.size == 24
BODY_LIMIT = {HELLO: 56 + 1024, GRANT: 32 * 4096, ERROR: 4096}

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
    for x in data:
        crc = t[(crc ^ x) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------- catalog
class Catalog:
    def __init__(self, path, check=True):
        raw = open(path, "rb").read()
        if raw[:8] != b"KSPDCAT\0":
            sys.exit("not a catalog")
        ver, hlen, blen, bcrc = struct.unpack_from("<IIQI", raw, 8)
        if ver not in (1, 2):
            sys.exit(f"catalog version {ver} not handled here")
        body = raw[hlen:hlen + blen]
        if check and crc32c(body) != bcrc:
            sys.exit("catalog body CRC mismatch")
        self.identity = bcrc
        f = struct.unpack_from("<" + "Q" * 18, raw, 32)
        kind, n, nfiles = f[0], f[1], f[2]
        samples_off, files_off, strings_off = f[5], f[6], f[8]
        src_off, src_len = f[10], f[11]
        strings = body[strings_off:]
        src = strings[src_off:src_off + src_len].decode("utf-8", "surrogateescape")
        kind_s, _, root = src.partition(":")
        if kind_s != "dir":
            # list:FILE -> the list's directory; tar:... not handled
            root = os.path.dirname(root) if kind_s == "list" else root
        files = []
        for i in range(nfiles):
            name_off, size, mtime, name_len, tag_len = struct.unpack_from("<QQqII", body, files_off + 32 * i)
            name = os.fsdecode(strings[name_off:name_off + name_len])
            files.append(os.path.join(root, name))
        self.n = n
        self.samples = []  # (path, offset, len, crc)
        for i in range(n):
            fi, label, ln, crc, off = struct.unpack_from("<IIIIQ", body, samples_off + 24 * i)
            self.samples.append((files[fi], off, ln, crc))
        self.kind = kind_s


# ---------------------------------------------------------------- times
def enc15(us):
    us = max(0, int(us))
    e = 0
    while (us >> e) >= 2048:
        e += 1
    if e > 15:
        return (15 << 11) | 2047
    return (e << 11) | (us >> e)


def times_b(ready_s, posted_s):
    return (1 << 31) | (enc15(posted_s * 1e6) << 16) | enc15(ready_s * 1e6)


# ---------------------------------------------------------------- helpers
def hdr(t, body_len, a=0, b=0, c=0):
    return HDR.pack(MAGIC, t, 0, body_len, a, b, c)


def recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return bytes(buf)


def refuse(sock, code, msg, gid=CONN):
    m = msg.encode()
    try:
        sock.sendall(hdr(ERROR, len(m), gid, code) + m)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.5)
        got = 0
        while got < 65536:
            d = sock.recv(65536)
            if not d:
                break
            got += len(d)
    except OSError:
        pass
    sock.close()
    log(f"refused: code {code}: {msg}")


def log(*a):
    print("[owner]", *a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- connection
class Conn:
    def __init__(self, sock, peer, args, cat, token):
        self.sock, self.peer, self.args, self.cat, self.token = sock, peer, args, cat, token
        self.q = queue.Queue()
        self.heartbeats = False
        self.lock = threading.Lock()
        self.dead = False
        self.outstanding = 0
        self.olock = threading.Lock()
        self.stats = dict(samples=0, bytes=0, grants=0, frames=0, heartbeats=0)

    def handshake(self):
        s = self.sock
        s.settimeout(self.args.handshake_timeout)
        deadline = time.monotonic() + self.args.handshake_timeout
        try:
            h = recv_exact(s, 24)
            magic, t, flags, blen, a, b, c = HDR.unpack(h)
            if magic != MAGIC or t != HELLO or flags != 0 or blen > BODY_LIMIT[HELLO]:
                return refuse(s, Violation, "expected a HELLO frame")
            if a != VERSION:
                return refuse(s, BadVersion, f"protocol version {a} is not spoken here (this node speaks {VERSION})")
            s.settimeout(max(0.001, deadline - time.monotonic()))
            body = recv_exact(s, blen)
        except (socket.timeout, EOFError, OSError) as e:
            return refuse(s, Violation, f"handshake not complete: {e}")
        if blen < 56:
            return refuse(s, Violation, "HELLO body shorter than 56 bytes")
        ident, rank, world, transport, nsamp, seed, ring_addr, ring_len, rkey, tlen = struct.unpack_from("<IIIIQQQQII", body)
        if tlen > 1024 or 56 + tlen != blen:
            return refuse(s, Violation, f"HELLO token length {tlen} does not match the body ({blen} bytes)")
        if not hmac.compare_digest(body[56:], self.token):
            return refuse(s, BadToken, "wrong job token")
        if world == 0:
            return refuse(s, Violation, "HELLO field world is 0")
        if rank >= world:
            return refuse(s, Violation, f"HELLO field rank is {rank}; it must be below world ({world})")
        if ring_len == 0:
            return refuse(s, Violation, "HELLO field ring_len is 0")
        if transport not in (0, 1):
            return refuse(s, Violation, f"HELLO field transport is {transport}")
        if ident != self.cat.identity or nsamp != self.cat.n:
            return refuse(s, WrongDataset, f"catalog {ident:08x}/{nsamp} samples; this node serves {self.cat.identity:08x}/{self.cat.n}")
        self.ring_len = ring_len
        # WELCOME: nodes=1, copies=1 | owner function scaled (0) << 16, max DATA, transport 0 (TCP)
        wb = struct.pack("<IIII", int(os.environ.get("OWNER_WELCOME_NODES", "1")), 1 | (0 << 16), self.args.chunk_bytes, 0)
        s.sendall(hdr(WELCOME, 16, VERSION, 0, self.args.max_grants) + wb)
        s.settimeout(None)
        log(f"welcomed {self.peer}: rank {rank}/{world} ring {ring_len} transport asked {transport}")
        return True

    def fatal(self, code, msg, gid=CONN):
        self.dead = True
        with self.lock:
            refuse(self.sock, code, msg, gid)

    def reader(self):
        s = self.sock
        try:
            while not self.dead:
                h = recv_exact(s, 24)
                magic, t, flags, blen, a, b, c = HDR.unpack(h)
                t_read = time.monotonic()
                if magic != MAGIC or flags != 0 or t not in (GRANT, ERROR) or blen > BODY_LIMIT[t]:
                    return self.fatal(Violation, f"bad frame header (magic {magic:#x}, type {t}, flags {flags}, body {blen})")
                body = recv_exact(s, blen)
                t_read = time.monotonic()  # "reading the GRANT frame": stamped once it is in whole
                if t == ERROR:
                    if a == CONN and b == 0 and blen == 0:
                        if c & 1 and not self.heartbeats:
                            self.heartbeats = True
                            self.q.put(("hb",))
                        continue
                    return self.fatal(Violation, f"ERROR from a consumer (grant {a:#x}, code {b})")
                n = a
                if n < 1 or n > 4096 or blen != 32 * n:
                    return self.fatal(Violation, f"GRANT with {n} entries and body {blen}")
                ents = []
                for i in range(n):
                    gid, ln, sid, off, rk, _ = struct.unpack_from("<IIQQII", body, 32 * i)
                    if gid == CONN:
                        return self.fatal(Violation, "GRANT id 0xFFFFFFFF is reserved")
                    if sid >= self.cat.n:
                        return self.fatal(Violation, f"GRANT sample {sid} is past the catalog ({self.cat.n})")
                    if ln != self.cat.samples[sid][2]:
                        return self.fatal(Violation, f"GRANT sample {sid} length {ln}, catalog says {self.cat.samples[sid][2]}")
                    if off + ln > self.ring_len:
                        return self.fatal(Violation, f"GRANT {gid} range past the ring")
                    if ln == 0:
                        continue
                    ents.append((gid, ln, sid, off))
                with self.olock:
                    self.outstanding += len(ents)
                    over = self.outstanding > self.args.max_grants
                if over:
                    return self.fatal(TooManyGrants, f"more than {self.args.max_grants} grants outstanding")
                self.stats["grants"] += len(ents)
                for e in ents:
                    self.q.put(("grant", t_read) + e)
        except (EOFError, OSError) as e:
            if not self.dead:
                log(f"{self.peer}: reader ends: {e}")
        finally:
            self.dead = True
            self.q.put(("end",))

    def send(self, data):
        with self.lock:
            self.sock.sendall(data)

    def writer(self):
        a = self.args
        last = time.monotonic()
        try:
            while True:
                try:
                    item = self.q.get(timeout=0.05)
                except queue.Empty:
                    item = None
                if self.dead:
                    return
                now = time.monotonic()
                if item is None or item[0] == "hb":
                    if self.heartbeats and (item is not None or now - last >= 0.25):
                        self.send(hdr(ERROR, 0, CONN, 0, 0))
                        self.stats["heartbeats"] += 1
                        last = time.monotonic()
                    continue
                if item[0] == "end":
                    return
                _, t0, gid, ln, sid, off = item
                path, foff, _, _ = self.cat.samples[sid]
                sent = 0
                with open(path, "rb") as f:
                    while sent < ln:
                        # the "disk": bytes are ready read_delay after the GRANT was read
                        wait = t0 + a.ready_delay - time.monotonic()
                        if wait > 0 and sent == 0:
                            time.sleep(wait)
                        n = min(a.chunk_bytes, ln - sent)
                        f.seek(foff + sent)
                        buf = f.read(n)
                        if len(buf) != n:
                            msg = f"grant {gid} sample {sid}: short read at {foff + sent} of {path}".encode()
                            self.send(hdr(ERROR, len(msg), gid, ReadFailed) + msg)
                            break
                        ready = time.monotonic() - t0
                        posted = time.monotonic() - t0
                        frame = hdr(DATA, n, gid, times_b(ready, posted), off + sent) + buf
                        if a.hold > 0 and sent == 0:
                            wait = t0 + a.ready_delay + a.hold - time.monotonic()
                            if wait > 0:
                                time.sleep(wait)
                        self.send(frame)
                        self.stats["frames"] += 1
                        sent += n
                    else:
                        self.stats["samples"] += 1
                        self.stats["bytes"] += ln
                with self.olock:
                    self.outstanding -= 1
                last = time.monotonic()
        except OSError as e:
            log(f"{self.peer}: writer ends: {e}")
        finally:
            self.dead = True
            try:
                self.sock.close()
            except OSError:
                pass
            log(f"{self.peer}: closed: {self.stats}")

    def run(self):
        if self.handshake() is not True:
            return
        r = threading.Thread(target=self.reader, daemon=True)
        r.start()
        self.writer()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--catalog", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--listen", default="127.0.0.1:7400")
    p.add_argument("--ready-delay-ms", type=float, default=20.0)
    p.add_argument("--hold-ms", type=float, default=0.0)
    p.add_argument("--chunk-bytes", type=int, default=256 * 1024)
    p.add_argument("--max-grants", type=int, default=8192)
    p.add_argument("--handshake-timeout", type=float, default=5.0)
    a = p.parse_args()
    a.ready_delay = a.ready_delay_ms / 1000
    a.hold = a.hold_ms / 1000
    cat = Catalog(a.catalog)
    tok = open(a.token_file, "rb").read(1027).rstrip()
    if not 1 <= len(tok) <= 1024:
        sys.exit("token must be 1 to 1024 bytes")
    host, _, port = a.listen.rpartition(":")
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, int(port)))
    ls.listen(socket.SOMAXCONN)
    bound = "%s:%d" % ls.getsockname()[:2]
    log(f"listening on {bound}: catalog {cat.identity:08x}, {cat.n} samples, ready delay {a.ready_delay_ms} ms, hold {a.hold_ms} ms")
    while True:
        s, peer = ls.accept()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=Conn(s, peer, a, cat, tok).run, daemon=True).start()


if __name__ == "__main__":
    main()
