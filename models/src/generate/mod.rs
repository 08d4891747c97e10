//! Text generation for the causal language models: [`GenerationConfig`] (greedy, temperature,
//! top-k, top-p, a seed, stop tokens, a token budget) and the loop behind
//! [`Pretrained::generate`](crate::Pretrained::generate) and
//! [`AutoModel::generate`](crate::AutoModel::generate).
//!
//! Prompts of different lengths are batched with **left** padding, as `transformers` pads for
//! generation: an attention mask hides the padding from every query, and positions skip it
//! (`cumsum(attention_mask) - 1`, 1 on the padding), so a prompt's tokens come out the same
//! alone or in a batch. The model runs in evaluation mode (no dropout), and each step's keys and
//! values (after RoPE) are kept in a [`KvCache`], detached: the first step runs the prompts,
//! each later one the last token only. Without the cache
//! ([`use_cache(false)`](GenerationConfig::use_cache)) every step runs the whole sequence again;
//! the two give the same tokens (tested on every architecture).

mod cache;
mod sampling;

pub(crate) use cache::{CacheSlot, CachedSpec};
pub use cache::{DecodeInputs, KvCache};

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::config::{present, read_json, read_json_file};
use crate::error::{Error, Result};
use sampling::Sampler;

/// How [`generate`](crate::Pretrained::generate) picks and stops: greedy by default (the
/// largest logit), or sampling with a [`temperature`](Self::temperature) above 0 (then
/// [`top_k`](Self::top_k) and [`top_p`](Self::top_p) apply, in `transformers`' order, drawn
/// from a generator seeded by [`seed`](Self::seed)). A sequence stops after
/// [`max_new_tokens`](Self::max_new_tokens) or at one of the [`stop_tokens`](Self::stop_tokens)
/// (kept as its last token).
///
/// ```
/// use accelerate_rs_models::GenerationConfig;
/// let greedy = GenerationConfig::default().max_new_tokens(32).stop_tokens([2]);
/// let sampled = GenerationConfig::default().temperature(0.7).top_p(0.9).seed(1);
/// # let _ = (greedy, sampled);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// Tokens generated at most per prompt (default 20, as `transformers`).
    pub max_new_tokens: usize,
    /// `None` or 0: greedy; above 0: sampling at this temperature.
    pub temperature: Option<f64>,
    /// Sampling: only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Sampling: only the most likely tokens whose probabilities sum to `p` (nucleus).
    pub top_p: Option<f64>,
    /// The generator's seed (sampling).
    pub seed: u64,
    /// A sequence ends at any of these (the template's end-of-turn, `eos_token_id`).
    pub stop_tokens: Vec<u32>,
    /// The id the left padding is made of (any id of the vocabulary: padding is masked);
    /// default 0.
    pub pad_token: u32,
    /// Keep each step's keys and values (default); `false` recomputes the whole sequence at
    /// every step.
    pub use_cache: bool,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_new_tokens: 20,
            temperature: None,
            top_k: None,
            top_p: None,
            seed: 0,
            stop_tokens: Vec::new(),
            pad_token: 0,
            use_cache: true,
        }
    }
}

impl GenerationConfig {
    /// At most `n` new tokens per prompt.
    pub fn max_new_tokens(mut self, n: usize) -> Self {
        self.max_new_tokens = n;
        self
    }

    /// Sampling at temperature `t` (0: greedy).
    pub fn temperature(mut self, t: f64) -> Self {
        self.temperature = Some(t);
        self
    }

    /// Sampling among the `k` most likely tokens.
    pub fn top_k(mut self, k: usize) -> Self {
        self.top_k = Some(k);
        self
    }

    /// Sampling among the most likely tokens whose probabilities reach `p` (in `(0, 1]`).
    pub fn top_p(mut self, p: f64) -> Self {
        self.top_p = Some(p);
        self
    }

    /// The seed of the sampling generator.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The tokens that end a sequence.
    pub fn stop_tokens(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        self.stop_tokens = ids.into_iter().collect();
        self
    }

    /// The id of the left padding.
    pub fn pad_token(mut self, id: u32) -> Self {
        self.pad_token = id;
        self
    }

    /// With the key/value cache (default) or recomputing every step.
    pub fn use_cache(mut self, on: bool) -> Self {
        self.use_cache = on;
        self
    }

    /// Whether a token is drawn rather than the largest logit taken.
    pub fn is_sampling(&self) -> bool {
        self.temperature.is_some_and(|t| t > 0.0)
    }

    /// Checks the settings: a finite temperature at least 0, `top_k` at least 1, `top_p` in
    /// `(0, 1]`.
    pub fn check(&self) -> Result<()> {
        let bad = |parameter: &str, reason: String| {
            Err(Error::Generation {
                what: parameter.to_string(),
                reason,
            })
        };
        if let Some(t) = self.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return bad("temperature", format!("{t}: must be a finite number >= 0"));
            }
        }
        if self.top_k == Some(0) {
            return bad("top_k", "0: must be at least 1".into());
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad("top_p", format!("{p}: must be in (0, 1]"));
            }
        }
        Ok(())
    }
}

