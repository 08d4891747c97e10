//! What chat templates expect of Python: `json.dumps` (the `tojson` filter `transformers`
//! installs), `str()` of a value (printing `{{ value }}`, the `string` filter) and
//! `datetime.strftime` (`strftime_now`).

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// The options of `json.dumps` that `transformers`' `tojson` passes on.
#[derive(Debug, Clone)]
pub(crate) struct JsonStyle {
    /// `indent`: `None` for one line.
    pub indent: Option<String>,
    /// `ensure_ascii` (`transformers`' default: false).
    pub ensure_ascii: bool,
    /// `separators`: (item, key) separators.
    pub item_separator: String,
    pub key_separator: String,
    /// `sort_keys`.
    pub sort_keys: bool,
}

impl JsonStyle {
    /// `json.dumps`' defaults for `indent` (its item separator is `","` with an indent, `", "`
    /// without).
    pub(crate) fn new(indent: Option<String>) -> Self {
        let item_separator = if indent.is_some() { "," } else { ", " };
        JsonStyle {
            indent,
            ensure_ascii: false,
            item_separator: item_separator.into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

/// `json.dumps(value, ...)`.
pub(crate) fn dumps(value: &Value, style: &JsonStyle) -> Result<String, Error> {
    let mut out = String::new();
    write_json(&mut out, value, style, 0)?;
    Ok(out)
}

fn newline_indent(out: &mut String, style: &JsonStyle, level: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&py_number(value)),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline_indent(out, style, level + 1);
                write_json(out, item, style, level + 1)?;
            }
            newline_indent(out, style, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                let key = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => py_str(&key),
                };
                entries.push((key, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline_indent(out, style, level + 1);
                write_json_string(out, key, style);
                out.push_str(&style.key_separator);
                write_json(out, item, style, level + 1)?;
            }
            newline_indent(out, style, level);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A JSON string as Python's `json` writes it.
fn write_json_string(out: &mut String, s: &str, style: &JsonStyle) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if style.ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A number as Python prints it: an integer as is, a float as `repr` (`1.0`, `1e-05`, `inf`).
fn py_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(x) => py_float(x),
        Err(_) => value.to_string(),
    }
}

/// `repr(x)` of a Python float.
pub(crate) fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // The shortest digits that round-trip, and the decimal exponent.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
        } else {
            let point = point as usize;
            if digits.len() <= point {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let rest = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exp_sign = if exp < 0 { "-" } else { "+" };
        format!("{sign}{first}{rest}e{exp_sign}{:02}", exp.unsigned_abs())
    }
}

/// `str(value)` in Python: what Jinja2 prints for `{{ value }}` and the `string` filter gives
/// (`None`, `True`, `['a', 1]`, `{'k': 'v'}`); undefined prints nothing.
pub(crate) fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        ValueKind::Undefined => String::new(),
        _ => py_repr(value),
    }
}

