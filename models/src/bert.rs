//! BERT: the encoder (`BertModel`) under the masked-LM head (`BertForMaskedLM`) and the
//! sequence-classification head (`BertForSequenceClassification`), with `transformers`'
//! parameter names (`bert.encoder.layer.0.attention.self.query.weight`, ...). At ZeRO stage 3
//! the units are the embeddings (`bert.embeddings`: word, position and token-type embeddings and
//! their LayerNorm), each layer (`bert.encoder.layer.{i}`) and the root (the head: the MLM
//! transform and decoder bias, or the pooler and the classifier).

use std::path::Path;
use std::sync::Arc;

use accelerate_rs::nn::{checkpoint_fn, LayerNorm, Linear};
use accelerate_rs::WrapPolicy;
use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::arch::{
    Architecture, Hidden, Inputs, MemoryProfile, Mode, ModelConfig, Proj, ShardedRun, Task,
};
use crate::config::{
    config_value, ensure, ensure_init_range, ensure_layers, ensure_multiple, ensure_positive,
    ensure_probabilities, ensure_sizes, parse, read_json, Activation, Origin,
};
use crate::error::Result as CrateResult;
use crate::layers::{
    attention, bce_with_logits, check_documents, check_mask, classification_loss, dropout,
    embedding, linear, lookup, masked_lm_loss, mse, norm_params, padding_idx, position_ids,
    AttentionSpec, Masks,
};

fn default_act() -> Activation {
    Activation::Gelu
}
fn default_pdrop() -> f64 {
    0.1
}
fn default_positions() -> usize {
    512
}
fn default_types() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_init() -> f64 {
    0.02
}
fn yes() -> bool {
    true
}

/// A BERT `config.json` (`BertConfig`). The five sizes are required; the rest default as in
/// `transformers`. Other keys (`id2label`, token ids, ...) are kept in `extra`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BertConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// The model width.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// The feed-forward inner width.
    pub intermediate_size: usize,
    /// The feed-forward activation (`gelu`, the exact one).
    #[serde(default = "default_act")]
    pub hidden_act: Activation,
    /// Dropout on the embeddings and after each sub-layer.
    #[serde(default = "default_pdrop")]
    pub hidden_dropout_prob: f64,
    /// Dropout on the attention probabilities.
    #[serde(default = "default_pdrop")]
    pub attention_probs_dropout_prob: f64,
    /// The longest sequence (learned positions).
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    /// Token types (segments).
    #[serde(default = "default_types")]
    pub type_vocab_size: usize,
    /// LayerNorm's epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// The standard deviation of the initial weights.
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    /// Only `absolute` is implemented.
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    /// The classifier's dropout; default `hidden_dropout_prob`.
    #[serde(default)]
    pub classifier_dropout: Option<f64>,
    /// `regression`, `single_label_classification` or `multi_label_classification`; default
    /// from the number of labels and the labels' dtype, as in `transformers`.
    #[serde(default)]
    pub problem_type: Option<String>,
    /// The masked-LM decoder is the word embedding matrix (default).
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Every other key of the file (`id2label`, ...), written back as it was.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
    /// The file it was read from and the keys it had.
    #[serde(skip)]
    origin: Origin,
}

impl ModelConfig for BertConfig {
    fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        let mut c: Self = parse(path, json)?;
        c.origin = Origin::of(path, json);
        c.check()?;
        Ok(c)
    }

    fn to_json(&self) -> Value {
        config_value(self, &self.origin.present, "bert")
    }

    fn path(&self) -> &Path {
        &self.origin.path
    }

    fn model_type(&self) -> &str {
        "bert"
    }

    fn initializer_range(&self) -> f64 {
        self.initializer_range
    }
}

impl BertConfig {
    /// Reads a `config.json` (or the one in a model folder).
    pub fn from_file(path: impl AsRef<Path>) -> CrateResult<Self> {
        let (path, json) = read_json(path.as_ref())?;
        <Self as ModelConfig>::from_json(&path, &json)
    }

    /// Parses and checks a configuration; `path` is named in errors.
    pub fn from_json(path: &Path, json: &Value) -> CrateResult<Self> {
        <Self as ModelConfig>::from_json(path, json)
    }

