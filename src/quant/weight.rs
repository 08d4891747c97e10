//! [`Weight4bit`]: a weight's packed 4-bit codes and their [`QuantState`]; quantizing,
//! dequantizing, and the tensors of a `transformers` 4-bit folder.

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use once_cell::sync::Lazy;
use rayon::prelude::*;

use crate::par::Inline;

use super::blockwise::{dequantize4_into, quantize4, quantize_nested};
use super::codes::{dynamic_map, Lut8, Rounding4};
use super::state::{JsonState, NestedScales, QuantState, Scales};
use super::{Quant4bitConfig, QuantType, NESTED_BLOCKSIZE};
use crate::error::{Error, Result};

/// The double quantization's lookup table for the dynamic map, built once.
static DYNAMIC_LUT: Lazy<Lut8> = Lazy::new(|| Lut8::new(&dynamic_map()));

/// Elements dequantized by one Rayon task.
const DEQUANT_CHUNK: usize = 16 * 1024;

/// A weight quantized to 4 bits (bitsandbytes' `Params4bit`): the packed codes, two a byte, and
/// the [`QuantState`] that dequantizes them. Built by [`quantize`](Self::quantize) from a
/// bf16/f16/f32 weight or [`read`](Self::read) from the tensors of a `transformers` 4-bit
/// folder; held in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Weight4bit {
    packed: Vec<u8>,
    state: QuantState,
}

