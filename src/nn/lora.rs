//! LoRA (low-rank adaptation, Hu et al. 2021; PEFT's `LoraConfig` and `lora.Linear`): a frozen
//! linear layer `W` plus a trainable low-rank update, `y = x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ` with
//! `A` `[r, in]` and `B` `[out, r]`, `s = alpha / r` (or `alpha / √r` with rsLoRA). `B` starts
//! at zero, so a fresh adapter leaves the layer's output as it was.
//!
//! The adapter's tensors are named as PEFT names them, `<module path>.lora_A.weight` and
//! `<module path>.lora_B.weight`, so a `VarMap` of adapters saves to (and loads from) a PEFT
//! adapter folder with [`checkpoint::save_adapter`](crate::checkpoint::save_adapter) and
//! [`checkpoint::load_adapter`](crate::checkpoint::load_adapter).

use std::path::Path;

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Init, VarBuilder};
use serde_json::{json, Value};

use super::dropout::dropout;
use super::linear::Linear;
use crate::error::Error;

/// Which linear layers get an adapter, by module path (`model.layers.0.self_attn.q_proj`):
/// PEFT's `target_modules`, with its matching rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TargetModules {
    /// PEFT's list form: a module whose path is one of the names or ends with `.` + a name
    /// (`"q_proj"` matches `model.layers.3.self_attn.q_proj`). An empty list lets a model pick
    /// its default (`accelerate-rs-models` uses PEFT's defaults per architecture).
    Names(Vec<String>),
    /// PEFT's string form: a regular expression that must match the whole path
    /// (`r".*\.(q|v)_proj"`).
    Regex(String),
    /// PEFT's `"all-linear"`: every linear layer except the output layer.
    AllLinear,
}

/// A LoRA adapter's settings: PEFT's `LoraConfig` (the keys of `adapter_config.json`).
///
/// ```
/// use accelerate_rs::nn::LoraConfig;
/// let config = LoraConfig::new(8, 16.0).dropout(0.05).target_modules(["q_proj", "v_proj"]);
/// assert_eq!(config.scaling(), 2.0);
/// assert!(config.matches("model.layers.0.self_attn.q_proj").unwrap());
/// assert!(!config.matches("model.layers.0.self_attn.o_proj").unwrap());
/// assert_eq!(config.rslora(true).scaling(), 16.0 / 8f64.sqrt());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The rank `r` of the update (`lora_A` is `[r, in]`, `lora_B` `[out, r]`).
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r` (`alpha / √r` with rsLoRA).
    pub alpha: f64,
    /// `lora_dropout`: dropout on the adapter's input, in training mode.
    pub dropout: f64,
    /// `target_modules`: which layers get an adapter.
    pub target_modules: TargetModules,
    /// `use_rslora`: rank-stabilized scaling, `alpha / √r`.
    pub use_rslora: bool,
    /// The adapters' dtype; `None`: f32 when the base is f16 or bf16 (PEFT's
    /// `autocast_adapter_dtype`), else the base's dtype. Not saved in `adapter_config.json`.
    pub adapter_dtype: Option<DType>,
    /// Where new adapters' `lora_A` values come from: `Some(seed)` draws them from `(seed, the
    /// adapter's name)` ([`seeded_var_builder`](crate::seeded_var_builder)), so the same seed
    /// gives the same adapters in every run and at any world size; `None` (default): Candle's
    /// unseeded generator, different in every run (`lora_B` starts at zero either way). Used by
    /// the model crate's `add_lora`; a [`LoraLinear`] of your own takes the `VarBuilder` you give
    /// it (e.g. [`Accelerator::var_builder`](crate::Accelerator::var_builder)). Not saved in
    /// `adapter_config.json`.
    pub init_seed: Option<u64>,
}

impl LoraConfig {
    /// Rank `r` and `alpha`, no dropout, no rsLoRA, the model's default target modules.
    pub fn new(r: usize, alpha: f64) -> Self {
        LoraConfig {
            r,
            alpha,
            dropout: 0.0,
            target_modules: TargetModules::Names(Vec::new()),
            use_rslora: false,
            adapter_dtype: None,
            init_seed: None,
        }
    }

