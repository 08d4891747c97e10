//! [`AutoModel`]: whichever supported architecture a Hugging Face folder holds, picked from its
//! `config.json` (`architectures`, else `model_type`), behind one interface.

use std::path::Path;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarMap;

use crate::bert::{BertForMaskedLm, BertForSequenceClassification};
use crate::config::{read_json, Config};
use crate::error::{Error, Result as CrateResult};
use crate::gpt2::Gpt2LmHeadModel;
use crate::llama::LlamaForCausalLm;

/// What a model is trained to do (which loss `loss` computes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Next-token prediction (labels shifted inside `loss`).
    CausalLm,
    /// Masked tokens (labels -100 except at masked positions; no shift).
    MaskedLm,
    /// One label per sequence.
    SequenceClassification,
}

/// Any architecture of this crate, loaded from a folder without naming its type: the
/// counterpart of `transformers`' `AutoModelFor*` classes.
///
/// ```no_run
/// # fn main() -> accelerate_rs_models::Result<()> {
/// use accelerate_rs_models::{AutoModel, Task};
/// use candle_core::{DType, Device};
/// let model = AutoModel::from_pretrained("models/tests/fixtures/llama", &Device::Cpu, DType::F32)?;
/// assert_eq!(model.task(), Task::CausalLm);
/// let varmap = model.varmap(); // for `accelerator.prepare(varmap, opt, loader)`
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AutoModel {
    /// Llama, Mistral, Qwen2.
    Llama(LlamaForCausalLm),
    /// GPT-2.
    Gpt2(Gpt2LmHeadModel),
    /// BERT, masked-LM head.
    BertMaskedLm(BertForMaskedLm),
    /// BERT, sequence-classification head.
    BertSequenceClassification(BertForSequenceClassification),
}

macro_rules! each {
    ($self:expr, $m:ident => $e:expr) => {
        match $self {
            AutoModel::Llama($m) => $e,
            AutoModel::Gpt2($m) => $e,
            AutoModel::BertMaskedLm($m) => $e,
            AutoModel::BertSequenceClassification($m) => $e,
        }
    };
}

/// The classes [`AutoModel`] loads, by `architectures[0]`.
pub const ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "GPT2LMHeadModel",
    "GPT2Model",
    "BertForMaskedLM",
    "BertForPreTraining",
    "BertForSequenceClassification",
];

impl AutoModel {
    /// Loads the folder `dir` on `device` in `dtype`: the class its `config.json` names in
    /// `architectures` (one of [`ARCHITECTURES`]), else the `model_type`'s language model
    /// (causal for Llama, Mistral, Qwen2 and GPT-2, masked for BERT). An unknown `model_type` or
    /// class is an error naming the file and the value.
    pub fn from_pretrained(
        dir: impl AsRef<Path>,
        device: &Device,
        dtype: DType,
    ) -> CrateResult<Self> {
        let dir = crate::config::model_folder(dir.as_ref())?;
        let (path, json) = read_json(dir)?;
        let config = Config::from_json(&path, &json)?;
        let arch = config.architecture().map(str::to_string);
        let model_type = config.model_type().to_string();
        let wrong = |arch: &str| {
            Error::config(
                &path,
                Some("architectures"),
                format!(
                    "`{arch}` with model_type `{}` is not implemented (supported: {})",
                    model_type,
                    ARCHITECTURES.join(", ")
                ),
            )
        };
        Ok(match config {
            Config::Llama(c) => {
                if let Some(a) = arch.as_deref() {
                    if !a.ends_with("ForCausalLM") {
                        return Err(wrong(a));
                    }
                }
                AutoModel::Llama(LlamaForCausalLm::load(c, dir, device, dtype)?)
            }
            Config::Gpt2(c) => {
                if let Some(a) = arch.as_deref() {
                    if !matches!(a, "GPT2LMHeadModel" | "GPT2Model") {
                        return Err(wrong(a));
                    }
                }
                AutoModel::Gpt2(Gpt2LmHeadModel::load(c, dir, device, dtype)?)
            }
            Config::Bert(c) => match arch.as_deref() {
                None | Some("BertForMaskedLM" | "BertForPreTraining") => {
                    AutoModel::BertMaskedLm(BertForMaskedLm::load(c, dir, device, dtype)?)
                }
                Some("BertForSequenceClassification") => AutoModel::BertSequenceClassification(
                    BertForSequenceClassification::load(c, dir, device, dtype)?,
                ),
                Some(a) => return Err(wrong(a)),
            },
        })
    }

    /// What `loss` computes.
    pub fn task(&self) -> Task {
        match self {
            AutoModel::Llama(_) | AutoModel::Gpt2(_) => Task::CausalLm,
            AutoModel::BertMaskedLm(_) => Task::MaskedLm,
            AutoModel::BertSequenceClassification(_) => Task::SequenceClassification,
        }
    }

    /// The `model_type`.
    pub fn model_type(&self) -> &str {
        match self {
            AutoModel::Llama(m) => &m.config().model_type,
            AutoModel::Gpt2(_) => "gpt2",
            AutoModel::BertMaskedLm(_) | AutoModel::BertSequenceClassification(_) => "bert",
        }
    }

