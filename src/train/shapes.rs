//! A model's parameters before they exist: a [`VarBuilder`] that records what a model asks for
//! (names, shapes, dtypes) without allocating it, and the check that an allocation of that size
//! can be made. Model loaders run a model's constructor through it first, compare the record
//! with the weight files' headers ([`check_weights_mapped`](crate::checkpoint::check_weights_mapped))
//! and with the machine, and only then allocate, so that a `config.json` claiming a vocabulary
//! of 2^40 is an error naming the tensor and the bytes, not a process killed by a failed
//! allocation.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::error::{Error, Result};
use crate::train::weights::ParamSpec;

/// The parameters a model asked a [`shape_only_var_builder`] for, in the order asked (each name
/// once).
#[derive(Clone, Debug, Default)]
pub struct ParamShapes(Arc<Mutex<Vec<ParamSpec>>>);

impl ParamShapes {
    /// The parameters recorded so far.
    pub fn specs(&self) -> Vec<ParamSpec> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

/// A [`VarBuilder`] that allocates nothing: every variable asked for is recorded in the
/// returned [`ParamShapes`] (name, shape, dtype) and given as a zero-strided view of one scalar,
/// so a model's constructor runs in microseconds and a few bytes whatever its sizes. The model
/// built is only good for learning its parameters: its values are all zero and it must not be
/// trained. A name asked for twice with two shapes is an error, as with a `VarMap`.
///
/// ```
/// use accelerate_rs::checkpoint::ParamSpec;
/// use accelerate_rs::shape_only_var_builder;
/// use candle_core::{DType, Device};
///
/// # fn main() -> candle_core::Result<()> {
/// let (vb, shapes) = shape_only_var_builder(DType::F32, &Device::Cpu);
/// // A layer far larger than any machine: nothing is allocated.
/// candle_nn::linear(1 << 30, 1 << 30, vb.pp("huge"))?;
/// let specs = shapes.specs();
/// assert_eq!(specs[0].name, "huge.weight");
/// assert_eq!(specs[0].shape, vec![1 << 30, 1 << 30]);
/// # Ok(()) }
/// ```
pub fn shape_only_var_builder(dtype: DType, device: &Device) -> (VarBuilder<'static>, ParamShapes) {
    let shapes = ParamShapes::default();
    let vb = VarBuilder::from_backend(Box::new(shapes.clone()), dtype, device.clone());
    (vb, shapes)
}

impl SimpleBackend for ParamShapes {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut specs = self.0.lock().map_err(|_| {
            candle_core::Error::Msg(format!("recording {name}: a lock is poisoned"))
        })?;
        match specs.iter().find(|s| s.name == name) {
            Some(s) if s.shape != shape.dims() => candle_core::bail!(
                "shape mismatch on {name}: asked for {shape:?}, earlier for {:?}",
                s.shape
            ),
            Some(_) => {}
            None => specs.push(ParamSpec {
                name: name.to_string(),
                shape: shape.dims().to_vec(),
                dtype,
            }),
        }
        Tensor::zeros((), dtype, device)?.broadcast_as(shape)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!(
            "`get_unchecked({name})`: a shape-only builder needs the shape, use `get`"
        )
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        false
    }
}

/// The bytes of `spec`'s tensor, or `None` when the count overflows 64 bits.
pub fn spec_bytes(spec: &ParamSpec) -> Option<u64> {
    spec.shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))?
        .checked_mul(spec.dtype.size_in_bytes() as u64)
}

/// Checks that the parameters `specs` can be allocated on `device` before anything is: their
/// sizes computed without overflow, and on the CPU each tensor and their total reserved from the
/// allocator and released at once (the reservation fails where the allocation would abort the
/// process). An error is [`Error::OutOfMemory`] naming the largest tensor and the bytes asked
/// for. On a GPU an allocation that fails is already an error, not an abort; only the
/// arithmetic is checked.
pub fn check_allocatable(specs: &[ParamSpec], device: &Device) -> Result<()> {
    let oom = |requested: Option<u64>, detail: String| Error::OutOfMemory {
        rank: None,
        device: crate::error::device_label(device),
        requested,
        limit: None,
        detail,
    };
    let mut total = 0u64;
    let mut largest: Option<(&ParamSpec, u64)> = None;
    for spec in specs {
        let bytes = spec_bytes(spec).ok_or_else(|| {
            oom(
                None,
                format!(
                    "parameter `{}` of shape {:?} needs more than 2^64 bytes",
                    spec.name, spec.shape
                ),
            )
        })?;
        total = total.checked_add(bytes).ok_or_else(|| {
            oom(
                None,
                "the parameters together need more than 2^64 bytes".into(),
            )
        })?;
        if largest.is_none_or(|(_, b)| bytes > b) {
            largest = Some((spec, bytes));
        }
    }
    if !device.is_cpu() {
        return Ok(());
    }
    let reserve = |bytes: u64| -> bool {
        let Ok(n) = usize::try_from(bytes) else {
            return false;
        };
        let mut v: Vec<u8> = Vec::new();
        v.try_reserve_exact(n).is_ok()
    };
    if let Some((spec, bytes)) = largest {
        if !reserve(bytes) {
            return Err(oom(
                Some(bytes),
                format!(
                    "parameter `{}` of shape {:?} ({:?}) cannot be allocated",
                    spec.name, spec.shape, spec.dtype
                ),
            ));
        }
    }
    if !reserve(total) {
        let (name, shape) = largest
            .map(|(s, _)| (s.name.as_str(), s.shape.clone()))
            .unwrap_or_default();
        return Err(oom(
            Some(total),
            format!(
                "the {} parameters together cannot be allocated (the largest: `{name}` {shape:?})",
                specs.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_recorded_without_allocating() {
        let (vb, shapes) = shape_only_var_builder(DType::BF16, &Device::Cpu);
        let w = vb
            .pp("a")
            .get((1usize << 40, 1usize << 20), "weight")
            .unwrap();
        assert_eq!(w.dims(), &[1 << 40, 1 << 20]);
        vb.pp("a")
            .get((1usize << 40, 1usize << 20), "weight")
            .unwrap();
        assert!(vb.pp("a").get((3, 3), "weight").is_err());
        let specs = shapes.specs();
        assert_eq!(specs.len(), 1);
        assert_eq!(spec_bytes(&specs[0]), Some(1 << 61));
        let err = check_allocatable(&specs, &Device::Cpu).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        assert!(err.to_string().contains("a.weight"), "{err}");
        let small = ParamSpec {
            name: "b".into(),
            shape: vec![4, 4],
            dtype: DType::F32,
        };
        check_allocatable(&[small], &Device::Cpu).unwrap();
        let wraps = ParamSpec {
            name: "c".into(),
            shape: vec![1 << 40, 1 << 40],
            dtype: DType::F32,
        };
        let err = check_allocatable(&[wraps], &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("more than 2^64"), "{err}");
    }
}