/// `repr(value)` in Python.
fn py_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => {
            if value.is_integer() {
                value.to_string()
            } else {
                match f64::try_from(value.clone()) {
                    Ok(x) if x.is_nan() => "nan".into(),
                    Ok(x) if x.is_infinite() => if x > 0.0 { "inf" } else { "-inf" }.into(),
                    Ok(x) => py_float(x),
                    Err(_) => value.to_string(),
                }
            }
        }
        ValueKind::String => py_string_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq => match value.try_iter() {
            Ok(items) => format!(
                "[{}]",
                items.map(|v| py_repr(&v)).collect::<Vec<_>>().join(", ")
            ),
            Err(_) => value.to_string(),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                let entries: Vec<String> = keys
                    .map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        format!("{}: {}", py_repr(&k), py_repr(&v))
                    })
                    .collect();
                format!("{{{}}}", entries.join(", "))
            }
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// `repr(s)` of a Python string: single quotes unless it holds a single quote and no double.
fn py_string_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A calendar time (UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DateTime {
    pub year: i64,
    /// 1..=12.
    pub month: u32,
    /// 1..=31.
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 = Monday.
    pub weekday: u32,
    /// 1..=366.
    pub yday: u32,
}

impl DateTime {
    /// The UTC calendar time `secs` seconds after the Unix epoch.
    pub(crate) fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
        let yday = before + day + u32::from(leap && month > 2);
        DateTime {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
            // 1970-01-01 was a Thursday (3).
            weekday: (days + 3).rem_euclid(7) as u32,
            yday,
        }
    }

    /// `datetime.strftime(format)` for the C-standard directives (`%d %b %Y %H:%M` ...); an
    /// unknown directive is kept as written, as Python does.
    pub(crate) fn strftime(&self, format: &str) -> String {
        let month = MONTHS[(self.month as usize + 11) % 12];
        let day = DAYS[self.weekday as usize % 7];
        let hour12 = match self.hour % 12 {
            0 => 12,
            h => h,
        };
        let mut out = String::new();
        let mut chars = format.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let Some(d) = chars.next() else {
                out.push('%');
                break;
            };
            let _ = match d {
                'Y' => write!(out, "{}", self.year),
                'y' => write!(out, "{:02}", self.year.rem_euclid(100)),
                'm' => write!(out, "{:02}", self.month),
                'd' => write!(out, "{:02}", self.day),
                'e' => write!(out, "{:>2}", self.day),
                'H' => write!(out, "{:02}", self.hour),
                'I' => write!(out, "{hour12:02}"),
                'M' => write!(out, "{:02}", self.minute),
                'S' => write!(out, "{:02}", self.second),
                'p' => write!(out, "{}", if self.hour < 12 { "AM" } else { "PM" }),
                'B' => write!(out, "{month}"),
                'b' | 'h' => write!(out, "{}", &month[..3]),
                'A' => write!(out, "{day}"),
                'a' => write!(out, "{}", &day[..3]),
                'j' => write!(out, "{:03}", self.yday),
                'w' => write!(out, "{}", (self.weekday + 1) % 7),
                'u' => write!(out, "{}", self.weekday + 1),
                'F' => write!(out, "{}-{:02}-{:02}", self.year, self.month, self.day),
                'T' => write!(
                    out,
                    "{:02}:{:02}:{:02}",
                    self.hour, self.minute, self.second
                ),
                '%' => write!(out, "%"),
                other => write!(out, "%{other}"),
            };
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (1e15, "1000000000000000.0"),
        ] {
            assert_eq!(py_float(x), want, "{x}");
        }
    }

    #[test]
    fn json_matches_python_dumps() {
        let v: Value =
            serde_json::from_str(r#"{"b": [1, 2.5, "é\n\"<"], "a": {}, "c": null, "d": true}"#)
                .unwrap();
        assert_eq!(
            dumps(&v, &JsonStyle::new(None)).unwrap(),
            r#"{"b": [1, 2.5, "é\n\"<"], "a": {}, "c": null, "d": true}"#
        );
        let indented = dumps(&v, &JsonStyle::new(Some("  ".into()))).unwrap();
        assert_eq!(
            indented,
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\\\"<\"\n  ],\n  \"a\": {},\n  \"c\": null,\n  \"d\": true\n}"
        );
        let mut ascii = JsonStyle::new(None);
        ascii.ensure_ascii = true;
        ascii.sort_keys = true;
        let v: Value = serde_json::from_str(r#"{"z": "é👋", "a": 1}"#).unwrap();
        assert_eq!(
            dumps(&v, &ascii).unwrap(),
            r#"{"a": 1, "z": "\u00e9\ud83d\udc4b"}"#
        );
    }

    #[test]
    fn str_is_python_str() {
        let v: Value = serde_json::from_str(r#"[null, true, 1, "it's", {"k": "v"}]"#).unwrap();
        assert_eq!(py_str(&v), r#"[None, True, 1, "it's", {'k': 'v'}]"#);
        assert_eq!(py_str(&Value::from("plain")), "plain");
        assert_eq!(py_str(&Value::UNDEFINED), "");
    }

    #[test]
    fn strftime_of_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let t = DateTime::from_unix(1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 309);
        assert_eq!(t.strftime("%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            t.strftime("%A %B %e, %H:%M:%S %I%p %j %y %%"),
            "Friday July 26, 13:05:09 01PM 208 24 %"
        );
        let epoch = DateTime::from_unix(0);
        assert_eq!(epoch.strftime("%Y-%m-%d %a"), "1970-01-01 Thu");
        let before = DateTime::from_unix(-86_400);
        assert_eq!(before.strftime("%F"), "1969-12-31");
        let leap = DateTime::from_unix(951_782_400); // 2000-02-29
        assert_eq!(leap.strftime("%F %j"), "2000-02-29 060");
    }
}
