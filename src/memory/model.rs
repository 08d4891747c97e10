//! What the memory estimate reads: a model's tensors (names, shapes, dtypes) from safetensors
//! headers, and the description of its architecture ([`Architecture`], given by whoever knows
//! it). Only headers are read: the 8-byte length and the JSON header of each safetensors file,
//! never the weights, so a header-only file (its data section absent) is accepted.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

/// One tensor of a checkpoint: its name, shape and dtype (as safetensors names it: `F32`,
/// `BF16`, `I64`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Its dimensions.
    pub shape: Vec<usize>,
    /// Its dtype's safetensors name.
    pub dtype: String,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elem_count(&self) -> u64 {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .unwrap_or(u64::MAX)
    }

    /// Whether it holds floating-point numbers (a trainable parameter rather than an integer
    /// buffer such as BERT's `position_ids`).
    pub fn is_float(&self) -> bool {
        matches!(
            self.dtype.as_str(),
            "F16" | "BF16" | "F32" | "F64" | "F8_E4M3" | "F8_E5M2"
        )
    }
}

/// An architecture as the memory estimate sees it: its sizes, what its blocks keep per token for
/// the backward pass, its default LoRA targets and its parameters. The estimate knows no
/// architecture itself: whoever does fills this in (`accelerate-rs-models`'
/// `memory_architecture`, from a `config.json`, as Accelerate's estimate asks `transformers`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Architecture {
    /// Its name (Hugging Face's `model_type`), for reports.
    pub name: String,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the widest per-token branch (the MLP's inner width).
    pub intermediate: usize,
    /// Blocks.
    pub layers: usize,
    /// Query heads: the attention weights kept per token are heads × keys, in f32.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (the default sequence length of an estimate).
    pub max_positions: usize,
    /// Elements one block keeps per token for the backward pass, in the compute dtype, as
    /// accelerate-rs's `nn` layers keep them (the attention weights apart).
    pub block_elements: u64,
    /// Elements kept per token outside the blocks (embeddings, final norm), in the compute
    /// dtype.
    pub outer_elements: u64,
    /// Whether the model ends in a vocabulary-sized output layer whose logits are kept (a
    /// language model's head; an encoder's task head is not counted).
    pub lm_head: bool,
    /// The Linear layers `peft` targets by default (its
    /// `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`): what LoRA adapts when no target is
    /// named.
    pub default_lora_targets: Vec<String>,
    /// The parameters (names and shapes, as the checkpoints name them): what the estimate counts
    /// when no safetensors file is given.
    pub parameters: Vec<TensorInfo>,
}

fn model_error(path: &Path, key: Option<&str>, reason: impl Into<String>) -> Error {
    let reason = reason.into();
    Error::ModelFile {
        path: path.to_path_buf(),
        tensor: None,
        reason: match key {
            Some(k) => format!("`{k}`: {reason}"),
            None => reason,
        },
        source: None,
    }
}

/// Where a model's tensors were read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorSource {
    /// Computed from `config.json` (no safetensors file given).
    Config,
    /// Read from the headers of `files` safetensors files; `header_only`: at least one of them
    /// has no (or a partial) data section.
    Safetensors {
        /// How many files.
        files: usize,
        /// Whether some file lacks its data section.
        header_only: bool,
    },
}

/// A model as the memory estimate sees it: its tensors and, when its architecture is known, its
/// architecture.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// Its tensors (parameters and buffers).
    pub tensors: Vec<TensorInfo>,
    /// Where they came from.
    pub tensors_from: TensorSource,
    /// The architecture, when known.
    pub architecture: Option<Architecture>,
    /// The `model_type` of a `config.json` whose architecture is not known (reported).
    pub unknown_model_type: Option<String>,
}

impl ModelSpec {
    /// A model from its architecture alone: its tensors are the architecture's parameters.
    pub fn from_architecture(architecture: Architecture) -> Self {
        ModelSpec {
            tensors: architecture.parameters.clone(),
            tensors_from: TensorSource::Config,
            architecture: Some(architecture),
            unknown_model_type: None,
        }
    }

    /// The same tensors, with their architecture.
    pub fn with_architecture(mut self, architecture: Architecture) -> Self {
        self.architecture = Some(architecture);
        self
    }

    /// Floating-point elements over every tensor (the parameters).
    pub fn parameter_count(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.is_float())
            .map(TensorInfo::elem_count)
            .fold(0u64, u64::saturating_add)
    }

    /// Reads a model's tensors (headers only): a folder's safetensors
    /// (`model.safetensors.index.json` with its shards, else `model.safetensors`, else every
    /// `*.safetensors` file), a
    /// safetensors file, or a sharded index (`*.safetensors.index.json`). Its architecture is
    /// unknown (`None`): `config.json` is read by whoever knows architectures
    /// (`accelerate_rs_models::model_spec` reads both).
    pub fn read(path: &Path) -> Result<Self> {
        let meta = std::fs::metadata(path).map_err(|e| match hub_id(path, &e) {
            Some(id) => Error::ModelFile {
                path: path.to_path_buf(),
                tensor: None,
                reason: format!(
                    "no such file or folder here; it looks like a Hugging Face Hub id, and models are read from local files only (headers, never weights). Fetch its config first, e.g. `huggingface-cli download {id} config.json model.safetensors.index.json --local-dir {}` (or `accelerate_rs_models::hub::download`), then pass that folder",
                    id.rsplit('/').next().unwrap_or(id)
                ),
                source: Some(e),
            },
            None => io_error("could not read", path, e),
        })?;
        if meta.is_dir() {
            return read_folder(path);
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.ends_with(".safetensors") {
            let (tensors, header_only) = read_safetensors_header(path)?;
            return Ok(ModelSpec {
                tensors,
                tensors_from: TensorSource::Safetensors {
                    files: 1,
                    header_only,
                },
                architecture: None,
                unknown_model_type: None,
            });
        }
        let json = read_json(path)?;
        if json.get("weight_map").is_none() {
            return Err(model_error(
                path,
                None,
                "not a safetensors file or a sharded index (no `weight_map`); a config.json is \
                 read with the architecture (accelerate-rs-models' `model_spec`)",
            ));
        }
        let (tensors, files, header_only) = read_index(path, &json)?;
        Ok(ModelSpec {
            tensors,
            tensors_from: TensorSource::Safetensors { files, header_only },
            architecture: None,
            unknown_model_type: None,
        })
    }
}

