//! [`JsonlTracker`]: one JSON object per line.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::Tracker;
use crate::error::{Error, Result};

/// Writes each [`log`](Tracker::log) call as one line of JSON:
/// `{"step":3,"time":1718000000.25,"loss":0.5,"lr":0.01}`.
///
/// `time` is the wall-clock time in seconds since the Unix epoch. Metric values that are not
/// finite (NaN, infinities) are written as `null`, as JSON has no number for them. Each line is
/// written to the file with a single write as it is logged, so a crash loses nothing already
/// logged. An existing file is appended to, so a resumed run continues the same log.
#[derive(Debug)]
pub struct JsonlTracker {
    file: File,
    path: PathBuf,
}

impl JsonlTracker {
    /// Opens (creating it and its directory if needed) the file at `path` for appending.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if let Some(parent) = path.parent() {
            super::create_dir(parent)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| Error::Io {
                context: "jsonl tracker: cannot open".into(),
                path: path.clone(),
                source,
            })?;
        Ok(JsonlTracker { file, path })
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl JsonlTracker {
    fn write_line(&mut self, line: &str) -> Result<()> {
        self.file
            .write_all(line.as_bytes())
            .map_err(|source| Error::Io {
                context: "jsonl tracker: cannot write".into(),
                path: self.path.clone(),
                source,
            })
    }
}

fn number(v: f64) -> String {
    // serde_json writes non-finite floats as `null`.
    serde_json::Value::from(v).to_string()
}

impl Tracker for JsonlTracker {
    /// Appends one line. A metric named `step` or `time` is rejected (those keys are taken).
    fn log(&mut self, metrics: &[(&str, f64)], step: u64) -> Result<()> {
        let mut line = format!("{{\"step\":{step},\"time\":{}", number(super::unix_time()));
        for (name, value) in metrics {
            if *name == "step" || *name == "time" {
                return Err(Error::invalid(
                    "metric name",
                    format!(
                        "`{name}` is reserved in {} (it holds the step and the time)",
                        self.path.display()
                    ),
                ));
            }
            line.push(',');
            line.push_str(&serde_json::Value::from(*name).to_string());
            line.push(':');
            line.push_str(&number(*value));
        }
        line.push_str("}\n");
        self.write_line(&line)
    }

    /// Appends one line `{"time":...,"hparams":{...}}` (no `step`: it holds for the whole run).
    fn log_hparams(&mut self, hparams: &super::HParams) -> Result<()> {
        let line = format!(
            "{{\"time\":{},\"hparams\":{}}}\n",
            number(super::unix_time()),
            hparams.to_json()
        );
        self.write_line(&line)
    }

    /// Syncs the file to disk (lines are already handed to the OS by [`log`](Tracker::log)).
    fn flush(&mut self) -> Result<()> {
        self.file.sync_data().map_err(|source| Error::Io {
            context: "jsonl tracker: cannot sync".into(),
            path: self.path.clone(),
            source,
        })
    }
}
