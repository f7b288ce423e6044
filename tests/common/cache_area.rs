//! Reading a cache area from outside, as docs/CACHE.md describes its
//! files: what tests check a cache area against.

#![allow(dead_code)] // not every test binary that includes this uses all of it

use std::path::Path;

use kspeed::dataset::Catalog;

/// The journal as docs/CACHE.md describes it: 32-byte little-endian
/// records (magic "KSCJ", kind 1 full / 2 empty, slot, length, id, CRC32C
/// of the sample, CRC32C of the first 28 bytes); the last whole record of
/// a slot says what it holds. Returns slot -> (id, len, crc) and the count
/// of whole records.
pub fn parse_journal(dir: &Path) -> (std::collections::BTreeMap<u32, (u64, u32, u32)>, usize) {
    let b = std::fs::read(dir.join("cache.journal")).unwrap_or_default();
    let mut held = std::collections::BTreeMap::new();
    let mut whole = 0;
    for r in b.chunks(32) {
        let u = |i: usize| u32::from_le_bytes(r[i..i + 4].try_into().unwrap());
        if r.len() < 32 || &r[0..4] != b"KSCJ" || crc32c::crc32c(&r[..28]) != u(28) {
            break;
        }
        whole += 1;
        let (kind, slot, len) = (u(4), u(8), u(12));
        let id = u64::from_le_bytes(r[16..24].try_into().unwrap());
        match kind {
            1 => held.insert(slot, (id, len, u(24))),
            2 => held.remove(&slot),
            k => panic!("record kind {k}"),
        };
    }
    (held, whole)
}

/// `cache.meta`'s slot classes, as docs/CACHE.md describes them: the
/// `classes` line, `BYTESxCOUNT` comma-separated, smallest first; slots
/// are numbered across the classes in that order and laid out one class
/// after another. Checks the `slots` line is their sum.
pub fn meta(dir: &Path) -> Classes {
    let m = std::fs::read_to_string(dir.join("cache.meta")).unwrap();
    let field = |k: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap()
            .trim()
            .to_string()
    };
    let classes: Vec<(u64, u64)> = field("classes ")
        .split(',')
        .map(|c| {
            let (b, n) = c.split_once('x').unwrap();
            (b.parse().unwrap(), n.parse().unwrap())
        })
        .collect();
    let cl = Classes(classes);
    assert_eq!(field("slots ").parse::<u64>().unwrap(), cl.slots());
    cl
}

/// (slot bytes, slot count) per class, smallest first.
#[derive(Debug, Clone)]
pub struct Classes(pub Vec<(u64, u64)>);

impl Classes {
    pub fn slots(&self) -> u64 {
        self.0.iter().map(|c| c.1).sum()
    }

    pub fn area_bytes(&self) -> u64 {
        self.0.iter().map(|c| c.0 * c.1).sum()
    }

    /// Where slot `slot` starts, and its bytes.
    pub fn slot(&self, slot: u64) -> (u64, u64) {
        let (mut first, mut base) = (0, 0);
        for &(bytes, count) in &self.0 {
            if slot < first + count {
                return (base + (slot - first) * bytes, bytes);
            }
            first += count;
            base += bytes * count;
        }
        panic!("slot {slot} past the area's {first}");
    }

    /// The class a sample of `len` bytes takes (the smallest that holds
    /// it), if any.
    pub fn class_for(&self, len: u64) -> Option<usize> {
        self.0.iter().position(|c| c.0 >= len.max(1))
    }
}

/// Every slot the journal calls full holds its sample's bytes (the
/// catalog's length and CRC), within its slot. Returns how many it holds.
pub fn check_held(dir: &Path, cat: &Catalog) -> usize {
    let cl = meta(dir);
    let data = std::fs::read(dir.join("cache.data")).unwrap();
    assert_eq!(data.len() as u64, cl.area_bytes(), "the area's size");
    let (held, _) = parse_journal(dir);
    let mut ids = std::collections::HashSet::new();
    for (&slot, &(id, len, crc)) in &held {
        assert!((slot as u64) < cl.slots(), "slot {slot} of {}", cl.slots());
        let c = cat.sample(id);
        assert_eq!(
            (len, crc),
            (c.len, c.crc32c),
            "slot {slot} names sample {id}"
        );
        let (at, bytes) = cl.slot(slot as u64);
        assert!(
            len as u64 <= bytes,
            "sample {id} of {len} bytes in a slot of {bytes}"
        );
        let at = at as usize;
        assert_eq!(
            crc32c::crc32c(&data[at..at + len as usize]),
            crc,
            "slot {slot}'s bytes are sample {id}'s"
        );
        assert!(ids.insert(id), "sample {id} in two slots");
    }
    held.len()
}
