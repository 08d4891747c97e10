//! The reports of the first sync step: the frozen-parameter report (which registered parameters
//! received no gradient, grouped by module, and the op that most likely cut them off from the
//! loss) and the same-data warning (every rank computed the same gradients).
//!
//! The cause is a guess from the parameter names. Candle cannot be asked: an op without a backward
//! pass (`apply_op*_no_bwd`) leaves no trace in the graph — its output records no op at all, so
//! walking the loss's graph (which `Tensor::op` keeps crate-private anyway) never meets it. What
//! the names show is the pattern of what trains and what does not:
//!
//! - the query and key projections of an attention block frozen while its value projection
//!   trains: the op between them and the attention scores has no backward — rotary embeddings
//!   (`candle_nn::rotary_emb::rope`, `rope_i`, `rope_thd`) or the softmax of the scores
//!   (`candle_nn::ops::softmax_last_dim`); the values go around both;
//! - all three projections frozen while the block's output projection trains: the attention
//!   itself has no backward (Candle's CPU flash attention, `candle_nn::attention::flash_attn`,
//!   which builds its output from raw data; candle-transformers' Qwen3 takes it on the CPU);
//! - a normalization layer's own weight frozen: the norm is Candle's fused one (or everything
//!   after it is cut, which the same replacement fixes when the cut is a norm further up);
//! - a mixture-of-experts router (`gate`, `router`) frozen: its routing weights leave the graph.

use std::collections::{BTreeMap, BTreeSet};

/// The most groups a report lists before it groups parameters under shorter prefixes.
const MAX_GROUPS: usize = 8;

/// The most modules a cause names before "and N more".
const MAX_NAMED: usize = 2;

/// `names` (dot-separated parameter names) grouped under the longest prefixes that make at most
/// [`MAX_GROUPS`] groups: `(prefix or the name itself, count)`, in name order. A group of one is
/// shown by its full name.
pub(crate) fn group_by_prefix(names: &[String]) -> Vec<(String, usize)> {
    let depth = names
        .iter()
        .map(|n| n.split('.').count().saturating_sub(1))
        .max()
        .unwrap_or(0);
    let group = |d: usize| {
        let mut groups: BTreeMap<String, Vec<&String>> = BTreeMap::new();
        for n in names {
            let parts: Vec<&str> = n.split('.').collect();
            let key = if parts.len() == 1 {
                n.clone()
            } else {
                parts[..d.min(parts.len() - 1)].join(".")
            };
            groups.entry(key).or_default().push(n);
        }
        groups
    };
    let mut d = depth;
    let mut groups = group(d);
    while groups.len() > MAX_GROUPS && d > 0 {
        d -= 1;
        groups = group(d);
    }
    groups
        .into_iter()
        .map(|(prefix, members)| match members.as_slice() {
            [only] => ((*only).clone(), 1),
            _ if prefix.is_empty() => ("*".to_string(), members.len()),
            _ => (format!("{prefix}.*"), members.len()),
        })
        .collect()
}

/// The role of an attention projection, from its module's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Proj {
    Q,
    K,
    V,
}

fn projection(segment: &str) -> Option<Proj> {
    match segment.to_ascii_lowercase().as_str() {
        "q_proj" | "wq" | "query" | "q" | "to_q" | "q_lin" => Some(Proj::Q),
        "k_proj" | "wk" | "key" | "k" | "to_k" | "k_lin" => Some(Proj::K),
        "v_proj" | "wv" | "value" | "v" | "to_v" | "v_lin" => Some(Proj::V),
        _ => None,
    }
}

/// Whether a module name is a normalization layer's (`norm`, `input_layernorm`, `ln_f`, `ln1`,
/// `LayerNorm`, ...).
fn is_norm(segment: &str) -> bool {
    let s = segment.to_ascii_lowercase();
    s.contains("norm")
        || s == "ln"
        || s.starts_with("ln_")
        || (s.len() > 2 && s.starts_with("ln") && s[2..].bytes().all(|b| b.is_ascii_digit()))
}

/// Whether a norm module sits on the query or key path (`q_norm`, `k_layernorm`, ...): frozen
/// with the projections when the cut is above it.
fn is_qk_norm(segment: &str) -> bool {
    let s = segment.to_ascii_lowercase();
    ["q_", "k_", "query", "key"]
        .iter()
        .any(|p| s.starts_with(p))
}

/// The module segments of a parameter name: all but the last (the parameter itself), or the
/// whole name when it has no module.
fn modules(name: &str) -> Vec<&str> {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.len() {
        1 => parts,
        n => parts[..n - 1].to_vec(),
    }
}

