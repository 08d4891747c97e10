//! Frozen-parameter detection: a model built with Candle's fused `candle_nn::LayerNorm` (no
//! backward pass) gives no gradient to anything upstream of it; the first optimizer step warns
//! on the main process (default), fails on every rank (`error`) or stays quiet (`off`), and the
//! same model with a differentiable layer norm passes the check. The report names the op that
//! most likely cut the graph: Candle's RoPE in an attention block (queries and keys frozen, values
//! training), Candle's CPU flash attention (queries, keys and values frozen, the output projection
//! training), or Candle's fused RmsNorm (everything before it frozen).
//!
//! The multi-process tests re-run this test binary as the workers: `frozen::worker_entry` does
//! nothing unless `ACCEL_FROZEN_ROLE` is set.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_rs::collective::Collective;
use accelerate_rs::{Accelerator, Error, MissingGradients};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{layer_norm, linear, loss, LayerNormConfig, Optimizer, VarBuilder, VarMap, SGD};

const ROLE_VAR: &str = "ACCEL_FROZEN_ROLE";

/// `enc` (linear) → `norm` → `head` (linear). With `fused`, `norm` is `candle_nn::LayerNorm`,
/// whose fast path has no backward: `enc.*` and `norm.*` get no gradient. Otherwise the same
/// norm through the differentiable `layer_norm_slow`.
struct Model {
    enc: candle_nn::Linear,
    norm: candle_nn::LayerNorm,
    head: candle_nn::Linear,
    fused: bool,
}

impl Model {
    fn new(varmap: &VarMap, fused: bool) -> candle_core::Result<Model> {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        Ok(Model {
            enc: linear(4, 8, vb.pp("enc"))?,
            norm: layer_norm(8, LayerNormConfig::default(), vb.pp("norm"))?,
            head: linear(8, 1, vb.pp("head"))?,
            fused,
        })
    }

    fn loss(&self) -> candle_core::Result<Tensor> {
        let x = Tensor::arange(0f32, 24.0, &Device::Cpu)?
            .reshape((6, 4))?
            .affine(0.1, -1.0)?;
        let y = x.sum_keepdim(1)?;
        let h = self.enc.forward(&x)?;
        let h = if self.fused {
            self.norm.forward(&h)?
        } else {
            let (w, b) = (self.norm.weight(), self.norm.bias().expect("bias"));
            candle_nn::ops::layer_norm_slow(&h, w, b, 1e-5)?
        };
        loss::mse(&self.head.forward(&h)?, &y)
    }
}

/// Three SGD steps through `acc` (accumulating `n` micro-steps per step when the accelerator
/// says so); the first error, if any.
fn train(acc: &Accelerator, fused: bool) -> accelerate_rs::Result<()> {
    let varmap = VarMap::new();
    let model = Model::new(&varmap, fused)?;
    acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(SGD::new(varmap.all_vars(), 0.01)?);
    for _ in 0..3 * acc.gradient_accumulation_steps() {
        opt.backward_step(&model.loss()?)?;
    }
    Ok(())
}

fn single(mode: Option<MissingGradients>, accumulate: usize) -> Accelerator {
    let mut b = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .gradient_accumulation_steps(accumulate);
    if let Some(m) = mode {
        b = b.missing_gradients(m);
    }
    b.build().unwrap()
}

#[test]
fn error_mode_names_every_parameter_without_a_gradient() {
    for accumulate in [1, 2] {
        let acc = single(Some(MissingGradients::Error), accumulate);
        match train(&acc, true) {
            Err(Error::MissingGradients {
                rank,
                params,
                report,
            }) => {
                assert_eq!(rank, 0);
                assert_eq!(
                    params,
                    ["enc.bias", "enc.weight", "norm.bias", "norm.weight"],
                    "{report}"
                );
                assert!(report.contains("4 of 6 trainable parameters"), "{report}");
                assert!(report.contains("enc.* (2)"), "{report}");
                assert!(report.contains("candle_nn::LayerNorm"), "{report}");
                assert!(report.contains("the normalization layer norm "), "{report}");
                assert!(!report.contains("rotary_emb"), "{report}");
            }
            other => panic!("accumulate {accumulate}: expected MissingGradients, got {other:?}"),
        }
    }
}

#[test]
fn warn_and_off_train_on_and_a_differentiable_model_passes_the_check() {
    for mode in [
        None,
        Some(MissingGradients::Warn),
        Some(MissingGradients::Off),
    ] {
        train(&single(mode, 1), true).unwrap();
    }
    // No parameter is left without a gradient: the strictest setting passes.
    for accumulate in [1, 3] {
        train(&single(Some(MissingGradients::Error), accumulate), false).unwrap();
    }
    assert_eq!(
        single(None, 1).state().missing_gradients(),
        MissingGradients::Warn
    );
}

