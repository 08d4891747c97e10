#!/usr/bin/env python3
"""Writes data/llama-2-7b/: the config.json of meta-llama/Llama-2-7b-hf and a header-only copy of
its safetensors checkpoint (no weights): the sharded index and two shard files holding only the
8-byte header length and the JSON header, with every tensor's real name, shape and dtype (F16),
and data offsets as if the weights followed. `accelerate-rs estimate-memory data/llama-2-7b`
reads them (it reads headers only and accepts a missing data section).

The tensors are split into shards in state-dict order at transformers' default shard size of
10 GB, which gives two shards as the published checkpoint has; which tensor sits in which shard
may differ from the published index (the estimate does not depend on it).

    python3 scripts/make_llama_fixture.py [OUT_DIR]
"""

import json
import os
import struct
import sys

CONFIG = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf",
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

MAX_SHARD = 10 * 10**9  # transformers' max_shard_size="10GB"
DTYPE, SIZE = "F16", 2


def tensors(c):
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    yield "model.embed_tokens.weight", [v, h]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}"
        for m in ["q_proj", "k_proj", "v_proj", "o_proj"]:
            yield f"{p}.self_attn.{m}.weight", [h, h]
        yield f"{p}.mlp.gate_proj.weight", [i, h]
        yield f"{p}.mlp.up_proj.weight", [i, h]
        yield f"{p}.mlp.down_proj.weight", [h, i]
        yield f"{p}.input_layernorm.weight", [h]
        yield f"{p}.post_attention_layernorm.weight", [h]
    yield "model.norm.weight", [h]
    yield "lm_head.weight", [v, h]


def nbytes(shape):
    n = SIZE
    for d in shape:
        n *= d
    return n


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "data", "llama-2-7b")
    os.makedirs(out, exist_ok=True)
    shards, cur, size = [], [], 0
    for name, shape in tensors(CONFIG):
        b = nbytes(shape)
        if cur and size + b > MAX_SHARD:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += b
    shards.append(cur)
    n = len(shards)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        # safetensors lays tensors out by name within a file (one dtype here).
        for name, shape in sorted(shard):
            b = nbytes(shape)
            header[name] = {"dtype": DTYPE, "shape": shape, "data_offsets": [off, off + b]}
            off += b
            weight_map[name] = fname
        total += off
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
        with open(os.path.join(out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total},
                   "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
        f.write("\n")
    print(f"{out}: {n} header-only shards, {total} bytes of weights described")


if __name__ == "__main__":
    main()
