//! A GGUF file's `tokenizer.*` metadata as plain data, and the `tokenizers` pipeline built from it.
//!
//! The models crate reads the GGUF and fills [`GgufVocab`]; this crate never parses GGUF itself.
//!
//! # What is reproduced
//!
//! The reference is Hugging Face transformers (5.x) loading the GGUF with
//! `AutoTokenizer.from_pretrained(dir, gguf_file=..)`. transformers picks its converter by the GGUF's
//! *architecture*; for `general.architecture = "llama"` (SmolLM2) it uses `GGUFLlamaConverter`, and because
//! `tokenizer.ggml.model` is not `"llama"` that converter takes its "llama-3" branch. For
//! `tokenizer.ggml.model = "gpt2"` this module builds the same pipeline:
//!
//! - model: BPE over `tokens` (id = position; on duplicate strings the last id wins, as a Python dict does)
//!   and `merges` (each `"a b"` split on its one space), `unk_token = tokens[unknown_token_id]`,
//!   `fuse_unk = true`, `byte_fallback = true`, no subword prefix/suffix, no dropout;
//! - normalizer: an empty `Sequence` (identity);
//! - pre-tokenizer: `ByteLevel(add_prefix_space=false, trim_offsets=false, use_regex=true)`, i.e. the GPT-2
//!   regex only. `tokenizer.ggml.pre` is ignored, as transformers ignores it;
//! - added tokens: every token whose `token_type` is 3 (control) becomes a special added token
//!   (`normalized=false`, no strip, not single-word), in id order. Type 4 (user-defined) tokens are NOT added:
//!   transformers' llama converter does not read them (they stay ordinary BPE vocabulary entries);
//! - decoder: `Sequence[ByteFallback, Fuse, Replace("▁"→" "), ByteLevel]`;
//! - post-processor: `TemplateProcessing` `$A:0` / `$A:0 $B:1` (what transformers' `update_post_processor`
//!   installs when `add_bos_token` is false), so `encode(.., add_special_tokens=true)` adds nothing.
//!
//! # Known differences and assumptions
//!
//! - transformers appends `Strip(" ", left=1)` to the decoder unless the GGUF carries
//!   `tokenizer.ggml.add_space_prefix` (false). [`GgufVocab`] has no field for that key, so this module assumes
//!   it is present and false, which holds for SmolLM2-135M-Instruct.Q4_1.gguf (and llama.cpp's GPT-2 style
//!   conversions generally). A GGUF without the key would decode with one leading space more than transformers.
//! - transformers' GGUF loader ignores `tokenizer.ggml.add_bos_token` / `add_eos_token`; this module honours
//!   them when `Some(true)` (prepending/appending the BOS/EOS token in the post-processor), as llama.cpp does.
//!   They are false/absent for SmolLM2, where the two agree.
//! - transformers' converter also sets the tokenizer's `eos_token` to `tokens[bos_token_id]` (a bug);
//!   [`crate::TextAssets::from_gguf_vocab`] uses `tokens[eos_token_id]`.
//! - The original SmolLM2 `tokenizer.json` pre-tokenizes with
//!   `Sequence[Digits(individual_digits=true), ByteLevel(add_prefix_space=false, trim_offsets=true)]` (llama.cpp's
//!   `smollm` pre-tokenizer is the same: `\p{N}` split, then the GPT-2 regex). The GGUF path has no `Digits` split;
//!   see [`original_smollm2_pre_tokenizer`] for a comparison.
//!
//! Invariants: building never panics; every inconsistency (ids out of range, merges that do not split in two or
//! name tokens absent from the vocabulary, length mismatches) is a [`TextError::InvalidVocab`], and non-`gpt2`
//! models are a [`TextError::Unsupported`].

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, Tokenizer};

use crate::error::{Result, TextError};
use crate::tokenizer::bos_eos_post_processor;

