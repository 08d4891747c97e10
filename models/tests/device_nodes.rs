//! The graph a GPU runs, on the CPU: with `accelerate_rs::nn::set_device_nodes_on_cpu` the
//! decoders take the one-node forms a GPU takes (`rope_attention`, `swiglu_linear`, the head and
//! its loss), with the CPU's kernels. For every architecture, the logits, the loss and every
//! gradient equal those of the CPU's own graph, which `parity.rs` holds to `transformers`'
//! golden files. The switch is process-wide: this binary holds this one test.

mod common;

use accelerate_rs::nn::{self, set_device_nodes_on_cpu};
use accelerate_rs::Parameters;
use accelerate_rs_models::AutoModel;
use candle_core::{DType, Device, Tensor};
use common::{fixture, golden, max_abs, rel_diff, ARCHS};

/// The logits, the loss and every parameter's gradient (name order) of `name`'s fixture, with
/// no padding mask (the one-node attention takes no mask).
fn run(name: &str) -> Vec<(String, Tensor)> {
    let mut model = AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
    model.train(true);
    let g = golden(name);
    let (ids, labels) = (&g["input_ids"], &g["labels"]);
    let mut out = vec![("logits".to_string(), model.forward(ids, None).unwrap())];
    let loss = model.loss(ids, labels).unwrap();
    let grads = nn::backward(&loss).unwrap();
    out.push(("loss".to_string(), loss.reshape(1).unwrap()));
    for (pname, var) in model.varmap().named_parameters() {
        let grad = grads
            .get(&var)
            .unwrap_or_else(|| panic!("{name}: `{pname}` got no gradient"));
        out.push((pname, grad.clone()));
    }
    out
}

#[test]
fn the_gpu_graph_equals_the_cpu_graph_for_every_architecture() {
    for name in ARCHS {
        set_device_nodes_on_cpu(false);
        let cpu = run(name);
        set_device_nodes_on_cpu(true);
        let device = run(name);
        set_device_nodes_on_cpu(false);
        assert_eq!(cpu.len(), device.len(), "{name}");
        let scale = cpu[2..].iter().map(|(_, t)| max_abs(t)).fold(0.0, f32::max);
        for ((what, a), (_, b)) in cpu.iter().zip(&device) {
            let d = if what == "logits" || what == "loss" {
                rel_diff(b, a)
            } else {
                // Gradients: relative to the tensor, or to the model's gradient scale for a
                // tensor whose gradient is rounding noise around zero.
                max_abs(&(b - a).unwrap()) / max_abs(a).max(1e-3 * scale).max(1e-12)
            };
            assert!(d <= 1e-4, "{name}: `{what}` differs by {d:e} (relative)");
        }
    }
}