    /// Initialises new adapters from `seed` (see [`init_seed`](Self::init_seed)).
    pub fn seed(mut self, seed: u64) -> Self {
        self.init_seed = Some(seed);
        self
    }

    /// Sets the dropout on the adapters' input.
    pub fn dropout(mut self, p: f64) -> Self {
        self.dropout = p;
        self
    }

    /// Targets the modules whose path is one of `names` or ends with `.` + one of them.
    pub fn target_modules<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.target_modules = TargetModules::Names(names.into_iter().map(Into::into).collect());
        self
    }

    /// Targets the modules whose whole path matches the regular expression `re`.
    pub fn target_regex(mut self, re: impl Into<String>) -> Self {
        self.target_modules = TargetModules::Regex(re.into());
        self
    }

    /// Targets every linear layer except the output layer (PEFT's `"all-linear"`).
    pub fn all_linear(mut self) -> Self {
        self.target_modules = TargetModules::AllLinear;
        self
    }

    /// Rank-stabilized LoRA on or off (scaling `alpha / √r` instead of `alpha / r`).
    pub fn rslora(mut self, on: bool) -> Self {
        self.use_rslora = on;
        self
    }

    /// Sets the adapters' dtype (see [`adapter_dtype`](Self::adapter_dtype)).
    pub fn with_adapter_dtype(mut self, dtype: DType) -> Self {
        self.adapter_dtype = Some(dtype);
        self
    }

    /// The factor on the update: `alpha / r`, or `alpha / √r` with rsLoRA.
    pub fn scaling(&self) -> f64 {
        let r = self.r.max(1) as f64;
        if self.use_rslora {
            self.alpha / r.sqrt()
        } else {
            self.alpha / r
        }
    }

    /// The adapters' dtype for a base layer of `base` dtype.
    pub fn adapter_dtype_for(&self, base: DType) -> DType {
        self.adapter_dtype.unwrap_or(match base {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        })
    }

    /// Checks the settings: a rank of at least 1, a finite `alpha`, a dropout in `[0, 1)`, a
    /// float adapter dtype, a regular expression that compiles.
    pub fn check(&self) -> crate::error::Result<()> {
        if self.r == 0 {
            return Err(Error::invalid("LoRA r", "the rank must be at least 1"));
        }
        if !self.alpha.is_finite() {
            return Err(Error::invalid(
                "LoRA alpha",
                format!("must be a finite number, got {}", self.alpha),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::invalid(
                "LoRA dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            ));
        }
        if let Some(d) = self.adapter_dtype {
            if !d.is_float() {
                return Err(Error::invalid(
                    "LoRA adapter dtype",
                    format!("must be a float dtype, got {d:?}"),
                ));
            }
        }
        if let TargetModules::Regex(re) = &self.target_modules {
            full_match(re)?;
        }
        Ok(())
    }

    /// Whether the module at `path` is a target (PEFT's rules; [`TargetModules::AllLinear`]
    /// matches everything: the caller leaves the output layer out). An invalid regular
    /// expression is an error naming it.
    pub fn matches(&self, path: &str) -> crate::error::Result<bool> {
        Ok(match &self.target_modules {
            TargetModules::Names(names) => names.iter().any(|t| {
                path == t
                    || path
                        .strip_suffix(t.as_str())
                        .is_some_and(|head| head.ends_with('.'))
            }),
            TargetModules::Regex(re) => full_match(re)?.is_match(path),
            TargetModules::AllLinear => true,
        })
    }

    /// `adapter_config.json` as PEFT writes it (`peft_type` `LORA`, `r`, `lora_alpha`,
    /// `lora_dropout`, `target_modules`, `use_rslora`, and the defaults of the features this
    /// crate does not implement: no bias, no DoRA, no per-layer patterns). The caller sets
    /// `base_model_name_or_path`, `task_type` and `fan_in_fan_out` as they apply.
    pub fn to_peft_json(&self) -> Value {
        let targets = match &self.target_modules {
            TargetModules::Names(n) => {
                let mut n = n.clone();
                n.sort();
                json!(n)
            }
            TargetModules::Regex(re) => json!(re),
            TargetModules::AllLinear => json!("all-linear"),
        };
        // An integral alpha as an integer, as PEFT's configs hold it.
        let alpha = if self.alpha.fract() == 0.0 && self.alpha.abs() < 1e15 {
            json!(self.alpha as i64)
        } else {
            json!(self.alpha)
        };
        json!({
            "peft_type": "LORA",
            "task_type": null,
            "base_model_name_or_path": null,
            "r": self.r,
            "lora_alpha": alpha,
            "lora_dropout": self.dropout,
            "target_modules": targets,
            "use_rslora": self.use_rslora,
            "fan_in_fan_out": false,
            "bias": "none",
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "init_lora_weights": true,
            "inference_mode": true,
        })
    }

    /// Reads PEFT's `adapter_config.json` (already parsed; `path` is named in errors). Keys of
    /// features this crate does not implement (DoRA, trained biases, per-layer ranks or alphas,
    /// `modules_to_save`, layer selections) are errors when set to anything but their default;
    /// other keys are ignored. `fan_in_fan_out` is decided by the layer type, as PEFT does.
    pub fn from_peft_json(path: &Path, json: &Value) -> crate::error::Result<Self> {
        let Some(obj) = json.as_object() else {
            return Err(Error::Config {
                path: path.to_path_buf(),
                key: None,
                reason: "is not a JSON object".into(),
            });
        };
        let peft = PeftJson { path, obj };
        match obj.get("peft_type").and_then(Value::as_str) {
            Some("LORA") => {}
            other => {
                return Err(peft.err(
                    "peft_type",
                    format!("{other:?}: only LORA adapters are supported"),
                ))
            }
        }
        let r = match obj.get("r") {
            None => 8,
            Some(v) => v
                .as_u64()
                .filter(|&r| r > 0)
                .ok_or_else(|| peft.err("r", format!("{v} is not a positive integer")))?
                as usize,
        };
        let alpha = peft.number("lora_alpha", 8.0)?;
        let dropout = peft.number("lora_dropout", 0.0)?;
        let use_rslora = peft.flag("use_rslora")?;
        let target_modules = peft.target_modules()?;
        peft.refuse_unsupported()?;
        let config = LoraConfig {
            r,
            alpha,
            dropout,
            target_modules,
            use_rslora,
            adapter_dtype: None,
            init_seed: None,
        };
        config.check().map_err(|e| match e {
            Error::InvalidArgument { name, reason } => {
                let key = match name.as_str() {
                    "LoRA r" => "r",
                    "LoRA alpha" => "lora_alpha",
                    "LoRA dropout" => "lora_dropout",
                    _ => "target_modules",
                };
                peft.err(key, reason)
            }
            e => e,
        })?;
        Ok(config)
    }
}

/// PEFT's `adapter_config.json` as an object, read key by key; errors name the file and key.
struct PeftJson<'a> {
    path: &'a Path,
    obj: &'a serde_json::Map<String, Value>,
}

impl PeftJson<'_> {
    /// An error about `key` of this file.
    fn err(&self, key: &str, reason: String) -> Error {
        Error::Config {
            path: self.path.to_path_buf(),
            key: Some(key.to_string()),
            reason,
        }
    }

    /// A number, `default` when absent or null.
    fn number(&self, key: &str, default: f64) -> crate::error::Result<f64> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(key, format!("{v} is not a number"))),
        }
    }

    /// A flag, false when absent or null.
    fn flag(&self, key: &str) -> crate::error::Result<bool> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(key, format!("{v} is not true or false"))),
        }
    }

    /// `target_modules`: a list of names, `all-linear`, or a regular expression.
    fn target_modules(&self) -> crate::error::Result<TargetModules> {
        Ok(match self.obj.get("target_modules") {
            None | Some(Value::Null) => TargetModules::Names(Vec::new()),
            Some(Value::String(s)) if s == "all-linear" => TargetModules::AllLinear,
            Some(Value::String(s)) => TargetModules::Regex(s.clone()),
            Some(Value::Array(a)) => TargetModules::Names(
                a.iter()
                    .map(|v| {
                        v.as_str().map(str::to_string).ok_or_else(|| {
                            self.err("target_modules", format!("{v} is not a module name"))
                        })
                    })
                    .collect::<crate::error::Result<_>>()?,
            ),
            Some(v) => {
                return Err(self.err(
                    "target_modules",
                    format!("{v} is not a list of names or a regular expression"),
                ))
            }
        })
    }

    /// The keys of features this crate does not implement: an error when one is set to anything
    /// but its default.
    fn refuse_unsupported(&self) -> crate::error::Result<()> {
        let obj = self.obj;
        // Features that would change what the adapter computes.
        for key in ["use_dora", "lora_bias", "use_qalora"] {
            if self.flag(key)? {
                return Err(self.err(key, "is not supported (plain LoRA only)".into()));
            }
        }
        match obj.get("bias") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(v) => {
                return Err(self.err(
                    "bias",
                    format!("{v}: trained biases are not supported (\"none\" only)"),
                ))
            }
        }
        for key in ["rank_pattern", "alpha_pattern"] {
            if obj
                .get(key)
                .is_some_and(|v| !v.is_null() && v.as_object().is_none_or(|m| !m.is_empty()))
            {
                return Err(self.err(key, "per-layer ranks and alphas are not supported".into()));
            }
        }
        for key in [
            "modules_to_save",
            "layers_to_transform",
            "layers_pattern",
            "exclude_modules",
            "layer_replication",
            "target_parameters",
            "trainable_token_indices",
        ] {
            let set = match obj.get(key) {
                None | Some(Value::Null) => false,
                Some(Value::Array(a)) => !a.is_empty(),
                Some(Value::String(s)) => !s.is_empty(),
                Some(Value::Object(m)) => !m.is_empty(),
                Some(_) => true,
            };
            if set {
                return Err(self.err(key, "is not supported: leave it unset".into()));
            }
        }
        Ok(())
    }
}

