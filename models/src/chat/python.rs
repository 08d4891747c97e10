//! What chat templates expect of Python: `json.dumps` (the `tojson` filter `transformers`
//! installs), `str()` of a value (printing `{{ value }}`, the `string` filter) and
//! `datetime.strftime` (`strftime_now`).

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// The deepest nesting a printed value may have. JSON rows nest at most 128 deep (serde_json's
/// limit) and templates add a few levels; deeper is a template building nests on purpose (a
/// namespace cannot hold itself: what a namespace stores is a copy), and printing stops there
/// rather than recursing on.
pub(crate) const MAX_DEPTH: usize = 256;

/// Text printed under a byte budget (what the rendering may still make) and [`MAX_DEPTH`]: a
/// template can neither print a value past its budget (a short indent repeated at every level
/// of a large value) nor recurse without end.
pub(crate) struct Printer {
    text: String,
    max_bytes: usize,
}

impl Printer {
    /// An empty text that may grow to `max_bytes`.
    pub(crate) fn new(max_bytes: usize) -> Self {
        Printer {
            text: String::new(),
            max_bytes,
        }
    }

    fn push(&mut self, s: &str) -> Result<(), Error> {
        if self.text.len().saturating_add(s.len()) > self.max_bytes {
            return Err(Error::new(
                ErrorKind::OutOfFuel,
                format!(
                    "printing a value would make more than the {} bytes the template's budget \
                     has left",
                    self.max_bytes
                ),
            ));
        }
        self.text.push_str(s);
        Ok(())
    }

    fn push_char(&mut self, c: char) -> Result<(), Error> {
        self.push(c.encode_utf8(&mut [0u8; 4]))
    }

    /// The text printed.
    pub(crate) fn into_text(self) -> String {
        self.text
    }
}

/// Fails past [`MAX_DEPTH`].
pub(crate) fn check_depth(depth: usize) -> Result<(), Error> {
    if depth > MAX_DEPTH {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "a value nested more than {MAX_DEPTH} levels deep (more than any conversation \
                 needs)"
            ),
        ));
    }
    Ok(())
}

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

/// `json.dumps(value, ...)`, at most `max_bytes` long.
pub(crate) fn dumps(value: &Value, style: &JsonStyle, max_bytes: usize) -> Result<String, Error> {
    let mut out = Printer::new(max_bytes);
    write_json(&mut out, value, style, 0)?;
    Ok(out.into_text())
}

fn newline_indent(out: &mut Printer, style: &JsonStyle, level: usize) -> Result<(), Error> {
    if let Some(indent) = &style.indent {
        out.push_char('\n')?;
        for _ in 0..level {
            out.push(indent)?;
        }
    }
    Ok(())
}

fn write_json(
    out: &mut Printer,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    check_depth(level)?;
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push("null")?,
        ValueKind::Bool => out.push(if value.is_true() { "true" } else { "false" })?,
        ValueKind::Number => out.push(&py_number(value))?,
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), style)?,
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                return out.push("[]");
            }
            out.push_char('[')?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(&style.item_separator)?;
                }
                newline_indent(out, style, level + 1)?;
                write_json(out, item, style, level + 1)?;
            }
            newline_indent(out, style, level)?;
            out.push_char(']')?;
        }
        ValueKind::Map => write_json_map(out, value, style, level)?,
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of kind {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

fn write_json_map(
    out: &mut Printer,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    let mut entries: Vec<(String, Value)> = Vec::new();
    for key in value.try_iter()? {
        let item = value.get_item(&key)?;
        let key = match key.as_str() {
            Some(s) => s.to_string(),
            None => py_str(&key, out.max_bytes, level + 1)?,
        };
        entries.push((key, item));
    }
    if style.sort_keys {
        entries.sort_by(|a, b| a.0.cmp(&b.0));
    }
    if entries.is_empty() {
        return out.push("{}");
    }
    out.push_char('{')?;
    for (i, (key, item)) in entries.iter().enumerate() {
        if i > 0 {
            out.push(&style.item_separator)?;
        }
        newline_indent(out, style, level + 1)?;
        write_json_string(out, key, style)?;
        out.push(&style.key_separator)?;
        write_json(out, item, style, level + 1)?;
    }
    newline_indent(out, style, level)?;
    out.push_char('}')
}

/// A JSON string as Python's `json` writes it.
fn write_json_string(out: &mut Printer, s: &str, style: &JsonStyle) -> Result<(), Error> {
    out.push_char('"')?;
    write_escaped(out, s, |c| match c {
        '"' => Some("\\\"".into()),
        '\\' => Some("\\\\".into()),
        '\n' => Some("\\n".into()),
        '\r' => Some("\\r".into()),
        '\t' => Some("\\t".into()),
        '\u{8}' => Some("\\b".into()),
        '\u{c}' => Some("\\f".into()),
        c if (c as u32) < 0x20 => Some(format!("\\u{:04x}", c as u32)),
        c if style.ensure_ascii && !c.is_ascii() => {
            let mut units = [0u16; 2];
            Some(
                c.encode_utf16(&mut units)
                    .iter()
                    .map(|unit| format!("\\u{unit:04x}"))
                    .collect(),
            )
        }
        _ => None,
    })?;
    out.push_char('"')
}

/// `s` with each character `escape` has an escape for replaced by it, the runs between pushed
/// whole.
fn write_escaped(
    out: &mut Printer,
    s: &str,
    escape: impl Fn(char) -> Option<String>,
) -> Result<(), Error> {
    let mut run = 0;
    for (i, c) in s.char_indices() {
        if let Some(escaped) = escape(c) {
            out.push(&s[run..i])?;
            out.push(&escaped)?;
            run = i + c.len_utf8();
        }
    }
    out.push(&s[run..])
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
/// (`None`, `True`, `['a', 1]`, `{'k': 'v'}`); undefined prints nothing. At most `max_bytes`
/// long, `depth` levels below the value printed first.
pub(crate) fn py_str(value: &Value, max_bytes: usize, depth: usize) -> Result<String, Error> {
    match value.kind() {
        ValueKind::String => Ok(value.as_str().unwrap_or_default().to_string()),
        ValueKind::Undefined => Ok(String::new()),
        _ => {
            let mut out = Printer::new(max_bytes);
            write_repr(&mut out, value, depth)?;
            Ok(out.into_text())
        }
    }
}

/// `repr(value)` in Python.
fn write_repr(out: &mut Printer, value: &Value, depth: usize) -> Result<(), Error> {
    check_depth(depth)?;
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push("None"),
        ValueKind::Bool => out.push(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push(&py_number_repr(value)),
        ValueKind::String => write_string_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => match value.try_iter() {
            Ok(items) => {
                out.push_char('[')?;
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push(", ")?;
                    }
                    write_repr(out, &item, depth + 1)?;
                }
                out.push_char(']')
            }
            Err(_) => out.push(&value.to_string()),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                out.push_char('{')?;
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push(", ")?;
                    }
                    let item = value.get_item(&key).unwrap_or_default();
                    write_repr(out, &key, depth + 1)?;
                    out.push(": ")?;
                    write_repr(out, &item, depth + 1)?;
                }
                out.push_char('}')
            }
            Err(_) => out.push(&value.to_string()),
        },
        _ => out.push(&value.to_string()),
    }
}

