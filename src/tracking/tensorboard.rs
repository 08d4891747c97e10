//! [`TensorBoardTracker`]: a TensorBoard event file, written without TensorFlow.
//!
//! The file is a sequence of TFRecords, each holding one serialized `tensorflow.Event` protobuf.
//! A record is framed as
//!
//! ```text
//! u64 length (little endian) | u32 masked crc32c(length bytes) | data | u32 masked crc32c(data)
//! ```
//!
//! with `masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8` (wrapping). The first record is
//! `Event { wall_time, file_version: "brain.Event:2" }`; each [`log`](Tracker::log) call adds
//! `Event { wall_time, step, summary: Summary { value: [Value { tag, simple_value }, ...] } }`.
//! The handful of protobuf fields needed are encoded by hand.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::Tracker;
use crate::error::{Error, Result};

/// Writes scalars to `<dir>/events.out.tfevents.<secs>.<hostname>.<pid>`, readable by
/// `tensorboard --logdir <dir>`.
///
/// Each [`log`](Tracker::log) call becomes one event (one record, written with a single write),
/// so a crash loses nothing already logged. Values are stored as 32-bit floats, as TensorBoard's
/// `simple_value` is.
#[derive(Debug)]
pub struct TensorBoardTracker {
    file: File,
    path: PathBuf,
}

impl TensorBoardTracker {
    /// Creates `dir` if needed and a new event file in it, and writes the file-version event.
    pub fn create(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        super::create_dir(dir)?;
        let now = super::unix_time();
        let name = format!(
            "events.out.tfevents.{}.{}.{}",
            now as u64,
            hostname(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| Error::Io {
                context: "tensorboard tracker: cannot create".into(),
                path: path.clone(),
                source,
            })?;
        let mut tracker = TensorBoardTracker { file, path };
        let mut event = Vec::new();
        put_double(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        tracker.write_record(&event)?;
        Ok(tracker)
    }

    /// The event file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        let record = frame(data);
        self.file.write_all(&record).map_err(|source| Error::Io {
            context: "tensorboard tracker: cannot write".into(),
            path: self.path.clone(),
            source,
        })
    }
}

impl Tracker for TensorBoardTracker {
    /// Appends one event holding every metric as a scalar summary at `step`. A `step` above
    /// `i64::MAX` is rejected (the protobuf field is an `int64`).
    fn log(&mut self, metrics: &[(&str, f64)], step: u64) -> Result<()> {
        let step = i64::try_from(step).map_err(|_| {
            Error::invalid(
                "step",
                format!(
                    "{step} does not fit TensorBoard's int64 step ({})",
                    self.path.display()
                ),
            )
        })?;
        let mut summary = Vec::new();
        for (tag, value) in metrics {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_float(&mut v, 2, *value as f32);
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, super::unix_time());
        put_varint_field(&mut event, 2, step as u64);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    /// Appends the hparams plugin's session-start record (what `SummaryWriter.add_hparams`
    /// writes, read by TensorBoard's HPARAMS tab): one event whose summary value
    /// `_hparams_/session_start_info` carries `HParamsPluginData { session_start_info: {
    /// hparams, start_time_secs } }` as the plugin's content. TensorBoard derives the table's
    /// columns from it and the run's scalars.
    fn log_hparams(&mut self, hparams: &super::HParams) -> Result<()> {
        let now = super::unix_time();
        let mut start_info = Vec::new();
        for (name, value) in hparams.iter() {
            let mut v = Vec::new();
            match value {
                super::HParamValue::Number(x) => put_double(&mut v, 2, *x),
                super::HParamValue::Text(t) => put_bytes(&mut v, 3, t.as_bytes()),
                super::HParamValue::Bool(b) => put_varint_field(&mut v, 4, u64::from(*b)),
            }
            let mut entry = Vec::new();
            put_bytes(&mut entry, 1, name.as_bytes());
            put_bytes(&mut entry, 2, &v);
            put_bytes(&mut start_info, 1, &entry);
        }
        put_double(&mut start_info, 5, now);
        let mut plugin_data = Vec::new();
        put_bytes(&mut plugin_data, 3, &start_info);
        let mut plugin = Vec::new();
        put_bytes(&mut plugin, 1, b"hparams");
        put_bytes(&mut plugin, 2, &plugin_data);
        let mut metadata = Vec::new();
        put_bytes(&mut metadata, 1, &plugin);
        put_varint_field(&mut metadata, 4, DATA_CLASS_TENSOR);
        // TensorBoard's null tensor for hparams records: a float32 scalar 0.
        let mut tensor = Vec::new();
        put_varint_field(&mut tensor, 1, DT_FLOAT);
        put_bytes(&mut tensor, 2, &[]);
        put_bytes(&mut tensor, 5, &0f32.to_le_bytes());
        let mut value = Vec::new();
        put_bytes(&mut value, 1, b"_hparams_/session_start_info");
        put_bytes(&mut value, 8, &tensor);
        put_bytes(&mut value, 9, &metadata);
        let mut summary = Vec::new();
        put_bytes(&mut summary, 1, &value);
        let mut event = Vec::new();
        put_double(&mut event, 1, now);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    /// Syncs the event file to disk (records are already handed to the OS by
    /// [`log`](Tracker::log)).
    fn flush(&mut self) -> Result<()> {
        self.file.sync_data().map_err(|source| Error::Io {
            context: "tensorboard tracker: cannot sync".into(),
            path: self.path.clone(),
            source,
        })
    }
}

/// The host name for the file name: `/proc/sys/kernel/hostname`, else `$HOSTNAME`, else
/// `localhost`; characters other than alphanumerics, `-` and `_` become `_`.
fn hostname() -> String {
    let raw = crate::settings::runtime::host_name().unwrap_or_else(|| "localhost".to_string());
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// `SummaryMetadata.data_class` of a tensor summary.
const DATA_CLASS_TENSOR: u64 = 2;
/// `TensorProto.dtype` of float32.
const DT_FLOAT: u64 = 1;

// ---- TFRecord framing ----

/// Frames `data` as one TFRecord.
fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) lookup table.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut k = 0;
        while k < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
            k += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = CRC32C_TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

// ---- protobuf encoding (only what Event needs) ----

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

fn put_varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    put_key(out, field, 0);
    put_varint(out, v);
}

fn put_double(out: &mut Vec<u8>, field: u32, v: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_float(out: &mut Vec<u8>, field: u32, v: f32) {
    put_key(out, field, 5);
    out.extend_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn protobuf_keys() {
        let mut v = Vec::new();
        put_double(&mut v, 1, 0.0);
        put_varint_field(&mut v, 2, 300);
        put_bytes(&mut v, 3, b"x");
        put_float(&mut v, 2, 1.0);
        assert_eq!(v[0], 0x09);
        assert_eq!(&v[9..12], &[0x10, 0xAC, 0x02]);
        assert_eq!(&v[12..15], &[0x1a, 1, b'x']);
        assert_eq!(v[15], 0x15);
    }
}
