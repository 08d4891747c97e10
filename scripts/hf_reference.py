#!/usr/bin/env python3
"""Golden files for accelerate-rs-models' parity tests, from Hugging Face `transformers`.

Needs `pip install torch transformers safetensors` (PyPI; CPU is enough). Not run by CI: its
outputs are committed, and `cargo test -p accelerate-rs-models` checks against them without
Python.

    python scripts/hf_reference.py fixtures [--out models/tests/fixtures]
        For each architecture (Llama with grouped-query attention and Llama 3 RoPE scaling,
        Llama with tied embeddings and biases, Mistral with a sliding window that cuts, Qwen2,
        GPT-2, BERT masked-LM, BERT sequence classification): a tiny random model saved as a
        Hugging Face folder (float32), and `golden.safetensors` beside it holding the inputs
        (`input_ids`, `attention_mask`, `labels`), the `logits`, the `loss`, every parameter's
        gradient (`grad.<name>`) and every parameter after 3 AdamW steps (`step3.<name>`).

    python scripts/hf_reference.py check DIR [DIR ...]
        Loads each folder accelerate-rs saved (`save_pretrained`) into `transformers` with
        `AutoModelFor*.from_pretrained`, runs the inputs of `DIR/probe.safetensors` (or the
        file given by --probe) and compares with the logits accelerate-rs computed there.
        `cargo run -p accelerate-rs-models --example roundtrip -- OUT` writes such folders for
        every fixture; `finetune --probe FILE` writes one for its output.

    python scripts/hf_reference.py chat-loss DIR --base BASE --data FILE.jsonl
        The held-out assistant-token loss (the last assistant turn of each `messages` row,
        rendered with the folder's chat template by `apply_chat_template`) of the fine-tuned
        folder DIR and of BASE in `transformers`: exits 1 unless DIR's is lower.

    python scripts/hf_reference.py generate-check DIR --data FILE.jsonl --generate BIN
            [--prompts N] [--max-new-tokens M]
        The first N different prompts (a user turn, after an optional system turn) of the
        conversations in FILE: `transformers`' greedy `generate` on the chat-template prompt
        (`apply_chat_template(..., add_generation_prompt=True)`) of the folder DIR, stopping at
        the tokenizer's `eos_token` and the folder's `eos_token_id`, against accelerate-rs'
        generate example BIN (`BIN --model DIR --chat --prompt USER [--system S] --json`): exits
        1 unless every prompt gives the same new token ids, or unless at least one answer is
        the conversation's own assistant turn (a fine-tuned folder answers its training prompts).

    python scripts/hf_reference.py lora [--out models/tests/fixtures]
        Needs `pip install peft` too. For a tiny Llama (rsLoRA on q_proj, v_proj and down_proj)
        and a tiny GPT-2 (LoRA on its Conv1D layers c_attn and c_fc, fan_in_fan_out): the base
        is the fixture of the same architecture; a PEFT adapter with random (nonzero) weights
        is saved as a PEFT adapter folder (`lora_<arch>/adapter`), and
        `lora_<arch>/golden.safetensors` holds the logits and loss with the adapter on the
        base fixture's inputs, every adapter tensor's gradient (`grad.<module>.lora_A.weight`),
        the merged weights of the targeted layers (`merged.<name>`, `merge_and_unload`) and
        the adapter after 3 AdamW steps on the adapter alone (`step3.<module>.lora_A.weight`);
        for Llama also the logits and adapter gradients with the base in bf16 (`bf16.*`).

    python scripts/hf_reference.py check-adapter ADAPTER --base BASE [--probe FILE]
        Loads the base model folder BASE in `transformers`, the PEFT adapter folder ADAPTER
        accelerate-rs saved (`save_adapter`) with `PeftModel.from_pretrained`, runs the inputs
        of `ADAPTER/probe.safetensors` and compares with the logits accelerate-rs computed.

    python scripts/hf_reference.py tokenizer [--corpus data/corpus.txt] [--out DIR] [--arch A]
        Trains a tiny byte-level BPE tokenizer on the corpus and saves, with it, a tiny random
        model (`llama`, `gpt2` or `bert`) as a Hugging Face folder: the fine-tuning example's
        model (`models/examples/tiny-llama`, committed).
"""

