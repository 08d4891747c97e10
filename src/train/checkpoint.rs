//! Checkpoints: save the training state and resume it bit-identically, as methods on
//! [`Accelerator`](crate::Accelerator) (Hugging Face Accelerate's `save_state` / `load_state` / `save_model`).
//!
//! A checkpoint is a directory holding
//!
//! | file | contents |
//! |---|---|
//! | `model.safetensors` | the model's parameters, under their names ([`Parameters`]) |
//! | `optimizer.safetensors` | the optimizer's state tensors (`"{i}.m"`, ...; only with an optimizer) |
//! | `manifest.json` | [`Manifest`]: steps, learning rate, schedule step, loader position, world size, version, `extra` |
//!
//! What goes in is named explicitly with [`CheckpointParts`]; [`Accelerator::load_state`](crate::Accelerator::load_state) puts
//! the model and optimizer back and returns the [`Manifest`], from which the caller restores the
//! rest ([`DataLoader::resume_at`](crate::DataLoader::resume_at),
//! [`Schedule::set_step`](crate::scheduler::Schedule::set_step)):
//!
//! ```no_run
//! # use accelerate_rs::{Accelerator, DataLoader, TensorDataset};
//! # use accelerate_rs::checkpoint::{CheckpointParts, LoaderPosition, latest_checkpoint};
//! # use accelerate_rs::optim::AdamW;
//! # use candle_nn::VarMap;
//! # fn main() -> accelerate_rs::Result<()> {
//! # let acc = Accelerator::new()?;
//! # let varmap = VarMap::new();
//! # let mut opt = AdamW::new_lr(varmap.all_vars(), 1e-3)?;
//! # let mut loader: DataLoader = todo!();
//! # let (step, epoch, batches_done) = (0u64, 0u64, 0usize);
//! // Save (every rank calls it; the main process writes):
//! let parts = CheckpointParts::new(&varmap)
//!     .optimizer(&opt)
//!     .loader(LoaderPosition { epoch, batches_done })
//!     .step(step);
//! acc.save_state_auto("ckpts", &parts, 3)?;
//!
//! // Resume (every rank reads the same files):
//! if let Some(dir) = latest_checkpoint("ckpts") {
//!     let manifest = acc.load_state(&dir, &varmap, Some(&mut opt))?;
//!     if let Some(pos) = manifest.loader {
//!         loader.resume_at(pos.epoch, pos.batches_done);
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! **Every rank** must call [`save_state`](crate::Accelerator::save_state),
//! [`save_state_auto`](crate::Accelerator::save_state_auto) and [`save_model`](crate::Accelerator::save_model)
//! at the same point: only the main process writes, the others wait for it and get its error, if
//! any. The directory must be visible to every rank (the same machine, or a shared file system)
//! for [`load_state`](crate::Accelerator::load_state).
//!
//! **Atomicity.** The main process writes everything into `<dir>.tmp-<pid>`, syncs it, and only
//! then renames it to `<dir>`. A directory cannot be renamed over a non-empty one, so an existing
//! `<dir>` is first renamed to `<dir>.old`, and removed once the new one is in place. A crash
//! leaves either the old checkpoint (as `<dir>` or `<dir>.old`, which `load_state` falls back
//! to) or the new one, never a mix; `manifest.json` is written last, so a directory without it
//! is never taken for a checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::optim::{AdamW, OptimizerState, Sgd};
use crate::train::mixed_precision::MixedPrecisionOptimizer;
use crate::train::optimizer::AcceleratedOptimizer;
use crate::train::params::Parameters;

/// The model file inside a checkpoint.
pub const MODEL_FILE: &str = "model.safetensors";
/// The optimizer state file inside a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The manifest inside a checkpoint; written last, so its presence marks a complete checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The prefix of the directories written by [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto).
pub const AUTO_PREFIX: &str = "checkpoint_";

/// An optimizer whose state can go into a checkpoint: [`AdamW`], [`Sgd`], and an
/// [`AcceleratedOptimizer`] wrapping one of them.
pub trait StatefulOptimizer {
    /// A snapshot of the state (see [`OptimizerState`]).
    fn optimizer_state(&self) -> Result<OptimizerState>;
    /// Puts a state back; errors (changing nothing) when it does not fit the parameters.
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()>;
}

