//! Building blocks shared by the architectures: parameters initialized as `transformers` does,
//! attention with padding masks, sliding windows and packed documents (tiled flash attention on
//! the CPU, fused, or composed where soft-capping or attention dropout needs it), position and
//! document ids checked, dropout, and the language-model losses.

use accelerate_rs::nn::{
    cross_entropy_with, flash_attention, flash_attention_fused, linear_cross_entropy,
    scaled_dot_product_attention, softmax_last_dim, AttentionOptions, CrossEntropyOptions,
    FlashAttentionOptions, Linear,
};
use candle_core::{DType, Result, Tensor};
use candle_nn::{Init, VarBuilder};

/// Which attention the layers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AttentionBackend {
    /// `accelerate_rs::nn::flash_attention` on the CPU (tiled: memory linear in the sequence,
    /// grouped-query attention without repeating the keys and values) wherever the layer's
    /// options allow it (not with Gemma 2's soft-capped scores nor with attention dropout in
    /// training); elsewhere the fused `scaled_dot_product_attention`, or composed ops where a
    /// sliding window, documents, soft-capping or dropout need them. On a GPU the same flash
    /// attention where its CUDA kernel is on (`accelerate_rs::nn::flash_attention_fused`),
    /// else the fused or composed ops.
    #[default]
    Auto,
    /// Composed Candle ops everywhere (the attention weights materialized): the reference.
    Composed,
}

/// The label value that adds nothing to a loss (`transformers`' and PyTorch's `-100`).
pub const IGNORE_INDEX: i64 = -100;

/// N(0, `std`²), or zeros for `std` 0 (parameters about to be loaded: no random numbers drawn).
pub(crate) fn normal(std: f64) -> Init {
    if std == 0.0 {
        Init::Const(0.0)
    } else {
        Init::Randn {
            mean: 0.0,
            stdev: std,
        }
    }
}

/// A `[out, in]` linear layer named `weight` (and `bias`) under `vb`, initialized as
/// `transformers` does: weights from N(0, `std`²), biases zero.
pub(crate) fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    std: f64,
    vb: VarBuilder,
) -> Result<Linear> {
    let (w, b) = linear_params(in_dim, out_dim, bias, std, &vb)?;
    Ok(Linear::new(w, b))
}

/// The parameters of [`linear`]: `weight` `[out, in]` from N(0, `std`²) and, if asked, a zero
/// `bias`, under `vb`.
pub(crate) fn linear_params(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    std: f64,
    vb: &VarBuilder,
) -> Result<(Tensor, Option<Tensor>)> {
    let w = vb.get_with_hints((out_dim, in_dim), "weight", normal(std))?;
    let b = if bias {
        Some(vb.get_with_hints(out_dim, "bias", Init::Const(0.0))?)
    } else {
        None
    };
    Ok((w, b))
}

/// An embedding table `[n, dim]` named `weight` under `vb`, from N(0, `std`²).
pub(crate) fn embedding(n: usize, dim: usize, std: f64, vb: VarBuilder) -> Result<Tensor> {
    vb.get_with_hints((n, dim), "weight", normal(std))
}

