//! What the memory estimate reads: a model's tensors (names, shapes, dtypes) from safetensors
//! headers, and its architecture from a Hugging Face `config.json`. Only headers are read: the
//! 8-byte length and the JSON header of each safetensors file, never the weights, so a
//! header-only file (its data section absent) is accepted.

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

/// The architectures whose activations the estimate knows (Hugging Face's `model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArchKind {
    /// `llama`: pre-norm decoder, RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.
    Llama,
    /// `mistral`: the same block as Llama.
    Mistral,
    /// `qwen2`: Llama's block with biases on the query, key and value projections.
    Qwen2,
    /// `gpt2`: pre-norm decoder, LayerNorm, learned positions, GELU MLP, fused `c_attn`.
    Gpt2,
    /// `bert`: post-norm encoder, LayerNorm, learned positions and token types, GELU MLP.
    Bert,
}

impl ArchKind {
    /// Hugging Face's `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            ArchKind::Llama => "llama",
            ArchKind::Mistral => "mistral",
            ArchKind::Qwen2 => "qwen2",
            ArchKind::Gpt2 => "gpt2",
            ArchKind::Bert => "bert",
        }
    }

    /// The Linear layers `peft` targets by default for this architecture (its
    /// `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
    pub fn default_lora_targets(self) -> &'static [&'static str] {
        match self {
            ArchKind::Llama | ArchKind::Mistral | ArchKind::Qwen2 => &["q_proj", "v_proj"],
            ArchKind::Gpt2 => &["c_attn"],
            ArchKind::Bert => &["query", "value"],
        }
    }
}