/// What most likely cut the graph, from the names: each kind with the modules it explains.
#[derive(Debug, Default, PartialEq, Eq)]
struct Causes {
    /// Attention blocks whose query and key projections get nothing while the values train.
    attention: Vec<String>,
    /// Attention blocks whose query, key and value projections get nothing while another
    /// parameter of the block (the output projection) trains.
    kernels: Vec<String>,
    /// Normalization layers whose own parameters get nothing.
    norms: Vec<String>,
    /// Mixture-of-experts routers that get nothing.
    routers: Vec<String>,
}

impl Causes {
    fn is_empty(&self) -> bool {
        self.attention.is_empty()
            && self.kernels.is_empty()
            && self.norms.is_empty()
            && self.routers.is_empty()
    }
}

/// The likely causes of the `missing` gradients among `all` parameters: attention cut at the
/// queries and keys, a fused attention kernel, norms, routers.
fn guess(missing: &[String], all: &[String]) -> Causes {
    let frozen: BTreeSet<&str> = missing.iter().map(String::as_str).collect();
    let blocks = projection_counts(all, &frozen);
    let attention: Vec<String> = blocks
        .iter()
        .filter(|(_, roles)| qk_frozen(roles) && roles.get(&Proj::V).is_some_and(|&(_, t)| t > 0))
        .map(|(block, _)| block.clone())
        .collect();
    let kernels = kernel_cuts(&blocks, all, &frozen);
    let (norms, routers) = norms_and_routers(missing, &attention, &kernels);
    Causes {
        attention,
        kernels,
        norms,
        routers,
    }
}

/// Per attention block (the module holding the projections): per role, (frozen, training).
type ProjectionCounts = BTreeMap<String, BTreeMap<Proj, (usize, usize)>>;

/// How many parameters of each projection role of each attention block are frozen and training.
fn projection_counts(all: &[String], frozen: &BTreeSet<&str>) -> ProjectionCounts {
    let mut blocks: ProjectionCounts = BTreeMap::new();
    for name in all {
        let segs = modules(name);
        if let Some((i, role)) = segs
            .iter()
            .enumerate()
            .find_map(|(i, s)| projection(s).map(|r| (i, r)))
        {
            let counts = blocks
                .entry(segs[..i].join("."))
                .or_default()
                .entry(role)
                .or_default();
            if frozen.contains(name.as_str()) {
                counts.0 += 1;
            } else {
                counts.1 += 1;
            }
        }
    }
    blocks
}

/// Whether a role's parameters are all frozen (and there are some).
fn only_frozen(r: Option<&(usize, usize)>) -> bool {
    r.is_some_and(|&(f, t)| f > 0 && t == 0)
}

/// Whether a block's queries and keys are all frozen.
fn qk_frozen(roles: &BTreeMap<Proj, (usize, usize)>) -> bool {
    only_frozen(roles.get(&Proj::Q)) && only_frozen(roles.get(&Proj::K))
}

/// Blocks whose whole attention (queries, keys, values) is frozen while something else in the
/// block trains: a fused attention kernel without a backward pass.
fn kernel_cuts(blocks: &ProjectionCounts, all: &[String], frozen: &BTreeSet<&str>) -> Vec<String> {
    blocks
        .iter()
        .filter(|(block, roles)| {
            let (prefix, depth) = if block.is_empty() {
                (String::new(), 0)
            } else {
                (format!("{block}."), block.split('.').count())
            };
            qk_frozen(roles)
                && only_frozen(roles.get(&Proj::V))
                && all.iter().any(|n| {
                    n.starts_with(&prefix)
                        && !frozen.contains(n.as_str())
                        && modules(n).get(depth).and_then(|s| projection(s)).is_none()
                })
        })
        .map(|(block, _)| block.clone())
        .collect()
}

