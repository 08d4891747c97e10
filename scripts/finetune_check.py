#!/usr/bin/env python3
"""End-to-end check of `models/examples/finetune` on real processes, as README's commands run it.

1. Full fine-tuning of the shipped tiny Llama on 1 and on 2 CPU processes with split batches
   (`ACCELERATE_RS_SPLIT_BATCHES=1`, so the global batch is the same): every step's training
   loss must print the same, the held-out loss must fall, and the saved `model.safetensors`
   must agree tensor by tensor (within 1e-5: the 2-process run sums the gradient in another
   order).
2. LoRA (r = 8, activation checkpointing, `--merge`) on 2 processes against 1 process, and
   against 2 processes without checkpointing: the same losses, the same adapter weights (bit for
   bit with and without checkpointing), a PEFT adapter folder and a merged Hugging Face folder
   written; the gradient all-reduce carries the adapters' gradients only (the bytes per step the
   example prints equal the adapters' size plus one flag per tensor, in f32).
3. Every family added after Llama (Qwen3, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE, Phi-3): a tiny
   model of each over the shipped tokenizer, trained from the same seeded initial weights
   (`--init-seed`) on 1 and on 2 processes with split batches: the same losses, the held-out loss
   falling, the saved weights agreeing within 1e-5; for the mixtures of experts, the tokens each
   expert takes on the held-out text (printed) after 200 steps with and without the
   load-balancing loss; with it (coefficient 0.1) every expert keeps at least 0.15x its fair
   share.
4. Conversations (data/chat_tiny.jsonl, the tiny model's chat template), with and without
   `--pack`, gradient accumulation 2, warmup + cosine: the same token-weighted losses on 1 and 2
   processes, the held-out assistant-token loss (data/chat_tiny_eval.jsonl) falling, the weights
   within 1e-5. Bad input (a row without an assistant turn, an unknown role, a folder without a
   template, a template that fails to render): an error naming it, no panic; over-long
   examples truncated and counted. Then 300 steps on 2 processes with `--eval-samples 3
   --eval-every 150 --log-dir`: the held-out samples (split over the processes) printed and in
   `samples.jsonl` in prompt order at steps 0, 150 and 300, the last ones equal to what the
   generate example answers from the saved folder, and that folder answering training prompts
   with their training answers (the generate example, greedy).
5. With `--python PY` (an interpreter that has torch, transformers and peft): the saved folders
   load in `transformers` / `peft` with the logits the example computed
   (`scripts/hf_reference.py check` / `check-adapter`), every family's too; the chat folders
   have a lower held-out assistant-token loss than the base in `transformers`
   (`hf_reference.py chat-loss`), and `transformers`' greedy `generate` on the 300-step chat
   folder gives the generate example's token ids on training prompts and answers at least one
   with its training answer (`hf_reference.py generate-check`).

With `--load-in-4bit`, QLoRA alone instead: LoRA (r = 8, activation checkpointing, `--merge`)
over the tiny Llama's base quantized on load to 4 bits (NF4, double quantization) on 2 processes
against 1 process: the same losses, the adapters within 1e-5, the held-out loss falling, only the
adapters' gradients all-reduced, a PEFT adapter folder and a merged (dequantized) folder written;
with `--python PY` (bitsandbytes installed too), peft loads the adapter on the base quantized by
`transformers` + bitsandbytes with the example's logits (`scripts/qlora_reference.py
check-adapter`), and `transformers` loads the merged folder with them.

Usage: python3 scripts/finetune_check.py [--no-build] [--python PY] [--keep DIR] [--load-in-4bit]
Stdlib only (the safetensors files are read by hand). Exits non-zero on the first failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "target", "release", "accelerate-rs")
FINETUNE = os.path.join(ROOT, "target", "release", "examples", "finetune")
GENERATE = os.path.join(ROOT, "target", "release", "examples", "generate")
MODEL = os.path.join(ROOT, "models", "examples", "tiny-llama")
TRAIN = os.path.join(ROOT, "data", "corpus.txt")
CHAT_TRAIN = os.path.join(ROOT, "data", "chat_tiny.jsonl")
CHAT_EVAL = os.path.join(ROOT, "data", "chat_tiny_eval.jsonl")
STEPS = 20


def fail(msg: str) -> None:
    sys.exit(f"finetune_check: FAIL: {msg}")


def run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    full = dict(os.environ)
    for k in ("ACCELERATE_RS_SPLIT_BATCHES", "ACCELERATE_RS_MIXED_PRECISION", "RUST_LOG"):
        full.pop(k, None)
    full.update(env or {})
    p = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        fail(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p.stdout


def finetune(n: int, out: str, extra: list[str], model: str = MODEL, steps: int = STEPS,
             launch: list[str] | None = None, data: list[str] | None = None) -> dict:
    """Runs the example on `n` processes with split batches (`launch`: more launcher flags;
    `data`: the data flags, by default the text corpus in windows of 64); returns what it
    printed."""
    data = data or ["--train", TRAIN, "--seq-len", "64"]
    cmd = [LAUNCHER, "launch", "--cpu", "-n", str(n)] + (launch or []) + [FINETUNE, "--model", model,
           "--max-steps", str(steps), "--batch-size", "8", "--log-every", "1",
           "--output", out] + data + extra
    text = run(cmd, {"ACCELERATE_RS_SPLIT_BATCHES": "1"})
    rank0 = [line.split("] ", 1)[1] for line in text.splitlines()
             if line.startswith("[rank 0] ")]
    losses = [m.group(1) for line in rank0
              if (m := re.search(r"training loss ([-+.0-9eEinfNa]+)", line))]
    held = [(m.group(1), m.group(2)) for line in rank0
            if (m := re.search(r"held-out loss (\S+) -> (\S+)$", line))]
    reduced = [int(m.group(1)) for line in rank0
               if (m := re.search(r"gradient all-reduce: (\d+) bytes per step", line))]
    if len(losses) != steps or len(held) != 1:
        fail(f"{n} processes, {extra}: expected {steps} losses and one held-out line:\n{text}")
    loads = [(m.group(1), json.loads(m.group(2)), float(m.group(3)), float(m.group(4)))
             for line in rank0
             if (m := re.search(r"expert load (\w+) .*: (\[[0-9, ]*\]) tokens; the busiest expert "
                                r"takes ([0-9.]+)x its fair share, the idlest ([0-9.]+)x", line))]
    return {"losses": losses, "before": float(held[0][0]), "after": float(held[0][1]),
            "reduced": reduced[0] if reduced else None, "loads": loads, "text": text}


# Tiny models of the families added after Llama (the vocabulary is the shipped tokenizer's):
# windows and soft-capping that act on 64-token windows, grouped-query attention, tied and untied
# heads, 2 of 4 experts with the load-balancing loss, LongRoPE past its original length.
FAMILIES = {
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
              "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True},
    "gemma2": {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
               "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16,
               "sliding_window": 32, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
               "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 8,
               "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
               "tie_word_embeddings": False},
    "mixtral": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                "output_router_logits": True, "router_aux_loss_coef": 0.02,
                "rope_theta": 10000.0, "tie_word_embeddings": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                  "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                  "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                  "output_router_logits": True, "router_aux_loss_coef": 0.02,
                  "tie_word_embeddings": True},
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
             "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "original_max_position_embeddings": 32,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.2],
                              "long_factor": [1.5, 3.0]},
             "partial_rotary_factor": 0.5, "tie_word_embeddings": False},
}


def family_folder(work: str, name: str, **overrides) -> str:
    """A model folder of family `name`: its config.json (tiny, the shipped tokenizer's
    vocabulary, `overrides` applied) and the shipped tokenizer's files, no weights
    (`--init-seed` draws them)."""
    with open(os.path.join(MODEL, "config.json")) as f:
        base = json.load(f)
    config = {"vocab_size": base["vocab_size"], "num_hidden_layers": 2,
              "max_position_embeddings": 256, "pad_token_id": base.get("pad_token_id", 0),
              "bos_token_id": base.get("bos_token_id"), "eos_token_id": base.get("eos_token_id"),
              "initializer_range": 0.02}
    config.update(FAMILIES[name])
    config.update(overrides)
    tag = "".join(f"-{k}-{v}" for k, v in overrides.items())
    folder = os.path.join(work, f"family-{name}{tag}", "model")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for file in os.listdir(MODEL):
        if file.startswith("tokenizer") or file == "special_tokens_map.json":
            shutil.copy(os.path.join(MODEL, file), folder)
    return folder


def check_family(work: str, name: str) -> str:
    """Family `name` trained on 1 and 2 processes: the same losses and weights; returns the
    2-process run's output folder (with its probe beside). A mixture of experts is compared
    without its load-balancing loss (a function of each process's whole batch, so 2 halves are
    not 1 batch; the routers still train through the routing weights), then trained with it on 2
    processes, its expert load reported and bounded."""
    moe = FAMILIES[name].get("output_router_logits", False)
    model = family_folder(work, name, output_router_logits=False) if moe else \
        family_folder(work, name)
    root = os.path.dirname(model)
    seed = ["--init-seed", "7"]
    one = finetune(1, os.path.join(root, "out-1"), seed, model)
    two = finetune(2, os.path.join(root, "out-2"),
                   seed + ["--probe", os.path.join(root, "out-2.probe.safetensors")], model)
    if one["losses"] != two["losses"]:
        fail(f"{name}: 1 and 2 processes print different losses:\n{one['losses']}\n"
             f"{two['losses']}")
    if not two["after"] < two["before"]:
        fail(f"{name}: held-out loss did not fall ({two['before']} -> {two['after']})")
    worst = compare(os.path.join(root, "out-1", "model.safetensors"),
                    os.path.join(root, "out-2", "model.safetensors"), 1e-5, f"{name} 1 vs 2")
    line = (f"{name}: {STEPS} losses equal on 1 and 2 processes ({one['losses'][0]} -> "
            f"{one['losses'][-1]}), held-out {two['before']} -> {two['after']}, weights within "
            f"{worst:.2g}")
    if moe:
        # The load-balancing loss at work: 200 steps on 2 processes with it (coefficient 0.1)
        # and without; with it, every expert keeps at least 0.15x its fair share of the
        # held-out tokens (without it, experts starve).
        for coef in (0.1, 0.0):
            folder = family_folder(work, name, router_aux_loss_coef=coef)
            out = finetune(2, os.path.join(os.path.dirname(folder), "out-2"), seed, folder,
                           steps=200)
            line += f"\n  200 steps, router_aux_loss_coef {coef}: held-out {out['before']} -> " \
                    f"{out['after']}"
            for when, load, busiest, idlest in out["loads"]:
                line += f"\n    expert load {when}: {load} (busiest {busiest:.2f}x, idlest " \
                        f"{idlest:.2f}x its fair share)"
                if coef > 0 and when == "after" and idlest < 0.15:
                    fail(f"{name}: with the load-balancing loss an expert fell to {idlest}x its "
                         f"fair share")
            if not out["loads"]:
                fail(f"{name}: no expert load printed")
    print(line)
    return os.path.join(root, "out-2")


def tensors(path: str) -> dict[str, tuple[str, list[int], list[float]]]:
    """A safetensors file's f32 tensors (name -> (dtype, shape, values)); stdlib only."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            fail(f"{path}: {name} is {meta['dtype']}, expected F32")
        a, b = meta["data_offsets"]
        out[name] = (meta["dtype"], meta["shape"], list(struct.unpack(f"<{(b - a) // 4}f", body[a:b])))
    return out


