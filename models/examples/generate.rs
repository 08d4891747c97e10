//! Generates text with a Hugging Face model folder (any causal architecture of
//! accelerate-rs-models) and prints it.
//!
//!     cargo run --release -p accelerate-rs-models --example generate -- \
//!         --model models/examples/tiny-llama --prompt "Hello" --max-new-tokens 20
//!
//! The prompt is tokenized with the folder's `tokenizer.json` (special tokens added, as
//! `tokenizer(text)` does), or with `--chat` rendered as a user turn (after `--system TEXT`, if
//! given) with the folder's chat template and its generation prompt (`apply_chat_template(...,
//! add_generation_prompt=True)`); generation then also stops at the template's end-of-turn
//! token (the tokenizer's `eos_token`). Greedy by default; `--temperature T` samples (with
//! `--top-k K`, `--top-p P`, `--seed S`). `--adapter DIR` loads a PEFT LoRA adapter folder onto
//! the model first. It stops at the folder's `eos_token_id` or after `--max-new-tokens`, and
//! prints the new text alone (special tokens skipped) on stdout; with `--json`, one JSON line
//! `{"ids": [...], "text": "..."}` holding the new token ids (a stop token included) and that
//! text, for scripts (`scripts/hf_reference.py generate-check` compares them with `transformers`).

use std::path::PathBuf;

use accelerate_rs_models::chat::{ChatEncoder, Conversation, Role};
use accelerate_rs_models::{
    decode_ids, encode_text, eos_token_ids, load_tokenizer, AutoModel, GenerationConfig, Tokenizer,
};
use anyhow::{anyhow, Context, Result};
use candle_core::{DType, Device};
use clap::Parser;

/// Generates text with a Hugging Face model folder.
#[derive(Parser, Debug)]
struct Args {
    /// The model folder (`config.json`, weights, `tokenizer.json`).
    #[arg(long)]
    model: PathBuf,
    /// The text to continue (with `--chat`: the user's message).
    #[arg(long)]
    prompt: String,
    /// Render the prompt as a user turn with the folder's chat template.
    #[arg(long)]
    chat: bool,
    /// With `--chat`: a system message before the user's.
    #[arg(long)]
    system: Option<String>,
    /// Tokens generated at most.
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sampling temperature (0: greedy, the default).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Sampling among the K most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sampling among the most likely tokens whose probabilities reach P.
    #[arg(long)]
    top_p: Option<f64>,
    /// The sampling generator's seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A PEFT LoRA adapter folder to load onto the model.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Print `{"ids": [...], "text": "..."}` (the new token ids and text) as one JSON line.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (prompt, mut stop, text_of) = prompt_ids(&args)?;
    stop.extend(eos_token_ids(&args.model)?);
    let mut model = AutoModel::from_pretrained(&args.model, &Device::Cpu, DType::F32)?;
    if let Some(dir) = &args.adapter {
        model
            .load_adapter(dir)
            .with_context(|| format!("--adapter {}", dir.display()))?;
    }
    let mut config = GenerationConfig::default()
        .max_new_tokens(args.max_new_tokens)
        .temperature(args.temperature)
        .seed(args.seed)
        .stop_tokens(stop);
    if let Some(k) = args.top_k {
        config = config.top_k(k);
    }
    if let Some(p) = args.top_p {
        config = config.top_p(p);
    }
    let new = model.generate(&[prompt], &config)?;
    let text = text_of
        .decode(&new[0])
        .context("decoding the generated ids")?;
    if args.json {
        println!("{}", serde_json::json!({ "ids": new[0], "text": text }));
    } else {
        println!("{text}");
    }
    Ok(())
}

/// What the new ids are decoded with: the folder's tokenizer, or the chat encoder's (loaded once
/// for the prompt and the answer).
enum Decoder {
    Plain(Box<Tokenizer>),
    Chat(Box<ChatEncoder>),
}

impl Decoder {
    /// The text of `ids`, special tokens skipped.
    fn decode(&self, ids: &[u32]) -> accelerate_rs_models::Result<String> {
        match self {
            Decoder::Plain(tokenizer) => decode_ids(tokenizer, ids, true),
            Decoder::Chat(encoder) => encoder.decode(ids, true),
        }
    }
}

/// The prompt's ids, the stop tokens it brings (`--chat`: the template's end of turn), and what
/// the answer is decoded with.
fn prompt_ids(args: &Args) -> Result<(Vec<u32>, Vec<u32>, Decoder)> {
    if !args.chat {
        if args.system.is_some() {
            return Err(anyhow!("--system needs --chat"));
        }
        let tokenizer = load_tokenizer(&args.model)?;
        let ids = encode_text(&tokenizer, &args.prompt, true).context("tokenizing --prompt")?;
        return Ok((ids, Vec::new(), Decoder::Plain(Box::new(tokenizer))));
    }
    let encoder = ChatEncoder::from_folder(&args.model).context("--chat")?;
    let mut turns = Vec::new();
    if let Some(system) = &args.system {
        turns.push((Role::System, system.clone()));
    }
    turns.push((Role::User, args.prompt.clone()));
    let ids = encoder.encode_prompt(&Conversation::new(turns)?)?;
    let stop = encoder.special_token_id("eos_token").into_iter().collect();
    Ok((ids, stop, Decoder::Chat(Box::new(encoder))))
}