/// The norms that are causes of their own (not explained by an attention cut) and the routers
/// among the `missing` parameters' modules.
fn norms_and_routers(
    missing: &[String],
    attention: &[String],
    kernels: &[String],
) -> (Vec<String>, Vec<String>) {
    // The parent module of an attention block whose whole attention is cut (a decoder layer):
    // its norms in front of the attention are cut off with it.
    let parent_of = |m: &str| {
        m.rsplit_once('.')
            .map_or(String::new(), |(p, _)| p.to_string())
    };
    let kernel_parents: BTreeSet<String> = kernels.iter().map(|k| parent_of(k)).collect();
    let mut norms = BTreeSet::new();
    let mut routers = BTreeSet::new();
    for name in missing {
        let segs = modules(name);
        for (i, s) in segs.iter().enumerate() {
            let module = segs[..=i].join(".");
            let parent = segs[..i].join(".");
            if is_norm(s) {
                // A norm explained by an attention cut (a q/k norm of a block whose queries and
                // keys are cut, any norm inside or beside a block whose attention is cut) is not
                // a cause of its own.
                let explained = (is_qk_norm(s) && attention.contains(&parent))
                    || kernels.contains(&parent)
                    || kernel_parents.contains(&parent);
                if !explained {
                    norms.insert(module);
                }
                break;
            }
            let lower = s.to_ascii_lowercase();
            if lower == "gate" || lower == "router" {
                routers.insert(module);
                break;
            }
        }
    }
    (norms.into_iter().collect(), routers.into_iter().collect())
}

/// `a, b (and 3 more)`.
fn some_of(modules: &[String]) -> String {
    let shown: Vec<&str> = modules
        .iter()
        .take(MAX_NAMED)
        .map(|m| if m.is_empty() { "(top level)" } else { m })
        .collect();
    let mut s = shown.join(", ");
    if modules.len() > MAX_NAMED {
        s.push_str(&format!(" (and {} more)", modules.len() - MAX_NAMED));
    }
    s
}

/// The warning (or error text) for `missing`, the parameters of `all` that received no
/// gradient.
pub(crate) fn report(missing: &[String], all: &[String]) -> String {
    let groups: Vec<String> = group_by_prefix(missing)
        .into_iter()
        .map(|(g, n)| if n == 1 { g } else { format!("{g} ({n})") })
        .collect();
    let causes = guess(missing, all);
    let mut why = Vec::new();
    if !causes.attention.is_empty() {
        why.push(format!(
            "the query and key projections of {} get no gradient while the value projection \
             does, so the op between them and the attention scores has no backward pass: most \
             likely `candle_nn::rotary_emb::rope` / `rope_i` / `rope_thd` (use \
             `accelerate_rs::nn::{{rope, rope_i, rope_thd}}`, same signatures), else \
             `candle_nn::ops::softmax_last_dim` on the scores (use \
             `accelerate_rs::nn::softmax_last_dim` or `accelerate_rs::nn::causal_softmax`)",
            some_of(&causes.attention)
        ));
    }
    if !causes.kernels.is_empty() {
        why.push(format!(
            "the query, key and value projections of {} get no gradient while the rest of the \
             block does, so the attention itself has no backward pass: most likely \
             `candle_nn::attention::flash_attn` (Candle's CPU flash attention, which \
             candle-transformers' Qwen3 takes on the CPU; use \
             `accelerate_rs::nn::scaled_dot_product_attention`); the norm in front of it gets no \
             gradient either",
            some_of(&causes.kernels)
        ));
    }
    if !causes.norms.is_empty() {
        why.push(format!(
            "the normalization layer {} gets no gradient, nor does anything before it: \
             `candle_nn::RmsNorm` / `rms_norm`, `candle_nn::LayerNorm` / `layer_norm` (its fused \
             path) and `candle_nn::ops::{{rms_norm, layer_norm}}` have no backward pass (use \
             `accelerate_rs::nn::{{rms_norm, layer_norm, RmsNorm, LayerNorm}}`, same \
             signatures); if that norm is differentiable, an op after it is not, e.g. \
             `candle_nn::ops::softmax_last_dim` (use `accelerate_rs::nn::softmax_last_dim`)",
            some_of(&causes.norms)
        ));
    }
    if !causes.routers.is_empty() {
        why.push(format!(
            "the router {} gets no gradient: its routing weights leave the graph, through \
             `candle_nn::ops::softmax_last_dim` (use `accelerate_rs::nn::softmax_last_dim`) or a \
             top-k computed on the host (`to_vec2`, as candle-transformers' Mixtral and Qwen2-MoE \
             do), which no op swap fixes",
            some_of(&causes.routers)
        ));
    }
    let cause = if causes.is_empty() {
        "Likely cause: a Candle op without a backward pass between them and the loss (the \
         parameter names do not say which): `candle_nn::LayerNorm` / `layer_norm` (its fused \
         path), `candle_nn::RmsNorm` / `rms_norm`, `candle_nn::ops::softmax_last_dim` and \
         `candle_nn::rotary_emb::{rope, rope_i, rope_thd}` cut the graph (candle issues #2168, \
         #3011); `accelerate_rs::nn::{layer_norm, rms_norm, softmax_last_dim, rope, rope_i, \
         rope_thd}` have the same signatures and a backward pass"
            .to_string()
    } else {
        format!(
            "Likely cause (a guess from the parameter names: an op without a backward pass \
             leaves no trace in Candle's graph): {}",
            why.join("; and ")
        )
    };
    format!(
        "{} of {} trainable parameters received no gradient at the first optimizer step, on any \
         rank, and will never be updated: {}. {cause}. If they are frozen on purpose, leave them \
         out of `prepare`, or set `missing_gradients` to `off` \
         (ACCELERATE_RS_MISSING_GRADIENTS=off); `error` makes this an error",
        missing.len(),
        all.len(),
        groups.join(", ")
    )
}