/// Rows `ids` (any shape of integer ids) of `table` `[n, dim]`: `[.., dim]`, differentiable
/// with respect to the table, except the row `padding_idx` (PyTorch's `nn.Embedding` padding
/// index, `pad_token_id` in `transformers`' Llama and BERT embeddings): its lookups pass no
/// gradient to the table. An id out of range, or ids of a float dtype, are an error naming them.
pub(crate) fn lookup(
    table: &Tensor,
    ids: &Tensor,
    padding_idx: Option<usize>,
    what: &str,
) -> Result<Tensor> {
    let n = table.dim(0)?;
    if ids.dtype().is_float() {
        candle_core::bail!(
            "{what}: of dtype {:?}; integer ids are expected",
            ids.dtype()
        );
    }
    let flat = ids.flatten_all()?.to_dtype(DType::I64)?;
    let values = flat.to_vec1::<i64>()?;
    if let Some((i, bad)) = values
        .iter()
        .enumerate()
        .find(|(_, &v)| v < 0 || v as usize >= n)
    {
        candle_core::bail!(
            "{what}: id {bad} at position {i} is outside the table's {n} rows (0..{n})"
        );
    }
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    // The ids just read, handed over in host memory: the lookup reads them again without
    // waiting for the device (one host synchronization per lookup, not two).
    let rows: Vec<u32> = values.iter().map(|&v| v as u32).collect();
    let host = Tensor::from_vec(rows, values.len(), &candle_core::Device::Cpu)?;
    let rows = accelerate_rs::nn::embedding(table, &host)?;
    let rows = match padding_idx {
        Some(pad) if values.iter().any(|&v| v as usize == pad) => {
            let flat = host.to_device(table.device())?;
            // The same values; the padding lookups through a detached copy of the table.
            let keep: Vec<f32> = values
                .iter()
                .map(|&v| if v as usize == pad { 0.0 } else { 1.0 })
                .collect();
            let keep = Tensor::from_vec(keep, (values.len(), 1), table.device())?
                .to_dtype(table.dtype())?;
            let frozen = table.detach().index_select(&flat, 0)?;
            (rows.broadcast_mul(&keep)? + frozen.broadcast_mul(&(1.0 - keep)?)?)?
        }
        _ => rows,
    };
    rows.reshape(dims)
}

/// `pad_token_id` from a configuration's other keys, if it is a row of a `vocab`-row table
/// (the embedding's padding index).
pub(crate) fn padding_idx(
    extra: &serde_json::Map<String, serde_json::Value>,
    vocab: usize,
) -> Option<usize> {
    extra
        .get("pad_token_id")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .filter(|&v| v < vocab)
}

/// A layer norm's `weight` (ones) and `bias` (zeros) under `vb`.
pub(crate) fn norm_params(
    dim: usize,
    bias: bool,
    vb: &VarBuilder,
) -> Result<(Tensor, Option<Tensor>)> {
    let w = vb.get_with_hints(dim, "weight", Init::Const(1.0))?;
    let b = if bias {
        Some(vb.get_with_hints(dim, "bias", Init::Const(0.0))?)
    } else {
        None
    };
    Ok((w, b))
}

/// Dropout with probability `p` when `train` (PyTorch's inverted dropout), else the identity:
/// `accelerate_rs::nn::dropout`, whose masks a checkpointed block's recomputation replays.
pub(crate) fn dropout(x: &Tensor, p: f64, train: bool) -> Result<Tensor> {
    if train && p > 0.0 {
        accelerate_rs::nn::dropout(x, p as f32)
    } else {
        Ok(x.clone())
    }
}

/// `[B, T]` attention mask (`transformers`' convention: 1 for a token, 0 for padding) checked
/// against the input ids' shape.
pub(crate) fn check_mask(mask: Option<&Tensor>, b: usize, t: usize) -> Result<()> {
    if let Some(m) = mask {
        if m.dims() != [b, t] {
            candle_core::bail!(
                "attention_mask has shape {:?}, expected [batch, seq] = [{b}, {t}] (1 for a \
                 token, 0 for padding)",
                m.dims()
            );
        }
    }
    Ok(())
}

/// Position ids `[B, T]` (`None`: `0..T`) checked: integers, none negative. Returns them
/// flattened (`[B·T]` u32, on the ids' device) with the largest one.
pub(crate) fn position_ids(
    ids: Option<&Tensor>,
    b: usize,
    t: usize,
) -> Result<Option<(Tensor, usize)>> {
    let Some(ids) = ids else {
        return Ok(None);
    };
    let values = integer_ids(ids, "position_ids", b, t)?;
    if let Some((i, bad)) = values.iter().enumerate().find(|(_, &v)| v < 0) {
        candle_core::bail!("position_ids: {bad} at position {i} is negative");
    }
    let max = values.iter().copied().max().unwrap_or(0) as usize;
    let flat: Vec<u32> = values.iter().map(|&v| v as u32).collect();
    Ok(Some((Tensor::from_vec(flat, b * t, ids.device())?, max)))
}