/// `re` compiled to match whole paths (PEFT's `re.fullmatch`).
fn full_match(re: &str) -> crate::error::Result<regex::Regex> {
    regex::Regex::new(&format!("^(?:{re})$")).map_err(|e| {
        Error::invalid(
            "LoRA target_modules",
            format!("`{re}` is not a valid regular expression: {e}"),
        )
    })
}

/// One LoRA adapter: `A` `[r, in]`, `B` `[out, r]`, the scaling and the dropout. The update it
/// adds to a layer's output is `s · dropout(x) Aᵀ Bᵀ`, computed in the adapter's dtype.
#[derive(Clone, Debug)]
pub struct Lora {
    a: Tensor,
    b: Tensor,
    scaling: f64,
    dropout: f32,
}

impl Lora {
    /// A fresh adapter for a layer from `in_dim` to `out_dim` features, its tensors created in
    /// `vb` (the module's path, in the adapters' dtype) as `lora_A.weight` (PEFT's default:
    /// Kaiming-uniform, `U(-1/√in, 1/√in)`) and `lora_B.weight` (zeros).
    pub fn new(in_dim: usize, out_dim: usize, config: &LoraConfig, vb: VarBuilder) -> Result<Self> {
        config.check().map_err(candle_core::Error::wrap)?;
        let bound = 1.0 / (in_dim.max(1) as f64).sqrt();
        let a = vb.get_with_hints(
            (config.r, in_dim),
            "lora_A.weight",
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
        )?;
        let b = vb.get_with_hints((out_dim, config.r), "lora_B.weight", Init::Const(0.0))?;
        Self::from_tensors(a, b, config.scaling(), config.dropout)
    }

