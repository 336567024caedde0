#!/usr/bin/env bash
# Regenerates fixtures/tiny-qwen3.5/model-f32.gguf from fixtures/tiny-qwen3.5/ (config.json and
# model.safetensors, used unchanged) by running llama.cpp's own converter, convert_hf_to_gguf.py,
# as vendored in the llama-cpp-python sdist pinned below: f32, no MTP layers (--no-mtp: the tiny
# checkpoint has none). crates/dflash-models/tests/gguf_hybrid.rs compares it with the HF directory.
#
# Needs python3 with torch, transformers, numpy, safetensors, tokenizers and pyyaml on PYTHONPATH
# (default /opt/pyt), and pip access to PyPI, or LLAMA_CPP_DIR=<a llama.cpp checkout> instead.
#
# Added for the conversion only, in a temporary copy of the checkpoint:
#  - a tiny byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json) of exactly the
#    checkpoint's 263 tokens: <|endoftext|> <|im_start|> <|im_end|> (ids 0-2; bos 1 and eos 2 as
#    in config.json), the 256 byte symbols, 4 merges. The converter reads the vocabulary from it.
#  - one hook: the converter names the BPE pre-tokenizer by hashing the ids a tokenizer gives a
#    test string, which only known real tokenizers match; the tiny one is given "qwen35", the name
#    real Qwen3.5 GGUFs carry. Nothing else of the converter is changed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
FIXTURE="$ROOT/fixtures/tiny-qwen3.5"
OUT="${1:-$FIXTURE/model-f32.gguf}"
LLAMA_CPP_PYTHON_VERSION=0.3.36
export PYTHONPATH="${PYTHONPATH:-/opt/pyt}"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [ -z "${LLAMA_CPP_DIR:-}" ]; then
    python3 -m pip download --quiet --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$WORK"
    tar xzf "$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$WORK" \
        "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
        "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp/conversion" \
        "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp/gguf-py"
    LLAMA_CPP_DIR="$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
fi

mkdir "$WORK/model"
cp "$FIXTURE/config.json" "$FIXTURE/model.safetensors" "$WORK/model/"

python3 - "$WORK/model" <<'EOF'
import json, sys
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

def bytes_to_unicode():  # GPT-2's printable stand-ins for the 256 bytes
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))

out = sys.argv[1]
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
byte_symbols = [bytes_to_unicode()[b] for b in range(256)]
merges = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r")]
vocab = {t: i for i, t in enumerate(specials + byte_symbols + [a + b for a, b in merges])}
assert len(vocab) == json.load(open(f"{out}/config.json"))["vocab_size"] == 263
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
tok.save(f"{out}/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
           "model_max_length": 256}, open(f"{out}/tokenizer_config.json", "w"), indent=1)
EOF

python3 - "$LLAMA_CPP_DIR" "$WORK/model" "$OUT" <<'EOF'
import runpy, sys
llama_dir, model_dir, outfile = sys.argv[1:]
sys.path[:0] = [llama_dir, f"{llama_dir}/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", "f32", "--no-mtp", "--outfile", outfile]
runpy.run_path(f"{llama_dir}/convert_hf_to_gguf.py", run_name="__main__")
EOF
echo "wrote $OUT ($(stat -c %s "$OUT") bytes)"
