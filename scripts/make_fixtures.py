#!/usr/bin/env python3
"""Reference fixtures for dflash-rs, made with PyTorch + Hugging Face transformers.

Run on the GPU machine (torch 2.11, transformers 5.17); everything is computed in float32 on the CPU there
(TF32 off), so the numbers do not depend on the GPU.  Outputs (all small, committed under fixtures/):

  tiny-llama/      random Llama (GQA, tied embeddings, odd sizes): config.json, model.safetensors
  tiny-llama31/    random Llama with Llama-3.1 rope scaling, untied lm_head
  tiny-qwen3/      random Qwen3 (q/k norm, head_dim != hidden/heads)
  tiny-qwen3.5/    random Qwen3.5 text hybrid (three Gated DeltaNet layers, then a gated full-attention
                   layer; Hv > Hk; partial rotary) — issue 17's reference (`--only-hybrid` makes it alone)
     each with reference.safetensors:
       input_ids [n] i64, logits [n,V], hidden_states.{i} [n,H] for i in 0..=L  (HF hidden_states[i];
       index 0 = embeddings, i = output of decoder layer i-1, the last one after the final norm as HF does)
       layer_output.{l} [n,H]: output of decoder layer l, captured by a forward hook (the DFlash tap)
       cont_input_ids [m], cont_logits [m,V], cont_hidden_states.{i}, cont_layer_output.{l}: a block of m tokens continued over the
       KV cache of the first n tokens (positions n..n+m-1)
  smollm2/text_cases.json   tokenisation and rendered chat template of a few prompts (GGUF tokenizer)
  smollm2/reference.safetensors  input_ids [n], logits_tail [3,V] (last 3 positions), argmax [n],
                                 greedy_ids [k] (greedy continuation, k new tokens)

Usage: make_fixtures.py OUT_DIR [--gguf PATH]
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_num_threads(min(16, os.cpu_count() or 1))

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_VOCAB = 263


def tiny_models():
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=104,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    llama = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0, head_dim=16)
    llama31 = LlamaConfig(
        **{**common, "num_hidden_layers": 2, "num_key_value_heads": 1},
        tie_word_embeddings=False,
        head_dim=16,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    qwen3 = Qwen3Config(
        **{**common, "rms_norm_eps": 1e-6},
        head_dim=24,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        attention_bias=False,
    )
    return [
        ("tiny-llama", LlamaForCausalLM, llama, 11),
        ("tiny-llama31", LlamaForCausalLM, llama31, 12),
        ("tiny-qwen3", Qwen3ForCausalLM, qwen3, 13),
    ]


def init_random(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # norms away from 1 so that a missing or misplaced weight shows
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def tiny_hybrid():
    """The Qwen3.5 text hybrid: the config class and model class transformers names them by."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    from transformers.models.qwen3_5 import configuration_qwen3_5 as c

    cfg = c.Qwen3_5TextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=104,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return [("tiny-qwen3.5", m.Qwen3_5ForCausalLM, cfg, 14)]


def make_tiny(out_dir, models=None):
    for name, cls, cfg, seed in models or tiny_models():
        torch.manual_seed(seed)
        cfg._attn_implementation = "eager"
        model = cls(cfg).to(torch.float32).eval()
        init_random(model, seed)
        d = os.path.join(out_dir, name)
        model.save_pretrained(d, safe_serialization=True)
        g = torch.Generator().manual_seed(seed + 100)
        n, m = 19, 7
        ids = torch.randint(0, TINY_VOCAB, (1, n + m), generator=g)
        captured = []
        hooks = [
            layer.register_forward_hook(lambda _m, _i, o: captured.append((o[0] if isinstance(o, tuple) else o)))
            for layer in model.model.layers
        ]
        with torch.no_grad():
            full = model(ids[:, :n], use_cache=True, output_hidden_states=True)
            full_taps, captured = captured, []
            cont = model(
                ids[:, n:], past_key_values=full.past_key_values, use_cache=True, output_hidden_states=True
            )
            cont_taps = captured
        for h in hooks:
            h.remove()
        t = {"input_ids": ids[0, :n].contiguous(), "cont_input_ids": ids[0, n:].contiguous()}
        t["logits"] = full.logits[0].float().clone().contiguous()
        t["cont_logits"] = cont.logits[0].float().clone().contiguous()
        for i, h in enumerate(full.hidden_states):
            t[f"hidden_states.{i}"] = h[0].float().clone().contiguous()
        for i, h in enumerate(cont.hidden_states):
            t[f"cont_hidden_states.{i}"] = h[0].float().clone().contiguous()
        # the output of decoder layer l (= HF hidden_states[l+1] before any final norm), captured by hooks
        for i, h in enumerate(full_taps):
            t[f"layer_output.{i}"] = h[0].float().clone().contiguous()
        for i, h in enumerate(cont_taps):
            t[f"cont_layer_output.{i}"] = h[0].float().clone().contiguous()
        save_file(t, os.path.join(d, "reference.safetensors"))
        print(f"{name}: layers={cfg.num_hidden_layers} logits {tuple(full.logits.shape)}", flush=True)


ENCODE_TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    "The year 2024 had 366 days; 3.14159 is pi.",
    "  leading spaces and\ttabs\nnew lines\n\n\ndone  ",
    "Unicode: café, naïve, 日本語, emoji 🦀🚀, Ελληνικά.",
    "def add(a, b):\n    return a + b  # sum\n",
    "<|im_start|>user\nhi<|im_end|>",
    "I'm sure you'll see they're right, isn't it?",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about Rust."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primes."},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "Two more?"},
    ],
]


def make_smollm2(out_dir, gguf_path):
    d = os.path.join(out_dir, "smollm2")
    os.makedirs(d, exist_ok=True)
    gdir, gname = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    cases = {"encode": [], "chat": [], "tokenizer_class": type(tok).__name__}
    for text in ENCODE_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        cases["encode"].append({"text": text, "ids": ids, "decoded": tok.decode(ids)})
    for msgs in CHATS:
        for agp in (True, False):
            rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
            ids = tok.encode(rendered, add_special_tokens=False)
            cases["chat"].append({"messages": msgs, "add_generation_prompt": agp, "rendered": rendered, "ids": ids})
    with open(os.path.join(d, "text_cases.json"), "w") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)

    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
        gen = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
    greedy = gen[0, ids.shape[1]:].contiguous()
    save_file(
        {
            "input_ids": ids[0].contiguous(),
            "logits_tail": logits[-3:].contiguous(),
            "argmax": logits.argmax(-1).contiguous(),
            "greedy_ids": greedy,
        },
        os.path.join(d, "reference.safetensors"),
    )
    print("smollm2 greedy:", repr(tok.decode(greedy)), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--only-hybrid", action="store_true")
    a = ap.parse_args()
    print("torch", torch.__version__, "transformers", transformers.__version__, flush=True)
    os.makedirs(a.out, exist_ok=True)
    if a.only_hybrid:
        make_tiny(a.out, tiny_hybrid())
        return 0
    if not a.skip_tiny:
        make_tiny(a.out)
        make_tiny(a.out, tiny_hybrid())
    if a.gguf:
        make_smollm2(a.out, a.gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
