//! The OpenAI wire format: requests of `/v1/chat/completions` and `/v1/completions` read into a
//! [`Parsed`] request, and the JSON of responses, stream chunks and errors.
//!
//! Invariants: a field this server cannot honour (`n > 1`, `logprobs`, `tools`, penalties, `echo`,
//! `suffix`, `best_of`) is refused with a 400 naming it — never silently ignored; unknown fields
//! are ignored, as the OpenAI API does. Defaults are OpenAI's (`temperature` 1, `top_p` 1) except
//! `max_tokens`, whose default is the server's.

use crate::{FinishReason, Message, Prompt, Sampling};
use serde_json::{json, Map, Value};

/// A request refused: the status, the message, and the field it names (if any).
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            param: param.map(String::from),
        }
    }

    /// `{"error": {...}}` as OpenAI writes it.
    pub fn body(&self) -> Value {
        let kind = match self.status {
            401 => "authentication_error",
            404 => "not_found_error",
            500.. => "server_error",
            _ => "invalid_request_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": null}})
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// A request, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

/// Reads `body` as a request to `endpoint`; `default_max_tokens` applies when it names none,
/// `seed` when it names no seed (the server passes a fresh one per request).
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    model_id: &str,
    default_max_tokens: usize,
    seed: u64,
) -> Result<Parsed, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not JSON: {e}"), None))?;
    let o = v
        .as_object()
        .ok_or_else(|| ApiError::invalid("the body must be a JSON object", None))?;
    if let Some(m) = o.get("model").filter(|m| !m.is_null()) {
        let m = m
            .as_str()
            .ok_or_else(|| ApiError::invalid("`model` must be a string", Some("model")))?;
        if m != model_id {
            return Err(ApiError {
                status: 404,
                message: format!("the model `{m}` does not exist; this server has `{model_id}`"),
                param: Some("model".into()),
            });
        }
    }
    refuse_unsupported(o, endpoint)?;
    let prompt = match endpoint {
        Endpoint::Chat => Prompt::Chat {
            messages: messages(o)?,
            enable_thinking: o
                .get("chat_template_kwargs")
                .and_then(|k| k.get("enable_thinking"))
                .map(|t| {
                    t.as_bool().ok_or_else(|| {
                        ApiError::invalid(
                            "`chat_template_kwargs.enable_thinking` must be a boolean",
                            Some("chat_template_kwargs"),
                        )
                    })
                })
                .transpose()?
                .unwrap_or(false),
        },
        Endpoint::Completions => Prompt::Text(text_prompt(o)?),
    };
    let max_tokens = match o
        .get("max_completion_tokens")
        .or_else(|| o.get("max_tokens"))
        .filter(|x| !x.is_null())
    {
        None => default_max_tokens,
        Some(x) => match x.as_u64() {
            Some(n) if n >= 1 => n as usize,
            _ => {
                return Err(ApiError::invalid(
                    "`max_tokens` must be an integer of at least 1",
                    Some("max_tokens"),
                ))
            }
        },
    };
    let temperature = number(o, "temperature", 1.0, 0.0, 2.0)?;
    let top_p = number(o, "top_p", 1.0, f64::MIN_POSITIVE, 1.0)?;
    let top_k = match o.get("top_k").filter(|x| !x.is_null()) {
        None => 0,
        // vLLM's convention: -1 (and 0) mean no filter
        Some(x) => match x.as_i64() {
            Some(k) if k <= 0 => 0,
            Some(k) => k as usize,
            None => {
                return Err(ApiError::invalid(
                    "`top_k` must be an integer",
                    Some("top_k"),
                ))
            }
        },
    };
    let seed = match o.get("seed").filter(|x| !x.is_null()) {
        None => seed,
        Some(x) => x
            .as_i64()
            .map(|s| s as u64)
            .ok_or_else(|| ApiError::invalid("`seed` must be an integer", Some("seed")))?,
    };
    let stop = match o.get("stop").filter(|x| !x.is_null()) {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|s| s.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid("`stop` must hold strings", Some("stop")))?,
        Some(_) => {
            return Err(ApiError::invalid(
                "`stop` must be a string or up to 4 strings",
                Some("stop"),
            ))
        }
    };
    let stream = flag(o, "stream")?;
    let include_usage = o
        .get("stream_options")
        .and_then(|s| s.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Parsed {
        prompt,
        max_tokens,
        sampling: Sampling {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            seed,
        },
        stop,
        stream,
        include_usage,
    })
}

