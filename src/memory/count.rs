//! The estimates: [`estimate`] (one rank's memory for a plan) and [`estimate_4bit`] (with a
//! 4-bit base).

use super::activations::activations;
use super::adapters::{is_target, linear_module, lora_counts};
use super::estimate::{fit, Estimate};
use super::model::ModelSpec;
use super::plan::{check_plan, compute_bytes, Plan};
use super::stage3::stage3;
use crate::error::{Error, Result};
use crate::settings::MixedPrecision;

/// The memory of one rank training `model` as `plan` says (see [the module](crate::memory)).
pub fn estimate(model: &ModelSpec, plan: &Plan) -> Result<Estimate> {
    check_plan(plan)?;
    let e = compute_bytes(plan.precision);
    let mixed = plan.precision != MixedPrecision::No;
    let n = plan.world_size as u128;
    let params: u128 = model
        .tensors
        .iter()
        .filter(|t| t.is_float())
        .map(|t| t.elem_count() as u128)
        .sum();
    if params == 0 {
        return Err(Error::invalid(
            "model",
            "it has no floating-point tensors to train",
        ));
    }
    // (trainable, frozen, adapter layers, adapter elements per token and block).
    let (trainable, frozen, lora_layers, adapter_tokens) = match &plan.lora {
        None => (params, 0, 0, 0),
        Some(lora) => lora_counts(model, plan, lora, params)?,
    };
    if plan.zero_stage == 3 {
        return stage3(
            model,
            plan,
            (trainable, frozen, lora_layers, adapter_tokens),
        );
    }
    // Trainable parameters live in f32 (masters under mixed precision, with half working
    // copies); a frozen base lives in the compute dtype.
    let parameters = frozen * e + trainable * if mixed { 2 } else { 4 };
    let masters = if mixed { trainable * 4 } else { 0 };
    let f32_grads = trainable * 4;
    let f32_grads = if plan.zero_stage >= 2 {
        f32_grads.div_ceil(n)
    } else {
        f32_grads
    };
    let gradients = f32_grads + if mixed { trainable * 2 } else { 0 };
    let state = trainable * plan.optimizer.state_bytes() as u128;
    let optimizer_state = if plan.zero_stage >= 1 {
        state.div_ceil(n)
    } else {
        state
    };
    let activations = model
        .architecture
        .as_ref()
        .map(|a| activations(a, plan, adapter_tokens, gradients))
        .transpose()?;
    let estimate = Estimate {
        trainable_params: fit(trainable, "the trainable parameters")?,
        frozen_params: fit(frozen, "the frozen parameters")?,
        lora_layers,
        parameters: fit(parameters, "the parameters")?,
        gradients: fit(gradients, "the gradients")?,
        optimizer_state: fit(optimizer_state, "the optimizer state")?,
        masters: fit(masters, "the f32 masters")?,
        activations,
        offloaded: 0,
    };
    // The totals must fit too.
    let states = [
        estimate.parameters,
        estimate.gradients,
        estimate.optimizer_state,
        estimate.masters,
    ]
    .iter()
    .map(|&b| b as u128)
    .sum::<u128>();
    let acts = estimate
        .activations
        .map_or(0, |a| a.kept as u128 + a.backward as u128);
    fit(states + acts, "the whole step")?;
    Ok(estimate)
}

