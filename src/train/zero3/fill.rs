//! Making a [`ShardedModel`]: from a model's variables (rank 0's values, one unit at a time),
//! or from its parameter list and a [`ShardSource`] (each rank draws or reads only its own
//! chunks, one parameter at a time: no rank ever holds the whole model).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::collective::{Collective, ReduceOp};
use crate::error::{Error, Result};
use crate::train::params::ParamSet;
use crate::train::weights::ParamSpec;

use super::layout::{ShardLayout, UnitLayout, WrapPolicy};
use super::unit::Unit;

/// Where the values of a model made by
/// [`Accelerator::shard_model`](crate::Accelerator::shard_model) come from.
#[derive(Clone, Copy)]
pub enum ShardSource<'a> {
    /// Drawn as [`seeded_var_builder`](crate::seeded_var_builder) draws them with this seed
    /// (the same values at every world size and stage; each rank draws one parameter at a
    /// time and keeps its pieces).
    Seeded(u64),
    /// Read from Hugging Face weights (a folder, a `.safetensors` file or a sharded index),
    /// `map` giving a file tensor's parameter name (or `None` to skip it): each rank reads only
    /// the bytes of its own chunks from the memory-mapped files. Every parameter must be in
    /// the files, with its shape (checked on the headers first).
    Files {
        /// The folder or file.
        path: &'a Path,
        /// File tensor name to parameter name.
        map: &'a dyn Fn(&str) -> Option<String>,
    },
}

impl std::fmt::Debug for ShardSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShardSource::Seeded(s) => write!(f, "Seeded({s})"),
            ShardSource::Files { path, .. } => write!(f, "Files({})", path.display()),
        }
    }
}

/// The settings every constructor shares.
/// What a sharded model is made of, as [`from_vars`] and [`from_source`] make it (the model
/// itself is assembled from them where it is defined).
pub(crate) struct Parts {
    pub(crate) collective: Arc<dyn Collective>,
    pub(crate) layout: ShardLayout,
    /// The units' shards (stage 3), or none.
    pub(crate) units: Vec<Unit>,
    /// The model's own variables (below stage 3), or none.
    pub(crate) whole: HashMap<String, Var>,
    pub(crate) compute: DType,
    pub(crate) device: Device,
    /// The whole parameters' ids, by name, when the model was made from its variables.
    pub(crate) ids: HashMap<String, candle_core::TensorId>,
}

pub(crate) struct Build<'a> {
    pub(crate) collective: Arc<dyn Collective>,
    pub(crate) policy: &'a WrapPolicy,
    /// Stage 3 (else the model's own variables are used).
    pub(crate) sharded: bool,
    pub(crate) compute: DType,
    pub(crate) device: Device,
    pub(crate) trainable: bool,
    /// Offload: shards (masters) in host memory, copies in the compute dtype on `device`.
    pub(crate) offload: bool,
}

impl Build<'_> {
    /// Where the shards live: host memory with offload, else the device.
    fn shard_device(&self) -> Device {
        if self.offload {
            Device::Cpu
        } else {
            self.device.clone()
        }
    }

    /// A unit over `shard` (moved to where shards live), with its device copy under offload
    /// (filled by [`Unit::refresh`]).
    fn unit(&self, layout: &UnitLayout, shard: Var, own: std::ops::Range<usize>) -> Result<Unit> {
        let (shard, copy) = if self.offload {
            let host = Var::from_tensor(&shard.as_tensor().to_device(&Device::Cpu)?)?;
            let copy = Var::zeros(own.len(), self.compute, &self.device)?;
            (host, Some(copy))
        } else {
            (shard, None)
        };
        let unit = Unit::new(layout.clone(), shard, own, self.trainable, copy);
        unit.refresh()?;
        Ok(unit)
    }
}

fn specs_of(named: &[(String, Var)]) -> Vec<ParamSpec> {
    named
        .iter()
        .map(|(n, v)| ParamSpec {
            name: n.clone(),
            shape: v.dims().to_vec(),
            dtype: v.dtype(),
        })
        .collect()
}

