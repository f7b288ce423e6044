//! An [`IoBackend`] over an object store: a poller reading a source in a
//! bucket (`Loader` with `source = "s3://…"`) runs its ordinary loop on it,
//! so the reads it issues in the rank's known order, ahead of need, up to
//! its queue depth, are ranged GETs in flight (clairvoyant prefetch), and
//! their bytes land in the ring where io_uring would have put them.
//!
//! A read names its object as [`Target::Object`] (the catalog's file
//! index; `objects` gives its key and ETag). Worker threads do the GETs; a
//! push hands the read to them over a bounded channel (never queued on the
//! heap: the channel and the staging array are sized at start to the
//! queue depth, and a push beyond the depth is refused as a full submission
//! queue), and they answer on another. A read completes with its length,
//! or `-EIO` (the store's error is logged with the object's URL; the poller
//! names the sample and the URL), or `-ESTALE` when the object was replaced
//! since the catalog. Operations other than reads complete with
//! `-ENOTSOCK`: a poller issues none.
//!
//! **Merged reads.** When the order visits neighbouring samples of one
//! object together (tar shards read with a block shuffle or no shuffle),
//! the backend is built with `merge`: pushed reads wait in a staging array,
//! and each GET that goes takes the earliest-needed staged read with every
//! staged read of the same object within [`MAX_GAP_BYTES`] of it (up to
//! [`MAX_PER_GET`] reads, [`MAX_GET_BYTES`]), streaming one ranged body
//! into their slots and skipping the gaps (tar headers, members that are
//! not the sample). A GET goes at once while fewer than half the GETs
//! allowed (`depth / MERGE_GETS`, at most [`MAX_MERGE_GETS`]) are out, and
//! otherwise only when full. Reads merge when the queue depth covers a
//! block: make `queue_depth` at least `shuffle_block`.
//! A rank of a W-rank world takes every W-th sample of a block, so its
//! reads merge where W - 1 samples fit in the hole bound; the node agent,
//! reading for all of a node's ranks, sees the denser union. A
//! store charges per request and limits request rates per prefix (S3: 5,500
//! GETs/s), and a local one spends its CPU per request: fewer, larger GETs
//! are what reading a bucket at speed needs. Without `merge` every read is
//! its own GET at once (a whole object per sample cannot merge).

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use super::{Completion, IoBackend, ReadOp, Target, Timespec};
use crate::dataset::store::Store;
use crate::error::{Error, Result};
use crate::sys::EventFd;

/// How long one GET may take, the client's retries included: a store that
/// stays down fails the read (named) rather than hold the loader, whose
/// stop waits for every read in flight.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Reads one merged GET serves at most (the message carrying them is a
/// fixed array: no allocation per GET).
pub const MAX_PER_GET: usize = 32;
/// The largest hole between two merged reads: tar headers and small
/// members between samples, not whole other samples.
pub const MAX_GAP_BYTES: u64 = 64 << 10;
/// The largest range one merged GET asks for.
pub const MAX_GET_BYTES: u64 = 16 << 20;
/// With `merge`, GETs out at once per backend: `depth / MERGE_GETS`
/// (at least 2), so that reads pushed while they run wait and merge.
pub const MERGE_GETS: usize = 4;

/// With `merge`, the most GETs out at once (and worker threads).
pub const MAX_MERGE_GETS: usize = 64;

/// The key and ETag of the catalog's file `i`.
pub type ObjectOf = dyn Fn(u32) -> (String, String) + Send + Sync;

/// One read (the buffer as an address: the caller owns it until the
/// completion is drained, [`IoBackend::push`]'s contract).
#[derive(Clone, Copy, Default)]
struct Job {
    user_data: u64,
    object: u32,
    offset: u64,
    buf: usize,
    len: u32,
    /// Push order: the earliest-needed staged read goes first.
    seq: u64,
}

impl Job {
    fn end(&self) -> u64 {
        self.offset + self.len as u64
    }
}

/// One GET: `count` reads of one object, sorted by offset, not
/// overlapping.
#[derive(Clone, Copy)]
struct Get {
    jobs: [Job; MAX_PER_GET],
    count: usize,
}