import argparse
import json
import math
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    BertConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

# accelerate_rs::optim::AdamW's hyper-parameters (src/optim/adamw.rs: lr, betas, eps,
# weight_decay, bias correction; decay on every parameter).
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
STEPS = 3

BATCH, SEQ, VOCAB = 2, 8, 64


def configs():
    """name -> (config, auto class, task)."""
    tiny = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
    return {
        # GQA (2 query heads share 1 key/value head), head_dim 8: the four inverse frequencies
        # fall in Llama 3's high, medium and low bands with original_max_position_embeddings 128.
        "llama": (
            LlamaConfig(
                **tiny,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=256,
                pad_token_id=0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 4.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128,
                },
                tie_word_embeddings=False,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        "llama_tied": (
            LlamaConfig(
                **tiny,
                num_attention_heads=4,
                num_key_value_heads=4,
                max_position_embeddings=64,
                tie_word_embeddings=True,
                attention_bias=True,
                mlp_bias=True,
                rope_theta=500.0,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        # A window of 4 over 8 tokens: the sliding window really cuts.
        "mistral": (
            MistralConfig(
                **tiny,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=64,
                sliding_window=4,
                tie_word_embeddings=False,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        "qwen2": (
            Qwen2Config(
                **tiny,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=True,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        "gpt2": (
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=16,
                n_layer=2,
                n_head=2,
                n_positions=16,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        "bert_mlm": (
            BertConfig(
                **tiny,
                num_attention_heads=2,
                max_position_embeddings=16,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            ),
            AutoModelForMaskedLM,
            "mlm",
        ),
        "bert_cls": (
            BertConfig(
                **tiny,
                num_attention_heads=2,
                max_position_embeddings=16,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                num_labels=3,
            ),
            AutoModelForSequenceClassification,
            "cls",
        ),
        # The architectures added later, at the end so that the seeds above stay.
        # q/k norms, head_dim 6 apart from hidden / heads = 4, GQA (4 query heads, 2 key/value),
        # biases on q, k, v and o, tied embeddings, and a window of 4 over 8 tokens on layer 1.
        "qwen3": (
            Qwen3Config(
                **tiny,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=6,
                max_position_embeddings=64,
                attention_bias=True,
                tie_word_embeddings=True,
                use_sliding_window=True,
                sliding_window=4,
                max_window_layers=1,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        # (1 + w) RMSNorms, scaled embeddings, GeGLU, a sliding layer (window 4 over 8 tokens)
        # then a global one, pre/post feed-forward norms, the scores scaled by
        # query_pre_attn_scalar 10 (not head_dim 8) and soft-capped at 2, the logits at 3 (both
        # really bend at these sizes), GQA, tied embeddings.
        "gemma2": (
            Gemma2Config(
                **tiny,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=64,
                sliding_window=4,
                query_pre_attn_scalar=10,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
                pad_token_id=0,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        # Gemma 3 text: q/k norms, one global layer in 2 (pattern 2), RoPE bases per kind (the
        # global one linearly scaled), no soft-capping, untied embeddings, 4 heads over 2.
        "gemma3": (
            Gemma3TextConfig(
                **tiny,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=4,
                max_position_embeddings=64,
                sliding_window=4,
                sliding_window_pattern=2,
                query_pre_attn_scalar=6,
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                },
                tie_word_embeddings=False,
                pad_token_id=0,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        # Mixtral: 4 experts, 2 per token (renormalized), the router's load-balancing loss in the
        # loss (output_router_logits, coefficient 0.1 so that it weighs), a window of 4 over 8
        # tokens, GQA, untied.
        "mixtral": (
            MixtralConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=12,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=64,
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
                router_aux_loss_coef=0.1,
                sliding_window=4,
                tie_word_embeddings=False,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        # Qwen3-MoE: q/k norms, a dense first layer (mlp_only_layers) then a sparse one with 4
        # experts, 2 per token, not renormalized (norm_topk_prob false), the aux loss, tied.
        "qwen3_moe": (
            Qwen3MoeConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=24,
                moe_intermediate_size=8,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=4,
                max_position_embeddings=64,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                mlp_only_layers=[0],
                output_router_logits=True,
                router_aux_loss_coef=0.1,
                tie_word_embeddings=True,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        # Qwen2-MoE: a shared expert behind a sigmoid gate, biases on q, k and v, 4 experts, 2
        # per token renormalized (norm_topk_prob), the aux loss, untied.
        "qwen2_moe": (
            Qwen2MoeConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=24,
                moe_intermediate_size=8,
                shared_expert_intermediate_size=12,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=64,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                output_router_logits=True,
                router_aux_loss_coef=0.1,
                tie_word_embeddings=False,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
        # Phi-3: fused qkv_proj and gate_up_proj, LongRoPE over half of each head
        # (partial_rotary_factor 0.5: 2 short and 2 long factors) with an original length of 4,
        # so that 8 tokens take the long factors and the attention factor (extension 64 / 4), a
        # window of 6 over 8 tokens, GQA, untied.
        "phi3": (
            Phi3Config(
                **tiny,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=64,
                original_max_position_embeddings=4,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                    "short_factor": [1.0, 1.5],
                    "long_factor": [2.0, 3.5],
                },
                sliding_window=6,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attention_dropout=0.0,
                tie_word_embeddings=False,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            AutoModelForCausalLM,
            "causal",
        ),
    }


def randomize(model, gen):
    """Every parameter drawn afresh (larger than `transformers`' 0.02 init, so that logits and
    gradients are far from trivial): norms' gains near 1, everything else N(0, 0.3^2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_gain = p.dim() == 1 and ("norm" in name.lower() or ".ln_" in name)
            if is_gain and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.3 * noise)


def inputs(task, gen):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -2:] = 0  # the second sequence is right-padded by two tokens...
    ids[1, -2:] = 0  # ...of id 0 (the padding index where pad_token_id is 0: no gradient)
    if task == "causal":
        labels = ids.clone()
        labels[mask == 0] = -100
    elif task == "mlm":
        labels = torch.full_like(ids, -100)
        for b, positions in enumerate([[1, 3, 6], [0, 2, 5]]):
            for t in positions:
                labels[b, t] = torch.randint(0, VOCAB, (1,), generator=gen).item()
    else:
        labels = torch.tensor([2, 0])
    return ids, mask, labels


def checkpoint_views(name, t, model_type):
    """A parameter as the checkpoint names it: `transformers` 5 holds a mixture's experts as
    3-D tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and
    Mixtral's router under `mlp.gate`, but saves them per expert as before (Mixtral:
    `block_sparse_moe.experts.{e}.w1/w3/w2.weight`; the Qwen MoEs: `mlp.experts.{e}.gate_proj/
    up_proj/down_proj.weight`). Returns [(checkpoint name, tensor view)]."""
    mixtral = model_type == "mixtral"
    prefix = name.rsplit(".mlp.", 1)[0] if ".mlp." in name else None
    block = f"{prefix}.block_sparse_moe" if mixtral else f"{prefix}.mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    if name.endswith(".mlp.experts.gate_up_proj"):
        half = t.shape[1] // 2
        out = []
        for e in range(t.shape[0]):
            out.append((f"{block}.experts.{e}.{gate}.weight", t[e, :half]))
            out.append((f"{block}.experts.{e}.{up}.weight", t[e, half:]))
        return out
    if name.endswith(".mlp.experts.down_proj"):
        return [(f"{block}.experts.{e}.{down}.weight", t[e]) for e in range(t.shape[0])]
    if mixtral and name.endswith(".mlp.gate.weight"):
        return [(f"{block}.gate.weight", t)]
    return [(name, t)]


def state_names(model):
    """Parameter name -> tensor, as save_pretrained writes them (tied copies once)."""
    seen = {}
    for name, p in model.named_parameters():  # named_parameters skips tied duplicates
        seen[name] = p
    return seen


def as_saved(named, model_type):
    """{name: tensor} of parameters (or their gradients) under the checkpoint's names."""
    out = {}
    for name, t in named.items():
        for saved, view in checkpoint_views(name, t, model_type):
            out[saved] = view.detach().clone().contiguous()
    return out


def forward_backward(name, model, params, ids, mask, labels):
    """One forward and backward pass: the golden inputs, logits, loss and the gradient of every
    parameter in `params` (name -> tensor) as `grad.<name>`."""
    out_ = model(input_ids=ids, attention_mask=mask, labels=labels)
    out_.loss.backward()
    golden = {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "logits": out_.logits.detach().contiguous(),
        "loss": out_.loss.detach().reshape(1),
    }
    if getattr(out_, "aux_loss", None) is not None:
        golden["aux_loss"] = out_.aux_loss.detach().reshape(1)
    grads = {}
    for pname, p in params.items():
        if p.grad is None:
            sys.exit(f"{name}: {pname} got no gradient in transformers")
        grads[pname] = p.grad
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    for pname, g in as_saved(grads, model_type).items():
        golden[f"grad.{pname}"] = g
    return golden


def make_fixture(name, out, seed):
    config, auto, task = configs()[name]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = auto.from_config(config, attn_implementation="eager")
    randomize(model, gen)
    folder = os.path.join(out, name)
    model.save_pretrained(folder)
    # Generation settings play no part in the tests.
    gen_config = os.path.join(folder, "generation_config.json")
    if os.path.exists(gen_config):
        os.remove(gen_config)
    saved = load_file(os.path.join(folder, "model.safetensors"))
    params = state_names(model)
    model_type = config.model_type
    missing = set(as_saved(params, model_type)) - set(saved)
    if missing:
        sys.exit(f"{name}: parameters not in the saved file: {sorted(missing)}")

    ids, mask, labels = inputs(task, gen)
    model.train()  # dropout is 0 in every fixture: train mode is deterministic
    golden = forward_backward(name, model, params, ids, mask, labels)

    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for pname, t in as_saved(params, model_type).items():
        golden[f"step{STEPS}.{pname}"] = t
    golden["step_losses"] = torch.tensor(losses)
    save_file(golden, os.path.join(folder, "golden.safetensors"))
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{name}: {len(params)} tensors, loss {golden['loss'].item():.6f}, {size / 1024:.1f} KiB")


# name -> (base fixture, LoraConfig keyword arguments, also the bf16 base's outputs)
LORA_CASES = {
    "lora_llama": (
        "llama",
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
             use_rslora=True),
        True,
    ),
    "lora_gpt2": (
        "gpt2",
        dict(r=2, lora_alpha=6, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True),
        False,
    ),
}


def adapter_name(name):
    """PEFT's parameter name -> the module path and tensor, as PEFT saves them
    (`base_model.model.` and the adapter name `default` dropped)."""
    return name.removeprefix("base_model.model.").replace(".default.", ".")


def make_lora_fixture(name, out, seed):
    from peft import LoraConfig, get_peft_model
    import copy
    import shutil

    base_name, kwargs, bf16 = LORA_CASES[name]
    base_dir = os.path.join(out, base_name)
    gen = torch.Generator().manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(
        base_dir, attn_implementation="eager", dtype=torch.float32
    )
    config = LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **kwargs)
    model = get_peft_model(base, config)
    params = {}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
                params[adapter_name(pname)] = p
    folder = os.path.join(out, name)
    adapter_dir = os.path.join(folder, "adapter")
    if os.path.exists(adapter_dir):
        shutil.rmtree(adapter_dir)
    model.save_pretrained(adapter_dir)
    readme = os.path.join(adapter_dir, "README.md")
    if os.path.exists(readme):
        os.remove(readme)

    g = load_file(os.path.join(base_dir, "golden.safetensors"))
    ids, mask, labels = g["input_ids"], g["attention_mask"], g["labels"]
    model.train()  # lora_dropout and the fixtures' dropout are 0: deterministic
    golden = forward_backward(name, model, params, ids, mask, labels)

    merged = copy.deepcopy(model).merge_and_unload()
    state = merged.state_dict()
    for module in {n.rsplit(".lora_", 1)[0] for n in params}:
        golden[f"merged.{module}.weight"] = state[f"{module}.weight"].detach().clone().contiguous()

    opt = torch.optim.AdamW(
        list(params.values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for pname, p in params.items():
        golden[f"step{STEPS}.{pname}"] = p.detach().clone().contiguous()
    golden["step_losses"] = torch.tensor(losses)
    if bf16:
        # The same adapter (f32, PEFT's autocast) on the base in bf16: bf16's rounding is large
        # for these tiny random models, so the bf16 test compares with bf16.
        from peft import PeftModel

        base16 = AutoModelForCausalLM.from_pretrained(
            base_dir, attn_implementation="eager", dtype=torch.bfloat16
        )
        model16 = PeftModel.from_pretrained(base16, adapter_dir, is_trainable=True)
        model16.train()
        out16 = model16(input_ids=ids, attention_mask=mask, labels=labels)
        out16.loss.backward()
        golden["bf16.logits"] = out16.logits.detach().float().contiguous()
        for pname, p in model16.named_parameters():
            if p.requires_grad:
                golden[f"bf16.grad.{adapter_name(pname)}"] = p.grad.detach().float().contiguous()
    save_file(golden, os.path.join(folder, "golden.safetensors"))
    size = sum(
        os.path.getsize(os.path.join(d, f))
        for d in (folder, adapter_dir)
        for f in os.listdir(d)
        if os.path.isfile(os.path.join(d, f))
    )
    print(
        f"{name}: {len(params)} adapter tensors on {base_name}, loss {golden['loss'].item():.6f}, "
        f"{size / 1024:.1f} KiB"
    )


def compare_probe(model, probe):
    """The model's logits on the probe's inputs against the probe's logits: the largest absolute
    difference, the logits' scale, and whether the difference is within 1e-4 of the scale."""
    model.eval()
    with torch.no_grad():
        logits = model(
            input_ids=probe["input_ids"], attention_mask=probe.get("attention_mask")
        ).logits
    want = probe["logits"].float()
    diff = (logits - want).abs().max().item()
    scale = want.abs().max().item()
    return diff, scale, diff <= 1e-4 * max(scale, 1.0)


def check_adapter(adapter_dir, base_dir, probe_path):
    from peft import PeftModel
    import peft

    probe_path = probe_path or os.path.join(adapter_dir, "probe.safetensors")
    probe = load_file(probe_path)
    base = AutoModelForCausalLM.from_pretrained(
        base_dir, attn_implementation="eager", dtype=torch.float32
    )
    model = PeftModel.from_pretrained(base, adapter_dir)
    diff, scale, ok = compare_probe(model, probe)
    print(
        f"{adapter_dir}: adapter on {base_dir} loaded by peft {peft.__version__}; max |logits "
        f"diff| {diff:.3e} (scale {scale:.3f}): {'OK' if ok else 'MISMATCH'}"
    )
    return ok


AUTO_BY_ARCH = {
    "ForCausalLM": AutoModelForCausalLM,
    "LMHeadModel": AutoModelForCausalLM,
    "ForMaskedLM": AutoModelForMaskedLM,
    "ForSequenceClassification": AutoModelForSequenceClassification,
}


def check(folder, probe_path):
    probe_path = probe_path or os.path.join(folder, "probe.safetensors")
    probe = load_file(probe_path)
    with open(os.path.join(folder, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    auto = next(a for suffix, a in AUTO_BY_ARCH.items() if arch.endswith(suffix))
    model = auto.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    diff, scale, ok = compare_probe(model, probe)
    print(
        f"{folder}: {arch} loaded by transformers {transformers.__version__}; max |logits diff| "
        f"{diff:.3e} (scale {scale:.3f}): {'OK' if ok else 'MISMATCH'}"
    )
    return ok


def make_tokenizer(corpus, out, vocab_size, arch):
    """A byte-level BPE tokenizer trained on `corpus` and a tiny random model of `arch` whose
    vocabulary is the tokenizer's, saved together as a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<mask>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([corpus], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        mask_token="<mask>",
    )
    torch.manual_seed(0)
    vocab = tok.get_vocab_size()
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        model = AutoModelForCausalLM.from_config(config)
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab, n_embd=48, n_layer=2, n_head=4, n_positions=256,
            bos_token_id=1, eos_token_id=2,
        )
        model = AutoModelForCausalLM.from_config(config)
    else:
        config = BertConfig(
            vocab_size=vocab, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=256, pad_token_id=0,
        )
        model = AutoModelForMaskedLM.from_config(config)
    model.save_pretrained(out)
    gen_config = os.path.join(out, "generation_config.json")
    if os.path.exists(gen_config):
        os.remove(gen_config)
    fast.save_pretrained(out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{out}: tokenizer of {vocab} tokens and a tiny {arch}, {size / 1024:.0f} KiB")


def assistant_loss(folder, rows):
    """The mean cross-entropy of the assistant's last turn over `rows` (conversations), with the
    model and tokenizer (and chat template) of `folder` in `transformers`: the tokens the template
    adds after the generation prompt, predicted from everything before them."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for messages in rows:
        prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(messages, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = tok(full, add_special_tokens=False)["input_ids"]
        if ids[: len(p)] != p:
            raise SystemExit(f"{folder}: the prompt's tokens are not a prefix of the conversation's")
        labels = [-100] * len(p) + ids[len(p):]
        with torch.no_grad():
            out = model(torch.tensor([ids]), labels=torch.tensor([labels]))
        n = sum(1 for x in labels[1:] if x != -100)
        total += out.loss.item() * n
        count += n
    return total / count


def chat_loss(folder, base, data):
    """Held-out assistant-token loss of the fine-tuned `folder` against `base`: lower, or exit 1."""
    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line)["messages"] for line in f if line.strip()]
    rows = [r for r in rows if r and r[-1]["role"] == "assistant"]
    before, after = assistant_loss(base, rows), assistant_loss(folder, rows)
    ok = after < before
    print(f"{folder}: transformers' held-out assistant-token loss {before:.4f} (base) -> "
          f"{after:.4f} (fine-tuned) over {len(rows)} conversations: "
          f"{'lower' if ok else 'NOT LOWER'}")
    return ok


def chat_prompts(data, n):
    """The first `n` different (system, user, answer) of the conversations in `data` whose
    messages are a user turn (after an optional system turn) and an assistant turn."""
    seen, out = set(), []
    with open(data, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            m = json.loads(line)["messages"]
            roles = [x["role"] for x in m]
            if roles == ["user", "assistant"]:
                key = (None, m[0]["content"], m[1]["content"])
            elif roles == ["system", "user", "assistant"]:
                key = (m[0]["content"], m[1]["content"], m[2]["content"])
            else:
                continue
            if key[:2] not in seen:
                seen.add(key[:2])
                out.append(key)
            if len(out) == n:
                break
    if not out:
        raise SystemExit(f"{data}: no conversation of a user turn and an assistant turn")
    return out


def generate_check(folder, data, binary, n, max_new_tokens):
    """transformers' greedy generate against accelerate-rs' generate example on the chat
    prompts of `data`: the same new ids for every prompt, and at least one training answer."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    eos = model.generation_config.eos_token_id
    stop += [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None and e not in stop]
    same, answered = 0, 0
    for system, user, answer in chat_prompts(data, n):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=stop, pad_token_id=tok.pad_token_id or 0,
                                 output_scores=True, return_dict_in_generate=True)
        theirs = out.sequences[0, len(ids):].tolist()
        margin = min((s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores)
        cmd = [binary, "--model", folder, "--chat", "--prompt", user, "--max-new-tokens",
               str(max_new_tokens), "--json"] + (["--system", system] if system else [])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
        ours = json.loads(p.stdout.strip().splitlines()[-1])
        reply = tok.decode(theirs, skip_special_tokens=True)
        equal = ours["ids"] == theirs
        same += equal
        answered += reply.strip() == answer.strip()
        print(f"  {user!r} -> transformers {reply!r}, ours {ours['text']!r}: "
              f"{'same ids' if equal else 'DIFFERENT ids'} ({len(theirs)} tokens, smallest "
              f"greedy margin {margin:.3g}); training answer {answer!r}")
        if not equal:
            print(f"    transformers {theirs}\n    ours         {ours['ids']}")
    total = len(chat_prompts(data, n))
    ok = same == total and answered > 0
    print(f"{folder}: greedy generate equal to transformers on {same}/{total} chat prompts, "
          f"{answered}/{total} answered with the training answer: {'OK' if ok else 'FAIL'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixtures")
    f.add_argument("--out", default="models/tests/fixtures")
    f.add_argument("--only", nargs="*")
    c = sub.add_parser("check")
    c.add_argument("dirs", nargs="+")
    c.add_argument("--probe")
    lo = sub.add_parser("lora")
    lo.add_argument("--out", default="models/tests/fixtures")
    ca = sub.add_parser("check-adapter")
    ca.add_argument("adapter")
    ca.add_argument("--base", required=True)
    ca.add_argument("--probe")
    cl = sub.add_parser("chat-loss")
    cl.add_argument("folder")
    cl.add_argument("--base", required=True)
    cl.add_argument("--data", required=True)
    g = sub.add_parser("generate-check")
    g.add_argument("folder")
    g.add_argument("--data", required=True)
    g.add_argument("--generate", required=True, help="accelerate-rs' generate example binary")
    g.add_argument("--prompts", type=int, default=6)
    g.add_argument("--max-new-tokens", type=int, default=32)
    t = sub.add_parser("tokenizer")
    t.add_argument("--corpus", default="data/corpus.txt")
    t.add_argument("--out", default="models/examples/tiny-llama")
    t.add_argument("--vocab-size", type=int, default=384)
    t.add_argument("--arch", choices=["llama", "gpt2", "bert"], default="llama")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "fixtures":
        for i, name in enumerate(configs()):
            if args.only and name not in args.only:
                continue
            make_fixture(name, args.out, seed=1000 + i)
    elif args.cmd == "check":
        ok = all([check(d, args.probe) for d in args.dirs])
        sys.exit(0 if ok else 1)
    elif args.cmd == "lora":
        for i, name in enumerate(LORA_CASES):
            make_lora_fixture(name, args.out, seed=2000 + i)
    elif args.cmd == "chat-loss":
        sys.exit(0 if chat_loss(args.folder, args.base, args.data) else 1)
    elif args.cmd == "generate-check":
        sys.exit(0 if generate_check(args.folder, args.data, args.generate, args.prompts,
                                     args.max_new_tokens) else 1)
    elif args.cmd == "check-adapter":
        sys.exit(0 if check_adapter(args.adapter, args.base, args.probe) else 1)
    else:
        make_tokenizer(args.corpus, args.out, args.vocab_size, args.arch)


if __name__ == "__main__":
    main()