impl StatefulOptimizer for AdamW {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        self.state()
    }
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.load_state(state)
    }
}

impl StatefulOptimizer for Sgd {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        self.state()
    }
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.load_state(state)
    }
}

impl<O: candle_nn::Optimizer + StatefulOptimizer> StatefulOptimizer for AcceleratedOptimizer<O> {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        self.inner().optimizer_state()
    }
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.inner_mut().load_optimizer_state(state)
    }
}

/// The state of the optimizer stepping the f32 masters; load the masters themselves with
/// [`Accelerator::load_state`](crate::Accelerator::load_state) and then call
/// [`sync_working_copies`](MixedPrecisionOptimizer::sync_working_copies).
impl<O: candle_nn::Optimizer + StatefulOptimizer> StatefulOptimizer for MixedPrecisionOptimizer<O> {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        self.accelerated().optimizer_state()
    }
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.accelerated_mut().load_optimizer_state(state)
    }
}

/// Where a data loader stands: `batches_done` batches of `epoch` were consumed. Give it back to
/// [`DataLoader::resume_at`](crate::DataLoader::resume_at).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderPosition {
    /// The epoch in progress.
    pub epoch: u64,
    /// Batches of that epoch already trained on (per rank; the same on every rank).
    pub batches_done: usize,
}

/// What [`Accelerator::save_state`](crate::Accelerator::save_state) writes. Built with [`new`](Self::new) and the setters.
pub struct CheckpointParts<'a> {
    /// The model's parameters (required).
    pub model: &'a dyn Parameters,
    /// The optimizer, if its state is to be saved.
    pub optimizer: Option<&'a dyn StatefulOptimizer>,
    /// The learning-rate schedule's step ([`Schedule::current_step`](crate::scheduler::Schedule::current_step)).
    pub schedule_step: Option<u64>,
    /// The data loader's position.
    pub loader: Option<LoaderPosition>,
    /// The data loader's position in global samples (resumable at any world size).
    pub samples: Option<crate::data::SamplePosition>,
    /// The training loop's own step counter.
    pub step: u64,
    /// Free-form strings saved in the manifest.
    pub extra: BTreeMap<String, String>,
}

impl std::fmt::Debug for CheckpointParts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointParts")
            .field("optimizer", &self.optimizer.is_some())
            .field("schedule_step", &self.schedule_step)
            .field("loader", &self.loader)
            .field("samples", &self.samples)
            .field("step", &self.step)
            .field("extra", &self.extra)
            .finish()
    }
}

impl<'a> CheckpointParts<'a> {
    /// Parts holding only `model` (step 0).
    pub fn new(model: &'a dyn Parameters) -> Self {
        CheckpointParts {
            model,
            optimizer: None,
            schedule_step: None,
            loader: None,
            samples: None,
            step: 0,
            extra: BTreeMap::new(),
        }
    }
    /// Saves the loader's position in **global samples**
    /// ([`DataLoader::sample_position`](crate::DataLoader::sample_position) or
    /// [`StreamingLoader`](crate::StreamingLoader)'s): unlike [`loader`](Self::loader), it
    /// resumes at any world size, each sample not yet seen exactly once
    /// ([`DataLoader::resume_from`](crate::DataLoader::resume_from)).
    pub fn samples(mut self, position: crate::data::SamplePosition) -> Self {
        self.samples = Some(position);
        self
    }
    /// Saves this optimizer's state too.
    pub fn optimizer(mut self, optimizer: &'a dyn StatefulOptimizer) -> Self {
        self.optimizer = Some(optimizer);
        self
    }
    /// Saves the schedule's step.
    pub fn schedule_step(mut self, step: u64) -> Self {
        self.schedule_step = Some(step);
        self
    }
    /// Saves the loader's position.
    pub fn loader(mut self, position: LoaderPosition) -> Self {
        self.loader = Some(position);
        self
    }
    /// Sets the training loop's step.
    pub fn step(mut self, step: u64) -> Self {
        self.step = step;
        self
    }
    /// Adds a free-form `key = value` to the manifest.
    pub fn extra(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }
}

