//! `accelerate-rs estimate-memory` with the real binary, on the header-only Llama-2-7B fixture
//! (`data/llama-2-7b`: config.json, a sharded index and two header-only shards) and on broken
//! inputs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/llama-2-7b")
}

fn estimate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_accelerate-rs"))
        .arg("estimate-memory")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = estimate(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn err(args: &[&str]) -> String {
    let out = estimate(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The row of `precision` and ZeRO `stage`, split into cells.
fn row(report: &str, precision: &str, stage: usize) -> Vec<String> {
    report
        .lines()
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect::<Vec<_>>()
        })
        .find(|c| c.len() >= 10 && c[0] == precision && c[1] == stage.to_string())
        .unwrap_or_else(|| panic!("no row {precision} {stage} in:\n{report}"))
}

#[test]
fn llama_2_7b_from_its_headers() {
    let dir = fixture();
    let r = ok(&[dir.to_str().unwrap(), "--seq-len", "2048"]);
    assert!(
        r.contains("llama (config.json): hidden 4096, intermediate 11008, 32 layers, 32 heads"),
        "{r}"
    );
    assert!(
        r.contains("6,738,415,616 parameters (6.74 B), from the headers of 2 safetensors files (header only: no data section, no weights read)"),
        "{r}"
    );
    assert!(r.contains("batch 1 x 2048 tokens"), "{r}");
    // fp32: 4 + 4 + 8 bytes per parameter; bf16: 2 + 6 + 8 + 4.
    assert_eq!(
        row(&r, "fp32", 0)[2..6],
        ["25.10 GiB", "25.10 GiB", "50.21 GiB", "-"]
    );
    assert_eq!(
        row(&r, "bf16 mixed", 0)[2..6],
        ["12.55 GiB", "37.65 GiB", "50.21 GiB", "25.10 GiB"]
    );
    // Checkpointing lowers the activations and the total.
    let bf16 = row(&r, "bf16 mixed", 0);
    let gib = |s: &str| s.trim_end_matches(" GiB").parse::<f64>().unwrap();
    assert!(gib(&bf16[8]) < gib(&bf16[6]) / 4.0, "{bf16:?}");
    assert!(gib(&bf16[9]) < gib(&bf16[7]), "{bf16:?}");
    assert!(
        r.contains("Not counted:") && r.contains("CUDA context"),
        "{r}"
    );

    // The same model from its config.json alone, and the index alone (no architecture).
    let c = ok(&[
        dir.join("config.json").to_str().unwrap(),
        "--precision",
        "bf16",
    ]);
    assert!(
        c.contains("6,738,415,616 parameters (6.74 B), computed from config.json"),
        "{c}"
    );
    assert_eq!(row(&c, "bf16 mixed", 0)[2..6], bf16[2..6]);
    let i = ok(&[dir.join("model.safetensors.index.json").to_str().unwrap()]);
    assert!(
        i.contains("architecture unknown") && i.contains("6,738,415,616 parameters"),
        "{i}"
    );
    assert_eq!(row(&i, "fp32", 0)[6], "unknown");
}

#[test]
fn zero_stages_and_lora_change_what_each_rank_holds() {
    let dir = fixture();
    let d = dir.to_str().unwrap();
    let r = ok(&[d, "-n", "4", "--precision", "fp32", "--seq-len", "512"]);
    assert!(r.contains("4 processes"), "{r}");
    // Stage 1 shards the AdamW state, stage 2 the gradients too.
    assert_eq!(row(&r, "fp32", 1)[3..5], ["25.10 GiB", "12.55 GiB"]);
    assert_eq!(row(&r, "fp32", 2)[3..5], ["6.28 GiB", "12.55 GiB"]);
    // Stage 3 shards the parameters too: 1/4 of the f32 parameters, plus the embeddings and
    // head (held for the step) and two decoder layers gathered (8.76 GiB); a quarter of the
    // AdamW state; every block recomputed (the checkpointed activations either way).
    let s3 = row(&r, "fp32", 3);
    assert_eq!(s3[2..5], ["8.76 GiB", "8.23 GiB", "12.55 GiB"]);
    assert_eq!(s3[6], s3[8]);
    let o = ok(&[
        d,
        "-n",
        "4",
        "--precision",
        "fp32",
        "--seq-len",
        "512",
        "--zero-stage",
        "3",
        "--offload-optimizer",
    ]);
    let s3o = row(&o, "fp32", 3);
    // On the host: the shard's masters (6.28), moments (12.55) and f32 gradients (6.28).
    assert_eq!(s3o[4], "0.0 MiB");
    assert_eq!(s3o.last().map(String::as_str), Some("25.10 GiB"));
    // LoRA r=8 on q_proj and v_proj: 32 layers x 2 x 8 x (4096 + 4096) adapters.
    let l = ok(&[d, "--lora-r", "8", "--precision", "bf16"]);
    assert!(
        l.contains(
            "LoRA r=8 on 64 Linear layers: 4,194,304 trainable parameters, 6,738,415,616 frozen"
        ),
        "{l}"
    );
    let cells = row(&l, "bf16 mixed", 0);
    assert_eq!(cells[2], "12.56 GiB"); // the bf16 base plus the adapters' working copies
    assert_eq!(cells[4], "32.0 MiB"); // AdamW over 4.2 M adapters
    let all = ok(&[d, "--lora-r", "16", "--lora-targets", "all-linear"]);
    assert!(all.contains("on 224 Linear layers"), "{all}");
}

#[test]
fn bad_models_and_flags_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture();
    let d = dir.to_str().unwrap();
    let e = err(&["/nonexistent/model"]);
    assert!(e.contains("/nonexistent/model"), "{e}");
    let e = err(&[d, "--lora-r", "8", "--lora-targets", "c_attn"]);
    assert!(e.contains("c_attn") && e.contains("q_proj"), "{e}");
    let e = err(&[d, "--world-size", "0"]);
    assert!(e.contains("--world-size"), "{e}");
    let e = err(&[d, "--zero-stage", "4", "-n", "2"]);
    assert!(
        e.contains("zero_stage") && e.contains("0, 1, 2 or 3"),
        "{e}"
    );
    let e = err(&[d, "--zero-stage", "2", "--offload-optimizer", "-n", "2"]);
    assert!(
        e.contains("offload_optimizer") && e.contains("stage 3"),
        "{e}"
    );
    let e = err(&[d, "--precision", "fp8"]);
    assert!(e.contains("fp8"), "{e}");
    // A shard cut short inside its header.
    let shard = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    let cut = tmp.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = err(&[cut.to_str().unwrap()]);
    assert!(
        e.contains("cut.safetensors") && e.contains("truncated"),
        "{e}"
    );
    // A config.json that is not JSON, and one without the sizes.
    let bad = tmp.path().join("config.json");
    std::fs::write(&bad, "{ not json").unwrap();
    let e = err(&[bad.to_str().unwrap()]);
    assert!(
        e.contains("config.json") && e.contains("not valid JSON"),
        "{e}"
    );
    std::fs::write(&bad, r#"{"model_type": "mistral", "hidden_size": 4096}"#).unwrap();
    let e = err(&[bad.to_str().unwrap()]);
    assert!(e.contains("vocab_size") && e.contains("missing"), "{e}");
}

/// The README's "Fine-tune a 7B model on one GPU" shows what the tool prints: every table row
/// there is a row of one of its commands.
#[test]
fn the_readme_shows_what_the_tool_prints() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let section = readme
        .split("## Fine-tune a 7B model on one GPU")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("the README has the section");
    let dir = fixture();
    let d = dir.to_str().unwrap();
    let common = [d, "--precision", "bf16", "--seq-len", "2048"];
    let b13 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/llama-2-13b/config.json");
    let b13 = b13.to_str().unwrap();
    let outputs = [
        ok(&common),
        ok(&[&common[..], &["--lora-r", "16"]].concat()),
        ok(&[&common[..], &["--lora-r", "16", "--load-in-4bit"]].concat()),
        ok(&[&common[..], &["-n", "8", "--zero-stage", "2"]].concat()),
        ok(&[&common[..], &["-n", "8", "--zero-stage", "3"]].concat()),
        ok(&[
            b13,
            "--precision",
            "bf16",
            "--seq-len",
            "2048",
            "-n",
            "8",
            "--zero-stage",
            "2,3",
        ]),
    ]
    .concat();
    let rows: Vec<&str> = section
        .lines()
        .map(str::trim)
        .filter(|l| {
            l.starts_with("| bf16") || l.starts_with("| precision") || l.starts_with("Per rank:")
        })
        .collect();
    assert!(rows.len() >= 5, "{rows:?}");
    for r in rows {
        assert!(
            outputs.lines().any(|l| l.trim() == r),
            "README line not printed by the tool: {r}"
        );
    }
}

/// A Hugging Face Hub id is not read from the network: the error says so and how to fetch the
/// config; a missing local path stays an I/O error naming it.
#[test]
fn a_hub_id_gets_a_way_to_fetch_its_config() {
    let e = err(&["meta-llama/Llama-2-7b-hf"]);
    assert!(
        e.contains("meta-llama/Llama-2-7b-hf")
            && e.contains("Hugging Face Hub id")
            && e.contains(
                "huggingface-cli download meta-llama/Llama-2-7b-hf config.json model.safetensors.index.json --local-dir Llama-2-7b-hf"
            ),
        "{e}"
    );
    for path in [
        "no-such-folder/config.json",
        "./no-such-folder/x",
        "/no/such/folder",
    ] {
        let e = err(&[path]);
        assert!(
            e.contains(path) && !e.contains("Hub") && e.contains("No such file"),
            "{path}: {e}"
        );
    }
}