    /// The logits: `[B, T, vocab]` for the language models, `[B, num_labels]` for a classifier.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        each!(self, m => m.forward(input_ids, attention_mask))
    }

    /// The task's loss (see [`Task`]).
    pub fn loss(&self, input_ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        each!(self, m => m.loss(input_ids, labels))
    }

    /// [`loss`](Self::loss) with an attention mask `[B, T]` (1 token, 0 padding).
    pub fn loss_with_mask(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Tensor> {
        each!(self, m => m.loss_with_mask(input_ids, attention_mask, labels))
    }

    /// The parameters, for `accelerate_rs::Accelerator::prepare` and the optimizer.
    pub fn varmap(&self) -> &VarMap {
        each!(self, m => m.varmap())
    }

    /// The same model over the working copies of mixed precision (see
    /// [`LlamaForCausalLm::with_parameters`]).
    pub fn with_parameters(&self, varmap: &VarMap) -> CrateResult<Self> {
        Ok(match self {
            AutoModel::Llama(m) => AutoModel::Llama(m.with_parameters(varmap)?),
            AutoModel::Gpt2(m) => AutoModel::Gpt2(m.with_parameters(varmap)?),
            AutoModel::BertMaskedLm(m) => AutoModel::BertMaskedLm(m.with_parameters(varmap)?),
            AutoModel::BertSequenceClassification(m) => {
                AutoModel::BertSequenceClassification(m.with_parameters(varmap)?)
            }
        })
    }

    /// The configuration as `config.json`.
    pub fn config_json(&self) -> serde_json::Value {
        each!(self, m => m.config_json())
    }

    /// Writes a folder `transformers` loads (one process; see
    /// [`LlamaForCausalLm::save_pretrained`]).
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> CrateResult<()> {
        each!(self, m => m.save_pretrained(dir))
    }

    /// Training mode (dropout) on or off.
    pub fn train(&mut self, on: bool) {
        each!(self, m => m.train(on))
    }

    /// Whether training mode (dropout) is on.
    pub fn is_training(&self) -> bool {
        each!(self, m => m.is_training())
    }

    /// Activation checkpointing of every block on or off (see
    /// [`LlamaForCausalLm::set_gradient_checkpointing`]).
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        each!(self, m => m.set_gradient_checkpointing(on))
    }

    /// Whether activation checkpointing is on.
    pub fn is_gradient_checkpointing(&self) -> bool {
        each!(self, m => m.is_gradient_checkpointing())
    }

    /// Adds LoRA adapters (see [`LlamaForCausalLm::add_lora`]).
    pub fn add_lora(&mut self, config: &accelerate_rs::nn::LoraConfig) -> CrateResult<()> {
        each!(self, m => m.add_lora(config))
    }

    /// Loads a PEFT adapter folder (see [`LlamaForCausalLm::load_adapter`]).
    pub fn load_adapter(&mut self, dir: impl AsRef<Path>) -> CrateResult<()> {
        each!(self, m => m.load_adapter(dir))
    }

    /// Writes the adapters as a PEFT adapter folder (see [`LlamaForCausalLm::save_adapter`]).
    pub fn save_adapter(&self, dir: impl AsRef<Path>) -> CrateResult<()> {
        each!(self, m => m.save_adapter(dir))
    }

    /// Merges the adapters into the base weights (see [`LlamaForCausalLm::merge_lora`]).
    pub fn merge_lora(&mut self) -> CrateResult<()> {
        each!(self, m => m.merge_lora())
    }

    /// The adapters' settings, when the model has adapters.
    pub fn lora_config(&self) -> Option<&accelerate_rs::nn::LoraConfig> {
        each!(self, m => m.lora_config())
    }

    /// What trains: the adapters when the model has them, else every parameter (see
    /// [`LlamaForCausalLm::trainable_parameters`]).
    pub fn trainable_parameters(&self) -> &VarMap {
        each!(self, m => m.trainable_parameters())
    }

    /// Floating-point operations per trained token of a forward and backward pass over windows of
    /// `seq_len` tokens (model FLOPs, the PaLM paper's convention, for `StepTimer::flops_per_step`
    /// and a FLOP/s or MFU figure): 2 per parameter forward, 2 per parameter for the gradient of
    /// the activations, 2 per *trained* parameter for the weight gradients (6 per parameter
    /// when every parameter trains; about 4 with LoRA, whose frozen base gets no weight
    /// gradient), plus attention's score and value products, `12 x layers x seq_len x hidden`
    /// (all of them, although a causal mask makes half unnecessary). Embedding lookups count as
    /// products (a small overestimate); activation checkpointing's recomputation is not counted.
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        let count =
            |m: &VarMap| -> f64 { m.all_vars().iter().map(|v| v.elem_count() as f64).sum() };
        let trained = count(self.trainable_parameters());
        let all = if self.lora_config().is_some() {
            count(self.varmap()) + trained
        } else {
            trained
        };
        let config = self.config_json();
        let key = |names: [&str; 2]| -> f64 {
            names
                .iter()
                .find_map(|k| config.get(*k).and_then(serde_json::Value::as_u64))
                .unwrap_or(0) as f64
        };
        let layers = key(["num_hidden_layers", "n_layer"]);
        let hidden = key(["hidden_size", "n_embd"]);
        4.0 * all + 2.0 * trained + 12.0 * layers * seq_len as f64 * hidden
    }
}
