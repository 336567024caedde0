//! [`TextTokenizer`]: a thin, error-typed wrapper around `tokenizers::Tokenizer`.
//!
//! Invariants:
//! - Encoding and decoding are exactly those of the wrapped `tokenizers` pipeline, which is what
//!   transformers 5.x' `TokenizersBackend` runs (transformers skips its `clean_up_tokenization_spaces` step for
//!   BPE models, so a BPE `decode` here equals `tokenizer.decode` there).
//! - Special (added) tokens written in the text, e.g. `<|im_start|>`, are always matched as single tokens, with
//!   or without `add_special_tokens`, as transformers does (its `split_special_tokens` defaults to false).
//!   `add_special_tokens` only controls the post-processor (BOS/EOS insertion).
//! - `decode` silently drops ids the vocabulary does not know (as `tokenizers` and transformers do), so a model
//!   whose embedding table is padded past the vocabulary cannot make decoding fail.
//! - Loading never panics; errors name the file and what was expected.

use std::path::Path;
use std::str::FromStr;

use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{PostProcessorWrapper, Tokenizer};

use crate::error::{Result, TextError};
use crate::gguf_vocab::GgufVocab;

/// A loaded tokenizer (from a `tokenizer.json` or from GGUF metadata).
#[derive(Clone, Debug)]
pub struct TextTokenizer {
    inner: Tokenizer,
}

impl TextTokenizer {
    /// Loads a `tokenizers` serialisation (`tokenizer.json`). Errors name `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| TextError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Parses a `tokenizer.json` held in memory; `origin` is the path used in error messages.
    pub fn from_json_str(json: &str, origin: &Path) -> Result<Self> {
        let inner = Tokenizer::from_str(json).map_err(|e| {
            TextError::parse(origin, "a Hugging Face tokenizers `tokenizer.json`", e)
        })?;
        Ok(Self { inner })
    }

    /// Builds the tokenizer transformers derives from a GGUF's metadata; see [`crate::gguf_vocab`] for exactly
    /// what is reproduced. Only `tokenizer.ggml.model = "gpt2"` is supported; others are refused with
    /// [`TextError::Unsupported`].
    pub fn from_gguf_vocab(v: &GgufVocab) -> Result<Self> {
        Ok(Self {
            inner: v.build_tokenizer()?,
        })
    }

    /// Wraps an already built `tokenizers::Tokenizer`.
    pub fn from_tokenizer(inner: Tokenizer) -> Self {
        Self { inner }
    }

    /// Token ids of `text`. `add_special_tokens` runs the post-processor (BOS/EOS where the tokenizer adds
    /// them); special tokens written in `text` are matched either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TextError::tokenizer("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; `skip_special_tokens` leaves out special added tokens. Unknown ids are dropped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::tokenizer("decode", e))
    }

    /// Number of distinct tokens including added tokens (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of a token string (vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token string of an id (in byte-level form for byte-level BPE, e.g. `"Ġworld"`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is a special added token (skipped by `decode(.., true)`).
    pub fn is_special_id(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }

    /// Ids of all special added tokens, ascending.
    pub fn special_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The `tokenizer.json` serialisation of this tokenizer.
    pub fn to_json(&self, pretty: bool) -> Result<String> {
        self.inner
            .to_string(pretty)
            .map_err(|e| TextError::tokenizer("serialisation", e))
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Replaces the post-processor by the one transformers' `update_post_processor` builds for these
    /// BOS/EOS settings (`None` = do not add).
    pub(crate) fn set_bos_eos(
        &mut self,
        bos: Option<(String, u32)>,
        eos: Option<(String, u32)>,
    ) -> Result<()> {
        let pp = bos_eos_post_processor(bos, eos)?;
        self.inner.with_post_processor(Some(pp));
        Ok(())
    }
}

/// `TemplateProcessing` as transformers' `update_post_processor` writes it:
/// single `[BOS:0] $A:0 [EOS:0]`, pair `[BOS:0] $A:0 [EOS:0] [BOS:1] $B:1 [EOS:1]`.
pub(crate) fn bos_eos_post_processor(
    bos: Option<(String, u32)>,
    eos: Option<(String, u32)>,
) -> Result<PostProcessorWrapper> {
    for (what, t) in [("BOS", &bos), ("EOS", &eos)] {
        if let Some((s, _)) = t {
            if s.is_empty() || s.contains(':') || s.chars().any(char::is_whitespace) {
                return Err(TextError::InvalidVocab(format!(
                    "{what} token {s:?} cannot be written in a TemplateProcessing post-processor"
                )));
            }
        }
    }
    let seq = |name: &str, type_id: u32| {
        let mut v = Vec::new();
        if let Some((b, _)) = &bos {
            v.push(format!("{b}:{type_id}"));
        }
        v.push(format!("${name}:{type_id}"));
        if let Some((e, _)) = &eos {
            v.push(format!("{e}:{type_id}"));
        }
        v
    };
    let single = seq("A", 0);
    let mut pair = single.clone();
    pair.extend(seq("B", 1));
    let special: Vec<(String, u32)> = bos.iter().chain(eos.iter()).cloned().collect();
    let pp = TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| b.try_pair(pair))
        .map_err(|e| TextError::tokenizer("post-processor construction", e))?
        .special_tokens(special)
        .build()
        .map_err(|e| TextError::tokenizer("post-processor construction", e))?;
    Ok(PostProcessorWrapper::Template(pp))
}
