//! Which dtypes and reductions the NCCL backend accepts, decided before anything is queued on a
//! communicator (an error inside a queued NCCL call would abort it for good). Plain logic,
//! compiled and tested in every build; `nccl.rs` maps the result to NCCL's element types.

use candle_core::DType;

use crate::collective::ReduceOp;
use crate::error::{Error, Result};

/// The dtypes NCCL has an element type for.
pub(crate) const NCCL_DTYPES: [DType; 8] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::U8,
    DType::U32,
    DType::I32,
    DType::I64,
];

/// Checks that `op` (a reduction when `reduce` is set) can run over NCCL on a `dtype` tensor:
/// NCCL must have the dtype, u8 is not reduced (as on the host backends) and integers have no
/// mean. The error names the operation, the dtype and what is supported.
pub(crate) fn validate(op: &str, dtype: DType, reduce: Option<ReduceOp>) -> Result<DType> {
    let unsupported = |why: &str| Error::UnsupportedDType {
        op: format!("{op} over NCCL{why}"),
        dtype: format!("{dtype:?}"),
    };
    if !NCCL_DTYPES.contains(&dtype) {
        return Err(unsupported(
            " (supported: f32, f64, f16, bf16, u8, u32, i32, i64)",
        ));
    }
    match reduce {
        Some(_) if dtype == DType::U8 => Err(unsupported(" (u8 cannot be reduced)")),
        Some(ReduceOp::Mean) if matches!(dtype, DType::U32 | DType::I32 | DType::I64) => {
            Err(unsupported(" (integers have no mean; use sum)"))
        }
        _ => Ok(dtype),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nccl_dtype_broadcasts_and_gathers() {
        for d in NCCL_DTYPES {
            assert_eq!(validate("broadcast", d, None).unwrap(), d);
            assert_eq!(validate("all_gather", d, None).unwrap(), d);
        }
    }

    #[test]
    fn floats_reduce_with_every_op_integers_without_mean_u8_not_at_all() {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                assert!(validate("all_reduce", d, Some(op)).is_ok(), "{d:?} {op:?}");
            }
            let e = validate("all_reduce", DType::U8, Some(op)).unwrap_err();
            assert!(e.to_string().contains("u8 cannot be reduced"), "{e}");
        }
        for d in [DType::U32, DType::I32, DType::I64] {
            assert!(validate("all_reduce", d, Some(ReduceOp::Sum)).is_ok());
            assert!(validate("all_reduce", d, Some(ReduceOp::Max)).is_ok());
            assert!(validate("all_reduce", d, Some(ReduceOp::Min)).is_ok());
            let e = validate("all_reduce", d, Some(ReduceOp::Mean)).unwrap_err();
            assert!(e.to_string().contains("integers have no mean"), "{e}");
        }
    }

    #[test]
    fn dtypes_nccl_lacks_are_refused_naming_op_and_dtype() {
        for d in [DType::I16, DType::F8E4M3] {
            let e = validate("broadcast", d, None).unwrap_err().to_string();
            assert!(e.contains("broadcast over NCCL"), "{e}");
            assert!(e.contains(&format!("{d:?}")), "{e}");
            assert!(e.contains("supported: f32"), "{e}");
        }
    }
}
