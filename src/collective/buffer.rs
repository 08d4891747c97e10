//! Typed views over the bytes that collectives move, and the host copies of tensors.

use std::ops::Range;

use candle_core::{CpuStorage, DType, Device, Shape, Tensor};
use half::{bf16, f16};

use crate::error::{Error, Result};

/// Element types the collectives move. Reductions work on the float types; `U8` can be broadcast
/// and gathered (used for metadata such as parameter names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    /// Raw bytes.
    U8,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
}

impl ElemType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            ElemType::U8 => 1,
            ElemType::F16 | ElemType::BF16 => 2,
            ElemType::F32 => 4,
            ElemType::F64 => 8,
        }
    }

    /// Short name (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ElemType::U8 => "u8",
            ElemType::F16 => "f16",
            ElemType::BF16 => "bf16",
            ElemType::F32 => "f32",
            ElemType::F64 => "f64",
        }
    }

    /// Wire code of this type.
    pub(crate) fn code(self) -> u8 {
        match self {
            ElemType::U8 => 1,
            ElemType::F16 => 2,
            ElemType::BF16 => 3,
            ElemType::F32 => 4,
            ElemType::F64 => 5,
        }
    }

    /// The type for a Candle dtype, if collectives support it.
    pub fn from_dtype(dtype: DType) -> Option<Self> {
        match dtype {
            DType::U8 => Some(ElemType::U8),
            DType::F16 => Some(ElemType::F16),
            DType::BF16 => Some(ElemType::BF16),
            DType::F32 => Some(ElemType::F32),
            DType::F64 => Some(ElemType::F64),
            _ => None,
        }
    }

    /// The Candle dtype of this type.
    pub fn dtype(self) -> DType {
        match self {
            ElemType::U8 => DType::U8,
            ElemType::F16 => DType::F16,
            ElemType::BF16 => DType::BF16,
            ElemType::F32 => DType::F32,
            ElemType::F64 => DType::F64,
        }
    }
}

impl std::fmt::Display for ElemType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A mutable, typed buffer handed to [`all_reduce`](super::Collective::all_reduce) or
/// [`broadcast`](super::Collective::broadcast). Build it from a typed slice:
/// `BufferMut::from(&mut v[..])`.
#[derive(Debug)]
pub struct BufferMut<'a> {
    bytes: &'a mut [u8],
    elem: ElemType,
}

/// A read-only typed buffer handed to [`all_gather`](super::Collective::all_gather).
#[derive(Debug, Clone, Copy)]
pub struct Buffer<'a> {
    bytes: &'a [u8],
    elem: ElemType,
}

macro_rules! typed_buffers {
    ($($t:ty => $e:expr),*) => {$(
        impl<'a> From<&'a mut [$t]> for BufferMut<'a> {
            fn from(v: &'a mut [$t]) -> Self {
                BufferMut { bytes: bytemuck::cast_slice_mut(v), elem: $e }
            }
        }
        impl<'a> From<&'a [$t]> for Buffer<'a> {
            fn from(v: &'a [$t]) -> Self {
                Buffer { bytes: bytemuck::cast_slice(v), elem: $e }
            }
        }
    )*};
}
typed_buffers!(u8 => ElemType::U8, f16 => ElemType::F16, bf16 => ElemType::BF16, f32 => ElemType::F32, f64 => ElemType::F64);

impl<'a> BufferMut<'a> {
    /// Elements `range` of a CPU tensor's storage as a typed buffer for the collectives (no
    /// copy); float storages only.
    pub(crate) fn of_cpu(dst: &'a mut CpuStorage, range: Range<usize>) -> Result<Self> {
        Ok(match dst {
            CpuStorage::F32(d) => BufferMut::from(&mut d[range]),
            CpuStorage::F64(d) => BufferMut::from(&mut d[range]),
            CpuStorage::BF16(d) => BufferMut::from(&mut d[range]),
            CpuStorage::F16(d) => BufferMut::from(&mut d[range]),
            d => {
                return Err(Error::UnsupportedDType {
                    op: "gradient bucket collective".into(),
                    dtype: format!("{:?}", candle_core::backend::BackendStorage::dtype(d)),
                })
            }
        })
    }

    /// Element type.
    pub fn elem(&self) -> ElemType {
        self.elem
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.elem.size()
    }
    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        self.bytes
    }
    /// The raw bytes, mutable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }
    /// A read-only view.
    pub fn as_buffer(&self) -> Buffer<'_> {
        Buffer {
            bytes: self.bytes,
            elem: self.elem,
        }
    }
}

impl<'a> Buffer<'a> {
    /// A view of raw bytes holding elements of type `elem`.
    pub(crate) fn raw(bytes: &'a [u8], elem: ElemType) -> Self {
        Buffer { bytes, elem }
    }
    /// Element type.
    pub fn elem(&self) -> ElemType {
        self.elem
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.elem.size()
    }
    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// The raw bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

/// Bytes stored with 8-byte alignment, so that any element type can be viewed in place.
#[derive(Clone, Debug, Default)]
pub struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        AlignedBytes {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }
    /// A copy of `bytes`.
    pub fn copy_from(bytes: &[u8]) -> Self {
        let mut a = Self::zeroed(bytes.len());
        a.as_mut().copy_from_slice(bytes);
        a
    }
    /// Grows (never shrinks the allocation) and sets the length to `len`.
    pub fn resize(&mut self, len: usize) {
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.len = len;
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsRef<[u8]> for AlignedBytes {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }
}

impl AsMut<[u8]> for AlignedBytes {
    fn as_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..len]
    }
}

