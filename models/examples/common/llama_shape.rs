//! The Llama-style model that `hf_bench` and `memory_bench` train (and
//! `scripts/pytorch_hf_bench.py` builds in `transformers`): its size flags and its
//! `config.json`. Included by both with `#[path]`.

/// The model's size: hidden 512, 4 layers, 8 heads, 2 key/value heads, SwiGLU 1408, vocab 8000
/// unless told otherwise; untied output layer.
#[derive(clap::Args, Debug, Clone)]
pub struct LlamaShape {
    #[arg(long, default_value_t = 8000)]
    pub vocab: usize,
    #[arg(long, default_value_t = 512)]
    pub hidden: usize,
    #[arg(long, default_value_t = 1408)]
    pub intermediate: usize,
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
}

impl LlamaShape {
    /// The `config.json` of this shape for sequences of up to `seq` tokens.
    pub fn config_json(&self, seq: usize) -> serde_json::Value {
        serde_json::json!({
            "model_type": "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": seq,
            "tie_word_embeddings": false,
        })
    }
}
