//! [`TextAssets`]: everything text-side of a model, from a Hugging Face directory or from GGUF metadata.
//!
//! Invariants for [`TextAssets::from_hf_dir`] (files as transformers 5.x reads them):
//! - `tokenizer.json` is required; `tokenizer_config.json`, `chat_template.jinja`, `chat_template.json` and
//!   `generation_config.json` are optional, but a file that exists and does not parse is an error naming it.
//! - Chat template: `chat_template.jinja` if present, else `tokenizer_config.json["chat_template"]` (a string, or
//!   a list of `{name, template}` from which `"default"` is taken; a list without `"default"` is an error), else
//!   `chat_template.json["chat_template"]`.
//! - `bos_token` / `eos_token` in `tokenizer_config.json` may be a string, an AddedToken object
//!   `{"content": ..}` or null.
//! - If `tokenizer_config.json` sets `add_bos_token` or `add_eos_token` (booleans), the post-processor is rebuilt
//!   as transformers' `update_post_processor` does (BOS/EOS added per the flags); otherwise `tokenizer.json`'s
//!   own post-processor stays. `add_bos` reports whether `encode(.., true)` prepends the BOS id.
//! - `eos_token_ids`: `generation_config.json["eos_token_id"]` (int or list), then the id of the tokenizer's
//!   `eos_token` if not already listed; no duplicates, order kept.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use crate::chat_template::ChatTemplate;
use crate::error::{Result, TextError};
use crate::gguf_vocab::GgufVocab;
use crate::tokenizer::TextTokenizer;

/// Everything text-side of a model.
#[derive(Debug)]
pub struct TextAssets {
    pub tokenizer: TextTokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub bos_token: Option<String>,
    /// Ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Whether `tokenizer.encode(text, true)` prepends the BOS token.
    pub add_bos: bool,
}

impl TextAssets {
    /// Loads `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja` / `chat_template.json` and
    /// `generation_config.json` from `dir` (see the module documentation for the rules).
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let mut tokenizer = TextTokenizer::from_file(&dir.join("tokenizer.json"))?;

        let config_path = dir.join("tokenizer_config.json");
        let config = read_json_object(&config_path)?;
        let get = |key: &str| config.as_ref().and_then(|c| c.get(key));

        let bos_token = token_string(get("bos_token"), &config_path, "bos_token")?;
        let eos_token = token_string(get("eos_token"), &config_path, "eos_token")?;

        let add_bos_flag = bool_field(get("add_bos_token"), &config_path, "add_bos_token")?;
        let add_eos_flag = bool_field(get("add_eos_token"), &config_path, "add_eos_token")?;
        if add_bos_flag.is_some() || add_eos_flag.is_some() {
            let resolve = |flag: Option<bool>, tok: &Option<String>, what: &str| -> Result<_> {
                match (flag, tok) {
                    (Some(true), Some(t)) => {
                        let id = tokenizer.token_to_id(t).ok_or_else(|| {
                            TextError::parse(
                                &config_path,
                                format!("{what} to be a token of tokenizer.json"),
                                format!("{t:?} is not in the vocabulary"),
                            )
                        })?;
                        Ok(Some((t.clone(), id)))
                    }
                    _ => Ok(None),
                }
            };
            let bos = resolve(add_bos_flag, &bos_token, "bos_token")?;
            let eos = resolve(add_eos_flag, &eos_token, "eos_token")?;
            tokenizer.set_bos_eos(bos, eos)?;
        }

        let template_source = chat_template_source(dir, &config_path, get("chat_template"))?;
        let chat_template = template_source
            .map(|src| ChatTemplate::new(&src, bos_token.clone(), eos_token.clone()))
            .transpose()?;

        let mut eos_token_ids = Vec::new();
        let gen_path = dir.join("generation_config.json");
        if let Some(gen) = read_json_object(&gen_path)? {
            match gen.get("eos_token_id") {
                None | Some(Json::Null) => {}
                Some(v) => eos_token_ids.extend(id_list(v, &gen_path, "eos_token_id")?),
            }
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
            eos_token_ids.push(id);
        }
        dedup_keep_order(&mut eos_token_ids);

