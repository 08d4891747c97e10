//! The fine-tuning example's data: the text tokenized and cut into windows, the model's inputs
//! and labels for a batch of windows, and the held-out loss.

use accelerate_rs::{Accelerator, ReduceOp};
use accelerate_rs_models::{encode_corpus, load_tokenizer, AutoModel, Task, IGNORE_INDEX};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::chat::{self, ids_and_index, is_conversation_file, ChatRows};
use crate::Args;

/// The training and held-out windows, with what building inputs from them needs.
pub(crate) struct Data {
    /// What the model learns (from `model.task()`).
    pub task: Task,
    /// The tokenizer's mask token (masked LMs).
    pub mask_id: Option<u32>,
    /// Tokens in the text.
    pub tokens: usize,
    /// Training windows `[N, T]` and their indices `[N]`.
    pub train: (Tensor, Tensor),
    /// Held-out windows and their indices.
    pub val: (Tensor, Tensor),
    /// Conversations: the rows (`train` and `val` hold their ids).
    pub chat: Option<ChatRows>,
}

impl Data {
    /// Reads and tokenizes `--train` with the model folder's tokenizer and cuts it into windows
    /// of `--seq-len` tokens, the last `--eval-fraction` held out; or, for conversations, the
    /// rows of [`ChatRows::load`].
    pub(crate) fn load(accelerator: &Accelerator, args: &Args, model: &AutoModel) -> Result<Self> {
        if is_conversation_file(&args.train)? {
            let rows = ChatRows::load(accelerator, args, model)?;
            let (train, val) = (ids_and_index(&rows.train)?, ids_and_index(&rows.val)?);
            return Ok(Data {
                task: model.task(),
                mask_id: None,
                tokens: rows
                    .train
                    .iter()
                    .map(|r| r.attention_mask.iter().sum::<u32>() as usize)
                    .sum(),
                train,
                val,
                chat: Some(rows),
            });
        }
        if args.eval.is_some() || args.pack || args.train_on_everything {
            bail!(
                "{}: plain text (not JSONL conversations with `messages` or `prompt`): --eval, \
                 --pack and --train-on-everything apply to conversations",
                args.train.display()
            );
        }
        let task = model.task();
        if task == Task::SequenceClassification {
            bail!(
                "{}: a sequence classifier needs labelled examples; this example trains \
                 language models (causal or masked) on plain text",
                args.model.display()
            );
        }
        let tokenizer = load_tokenizer(&args.model)?;
        let mask_id = ["<mask>", "[MASK]"]
            .iter()
            .find_map(|t| tokenizer.token_to_id(t));
        if task == Task::MaskedLm && mask_id.is_none() {
            bail!(
                "{}: the tokenizer has no <mask> or [MASK] token",
                args.model.display()
            );
        }
        let text = accelerate_rs::files::read_to_string_bounded(
            &args.train,
            accelerate_rs::files::MAX_TEXT_BYTES,
        )?;
        let tokens = encode_corpus(&tokenizer, &text)?;
        let vocab = model.config_json()["vocab_size"].as_u64().unwrap_or(0) as usize;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("the tokenizer gives id {bad}, outside the model's vocabulary of {vocab}");
        }
        if !(0.0..1.0).contains(&args.eval_fraction) {
            bail!(
                "--eval-fraction must be in [0, 1), got {}",
                args.eval_fraction
            );
        }
        let split = tokens.len() - (tokens.len() as f64 * args.eval_fraction) as usize;
        Ok(Data {
            task,
            mask_id,
            tokens: tokens.len(),
            train: windows(&tokens[..split], args.seq_len, 0)?,
            val: windows(&tokens[split..], args.seq_len, args.eval_windows)?,
            chat: None,
        })
    }
}

