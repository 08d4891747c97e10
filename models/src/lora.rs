//! LoRA on the Hugging Face architectures: their linear layers ([`Proj`]: a projection with
//! its module path and, once targeted, an adapter), the frozen rebuild of a model around its
//! own parameters, and the adapter's life cycle shared by every architecture (add, save and
//! load in PEFT's format, merge).

use std::path::{Path, PathBuf};

use accelerate_rs::checkpoint::{load_adapter, read_adapter_config, save_adapter};
use accelerate_rs::nn::{Linear, Linear4bit, Lora, LoraConfig, TargetModules};
use candle_core::{DType, Device, Module, Result, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use serde_json::{json, Value};

use crate::base4bit::Placeholders;
use crate::error::{Error, Result as CrateResult};
use crate::weights::{Adapters, Weights};

/// A linear layer of a model: `y = x Wᵀ + b`, its weight stored `[out, in]` (or `[in, out]`
/// for GPT-2's `Conv1D`, `fan_in_fan_out`), its module path (`model.layers.0.self_attn.q_proj`)
/// and its LoRA adapter once `add_lora` targeted it. Architectures build their linear layers as
/// `Proj`s so that LoRA can adapt them ([`Architecture::projections_mut`](crate::Architecture::projections_mut)).
///
/// In a model loaded with a 4-bit base (`Pretrained::from_pretrained_4bit`, QLoRA) the weight
/// is a frozen [`Linear4bit`] ([`weight_4bit`](Self::weight_4bit)) and the bias stays in the
/// compute dtype.
#[derive(Debug, Clone)]
pub struct Proj {
    path: String,
    /// The weight, or for a 4-bit layer a placeholder of its shape (no storage).
    weight: Tensor,
    bias: Option<Tensor>,
    /// `weight` is `[in, out]` (`Conv1D`).
    fan_in_fan_out: bool,
    lora: Option<Lora>,
    /// The 4-bit weight (`[out, in]`, no bias), when the base is quantized.
    base4: Option<Linear4bit>,
}

impl Proj {
    /// A `[out, in]` layer named `weight` (and `bias`) under `vb`, initialized as
    /// `transformers` does: weights from N(0, `std`²), biases zero.
    pub fn linear(
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        std: f64,
        vb: VarBuilder,
    ) -> Result<Self> {
        let (weight, bias) = crate::layers::linear_params(in_dim, out_dim, bias, std, &vb)?;
        Ok(Proj {
            path: vb.prefix(),
            weight,
            bias,
            fan_in_fan_out: false,
            lora: None,
            base4: None,
        })
    }

    /// GPT-2's `Conv1D`: `y = x W + b`, `W` stored `[in, out]`, with a bias.
    pub fn conv1d(in_dim: usize, out_dim: usize, std: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Proj {
            path: vb.prefix(),
            weight: vb.get_with_hints((in_dim, out_dim), "weight", crate::layers::normal(std))?,
            bias: Some(vb.get_with_hints(out_dim, "bias", Init::Const(0.0))?),
            fan_in_fan_out: true,
            lora: None,
            base4: None,
        })
    }

    /// A scalar zero that depends on every tensor of the layer (weight, bias, adapter): added to
    /// a mixture of experts' output for an expert no token chose, so that its parameters get a
    /// zero gradient rather than none.
    pub fn zero_contribution(&self) -> Result<Tensor> {
        let mut parts = Vec::new();
        if self.base4.is_none() {
            parts.push(&self.weight);
        }
        parts.extend(self.bias.as_ref());
        if let Some(lora) = &self.lora {
            parts.push(lora.a());
            parts.push(lora.b());
        }
        let zero = Tensor::zeros((), self.weight.dtype(), self.weight.device())?;
        let mut sum = zero.clone();
        for p in parts {
            sum = (sum + p.sum_all()?.to_dtype(self.weight.dtype())?)?;
        }
        // Times a zero tensor, not `* 0.0`: Candle's backward prunes an affine op by 0.
        sum.mul(&zero)
    }

    /// Its module path (`model.layers.0.self_attn.q_proj`): what LoRA's `target_modules` match.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The weight as stored (`[out, in]`, or `[in, out]` for `Conv1D`); `None` for a 4-bit
    /// layer (see [`weight_4bit`](Self::weight_4bit)).
    pub fn weight(&self) -> Option<&Tensor> {
        match self.base4 {
            Some(_) => None,
            None => Some(&self.weight),
        }
    }

    /// The 4-bit weight (`[out, in]`, frozen, without the bias), when the base is quantized.
    pub fn weight_4bit(&self) -> Option<&Linear4bit> {
        self.base4.as_ref()
    }

    /// The bias, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Holds the weight in 4 bits: `layer` (`[out, in]`, its dimensions this layer's).
    pub(crate) fn set_4bit(&mut self, layer: Linear4bit) -> Result<()> {
        let (i, o) = self.dims()?;
        if layer.dims() != (o, i) {
            candle_core::bail!(
                "`{}.weight`: the 4-bit weight is {:?}, the layer is [{o}, {i}]",
                self.path,
                layer.dims()
            );
        }
        self.base4 = Some(layer);
        Ok(())
    }

    /// Whether the weight is stored `[in, out]` (GPT-2's `Conv1D`).
    pub(crate) fn is_fan_in_fan_out(&self) -> bool {
        self.fan_in_fan_out
    }

    /// `(in, out)` features.
    pub fn dims(&self) -> Result<(usize, usize)> {
        let (a, b) = self.weight.dims2()?;
        Ok(if self.fan_in_fan_out { (a, b) } else { (b, a) })
    }

    /// The layer as a plain [`Linear`] (`[out, in]` weight), when it is one: no adapter, no
    /// 4-bit base, not a `Conv1D`. What fused ops over several layers take.
    pub(crate) fn plain(&self) -> Option<Linear> {
        let plain = self.lora.is_none() && self.base4.is_none() && !self.fan_in_fan_out;
        plain.then(|| Linear::new(self.weight.clone(), self.bias.clone()))
    }

    /// The output for `x` `[.., in]`: the base layer (one fused op), plus the adapter's update
    /// if there is one (its dropout only if `train`).
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if let Some(q) = &self.base4 {
            let y = match &self.lora {
                Some(lora) => q.forward_with_lora(x, lora, train)?,
                None => q.forward(x)?,
            };
            return match &self.bias {
                Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?),
                None => Ok(y),
            };
        }
        // The fused ops take `[out, in]`: for `Conv1D`, one transposed copy of the weight per
        // call (its gradient, when the weight trains, flows back through the copy).
        let w = if self.fan_in_fan_out {
            self.weight.t()?.contiguous()?
        } else {
            self.weight.clone()
        };
        match &self.lora {
            Some(lora) => lora.forward_with_base(x, &w, self.bias.as_ref(), train),
            None => Linear::new(w, self.bias.clone()).forward(x),
        }
    }
}

