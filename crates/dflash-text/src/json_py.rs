//! Python `json.dumps` for minijinja values (the `tojson` filter of chat templates).
//!
//! Invariants: output is byte-identical to CPython's `json.dumps(x, ensure_ascii=.., indent=.., separators=..,
//! sort_keys=..)` for JSON-like data (none, bools, integers, floats, strings, lists, dicts with string keys):
//! default separators `", "`/`": "` without indent and `","`/`": "` with indent; empty containers stay `[]`/`{}`;
//! floats use Python's `repr` (`1.0`, `1e-05`, `1e+16`, `NaN`, `Infinity`); with `ensure_ascii` non-ASCII
//! becomes `\uXXXX` (surrogate pairs above U+FFFF). Undefined values and non-JSON objects are errors, as
//! Python's `TypeError` would be.

use minijinja::value::{Value, ValueKind};

/// `json.dumps` keyword arguments.
#[derive(Clone, Debug, Default)]
pub(crate) struct JsonOptions {
    pub ensure_ascii: bool,
    /// Indent unit (Python's int `n` is `n` spaces); `None` = single line.
    pub indent: Option<String>,
    /// (item separator, key separator); `None` = Python's default for the indent mode.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

/// Serialises `value` as Python's `json.dumps` would.
pub(crate) fn py_json_dumps(value: &Value, opts: &JsonOptions) -> Result<String, String> {
    let (item_sep, key_sep) = match (&opts.separators, &opts.indent) {
        (Some((i, k)), _) => (i.clone(), k.clone()),
        (None, Some(_)) => (",".to_string(), ": ".to_string()),
        (None, None) => (", ".to_string(), ": ".to_string()),
    };
    let mut w = Writer {
        opts,
        item_sep,
        key_sep,
        out: String::new(),
    };
    w.value(value, 0)?;
    Ok(w.out)
}

struct Writer<'a> {
    opts: &'a JsonOptions,
    item_sep: String,
    key_sep: String,
    out: String,
}

impl Writer<'_> {
    fn newline(&mut self, level: usize) {
        if let Some(ind) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..level {
                self.out.push_str(ind);
            }
        }
    }

    fn value(&mut self, v: &Value, level: usize) -> Result<(), String> {
        match v.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    self.out.push_str(&v.to_string());
                } else {
                    let f = f64::try_from(v.clone()).map_err(|e| e.to_string())?;
                    self.out.push_str(&py_float_repr(f));
                }
            }
            ValueKind::String => {
                let s = v.as_str().unwrap_or_default();
                self.string(s);
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
                self.seq(&items, level)?;
            }
            ValueKind::Map => self.map(v, level)?,
            other => {
                return Err(format!("Object of type {other} is not JSON serializable"));
            }
        }
        Ok(())
    }

    fn seq(&mut self, items: &[Value], level: usize) -> Result<(), String> {
        if items.is_empty() {
            self.out.push_str("[]");
            return Ok(());
        }
        self.out.push('[');
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(level + 1);
            self.value(item, level + 1)?;
        }
        self.newline(level);
        self.out.push(']');
        Ok(())
    }

    fn map(&mut self, v: &Value, level: usize) -> Result<(), String> {
        let mut entries = Vec::new();
        for key in v.try_iter().map_err(|e| e.to_string())? {
            let val = v.get_item(&key).map_err(|e| e.to_string())?;
            let k = match key.kind() {
                ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                ValueKind::Number if key.is_integer() => key.to_string(),
                ValueKind::Number => {
                    py_float_repr(f64::try_from(key.clone()).map_err(|e| e.to_string())?)
                }
                ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
                ValueKind::None => "null".to_string(),
                other => {
                    return Err(format!(
                        "keys must be str, int, float, bool or None, not {other}"
                    ))
                }
            };
            entries.push((k, val));
        }
        if self.opts.sort_keys {
            entries.sort_by(|a, b| a.0.cmp(&b.0));
        }
        if entries.is_empty() {
            self.out.push_str("{}");
            return Ok(());
        }
        self.out.push('{');
        for (i, (k, val)) in entries.iter().enumerate() {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(level + 1);
            self.string(k);
            let sep = self.key_sep.clone();
            self.out.push_str(&sep);
            self.value(val, level + 1)?;
        }
        self.newline(level);
        self.out.push('}');
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => self.out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.opts.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        self.out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents in [-4, 16),
/// scientific (`1e-05`, `1.5e+16`) otherwise.
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    let sci = format!("{:e}", f.abs()); // e.g. "1.2345e3", "0e0"
    let (mant, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let body = if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                format!("{digits}{}.0", "0".repeat((int_len - n) as usize))
            } else {
                format!(
                    "{}.{}",
                    &digits[..int_len as usize],
                    &digits[int_len as usize..]
                )
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let m = if n > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits.clone()
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{m}e{esign}{:02}", exp.abs())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (123456.789, "123456.789"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (-2.5e-7, "-2.5e-07"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn escapes_and_errors() {
        let v = Value::from("a\"\\\u{1}😀");
        let o = JsonOptions {
            ensure_ascii: true,
            ..Default::default()
        };
        assert_eq!(
            py_json_dumps(&v, &o).unwrap(),
            "\"a\\\"\\\\\\u0001\\ud83d\\ude00\""
        );
        assert!(py_json_dumps(&Value::UNDEFINED, &o).is_err());
        let empty: Vec<Value> = vec![];
        let o = JsonOptions {
            indent: Some("  ".into()),
            ..Default::default()
        };
        assert_eq!(py_json_dumps(&Value::from(empty), &o).unwrap(), "[]");
    }
}
