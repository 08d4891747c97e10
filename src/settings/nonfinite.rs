//! [`NonFinite`]: what training does when the gradients turn non-finite (NaN or infinite), a
//! setting like any other (builder, `ACCELERATE_RS_NONFINITE`, config file key `nonfinite`).

/// What an optimizer step does when the averaged gradients hold a NaN or an infinity, outside
/// fp16 loss scaling (which skips such steps and lowers its scale on its own): the `nonfinite`
/// setting ([`AcceleratorBuilder::nonfinite`](crate::AcceleratorBuilder::nonfinite) >
/// `ACCELERATE_RS_NONFINITE` > config key `nonfinite` > `error`).
///
/// A loss gone to NaN (a learning rate too high, an epsilon of 0 in a configuration, a bad batch)
/// otherwise trains on quietly and the model saved at the end computes nothing but NaN. The check
/// costs one pass over the gradients and one scalar read per optimizer step (none when the
/// gradient norm is already computed for clipping); under ZeRO stage 2 one small all-reduce makes
/// every rank reach the same verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NonFinite {
    /// Stop with [`Error::NonFinite`](crate::Error::NonFinite) on every rank, naming the step,
    /// the rank and the first parameter whose gradient is not finite (the default).
    #[default]
    Error,
    /// Warn on the main process and step anyway.
    Warn,
    /// Warn on the main process and skip the step (the parameters and the optimizer state stay
    /// as they were), as fp16 loss scaling does on an overflow.
    SkipStep,
    /// Do not check.
    Off,
}

impl std::str::FromStr for NonFinite {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "error" => Ok(NonFinite::Error),
            "warn" => Ok(NonFinite::Warn),
            "skip-step" => Ok(NonFinite::SkipStep),
            "off" => Ok(NonFinite::Off),
            _ => Err(format!(
                "expected `error`, `warn`, `skip-step` or `off`, got {s:?}"
            )),
        }
    }
}

impl NonFinite {
    /// The setting's name: `error`, `warn`, `skip-step` or `off`.
    pub fn as_str(self) -> &'static str {
        match self {
            NonFinite::Error => "error",
            NonFinite::Warn => "warn",
            NonFinite::SkipStep => "skip-step",
            NonFinite::Off => "off",
        }
    }
}

impl crate::settings::parse::Setting for NonFinite {
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
            NonFinite::Error,
            NonFinite::Warn,
            NonFinite::SkipStep,
            NonFinite::Off,
        ] {
            assert_eq!(m.as_str().parse::<NonFinite>(), Ok(m));
            assert_eq!(m.as_str().to_uppercase().parse::<NonFinite>(), Ok(m));
        }
        assert_eq!("skip_step".parse::<NonFinite>(), Ok(NonFinite::SkipStep));
        for bad in ["", "no", "skip", "1"] {
            let e = bad.parse::<NonFinite>().unwrap_err();
            assert!(e.contains("`skip-step`"), "{e}");
        }
        let t: toml::Value = toml::from_str("v = \"skip-step\"").unwrap();
        let v: NonFinite = t["v"].clone().try_into().unwrap();
        assert_eq!(v, NonFinite::SkipStep);
    }
}
