//! Activation checkpointing (`nn::checkpoint`): the gradients of a checkpointed model equal the
//! plain model's bit for bit on the CPU (f32), through `nn::backward` and through an
//! Accelerator's optimizer wrapper; a plain `loss.backward()` is caught.

use accelerate_rs::nn::{self, layer_norm, linear, packed_self_attention, AttentionOptions};
use accelerate_rs::optim::AdamW;
use accelerate_rs::Accelerator;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{LayerNormConfig, VarBuilder, VarMap};

const D: usize = 16;
const T: usize = 6;

/// A pre-norm transformer block built from `accelerate_rs::nn` layers.
#[derive(Clone)]
struct Block {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
}

impl Block {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            ln1: layer_norm(D, LayerNormConfig::default(), vb.pp("ln1"))?,
            qkv: linear(D, 3 * D, vb.pp("qkv"))?,
            proj: linear(D, D, vb.pp("proj"))?,
            ln2: layer_norm(D, LayerNormConfig::default(), vb.pp("ln2"))?,
            up: linear(D, 4 * D, vb.pp("up"))?,
            down: linear(4 * D, D, vb.pp("down"))?,
        })
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        let a = packed_self_attention(&qkv, 2, &AttentionOptions::default().causal(true))?;
        let x = (x + self.proj.forward(&a)?)?;
        let h = nn::gelu(&self.up.forward(&self.ln2.forward(&x)?)?)?;
        x + self.down.forward(&h)?
    }
}

struct Model {
    embed: nn::Linear,
    blocks: Vec<Block>,
    head: nn::Linear,
}

impl Model {
    fn new(varmap: &VarMap, layers: usize) -> Result<Self> {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        let model = Self {
            embed: linear(8, D, vb.pp("embed"))?,
            blocks: (0..layers)
                .map(|i| Block::new(vb.pp(format!("blocks.{i}"))))
                .collect::<Result<_>>()?,
            head: linear(D, 5, vb.pp("head"))?,
        };
        // Deterministic weights, the same for every model built this way.
        let mut vars = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect::<Vec<_>>();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (i, (_, v)) in vars.iter().enumerate() {
            let n = v.elem_count();
            let vals: Vec<f32> = (0..n)
                .map(|j| (((i * 7919 + j * 104_729) % 1000) as f32 / 1000.0 - 0.5) * 0.4)
                .collect();
            v.set(&Tensor::from_vec(vals, v.shape(), &Device::Cpu)?)?;
        }
        Ok(model)
    }

    /// `checkpointed`: every block through `nn::checkpoint`; `embed_input`: the raw input goes
    /// straight into a checkpointed block (no gradient on the block's input).
    fn loss(&self, x: &Tensor, checkpointed: bool, raw_first: bool) -> Result<Tensor> {
        let mut h = if raw_first && checkpointed {
            nn::checkpoint(&self.embed, x)?
        } else {
            self.embed.forward(x)?
        };
        for b in &self.blocks {
            h = if checkpointed {
                nn::checkpoint(b, &h)?
            } else {
                b.forward(&h)?
            };
        }
        self.head.forward(&h)?.sqr()?.mean_all()
    }
}

fn input() -> Tensor {
    let vals: Vec<f32> = (0..2 * T * 8)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    Tensor::from_vec(vals, (2, T, 8), &Device::Cpu).unwrap()
}