/// Every rank returns an error when any rank failed (`result` is this rank's outcome), so that
/// no rank goes on to wait in a collective for one that stopped.
pub(crate) fn agree(c: &dyn Collective, what: &str, result: Result<()>) -> Result<()> {
    if c.world_size() == 1 {
        return result;
    }
    let mut failed = [if result.is_ok() {
        0f32
    } else {
        (c.rank() + 1) as f32
    }];
    c.all_reduce((&mut failed[..]).into(), ReduceOp::Max)?;
    result?;
    if failed[0] != 0.0 {
        return Err(Error::invalid(
            what,
            format!("rank {} failed (see its error)", failed[0] as usize - 1),
        ));
    }
    Ok(())
}

/// From a model's variables: below stage 3 it uses them; at stage 3 it checks that every
/// rank has the same parameters, cuts rank 0's values into the units' shards (one unit
/// broadcast at a time) and keeps only this rank's chunks (drop the variables afterwards to
/// free them).
pub(crate) fn from_vars(b: Build<'_>, named: Vec<(String, Var)>) -> Result<Parts> {
    let c = b.collective.as_ref();
    let layout = ShardLayout::new(&specs_of(&named), b.policy)?;
    let ids = named.iter().map(|(n, v)| (n.clone(), v.id())).collect();
    let vars: HashMap<String, Var> = named.into_iter().collect();
    if !b.sharded {
        return Ok(Parts {
            collective: b.collective.clone(),
            layout,
            units: Vec::new(),
            whole: vars,
            compute: b.compute,
            device: b.device,
            ids,
        });
    }
    if c.world_size() > 1 {
        let named: Vec<(String, Var)> = vars.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        ParamSet::new(named, usize::MAX)?.verify(c)?;
    }
    let (n, me) = (c.world_size(), c.rank());
    let mut units = Vec::with_capacity(layout.units.len());
    for u in &layout.units {
        let parts = u
            .members
            .iter()
            .map(|m| vars[&m.name].as_tensor().flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let flat = c.broadcast_tensor(&Tensor::cat(&parts, 0)?, 0)?;
        let own = u.own(n, me);
        let shard = Var::from_tensor(&flat.narrow(0, own.start, own.len())?)?;
        units.push(b.unit(u, shard, own)?);
    }
    Ok(Parts {
        collective: b.collective.clone(),
        layout,
        units,
        whole: HashMap::new(),
        compute: b.compute,
        device: b.device,
        ids,
    })
}

/// At stage 3, from the parameters `build` asks a [`VarBuilder`] for (it builds the model;
/// run once with a builder that allocates nothing, to learn them) in `dtype`, with values
/// from `source`: each rank allocates only its shards and fills them one parameter at a
/// time.
pub(crate) fn from_source(
    b: Build<'_>,
    dtype: DType,
    build: &dyn Fn(VarBuilder<'_>) -> candle_core::Result<()>,
    source: ShardSource<'_>,
) -> Result<Parts> {
    let (vb, shapes) = crate::train::shapes::shape_only_var_builder(dtype, &b.device);
    build(vb)?;
    let specs = shapes.specs();
    let layout = ShardLayout::new(&specs, b.policy)?;
    if !b.sharded {
        return Err(Error::invalid(
            "zero_stage",
            "a model is made from its parameter list and sharded only at stage 3; below it, \
                 build it whole (`VarBuilder`, `from_pretrained`) and `prepare` it",
        ));
    }
    let c = b.collective.as_ref();
    let (n, me) = (c.world_size(), c.rank());
    let mut units = Vec::with_capacity(layout.units.len());
    for u in &layout.units {
        let own = u.own(n, me);
        let shard = Var::zeros(own.len(), u.dtype, &b.shard_device())?;
        units.push(b.unit(u, shard, own)?);
    }
    let filled = match source {
        ShardSource::Seeded(seed) => fill_seeded(&layout, &units, build, seed, n, me, &b.device),
        ShardSource::Files { path, map } => fill_files(&layout, &units, &specs, path, map, n, me),
    };
    let filled = filled.and_then(|()| units.iter().try_for_each(Unit::refresh));
    agree(c, "loading a ZeRO-3 model", filled)?;
    Ok(Parts {
        collective: b.collective.clone(),
        layout,
        units,
        whole: HashMap::new(),
        compute: b.compute,
        device: b.device,
        ids: HashMap::new(),
    })
}

/// Writes `values` (a whole parameter, any shape, or a 1-D piece starting at element
/// `values_start` of it) into the units' shards where this rank owns them.
pub(crate) fn write_pieces(
    layout: &ShardLayout,
    units: &[Unit],
    name: &str,
    values: &Tensor,
    values_start: usize,
    world: usize,
    rank: usize,
) -> Result<()> {
    let Some((u, m)) = layout.find(name) else {
        return Err(Error::invalid(
            format!("parameter `{name}`"),
            "is not a parameter of the sharded model",
        ));
    };
    let values = values
        .flatten_all()?
        .to_dtype(units[u].shard.dtype())?
        .to_device(units[u].shard.device())?;
    let end = values_start + values.elem_count();
    for p in layout.units[u].pieces(world, rank) {
        if p.member != m {
            continue;
        }
        let (lo, hi) = (p.in_param.start.max(values_start), p.in_param.end.min(end));
        if lo >= hi {
            continue;
        }
        let src = values.narrow(0, lo - values_start, hi - lo)?.contiguous()?;
        let at = p.in_shard.start + (lo - p.in_param.start);
        units[u].shard.as_tensor().slice_set(&src, 0, at)?;
    }
    Ok(())
}

/// The backend that fills the shards while a model's constructor runs: each parameter drawn
/// whole (one at a time), this rank's pieces kept, a zero-strided view handed back.
struct SeededFill<'a> {
    layout: &'a ShardLayout,
    units: &'a [Unit],
    seed: u64,
    world: usize,
    rank: usize,
    done: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl SimpleBackend for SeededFill<'_> {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let first = self
            .done
            .lock()
            .map(|mut d| d.insert(name.to_string()))
            .unwrap_or(true);
        if first {
            let values = crate::train::init::seeded_values(init, &shape, self.seed, name, dtype)?;
            write_pieces(
                self.layout,
                self.units,
                name,
                &values,
                0,
                self.world,
                self.rank,
            )?;
        }
        Tensor::zeros((), dtype, device)?.broadcast_as(shape)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("`get_unchecked({name})`: a ZeRO-3 model is built with `get`")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        false
    }
}

