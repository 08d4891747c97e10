#!/usr/bin/env python3
"""Golden files for accelerate_rs::quant (4-bit NF4/FP4 weights), from `bitsandbytes` on the CPU.

Needs `pip install torch bitsandbytes safetensors transformers` (PyPI; CPU is enough; written
against bitsandbytes 0.50.2 and torch 2.15). Not run by CI: its output is committed, and
`cargo test --test it quant` checks against it without Python.

    python scripts/bnb_reference.py fixtures [--out tests/fixtures/bnb4bit]
        Writes `golden.safetensors`: for each case below, under the case's name as the module
        prefix, the weight quantized (`<case>.input`), the six tensors a `transformers` 4-bit
        folder holds per linear layer (`<case>.weight` (packed, uint8 [n/2, 1]),
        `.weight.absmax`, `.weight.quant_map`, `.weight.nested_absmax`,
        `.weight.nested_quant_map`, `.weight.quant_state.bitsandbytes__<type>`: the JSON of
        `QuantState.as_dict(packed=True)` as bytes), the per-block scales bitsandbytes
        dequantizes from the nested statistics (`<case>.absmax_f32`) and the dequantized weight
        (`<case>.dequant`, in the weight's dtype; not for `big_bf16`, whose
        packed bytes and scales are checked). Also the tensors `transformers` itself saves
        for two layers of `models/examples/tiny-llama` quantized on load with
        `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True)` (under their own names, `model.layers.0...`), which the
        script checks equal `F.quantize_4bit`'s.

What the reference is, exactly: `bitsandbytes.functional.quantize_4bit(w, blocksize=64,
quant_type=..., compress_statistics=...)` on the CPU (its portable PyTorch kernel for the 4-bit
codes; the C++ CPU kernel with its 65,536-entry lookup table for the 8-bit nested absmax; the
nested offset is `torch.mean` of the absmax, summed in PyTorch's CPU order). The dequantized
values are bitsandbytes' portable kernel (`backends/default/ops.py`), the same flat layout as its
CUDA kernel: bitsandbytes 0.50.2's AVX-512 CPU kernel (`cdequantize_blockwise_cpu_nf4_*`) takes
the wrong block scale when a weight's last dimension is a multiple of 16 but not of the block
size (every tiny-llama layer: 32 or 96 inputs); the script says where it differs.

The `big_bf16` case's weight (258 blocks: two nested blocks of 256) is not stored: both sides
compute it, `bf16(((i * 2654435761) mod 2^32 >> 20) - 2048) * 2^-14)` for element `i`, in
integers and exact float scaling (`big_input` here, the same formula in the Rust test).
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import bitsandbytes.functional as F
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "models", "examples", "tiny-llama")
BLOCKSIZE = 64


def big_input():
    """The `big_bf16` case's weight, [127, 130] in bf16, from integers only."""
    i = np.arange(127 * 130, dtype=np.uint64)
    h = (i * np.uint64(2654435761)) % np.uint64(2**32)
    v = (h >> np.uint64(20)).astype(np.int64) - 2048  # in [-2048, 2047]
    w = torch.from_numpy(v.astype(np.float32) * np.float32(2.0**-14))
    return w.reshape(127, 130).to(torch.bfloat16)


def edge_input():
    """[4, 64] f32: a block of zeros, a block of NF4's decision boundaries exactly (ties), a block
    of the code values themselves scaled by 3, and a block with tiny and negative-zero values."""
    code = F.get_4bit_type("nf4", device="cpu")
    mids = (code[:-1] + code[1:]) / 2
    row1 = torch.cat([mids, -mids, torch.full((34,), 0.25)])
    row1[-1] = 1.0  # absmax 1: the ties stay exact after scaling
    row1 = row1 * 0.5  # absmax 0.5: 1 / 0.5 = 2 exactly
    row2 = torch.cat([code, code, code, code]) * 3.0
    gen = torch.Generator().manual_seed(5)
    row3 = torch.randn(64, generator=gen) * 1e-30
    row3[0], row3[1], row3[2] = -0.0, 0.0, 2e-30
    return torch.stack([torch.zeros(64), row1, row2, row3]).float()


