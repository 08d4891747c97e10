//! How long `ChatEncoder::encode` takes per conversation (render with the chat template,
//! tokenize, label the assistant's tokens): the rows of a folder's `conversations.jsonl`, each
//! encoded `--repeat` times per round, for `--rounds` rounds; one line per round with the mean
//! time per conversation and the mean number of tokens.
//!
//!     cargo build --release -p accelerate-rs-models --example chat_encode_bench
//!     target/release/examples/chat_encode_bench models/tests/fixtures/chat_qwen2

use std::path::PathBuf;
use std::time::Instant;

use accelerate_rs_models::chat::{ChatEncoder, ConversationReader};
use anyhow::{Context, Result};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// A folder with a chat template, `tokenizer.json` and `conversations.jsonl`.
    folder: PathBuf,
    /// Rounds, one line each.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Times each row is encoded per round.
    #[arg(long, default_value_t = 400)]
    repeat: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let encoder = ChatEncoder::from_folder(&args.folder)?;
    let rows = ConversationReader::new(vec![args.folder.join("conversations.jsonl")])?
        .collect::<accelerate_rs_models::Result<Vec<_>>>()?;
    let encodable: Vec<_> = rows.iter().filter(|c| encoder.encode(c).is_ok()).collect();
    anyhow::ensure!(
        !encodable.is_empty(),
        "{}: no conversation of conversations.jsonl encodes",
        args.folder.display()
    );
    for round in 0..args.rounds {
        let start = Instant::now();
        let mut tokens = 0usize;
        for _ in 0..args.repeat {
            for c in &encodable {
                tokens += encoder.encode(c).context("encoding")?.len();
            }
        }
        let n = (args.repeat * encodable.len()).max(1);
        println!(
            "round {round}: {:.1} us per conversation ({n} conversations, {:.0} tokens each)",
            start.elapsed().as_secs_f64() * 1e6 / n as f64,
            tokens as f64 / n as f64
        );
    }
    Ok(())
}
