//! Reproducible initialisation: a [`VarBuilder`] over a [`VarMap`] whose new variables are drawn
//! from a generator seeded by `(seed, variable name)`, so the same seed gives the same weights
//! at any world size, in any creation order, with any other code drawing random numbers in
//! between. Candle's own CPU initialisers (`Init::Randn`, `Init::Uniform`, Kaiming) use an
//! unseeded generator: two runs of a plain Candle program start from different weights.

use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A [`VarBuilder`] whose new variables go into `varmap` (like
/// [`VarBuilder::from_varmap`]) with values drawn from `(seed, full variable name)`: the
/// variable's [`Init`] (`Const`, `Randn`, `Uniform` or `Kaiming`, with Candle's formulas for the
/// bounds and deviations) is sampled from a ChaCha8 generator seeded by the seed and the name,
/// on the CPU in f64 and then cast to `dtype` and moved to `device`. The same seed and name give
/// the same values bit for bit, whatever the world size, the order in which variables are
/// created and the device. Variables already in `varmap` are returned as they are (their shape
/// checked), as `VarMap` does.
///
/// [`Accelerator::var_builder`](crate::Accelerator::var_builder) is this with the seed given to
/// [`Accelerator::set_seed`](crate::Accelerator::set_seed).
///
/// ```
/// use accelerate_rs::seeded_var_builder;
/// use candle_core::{DType, Device};
/// use candle_nn::{linear, VarMap};
///
/// # fn main() -> candle_core::Result<()> {
/// let (a, b) = (VarMap::new(), VarMap::new());
/// let x = linear(4, 2, seeded_var_builder(&a, 7, DType::F32, &Device::Cpu).pp("fc"))?;
/// // Another layer created first does not change `fc`'s weights.
/// let vb = seeded_var_builder(&b, 7, DType::F32, &Device::Cpu);
/// let _other = linear(3, 3, vb.pp("other"))?;
/// let y = linear(4, 2, vb.pp("fc"))?;
/// assert_eq!(x.weight().to_vec2::<f32>()?, y.weight().to_vec2::<f32>()?);
/// # Ok(()) }
/// ```
pub fn seeded_var_builder(
    varmap: &VarMap,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> VarBuilder<'static> {
    VarBuilder::from_backend(
        Box::new(SeededVarMap {
            varmap: varmap.clone(),
            seed,
        }),
        dtype,
        device.clone(),
    )
}

/// The backend of [`seeded_var_builder`]: a [`VarMap`] and a seed.
struct SeededVarMap {
    varmap: VarMap,
    seed: u64,
}

impl SimpleBackend for SeededVarMap {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut vars = self
            .varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("creating {name}: the VarMap's lock is poisoned (a thread panicked while holding it)")))?;
        if let Some(var) = vars.get(name) {
            if var.shape() != &shape {
                candle_core::bail!(
                    "shape mismatch on {name}: asked for {shape:?}, the VarMap holds {:?}",
                    var.shape()
                );
            }
            return Ok(var.as_tensor().clone());
        }
        // Drawn in f64 on the host first: check that it can be, rather than abort.
        let spec = crate::train::weights::ParamSpec {
            name: name.to_string(),
            shape: shape.dims().to_vec(),
            dtype: DType::F64,
        };
        crate::train::shapes::check_allocatable(&[spec], &Device::Cpu)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let tensor = seeded_values(init, &shape, self.seed, name, dtype)?.to_device(device)?;
        let var = Var::from_tensor(&tensor)?;
        let tensor = var.as_tensor().clone();
        vars.insert(name.to_string(), var);
        Ok(tensor)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!(
            "`get_unchecked({name})` does not make sense for a seeded VarMap, use `get`"
        )
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap
            .data()
            .lock()
            .map(|vars| vars.contains_key(name))
            .unwrap_or(false)
    }
}

/// The values [`seeded_var_builder`] gives variable `name` of `shape` under `seed` with
/// `init`: drawn in f64 on the CPU, cast to `dtype` (ZeRO-3 draws each parameter this way and
/// keeps its rank's pieces).
pub(crate) fn seeded_values(
    init: Init,
    shape: &Shape,
    seed: u64,
    name: &str,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let values = draw(init, shape, rng_for(seed, name))?;
    Tensor::from_vec(values, shape.clone(), &Device::Cpu)?.to_dtype(dtype)
}

