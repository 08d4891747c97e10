//! `manifest.json`: its fields, the seal that makes an edit or a damaged byte detectable, and
//! the verification of a checkpoint's files against it.
//!
//! **The seal.** The manifest is pretty-printed JSON whose last entry, `manifest_crc32`, stands
//! on its own line and holds the CRC-32 of every byte of the file before that line's comma. The
//! check reads the bytes as they are on disk; it never serializes a parsed manifest again, so it
//! cannot disagree with itself (a re-serialization can differ from what was written: serde_json's
//! default float parser is not exact, and 14% of a cosine schedule's learning rates came back
//! one ULP off). Manifests of the first format (a `checksum` over a re-serialization) are still
//! read and checked; parsing is exact now (serde_json's `float_roundtrip`), so their floats
//! serialize back to the bytes that were checksummed.
//!
//! **Exact floats.** Every `f64` a manifest holds is written in the shortest form that parses
//! back to the same bits; infinities and NaNs, which JSON numbers cannot hold, are written as the
//! strings `"inf"`, `"-inf"`, `"NaN"` or `"NaN(0x<bits>)"`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::io::corrupt;
use super::names::{MANIFEST_FILE, MODEL_FILE};
use crate::error::{Error, Result};
use crate::files::{io_err, with_suffix};

/// Where a data loader stands: `batches_done` batches of `epoch` were consumed. Give it back to
/// [`DataLoader::resume_at`](crate::DataLoader::resume_at).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderPosition {
    /// The epoch in progress.
    pub epoch: u64,
    /// Batches of that epoch already trained on (per rank; the same on every rank).
    pub batches_done: usize,
}

/// The optimizer's scalars in a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerManifest {
    /// Optimizer steps taken.
    pub step: u64,
    /// The learning rate in force (bit for bit: see the module docs on exact floats).
    #[serde(with = "exact_f64")]
    pub lr: f64,
    /// The names of the tensors in `optimizer.safetensors`, in order.
    pub tensors: Vec<String>,
    /// ZeRO: the number of per-rank files the state is cut across
    /// (`optimizer.rank-00000-of-0000N.safetensors`, ...), instead of `optimizer.safetensors`;
    /// `None` for one whole file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<usize>,
    /// With [`shards`](Self::shards): the shape of each of [`tensors`](Self::tensors).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shapes: Vec<Vec<usize>>,
}

/// `manifest.json`: everything in a checkpoint besides tensors. Returned by
/// [`Accelerator::load_state`](crate::Accelerator::load_state) and [`read_manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The accelerate-rs version that wrote it.
    pub version: String,
    /// The number of processes of the run that wrote it.
    pub world_size: usize,
    /// The training loop's step ([`CheckpointParts::step`](super::CheckpointParts::step)).
    pub step: u64,
    /// The optimizer's scalars, when an optimizer was saved.
    pub optimizer: Option<OptimizerManifest>,
    /// The schedule's step, when saved.
    pub schedule_step: Option<u64>,
    /// The loader's position, when saved.
    pub loader: Option<LoaderPosition>,
    /// The loader's position in global samples, when saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<crate::data::SamplePosition>,
    /// The parameter names in `model.safetensors`, in name order.
    pub parameters: Vec<String>,
    /// ZeRO-3: the number of per-rank files the model's parameters are cut across
    /// (`model.rank-00000-of-0000N.safetensors`, ...: each rank's pieces, tensors named
    /// `<parameter>@<first element>`), instead of `model.safetensors`; `None` for one whole
    /// file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_shards: Option<usize>,
    /// With [`model_shards`](Self::model_shards): the shape of each of
    /// [`parameters`](Self::parameters).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_shapes: Vec<Vec<usize>>,
    /// Free-form strings ([`CheckpointParts::extra`](super::CheckpointParts::extra)).
    pub extra: BTreeMap<String, String>,
    /// The named models ([`CheckpointParts::model_named`](super::CheckpointParts::model_named))
    /// and their parameter names.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub models: BTreeMap<String, Vec<String>>,
    /// The named optimizers' scalars
    /// ([`CheckpointParts::optimizer_named`](super::CheckpointParts::optimizer_named)).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub optimizers: BTreeMap<String, OptimizerManifest>,
    /// The names of the states of [`CheckpointParts::state`](super::CheckpointParts::state)
    /// (their values, per rank, are in `states.json`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub states: Vec<String>,
    /// Size and CRC-32 of every file of the checkpoint, checked by [`verify_checkpoint`] and on
    /// every load (empty in checkpoints written before checksums existed: those load unverified,
    /// with a warning).
    #[serde(default)]
    pub files: BTreeMap<String, FileChecksum>,
    /// First format only (read, never written): the CRC-32 of the manifest serialized again
    /// with this field unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<u32>,
    /// The seal: the CRC-32 of the file's bytes before this entry's line (see the module docs).
    /// Written last, on its own line, by every save.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_crc32: Option<u32>,
}