/// [`estimate`] with a 4-bit base (QLoRA: `load_in_4bit`, bitsandbytes' NF4/FP4 with blocks of
/// `blocksize`): the Linear layers of the frozen base (every one but the embeddings and the
/// output layer, as `all-linear` takes them) held in half a byte a weight plus their scales
/// (with `double_quant`, one byte a block, an f32 a 256 blocks and the 1 KiB 8-bit map per layer;
/// without, an f32 a block) instead of the compute dtype, plus the largest such layer
/// dequantized in the compute dtype (the working copy its forward and backward products use);
/// the embeddings, norms, biases and head stay in the compute dtype. Needs [`Plan::lora`] (a
/// 4-bit base is frozen) and a ZeRO stage below 3 (a 4-bit base is not sharded).
pub fn estimate_4bit(
    model: &ModelSpec,
    plan: &Plan,
    blocksize: usize,
    double_quant: bool,
) -> Result<Estimate> {
    if plan.lora.is_none() {
        return Err(Error::invalid(
            "load in 4 bits",
            "a 4-bit base is frozen: train LoRA adapters over it (a LoRA rank)",
        ));
    }
    if plan.zero_stage == 3 {
        return Err(Error::invalid(
            "load in 4 bits",
            "a 4-bit base is not sharded (ZeRO stage 3): use stage 0-2",
        ));
    }
    if blocksize == 0 {
        return Err(Error::invalid("4-bit block size", "must be at least 1"));
    }
    let mut est = estimate(model, plan)?;
    let e = compute_bytes(plan.precision);
    let all = ["all-linear".to_string()];
    let (mut dense, mut packed, mut largest) = (0u128, 0u128, 0u128);
    for t in &model.tensors {
        if linear_module(t).is_some_and(|m| is_target(m, &all)) {
            let n = t.elem_count() as u128;
            let blocks = n.div_ceil(blocksize as u128);
            let scales = if double_quant {
                blocks + blocks.div_ceil(256) * 4 + 256 * 4
            } else {
                blocks * 4
            };
            dense += n * e;
            packed += n.div_ceil(2) + scales;
            largest = largest.max(n * e);
        }
    }
    let parameters = est.parameters as u128 - dense.min(est.parameters as u128) + packed + largest;
    est.parameters = fit(parameters, "the parameters")?;
    Ok(est)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Architecture, Lora, OptimizerKind, TensorInfo};

    /// A Llama of hidden 64, MLP 176, 2 layers, 4 heads (`kv` key/value heads), vocabulary 100,
    /// untied, described as `accelerate-rs-models` describes Llama.
    fn llama(kv: usize) -> ModelSpec {
        let (h, i, v, d) = (64usize, 176usize, 100usize, 16usize);
        let mut parameters = Vec::new();
        let mut add = |name: String, shape: Vec<usize>| {
            parameters.push(TensorInfo {
                name,
                shape,
                dtype: "F32".into(),
            })
        };
        add("model.embed_tokens.weight".into(), vec![v, h]);
        for l in 0..2 {
            let p = format!("model.layers.{l}");
            add(format!("{p}.input_layernorm.weight"), vec![h]);
            add(format!("{p}.self_attn.q_proj.weight"), vec![h, h]);
            add(format!("{p}.self_attn.k_proj.weight"), vec![kv * d, h]);
            add(format!("{p}.self_attn.v_proj.weight"), vec![kv * d, h]);
            add(format!("{p}.self_attn.o_proj.weight"), vec![h, h]);
            add(format!("{p}.post_attention_layernorm.weight"), vec![h]);
            add(format!("{p}.mlp.gate_proj.weight"), vec![i, h]);
            add(format!("{p}.mlp.up_proj.weight"), vec![i, h]);
            add(format!("{p}.mlp.down_proj.weight"), vec![h, i]);
        }
        add("model.norm.weight".into(), vec![h]);
        add("lm_head.weight".into(), vec![v, h]);
        let gqa = if kv < 4 { 2 * h } else { 0 };
        ModelSpec::from_architecture(Architecture {
            name: "llama".into(),
            hidden: h,
            intermediate: i,
            layers: 2,
            heads: 4,
            kv_heads: kv,
            head_dim: d,
            vocab: v,
            max_positions: 2048,
            block_elements: (6 * h + 5 * h + 4 * kv * d + 3 * i + gqa) as u64,
            outer_elements: 2 * h as u64,
            lm_head: true,
            default_lora_targets: vec!["q_proj".into(), "v_proj".into()],
            parameters,
        })
    }

    #[test]
    fn states_follow_precision_zero_and_optimizer() {
        let m = llama(4);
        let p = m.parameter_count();
        // embed + 2 x (2 norms + 4 attention + 3 MLP) + norm + head.
        let want = 100 * 64 + 2 * (2 * 64 + 4 * 64 * 64 + 3 * 64 * 176) + 64 + 100 * 64;
        assert_eq!(p, want);
        let e = |plan: Plan| estimate(&m, &plan).unwrap();
        let f32 = e(Plan::default());
        assert_eq!(
            (
                f32.parameters,
                f32.gradients,
                f32.optimizer_state,
                f32.masters
            ),
            (4 * p, 4 * p, 8 * p, 0)
        );
        let bf16 = e(Plan {
            precision: MixedPrecision::Bf16,
            ..Plan::default()
        });
        assert_eq!(
            (
                bf16.parameters,
                bf16.gradients,
                bf16.optimizer_state,
                bf16.masters
            ),
            (2 * p, 6 * p, 8 * p, 4 * p)
        );
        let z1 = e(Plan {
            zero_stage: 1,
            world_size: 4,
            ..Plan::default()
        });
        assert_eq!(
            (z1.gradients, z1.optimizer_state),
            (4 * p, (8 * p).div_ceil(4))
        );
        let z2 = e(Plan {
            zero_stage: 2,
            world_size: 4,
            precision: MixedPrecision::Fp16,
            ..Plan::default()
        });
        assert_eq!(z2.gradients, (4 * p).div_ceil(4) + 2 * p);
        let sgd = e(Plan {
            optimizer: OptimizerKind::Sgd,
            ..Plan::default()
        });
        assert_eq!(sgd.optimizer_state, 0);
    }

    #[test]
    fn lora_trains_adapters_on_the_targets_only() {
        let m = llama(4);
        let p = m.parameter_count();
        let plan = Plan {
            precision: MixedPrecision::Bf16,
            lora: Some(Lora {
                r: 8,
                targets: vec![],
            }),
            ..Plan::default()
        };
        let e = estimate(&m, &plan).unwrap();
        // q_proj and v_proj in 2 layers: 8 x (64 + 64) each.
        let adapters = 4 * 8 * 128;
        assert_eq!(
            (e.trainable_params, e.frozen_params, e.lora_layers),
            (adapters, p, 4)
        );
        assert_eq!(e.parameters, 2 * p + 2 * adapters);
        assert_eq!(
            (e.gradients, e.optimizer_state, e.masters),
            (6 * adapters, 8 * adapters, 4 * adapters)
        );
        let all = Plan {
            lora: Some(Lora {
                r: 8,
                targets: vec!["all-linear".into()],
            }),
            ..plan.clone()
        };
        assert_eq!(estimate(&m, &all).unwrap().lora_layers, 2 * 7);
        let none = Plan {
            lora: Some(Lora {
                r: 8,
                targets: vec!["c_attn".into()],
            }),
            ..plan
        };
        let err = estimate(&m, &none).unwrap_err().to_string();
        assert!(err.contains("c_attn") && err.contains("q_proj"), "{err}");
    }

    #[test]
    fn activations_grow_with_the_batch_and_shrink_with_checkpointing() {
        let m = llama(2);
        let a = |batch, ckpt| {
            estimate(
                &m,
                &Plan {
                    batch_size: batch,
                    seq_len: 32,
                    checkpointing: ckpt,
                    ..Plan::default()
                },
            )
            .unwrap()
            .activations
            .unwrap()
        };
        let (one, two) = (a(1, false), a(2, false));
        assert_eq!(two.kept, 2 * one.kept);
        // Per token and block: 6h + 5q + 4kv + 3i + 2q (grouped-query), f32; 4 heads x 32 keys.
        let block = (6 * 64 + 5 * 64 + 4 * 32 + 3 * 176 + 2 * 64) * 4 + 4 * 32 * 4;
        assert_eq!(one.kept, 32 * (2 * block + 2 * 64 * 4 + 100 * 4));
        let ck = a(1, true);
        assert!(
            ck.kept < one.kept / 2 && ck.backward > one.backward,
            "{ck:?} {one:?}"
        );
    }

    #[test]
    fn bad_plans_are_refused() {
        let m = llama(4);
        for plan in [
            Plan {
                zero_stage: 4,
                ..Plan::default()
            },
            Plan {
                zero_stage: 2,
                offload_optimizer: true,
                ..Plan::default()
            },
            Plan {
                world_size: 0,
                ..Plan::default()
            },
            Plan {
                batch_size: 0,
                ..Plan::default()
            },
            Plan {
                lora: Some(Lora {
                    r: 0,
                    targets: vec![],
                }),
                ..Plan::default()
            },
        ] {
            assert!(estimate(&m, &plan).is_err(), "{plan:?}");
        }
    }

    #[test]
    fn stage_3_shards_parameters_masters_and_gradients() {
        let m = llama(4);
        let p = m.parameter_count();
        // Two blocks of 2 x 64 + 4 x 64 x 64 + 3 x 64 x 176; the rest (embeddings, norm, head)
        // held for the step.
        let block = 2 * 64 + 4 * 64 * 64 + 3 * 64 * 176;
        let held = p - 2 * block;
        let plan = Plan {
            precision: MixedPrecision::Bf16,
            zero_stage: 3,
            world_size: 4,
            ..Plan::default()
        };
        let e = estimate(&m, &plan).unwrap();
        assert_eq!(e.masters, (4 * p).div_ceil(4));
        assert_eq!(e.optimizer_state, (8 * p).div_ceil(4));
        assert_eq!(e.parameters, (held + 2 * block) * 2);
        assert_eq!(e.gradients, 4 * p / 4 + held.max(block) * 6);
        // Every block recomputed: the checkpointed activations, asked for or not.
        let ckpt = estimate(
            &m,
            &Plan {
                checkpointing: true,
                ..plan.clone()
            },
        )
        .unwrap();
        assert_eq!(e.activations, ckpt.activations);
        // Offload: moments, masters and f32 shard gradients on the host.
        let o = estimate(
            &m,
            &Plan {
                offload_optimizer: true,
                ..plan
            },
        )
        .unwrap();
        assert_eq!(o.offloaded, e.masters + e.optimizer_state + 4 * p / 4);
        assert_eq!((o.optimizer_state, o.masters), (0, 0));
        assert!(o.total() < e.total());
    }
}
