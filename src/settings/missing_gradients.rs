//! [`MissingGradients`]: what to do when registered parameters receive no gradient, a setting
//! like any other (builder, `ACCELERATE_RS_MISSING_GRADIENTS`, config file key
//! `missing_gradients`).

/// What the first optimizer step does when some registered (trainable) parameters received no
/// gradient on every rank: the `missing_gradients` setting
/// ([`AcceleratorBuilder::missing_gradients`](crate::AcceleratorBuilder::missing_gradients) >
/// `ACCELERATE_RS_MISSING_GRADIENTS` > config key `missing_gradients` > `warn`).
///
/// The usual cause is a Candle op without a backward pass upstream of those parameters:
/// `candle_nn::LayerNorm`'s fused fast path, `candle_nn::RmsNorm` and
/// `candle_nn::ops::softmax_last_dim` cut the graph, so everything before them silently stops
/// learning while the loss still falls. The check runs once, on the first sync step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingGradients {
    /// Print one warning on the main process naming the parameters (the default).
    #[default]
    Warn,
    /// Fail the first optimizer step with [`Error::MissingGradients`](crate::Error::MissingGradients) on every rank.
    Error,
    /// Do not check (parameters frozen on purpose).
    Off,
}

impl std::str::FromStr for MissingGradients {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "warn" => Ok(MissingGradients::Warn),
            "error" => Ok(MissingGradients::Error),
            "off" => Ok(MissingGradients::Off),
            _ => Err(format!("expected `warn`, `error` or `off`, got {s:?}")),
        }
    }
}

impl MissingGradients {
    /// The setting's name: `warn`, `error` or `off`.
    pub fn as_str(self) -> &'static str {
        match self {
            MissingGradients::Warn => "warn",
            MissingGradients::Error => "error",
            MissingGradients::Off => "off",
        }
    }
}

impl crate::settings::parse::Setting for MissingGradients {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_name_and_rejects_others() {
        for m in [
            MissingGradients::Warn,
            MissingGradients::Error,
            MissingGradients::Off,
        ] {
            assert_eq!(m.as_str().parse::<MissingGradients>(), Ok(m));
            assert_eq!(m.as_str().to_uppercase().parse::<MissingGradients>(), Ok(m));
        }
        for bad in ["", "no", "warning", "1"] {
            let e = bad.parse::<MissingGradients>().unwrap_err();
            assert!(e.contains("`warn`, `error` or `off`"), "{e}");
        }
    }
}
