"""Reference encodings/decodings/chat renderings from Hugging Face transformers loading a GGUF tokenizer.

Produces tests/data/hf_gguf_reference.json for crates/dflash-text (tests/hf_reference.rs).
Run where transformers (5.x) and the `gguf` package are importable:

    python3 hf_gguf_reference.py DIR GGUF_NAME OUT.json

DIR/GGUF_NAME may be a vocabulary-only GGUF (all metadata of the model, no tensors): the tokenizer only
reads metadata. The committed reference was made from such a copy of SmolLM2-135M-Instruct.Q4_1.gguf
(written with candle's `gguf_file::write(&mut w, &all_metadata, &[])`, 1.7 MB) with transformers 5.17.0,
tokenizers 0.23.2 and gguf 0.19.0 on the GPU machine.
"""

import json
import sys

import tokenizers
import transformers
from transformers import AutoTokenizer

TEXTS = [
    "Hello world",
    "Hello, world! How are you?",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "3.14159 and 2024",
    "a 12",
    "a  12",
    "x\n\n42 apples",
    " 42",
    "½ ² ٣ ⅷ",
    "🦀 Rust é 日本語 Ελληνικά русский",
    "emoji 👍🏽 family 👨‍👩‍👧",
    "a   b\t\tc\n\n\nd  ",
    "  leading spaces",
    "trailing   ",
    "\r\nwindows\r\n",
    "<|im_start|>user\nhi<|im_end|>",
    "x<|im_end|>y",
    " <|im_start|> spaced <|im_end|> ",
    "<|endoftext|>",
    "<|im_start",
    "<repo_name>foo<file_sep>bar",
    "don't I'm we've THEY'RE",
    "def f(x):\n    return x**2  # square\n",
    "",
    "   ",
    "\u00a0non-breaking\u2009thin\u200bzero",
]

CHATS = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "user", "content": "What is the capital of France?"}], False),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3? 🦀"},
        ],
        True,
    ),
]


def main():
    d, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    backend = json.loads(tok.backend_tokenizer.to_str())
    backend["model"] = {k: v for k, v in backend["model"].items() if k not in ("vocab", "merges")}
    res = {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "class": type(tok).__name__,
        "backend_without_vocab": backend,
        "len": len(tok),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": getattr(tok, "add_bos_token", None),
        "encode": [],
        "decode": [],
        "chat": [],
    }
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=True)
        ids_plain = tok.encode(t, add_special_tokens=False)
        res["encode"].append({"text": t, "ids": ids, "ids_no_special": ids_plain})
        for skip in (False, True):
            res["decode"].append(
                {"ids": ids, "skip_special_tokens": skip, "text": tok.decode(ids, skip_special_tokens=skip)}
            )
    for ids in ([216, 19556], [1, 216, 905, 2], [2, 905], [10813, 116]):
        for skip in (False, True):
            res["decode"].append(
                {"ids": ids, "skip_special_tokens": skip, "text": tok.decode(ids, skip_special_tokens=skip)}
            )
    for messages, agp in CHATS:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        res["chat"].append({"messages": messages, "add_generation_prompt": agp, "rendered": rendered, "ids": ids})
    with open(out, "w", encoding="utf-8") as f:
        json.dump(res, f, ensure_ascii=False, indent=1)
    print("wrote", out, res["class"], res["transformers"], res["tokenizers"])


if __name__ == "__main__":
    main()