    fn check(&self) -> CrateResult<()> {
        let p = &self.origin.path;
        ensure_sizes(
            p,
            &[
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("num_attention_heads", self.num_attention_heads),
                ("intermediate_size", self.intermediate_size),
                ("max_position_embeddings", self.max_position_embeddings),
                ("type_vocab_size", self.type_vocab_size),
            ],
        )?;
        ensure_layers(p, ("num_hidden_layers", self.num_hidden_layers))?;
        ensure_positive(p, &[("layer_norm_eps", self.layer_norm_eps)])?;
        ensure_init_range(p, self.initializer_range)?;
        ensure_multiple(
            p,
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            "",
        )?;
        ensure(
            self.position_embedding_type
                .as_deref()
                .is_none_or(|t| t == "absolute"),
            p,
            "position_embedding_type",
            format!(
                "`{}` is not implemented (only `absolute`)",
                self.position_embedding_type.as_deref().unwrap_or("")
            ),
        )?;
        ensure_probabilities(
            p,
            &[
                ("hidden_dropout_prob", self.hidden_dropout_prob),
                (
                    "attention_probs_dropout_prob",
                    self.attention_probs_dropout_prob,
                ),
                ("classifier_dropout", self.classifier_dropout.unwrap_or(0.0)),
            ],
        )?;
        if let Some(t) = &self.problem_type {
            ensure(
                matches!(
                    t.as_str(),
                    "regression" | "single_label_classification" | "multi_label_classification"
                ),
                p,
                "problem_type",
                format!("`{t}` is not regression, single_label_classification or multi_label_classification"),
            )?;
        }
        ensure(self.num_labels() > 0, p, "id2label", "no labels")?;
        Ok(())
    }

    /// The number of classes of a sequence classifier: the size of `id2label`, else
    /// `num_labels`, else 2 (as in `transformers`).
    pub fn num_labels(&self) -> usize {
        if let Some(m) = self.extra.get("id2label").and_then(|m| m.as_object()) {
            return m.len();
        }
        self.extra
            .get("num_labels")
            .and_then(|n| n.as_u64())
            .map_or(2, |n| n as usize)
    }
}

/// The ZeRO-3 unit of the embeddings.
const EMBED_UNIT: &str = "bert.embeddings";

/// The ZeRO-3 units of a BERT of `layers` layers: the embeddings, each layer, and the root unit
/// holding the head (either class's).
fn wrap_policy(layers: usize) -> WrapPolicy {
    let blocks = (0..layers).map(|i| format!("bert.encoder.layer.{i}"));
    WrapPolicy::prefixes(std::iter::once(EMBED_UNIT.to_string()).chain(blocks))
}

/// The encoder's parameters: embeddings, layers and (for classification) the pooler.
#[derive(Debug, Clone)]
struct Encoder {
    /// How the layers are made (ZeRO-3 makes them again from their gathered units).
    config: Arc<BertConfig>,
    embeddings: Embeddings,
    layers: Vec<EncoderLayer>,
    pooler: Option<Proj>,
}

/// The word, position and token-type embeddings, summed, normalized and dropped out.
#[derive(Debug, Clone)]
struct Embeddings {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    norm: LayerNorm,
    dropout: f64,
    max_positions: usize,
    /// `pad_token_id`: the word embedding's padding index.
    pad: Option<usize>,
}

#[derive(Debug, Clone)]
struct EncoderLayer {
    query: Proj,
    key: Proj,
    value: Proj,
    attn_out: Proj,
    attn_norm: LayerNorm,
    intermediate: Proj,
    output: Proj,
    out_norm: LayerNorm,
    heads: usize,
    act: Activation,
    attn_dropout: f64,
    dropout: f64,
}

fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    let (w, b) = norm_params(size, true, &vb)?;
    let b = b.ok_or_else(|| candle_core::Error::Msg("layer norm without bias".into()))?;
    Ok(LayerNorm::new(w, b, eps))
}