/// The separator before the seal's entry, as written: a comma ending the last other entry, a
/// new line and two spaces of indentation.
const SEAL_LINE: &str = ",\n  \"manifest_crc32\": ";

impl Manifest {
    /// The text of `manifest.json` for this manifest: pretty-printed JSON, sealed with
    /// [`manifest_crc32`](Self::manifest_crc32) (any value in `checksum` and
    /// `manifest_crc32` is replaced).
    pub(super) fn to_sealed_json(&self) -> Result<String> {
        let mut bare = self.clone();
        bare.checksum = None;
        bare.manifest_crc32 = None;
        let body = serde_json::to_string_pretty(&bare).map_err(|e| Error::Internal {
            what: "serializing a checkpoint manifest".into(),
            reason: e.to_string(),
        })?;
        let head = body.strip_suffix("\n}").ok_or_else(|| Error::Internal {
            what: "serializing a checkpoint manifest".into(),
            reason: "serde_json's pretty form does not end in a line with `}`".into(),
        })?;
        let crc = crc32fast::hash(head.as_bytes());
        Ok(format!("{head}{SEAL_LINE}{crc}\n}}\n"))
    }

    /// Parses the text of `path` (a `manifest.json`) and checks its seal (or, for a manifest of
    /// the first format, its `checksum`); a manifest with neither passes (it predates
    /// checksums).
    pub(super) fn from_sealed_json(text: &str, path: &Path) -> Result<Manifest> {
        let m: Manifest = serde_json::from_str(text).map_err(|e| Error::CheckpointCorrupt {
            path: path.to_path_buf(),
            reason: format!("the manifest does not parse: {e}"),
        })?;
        let edited = |why: String| Error::CheckpointCorrupt {
            path: path.to_path_buf(),
            reason: format!("{why} (the manifest was edited or damaged)"),
        };
        if let Some(want) = m.manifest_crc32 {
            let Some((at, written)) = seal_of(text) else {
                return Err(edited(
                    "its `manifest_crc32` entry is not the last line, where it was written".into(),
                ));
            };
            let got = crc32fast::hash(&text.as_bytes()[..at]);
            if written != want || got != want {
                return Err(edited(format!(
                    "the CRC-32 of its bytes is {got:08x}, its seal records {want:08x}"
                )));
            }
        } else if let Some(want) = m.checksum {
            // The first format: a CRC-32 of the manifest serialized again without it.
            let mut bare = m.clone();
            bare.checksum = None;
            let again = serde_json::to_string_pretty(&bare).map_err(|e| Error::Internal {
                what: "serializing a checkpoint manifest".into(),
                reason: e.to_string(),
            })?;
            let got = crc32fast::hash(again.as_bytes());
            if got != want {
                return Err(edited(format!(
                    "its checksum is {want:08x}, its contents give {got:08x}"
                )));
            }
        }
        Ok(m)
    }
}

/// Where the seal's entry starts in `text` (the byte after the last sealed byte) and the number
/// it holds, when the text ends the way [`Manifest::to_sealed_json`] writes it.
fn seal_of(text: &str) -> Option<(usize, u32)> {
    let at = text.rfind(SEAL_LINE)?;
    let rest = text[at + SEAL_LINE.len()..].trim_end();
    let digits = rest.strip_suffix('}')?.trim_end();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((at, digits.parse().ok()?))
}

