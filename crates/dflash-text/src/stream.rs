//! [`StreamDecoder`]: incremental detokenisation for streaming generation.
//!
//! Invariants:
//! - Concatenating every string returned by [`StreamDecoder::push`] and [`StreamDecoder::finish`] gives
//!   `tokenizer.decode(all_ids, skip_special)` for the byte-level BPE and SentencePiece-style decoders this
//!   project uses (tested on SmolLM2 with multi-byte text, emoji and special tokens).
//! - A returned chunk never ends inside a UTF-8 character: text whose decoding ends in U+FFFD (a byte-level
//!   piece that stops mid-character) is held back until a later id completes it, or until `finish`.
//! - Cost per id is two decodes of a short window (the ids since the last emitted chunk plus the chunk
//!   before), not of the whole sequence.
//!
//! Method (as `tokenizers`' `DecodeStream` and transformers' `TextStreamer`): decode a window that starts at
//! `prefix` once without and once with the new ids, and emit the difference. Decoders can treat the start of a
//! string specially (a `Strip` of the leading space, a Metaspace prefix), so the window is extended backwards
//! while its prefix part decodes to nothing (e.g. only skipped special tokens): then the start-of-string rule
//! cannot hit the new text. If the window's two decodes still disagree on their common part, the chunk is
//! computed from full decodes instead (slow path, never taken by byte-level BPE).

use crate::error::Result;
use crate::tokenizer::TextTokenizer;

const REPLACEMENT: char = '\u{FFFD}';

/// Streaming detokenizer: push ids one by one, get the newly completed text.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tok: &'a TextTokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Start of the decode window.
    prefix: usize,
    /// End of the ids whose text has been emitted.
    read: usize,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder with no ids yet; `skip_special` as in [`TextTokenizer::decode`].
    pub fn new(tok: &'a TextTokenizer, skip_special: bool) -> Self {
        Self {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Adds one id; returns the text it completes, or `None` while nothing new is complete.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        self.step(false)
    }

    /// Emits whatever is still held back (an incomplete character decodes to U+FFFD, as in a full decode).
    /// Further `push` calls continue the same stream.
    pub fn finish(&mut self) -> Result<Option<String>> {
        self.step(true)
    }

    fn decode(&self, from: usize, to: usize) -> Result<String> {
        self.tok.decode(&self.ids[from..to], self.skip_special)
    }

    fn step(&mut self, flush: bool) -> Result<Option<String>> {
        if self.read == self.ids.len() {
            return Ok(None);
        }
        let mut prefix_text = self.decode(self.prefix, self.read)?;
        while prefix_text.is_empty() && self.prefix > 0 {
            self.prefix -= 1;
            prefix_text = self.decode(self.prefix, self.read)?;
        }
        let new_text = self.decode(self.prefix, self.ids.len())?;
        let chunk = match new_text.strip_prefix(prefix_text.as_str()) {
            Some(rest) => rest.to_string(),
            None => self.slow_chunk()?,
        };
        if chunk.is_empty() || (!flush && chunk.ends_with(REPLACEMENT)) {
            return Ok(None);
        }
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(Some(chunk))
    }

    /// The new text from full decodes (used only when the window decodes are inconsistent).
    fn slow_chunk(&self) -> Result<String> {
        let done = self.decode(0, self.read)?;
        let all = self.decode(0, self.ids.len())?;
        Ok(match all.strip_prefix(done.as_str()) {
            Some(rest) => rest.to_string(),
            // The decoder rewrote already emitted text; nothing can be retracted, emit only the tail
            // beyond what was emitted.
            None => all.get(done.len()..).unwrap_or_default().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf_vocab::GgufVocab;

    /// Byte-level vocab: the 256 byte symbols plus a special token.
    fn byte_tok() -> TextTokenizer {
        let bl = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
        let mut tokens: Vec<String> = bl.into_iter().map(|c| c.to_string()).collect();
        tokens.sort();
        tokens.insert(0, "<|s|>".into());
        let n = tokens.len();
        tokens.push("ĠĠ".into());
        let mut token_types = vec![1; tokens.len()];
        token_types[0] = 3;
        let v = GgufVocab {
            model: "gpt2".into(),
            tokens,
            token_types,
            merges: vec!["Ġ Ġ".into()],
            ..Default::default()
        };
        assert_eq!(n, 257);
        TextTokenizer::from_gguf_vocab(&v).unwrap()
    }

    fn stream_all(tok: &TextTokenizer, ids: &[u32], skip: bool) -> (String, Vec<String>) {
        let mut d = StreamDecoder::new(tok, skip);
        let mut chunks = Vec::new();
        for &id in ids {
            if let Some(c) = d.push(id).unwrap() {
                chunks.push(c);
            }
        }
        if let Some(c) = d.finish().unwrap() {
            chunks.push(c);
        }
        (chunks.concat(), chunks)
    }

    #[test]
    fn byte_pieces_are_held_until_complete() {
        let tok = byte_tok();
        let text = "a é 🦀<|s|>  x";
        let ids = tok.encode(text, false).unwrap();
        for skip in [false, true] {
            let (s, chunks) = stream_all(&tok, &ids, skip);
            assert_eq!(s, tok.decode(&ids, skip).unwrap());
            assert!(
                chunks.iter().all(|c| !c.contains(REPLACEMENT)),
                "{chunks:?}"
            );
        }
        // The crab is 4 byte tokens: exactly one chunk holds it.
        let (_, chunks) = stream_all(&tok, &ids, false);
        assert!(chunks.contains(&"🦀".to_string()), "{chunks:?}");
    }

    #[test]
    fn finish_flushes_incomplete_character() {
        let tok = byte_tok();
        let ids = tok.encode("é", false).unwrap();
        assert_eq!(ids.len(), 2);
        let mut d = StreamDecoder::new(&tok, false);
        assert_eq!(d.push(ids[0]).unwrap(), None);
        assert_eq!(d.finish().unwrap().as_deref(), Some("\u{FFFD}"));
        assert_eq!(d.finish().unwrap(), None);
    }
}