/// One rank's contribution returned by [`all_gather`](super::Collective::all_gather).
#[derive(Clone, Debug)]
pub struct OwnedBuffer {
    bytes: AlignedBytes,
    elem: ElemType,
}

impl OwnedBuffer {
    /// Wraps bytes of the given element type.
    pub fn new(bytes: AlignedBytes, elem: ElemType) -> Self {
        OwnedBuffer { bytes, elem }
    }
    /// Element type.
    pub fn elem(&self) -> ElemType {
        self.elem
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.elem.size()
    }
    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_ref()
    }
    /// A typed view; errors when `T` is not the buffer's element type.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        if T::ELEM != self.elem {
            return Err(Error::invalid(
                "element type",
                format!("buffer holds {}, asked for {}", self.elem, T::ELEM),
            ));
        }
        bytemuck::try_cast_slice(self.bytes.as_ref())
            .map_err(|e| Error::invalid("buffer", format!("cannot view as {}: {e}", T::ELEM)))
    }
}

/// Rust element types that collectives accept.
pub trait Element: bytemuck::Pod + candle_core::WithDType {
    /// The matching [`ElemType`].
    const ELEM: ElemType;
}
impl Element for u8 {
    const ELEM: ElemType = ElemType::U8;
}
impl Element for f16 {
    const ELEM: ElemType = ElemType::F16;
}
impl Element for bf16 {
    const ELEM: ElemType = ElemType::BF16;
}
impl Element for f32 {
    const ELEM: ElemType = ElemType::F32;
}
impl Element for f64 {
    const ELEM: ElemType = ElemType::F64;
}

/// A tensor copied to host memory as a flat, typed vector (used by the host-side collectives).
#[derive(Debug)]
pub(crate) enum HostVec {
    U8(Vec<u8>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl HostVec {
    /// Copies `t` (any layout, any device) to a flat host vector.
    pub(crate) fn from_tensor(t: &Tensor, op: &str) -> Result<Self> {
        let flat = t.flatten_all()?;
        Ok(match t.dtype() {
            DType::U8 => HostVec::U8(flat.to_vec1()?),
            DType::F16 => HostVec::F16(flat.to_vec1()?),
            DType::BF16 => HostVec::BF16(flat.to_vec1()?),
            DType::F32 => HostVec::F32(flat.to_vec1()?),
            DType::F64 => HostVec::F64(flat.to_vec1()?),
            other => {
                return Err(Error::UnsupportedDType {
                    op: op.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        })
    }

    /// A typed mutable view for the collectives.
    pub(crate) fn as_buffer_mut(&mut self) -> BufferMut<'_> {
        match self {
            HostVec::U8(v) => BufferMut::from(&mut v[..]),
            HostVec::F16(v) => BufferMut::from(&mut v[..]),
            HostVec::BF16(v) => BufferMut::from(&mut v[..]),
            HostVec::F32(v) => BufferMut::from(&mut v[..]),
            HostVec::F64(v) => BufferMut::from(&mut v[..]),
        }
    }

    /// Back to a tensor of the given shape on `device`.
    pub(crate) fn into_tensor(self, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        Ok(match self {
            HostVec::U8(v) => Tensor::from_vec(v, shape, device)?,
            HostVec::F16(v) => Tensor::from_vec(v, shape, device)?,
            HostVec::BF16(v) => Tensor::from_vec(v, shape, device)?,
            HostVec::F32(v) => Tensor::from_vec(v, shape, device)?,
            HostVec::F64(v) => Tensor::from_vec(v, shape, device)?,
        })
    }
}

/// Builds a tensor of `shape` on `device` from raw little-endian bytes of element type `elem`.
pub(crate) fn tensor_from_bytes(
    bytes: &[u8],
    elem: ElemType,
    shape: impl Into<Shape>,
    device: &Device,
) -> Result<Tensor> {
    fn typed<T: Element>(bytes: &[u8]) -> Vec<T> {
        bytemuck::pod_collect_to_vec(bytes)
    }
    let shape = shape.into();
    Ok(match elem {
        ElemType::U8 => Tensor::from_vec(bytes.to_vec(), shape, device)?,
        ElemType::F16 => Tensor::from_vec(typed::<f16>(bytes), shape, device)?,
        ElemType::BF16 => Tensor::from_vec(typed::<bf16>(bytes), shape, device)?,
        ElemType::F32 => Tensor::from_vec(typed::<f32>(bytes), shape, device)?,
        ElemType::F64 => Tensor::from_vec(typed::<f64>(bytes), shape, device)?,
    })
}