/// Serde for an `f64` that must come back bit for bit: finite values as JSON numbers (exact with
/// serde_json's `float_roundtrip`), the others as strings JSON numbers cannot be confused with.
pub(super) mod exact_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    const CANONICAL_NAN: u64 = 0x7ff8_0000_0000_0000;

    /// The string for a non-finite `v`.
    fn name(v: f64) -> String {
        if v == f64::INFINITY {
            "inf".into()
        } else if v == f64::NEG_INFINITY {
            "-inf".into()
        } else if v.to_bits() == CANONICAL_NAN {
            "NaN".into()
        } else {
            format!("NaN(0x{:016x})", v.to_bits())
        }
    }

    /// The value of a string written by [`name`].
    fn parse(s: &str) -> Option<f64> {
        match s {
            "inf" => Some(f64::INFINITY),
            "-inf" => Some(f64::NEG_INFINITY),
            "NaN" => Some(f64::from_bits(CANONICAL_NAN)),
            _ => {
                let hex = s.strip_prefix("NaN(0x")?.strip_suffix(')')?;
                let v = f64::from_bits(u64::from_str_radix(hex, 16).ok()?);
                v.is_nan().then_some(v)
            }
        }
    }

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_str(&name(*v))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Number(f64),
            Text(String),
        }
        match Written::deserialize(d)? {
            Written::Number(v) => Ok(v),
            Written::Text(s) => parse(&s).ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "`{s}` is not a number (expected a JSON number, \"inf\", \"-inf\", \"NaN\" or \"NaN(0x<16 hex digits>)\")"
                ))
            }),
        }
    }
}

/// A file's size and CRC-32, as recorded in a [`Manifest`] when the file was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileChecksum {
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the contents.
    pub crc32: u32,
}

/// The file of rank `rank`'s pieces of a ZeRO-3 model in a checkpoint of `world_size` ranks.
pub(super) fn model_shard_file(rank: usize, world_size: usize) -> String {
    format!("model.rank-{rank:05}-of-{world_size:05}.safetensors")
}

/// Size and CRC-32 of the file at `path`, read in 1 MiB blocks.
pub(super) fn checksum_file(path: &Path) -> std::io::Result<FileChecksum> {
    use std::io::Read;
    let mut f = fs::File::open(path)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(FileChecksum {
        bytes,
        crc32: hasher.finalize(),
    })
}

/// Checks the checkpoint in `dir` (or its `.old` copy after an interrupted save) against its
/// manifest: the manifest's own seal, then the size and CRC-32 of every file it lists.
/// Returns the manifest; the error names the file that does not match. A checkpoint written
/// before checksums existed passes, with a warning (once per process).
pub fn verify_checkpoint(dir: impl AsRef<Path>) -> Result<Manifest> {
    let dir = dir.as_ref();
    let found = found(dir)?;
    let mpath = found.join(MANIFEST_FILE);
    let text = fs::read_to_string(&mpath).map_err(|e| io_err("reading", &mpath, e))?;
    let manifest = Manifest::from_sealed_json(&text, &mpath)?;
    if manifest.files.is_empty() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            crate::logging::warn_always(format_args!(
                "checkpoint {} has no checksums (written by an accelerate-rs before 0.2): it is loaded unverified",
                found.display()
            ))
        });
        return Ok(manifest);
    }
    let model_files: Vec<String> = match manifest.model_shards {
        Some(n) => (0..n).map(|r| model_shard_file(r, n)).collect(),
        None => vec![MODEL_FILE.to_string()],
    };
    if let Some(f) = model_files
        .iter()
        .find(|f| !manifest.files.contains_key(*f))
    {
        return Err(corrupt(&mpath, format!("it lists no checksum for {f}")));
    }
    for (name, want) in &manifest.files {
        let path = found.join(name);
        if verified(&path, want) {
            continue;
        }
        let got = match checksum_file(&path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(corrupt(&path, "the file is missing"))
            }
            Err(e) => return Err(io_err("reading", &path, e)),
        };
        if got.bytes != want.bytes {
            return Err(corrupt(
                &path,
                format!(
                    "it has {} bytes, the manifest recorded {} (truncated or replaced)",
                    got.bytes, want.bytes
                ),
            ));
        }
        if got.crc32 != want.crc32 {
            return Err(corrupt(
                &path,
                format!(
                    "its CRC-32 is {:08x}, the manifest recorded {:08x} (damaged or replaced)",
                    got.crc32, want.crc32
                ),
            ));
        }
        remember_verified(&path, want);
    }
    Ok(manifest)
}