/// The optimizer's scalars in a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerManifest {
    /// Optimizer steps taken.
    pub step: u64,
    /// The learning rate in force.
    pub lr: f64,
    /// The names of the tensors in `optimizer.safetensors`, in order.
    pub tensors: Vec<String>,
}

/// `manifest.json`: everything in a checkpoint besides tensors. Returned by
/// [`Accelerator::load_state`](crate::Accelerator::load_state) and [`read_manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The accelerate-rs version that wrote it.
    pub version: String,
    /// The number of processes of the run that wrote it.
    pub world_size: usize,
    /// The training loop's step ([`CheckpointParts::step`]).
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
    /// Free-form strings ([`CheckpointParts::extra`]).
    pub extra: BTreeMap<String, String>,
    /// Size and CRC-32 of every file of the checkpoint, checked by [`verify_checkpoint`] and on
    /// every load (empty in checkpoints written before checksums existed: those load unverified,
    /// with a warning).
    #[serde(default)]
    pub files: BTreeMap<String, FileChecksum>,
    /// CRC-32 of this manifest as written with this field unset, so that an edited manifest
    /// (a changed step, a swapped file list) is caught too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<u32>,
}

/// A file's size and CRC-32, as recorded in a [`Manifest`] when the file was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileChecksum {
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the contents.
    pub crc32: u32,
}

