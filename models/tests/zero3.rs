//! ZeRO-3 on the Llama of this crate (the tiny `llama` fixture: 2 decoder layers, grouped-query
//! attention, untied head): `from_pretrained_sharded` on N ranks, each reading only its slices,
//! trained K AdamW steps, ends with the parameters of stage 0 on the same N ranks; the same
//! with gradient accumulation, bf16 mixed precision and LoRA adapters (saved whole, loadable).
//! Every decoder family, GPT-2 and both BERT heads (tied and untied output layers) the same on 2
//! ranks. Real processes (the library's self-launch over TCP on loopback) and in-process ranks.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_rs::collective::{Collective, ThreadGroup};
use accelerate_rs::nn::LoraConfig;
use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::{Accelerator, DataLoader, MixedPrecision, Parameters, TensorDataset};
use accelerate_rs_models::{AutoModel, Config, LlamaForCausalLm, Task};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use common::fixture;

const STEPS: usize = 4;
const BATCH: usize = 2;
const SEQ: usize = 8;
const VOCAB: u32 = 64;

/// What a run trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// Every parameter.
    Full,
    /// LoRA adapters on a frozen base.
    Lora,
}

fn cfg() -> ParamsAdamW {
    ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.01,
        ..ParamsAdamW::default()
    }
}

/// Deterministic token ids: `n` sequences of `SEQ`.
fn tokens(n: usize) -> Tensor {
    let v: Vec<u32> = (0..n * SEQ)
        .map(|i| ((i * 37 + i / SEQ * 11) as u32) % VOCAB)
        .collect();
    Tensor::from_vec(v, (n, SEQ), &Device::Cpu).unwrap()
}

/// Rank-4 adapters on the attention's query and value projections (or Phi-3's fused `qkv_proj`,
/// GPT-2's fused `c_attn`, BERT's `query` and `value`: peft's defaults, named because peft has
/// none for the Qwen mixtures of experts).
fn lora() -> LoraConfig {
    let targets = [
        "q_proj", "v_proj", "qkv_proj", "c_attn", "query", "value", "dense",
    ];
    let mut c = LoraConfig::new(4, 8.0).target_modules(targets);
    c.init_seed = Some(7);
    c
}

