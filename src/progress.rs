//! Progress for long work (catalog build, preload, verify, gen): a bar with
//! bytes/s and ETA on a terminal, plain periodic lines otherwise (logs, CI),
//! or nothing. Updating is a relaxed atomic add, so workers may call it per
//! sample.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[cfg(feature = "cli")]
use indicatif::{ProgressBar, ProgressStyle};

/// Without the `cli` feature (the library alone) there are no bars: a bar
/// asked for is shown as lines.
#[cfg(not(feature = "cli"))]
struct ProgressBar;

#[cfg(not(feature = "cli"))]
impl ProgressBar {
    fn inc(&self, _bytes: u64) {}
    fn set_prefix(&self, _items: String) {}
    fn finish_and_clear(&self) {}
}

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressMode {
    /// A bar when stderr is a terminal, lines otherwise.
    #[default]
    Auto,
    /// Always a bar (lines in a build without the `cli` feature).
    Bar,
    /// Plain lines on stderr every interval.
    Lines,
    /// Nothing (the library default).
    Quiet,
}

impl std::str::FromStr for ProgressMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ProgressMode::Auto),
            "bar" => Ok(ProgressMode::Bar),
            "lines" => Ok(ProgressMode::Lines),
            "none" | "quiet" => Ok(ProgressMode::Quiet),
            _ => Err(format!(
                "progress mode {s:?}: expected auto, bar, lines or none"
            )),
        }
    }
}

/// How often plain progress lines are printed: `KSPEED_PROGRESS_INTERVAL_MS`, default 5 s.
fn line_interval() -> Duration {
    std::env::var("KSPEED_PROGRESS_INTERVAL_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_secs(5))
}

struct Counter {
    done: AtomicU64,
    total: u64,
    /// Items (samples, objects) done and in all, when counted.
    items: AtomicU64,
    total_items: Option<u64>,
}

/// A progress reporter over a known number of bytes.
pub struct Progress {
    counter: Arc<Counter>,
    bar: Option<ProgressBar>,
    ticker: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
}

/// CPU seconds (user + system) this process has used, for reports.
pub use crate::sys::{default_sigpipe, process_cpu_seconds};

/// Parses a size: a number with an optional unit (`4096`, `64KiB`,
/// `256MiB`, `1GB`; binary and decimal units). The error says what is
/// accepted.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s.trim()).map_err(|e| {
        format!("{s:?} is not a size ({e}); use a number of bytes with an optional unit, e.g. 4096, 64KiB, 256MiB, 1GB")
    })
}

/// Formats a byte count with a binary unit, for the library's own messages
/// (progress lines, errors). The `kspeed` command uses indicatif's
/// `HumanBytes`; the library does not depend on indicatif.
pub fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

impl Progress {
    /// Starts reporting `label` over `total_bytes`.
    pub fn new(label: &str, total_bytes: u64, mode: ProgressMode) -> Self {
        Self::make(label, total_bytes, None, mode)
    }

    /// Starts reporting `label` over `total_bytes` in `total_items` items
    /// (samples, objects), both shown; count them with [`Progress::add_item`].
    pub fn with_items(label: &str, total_bytes: u64, total_items: u64, mode: ProgressMode) -> Self {
        Self::make(label, total_bytes, Some(total_items), mode)
    }

    fn make(label: &str, total_bytes: u64, total_items: Option<u64>, mode: ProgressMode) -> Self {
        let counter = Arc::new(Counter {
            done: AtomicU64::new(0),
            total: total_bytes,
            items: AtomicU64::new(0),
            total_items,
        });
        let mode = match mode {
            ProgressMode::Auto if cfg!(feature = "cli") && std::io::stderr().is_terminal() => {
                ProgressMode::Bar
            }
            ProgressMode::Auto => ProgressMode::Lines,
            ProgressMode::Bar if !cfg!(feature = "cli") => ProgressMode::Lines,
            m => m,
        };
        let mut p = Progress {
            counter: counter.clone(),
            bar: None,
            ticker: None,
        };
        match mode {
            #[cfg(feature = "cli")]
            ProgressMode::Bar => {
                let bar = ProgressBar::new(total_bytes);
                bar.set_style(
                    ProgressStyle::with_template(if total_items.is_some() {
                        "{msg:>9} [{bar:30}] {bytes}/{total_bytes} {prefix} {bytes_per_sec} ETA {eta}"
                    } else {
                        "{msg:>9} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}"
                    })
                    .expect("valid template")
                    .progress_chars("=> "),
                );
                bar.set_message(label.to_string());
                if let Some(n) = total_items {
                    bar.set_prefix(format!("0/{n}"));
                }
                p.bar = Some(bar);
            }
            ProgressMode::Lines => {
                let (tx, rx) = mpsc::channel::<()>();
                let label = label.to_string();
                let interval = line_interval();
                let start = Instant::now();
                let handle = std::thread::spawn(move || {
                    while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(interval) {
                        eprintln!("{}", line(&label, &counter, start.elapsed()));
                    }
                });
                p.ticker = Some((tx, handle));
            }
            _ => {}
        }
        p
    }

    /// Adds `bytes` of work done.
    pub fn add(&self, bytes: u64) {
        self.counter.done.fetch_add(bytes, Ordering::Relaxed);
        if let Some(b) = &self.bar {
            b.inc(bytes);
        }
    }

    /// Adds one item of `bytes` (a progress made by
    /// [`Progress::with_items`]). The bar's item count is redrawn every 64
    /// items, not formatted per item.
    pub fn add_item(&self, bytes: u64) {
        let n = self.counter.items.fetch_add(1, Ordering::Relaxed) + 1;
        if let (Some(b), Some(total)) = (&self.bar, self.counter.total_items) {
            if n.is_multiple_of(64) || n == total {
                b.set_prefix(format!("{n}/{total}"));
            }
        }
        self.add(bytes);
    }

    /// Bytes done so far.
    pub fn done(&self) -> u64 {
        self.counter.done.load(Ordering::Relaxed)
    }

    /// Stops the bar or the ticker.
    pub fn finish(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
        if let Some((tx, h)) = self.ticker.take() {
            drop(tx);
            let _ = h.join();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop();
    }
}

fn line(label: &str, c: &Counter, elapsed: Duration) -> String {
    let done = c.done.load(Ordering::Relaxed);
    let secs = elapsed.as_secs_f64().max(1e-9);
    let rate = done as f64 / secs;
    let pct = if c.total > 0 {
        100.0 * done as f64 / c.total as f64
    } else {
        100.0
    };
    let eta = if rate > 0.0 {
        format!("{:.0} s", c.total.saturating_sub(done) as f64 / rate)
    } else {
        "unknown".into()
    };
    let items = match c.total_items {
        Some(n) => format!(", {} / {n} samples", c.items.load(Ordering::Relaxed)),
        None => String::new(),
    };
    format!(
        "{label}: {} / {} ({pct:.1}%){items}, {}/s, ETA {eta}",
        human_bytes(done as f64),
        human_bytes(c.total as f64),
        human_bytes(rate)
    )
}
