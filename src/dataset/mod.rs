//! The dataset side: sources, the catalog, the owner function, a node's space
//! (packed extents + manifest) and its preload, and a test-data generator.

pub mod catalog;
#[cfg(feature = "gen")]
pub mod gen;
pub mod owner;
pub mod partial;
pub mod preload;
pub mod rebalance;
pub mod repair;
mod scan;
mod shard;
pub mod source;
pub mod space;
#[cfg(feature = "s3")]
pub mod store;
#[cfg(feature = "s3")]
mod store_scan;
#[cfg(feature = "s3")]
mod store_url;

pub use catalog::{mixture_identity, BuildOptions, Catalog, Sample};
pub use owner::{OwnerFn, Placement};
pub use partial::PartialHolders;
pub use preload::{preload, unload, PreloadOptions, PreloadReport, SpaceLock};
pub use rebalance::{rebalance, Fetch, RebalanceOptions, RebalanceReport, SourceFetch};
pub use repair::{repair, repair_verified, RepairReport};
pub use source::{ScanNotes, ScanOptions, SourceKind, SourceSpec};
pub use space::{BadExtent, BadKind, BadSample, LayoutParams, Location, Space, VerifyReport};

/// The default thread count of the bulk passes (checksums, preload,
/// verify): the CPUs this process may use.
pub use crate::par::default_threads;
/// Raises the open-files soft limit to the hard limit (see the function in
/// `sys`); the CLI, preload and verify call it at start.
pub use crate::sys::raise_open_files_limit;
