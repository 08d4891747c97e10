#!/usr/bin/env python3
"""Golden files for accelerate-rs-models' generation tests, from Hugging Face `transformers`.

Needs torch, transformers and peft (the venv of scripts/hf_reference.py). Not run by CI: its
outputs are committed (`models/tests/fixtures/<name>/generate.json`, a few hundred bytes each),
and `cargo test -p accelerate-rs-models --test generate` checks against them without Python.

    python scripts/generate_reference.py [--fixtures models/tests/fixtures] [--max-new-tokens 6]

For each causal fixture (written by `scripts/hf_reference.py fixtures`) and for the LoRA fixture
`lora_llama` (its PEFT adapter on the `llama` fixture, through `peft`): greedy
`model.generate(...)` token ids, eager attention, float32, no end-of-sequence token, for

- `single`: one prompt longer than the fixture's sliding window (where it has one), and
- `batch`: two prompts of different lengths, left-padded with an attention mask (the positions
  `generate` derives from the mask skip the padding).

Prompts are drawn from a seeded generator, and drawn again until every greedy choice wins by at
least `MARGIN` over the runner-up (a near tie could go either way between two correct
implementations in f32) and the expected ids hold `MIN_DISTINCT` different tokens (a model stuck
on one token would check little); the smallest margin is written beside the ids.
"""

import argparse
import json
import os

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

CAUSAL = [
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen2_moe",
    "qwen3_moe", "phi3", "gpt2",
]
MARGIN = 1e-3
# Distinct ids among the expected ones: a model stuck on one token would check little.
MIN_DISTINCT = 4
# Prompt lengths: longer than every fixture's sliding window (4, Phi-3's 6), within GPT-2's 16
# positions with the new tokens.
SINGLE_LEN = 9
BATCH_LENS = (9, 5)
PAD = 0


def load(fixtures, name):
    if name == "lora_llama":
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(
            os.path.join(fixtures, "llama"), attn_implementation="eager", dtype=torch.float32
        )
        return PeftModel.from_pretrained(base, os.path.join(fixtures, name, "adapter"))
    return AutoModelForCausalLM.from_pretrained(
        os.path.join(fixtures, name), attn_implementation="eager", dtype=torch.float32
    )


def greedy(model, prompts, new_tokens):
    """Left-pads `prompts`, runs greedy `generate`; the new ids of each and the smallest margin
    of a greedy choice."""
    t = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (t - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    new = out.sequences[:, t:].tolist()
    margin = float("inf")
    for logits in out.logits:
        top = logits.float().topk(2, dim=-1).values
        margin = min(margin, (top[:, 0] - top[:, 1]).min().item())
    if any(len(n) != new_tokens for n in new):
        raise SystemExit(f"generate returned {[len(n) for n in new]} tokens, not {new_tokens}")
    return new, margin


def golden(model, vocab, new_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    for attempt in range(200):
        draw = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()  # noqa: E731
        single = [draw(SINGLE_LEN)]
        batch = [draw(n) for n in BATCH_LENS]
        s_new, s_margin = greedy(model, single, new_tokens)
        b_new, b_margin = greedy(model, batch, new_tokens)
        varied = len(set(sum(s_new + b_new, []))) >= MIN_DISTINCT
        if min(s_margin, b_margin) >= MARGIN and varied:
            return {
                "max_new_tokens": new_tokens,
                "pad_token": PAD,
                "cases": [
                    {"name": "single", "prompts": single, "expected": s_new,
                     "margin": round(s_margin, 6)},
                    {"name": "batch", "prompts": batch, "expected": b_new,
                     "margin": round(b_margin, 6)},
                ],
                "attempts": attempt + 1,
                "transformers": transformers.__version__,
            }
    raise SystemExit("no prompts with a safe greedy margin in 200 draws")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--fixtures", default=os.path.join(here, "..", "models/tests/fixtures"))
    ap.add_argument("--max-new-tokens", type=int, default=6)
    args = ap.parse_args()
    torch.manual_seed(0)
    for i, name in enumerate(CAUSAL + ["lora_llama"]):
        model = load(args.fixtures, name)
        model.eval()
        model.generation_config.eos_token_id = None
        # The mixtures' load-balancing loss plays no part in generation (and fails on a cache).
        if hasattr(model.config, "output_router_logits"):
            model.config.output_router_logits = False
        vocab = model.config.vocab_size if name != "lora_llama" else model.base_model.config.vocab_size
        g = golden(model, vocab, args.max_new_tokens, seed=100 + i)
        path = os.path.join(args.fixtures, name, "generate.json")
        with open(path, "w") as f:
            json.dump(g, f)
            f.write("\n")
        margins = [c["margin"] for c in g["cases"]]
        print(f"{name}: {g['cases'][1]['expected']} (margins {margins}, {g['attempts']} draws)")


if __name__ == "__main__":
    main()