/// Reads from one bucket through worker threads.
pub struct StoreRing {
    jobs: Option<Sender<Get>>,
    /// Bumped by a worker after each GET's completions: a loop that also
    /// waits on an io_uring (`ring/split.rs`) sleeps on a read of it there.
    wake: Arc<EventFd>,
    done: Receiver<Completion>,
    /// One message per GET finished (after its reads' completions).
    gets_done: Receiver<()>,
    /// Completions taken by a wait, not drained yet (at most `depth`).
    ready: Vec<Completion>,
    /// Pushed reads not handed to a worker yet (`merge` only; at most
    /// `depth`, allocated once).
    staged: Vec<Job>,
    /// Pushed and not drained: staged, at a worker, or completed.
    in_flight: usize,
    depth: usize,
    /// GETs at the workers, and the most allowed at once.
    gets_out: usize,
    max_gets: usize,
    merge: bool,
    seq: u64,
    workers: Vec<JoinHandle<()>>,
}

impl StoreRing {
    /// A backend with `depth` reads in flight at most, reading `bucket`'s
    /// objects named by `objects`; with `merge`, neighbouring reads of one
    /// object share GETs (module doc).
    pub fn new(bucket: &str, objects: Arc<ObjectOf>, depth: usize, merge: bool) -> Result<Self> {
        let depth = depth.max(1);
        let max_gets = if merge {
            (depth / MERGE_GETS).clamp(2, MAX_MERGE_GETS).min(depth)
        } else {
            depth
        };
        let store = Store::of(bucket)?;
        let (jobs, rx) = bounded::<Get>(max_gets);
        let (tx, done) = bounded::<Completion>(depth);
        let (got, gets_done) = bounded::<()>(max_gets);
        let wake =
            Arc::new(EventFd::new().map_err(|e| Error::io("eventfd", "object-store reader", e))?);
        let mut workers = Vec::with_capacity(max_gets);
        for i in 0..max_gets {
            let (rx, tx, got) = (rx.clone(), tx.clone(), got.clone());
            let (store, objects, wake) = (store.clone(), objects.clone(), wake.clone());
            let w = std::thread::Builder::new()
                .name(format!("kspeed-get-{i}"))
                .spawn(move || {
                    while let Ok(g) = rx.recv() {
                        let result = get(&store, &*objects, &g);
                        // The GET's end first, then its reads': a poller
                        // that holds staged reads while GETs are out
                        // (dispatch) then always has a completion coming
                        // for the wait it blocks in. The other way round it
                        // could drain every completion, still count this
                        // GET as out, and wait forever. Capacities
                        // `max_gets` and `depth`, and at most that many out:
                        // never blocks.
                        let _ = got.send(());
                        for j in &g.jobs[..g.count] {
                            let _ = tx.send(Completion {
                                user_data: j.user_data,
                                result: if result == 0 { j.len as i32 } else { result },
                            });
                        }
                        // After the completions: a waiter woken by it
                        // finds them.
                        wake.notify();
                    }
                })
                .map_err(|e| Error::ThreadSpawn {
                    thread: "object-store reader",
                    source: Arc::new(e),
                })?;
            workers.push(w);
        }
        Ok(StoreRing {
            jobs: Some(jobs),
            wake,
            done,
            gets_done,
            ready: Vec::with_capacity(depth),
            staged: Vec::with_capacity(if merge { depth } else { 0 }),
            in_flight: 0,
            depth,
            gets_out: 0,
            max_gets,
            merge,
            seq: 0,
            workers,
        })
    }

    /// The eventfd a worker bumps after each GET's completions (once per
    /// GET; a read of it may also find a wake-up for completions already
    /// drained).
    pub fn wake_fd(&self) -> RawFd {
        self.wake.raw()
    }

    /// Whether a completion is ready to drain now.
    pub fn has_completions(&self) -> bool {
        !self.ready.is_empty() || !self.done.is_empty()
    }

    /// An operation this backend has no use for: it completes with
    /// `-ENOTSOCK` (a caller's bug, named), as on the test backends.
    fn refuse(&mut self, user_data: u64) -> bool {
        if self.in_flight == self.depth {
            return false;
        }
        self.ready.push(Completion {
            user_data,
            result: -libc::ENOTSOCK,
        });
        self.in_flight += 1;
        true
    }

    /// Counts the GETs the workers finished.
    fn reap_gets(&mut self) {
        while self.gets_done.try_recv().is_ok() {
            self.gets_out = self
                .gets_out
                .checked_sub(1)
                .expect("more GETs finished than sent");
        }
    }

