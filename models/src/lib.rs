//! # accelerate-rs-models
//!
//! Hugging Face architectures that **train** with [accelerate-rs](accelerate_rs): Llama 2/3,
//! Mistral and Qwen2 (one implementation), Qwen3, Gemma 2 and 3 (text), Phi-3, the mixtures of
//! experts Mixtral, Qwen2-MoE and Qwen3-MoE (routers that learn, `transformers`'
//! load-balancing loss), GPT-2, and BERT (masked-LM and sequence-classification heads), loaded
//! from and saved to Hugging Face model folders, with `tokenizer.json` through the `tokenizers`
//! crate.
//!
//! Built on `accelerate_rs::nn`'s differentiable fused layers (RMSNorm, LayerNorm, attention,
//! `Linear`, GELU, the head fused with the cross-entropy) and differentiable RoPE, so that
//! **every parameter gets a gradient**: unlike `candle-transformers`' models, whose fused norms,
//! softmax and RoPE have no backward pass, the whole model learns. Forward passes are
//! training-shaped: the full sequence, an attention (padding) mask, logits for every position,
//! and `loss(input_ids, labels)` with `transformers`' shift and ignore index (-100).
//!
//! ```no_run
//! use accelerate_rs::optim::AdamW;
//! use accelerate_rs::{Accelerator, DataLoader, TensorDataset};
//! use accelerate_rs_models::{load_tokenizer, AutoModel};
//! use candle_core::DType;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let accelerator = Accelerator::new()?;
//! let mut model = AutoModel::from_pretrained("my-llama", accelerator.device(), DType::F32)?;
//! let tokenizer = load_tokenizer("my-llama")?;
//! # let loader: DataLoader = todo!();
//! let opt = AdamW::new_lr(model.varmap().all_vars(), 1e-4)?;
//! let (mut opt, mut loader) = accelerator.prepare(model.varmap(), opt, loader)?;
//! model.train(true);
//! for batch in loader.iter()? {
//!     let batch = batch?;
//!     let loss = model.loss(&batch[0], &batch[0])?; // next-token loss, shifted inside
//!     opt.backward_step(&loss)?;
//! }
//! if accelerator.is_main_process() {
//!     model.save_pretrained("my-llama-finetuned")?; // transformers loads it
//! }
//! # Ok(()) }
//! ```
//!
//! Every architecture is one type implementing [`Architecture`] (its layers, how they are
//! assembled, its class names and default LoRA targets, its memory profile), and its model is
//! [`Pretrained<A>`](Pretrained), which holds what every architecture shares once:
//! [`LlamaForCausalLm`] is `Pretrained<Llama>`, and so on. [`AutoModel`] picks the architecture
//! of a folder from the registry (one line per architecture).
//!
//! Each model owns its parameters ([`LlamaForCausalLm::varmap`]), under the Hugging Face names
//! (`model.layers.0.self_attn.q_proj.weight`, `transformer.h.0.attn.c_attn.weight`,
//! `bert.encoder.layer.0.attention.self.query.weight`), so a folder `save_pretrained` wrote in
//! Python loads here, and one saved here loads in `transformers`. Loading is all or nothing
//! (`accelerate_rs::checkpoint::load_weights`): a missing, unexpected or mis-shaped tensor, a
//! truncated shard or an unknown `model_type` is an error naming the file and the tensor or key.
//!
//! Parity with `transformers` is tested against golden files (`models/tests/fixtures`, written
//! by `scripts/hf_reference.py`): logits, loss, every gradient, and the parameters after three
//! AdamW steps.
//!
//! ## LoRA and activation checkpointing
//!
//! [`LlamaForCausalLm::add_lora`] (on every architecture, and [`AutoModel`]) wraps the linear
//! layers that `accelerate_rs::nn::LoraConfig` targets with LoRA adapters (PEFT's rules and
//! defaults), freezes the base, and makes
//! [`trainable_parameters`](LlamaForCausalLm::trainable_parameters) the adapters: only they
//! are stepped and all-reduced. Adapters save and load as PEFT adapter folders
//! ([`save_adapter`](LlamaForCausalLm::save_adapter),
//! [`load_adapter`](LlamaForCausalLm::load_adapter)): `peft` loads ours and we load its, checked
//! against golden files of `scripts/hf_reference.py lora`.
//! [`merge_lora`](LlamaForCausalLm::merge_lora) folds them into the weights for a plain folder.
//! [`set_gradient_checkpointing`](LlamaForCausalLm::set_gradient_checkpointing) recomputes
//! every block's activations in the backward pass instead of keeping them.
//!
//! ```no_run
//! use accelerate_rs::nn::LoraConfig;
//! use accelerate_rs::optim::AdamW;
//! use accelerate_rs_models::AutoModel;
//! use candle_core::{DType, Device};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut model = AutoModel::from_pretrained("my-llama", &Device::Cpu, DType::BF16)?;
//! model.add_lora(&LoraConfig::new(8, 16.0).target_modules(["q_proj", "v_proj"]))?;
//! model.set_gradient_checkpointing(true);
//! let opt = AdamW::new_lr(model.trainable_parameters().all_vars(), 2e-4)?; // f32 adapters
//! // ... accelerator.prepare(model.trainable_parameters(), opt, loader), train ...
//! model.save_adapter("my-adapter")?; // PeftModel.from_pretrained(base, "my-adapter")
//! model.merge_lora()?;
//! model.save_pretrained("my-llama-merged")?;
//! # Ok(()) }
//! ```
//!
//! ## Chat data
//!
//! [`chat`] reads conversations (JSONL rows of `messages`, or `prompt`/`completion`), renders
//! them with the model folder's own chat template (Jinja, through minijinja, as `transformers`'
//! `apply_chat_template` renders it) and tokenizes them into examples whose labels are the
//! assistant's tokens:
//!
//! ```no_run
//! use accelerate_rs_models::chat::{ChatDataset, ChatEncoder};
//!
//! # fn main() -> accelerate_rs_models::Result<()> {
//! let encoder = ChatEncoder::from_folder("my-instruct-model")?; // chat template + tokenizer
//! let data = ChatDataset::new(vec!["train.jsonl".into()], encoder, 1024)?;
//! for example in data.examples()? {
//!     let example = example?; // input_ids, labels (-100 outside the assistant's turns)
//!     # let _ = example;
//! }
//! # Ok(()) }
//! ```
//!
//! ## Generation
//!
//! Every causal model generates with a key/value cache ([`generate`]): greedy or sampled
//! (temperature, top-k, top-p, a seed), stop tokens, prompts batched with left padding, sliding
//! windows, LoRA adapters applied; greedy ids equal `transformers`' `generate`.
//!
//! ```no_run
//! use accelerate_rs_models::{AutoModel, GenerationConfig};
//! use candle_core::{DType, Device};
//!
//! # fn main() -> accelerate_rs_models::Result<()> {
//! let model = AutoModel::from_pretrained("my-llama", &Device::Cpu, DType::F32)?;
//! let config = GenerationConfig::default().max_new_tokens(32).stop_tokens([2]);
//! let new_ids = model.generate(&[vec![1, 15043, 3186]], &config)?;
//! # let _ = new_ids;
//! # Ok(()) }
//! ```
//!
//! The `hub` feature adds `hub::download` (the `hf-hub` crate).
#![deny(missing_docs)]
#![deny(rustdoc::broken_intra_doc_links)]