fn refuse_unsupported(o: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    let set = |k: &str| o.get(k).is_some_and(|v| !v.is_null());
    if let Some(n) = o.get("n").and_then(Value::as_u64) {
        if n != 1 {
            return Err(ApiError::invalid("only `n` = 1 is supported", Some("n")));
        }
    }
    for k in ["presence_penalty", "frequency_penalty"] {
        if o.get(k).and_then(Value::as_f64).is_some_and(|p| p != 0.0) {
            return Err(ApiError::invalid(
                format!("`{k}` is not supported"),
                Some(k),
            ));
        }
    }
    let logprobs = match endpoint {
        Endpoint::Chat => o.get("logprobs").and_then(Value::as_bool).unwrap_or(false),
        Endpoint::Completions => set("logprobs"),
    };
    if logprobs {
        return Err(ApiError::invalid(
            "`logprobs` is not supported",
            Some("logprobs"),
        ));
    }
    for k in ["tools", "functions", "logit_bias", "suffix"] {
        if set(k) {
            return Err(ApiError::invalid(
                format!("`{k}` is not supported"),
                Some(k),
            ));
        }
    }
    if o.get("echo").and_then(Value::as_bool).unwrap_or(false) {
        return Err(ApiError::invalid("`echo` is not supported", Some("echo")));
    }
    if o.get("best_of")
        .and_then(Value::as_u64)
        .is_some_and(|b| b > 1)
    {
        return Err(ApiError::invalid(
            "`best_of` is not supported",
            Some("best_of"),
        ));
    }
    Ok(())
}

fn messages(o: &Map<String, Value>) -> Result<Vec<Message>, ApiError> {
    let err = |m: &str| ApiError::invalid(m, Some("messages"));
    let list = o
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| err("`messages` must be a list of messages"))?;
    if list.is_empty() {
        return Err(err("`messages` is empty"));
    }
    list.iter()
        .map(|m| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| err("every message needs a string `role`"))?;
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                // content parts: text only
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| match p.get("type").and_then(Value::as_str) {
                        Some("text") => p
                            .get("text")
                            .and_then(Value::as_str)
                            .map(String::from)
                            .ok_or_else(|| err("a text part needs `text`")),
                        other => Err(err(&format!(
                            "content parts of type {other:?} are not supported (text only)"
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .concat(),
                Some(Value::Null) | None => String::new(),
                Some(_) => return Err(err("`content` must be a string or a list of parts")),
            };
            Ok(Message {
                role: role.to_string(),
                content,
            })
        })
        .collect()
}

fn text_prompt(o: &Map<String, Value>) -> Result<String, ApiError> {
    let err = || {
        ApiError::invalid(
            "`prompt` must be a string (or a list of one)",
            Some("prompt"),
        )
    };
    match o.get("prompt") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 => a[0].as_str().map(String::from).ok_or_else(err),
        Some(Value::Array(a)) if a.len() > 1 => Err(ApiError::invalid(
            "one prompt a request (batched prompts are not supported)",
            Some("prompt"),
        )),
        _ => Err(err()),
    }
}

fn number(
    o: &Map<String, Value>,
    k: &str,
    default: f64,
    lo: f64,
    hi: f64,
) -> Result<f64, ApiError> {
    match o.get(k).filter(|x| !x.is_null()) {
        None => Ok(default),
        Some(x) => match x.as_f64() {
            Some(v) if (lo..=hi).contains(&v) => Ok(v),
            _ => Err(ApiError::invalid(
                format!("`{k}` must be a number in [{lo}, {hi}]"),
                Some(k),
            )),
        },
    }
}

fn flag(o: &Map<String, Value>, k: &str) -> Result<bool, ApiError> {
    match o.get(k).filter(|x| !x.is_null()) {
        None => Ok(false),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| ApiError::invalid(format!("`{k}` must be a boolean"), Some(k))),
    }
}

/// The fields every response and chunk of one request share.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion})
}

