//! Unit tests of `arch.rs`: the defaults of [`Architecture`] (an architecture without ZeRO-3
//! units is refused at stage 3, naming its class) and the gathered head [`Hidden`] carries.

use std::time::Duration;

use accelerate_rs::collective::{Collective, ThreadGroup};
use accelerate_rs::nn::Linear;
use accelerate_rs::{Accelerator, ShardSource};
use candle_core::Device;

use super::*;

#[derive(Debug, Clone)]
struct NoUnitsConfig;

impl ModelConfig for NoUnitsConfig {
    fn from_json(_: &Path, _: &serde_json::Value) -> crate::Result<Self> {
        Ok(NoUnitsConfig)
    }
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "model_type": "no_units" })
    }
    fn path(&self) -> &Path {
        Path::new("")
    }
    fn model_type(&self) -> &str {
        "no_units"
    }
    fn initializer_range(&self) -> f64 {
        0.02
    }
}

/// An architecture that keeps every default method: one linear layer, no ZeRO-3 units.
#[derive(Debug, Clone)]
struct NoUnits {
    proj: Proj,
}

impl Architecture for NoUnits {
    type Config = NoUnitsConfig;
    const MODEL_TYPES: &'static [&'static str] = &["no_units"];
    const CLASSES: &'static [&'static str] = &["NoUnitsForCausalLM"];
    const TASK: Task = Task::CausalLm;
    const LORA_TARGETS: &'static [&'static str] = &[];
    const PEFT_TASK_TYPE: Option<&'static str> = None;

    fn assemble(_: &NoUnitsConfig, vb: VarBuilder, std: f64) -> Result<Self> {
        let proj = Proj::linear(4, 4, false, std, vb.pp("proj"))?;
        Ok(NoUnits { proj })
    }
    fn projections_mut(&mut self) -> Vec<&mut Proj> {
        vec![&mut self.proj]
    }
    fn hidden_states(&self, inputs: &Inputs<'_>, _: Mode) -> Result<Hidden> {
        Ok(Hidden::new(inputs.input_ids.to_dtype(DType::F32)?))
    }
    fn logits(&self, hidden: &Hidden, _: Mode) -> Result<Tensor> {
        Ok(hidden.states.clone())
    }
    fn loss(&self, hidden: &Hidden, _: &Tensor, _: Mode) -> Result<Tensor> {
        hidden.states.sum_all()
    }
    fn memory_profile(_: &NoUnitsConfig) -> MemoryProfile {
        MemoryProfile {
            hidden: 4,
            intermediate: 4,
            layers: 1,
            heads: 1,
            kv_heads: 1,
            head_dim: 4,
            vocab: 4,
            max_positions: 4,
            block_elements: 4,
            outer_elements: 4,
            lm_head: false,
        }
    }
}

fn stage_3() -> Accelerator {
    let c: Arc<dyn Collective> = Arc::new(
        ThreadGroup::new(1, Duration::from_secs(60))
            .unwrap()
            .remove(0),
    );
    Accelerator::builder()
        .collective(c)
        .zero_stage(3)
        .build()
        .unwrap()
}

/// An architecture without ZeRO-3 units (the defaults) is refused at stage 3 with an error
/// naming its class, whether loading sharded or running the default sharded forward.
#[test]
fn an_architecture_without_units_is_refused_at_stage_3() {
    assert!(NoUnits::wrap_policy(&NoUnitsConfig).is_none());
    let acc = stage_3();
    let e = crate::Pretrained::<NoUnits>::from_config_sharded(&NoUnitsConfig, &acc, DType::F32, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("NoUnitsForCausalLM") && e.contains("stage 3"),
        "{e}"
    );

    let build = |vb: VarBuilder<'_>| NoUnits::assemble(&NoUnitsConfig, vb, 0.02).map(drop);
    let policy = WrapPolicy::one_unit();
    let model = acc
        .shard_model(&policy, DType::F32, &build, ShardSource::Seeded(1))
        .unwrap();
    let run = ShardedRun {
        model,
        adapters: None,
        dtype: DType::F32,
    };
    let layers = NoUnits::assemble(
        &NoUnitsConfig,
        VarBuilder::zeros(DType::F32, &Device::Cpu),
        0.0,
    )
    .unwrap();
    let ids = Tensor::zeros((1, 2), DType::U32, &Device::Cpu).unwrap();
    let e = layers
        .hidden_states_sharded(&Inputs::new(&ids), Mode::default(), &run)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("NoUnitsForCausalLM") && e.contains("stage 3"),
        "{e}"
    );
}

/// Hidden states carrying another architecture's gathered head are an error naming the
/// type asked for, not a silent fallback to the placeholder head.
#[test]
fn a_gathered_head_of_another_type_is_an_error() {
    let states = Tensor::zeros((1, 2, 4), DType::F32, &Device::Cpu).unwrap();
    let plain = Hidden::new(states.clone());
    assert!(plain.gathered_head::<Linear>().unwrap().is_none());
    let hidden = Hidden::new(states.clone()).with_head(Linear::new(states.get(0).unwrap(), None));
    assert!(hidden.gathered_head::<Linear>().unwrap().is_some());
    let e = hidden.gathered_head::<u8>().unwrap_err().to_string();
    assert!(e.contains("u8"), "{e}");
}