impl EncoderLayer {
    fn new(c: &BertConfig, std: f64, vb: VarBuilder) -> Result<Self> {
        let h = c.hidden_size;
        Ok(EncoderLayer {
            query: Proj::linear(h, h, true, std, vb.pp("attention.self.query"))?,
            key: Proj::linear(h, h, true, std, vb.pp("attention.self.key"))?,
            value: Proj::linear(h, h, true, std, vb.pp("attention.self.value"))?,
            attn_out: Proj::linear(h, h, true, std, vb.pp("attention.output.dense"))?,
            attn_norm: layer_norm(h, c.layer_norm_eps, vb.pp("attention.output.LayerNorm"))?,
            intermediate: Proj::linear(
                h,
                c.intermediate_size,
                true,
                std,
                vb.pp("intermediate.dense"),
            )?,
            output: Proj::linear(c.intermediate_size, h, true, std, vb.pp("output.dense"))?,
            out_norm: layer_norm(h, c.layer_norm_eps, vb.pp("output.LayerNorm"))?,
            heads: c.num_attention_heads,
            act: c.hidden_act,
            attn_dropout: c.attention_probs_dropout_prob,
            dropout: c.hidden_dropout_prob,
        })
    }

    fn forward(&self, x: &Tensor, masks: &Masks, train: bool) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let d = c / self.heads;
        let split = |y: Tensor| y.reshape((b, t, self.heads, d))?.transpose(1, 2);
        let q = split(self.query.forward(x, train)?)?;
        let k = split(self.key.forward(x, train)?)?;
        let v = split(self.value.forward(x, train)?)?;
        let spec = AttentionSpec {
            causal: false,
            mask: masks.mask.as_ref(),
            documents: masks.documents.as_ref(),
            window: None,
            scale: 1.0 / (d as f64).sqrt(),
            dropout: self.attn_dropout,
            softcap: None,
            backend: masks.backend,
        };
        let y = attention(&q, &k, &v, &spec, train)?
            .transpose(1, 2)?
            .reshape((b, t, c))?;
        let a = dropout(&self.attn_out.forward(&y, train)?, self.dropout, train)?;
        let h = self.attn_norm.forward(&(a + x)?)?;
        let i = self.act.apply(&self.intermediate.forward(&h, train)?)?;
        let o = dropout(&self.output.forward(&i, train)?, self.dropout, train)?;
        self.out_norm.forward(&(o + h)?)
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        vec![
            &mut self.query,
            &mut self.key,
            &mut self.value,
            &mut self.attn_out,
            &mut self.intermediate,
            &mut self.output,
        ]
    }
}

impl Embeddings {
    /// The embeddings under `vb` (`bert.embeddings`).
    fn new(c: &BertConfig, std: f64, vb: VarBuilder) -> Result<Self> {
        let h = c.hidden_size;
        Ok(Embeddings {
            word: embedding(c.vocab_size, h, std, vb.pp("word_embeddings"))?,
            position: embedding(
                c.max_position_embeddings,
                h,
                std,
                vb.pp("position_embeddings"),
            )?,
            token_type: embedding(c.type_vocab_size, h, std, vb.pp("token_type_embeddings"))?,
            norm: layer_norm(h, c.layer_norm_eps, vb.pp("LayerNorm"))?,
            dropout: c.hidden_dropout_prob,
            max_positions: c.max_position_embeddings,
            pad: padding_idx(&c.extra, c.vocab_size),
        })
    }

