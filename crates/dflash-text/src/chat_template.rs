//! [`ChatTemplate`]: Hugging Face style Jinja chat templates rendered with minijinja.
//!
//! Invariants (matching transformers' `apply_chat_template` environment):
//! - `trim_blocks` and `lstrip_blocks` are on; a single trailing newline of the template source is dropped
//!   (Jinja2's `keep_trailing_newline=False`); the rendered text is returned as is, not stripped.
//! - Python string/dict/list methods (`.startswith`, `.strip`, `.split`, `.items()`, ...) work through
//!   minijinja-contrib's pycompat callback.
//! - `raise_exception(msg)` fails the render with a [`TextError::TemplateRender`] whose message contains `msg`.
//! - `strftime_now(fmt)` formats the current time (UTC; Python uses local time) with the common C `strftime`
//!   directives.
//! - `tojson` is Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`
//!   (HF's override): no HTML escaping, `", "`/`": "` separators, `indent` as int or string, keys in insertion
//!   order (`preserve_order` is enabled for minijinja and serde_json).
//! - Variables: `messages`, `tools` (none when absent), `add_generation_prompt`, and, only when known,
//!   `enable_thinking`, `bos_token`, `eos_token` (undefined otherwise, so `is defined` tests behave as in HF).
//! - `{% generation %}` / `{% endgeneration %}` (transformers' AssistantTracker extension) render their body
//!   unchanged.
//! - The template is compiled once in [`ChatTemplate::new`]; syntax errors surface there.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TextError};
use crate::json_py::{py_json_dumps, JsonOptions};

const TEMPLATE_NAME: &str = "chat_template";

/// One chat turn.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Per-render options.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    /// Append the assistant turn header (HF `add_generation_prompt`).
    pub add_generation_prompt: bool,
    /// Passed as `enable_thinking` when `Some` (Qwen3-style templates); undefined when `None`.
    pub enable_thinking: Option<bool>,
    /// Tool schemas (usually a JSON array), passed as `tools`; `none` when absent.
    pub tools: Option<serde_json::Value>,
}

/// A compiled chat template plus the special-token strings it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; fails with [`TextError::TemplateSyntax`] on syntax errors.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TextError::TemplateSyntax(describe(&e)))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| TextError::TemplateSyntax(describe(&e)))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The BOS token string given at construction.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token string given at construction.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders `messages`; the output is not stripped (HF does not strip it either).
    pub fn render(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        let mut vars: Vec<(&str, Value)> = vec![
            ("messages", Value::from(Serde(messages))),
            (
                "tools",
                opts.tools
                    .as_ref()
                    .map(|t| Value::from(Serde(t)))
                    .unwrap_or(Value::from(())),
            ),
            (
                "add_generation_prompt",
                Value::from(opts.add_generation_prompt),
            ),
        ];
        if let Some(t) = opts.enable_thinking {
            vars.push(("enable_thinking", Value::from(t)));
        }
        if let Some(b) = &self.bos_token {
            vars.push(("bos_token", Value::from(b.as_str())));
        }
        if let Some(e) = &self.eos_token {
            vars.push(("eos_token", Value::from(e.as_str())));
        }
        let ctx = Value::from_pairs(vars);
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::TemplateRender(describe(&e)))?;
        tmpl.render(ctx)
            .map_err(|e| TextError::TemplateRender(describe(&e)))
    }
}