fn fill_seeded(
    layout: &ShardLayout,
    units: &[Unit],
    build: &dyn Fn(VarBuilder<'_>) -> candle_core::Result<()>,
    seed: u64,
    world: usize,
    rank: usize,
    device: &Device,
) -> Result<()> {
    let fill = SeededFill {
        layout,
        units,
        seed,
        world,
        rank,
        done: Default::default(),
    };
    let dtype = layout.units.first().map_or(DType::F32, |u| u.dtype);
    build(VarBuilder::from_backend(
        Box::new(fill),
        dtype,
        device.clone(),
    ))?;
    Ok(())
}

/// Reads this rank's pieces of every parameter from the weight files.
fn fill_files(
    layout: &ShardLayout,
    units: &[Unit],
    specs: &[ParamSpec],
    path: &Path,
    map: &dyn Fn(&str) -> Option<String>,
    world: usize,
    rank: usize,
) -> Result<()> {
    let mut wanted = Vec::new();
    for u in &layout.units {
        for p in u.pieces(world, rank) {
            wanted.push((u.members[p.member].name.clone(), p.in_param));
        }
    }
    crate::train::weights::read_slices(path, specs, map, &wanted, &mut |k, t| {
        let (name, range) = &wanted[k];
        write_pieces(layout, units, name, &t, range.start, world, rank)
    })?;
    Ok(())
}
