//! A sparse mixture of experts (Mixtral's `block_sparse_moe`, the Qwen MoEs' `mlp`) whose router
//! trains: the top-k routing weights are computed in the graph (softmax, top-k by a sort whose
//! indices alone leave it, `gather` of the probabilities, renormalized), so the router's gradient
//! flows through the weights each token gives its experts, and through the load-balancing loss
//! ([`load_balancing_loss`], `transformers`' `load_balancing_loss_func`). The experts run grouped:
//! the tokens are gathered by expert once (`index_select`), each expert multiplies its tokens in
//! one product, and the weighted outputs are scattered back once (`index_add`); no loop over
//! tokens.

use accelerate_rs::nn::softmax_last_dim;
use candle_core::{DType, Result, Tensor};
use candle_nn::VarBuilder;

use crate::arch::Proj;
use crate::config::Activation;
use crate::decoder::{GatedMlp, MlpNames};

/// How a mixture of experts routes and what it holds besides its experts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MoeShape {
    pub(crate) hidden: usize,
    /// Each expert's inner width.
    pub(crate) inner: usize,
    pub(crate) experts: usize,
    pub(crate) top_k: usize,
    /// The top-k weights divided by their sum (Mixtral; Qwen's `norm_topk_prob`).
    pub(crate) normalize: bool,
    /// Qwen2-MoE's shared expert (`shared_expert`, gated by `sigmoid(shared_expert_gate(x))`):
    /// its inner width.
    pub(crate) shared: Option<usize>,
    pub(crate) act: Activation,
}

/// The sparse block: the router (`gate`), the experts (`experts.{e}`), and the shared expert.
#[derive(Debug, Clone)]
pub(crate) struct SparseMoe {
    router: Proj,
    experts: Vec<GatedMlp>,
    shared: Option<(GatedMlp, Proj)>,
    shape: MoeShape,
}

/// Where each routed copy of a token goes: the token of each copy, grouped by expert, and how
/// many copies each expert takes.
struct Routing {
    /// `[N·k]` token index of each copy, in the experts' order.
    tokens: Tensor,
    /// `[N·k]` index into the flattened `[N, k]` weights of each copy.
    slots: Tensor,
    counts: Vec<usize>,
}