/// The error's message, its detail and position, plus any chained causes.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn tojson(value: Value, args: Rest<Value>, kwargs: Kwargs) -> std::result::Result<String, Error> {
    // Positional order of HF's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
    let mut opts = JsonOptions::default();
    let mut positional = args.iter();
    let bad = |what: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    let set_indent = |opts: &mut JsonOptions, v: &Value| -> std::result::Result<(), Error> {
        opts.indent = if v.is_none() || v.is_undefined() {
            None
        } else if let Some(s) = v.as_str() {
            Some(s.to_string())
        } else if let Some(n) = v.as_i64() {
            Some(" ".repeat(n.max(0) as usize))
        } else {
            return Err(bad("indent must be an integer, a string or none"));
        };
        Ok(())
    };
    let set_separators = |opts: &mut JsonOptions, v: &Value| -> std::result::Result<(), Error> {
        if v.is_none() || v.is_undefined() {
            opts.separators = None;
            return Ok(());
        }
        let items: Vec<Value> = v
            .try_iter()
            .map_err(|_| bad("separators must be a pair of strings"))?
            .collect();
        match items.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                opts.separators = Some((
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ));
                Ok(())
            }
            _ => Err(bad("separators must be a pair of strings")),
        }
    };
    if let Some(v) = positional.next() {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = positional.next() {
        set_indent(&mut opts, v)?;
    }
    if let Some(v) = positional.next() {
        set_separators(&mut opts, v)?;
    }
    if let Some(v) = positional.next() {
        opts.sort_keys = v.is_true();
    }
    if positional.next().is_some() {
        return Err(bad("too many arguments"));
    }
    if let Some(v) = kwargs.get::<Option<Value>>("ensure_ascii")? {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = kwargs.get::<Option<Value>>("indent")? {
        set_indent(&mut opts, &v)?;
    }
    if let Some(v) = kwargs.get::<Option<Value>>("separators")? {
        set_separators(&mut opts, &v)?;
    }
    if let Some(v) = kwargs.get::<Option<Value>>("sort_keys")? {
        opts.sort_keys = v.is_true();
    }
    kwargs.assert_all_used()?;
    py_json_dumps(&value, &opts).map_err(|m| Error::new(ErrorKind::InvalidOperation, m))
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (keeping `-`/`+` whitespace control) by an
/// always-true `if` block, which minijinja understands and which renders the body unchanged.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        match parse_generation_tag(tag) {
            Some((len, open_mod, close_mod, is_end)) => {
                let body = if is_end { "endif" } else { "if true" };
                out.push_str(&format!("{{%{open_mod} {body} {close_mod}%}}"));
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// If `s` starts with a `generation`/`endgeneration` block tag, returns (length, opening modifier, closing
/// modifier, is_end).
fn parse_generation_tag(s: &str) -> Option<(usize, &str, &str, bool)> {
    let inner = s.strip_prefix("{%")?;
    let (open_mod, inner) = match inner.chars().next() {
        Some(c @ ('-' | '+')) => (&s[2..2 + c.len_utf8()], &inner[1..]),
        _ => ("", inner),
    };
    let trimmed = inner.trim_start();
    let (is_end, after) = if let Some(a) = trimmed.strip_prefix("endgeneration") {
        (true, a)
    } else if let Some(a) = trimmed.strip_prefix("generation") {
        (false, a)
    } else {
        return None;
    };
    let after_ws = after.trim_start();
    if after_ws.len() == after.len() && !after.starts_with(['-', '+', '%']) {
        return None; // e.g. `generation_foo`
    }
    let (close_mod, tail) = match after_ws.chars().next() {
        Some(c @ ('-' | '+')) => (&after_ws[..c.len_utf8()], &after_ws[1..]),
        _ => ("", after_ws),
    };
    let tail = tail.strip_prefix("%}")?;
    Some((s.len() - tail.len(), open_mod, close_mod, is_end))
}

fn strftime_now(fmt: String) -> std::result::Result<String, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(strftime_utc(&fmt, secs))
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
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix time (UTC) with C `strftime` directives `%Y %y %m %d %e %H %I %M %S %p %b %h %B %a %A %j %u
/// %w %F %T %D %%` and the glibc no-padding flag (`%-d`). Unknown directives are copied verbatim.
pub(crate) fn strftime_utc(fmt: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (sod / 3600, (sod / 60) % 60, sod % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; 0 = Monday
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |v: i64, width: usize| {
            if no_pad {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('b') | Some('h') => out.push_str(&MONTHS[(month - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(month - 1) as usize]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('u') => out.push_str(&(weekday + 1).to_string()),
            Some('w') => out.push_str(&((weekday + 1) % 7).to_string()),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('D') => out.push_str(&format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100))),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Day count since 1970-01-01 of a civil date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, opts: &RenderOptions) -> Result<String> {
        ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into()))?
            .render(&[ChatMessage::new("user", "hi")], opts)
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(strftime_utc("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            strftime_utc("%A %B %-d, %j %I%p %%", t),
            "Thursday February 29, 060 01PM %"
        );
        assert_eq!(strftime_utc("%F %T %q", 0), "1970-01-01 00:00:00 %q");
        assert_eq!(strftime_utc("%a", -86_400), "Wed");
    }

    #[test]
    fn generation_tags_are_transparent() {
        let src = "{% for m in messages %}{%- generation -%} [{{ m.content }}] {%- endgeneration %}{% endfor %}";
        assert_eq!(render(src, &RenderOptions::default()).unwrap(), "[hi]");
        assert_eq!(
            rewrite_generation_tags("{% generation_x %}{%generation%}"),
            "{% generation_x %}{% if true %}"
        );
    }

    #[test]
    fn variables_and_python_methods() {
        let src = "{{ bos_token }}{% if enable_thinking is defined %}T{{ enable_thinking }}{% endif %}\
                   {% if tools is none %}N{% endif %}{{ messages[0].content.upper() }}\
                   {{ ' a b '.strip().split(' ') | join(',') }}{% if add_generation_prompt %}G{% endif %}";
        assert_eq!(render(src, &RenderOptions::default()).unwrap(), "<s>NHIa,b");
        let o = RenderOptions {
            add_generation_prompt: true,
            enable_thinking: Some(false),
            tools: None,
        };
        assert_eq!(render(src, &o).unwrap(), "<s>TFalseNHIa,bG");
    }

    #[test]
    fn tojson_matches_python() {
        let o = RenderOptions {
            tools: Some(serde_json::json!([{"z": 1, "a": [1.5, "é<>&\n", null, true]}])),
            ..Default::default()
        };
        assert_eq!(
            render("{{ tools | tojson }}", &o).unwrap(),
            "[{\"z\": 1, \"a\": [1.5, \"é<>&\\n\", null, true]}]"
        );
        assert_eq!(
            render("{{ tools[0] | tojson(indent=2) }}", &o).unwrap(),
            "{\n  \"z\": 1,\n  \"a\": [\n    1.5,\n    \"é<>&\\n\",\n    null,\n    true\n  ]\n}"
        );
        assert_eq!(
            render(
                "{{ tools[0] | tojson(sort_keys=true, separators=(',', ':')) }}",
                &o
            )
            .unwrap(),
            "{\"a\":[1.5,\"é<>&\\n\",null,true],\"z\":1}"
        );
        assert_eq!(
            render("{{ tools[0].a[1] | tojson(ensure_ascii=true) }}", &o).unwrap(),
            "\"\\u00e9<>&\\n\""
        );
    }

    #[test]
    fn errors_are_reported() {
        let e = render(
            "{{ raise_exception('no system role') }}",
            &RenderOptions::default(),
        )
        .unwrap_err();
        assert!(matches!(e, TextError::TemplateRender(_)));
        assert!(e.to_string().contains("no system role"), "{e}");
        let e = ChatTemplate::new("{% for %}", None, None).unwrap_err();
        assert!(matches!(e, TextError::TemplateSyntax(_)), "{e}");
    }

    #[test]
    fn trailing_newline_and_no_strip() {
        assert_eq!(
            render("  {{ 'x' }}  \n\n", &RenderOptions::default()).unwrap(),
            "  x  \n"
        );
    }
}