/// `repr(x)` of a number: an integer as is, a float as Python's `repr` (`nan`, `inf`).
fn py_number_repr(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(x) if x.is_nan() => "nan".into(),
        Ok(x) if x.is_infinite() => if x > 0.0 { "inf" } else { "-inf" }.into(),
        Ok(x) => py_float(x),
        Err(_) => value.to_string(),
    }
}

/// `repr(s)` of a Python string: single quotes unless it holds a single quote and no double.
fn write_string_repr(out: &mut Printer, s: &str) -> Result<(), Error> {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push_char(quote)?;
    write_escaped(out, s, |c| match c {
        '\\' => Some("\\\\".into()),
        '\n' => Some("\\n".into()),
        '\r' => Some("\\r".into()),
        '\t' => Some("\\t".into()),
        c if c == quote => Some(format!("\\{c}")),
        c if (c as u32) < 0x20 || c as u32 == 0x7f => Some(format!("\\x{:02x}", c as u32)),
        _ => None,
    })?;
    out.push_char(quote)
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
            dumps(&v, &JsonStyle::new(None), usize::MAX).unwrap(),
            r#"{"b": [1, 2.5, "é\n\"<"], "a": {}, "c": null, "d": true}"#
        );
        let indented = dumps(&v, &JsonStyle::new(Some("  ".into())), usize::MAX).unwrap();
        assert_eq!(
            indented,
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\\\"<\"\n  ],\n  \"a\": {},\n  \"c\": null,\n  \"d\": true\n}"
        );
        let mut ascii = JsonStyle::new(None);
        ascii.ensure_ascii = true;
        ascii.sort_keys = true;
        let v: Value = serde_json::from_str(r#"{"z": "é👋", "a": 1}"#).unwrap();
        assert_eq!(
            dumps(&v, &ascii, usize::MAX).unwrap(),
            r#"{"a": 1, "z": "\u00e9\ud83d\udc4b"}"#
        );
    }

    #[test]
    fn str_is_python_str() {
        let v: Value = serde_json::from_str(r#"[null, true, 1, "it's", {"k": "v"}]"#).unwrap();
        assert_eq!(
            py_str(&v, usize::MAX, 0).unwrap(),
            r#"[None, True, 1, "it's", {'k': 'v'}]"#
        );
        assert_eq!(
            py_str(&Value::from("plain"), usize::MAX, 0).unwrap(),
            "plain"
        );
        assert_eq!(py_str(&Value::UNDEFINED, usize::MAX, 0).unwrap(), "");
    }

    #[test]
    fn printing_stops_at_its_budget_and_depth() {
        let v: Value = serde_json::from_str(r#"[[1, 2], {"k": "v"}, "x"]"#).unwrap();
        let full = dumps(&v, &JsonStyle::new(Some("  ".into())), usize::MAX).unwrap();
        let err = dumps(&v, &JsonStyle::new(Some("  ".into())), full.len() - 1).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfFuel);
        assert_eq!(
            dumps(&v, &JsonStyle::new(Some("  ".into())), full.len()).unwrap(),
            full
        );
        let repr = py_str(&v, usize::MAX, 0).unwrap();
        assert_eq!(repr, "[[1, 2], {'k': 'v'}, 'x']");
        assert!(py_str(&v, repr.len() - 1, 0).is_err());
        // One level past the deepest accepted.
        let mut deep = Value::from(1);
        for _ in 0..MAX_DEPTH {
            deep = Value::from(vec![deep]);
        }
        assert!(py_str(&deep, usize::MAX, 0).is_ok());
        assert!(dumps(&deep, &JsonStyle::new(None), usize::MAX).is_ok());
        let deeper = Value::from(vec![deep]);
        let err = py_str(&deeper, usize::MAX, 0).unwrap_err();
        assert!(err.to_string().contains("levels deep"), "{err}");
        assert!(dumps(&deeper, &JsonStyle::new(None), usize::MAX).is_err());
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
