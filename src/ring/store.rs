//! An [`IoBackend`] over an object store: a poller reading a source in a
//! bucket (`Loader` with `source = "s3://…"`) runs its ordinary loop on it,
//! so the reads it issues in the rank's known order, ahead of need, up to
//! its queue depth, are ranged GETs in flight (clairvoyant prefetch), and
//! their bytes land in the ring where io_uring would have put them.
//!
//! A read names its object as [`Target::Object`] (the catalog's file
//! index; `objects` gives its key and ETag). Each backend owns `depth`
//! worker threads, one per read in flight; a push hands the read to them
//! over a bounded channel (capacity `depth`: a push beyond it is refused as
//! a full submission queue, never queued on the heap), and they answer on
//! another. A read completes with its length, or `-EIO` (the store's
//! error is logged with the object's URL; the poller names the sample and
//! the URL), or `-ESTALE` when the object was replaced since the catalog.
//! Operations other than reads complete with `-ENOTSOCK`: a poller issues
//! none.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use super::{Completion, IoBackend, ReadOp, Target, Timespec};
use crate::dataset::store::Store;
use crate::error::{Error, Result};

/// How long one read may take, the client's retries included: a store that
/// stays down fails the read (named) rather than hold the loader, whose
/// stop waits for every read in flight.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// The key and ETag of the catalog's file `i`.
pub type ObjectOf = dyn Fn(u32) -> (String, String) + Send + Sync;

/// One read handed to a worker (the buffer as an address: the caller owns
/// it until the completion is drained, [`IoBackend::push`]'s contract).
struct Job {
    user_data: u64,
    object: u32,
    offset: u64,
    buf: usize,
    len: u32,
}

/// Reads from one bucket through worker threads.
pub struct StoreRing {
    jobs: Option<Sender<Job>>,
    done: Receiver<Completion>,
    /// Completions taken by a wait, not drained yet (at most `depth`).
    ready: Vec<Completion>,
    in_flight: usize,
    depth: usize,
    workers: Vec<JoinHandle<()>>,
}

impl StoreRing {
    /// A backend with `depth` reads in flight at most, reading `bucket`'s
    /// objects named by `objects`.
    pub fn new(bucket: &str, objects: Arc<ObjectOf>, depth: usize) -> Result<Self> {
        let depth = depth.max(1);
        let store = Store::of(bucket)?;
        let (jobs, rx) = bounded::<Job>(depth);
        let (tx, done) = bounded::<Completion>(depth);
        let mut workers = Vec::with_capacity(depth);
        for i in 0..depth {
            let (rx, tx, store, objects) = (rx.clone(), tx.clone(), store.clone(), objects.clone());
            let w = std::thread::Builder::new()
                .name(format!("kspeed-get-{i}"))
                .spawn(move || {
                    while let Ok(j) = rx.recv() {
                        let result = get(&store, &*objects, &j);
                        // Capacity `depth` and at most `depth` jobs out:
                        // never blocks.
                        let _ = tx.send(Completion {
                            user_data: j.user_data,
                            result,
                        });
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
            done,
            ready: Vec::with_capacity(depth),
            in_flight: 0,
            depth,
            workers,
        })
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

    /// Waits up to `timeout` for one completion into `ready`.
    fn wait_one(&mut self, timeout: Option<Duration>) {
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

/// One GET: the result is the bytes read or a negated errno.
fn get(store: &Store, objects: &ObjectOf, j: &Job) -> i32 {
    let (key, etag) = objects(j.object);
    // SAFETY: push's contract: buf..buf+len is the caller's, untouched by
    // anyone else, until this read's completion is drained.
    let dst = unsafe { std::slice::from_raw_parts_mut(j.buf as *mut u8, j.len as usize) };
    match store.read_into(&key, Some(&etag), j.offset, READ_TIMEOUT, dst) {
        Ok(_) => j.len as i32,
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
        };
        match self.jobs.as_ref().expect("running").try_send(job) {
            Ok(()) => {
                self.in_flight += 1;
                true
            }
            Err(_) => false,
        }
    }

    fn submit(&mut self, wait: bool) -> io::Result<()> {
        if wait {
            self.wait_one(None);
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
        n
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn cancel_all(&mut self) {
        // A GET cannot be called back: wait for each (its own timeouts
        // bound it), dropping the completions.
        let outstanding = self.in_flight - self.ready.len();
        self.ready.clear();
        for _ in 0..outstanding {
            if self.done.recv().is_err() {
                break;
            }
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