    /// The embeddings of `inputs` and what every layer sees besides its input; the inputs'
    /// shapes checked.
    fn forward(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<(Tensor, Masks)> {
        let (input_ids, token_type_ids, mask) = (
            inputs.input_ids,
            inputs.token_type_ids,
            inputs.attention_mask,
        );
        let (b, t) = input_ids.dims2()?;
        check_mask(mask, b, t)?;
        check_documents(inputs.document_ids, b, t)?;
        if t > self.max_positions {
            candle_core::bail!(
                "input_ids: {t} tokens, but BERT has positions for max_position_embeddings = {} only",
                self.max_positions
            );
        }
        let words = lookup(&self.word, input_ids, self.pad, "input_ids")?;
        let types = match token_type_ids {
            Some(tt) => {
                if tt.dims() != [b, t] {
                    candle_core::bail!(
                        "token_type_ids has shape {:?}, expected [{b}, {t}]",
                        tt.dims()
                    );
                }
                lookup(&self.token_type, tt, None, "token_type_ids")?
            }
            None => self
                .token_type
                .narrow(0, 0, 1)?
                .unsqueeze(0)?
                .broadcast_as(words.shape())?,
        };
        let pos = match inputs.position_ids {
            Some(p) => {
                position_ids(Some(p), b, t)?;
                lookup(&self.position, p, None, "position_ids")?
            }
            None => self.position.narrow(0, 0, t)?.unsqueeze(0)?,
        };
        let e = (words + types)?.broadcast_add(&pos)?;
        let h = dropout(&self.norm.forward(&e)?, self.dropout, mode.training)?;
        let masks = Masks {
            mask: mask.cloned(),
            documents: inputs.document_ids.cloned(),
            backend: mode.attention,
        };
        Ok((h, masks))
    }
}

impl Encoder {
    fn new(c: &BertConfig, pooler: bool, std: f64, vb: VarBuilder) -> Result<Self> {
        let h = c.hidden_size;
        Ok(Encoder {
            config: Arc::new(c.clone()),
            embeddings: Embeddings::new(c, std, vb.pp("embeddings"))?,
            layers: (0..c.num_hidden_layers)
                .map(|i| EncoderLayer::new(c, std, vb.pp(format!("encoder.layer.{i}"))))
                .collect::<Result<Vec<_>>>()?,
            pooler: if pooler {
                Some(Proj::linear(h, h, true, std, vb.pp("pooler.dense"))?)
            } else {
                None
            },
        })
    }

    fn forward(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<Tensor> {
        let (mut h, masks) = self.embeddings.forward(inputs, mode)?;
        let train = mode.training;
        for layer in &self.layers {
            h = if mode.checkpointing {
                let (layer, masks) = (layer.clone(), masks.clone());
                checkpoint_fn(move |x| layer.forward(x, &masks, train), &h)?
            } else {
                layer.forward(&h, &masks, train)?
            };
        }
        Ok(h)
    }

    /// [`forward`](Self::forward) at ZeRO stage 3: the embeddings unit gathered and held until
    /// the backward pass ends; each layer built from its gathered unit (LoRA adapters
    /// attached), run and recomputed in the backward pass. Returns the hidden states and the
    /// gathered word embeddings (the tied MLM decoder).
    fn forward_sharded(
        &self,
        inputs: &Inputs<'_>,
        mode: Mode,
        s: &ShardedRun,
    ) -> Result<(Tensor, Tensor)> {
        let embeddings = Embeddings::new(&self.config, 0.0, s.gather(EMBED_UNIT)?.pp(EMBED_UNIT))?;
        let (mut h, masks) = embeddings.forward(inputs, mode)?;
        for i in 0..self.layers.len() {
            let (config, masks, train) = (self.config.clone(), masks.clone(), mode.training);
            let unit = format!("bert.encoder.layer.{i}");
            let at = unit.clone();
            h = s.run_block(
                &unit,
                &h,
                move |vb| EncoderLayer::new(&config, 0.0, vb.pp(&at)),
                EncoderLayer::projections_mut,
                move |layer, x| layer.forward(x, &masks, train),
            )?;
        }
        Ok((h, embeddings.word))
    }

    /// The encoder's linear layers (the pooler's too, if it has one).
    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out: Vec<&mut Proj> = self
            .layers
            .iter_mut()
            .flat_map(EncoderLayer::projections_mut)
            .collect();
        if let Some(p) = self.pooler.as_mut() {
            out.push(p);
        }
        out
    }
}

/// The tensors of a BERT checkpoint as this crate's names: `bert.` added to the bare encoder's
/// names, old `LayerNorm.gamma`/`beta` renamed, position-id buffers skipped.
fn bert_name(name: &str) -> Option<String> {
    if name.ends_with(".position_ids") {
        return None;
    }
    let name = name
        .replace("LayerNorm.gamma", "LayerNorm.weight")
        .replace("LayerNorm.beta", "LayerNorm.bias");
    if ["embeddings.", "encoder.", "pooler."]
        .iter()
        .any(|p| name.starts_with(p))
    {
        return Some(format!("bert.{name}"));
    }
    Some(name)
}

/// The sizes and per-token activations of a BERT encoder (either head).
fn bert_profile(c: &BertConfig) -> MemoryProfile {
    let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
    MemoryProfile {
        hidden: c.hidden_size,
        intermediate: c.intermediate_size,
        layers: c.num_hidden_layers,
        heads: c.num_attention_heads,
        kv_heads: c.num_attention_heads,
        head_dim: c.hidden_size / c.num_attention_heads.max(1),
        vocab: c.vocab_size,
        max_positions: c.max_position_embeddings,
        // query, key, value, attention, merged heads, dense, add, LayerNorm, output dense, add,
        // LayerNorm; intermediate and GELU.
        block_elements: 11 * h + 2 * i,
        // Word, position and token-type embeddings, two sums, LayerNorm.
        outer_elements: 6 * h,
        // The task head is not counted.
        lm_head: false,
    }
}

/// The layers of BERT with its masked-language-model head ([`BertForMaskedLm`]).
#[derive(Debug, Clone)]
pub struct BertMlm {
    encoder: Encoder,
    head: MlmHead,
}

/// The masked-LM head (`cls.predictions`): the transform (dense, activation, LayerNorm) and the
/// decoder to the vocabulary (the word embeddings, tied, or its own) with its bias.
#[derive(Debug, Clone)]
struct MlmHead {
    transform: Proj,
    transform_norm: LayerNorm,
    decoder: Linear,
    act: Activation,
}

impl MlmHead {
    /// The head under `vb` (`cls.predictions`); its decoder is `word` when tied.
    fn new(c: &BertConfig, word: &Tensor, std: f64, vb: VarBuilder) -> Result<Self> {
        let h = c.hidden_size;
        let bias = vb.get_with_hints(c.vocab_size, "bias", candle_nn::Init::Const(0.0))?;
        let weight = if c.tie_word_embeddings {
            word.clone()
        } else {
            vb.pp("decoder").get_with_hints(
                (c.vocab_size, h),
                "weight",
                crate::layers::normal(std),
            )?
        };
        Ok(MlmHead {
            transform: Proj::linear(h, h, true, std, vb.pp("transform.dense"))?,
            transform_norm: layer_norm(h, c.layer_norm_eps, vb.pp("transform.LayerNorm"))?,
            decoder: Linear::new(weight, Some(bias)),
            act: c.hidden_act,
        })
    }