/// The warning of the same-data check (`GradSync::check_same_data`): every rank computed the
/// same gradients at the first step, so the ranks train on the same batches.
pub(crate) fn same_data_report(world: usize) -> String {
    format!(
        "all {world} ranks (0 to {}) computed the same gradients at the first step: they are \
         training on the same batches, so {world} processes do the work of one. Give each rank \
         its own share of the data: pass the DataLoader through `accelerator.prepare` (or \
         `prepare_data_loader` / `prepare_streaming_loader`), or take this rank's rows with \
         `accelerator.shard_rows(&x)` (indices: `shard_range`). If the ranks are meant to see \
         the same data, ignore this warning (it is printed once)",
        world - 1
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn groups_under_the_longest_prefixes_that_fit() {
        // Few names: grouped by module, a lone parameter by its full name.
        let g = group_by_prefix(&names(&["enc.bias", "enc.weight", "norm.weight"]));
        assert_eq!(
            g,
            [("enc.*".to_string(), 2), ("norm.weight".to_string(), 1)]
        );
        // 4 layers x 3 modules x 2 = 24 parameters: 12 module groups are too many, 4 layers fit.
        let mut many = Vec::new();
        for l in 0..4 {
            for m in ["attn", "ffn", "norm"] {
                for p in ["weight", "bias"] {
                    many.push(format!("layers.{l}.{m}.{p}"));
                }
            }
        }
        let g = group_by_prefix(&many);
        assert_eq!(g.len(), 4, "{g:?}");
        assert_eq!(g[0], ("layers.0.*".to_string(), 6));
        // Top-level names without a common module.
        let g = group_by_prefix(&names(&["a", "b"]));
        assert_eq!(g, [("a".to_string(), 1), ("b".to_string(), 1)]);
        let nine: Vec<String> = (0..9).map(|i| format!("m{i}.w")).collect();
        assert_eq!(group_by_prefix(&nine), [("*".to_string(), 9)]);
        assert!(group_by_prefix(&[]).is_empty());
    }

    /// The parameter names of a Llama-style model with `layers` layers (Hugging Face's names).
    fn llama(layers: usize, qk_norm: bool) -> Vec<String> {
        let mut v = names(&[
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
        ]);
        for l in 0..layers {
            let p = format!("model.layers.{l}");
            for m in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                v.push(format!("{p}.self_attn.{m}.weight"));
            }
            if qk_norm {
                v.push(format!("{p}.self_attn.q_norm.weight"));
                v.push(format!("{p}.self_attn.k_norm.weight"));
            }
            for m in ["gate_proj", "up_proj", "down_proj"] {
                v.push(format!("{p}.mlp.{m}.weight"));
            }
            v.push(format!("{p}.input_layernorm.weight"));
            v.push(format!("{p}.post_attention_layernorm.weight"));
        }
        v.sort();
        v
    }

    #[test]
    fn frozen_queries_and_keys_point_to_rope_not_the_norms() {
        for qk_norm in [false, true] {
            let all = llama(3, qk_norm);
            let missing: Vec<String> = all
                .iter()
                .filter(|n| {
                    ["q_proj", "k_proj", "q_norm", "k_norm"]
                        .iter()
                        .any(|m| n.contains(m))
                })
                .cloned()
                .collect();
            let c = guess(&missing, &all);
            assert_eq!(
                c.attention,
                [
                    "model.layers.0.self_attn",
                    "model.layers.1.self_attn",
                    "model.layers.2.self_attn"
                ]
            );
            assert!(c.norms.is_empty() && c.routers.is_empty(), "{c:?}");
            let r = report(&missing, &all);
            assert!(r.contains("candle_nn::rotary_emb::rope"), "{r}");
            assert!(
                r.contains("accelerate_rs::nn::{rope, rope_i, rope_thd}"),
                "{r}"
            );
            assert!(
                r.contains("model.layers.0.self_attn, model.layers.1.self_attn (and 1 more)"),
                "{r}"
            );
            assert!(!r.contains("RmsNorm"), "{r}");
            assert!(r.contains("a guess from the parameter names"), "{r}");
        }
        // Values frozen too: not the attention's scores.
        let all = llama(1, false);
        let missing: Vec<String> = all
            .iter()
            .filter(|n| n.contains("_proj") && !n.contains("o_proj") && !n.contains("mlp"))
            .cloned()
            .collect();
        assert!(guess(&missing, &all).attention.is_empty());
    }

    #[test]
    fn a_whole_attention_cut_points_to_the_attention_kernel() {
        // Qwen3 with differentiable norms and RoPE, on the CPU: q, k, v and the norms in front
        // of the attention get nothing, the output projection trains.
        let all = llama(2, true);
        let missing: Vec<String> = all
            .iter()
            .filter(|n| {
                [
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "q_norm",
                    "k_norm",
                    "input_layernorm",
                ]
                .iter()
                .any(|m| n.contains(m))
            })
            .cloned()
            .collect();
        let c = guess(&missing, &all);
        assert_eq!(
            c.kernels,
            ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        );
        assert!(c.attention.is_empty() && c.norms.is_empty(), "{c:?}");
        let r = report(&missing, &all);
        assert!(r.contains("candle_nn::attention::flash_attn"), "{r}");
        assert!(
            r.contains("accelerate_rs::nn::scaled_dot_product_attention"),
            "{r}"
        );
        assert!(!r.contains("RmsNorm") && !r.contains("rotary_emb"), "{r}");
        // The whole block frozen (output projection too): not the attention's doing.
        let missing: Vec<String> = all
            .iter()
            .filter(|n| n.contains("self_attn"))
            .cloned()
            .collect();
        assert!(guess(&missing, &all).kernels.is_empty());
    }

    #[test]
    fn everything_below_the_last_norm_points_to_the_norms() {
        let all = llama(2, false);
        let missing: Vec<String> = all
            .iter()
            .filter(|n| *n != "lm_head.weight")
            .cloned()
            .collect();
        let c = guess(&missing, &all);
        assert!(c.attention.is_empty(), "{c:?}");
        assert_eq!(c.norms.len(), 5, "{c:?}");
        assert!(c.norms.contains(&"model.norm".to_string()));
        let r = report(&missing, &all);
        assert!(
            r.starts_with(&format!("{} of {} trainable", all.len() - 1, all.len())),
            "{r}"
        );
        assert!(
            r.contains("candle_nn::RmsNorm")
                && r.contains("accelerate_rs::nn::{rms_norm, layer_norm, RmsNorm, LayerNorm}"),
            "{r}"
        );
        assert!(!r.contains("rotary_emb"), "{r}");
        // GPT-2's and BERT's names.
        for (name, module) in [
            ("transformer.ln_f.weight", "transformer.ln_f"),
            ("h.0.ln_1.bias", "h.0.ln_1"),
            (
                "bert.embeddings.LayerNorm.weight",
                "bert.embeddings.LayerNorm",
            ),
            ("blocks.0.ln2.weight", "blocks.0.ln2"),
        ] {
            let c = guess(&names(&[name]), &names(&[name, "head.weight"]));
            assert_eq!(c.norms, [module], "{name}");
        }
        // A linear layer named like none of these: the generic list.
        let r = report(
            &names(&["enc.bias", "enc.weight"]),
            &names(&["enc.bias", "enc.weight", "head.weight"]),
        );
        assert!(r.starts_with("2 of 3 trainable parameters"), "{r}");
        assert!(r.contains("enc.* (2)"), "{r}");
        assert!(
            r.contains("do not say which")
                && r.contains("softmax_last_dim")
                && r.contains("rope_thd"),
            "{r}"
        );
        assert!(r.contains("ACCELERATE_RS_MISSING_GRADIENTS=off"), "{r}");
    }

    #[test]
    fn a_frozen_router_points_to_its_routing_weights() {
        let all = names(&[
            "layers.0.moe.gate.weight",
            "layers.0.moe.experts.0.w1.weight",
            "layers.0.moe.experts.1.w1.weight",
        ]);
        let c = guess(&names(&["layers.0.moe.gate.weight"]), &all);
        assert_eq!(c.routers, ["layers.0.moe.gate"]);
        // A gate projection of an MLP is not a router.
        let c = guess(
            &names(&["mlp.gate_proj.weight"]),
            &names(&["mlp.gate_proj.weight"]),
        );
        assert!(c.is_empty(), "{c:?}");
    }
}
