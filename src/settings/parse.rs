//! One strict parser for the text of every setting, and [`pick`], the one precedence.
//!
//! Every environment variable accelerate-rs reads goes through [`env_value`] (or
//! [`process_env`]): an empty value counts as unset, anything else must parse, and a value that
//! does not is an [`Error::Env`] naming the variable, the value and what was expected. A typo
//! such as `ACCELERATE_RS_OVERLAP=yes-please` is an error, never a silent "on".

use crate::error::{Error, Result};

/// A value that a setting can hold, parsed from its text form.
pub(crate) trait Setting: Sized {
    /// Parses a trimmed, non-empty value, or says what was expected.
    fn parse_setting(s: &str) -> std::result::Result<Self, String>;
}

impl Setting for bool {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(true),
            "0" | "false" | "no" | "off" => Ok(false),
            _ => Err("expected 1/0, true/false, yes/no or on/off".into()),
        }
    }
}

impl Setting for usize {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        if !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err("expected a non-negative integer".into());
        }
        s.parse().map_err(|_| "integer out of range".into())
    }
}

impl Setting for u16 {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        s.parse()
            .map_err(|_| "expected a port number 0-65535".into())
    }
}

/// A finite number above zero (timeouts, sizes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Positive(pub(crate) f64);

impl Setting for Positive {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        match s.parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(Positive(x)),
            _ => Err("expected a positive number".into()),
        }
    }
}

/// A duration in seconds within [`limits::checked_secs`](super::limits::checked_secs)'s range
/// (above 0, at most a week).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Secs(pub(crate) std::time::Duration);

impl Setting for Secs {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        let v: f64 = s
            .parse()
            .map_err(|_| "expected a number of seconds".to_string())?;
        super::limits::checked_secs(v, false).map(Secs)
    }
}

/// A count as launchers write it: a non-negative integer, where SLURM's `4(x2)` (4 tasks on each
/// of 2 nodes) reads 4.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Count(pub(crate) usize);

impl Setting for Count {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        let (n, rest) = s.split_at(digits);
        if n.is_empty() || !(rest.is_empty() || rest.starts_with("(x")) {
            return Err("expected a non-negative integer".into());
        }
        n.parse()
            .map(Count)
            .map_err(|_| "integer out of range".into())
    }
}

/// A number of bytes: digits, optionally followed by `B`, `KiB`, `MiB`, `GiB` or `TiB` (also
/// `K`, `M`, `G`, `T`; powers of 1024).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bytes(pub(crate) u64);

impl Setting for Bytes {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        const EXPECTED: &str = "expected a number of bytes, optionally with a suffix B, KiB, MiB, GiB or TiB (e.g. 512MiB)";
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        let (n, unit) = s.split_at(digits);
        let n: u64 = n.parse().map_err(|_| EXPECTED.to_string())?;
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kib" => 10,
            "m" | "mib" => 20,
            "g" | "gib" => 30,
            "t" | "tib" => 40,
            _ => return Err(EXPECTED.into()),
        };
        n.checked_mul(1u64 << shift)
            .map(Bytes)
            .ok_or_else(|| format!("{s} is more bytes than fit in 64 bits"))
    }
}

impl Setting for String {
    fn parse_setting(s: &str) -> std::result::Result<Self, String> {
        Ok(s.to_string())
    }
}

/// Parses `value`, the value of variable `var`.
pub(crate) fn parse<T: Setting>(var: &str, value: &str) -> Result<T> {
    T::parse_setting(value.trim()).map_err(|reason| Error::Env {
        var: var.into(),
        value: value.into(),
        reason,
    })
}

/// The variable `var` read through `getenv`, parsed; `None` when unset or empty.
pub(crate) fn env_value<T: Setting>(
    getenv: &dyn Fn(&str) -> Option<String>,
    var: &str,
) -> Result<Option<T>> {
    match getenv(var).filter(|v| !v.trim().is_empty()) {
        Some(v) => parse(var, &v).map(Some),
        None => Ok(None),
    }
}

/// [`env_value`] on this process's environment.
pub(crate) fn process_env<T: Setting>(var: &str) -> Result<Option<T>> {
    env_value(&|k| std::env::var(k).ok(), var)
}

/// The precedence of every setting: a builder call beats the environment variable, which beats
/// the config file, which beats the default.
pub(crate) fn pick<T>(builder: Option<T>, env: Option<T>, file: Option<T>, default: T) -> T {
    builder.or(env).or(file).unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(var: &'static str, value: &'static str) -> impl Fn(&str) -> Option<String> {
        move |k| (k == var).then(|| value.to_string())
    }

    #[test]
    fn typos_are_errors_naming_the_variable_and_value() {
        let e = env_value::<bool>(
            &env_of("ACCELERATE_RS_OVERLAP", "yes-please"),
            "ACCELERATE_RS_OVERLAP",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("ACCELERATE_RS_OVERLAP") && e.contains("yes-please"),
            "{e}"
        );
        assert!(env_value::<usize>(&env_of("N", "4(x2)"), "N").is_err());
        assert!(env_value::<Positive>(&env_of("T", "-3"), "T").is_err());
        assert!(env_value::<u16>(&env_of("P", "99999"), "P").is_err());
    }

    #[test]
    fn values_parse_and_empty_is_unset() {
        assert_eq!(
            env_value::<bool>(&env_of("B", " On "), "B").unwrap(),
            Some(true)
        );
        assert_eq!(
            env_value::<bool>(&env_of("B", "0"), "B").unwrap(),
            Some(false)
        );
        assert_eq!(env_value::<bool>(&env_of("B", "  "), "B").unwrap(), None);
        assert_eq!(env_value::<bool>(&env_of("X", "1"), "B").unwrap(), None);
        assert_eq!(
            env_value::<Count>(&env_of("C", "4(x2)"), "C").unwrap(),
            Some(Count(4))
        );
        assert_eq!(
            env_value::<usize>(&env_of("N", "12"), "N").unwrap(),
            Some(12)
        );
    }

    #[test]
    fn byte_sizes_parse_with_binary_suffixes_and_refuse_the_rest() {
        let b = |v: &'static str| env_value::<Bytes>(&env_of("M", v), "M");
        assert_eq!(b("1048576").unwrap(), Some(Bytes(1 << 20)));
        assert_eq!(b("64KiB").unwrap(), Some(Bytes(64 << 10)));
        assert_eq!(b("3 MiB").unwrap(), Some(Bytes(3 << 20)));
        assert_eq!(b("2g").unwrap(), Some(Bytes(2 << 30)));
        assert_eq!(b("7B").unwrap(), Some(Bytes(7)));
        for bad in ["MiB", "-1", "1.5GiB", "12 parsecs", "99999999999TiB"] {
            let e = b(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("M={bad:?}")), "{e}");
        }
    }

    #[test]
    fn pick_follows_builder_env_file_default() {
        assert_eq!(pick(Some(1), Some(2), Some(3), 4), 1);
        assert_eq!(pick(None, Some(2), Some(3), 4), 2);
        assert_eq!(pick(None, None, Some(3), 4), 3);
        assert_eq!(pick(None, None, None, 4), 4);
    }
}
