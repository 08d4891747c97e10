//! Hugging Face `config.json` files: the reading and parsing the architectures' configurations
//! share (a missing key or a value of the wrong type is an error naming the file and the key),
//! and the checks of their values.

use std::path::{Path, PathBuf};

use candle_core::DType;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where a configuration was read from: the file (named in errors) and the keys it had (a
/// `null` is written back only where the file had one).
#[derive(Debug, Clone, Default)]
pub(crate) struct Origin {
    pub(crate) path: PathBuf,
    pub(crate) present: std::collections::BTreeSet<String>,
}

impl Origin {
    /// The origin of `json`, read from `path`.
    pub(crate) fn of(path: &Path, json: &serde_json::Value) -> Self {
        Origin {
            path: path.to_path_buf(),
            present: json
                .as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default(),
        }
    }
}

/// What to do about a model path that does not exist: a Hub id (`owner/name`) is downloaded
/// first; otherwise nothing to add.
pub(crate) fn missing_hint(path: &Path) -> String {
    let text = path.to_string_lossy();
    let id = match text.split_once('/') {
        Some((owner, name))
            if !owner.is_empty()
                && !name.is_empty()
                && !name.contains('/')
                && !name.ends_with(".json")
                && !owner.starts_with('.')
                && !Path::new(owner).exists() =>
        {
            text.as_ref()
        }
        _ => return String::new(),
    };
    format!(
        " (models load from local folders: for the Hugging Face Hub model `{id}`, download it first, e.g. `huggingface-cli download {id} --local-dir DIR`, or call `accelerate_rs_models::hub::download` with the crate's `hub` feature)"
    )
}

/// Reads a JSON file (or `config.json` in a folder): the file's path and its value. Only a
/// regular file (links followed) of at most `accelerate_rs::files::MAX_JSON_BYTES` is read.
pub(crate) fn read_json(path: &Path) -> Result<(PathBuf, serde_json::Value)> {
    let path = if path.is_dir() {
        path.join(accelerate_rs::checkpoint::CONFIG_FILE)
    } else {
        path.to_path_buf()
    };
    read_json_file(&path)
}

/// Whether anything is at `path`: a file, a folder, a FIFO or a link (one that leads nowhere
/// too). An optional file of a model folder (`generation_config.json`, `chat_template.jinja`)
/// that is there but is no readable file is an error naming it when read: taken as absent, a
/// broken download would change what a run does without a word.
pub(crate) fn present(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// [`read_json`] of the file `path` itself (a folder there is an error, not its `config.json`).
pub(crate) fn read_json_file(path: &Path) -> Result<(PathBuf, serde_json::Value)> {
    let path = path.to_path_buf();
    if !present(&path) {
        return Err(Error::config(
            &path,
            None,
            format!("could not read it: no such file{}", missing_hint(&path)),
        ));
    }
    let bytes = accelerate_rs::files::read_bounded(&path, accelerate_rs::files::MAX_JSON_BYTES)?;
    let json: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::config(&path, None, format!("not valid JSON: {e}")))?;
    if !json.is_object() {
        return Err(Error::config(&path, None, "expected a JSON object"));
    }
    Ok((path, json))
}

/// The model folder `dir` a loader was given, checked to be one: a file (`config.json` itself,
/// a weights file) is an error saying to pass its folder.
pub(crate) fn model_folder(dir: &Path) -> Result<&Path> {
    if dir.is_dir() {
        return Ok(dir);
    }
    if dir.exists() {
        let folder = dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        return Err(Error::config(
            dir,
            None,
            format!(
                "a model is loaded from its folder, and this is a file: pass the folder ({})",
                folder.display()
            ),
        ));
    }
    // Absent: read_json's error names it (with the Hub hint).
    read_json(dir).map(|_| dir)
}

/// Deserializes `json` into `T`, naming the key of a missing or mistyped value.
pub(crate) fn parse<T: DeserializeOwned>(path: &Path, json: &serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(json).map_err(|e| {
        let at = e.path().to_string();
        let inner = e.into_inner().to_string();
        // serde's message for a missing key is "missing field `name`".
        if let Some(rest) = inner.strip_prefix("missing field `") {
            let key = rest.split('`').next().unwrap_or(rest);
            let key = if at == "." || at.is_empty() {
                key.to_string()
            } else {
                format!("{at}.{key}")
            };
            return Error::config(path, Some(&key), "missing (required)");
        }
        let key = (at != "." && !at.is_empty()).then_some(at);
        Error::config(path, key.as_deref(), inner)
    })
}

/// An activation function, by its `transformers` name (`hidden_act`, `activation_function`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Activation {
    /// `gelu`: the exact GELU, `x Φ(x)` (erf).
    #[serde(rename = "gelu")]
    Gelu,
    /// `gelu_new`: the tanh approximation.
    #[serde(rename = "gelu_new")]
    GeluNew,
    /// `gelu_pytorch_tanh`: the tanh approximation.
    #[serde(rename = "gelu_pytorch_tanh")]
    GeluPytorchTanh,
    /// `gelu_fast`: the tanh approximation.
    #[serde(rename = "gelu_fast")]
    GeluFast,
    /// `relu`.
    #[serde(rename = "relu")]
    Relu,
    /// `silu`: `x σ(x)`.
    #[serde(rename = "silu")]
    Silu,
    /// `swish`: `x σ(x)`.
    #[serde(rename = "swish")]
    Swish,
}

impl Activation {
    /// Applies it (differentiable: the tanh GELU, ReLU and SiLU are `accelerate_rs::nn`'s fused
    /// ops, the exact GELU Candle's).
    pub fn apply(self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        match self {
            Activation::Gelu => x.gelu_erf(),
            Activation::GeluNew | Activation::GeluPytorchTanh | Activation::GeluFast => {
                accelerate_rs::nn::gelu(x)
            }
            Activation::Relu => accelerate_rs::nn::relu(x),
            Activation::Silu | Activation::Swish => accelerate_rs::nn::silu(x),
        }
    }
}

