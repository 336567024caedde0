//! The tokenizer built from SmolLM2-135M-Instruct's GGUF metadata: metadata, known encodings, special tokens,
//! round trips, streaming, and the difference to the original SmolLM2 `tokenizer.json` design.
//! Expected ids come from transformers 5.17 (see tests/data/hf_gguf_reference.json) or from the vocabulary.

mod common;

use dflash_text::gguf_vocab::original_smollm2_pre_tokenizer;
use dflash_text::{StreamDecoder, TextTokenizer};

macro_rules! tok_or_skip {
    ($name:expr) => {
        match common::smollm2_tokenizer($name) {
            Some(t) => t,
            None => return,
        }
    };
}

#[test]
fn gguf_metadata_is_as_documented() {
    let Some(v) = common::smollm2_vocab("gguf_metadata_is_as_documented") else {
        return;
    };
    assert_eq!(v.model, "gpt2");
    assert_eq!(v.pre.as_deref(), Some("smollm"));
    assert_eq!(v.tokens.len(), 49_152);
    assert_eq!(v.merges.len(), 48_900);
    assert_eq!(
        &v.tokens[..3],
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    );
    assert_eq!(
        (
            v.bos_token_id,
            v.eos_token_id,
            v.unknown_token_id,
            v.padding_token_id
        ),
        (Some(1), Some(2), Some(0), Some(2))
    );
    assert_eq!(v.add_bos_token, Some(false));
    let control: Vec<usize> = (0..v.token_types.len())
        .filter(|&i| v.token_types[i] == 3)
        .collect();
    assert_eq!(control, (0..17).collect::<Vec<_>>());
    assert!(v.token_types.iter().all(|&t| t == 1 || t == 3));
    assert!(v
        .chat_template
        .as_deref()
        .unwrap_or("")
        .contains("<|im_start|>"));
}

#[test]
fn vocab_and_special_tokens() {
    let tok = tok_or_skip!("vocab_and_special_tokens");
    assert_eq!(tok.vocab_size(), 49_152);
    assert_eq!(tok.special_token_ids(), (0..17).collect::<Vec<u32>>());
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.token_to_id("Ġworld"), Some(905));
    assert!(tok.is_special_id(0) && !tok.is_special_id(905));
    assert_eq!(tok.id_to_token(49_152), None);
}

#[test]
fn known_encodings() {
    let tok = tok_or_skip!("known_encodings");
    let cases: &[(&str, &[u32])] = &[
        // ASCII words and punctuation.
        ("Hello world", &[19556, 905]),
        (
            "Hello, world! How are you?",
            &[19556, 28, 905, 17, 1073, 359, 346, 47],
        ),
        ("don't I'm we've", &[12420, 982, 339, 5248, 392, 3543]),
        // Digits: the vocabulary has single digits only.
        ("12345", &[33, 34, 35, 36, 37]),
        (
            "3.14159 and 2024",
            &[35, 30, 33, 36, 33, 37, 41, 284, 216, 34, 32, 34, 36],
        ),
        (" 42", &[216, 36, 34]),
        // Unicode and emoji as byte-level pieces.
        (
            "🦀 Rust é 日本語",
            &[
                10813, 116, 218, 36828, 26411, 17097, 241, 115, 40993, 179, 120, 248,
            ],
        ),
        // Whitespace runs: GPT-2 regex `\s+(?!\S)` keeps the last space for the next word.
        (
            "a   b\t\tc\n\n\nd  ",
            &[81, 256, 278, 197, 197, 83, 1116, 198, 84, 256],
        ),
        ("  leading", &[216, 2899]),
        ("   ", &[333]),
        // Special tokens inside text.
        ("<|im_start|>user\nhi<|im_end|>", &[1, 4093, 198, 6004, 2]),
        ("x<|im_end|>y", &[104, 2, 105]),
        ("<|endoftext|>", &[0]),
        // An incomplete special token is ordinary text.
        ("<|im_start", &[44, 108, 306, 79, 3738]),
    ];
    for (text, want) in cases {
        for add_special in [true, false] {
            let got = tok.encode(text, add_special).unwrap();
            assert_eq!(
                &got,
                want,
                "{text:?} (add_special_tokens={add_special}): {:?}",
                common::pieces(tok, &got)
            );
        }
    }
}

