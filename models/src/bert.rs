//! BERT: the encoder (`BertModel`) under the masked-LM head (`BertForMaskedLM`) and the
//! sequence-classification head (`BertForSequenceClassification`), with `transformers`'
//! parameter names (`bert.encoder.layer.0.attention.self.query.weight`, ...).

use std::path::Path;

use accelerate_rs::nn::{checkpoint_fn, LayerNorm, Linear};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{
    config_readers, ensure, ensure_init_range, ensure_layers, ensure_multiple, ensure_positive,
    ensure_probabilities, ensure_sizes, Activation, Origin,
};
use crate::error::Result as CrateResult;
use crate::layers::{
    attention, bce_with_logits, check_mask, classification_loss, dropout, embedding, linear,
    lookup, masked_lm_loss, mse, norm_params, padding_idx, AttentionSpec,
};
use crate::lora::{adaptable, Proj};
use crate::pretrained::{pretrained_methods, Weights};

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

config_readers!(BertConfig);

impl BertConfig {
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

/// The encoder's parameters: embeddings, layers and (for classification) the pooler.
#[derive(Debug, Clone)]
struct Encoder {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    embed_norm: LayerNorm,
    layers: Vec<EncoderLayer>,
    pooler: Option<Proj>,
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

    fn forward(&self, x: &Tensor, mask: Option<&Tensor>, train: bool) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let d = c / self.heads;
        let split = |y: Tensor| y.reshape((b, t, self.heads, d))?.transpose(1, 2);
        let q = split(self.query.forward(x, train)?)?;
        let k = split(self.key.forward(x, train)?)?;
        let v = split(self.value.forward(x, train)?)?;
        let spec = AttentionSpec {
            causal: false,
            mask,
            window: None,
            scale: 1.0 / (d as f64).sqrt(),
            dropout: self.attn_dropout,
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

    fn projections_mut(&mut self) -> [&mut Proj; 6] {
        [
            &mut self.query,
            &mut self.key,
            &mut self.value,
            &mut self.attn_out,
            &mut self.intermediate,
            &mut self.output,
        ]
    }
}

impl Encoder {
    fn new(c: &BertConfig, pooler: bool, std: f64, vb: VarBuilder) -> Result<Self> {
        let e = vb.pp("embeddings");
        let h = c.hidden_size;
        Ok(Encoder {
            word: embedding(c.vocab_size, h, std, e.pp("word_embeddings"))?,
            position: embedding(
                c.max_position_embeddings,
                h,
                std,
                e.pp("position_embeddings"),
            )?,
            token_type: embedding(c.type_vocab_size, h, std, e.pp("token_type_embeddings"))?,
            embed_norm: layer_norm(h, c.layer_norm_eps, e.pp("LayerNorm"))?,
            layers: (0..c.num_hidden_layers)
                .map(|i| EncoderLayer::new(c, std, vb.pp(format!("encoder.layer.{i}"))))
                .collect::<Result<Vec<_>>>()?,
            pooler: if pooler {
                Some(Proj::linear(h, h, true, std, vb.pp("pooler.dense"))?)
            } else {
                None
            },
            dropout: c.hidden_dropout_prob,
            max_positions: c.max_position_embeddings,
            pad: padding_idx(&c.extra, c.vocab_size),
        })
    }

    fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        mask: Option<&Tensor>,
        train: bool,
        checkpointing: bool,
    ) -> Result<Tensor> {
        let (b, t) = input_ids.dims2()?;
        check_mask(mask, b, t)?;
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
        let pos = self.position.narrow(0, 0, t)?.unsqueeze(0)?;
        let e = (words + types)?.broadcast_add(&pos)?;
        let mut h = dropout(&self.embed_norm.forward(&e)?, self.dropout, train)?;
        for layer in &self.layers {
            h = if checkpointing {
                let (layer, mask) = (layer.clone(), mask.cloned());
                checkpoint_fn(move |x| layer.forward(x, mask.as_ref(), train), &h)?
            } else {
                layer.forward(&h, mask, train)?
            };
        }
        Ok(h)
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

/// BERT with its masked-language-model head (`BertForMaskedLM`), trainable: every parameter
/// gets a gradient. The decoder shares the word embeddings (unless `tie_word_embeddings` is
/// false) and has its own bias, `cls.predictions.bias`.
#[derive(Debug, Clone)]
pub struct BertForMaskedLm {
    config: BertConfig,
    encoder: Encoder,
    transform: Proj,
    transform_norm: LayerNorm,
    decoder: Linear,
    weights: Weights,
}

/// The parts of a masked LM: encoder, head transform and its norm, decoder.
type MlmParts = (Encoder, Proj, LayerNorm, Linear);

pretrained_methods!(
    BertForMaskedLm,
    config = BertConfig,
    architectures = ["BertForMaskedLM", "BertForPreTraining"],
    ///
    /// A pre-training checkpoint (`BertForPreTraining`, `bert-base-uncased`) loads too: its pooler
    /// and next-sentence head are skipped.
);

impl BertForMaskedLm {
    pub(crate) fn load(
        config: BertConfig,
        dir: &Path,
        device: &Device,
        dtype: DType,
    ) -> CrateResult<Self> {
        let tied = config.tie_word_embeddings;
        let map = |name: &str| {
            let name = bert_name(name)?;
            let skip = name.starts_with("bert.pooler.")
                || name.starts_with("cls.seq_relationship.")
                || name == "cls.predictions.decoder.bias"
                || (tied && name == "cls.predictions.decoder.weight");
            (!skip).then_some(name)
        };
        let model = Self::build(
            &config,
            candle_nn::VarMap::new(),
            device,
            dtype,
            0.0,
            Some((dir, &map)),
        )?;
        model.weights.load(dir, map)?;
        Ok(model)
    }

    /// The model around `parts` (built by [`assemble`](Self::assemble) over `weights`).
    fn from_parts(config: &BertConfig, parts: MlmParts, weights: Weights) -> CrateResult<Self> {
        let (encoder, transform, transform_norm, decoder) = parts;
        Ok(BertForMaskedLm {
            config: config.clone(),
            encoder,
            transform,
            transform_norm,
            decoder,
            weights,
        })
    }

    /// The layers, their parameters fetched from `vb`.
    fn assemble(config: &BertConfig, vb: VarBuilder, std: f64) -> CrateResult<MlmParts> {
        {
            let encoder = Encoder::new(config, false, std, vb.pp("bert"))?;
            let p = vb.pp("cls.predictions");
            let h = config.hidden_size;
            let transform = Proj::linear(h, h, true, std, p.pp("transform.dense"))?;
            let transform_norm = layer_norm(h, config.layer_norm_eps, p.pp("transform.LayerNorm"))?;
            let bias = p.get_with_hints(config.vocab_size, "bias", candle_nn::Init::Const(0.0))?;
            let weight = if config.tie_word_embeddings {
                encoder.word.clone()
            } else {
                p.pp("decoder").get_with_hints(
                    (config.vocab_size, h),
                    "weight",
                    crate::layers::normal(std),
                )?
            };
            Ok((
                encoder,
                transform,
                transform_norm,
                Linear::new(weight, Some(bias)),
            ))
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    fn config_value(&self) -> Value {
        bert_config_value(&self.config)
    }

    fn class_name(&self) -> &'static str {
        "BertForMaskedLM"
    }

    /// The encoder's hidden states `[B, T, hidden]` (before the head), with optional segment
    /// ids `token_type_ids` `[B, T]` (default 0) and `attention_mask` `[B, T]` (1 token, 0
    /// padding).
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.encoder.forward(
            input_ids,
            token_type_ids,
            attention_mask,
            self.weights.training,
            self.weights.checkpointing,
        )
    }

    fn transformed(&self, hidden: &Tensor) -> Result<Tensor> {
        let x = self
            .config
            .hidden_act
            .apply(&self.transform.forward(hidden, self.weights.training)?)?;
        self.transform_norm.forward(&x)
    }

    /// The logits `[B, T, vocab]` of every position.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        self.forward_with_token_types(input_ids, None, attention_mask)
    }

    /// [`forward`](Self::forward) with segment ids.
    pub fn forward_with_token_types(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let h = self.hidden_states(input_ids, token_type_ids, attention_mask)?;
        self.decoder.forward(&self.transformed(&h)?)
    }

    /// The masked-LM loss: `labels` `[B, T]` hold the original token at masked positions and
    /// -100 elsewhere (no shift); the mean over the labelled positions.
    pub fn loss(&self, input_ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        self.loss_with_mask(input_ids, None, labels)
    }

    /// [`loss`](Self::loss) with an attention mask.
    pub fn loss_with_mask(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Tensor> {
        let h = self.hidden_states(input_ids, None, attention_mask)?;
        masked_lm_loss(&self.transformed(&h)?, &self.decoder, labels)
    }
}

fn bert_config_value(c: &BertConfig) -> Value {
    crate::config::config_value(c, &c.origin.present, "bert")
}

/// BERT with a sequence-classification head (`BertForSequenceClassification`): the pooled first
/// token (`tanh(dense(h₀))`), dropout, and `classifier` to `num_labels` logits. Trainable:
/// every parameter gets a gradient.
#[derive(Debug, Clone)]
pub struct BertForSequenceClassification {
    config: BertConfig,
    encoder: Encoder,
    classifier: Linear,
    weights: Weights,
}

pretrained_methods!(
    BertForSequenceClassification,
    config = BertConfig,
    architectures = ["BertForSequenceClassification"],
);

impl BertForSequenceClassification {
    pub(crate) fn load(
        config: BertConfig,
        dir: &Path,
        device: &Device,
        dtype: DType,
    ) -> CrateResult<Self> {
        let map = |name: &str| {
            let name = bert_name(name)?;
            (!name.starts_with("cls.")).then_some(name)
        };
        let model = Self::build(
            &config,
            candle_nn::VarMap::new(),
            device,
            dtype,
            0.0,
            Some((dir, &map)),
        )?;
        model.weights.load(dir, map)?;
        Ok(model)
    }

    /// The model around `parts` (built by [`assemble`](Self::assemble) over `weights`).
    fn from_parts(
        config: &BertConfig,
        parts: (Encoder, Linear),
        weights: Weights,
    ) -> CrateResult<Self> {
        let (encoder, classifier) = parts;
        Ok(BertForSequenceClassification {
            config: config.clone(),
            encoder,
            classifier,
            weights,
        })
    }

    /// The layers, their parameters fetched from `vb`.
    fn assemble(config: &BertConfig, vb: VarBuilder, std: f64) -> CrateResult<(Encoder, Linear)> {
        {
            let encoder = Encoder::new(config, true, std, vb.pp("bert"))?;
            let classifier = linear(
                config.hidden_size,
                config.num_labels(),
                true,
                std,
                vb.pp("classifier"),
            )?;
            Ok((encoder, classifier))
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    fn config_value(&self) -> Value {
        bert_config_value(&self.config)
    }

    fn class_name(&self) -> &'static str {
        "BertForSequenceClassification"
    }

    /// The logits `[B, num_labels]`.
    pub fn forward(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        self.forward_with_token_types(input_ids, None, attention_mask)
    }

    /// [`forward`](Self::forward) with segment ids.
    pub fn forward_with_token_types(
        &self,
        input_ids: &Tensor,
        token_type_ids: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let h = self.encoder.forward(
            input_ids,
            token_type_ids,
            attention_mask,
            self.weights.training,
            self.weights.checkpointing,
        )?;
        let first = h.narrow(1, 0, 1)?.squeeze(1)?;
        let pooler = self
            .encoder
            .pooler
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("the classifier has no pooler".into()))?;
        let pooled = pooler.forward(&first, self.weights.training)?.tanh()?;
        let p = self
            .config
            .classifier_dropout
            .unwrap_or(self.config.hidden_dropout_prob);
        self.classifier
            .forward(&dropout(&pooled, p, self.weights.training)?)
    }

    /// The loss of `transformers`' `BertForSequenceClassification`: with `problem_type` unset,
    /// mean squared error for one label (float `labels` `[B]`), cross-entropy for integer class
    /// ids `[B]` (-100 ignored), binary cross-entropy with logits for float `[B, num_labels]`
    /// targets.
    pub fn loss(&self, input_ids: &Tensor, labels: &Tensor) -> Result<Tensor> {
        self.loss_with_mask(input_ids, None, labels)
    }

    /// [`loss`](Self::loss) with an attention mask.
    pub fn loss_with_mask(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Tensor> {
        let logits = self.forward(input_ids, attention_mask)?;
        let (b, n) = logits.dims2()?;
        let problem = match self.config.problem_type.as_deref() {
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
}

adaptable!(
    BertForMaskedLm,
    targets = ["query", "value"],
    task_type = None,
    |m| {
        let mut out = m.encoder.projections_mut();
        out.push(&mut m.transform);
        out
    },
);
adaptable!(
    BertForSequenceClassification,
    targets = ["query", "value"],
    task_type = None,
    |m| m.encoder.projections_mut(),
);
