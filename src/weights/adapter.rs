//! PEFT adapter folders: `adapter_config.json` and `adapter_model.safetensors`, the tensors
//! named `base_model.model.<module path>.lora_A.weight` (and `lora_B`), as `peft`'s
//! `save_pretrained` writes them and `PeftModel.from_pretrained` reads them.

use std::fs;
use std::path::Path;

use serde_json::Value;

use super::model_file::{check_finite, model_write_err};
use super::place::{check_folder_target, fresh_tmp, place_files};
use crate::error::{Error, Result};
use crate::files::{write_json, write_safetensors};
use crate::nn::LoraConfig;
use crate::train::params::{named_tensors, Parameters};
use crate::train::weights::load_weights_mapped;

/// The adapter's settings in a PEFT adapter folder.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's tensors in a PEFT adapter folder.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT puts before a module path in the adapter file's tensor names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Writes a PEFT adapter folder `dir`: `config` as `adapter_config.json` (usually
/// [`LoraConfig::to_peft_json`] with the model's `base_model_name_or_path` and `task_type`) and
/// the `adapters`' tensors (named `<module path>.lora_A.weight`, ...) as
/// `adapter_model.safetensors` under PEFT's names (`base_model.model.` before each). Written
/// into `<dir>.tmp-<pid>`, then moved into `dir` (an earlier adapter's two files there are
/// replaced, every other file stays; `dir` being a file is an error); call it on one process.
///
/// ```
/// # fn main() -> accelerate_rs::Result<()> {
/// use accelerate_rs::checkpoint::{load_adapter, read_adapter_config, save_adapter};
/// use accelerate_rs::nn::{linear, LoraConfig, LoraLinear};
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
///
/// let dir = tempfile::tempdir().unwrap();
/// let (base, adapters) = (VarMap::new(), VarMap::new());
/// let fc = linear(8, 8, VarBuilder::from_varmap(&base, DType::F32, &Device::Cpu).pp("fc"))?;
/// let config = LoraConfig::new(2, 4.0).target_modules(["fc"]);
/// let vb = VarBuilder::from_varmap(&adapters, DType::F32, &Device::Cpu);
/// let fc = LoraLinear::new(fc, &config, vb.pp("fc"))?;
/// save_adapter(dir.path().join("adapter"), &config.to_peft_json(), &adapters)?;
///
/// let (read, _json) = read_adapter_config(dir.path().join("adapter"))?;
/// assert_eq!(read.r, 2);
/// load_adapter(dir.path().join("adapter"), &adapters)?; // all or nothing
/// # Ok(()) }
/// ```
pub fn save_adapter(
    dir: impl AsRef<Path>,
    config: &Value,
    adapters: &dyn Parameters,
) -> Result<()> {
    write_adapter(dir.as_ref(), config, adapters).map_err(model_write_err)
}

fn write_adapter(dir: &Path, config: &Value, adapters: &dyn Parameters) -> Result<()> {
    let tensors: Vec<_> = named_tensors(adapters)?
        .into_iter()
        .map(|(n, t)| (format!("{PEFT_PREFIX}{n}"), t))
        .collect();
    if tensors.is_empty() {
        return Err(Error::invalid(
            "adapters",
            format!("{}: there are no adapter tensors to save", dir.display()),
        ));
    }
    check_folder_target(dir)?;
    check_finite(dir, &tensors)?;
    let tmp = fresh_tmp(dir)?;
    let written = write_safetensors(&tmp.join(ADAPTER_WEIGHTS_FILE), &tensors)
        .and_then(|()| write_json(&tmp.join(ADAPTER_CONFIG_FILE), config));
    if let Err(e) = written {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    place_files(&tmp, dir, |_| false)
}

/// Reads `adapter_config.json` of the PEFT adapter folder `dir` (or the file itself): the
/// settings, and the whole JSON (for `base_model_name_or_path`, `task_type`, ...). Errors name
/// the file and the key.
pub fn read_adapter_config(dir: impl AsRef<Path>) -> Result<(LoraConfig, Value)> {
    let dir = dir.as_ref();
    let path = if dir.is_dir() {
        dir.join(ADAPTER_CONFIG_FILE)
    } else {
        dir.to_path_buf()
    };
    if !path.exists() {
        return Err(Error::Config {
            path: path.clone(),
            key: None,
            reason: format!("no such file: a PEFT adapter folder holds {ADAPTER_CONFIG_FILE} and {ADAPTER_WEIGHTS_FILE}"),
        });
    }
    let text = crate::files::read_bounded(&path, crate::files::MAX_JSON_BYTES)?;
    let json: Value = serde_json::from_slice(&text).map_err(|e| Error::Config {
        path: path.clone(),
        key: None,
        reason: format!("is not valid JSON: {e}"),
    })?;
    let config = LoraConfig::from_peft_json(&path, &json)?;
    Ok((config, json))
}

/// Loads `adapter_model.safetensors` of the PEFT adapter folder `dir` into `adapters` (named
/// `<module path>.lora_A.weight`, ...; the file's `base_model.model.` is dropped), all or
/// nothing: a missing or unexpected tensor, or one of another shape, is an error naming the
/// file and the tensor, and nothing changes.
pub fn load_adapter(dir: impl AsRef<Path>, adapters: &dyn Parameters) -> Result<()> {
    let file = dir.as_ref().join(ADAPTER_WEIGHTS_FILE);
    if !file.exists() {
        return Err(Error::ModelFile {
            path: file,
            tensor: None,
            reason: "missing: a PEFT adapter folder holds the adapter's tensors in it".into(),
            source: None,
        });
    }
    load_weights_mapped(&file, adapters, |name| {
        // A tensor without PEFT's prefix keeps its name, and is reported as unexpected.
        Some(name.strip_prefix(PEFT_PREFIX).unwrap_or(name).to_string())
    })
}