/// The sizes of a transformer, from its `config.json`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Architecture {
    /// Which block the model stacks.
    pub kind: ArchKind,
    /// Width of the residual stream (`hidden_size`, GPT-2's `n_embd`).
    pub hidden: usize,
    /// Width of the MLP (`intermediate_size`, GPT-2's `n_inner`, default 4 × hidden).
    pub intermediate: usize,
    /// Blocks (`num_hidden_layers`, GPT-2's `n_layer`).
    pub layers: usize,
    /// Attention heads (`num_attention_heads`, GPT-2's `n_head`).
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`; the number of heads without grouped-query
    /// attention).
    pub kv_heads: usize,
    /// Width of one head (`head_dim`, default hidden / heads).
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (`max_position_embeddings`, GPT-2's `n_positions`).
    pub max_positions: usize,
    /// Whether the output layer shares the token embeddings (`tie_word_embeddings`).
    pub tie_embeddings: bool,
    /// BERT's token types (`type_vocab_size`); 0 for the others.
    pub type_vocab: usize,
}

/// A key of a config, read as a positive integer.
fn size_key(cfg: &Value, path: &Path, keys: &[&str], default: Option<usize>) -> Result<usize> {
    for key in keys {
        match cfg.get(key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let max = if matches!(*key, "num_hidden_layers" | "n_layer") {
                    crate::settings::limits::MAX_MODEL_LAYERS
                } else {
                    crate::settings::limits::MAX_MODEL_SIZE
                };
                return v
                    .as_u64()
                    .filter(|&n| n > 0 && n <= max as u64)
                    .map(|n| n as usize)
                    .ok_or_else(|| {
                        model_error(
                            path,
                            Some(key),
                            format!("expected a positive integer of at most {max}, got {v}"),
                        )
                    });
            }
        }
    }
    default.ok_or_else(|| {
        model_error(
            path,
            keys.first().copied(),
            format!("missing (looked for {})", keys.join(", ")),
        )
    })
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

impl Architecture {
    /// The architecture of a Hugging Face `config.json` (`path` names it in errors). `Ok(None)`
    /// for a `model_type` the estimate has no activation model for.
    pub fn from_config(cfg: &Value, path: &Path) -> Result<Option<Self>> {
        if !cfg.is_object() {
            return Err(model_error(path, None, "expected a JSON object"));
        }
        let kind =
            match cfg.get("model_type").and_then(Value::as_str) {
                Some("llama") => ArchKind::Llama,
                Some("mistral") => ArchKind::Mistral,
                Some("qwen2") => ArchKind::Qwen2,
                Some("gpt2") => ArchKind::Gpt2,
                Some("bert") => ArchKind::Bert,
                Some(_) => return Ok(None),
                None => return Err(model_error(
                    path,
                    Some("model_type"),
                    "missing: say which architecture this is (llama, mistral, qwen2, gpt2 or bert)",
                )),
            };
        let gpt2 = kind == ArchKind::Gpt2;
        let hidden = size_key(cfg, path, &["hidden_size", "n_embd"], None)?;
        let heads = size_key(cfg, path, &["num_attention_heads", "n_head"], None)?;
        let explicit_head_dim = cfg.get("head_dim").is_some_and(|v| !v.is_null());
        if !explicit_head_dim && hidden % heads != 0 {
            return Err(model_error(
                path,
                Some("num_attention_heads"),
                format!("{heads} heads do not divide the hidden size {hidden} (and no head_dim is given)"),
            ));
        }
        let head_dim = size_key(cfg, path, &["head_dim"], Some(hidden / heads))?;
        let kv_heads = size_key(cfg, path, &["num_key_value_heads"], Some(heads))?;
        if heads % kv_heads != 0 {
            return Err(model_error(
                path,
                Some("num_key_value_heads"),
                format!("{kv_heads} key/value heads do not divide the {heads} attention heads"),
            ));
        }
        let default_tie = gpt2 || kind == ArchKind::Bert;
        let tie_embeddings = match cfg.get("tie_word_embeddings") {
            None | Some(Value::Null) => default_tie,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(model_error(
                    path,
                    Some("tie_word_embeddings"),
                    format!("expected true or false, got {v}"),
                ))
            }
        };
        Ok(Some(Architecture {
            kind,
            hidden,
            intermediate: size_key(
                cfg,
                path,
                &["intermediate_size", "n_inner"],
                gpt2.then_some(4 * hidden),
            )?,
            layers: size_key(cfg, path, &["num_hidden_layers", "n_layer"], None)?,
            heads,
            kv_heads,
            head_dim,
            vocab: size_key(cfg, path, &["vocab_size"], None)?,
            max_positions: size_key(
                cfg,
                path,
                &["max_position_embeddings", "n_positions"],
                Some(2048),
            )?,
            tie_embeddings,
            type_vocab: if kind == ArchKind::Bert {
                size_key(cfg, path, &["type_vocab_size"], Some(2))?
            } else {
                0
            },
        }))
    }

    /// The parameters the Hugging Face model has, with its checkpoints' names, in `dtype` (a
    /// safetensors dtype name): what the estimate counts when no safetensors file is given.
    pub fn tensors(&self, dtype: &str) -> Vec<TensorInfo> {
        let (h, i, v) = (self.hidden, self.intermediate, self.vocab);
        let kv = self.kv_heads * self.head_dim;
        let q = self.heads * self.head_dim;
        let mut out = Vec::new();
        let mut add = |name: String, shape: Vec<usize>| {
            out.push(TensorInfo {
                name,
                shape,
                dtype: dtype.to_string(),
            })
        };
        match self.kind {
            ArchKind::Llama | ArchKind::Mistral | ArchKind::Qwen2 => {
                add("model.embed_tokens.weight".into(), vec![v, h]);
                for l in 0..self.layers {
                    let p = format!("model.layers.{l}");
                    add(format!("{p}.input_layernorm.weight"), vec![h]);
                    add(format!("{p}.self_attn.q_proj.weight"), vec![q, h]);
                    add(format!("{p}.self_attn.k_proj.weight"), vec![kv, h]);
                    add(format!("{p}.self_attn.v_proj.weight"), vec![kv, h]);
                    if self.kind == ArchKind::Qwen2 {
                        add(format!("{p}.self_attn.q_proj.bias"), vec![q]);
                        add(format!("{p}.self_attn.k_proj.bias"), vec![kv]);
                        add(format!("{p}.self_attn.v_proj.bias"), vec![kv]);
                    }
                    add(format!("{p}.self_attn.o_proj.weight"), vec![h, q]);
                    add(format!("{p}.post_attention_layernorm.weight"), vec![h]);
                    add(format!("{p}.mlp.gate_proj.weight"), vec![i, h]);
                    add(format!("{p}.mlp.up_proj.weight"), vec![i, h]);
                    add(format!("{p}.mlp.down_proj.weight"), vec![h, i]);
                }
                add("model.norm.weight".into(), vec![h]);
                if !self.tie_embeddings {
                    add("lm_head.weight".into(), vec![v, h]);
                }
            }
            ArchKind::Gpt2 => {
                add("wte.weight".into(), vec![v, h]);
                add("wpe.weight".into(), vec![self.max_positions, h]);
                for l in 0..self.layers {
                    let p = format!("h.{l}");
                    for ln in ["ln_1", "ln_2"] {
                        add(format!("{p}.{ln}.weight"), vec![h]);
                        add(format!("{p}.{ln}.bias"), vec![h]);
                    }
                    // GPT-2's Conv1D stores weights as [in, out].
                    add(format!("{p}.attn.c_attn.weight"), vec![h, 3 * h]);
                    add(format!("{p}.attn.c_attn.bias"), vec![3 * h]);
                    add(format!("{p}.attn.c_proj.weight"), vec![h, h]);
                    add(format!("{p}.attn.c_proj.bias"), vec![h]);
                    add(format!("{p}.mlp.c_fc.weight"), vec![h, i]);
                    add(format!("{p}.mlp.c_fc.bias"), vec![i]);
                    add(format!("{p}.mlp.c_proj.weight"), vec![i, h]);
                    add(format!("{p}.mlp.c_proj.bias"), vec![h]);
                }
                add("ln_f.weight".into(), vec![h]);
                add("ln_f.bias".into(), vec![h]);
                if !self.tie_embeddings {
                    add("lm_head.weight".into(), vec![v, h]);
                }
            }
            ArchKind::Bert => {
                add("bert.embeddings.word_embeddings.weight".into(), vec![v, h]);
                add(
                    "bert.embeddings.position_embeddings.weight".into(),
                    vec![self.max_positions, h],
                );
                add(
                    "bert.embeddings.token_type_embeddings.weight".into(),
                    vec![self.type_vocab, h],
                );
                add("bert.embeddings.LayerNorm.weight".into(), vec![h]);
                add("bert.embeddings.LayerNorm.bias".into(), vec![h]);
                for l in 0..self.layers {
                    let p = format!("bert.encoder.layer.{l}");
                    for m in [
                        "attention.self.query",
                        "attention.self.key",
                        "attention.self.value",
                        "attention.output.dense",
                    ] {
                        add(format!("{p}.{m}.weight"), vec![h, h]);
                        add(format!("{p}.{m}.bias"), vec![h]);
                    }
                    add(format!("{p}.attention.output.LayerNorm.weight"), vec![h]);
                    add(format!("{p}.attention.output.LayerNorm.bias"), vec![h]);
                    add(format!("{p}.intermediate.dense.weight"), vec![i, h]);
                    add(format!("{p}.intermediate.dense.bias"), vec![i]);
                    add(format!("{p}.output.dense.weight"), vec![h, i]);
                    add(format!("{p}.output.dense.bias"), vec![h]);
                    add(format!("{p}.output.LayerNorm.weight"), vec![h]);
                    add(format!("{p}.output.LayerNorm.bias"), vec![h]);
                }
            }
        }
        out
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

/// A model as the memory estimate sees it: its tensors and, when its `config.json` was read
/// and its architecture is known, its architecture.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// Its tensors (parameters and buffers).
    pub tensors: Vec<TensorInfo>,
    /// Where they came from.
    pub tensors_from: TensorSource,
    /// The architecture, when a `config.json` with a known `model_type` was read.
    pub architecture: Option<Architecture>,
    /// The `model_type` of a `config.json` whose architecture the estimate does not know.
    pub unknown_model_type: Option<String>,
}

impl ModelSpec {
    /// A model from a parsed `config.json` alone: its tensors computed from the architecture
    /// (in f32). `path` names the file in errors.
    pub fn from_config(cfg: &Value, path: &Path) -> Result<Self> {
        match Architecture::from_config(cfg, path)? {
            Some(arch) => Ok(ModelSpec {
                tensors: arch.tensors("F32"),
                tensors_from: TensorSource::Config,
                architecture: Some(arch),
                unknown_model_type: None,
            }),
            None => Err(model_error(
                path,
                Some("model_type"),
                format!(
                    "{} is not an architecture the estimate knows (llama, mistral, qwen2, gpt2, bert); give its safetensors files to count its parameters",
                    cfg.get("model_type").unwrap_or(&Value::Null)
                ),
            )),
        }
    }

    /// Floating-point elements over every tensor (the parameters).
    pub fn parameter_count(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.is_float())
            .map(TensorInfo::elem_count)
            .fold(0u64, u64::saturating_add)
    }

    /// Reads a model (headers only): a Hugging Face folder (its `config.json` and its
    /// safetensors: `model.safetensors.index.json` with its shards, else every `*.safetensors`
    /// file), a `config.json`, a safetensors file, or a sharded index
    /// (`*.safetensors.index.json`).
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
        if json.get("weight_map").is_some() {
            let (tensors, files, header_only) = read_index(path, &json)?;
            return Ok(ModelSpec {
                tensors,
                tensors_from: TensorSource::Safetensors { files, header_only },
                architecture: None,
                unknown_model_type: None,
            });
        }
        ModelSpec::from_config(&json, path)
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
    let config = dir.join("config.json");
    let (architecture, unknown, config_tensors) = if config.is_file() {
        let cfg = read_json(&config)?;
        match Architecture::from_config(&cfg, &config)? {
            Some(a) => {
                let t = a.tensors("F32");
                (Some(a), None, Some(t))
            }
            None => (None, cfg.get("model_type").map(|v| v.to_string()), None),
        }
    } else {
        (None, None, None)
    };
    let index = dir.join("model.safetensors.index.json");
    let found = if index.is_file() {
        let (t, files, header_only) = read_index(&index, &read_json(&index)?)?;
        Some((t, files, header_only))
    } else {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io_error("could not list", dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            None
        } else {
            let mut all = Vec::new();
            let mut header_only = false;
            for f in &files {
                let (t, h) = read_safetensors_header(f)?;
                all.extend(t);
                header_only |= h;
            }
            Some((all, files.len(), header_only))
        }
    };
    match (found, config_tensors) {
        (Some((tensors, files, header_only)), _) => Ok(ModelSpec {
            tensors,
            tensors_from: TensorSource::Safetensors { files, header_only },
            architecture,
            unknown_model_type: unknown,
        }),
        (None, Some(tensors)) => Ok(ModelSpec {
            tensors,
            tensors_from: TensorSource::Config,
            architecture,
            unknown_model_type: None,
        }),
        (None, None) => Err(model_error(
            dir,
            None,
            if config.is_file() {
                "its config.json has a model_type the estimate does not know and there is no safetensors file to count the parameters from"
            } else {
                "no config.json and no safetensors file in this folder"
            },
        )),
    }
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
