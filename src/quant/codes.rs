//! The code tables of bitsandbytes' 4-bit and 8-bit blockwise formats, as the f32 values
//! bitsandbytes computes (its outputs, checked against `tests/fixtures/bnb4bit`), and the decision
//! boundaries its CPU quantizers round with.

/// The 4-bit data type: `bnb_4bit_quant_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// NormalFloat 4 (QLoRA): the quantiles of a normal distribution, for normally distributed
    /// weights.
    Nf4,
    /// A 4-bit float (1 sign, 2 exponent and 1 mantissa bits).
    Fp4,
}

impl QuantType {
    /// Its name in bitsandbytes' files: `"nf4"` or `"fp4"`.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Nf4 => "nf4",
            QuantType::Fp4 => "fp4",
        }
    }

    /// The type named `name` (`"nf4"`, `"fp4"`), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "nf4" => Some(QuantType::Nf4),
            "fp4" => Some(QuantType::Fp4),
            _ => None,
        }
    }

    /// The 16 values of the type, indexed by code (bitsandbytes' `quant_map`).
    pub fn code(self) -> [f32; 16] {
        code4(self)
    }
}

/// NF4 (NormalFloat, QLoRA): 16 quantiles of N(0, 1) scaled to [-1, 1], indexed by the 4-bit
/// code (sorted, 7 is 0). bitsandbytes' `get_4bit_type("nf4")`, bit for bit.
const NF4: [u32; 16] = [
    0xbf80_0000,
    0xbf32_39b1,
    0xbf06_6b30,
    0xbeca_32a0,
    0xbe91_a24d,
    0xbe3d_353f,
    0xbdba_7871,
    0x0000_0000,
    0x3da2_faff,
    0x3e24_cae3,
    0x3e7c_04dd,
    0x3ead_033a,
    0x3ee1_a4b8,
    0x3f10_07ab,
    0x3f39_13b3,
    0x3f80_0000,
];

/// FP4 (1 sign, 2 exponent, 1 mantissa bit) before its scaling by 1/12, indexed by the 4-bit
/// code: bit 3 is the sign; code 8 is a second (positive) zero, as in bitsandbytes.
const FP4_UNSCALED: [f32; 16] = [
    0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0,
];

/// The FP4 codes in ascending order of value: PyTorch's `argsort` of the table, which puts code 0
/// before code 8 (both zero). A value rounds to the code at the position of its interval.
const FP4_ORDER: [u8; 16] = [11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3];

/// The 8-bit signed dynamic map (`create_dynamic_map()`, Dettmers 2015) the double quantization
/// codes the block scales with, bit for bit: 256 sorted values from -0.99297 to 1.
const DYNAMIC: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// Entries of the double quantization's lookup table: normalized values in [-1, 1] are
/// rounded to one of 65,536 evenly spaced points, each mapped to its nearest code.
const LUT_SIZE: usize = 65_536;

/// The 16 values of a 4-bit type, indexed by code.
pub(crate) fn code4(quant_type: QuantType) -> [f32; 16] {
    match quant_type {
        QuantType::Nf4 => NF4.map(f32::from_bits),
        QuantType::Fp4 => FP4_UNSCALED.map(|v| v / 12.0),
    }
}

/// The 8-bit dynamic map, indexed by code.
pub(crate) fn dynamic_map() -> [f32; 256] {
    DYNAMIC.map(f32::from_bits)
}

/// How a 4-bit type rounds: the 15 midpoints between its values in ascending order, and the code
/// of each of the 16 intervals they cut. A value `v` (scaled to [-1, 1]) gets the code of the
/// interval numbered by how many midpoints are below it, so a value on a midpoint takes the
/// lower one (PyTorch's `bucketize`, what bitsandbytes' CPU quantizer calls).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rounding4 {
    mids: [f32; 15],
    codes: [u8; 16],
}

impl Rounding4 {
    /// The rounding of `quant_type`.
    pub(crate) fn of(quant_type: QuantType) -> Self {
        let table = code4(quant_type);
        let order: [u8; 16] = match quant_type {
            QuantType::Nf4 => std::array::from_fn(|i| i as u8),
            QuantType::Fp4 => FP4_ORDER,
        };
        let mids = std::array::from_fn(|i| {
            (table[order[i] as usize] + table[order[i + 1] as usize]) / 2.0
        });
        Rounding4 { mids, codes: order }
    }

    /// The code of `v` (in [-1, 1]; a NaN takes the last interval, as `bucketize` gives it).
    #[inline(always)]
    pub(crate) fn code(&self, v: f32) -> u8 {
        if v.is_nan() {
            return self.codes[15];
        }
        let below: usize = self.mids.iter().map(|&m| usize::from(m < v)).sum();
        self.codes[below]
    }
}

/// The nearest-code lookup table of bitsandbytes' C++ CPU blockwise quantizer for a sorted
/// 256-entry `code`: entry `i` is for the value `-1 + 2i / 65535` (f32 arithmetic), and holds the
/// first code whose upper midpoint is not below it.
pub(crate) struct Lut8 {
    table: Vec<u8>,
}

impl Lut8 {
    /// The table of `code` (256 sorted values).
    pub(crate) fn new(code: &[f32; 256]) -> Self {
        let mids: Vec<f32> = code.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
        let mut table = Vec::with_capacity(LUT_SIZE);
        let mut idx = 0usize;
        let last = (LUT_SIZE - 1) as f32;
        for i in 0..LUT_SIZE {
            let val = -1.0f32 + (2.0f32 * i as f32) / last;
            while idx < mids.len() && mids[idx] < val {
                idx += 1;
            }
            table.push(idx as u8);
        }
        Lut8 { table }
    }

    /// The code of `v` (a value already divided by its block's absmax): clamped to [-1, 1],
    /// mapped to the nearest of the table's points as the C++ kernel does (`(v + 1) · 0.5`, then
    /// one fused multiply-add by 65535 plus 0.5, truncated).
    #[inline(always)]
    pub(crate) fn code(&self, v: f32) -> u8 {
        let v = v.clamp(-1.0, 1.0);
        let t = ((v + 1.0) * 0.5).mul_add((LUT_SIZE - 1) as f32, 0.5);
        // `t` is in [0.5, 65535.5]: the truncation is an index of the table.
        self.table[(t as usize).min(LUT_SIZE - 1)]
    }
}