/// Files verified in this process (path, checksum, modification time), so that resuming
/// ([`latest_checkpoint`](super::latest_checkpoint) then `load_state`) reads each file once for
/// its checksum.
static VERIFIED: std::sync::Mutex<Vec<(PathBuf, FileChecksum, Option<std::time::SystemTime>)>> =
    std::sync::Mutex::new(Vec::new());

fn mtime(path: &Path) -> Option<std::time::SystemTime> {
    fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn verified(path: &Path, sum: &FileChecksum) -> bool {
    let now = mtime(path);
    now.is_some()
        && VERIFIED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|(p, s, t)| p == path && s == sum && *t == now)
}

fn remember_verified(path: &Path, sum: &FileChecksum) {
    let mut v = VERIFIED.lock().unwrap_or_else(|p| p.into_inner());
    if v.len() > 64 {
        v.remove(0);
    }
    v.push((path.to_path_buf(), *sum, mtime(path)));
}

pub(super) fn is_complete(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
}

/// The directory `load_state(dir)` reads: `dir` when complete, else `dir.old` when complete
/// (a crash between the two renames of a save), else `None`.
pub fn resolve_checkpoint(dir: impl AsRef<Path>) -> Option<PathBuf> {
    let dir = dir.as_ref();
    if is_complete(dir) {
        return Some(dir.to_path_buf());
    }
    let old = with_suffix(dir, ".old");
    is_complete(&old).then_some(old)
}

/// [`resolve_checkpoint`], or an error naming `dir` when it holds no complete checkpoint.
fn found(dir: &Path) -> Result<PathBuf> {
    resolve_checkpoint(dir).ok_or_else(|| Error::InvalidArgument {
        name: format!("checkpoint {}", dir.display()),
        reason: format!(
            "no complete checkpoint here: {MANIFEST_FILE} is missing (and there is no complete `.old` copy)"
        ),
    })
}

