//! The mixtures of experts: the load-balancing loss is `transformers`' (golden `aux_loss`), the
//! routers learn (through the routing weights alone, and through the auxiliary loss), and the
//! expert load counts every routed token once per chosen expert.

mod common;

use accelerate_rs::optim::AdamW;
use accelerate_rs::Parameters;
use accelerate_rs_models::{AutoModel, Inputs, Mixtral, MixtralForCausalLm};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use common::{adamw_params, copy_fixture, fixture, golden, max_abs, rel_diff};

const MOES: [&str; 3] = ["mixtral", "qwen3_moe", "qwen2_moe"];

fn load(dir: &std::path::Path) -> MixtralForCausalLm {
    let mut m = MixtralForCausalLm::from_pretrained(dir, &Device::Cpu, DType::F32).unwrap();
    m.train(true);
    m
}

#[test]
fn the_load_balancing_loss_is_transformers() {
    for name in MOES {
        let g = golden(name);
        let model = load(&fixture(name));
        let inputs = Inputs::new(&g["input_ids"]).attention_mask(Some(&g["attention_mask"]));
        let aux = model.hidden(&inputs).unwrap().aux_loss.unwrap();
        let coef = model.config().router_aux_loss_coef;
        let ours = (aux / coef).unwrap().reshape(1).unwrap();
        let d = rel_diff(&ours, &g["aux_loss"]);
        assert!(d <= 1e-5, "{name}: aux loss differs by {d:e}");
    }
}

/// The router's weight, and its gradient for the golden batch.
fn router_grad(model: &MixtralForCausalLm, name: &str, router: &str) -> (Tensor, Tensor) {
    let g = golden(name);
    let loss = model
        .loss_with_mask(&g["input_ids"], Some(&g["attention_mask"]), &g["labels"])
        .unwrap();
    let grads = loss.backward().unwrap();
    let var = model
        .varmap()
        .named_parameters()
        .into_iter()
        .find(|(n, _)| n == router)
        .unwrap_or_else(|| panic!("{name}: no `{router}`"))
        .1;
    let grad = grads.get(&var).unwrap().clone();
    (var.as_tensor().clone(), grad)
}

#[test]
fn routers_learn_with_and_without_the_aux_loss() {
    let router = "model.layers.1.block_sparse_moe.gate.weight";
    // With the load-balancing loss, and without it (the routing weights alone).
    for aux in [true, false] {
        let (_tmp, dir) = copy_fixture("mixtral");
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).unwrap().replace(
            "\"output_router_logits\": true",
            &format!("\"output_router_logits\": {aux}"),
        );
        std::fs::write(&path, text).unwrap();
        let model = load(&dir);
        let (before, grad) = router_grad(&model, "mixtral", router);
        let before = before.copy().unwrap();
        assert!(
            max_abs(&grad) > 1e-4,
            "aux {aux}: router gradient {}",
            max_abs(&grad)
        );
        let g = golden("mixtral");
        let mut opt = AdamW::new(model.varmap().all_vars(), adamw_params()).unwrap();
        for _ in 0..3 {
            let loss = model
                .loss_with_mask(&g["input_ids"], Some(&g["attention_mask"]), &g["labels"])
                .unwrap();
            opt.backward_step(&loss).unwrap();
        }
        let (after, _) = router_grad(&model, "mixtral", router);
        let moved = max_abs(&(after - before).unwrap());
        assert!(moved > 1e-3, "aux {aux}: the router moved {moved}");
    }
}

#[test]
fn expert_load_counts_each_routed_token_top_k_times() {
    for name in MOES {
        let g = golden(name);
        let model = AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
        let m: &MixtralForCausalLm = model.downcast_ref().unwrap();
        let config = m.config();
        let layers: &Mixtral = m.layers();
        let inputs = Inputs::new(&g["input_ids"]).attention_mask(Some(&g["attention_mask"]));
        let loads = layers.expert_load(&inputs).unwrap();
        let tokens = g["attention_mask"]
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as usize;
        assert!(!loads.is_empty(), "{name}");
        for load in &loads {
            assert_eq!(load.len(), config.experts(), "{name}");
            assert_eq!(
                load.iter().sum::<usize>(),
                tokens * config.num_experts_per_tok,
                "{name}: {load:?}"
            );
        }
    }
}
