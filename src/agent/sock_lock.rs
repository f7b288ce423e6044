//! The lock that keeps two agents off one attach socket path: an `flock`
//! on `<path>.lock`, held for the listener's life and removed with it.
//!
//! Removing a lock file while others may open it is the classic race (an
//! agent opens the old file, the holder removes it and exits, the agent
//! locks the removed file while a third creates and locks a new one). So
//! a lock is only taken once the path still names the file locked, and
//! the file is removed only while it is still the path's and still held.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// `<path>.lock`, locked; removed (while still locked) on drop.
#[derive(Debug)]
pub(crate) struct SocketLock {
    path: PathBuf,
    file: File,
}

/// Whether `a` and `b` are the same file.
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    a.ino() == b.ino() && a.dev() == b.dev()
}

impl SocketLock {
    /// Opens and locks `path` (`flock`, not waiting). Another agent
    /// removes the file when it stops, still holding the lock; so a file
    /// locked after it was removed is not the path's any more, and the
    /// path's new file is tried (at most 8 times: each retry means another
    /// agent just stopped). `busy` makes the error for a lock another
    /// agent holds, or for a path replaced at every try.
    pub(crate) fn take(path: &Path, busy: &dyn Fn(String) -> Error) -> Result<SocketLock> {
        for _ in 0..8 {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(path)
                .map_err(|e| Error::io("open", path, e))?;
            // SAFETY: flock on a descriptor we own; no pointer.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                return Err(busy(format!(
                    "another agent holds {} ({})",
                    path.display(),
                    io::Error::last_os_error()
                )));
            }
            let held = file.metadata().map_err(|e| Error::io("stat", path, e))?;
            match std::fs::metadata(path) {
                Ok(m) if same_file(&m, &held) => {
                    return Ok(SocketLock {
                        path: path.to_path_buf(),
                        file,
                    })
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("stat", path, e)),
            }
        }
        Err(busy(format!(
            "{} kept being replaced while this agent locked it (agents starting and stopping at once?)",
            path.display()
        )))
    }
}

impl Drop for SocketLock {
    fn drop(&mut self) {
        // Only the file we hold: one somebody replaced (a cleanup of /run)
        // may be another agent's lock now. Removed while still locked, so
        // an agent that locked it meanwhile sees it replaced (`take`).
        let ours = self
            .file
            .metadata()
            .ok()
            .zip(std::fs::metadata(&self.path).ok());
        if ours.is_some_and(|(held, now)| same_file(&held, &now)) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
