//! Rotary position embeddings (RoPE) as the decoders use them: the inverse frequencies, with
//! `transformers`' default, `linear`, `llama3` and `longrope` (Phi-3's, also called `su`)
//! scalings, partial rotation (`partial_rotary_factor`), and their application to queries and
//! keys.

use std::path::Path;

use candle_core::{DType, Device, Result, Tensor};
use serde_json::Value;

use crate::config::ensure_positive;
use crate::error::{Error, Result as CrateResult};

/// How the inverse frequencies are scaled (`rope_parameters` / `rope_scaling` in `config.json`).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum RopeScaling {
    /// `default`: `θ^(-2i/d)`.
    Default,
    /// `linear`: positions divided by `factor` (the frequencies too).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// `llama3`: Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// `factor`: the low frequencies are divided by it.
        factor: f64,
        /// `low_freq_factor`.
        low_freq_factor: f64,
        /// `high_freq_factor`.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f64,
    },
    /// `longrope` (`su`): Phi-3's per-frequency factors, the short ones up to
    /// `original_max_position_embeddings` positions and the long ones beyond, with cos and sin
    /// scaled by `attention_factor`.
    LongRope {
        /// `short_factor`: one divisor per frequency, for sequences up to the original length.
        short_factor: Vec<f64>,
        /// `long_factor`: one divisor per frequency, for longer sequences.
        long_factor: Vec<f64>,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f64,
        /// The factor on cos and sin: `attention_factor`, by default
        /// `sqrt(1 + ln(factor) / ln(original))` with `factor` the context's extension.
        attention_factor: f64,
    },
}

/// RoPE settings: the base θ, the scaling, and the share of each head that is rotated.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// `rope_theta`.
    pub theta: f64,
    /// The scaling.
    pub scaling: RopeScaling,
    /// `partial_rotary_factor`: the first `head_dim × factor` features of each head are
    /// rotated, the others pass (1.0: all of them).
    pub partial_rotary_factor: f64,
}

fn number(
    map: &serde_json::Map<String, Value>,
    key: &str,
    path: &Path,
    at: &str,
) -> CrateResult<f64> {
    match map.get(key) {
        Some(v) => v.as_f64().ok_or_else(|| {
            Error::config(
                path,
                Some(&format!("{at}.{key}")),
                format!("expected a number, got {v}"),
            )
        }),
        None => Err(Error::config(
            path,
            Some(&format!("{at}.{key}")),
            "missing (required by this rope_type)",
        )),
    }
}

