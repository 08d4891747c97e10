//! ZeRO-3 on the facade: making a [`ShardedModel`] and preparing an optimizer for it (the
//! machinery is `train/zero3/`).

use candle_core::DType;
use candle_nn::{Optimizer, VarBuilder};

use super::Accelerator;
use crate::data::DataLoader;
use crate::error::{Error, Result};
use crate::settings::MixedPrecision;
use crate::train::optimizer::{rebase_optimizer, AcceleratedOptimizer};
use crate::train::params::Parameters;
use crate::train::zero3::{self, ShardSource, ShardedModel, WrapPolicy};

impl Accelerator {
    /// [`prepare`](Self::prepare) for a model cut into units by `policy` (ZeRO-3, FSDP): returns
    /// the optimizer, the loader and the [`ShardedModel`] to run the model's blocks through.
    ///
    /// At `zero_stage = 3` every rank checks that all ranks have the same parameters, keeps its
    /// 1/N of each unit of rank 0's values (drop `model` afterwards to free the whole copy) and
    /// moves `optimizer` (an [`optim::AdamW`](crate::optim::AdamW) or
    /// [`optim::Sgd`](crate::optim::Sgd) built over `model`'s variables, whose weight-decay
    /// groups it keeps) onto its shards; the step updates only them. Under mixed precision
    /// (bf16) the shards are the f32 masters and the units are gathered in bf16; `model` must
    /// then be f32. Below stage 3 this is [`prepare`](Self::prepare), and the
    /// [`ShardedModel`] runs the blocks on `model`'s own variables (cast to the compute dtype
    /// under mixed precision), so the same script runs at every stage.
    ///
    /// ```
    /// use accelerate_rs::optim::AdamW;
    /// use accelerate_rs::{Accelerator, DataLoader, TensorDataset, WrapPolicy};
    /// use candle_core::{DType, Module, Tensor};
    /// use candle_nn::VarMap;
    ///
    /// # fn main() -> accelerate_rs::Result<()> {
    /// let acc = Accelerator::builder().cpu(true).zero_stage(3).build()?;
    /// let varmap = VarMap::new();
    /// let vb = acc.var_builder(&varmap, DType::F32);
    /// let _ = (candle_nn::linear(4, 8, vb.pp("l0"))?, candle_nn::linear(8, 1, vb.pp("l1"))?);
    /// let opt = AdamW::new_lr(varmap.all_vars(), 1e-2)?;
    /// let x = Tensor::ones((16, 4), DType::F32, acc.device())?;
    /// let loader = DataLoader::new(TensorDataset::new(vec![x.clone(), x.sum_keepdim(1)?])?, 4);
    /// let policy = WrapPolicy::prefixes(["l0", "l1"]);
    /// let (mut opt, loader, model) = acc.prepare_sharded(&varmap, &policy, opt, loader)?;
    /// drop(varmap); // each rank now keeps only its shards
    /// for batch in loader.iter()? {
    ///     let batch = batch?;
    ///     let h = model.run("l0", &batch[0], |vb, x| candle_nn::linear(4, 8, vb.pp("l0"))?.forward(x)?.relu())?;
    ///     let y = model.run("l1", &h, |vb, x| candle_nn::linear(8, 1, vb.pp("l1"))?.forward(x))?;
    ///     opt.backward_step(&candle_nn::loss::mse(&y, &batch[1])?)?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn prepare_sharded<P: Parameters + ?Sized, O: Optimizer + 'static>(
        &self,
        model: &P,
        policy: &WrapPolicy,
        optimizer: O,
        loader: DataLoader,
    ) -> Result<(AcceleratedOptimizer<O>, DataLoader, ShardedModel)> {
        let named = model.named_parameters();
        let mode = self.checked_mode(&named)?;
        let sharded = zero3::from_vars(self.sharding(policy, mode, true), named.clone())?;
        // Everything checked before anything is registered: a refused optimizer leaves the
        // accelerator as it was.
        let loader = self.prepare_data_loader(loader)?;
        if !sharded.is_sharded() {
            self.inner.grads.register(named)?;
            return Ok((self.prepare_optimizer(optimizer), loader, sharded));
        }
        let mut optimizer = optimizer;
        rebase_optimizer(&mut optimizer, &sharded.inner().param_pieces())?;
        self.inner.grads.register_sharded(sharded.inner().clone())?;
        let opt = AcceleratedOptimizer::new_sharded(optimizer, self.inner.grads.clone());
        Ok((opt, loader, sharded))
    }

    /// At `zero_stage = 3`, a [`ShardedModel`] made without ever holding the whole model:
    /// `build` constructs the model from a [`VarBuilder`] (it is run once with a builder that
    /// allocates nothing, to learn the parameters, and once more while the values are drawn),
    /// `dtype` is the parameters' (f32 under mixed precision: the masters), `source` where the
    /// values come from ([`ShardSource::Seeded`], or only this rank's slices read from
    /// safetensors files with [`ShardSource::Files`]). Below stage 3 an error: build the model
    /// whole and [`prepare`](Self::prepare) it. Give its optimizer to
    /// [`prepare_sharded_optimizer`](Self::prepare_sharded_optimizer).
    pub fn shard_model(
        &self,
        policy: &WrapPolicy,
        dtype: DType,
        build: &dyn Fn(VarBuilder<'_>) -> candle_core::Result<()>,
        source: ShardSource<'_>,
    ) -> Result<ShardedModel> {
        self.shard_model_with(policy, dtype, build, source, true)
    }

    /// [`shard_model`](Self::shard_model) for a frozen model (the base under LoRA adapters):
    /// no gradient is computed or reduced for it, and no optimizer steps it. Train what is
    /// added to it (the adapters, replicated on every rank) with
    /// [`prepare`](Self::prepare).
    pub fn shard_frozen_model(
        &self,
        policy: &WrapPolicy,
        dtype: DType,
        build: &dyn Fn(VarBuilder<'_>) -> candle_core::Result<()>,
        source: ShardSource<'_>,
    ) -> Result<ShardedModel> {
        self.shard_model_with(policy, dtype, build, source, false)
    }

    fn shard_model_with(
        &self,
        policy: &WrapPolicy,
        dtype: DType,
        build: &dyn Fn(VarBuilder<'_>) -> candle_core::Result<()>,
        source: ShardSource<'_>,
        trainable: bool,
    ) -> Result<ShardedModel> {
        let mode = self.inner.state.mixed_precision();
        if mode != MixedPrecision::No && dtype != DType::F32 {
            return Err(masters_err(&format!("the model's dtype {dtype:?}"), mode));
        }
        let b = self.sharding(policy, mode, trainable);
        let model = zero3::from_source(b, dtype, build, source)?;
        self.inner.grads.register_sharded(model.inner().clone())?;
        Ok(model)
    }

    /// Wraps an optimizer for a [`ShardedModel`]: at stage 3 it is moved onto this rank's shards
    /// (built over the model's variables, it keeps their order and weight-decay groups; built
    /// over none, it takes every parameter in name order, without decay for those named by
    /// [`ShardedModel::no_weight_decay_on`]). Below stage 3 it is
    /// [`prepare_optimizer`](Self::prepare_optimizer).
    pub fn prepare_sharded_optimizer<O: Optimizer + 'static>(
        &self,
        model: &ShardedModel,
        mut optimizer: O,
    ) -> Result<AcceleratedOptimizer<O>> {
        if !model.is_sharded() {
            return Ok(self.prepare_optimizer(optimizer));
        }
        rebase_optimizer(&mut optimizer, &model.inner().param_pieces())?;
        Ok(AcceleratedOptimizer::new_sharded(
            optimizer,
            self.inner.grads.clone(),
        ))
    }

    /// The settings of a sharded model made on this accelerator.
    fn sharding<'a>(
        &self,
        policy: &'a WrapPolicy,
        mode: MixedPrecision,
        trainable: bool,
    ) -> zero3::Build<'a> {
        zero3::Build {
            collective: self.inner.collective.clone(),
            policy,
            sharded: self.inner.state.zero_stage() >= 3,
            compute: mode.compute_dtype(),
            device: self.device().clone(),
            trainable,
            offload: self.inner.state.offload_optimizer(),
        }
    }

    /// The mixed-precision mode, checked against the parameters (f32 masters).
    fn checked_mode(&self, named: &[(String, candle_core::Var)]) -> Result<MixedPrecision> {
        let mode = self.inner.state.mixed_precision();
        if mode != MixedPrecision::No {
            if let Some((n, v)) = named.iter().find(|(_, v)| v.dtype() != DType::F32) {
                return Err(masters_err(
                    &format!("parameter `{n}` ({:?})", v.dtype()),
                    mode,
                ));
            }
        }
        Ok(mode)
    }
}

fn masters_err(what: &str, mode: MixedPrecision) -> Error {
    Error::invalid(
        "mixed precision",
        format!(
            "{what}: with {mode} the sharded parameters are the f32 masters (the units are gathered in {:?}); build the model in f32",
            mode.compute_dtype()
        ),
    )
}
