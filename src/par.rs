//! A small scoped worker pool for the bulk passes (catalog checksums, preload
//! copy, verify): workers claim fixed-size chunks of an index range from an
//! atomic cursor, so chunk `k` always covers `k*chunk .. (k+1)*chunk`.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::Result;

/// Runs `f` over `0..n` in chunks of `chunk` on `threads` threads. The first
/// error stops further claims and is returned; chunks already running finish.
pub fn for_each_chunk<F>(n: u64, chunk: u64, threads: usize, f: F) -> Result<()>
where
    F: Fn(Range<u64>) -> Result<()> + Sync,
{
    let chunk = chunk.max(1);
    let cursor = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_err = Mutex::new(None);
    let chunks = n.div_ceil(chunk);
    let threads = threads.clamp(1, chunks.max(1) as usize);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) {
                    return;
                }
                let k = cursor.fetch_add(1, Ordering::Relaxed);
                if k >= chunks {
                    return;
                }
                let start = k * chunk;
                if let Err(e) = f(start..(start + chunk).min(n)) {
                    failed.store(true, Ordering::Relaxed);
                    first_err.lock().expect("not poisoned").get_or_insert(e);
                    return;
                }
            });
        }
    });
    match first_err.into_inner().expect("not poisoned") {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Default worker count for the bulk passes: enough outstanding reads to keep
/// an SSD busy even on a 2-core machine, since the work is I/O bound.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(4, 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn covers_every_index_once() {
        let seen: Vec<AtomicU64> = (0..1000).map(|_| AtomicU64::new(0)).collect();
        for_each_chunk(1000, 7, 4, |r| {
            for i in r {
                seen[i as usize].fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
        .unwrap();
        assert!(seen.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn first_error_is_returned() {
        let r = for_each_chunk(100, 1, 3, |r| {
            if r.start == 42 {
                Err(Error::InvalidConfig("boom".into()))
            } else {
                Ok(())
            }
        });
        assert!(matches!(r, Err(Error::InvalidConfig(m)) if m == "boom"));
    }
}