    /// An adapter of given tensors (`a` `[r, in]`, `b` `[out, r]`, one float dtype).
    pub fn from_tensors(a: Tensor, b: Tensor, scaling: f64, dropout: f64) -> Result<Self> {
        let (r, _) = a.dims2()?;
        let (_, rb) = b.dims2()?;
        if r != rb || a.dtype() != b.dtype() || !a.dtype().is_float() {
            candle_core::bail!(
                "LoRA: lora_A {:?} {:?} and lora_B {:?} {:?} do not make an adapter ([r, in] and [out, r], one float dtype)",
                a.dims(),
                a.dtype(),
                b.dims(),
                b.dtype()
            );
        }
        if !(0.0..1.0).contains(&dropout) {
            candle_core::bail!("LoRA: dropout must be in [0, 1), got {dropout}");
        }
        Ok(Lora {
            a,
            b,
            scaling,
            dropout: dropout as f32,
        })
    }

    /// `lora_A`, `[r, in]`.
    pub fn a(&self) -> &Tensor {
        &self.a
    }

    /// `lora_B`, `[out, r]`.
    pub fn b(&self) -> &Tensor {
        &self.b
    }

    /// The factor on the update.
    pub fn scaling(&self) -> f64 {
        self.scaling
    }

    /// The dropout probability on the adapter's input (in training mode).
    pub fn dropout(&self) -> f64 {
        f64::from(self.dropout)
    }

