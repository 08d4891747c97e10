//! Rotary position embeddings (RoPE) as the Llama family uses them: the inverse frequencies, with
//! `transformers`' default, `linear` and `llama3` scalings, and their application to queries and
//! keys.

use std::path::Path;

use candle_core::{DType, Device, Result, Tensor};
use serde_json::Value;

use crate::error::{Error, Result as CrateResult};

/// How the inverse frequencies are scaled (`rope_parameters` / `rope_scaling` in `config.json`).
#[derive(Debug, Clone, Copy, PartialEq)]
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
}

/// RoPE settings: the base θ and the scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// `rope_theta`.
    pub theta: f64,
    /// The scaling.
    pub scaling: RopeScaling,
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
        let theta = match map.and_then(|m| m.get("rope_theta")) {
            Some(v) => v.as_f64().ok_or_else(|| {
                Error::config(path, Some(&format!("{at}.rope_theta")), "expected a number")
            })?,
            None => rope_theta.unwrap_or(10_000.0),
        };
        let Some(map) = map else {
            return Ok(RopeConfig {
                theta,
                scaling: RopeScaling::Default,
            });
        };
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
            other => {
                return Err(Error::config(
                    path,
                    Some(&format!("{at}.{type_key}")),
                    format!(
                        "RoPE scaling `{other}` is not implemented (supported: default, linear, \
                         llama3)"
                    ),
                ))
            }
        };
        let positive = |v: f64| v.is_finite() && v > 0.0;
        let ok = positive(theta)
            && match scaling {
                RopeScaling::Default => true,
                RopeScaling::Linear { factor } => positive(factor),
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => {
                    positive(factor)
                        && positive(low_freq_factor)
                        && positive(original_max_position_embeddings)
                        && high_freq_factor > low_freq_factor
                }
            };
        if !ok {
            return Err(Error::config(
                path,
                Some(at),
                format!(
                    "invalid values: theta {theta}, {scaling:?} (positive numbers expected, \
                     high_freq_factor above low_freq_factor)"
                ),
            ));
        }
        Ok(RopeConfig { theta, scaling })
    }

    /// The `head_dim / 2` inverse frequencies, computed in f32 as `transformers` does.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let base = self.theta as f32;
        let inv: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        match self.scaling {
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

/// The cos and sin tables `[T, head_dim / 2]` for positions `0..t`, in `dtype`.
pub(crate) fn tables(
    inv_freq: &[f32],
    t: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for p in 0..t {
        for &f in inv_freq {
            let angle = p as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let cos = Tensor::from_vec(cos, (t, half), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (t, half), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// RoPE on `x` `[B, H, T, D]` with `cos`, `sin` `[T, D / 2]`, the halves rotated
/// (`transformers`' `rotate_half`): `accelerate_rs::nn::rope`, fused and differentiable (its
/// backward reaches the query and key projections).
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    accelerate_rs::nn::rope(x, cos, sin)
}