impl Weight4bit {
    /// Quantizes `w` (f32, bf16 or f16, any shape, finite values, on any device) as
    /// bitsandbytes' `quantize_4bit(w, blocksize, quant_type, compress_statistics)` does.
    pub fn quantize(w: &Tensor, config: &Quant4bitConfig) -> Result<Self> {
        config.check()?;
        let dtype = w.dtype();
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::invalid(
                "4-bit quantization",
                format!("the weight is {dtype:?}; bitsandbytes quantizes f32, bf16 or f16"),
            ));
        }
        let shape = w.dims().to_vec();
        if shape.is_empty() || w.elem_count() == 0 {
            return Err(Error::invalid(
                "4-bit quantization",
                format!("the weight has shape {shape:?}: at least one dimension and one element"),
            ));
        }
        let x = w
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        if let Some((i, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::invalid(
                "4-bit quantization",
                format!("element {i} of the weight is {v}: only finite weights are quantized"),
            ));
        }
        let rounding = Rounding4::of(config.quant_type);
        let (packed, absmax) = quantize4(&x, config.blocksize, &rounding);
        let scales = if config.double_quant {
            let (codes, nested, offset) = quantize_nested(&absmax, NESTED_BLOCKSIZE, &DYNAMIC_LUT);
            let code = Box::new(dynamic_map());
            Scales::Nested(NestedScales::new(
                codes,
                nested,
                code,
                NESTED_BLOCKSIZE,
                offset,
            ))
        } else {
            Scales::Plain(absmax)
        };
        let state = QuantState::new(config.quant_type, config.blocksize, dtype, shape, scales);
        Ok(Weight4bit { packed, state })
    }

    /// The packed codes, `ceil(elements / 2)` bytes, the first element of a pair in the high
    /// nibble.
    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// The state that dequantizes the codes.
    pub fn state(&self) -> &QuantState {
        &self.state
    }

    /// The shape of the weight.
    pub fn shape(&self) -> &[usize] {
        self.state.shape()
    }

    /// The dtype of the weight quantized (and of its dequantization).
    pub fn dtype(&self) -> DType {
        self.state.dtype()
    }

    /// Bytes of memory the weight holds: the packed codes and the scales (and the 8-bit map,
    /// with double quantization).
    pub fn nbytes(&self) -> usize {
        self.packed.len() + self.state.nbytes()
    }

    /// The weight dequantized, in its dtype and shape, on the CPU: bitsandbytes'
    /// `dequantize_4bit`, bit for bit (each value `code · scale` in f32, rounded once to the
    /// dtype).
    pub fn dequantize(&self) -> Result<Tensor> {
        let round = rounding(self.dtype());
        let mut out = vec![0f32; self.state.elem_count()];
        self.dequantize_into(0, &mut out, round);
        let t = Tensor::from_vec(out, self.shape(), &Device::Cpu)?;
        // The values are the dtype's already: the conversion is exact.
        Ok(t.to_dtype(self.dtype())?)
    }

    /// Dequantizes the flat elements `start..start + out.len()` into `out` (in parallel), each
    /// value taken through `round` (the dtypes it passes through).
    pub(crate) fn dequantize_into(
        &self,
        start: usize,
        out: &mut [f32],
        round: impl Fn(f32) -> f32 + Send + Sync,
    ) {
        let code = self.state.quant_type().code();
        let bs = self.state.blocksize();
        let state = &self.state;
        out.par_chunks_mut(DEQUANT_CHUNK)
            .inline_when_single()
            .enumerate()
            .for_each(|(i, chunk)| {
                let first = start + i * DEQUANT_CHUNK;
                dequantize4_into(
                    &self.packed,
                    &code,
                    bs,
                    |b| state.scale(b),
                    &round,
                    first,
                    chunk,
                );
            });
    }

    /// The tensors `transformers` saves for this weight under the module path `prefix` (on the
    /// CPU): `<prefix>.weight` (u8 `[ceil(n/2), 1]`), `<prefix>.weight.absmax`,
    /// `.weight.quant_map`, with double quantization `.weight.nested_absmax` and
    /// `.weight.nested_quant_map`, and `.weight.quant_state.bitsandbytes__<type>` (the JSON of
    /// [`QuantState::to_json`] as u8).
    pub fn tensors(&self, prefix: &str) -> Result<Vec<(String, Tensor)>> {
        let cpu = &Device::Cpu;
        let w = format!("{prefix}.weight");
        let mut out = vec![(
            w.clone(),
            Tensor::from_vec(self.packed.clone(), (self.packed.len(), 1), cpu)?,
        )];
        match self.state.scales() {
            Scales::Plain(a) => {
                out.push((format!("{w}.absmax"), Tensor::new(a.as_slice(), cpu)?));
            }
            Scales::Nested(n) => {
                out.push((format!("{w}.absmax"), Tensor::new(n.codes(), cpu)?));
                out.push((format!("{w}.nested_absmax"), Tensor::new(n.absmax(), cpu)?));
                let map = Tensor::new(n.code().as_slice(), cpu)?;
                out.push((format!("{w}.nested_quant_map"), map));
            }
        }
        let code = self.state.quant_type().code();
        out.push((format!("{w}.quant_map"), Tensor::new(code.as_slice(), cpu)?));
        let json = self.state.to_json().into_bytes();
        let name = format!(
            "{w}.quant_state.bitsandbytes__{}",
            self.state.quant_type().name()
        );
        out.push((name, Tensor::new(json.as_slice(), cpu)?));
        Ok(out)
    }

    /// Reads the weight of the module `prefix` from the tensors of a `transformers` 4-bit folder
    /// (see [`tensors`](Self::tensors)), `get` giving a tensor by its full name (`None` when
    /// absent; on any device). Every tensor is checked against the JSON state: a missing
    /// tensor, a wrong dtype or size, an unknown quantization, a malformed JSON or a table
    /// other than bitsandbytes' is an error naming the tensor.
    pub fn read(prefix: &str, get: impl Fn(&str) -> Option<Tensor>) -> Result<Self> {
        let w = format!("{prefix}.weight");
        let reader = Reader { get: &get };
        let json_names = [QuantType::Nf4, QuantType::Fp4]
            .map(|t| (t, format!("{w}.quant_state.bitsandbytes__{}", t.name())));
        let found: Vec<_> = json_names
            .iter()
            .filter_map(|(t, n)| get(n).map(|tensor| (*t, n, tensor)))
            .collect();
        let (quant_type, json_name, json) = match found.as_slice() {
            [one] => one.clone(),
            [] => {
                return Err(quantized(
                    &json_names[0].1,
                    format!(
                        "missing (nor is there {}): not a 4-bit weight",
                        json_names[1].1
                    ),
                ))
            }
            _ => {
                return Err(quantized(
                    &json_names[0].1,
                    format!("both it and {} are present", json_names[1].1),
                ))
            }
        };
        let bytes = reader.values::<u8>(json_name, &json, DType::U8, None)?;
        let js = JsonState::parse(json_name, &bytes, quant_type)?;
        let n: usize = js.shape.iter().product();
        let blocks = n.div_ceil(js.blocksize);
        let packed = reader.read::<u8>(&w, DType::U8, Some(n.div_ceil(2)))?;
        let map_name = format!("{w}.quant_map");
        let map = reader.read::<f32>(&map_name, DType::F32, Some(16))?;
        let table = quant_type.code();
        if map
            .iter()
            .zip(&table)
            .any(|(a, b)| a.to_bits() != b.to_bits())
        {
            return Err(quantized(
                &map_name,
                format!(
                    "holds {map:?}, not bitsandbytes' {} table {table:?}",
                    quant_type.name()
                ),
            ));
        }
        let absmax_name = format!("{w}.absmax");
        let nested_names = [
            format!("{w}.nested_absmax"),
            format!("{w}.nested_quant_map"),
        ];
        let scales = match js.nested {
            Some((nbs, offset)) => {
                let codes = reader.read::<u8>(&absmax_name, DType::U8, Some(blocks))?;
                let nested =
                    reader.read::<f32>(&nested_names[0], DType::F32, Some(blocks.div_ceil(nbs)))?;
                let map = reader.read::<f32>(&nested_names[1], DType::F32, Some(256))?;
                let mut code = Box::new([0f32; 256]);
                code.copy_from_slice(&map);
                Scales::Nested(NestedScales::new(codes, nested, code, nbs, offset))
            }
            None => {
                if let Some(extra) = nested_names.iter().find(|n| get(n).is_some()) {
                    return Err(quantized(
                        extra,
                        format!("present, but {json_name} has no nested_* keys"),
                    ));
                }
                Scales::Plain(reader.read::<f32>(&absmax_name, DType::F32, Some(blocks))?)
            }
        };
        let state = QuantState::new(js.quant_type, js.blocksize, js.dtype, js.shape, scales);
        Ok(Weight4bit { packed, state })
    }
}