/// Document ids `[B, T]` (packed rows) checked: integers of the input's shape.
pub(crate) fn check_documents(ids: Option<&Tensor>, b: usize, t: usize) -> Result<()> {
    if let Some(ids) = ids {
        integer_ids(ids, "document_ids", b, t)?;
    }
    Ok(())
}

/// `ids` `[b, t]` of an integer dtype, as i64 values (`what` names them in errors).
fn integer_ids(ids: &Tensor, what: &str, b: usize, t: usize) -> Result<Vec<i64>> {
    if ids.dims() != [b, t] {
        candle_core::bail!(
            "{what} has shape {:?}, expected the input ids' [batch, seq] = [{b}, {t}]",
            ids.dims()
        );
    }
    if ids.dtype().is_float() {
        candle_core::bail!("{what} must be integers, got {:?}", ids.dtype());
    }
    ids.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()
}

/// What the attention of every block of a forward pass sees besides its input (GPT-2, BERT):
/// the padding mask, the documents of packed rows, the backend. Cloned into a checkpointed
/// block's closure.
#[derive(Debug, Clone, Default)]
pub(crate) struct Masks {
    /// `[B, T]`, 1 = token, 0 = padding.
    pub mask: Option<Tensor>,
    /// `[B, T]` document ids.
    pub documents: Option<Tensor>,
    /// Which attention runs.
    pub backend: AttentionBackend,
}

/// The attention of one layer: what each query may see.
#[derive(Debug, Clone)]
pub(crate) struct AttentionSpec<'a> {
    /// Decoder self-attention (query `i` sees keys `..=i`).
    pub causal: bool,
    /// `[B, T]`, 1 = token, 0 = padding.
    pub mask: Option<&'a Tensor>,
    /// `[B, T]` document ids: a query sees the keys of its own document only.
    pub documents: Option<&'a Tensor>,
    /// Query `i` sees keys `j` with `i - j < window` only (Mistral's sliding window).
    pub window: Option<usize>,
    /// The factor on the scores.
    pub scale: f64,
    /// Dropout on the attention probabilities (training only).
    pub dropout: f64,
    /// Gemma 2's soft-capping of the scores: `cap · tanh(scores / cap)` before the mask.
    pub softcap: Option<f64>,
    /// Which attention runs.
    pub backend: AttentionBackend,
}

/// `softmax(scale q kᵀ + mask) v` for `q` `[B, H, T, D]` and `k`, `v` `[B, KV, T, D]` (`KV`
/// divides `H`: grouped-query attention). With [`AttentionBackend::Auto`] and neither
/// soft-capping nor attention dropout, `accelerate_rs::nn::flash_attention` (tiled, the keys
/// and values not repeated) where it runs fused (on the CPU; on a GPU where its CUDA kernel is
/// on); else `accelerate_rs::nn::scaled_dot_product_attention` (one fused op on the CPU)
/// unless a sliding window that cuts something, documents, soft-capping,
/// dropout or the `Composed` backend ask for the composed path.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec<'_>,
    train: bool,
) -> Result<Tensor> {
    let (h, kv, t) = (q.dim(1)?, k.dim(1)?, q.dim(2)?);
    if kv == 0 || h % kv != 0 {
        candle_core::bail!("attention: {h} query heads are not a multiple of {kv} key/value heads");
    }
    let drops = train && spec.dropout > 0.0;
    let auto = spec.backend == AttentionBackend::Auto;
    if auto && !drops && spec.softcap.is_none() && flash_attention_fused(q)? {
        return flash(q, k, v, spec);
    }
    let window_cuts = spec.window.is_some_and(|w| w < t);
    if auto && !window_cuts && !drops && spec.softcap.is_none() && spec.documents.is_none() {
        let mut options = AttentionOptions::default()
            .causal(spec.causal)
            .scale(spec.scale);
        if let Some(m) = spec.mask {
            options = options.key_padding_mask(m.eq(0.0)?);
        }
        // Grouped key/value heads as they are: repeated inside where a path needs it (on a
        // GPU's one-node attention, read in place).
        return scaled_dot_product_attention(q, k, v, &options);
    }
    let (k, v) = (repeat_kv(k, h / kv)?, repeat_kv(v, h / kv)?);
    composed_attention(q, &k, &v, spec, train)
}