    fn transformed(&self, hidden: &Tensor, train: bool) -> Result<Tensor> {
        let x = self.act.apply(&self.transform.forward(hidden, train)?)?;
        self.transform_norm.forward(&x)
    }
}

/// BERT with its masked-language-model head (`BertForMaskedLM`), trainable: every parameter
/// gets a gradient. The decoder shares the word embeddings (unless `tie_word_embeddings` is
/// false) and has its own bias, `cls.predictions.bias`. A pre-training checkpoint
/// (`BertForPreTraining`, `bert-base-uncased`) loads too: its pooler and next-sentence head are
/// skipped. Segment ids go through [`forward_with`](crate::Pretrained::forward_with).
pub type BertForMaskedLm = crate::Pretrained<BertMlm>;

impl BertMlm {
    /// The head: this model's, or (ZeRO-3) the one built from its gathered units.
    fn head<'a>(&'a self, hidden: &'a Hidden) -> Result<&'a MlmHead> {
        Ok(hidden.gathered_head::<MlmHead>()?.unwrap_or(&self.head))
    }
}

impl Architecture for BertMlm {
    type Config = BertConfig;
    const MODEL_TYPES: &'static [&'static str] = &["bert"];
    const CLASSES: &'static [&'static str] = &["BertForMaskedLM", "BertForPreTraining"];
    const TASK: Task = Task::MaskedLm;
    const LORA_TARGETS: &'static [&'static str] = &["query", "value"];
    /// None: `peft`'s SEQ_CLS would add the classifier as a module to save; the adapters here
    /// cover the encoder's linear layers only.
    const PEFT_TASK_TYPE: Option<&'static str> = None;

    fn parameter_name(config: &BertConfig, name: &str) -> Option<String> {
        let name = bert_name(name)?;
        let skip = name.starts_with("bert.pooler.")
            || name.starts_with("cls.seq_relationship.")
            || name == "cls.predictions.decoder.bias"
            || (config.tie_word_embeddings && name == "cls.predictions.decoder.weight");
        (!skip).then_some(name)
    }

    fn assemble(config: &BertConfig, vb: VarBuilder, std: f64) -> Result<Self> {
        let encoder = Encoder::new(config, false, std, vb.pp("bert"))?;
        let word = encoder.embeddings.word.clone();
        let head = MlmHead::new(config, &word, std, vb.pp("cls.predictions"))?;
        Ok(BertMlm { encoder, head })
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out = self.encoder.projections_mut();
        out.push(&mut self.head.transform);
        out
    }

    /// The encoder's hidden states `[B, T, hidden]` (before the head).
    fn hidden_states(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<Hidden> {
        Ok(Hidden::new(self.encoder.forward(inputs, mode)?))
    }

    /// [`hidden_states`](Self::hidden_states) at ZeRO stage 3 (see `Encoder::forward_sharded`);
    /// the head is built from the root unit (`cls.predictions`, LoRA adapters attached) and the
    /// gathered word embeddings (tied decoder), and comes back in the [`Hidden`].
    fn hidden_states_sharded(
        &self,
        inputs: &Inputs<'_>,
        mode: Mode,
        s: &ShardedRun,
    ) -> Result<Hidden> {
        let (h, word) = self.encoder.forward_sharded(inputs, mode, s)?;
        let root = s.gather("")?.pp("cls.predictions");
        let mut head = MlmHead::new(&self.encoder.config, &word, 0.0, root)?;
        s.attach(vec![&mut head.transform], h.device())?;
        Ok(Hidden::new(h).with_head(head))
    }

    fn wrap_policy(config: &BertConfig) -> Option<WrapPolicy> {
        Some(wrap_policy(config.num_hidden_layers))
    }

    fn logits(&self, hidden: &Hidden, mode: Mode) -> Result<Tensor> {
        let head = self.head(hidden)?;
        head.decoder
            .forward(&head.transformed(&hidden.states, mode.training)?)
    }

    /// The masked-LM loss: `labels` `[B, T]` hold the original token at masked positions and
    /// -100 elsewhere (no shift); the mean over the labelled positions.
    fn loss(&self, hidden: &Hidden, labels: &Tensor, mode: Mode) -> Result<Tensor> {
        let head = self.head(hidden)?;
        let x = head.transformed(&hidden.states, mode.training)?;
        hidden.with_aux(masked_lm_loss(&x, &head.decoder, labels)?)
    }

    fn memory_profile(c: &BertConfig) -> MemoryProfile {
        bert_profile(c)
    }
}