/// Size and CRC-32 of the file at `path`, read in 1 MiB blocks.
fn checksum_file(path: &Path) -> std::io::Result<FileChecksum> {
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

/// The CRC-32 of `m`'s JSON form with [`Manifest::checksum`] unset.
fn manifest_crc(m: &Manifest, path: &Path) -> Result<u32> {
    let mut bare = m.clone();
    bare.checksum = None;
    let text = serde_json::to_string_pretty(&bare)
        .map_err(|e| checkpoint_err(path, format!("could not serialize the manifest: {e}")))?;
    Ok(crc32fast::hash(text.as_bytes()))
}

fn corrupt(path: &Path, reason: impl Into<String>) -> Error {
    Error::CheckpointCorrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn write_err(path: &Path, reason: impl Into<String>, source: Option<std::io::Error>) -> Error {
    Error::CheckpointWrite {
        path: path.to_path_buf(),
        reason: reason.into(),
        source,
    }
}

/// Checks the checkpoint in `dir` (or its `.old` copy after an interrupted save) against its
/// manifest: the manifest's own checksum, then the size and CRC-32 of every file it lists.
/// Returns the manifest; the error names the file that does not match. A checkpoint written
/// before checksums existed passes, with a warning (once per process).
pub fn verify_checkpoint(dir: impl AsRef<Path>) -> Result<Manifest> {
    let dir = dir.as_ref();
    let manifest = read_manifest(dir)?;
    let found = resolve_checkpoint(dir).unwrap_or_else(|| dir.to_path_buf());
    let mpath = found.join(MANIFEST_FILE);
    if let Some(sum) = manifest.checksum {
        if manifest_crc(&manifest, &mpath)? != sum {
            return Err(corrupt(
                &mpath,
                "its checksum does not match its contents (the manifest was edited or damaged)",
            ));
        }
    }
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
    if !manifest.files.contains_key(MODEL_FILE) {
        return Err(corrupt(
            &mpath,
            format!("it lists no checksum for {MODEL_FILE}"),
        ));
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
/// ([`latest_checkpoint`] then `load_state`) reads each file once for its checksum.
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

fn io_err(context: impl Into<String>, path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        context: context.into(),
        path: path.to_path_buf(),
        source,
    }
}

fn checkpoint_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::invalid(format!("checkpoint {}", path.display()), reason)
}

/// `path` with `suffix` appended to its last component.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

fn is_complete(dir: &Path) -> bool {
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

/// Reads a checkpoint's manifest (falling back to `<dir>.old` like
/// [`Accelerator::load_state`](crate::Accelerator::load_state)).
pub fn read_manifest(dir: impl AsRef<Path>) -> Result<Manifest> {
    let dir = dir.as_ref();
    let found = resolve_checkpoint(dir).ok_or_else(|| {
        checkpoint_err(
            dir,
            format!("no complete checkpoint here: {MANIFEST_FILE} is missing (and there is no complete `.old` copy)"),
        )
    })?;
    let path = found.join(MANIFEST_FILE);
    let text = fs::read_to_string(&path).map_err(|e| io_err("reading", &path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| checkpoint_err(&path, format!("the manifest does not parse: {e}")))
}

/// The number `N` of a `checkpoint_<N>` directory name.
fn auto_number(name: &str) -> Option<u64> {
    name.strip_prefix(AUTO_PREFIX)?.parse().ok()
}

/// The `checkpoint_<N>` entries of `root` (complete or not), sorted by `N`.
fn auto_entries(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let n = auto_number(name.to_str()?)?;
            Some((n, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// The newest sound checkpoint written by [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto) under `root`: the
/// `checkpoint_<N>` with the largest `N` that is complete (its manifest exists, or its `.old`
/// copy is complete) and passes [`verify_checkpoint`]. A newer checkpoint that fails
/// verification is skipped with a warning naming the bad file, so a run resumes from the newest
/// one that is intact. Partial directories (`*.tmp-<pid>` of a crashed save, `*.deleting-<pid>`
/// of an interrupted rotation) are ignored. `None` when there is none (or `root` does not
/// exist).
pub fn latest_checkpoint(root: impl AsRef<Path>) -> Option<PathBuf> {
    for dir in complete_checkpoints(root.as_ref()).into_iter().rev() {
        match verify_checkpoint(&dir) {
            Ok(_) => return Some(dir),
            Err(e) => crate::logging::warn_always(format_args!(
                "skipping checkpoint {}: {e}; falling back to an older one",
                dir.display()
            )),
        }
    }
    None
}

/// The complete `checkpoint_<N>` directories under `root`, oldest first (not verified).
fn complete_checkpoints(root: &Path) -> Vec<PathBuf> {
    let mut numbers: Vec<u64> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let name = name.to_str()?;
            auto_number(name.strip_suffix(".old").unwrap_or(name))
        })
        .collect();
    numbers.sort_unstable();
    numbers.dedup();
    numbers
        .into_iter()
        .map(|n| root.join(format!("{AUTO_PREFIX}{n}")))
        .filter(|dir| resolve_checkpoint(dir).is_some())
        .collect()
}

/// Parameters as a name → tensor map, checking that names are unique.
fn named_tensors(model: &dyn Parameters) -> Result<Vec<(String, Tensor)>> {
    let mut named: Vec<(String, Tensor)> = model
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some(w) = named.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(Error::invalid(
            "model parameters",
            format!("the name `{}` is used twice", w[0].0),
        ));
    }
    Ok(named)
}

fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
    // Create it first, so that a refusal (missing folder, no space, no permission) comes with
    // its OS error.
    fs::File::create(path).map_err(|e| write_err(path, "could not create the file", Some(e)))?;
    candle_core::safetensors::save(&map, path).map_err(|e| match e {
        candle_core::Error::Io(io) => write_err(path, "the file system refused it", Some(io)),
        e => write_err(path, e.to_string(), None),
    })?;
    sync_file(path)
}

fn sync_file(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("syncing", path, e))
}

fn sync_dir(path: &Path) {
    // Best effort: not every platform can fsync a directory.
    if let Ok(f) = fs::File::open(path) {
        let _ = f.sync_all();
    }
}

/// Test-only hook ([`env::TEST_CRASH_AFTER`](crate::env::TEST_CRASH_AFTER)`=<file>`): the main process exits (code 3)
/// right after writing that file of a checkpoint, as a kill would.
fn crash_hook(file: &str) {
    let var = crate::settings::env::TEST_CRASH_AFTER;
    if matches!(crate::settings::parse::process_env::<String>(var), Ok(Some(v)) if v == file) {
        log::error!("{var}={file}: exiting mid-save");
        std::process::exit(3);
    }
}

/// Writes a checkpoint into `tmp` (which must not exist).
fn write_checkpoint(tmp: &Path, parts: &CheckpointParts<'_>, world_size: usize) -> Result<()> {
    fs::create_dir_all(tmp).map_err(|e| io_err("creating", tmp, e))?;
    let model = named_tensors(parts.model)?;
    write_safetensors(&tmp.join(MODEL_FILE), &model)?;
    crash_hook(MODEL_FILE);
    let optimizer = match parts.optimizer {
        Some(opt) => {
            let state = opt.optimizer_state()?;
            write_safetensors(&tmp.join(OPTIMIZER_FILE), &state.tensors)?;
            crash_hook(OPTIMIZER_FILE);
            Some(OptimizerManifest {
                step: state.step,
                lr: state.lr,
                tensors: state.tensors.iter().map(|(n, _)| n.clone()).collect(),
            })
        }
        None => None,
    };
    // Checksums of the files as they are on disk.
    let mut files = BTreeMap::new();
    for name in [MODEL_FILE, OPTIMIZER_FILE] {
        let path = tmp.join(name);
        if path.is_file() {
            let sum = checksum_file(&path).map_err(|e| io_err("reading back", &path, e))?;
            files.insert(name.to_string(), sum);
        }
    }
    let path = tmp.join(MANIFEST_FILE);
    let mut manifest = Manifest {
        version: env!("CARGO_PKG_VERSION").to_string(),
        world_size,
        step: parts.step,
        optimizer,
        schedule_step: parts.schedule_step,
        loader: parts.loader,
        samples: parts.samples,
        parameters: model.iter().map(|(n, _)| n.clone()).collect(),
        extra: parts.extra.clone(),
        files,
        checksum: None,
    };
    manifest.checksum = Some(manifest_crc(&manifest, &path)?);
    let text = serde_json::to_string_pretty(&manifest)
        .map_err(|e| checkpoint_err(&path, format!("could not serialize the manifest: {e}")))?;
    let mut f = fs::File::create(&path).map_err(|e| io_err("creating", &path, e))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err("writing", &path, e))?;
    sync_dir(tmp);
    Ok(())
}

/// Writes `parts` to `dir` atomically (see the module docs). Main process only.
fn save_atomic(dir: &Path, parts: &CheckpointParts<'_>, world_size: usize) -> Result<()> {
    let tmp = with_suffix(dir, &format!(".tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing stale", &tmp, e))?;
    }
    if let Err(e) = write_checkpoint(&tmp, parts, world_size) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let old = with_suffix(dir, ".old");
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| io_err("removing stale", &old, e))?;
        }
        fs::rename(dir, &old).map_err(|e| io_err("renaming the previous checkpoint", dir, e))?;
    }
    fs::rename(&tmp, dir).map_err(|e| io_err("renaming the new checkpoint into", dir, e))?;
    if let Some(parent) = dir.parent() {
        sync_dir(parent);
    }
    if old.exists() {
        fs::remove_dir_all(&old)
            .map_err(|e| io_err("removing the previous checkpoint", &old, e))?;
    }
    Ok(())
}

