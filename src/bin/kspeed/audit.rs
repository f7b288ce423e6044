//! `kspeed audit`: checks from every rank's saved position that a job
//! delivered each sample of an epoch exactly once, across resumes at other
//! world sizes and, for a mixture of datasets, under other weights
//! (`kspeed::sampler::audit_positions`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use kspeed::sampler::{audit_positions, SavedPosition};

#[derive(Args)]
pub(crate) struct AuditArgs {
    /// Saved positions (`Loader::save_position`: KSPDPOS3, a mixture's
    /// KSPDPOS4): the last one of every rank of every world that dealt the
    /// epochs to check (a job resumed at 8, then 5 ranks: the 8 files
    /// written at the resume and the 5 written at the end). A mixture's
    /// files may come from worlds of other weights (a job resumed from its
    /// KSPDMIX1 position under new weights).
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

/// Exit status: 0 every epoch exactly once, 3 a mismatch (named), 1 a file
/// that cannot be read or is not a KSPDPOS3/KSPDPOS4 position (or a
/// mixture's KSPDPOS3, saved before positions recorded the mixture).
pub(crate) fn run(a: AuditArgs) -> kspeed::Result<ExitCode> {
    let mut saved = Vec::with_capacity(a.files.len());
    for f in &a.files {
        let bytes = std::fs::read(f).map_err(|e| kspeed::Error::io("read", f, e))?;
        let s = SavedPosition::decode(&bytes).map_err(|e| match e {
            // Its own prefix once, after the file's name.
            kspeed::Error::BadPosition(why) => {
                kspeed::Error::BadPosition(format!("{}: {why}", f.display()))
            }
            e => e,
        })?;
        saved.push(s);
    }
    match audit_positions(&saved) {
        Ok(reports) => {
            for r in reports {
                println!("{r}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ kspeed::Error::AuditMismatch(_)) => {
            eprintln!("kspeed: {e}");
            Ok(ExitCode::from(3))
        }
        Err(e) => Err(e),
    }
}