#[test]
fn a_parameter_with_a_gradient_on_any_rank_is_not_reported() {
    // Three in-process ranks; only rank 1 lets gradients reach `enc` and `norm`. After the
    // average every rank has them, so nobody errs (nor waits for a rank that erred).
    let results = crate::common::in_process_with(
        3,
        |c: Arc<dyn Collective>| {
            Accelerator::builder()
                .collective(c)
                .missing_gradients(MissingGradients::Error)
        },
        |acc| {
            let fused = acc.rank() != 1;
            train(&acc, fused).map_err(|e| e.to_string())
        },
    );
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
}

fn launch(role: &str, extra_env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(crate::common::launcher());
    cmd.args(["launch", "--cpu", "-n", "2"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "frozen::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, role)
        .env_remove("RUST_LOG")
        .env_remove("ACCELERATE_RS_MISSING_GRADIENTS")
        .envs(extra_env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let out = cmd.output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(60));
    let text = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[test]
fn two_processes_warn_once_on_the_main_process_by_default() {
    let (code, text) = launch("fused", &[]);
    assert_eq!(code, Some(0), "{text}");
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("received no gradient"))
        .collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(warnings[0].starts_with("[rank 0]"), "{text}");
    assert!(
        warnings[0].contains("enc.* (2), norm.* (2)"),
        "{}",
        warnings[0]
    );
}

#[test]
fn two_processes_fail_on_every_rank_in_error_mode() {
    let (code, text) = launch("fused", &[("ACCELERATE_RS_MISSING_GRADIENTS", "error")]);
    assert_ne!(code, Some(0), "{text}");
    // Every rank reaches the same verdict (the flags were averaged); the launcher stops the others
    // as soon as the first exits, so only that one is sure to have printed its error.
    assert!(
        text.lines().any(|l| l.starts_with("[rank ")
            && l.contains("worker failed: rank")
            && l.contains("received no gradient")),
        "no rank reported the missing gradients:\n{text}"
    );
    // A bad value of the setting is an error naming the variable, not a silent default.
    let (code, text) = launch("fused", &[("ACCELERATE_RS_MISSING_GRADIENTS", "loud")]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("ACCELERATE_RS_MISSING_GRADIENTS"), "{text}");
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let result = Accelerator::new().and_then(|acc| train(&acc, role == "fused"));
    crate::common::exit_worker(result)
}

/// Which op of [`Attention`] has no backward pass.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cut {
    /// None: `accelerate_rs::nn` throughout.
    Nothing,
    /// `candle_nn::rotary_emb::rope` on the queries and keys.
    CandleRope,
    /// `candle_nn::RmsNorm` as the final norm.
    CandleFinalNorm,
    /// `candle_nn::attention::flash_attn` (Candle's CPU flash attention) for the attention.
    CandleFlashAttention,
}

/// One Llama-style attention block with Hugging Face's parameter names: RMS norm, q/k/v
/// projections, rotary embeddings, softmax attention, output projection, residual, final norm
/// and head; `accelerate_rs::nn` ops except the one `cut` names.
struct Attention {
    norm: accelerate_rs::nn::RmsNorm,
    q: candle_nn::Linear,
    k: candle_nn::Linear,
    v: candle_nn::Linear,
    o: candle_nn::Linear,
    final_norm: Box<dyn Module>,
    head: candle_nn::Linear,
    cut: Cut,
}

impl Attention {
    fn new(varmap: &VarMap, cut: Cut) -> candle_core::Result<Attention> {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        let at = vb.pp("model.layers.0");
        let final_norm: Box<dyn Module> = if cut == Cut::CandleFinalNorm {
            Box::new(candle_nn::rms_norm(8, 1e-5, vb.pp("model.norm"))?)
        } else {
            Box::new(accelerate_rs::nn::rms_norm(8, 1e-5, vb.pp("model.norm"))?)
        };
        Ok(Attention {
            norm: accelerate_rs::nn::rms_norm(8, 1e-5, at.pp("input_layernorm"))?,
            q: candle_nn::linear_no_bias(8, 8, at.pp("self_attn.q_proj"))?,
            k: candle_nn::linear_no_bias(8, 8, at.pp("self_attn.k_proj"))?,
            v: candle_nn::linear_no_bias(8, 8, at.pp("self_attn.v_proj"))?,
            o: candle_nn::linear_no_bias(8, 8, at.pp("self_attn.o_proj"))?,
            final_norm,
            head: candle_nn::linear_no_bias(8, 1, vb.pp("lm_head"))?,
            cut,
        })
    }

    fn loss(&self) -> candle_core::Result<Tensor> {
        let (b, t, heads, d) = (2, 5, 2, 4);
        let x = Tensor::arange(0f32, (b * t * 8) as f32, &Device::Cpu)?
            .reshape((b, t, 8))?
            .affine(0.05, -1.0)?
            .sin()?;
        let angles = Tensor::arange(0f32, (t * d / 2) as f32, &Device::Cpu)?
            .reshape((t, d / 2))?
            .affine(0.3, 0.0)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let h = self.norm.forward(&x)?;
        let split = |l: &candle_nn::Linear| -> candle_core::Result<Tensor> {
            l.forward(&h)?
                .reshape((b, t, heads, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let rope = |x: &Tensor| {
            if self.cut == Cut::CandleRope {
                candle_nn::rotary_emb::rope(x, &cos, &sin)
            } else {
                accelerate_rs::nn::rope(x, &cos, &sin)
            }
        };
        let (q, k, v) = (
            rope(&split(&self.q)?)?,
            rope(&split(&self.k)?)?,
            split(&self.v)?,
        );
        let y = if self.cut == Cut::CandleFlashAttention {
            // [B, T, H, D] in, [B, H, T, D] out.
            let bthd = |x: &Tensor| x.transpose(1, 2)?.contiguous();
            let mask = candle_nn::attention::AttnMask::causal();
            candle_nn::attention::flash_attn::<f32>(
                &bthd(&q)?,
                &bthd(&k)?,
                &bthd(&v)?,
                0.5,
                mask,
                None,
                None,
            )?
        } else {
            let att = accelerate_rs::nn::causal_softmax(&q.matmul(&k.t()?)?, 0.5)?;
            att.matmul(&v)?
        };
        let y = y.transpose(1, 2)?.reshape((b, t, 8))?;
        let h = (x + self.o.forward(&y)?)?;
        let out = self.head.forward(&self.final_norm.forward(&h)?)?;
        loss::mse(&out, &out.ones_like()?)
    }
}

/// Three SGD steps of [`Attention`] under `missing_gradients = error`, one process.
fn train_attention(cut: Cut) -> accelerate_rs::Result<()> {
    let acc = single(Some(MissingGradients::Error), 1);
    let varmap = VarMap::new();
    let model = Attention::new(&varmap, cut)?;
    acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(SGD::new(varmap.all_vars(), 0.01)?);
    for _ in 0..3 {
        opt.backward_step(&model.loss()?)?;
    }
    Ok(())
}

#[test]
fn the_report_names_the_op_that_cut_the_graph() {
    // Every op differentiable: the strictest setting passes.
    train_attention(Cut::Nothing).unwrap();
    // Candle's RoPE: the query and key projections freeze, the values train; the report blames
    // the rotary embeddings and names their replacement, not the norms.
    match train_attention(Cut::CandleRope) {
        Err(Error::MissingGradients { params, report, .. }) => {
            assert_eq!(
                params,
                [
                    "model.layers.0.self_attn.k_proj.weight",
                    "model.layers.0.self_attn.q_proj.weight"
                ],
                "{report}"
            );
            assert!(report.contains("candle_nn::rotary_emb::rope"), "{report}");
            assert!(
                report.contains("accelerate_rs::nn::{rope, rope_i, rope_thd}"),
                "{report}"
            );
            assert!(
                report.contains("model.layers.0.self_attn get no gradient"),
                "{report}"
            );
            assert!(!report.contains("candle_nn::RmsNorm"), "{report}");
        }
        other => panic!("expected MissingGradients, got {other:?}"),
    }
    // Candle's CPU flash attention: queries, keys, values and the norm in front of them freeze,
    // the output projection trains; the report blames the attention, not the norm.
    match train_attention(Cut::CandleFlashAttention) {
        Err(Error::MissingGradients { params, report, .. }) => {
            assert_eq!(
                params,
                [
                    "model.layers.0.input_layernorm.weight",
                    "model.layers.0.self_attn.k_proj.weight",
                    "model.layers.0.self_attn.q_proj.weight",
                    "model.layers.0.self_attn.v_proj.weight"
                ],
                "{report}"
            );
            assert!(
                report.contains("candle_nn::attention::flash_attn"),
                "{report}"
            );
            assert!(
                report.contains("nn::scaled_dot_product_attention"),
                "{report}"
            );
            assert!(!report.contains("candle_nn::RmsNorm"), "{report}");
            assert!(!report.contains("rotary_emb"), "{report}");
        }
        other => panic!("expected MissingGradients, got {other:?}"),
    }
    // Candle's fused RmsNorm last: everything but the head freezes; the report blames the norm.
    match train_attention(Cut::CandleFinalNorm) {
        Err(Error::MissingGradients { params, report, .. }) => {
            assert_eq!(params.len(), 6, "{report}");
            assert!(report.contains("6 of 7 trainable parameters"), "{report}");
            assert!(report.contains("candle_nn::RmsNorm"), "{report}");
            assert!(
                report.contains("accelerate_rs::nn::{rms_norm, layer_norm"),
                "{report}"
            );
            assert!(report.contains("model.norm"), "{report}");
            assert!(!report.contains("rotary_emb"), "{report}");
        }
        other => panic!("expected MissingGradients, got {other:?}"),
    }
}
