//! The [`Dataset`] trait and the in-memory [`TensorDataset`].

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

/// A random-access collection of samples, each made of one tensor per field
/// (e.g. `[features, label]`).
pub trait Dataset: Send + Sync {
    /// The number of samples.
    fn len(&self) -> usize;

    /// Whether the dataset has no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One sample: one tensor per field (e.g. `[features, label]`).
    fn get(&self, index: usize) -> Result<Vec<Tensor>>;

    /// A batch: one tensor per field, stacked along a new dim 0.
    ///
    /// The default calls [`get`](Dataset::get) for each index and stacks the fields; it fails,
    /// naming the index, when the samples' field counts or shapes differ.
    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        stack_samples(self, indices)
    }
}

/// Gets each sample and stacks its fields along a new dim 0, checking that they agree.
fn stack_samples<D: Dataset + ?Sized>(dataset: &D, indices: &[usize]) -> Result<Vec<Tensor>> {
    stack_fields(indices.iter().map(|&index| (index, dataset.get(index))))
}

/// Stacks samples, given with the index that names them in errors, field by field along a new
/// dim 0; fails, naming the index, when the field counts or shapes differ.
pub(crate) fn stack_fields(
    samples: impl IntoIterator<Item = (usize, Result<Vec<Tensor>>)>,
) -> Result<Vec<Tensor>> {
    let mut first_index = None;
    let mut fields: Vec<Vec<Tensor>> = Vec::new();
    for (index, sample) in samples {
        let sample = sample?;
        let Some(first_index) = first_index else {
            if sample.is_empty() {
                return Err(Error::data(format!("sample {index} has no fields")));
            }
            first_index = Some(index);
            fields = sample.into_iter().map(|t| vec![t]).collect();
            continue;
        };
        if sample.len() != fields.len() {
            return Err(Error::data(format!(
                "sample {index} has {} fields but sample {first_index} has {}",
                sample.len(),
                fields.len()
            )));
        }
        for (f, (tensor, column)) in sample.into_iter().zip(fields.iter_mut()).enumerate() {
            let expected = column[0].dims();
            if tensor.dims() != expected {
                return Err(Error::data(format!(
                    "sample {index} field {f} has shape {:?} but sample {first_index} has {:?}",
                    tensor.dims(),
                    expected
                )));
            }
            column.push(tensor);
        }
    }
    if first_index.is_none() {
        return Err(Error::data("get_batch called with no indices"));
    }
    fields
        .iter()
        .map(|column| Tensor::stack(column, 0).map_err(Error::from))
        .collect()
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn len(&self) -> usize {
        (**self).len()
    }

    fn is_empty(&self) -> bool {
        (**self).is_empty()
    }

    fn get(&self, index: usize) -> Result<Vec<Tensor>> {
        (**self).get(index)
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        (**self).get_batch(indices)
    }
}

impl<D: Dataset + ?Sized> Dataset for Box<D> {
    fn len(&self) -> usize {
        (**self).len()
    }

    fn is_empty(&self) -> bool {
        (**self).is_empty()
    }

    fn get(&self, index: usize) -> Result<Vec<Tensor>> {
        (**self).get(index)
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        (**self).get_batch(indices)
    }
}

/// An in-memory dataset over tensors sharing their first dimension (e.g. `x: [N, 64]`, `y: [N]`).
///
/// Sample `i` is row `i` of each tensor; a batch is one `index_select` per tensor.
#[derive(Debug, Clone)]
pub struct TensorDataset {
    tensors: Vec<Tensor>,
    len: usize,
}

impl TensorDataset {
    /// Builds the dataset. Fails if `tensors` is empty, if a tensor is a scalar, if the tensors
    /// differ in their dim 0 (naming which) or live on different devices.
    pub fn new(tensors: Vec<Tensor>) -> Result<Self> {
        let Some(first) = tensors.first() else {
            return Err(Error::invalid(
                "tensors",
                "TensorDataset needs at least one tensor",
            ));
        };
        let first_device = first.device().clone();
        let mut len = None;
        for (i, t) in tensors.iter().enumerate() {
            let Some(&rows) = t.dims().first() else {
                return Err(Error::invalid(
                    "tensors",
                    format!("tensor {i} is a scalar; every tensor needs a dim 0 to index"),
                ));
            };
            match len {
                None => len = Some(rows),
                Some(n) if n != rows => {
                    return Err(Error::invalid(
                        "tensors",
                        format!(
                            "tensor {i} has {rows} rows along dim 0 (shape {:?}) but tensor 0 has {n}",
                            t.dims()
                        ),
                    ));
                }
                Some(_) => {}
            }
            if !t.device().same_device(&first_device) {
                return Err(Error::invalid(
                    "tensors",
                    format!(
                        "tensor {i} is on {:?} but tensor 0 is on {:?}",
                        t.device().location(),
                        first_device.location()
                    ),
                ));
            }
        }
        Ok(TensorDataset {
            tensors,
            len: len.unwrap_or(0),
        })
    }

    /// The tensors, one per field.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The device the tensors live on.
    pub fn device(&self) -> &Device {
        // `new` guarantees at least one tensor; fall back to the CPU defensively.
        self.tensors
            .first()
            .map(|t| t.device())
            .unwrap_or(&Device::Cpu)
    }

    fn check_index(&self, index: usize) -> Result<()> {
        if index >= self.len {
            return Err(Error::data(format!(
                "index {index} is out of range for a dataset of len {}",
                self.len
            )));
        }
        Ok(())
    }
}

impl Dataset for TensorDataset {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<Vec<Tensor>> {
        self.check_index(index)?;
        self.tensors
            .iter()
            .map(|t| t.get(index).map_err(Error::from))
            .collect()
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Vec<Tensor>> {
        if indices.is_empty() {
            return Err(Error::data("get_batch called with no indices"));
        }
        let mut ids = Vec::with_capacity(indices.len());
        for &index in indices {
            self.check_index(index)?;
            let id = u32::try_from(index).map_err(|_| {
                Error::data(format!("index {index} does not fit the u32 index tensor"))
            })?;
            ids.push(id);
        }
        let ids = Tensor::from_vec(ids, indices.len(), self.device())?;
        self.tensors
            .iter()
            .map(|t| t.index_select(&ids, 0).map_err(Error::from))
            .collect()
    }
}
