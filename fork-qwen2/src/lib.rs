//! docs/candle-transformers.md's recipe, followed literally and tested: `candle-transformers`'
//! `qwen2.rs` forked into this crate ([`qwen2`]: every change marked `// accelerate-rs:`),
//! loaded from a folder `transformers` wrote, trained through `Accelerator::prepare` on one or
//! several processes, and saved as a folder `transformers` (and `accelerate-rs-models`) loads.
//! `tests/recipe.rs` runs it in CI.
//!
//! ```no_run
//! use accelerate_rs::Accelerator;
//! use candle::DType;
//! use candle_nn::VarMap;
//! use fork_qwen2::qwen2::{Config, ModelForCausalLM};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let acc = Accelerator::new()?;
//! let dir = std::path::Path::new("Qwen2-0.5B");
//! let cfg = Config::from_json(&std::fs::read_to_string(dir.join("config.json"))?)?;
//! let varmap = VarMap::new();
//! // Builds the layers over a fresh VarMap (the tie comes from the configuration), then loads
//! // the folder's weights into it, all or nothing, every tensor checked by name and shape.
//! let mut model = ModelForCausalLM::new(&cfg, acc.var_builder(&varmap, DType::F32))?;
//! accelerate_rs::weights::load_weights_mapped(dir, &varmap, |n| Some(n.to_string()))?;
//! // ... accelerator.prepare(&varmap, optimizer, loader), then per batch:
//! // let logits = model.forward_train(&ids)?; // every position, KV cache cleared
//! # Ok(()) }
//! ```

pub mod qwen2;