/// Anything whose parameters are fetched by name: the model's `VarMap` behind detached tensors,
/// so that the model built from it computes no gradient for them (frozen), while they share
/// the parameters' storage (loading, merging and saving still see them).
struct Frozen(VarMap);

impl SimpleBackend for Frozen {
    fn get(&self, s: Shape, name: &str, _: Init, _: DType, _: &Device) -> Result<Tensor> {
        let data = self.0.data().lock().unwrap_or_else(|p| p.into_inner());
        match data.get(name) {
            Some(v) if v.shape() == &s => Ok(v.as_tensor().detach()),
            Some(v) => {
                candle_core::bail!("`{name}` has shape {:?}, the model expects {s:?}", v.dims())
            }
            None => candle_core::bail!("`{name}` is not a parameter of the model"),
        }
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> Result<Tensor> {
        candle_core::bail!("`{name}`: a frozen model's parameters are fetched with their shape")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0
            .data()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(name)
    }
}

/// A builder over `weights`' existing parameters: frozen (detached tensors) or trainable (the
/// variables themselves); a 4-bit base's quantized weights are placeholders (see
/// `base4bit::Placeholders`).
pub(crate) fn rebuild_vb(weights: &Weights, frozen: bool) -> VarBuilder<'static> {
    let backend: Box<dyn SimpleBackend> = if frozen {
        Box::new(Frozen(weights.varmap.clone()))
    } else {
        Box::new(weights.varmap.clone())
    };
    let backend: Box<dyn SimpleBackend> = match &weights.base4 {
        Some(base) => Box::new(Placeholders {
            inner: backend,
            base: base.clone(),
        }),
        None => backend,
    };
    VarBuilder::from_backend(backend, weights.dtype, weights.device.clone())
}