/// The generator of variable `name` under `seed`: FNV-1a of the name, mixed with the seed
/// (splitmix64), seeds a ChaCha8 stream. Stable across runs, platforms and releases.
fn rng_for(seed: u64, name: &str) -> ChaCha8Rng {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut z = h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ChaCha8Rng::seed_from_u64(z ^ (z >> 31))
}

/// A uniform number in `[0, 1)` with 53 random bits.
fn unit(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// `n` samples of `init` for a variable of `shape` (Candle's bounds and deviations).
fn draw(init: Init, shape: &Shape, mut rng: ChaCha8Rng) -> candle_core::Result<Vec<f64>> {
    let n = shape.elem_count();
    let uniform = |rng: &mut ChaCha8Rng, lo: f64, up: f64| -> Vec<f64> {
        (0..n).map(|_| lo + (up - lo) * unit(rng)).collect()
    };
    // Box-Muller: two normal samples per pair of uniforms.
    let normal = |rng: &mut ChaCha8Rng, mean: f64, std: f64| -> Vec<f64> {
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let (u1, u2) = (1.0 - unit(rng), unit(rng));
            let r = (-2.0 * u1.ln()).sqrt();
            let t = std::f64::consts::TAU * u2;
            out.push(mean + std * r * t.cos());
            out.push(mean + std * r * t.sin());
        }
        out.truncate(n);
        out
    };
    Ok(match init {
        Init::Const(c) => vec![c; n],
        Init::Uniform { lo, up } => uniform(&mut rng, lo, up),
        Init::Randn { mean, stdev } => normal(&mut rng, mean, stdev),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape).max(1) as f64).sqrt();
            match dist {
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    uniform(&mut rng, -bound, bound)
                }
                NormalOrUniform::Normal => normal(&mut rng, 0.0, std),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(init: Init, name: &str, seed: u64) -> Vec<f64> {
        draw(init, &Shape::from((64, 32)), rng_for(seed, name)).unwrap()
    }

    #[test]
    fn same_seed_and_name_same_values_else_different() {
        let init = candle_nn::init::DEFAULT_KAIMING_NORMAL;
        assert_eq!(values(init, "fc.weight", 1), values(init, "fc.weight", 1));
        assert_ne!(values(init, "fc.weight", 1), values(init, "fc.weight", 2));
        assert_ne!(values(init, "fc.weight", 1), values(init, "fc2.weight", 1));
    }

    #[test]
    fn the_samples_follow_the_init() {
        let mean_std = |v: &[f64]| {
            let m = v.iter().sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len() as f64;
            (m, var.sqrt())
        };
        let v = values(
            Init::Randn {
                mean: 1.0,
                stdev: 2.0,
            },
            "w",
            3,
        );
        let (m, s) = mean_std(&v);
        assert!((m - 1.0).abs() < 0.15 && (s - 2.0).abs() < 0.1, "{m} {s}");
        let v = values(Init::Uniform { lo: -0.5, up: 0.25 }, "w", 3);
        assert!(v.iter().all(|x| (-0.5..0.25).contains(x)));
        let (m, _) = mean_std(&v);
        assert!((m + 0.125).abs() < 0.02, "{m}");
        assert!(values(Init::Const(0.5), "w", 3).iter().all(|x| *x == 0.5));
        // Kaiming uniform, fan-in 32, ReLU gain: bound sqrt(3) * sqrt(2) / sqrt(32).
        let v = values(candle_nn::init::DEFAULT_KAIMING_UNIFORM, "w", 3);
        let bound = 3f64.sqrt() * 2f64.sqrt() / 32f64.sqrt();
        assert!(v.iter().all(|x| x.abs() <= bound));
        assert!(v.iter().any(|x| x.abs() > 0.9 * bound));
    }

    #[test]
    fn existing_variables_are_kept_and_shapes_checked() {
        let varmap = VarMap::new();
        let vb = seeded_var_builder(&varmap, 0, DType::F32, &Device::Cpu);
        let a = vb.get_with_hints((2, 3), "w", Init::Const(1.0)).unwrap();
        let b = vb.get_with_hints((2, 3), "w", Init::Const(5.0)).unwrap();
        assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        assert_eq!(varmap.all_vars().len(), 1);
        let e = vb
            .get_with_hints((3, 2), "w", Init::Const(1.0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("shape mismatch on w"), "{e}");
    }
}