/// The end-of-sequence ids of the model folder `dir`: `eos_token_id` (a number or a list) of
/// its `generation_config.json` (when it has one) and of its `config.json`, without repeats;
/// the stop tokens `transformers`' `generate` uses for the folder. An error names the file and
/// the key when a value is not an id or a list of ids, and names `generation_config.json` when
/// something is there that is no readable file (a folder, a link to nothing).
pub fn eos_token_ids(dir: impl AsRef<Path>) -> Result<Vec<u32>> {
    let dir = dir.as_ref();
    let mut ids = Vec::new();
    // Repeats found in a set: a hostile list of millions of ids stays linear.
    let mut seen = std::collections::HashSet::new();
    let generation = dir.join("generation_config.json");
    // A `generation_config.json` that is there but no file (a folder, a link to nothing) is an
    // error, not skipped: its stop tokens would be lost without a word.
    let mut files = Vec::new();
    if present(&generation) {
        files.push(read_json_file(&generation)?);
    }
    files.push(read_json(dir)?);
    for (path, json) in files {
        let bad = || {
            Error::config(
                &path,
                Some("eos_token_id"),
                "expected an id or a list of ids",
            )
        };
        let found: Vec<u32> = match json.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|v| u32::try_from(v).ok())
                        .ok_or_else(bad)
                })
                .collect::<Result<_>>()?,
            Some(v) => vec![v
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(bad)?],
        };
        for id in found {
            if seen.insert(id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// The prompts left-padded to one length: `[B][T]` ids, mask and positions
/// (`cumsum(mask) - 1`, 1 on the padding, as `transformers` makes them).
struct Batch {
    ids: Vec<Vec<u32>>,
    mask: Vec<Vec<u8>>,
    positions: Vec<Vec<u32>>,
}

impl Batch {
    fn left_padded(prompts: &[Vec<u32>], pad: u32) -> Result<Batch> {
        if prompts.is_empty() {
            return Err(Error::Generation {
                what: "prompts".into(),
                reason: "no prompt given".into(),
            });
        }
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(Error::Generation {
                what: format!("prompts[{i}]"),
                reason: "an empty prompt (give at least one token, such as BOS)".into(),
            });
        }
        let t = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let mut batch = Batch {
            ids: Vec::new(),
            mask: Vec::new(),
            positions: Vec::new(),
        };
        for p in prompts {
            let pad_len = t - p.len();
            batch.ids.push([vec![pad; pad_len], p.clone()].concat());
            batch
                .mask
                .push([vec![0; pad_len], vec![1; p.len()]].concat());
            let pos = (0..p.len() as u32).collect::<Vec<_>>();
            batch.positions.push([vec![1; pad_len], pos].concat());
        }
        Ok(batch)
    }

    /// Appends one token (and its mask, position) to every row.
    fn push(&mut self, tokens: &[u32]) {
        for (i, &tok) in tokens.iter().enumerate() {
            // `cumsum(mask) - 1`: the number of tokens before it.
            let position = self.mask[i].iter().filter(|&&m| m != 0).count() as u32;
            self.ids[i].push(tok);
            self.mask[i].push(1);
            self.positions[i].push(position);
        }
    }

    /// The columns `from..` (the tokens a step runs).
    fn columns(&self, from: usize) -> Batch {
        let cut = |rows: &[Vec<u32>]| rows.iter().map(|r| r[from..].to_vec()).collect();
        Batch {
            ids: cut(&self.ids),
            mask: self.mask.iter().map(|r| r[from..].to_vec()).collect(),
            positions: cut(&self.positions),
        }
    }

    /// The ids as a `[B, T]` tensor.
    fn ids_tensor(&self, device: &Device) -> Result<Tensor> {
        let t = self.ids.first().map_or(0, Vec::len);
        Ok(Tensor::from_vec(
            self.ids.concat(),
            (self.ids.len(), t),
            device,
        )?)
    }
}

/// One forward step of a model: the last position's logits `[B, vocab]` of `inputs`, the
/// step's keys and values appended to the cache.
pub(crate) type DecodeFn<'m> =
    dyn Fn(&DecodeInputs<'_>, &mut KvCache) -> candle_core::Result<Tensor> + 'm;

/// Generates from `prompts` with `decode` (a model on `device`): the new tokens of each prompt
/// (a stop token included as the last).
pub(crate) fn generate(
    decode: &DecodeFn<'_>,
    device: &Device,
    prompts: &[Vec<u32>],
    config: &GenerationConfig,
) -> Result<Vec<Vec<u32>>> {
    config.check()?;
    let mut batch = Batch::left_padded(prompts, config.pad_token)?;
    let mut sampler = Sampler::new(config.temperature, config.top_k, config.top_p, config.seed);
    let mut out = vec![Vec::new(); prompts.len()];
    let mut done = vec![false; prompts.len()];
    let mut cache = KvCache::new();
    // A set: a folder's `eos_token_id` list may hold millions of ids, looked up every token.
    let stop: std::collections::HashSet<u32> = config.stop_tokens.iter().copied().collect();
    for made in 0..config.max_new_tokens {
        if !config.use_cache {
            cache = KvCache::new();
        }
        let step = batch.columns(cache.len());
        let ids = step.ids_tensor(device)?;
        let inputs = DecodeInputs {
            input_ids: &ids,
            position_ids: &step.positions,
            attention_mask: &step.mask,
        };
        let logits = decode(&inputs, &mut cache)?;
        let logits_dtype = logits.dtype();
        let logits = logits.to_dtype(candle_core::DType::F32)?;
        let rows = logits.to_vec2::<f32>()?;
        let mut next = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            if done[i] {
                next.push(config.pad_token);
                continue;
            }
            if let Some(what) = sampling::unusable(row) {
                return Err(Error::Generation {
                    what: format!("prompts[{i}]"),
                    reason: format!(
                        "the model's logits for new token {} {what}, so no token can be picked \
                         (its activations overflowed {logits_dtype:?}: weights too large for \
                         that type, or a model whose training diverged)",
                        made + 1
                    ),
                });
            }
            let tok = sampler.pick(row);
            out[i].push(tok);
            done[i] = stop.contains(&tok);
            next.push(tok);
        }
        if done.iter().all(|&d| d) {
            break;
        }
        batch.push(&next);
    }
    Ok(out)
}
