//! The fine-tuning example's conversations: JSONL files (`messages`, or `prompt`/`completion`)
//! rendered with the model folder's chat template, labelled on the assistant's tokens (or on
//! every token), one example per row or packed (`--pack`); the token-weighted loss of a batch
//! of rows and the held-out assistant-token loss.

use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

use accelerate_rs::{Accelerator, ReduceOp, TokenLoss};
use accelerate_rs_models::chat::{
    ChatDataset, ChatEncoder, ChatExample, Overlong, PackedBatch, PackedRow, Packer,
};
use accelerate_rs_models::{AutoModel, Inputs, Task};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use crate::Args;

/// The rows of a chat run: each one example padded, or examples packed.
pub(crate) struct ChatRows {
    pub train: Vec<PackedRow>,
    pub val: Vec<PackedRow>,
    pub pack: bool,
}

/// Whether `path` holds conversations: its first non-blank line is a JSON object with
/// `messages` or `prompt` (an object with neither is an error naming the file); otherwise it is
/// plain text.
pub(crate) fn is_conversation_file(path: &Path) -> Result<bool> {
    // Only a regular file (a FIFO or a device would block or never end).
    let (file, _) = accelerate_rs::files::open_regular(path)?;
    let mut reader = std::io::BufReader::new(file);
    let mut line = String::new();
    loop {
        line.clear();
        // A bounded look at the first line (plain text may be one long line).
        let n = std::io::Read::take(&mut reader, 1 << 20)
            .read_line(&mut line)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok(false);
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    let Ok(serde_json::Value::Object(row)) = serde_json::from_str(line.trim()) else {
        return Ok(false);
    };
    if row.contains_key("messages") || row.contains_key("prompt") {
        return Ok(true);
    }
    let keys: Vec<&String> = row.keys().collect();
    bail!(
        "{}: line 1 is a JSON object with keys {keys:?}; a conversation needs `messages` (a list \
         of {{role, content}}) or `prompt` and `completion`",
        path.display()
    )
}

/// The encoded examples of `file`, at most `--seq-len` tokens each (longer ones truncated, and
/// counted in a printed line).
fn examples(
    accelerator: &Accelerator,
    file: &Path,
    encoder: Arc<ChatEncoder>,
    seq_len: usize,
) -> Result<Vec<ChatExample>> {
    let data = ChatDataset::from_arc(vec![file.to_path_buf()], encoder, seq_len)?
        .overlong(Overlong::Truncate);
    let mut pass = data.examples()?;
    let examples = (&mut pass).collect::<accelerate_rs_models::Result<Vec<_>>>()?;
    let s = pass.stats();
    accelerator.print(format!(
        "{}: {} conversations, {} examples; {} truncated and {} skipped for being longer than \
         --seq-len {seq_len} tokens (the longest has {})",
        file.display(),
        s.rows,
        s.examples,
        s.truncated,
        s.skipped,
        s.longest
    ));
    if examples.is_empty() {
        bail!("{}: no conversation to train on", file.display());
    }
    Ok(examples)
}

/// Rows of `seq_len` tokens: packed, or one example each (padded).
fn rows(examples: &[ChatExample], seq_len: usize, pad: u32, pack: bool) -> Result<Vec<PackedRow>> {
    let mut packer = Packer::new(seq_len)?.pad_id(pad);
    let mut rows = Vec::new();
    for example in examples {
        rows.extend(packer.push_example(example)?);
        if !pack {
            rows.extend(packer.finish());
        }
    }
    rows.extend(packer.finish());
    Ok(rows)
}

impl ChatRows {
    /// The conversations of `--train` (and `--eval`; without it, the last `--eval-fraction` of
    /// the training conversations are held out, which `--train-on-everything` refuses), encoded with the folder's chat template; the
    /// held-out rows are labelled on the assistant's tokens whatever `--train-on-everything`.
    pub(crate) fn load(accelerator: &Accelerator, args: &Args, model: &AutoModel) -> Result<Self> {
        if model.task() != Task::CausalLm {
            bail!(
                "{}: conversations train a causal language model; this folder holds a {:?} model",
                args.model.display(),
                model.task()
            );
        }
        let encoder = ChatEncoder::from_folder(&args.model)?;
        let pad = ["pad_token", "eos_token"]
            .iter()
            .find_map(|t| encoder.special_token_id(t))
            .unwrap_or(0);
        let eval_encoder = Arc::new(ChatEncoder::from_folder(&args.model)?);
        let train_encoder = Arc::new(encoder.train_on_all(args.train_on_everything));
        let mut train = examples(accelerator, &args.train, train_encoder, args.seq_len)?;
        let val = match &args.eval {
            Some(file) => examples(accelerator, file, eval_encoder, args.seq_len)?,
            None => {
                let held = (train.len() as f64 * args.eval_fraction) as usize;
                if held == 0 || held == train.len() {
                    bail!(
                        "{} conversations: --eval-fraction {} holds out none or all of them; \
                         give --eval FILE.jsonl",
                        train.len(),
                        args.eval_fraction
                    );
                }
                if args.train_on_everything {
                    bail!(
                        "--train-on-everything labels every token of the training \
                         conversations, and the held-out loss is the assistant's: give the \
                         held-out conversations as --eval FILE.jsonl"
                    );
                }
                train.split_off(train.len() - held)
            }
        };
        Ok(ChatRows {
            train: rows(&train, args.seq_len, pad, args.pack)?,
            // Held out one example per row even with `--pack`: packing cuts an example at a row's
            // end, and its continuation would be scored without its beginning.
            val: rows(&val, args.seq_len, pad, false)?,
            pack: args.pack,
        })
    }
}

/// Ids `[N, T]` and indices `[N]` of `rows`.
pub(crate) fn ids_and_index(rows: &[PackedRow]) -> Result<(Tensor, Tensor)> {
    let batch = PackedBatch::new(rows, &Device::Cpu)?;
    let n = rows.len() as u32;
    Ok((batch.input_ids, Tensor::arange(0u32, n, &Device::Cpu)?))
}

/// The rows of `index` (row numbers) stacked on `device`.
pub(crate) fn batch(rows: &[PackedRow], index: &[u32], device: &Device) -> Result<PackedBatch> {
    let picked: Vec<PackedRow> = index
        .iter()
        .map(|&i| {
            rows.get(i as usize)
                .cloned()
                .context("row index out of range")
        })
        .collect::<Result<_>>()?;
    Ok(PackedBatch::new(&picked, device)?)
}

/// The model's inputs for `batch`: packed rows with their positions and documents, else the
/// padding mask alone.
fn inputs(batch: &PackedBatch, pack: bool) -> Inputs<'_> {
    if pack {
        batch.inputs()
    } else {
        Inputs::new(&batch.input_ids).attention_mask(Some(&batch.attention_mask))
    }
}