/// Loads a safetensors file of a checkpoint onto `device`.
fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(checkpoint_err(path, "the file is missing"));
    }
    candle_core::safetensors::load(path, device)
        .map_err(|e| checkpoint_err(path, format!("could not read: {e}")))
}

/// Whether a float tensor holds a NaN or an infinity.
fn non_finite(t: &Tensor) -> Result<bool> {
    let t = t.to_dtype(candle_core::DType::F32)?;
    let count = |m: Tensor| -> Result<u32> {
        Ok(m.to_dtype(candle_core::DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()?)
    };
    Ok(count(t.ne(&t)?)? + count(t.abs()?.eq(f64::INFINITY)?)? > 0)
}

/// Checks `file`'s tensors against `model` and returns `(var, value)` pairs to set; nothing is
/// changed here.
fn fit_model(
    path: &Path,
    mut tensors: HashMap<String, Tensor>,
    model: &dyn Parameters,
) -> Result<Vec<(candle_core::Var, Tensor)>> {
    let mut named = model.named_parameters();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(named.len());
    for (name, var) in named {
        let t = tensors.remove(&name).ok_or_else(|| {
            checkpoint_err(
                path,
                format!("parameter `{name}` is missing (the model has it, the file does not)"),
            )
        })?;
        if t.dims() != var.dims() {
            return Err(checkpoint_err(
                path,
                format!(
                    "parameter `{name}` has shape {:?} in the file, but {:?} in the model",
                    t.dims(),
                    var.dims()
                ),
            ));
        }
        if t.dtype().is_float() && non_finite(&t)? {
            return Err(corrupt(
                path,
                format!("parameter `{name}` holds NaN or infinite values (a diverged run was saved, or the file was damaged)"),
            ));
        }
        let t = t.to_device(var.device())?.to_dtype(var.dtype())?;
        out.push((var, t));
    }
    if let Some(extra) = tensors.keys().min() {
        return Err(checkpoint_err(
            path,
            format!(
                "parameter `{extra}` is in the file but not in the model ({} unexpected in all)",
                tensors.len()
            ),
        ));
    }
    Ok(out)
}

// Checkpoint writing and reading across the ranks of one run, on a collective (the
// `Accelerator` methods of the same names call these).

/// The lock file of a checkpoint folder.
pub const LOCK_FILE: &str = ".accelerate-rs.lock";

/// Checkpoint folders this process has locked, with their open lock files: a lock lasts as long
/// as its file is open, i.e. until this process ends (so a crashed run never blocks the next).
static LOCKS: std::sync::Mutex<Vec<(PathBuf, fs::File)>> = std::sync::Mutex::new(Vec::new());

/// This machine's host name, for lock files.
fn host_name() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "an unknown host".into())
}

