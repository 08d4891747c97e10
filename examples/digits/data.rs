//! Shared by the `digits` and `digits_plain` examples: the UCI digits data and the MLP.

use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear, Linear, VarBuilder};
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Features (n × 64, scaled to 0..1) and labels (n, u32) of one split.
pub struct Split {
    pub x: Tensor,
    pub y: Tensor,
}

/// The UCI digits data shipped in `data/digits.csv.gz` (57 KB), inside the binary, so a binary
/// built on one machine runs on another without the repository.
const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// Reads the gzip'd CSV at `path` (the copy inside the binary when `None`) and splits it 80/20
/// into train and test with a fixed shuffle.
pub fn load(
    path: Option<&Path>,
    seed: u64,
    device: &Device,
    dtype: DType,
) -> Result<(Split, Split)> {
    let name = path.map_or_else(
        || "digits.csv.gz (built in)".to_string(),
        |p| p.display().to_string(),
    );
    let gz = match path {
        Some(p) => std::fs::read(p).with_context(|| format!("cannot open {name}"))?,
        None => DIGITS_CSV_GZ.to_vec(),
    };
    let mut text = String::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_string(&mut text)
        .with_context(|| format!("{name} is not a gzip'd CSV"))?;
    let mut rows: Vec<(Vec<f32>, u32)> = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let vals: Vec<&str> = line.split(',').collect();
        if vals.len() != 65 {
            bail!(
                "{name}:{}: expected 65 comma-separated values, found {}",
                i + 1,
                vals.len()
            );
        }
        let parse = |s: &str| -> Result<f32> {
            s.trim()
                .parse::<f32>()
                .with_context(|| format!("{name}:{}: `{s}` is not a number", i + 1))
        };
        let x = vals[..64]
            .iter()
            .map(|v| parse(v).map(|p| p / 16.0))
            .collect::<Result<Vec<_>>>()?;
        let y = parse(vals[64])? as u32;
        rows.push((x, y));
    }
    rows.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let n_test = rows.len() / 5;
    let (test, train) = rows.split_at(n_test);
    let to_split = |rows: &[(Vec<f32>, u32)]| -> Result<Split> {
        let x: Vec<f32> = rows.iter().flat_map(|r| r.0.iter().copied()).collect();
        let y: Vec<u32> = rows.iter().map(|r| r.1).collect();
        Ok(Split {
            x: Tensor::from_vec(x, (rows.len(), 64), device)?.to_dtype(dtype)?,
            y: Tensor::from_vec(y, rows.len(), device)?,
        })
    };
    Ok((to_split(train)?, to_split(test)?))
}

/// 64 → 128 → 10 with a ReLU.
pub struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    pub fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Mlp {
            fc1: linear(64, 128, vb.pp("fc1"))?,
            fc2: linear(128, 10, vb.pp("fc2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

/// Fraction of `split` classified correctly.
pub fn accuracy(model: &Mlp, split: &Split) -> Result<f32> {
    let pred = model.forward(&split.x)?.argmax(D::Minus1)?;
    let correct = pred
        .eq(&split.y)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(correct / split.y.dim(0)? as f32)
}

/// Command-line options shared by both examples.
#[derive(clap::Parser, Debug)]
pub struct Args {
    /// A gzip'd CSV of the same layout (64 pixel values 0..16, then the label), instead of the
    /// UCI digits data built into this binary.
    #[arg(long)]
    pub data: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 30)]
    pub epochs: u64,
    /// Batch size per process.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Compute dtype of the model and inputs: f32, bf16 or f16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: DType,
    /// Exit with an error if the final test accuracy is below this.
    #[arg(long)]
    pub min_accuracy: Option<f32>,
}

fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        other => bail!("--dtype {other}: expected f32, bf16 or f16"),
    }
}

/// Checks `--min-accuracy`.
pub fn check(acc: f32, args: &Args) -> Result<()> {
    match args.min_accuracy {
        Some(min) if acc < min => bail!("test accuracy {acc:.4} is below --min-accuracy {min}"),
        _ => Ok(()),
    }
}