impl SparseMoe {
    /// The block under `vb`, the experts' projections named by `names`.
    pub(crate) fn new(shape: MoeShape, names: MlpNames, std: f64, vb: VarBuilder) -> Result<Self> {
        let (h, e) = (shape.hidden, shape.experts);
        let router = Proj::linear(h, e, false, std, vb.pp("gate"))?;
        let experts = (0..e)
            .map(|i| {
                GatedMlp::new(
                    (h, shape.inner),
                    false,
                    shape.act,
                    names,
                    std,
                    vb.pp(format!("experts.{i}")),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = match shape.shared {
            Some(inner) => Some((
                GatedMlp::new(
                    (h, inner),
                    false,
                    shape.act,
                    MlpNames::LLAMA,
                    std,
                    vb.pp("shared_expert"),
                )?,
                Proj::linear(h, 1, false, std, vb.pp("shared_expert_gate"))?,
            )),
            None => None,
        };
        Ok(SparseMoe {
            router,
            experts,
            shared,
            shape,
        })
    }

    pub(crate) fn experts(&self) -> usize {
        self.shape.experts
    }

    /// The top-k experts of each row of the router's probabilities `[N, E]` (f32): `[N, k]`.
    fn top_k(&self, probs: &Tensor) -> Result<Tensor> {
        probs
            .arg_sort_last_dim(false)?
            .narrow(1, 0, self.shape.top_k)?
            .contiguous()
    }

    /// The copies of the tokens each expert takes, from the top-k indices `[N, k]`.
    fn route(&self, top: &Tensor) -> Result<Routing> {
        let k = self.shape.top_k;
        let chosen = top.flatten_all()?.to_vec1::<u32>()?;
        let mut counts = vec![0usize; self.shape.experts];
        for &e in &chosen {
            if let Some(c) = counts.get_mut(e as usize) {
                *c += 1;
            }
        }
        let mut order: Vec<u32> = (0..chosen.len() as u32).collect();
        order.sort_by_key(|&p| chosen[p as usize]);
        let tokens: Vec<u32> = order.iter().map(|&p| p / k as u32).collect();
        let device = top.device();
        Ok(Routing {
            tokens: Tensor::from_vec(tokens, order.len(), device)?,
            slots: Tensor::from_vec(order.clone(), order.len(), device)?,
            counts,
        })
    }

    /// `[B, T, H]` out, and the router's logits `[B·T, E]` (for the load-balancing loss).
    pub(crate) fn forward(&self, x: &Tensor, train: bool) -> Result<(Tensor, Tensor)> {
        let (b, t, h) = x.dims3()?;
        let xs = x.reshape((b * t, h))?;
        let logits = self.router.forward(&xs, train)?;
        let probs = softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        let top = self.top_k(&probs)?;
        let mut weights = probs.gather(&top, 1)?;
        if self.shape.normalize {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let weights = weights.to_dtype(x.dtype())?.flatten_all()?;
        let routing = self.route(&top)?;
        let copies = xs.index_select(&routing.tokens, 0)?;
        let mut outputs = Vec::new();
        let mut unused = Vec::new();
        let mut start = 0;
        for (expert, &n) in self.experts.iter().zip(&routing.counts) {
            if n == 0 {
                unused.push(expert);
                continue;
            }
            outputs.push(expert.forward(&copies.narrow(0, start, n)?, train)?);
            start += n;
        }
        let routed = Tensor::cat(&outputs, 0)?
            .broadcast_mul(&weights.index_select(&routing.slots, 0)?.unsqueeze(1)?)?;
        let mut out = xs.zeros_like()?.index_add(&routing.tokens, &routed, 0)?;
        // An expert no token chose still gets a gradient (zeros), as on the other ranks.
        for expert in unused {
            out = out.broadcast_add(&expert.zero_contribution()?)?;
        }
        if let Some((mlp, gate)) = &self.shared {
            let g = gate.forward(&xs, train)?;
            let sigmoid = (g.neg()?.exp()? + 1.0)?.recip()?;
            out = (out + mlp.forward(&xs, train)?.broadcast_mul(&sigmoid)?)?;
        }
        Ok((out.reshape((b, t, h))?, logits))
    }

    /// The tokens each expert takes for `x` `[B, T, H]` (the top-k choices counted, the
    /// attention mask's padding left out when given).
    pub(crate) fn load(&self, x: &Tensor, mask: Option<&[f32]>) -> Result<Vec<usize>> {
        let (b, t, h) = x.dims3()?;
        let logits = self.router.forward(&x.reshape((b * t, h))?, false)?;
        let top = self.top_k(&softmax_last_dim(&logits.to_dtype(DType::F32)?)?)?;
        let chosen = top.to_vec2::<u32>()?;
        let mut counts = vec![0usize; self.shape.experts];
        for (row, experts) in chosen.iter().enumerate() {
            if mask.is_some_and(|m| m.get(row).is_some_and(|&v| v == 0.0)) {
                continue;
            }
            for &e in experts {
                if let Some(c) = counts.get_mut(e as usize) {
                    *c += 1;
                }
            }
        }
        Ok(counts)
    }

    pub(crate) fn projections_mut(&mut self) -> Vec<&mut Proj> {
        let mut out = vec![&mut self.router];
        for e in &mut self.experts {
            out.extend(e.projections_mut());
        }
        if let Some((mlp, gate)) = self.shared.as_mut() {
            out.extend(mlp.projections_mut());
            out.push(gate);
        }
        out
    }
}

/// `transformers`' load-balancing loss (Switch Transformer's, as `load_balancing_loss_func`
/// computes it) over every sparse layer's router logits `[N, E]`: `E · Σₑ fₑ · Pₑ`, with `fₑ` the
/// share of the top-`k` choices that go to expert `e` and `Pₑ` its mean routing probability, both
/// over the rows of every layer (the attention mask's padding rows left out). The choices are
/// counts (no gradient); the gradient reaches the routers through the probabilities.
pub(crate) fn load_balancing_loss(
    router_logits: &[Tensor],
    experts: usize,
    top_k: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let Some(first) = router_logits.first() else {
        candle_core::bail!("load-balancing loss: no router logits");
    };
    let device = first.device();
    let keep: Option<Vec<f32>> = match mask {
        Some(m) => Some(m.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
        None => None,
    };
    let mut counts = vec![0f32; experts];
    let mut rows = 0f32;
    let mut prob_sum: Option<Tensor> = None;
    for logits in router_logits {
        let probs = softmax_last_dim(logits)?;
        let n = probs.dim(0)?;
        let weight = match &keep {
            Some(k) if k.len() == n => k.clone(),
            Some(k) => candle_core::bail!(
                "load-balancing loss: {} mask values for {n} router rows",
                k.len()
            ),
            None => vec![1.0; n],
        };
        let top = probs
            .to_dtype(DType::F32)?
            .arg_sort_last_dim(false)?
            .narrow(1, 0, top_k)?
            .to_vec2::<u32>()?;
        for (row, chosen) in top.iter().enumerate() {
            for &e in chosen {
                if let Some(c) = counts.get_mut(e as usize) {
                    *c += weight[row];
                }
            }
        }
        rows += weight.iter().sum::<f32>();
        let w = Tensor::from_vec(weight, (n, 1), device)?.to_dtype(probs.dtype())?;
        let sum = probs.broadcast_mul(&w)?.sum(0)?.to_dtype(DType::F32)?;
        prob_sum = Some(match prob_sum {
            Some(s) => (s + sum)?,
            None => sum,
        });
    }
    let prob_sum = prob_sum.ok_or_else(|| candle_core::Error::Msg("no router".into()))?;
    let rows = rows.max(1.0);
    let share = Tensor::from_vec(counts, experts, device)?;
    let loss = (share / rows as f64)?
        .mul(&(prob_sum / rows as f64)?)?
        .sum_all()?;
    loss * experts as f64
}