    /// The update `s · dropout(x) Aᵀ Bᵀ` for inputs `x` `[.., in]` (cast to the adapter's
    /// dtype): `[.., out]` in the adapter's dtype. Dropout only if `train`.
    pub fn update(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let x = if x.dtype() == self.a.dtype() {
            x.clone()
        } else {
            x.to_dtype(self.a.dtype())?
        };
        let x = if train && self.dropout > 0.0 {
            dropout(&x, self.dropout)?
        } else {
            x
        };
        // The scaling on the rank-r intermediate: r values per row instead of `out`.
        let h = (Linear::new(self.a.clone(), None).forward(&x)? * self.scaling)?;
        Linear::new(self.b.clone(), None).forward(&h)
    }

    /// A frozen linear layer's output for `x` plus the update: `x Wᵀ + b + s · dropout(x) Aᵀ
    /// Bᵀ` for `w` `[out, in]` and `bias` `[out]` (tensors outside the graph: no gradient is
    /// computed for them). On the CPU or a GPU, with one dtype and no dropout drawn, one fused
    /// op whose only tensor of the output's size is the output (composed, the update, its
    /// scaled copy and the sum are three more, all kept by the graph); otherwise the base layer
    /// and [`add_to`](Self::add_to).
    pub fn forward_with_base(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let dropping = train && self.dropout > 0.0;
        if !dropping && super::lora_op::fusable(x, w, bias, &self.a, &self.b) {
            let op = super::lora_op::LoraOp {
                w: w.clone(),
                bias: bias.cloned(),
                scaling: self.scaling,
            };
            return x.contiguous()?.apply_op3(&self.a, &self.b, op);
        }
        let y = Linear::new(w.clone(), bias.cloned()).forward(x)?;
        self.add_to(&y, x, train)
    }

    /// `base` (a layer's output for `x`) plus the [`update`](Self::update), in `base`'s dtype
    /// (added in the adapter's dtype when the two differ, as PEFT does).
    pub fn add_to(&self, base: &Tensor, x: &Tensor, train: bool) -> Result<Tensor> {
        let u = self.update(x, train)?;
        if base.dtype() == u.dtype() {
            base + u
        } else {
            (base.to_dtype(u.dtype())? + u)?.to_dtype(base.dtype())
        }
    }

    /// The update as a weight, `s · B A` (`[out, in]`, the adapter's dtype): what merging adds
    /// to the base layer's weight.
    pub fn delta_weight(&self) -> Result<Tensor> {
        self.b.matmul(&self.a)? * self.scaling
    }