    /// Hands staged reads to the workers while fewer than `max_gets` GETs
    /// are out: each GET takes the earliest-needed staged read and its
    /// mergeable neighbours ([`gather`]). While half of `max_gets` are
    /// out, a GET leaves only full (its neighbours may still be on their
    /// way: the poller pushes a few reads per submission); below that,
    /// whatever is staged goes, so the store stays busy while reads wait
    /// even where they never merge.
    fn dispatch(&mut self) {
        self.reap_gets();
        while !self.staged.is_empty() && self.gets_out < self.max_gets {
            let g = gather(&mut self.staged);
            let jobs = &g.jobs[..g.count];
            let full = g.count == MAX_PER_GET
                || jobs[g.count - 1].end() - jobs[0].offset >= MAX_GET_BYTES / 2;
            if !full && self.gets_out >= self.max_gets.div_ceil(2) {
                // Back where they were (the array had room for them).
                self.staged.extend_from_slice(jobs);
                break;
            }
            self.send(g);
        }
    }

    fn send(&mut self, g: Get) {
        // Capacity `max_gets` and fewer out: never full.
        self.jobs
            .as_ref()
            .expect("running")
            .try_send(g)
            .expect("a GET slot is free");
        self.gets_out += 1;
    }

    /// Waits up to `timeout` for one completion into `ready`.
    fn wait_one(&mut self, timeout: Option<Duration>) {
        self.dispatch();
        if self.in_flight == 0 || !self.ready.is_empty() {
            return;
        }
        let c = match timeout {
            Some(t) => self.done.recv_timeout(t).ok(),
            None => self.done.recv().ok(),
        };
        if let Some(c) = c {
            self.ready.push(c);
        }
    }
}

/// Takes from `staged` the earliest-needed read and every read of the same
/// object that extends its run without a hole over [`MAX_GAP_BYTES`] or a
/// range over [`MAX_GET_BYTES`] (at most [`MAX_PER_GET`]), sorted by
/// offset. `staged` is at most the queue depth: the scans are short and
/// allocate nothing.
fn gather(staged: &mut Vec<Job>) -> Get {
    let first = (0..staged.len())
        .min_by_key(|&i| staged[i].seq)
        .expect("something staged");
    let head = staged.swap_remove(first);
    let mut g = Get {
        jobs: [Job::default(); MAX_PER_GET],
        count: 1,
    };
    g.jobs[0] = head;
    let (mut lo, mut hi) = (head.offset, head.end());
    // Grow the run both ways, nearest neighbour first, until nothing fits.
    while g.count < MAX_PER_GET {
        let next = (0..staged.len())
            .filter(|&i| {
                let j = &staged[i];
                j.object == head.object
                    && (j.offset >= hi && j.offset - hi <= MAX_GAP_BYTES
                        || j.end() <= lo && lo - j.end() <= MAX_GAP_BYTES)
                    && j.end().max(hi) - j.offset.min(lo) <= MAX_GET_BYTES
            })
            .min_by_key(|&i| {
                let j = &staged[i];
                if j.offset >= hi {
                    j.offset - hi
                } else {
                    lo - j.end()
                }
            });
        let Some(i) = next else { break };
        let j = staged.swap_remove(i);
        (lo, hi) = (lo.min(j.offset), hi.max(j.end()));
        g.jobs[g.count] = j;
        g.count += 1;
    }
    g.jobs[..g.count].sort_unstable_by_key(|j| j.offset);
    g
}

