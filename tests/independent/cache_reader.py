#!/usr/bin/env python3
"""Independent reader for a kspeed NVMe cache area, written from
docs/CACHE.md ("The cache area") alone by someone who did not read kspeed's
sources: tests/cache_area.rs runs it on an area kspeed wrote, so the area
is checked by a reader that is not kspeed's own, and the doc against what
it promises (meta lines, classes, slot layout, journal records and replay,
zero padding, no sample in two slots, every held slot byte-identical to a
source file of the same length and CRC32C).

  cache_reader.py AREA_DIR SOURCE_DIR     (exit 0: whole; 1: mismatches)
"""
import os, struct, sys
from collections import defaultdict

# ---- CRC32C (Castagnoli, reflected poly 0x82F63B78), table-driven, slicing-by-4 ----
POLY = 0x82F63B78
T0 = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ POLY if c & 1 else c >> 1
    T0.append(c)
T1 = [(T0[i] >> 8) ^ T0[T0[i] & 0xFF] for i in range(256)]
T2 = [(T1[i] >> 8) ^ T0[T1[i] & 0xFF] for i in range(256)]
T3 = [(T2[i] >> 8) ^ T0[T2[i] & 0xFF] for i in range(256)]

def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    n = len(data)
    n4 = n - (n % 4)
    t0, t1, t2, t3 = T0, T1, T2, T3
    mv = memoryview(data)
    if n4:
        for (w,) in struct.iter_unpack('<I', mv[:n4]):
            crc ^= w
            crc = t3[crc & 0xFF] ^ t2[(crc >> 8) & 0xFF] ^ t1[(crc >> 16) & 0xFF] ^ t0[crc >> 24]
    for b in mv[n4:]:
        crc = t0[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF

assert crc32c(b"123456789") == 0xE3069283

KIB4 = 4096
problems = []
notes = []
def bad(msg):
    problems.append(msg)
    print("MISMATCH:", msg)

def main():
    if len(sys.argv) != 3:
        print("usage: cache_reader.py AREA_DIR SRC_DIR"); sys.exit(2)
    area, src = sys.argv[1], sys.argv[2]

    # ---- 1. cache.meta ----
    raw = open(os.path.join(area, "cache.meta"), "rb").read().decode("ascii")
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    else:
        notes.append("cache.meta has no trailing newline")
    if len(lines) != 4:
        bad(f"cache.meta has {len(lines)} lines, expected 4")
    if lines[0] != "kspeed-cache 1":
        bad(f"first line {lines[0]!r} != 'kspeed-cache 1'")
    ds = lines[1].split(" ")
    if not (len(ds) == 2 and ds[0] == "dataset" and len(ds[1]) == 8 and all(c in "0123456789abcdef" for c in ds[1])):
        bad(f"dataset line malformed: {lines[1]!r}")
    cl = lines[2].split(" ")
    classes = []
    if len(cl) != 2 or cl[0] != "classes":
        bad(f"classes line malformed: {lines[2]!r}")
    else:
        for item in cl[1].split(","):
            b, c = item.split("x")
            classes.append((int(b), int(c)))
    sl = lines[3].split(" ")
    if len(sl) != 2 or sl[0] != "slots":
        bad(f"slots line malformed: {lines[3]!r}")
    nslots = int(sl[1])
    if nslots != sum(c for _, c in classes):
        bad(f"slots {nslots} != sum of class counts {sum(c for _, c in classes)}")
    # class sizes: multiples of 4 KiB, strictly increasing, first 4 KiB, each
    # max(prev+4K, roundup(prev*1.25, 4K)); last may be smaller (p99 cap)
    sizes = [b for b, _ in classes]
    if sizes[0] != KIB4:
        bad(f"first class {sizes[0]} != 4096")
    for i, b in enumerate(sizes):
        if b % KIB4:
            bad(f"class {b} not a multiple of 4 KiB")
        if i:
            prev = sizes[i - 1]
            step = max(prev + KIB4, ((prev * 5 + 3) // 4 + KIB4 - 1) // KIB4 * KIB4)
            if i < len(sizes) - 1 and b != step:
                bad(f"class {i} is {b}, expected {step} (quarter larger, 4K rounded)")
            if i == len(sizes) - 1 and not (prev < b <= step):
                bad(f"last class {b} not in ({prev}, {step}]")
    zero = [b for b, c in classes if c == 0]
    if zero:
        notes.append(f"{len(zero)} classes listed with 0 slots: {zero}")

    # ---- 2. slot geometry ----
    slot_off, slot_size, slot_class = [], [], []
    off = 0
    for ci, (b, c) in enumerate(classes):
        for _ in range(c):
            slot_off.append(off); slot_size.append(b); slot_class.append(ci)
            off += b
    total = off
    dsize = os.path.getsize(os.path.join(area, "cache.data"))
    if dsize != total:
        bad(f"cache.data is {dsize} bytes, classes say {total}")

    def smallest_class(length):
        for ci, b in enumerate(sizes):
            if length <= b:
                return ci
        return None

    # ---- 3. journal replay ----
    j = open(os.path.join(area, "cache.journal"), "rb").read()
    nrec = 0
    state = {}          # slot -> (kind, length, id, crc, record index)
    stop_reason = "end of file"
    counts = defaultdict(int)
    pos = 0
    while True:
        rec = j[pos:pos + 32]
        if len(rec) < 32:
            if rec:
                stop_reason = f"short tail of {len(rec)} bytes at {pos}"
            break
        magic, kind, slot, length, sid, scrc, rcrc = struct.unpack("<4sIIIQII", rec)
        if magic != b"KSCJ":
            stop_reason = f"bad magic at {pos}"; break
        if rcrc != crc32c(rec[:28]):
            stop_reason = f"bad record CRC at {pos}"; break
        if kind not in (1, 2):
            stop_reason = f"bad kind {kind} at {pos}"; break
        nrec += 1
        counts[kind] += 1
        pos += 32
        if kind == 2 and (length, sid, scrc) != (0, 0, 0):
            bad(f"record {nrec-1}: empty record with nonzero length/id/crc")
        if slot >= nslots:
            bad(f"record {nrec-1}: slot {slot} >= slots {nslots}")
            continue
        if kind == 1 and smallest_class(length) != slot_class[slot]:
            # doc: such a record is ignored; kspeed should never write it
            bad(f"record {nrec-1}: slot {slot} (class {sizes[slot_class[slot]]}) not of the class of length {length}")
            continue
        state[slot] = (kind, length, sid, scrc, nrec - 1)
    if pos != len(j):
        bad(f"journal replay stopped at byte {pos} of {len(j)} ({stop_reason})")

    # of two slots naming one sample, the later record wins
    by_id = defaultdict(list)
    for s, (k, l, sid, c, ri) in state.items():
        if k == 1:
            by_id[sid].append((ri, s))
    for sid, lst in by_id.items():
        if len(lst) > 1:
            bad(f"sample id {sid} in {len(lst)} slots: {sorted(s for _, s in lst)}")
            lst.sort()
            for _, s in lst[:-1]:
                state[s] = (2, 0, 0, 0, -1)
    full = sorted(s for s, v in state.items() if v[0] == 1)

    # ---- 4. data checks ----
    data = open(os.path.join(area, "cache.data"), "rb")
    slot_bytes = {}
    for s in full:
        _, length, sid, scrc, _ = state[s]
        if length > slot_size[s]:
            bad(f"slot {s}: length {length} > slot bytes {slot_size[s]}"); continue
        if length == 0:
            bad(f"slot {s}: full with length 0")
        data.seek(slot_off[s])
        pad = (-length) % KIB4
        buf = data.read(length + pad)
        body = buf[:length]
        if crc32c(body) != scrc:
            bad(f"slot {s} (id {sid}): CRC32C {crc32c(body):08x} != journal {scrc:08x}")
        if buf[length:].count(0) != pad:
            bad(f"slot {s}: nonzero bytes in padding to 4 KiB boundary")
        slot_bytes[s] = body

    # ---- 5. compare with source files ----
    want_len = {state[s][1] for s in full}
    index = defaultdict(list)
    nsrc = 0
    for root, _, files in os.walk(src):
        for fn in files:
            if not fn.lower().endswith(".jpg"):
                continue
            p = os.path.join(root, fn)
            nsrc += 1
            if os.path.getsize(p) not in want_len:
                continue
            b = open(p, "rb").read()
            index[(len(b), crc32c(b))].append(p)
    matched = 0
    for s in full:
        if s not in slot_bytes:
            continue
        _, length, sid, scrc, _ = state[s]
        cands = index.get((length, scrc), [])
        if not cands:
            bad(f"slot {s} (id {sid}): no source .jpg with length {length} and CRC {scrc:08x}"); continue
        if any(open(p, "rb").read() == slot_bytes[s] for p in cands):
            matched += 1
        else:
            bad(f"slot {s} (id {sid}): bytes differ from every source file with same length/CRC")

    print("---- summary ----")
    print(f"meta: dataset {ds[1] if len(ds) > 1 else '?'}, {len(classes)} classes, {nslots} slots, data {dsize} bytes (expected {total})")
    print(f"journal: {len(j)} bytes, {nrec} records replayed ({counts[1]} full, {counts[2]} empty), stop: {stop_reason}")
    print(f"full slots: {len(full)} of {nslots}; distinct sample ids: {len({state[s][2] for s in full})}")
    print(f"source .jpg files: {nsrc}; full slots matched byte-for-byte to a source file: {matched}")
    for n in notes:
        print("note:", n)
    print(f"mismatches: {len(problems)}")
    sys.exit(1 if problems else 0)

if __name__ == "__main__":
    main()