/// The tokens the causal loss of `labels` `[B, T]` predicts (after the shift, not -100).
fn targets(labels: &Tensor) -> Result<u64> {
    let t = labels.dim(1)?;
    let shifted = labels.narrow(1, 1, t - 1)?;
    Ok(shifted
        .ge(0i64)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()? as u64)
}

/// The token-weighted loss of `batch`: the summed loss of its target tokens and their number
/// (a batch without one: a zero that still reaches every parameter, and 0).
pub(crate) fn token_loss(model: &AutoModel, batch: &PackedBatch, pack: bool) -> Result<TokenLoss> {
    let inputs = inputs(batch, pack);
    let n = targets(&batch.labels)?;
    let sum = if n == 0 {
        (model.forward_with(&inputs)?.sum_all()? * 0.0)?
    } else {
        (model.loss_with(&inputs, &batch.labels)? * n as f64)?
    };
    Ok(TokenLoss::new(sum, n)?)
}

/// The held-out assistant-token loss: the mean over every held-out target token (each process
/// takes every `world_size`-th row, one example each; the sums are reduced).
pub(crate) fn evaluate(
    accelerator: &Accelerator,
    model: &AutoModel,
    rows: &ChatRows,
    batch_size: usize,
) -> Result<f64> {
    let device = accelerator.device();
    let n = rows.val.len();
    let mine: Vec<u32> = (accelerator.rank()..n)
        .step_by(accelerator.world_size())
        .map(|i| i as u32)
        .collect();
    let mut chunks: Vec<&[u32]> = mine.chunks(batch_size.max(1)).collect();
    if model.sharded_parameters().is_some() {
        // ZeRO-3: as many forward passes on every rank (an empty chunk counts for nothing).
        let most = n
            .div_ceil(accelerator.world_size())
            .div_ceil(batch_size.max(1));
        chunks.resize(most, &[]);
    }
    let (mut sum, mut count) = (0f64, 0f64);
    for chunk in chunks {
        let (chunk, weight) = match chunk {
            [] => (&[0u32][..], 0.0),
            c => (c, 1.0),
        };
        let b = batch(&rows.val, chunk, device)?;
        let loss = token_loss(model, &b, false)?;
        sum += loss.sum().to_dtype(DType::F64)?.to_scalar::<f64>()? * weight;
        count += loss.tokens() as f64 * weight;
    }
    let totals = accelerator.reduce(&Tensor::new(&[sum, count], device)?, ReduceOp::Sum)?;
    let totals = totals.to_vec1::<f64>()?;
    if totals[1] == 0.0 {
        bail!("no held-out assistant token to evaluate");
    }
    Ok(totals[0] / totals[1])
}