/// The model's inputs and labels for windows `ids` `[B, T]` whose dataset indices are `index`:
/// the windows themselves for a causal LM (shifted in `loss`); for a masked LM, each token
/// replaced by `mask_id` with probability `p` (the same positions for a window on any number
/// of processes: drawn from the seed and the window's index), labels -100 elsewhere.
pub(crate) fn inputs_and_labels(
    task: Task,
    ids: &Tensor,
    index: &Tensor,
    mask_id: Option<u32>,
    p: f64,
    seed: u64,
) -> Result<(Tensor, Tensor)> {
    if task != Task::MaskedLm {
        return Ok((ids.clone(), ids.to_dtype(DType::I64)?));
    }
    let mask_id = mask_id.context("a masked LM needs a mask token")?;
    let rows = ids.to_vec2::<u32>()?;
    let index = index.to_vec1::<u32>()?;
    let (mut input, mut labels) = (Vec::new(), Vec::new());
    for (row, &i) in rows.iter().zip(&index) {
        let mut rng =
            ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9).wrapping_add(i as u64));
        for &tok in row {
            if rng.random::<f64>() < p {
                input.push(mask_id);
                labels.push(tok as i64);
            } else {
                input.push(tok);
                labels.push(IGNORE_INDEX);
            }
        }
    }
    let shape = ids.dims2()?;
    Ok((
        Tensor::from_vec(input, shape, ids.device())?,
        Tensor::from_vec(labels, shape, ids.device())?,
    ))
}

/// Non-overlapping windows of `t` tokens: `[N, t]` and their indices `[N]`.
fn windows(tokens: &[u32], t: usize, limit: usize) -> Result<(Tensor, Tensor)> {
    let mut n = tokens.len() / t;
    if limit > 0 {
        n = n.min(limit);
    }
    if n == 0 {
        bail!(
            "{} tokens make no window of {t}: use a longer text or a shorter --seq-len",
            tokens.len()
        );
    }
    let ids = Tensor::from_slice(&tokens[..n * t], (n, t), &Device::Cpu)?;
    let index = Tensor::arange(0u32, n as u32, &Device::Cpu)?;
    Ok((ids, index))
}

/// The mean held-out loss over every held-out window (each process takes every
/// `world_size`-th window; the sums are reduced), weighted by the tokens predicted.
pub(crate) fn evaluate(
    accelerator: &Accelerator,
    model: &AutoModel,
    data: &Data,
    args: &Args,
) -> Result<f64> {
    if let Some(rows) = &data.chat {
        return chat::evaluate(accelerator, model, rows, args.batch_size);
    }
    let (task, val, mask_id) = (data.task, &data.val, data.mask_id);
    let device = accelerator.device();
    let n = val.0.dim(0)?;
    let mine: Vec<u32> = (accelerator.rank()..n)
        .step_by(accelerator.world_size())
        .map(|i| i as u32)
        .collect();
    let (mut sum, mut count) = (0f64, 0f64);
    let batch = args.batch_size.max(1);
    let mut chunks: Vec<&[u32]> = mine.chunks(batch).collect();
    if model.sharded_parameters().is_some() {
        // ZeRO-3: every rank runs the same units in the same order, so every rank makes as many
        // forward passes as the rank with the most windows (an empty chunk: window 0, counted
        // for nothing).
        let most = n.div_ceil(accelerator.world_size()).div_ceil(batch);
        chunks.resize(most, &[]);
    }
    for chunk in chunks {
        let (chunk, weight) = match chunk {
            [] => (&[0u32][..], 0.0),
            c => (c, 1.0),
        };
        let idx = Tensor::new(chunk, &Device::Cpu)?;
        let ids = val.0.index_select(&idx, 0)?;
        let index = val.1.index_select(&idx, 0)?;
        // Held-out masks from their own seed.
        let (x, y) = inputs_and_labels(
            task,
            &ids,
            &index,
            mask_id,
            args.mlm_probability,
            args.seed ^ 0xEEEE,
        )?;
        let predicted = match task {
            Task::CausalLm => (ids.dim(0)? * (ids.dim(1)? - 1)) as f64,
            _ => y
                .ge(0i64)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()? as f64,
        };
        let predicted = predicted * weight;
        if predicted == 0.0 && model.sharded_parameters().is_none() {
            continue;
        }
        let loss = model.loss(&x.to_device(device)?, &y.to_device(device)?)?;
        sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * predicted;
        count += predicted;
    }
    let totals = accelerator.reduce(&Tensor::new(&[sum, count], device)?, ReduceOp::Sum)?;
    let totals = totals.to_vec1::<f64>()?;
    if totals[1] == 0.0 {
        bail!("no held-out token to evaluate: raise --eval-fraction");
    }
    Ok(totals[0] / totals[1])
}
