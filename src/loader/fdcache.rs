//! Open source files kept open across samples (source mode): a bounded
//! cache keyed by the catalog's file index, so a directory of small files
//! read in several epochs, or a tar shard of thousands of members, costs one
//! `open` per file and run, not an `open` and a `close` per sample (both
//! block the poller: the stall detector counts them).
//!
//! Bounded by [`capacity`] (from `RLIMIT_NOFILE`); a full cache evicts the
//! least recently used entry nobody reads from (the clock algorithm, no
//! allocation after construction). An entry with reads in flight is never
//! closed: io_uring resolves a plain descriptor when it submits, and the
//! number could otherwise be reused for another file meanwhile. When every
//! entry is in use the file is opened for that one sample
//! ([`Lease::Owned`]) and closed when its reads are done.
//!
//! A cache lives as long as its poller or network thread, that is as long
//! as the loader (epochs after `set_epoch` included): a file replaced or
//! removed meanwhile is read as it was when first opened, as a process
//! holding it open would; the catalog's CRC32C check (`verify_crc32c`)
//! still catches changed bytes. A new loader opens it again.
//!
//! Descriptors are owned (`File`s): dropping the cache (the poller's exit, or a
//! panic unwinding it) closes them.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};

/// All of one loader's caches together hold at most this many descriptors.
/// The cache lives in the trainer's process: thousands of extra descriptors
/// pin inodes, are inherited by forked workers and push the process's other
/// descriptors past `FD_SETSIZE` (1,024, where `select(2)` stops working).
/// A tar shard or a small directory fits; for a directory of many more
/// files read in shuffled order a larger cache would hit rarely anyway.
const TOTAL_MAX: u64 = 1024;

/// Descriptors one cache may hold: a quarter of the soft `RLIMIT_NOFILE`,
/// at most [`TOTAL_MAX`], shared by `users` caches (pollers and the network
/// thread), and at least 16 each.
pub(crate) fn capacity(users: usize) -> usize {
    let limit = match crate::sys::open_files_limit() {
        0 => 1024,
        n => n,
    };
    ((limit / 4).min(TOTAL_MAX) as usize / users.max(1)).max(16)
}

/// A descriptor lent for one sample's reads; give it back with
/// [`FdCache::release`].
#[derive(Debug)]
pub(crate) enum Lease {
    /// Entry `slot` of the cache.
    Cached(u32),
    /// Opened for this sample alone (the cache was full of busy entries).
    Owned(File),
}

#[derive(Debug)]
struct Entry {
    file: u32,
    fd: File,
    /// Samples whose reads use it now.
    users: u32,
    /// Used since the clock hand last passed.
    referenced: bool,
}

/// See the module comment.
#[derive(Debug)]
pub(crate) struct FdCache {
    entries: Vec<Option<Entry>>,
    /// File index -> entry; at most `entries.len()` keys (allocated once).
    by_file: HashMap<u32, u32>,
    hand: usize,
    /// Files opened (hits are `lookups - opens`), for tests.
    opens: u64,
}