fn grad_bits(varmap: &VarMap, grads: &GradStore) -> Vec<(String, Vec<u32>)> {
    let mut out: Vec<_> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| {
            let g = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{n} has no gradient"));
            let bits = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (n.clone(), bits.into_iter().map(f32::to_bits).collect())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn checkpointed_gradients_equal_plain_ones_bit_for_bit() {
    for raw_first in [false, true] {
        let varmap = VarMap::new();
        let model = Model::new(&varmap, 3).unwrap();
        let plain = nn::backward(&model.loss(&input(), false, false).unwrap()).unwrap();
        let ckpt = nn::backward(&model.loss(&input(), true, raw_first).unwrap()).unwrap();
        let (a, b) = (grad_bits(&varmap, &plain), grad_bits(&varmap, &ckpt));
        assert_eq!(a.len(), 3 * 12 + 4);
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            assert_eq!(
                x, y,
                "{name}: checkpointed gradient differs (raw_first {raw_first})"
            );
        }
    }
}

#[test]
fn nested_checkpoints_and_the_input_gradient() {
    let varmap = VarMap::new();
    let model = Model::new(&varmap, 2).unwrap();
    let x = Var::from_tensor(&input()).unwrap();
    let run = |nested: bool| {
        let h = model.embed.forward(x.as_tensor()).unwrap();
        let h = if nested {
            let blocks = model.blocks.clone();
            nn::checkpoint_fn(
                move |h: &Tensor| {
                    let h = nn::checkpoint(&blocks[0], h)?;
                    nn::checkpoint(&blocks[1], &h)
                },
                &h,
            )
            .unwrap()
        } else {
            model.blocks[1]
                .forward(&model.blocks[0].forward(&h).unwrap())
                .unwrap()
        };
        let loss = model
            .head
            .forward(&h)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        nn::backward(&loss).unwrap()
    };
    let (plain, nested) = (run(false), run(true));
    assert_eq!(grad_bits(&varmap, &plain), grad_bits(&varmap, &nested));
    let gx = |g: &GradStore| {
        g.get(x.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(gx(&plain), gx(&nested));
}

/// A checkpointed block without parameters of its own (a frozen layer, a parameter-free op)
/// still passes the gradient of its input on: the layers before it train.
#[test]
fn a_block_without_parameters_passes_the_input_gradient_on() {
    let x = Var::from_tensor(&input()).unwrap();
    let d = x.dim(2).unwrap();
    let frozen = Tensor::randn(0f32, 1.0, (d, d), &Device::Cpu).unwrap();
    let run = |checkpointed: bool| {
        let h = (x.as_tensor() * 1.5).unwrap();
        let w = frozen.clone();
        let block = move |h: &Tensor| h.broadcast_matmul(&w)?.tanh();
        let y = if checkpointed {
            nn::checkpoint_fn(block, &h).unwrap()
        } else {
            block(&h).unwrap()
        };
        let grads = nn::backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
        grads
            .get(x.as_tensor())
            .expect("the input's gradient")
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(run(false), run(true));
}

#[test]
fn a_plain_backward_is_caught_at_the_next_checkpoint() {
    let varmap = VarMap::new();
    let model = Model::new(&varmap, 1).unwrap();
    let _ = model
        .loss(&input(), true, false)
        .unwrap()
        .backward()
        .unwrap();
    let err = model.loss(&input(), true, false).unwrap_err().to_string();
    assert!(
        err.contains("never collected") && err.contains("accelerator.backward"),
        "{err}"
    );
    // Reported once: the next pass through `nn::backward` works.
    let grads = nn::backward(&model.loss(&input(), true, false).unwrap()).unwrap();
    assert_eq!(grad_bits(&varmap, &grads).len(), 12 + 4);
}

#[test]
fn an_optimizer_wrapper_steps_checkpointed_models_like_plain_ones() {
    let after = |checkpointed: bool| {
        let acc = Accelerator::builder().cpu(true).build().unwrap();
        let varmap = VarMap::new();
        let model = Model::new(&varmap, 2).unwrap();
        acc.prepare_model(&varmap).unwrap();
        let mut opt = acc.prepare_optimizer(AdamW::new_lr(varmap.all_vars(), 1e-2).unwrap());
        for _ in 0..3 {
            let loss = model.loss(&input(), checkpointed, false).unwrap();
            opt.backward_step(&loss).unwrap();
        }
        let mut w: Vec<_> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                )
            })
            .collect();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        w
    };
    let (plain, ckpt) = (after(false), after(true));
    for ((n, a), (_, b)) in plain.iter().zip(&ckpt) {
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{n}"
        );
    }
}