#[test]
fn special_tokens_are_atomic_and_skippable() {
    let tok = tok_or_skip!("special_tokens_are_atomic_and_skippable");
    let ids = tok
        .encode("<|im_start|>assistant\nok<|im_end|><|endoftext|>", true)
        .unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(&ids[ids.len() - 2..], &[2, 0]);
    assert_eq!(
        tok.decode(&ids, false).unwrap(),
        "<|im_start|>assistant\nok<|im_end|><|endoftext|>"
    );
    assert_eq!(tok.decode(&ids, true).unwrap(), "assistant\nok");
    // No BOS is added (add_bos_token = false), and no leading space is stripped on decode.
    assert_eq!(tok.encode("", true).unwrap(), Vec::<u32>::new());
    assert_eq!(tok.decode(&[216, 19556], false).unwrap(), " Hello");
    // Unknown ids are dropped, not an error.
    assert_eq!(tok.decode(&[19556, 4_000_000], false).unwrap(), "Hello");
}

const VARIED: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, עברית, العربية, हिन्दी",
    "CJK 日本語のテキスト 中文文本 한국어 텍스트",
    "emoji 👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 crab 🦀",
    "code:\n\tfn main() {\n        println!(\"{}\", 1 + 2);\n    }\n",
    "  \n\r\n \t mixed   whitespace \u{a0}\u{2009}\u{200b}  ",
    "math ½ ² ٣ ⅷ 3.14e-10 0x1F",
    "<|im_start|>system\nsp<|im_end|>\n<|im_start|>user\n🦀?<|im_end|>\n",
    "",
];

#[test]
fn encode_decode_round_trip() {
    let tok = tok_or_skip!("encode_decode_round_trip");
    for text in VARIED {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(&tok.decode(&ids, false).unwrap(), text);
    }
}

fn stream(tok: &TextTokenizer, ids: &[u32], skip: bool) -> Vec<String> {
    let mut d = StreamDecoder::new(tok, skip);
    let mut out = Vec::new();
    for &id in ids {
        if let Some(c) = d.push(id).unwrap() {
            out.push(c);
        }
    }
    out.extend(d.finish().unwrap());
    out
}

#[test]
fn stream_decoder_matches_full_decode() {
    let tok = tok_or_skip!("stream_decoder_matches_full_decode");
    for text in VARIED {
        let ids = tok.encode(text, true).unwrap();
        for skip in [false, true] {
            let chunks = stream(tok, &ids, skip);
            assert_eq!(
                chunks.concat(),
                tok.decode(&ids, skip).unwrap(),
                "{text:?} skip={skip}"
            );
            for c in &chunks {
                assert!(
                    !c.contains('\u{FFFD}'),
                    "{text:?}: chunk {c:?} splits a character"
                );
            }
        }
    }
    // A 4-byte emoji split over byte pieces is emitted once, whole.
    let ids = tok.encode("🦀", false).unwrap();
    assert!(ids.len() > 1);
    assert_eq!(stream(tok, &ids, false), vec!["🦀".to_string()]);
}

#[test]
fn original_smollm2_design_differs_only_before_digits() {
    let tok = tok_or_skip!("original_smollm2_design_differs_only_before_digits");
    let mut orig = tok.inner().clone();
    orig.with_pre_tokenizer(Some(original_smollm2_pre_tokenizer()));
    let orig = TextTokenizer::from_tokenizer(orig);
    let numeric_after_space = |t: &str| {
        let c: Vec<char> = t.chars().collect();
        c.windows(2)
            .any(|w| w[0].is_whitespace() && w[1].is_numeric())
    };
    // Wherever no whitespace precedes a numeric character, both designs agree: the vocabulary has no
    // multi-digit tokens, so splitting digits first changes nothing.
    let mut compared = 0;
    for text in VARIED
        .iter()
        .chain(&["12345", "3.14159 and2024", "x1y2", "½²"])
    {
        if numeric_after_space(text) {
            continue;
        }
        assert_eq!(
            tok.encode(text, false).unwrap(),
            orig.encode(text, false).unwrap(),
            "{text:?}"
        );
        compared += 1;
    }
    assert!(compared >= 10);
    // Whitespace before a numeric character: the GGUF path (GPT-2 regex only, as transformers) gives the
    // last space to the number (` ?\p{N}+`), the original design (digits split first) keeps the whitespace
    // run together, and a space before a non-ASCII numeric can merge with it.
    let pieces = |t: &TextTokenizer, s: &str| common::pieces(t, &t.encode(s, false).unwrap());
    assert_eq!(pieces(tok, "a  12"), ["a", "Ġ", "Ġ", "1", "2"]);
    assert_eq!(pieces(&orig, "a  12"), ["a", "ĠĠ", "1", "2"]);
    assert_eq!(pieces(tok, " 42"), pieces(&orig, " 42"));
    assert_ne!(pieces(tok, "x ½"), pieces(&orig, "x ½"));
}