/// The layers of BERT with a sequence-classification head ([`BertForSequenceClassification`]).
#[derive(Debug, Clone)]
pub struct BertClassifier {
    encoder: Encoder,
    classifier: Linear,
    classifier_dropout: f64,
    problem_type: Option<String>,
}

/// ZeRO-3: the classifier's head built from the root unit: the pooler (`bert.pooler.dense`) and
/// the classifier.
#[derive(Debug, Clone)]
struct PooledHead {
    pooler: Proj,
    classifier: Linear,
}

impl BertClassifier {
    /// The pooler and the classifier: this model's, or (ZeRO-3) those built from the root unit.
    fn head<'a>(&'a self, hidden: &'a Hidden) -> Result<(&'a Proj, &'a Linear)> {
        if let Some(head) = hidden.gathered_head::<PooledHead>()? {
            return Ok((&head.pooler, &head.classifier));
        }
        let pooler = self
            .encoder
            .pooler
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("the classifier has no pooler".into()))?;
        Ok((pooler, &self.classifier))
    }
}

/// BERT with a sequence-classification head (`BertForSequenceClassification`): the pooled first
/// token (`tanh(dense(h₀))`), dropout, and `classifier` to `num_labels` logits. Trainable: every
/// parameter gets a gradient. Its loss is `transformers`': with `problem_type` unset, mean
/// squared error for one label (float `labels` `[B]`), cross-entropy for integer class ids `[B]`
/// (-100 ignored), binary cross-entropy with logits for float `[B, num_labels]` targets.
pub type BertForSequenceClassification = crate::Pretrained<BertClassifier>;