impl FdCache {
    pub(crate) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        FdCache {
            entries: (0..capacity).map(|_| None).collect(),
            by_file: HashMap::with_capacity(capacity),
            hand: 0,
            opens: 0,
        }
    }

    /// The descriptor of `file`, opened with `open` unless cached.
    pub(crate) fn acquire(
        &mut self,
        file: u32,
        open: impl FnOnce() -> std::io::Result<File>,
    ) -> std::io::Result<Lease> {
        if let Some(&slot) = self.by_file.get(&file) {
            let e = self.entries[slot as usize].as_mut().expect("mapped entry");
            e.users += 1;
            e.referenced = true;
            return Ok(Lease::Cached(slot));
        }
        let fd = open()?;
        self.opens += 1;
        let Some(slot) = self.victim() else {
            return Ok(Lease::Owned(fd));
        };
        if let Some(old) = self.entries[slot].take() {
            self.by_file.remove(&old.file);
            // `old.fd` closes here.
        }
        self.entries[slot] = Some(Entry {
            file,
            fd,
            users: 1,
            referenced: true,
        });
        self.by_file.insert(file, slot as u32);
        Ok(Lease::Cached(slot as u32))
    }

    /// A free or evictable entry (the clock algorithm), or None when every
    /// entry has reads in flight.
    fn victim(&mut self) -> Option<usize> {
        let n = self.entries.len();
        // Two sweeps: the first clears reference bits.
        for _ in 0..2 * n {
            let i = self.hand;
            self.hand = (self.hand + 1) % n;
            match &mut self.entries[i] {
                None => return Some(i),
                Some(e) if e.users > 0 => {}
                Some(e) if e.referenced => e.referenced = false,
                Some(_) => return Some(i),
            }
        }
        None
    }

    /// The file behind `lease` (open until it is released).
    pub(crate) fn file<'a>(&'a self, lease: &'a Lease) -> &'a File {
        match lease {
            Lease::Cached(slot) => {
                &self.entries[*slot as usize]
                    .as_ref()
                    .expect("leased entry")
                    .fd
            }
            Lease::Owned(f) => f,
        }
    }

    /// The raw descriptor behind `lease` (valid until it is released).
    pub(crate) fn fd(&self, lease: &Lease) -> RawFd {
        self.file(lease).as_raw_fd()
    }

    /// The sample's reads are done (or were never issued).
    pub(crate) fn release(&mut self, lease: Lease) {
        match lease {
            Lease::Cached(slot) => {
                let e = self.entries[slot as usize].as_mut().expect("leased entry");
                // More releases than leases is a bug; wrapping would mark the
                // entry busy forever (never evicted) instead of saying so.
                e.users = e
                    .users
                    .checked_sub(1)
                    .expect("fd cache: entry released more often than leased");
            }
            Lease::Owned(fd) => drop(fd),
        }
    }

    #[cfg(test)]
    fn opens(&self) -> u64 {
        self.opens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(n: usize) -> (tempfile::TempDir, Vec<std::path::PathBuf>) {
        let dir = tempfile::tempdir().unwrap();
        let paths = (0..n)
            .map(|i| {
                let p = dir.path().join(format!("f{i}"));
                std::fs::write(&p, [i as u8]).unwrap();
                p
            })
            .collect();
        (dir, paths)
    }

    #[test]
    fn a_file_is_opened_once_while_it_stays_cached() {
        let (_d, p) = files(3);
        let mut c = FdCache::new(4);
        for _ in 0..10 {
            for (i, path) in p.iter().enumerate() {
                let l = c.acquire(i as u32, || File::open(path)).unwrap();
                assert!(c.fd(&l) >= 0);
                c.release(l);
            }
        }
        assert_eq!(c.opens(), 3);
    }

    #[test]
    fn a_full_cache_evicts_an_idle_entry_never_a_busy_one() {
        let (_d, p) = files(3);
        let mut c = FdCache::new(2);
        let a = c.acquire(0, || File::open(&p[0])).unwrap();
        let a_fd = c.fd(&a);
        let b = c.acquire(1, || File::open(&p[1])).unwrap();
        c.release(b);
        // File 0 is busy: file 2 takes file 1's entry.
        let x = c.acquire(2, || File::open(&p[2])).unwrap();
        assert!(matches!(x, Lease::Cached(_)));
        assert_eq!(c.fd(&a), a_fd);
        // Both busy now: file 1 is opened for its sample alone.
        let y = c.acquire(1, || File::open(&p[1])).unwrap();
        assert!(matches!(y, Lease::Owned(_)));
        c.release(y);
        c.release(x);
        c.release(a);
        assert_eq!(c.opens(), 4);
        assert!(c.by_file.len() <= 2);
    }

    #[test]
    fn an_open_error_is_returned_and_nothing_cached() {
        let mut c = FdCache::new(2);
        let e = c
            .acquire(0, || File::open("/nonexistent/kspeed-fdcache"))
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        assert!(c.by_file.is_empty());
    }
}