pub mod arch;
mod auto;
mod base4bit;
mod bert;
pub mod chat;
mod config;
mod decoder;
mod error;
mod estimate;
mod gemma;
pub mod generate;
mod gpt2;
#[cfg(feature = "hub")]
pub mod hub;
mod layers;
mod llama;
mod lora;
mod mixtral;
mod moe;
mod phi3;
mod pretrained;
mod qwen3;
mod registry;
mod rope;
mod tokenizer;
mod weights;

pub use arch::{Architecture, AttentionBackend, Inputs, ModelConfig, Task};
pub use auto::AutoModel;
pub use bert::{
    BertClassifier, BertConfig, BertForMaskedLm, BertForSequenceClassification, BertMlm,
};
pub use chat::{
    ChatDataset, ChatEncoder, ChatExample, ChatTemplate, Conversation, ConversationReader,
};
pub use config::Activation;
pub use error::{ChatErrorKind, Error, Result};
pub use estimate::model_spec;
pub use gemma::{Gemma, GemmaConfig, GemmaForCausalLm};
pub use generate::{eos_token_ids, DecodeInputs, GenerationConfig, KvCache};
pub use gpt2::{Gpt2, Gpt2Config, Gpt2LmHeadModel};
pub use layers::IGNORE_INDEX;
pub use llama::{Llama, LlamaConfig, LlamaForCausalLm};
pub use mixtral::{Mixtral, MixtralForCausalLm, MoeConfig};
pub use phi3::{Phi3, Phi3Config, Phi3ForCausalLm};
pub use pretrained::Pretrained;
pub use qwen3::{Qwen3, Qwen3Config, Qwen3ForCausalLm};
pub use registry::{architectures, model_types, Config};
pub use rope::{RopeConfig, RopeScaling};
pub use tokenizer::{
    decode_ids, encode_corpus, encode_text, load_tokenizer, Tokenizer, TOKENIZER_FILE,
    TOKENIZE_BYTES_PER_SECOND, TOKENIZE_GRACE,
};
pub use weights::DEFAULT_MAX_SHARD_BYTES;
