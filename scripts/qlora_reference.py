#!/usr/bin/env python3
"""Golden files for QLoRA in the models crate (a 4-bit base with LoRA adapters), from
`transformers` + `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)` + `peft` on the CPU.

Needs the venv of scripts/hf_reference.py with `bitsandbytes` (written against transformers
5.24, peft 0.21, bitsandbytes 0.50.2, torch 2.15). Not run by CI: its output is committed, and
`cargo test -p accelerate-rs-models --test qlora` checks against it without Python.

    python scripts/qlora_reference.py fixtures [--out models/tests/fixtures/llama_4bit]
        From the tiny Llama fixture (models/tests/fixtures/llama, f32): the folder
        `transformers` saves for it loaded in 4 bits (`config.json` with its
        `quantization_config`, `model.safetensors` with each linear layer's packed weight and
        quantization state), a PEFT adapter on that base (`adapter/`, every linear layer, r=4,
        values drawn at random so that every gradient is non-zero) and `golden.safetensors`:
        the Llama fixture's inputs, the 4-bit model's logits (`base.logits`), and with the
        adapter (training mode, dropout 0) its logits, loss and the adapter's gradients
        (`grad.<module>.lora_A.weight`, ...).

    python scripts/qlora_reference.py check-adapter ADAPTER --base BASE [--probe P]
        Loads the adapter folder ADAPTER (written by the fine-tuning example with
        `--load-in-4bit`) with peft on the folder BASE loaded in 4 bits (NF4, double
        quantization, f32 compute), and compares its logits with the probe the example wrote
        (`ADAPTER/probe.safetensors`: input_ids, logits); exit status 1 on a mismatch.

bitsandbytes 0.50.2's AVX-512 CPU dequantization takes the wrong block scales when a weight's
last dimension is a multiple of 16 but not of 64 (every tiny Llama layer: 16 or 32 inputs), so
this script registers bitsandbytes' own portable dequantization kernel
(`backends/default/ops.py`, the flat layout of its CUDA kernel) for the CPU before anything runs:
the reference is bitsandbytes' format and values, not that kernel's bug (see CHANGELOG, 4-bit
entry). Quantization itself is bitsandbytes' unchanged.
"""

import argparse
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "models", "tests", "fixtures", "llama")
SEED = 39
TOL = 1e-4


def portable_dequant():
    """Registers bitsandbytes' portable 4-bit dequantization as its CPU kernel."""
    from bitsandbytes._ops import register_kernel
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    @register_kernel("bitsandbytes::dequantize_4bit", "cpu")
    def _(A, absmax, blocksize, quant_type, shape, dtype):
        code = _get_4bit_code(quant_type, A.device)
        return _dequantize_4bit_compute(
            A.view(torch.uint8).reshape(-1), absmax, code, blocksize, shape, dtype
        )


def load_4bit(folder):
    """The folder loaded as `transformers` loads it in 4 bits (QLoRA's NF4, f32 compute)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        quantization_config=config,
        dtype=torch.float32,
        attn_implementation="eager",
        device_map="cpu",
    )
    # On a CPU with AVX-512 BF16, bitsandbytes repacks a layer's weight for its bf16 inference
    # kernel in eval mode (another layout and bf16 products): keep its reference path, the
    # dequantized weight times the input in the compute dtype, as in training.
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def adapter_name(name):
    """PEFT's parameter name -> the name PEFT saves it under."""
    return name.removeprefix("base_model.model.").replace(".default.", ".")


def fixtures(out):
    from peft import LoraConfig, get_peft_model

    os.makedirs(out, exist_ok=True)
    model = load_4bit(BASE)
    model.save_pretrained(out)
    g = load_file(os.path.join(BASE, "golden.safetensors"))
    ids, mask, labels = g["input_ids"], g["attention_mask"], g["labels"]
    golden = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    model.eval()
    with torch.no_grad():
        golden["base.logits"] = model(input_ids=ids, attention_mask=mask).logits.contiguous()

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(SEED)
    params = {}
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
                params[adapter_name(name)] = p
    adapter_dir = os.path.join(out, "adapter")
    if os.path.exists(adapter_dir):
        shutil.rmtree(adapter_dir)
    peft_model.save_pretrained(adapter_dir)
    readme = os.path.join(adapter_dir, "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    peft_model.train()
    res = peft_model(input_ids=ids, attention_mask=mask, labels=labels)
    res.loss.backward()
    golden["lora.logits"] = res.logits.detach().contiguous()
    golden["lora.loss"] = res.loss.detach().reshape(1)
    for name, p in params.items():
        golden[f"grad.{name}"] = p.grad.detach().contiguous()
    save_file(golden, os.path.join(out, "golden.safetensors"))
    size = sum(
        os.path.getsize(os.path.join(d, f))
        for d in (out, adapter_dir)
        for f in os.listdir(d)
        if os.path.isfile(os.path.join(d, f))
    )
    print(f"{out}: {len(params)} adapter tensors, loss {res.loss.item():.6f}, {size / 1024:.1f} KiB")


def check_adapter(adapter_dir, base_dir, probe_path):
    import peft
    from peft import PeftModel

    probe = load_file(probe_path or os.path.join(adapter_dir, "probe.safetensors"))
    model = PeftModel.from_pretrained(load_4bit(base_dir), adapter_dir)
    model.eval()
    with torch.no_grad():
        logits = model(
            input_ids=probe["input_ids"], attention_mask=probe.get("attention_mask")
        ).logits
    want = probe["logits"].float()
    diff = (logits - want).abs().max().item()
    scale = want.abs().max().item()
    ok = diff <= TOL * max(scale, 1.0)
    print(
        f"{adapter_dir}: adapter on {base_dir} in 4 bits (NF4, double quantization) loaded by "
        f"peft {peft.__version__}; max |logits diff| {diff:.3e} (scale {scale:.3f}): "
        f"{'OK' if ok else 'MISMATCH'}"
    )
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixtures")
    f.add_argument("--out", default=os.path.join(ROOT, "models", "tests", "fixtures", "llama_4bit"))
    c = sub.add_parser("check-adapter")
    c.add_argument("adapter")
    c.add_argument("--base", required=True)
    c.add_argument("--probe")
    args = ap.parse_args()
    torch.manual_seed(0)
    portable_dequant()
    if args.cmd == "fixtures":
        fixtures(args.out)
        return 0
    return 0 if check_adapter(args.adapter, args.base, args.probe) else 1


if __name__ == "__main__":
    sys.exit(main())