/// One GET for `g`'s reads: 0, or a negated errno for all of them.
fn get(store: &Store, objects: &ObjectOf, g: &Get) -> i32 {
    let jobs = &g.jobs[..g.count];
    let (key, etag) = objects(jobs[0].object);
    let range = jobs[0].offset..jobs[g.count - 1].end();
    // The body streams through once: each piece is cut at the reads'
    // bounds, copied into the read it belongs to, the holes dropped.
    let (mut at, mut next) = (range.start, 0usize);
    let sink = |mut piece: &[u8]| {
        while !piece.is_empty() && next < jobs.len() {
            let j = &jobs[next];
            if at < j.offset {
                let skip = (j.offset - at).min(piece.len() as u64) as usize;
                (at, piece) = (at + skip as u64, &piece[skip..]);
                continue;
            }
            let take = (j.end() - at).min(piece.len() as u64) as usize;
            // SAFETY: push's contract: buf..buf+len is the caller's,
            // untouched by anyone else, until this read's completion is
            // drained; at - offset + take <= len by the bound above.
            // Through the kernel: in the node agent the buffer is a rank's
            // ring, whose hugetlb page the rank may take away (the read then
            // fails, EFAULT, instead of the agent dying of SIGBUS).
            let copied = unsafe {
                crate::sys::copy_faultable(
                    (j.buf as *mut u8).add((at - j.offset) as usize),
                    piece.as_ptr(),
                    take,
                )
            };
            if !copied {
                return Err(crate::Error::io(
                    "copy a GET's body into",
                    "<the ring>",
                    std::io::Error::from_raw_os_error(libc::EFAULT),
                ));
            }
            (at, piece) = (at + take as u64, &piece[take..]);
            if at == j.end() {
                next += 1;
            }
        }
        Ok(())
    };
    match store.read_within(&key, Some(&etag), range, READ_TIMEOUT, sink) {
        Ok(_) => 0,
        Err(e) => {
            log::warn!("{e}");
            match e {
                Error::SourceChanged { .. } => -libc::ESTALE,
                Error::StoreNotFound { .. } => -libc::ENOENT,
                Error::StoreAccessDenied { .. } => -libc::EACCES,
                _ => -libc::EIO,
            }
        }
    }
}

impl Drop for StoreRing {
    fn drop(&mut self) {
        // Every read completes before its memory goes (the poller cancels
        // and reaps before dropping us); then the workers end.
        self.cancel_all();
        self.jobs = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl IoBackend for StoreRing {
    /// # Safety
    /// As for [`IoBackend::push`].
    unsafe fn push(&mut self, op: &ReadOp) -> bool {
        if self.in_flight == self.depth {
            return false;
        }
        let Target::Object(object) = op.target else {
            // Not an object: complete it as an error the caller names.
            self.ready.push(Completion {
                user_data: op.user_data,
                result: -libc::EBADF,
            });
            self.in_flight += 1;
            return true;
        };
        let job = Job {
            user_data: op.user_data,
            object,
            offset: op.offset,
            buf: op.buf as usize,
            len: op.len,
            seq: self.seq,
        };
        self.seq += 1;
        self.in_flight += 1;
        if self.merge {
            // Capacity depth, and at most depth reads in flight.
            self.staged.push(job);
        } else {
            let mut g = Get {
                jobs: [Job::default(); MAX_PER_GET],
                count: 1,
            };
            g.jobs[0] = job;
            // Without merge, max_gets == depth > reads at the workers.
            self.send(g);
        }
        true
    }

    fn submit(&mut self, wait: bool) -> io::Result<()> {
        if wait {
            self.wait_one(None);
        } else {
            self.dispatch();
        }
        Ok(())
    }

    fn drain(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let c = match self.ready.pop() {
                Some(c) => c,
                None => match self.done.try_recv() {
                    Ok(c) => c,
                    Err(_) => break,
                },
            };
            out[n] = c;
            n += 1;
        }
        self.in_flight = self
            .in_flight
            .checked_sub(n)
            .expect("more completions than reads in flight");
        self.reap_gets();
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn cancel_all(&mut self) {
        // Staged reads never started: dropped. A GET cannot be called
        // back: wait for each (its own timeouts bound it), dropping the
        // completions.
        let outstanding = self.in_flight - self.ready.len() - self.staged.len();
        self.ready.clear();
        self.staged.clear();
        for _ in 0..outstanding {
            if self.done.recv().is_err() {
                break;
            }
        }
        while self.gets_out > 0 && self.gets_done.recv().is_ok() {
            self.gets_out -= 1;
        }
        self.in_flight = 0;
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_send(&mut self, ud: u64, _: RawFd, _: *const u8, _: u32, _: bool) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_sendmsg(&mut self, ud: u64, _: RawFd, _: *const libc::msghdr) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_recv(&mut self, ud: u64, _: RawFd, _: *mut u8, _: u32) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_recvmsg(&mut self, ud: u64, _: RawFd, _: *mut libc::msghdr) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_eventfd_read(&mut self, ud: u64, _: RawFd, _: *mut u64) -> bool {
        self.refuse(ud)
    }

    fn push_poll_in(&mut self, ud: u64, _: RawFd) -> bool {
        self.refuse(ud)
    }

    /// # Safety
    /// Nothing is touched.
    unsafe fn push_timeout(&mut self, ud: u64, _: *const Timespec) -> bool {
        self.refuse(ud)
    }

    fn push_cancel(&mut self, ud: u64, _: u64) -> bool {
        self.refuse(ud)
    }

    fn submit_pending(&mut self) -> io::Result<()> {
        self.dispatch();
        Ok(())
    }

    fn submit_wait_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        self.wait_one(Some(timeout));
        Ok(())
    }

    fn lost_completions(&mut self) -> u32 {
        0
    }

    /// # Safety
    /// Nothing is registered: workers copy into the caller's memory.
    unsafe fn register_buffers(&mut self, _: &[(*mut u8, usize)]) -> Result<()> {
        Ok(())
    }

    fn now(&self) -> Instant {
        Instant::now()
    }

    fn shutdown(&mut self, _: RawFd) {}

    fn send_now(&mut self, _: RawFd, _: &[u8]) -> io::Result<usize> {
        Err(io::Error::from_raw_os_error(libc::ENOTSOCK))
    }

    fn set_user_timeout(&mut self, _: RawFd, _: Duration) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::ENOTSOCK))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(seq: u64, object: u32, offset: u64, len: u32) -> Job {
        Job {
            user_data: seq,
            object,
            offset,
            buf: 0,
            len,
            seq,
        }
    }

