//! The key/value cache of generation: each layer's keys (after RoPE) and values of the tokens
//! seen so far, the attention mask of those tokens, and the attention of new queries over them.
//!
//! [`KvCache`] owns the state of one generation; a forward step ([`KvCache::begin`]) appends
//! the new tokens' mask and hands each layer a [`CacheSlot`], through which the layer's
//! attention appends its keys and values and attends over all of them
//! ([`CacheSlot::attend`]). Keys and values are stored detached (no autograd graph is kept
//! from one step to the next) and with the key/value heads only (grouped-query attention
//! repeats them at each step).

use std::sync::{Arc, Mutex};

use accelerate_rs::nn::softmax_last_dim;
use candle_core::{DType, Result, Tensor};

/// One layer's keys and values `[B, KV, L, D]`, shared with the step that appends to them.
type LayerKv = Arc<Mutex<Option<(Tensor, Tensor)>>>;

/// What one step of generation runs on: the new tokens, their positions and their mask.
#[derive(Debug, Clone, Copy)]
pub struct DecodeInputs<'a> {
    /// `[B, T]` integer ids of the new tokens (the whole prompt at the first step).
    pub input_ids: &'a Tensor,
    /// `[B, T]` positions of the new tokens (RoPE, learned positions): with left padding they
    /// skip the padding (`transformers`' `cumsum(attention_mask) - 1`).
    pub position_ids: &'a [Vec<u32>],
    /// `[B][T]`: 1 for a token, 0 for padding (no query sees a padding key).
    pub attention_mask: &'a [Vec<u8>],
}

/// The key/value cache of one generation: per layer the keys (after RoPE) and values of every
/// token given so far, and their attention mask. Made empty by [`KvCache::new`]; each forward
/// step ([`Architecture::decode`](crate::Architecture::decode)) appends the new tokens. One
/// cache serves one model and one batch.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    /// `[B][L]`: 1 for a token, 0 for padding.
    mask: Vec<Vec<u8>>,
}

impl KvCache {
    /// An empty cache (its layers are made at the first step).
    pub fn new() -> Self {
        KvCache::default()
    }

    /// Tokens cached per sequence.
    pub fn len(&self) -> usize {
        self.mask.first().map_or(0, Vec::len)
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts a step over `inputs`: checks their shapes against the cache, appends their mask
    /// and returns what the layers attend with. `layers` is the model's count (an error if the
    /// cache was filled by another model).
    pub(crate) fn begin(&mut self, inputs: &DecodeInputs<'_>, layers: usize) -> Result<Step> {
        let (b, t) = inputs.input_ids.dims2()?;
        if t == 0 {
            candle_core::bail!("decode: input_ids has no token");
        }
        if self.is_empty() && self.layers.len() != layers {
            self.layers = (0..layers).map(|_| Arc::new(Mutex::new(None))).collect();
        }
        if self.layers.len() != layers {
            candle_core::bail!(
                "KvCache: made for {} layers, the model has {layers}",
                self.layers.len()
            );
        }
        let pos = inputs.position_ids;
        let mask = inputs.attention_mask;
        let pos_ok = pos.len() == b && pos.iter().all(|r| r.len() == t);
        if !pos_ok || mask.len() != b || mask.iter().any(|r| r.len() != t) {
            candle_core::bail!(
                "decode: position_ids and attention_mask must be [{b}][{t}] as input_ids"
            );
        }
        if !self.mask.is_empty() && self.mask.len() != b {
            candle_core::bail!(
                "KvCache: holds {} sequences, the step gives {b}",
                self.mask.len()
            );
        }
        let past = self.len();
        self.mask.resize(b, Vec::new());
        for (row, new) in self.mask.iter_mut().zip(inputs.attention_mask) {
            row.extend(new.iter().map(|&m| u8::from(m != 0)));
        }
        Ok(Step {
            layers: self.layers.clone(),
            mask: Arc::new(self.mask.clone()),
            past,
            new: t,
        })
    }
}

/// One step of generation as the layers see it: the cache's layers, the mask of every key, how
/// many keys were cached before the step and how many the step adds.
#[derive(Debug, Clone)]
pub(crate) struct Step {
    layers: Vec<LayerKv>,
    mask: Arc<Vec<Vec<u8>>>,
    past: usize,
    new: usize,
}

impl Step {
    /// Layer `i`'s view of the step.
    pub(crate) fn slot(&self, i: usize) -> Result<CacheSlot> {
        let kv = self.layers.get(i).cloned().ok_or_else(|| {
            candle_core::Error::Msg(format!("KvCache: no layer {i} in the cache"))
        })?;
        Ok(CacheSlot {
            kv,
            mask: self.mask.clone(),
            past: self.past,
            new: self.new,
        })
    }
}

/// What a layer's attention needs besides its queries, keys and values in a cached step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CachedSpec {
    /// Each query sees at most this many keys (itself included), counted in the padded
    /// sequence as `transformers` counts them.
    pub(crate) window: Option<usize>,
    /// The factor on the scores.
    pub(crate) scale: f64,
    /// Soft-capping of the scores (Gemma 2).
    pub(crate) softcap: Option<f64>,
}