/// Takes (once per process) the exclusive lock of checkpoint folder `folder`: two runs saving
/// into one folder would overwrite and rotate away each other's checkpoints. Fails with
/// [`Error::CheckpointLocked`], naming the holder, when another live process holds it.
fn lock_folder(folder: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    fs::create_dir_all(folder).map_err(|e| io_err("creating", folder, e))?;
    let key = folder
        .canonicalize()
        .unwrap_or_else(|_| folder.to_path_buf());
    let mut locks = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    if locks.iter().any(|(p, _)| *p == key) {
        return Ok(());
    }
    let path = folder.join(LOCK_FILE);
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io_err("opening the lock file", &path, e))?;
    // SAFETY: `flock` on the descriptor of `f`, which stays open for the whole call; it only
    // changes the lock state of the open file, no memory is involved.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let holder = fs::read_to_string(&path)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "a process that wrote no details".into());
            return Err(Error::CheckpointLocked {
                path: folder.to_path_buf(),
                holder,
            });
        }
        return Err(io_err("locking", &path, err));
    }
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let who = format!(
        "pid {} on {}, since {since} (Unix time)",
        std::process::id(),
        host_name()
    );
    f.set_len(0)
        .and_then(|()| f.write_all(who.as_bytes()))
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err("writing the lock file", &path, e))?;
    locks.push((key, f));
    Ok(())
}

/// See [`Accelerator::save_state`](crate::Accelerator::save_state).
pub(crate) fn save_state(
    c: &dyn Collective,
    dir: &Path,
    parts: &CheckpointParts<'_>,
) -> Result<()> {
    let result = if c.rank() == 0 {
        let folder = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        lock_folder(&folder).and_then(|()| save_atomic(dir, parts, c.world_size()))
    } else {
        Ok(())
    };
    agree(c, "save_state", dir, result)
}

/// See [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto).
pub(crate) fn save_state_auto(
    c: &dyn Collective,
    root: &Path,
    parts: &CheckpointParts<'_>,
    total_limit: usize,
) -> Result<PathBuf> {
    // Every rank lists `root` before anyone writes, so all pick the same N.
    let next = auto_entries(root)
        .iter()
        .map(|(n, _)| n + 1)
        .chain(latest_number(root).map(|n| n + 1))
        .max()
        .unwrap_or(0);
    c.barrier()?;
    let dir = root.join(format!("{AUTO_PREFIX}{next}"));
    let result = if c.rank() == 0 {
        lock_folder(root)
            .and_then(|()| save_atomic(&dir, parts, c.world_size()))
            .and_then(|()| rotate(root, total_limit))
    } else {
        Ok(())
    };
    agree(c, "save_state_auto", &dir, result)?;
    Ok(dir)
}

