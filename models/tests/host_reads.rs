//! Host reads of a Llama-style model's training step (ARCHITECTURE.md, "Host reads per step"):
//! the forward pass and the optimizer step each make the documented number of reads of tensors
//! into host memory (on a GPU each one a host synchronization), counted by
//! `accelerate_rs::host_reads`. The CPU runs the same code and counts the same. The counter is
//! process-wide: this binary holds this one test.

mod common;

use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::{host_reads, Accelerator};
use accelerate_rs_models::AutoModel;
use candle_core::{DType, Device};
use candle_nn::Optimizer;
use common::{fixture, golden};

/// The forward pass's reads: the input ids (the embedding lookup checks them and groups the
/// lookups by table row; the model reads them once and hands them over in host memory), then
/// the loss's target ids (checked against the vocabulary, the ignored `-100` labels counted).
const FORWARD: u64 = 2;
/// The step's: the loss's upstream gradient in the backward pass (the CPU's fused head-and-loss
/// op reads it; a GPU's kernel reads it on the device, one read fewer), then the finiteness
/// check of the gradients.
const STEP: u64 = 2;

#[test]
fn a_llama_training_step_makes_the_documented_host_reads() {
    let accelerator = Accelerator::new().unwrap();
    let model = AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::F32).unwrap();
    let opt = AdamW::new(model.varmap().all_vars(), ParamsAdamW::default()).unwrap();
    accelerator.prepare_model(model.varmap()).unwrap();
    let mut opt = accelerator.prepare_optimizer(opt);
    let g = golden("llama");
    let (ids, labels) = (&g["input_ids"], &g["labels"]);
    let mut counts = Vec::new();
    for _ in 0..3 {
        let before = host_reads();
        let loss = model.loss(ids, labels).unwrap();
        let forward = host_reads() - before;
        opt.backward_step(&loss).unwrap();
        counts.push((forward, host_reads() - before - forward));
    }
    assert_eq!(counts, vec![(FORWARD, STEP); 3], "(forward, step) per step");
}