/// The `transformers` name of a dtype (`config.json`'s `dtype` / `torch_dtype`).
pub(crate) fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

/// A configuration as `config.json`: `value` (the configuration's own serialization, unknown
/// keys included) with `architectures` set to `class` and `dtype` (and `torch_dtype` when
/// present) to the dtype the weights are saved in.
pub(crate) fn to_config_json(
    mut value: serde_json::Value,
    class: &str,
    dtype: DType,
) -> serde_json::Value {
    if let Some(map) = value.as_object_mut() {
        map.insert("architectures".into(), serde_json::json!([class]));
        map.insert("dtype".into(), dtype_name(dtype).into());
        if map.contains_key("torch_dtype") {
            map.insert("torch_dtype".into(), dtype_name(dtype).into());
        }
    }
    value
}

/// `max_position_embeddings` among a configuration's other keys (2048 when absent): the
/// default sequence length of a memory estimate.
pub(crate) fn max_position_embeddings(extra: &serde_json::Map<String, serde_json::Value>) -> usize {
    extra
        .get("max_position_embeddings")
        .and_then(serde_json::Value::as_u64)
        .map_or(2048, |n| n as usize)
}

/// A configuration's JSON form: its serialization with `model_type` set, without the `null`s of
/// optional keys the original file did not have.
pub(crate) fn config_value<T: Serialize>(
    config: &T,
    present: &std::collections::BTreeSet<String>,
    model_type: &str,
) -> serde_json::Value {
    let mut v = serde_json::to_value(config)
        .unwrap_or_else(|_| serde_json::Value::Object(Default::default()));
    if let Some(m) = v.as_object_mut() {
        m.retain(|k, v| !v.is_null() || present.contains(k));
        m.insert("model_type".into(), model_type.into());
    }
    v
}

use accelerate_rs::limits::{MAX_MODEL_LAYERS, MAX_MODEL_SIZE};

/// Checks that each size `(key, value)` of a configuration read from `path` is from 1 to
/// `accelerate_rs::limits::MAX_MODEL_SIZE`.
pub(crate) fn ensure_sizes(path: &Path, sizes: &[(&str, usize)]) -> Result<()> {
    for &(key, v) in sizes {
        ensure(v > 0, path, key, "must be at least 1")?;
        ensure(
            v <= MAX_MODEL_SIZE,
            path,
            key,
            format!("{v} is over the largest size accepted, {MAX_MODEL_SIZE}"),
        )?;
    }
    Ok(())
}

/// Checks a layer count `(key, value)`: at most `accelerate_rs::limits::MAX_MODEL_LAYERS`.
pub(crate) fn ensure_layers(path: &Path, (key, v): (&str, usize)) -> Result<()> {
    ensure(
        v <= MAX_MODEL_LAYERS,
        path,
        key,
        format!("{v} layers is over the most accepted, {MAX_MODEL_LAYERS}"),
    )
}

/// Checks that each value `(key, value)` that must be positive (an epsilon) is a finite number
/// above 0: a zero or negative epsilon divides by zero or takes the root of a negative number,
/// and the model trains to NaN.
pub(crate) fn ensure_positive(path: &Path, values: &[(&str, f64)]) -> Result<()> {
    for &(key, v) in values {
        ensure(
            v.is_finite() && v > 0.0,
            path,
            key,
            format!("{v}: must be a finite number above 0"),
        )?;
    }
    Ok(())
}

/// Checks `initializer_range` (the standard deviation of fresh weights): finite, not negative.
pub(crate) fn ensure_init_range(path: &Path, v: f64) -> Result<()> {
    ensure(
        v.is_finite() && v >= 0.0,
        path,
        "initializer_range",
        format!("{v}: must be a finite number, 0 or above"),
    )
}

/// `key`'s value `v` is a multiple of `of`'s value `n` (a width split into heads); the error
/// names `key` and ends with `note` (empty for none).
pub(crate) fn ensure_multiple(
    path: &Path,
    (key, v): (&str, usize),
    (of, n): (&str, usize),
    note: &str,
) -> Result<()> {
    ensure(
        n > 0 && v.is_multiple_of(n),
        path,
        key,
        format!("{v} is not a multiple of {of} = {n}{note}"),
    )
}

/// `layer_types`, when given: one entry per layer, each `full_attention` or
/// `sliding_attention`.
pub(crate) fn ensure_layer_types(
    path: &Path,
    types: Option<&[String]>,
    layers: usize,
) -> Result<()> {
    let Some(types) = types else {
        return Ok(());
    };
    ensure(
        types.len() == layers,
        path,
        "layer_types",
        format!("{} entries for {layers} layers", types.len()),
    )?;
    match types
        .iter()
        .find(|t| !matches!(t.as_str(), "full_attention" | "sliding_attention"))
    {
        Some(bad) => Err(Error::config(
            path,
            Some("layer_types"),
            format!("`{bad}` is not full_attention or sliding_attention"),
        )),
        None => Ok(()),
    }
}

/// Each dropout probability is in [0, 1).
pub(crate) fn ensure_probabilities(path: &Path, probabilities: &[(&str, f64)]) -> Result<()> {
    for &(key, p) in probabilities {
        ensure((0.0..1.0).contains(&p), path, key, "must be in [0, 1)")?;
    }
    Ok(())
}

/// A check on a parsed configuration: `Ok` when `ok`, else an error naming `key`.
pub(crate) fn ensure(ok: bool, path: &Path, key: &str, reason: impl Into<String>) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::config(path, Some(key), reason))
    }
}