impl Envelope {
    fn base(&self, object: &str) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(object));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m
    }

    /// The whole (non-streamed) response.
    pub fn response(
        &self,
        text: &str,
        finish: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        stats: &Value,
    ) -> Value {
        let (object, choice) = match self.endpoint {
            Endpoint::Chat => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": finish, "logprobs": null}),
            ),
            Endpoint::Completions => (
                "text_completion",
                json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null}),
            ),
        };
        let mut m = self.base(object);
        m.insert("choices".into(), json!([choice]));
        m.insert("usage".into(), usage(prompt_tokens, completion_tokens));
        m.insert("dflash".into(), stats.clone());
        Value::Object(m)
    }

    /// A stream chunk carrying `text` (the chat's first chunk also names the role) or, with
    /// `finish`, the last chunk of the choice.
    pub fn chunk(&self, text: Option<&str>, first: bool, finish: Option<FinishReason>) -> Value {
        let (object, choice) = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                (
                    "chat.completion.chunk",
                    json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}),
                )
            }
            Endpoint::Completions => (
                "text_completion",
                json!({"index": 0, "text": text.unwrap_or(""), "finish_reason": finish,
                       "logprobs": null}),
            ),
        };
        let mut m = self.base(object);
        m.insert("choices".into(), json!([choice]));
        Value::Object(m)
    }

    /// The usage chunk (`stream_options.include_usage`): no choices.
    pub fn usage_chunk(
        &self,
        prompt_tokens: usize,
        completion_tokens: usize,
        stats: &Value,
    ) -> Value {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let mut m = self.base(object);
        m.insert("choices".into(), json!([]));
        m.insert("usage".into(), usage(prompt_tokens, completion_tokens));
        m.insert("dflash".into(), stats.clone());
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Parsed, ApiError> {
        parse(Endpoint::Chat, body.as_bytes(), "m", 64, 7)
    }

    #[test]
    fn reads_a_chat_request_with_openai_defaults() {
        let p = chat(r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}],
            "stop":"\n","stream":true,"stream_options":{"include_usage":true}}"#)
        .unwrap();
        let Prompt::Chat {
            messages,
            enable_thinking,
        } = &p.prompt
        else {
            panic!()
        };
        assert_eq!(messages[1].content, "hi there");
        assert!(!enable_thinking);
        assert_eq!(
            (p.max_tokens, p.stop.clone(), p.stream, p.include_usage),
            (64, vec!["\n".to_string()], true, true)
        );
        assert_eq!(
            p.sampling,
            Sampling {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0,
                seed: 7
            }
        );
    }

    #[test]
    fn reads_sampling_fields_and_a_text_prompt() {
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":["Once"],"max_tokens":5,"temperature":0,"top_p":0.9,"top_k":-1,"seed":3}"#,
            "m",
            64,
            7,
        )
        .unwrap();
        assert_eq!(p.prompt, Prompt::Text("Once".into()));
        assert_eq!(p.max_tokens, 5);
        assert_eq!(
            p.sampling,
            Sampling {
                temperature: 0.0,
                top_p: 0.9,
                top_k: 0,
                seed: 3
            }
        );
    }

    #[test]
    fn refuses_what_it_cannot_honour_naming_the_field() {
        // a valid message plus one field each
        let one =
            |extra: &str| format!(r#"{{"messages":[{{"role":"user","content":"x"}}],{extra}}}"#);
        let cases = [
            (r#"{"messages":[]}"#.to_string(), "messages", 400),
            (one(r#""n":2"#), "n", 400),
            (one(r#""logprobs":true"#), "logprobs", 400),
            (one(r#""tools":[{}]"#), "tools", 400),
            (one(r#""temperature":3"#), "temperature", 400),
            (one(r#""max_tokens":0"#), "max_tokens", 400),
            (one(r#""stop":["a","b","c","d","e"]"#), "stop", 400),
            (one(r#""model":"other""#), "model", 404),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#.to_string(),
                "messages",
                400,
            ),
        ];
        for (body, param, status) in cases {
            let e = chat(&body).unwrap_err();
            assert_eq!(
                (e.param.as_deref(), e.status),
                (Some(param), status),
                "{body}"
            );
        }
        assert_eq!(chat("not json").unwrap_err().status, 400);
        assert_eq!(chat("[1]").unwrap_err().status, 400);
    }
}
