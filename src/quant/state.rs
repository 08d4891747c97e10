//! [`QuantState`]: what a 4-bit weight needs besides its packed codes (bitsandbytes'
//! `QuantState`): type, block size, dtype and shape of the original weight, and its block scales,
//! plain or double-quantized; with the JSON bitsandbytes packs the non-tensor part into.

use candle_core::DType;
use serde_json::{Map, Value};

use super::blockwise::dequantize_nested;
use super::{QuantType, BLOCKSIZES};
use crate::error::{Error, Result};

/// The block scales of a 4-bit weight.
#[derive(Clone, Debug, PartialEq)]
pub enum Scales {
    /// One f32 scale a block (no double quantization): `weight.absmax`.
    Plain(Vec<f32>),
    /// Double-quantized scales.
    Nested(NestedScales),
}

/// Double-quantized block scales: block `i`'s scale is `code[codes[i]] · absmax[i / blocksize] +
/// offset`.
#[derive(Clone, Debug, PartialEq)]
pub struct NestedScales {
    codes: Vec<u8>,
    absmax: Vec<f32>,
    code: Box<[f32; 256]>,
    blocksize: usize,
    offset: f32,
}

impl NestedScales {
    /// Scales of `codes` (one a block), `absmax` (one per `blocksize` codes), the 8-bit map
    /// `code` and the `offset`; the caller has checked that the lengths agree.
    pub(crate) fn new(
        codes: Vec<u8>,
        absmax: Vec<f32>,
        code: Box<[f32; 256]>,
        blocksize: usize,
        offset: f32,
    ) -> Self {
        NestedScales {
            codes,
            absmax,
            code,
            blocksize,
            offset,
        }
    }

    /// One 8-bit code a block (`weight.absmax`).
    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// The absmax of each block of [`blocksize`](Self::blocksize) codes
    /// (`weight.nested_absmax`).
    pub fn absmax(&self) -> &[f32] {
        &self.absmax
    }

    /// The 8-bit map (`weight.nested_quant_map`).
    pub fn code(&self) -> &[f32; 256] {
        &self.code
    }

    /// Codes a nested block (256 when bitsandbytes quantizes).
    pub fn blocksize(&self) -> usize {
        self.blocksize
    }

    /// The mean of the scales, subtracted before coding them.
    pub fn offset(&self) -> f32 {
        self.offset
    }

    /// The scale of block `b` (`b` below the number of codes).
    #[inline(always)]
    fn scale(&self, b: usize) -> f32 {
        self.code[self.codes[b] as usize] * self.absmax[b / self.blocksize] + self.offset
    }
}

/// What a 4-bit weight needs besides its packed codes: bitsandbytes' `QuantState`.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantState {
    quant_type: QuantType,
    blocksize: usize,
    dtype: DType,
    shape: Vec<usize>,
    scales: Scales,
}

impl QuantState {
    /// A state of checked parts (see `Weight4bit::read` and `Weight4bit::quantize`).
    pub(crate) fn new(
        quant_type: QuantType,
        blocksize: usize,
        dtype: DType,
        shape: Vec<usize>,
        scales: Scales,
    ) -> Self {
        QuantState {
            quant_type,
            blocksize,
            dtype,
            shape,
            scales,
        }
    }

    /// NF4 or FP4.
    pub fn quant_type(&self) -> QuantType {
        self.quant_type
    }

    /// Elements a block.
    pub fn blocksize(&self) -> usize {
        self.blocksize
    }

    /// The dtype of the weight quantized, which dequantization gives back.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape of the weight quantized.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Elements of the weight.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// Blocks of the weight: `ceil(elements / blocksize)`.
    pub fn blocks(&self) -> usize {
        self.elem_count().div_ceil(self.blocksize)
    }

    /// The block scales, as stored.
    pub fn scales(&self) -> &Scales {
        &self.scales
    }

    /// The block scales in f32, as bitsandbytes computes them before dequantizing (double
    /// quantization undone).
    pub fn absmax(&self) -> Vec<f32> {
        match &self.scales {
            Scales::Plain(a) => a.clone(),
            Scales::Nested(n) => {
                dequantize_nested(&n.codes, &n.absmax, &n.code, n.blocksize, n.offset)
            }
        }
    }

