//! Failover to an object store: a sample no node can serve, of a space
//! preloaded from `s3://…`, is read from the bucket by a small pool of
//! threads beside the network thread, never on it (a GET waits on the
//! network; the thread's other connections must not).
//!
//! The pool has one thread per source-read slot (`source.rs` gives the
//! count), started on the first such sample. A request names the slot, the sample
//! and where its bytes go (the sample's span of the ring, or the slot's
//! bounce buffer for a GPU ring); the worker GETs the sample's byte range,
//! conditional on the object's cataloged ETag, straight into that memory,
//! answers on a bounded channel and wakes the network thread through its
//! wake descriptor. Both channels hold at most one message per slot, so a
//! send never blocks and nothing is allocated by the channels per sample.
//! Until the answer is taken, the slot counts as in flight
//! (`SourceReads::busy`), so the thread (and with it the ring) outlives
//! every write a worker may still make. The network thread then checks the
//! CRC32C and publishes or fails the sample exactly as for a file.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::dataset::store::Store;
use crate::loader::shared::Shared;

/// How long one sample's GET may take, retries included, before the sample
/// fails over to nothing (a stopping loader waits at most this long).
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);

/// A sample to read into memory the network thread set aside.
pub(super) struct Fetch {
    pub(super) slot: usize,
    pub(super) id: u64,
    /// The sample's bytes go here (`len` bytes; ring span or bounce buffer).
    pub(super) dst: usize,
    pub(super) len: u32,
}

/// A worker's answer for `slot`.
pub(super) struct Fetched {
    pub(super) slot: usize,
    pub(super) res: Result<(), String>,
}

/// The workers and their channels.
pub(super) struct StorePool {
    tx: Option<Sender<Fetch>>,
    done: Receiver<Fetched>,
    workers: Vec<JoinHandle<()>>,
}

impl StorePool {
    /// Starts `slots` workers (one per source-read slot) reading `sh`'s
    /// catalog's source.
    pub(super) fn start(sh: &Arc<Shared>, slots: usize) -> std::io::Result<Self> {
        let (tx, rx) = bounded::<Fetch>(slots);
        let (done_tx, done) = bounded::<Fetched>(slots);
        let mut workers = Vec::with_capacity(slots);
        for i in 0..slots {
            let (rx, done_tx, sh) = (rx.clone(), done_tx.clone(), sh.clone());
            workers.push(
                std::thread::Builder::new()
                    .name(format!("kspeed-s3get-{i}"))
                    .spawn(move || {
                        while let Ok(f) = rx.recv() {
                            let res = fetch(&sh, &f);
                            // Capacity is one per slot and a slot has one
                            // request at a time: this never blocks.
                            let _ = done_tx.send(Fetched { slot: f.slot, res });
                            if let Some(n) = sh.net.as_ref() {
                                n.wake.notify();
                            }
                        }
                    })?,
            );
        }
        Ok(StorePool {
            tx: Some(tx),
            done,
            workers,
        })
    }

    /// Hands `f` to a worker. The caller holds slot `f.slot` in flight until
    /// its answer is taken with [`StorePool::try_done`].
    pub(super) fn send(&self, f: Fetch) {
        self.tx
            .as_ref()
            .expect("pool running")
            .try_send(f)
            .expect("at most one request per source slot: the channel has room");
    }

    /// An answer, if one came.
    pub(super) fn try_done(&self) -> Option<Fetched> {
        self.done.try_recv().ok()
    }
}

impl Drop for StorePool {
    fn drop(&mut self) {
        // Workers end when the request channel closes; the network thread
        // drops the pool only with no request outstanding, so none is in a
        // GET now.
        self.tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Reads sample `f.id` from the store into `f.dst`.
fn fetch(sh: &Shared, f: &Fetch) -> Result<(), String> {
    let cat = sh.input.catalog();
    let s = cat.sample(f.id);
    let file = cat.file(s.file);
    let url = cat
        .source_spec()
        .store_url()
        .ok_or_else(|| "the catalog's source is not in an object store".to_string())?;
    let key = format!(
        "{}{}",
        url.dir_prefix_or_parent(),
        file.name.to_string_lossy()
    );
    let store = Store::of(&url.bucket).map_err(|e| e.to_string())?;
    // SAFETY: the network thread set `dst..dst+len` aside for this request
    // (the sample's unpublished ring span, written by no connection, or the
    // slot's bounce buffer, not resized while the slot is in flight) and
    // touches it again only after taking this request's answer.
    let dst = unsafe { std::slice::from_raw_parts_mut(f.dst as *mut u8, f.len as usize) };
    let etag = String::from_utf8_lossy(file.etag);
    store
        .read_into(&key, Some(&etag), s.offset, FETCH_TIMEOUT, dst)
        .map(|_| ())
        .map_err(|e| format!("{}: {e}", url.child(&file.name.to_string_lossy())))
}