        let add_bos = adds_bos(&tokenizer, bos_token.as_deref())?;
        Ok(Self {
            tokenizer,
            chat_template,
            bos_token,
            eos_token_ids,
            add_bos,
        })
    }

    /// Builds the tokenizer from GGUF metadata (see [`crate::gguf_vocab`]), the chat template from
    /// `tokenizer.chat_template`, BOS/EOS strings from `tokens[bos_token_id]` / `tokens[eos_token_id]`, and
    /// `eos_token_ids = [eos_token_id]`.
    pub fn from_gguf_vocab(v: &GgufVocab) -> Result<Self> {
        let tokenizer = TextTokenizer::from_gguf_vocab(v)?;
        let bos_token = v
            .bos_token_id
            .map(|id| v.token(id, "tokenizer.ggml.bos_token_id").map(String::from))
            .transpose()?;
        let eos_token = v
            .eos_token_id
            .map(|id| v.token(id, "tokenizer.ggml.eos_token_id").map(String::from))
            .transpose()?;
        let chat_template = v
            .chat_template
            .as_deref()
            .map(|src| ChatTemplate::new(src, bos_token.clone(), eos_token.clone()))
            .transpose()?;
        let add_bos = adds_bos(&tokenizer, bos_token.as_deref())?;
        Ok(Self {
            tokenizer,
            chat_template,
            bos_token,
            eos_token_ids: v.eos_token_id.into_iter().collect(),
            add_bos,
        })
    }
}

/// Whether the post-processor puts the BOS id first.
fn adds_bos(tok: &TextTokenizer, bos: Option<&str>) -> Result<bool> {
    let Some(bos_id) = bos.and_then(|b| tok.token_to_id(b)) else {
        return Ok(false);
    };
    let with = tok.encode("", true)?;
    Ok(with.first() == Some(&bos_id))
}

fn dedup_keep_order(ids: &mut Vec<u32>) {
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
}

/// Reads a JSON object; `Ok(None)` when the file does not exist.
fn read_json_object(path: &Path) -> Result<Option<serde_json::Map<String, Json>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(TextError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    match serde_json::from_str::<Json>(&text) {
        Ok(Json::Object(m)) => Ok(Some(m)),
        Ok(other) => Err(TextError::parse(
            path,
            "a JSON object",
            format!("found {}", json_kind(&other)),
        )),
        Err(e) => Err(TextError::parse(path, "a JSON object", e)),
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// A special token given as a string, an AddedToken object `{"content": ..}` or null.
fn token_string(v: Option<&Json>, path: &Path, key: &str) -> Result<Option<String>> {
    match v {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(m)) => match m.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(TextError::parse(
                path,
                format!("\"{key}\" as an AddedToken object with a string \"content\""),
                "\"content\" is missing or not a string",
            )),
        },
        Some(other) => Err(TextError::parse(
            path,
            format!("\"{key}\" to be a string, an AddedToken object or null"),
            format!("found {}", json_kind(other)),
        )),
    }
}

fn bool_field(v: Option<&Json>, path: &Path, key: &str) -> Result<Option<bool>> {
    match v {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(TextError::parse(
            path,
            format!("\"{key}\" to be a boolean"),
            format!("found {}", json_kind(other)),
        )),
    }
}

fn id_list(v: &Json, path: &Path, key: &str) -> Result<Vec<u32>> {
    let one = |x: &Json| -> Result<u32> {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| {
                TextError::parse(
                    path,
                    format!("\"{key}\" to be a token id or a list of token ids"),
                    format!("found {x}"),
                )
            })
    };
    match v {
        Json::Array(items) => items.iter().map(one).collect(),
        x => Ok(vec![one(x)?]),
    }
}

/// The chat template source by the precedence in the module documentation.
fn chat_template_source(
    dir: &Path,
    config_path: &Path,
    from_config: Option<&Json>,
) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(s) => return Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(TextError::Io {
                path: jinja,
                source,
            })
        }
    }
    if let Some(v) = from_config {
        if let Some(s) = template_value(v, config_path)? {
            return Ok(Some(s));
        }
    }
    let json_path: PathBuf = dir.join("chat_template.json");
    if let Some(obj) = read_json_object(&json_path)? {
        if let Some(v) = obj.get("chat_template") {
            return template_value(v, &json_path);
        }
    }
    Ok(None)
}

/// A `chat_template` value: a string, a list of `{name, template}` (take `"default"`), or null.
fn template_value(v: &Json, path: &Path) -> Result<Option<String>> {
    match v {
        Json::Null => Ok(None),
        Json::String(s) => Ok(Some(s.clone())),
        Json::Array(items) => {
            let mut names = Vec::new();
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => {
                        return Err(TextError::parse(
                            path,
                            "\"chat_template\" list entries of the form {\"name\": str, \"template\": str}",
                            format!("found {item}"),
                        ))
                    }
                }
            }
            Err(TextError::parse(
                path,
                "a chat template named \"default\" in the \"chat_template\" list",
                format!("only {names:?} are present"),
            ))
        }
        other => Err(TextError::parse(
            path,
            "\"chat_template\" to be a string or a list of {name, template}",
            format!("found {}", json_kind(other)),
        )),
    }
}