def compare(a_path: str, b_path: str, tol: float, what: str) -> float:
    a, b = tensors(a_path), tensors(b_path)
    if sorted(a) != sorted(b):
        fail(f"{what}: different tensors: {sorted(set(a) ^ set(b))}")
    worst = 0.0
    for name in a:
        if a[name][1] != b[name][1]:
            fail(f"{what}: {name} has shape {a[name][1]} vs {b[name][1]}")
        for x, y in zip(a[name][2], b[name][2]):
            d = abs(x - y) / max(1.0, abs(x))
            worst = max(worst, d)
            if d > tol:
                fail(f"{what}: {name} differs by {d:.3g} (> {tol})")
    return worst


def need(folder: str, names: list[str]) -> None:
    for n in names:
        if not os.path.isfile(os.path.join(folder, n)):
            fail(f"{folder}: {n} was not written")


CHAT = ["--train", CHAT_TRAIN, "--eval", CHAT_EVAL,
        "--seq-len", "128", "--lr", "3e-3", "--gradient-accumulation", "2", "--warmup-steps", "5",
        "--lr-schedule", "cosine"]


def check_chat(work: str) -> list[str]:
    """Conversations (the shipped tiny chat data and template), with and without --pack: the
    same token-weighted losses on 1 and 2 processes (split batches, gradient accumulation 2), the
    held-out assistant-token loss falling, the weights within 1e-5; returns the 2-process output
    folders."""
    outs = []
    for pack in ([], ["--pack"]):
        tag = "chat-pack" if pack else "chat"
        one = finetune(1, os.path.join(work, f"{tag}-1"), pack, data=CHAT)
        two = finetune(2, os.path.join(work, f"{tag}-2"), pack, data=CHAT)
        if one["losses"] != two["losses"]:
            fail(f"{tag}: 1 and 2 processes print different losses:\n{one['losses']}\n"
                 f"{two['losses']}")
        if not two["after"] < two["before"]:
            fail(f"{tag}: held-out assistant loss did not fall ({two['before']} -> {two['after']})")
        if "0 truncated and 0 skipped" not in two["text"]:
            fail(f"{tag}: the data's counts were not printed:\n{two['text']}")
        worst = compare(os.path.join(work, f"{tag}-1", "model.safetensors"),
                        os.path.join(work, f"{tag}-2", "model.safetensors"), 1e-5,
                        f"{tag} 1 vs 2")
        print(f"{tag}: {STEPS} token-weighted losses equal on 1 and 2 processes "
              f"({one['losses'][0]} -> {one['losses'][-1]}), held-out assistant loss "
              f"{two['before']} -> {two['after']}, weights within {worst:.2g}")
        outs.append(os.path.join(work, f"{tag}-2"))
    return outs