/// Reads a checkpoint's manifest (falling back to `<dir>.old` like
/// [`Accelerator::load_state`](crate::Accelerator::load_state)), without checking its seal or
/// files: [`verify_checkpoint`] does both.
pub fn read_manifest(dir: impl AsRef<Path>) -> Result<Manifest> {
    let path = found(dir.as_ref())?.join(MANIFEST_FILE);
    let text = fs::read_to_string(&path).map_err(|e| io_err("reading", &path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::CheckpointCorrupt {
        path: path.clone(),
        reason: format!("the manifest does not parse: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn optimizer(lr: f64) -> OptimizerManifest {
        OptimizerManifest {
            step: 7,
            lr,
            tensors: vec!["0.m".into()],
            shards: None,
            shapes: Vec::new(),
        }
    }

    fn manifest(lrs: [f64; 3]) -> Manifest {
        Manifest {
            version: "0.1.0".into(),
            world_size: 2,
            step: 529,
            optimizer: Some(optimizer(lrs[0])),
            schedule_step: Some(529),
            loader: None,
            samples: None,
            parameters: vec!["w".into()],
            model_shards: None,
            model_shapes: Vec::new(),
            extra: BTreeMap::from([("note".into(), "0.1 + 0.2 = 0.30000000000000004".into())]),
            models: BTreeMap::new(),
            optimizers: BTreeMap::from([
                ("critic".into(), optimizer(lrs[1])),
                ("gen".into(), optimizer(lrs[2])),
            ]),
            states: Vec::new(),
            files: BTreeMap::from([(
                MODEL_FILE.into(),
                FileChecksum {
                    bytes: 12,
                    crc32: 0xdead_beef,
                },
            )]),
            checksum: None,
            manifest_crc32: None,
        }
    }

    fn same_bits(a: &Manifest, b: &Manifest) -> bool {
        let lrs = |m: &Manifest| {
            std::iter::once(m.optimizer.as_ref().map(|o| o.lr.to_bits()))
                .chain(m.optimizers.values().map(|o| Some(o.lr.to_bits())))
                .collect::<Vec<_>>()
        };
        lrs(a) == lrs(b)
    }

    /// The first format's text: the manifest with `checksum` set to the CRC-32 of its own
    /// serialization without it (as accelerate-rs 0.1 wrote it).
    fn first_format(m: &Manifest) -> String {
        let mut m = m.clone();
        m.checksum = None;
        let crc = crc32fast::hash(serde_json::to_string_pretty(&m).unwrap().as_bytes());
        m.checksum = Some(crc);
        serde_json::to_string_pretty(&m).unwrap()
    }

    fn round_trip(m: &Manifest) -> Manifest {
        let text = m.to_sealed_json().unwrap();
        let back = Manifest::from_sealed_json(&text, Path::new("manifest.json")).unwrap();
        assert!(back.manifest_crc32.is_some());
        back
    }

    /// Learning rates of a warmup-cosine schedule that serde_json's default float parser
    /// brought back one ULP off, failing the first format's check on load.
    const ONE_ULP_OFF: [f64; 3] = [
        0.00038289406344429013,
        0.00014000000000000001,
        0.0009999949531800825,
    ];

    #[test]
    fn learning_rates_that_broke_the_first_format_come_back_exactly() {
        let m = manifest(ONE_ULP_OFF);
        let back = round_trip(&m);
        assert!(same_bits(&m, &back));
        // And a manifest of the first format holding them verifies now.
        let old = first_format(&m);
        let read = Manifest::from_sealed_json(&old, Path::new("manifest.json")).unwrap();
        assert!(same_bits(&m, &read));
    }

    #[test]
    fn an_edit_anywhere_breaks_the_seal() {
        let text = manifest(ONE_ULP_OFF).to_sealed_json().unwrap();
        for edit in [
            text.replacen("\"step\": 529", "\"step\": 530", 1),
            text.replacen("0.1 + 0.2", "0.1 + 0.3", 1),
            text.replacen(SEAL_LINE, ",\n \"manifest_crc32\": ", 1),
            text.replacen("\"world_size\": 2", "\"world_size\":  2", 1),
        ] {
            assert_ne!(edit, text);
            let err = Manifest::from_sealed_json(&edit, Path::new("m.json")).unwrap_err();
            assert!(
                matches!(&err, Error::CheckpointCorrupt { reason, .. } if reason.contains("edited")),
                "{err}"
            );
        }
        // A first-format manifest with an edited step fails its own check.
        let old = first_format(&manifest(ONE_ULP_OFF)).replacen("529", "530", 1);
        assert!(Manifest::from_sealed_json(&old, Path::new("m.json")).is_err());
    }

    #[test]
    fn non_finite_rates_are_written_as_strings_and_read_back() {
        let weird_nan = f64::from_bits(0xfff0_0000_0000_0001);
        let m = manifest([f64::INFINITY, f64::NEG_INFINITY, weird_nan]);
        let text = m.to_sealed_json().unwrap();
        assert!(text.contains("\"inf\"") && text.contains("\"NaN(0xfff0000000000001)\""));
        assert!(same_bits(&m, &round_trip(&m)));
        assert!(same_bits(
            &manifest([f64::NAN; 3]),
            &round_trip(&manifest([f64::NAN; 3]))
        ));
        let bad = text.replace("\"inf\"", "\"infinity\"");
        assert!(Manifest::from_sealed_json(&bad, Path::new("m.json")).is_err());
    }

    fn any_f64() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<u64>().prop_map(f64::from_bits),
            // Subnormals and their neighbours.
            (0u64..(1 << 53)).prop_map(f64::from_bits),
            (0u64..(1 << 53)).prop_map(|b| -f64::from_bits(b)),
            Just(f64::MAX),
            Just(f64::MIN),
            Just(f64::MIN_POSITIVE),
            Just(f64::EPSILON),
            Just(-0.0),
            // Rates as schedules make them: a few ULPs around a cosine of a fraction.
            (1u32..100_000, 1u32..100_000, -3i64..4).prop_map(|(a, b, ulps)| {
                let x =
                    1e-3 * 0.5 * (1.0 + (std::f64::consts::PI * a as f64 / (a + b) as f64).cos());
                f64::from_bits((x.to_bits() as i64 + ulps) as u64)
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn every_f64_survives_a_sealed_manifest(a in any_f64(), b in any_f64(), c in any_f64()) {
            let m = manifest([a, b, c]);
            let back = round_trip(&m);
            prop_assert!(same_bits(&m, &back));
            prop_assert_eq!(back.step, 529);
            // The first format's check passes too now that parsing is exact (non-finite
            // values did not exist in it: JSON has no number for them).
            if a.is_finite() && b.is_finite() && c.is_finite() {
                let old = first_format(&m);
                prop_assert!(Manifest::from_sealed_json(&old, Path::new("m.json")).is_ok());
            }
        }
    }
}
