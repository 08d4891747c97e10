//! What `accelerate-rs estimate-memory` reads about a model: its architecture from
//! `config.json` (through the registry: sizes, activations per token, parameters, LoRA targets)
//! and its tensors from the safetensors headers (`accelerate_rs::memory::ModelSpec::read`), never
//! the weights.

use std::path::Path;

use accelerate_rs::memory::ModelSpec;

use crate::config::read_json;
use crate::error::{Error, Result};
use crate::registry::{model_types, Config};

/// The model at `path` as the memory estimate sees it: a Hugging Face folder (its `config.json`
/// and its safetensors: `model.safetensors.index.json` with its shards, else `model.safetensors`,
/// else every `*.safetensors` file), a `config.json`, a safetensors file, or a sharded index
/// (`*.safetensors.index.json`). The tensors come from the safetensors headers when there are
/// any (a header-only file is enough), else from the architecture; the architecture from
/// `config.json` when one is read and its `model_type` is known (else the estimate reports it
/// unknown and counts no activations).
pub fn model_spec(path: &Path) -> Result<ModelSpec> {
    if path.is_dir() {
        return folder_spec(path);
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !path.exists() || name.ends_with(".safetensors") || name.ends_with(".index.json") {
        // Headers only; a missing path is an I/O error naming it (or the Hub hint).
        return Ok(ModelSpec::read(path)?);
    }
    let (file, json) = read_json(path)?;
    if json.get("weight_map").is_some() {
        return Ok(ModelSpec::read(path)?);
    }
    match Config::from_json(&file, &json) {
        Ok(config) => Ok(ModelSpec::from_architecture(config.memory_architecture()?)),
        Err(Error::Config { key: Some(k), .. }) if k == "model_type" => Err(Error::config(
            &file,
            Some("model_type"),
            format!(
                "{} is not an architecture the estimate knows ({}); give its safetensors files \
                 to count its parameters",
                json.get("model_type").unwrap_or(&serde_json::Value::Null),
                model_types().join(", ")
            ),
        )),
        Err(e) => Err(e),
    }
}

/// A folder: `config.json` for the architecture, the safetensors headers for the tensors.
fn folder_spec(dir: &Path) -> Result<ModelSpec> {
    let config = dir.join(accelerate_rs::checkpoint::CONFIG_FILE);
    let (architecture, unknown) = if config.exists() {
        accelerate_rs::files::check_regular(&config)?;
        let (file, json) = read_json(&config)?;
        let known = json
            .get("model_type")
            .and_then(|t| t.as_str())
            .is_some_and(|t| model_types().contains(&t));
        if known || json.get("model_type").is_none() {
            (
                Some(Config::from_json(&file, &json)?.memory_architecture()?),
                None,
            )
        } else {
            let t = json.get("model_type").map(|v| v.to_string());
            (None, t)
        }
    } else {
        (None, None)
    };
    let has_weights = dir.join(accelerate_rs::checkpoint::INDEX_FILE).exists()
        || std::fs::read_dir(dir)
            .map_err(|e| {
                Error::Accelerate(accelerate_rs::Error::Io {
                    context: "could not list".into(),
                    path: dir.to_path_buf(),
                    source: e,
                })
            })?
            .filter_map(|e| e.ok())
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"));
    let mut spec = match (has_weights, architecture) {
        (true, architecture) => {
            let spec = ModelSpec::read(dir)?;
            match architecture {
                Some(a) => spec.with_architecture(a),
                None => spec,
            }
        }
        (false, Some(a)) => ModelSpec::from_architecture(a),
        (false, None) => {
            return Err(Error::config(
                dir,
                None,
                if config.is_file() {
                    "its config.json has a model_type the estimate does not know and there is no \
                     safetensors file to count the parameters from"
                } else {
                    "no config.json and no safetensors file in this folder"
                },
            ))
        }
    };
    spec.unknown_model_type = unknown;
    Ok(spec)
}