def check_chat_errors(work: str) -> None:
    """Bad conversations and folders: a clear error (exit code 1, the culprit named, no panic),
    or for an over-long example a count of the truncated ones."""
    bad = os.path.join(work, "bad")
    os.makedirs(bad, exist_ok=True)
    no_template = os.path.join(bad, "no-template")
    shutil.copytree(MODEL, no_template, dirs_exist_ok=True)
    os.remove(os.path.join(no_template, "chat_template.jinja"))
    failing = os.path.join(bad, "failing-template")
    shutil.copytree(MODEL, failing, dirs_exist_ok=True)
    with open(os.path.join(failing, "chat_template.jinja"), "w") as f:
        f.write("{{ raise_exception('this template refuses every conversation') }}")
    user = {"role": "user", "content": "hi"}
    rows = {
        "no-assistant.jsonl": [{"messages": [user]}] * 3,
        "unknown-role.jsonl": [{"messages": [user, {"role": "robot", "content": "x"}]}],
        "ok.jsonl": [{"messages": [user, {"role": "assistant", "content": "hello"}]}] * 3,
        "long.jsonl": [{"messages": [user, {"role": "assistant", "content": "word " * 40}]}] * 4
        + [{"messages": [user, {"role": "assistant", "content": "short"}]}] * 4,
    }
    for name, content in rows.items():
        with open(os.path.join(bad, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in content)
    cases = [  # (model, train file, what the error must name)
        (MODEL, "no-assistant.jsonl", "assistant"),
        (MODEL, "unknown-role.jsonl", "robot"),
        (no_template, "ok.jsonl", "chat_template"),
        (failing, "ok.jsonl", "refuses every conversation"),
    ]
    for model, file, word in cases:
        cmd = [FINETUNE, "--model", model, "--train", os.path.join(bad, file), "--eval",
               os.path.join(bad, "ok.jsonl"), "--max-steps", "1", "--batch-size", "1",
               "--output", os.path.join(bad, "out"), "--overwrite"]
        env = dict(os.environ, RUST_BACKTRACE="0")
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        text = p.stdout + p.stderr
        if p.returncode == 0 or "panicked" in text or word not in text:
            fail(f"bad input {file} with {os.path.basename(model)}: exit {p.returncode}, expected "
                 f"an error naming {word!r}:\n{text}")
        error = next((l for l in text.splitlines() if l.startswith("Error")), text.strip())
        print(f"bad input {file} ({os.path.basename(model)}): {error}")
    cmd = [FINETUNE, "--model", MODEL, "--train", os.path.join(bad, "long.jsonl"), "--eval",
           os.path.join(bad, "ok.jsonl"), "--seq-len", "24", "--max-steps", "2", "--batch-size",
           "2", "--output", os.path.join(bad, "out"), "--overwrite"]
    text = run(cmd)
    if "4 truncated" not in text:
        fail(f"over-long examples were not counted:\n{text}")
    print("over-long examples: " + next(l for l in text.splitlines() if "truncated" in l))


def generate(folder: str, user: str, system: str | None = None) -> dict:
    """Our generate example's greedy answer to `user` (a chat turn) from `folder`: ids and text."""
    cmd = [GENERATE, "--model", folder, "--chat", "--prompt", user, "--json"]
    out = run(cmd + (["--system", system] if system else []))
    return json.loads(out.strip().splitlines()[-1])


def conversations(path: str) -> list[tuple[str | None, str, str]]:
    """(system, user, answer) of each row of `path` that is a user turn (after an optional
    system turn) and an assistant turn."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = json.loads(line)["messages"] if line.strip() else []
            roles = [x["role"] for x in m]
            if roles == ["user", "assistant"]:
                out.append((None, m[0]["content"], m[1]["content"]))
            elif roles == ["system", "user", "assistant"]:
                out.append((m[0]["content"], m[1]["content"], m[2]["content"]))
    return out


CHAT_SAMPLES = 3


def check_chat_answers(work: str) -> str:
    """The tiny model fine-tuned on the chat data on 2 processes for long enough to learn it,
    with samples: the samples of the held-out prompts are printed and written to samples.jsonl
    (prompt order, at the start, every 150 steps and at the end; split over the 2 processes),
    the last ones equal to what our generate example answers from the saved folder, and that
    folder answers training prompts with their training answers. Returns the folder."""
    out, logs = os.path.join(work, "chat-answers"), os.path.join(work, "chat-answers-log")
    steps, every = 300, 150
    r = finetune(2, out, ["--pack", "--eval-samples", str(CHAT_SAMPLES),
                          "--eval-every", str(every), "--log-dir", logs], steps=steps,
                 data=["--train", CHAT_TRAIN, "--eval", CHAT_EVAL, "--seq-len", "128",
                       "--lr", "1e-2", "--warmup-steps", "10", "--lr-schedule", "cosine"])
    with open(os.path.join(logs, "samples.jsonl"), encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    held = conversations(CHAT_EVAL)[:CHAT_SAMPLES]
    expected = [(step, i) for step in (0, every, steps) for i in range(CHAT_SAMPLES)]
    if [(s["step"], s["index"]) for s in samples] != expected:
        fail(f"samples.jsonl: expected (step, index) {expected}, got {samples}")
    for s in samples:
        if s["prompt"] != held[s["index"]][1] or s["reference"] != held[s["index"]][2]:
            fail(f"sample {s} is not held-out conversation {s['index']} {held[s['index']]}")
    printed = [l for l in r["text"].splitlines() if l.startswith("[rank 0] sample ")]
    if len(printed) != len(expected):
        fail(f"expected {len(expected)} printed samples:\n{r['text']}")
    for s in samples[-CHAT_SAMPLES:]:
        system, user, _ = held[s["index"]]
        ours = generate(out, user, system)
        if ours["text"] != s["generated"] or len(ours["ids"]) != s["tokens"]:
            fail(f"sample {s['index']} (generated on rank {s['index'] % 2}) says {s}, the "
                 f"generate example on the saved folder {ours}")
    trained = conversations(CHAT_TRAIN)
    picked = [trained[i] for i in range(0, len(trained), len(trained) // 8)][:8]
    right = [(u, a) for (sys_, u, a) in picked if generate(out, u, sys_)["text"] == a]
    if not right:
        fail(f"the fine-tuned folder answers none of the training prompts {picked}")
    if not r["after"] < r["before"] / 4:
        fail(f"chat answers: held-out loss {r['before']} -> {r['after']}, not far lower")
    print(f"chat answers: {steps} steps on 2 processes, held-out loss {r['before']} -> "
          f"{r['after']}; samples.jsonl in prompt order at steps 0, {every}, {steps}, the last equal "
          f"to the generate example on the saved folder; {len(right)}/{len(picked)} training "
          f"prompts answered with their training answer by the generate example (e.g. "
          f"{right[0][0]!r} -> {right[0][1]!r})")
    return out


def check_qlora(work: str, python: str | None) -> None:
    """LoRA over a 4-bit base: 1 process = 2 processes, the held-out loss falls, only the
    adapters all-reduced; peft and transformers load what was saved (with `python`)."""
    qlora = ["--load-in-4bit", "--lora-r", "8", "--lr", "5e-3", "--checkpoint-activations"]
    q1 = finetune(1, os.path.join(work, "qlora-1"), qlora)
    q2 = finetune(2, os.path.join(work, "qlora-2"), qlora + [
        "--merge", os.path.join(work, "qlora-2-merged"),
        "--probe", os.path.join(work, "qlora-2.probe.safetensors")])
    if q1["losses"] != q2["losses"]:
        fail(f"QLoRA: 1 and 2 processes print different losses:\n{q1['losses']}\n{q2['losses']}")
    if not q2["after"] < q2["before"]:
        fail(f"QLoRA: held-out loss did not fall ({q2['before']} -> {q2['after']})")
    if "in a 4-bit base of" not in q2["text"]:
        fail(f"QLoRA: the run does not say its base is 4-bit:\n{q2['text']}")
    need(os.path.join(work, "qlora-2"), ["adapter_config.json", "adapter_model.safetensors"])
    need(os.path.join(work, "qlora-2-merged"), ["config.json", "model.safetensors"])
    adapter = lambda d: os.path.join(work, d, "adapter_model.safetensors")  # noqa: E731
    worst = compare(adapter("qlora-1"), adapter("qlora-2"), 1e-5, "QLoRA 1 vs 2")
    sizes = tensors(adapter("qlora-2"))
    values = sum(len(v[2]) for v in sizes.values())
    expected = 4 * (values + len(sizes))
    if q2["reduced"] != expected:
        fail(f"QLoRA: {q2['reduced']} bytes all-reduced per step, expected {expected}")
    print(f"QLoRA (NF4 base, LoRA r=8, activation checkpointing): {STEPS} losses equal on 1 and 2 "
          f"processes ({q1['losses'][0]} -> {q1['losses'][-1]}), adapters within {worst:.2g}, "
          f"held-out {q2['before']} -> {q2['after']}; all-reduce {q2['reduced']} bytes/step "
          f"(the adapters only)")
    if not python:
        print("peft/bitsandbytes checks skipped (no --python given)")
        return
    probe = os.path.join(work, "qlora-2.probe.safetensors")
    print(run([python, os.path.join(ROOT, "scripts", "qlora_reference.py"), "check-adapter",
               os.path.join(work, "qlora-2"), "--base", MODEL, "--probe", probe]).strip())
    print(run([python, os.path.join(ROOT, "scripts", "hf_reference.py"), "check",
               os.path.join(work, "qlora-2-merged"), "--probe", probe]).strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-build", action="store_true", help="use the release binaries as they are")
    ap.add_argument("--python", help="an interpreter with torch, transformers and peft")
    ap.add_argument("--keep", help="write the runs here (default: a temporary folder, removed)")
    ap.add_argument("--load-in-4bit", action="store_true", help="check QLoRA (a 4-bit base) only")
    args = ap.parse_args()

    if not args.no_build:
        for cmd in (["cargo", "build", "--release", "-p", "accelerate-rs-models", "--example",
                     "finetune", "--example", "generate"],
                    ["cargo", "build", "--release", "-p", "accelerate-rs-cli"]):
            subprocess.run(cmd, cwd=ROOT, check=True)
    work = args.keep or tempfile.mkdtemp(prefix="finetune-check-")
    os.makedirs(work, exist_ok=True)
    try:
        if args.load_in_4bit:
            check_qlora(work, args.python)
            print("finetune_check --load-in-4bit: PASS")
            return 0
        # 1. Full fine-tuning: 1 process = 2 processes with the same global batch.
        one = finetune(1, os.path.join(work, "full-1"), [])
        two = finetune(2, os.path.join(work, "full-2"),
                       ["--probe", os.path.join(work, "full-2.probe.safetensors")])
        if one["losses"] != two["losses"]:
            fail(f"full fine-tuning: 1 and 2 processes print different losses:\n"
                 f"{one['losses']}\n{two['losses']}")
        if not two["after"] < two["before"]:
            fail(f"full fine-tuning: held-out loss did not fall ({two['before']} -> {two['after']})")
        need(os.path.join(work, "full-2"), ["config.json", "model.safetensors", "tokenizer.json"])
        worst = compare(os.path.join(work, "full-1", "model.safetensors"),
                        os.path.join(work, "full-2", "model.safetensors"), 1e-5, "full 1 vs 2")
        print(f"full fine-tuning: {STEPS} losses equal on 1 and 2 processes "
              f"({one['losses'][0]} -> {one['losses'][-1]}), held-out {two['before']} -> "
              f"{two['after']}, weights within {worst:.2g}; all-reduce {two['reduced']} bytes/step")

        # 2. LoRA with activation checkpointing and a merged folder.
        lora = ["--lora-r", "8", "--lr", "5e-3"]
        l1 = finetune(1, os.path.join(work, "lora-1"), lora + ["--checkpoint-activations"])
        l2 = finetune(2, os.path.join(work, "lora-2"), lora + [
            "--checkpoint-activations", "--merge", os.path.join(work, "lora-2-merged"),
            "--probe", os.path.join(work, "lora-2.probe.safetensors")])
        l2p = finetune(2, os.path.join(work, "lora-2-plain"), lora)
        if l1["losses"] != l2["losses"]:
            fail(f"LoRA: 1 and 2 processes print different losses:\n{l1['losses']}\n{l2['losses']}")
        if l2["losses"] != l2p["losses"]:
            fail("LoRA: activation checkpointing changed the losses:\n"
                 f"{l2['losses']}\n{l2p['losses']}")
        if not l2["after"] < l2["before"]:
            fail(f"LoRA: held-out loss did not fall ({l2['before']} -> {l2['after']})")
        need(os.path.join(work, "lora-2"), ["adapter_config.json", "adapter_model.safetensors"])
        need(os.path.join(work, "lora-2-merged"),
             ["config.json", "model.safetensors", "tokenizer.json"])
        adapter = lambda d: os.path.join(work, d, "adapter_model.safetensors")  # noqa: E731
        worst_l = compare(adapter("lora-1"), adapter("lora-2"), 1e-5, "LoRA 1 vs 2")
        exact = compare(adapter("lora-2"), adapter("lora-2-plain"), 0.0, "LoRA with/without ckpt")
        sizes = tensors(adapter("lora-2"))
        adapter_values = sum(len(v[2]) for v in sizes.values())
        expected = 4 * (adapter_values + len(sizes))  # f32 gradients + one f32 flag per tensor
        if l2["reduced"] != expected:
            fail(f"LoRA: {l2['reduced']} bytes all-reduced per step, expected {expected} "
                 f"({adapter_values} adapter values and {len(sizes)} flags in f32)")
        if two["reduced"] is None or not l2["reduced"] < two["reduced"]:
            fail(f"LoRA all-reduced {l2['reduced']} bytes per step, full fine-tuning {two['reduced']}")
        print(f"LoRA r=8: {STEPS} losses equal on 1 and 2 processes and with/without activation "
              f"checkpointing, adapters within {worst_l:.2g} (1 vs 2) and {exact:.2g} (ckpt), "
              f"held-out {l2['before']} -> {l2['after']}; all-reduce {l2['reduced']} bytes/step "
              f"= {len(sizes)} adapter tensors ({adapter_values} values) + flags, against "
              f"{two['reduced']} for full fine-tuning")

        # 3. ZeRO-3 with the launcher's flag alone: the same run, parameters sharded.
        z3 = finetune(2, os.path.join(work, "full-2-z3"),
                      ["--probe", os.path.join(work, "full-2-z3.probe.safetensors")],
                      launch=["--zero-stage", "3"])
        if z3["losses"] != two["losses"]:
            fail(f"ZeRO-3: 2 processes at stage 3 print other losses than at stage 0:\n"
                 f"{two['losses']}\n{z3['losses']}")
        if "sharded over the processes (ZeRO-3)" not in z3["text"]:
            fail(f"ZeRO-3: the run does not say the parameters are sharded:\n{z3['text']}")
        need(os.path.join(work, "full-2-z3"), ["config.json", "model.safetensors", "tokenizer.json"])
        worst_z = compare(os.path.join(work, "full-2", "model.safetensors"),
                          os.path.join(work, "full-2-z3", "model.safetensors"), 1e-6, "stage 0 vs 3")
        z3l = finetune(2, os.path.join(work, "lora-2-z3"), lora, launch=["--zero-stage", "3"])
        if z3l["losses"] != l2p["losses"]:
            fail(f"ZeRO-3 LoRA: other losses than at stage 0:\n{l2p['losses']}\n{z3l['losses']}")
        worst_zl = compare(adapter("lora-2-plain"), adapter("lora-2-z3"), 1e-6, "LoRA stage 0 vs 3")
        print(f"ZeRO-3 (launch --zero-stage 3): full and LoRA losses equal to stage 0 on 2 "
              f"processes, weights within {worst_z:.2g}, adapters within {worst_zl:.2g}")

        # 4. The families added after Llama.
        families = [check_family(work, name) for name in FAMILIES]

        # 5. Conversations, with and without packing; bad chat input.
        chats = check_chat(work)
        check_chat_errors(work)
        answers = check_chat_answers(work)

        # 6. transformers / peft load what was saved, with the same logits.
        if args.python:
            ref = os.path.join(ROOT, "scripts", "hf_reference.py")
            for sub in (["check", os.path.join(work, "full-2"), "--probe",
                         os.path.join(work, "full-2.probe.safetensors")],
                        ["check-adapter", os.path.join(work, "lora-2"), "--base", MODEL,
                         "--probe", os.path.join(work, "lora-2.probe.safetensors")],
                        ["check", os.path.join(work, "lora-2-merged"), "--probe",
                         os.path.join(work, "lora-2.probe.safetensors")],
                        ["check", os.path.join(work, "full-2-z3"), "--probe",
                         os.path.join(work, "full-2-z3.probe.safetensors")]):
                print(run([args.python, ref] + sub).strip())
            for out in families:
                print(run([args.python, ref, "check", out, "--probe",
                           out + ".probe.safetensors"]).strip())
            for out in chats + [answers]:
                print(run([args.python, ref, "chat-loss", out, "--base", MODEL, "--data",
                           CHAT_EVAL]).strip())
            print(run([args.python, ref, "generate-check", answers, "--data", CHAT_TRAIN,
                       "--generate", GENERATE]).strip())
        else:
            print("transformers/peft checks skipped (no --python given)")
        print("finetune_check: PASS")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