/// What the shared LoRA code needs from an architecture.
pub(crate) trait Adaptable: Clone {
    /// The parameters and adapters.
    fn weights(&self) -> &Weights;
    /// The parameters and adapters, to change.
    fn weights_mut(&mut self) -> &mut Weights;
    /// Every linear layer LoRA may target (not the output layer).
    fn projections_mut(&mut self) -> Vec<&mut Proj>;
    /// The same model built again around its parameters: frozen (no gradient for them) or not.
    /// Adapters, training mode and checkpointing carry over; the layers have no adapter.
    fn rebuild(&self, frozen: bool) -> CrateResult<Self>;
    /// PEFT's default target modules for the architecture.
    fn default_targets(&self) -> &'static [&'static str];
    /// PEFT's `task_type` (`CAUSAL_LM`, `SEQ_CLS`), if PEFT has one for the head. None by
    /// default: for BERT, PEFT's SEQ_CLS would add the classifier as a module to save, and the
    /// adapters here cover the encoder's linear layers only.
    fn task_type(&self) -> Option<&'static str> {
        None
    }
    /// The `config.json` the model was read from (empty for a model built in memory).
    fn config_path(&self) -> &Path;
    /// The folder the model was loaded from, if any (`base_model_name_or_path`).
    fn source(&self) -> Option<PathBuf> {
        self.config_path()
            .parent()
            .map(Path::to_path_buf)
            .filter(|p| !p.as_os_str().is_empty())
    }
}

/// Adds adapters to `model`'s layers that `config` targets: see
/// `LlamaForCausalLm::add_lora`.
pub(crate) fn add_lora<M: Adaptable>(model: &mut M, config: &LoraConfig) -> CrateResult<()> {
    if model.weights().adapters.is_some() {
        return Err(Error::Accelerate(accelerate_rs::Error::invalid(
            "LoRA",
            "the model already has adapters: merge them (`merge_lora`) or load the model again first",
        )));
    }
    let mut config = config.clone();
    if matches!(&config.target_modules, TargetModules::Names(n) if n.is_empty()) {
        config.target_modules = TargetModules::Names(default_targets(model)?);
    }
    config.check()?;
    let mut frozen = model.rebuild(true)?;
    let weights = frozen.weights().clone();
    let dtype = config.adapter_dtype_for(weights.dtype);
    let varmap = VarMap::new();
    let vb = match config.init_seed {
        Some(seed) => accelerate_rs::seeded_var_builder(&varmap, seed, dtype, &weights.device),
        None => VarBuilder::from_varmap(&varmap, dtype, &weights.device),
    };
    // The rank is bounded by every targeted layer's dimensions, checked before anything is
    // allocated (an adapter of rank r holds r x (in + out) values).
    for p in frozen.projections_mut() {
        if config.matches(&p.path)? {
            let (i, o) = p.dims()?;
            if config.r > i.min(o) {
                return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                    "LoRA r",
                    format!(
                        "r = {} is over the smaller dimension of `{}` ({i} in, {o} out): an \
                         adapter's rank is at most min(in, out)",
                        config.r, p.path
                    ),
                )));
            }
        }
    }
    let mut paths = Vec::new();
    let mut matched = 0usize;
    for p in frozen.projections_mut() {
        paths.push(p.path.clone());
        if config.matches(&p.path)? {
            let (i, o) = p.dims()?;
            p.lora = Some(Lora::new(i, o, &config, vb.pp(&p.path))?);
            matched += 1;
        }
    }
    if matched == 0 {
        let shown: Vec<&str> = paths.iter().take(12).map(String::as_str).collect();
        return Err(Error::Accelerate(accelerate_rs::Error::invalid(
            "LoRA target_modules",
            format!(
                "{:?} matches none of the model's {} linear layers (the output layer is never \
                 targeted); they are: {}{}",
                config.target_modules,
                paths.len(),
                shown.join(", "),
                if paths.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            ),
        )));
    }
    if let Some(sharded) = &frozen.weights().sharded {
        // ZeRO-3: the base stays sharded and frozen; the adapters train replicated.
        sharded.freeze();
    }
    frozen.weights_mut().adapters = Some(Adapters { config, varmap });
    *model = frozen;
    Ok(())
}

/// ZeRO-3: puts `adapters` (replicated on every rank, trained whole) on the `projections` of a
/// layer just built from a gathered unit, as [`add_lora`] put them on the whole model's.
pub(crate) fn attach(
    projections: Vec<&mut Proj>,
    adapters: &Adapters,
    base_dtype: DType,
    device: &Device,
) -> Result<()> {
    let config = &adapters.config;
    let dtype = config.adapter_dtype_for(base_dtype);
    let vb = VarBuilder::from_varmap(&adapters.varmap, dtype, device);
    for p in projections {
        if config
            .matches(&p.path)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?
        {
            let (i, o) = p.dims()?;
            p.lora = Some(Lora::new(i, o, config, vb.pp(&p.path))?);
        }
    }
    Ok(())
}