    /// The scale of block `b` (below [`blocks`](Self::blocks)).
    #[inline(always)]
    pub(crate) fn scale(&self, b: usize) -> f32 {
        match &self.scales {
            Scales::Plain(a) => a[b],
            Scales::Nested(n) => n.scale(b),
        }
    }

    /// Bytes held by the scales.
    pub(crate) fn nbytes(&self) -> usize {
        match &self.scales {
            Scales::Plain(a) => 4 * a.len(),
            Scales::Nested(n) => n.codes.len() + 4 * n.absmax.len() + 4 * 256,
        }
    }

    /// The JSON bitsandbytes stores in `weight.quant_state.bitsandbytes__<type>`, byte for byte
    /// as its `json.dumps` writes it (keys in its order, `", "` and `": "` separators, the
    /// offset as Python's `repr`).
    pub fn to_json(&self) -> String {
        let shape: Vec<String> = self.shape.iter().map(usize::to_string).collect();
        let mut s = format!(
            "{{\"quant_type\": \"{}\", \"blocksize\": {}, \"dtype\": \"{}\", \"shape\": [{}]",
            self.quant_type.name(),
            self.blocksize,
            dtype_name(self.dtype),
            shape.join(", ")
        );
        if let Scales::Nested(n) = &self.scales {
            s += &format!(
                ", \"nested_blocksize\": {}, \"nested_dtype\": \"float32\", \"nested_offset\": {}",
                n.blocksize,
                python_repr(f64::from(n.offset))
            );
        }
        s.push('}');
        s
    }
}

/// The non-tensor part of a state, parsed from its JSON.
#[derive(Debug)]
pub(crate) struct JsonState {
    pub(crate) quant_type: QuantType,
    pub(crate) blocksize: usize,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    /// `(nested_blocksize, nested_offset)` with double quantization.
    pub(crate) nested: Option<(usize, f32)>,
}

impl JsonState {
    /// Parses `bytes`, the JSON of the tensor `tensor` (which names the type `expected`):
    /// every key bitsandbytes writes, of its type, and no other.
    pub(crate) fn parse(tensor: &str, bytes: &[u8], expected: QuantType) -> Result<Self> {
        let err = |reason: String| Error::Quantized {
            tensor: tensor.to_string(),
            reason,
        };
        let text = std::str::from_utf8(bytes)
            .map_err(|e| err(format!("the quant state is not UTF-8 text: {e}")))?;
        let value: Value = serde_json::from_str(text)
            .map_err(|e| err(format!("the quant state is not valid JSON ({e}): {text:?}")))?;
        let Value::Object(obj) = value else {
            return Err(err(format!("the quant state is not a JSON object: {text}")));
        };
        const KEYS: [&str; 7] = [
            "quant_type",
            "blocksize",
            "dtype",
            "shape",
            "nested_blocksize",
            "nested_dtype",
            "nested_offset",
        ];
        if let Some(k) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(err(format!(
                "unknown key `{k}` in the quant state (keys: {KEYS:?})"
            )));
        }
        let field = Field {
            obj: &obj,
            err: &err,
        };
        let name = field.str("quant_type")?;
        let quant_type = QuantType::from_name(name).ok_or_else(|| {
            err(format!(
                "quant_type {name:?} is neither \"nf4\" nor \"fp4\""
            ))
        })?;
        if quant_type != expected {
            return Err(err(format!(
                "quant_type {name:?} disagrees with the tensor's name (bitsandbytes__{})",
                expected.name()
            )));
        }
        let blocksize = field.usize("blocksize")?;
        if !BLOCKSIZES.contains(&blocksize) {
            return Err(err(format!(
                "blocksize {blocksize} is not one of {BLOCKSIZES:?}"
            )));
        }
        let dtype = match field.str("dtype")? {
            "float32" => DType::F32,
            "bfloat16" => DType::BF16,
            "float16" => DType::F16,
            d => {
                return Err(err(format!(
                    "dtype {d:?}: float32, bfloat16 or float16 expected"
                )))
            }
        };
        let shape = field.shape()?;
        let nested = field.nested()?;
        Ok(JsonState {
            quant_type,
            blocksize,
            dtype,
            shape,
            nested,
        })
    }
}