/// The attention through `accelerate_rs::nn::flash_attention` (no dropout, no soft-capping).
fn flash(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec<'_>) -> Result<Tensor> {
    let mut options = FlashAttentionOptions::default()
        .causal(spec.causal)
        .scale(spec.scale);
    if let Some(m) = spec.mask {
        options = options.key_padding_mask(m.eq(0.0)?);
    }
    if let Some(w) = spec.window {
        options = options.window(w);
    }
    if let Some(d) = spec.documents {
        options = options.document_ids(d.clone());
    }
    flash_attention(q, k, v, &options)
}

/// The attention as composed (differentiable) Candle ops, with any mask.
fn composed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec<'_>,
    train: bool,
) -> Result<Tensor> {
    let (b, h, tq, _) = q.dims4()?;
    let tk = k.dim(2)?;
    let dev = q.device();
    let rows = |m: Option<&Tensor>| -> Result<Option<Vec<Vec<i64>>>> {
        m.map(|m| m.to_dtype(DType::I64)?.to_vec2::<i64>())
            .transpose()
    };
    let (pad, docs) = (rows(spec.mask)?, rows(spec.documents)?);
    let mut visible = vec![0u8; b * tq * tk];
    for bi in 0..b {
        for i in 0..tq {
            for j in 0..tk {
                let future = spec.causal && j > i;
                let outside = spec.window.is_some_and(|w| i >= j + w);
                let padded = pad.as_ref().is_some_and(|p| p[bi][j] == 0);
                let other = docs.as_ref().is_some_and(|d| d[bi][i] != d[bi][j]);
                visible[(bi * tq + i) * tk + j] = u8::from(!(future || outside || padded || other));
            }
        }
    }
    let visible = Tensor::from_vec(visible, (b, 1, tq, tk), dev)?.broadcast_as((b, h, tq, tk))?;
    let scores = (q.contiguous()?.matmul(&k.contiguous()?.t()?)? * spec.scale)?;
    let scores = match spec.softcap {
        Some(cap) => softcap(&scores, cap)?,
        None => scores,
    };
    let neg = Tensor::new(f32::NEG_INFINITY, dev)?
        .to_dtype(scores.dtype())?
        .broadcast_as(scores.shape())?;
    let p = softmax_last_dim(&visible.where_cond(&scores, &neg)?)?;
    // A query that sees no key gets zeros (the softmax of an empty row is NaN).
    let p = visible.where_cond(&p, &p.zeros_like()?)?;
    let p = dropout(&p, spec.dropout, train)?;
    p.matmul(&v.contiguous()?)
}

/// `k` `[B, KV, T, D]` with each head repeated `n` times: `[B, KV·n, T, D]` (grouped-query
/// attention; the gradient sums over the copies).
pub(crate) fn repeat_kv(k: &Tensor, n: usize) -> Result<Tensor> {
    if n == 1 {
        return Ok(k.clone());
    }
    let (b, kv, t, d) = k.dims4()?;
    k.unsqueeze(2)?
        .broadcast_as((b, kv, n, t, d))?
        .reshape((b, kv * n, t, d))
}

/// Labels as i64, checked against the input's `[B, T]`.
fn labels_i64(labels: &Tensor, b: usize, t: usize) -> Result<Tensor> {
    if labels.dims() != [b, t] {
        candle_core::bail!(
            "labels have shape {:?}, expected the input ids' [batch, seq] = [{b}, {t}]",
            labels.dims()
        );
    }
    if labels.dtype().is_float() {
        candle_core::bail!(
            "labels must be integer token ids (-100 to ignore a position), got {:?}",
            labels.dtype()
        );
    }
    labels.to_dtype(DType::I64)
}

