//! A 4-bit base (QLoRA): the linear layers of a model held as `accelerate_rs::nn::Linear4bit`
//! (NF4 or FP4, bitsandbytes' format) while the embeddings, norms, biases and the output layer
//! stay in the compute dtype, as `transformers` + bitsandbytes load a model with
//! `BitsAndBytesConfig(load_in_4bit=True)`. What is here: [`Base4bit`] (the quantized layers by
//! module path, shared by every rebuild of the model), the `VarBuilder` backend that hands the
//! layers' constructors a storage-free placeholder for a quantized weight, reading or quantizing
//! the weights from a folder one at a time, and `config.json`'s `quantization_config`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use accelerate_rs::checkpoint::WeightFiles;
use accelerate_rs::nn::Linear4bit;
use accelerate_rs::quant::{Quant4bitConfig, QuantType, Weight4bit};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::Init;
use serde_json::{json, Value};

use crate::error::{Error, Result};

/// The suffixes of the tensors a `transformers` 4-bit folder saves beside a layer's `weight`.
const STATE_SUFFIXES: [&str; 6] = [
    ".absmax",
    ".quant_map",
    ".nested_absmax",
    ".nested_quant_map",
    ".quant_state.bitsandbytes__nf4",
    ".quant_state.bitsandbytes__fp4",
];

/// The quantized linear layers of a model, by module path (`model.layers.0.self_attn.q_proj`),
/// each a frozen [`Linear4bit`] without its bias (the bias stays a parameter of the model, in
/// the compute dtype), and how they were quantized (`config.json`'s `quantization_config`).
#[derive(Debug, Clone)]
pub(crate) struct Base4bit {
    layers: BTreeMap<String, Linear4bit>,
    config: Quant4bitConfig,
}

impl Base4bit {
    /// The quantized layer at `path`, if it is one.
    pub(crate) fn layer(&self, path: &str) -> Option<&Linear4bit> {
        self.layers.get(path)
    }

    /// Whether the parameter `name` is a quantized layer's weight (`<path>.weight`).
    pub(crate) fn holds(&self, name: &str) -> bool {
        name.strip_suffix(".weight")
            .is_some_and(|p| self.layers.contains_key(p))
    }

    /// The quantized layers.
    pub(crate) fn layers(&self) -> impl Iterator<Item = (&String, &Linear4bit)> {
        self.layers.iter()
    }

    /// Elements of the quantized weights.
    pub(crate) fn elem_count(&self) -> usize {
        self.layers
            .values()
            .map(|l| l.weight().shape().iter().product::<usize>())
            .sum()
    }

    /// Bytes the quantized weights hold (codes, scales, maps).
    pub(crate) fn nbytes(&self) -> usize {
        self.layers.values().map(Linear4bit::nbytes).sum()
    }

    /// `config.json`'s `quantization_config`, as `transformers` writes it for
    /// `BitsAndBytesConfig(load_in_4bit=True, ...)`, `compute` the compute dtype.
    pub(crate) fn quantization_config(&self, compute: DType) -> Value {
        quantization_json(&self.config, compute)
    }
}

/// `transformers`' `quantization_config` for a 4-bit model quantized by `config`.
fn quantization_json(config: &Quant4bitConfig, compute: DType) -> Value {
    let dtype = match compute {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    json!({
        "quant_method": "bitsandbytes",
        "_load_in_4bit": true,
        "_load_in_8bit": false,
        "load_in_4bit": true,
        "load_in_8bit": false,
        "bnb_4bit_quant_type": config.quant_type.name(),
        "bnb_4bit_use_double_quant": config.double_quant,
        "bnb_4bit_compute_dtype": dtype,
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_enable_fp32_cpu_offload": false,
        "llm_int8_has_fp16_weight": false,
        "llm_int8_skip_modules": null,
        "llm_int8_threshold": 6.0,
    })
}

/// The 4-bit quantization `config.json` (`json`, read from `path`) declares in
/// `quantization_config`: `None` without one; an error for another quantization (8-bit, GPTQ,
/// ...), naming the key.
pub(crate) fn declared(path: &Path, json: &Value) -> Result<Option<Quant4bitConfig>> {
    let Some(q) = json.get("quantization_config") else {
        return Ok(None);
    };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    let four = q.get("load_in_4bit").and_then(Value::as_bool) == Some(true)
        || q.get("_load_in_4bit").and_then(Value::as_bool) == Some(true);
    if method != "bitsandbytes" || !four {
        return Err(Error::config(
            path,
            Some("quantization_config"),
            format!(
                "quant_method `{method}`{}: this crate reads bitsandbytes' 4-bit models only \
                 (load_in_4bit)",
                if four { "" } else { " without load_in_4bit" }
            ),
        ));
    }
    let name = q
        .get("bnb_4bit_quant_type")
        .and_then(Value::as_str)
        .unwrap_or("fp4");
    let quant_type = QuantType::from_name(name).ok_or_else(|| {
        Error::config(
            path,
            Some("quantization_config.bnb_4bit_quant_type"),
            format!("`{name}`: nf4 or fp4 expected"),
        )
    })?;
    let double = q
        .get("bnb_4bit_use_double_quant")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Some(Quant4bitConfig {
        quant_type,
        blocksize: 64,
        double_quant: double,
    }))
}