impl Architecture for BertClassifier {
    type Config = BertConfig;
    const MODEL_TYPES: &'static [&'static str] = &["bert"];
    const CLASSES: &'static [&'static str] = &["BertForSequenceClassification"];
    const TASK: Task = Task::SequenceClassification;
    const LORA_TARGETS: &'static [&'static str] = &["query", "value"];
    const PEFT_TASK_TYPE: Option<&'static str> = None;

    fn parameter_name(_config: &BertConfig, name: &str) -> Option<String> {
        let name = bert_name(name)?;
        (!name.starts_with("cls.")).then_some(name)
    }

    fn assemble(config: &BertConfig, vb: VarBuilder, std: f64) -> Result<Self> {
        let encoder = Encoder::new(config, true, std, vb.pp("bert"))?;
        let classifier = linear(
            config.hidden_size,
            config.num_labels(),
            true,
            std,
            vb.pp("classifier"),
        )?;
        Ok(BertClassifier {
            encoder,
            classifier,
            classifier_dropout: config
                .classifier_dropout
                .unwrap_or(config.hidden_dropout_prob),
            problem_type: config.problem_type.clone(),
        })
    }

    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        self.encoder.projections_mut()
    }

    fn hidden_states(&self, inputs: &Inputs<'_>, mode: Mode) -> Result<Hidden> {
        Ok(Hidden::new(self.encoder.forward(inputs, mode)?))
    }

    /// [`hidden_states`](Self::hidden_states) at ZeRO stage 3 (see `Encoder::forward_sharded`);
    /// the pooler (LoRA adapters attached) and the classifier are built from the root unit and
    /// come back in the [`Hidden`].
    fn hidden_states_sharded(
        &self,
        inputs: &Inputs<'_>,
        mode: Mode,
        s: &ShardedRun,
    ) -> Result<Hidden> {
        let (h, _) = self.encoder.forward_sharded(inputs, mode, s)?;
        let root = s.gather("")?;
        let c = &self.encoder.config;
        let (hidden, labels) = (c.hidden_size, c.num_labels());
        let mut pooler = Proj::linear(hidden, hidden, true, 0.0, root.pp("bert.pooler.dense"))?;
        s.attach(vec![&mut pooler], h.device())?;
        let classifier = linear(hidden, labels, true, 0.0, root.pp("classifier"))?;
        Ok(Hidden::new(h).with_head(PooledHead { pooler, classifier }))
    }

    fn wrap_policy(config: &BertConfig) -> Option<WrapPolicy> {
        Some(wrap_policy(config.num_hidden_layers))
    }

    /// The logits `[B, num_labels]`.
    fn logits(&self, hidden: &Hidden, mode: Mode) -> Result<Tensor> {
        let first = hidden.states.narrow(1, 0, 1)?.squeeze(1)?;
        let (pooler, classifier) = self.head(hidden)?;
        let pooled = pooler.forward(&first, mode.training)?.tanh()?;
        classifier.forward(&dropout(&pooled, self.classifier_dropout, mode.training)?)
    }

    fn loss(&self, hidden: &Hidden, labels: &Tensor, mode: Mode) -> Result<Tensor> {
        let logits = self.logits(hidden, mode)?;
        let (b, n) = logits.dims2()?;
        let problem = match self.problem_type.as_deref() {
            Some(p) => p,
            None if n == 1 => "regression",
            None if !labels.dtype().is_float() => "single_label_classification",
            None => "multi_label_classification",
        };
        match problem {
            "regression" => {
                if labels.elem_count() != b * n {
                    candle_core::bail!(
                        "labels {:?}: regression expects {b} x {n} values",
                        labels.dims()
                    );
                }
                let y = labels.to_dtype(logits.dtype())?.reshape(logits.shape())?;
                mse(&logits, &y)
            }
            "single_label_classification" => {
                if labels.dims() != [b] || labels.dtype().is_float() {
                    candle_core::bail!(
                        "labels {:?} {:?}: single-label classification expects [{b}] integer \
                         class ids",
                        labels.dims(),
                        labels.dtype()
                    );
                }
                classification_loss(&logits, labels)
            }
            _ => {
                if labels.dims() != [b, n] {
                    candle_core::bail!(
                        "labels {:?}: multi-label classification expects [{b}, {n}] targets in \
                         [0, 1]",
                        labels.dims()
                    );
                }
                bce_with_logits(&logits, labels)
            }
        }
    }

    fn memory_profile(c: &BertConfig) -> MemoryProfile {
        bert_profile(c)
    }
}