/// GGUF `tokenizer.ggml.token_type` value of control (special) tokens.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF `tokenizer.ggml.token_type` value of user-defined tokens.
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Plain data read from a GGUF file's `tokenizer.*` metadata (the models crate fills it; this crate never reads
/// GGUF itself). Absent arrays are empty vectors, absent scalars `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`, e.g. `"gpt2"` or `"llama"`.
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `"smollm"`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`; the id of a token is its position.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte); empty or
    /// as long as `tokens`.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.scores` (unused by BPE).
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.merges`, each `"left right"`.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

impl GgufVocab {
    /// The token string of `id`, or an error naming `what` (e.g. `"tokenizer.ggml.bos_token_id"`).
    pub fn token(&self, id: u32, what: &str) -> Result<&str> {
        self.tokens
            .get(id as usize)
            .map(String::as_str)
            .ok_or_else(|| {
                TextError::InvalidVocab(format!(
                    "{what} = {id} but tokenizer.ggml.tokens has only {} entries",
                    self.tokens.len()
                ))
            })
    }

    /// Checks that the arrays agree in length and that every special id names a token.
    fn validate(&self) -> Result<()> {
        if self.tokens.is_empty() {
            return Err(TextError::InvalidVocab(
                "tokenizer.ggml.tokens is empty or missing".into(),
            ));
        }
        if self.tokens.len() > u32::MAX as usize {
            return Err(TextError::InvalidVocab(format!(
                "tokenizer.ggml.tokens has {} entries, more than u32 ids can address",
                self.tokens.len()
            )));
        }
        if !self.token_types.is_empty() && self.token_types.len() != self.tokens.len() {
            return Err(TextError::InvalidVocab(format!(
                "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                self.token_types.len(),
                self.tokens.len()
            )));
        }
        for (name, id) in [
            ("tokenizer.ggml.bos_token_id", self.bos_token_id),
            ("tokenizer.ggml.eos_token_id", self.eos_token_id),
            ("tokenizer.ggml.unknown_token_id", self.unknown_token_id),
            ("tokenizer.ggml.padding_token_id", self.padding_token_id),
        ] {
            if let Some(id) = id {
                self.token(id, name)?;
            }
        }
        Ok(())
    }

    /// The merges as pairs, each entry split on its single space.
    fn merge_pairs(&self) -> Result<Vec<(String, String)>> {
        self.merges
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut parts = m.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(a), Some(b), None) if !a.is_empty() && !b.is_empty() => {
                        Ok((a.to_string(), b.to_string()))
                    }
                    _ => Err(TextError::InvalidVocab(format!(
                        "tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by one space"
                    ))),
                }
            })
            .collect()
    }

    /// Builds the `tokenizers` pipeline described in the module documentation.
    pub(crate) fn build_tokenizer(&self) -> Result<Tokenizer> {
        if self.model != "gpt2" {
            return Err(TextError::Unsupported(format!(
                "tokenizer.ggml.model = {:?}; only \"gpt2\" (byte-level BPE) is supported",
                self.model
            )));
        }
        self.validate()?;
        if self.merges.is_empty() {
            return Err(TextError::InvalidVocab(
                "tokenizer.ggml.model is \"gpt2\" but tokenizer.ggml.merges is empty or missing"
                    .into(),
            ));
        }

        let mut vocab = Vocab::default();
        for (id, tok) in self.tokens.iter().enumerate() {
            vocab.insert(tok.clone(), id as u32);
        }
        let merges = self.merge_pairs()?;
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .fuse_unk(true)
            .byte_fallback(true);
        if let Some(unk) = self.unknown_token_id {
            builder = builder.unk_token(self.token(unk, "tokenizer.ggml.unknown_token_id")?.into());
        }
        let bpe = builder
            .build()
            .map_err(|e| TextError::InvalidVocab(format!("cannot build the BPE model: {e}")))?;

        let mut tok = Tokenizer::new(bpe);
        tok.with_normalizer(Some(NormalizerWrapper::Sequence(NormalizerSequence::new(
            vec![],
        ))));
        tok.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, false, true,
        ))));
        tok.with_decoder(Some(gguf_llama3_decoder()?));

        let specials: Vec<AddedToken> = self
            .token_types
            .iter()
            .zip(&self.tokens)
            .filter(|(ty, t)| **ty == TOKEN_TYPE_CONTROL && !t.is_empty())
            .map(|(_, t)| AddedToken::from(t.clone(), true).normalized(false))
            .collect();
        if !specials.is_empty() {
            tok.add_special_tokens(&specials);
        }

        let pick =
            |flag: Option<bool>, id: Option<u32>, name: &str| -> Result<Option<(String, u32)>> {
                match (flag, id) {
                    (Some(true), Some(id)) => Ok(Some((self.token(id, name)?.to_string(), id))),
                    _ => Ok(None),
                }
            };
        let bos = pick(
            self.add_bos_token,
            self.bos_token_id,
            "tokenizer.ggml.bos_token_id",
        )?;
        let eos = pick(
            self.add_eos_token,
            self.eos_token_id,
            "tokenizer.ggml.eos_token_id",
        )?;
        tok.with_post_processor(Some(bos_eos_post_processor(bos, eos)?));
        Ok(tok)
    }
}

/// The decoder transformers' `GGUFLlamaConverter` builds for non-`llama` GGUF tokenizers with
/// `add_space_prefix = false`.
fn gguf_llama3_decoder() -> Result<DecoderWrapper> {
    let replace =
        Replace::new("▁", " ").map_err(|e| TextError::tokenizer("decoder construction", e))?;
    Ok(DecoderWrapper::Sequence(DecoderSequence::new(vec![
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
        DecoderWrapper::Replace(replace),
        // transformers' Python `decoders.ByteLevel(..)` ignores its arguments and serialises the defaults
        // (true, true, true); a decoder ignores them anyway. Defaults here keep the JSON identical.
        DecoderWrapper::ByteLevel(ByteLevel::default()),
    ])))
}

/// The pre-tokenizer of the original SmolLM2 `tokenizer.json` (digits split one by one, then byte-level with
/// the GPT-2 regex). Not used by [`crate::TextTokenizer::from_gguf_vocab`]; exposed so tests and tools can
/// measure where the GGUF path (no digit split) and the original design disagree.
pub fn original_smollm2_pre_tokenizer() -> PreTokenizerWrapper {
    PreTokenizerWrapper::Sequence(PreTokenizerSequence::new(vec![
        PreTokenizerWrapper::Digits(Digits::new(true)),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> GgufVocab {
        GgufVocab {
            model: "gpt2".into(),
            tokens: ["<s>", "a", "b", "ab", "Ġ", "Ġab"]
                .map(String::from)
                .to_vec(),
            token_types: vec![3, 1, 1, 1, 1, 1],
            merges: vec!["a b".into(), "Ġ ab".into()],
            bos_token_id: Some(0),
            ..Default::default()
        }
    }

    #[test]
    fn builds_tiny_vocab() {
        let tok = tiny().build_tokenizer().unwrap();
        let enc = tok.encode("ab ab<s>", true).unwrap();
        assert_eq!(enc.get_ids(), &[3, 5, 0]);
        assert_eq!(tok.decode(&[3, 5, 0], true).unwrap(), "ab ab");
    }

    #[test]
    fn rejects_bad_metadata() {
        let mut v = tiny();
        v.model = "llama".into();
        assert!(matches!(
            v.build_tokenizer(),
            Err(TextError::Unsupported(_))
        ));
        let mut v = tiny();
        v.merges.push("a b c".into());
        let e = v.build_tokenizer().unwrap_err().to_string();
        assert!(e.contains("merges[2]"), "{e}");
        let mut v = tiny();
        v.merges.push("a x".into());
        assert!(matches!(
            v.build_tokenizer(),
            Err(TextError::InvalidVocab(_))
        ));
        let mut v = tiny();
        v.eos_token_id = Some(99);
        let e = v.build_tokenizer().unwrap_err().to_string();
        assert!(e.contains("eos_token_id = 99"), "{e}");
        let mut v = tiny();
        v.token_types.pop();
        assert!(matches!(
            v.build_tokenizer(),
            Err(TextError::InvalidVocab(_))
        ));
        let mut v = tiny();
        v.merges.clear();
        assert!(matches!(
            v.build_tokenizer(),
            Err(TextError::InvalidVocab(_))
        ));
    }

    #[test]
    fn add_bos_flag_is_honoured() {
        let mut v = tiny();
        v.add_bos_token = Some(true);
        let tok = v.build_tokenizer().unwrap();
        assert_eq!(tok.encode("ab", true).unwrap().get_ids(), &[0, 3]);
        assert_eq!(tok.encode("ab", false).unwrap().get_ids(), &[3]);
    }
}