/// A linear layer to hold in 4 bits: its module path and whether the checkpoint stores its
/// weight `[in, out]` (GPT-2's `Conv1D`; transposed before quantizing, as `transformers` does).
pub(crate) struct Target {
    pub(crate) path: String,
    pub(crate) fan_in_fan_out: bool,
}

/// The weight files of a folder, memory-mapped, with the tensor each parameter is read from.
struct Files {
    st: MmapedSafetensors,
    /// Parameter name → tensor name.
    tensors: HashMap<String, String>,
}

impl Files {
    /// Maps the weight files of `dir`; `map` gives a tensor's parameter name.
    fn open(dir: &Path, map: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let found = WeightFiles::find(dir)?;
        // SAFETY: the maps are read-only and live as long as this value; the files are not
        // modified while a model loads (the contract of every memory-mapped checkpoint loader,
        // `accelerate_rs::checkpoint::load_weights` included).
        let st = unsafe { MmapedSafetensors::multi(found.files()) }.map_err(|e| {
            accelerate_rs::Error::invalid(
                format!("weight files of {}", dir.display()),
                format!("could not map them: {e}"),
            )
        })?;
        let mut tensors = HashMap::new();
        for (name, _) in st.tensors() {
            if let Some(p) = map(&name) {
                tensors.insert(p, name);
            }
        }
        Ok(Files { st, tensors })
    }

    /// The tensor `name` on the CPU, or `None` when no file holds it.
    fn get(&self, name: &str) -> Option<Tensor> {
        self.st.load(name, &Device::Cpu).ok()
    }
}

/// Reads the layers `targets` of the folder `dir` in 4 bits, one at a time: from a
/// `transformers` 4-bit folder its saved tensors (`<tensor>.weight`, `.weight.absmax`, ...), as
/// they are; from a float folder, each weight read in `dtype` and quantized by `config` (only one
/// layer's full-precision weight exists at a time). `map` gives a tensor's parameter name.
pub(crate) fn read(
    dir: &Path,
    targets: &[Target],
    map: &dyn Fn(&str) -> Option<String>,
    dtype: DType,
    config: &Quant4bitConfig,
) -> Result<Base4bit> {
    let files = Files::open(dir, map)?;
    let mut layers = BTreeMap::new();
    for t in targets {
        let param = format!("{}.weight", t.path);
        let Some(tensor) = files.tensors.get(&param) else {
            return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                format!("weight files of {}", dir.display()),
                format!("no tensor holds the parameter `{param}`"),
            )));
        };
        let prefix = tensor.strip_suffix(".weight").unwrap_or(tensor);
        let stated = STATE_SUFFIXES[4..]
            .iter()
            .any(|s| files.st.get(&format!("{tensor}{s}")).is_ok());
        let weight = if stated {
            Weight4bit::read(prefix, |n| files.get(n))?
        } else {
            let w = files.st.load(tensor, &Device::Cpu).map_err(|e| {
                accelerate_rs::Error::invalid(format!("tensor `{tensor}`"), e.to_string())
            })?;
            let w = if t.fan_in_fan_out { w.t()? } else { w };
            Weight4bit::quantize(&w.to_dtype(dtype)?, config)?
        };
        layers.insert(t.path.clone(), Linear4bit::new(weight, None)?);
    }
    Ok(Base4bit {
        layers,
        config: *config,
    })
}

/// `map` with the tensors of `base`'s layers skipped (their weight and the 4-bit state saved
/// beside it): what the dense parameters are loaded with.
pub(crate) fn skipping<'a>(
    base: &'a Base4bit,
    map: &'a dyn Fn(&str) -> Option<String>,
) -> impl Fn(&str) -> Option<String> + 'a {
    move |tensor: &str| {
        let stem = STATE_SUFFIXES
            .iter()
            .find_map(|s| tensor.strip_suffix(s))
            .unwrap_or(tensor);
        if map(stem).is_some_and(|p| base.holds(&p)) {
            return None;
        }
        map(tensor)
    }
}

/// A `VarBuilder` backend over `inner` that hands out, for the weight of a quantized layer, a
/// placeholder of the asked shape with no storage of its own (a broadcast scalar zero): the
/// layers' constructors run unchanged, and the layer's weight is then replaced by the 4-bit one.
pub(crate) struct Placeholders {
    pub(crate) inner: Box<dyn SimpleBackend>,
    pub(crate) base: Arc<Base4bit>,
}

impl SimpleBackend for Placeholders {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if self.base.holds(name) {
            return Tensor::zeros((), dtype, dev)?.broadcast_as(s);
        }
        self.inner.get(s, name, h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.inner.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.base.holds(name) || self.inner.contains_tensor(name)
    }
}

/// The tensors `transformers` saves for `base`'s layers (`<path>.weight` packed, its
/// `.absmax`, ...), on the CPU.
pub(crate) fn saved_tensors(base: &Base4bit) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for (path, layer) in base.layers() {
        out.extend(layer.weight().tensors(path)?);
    }
    Ok(out)
}
