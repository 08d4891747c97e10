//! How to quantize a weight: the block sizes and [`Quant4bitConfig`].

use super::codes::QuantType;
use crate::error::{Error, Result};

/// The block sizes bitsandbytes' 4-bit quantization takes.
pub const BLOCKSIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// The block size of the double quantization's 8-bit codes (bitsandbytes' fixed 256).
pub const NESTED_BLOCKSIZE: usize = 256;

/// How to quantize a weight: `transformers`' `BitsAndBytesConfig` 4-bit keys.
///
/// [`nf4`](Self::nf4) is QLoRA's setting (NF4, blocks of 64, double quantization);
/// `BitsAndBytesConfig`'s own defaults are FP4 without double quantization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quant4bitConfig {
    /// `bnb_4bit_quant_type`.
    pub quant_type: QuantType,
    /// The block size (64 in `transformers`; one of [`BLOCKSIZES`]).
    pub blocksize: usize,
    /// `bnb_4bit_use_double_quant`: quantize the block scales too.
    pub double_quant: bool,
}

impl Quant4bitConfig {
    /// NF4, blocks of 64, double quantization (QLoRA).
    pub fn nf4() -> Self {
        Quant4bitConfig {
            quant_type: QuantType::Nf4,
            blocksize: 64,
            double_quant: true,
        }
    }

    /// FP4, blocks of 64, double quantization.
    pub fn fp4() -> Self {
        Quant4bitConfig {
            quant_type: QuantType::Fp4,
            ..Self::nf4()
        }
    }

    /// With double quantization on or off.
    pub fn double_quant(mut self, on: bool) -> Self {
        self.double_quant = on;
        self
    }

    /// With block size `blocksize`.
    pub fn blocksize(mut self, blocksize: usize) -> Self {
        self.blocksize = blocksize;
        self
    }

    /// An error unless the block size is one bitsandbytes takes.
    pub fn check(&self) -> Result<()> {
        if BLOCKSIZES.contains(&self.blocksize) {
            Ok(())
        } else {
            Err(Error::invalid(
                "4-bit block size",
                format!("{} is not one of {BLOCKSIZES:?}", self.blocksize),
            ))
        }
    }
}