/// PEFT's default target modules of `model`'s architecture, or an error naming its linear layers
/// where there are none (as `peft` refuses).
fn default_targets<M: Adaptable>(model: &M) -> CrateResult<Vec<String>> {
    let defaults = model.default_targets();
    if !defaults.is_empty() {
        return Ok(defaults.iter().map(|s| s.to_string()).collect());
    }
    let mut names: Vec<String> = Vec::new();
    for p in model.clone().projections_mut() {
        let last = p.path.rsplit('.').next().unwrap_or(&p.path).to_string();
        if !names.contains(&last) {
            names.push(last);
        }
    }
    Err(Error::Accelerate(accelerate_rs::Error::invalid(
        "LoRA target_modules",
        format!(
            "this architecture has no default target modules (peft has none for it either): \
             name them; its linear layers are {}",
            names.join(", ")
        ),
    )))
}

/// The model's adapters, or an error naming `what` needs them.
fn adapters<'a, M: Adaptable>(model: &'a M, what: &str) -> CrateResult<&'a Adapters> {
    model.weights().adapters.as_ref().ok_or_else(|| {
        Error::Accelerate(accelerate_rs::Error::invalid(
            what,
            "the model has no LoRA adapters: call `add_lora` or `load_adapter` first",
        ))
    })
}

/// Writes `model`'s adapters as a PEFT adapter folder.
pub(crate) fn save<M: Adaptable>(model: &M, dir: &Path) -> CrateResult<()> {
    let a = adapters(model, "save_adapter")?;
    let mut config = a.config.to_peft_json();
    if let Some(obj) = config.as_object_mut() {
        let base = model.source().map(|p| p.display().to_string());
        obj.insert("base_model_name_or_path".into(), json!(base));
        obj.insert("task_type".into(), json!(model.task_type()));
        let conv = model
            .clone()
            .projections_mut()
            .iter()
            .any(|p| p.fan_in_fan_out);
        obj.insert("fan_in_fan_out".into(), Value::Bool(conv));
    }
    save_adapter(dir, &config, &a.varmap)?;
    Ok(())
}

/// Loads a PEFT adapter folder onto `model` (which must have none): all or nothing.
pub(crate) fn load<M: Adaptable>(model: &mut M, dir: &Path) -> CrateResult<()> {
    let (config, _) = read_adapter_config(dir)?;
    let mut with = model.clone();
    add_lora(&mut with, &config)?;
    let a = adapters(&with, "load_adapter")?;
    load_adapter(dir, &a.varmap)?;
    *model = with;
    Ok(())
}

/// Merges the adapters into the base weights (`W + s · B A`, in the parameters' storage) and
/// drops them; the model is trainable again, every parameter. A 4-bit base is dequantized (in
/// the parameters' dtype) and the adapters merged into it: the model is a full-precision one
/// after.
pub(crate) fn merge<M: Adaptable>(model: &mut M) -> CrateResult<()> {
    adapters(model, "merge_lora")?;
    if model.weights().sharded.is_some() {
        return Err(Error::Accelerate(accelerate_rs::Error::invalid(
            "merge_lora",
            "the base is sharded (ZeRO-3): save the adapters (`save_adapter`, loadable by peft) \
             and merge them into the base on one process",
        )));
    }
    let weights = model.weights().clone();
    let mut merged = Vec::new();
    let mut added = Vec::new();
    {
        let data = weights
            .varmap
            .data()
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut m = model.clone();
        for p in m.projections_mut() {
            let name = format!("{}.weight", p.path);
            if let Some(q) = &p.base4 {
                let w = q
                    .dequantized_weight()?
                    .to_dtype(weights.dtype)?
                    .to_device(&weights.device)?;
                let w = if p.fan_in_fan_out {
                    w.t()?.contiguous()?
                } else {
                    w
                };
                let w = match &p.lora {
                    Some(lora) => lora.merged_weight(&w, p.fan_in_fan_out)?,
                    None => w,
                };
                added.push((name, w));
                continue;
            }
            let Some(lora) = &p.lora else { continue };
            let var = data.get(&name).ok_or_else(|| {
                candle_core::Error::Msg(format!("merge_lora: `{name}` is not a parameter"))
            })?;
            merged.push((
                var.clone(),
                lora.merged_weight(var.as_tensor(), p.fan_in_fan_out)?,
            ));
        }
    }
    // Every merged weight is computed before any is written.
    for (var, w) in merged {
        var.set(&w)?;
    }
    {
        let mut data = weights
            .varmap
            .data()
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (name, w) in added {
            data.insert(name, candle_core::Var::from_tensor(&w)?);
        }
    }
    model.weights_mut().adapters = None;
    model.weights_mut().base4 = None;
    *model = model.rebuild(false)?;
    Ok(())
}

/// The parameters an optimizer and `Accelerator::prepare` take: the adapters when the model
/// has them, else every parameter.
pub(crate) fn trainable(weights: &Weights) -> &VarMap {
    match &weights.adapters {
        Some(a) => &a.varmap,
        None => &weights.varmap,
    }
}