impl RopeConfig {
    /// From a `config.json`: `rope_parameters` (transformers 5: `rope_type`, `rope_theta` and the
    /// scaling's keys), else `rope_theta` and `rope_scaling` (transformers 4; its `type` or
    /// `rope_type`). A scaling other than `default`, `linear` and `llama3` is an error naming
    /// the key and the value.
    pub fn from_json(
        path: &Path,
        rope_theta: Option<f64>,
        rope_scaling: Option<&Value>,
        rope_parameters: Option<&Value>,
    ) -> CrateResult<Self> {
        let (at, params) = match (rope_parameters, rope_scaling) {
            (Some(p), _) if !p.is_null() => ("rope_parameters", Some(p)),
            (_, Some(s)) if !s.is_null() => ("rope_scaling", Some(s)),
            _ => ("rope_scaling", None),
        };
        let map = match params {
            None => None,
            Some(Value::Object(m)) => Some(m),
            Some(other) => {
                return Err(Error::config(
                    path,
                    Some(at),
                    format!("expected an object, got {other}"),
                ))
            }
        };
        // In transformers 5's `rope_parameters` (or a `rope_scaling` holding it), else at the top.
        let (theta, theta_key) = match map.and_then(|m| m.get("rope_theta")) {
            Some(v) => {
                let key = format!("{at}.rope_theta");
                let theta = v
                    .as_f64()
                    .ok_or_else(|| Error::config(path, Some(&key), "expected a number"))?;
                (theta, key)
            }
            None => (rope_theta.unwrap_or(10_000.0), "rope_theta".to_string()),
        };
        ensure_positive(path, &[(&theta_key, theta)])?;
        let Some(map) = map else {
            return Ok(RopeConfig {
                theta,
                scaling: RopeScaling::Default,
                partial_rotary_factor: 1.0,
            });
        };
        let partial_rotary_factor = match map.get("partial_rotary_factor") {
            None | Some(Value::Null) => 1.0,
            Some(_) => number(map, "partial_rotary_factor", path, at)?,
        };
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
            return Err(Error::config(
                path,
                Some(&format!("{at}.partial_rotary_factor")),
                format!("{partial_rotary_factor}: must be in (0, 1]"),
            ));
        }
        let (type_key, kind) = match (map.get("rope_type"), map.get("type")) {
            (Some(v), _) => ("rope_type", v),
            (None, Some(v)) => ("type", v),
            (None, None) => ("rope_type", &Value::Null),
        };
        let kind = match kind {
            Value::Null => "default",
            Value::String(s) => s.as_str(),
            other => {
                return Err(Error::config(
                    path,
                    Some(&format!("{at}.{type_key}")),
                    format!("expected a string, got {other}"),
                ))
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: number(map, "factor", path, at)?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: number(map, "factor", path, at)?,
                low_freq_factor: number(map, "low_freq_factor", path, at)?,
                high_freq_factor: number(map, "high_freq_factor", path, at)?,
                original_max_position_embeddings: number(
                    map,
                    "original_max_position_embeddings",
                    path,
                    at,
                )?,
            },
            "longrope" | "su" => long_rope(map, path, at)?,
            other => {
                return Err(Error::config(
                    path,
                    Some(&format!("{at}.{type_key}")),
                    format!(
                        "RoPE scaling `{other}` is not implemented (supported: default, linear, \
                         llama3, longrope)"
                    ),
                ))
            }
        };
        check_values(path, at, &scaling)?;
        Ok(RopeConfig {
            theta,
            scaling,
            partial_rotary_factor,
        })
    }

    /// The features of a `head_dim`-wide head that are rotated (`partial_rotary_factor`).
    pub fn rotary_dim(&self, head_dim: usize) -> usize {
        (head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Checks the settings against the head width: an even rotated width, and for `longrope`
    /// one factor per frequency; the error names `path`'s `key`.
    pub fn check_head_dim(&self, path: &Path, key: &str, head_dim: usize) -> CrateResult<()> {
        let d = self.rotary_dim(head_dim);
        if d == 0 || !d.is_multiple_of(2) {
            return Err(Error::config(
                path,
                Some(key),
                format!("{d} rotated features per head (head_dim {head_dim}): RoPE needs an even, nonzero number"),
            ));
        }
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            ..
        } = &self.scaling
        {
            if short_factor.len() != d / 2 || long_factor.len() != d / 2 {
                return Err(Error::config(
                    path,
                    Some(key),
                    format!(
                        "longrope has {} short and {} long factors; {} rotated features per head need {} of each",
                        short_factor.len(),
                        long_factor.len(),
                        d,
                        d / 2
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The factor on cos and sin (`longrope`'s `attention_factor`; 1 otherwise).
    pub fn attention_factor(&self) -> f64 {
        match self.scaling {
            RopeScaling::LongRope {
                attention_factor, ..
            } => attention_factor,
            _ => 1.0,
        }
    }

    /// The inverse frequencies for sequences of `seq_len` positions: [`inv_freq`](Self::inv_freq),
    /// except that `longrope` takes its long factors beyond its original length, as
    /// `transformers` does for the longest position of the batch.
    pub fn inv_freq_for(&self, head_dim: usize, seq_len: usize) -> Vec<f32> {
        if let RopeScaling::LongRope {
            long_factor,
            original_max_position_embeddings,
            ..
        } = &self.scaling
        {
            if seq_len as f64 > *original_max_position_embeddings {
                return self.long_rope_freqs(head_dim, long_factor);
            }
        }
        self.inv_freq(head_dim)
    }

    /// `1 / (factor_i θ^(2i/d))` over the rotated width `d`, in f32 as `transformers` does.
    fn long_rope_freqs(&self, head_dim: usize, factors: &[f64]) -> Vec<f32> {
        let d = self.rotary_dim(head_dim);
        let base = self.theta as f32;
        (0..d / 2)
            .map(|i| {
                let f = factors.get(i).copied().unwrap_or(1.0) as f32;
                1.0 / (f * base.powf((2 * i) as f32 / d as f32))
            })
            .collect()
    }

    /// The `rotary_dim / 2` inverse frequencies (`head_dim / 2` without partial rotation),
    /// computed in f32 as `transformers` does; `longrope`'s short ones.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let d = self.rotary_dim(head_dim);
        let base = self.theta as f32;
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        match self.scaling {
            RopeScaling::LongRope {
                ref short_factor, ..
            } => self.long_rope_freqs(head_dim, short_factor),
            RopeScaling::Default => inv,
            RopeScaling::Linear { factor } => inv.iter().map(|f| f / factor as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high, old) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    original_max_position_embeddings as f32,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                inv.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        }
    }
}

/// The cos and sin tables `[T, rotary_dim / 2]` for positions `0..t`, multiplied by `scale`
/// (`longrope`'s attention factor; 1 otherwise), in `dtype`.
pub(crate) fn tables(
    inv_freq: &[f32],
    t: usize,
    scale: f32,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for p in 0..t {
        for &f in inv_freq {
            let angle = p as f32 * f;
            cos.push(angle.cos() * scale);
            sin.push(angle.sin() * scale);
        }
    }
    let cos = Tensor::from_vec(cos, (t, half), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (t, half), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// RoPE on `x` `[B, H, T, D]` with `cos`, `sin` `[T, R / 2]` (or `[B, T, R / 2]`: one table
/// per row, at its position ids), the halves of the first `R`
/// features rotated (`transformers`' `rotate_half`), the other `D - R` passed as they are:
/// `accelerate_rs::nn::rope`, fused and differentiable (its backward reaches the query and key
/// projections).
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(3)?;
    let r = 2 * cos.dim(candle_core::D::Minus1)?;
    if r >= d {
        return accelerate_rs::nn::rope(&x.contiguous()?, cos, sin);
    }
    let rotated = accelerate_rs::nn::rope(&x.narrow(3, 0, r)?.contiguous()?, cos, sin)?;
    Tensor::cat(&[&rotated, &x.narrow(3, r, d - r)?], 3)
}

/// Checks the numbers of a RoPE scaling: positive and finite, Llama 3's high frequency factor
/// above its low one; the error names the first key that is wrong (`rope_parameters.factor`).
fn check_values(path: &Path, at: &str, scaling: &RopeScaling) -> CrateResult<()> {
    let positive = |v: f64| v.is_finite() && v > 0.0;
    let mut numbers = vec![];
    match scaling {
        RopeScaling::Default => {}
        RopeScaling::Linear { factor } => numbers.push(("factor", *factor)),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            numbers.extend([
                ("factor", *factor),
                ("low_freq_factor", *low_freq_factor),
                ("high_freq_factor", *high_freq_factor),
                (
                    "original_max_position_embeddings",
                    *original_max_position_embeddings,
                ),
            ]);
        }
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => {
            let lists = [("short_factor", short_factor), ("long_factor", long_factor)];
            for (key, list) in lists {
                if let Some((i, &f)) = list.iter().enumerate().find(|(_, &f)| !positive(f)) {
                    ensure_positive(path, &[(&format!("{at}.{key}[{i}]"), f)])?;
                }
            }
            numbers.extend([
                (
                    "original_max_position_embeddings",
                    *original_max_position_embeddings,
                ),
                ("attention_factor", *attention_factor),
            ]);
        }
    }
    for (key, v) in numbers {
        ensure_positive(path, &[(&format!("{at}.{key}"), v)])?;
    }
    if let RopeScaling::Llama3 {
        low_freq_factor: low,
        high_freq_factor: high,
        ..
    } = *scaling
    {
        if high <= low {
            return Err(Error::config(
                path,
                Some(&format!("{at}.high_freq_factor")),
                format!("{high}: must be above low_freq_factor ({low})"),
            ));
        }
    }
    Ok(())
}

/// `longrope`'s settings from `rope_parameters` (or `rope_scaling`) `map`, named `at` in errors.
fn long_rope(
    map: &serde_json::Map<String, Value>,
    path: &Path,
    at: &str,
) -> CrateResult<RopeScaling> {
    let factors = |key: &str| -> CrateResult<Vec<f64>> {
        let bad = |why: &str| Error::config(path, Some(&format!("{at}.{key}")), why.to_string());
        match map.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_f64().ok_or_else(|| bad("expected a list of numbers")))
                .collect(),
            Some(_) => Err(bad("expected a list of numbers")),
            None => Err(bad("missing (required by longrope)")),
        }
    };
    let original = number(map, "original_max_position_embeddings", path, at)?;
    let factor = match (map.get("factor"), map.get("max_position_embeddings")) {
        (Some(v), _) if !v.is_null() => number(map, "factor", path, at)?,
        (_, Some(v)) if !v.is_null() => {
            number(map, "max_position_embeddings", path, at)? / original
        }
        _ => number(map, "factor", path, at)?,
    };
    let attention_factor = match map.get("attention_factor") {
        Some(v) if !v.is_null() => number(map, "attention_factor", path, at)?,
        _ if factor <= 1.0 => 1.0,
        _ => (1.0 + factor.ln() / original.ln()).sqrt(),
    };
    Ok(RopeScaling::LongRope {
        short_factor: factors("short_factor")?,
        long_factor: factors("long_factor")?,
        original_max_position_embeddings: original,
        attention_factor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `longrope`: the short factors up to the original length, the long ones beyond, the
    /// default attention factor `sqrt(1 + ln(factor) / ln(original))`, partial rotation.
    #[test]
    fn longrope_picks_its_factors_by_length() {
        let params = serde_json::json!({
            "rope_type": "su", "rope_theta": 100.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0],
            "original_max_position_embeddings": 4, "max_position_embeddings": 64,
        });
        let c = RopeConfig::from_json(Path::new("c"), None, None, Some(&params)).unwrap();
        assert_eq!(c.rotary_dim(8), 4);
        let base = |i: usize| 100f32.powf((2 * i) as f32 / 4.0);
        let short: Vec<f32> = (0..2).map(|i| 1.0 / ([1.0, 2.0][i] * base(i))).collect();
        let long: Vec<f32> = (0..2).map(|i| 1.0 / ([3.0, 4.0][i] * base(i))).collect();
        assert_eq!(c.inv_freq_for(8, 4), short);
        assert_eq!(c.inv_freq_for(8, 5), long);
        let want = (1.0 + 16f64.ln() / 4f64.ln()).sqrt();
        assert!((c.attention_factor() - want).abs() < 1e-12);
        // One factor too few for the rotated width is named.
        let e = c
            .check_head_dim(Path::new("c"), "head_dim", 16)
            .unwrap_err();
        assert!(e.to_string().contains("longrope"), "{e}");
        // No extension factor and no max_position_embeddings: the key is named.
        let mut bad = params.clone();
        bad.as_object_mut()
            .unwrap()
            .remove("max_position_embeddings");
        let e = RopeConfig::from_json(Path::new("c"), None, None, Some(&bad)).unwrap_err();
        assert!(e.to_string().contains("factor"), "{e}");
    }
}