/// The loss of one batch `ids` `[B, SEQ]` for the model's task: a language model predicts its
/// own tokens (shifted for a causal one; every position labelled for a masked one), a
/// classifier the first token's id modulo its 3 labels. GPT-2 and BERT get a padding mask (the
/// last two tokens of the first row), which their blocks must see at every stage.
fn batch_loss(model: &AutoModel, ids: &Tensor) -> Tensor {
    let labels = match model.task() {
        Task::SequenceClassification => {
            let first: Vec<u32> = ids
                .narrow(1, 0, 1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let v: Vec<u32> = first.iter().map(|t| t % 3).collect();
            Tensor::from_vec(v, first.len(), ids.device()).unwrap()
        }
        _ => ids.clone(),
    };
    let mask = matches!(model.model_type(), "gpt2" | "bert").then(|| {
        let (b, t) = ids.dims2().unwrap();
        let v: Vec<u32> = (0..b * t).map(|i| u32::from(i < t - 2 || i >= t)).collect();
        Tensor::from_vec(v, (b, t), ids.device()).unwrap()
    });
    model
        .loss_with_mask(ids, mask.as_ref(), &labels)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

/// The model of `dir` at the accelerator's stage: its weights, or for a folder holding only a
/// `config.json` fresh ones drawn from seed 5 (the same at every stage and world size).
fn load(acc: &Accelerator, dir: &Path) -> AutoModel {
    let sharded = acc.state().zero_stage() == 3;
    if dir.join("model.safetensors").is_file() {
        return if sharded {
            AutoModel::from_pretrained_sharded(dir, acc, DType::F32).unwrap()
        } else {
            AutoModel::from_pretrained(dir, acc.device(), DType::F32).unwrap()
        };
    }
    let config = Config::from_file(dir.join("config.json")).unwrap();
    if sharded {
        AutoModel::from_config_sharded(&config, acc, DType::F32, 5).unwrap()
    } else {
        AutoModel::from_config_seeded(&config, 5, acc.device(), DType::F32).unwrap()
    }
}

/// `STEPS` optimizer steps at the accelerator's stage; the final trained tensors by name (the
/// whole model, or the adapters) and, for LoRA, the adapter folder written by rank 0.
fn train(
    acc: &Accelerator,
    dir: &Path,
    variant: Variant,
    out: Option<&Path>,
) -> HashMap<String, Tensor> {
    let n = acc.gradient_accumulation_steps();
    accelerate_rs::nn::set_dropout_seed(100 + acc.rank() as u64);
    let data = TensorDataset::new(vec![tokens(acc.world_size() * BATCH * STEPS * n)]).unwrap();
    let loader = DataLoader::new(data, BATCH);
    let sharded = acc.state().zero_stage() == 3;
    let mut model = load(acc, dir);
    model.train(true);
    if variant == Variant::Lora {
        model.add_lora(&lora()).unwrap();
    }
    let compute = acc.state().mixed_precision().compute_dtype();
    macro_rules! steps {
        ($opt:expr, $loader:expr, $model:expr) => {{
            for b in $loader.iter().unwrap() {
                let b = b.unwrap();
                let loss = batch_loss(&$model, &b[0]);
                $opt.backward_step_batch(&loss, &b).unwrap();
            }
        }};
    }
    match (variant, sharded) {
        (Variant::Full, true) => {
            let s = model.sharded_parameters().unwrap().clone();
            let mut opt = acc
                .prepare_sharded_optimizer(&s, AdamW::new(Vec::new(), cfg()).unwrap())
                .unwrap();
            let loader = acc.prepare_data_loader(loader).unwrap();
            steps!(opt, loader, model);
            s.full_parameters().unwrap().into_iter().collect()
        }
        (Variant::Full, false) => {
            let vars = model.varmap().all_vars();
            let opt = AdamW::new(vars, cfg()).unwrap();
            if compute == DType::F32 {
                let (mut opt, loader) = acc.prepare(model.varmap(), opt, loader).unwrap();
                steps!(opt, loader, model);
            } else {
                let (mut opt, loader, work) =
                    acc.prepare_mixed(model.varmap(), opt, loader).unwrap();
                let mut working = model.with_parameters(&work).unwrap();
                working.train(true);
                for b in loader.iter().unwrap() {
                    let b = b.unwrap();
                    let loss = batch_loss(&working, &b[0]);
                    opt.backward_step_batch(&loss, &b).unwrap();
                }
            }
            snapshot(model.varmap())
        }
        (Variant::Lora, _) => {
            let adapters = model.trainable_parameters().clone();
            let opt = AdamW::new(adapters.all_vars(), cfg()).unwrap();
            let (mut opt, loader) = acc.prepare(&adapters, opt, loader).unwrap();
            steps!(opt, loader, model);
            if let (Some(out), true) = (out, acc.is_main_process()) {
                model.save_adapter(out).unwrap();
            }
            snapshot(&adapters)
        }
    }
}

fn snapshot(p: &dyn Parameters) -> HashMap<String, Tensor> {
    p.named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect()
}

fn max_abs_diff(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> f32 {
    assert_eq!(a.len(), b.len(), "different parameters");
    a.iter()
        .map(|(k, t)| {
            let o = b.get(k).unwrap_or_else(|| panic!("`{k}` missing"));
            let d = (t.to_dtype(DType::F32).unwrap() - o.to_dtype(DType::F32).unwrap()).unwrap();
            d.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .fold(0.0, f32::max)
}

/// `world` in-process ranks at `stage` training the model folder `dir`: rank 0's result.
fn in_process_on(
    dir: &Path,
    world: usize,
    stage: usize,
    accumulate: usize,
    mixed: MixedPrecision,
    variant: Variant,
) -> HashMap<String, Tensor> {
    let dir = dir.to_path_buf();
    let handles: Vec<_> = ThreadGroup::new(world, Duration::from_secs(60))
        .unwrap()
        .into_iter()
        .map(|c| {
            let c: Arc<dyn Collective> = Arc::new(c);
            let dir = dir.clone();
            std::thread::spawn(move || {
                let acc = Accelerator::builder()
                    .collective(c)
                    .zero_stage(stage)
                    .gradient_accumulation_steps(accumulate)
                    .mixed_precision(mixed)
                    .build()
                    .unwrap();
                train(&acc, &dir, variant, None)
            })
        })
        .collect();
    let mut out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    out.swap_remove(0)
}

/// [`in_process_on`] the tiny Llama.
fn in_process(
    world: usize,
    stage: usize,
    accumulate: usize,
    mixed: MixedPrecision,
    variant: Variant,
) -> HashMap<String, Tensor> {
    in_process_on(&fixture("llama"), world, stage, accumulate, mixed, variant)
}

/// How far stage 3 may end from stage 0 after `STEPS` AdamW steps (f32). Bit for bit on one
/// rank and, without accumulation, on two (the reduce-scatter adds the same two numbers as the
/// all-reduce); on more ranks the ring adds a chunk's values in another order than the
/// all-reduce's buckets (1e-6). With accumulation stage 3 sums the micro-steps' means where
/// stage 0 takes the mean of their sums; AdamW's `m / (sqrt(v) + 1e-8)` turns the rounding of a
/// gradient that cancels to near zero into a visible update difference (up to 1.6e-5 measured
/// on 4 ranks; 1.2e-7 with `eps = 1e-3`, which does not amplify it), hence 5e-5.
fn tolerance(world: usize, accumulate: usize) -> f32 {
    match (world, accumulate) {
        (1, _) | (2, 1) => 0.0,
        (_, 1) => 1e-6,
        _ => 5e-5,
    }
}

#[test]
fn stage_3_llama_matches_stage_0_in_process() {
    for world in 1..=4 {
        for accumulate in [1, 2] {
            let base = in_process(world, 0, accumulate, MixedPrecision::No, Variant::Full);
            let got = in_process(world, 3, accumulate, MixedPrecision::No, Variant::Full);
            let d = max_abs_diff(&base, &got);
            println!("llama world {world} accumulate {accumulate}: {d:e}");
            assert!(
                d <= tolerance(world, accumulate),
                "world {world} accumulate {accumulate}: {d:e}"
            );
        }
    }
    let base = in_process(2, 0, 1, MixedPrecision::Bf16, Variant::Full);
    let got = in_process(2, 3, 1, MixedPrecision::Bf16, Variant::Full);
    let d = max_abs_diff(&base, &got);
    println!("llama bf16 world 2: {d:e}");
    assert!(d == 0.0, "bf16: {d:e}");
    let base = in_process(3, 0, 1, MixedPrecision::No, Variant::Lora);
    let got = in_process(3, 3, 1, MixedPrecision::No, Variant::Lora);
    let d = max_abs_diff(&base, &got);
    println!("llama LoRA world 3: {d:e}");
    assert!(d <= 1e-6, "LoRA: {d:e}");
}

/// Every decoder family runs sharded through the one generic decoder: on 2 ranks, stage 3
/// ends where stage 0 does, full training and LoRA on a sharded base.
#[test]
fn every_decoder_family_at_stage_3_matches_stage_0() {
    for name in [
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "phi3",
        "llama_tied",
    ] {
        let dir = fixture(name);
        let run = |stage, variant| in_process_on(&dir, 2, stage, 1, MixedPrecision::No, variant);
        let d = max_abs_diff(&run(0, Variant::Full), &run(3, Variant::Full));
        println!("{name} world 2: {d:e}");
        assert!(d <= 1e-6, "{name}: {d:e}");
        let d = max_abs_diff(&run(0, Variant::Lora), &run(3, Variant::Lora));
        println!("{name} LoRA world 2: {d:e}");
        assert!(d <= 1e-6, "{name} LoRA: {d:e}");
    }
}

/// A copy of fixture `name`'s `config.json` alone with the keys `edits` changed, in
/// `tmp/{name}_{suffix}`: trained from fresh weights (see [`load`]).
fn edited(name: &str, tmp: &Path, suffix: &str, edits: &[(&str, serde_json::Value)]) -> PathBuf {
    let text = std::fs::read_to_string(fixture(name).join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (key, value) in edits {
        json[*key] = value.clone();
    }
    let dir = tmp.join(format!("{name}_{suffix}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    dir
}

/// Fixture `name` with `tie_word_embeddings` false: its output layer a parameter of the root
/// unit.
fn untied(name: &str, tmp: &Path) -> PathBuf {
    edited(
        name,
        tmp,
        "untied",
        &[("tie_word_embeddings", false.into())],
    )
}

/// The parameters of the model folder `dir` before any training.
fn initial(dir: &Path) -> HashMap<String, Tensor> {
    let c: Arc<dyn Collective> = Arc::new(
        ThreadGroup::new(1, Duration::from_secs(60))
            .unwrap()
            .remove(0),
    );
    let acc = Accelerator::builder().collective(c).build().unwrap();
    snapshot(load(&acc, dir).varmap())
}

/// GPT-2 and BERT (masked LM and classifier; tied output layers, and untied from fresh weights)
/// run sharded through their own units: on 2 ranks, with a padding mask, stage 3 ends where
/// stage 0 does, full training and LoRA on a sharded base, and under bf16 mixed precision.
#[test]
fn gpt2_and_bert_at_stage_3_match_stage_0() {
    let tmp = tempfile::tempdir().unwrap();
    let mut dirs: Vec<PathBuf> = ["gpt2", "bert_mlm", "bert_cls"].map(fixture).into();
    dirs.push(untied("gpt2", tmp.path()));
    dirs.push(untied("bert_mlm", tmp.path()));
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let run = |stage, variant| in_process_on(&dir, 2, stage, 1, MixedPrecision::No, variant);
        let (base, got) = (run(0, Variant::Full), run(3, Variant::Full));
        let d = max_abs_diff(&base, &got);
        println!("{name} world 2: {d:e}");
        assert!(d <= 1e-6, "{name}: {d:e}");
        // Training moved the parameters (the comparison is not of two untouched models).
        let moved = max_abs_diff(&initial(&dir), &base);
        assert!(moved > 1e-4, "{name}: nothing trained ({moved:e})");
        let d = max_abs_diff(&run(0, Variant::Lora), &run(3, Variant::Lora));
        println!("{name} LoRA world 2: {d:e}");
        assert!(d <= 1e-6, "{name} LoRA: {d:e}");
    }
    for name in ["gpt2", "bert_mlm"] {
        let dir = fixture(name);
        let run = |stage| in_process_on(&dir, 2, stage, 1, MixedPrecision::Bf16, Variant::Full);
        let d = max_abs_diff(&run(0), &run(3));
        println!("{name} bf16 world 2: {d:e}");
        assert!(d <= 1e-6, "{name} bf16: {d:e}");
    }
}

/// The model FLOPs of a step (what the fine-tuning example's throughput line divides by) are
/// the same at stage 3, where no rank holds the parameters whole, as at stage 0.
#[test]
fn flops_per_token_are_the_same_at_stage_3() {
    for name in ["llama", "gpt2"] {
        // One sharded model per accelerator.
        let c: Arc<dyn Collective> = Arc::new(
            ThreadGroup::new(1, Duration::from_secs(60))
                .unwrap()
                .remove(0),
        );
        let acc = Accelerator::builder()
            .collective(c)
            .zero_stage(3)
            .build()
            .unwrap();
        let whole = AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
        let mut sharded =
            AutoModel::from_pretrained_sharded(fixture(name), &acc, DType::F32).unwrap();
        let want = whole.flops_per_token(SEQ);
        assert!(want > 0.0);
        assert_eq!(sharded.flops_per_token(SEQ), want, "{name}");
        sharded.add_lora(&lora()).unwrap();
        let mut whole = whole;
        whole.add_lora(&lora()).unwrap();
        assert_eq!(
            sharded.flops_per_token(SEQ),
            whole.flops_per_token(SEQ),
            "{name} LoRA"
        );
    }
}

const OUT_VAR: &str = "ACCEL_Z3_LLAMA_OUT";
const VARIANT_VAR: &str = "ACCEL_Z3_LLAMA_VARIANT";
/// The fixture the worker trains (default `llama`).
const FIXTURE_VAR: &str = "ACCEL_Z3_FIXTURE";

/// A worker process of the tests below; does nothing in a normal test run. Rank 0 writes the
/// trained tensors (and, for LoRA, the adapter folder) into the folder `OUT_VAR` names.
#[test]
fn zero3_llama_process_entry() {
    let Some(out) = std::env::var_os(OUT_VAR).map(PathBuf::from) else {
        return;
    };
    let variant = match std::env::var(VARIANT_VAR).as_deref() {
        Ok("lora") => Variant::Lora,
        _ => Variant::Full,
    };
    let acc = Accelerator::builder()
        .cpu(true)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let stage = acc.state().zero_stage();
    let adapter = out.join(format!("adapter-{stage}"));
    let name = std::env::var(FIXTURE_VAR).unwrap_or_else(|_| "llama".into());
    let trained = train(&acc, &fixture(&name), variant, Some(&adapter));
    if acc.is_main_process() {
        let name = format!("stage{stage}-world{}.safetensors", acc.world_size());
        candle_core::safetensors::save(&trained, out.join(name)).unwrap();
    }
}

/// The launcher next to this test binary (`cargo test` at the workspace root builds it), if
/// it is there and knows `--zero-stage` (a target folder shared with older builds may hold
/// another one).
fn launcher() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("accelerate-rs");
    let help = std::process::Command::new(&bin)
        .args(["launch", "--help"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&help.stdout)
        .contains("--zero-stage")
        .then_some(bin)
}

/// This test binary's worker on `world` real processes at `stage`: through `accelerate-rs
/// launch --zero-stage` when the launcher is built, else the library's self-launch
/// (`ACCELERATE_RS_NUM_PROCESSES`); bounded in time. Returns rank 0's tensors.
fn processes(world: usize, stage: usize, variant: &str, out: &Path) -> HashMap<String, Tensor> {
    processes_of("llama", world, stage, variant, out)
}

/// [`processes`] training fixture `name`.
fn processes_of(
    name: &str,
    world: usize,
    stage: usize,
    variant: &str,
    out: &Path,
) -> HashMap<String, Tensor> {
    let exe = std::env::current_exe().unwrap();
    let entry = [
        "--exact",
        "zero3_llama_process_entry",
        "--nocapture",
        "--test-threads=1",
    ];
    let mut cmd = match launcher() {
        Some(l) => {
            let mut c = std::process::Command::new(l);
            c.args(["launch", "--cpu", "-n", &world.to_string()])
                .args(["--zero-stage", &stage.to_string()])
                .arg(&exe)
                .args(entry);
            c
        }
        None => {
            let mut c = std::process::Command::new(&exe);
            c.args(entry)
                .env("ACCELERATE_RS_NUM_PROCESSES", world.to_string())
                .env("ACCELERATE_RS_ZERO_STAGE", stage.to_string());
            c
        }
    };
    cmd.env(OUT_VAR, out)
        .env(VARIANT_VAR, variant)
        .env(FIXTURE_VAR, name)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("ACCELERATE_RS_SECRET")
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null());
    let start = Instant::now();
    let o = cmd.output().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(120),
        "{world} processes took too long"
    );
    assert!(
        o.status.success(),
        "stage {stage} on {world} processes:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let path = out.join(format!("stage{stage}-world{world}.safetensors"));
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// Real processes: stage 3 on 1, 2, 3 and 4 processes ends where stage 0 does.
#[test]
fn stage_3_llama_on_1_to_4_processes_matches_stage_0() {
    let dir = tempfile::tempdir().unwrap();
    for world in 1..=4 {
        let base = processes(world, 0, "full", dir.path());
        let got = processes(world, 3, "full", dir.path());
        let d = max_abs_diff(&base, &got);
        println!("llama on {world} processes: {d:e}");
        assert!(d <= tolerance(world, 1), "{world} processes: {d:e}");
    }
}

/// Real processes: GPT-2 and BERT (masked LM) at stage 3 on 2 processes end where stage 0 does,
/// full training and LoRA.
#[test]
fn gpt2_and_bert_on_2_processes_match_stage_0() {
    for name in ["gpt2", "bert_mlm"] {
        for variant in ["full", "lora"] {
            let dir = tempfile::tempdir().unwrap();
            let base = processes_of(name, 2, 0, variant, dir.path());
            let got = processes_of(name, 2, 3, variant, dir.path());
            assert!(!base.is_empty());
            let d = max_abs_diff(&base, &got);
            println!("{name} {variant} on 2 processes: {d:e}");
            assert!(d <= 1e-6, "{name} {variant}: {d:e}");
        }
    }
}

/// Real processes: LoRA over a sharded base on 2 processes trains the adapters of stage 0, and
/// the adapter folder rank 0 writes is whole and loads onto a fresh model (as peft loads it).
#[test]
fn lora_over_a_sharded_base_saves_whole_adapters() {
    let dir = tempfile::tempdir().unwrap();
    let base = processes(2, 0, "lora", dir.path());
    let got = processes(2, 3, "lora", dir.path());
    let d = max_abs_diff(&base, &got);
    assert!(d <= 1e-6, "LoRA adapters: {d:e}");
    let folder = dir.path().join("adapter-3");
    let saved =
        candle_core::safetensors::load(folder.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    assert_eq!(saved.len(), got.len(), "every adapter tensor is saved");
    let mut fresh =
        LlamaForCausalLm::from_pretrained(fixture("llama"), &Device::Cpu, DType::F32).unwrap();
    fresh.load_adapter(&folder).unwrap();
    let loaded = snapshot(fresh.trainable_parameters());
    assert_eq!(max_abs_diff(&loaded, &got), 0.0);
}

/// With dropout on (embeddings, attention probabilities, residual branches), stage 3 draws the
/// masks of stage 0: the blocks recomputed in the backward pass replay their masks, and the
/// stream goes on as if they had not been recomputed. Each rank seeds its stream the same way
/// at both stages.
#[test]
fn gpt2_and_bert_with_dropout_at_stage_3_match_stage_0() {
    let tmp = tempfile::tempdir().unwrap();
    let p = serde_json::Value::from(0.1);
    let gpt2 = ["resid_pdrop", "embd_pdrop", "attn_pdrop"].map(|k| (k, p.clone()));
    let bert = ["hidden_dropout_prob", "attention_probs_dropout_prob"].map(|k| (k, p.clone()));
    for dir in [
        edited("gpt2", tmp.path(), "dropout", &gpt2),
        edited("bert_mlm", tmp.path(), "dropout", &bert),
    ] {
        let run = |stage| in_process_on(&dir, 2, stage, 1, MixedPrecision::No, Variant::Full);
        let d = max_abs_diff(&run(0), &run(3));
        println!("{} world 2: {d:e}", dir.display());
        assert!(d <= 1e-6, "{}: {d:e}", dir.display());
    }
}

/// `save_model_with_config` of a sharded model (fixture `name`, one step trained on 3 ranks)
/// streams one unit at a time through rank 0 into a Hugging Face folder (here cut into shards of
/// at most 2 kB, with their index) that `from_pretrained` loads back to the very parameters the
/// ranks hold; `save_pretrained` says what to call instead. Returns the tensors the folder's
/// index names.
fn sharded_model_saves_a_folder_from_pretrained_loads(name: &'static str) -> Vec<String> {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("saved");
    let handles: Vec<_> = ThreadGroup::new(3, Duration::from_secs(60))
        .unwrap()
        .into_iter()
        .map(|c| {
            let c: Arc<dyn Collective> = Arc::new(c);
            let out = out.clone();
            std::thread::spawn(move || {
                let acc = Accelerator::builder()
                    .collective(c)
                    .zero_stage(3)
                    .build()
                    .unwrap();
                let model = load(&acc, &fixture(name));
                let s = model.sharded_parameters().unwrap().clone();
                let mut opt = acc
                    .prepare_sharded_optimizer(&s, AdamW::new(Vec::new(), cfg()).unwrap())
                    .unwrap();
                opt.backward_step(&batch_loss(&model, &tokens(BATCH)))
                    .unwrap();
                acc.save_model_with_config(&out, &s, &model.config_json(), 2000)
                    .unwrap();
                let e = model
                    .save_pretrained(out.join("x"))
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("save_model_with_config"), "{e}");
                s.full_parameters()
                    .unwrap()
                    .into_iter()
                    .collect::<HashMap<_, _>>()
            })
        })
        .collect();
    let held: Vec<HashMap<String, Tensor>> =
        handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(out.join("model.safetensors.index.json").is_file());
    assert!(out.join("config.json").is_file());
    let loaded = AutoModel::from_pretrained(&out, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(
        max_abs_diff(&snapshot(loaded.varmap()), &held[0]),
        0.0,
        "{name}"
    );
    let before = initial(&fixture(name));
    assert!(
        max_abs_diff(&before, &held[0]) > 0.0,
        "{name}: the step changed nothing"
    );
    let index = std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap();
    let index: serde_json::Value = serde_json::from_str(&index).unwrap();
    let names = index["weight_map"].as_object().unwrap().keys().cloned();
    names.collect()
}

#[test]
fn a_sharded_llama_saves_a_folder_from_pretrained_loads() {
    let names = sharded_model_saves_a_folder_from_pretrained_loads("llama");
    assert!(names.iter().any(|n| n == "lm_head.weight"), "{names:?}");
}

/// GPT-2 (tied output layer: the folder holds no `lm_head.weight`) and BERT's masked LM.
#[test]
fn a_sharded_gpt2_or_bert_saves_a_folder_from_pretrained_loads() {
    let names = sharded_model_saves_a_folder_from_pretrained_loads("gpt2");
    assert!(
        names.iter().any(|n| n == "transformer.wte.weight"),
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n == "lm_head.weight"), "{names:?}");
    let names = sharded_model_saves_a_folder_from_pretrained_loads("bert_mlm");
    assert!(
        names.iter().any(|n| n == "cls.predictions.bias"),
        "{names:?}"
    );
}
