//! LoRA in the estimate: which Linear layers the adapters take, and what they add.

use super::model::{ModelSpec, TensorInfo};
use super::plan::{Lora, Plan};
use crate::error::{Error, Result};
use crate::settings::MixedPrecision;

/// The module name of a weight (`model.layers.0.self_attn.q_proj` of
/// `model.layers.0.self_attn.q_proj.weight`), for a 2-D float weight only.
pub(super) fn linear_module(t: &TensorInfo) -> Option<&str> {
    if t.shape.len() != 2 || !t.is_float() {
        return None;
    }
    t.name.strip_suffix(".weight")
}

/// Whether `module` is a LoRA target: `all-linear` takes every Linear layer but the embeddings
/// and the output layer (as `peft`); a name matches the module's last components.
pub(super) fn is_target(module: &str, targets: &[String]) -> bool {
    targets.iter().any(|t| {
        if t == "all-linear" {
            let last = module.rsplit('.').next().unwrap_or(module);
            !(module.contains("embed")
                || matches!(last, "wte" | "wpe" | "lm_head" | "word_embeddings")
                || module.ends_with("embeddings"))
        } else {
            module == t || module.ends_with(&format!(".{t}"))
        }
    })
}

/// The Linear layers `lora` adapts: the ones it names, else the architecture's defaults.
pub(super) fn lora_targets(model: &ModelSpec, lora: &Lora) -> Result<Vec<String>> {
    if !lora.targets.is_empty() {
        return Ok(lora.targets.clone());
    }
    let arch = model.architecture.as_ref().ok_or_else(|| {
        Error::invalid(
            "lora targets",
            "the architecture is unknown (no config.json read): name the target modules",
        )
    })?;
    if arch.default_lora_targets.is_empty() {
        return Err(Error::invalid(
            "lora targets",
            format!(
                "`{}` has no default LoRA targets (peft has none for it): name the target modules",
                arch.name
            ),
        ));
    }
    Ok(arch.default_lora_targets.clone())
}

/// LoRA's counts for `model` with `params` float elements: (trainable: the adapters' elements,
/// frozen: the base's, adapted Linear layers, adapter elements kept per token and block).
pub(super) fn lora_counts(
    model: &ModelSpec,
    plan: &Plan,
    lora: &Lora,
    params: u128,
) -> Result<(u128, u128, usize, u128)> {
    let targets = lora_targets(model, lora)?;
    let r = lora.r as u128;
    let (mut adapters, mut layers, mut per_token) = (0u128, 0usize, 0u128);
    for t in &model.tensors {
        if let Some(m) = linear_module(t) {
            if is_target(m, &targets) {
                let (a, b) = (t.shape[0] as u128, t.shape[1] as u128);
                adapters += r * (a + b);
                layers += 1;
                // In f32 the base and the update are one fused op (`nn::LoraLinear`,
                // `Lora::forward_with_base`): its output is the only tensor kept, as for
                // a plain Linear. With a half-precision base the adapters (f32) are
                // composed: x·A (r), then B (the output) scaled and added, r + 2·out per
                // token. The output width is the larger dimension for GPT-2's `c_attn`.
                if plan.precision != MixedPrecision::No {
                    per_token += r + 2 * a.max(b);
                }
            }
        }
    }
    if layers == 0 {
        let some: Vec<&str> = model
            .tensors
            .iter()
            .filter_map(linear_module)
            .filter_map(|m| m.rsplit('.').next())
            .fold(Vec::new(), |mut v, m| {
                if !v.contains(&m) {
                    v.push(m);
                }
                v
            });
        return Err(Error::invalid(
            "lora targets",
            format!(
                "{targets:?} match no Linear layer of the model; its Linear layers are named {}",
                some.join(", ")
            ),
        ));
    }
    let per_block = model
        .architecture
        .as_ref()
        .map_or(0, |a| per_token / a.layers as u128);
    Ok((adapters, params, layers, per_block))
}