/// See [`Accelerator::save_model`](crate::Accelerator::save_model).
pub(crate) fn save_model(c: &dyn Collective, path: &Path, model: &dyn Parameters) -> Result<()> {
    let result = if c.rank() == 0 {
        let tmp = with_suffix(path, &format!(".tmp-{}", std::process::id()));
        named_tensors(model)
            .and_then(|t| write_safetensors(&tmp, &t))
            .and_then(|()| {
                fs::rename(&tmp, path).map_err(|e| io_err("renaming the model into", path, e))
            })
    } else {
        Ok(())
    };
    agree(c, "save_model", path, result)
}

/// The index Hugging Face tooling reads next to sharded safetensors files.
pub const SHARD_INDEX_FILE: &str = "model.safetensors.index.json";

/// Groups `tensors` (in name order) into shards of at most `max_bytes` each (a tensor larger
/// than that gets a shard of its own).
fn plan_shards(tensors: &[(String, Tensor)], max_bytes: usize) -> Vec<Vec<(String, Tensor)>> {
    let mut shards: Vec<Vec<(String, Tensor)>> = Vec::new();
    let mut size = 0usize;
    for (name, t) in tensors {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        if shards.is_empty() || (size + bytes > max_bytes && size > 0) {
            shards.push(Vec::new());
            size = 0;
        }
        if let Some(last) = shards.last_mut() {
            last.push((name.clone(), t.clone()));
        }
        size += bytes;
    }
    shards
}

/// Writes the model into `dir` as Hugging Face does: `model.safetensors` when it fits in one
/// shard of `max_shard_bytes`, else `model-0000i-of-0000n.safetensors` files and
/// `model.safetensors.index.json` (`metadata.total_size`, `weight_map`). Main process only;
/// written into `<dir>.tmp-<pid>` and renamed into place.
fn write_sharded(dir: &Path, model: &dyn Parameters, max_shard_bytes: usize) -> Result<()> {
    if max_shard_bytes == 0 {
        return Err(Error::invalid("max_shard_size", "must be at least 1 byte"));
    }
    let tensors = named_tensors(model)?;
    let shards = plan_shards(&tensors, max_shard_bytes);
    let tmp = with_suffix(dir, &format!(".tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing stale", &tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| write_err(&tmp, "could not create it", Some(e)))?;
    let n = shards.len();
    if n <= 1 {
        write_safetensors(&tmp.join(MODEL_FILE), &tensors)?;
    } else {
        let mut weight_map = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            write_safetensors(&tmp.join(&name), shard)?;
            for (t, _) in shard {
                weight_map.insert(t.clone(), name.clone());
            }
        }
        let total: usize = tensors
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let path = tmp.join(SHARD_INDEX_FILE);
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| write_err(&path, format!("could not serialize the index: {e}"), None))?;
        fs::write(&path, text).map_err(|e| write_err(&path, "could not write it", Some(e)))?;
        sync_file(&path)?;
    }
    sync_dir(&tmp);
    let old = with_suffix(dir, ".old");
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| io_err("removing stale", &old, e))?;
        }
        fs::rename(dir, &old).map_err(|e| io_err("renaming the previous model", dir, e))?;
    }
    fs::rename(&tmp, dir).map_err(|e| io_err("renaming the new model into", dir, e))?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io_err("removing the previous model", &old, e))?;
    }
    Ok(())
}

/// See [`Accelerator::save_model_sharded`](crate::Accelerator::save_model_sharded).
pub(crate) fn save_model_sharded(
    c: &dyn Collective,
    dir: &Path,
    model: &dyn Parameters,
    max_shard_bytes: usize,
) -> Result<()> {
    let result = if c.rank() == 0 {
        write_sharded(dir, model, max_shard_bytes)
    } else {
        Ok(())
    };
    agree(c, "save_model_sharded", dir, result)
}