def cases():
    """name -> (weight, quant_type, double quantization)."""
    tiny = load_file(os.path.join(TINY, "model.safetensors"))
    layer = "model.layers.0."
    gen = torch.Generator().manual_seed(39)
    return {
        "llama_q": (tiny[layer + "self_attn.q_proj.weight"], "nf4", True),
        "llama_down_bf16": (tiny[layer + "mlp.down_proj.weight"].to(torch.bfloat16), "nf4", True),
        "odd_f32": (torch.randn(7, 33, generator=gen) * 0.02, "nf4", True),
        "fp4_k": (tiny[layer + "self_attn.k_proj.weight"], "fp4", True),
        "plain_v": (tiny[layer + "self_attn.v_proj.weight"], "nf4", False),
        "edge": (edge_input(), "nf4", True),
        "small_f16": ((torch.randn(3, 40, generator=gen) * 0.1).to(torch.float16), "nf4", True),
        "big_bf16": (big_input(), "nf4", True),
    }


def state_tensors(prefix, packed, state):
    """The tensors `transformers` saves for a 4-bit linear's weight under `prefix`."""
    out = {prefix + ".weight": packed.contiguous()}
    for k, v in state.as_dict(packed=True).items():
        out[prefix + ".weight." + k] = v.contiguous()
    return out


def absmax_f32(state):
    """The per-block scales bitsandbytes dequantizes with (`dequantize_4bit`'s own steps)."""
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
        return absmax.float()
    return state.absmax.float()


def fixtures(out):
    tensors = {}
    for name, (w, quant_type, nested) in cases().items():
        w = w.contiguous()
        packed, state = F.quantize_4bit(
            w, blocksize=BLOCKSIZE, quant_type=quant_type, compress_statistics=nested
        )
        scales = absmax_f32(state)
        code = F.get_4bit_type(quant_type, device="cpu")
        dq = _dequantize_4bit_compute(packed.reshape(-1), scales, code, BLOCKSIZE, w.shape, w.dtype)
        cpu = F.dequantize_4bit(packed, state)
        if not torch.equal(cpu, dq):
            bad = (cpu != dq).sum().item()
            print(
                f"{name}: bitsandbytes' CPU dequantize_4bit differs from its portable kernel in "
                f"{bad} of {dq.numel()} values (shape {tuple(w.shape)}); the portable one is stored"
            )
        err = (dq.float() - w.float()).abs().max().item()
        print(f"{name}: {tuple(w.shape)} {w.dtype} {quant_type} nested={nested}, max |w - dq| {err:.3g}")
        if name != "big_bf16":
            tensors[name + ".input"] = w
        tensors.update(state_tensors(name, packed, state))
        tensors[name + ".absmax_f32"] = scales.contiguous()
        if name != "big_bf16":  # 33 KB; its scales (`absmax_f32`) and bytes are checked
            tensors[name + ".dequant"] = dq.contiguous()
    tensors.update(transformers_tensors(tensors))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "golden.safetensors")
    # Copies: a non-nested state's absmax is also its absmax_f32 (safetensors refuses shared ones).
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, path)
    os.chmod(path, 0o644)
    print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(tensors)} tensors)")


def transformers_tensors(ours):
    """Two layers of tiny-llama as `transformers` saves them after quantizing on load, checked
    equal to the `llama_q` case (and to `quantize_4bit` for down_proj)."""
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        TINY, quantization_config=config, device_map="cpu", dtype=torch.float32
    )
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    keep = {}
    for layer in ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]:
        for k, v in saved.items():
            if k.startswith(layer + ".weight"):
                keep[k] = v.contiguous()
    tiny = load_file(os.path.join(TINY, "model.safetensors"))
    for layer, case in [("model.layers.0.self_attn.q_proj", "llama_q"), ("model.layers.1.mlp.down_proj", None)]:
        if case is None:
            packed, state = F.quantize_4bit(
                tiny[layer + ".weight"], blocksize=BLOCKSIZE, quant_type="nf4", compress_statistics=True
            )
            ref = state_tensors(layer, packed, state)
        else:
            ref = {layer + k[len(case):]: v for k, v in ours.items() if k.startswith(case + ".weight")}
        assert set(ref) == {k for k in keep if k.startswith(layer + ".")}, (sorted(ref), sorted(keep))
        for k, v in ref.items():
            assert torch.equal(keep[k], v), f"transformers' {k} differs from quantize_4bit's"
    print(f"transformers: {len(keep)} tensors of 2 layers, equal to quantize_4bit's")
    return keep


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixtures")
    f.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "bnb4bit"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "fixtures":
        fixtures(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
