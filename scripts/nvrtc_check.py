#!/usr/bin/env python3
"""Compiles the crate's run-time CUDA sources with the real NVRTC, on a machine WITHOUT a GPU.

accelerate-rs compiles its CUDA kernels at run time with NVRTC (src/optim/fused_optim.cu for the
fused optimizers, src/nn/kernels.cu for the `nn-cuda` feature, src/nn/flash.cu for flash
attention, src/quant/dequant4.cu not yet launched; each behind src/cuda_prelude.cu).
`cargo build` never sees that code, so a syntax error would only show on a GPU. This script loads libnvrtc.so.13 (NVIDIA's
`nvidia-cuda-nvrtc` wheel from PyPI, downloaded into ~/.cache/accel-nvrtc the first time, or
$ACCEL_NVRTC_LIB), compiles each source with the options the crate uses, for the architectures
given (default compute_80 and compute_90), checks that every kernel the Rust side launches is
in the PTX, and assembles the PTX with ptxas for the real GPU when ptxas is there (the CUDA
toolchain of ../shared/tools/cuda-toolchain.sh has it), as the driver would.

    python3 scripts/nvrtc_check.py                 # all sources, compute_80 and compute_90
    python3 scripts/nvrtc_check.py --arch compute_90

Exit status 0 when everything compiles and every entry point is present; 1 otherwise.
"""
import argparse
import ctypes
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

REPO = pathlib.Path(__file__).resolve().parent.parent
WHEEL = "nvidia-cuda-nvrtc==13.0.88"
CACHE = pathlib.Path(os.environ.get("ACCEL_NVRTC_HOME", pathlib.Path.home() / ".cache" / "accel-nvrtc"))

# (source, options, entry points the Rust side launches)
SOURCES = [
    (
        "src/optim/fused_optim.cu",
        ["--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false"],
        # nonfinite: a trial kernel (ACCELERATE_RS_CUDA_TRIAL=1) until a GPU proves it.
        [f"{op}_{t}" for op in ("adamw", "sgd", "nonfinite") for t in ("f32", "bf16", "f16")],
    ),
    (
        "src/nn/kernels.cu",
        [],
        [
            f"{op}_{t}"
            for op in (
                "norm_fwd",
                "norm_bwd_rows",
                "norm_bwd_cols",
                "norm_bwd_finish",
                "softmax_fwd",
                "softmax_bwd",
                "ce_rows",
                "ce_mean",
                "ce_bwd",
                "gelu_fwd",
                "gelu_bwd",
                "relu_fwd",
                "relu_bwd",
                "silu_fwd",
                "silu_bwd",
                "swiglu_fwd",
                "swiglu_bwd",
                "rope_fwd",
                "rope_tables",
                # Trial kernels (ACCELERATE_RS_CUDA_TRIAL=1) until a GPU proves them.
                "embedding_rows",
                "embedding_grad",
            )
            for t in ("f32", "bf16", "f16")
        ],
    ),
    # Flash attention (src/nn/flash_cuda.rs): launched only with ACCELERATE_RS_NN_CUDA_FLASH=1
    # (proven on an H100, slower than the composed attention at training sizes).
    (
        "src/nn/flash.cu",
        [],
        [f"{op}_{t}" for op in ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkv") for t in ("f32", "bf16", "f16")],
    ),
    # Not launched yet (no GPU has run it): the 4-bit dequantization, compiled here so that it
    # stays valid CUDA until it is wired in.
    (
        "src/quant/dequant4.cu",
        ["--fmad=false"],
        [f"dequant4_{t}" for t in ("f32", "bf16", "f16")],
    ),
]


def nvrtc_lib() -> pathlib.Path:
    if os.environ.get("ACCEL_NVRTC_LIB"):
        return pathlib.Path(os.environ["ACCEL_NVRTC_LIB"])
    lib = CACHE / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as d:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                 "--only-binary=:all:", "-d", d, WHEEL],
                check=True,
            )
            (whl,) = pathlib.Path(d).glob("*.whl")
            with zipfile.ZipFile(whl) as z:
                # Only the library and its builtins (the wheel also has .alt variants).
                wanted = [n for n in z.namelist()
                          if re.search(r"/libnvrtc(-builtins)?\.so\.[0-9.]+$", n)]
                z.extractall(CACHE, members=wanted)
    return lib


def compile_source(nvrtc, path: str, options, arch: str):
    # The sources are compiled with the shared prelude in front, as src/nn/cuda.rs and
    # src/optim/fused_cuda.rs put it there (`concat!`).
    src = (REPO / "src/cuda_prelude.cu").read_bytes() + (REPO / path).read_bytes()
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, path.encode(), 0, None, None)
    if rc != 0:
        return False, f"nvrtcCreateProgram failed: {rc}", ""
    opts = [o.encode() for o in options + [f"--gpu-architecture={arch}"]]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    ptx = ""
    if rc == 0:
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, buf)
        ptx = buf.value.decode()
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace"), ptx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="e.g. compute_90 (repeatable)")
    args = ap.parse_args()
    archs = args.arch or ["compute_80", "compute_90"]
    lib = nvrtc_lib()
    # NVRTC dlopens its builtins by name: load them first (from the same folder) so that it
    # finds them without LD_LIBRARY_PATH.
    for b in sorted(lib.parent.glob("libnvrtc-builtins.so.*")):
        if ".alt." not in b.name:
            ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(str(lib))
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(f"nvrtc_check: NVRTC {major.value}.{minor.value} from {lib}")
    ptxas = shutil.which("ptxas") or next(
        (str(p) for p in [pathlib.Path.home() / ".cache/accel-cuda-13.0/bin/ptxas"] if p.exists()), None)
    if not ptxas:
        print("nvrtc_check: ptxas not found (source ../shared/tools/cuda-toolchain.sh): PTX not assembled")
    failed = 0
    for path, options, entries in SOURCES:
        for arch in archs:
            ok, log, ptx = compile_source(nvrtc, path, options, arch)
            found = set(re.findall(r"\.entry\s+(\w+)", ptx))
            missing = [e for e in entries if e not in found]
            assembled = ""
            if ok and not missing and ptxas:
                # The driver's JIT does what ptxas does: assemble for the real GPU.
                sm = arch.replace("compute_", "sm_")
                with tempfile.TemporaryDirectory() as d:
                    f = pathlib.Path(d) / "k.ptx"
                    f.write_text(ptx)
                    r = subprocess.run([ptxas, f"-arch={sm}", str(f), "-o", str(f) + ".cubin"],
                                       capture_output=True, text=True)
                if r.returncode != 0:
                    ok = False
                    log = r.stderr
                else:
                    assembled = f", assembled by ptxas for {sm}"
            if ok and not missing:
                print(f"ok: {path} for {arch}: {len(found)} kernels{assembled}")
            else:
                failed += 1
                print(f"FAILED: {path} for {arch}")
                if log.strip():
                    print(log)
                if ok and missing:
                    print(f"  missing entry points: {', '.join(missing)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