/// `path` as a Hugging Face Hub id (`owner/name`) when it is one that names nothing here.
fn hub_id<'a>(path: &'a Path, e: &std::io::Error) -> Option<&'a str> {
    let text = path.to_str()?;
    let (owner, name) = text.split_once('/')?;
    let plain = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let a_file = [".json", ".safetensors"].iter().any(|x| name.ends_with(x));
    let unlike_a_path = !a_file && !Path::new(owner).exists();
    (e.kind() == std::io::ErrorKind::NotFound && plain(owner) && plain(name) && unlike_a_path)
        .then_some(text)
}

fn io_error(what: &str, path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        context: what.to_string(),
        path: path.to_path_buf(),
        source,
    }
}

fn read_json(path: &Path) -> Result<Value> {
    crate::files::read_json(path)
}

fn read_folder(dir: &Path) -> Result<ModelSpec> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let (tensors, files, header_only) = read_index(&index, &read_json(&index)?)?;
        return Ok(ModelSpec {
            tensors,
            tensors_from: TensorSource::Safetensors { files, header_only },
            architecture: None,
            unknown_model_type: None,
        });
    }
    // A Hugging Face folder's single file, else every safetensors file there.
    let single = dir.join("model.safetensors");
    let mut files: Vec<PathBuf> = if single.exists() {
        vec![single]
    } else {
        std::fs::read_dir(dir)
            .map_err(|e| io_error("could not list", dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect()
    };
    files.sort();
    if files.is_empty() {
        return Err(model_error(dir, None, "no safetensors file in this folder"));
    }
    let mut tensors = Vec::new();
    let mut header_only = false;
    for f in &files {
        let (t, h) = read_safetensors_header(f)?;
        tensors.extend(t);
        header_only |= h;
    }
    Ok(ModelSpec {
        tensors,
        tensors_from: TensorSource::Safetensors {
            files: files.len(),
            header_only,
        },
        architecture: None,
        unknown_model_type: None,
    })
}

/// The tensors of every shard of a sharded checkpoint's index (`weight_map`: tensor name ->
/// file, relative to the index), checking that each shard holds the tensors the index puts
/// there. Returns them, the number of shards, and whether some shard is header-only.
fn read_index(path: &Path, json: &Value) -> Result<(Vec<TensorInfo>, usize, bool)> {
    let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
        return Err(model_error(
            path,
            Some("weight_map"),
            "expected an object of tensor name -> file",
        ));
    };
    let mut files: Vec<&str> = Vec::new();
    for (name, file) in map {
        let Some(f) = file.as_str() else {
            return Err(model_error(
                path,
                Some("weight_map"),
                format!("tensor `{name}`: expected a file name, got {file}"),
            ));
        };
        if f.contains('/') || f.contains('\\') || f == ".." {
            return Err(model_error(
                path,
                Some("weight_map"),
                format!("tensor `{name}`: shard `{f}` must be a file name beside the index"),
            ));
        }
        if !files.contains(&f) {
            files.push(f);
        }
    }
    if files.is_empty() {
        return Err(model_error(path, Some("weight_map"), "is empty"));
    }
    files.sort_unstable();
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut all = Vec::new();
    let mut header_only = false;
    for f in &files {
        let shard = dir.join(f);
        let (tensors, h) = read_safetensors_header(&shard)?;
        header_only |= h;
        for (name, file) in map {
            if file.as_str() == Some(f) && !tensors.iter().any(|t| &t.name == name) {
                return Err(model_error(
                    &shard,
                    None,
                    format!(
                        "the index {} puts tensor `{name}` here, but the file does not hold it",
                        path.display()
                    ),
                ));
            }
        }
        all.extend(tensors);
    }
    Ok((all, files.len(), header_only))
}

/// The tensors of one safetensors file from its header (the 8-byte little-endian length and the
/// JSON header), checked by [`SafetensorsHeader::read`](crate::files::SafetensorsHeader::read):
/// a regular file (links followed), known dtypes, offsets that match the shapes and tile the
/// data section, no tensor named twice. Returns them (in offset order) and whether the file's
/// data section is shorter than the header says (a header-only file).
pub fn read_safetensors_header(path: &Path) -> Result<(Vec<TensorInfo>, bool)> {
    let header = crate::files::SafetensorsHeader::read(path)?;
    let complete = header.is_complete();
    let tensors = header
        .tensors
        .into_iter()
        .map(|t| TensorInfo {
            name: t.name,
            shape: t.shape,
            dtype: t.dtype,
        })
        .collect();
    Ok((tensors, !complete))
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