    fn offsets(g: &Get) -> Vec<u64> {
        g.jobs[..g.count].iter().map(|j| j.offset).collect()
    }

    #[test]
    fn gather_merges_neighbours_of_the_earliest_read() {
        // Object 1: reads at 0, 1536, 3072 (1 KiB each, 512-byte holes: tar
        // headers), one 1 MiB further on; object 2 at 1024. The earliest
        // pushed is the one at 1536.
        let mut staged = vec![
            job(3, 1, 0, 1024),
            job(1, 1, 1536, 1024),
            job(4, 2, 1024, 1024),
            job(2, 1, 3072, 1024),
            job(5, 1, 3072 + (1 << 20), 1024),
        ];
        let g = gather(&mut staged);
        assert_eq!(offsets(&g), [0, 1536, 3072]);
        assert!(g.jobs[..g.count].iter().all(|j| j.object == 1));
        // What is left goes earliest first, alone.
        assert_eq!(offsets(&gather(&mut staged)), [1024]);
        assert_eq!(offsets(&gather(&mut staged)), [3072 + (1 << 20)]);
        assert!(staged.is_empty());
    }

    #[test]
    fn gather_stops_at_its_bounds() {
        // 40 adjacent reads: the first GET takes MAX_PER_GET of them.
        let mut staged: Vec<Job> = (0..40).map(|i| job(i, 0, i * 100, 100)).collect();
        let g = gather(&mut staged);
        assert_eq!(g.count, MAX_PER_GET);
        assert_eq!(staged.len(), 40 - MAX_PER_GET);
        // Reads that would stretch a GET past MAX_GET_BYTES stay apart.
        let big = (MAX_GET_BYTES / 2) as u32;
        let mut staged = vec![
            job(0, 0, 0, big),
            job(1, 0, big as u64, big),
            job(2, 0, 2 * big as u64, big),
        ];
        assert_eq!(gather(&mut staged).count, 2);
        assert_eq!(gather(&mut staged).count, 1);
        // A hole over MAX_GAP_BYTES is not read through; one of it is.
        let mut staged = vec![job(0, 0, 0, 10), job(1, 0, 10 + MAX_GAP_BYTES + 1, 10)];
        assert_eq!(gather(&mut staged).count, 1);
        let mut staged = vec![job(0, 0, 0, 10), job(1, 0, 10 + MAX_GAP_BYTES, 10)];
        assert_eq!(gather(&mut staged).count, 2);
        // The same sample twice (padding) is two GETs, never an overlap.
        let mut staged = vec![job(0, 0, 0, 10), job(1, 0, 0, 10)];
        assert_eq!(gather(&mut staged).count, 1);
    }
}