/// The causal language-model loss of `transformers`' `*ForCausalLM`: position `t`'s hidden
/// state predicts label `t + 1` (the shift is done here), labels equal to -100 are ignored, the
/// mean is over the others. `hidden` is `[B, T, C]`, `head` the output layer; the head and the
/// cross-entropy run as one fused op (no `[B, T, vocab]` logits kept).
pub(crate) fn causal_lm_loss(hidden: &Tensor, head: &Linear, labels: &Tensor) -> Result<Tensor> {
    let (b, t, _) = hidden.dims3()?;
    let labels = labels_i64(labels, b, t)?;
    if t < 2 {
        candle_core::bail!(
            "a causal language-model loss needs sequences of at least 2 tokens, got {t}"
        );
    }
    let x = hidden.narrow(1, 0, t - 1)?;
    let targets = labels.narrow(1, 1, t - 1)?.contiguous()?;
    linear_cross_entropy(
        &x,
        head,
        &targets,
        CrossEntropyOptions::default().ignore_index(IGNORE_INDEX),
    )
}

/// `cap · tanh(x / cap)`: Gemma 2's soft-capping of attention scores and logits.
pub(crate) fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    (x / cap)?.tanh()? * cap
}

/// The causal language-model loss of [`causal_lm_loss`] from logits already computed
/// (`[B, T, vocab]`, soft-capped): the shift, -100 ignored, the mean over the others.
pub(crate) fn causal_lm_loss_from_logits(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let (b, t, v) = logits.dims3()?;
    let labels = labels_i64(labels, b, t)?;
    if t < 2 {
        candle_core::bail!(
            "a causal language-model loss needs sequences of at least 2 tokens, got {t}"
        );
    }
    let x = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?;
    let targets = labels.narrow(1, 1, t - 1)?.flatten_all()?;
    cross_entropy_with(
        &x,
        &targets,
        CrossEntropyOptions::default().ignore_index(IGNORE_INDEX),
    )
}

/// The masked language-model loss (`*ForMaskedLM`): no shift, -100 ignored.
pub(crate) fn masked_lm_loss(hidden: &Tensor, head: &Linear, labels: &Tensor) -> Result<Tensor> {
    let (b, t, _) = hidden.dims3()?;
    let labels = labels_i64(labels, b, t)?;
    linear_cross_entropy(
        hidden,
        head,
        &labels,
        CrossEntropyOptions::default().ignore_index(IGNORE_INDEX),
    )
}

/// Cross-entropy of `logits` `[N, C]` against class ids `[N]`, -100 ignored.
pub(crate) fn classification_loss(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let labels = labels.flatten_all()?.to_dtype(DType::I64)?;
    cross_entropy_with(
        logits,
        &labels,
        CrossEntropyOptions::default().ignore_index(IGNORE_INDEX),
    )
}

/// The mean of `(a - b)²`.
pub(crate) fn mse(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    (a - b)?.sqr()?.mean_all()
}

/// The mean binary cross-entropy of `logits` against `targets` in `[0, 1]` (PyTorch's
/// `BCEWithLogitsLoss`, computed stably: `max(x, 0) - x y + log(1 + exp(-|x|))`).
pub(crate) fn bce_with_logits(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let y = targets.to_dtype(logits.dtype())?;
    let pos = logits.relu()?;
    let soft = (logits.abs()?.neg()?.exp()? + 1.0)?.log()?;
    ((pos - (logits * y)?)? + soft)?.mean_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn float_or_out_of_range_ids_are_named() -> Result<()> {
        let dev = Device::Cpu;
        let table = Tensor::zeros((4, 2), DType::F32, &dev)?;
        let rows = lookup(&table, &Tensor::new(&[[3u32, 0]], &dev)?, None, "input_ids")?;
        assert_eq!(rows.dims(), &[1, 2, 2]);
        for (ids, bad) in [
            (
                Tensor::new(&[f32::NAN, 1.0], &dev)?,
                "input_ids: of dtype F32",
            ),
            (Tensor::new(&[7i64], &dev)?, "input_ids: id 7 at position 0"),
        ] {
            let err = lookup(&table, &ids, None, "input_ids")
                .err()
                .map(|e| e.to_string());
            assert!(err.as_deref().is_some_and(|e| e.contains(bad)), "{err:?}");
        }
        Ok(())
    }
}
