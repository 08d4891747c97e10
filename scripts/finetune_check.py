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
3. With `--python PY` (an interpreter that has torch, transformers and peft): the saved folders
   load in `transformers` / `peft` with the logits the example computed
   (`scripts/hf_reference.py check` / `check-adapter`).

Usage: python3 scripts/finetune_check.py [--no-build] [--python PY] [--keep DIR]
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
MODEL = os.path.join(ROOT, "models", "examples", "tiny-llama")
TRAIN = os.path.join(ROOT, "data", "corpus.txt")
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


def finetune(n: int, out: str, extra: list[str]) -> dict:
    """Runs the example on `n` processes with split batches; returns what it printed."""
    cmd = [LAUNCHER, "launch", "--cpu", "-n", str(n), FINETUNE, "--model", MODEL,
           "--train", TRAIN, "--max-steps", str(STEPS), "--seq-len", "64", "--batch-size", "8",
           "--log-every", "1", "--output", out] + extra
    text = run(cmd, {"ACCELERATE_RS_SPLIT_BATCHES": "1"})
    rank0 = [line.split("] ", 1)[1] for line in text.splitlines()
             if line.startswith("[rank 0] ")]
    losses = [m.group(1) for line in rank0
              if (m := re.search(r"training loss ([-+.0-9eEinfNa]+)", line))]
    held = [(m.group(1), m.group(2)) for line in rank0
            if (m := re.search(r"held-out loss (\S+) -> (\S+)$", line))]
    reduced = [int(m.group(1)) for line in rank0
               if (m := re.search(r"gradient all-reduce: (\d+) bytes per step", line))]
    if len(losses) != STEPS or len(held) != 1:
        fail(f"{n} processes, {extra}: expected {STEPS} losses and one held-out line:\n{text}")
    return {"losses": losses, "before": float(held[0][0]), "after": float(held[0][1]),
            "reduced": reduced[0] if reduced else None, "text": text}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-build", action="store_true", help="use the release binaries as they are")
    ap.add_argument("--python", help="an interpreter with torch, transformers and peft")
    ap.add_argument("--keep", help="write the runs here (default: a temporary folder, removed)")
    args = ap.parse_args()

    if not args.no_build:
        for cmd in (["cargo", "build", "--release", "-p", "accelerate-rs-models", "--example",
                     "finetune"], ["cargo", "build", "--release", "-p", "accelerate-rs-cli"]):
            subprocess.run(cmd, cwd=ROOT, check=True)
    work = args.keep or tempfile.mkdtemp(prefix="finetune-check-")
    os.makedirs(work, exist_ok=True)
    try:
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

        # 3. transformers / peft load what was saved, with the same logits.
        if args.python:
            ref = os.path.join(ROOT, "scripts", "hf_reference.py")
            for sub in (["check", os.path.join(work, "full-2"), "--probe",
                         os.path.join(work, "full-2.probe.safetensors")],
                        ["check-adapter", os.path.join(work, "lora-2"), "--base", MODEL,
                         "--probe", os.path.join(work, "lora-2.probe.safetensors")],
                        ["check", os.path.join(work, "lora-2-merged"), "--probe",
                         os.path.join(work, "lora-2.probe.safetensors")]):
                print(run([args.python, ref] + sub).strip())
        else:
            print("transformers/peft checks skipped (no --python given)")
        print("finetune_check: PASS")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