/// One layer's part of a cached step (see [`KvCache`]).
#[derive(Debug, Clone)]
pub(crate) struct CacheSlot {
    kv: LayerKv,
    mask: Arc<Vec<Vec<u8>>>,
    past: usize,
    new: usize,
}

impl CacheSlot {
    /// Appends `k`, `v` `[B, KV, T, D]` (after RoPE) to the layer's cache and returns the
    /// attention of `q` `[B, H, T, D]` over every cached key: causal (query `i` of the step is
    /// at `past + i`), without the padding keys, within the window; `[B, H, T, D]`.
    pub(crate) fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        spec: CachedSpec,
    ) -> Result<Tensor> {
        let (k, v) = self.append(k, v)?;
        let (b, h, t, _) = q.dims4()?;
        let kv = k.dim(1)?;
        if kv == 0 || h % kv != 0 || t != self.new {
            candle_core::bail!("cached attention: {h} query heads over {kv} key heads, {t} queries for a step of {}", self.new);
        }
        let (k, v) = (repeat_heads(&k, h / kv)?, repeat_heads(&v, h / kv)?);
        let l = k.dim(2)?;
        let visible = self.visible(b, l, spec.window)?.to_device(q.device())?;
        let visible = visible.broadcast_as((b, h, t, l))?;
        let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * spec.scale)?;
        let scores = match spec.softcap {
            Some(cap) => ((&scores / cap)?.tanh()? * cap)?,
            None => scores,
        };
        let neg = Tensor::new(f32::NEG_INFINITY, q.device())?
            .to_dtype(scores.dtype())?
            .broadcast_as(scores.shape())?;
        let p = softmax_last_dim(&visible.where_cond(&scores, &neg)?)?;
        // A query that sees no key (a padding query) gets zeros, not NaN.
        let p = visible.where_cond(&p, &p.zeros_like()?)?;
        p.matmul(&v)
    }

    /// The layer's keys and values with `k`, `v` appended (stored detached, contiguous).
    fn append(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let mut kv = self
            .kv
            .lock()
            .map_err(|_| candle_core::Error::Msg("KvCache: a step panicked holding it".into()))?;
        let (k, v) = (k.detach(), v.detach());
        let both = match kv.take() {
            Some((pk, pv)) => {
                if pk.dim(2)? != self.past {
                    candle_core::bail!(
                        "KvCache: a layer holds {} keys, the cache {}",
                        pk.dim(2)?,
                        self.past
                    );
                }
                (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?)
            }
            None if self.past == 0 => (k.contiguous()?, v.contiguous()?),
            None => candle_core::bail!("KvCache: a layer holds no keys after {}", self.past),
        };
        *kv = Some(both.clone());
        Ok(both)
    }

    /// `[B, 1, T, L]` u8: whether query `i` of the step sees key `j`.
    fn visible(&self, b: usize, l: usize, window: Option<usize>) -> Result<Tensor> {
        let t = self.new;
        let mut out = vec![0u8; b * t * l];
        for (bi, keys) in self.mask.iter().enumerate().take(b) {
            for i in 0..t {
                let at = self.past + i;
                for (j, &key) in keys.iter().enumerate().take(l) {
                    let seen = j <= at && window.is_none_or(|w| at - j < w) && key != 0;
                    out[(bi * t + i) * l + j] = u8::from(seen);
                }
            }
        }
        Tensor::from_vec(out, (b, 1, t, l), &candle_core::Device::Cpu)?.to_dtype(DType::U8)
    }
}

/// `x` `[B, KV, L, D]` with each head repeated `n` times: `[B, KV·n, L, D]`.
fn repeat_heads(x: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return x.contiguous();
    }
    let (b, kv, l, d) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, kv, n, l, d))?
        .reshape((b, kv * n, l, d))
}