/// See [`Accelerator::load_state`](crate::Accelerator::load_state): reads onto `device`;
/// `world_size` is only compared with the writer's, for the log.
pub(crate) fn load_state(
    device: &Device,
    world_size: usize,
    dir: &Path,
    model: &dyn Parameters,
    optimizer: Option<&mut dyn StatefulOptimizer>,
) -> Result<Manifest> {
    let manifest = verify_checkpoint(dir)?;
    let found = resolve_checkpoint(dir).unwrap_or_else(|| dir.to_path_buf());
    if found != dir {
        log::warn!(
            "checkpoint {} is incomplete; loading {} (a save was interrupted)",
            dir.display(),
            found.display()
        );
    }
    if manifest.world_size != world_size {
        log::info!(
            "checkpoint {} was written by {} process(es), loading into {}",
            found.display(),
            manifest.world_size,
            world_size
        );
    }
    let model_path = found.join(MODEL_FILE);
    let sets = fit_model(&model_path, read_safetensors(&model_path, device)?, model)?;
    let opt_state = match (&optimizer, &manifest.optimizer) {
        (Some(_), Some(m)) => {
            let path = found.join(OPTIMIZER_FILE);
            let mut tensors = read_safetensors(&path, device)?;
            let mut ordered = Vec::with_capacity(m.tensors.len());
            for name in &m.tensors {
                let t = tensors.remove(name).ok_or_else(|| {
                    checkpoint_err(&path, format!("optimizer tensor `{name}` is missing"))
                })?;
                ordered.push((name.clone(), t));
            }
            Some(OptimizerState {
                step: m.step,
                lr: m.lr,
                tensors: ordered,
            })
        }
        (Some(_), None) => {
            return Err(checkpoint_err(
                &found,
                "an optimizer was given, but the checkpoint holds no optimizer state",
            ))
        }
        (None, _) => None,
    };
    if let (Some(opt), Some(state)) = (optimizer, opt_state) {
        opt.load_optimizer_state(state).map_err(|e| {
            checkpoint_err(
                &found.join(OPTIMIZER_FILE),
                format!("does not fit the optimizer: {e}"),
            )
        })?;
    }
    for (var, t) in sets {
        var.set(&t)?;
    }
    Ok(manifest)
}

/// Makes every rank return the main process's result of a write.
fn agree(c: &dyn Collective, op: &str, path: &Path, result: Result<()>) -> Result<()> {
    let mut ok = [if result.is_ok() { 1f32 } else { 0f32 }];
    c.broadcast((&mut ok[..]).into(), 0)?;
    result?;
    if ok[0] != 1.0 {
        return Err(write_err(
            path,
            format!("{op} failed on the main process, rank 0 (see its error)"),
            None,
        ));
    }
    Ok(())
}

/// The largest `N` of a complete checkpoint under `root` (sound or not: a new checkpoint never
/// takes the number of a damaged one).
fn latest_number(root: &Path) -> Option<u64> {
    complete_checkpoints(root)
        .last()
        .and_then(|p| p.file_name().and_then(|n| n.to_str()).and_then(auto_number))
}

/// Keeps the newest `total_limit` complete `checkpoint_<N>` directories under `root` and removes
/// the rest, plus leftovers of crashed saves.
fn rotate(root: &Path, total_limit: usize) -> Result<()> {
    let entries = fs::read_dir(root).map_err(|e| io_err("listing", root, e))?;
    let mut complete = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(AUTO_PREFIX) {
            continue;
        }
        if name.contains(".tmp-")
            || name.contains(DELETING)
            || (name.ends_with(".old") && {
                let base = path.with_file_name(name.trim_end_matches(".old"));
                is_complete(&base)
            })
        {
            remove_dir_safely(&path)?;
            continue;
        }
        if let Some(n) = auto_number(name) {
            if is_complete(&path) {
                complete.push((n, path));
            }
        }
    }
    if total_limit == 0 || complete.len() <= total_limit {
        return Ok(());
    }
    complete.sort();
    let excess = complete.len() - total_limit;
    for (_, path) in complete.into_iter().take(excess) {
        remove_dir_safely(&path)?;
    }
    Ok(())
}

/// The infix of a directory being deleted by rotation.
const DELETING: &str = ".deleting-";

/// Removes a checkpoint directory without ever leaving a half-deleted checkpoint under its
/// name: it is first renamed to `<name>.deleting-<pid>` (which no loader reads), then removed.
fn remove_dir_safely(path: &Path) -> Result<()> {
    let doomed = if path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains(DELETING))
    {
        path.to_path_buf()
    } else {
        let doomed = with_suffix(path, &format!("{DELETING}{}", std::process::id()));
        fs::rename(path, &doomed).map_err(|e| io_err("renaming for removal", path, e))?;
        doomed
    };
    fs::remove_dir_all(&doomed).map_err(|e| io_err("removing", &doomed, e))
}
