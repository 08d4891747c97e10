//! The run-time compiled CUDA kernels (`src/nn/kernels.cu`, `src/nn/flash.cu`,
//! `src/optim/fused_optim.cu`, `src/quant/dequant4.cu`) run on
//! the CPU: `tests/cuda_emulation/emu.hpp` gives them one OS thread per CUDA thread, barriers for
//! `__syncthreads` and the warp shuffles, and software half-precision conversions; the checks
//! compare every kernel with references written from the formulas (and the optimizer kernels bit
//! for bit with the CPU kernels' arithmetic). This tests the kernels' logic — reductions,
//! indexing, masking, rounding — on a machine without a GPU; the device itself is checked by
//! `examples/nn_kernels.rs` and `accelerate-rs test` in `scripts/gpu-smoke.sh`.
//!
//! Needs a C++20 compiler (`$CXX`, default `c++`; g++ 10 or later).

use std::path::Path;
use std::process::Command;

fn build_and_run(source: &str) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("check");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-ffp-contract=off", "-pthread"])
        .arg(Path::new(root).join(source))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler `{cxx}` (set CXX): {e}"));
    assert!(
        built.status.success(),
        "compiling {source} with {cxx} failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{source}:\n{text}");
    text
}

#[test]
fn nn_kernels_match_their_references_on_the_cpu() {
    let text = build_and_run("tests/cuda_emulation/check.cpp");
    assert!(text.contains("cuda_emulation: 0 failure(s)"), "{text}");
    // Every kernel family was exercised.
    for what in [
        "layer_norm",
        "rms_norm",
        "causal_softmax",
        "cross_entropy",
        "gelu backward",
        "relu backward",
        "bf16/f16 conversions",
        "layer_norm forward bf16",
        "layer_norm forward f16",
    ] {
        assert!(text.contains(&format!("PASS {what}")), "{what}:\n{text}");
    }
}

#[test]
fn fused_optimizer_kernels_match_the_cpu_arithmetic_bit_for_bit() {
    let text = build_and_run("tests/cuda_emulation/check_optim.cpp");
    assert!(
        text.contains("cuda_emulation (optim): 0 failure(s)"),
        "{text}"
    );
    assert_eq!(text.matches("bit for bit").count(), 27, "{text}");
}

#[test]
fn dequant4_kernel_matches_the_format_bit_for_bit() {
    let text = build_and_run("tests/cuda_emulation/check_quant.cpp");
    assert!(
        text.contains("cuda_emulation (quant): 0 failure(s)"),
        "{text}"
    );
    assert_eq!(text.matches("bit for bit").count(), 40, "{text}");
}

#[test]
fn flash_attention_kernels_match_their_references_on_the_cpu() {
    let text = build_and_run("tests/cuda_emulation/check_flash.cpp");
    assert!(
        text.contains("cuda_emulation (flash): 0 failure(s)"),
        "{text}"
    );
    // Every mask, both half types, and the NaN row were checked, forward and all gradients.
    for what in [
        "causal [1,2,40,40,16] f32 dk",
        "window 6, GQA 4/2 [1,4,30,30,8] f32 dq",
        "documents 10+1+13 causal, padding [2,2,24,24,8] f32 dv",
        "every key of a row padded [2,1,9,9,8] f32 log-sum-exp",
        "head width 256 [1,1,6,6,256] f32 forward",
        "window 6, GQA 4/2 [1,4,30,30,8] bf16 dv",
        "documents 10+1+13 causal, padding [2,2,24,24,8] f16 dk",
        "NaN query row gives NaN",
    ] {
        assert!(
            text.contains(&format!("PASS flash {what}")),
            "{what}:\n{text}"
        );
    }
    assert_eq!(text.matches("PASS").count(), 51, "{text}");
}