/// Typed reads of a JSON object's keys, with errors naming the key.
struct Field<'a, E: Fn(String) -> Error> {
    obj: &'a Map<String, Value>,
    err: &'a E,
}

impl<E: Fn(String) -> Error> Field<'_, E> {
    fn get(&self, key: &str) -> Result<&Value> {
        self.obj
            .get(key)
            .ok_or_else(|| (self.err)(format!("the quant state lacks `{key}`")))
    }

    fn str(&self, key: &str) -> Result<&str> {
        self.get(key)?
            .as_str()
            .ok_or_else(|| (self.err)(format!("`{key}` is not a string")))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.get(key)?
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| (self.err)(format!("`{key}` is not a non-negative integer")))
    }

    /// `(nested_blocksize, nested_offset)` when any `nested_*` key is there (then all three
    /// must be, `nested_dtype` float32).
    fn nested(&self) -> Result<Option<(usize, f32)>> {
        let keys = ["nested_blocksize", "nested_dtype", "nested_offset"];
        if !keys.iter().any(|k| self.obj.contains_key(*k)) {
            return Ok(None);
        }
        let blocksize = self.usize("nested_blocksize")?;
        if blocksize == 0 {
            return Err((self.err)("nested_blocksize is 0".into()));
        }
        let dtype = self.str("nested_dtype")?;
        if dtype != "float32" {
            return Err((self.err)(format!(
                "nested_dtype {dtype:?}: \"float32\" expected"
            )));
        }
        let offset = match self.obj.get("nested_offset") {
            Some(Value::Number(n)) => n.as_f64().map(|v| v as f32),
            _ => None,
        }
        .filter(|v| v.is_finite())
        .ok_or_else(|| (self.err)("nested_offset is missing or not a finite number".into()))?;
        Ok(Some((blocksize, offset)))
    }

    fn shape(&self) -> Result<Vec<usize>> {
        let bad = || (self.err)("`shape` is not a list of non-negative integers".into());
        let dims = self.get("shape")?.as_array().ok_or_else(bad)?;
        let shape = dims
            .iter()
            .map(|d| d.as_u64().and_then(|v| usize::try_from(v).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(bad)?;
        let count = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        match count {
            Some(c) if c > 0 => Ok(shape),
            _ => Err((self.err)(format!(
                "shape {shape:?} has no elements or too many"
            ))),
        }
    }
}

/// PyTorch's name of a float dtype (`str(dtype)` without `torch.`).
pub(crate) fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// `repr(x)` of Python for a finite float: the shortest digits that read back as `x`, in
/// positional notation for decimal exponents from -4 to 15 (`0.0001`, `123.0`) and scientific
/// notation with a signed two-digit exponent otherwise (`1e-05`, `1.5e+16`).
pub(crate) fn python_repr(x: f64) -> String {
    if !x.is_finite() {
        return if x.is_nan() {
            "NaN".into()
        } else if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `d[.ddd]e<exp>`.
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    let body = if (-4..16).contains(&exp) {
        if exp >= 0 {
            let point = exp as usize + 1;
            if digits.len() > point {
                format!("{}.{}", &digits[..point], &digits[point..])
            } else {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let frac = &digits[1..];
        let m = if frac.is_empty() {
            digits[..1].to_string()
        } else {
            format!("{}.{frac}", &digits[..1])
        };
        format!("{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::python_repr;

    #[test]
    fn python_float_repr() {
        // `repr` of these floats in Python 3.11.
        let cases = [
            (2.6502578258514404, "2.6502578258514404"),
            (0.875, "0.875"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (123.0, "123.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (-2.5e-10, "-2.5e-10"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e20, "1.2345e+20"),
            (0.12395719438791275, "0.12395719438791275"),
            (1e-300, "1e-300"),
        ];
        for (x, want) in cases {
            assert_eq!(python_repr(x), want, "{x:e}");
        }
    }
}
