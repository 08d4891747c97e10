//! Command-line arguments and the character-level corpus of the transformer_lm example.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use accelerate_rs::{IterableDataset, RecordStream};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use clap::Parser;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Train a small decoder-only Transformer language model on a character-level corpus.
#[derive(Parser, Debug)]
#[command(version, about)]
pub struct Args {
    /// A text corpus (UTF-8) instead of the one built into this binary (`data/corpus.txt`); its
    /// last `--val-fraction` is held out for evaluation.
    #[arg(long)]
    pub corpus: Option<PathBuf>,
    /// Fraction of the corpus (its end) held out for the evaluation loss.
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Model (embedding) width.
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    /// Attention heads (must divide --d-model).
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Context length in characters.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Tie the output head to the token embedding.
    #[arg(long)]
    pub tie_weights: bool,
    /// The MLP's activation: gelu (GPT-2) or relu (PyTorch's `nn.TransformerEncoderLayer`).
    #[arg(long, default_value = "gelu")]
    pub activation: crate::model::Activation,
    /// Sequences per micro-batch on each process.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Micro-batches accumulated per optimizer step, given to the Accelerator builder. Unset:
    /// the launcher's `--gradient-accumulation-steps`
    /// (`ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS`), else the config file, else 1.
    #[arg(long)]
    pub grad_accum: Option<usize>,
    /// Optimizer steps to train for (the cosine schedule ends there).
    #[arg(long, default_value_t = 100)]
    pub max_steps: u64,
    /// Steps of linear learning-rate warmup from 0.
    #[arg(long, default_value_t = 10)]
    pub warmup_steps: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    /// Final learning rate, as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    pub min_lr_ratio: f64,
    /// AdamW weight decay, on weight matrices and embeddings only.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Global gradient-norm clipping threshold (0 turns it off).
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad_norm: f64,
    /// Print (main process) and log metrics every N optimizer steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
    /// Held-out batches (of --batch-size sequences, across all processes) for the final
    /// evaluation loss; 0 evaluates the whole held-out split.
    #[arg(long, default_value_t = 8)]
    pub eval_batches: usize,
    /// Where the main process writes `metrics.jsonl`.
    #[arg(long, default_value = "runs/transformer_lm")]
    pub log_dir: PathBuf,
    /// Save a checkpoint every this many optimizer steps (0: never) under `--log-dir`/checkpoints.
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: u64,
    /// How many checkpoints to keep.
    #[arg(long, default_value_t = 2)]
    pub keep_checkpoints: usize,
    /// Resume from the newest complete checkpoint, if there is one (automatic after a restart by
    /// `accelerate-rs launch --max-restarts`).
    #[arg(long)]
    pub resume: bool,
    /// With `--resume`: when checkpoints exist but none is sound, start from step 0 anyway
    /// (without it, such a resume is an error listing each checkpoint and why it was refused).
    #[arg(long)]
    pub start_fresh: bool,
    /// Seed for initialization and shuffling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// A character-level vocabulary: the sorted distinct characters of the corpus.
pub struct Vocab {
    chars: Vec<char>,
    index: BTreeMap<char, u32>,
}

impl Vocab {
    pub fn new(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let index = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        Vocab { chars, index }
    }

    pub fn len(&self) -> usize {
        self.chars.len()
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.chars().map(|c| self.index[&c]).collect()
    }
}

/// The tokenized corpus split in two: training and held-out tokens.
pub struct Corpus {
    pub vocab: Vocab,
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

/// `data/corpus.txt` (157 KB), inside the binary so that it runs away from the repository.
const CORPUS: &str = include_str!("../../data/corpus.txt");

pub fn load(args: &Args) -> Result<Corpus> {
    let text = match &args.corpus {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading the corpus {}", path.display()))?,
        None => CORPUS.to_string(),
    };
    if !(0.0..1.0).contains(&args.val_fraction) {
        bail!(
            "--val-fraction must be in [0, 1), got {}",
            args.val_fraction
        );
    }
    let vocab = Vocab::new(&text);
    let tokens = vocab.encode(&text);
    let n_val = (tokens.len() as f64 * args.val_fraction) as usize;
    let (train, val) = tokens.split_at(tokens.len() - n_val);
    let min = args.seq_len + 1;
    if train.len() < min || (n_val > 0 && val.len() < min) {
        bail!(
            "corpus too small for --seq-len {}: {} training and {} held-out characters",
            args.seq_len,
            train.len(),
            val.len()
        );
    }
    Ok(Corpus {
        vocab,
        train: train.to_vec(),
        val: val.to_vec(),
    })
}

/// Non-overlapping windows of `seq_len + 1` tokens as inputs `x: [N, T]` and next-token targets
/// `y: [N, T]` (`u32`), at most `limit` of them.
pub fn windows(
    tokens: &[u32],
    seq_len: usize,
    limit: Option<usize>,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let mut n = tokens.len().saturating_sub(1) / seq_len.max(1);
    if let Some(limit) = limit {
        n = n.min(limit);
    }
    let mut x = Vec::with_capacity(n * seq_len);
    let mut y = Vec::with_capacity(n * seq_len);
    for i in 0..n {
        let start = i * seq_len;
        x.extend_from_slice(&tokens[start..start + seq_len]);
        y.extend_from_slice(&tokens[start + 1..start + seq_len + 1]);
    }
    Ok((
        Tensor::from_vec(x, (n, seq_len), device)?,
        Tensor::from_vec(y, (n, seq_len), device)?,
    ))
}

/// The training text as a stream (an [`IterableDataset`]): each record is the start of one
/// window of `seq_len + 1` characters, in a seeded order that changes with the epoch, decoded
/// into `[input, target]` (the target shifted by one). The [`StreamingLoader`] over it shards the
/// windows across processes and counts its position in global samples, so a checkpoint resumes
/// mid-epoch at any world size. A corpus in files would use
/// [`TextLines`](accelerate_rs::TextLines) the same way.
///
/// [`StreamingLoader`]: accelerate_rs::StreamingLoader
pub struct CharWindows {
    tokens: Arc<Vec<u32>>,
    seq_len: usize,
    seed: u64,
}

impl CharWindows {
    pub fn new(tokens: Vec<u32>, seq_len: usize, seed: u64) -> Result<Self> {
        if seq_len == 0 || tokens.len() <= seq_len {
            bail!(
                "the training text ({} characters) is too short for --seq-len {seq_len}",
                tokens.len()
            );
        }
        Ok(CharWindows {
            tokens: Arc::new(tokens),
            seq_len,
            seed,
        })
    }
}

impl IterableDataset for CharWindows {
    type Record = usize;

    fn records(&self, epoch: u64) -> accelerate_rs::Result<RecordStream<usize>> {
        let n = (self.tokens.len() - 1) / self.seq_len;
        let mut starts: Vec<usize> = (0..n).map(|i| i * self.seq_len).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(epoch));
        starts.shuffle(&mut rng);
        Ok(Box::new(starts.into_iter().map(Ok)))
    }

    fn decode(&self, start: &usize) -> accelerate_rs::Result<Vec<Tensor>> {
        let (s, t) = (*start, self.seq_len);
        let x = Tensor::new(&self.tokens[s..s + t], &Device::Cpu)?;
        let y = Tensor::new(&self.tokens[s + 1..s + t + 1], &Device::Cpu)?;
        Ok(vec![x, y])
    }
}