    /// `weight` with the update merged in: `W + s · B A` for a `[out, in]` weight, or, with
    /// `fan_in_fan_out` (GPT-2's `Conv1D`, `[in, out]`), `W + (s · B A)ᵀ`; summed in f32 (f64
    /// for f64) and returned in `weight`'s dtype.
    pub fn merged_weight(&self, weight: &Tensor, fan_in_fan_out: bool) -> Result<Tensor> {
        let delta = self.delta_weight()?;
        let delta = if fan_in_fan_out { delta.t()? } else { delta };
        if delta.dims() != weight.dims() {
            candle_core::bail!(
                "LoRA: the update is {:?}, the weight {:?}",
                delta.dims(),
                weight.dims()
            );
        }
        let acc = if weight.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        (weight.detach().to_dtype(acc)? + delta.detach().to_dtype(acc)?)?.to_dtype(weight.dtype())
    }
}

/// A [`Linear`] layer with a LoRA adapter: the base layer frozen (its tensors detached: no
/// gradient is computed for them, so they stay out of the optimizer and the gradient
/// all-reduce), the adapter trainable. Wrap your own `accelerate_rs::nn::Linear` layers with it;
/// the optimizer and [`Accelerator::prepare`](crate::Accelerator::prepare) get the adapters'
/// `VarMap` only.
///
/// ```
/// use accelerate_rs::nn::{linear, LoraConfig, LoraLinear};
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
///
/// # fn main() -> candle_core::Result<()> {
/// let (base, adapters) = (VarMap::new(), VarMap::new());
/// let dev = Device::Cpu;
/// let q = linear(16, 16, VarBuilder::from_varmap(&base, DType::F32, &dev).pp("attn.q"))?;
/// let config = LoraConfig::new(4, 8.0).target_modules(["q"]);
/// let vb = VarBuilder::from_varmap(&adapters, DType::F32, &dev);
/// let q = LoraLinear::new(q, &config, vb.pp("attn.q"))?;
/// let x = Tensor::randn(0f32, 1.0, (2, 16), &dev)?;
/// let grads = q.forward_t(&x, true)?.sum_all()?.backward()?;
/// assert!(grads.get(q.base().weight()).is_none()); // frozen
/// let names: Vec<String> = adapters.data().lock().unwrap().keys().cloned().collect();
/// assert!(names.contains(&"attn.q.lora_A.weight".to_string()));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct LoraLinear {
    base: Linear,
    lora: Lora,
}

impl LoraLinear {
    /// Wraps `base` (frozen from here on) with a fresh adapter whose tensors are created in `vb`
    /// (the module's path; see [`Lora::new`]). The adapters' dtype is `vb`'s.
    pub fn new(base: Linear, config: &LoraConfig, vb: VarBuilder) -> Result<Self> {
        let (out_dim, in_dim) = base.weight().dims2()?;
        let lora = Lora::new(in_dim, out_dim, config, vb)?;
        Ok(Self::from_parts(base, lora))
    }

    /// `base` (frozen from here on) with the adapter `lora`.
    pub fn from_parts(base: Linear, lora: Lora) -> Self {
        let frozen = Linear::new(base.weight().detach(), base.bias().map(Tensor::detach));
        LoraLinear { base: frozen, lora }
    }

    /// The frozen base layer.
    pub fn base(&self) -> &Linear {
        &self.base
    }

    /// The adapter.
    pub fn lora(&self) -> &Lora {
        &self.lora
    }

    /// `base(x) + s · dropout(x) Aᵀ Bᵀ`; dropout only if `train`.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.lora
            .forward_with_base(x, self.base.weight(), self.base.bias(), train)
    }

    /// The base layer with the update merged into its weight (`W + s · B A`): the same outputs
    /// (without dropout), one matrix product per call.
    pub fn merge(&self) -> Result<Linear> {
        let w = self.lora.merged_weight(self.base.weight(), false)?;
        Ok(Linear::new(w, self.base.bias().cloned()))
    }
}

impl Module for LoraLinear {
    /// [`forward_t`](LoraLinear::forward_t) without dropout (evaluation, or an adapter without
    /// dropout).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_t(x, false)
    }
}