/// An [`Error::Quantized`] naming `tensor`.
fn quantized(tensor: &str, reason: String) -> Error {
    Error::Quantized {
        tensor: tensor.to_string(),
        reason,
    }
}

/// The rounding of an f32 to `dtype`'s nearest value (to nearest, ties to even), as an f32.
pub(crate) fn rounding(dtype: DType) -> fn(f32) -> f32 {
    match dtype {
        DType::BF16 => |v| bf16::from_f32(v).to_f32(),
        DType::F16 => |v| f16::from_f32(v).to_f32(),
        _ => |v| v,
    }
}

/// Typed reads of the tensors `get` finds, with errors naming the tensor.
struct Reader<'a, G: Fn(&str) -> Option<Tensor>> {
    get: &'a G,
}

impl<G: Fn(&str) -> Option<Tensor>> Reader<'_, G> {
    /// The values of the tensor `name`: present, of `dtype`, of `count` elements if given.
    fn read<T: candle_core::WithDType>(
        &self,
        name: &str,
        dtype: DType,
        count: Option<usize>,
    ) -> Result<Vec<T>> {
        let t = (self.get)(name).ok_or_else(|| quantized(name, "missing".into()))?;
        self.values(name, &t, dtype, count)
    }

    /// The values of `t` (the tensor `name`), checked as [`read`](Self::read) does.
    fn values<T: candle_core::WithDType>(
        &self,
        name: &str,
        t: &Tensor,
        dtype: DType,
        count: Option<usize>,
    ) -> Result<Vec<T>> {
        if t.dtype() != dtype {
            return Err(quantized(
                name,
                format!("is {:?}, {dtype:?} expected", t.dtype()),
            ));
        }
        if let Some(c) = count {
            if t.elem_count() != c {
                return Err(quantized(
                    name,
                    format!(
                        "has shape {:?} ({} elements), {c} elements expected",
                        t.dims(),
                        t.elem_count()
                    ),
                ));
            }
        }
        let v = t
            .flatten_all()
            .and_then(|t| t.to_device(&Device::Cpu))
            .and_then(|t| t.to_vec1::<T>())
            .map_err(|e| quantized(name, format!("cannot be read: {e}")))?;
        Ok(v)
    }
}
