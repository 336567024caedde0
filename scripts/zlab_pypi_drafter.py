#!/usr/bin/env python3
"""Save a SmolLM2-135M drafter with z-lab's own package (PyPI `dflash` 0.1.0, over torch and
transformers), for `dflash diagnose` on a drafter made elsewhere (docs/benchmarks.md, issue 16).

    pip install torch transformers safetensors && pip install --no-deps dflash==0.1.0
    python scripts/zlab_pypi_drafter.py OUT_DIR [--weights drafters/smollm2-135m-instruct] [--layers N]

With --weights the package's DFlashDraftModel loads that drafter's tensors (strict: every name
and shape must match the package's model) before saving; without, it keeps the package's random
initialisation (`--layers` layers). The config is the package's Qwen3Config with the fields z-lab's
checkpoints carry (`dflash_config`, `num_target_layers`, `block_size`, `layer_types`).
"""
import argparse
import glob
import json
import os

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

from dflash import DFlashDraftModel

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--weights")
ap.add_argument("--layers", type=int, default=1)
ap.add_argument("--seed", type=int, default=1)
a = ap.parse_args()

layers, taps = a.layers, None
if a.weights:
    src = json.load(open(os.path.join(a.weights, "config.json")))
    layers = src["num_hidden_layers"]
    taps = src.get("dflash_config", {}).get("target_layer_ids")
torch.manual_seed(a.seed)
# SmolLM2-135M-Instruct's shape (the target: 30 layers, hidden 576, vocab 49152)
cfg = Qwen3Config(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=layers,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=False,
    layer_types=["full_attention"] * layers,
    architectures=["DFlashDraftModel"],
    auto_map={"AutoModel": "dflash.DFlashDraftModel"},
)
cfg.num_target_layers = 30
cfg.block_size = 16
# mask: <jupyter_text> (16, the highest special token that is neither EOS nor BOS, as
# `dflash draft init` picks); taps: the weights' own, else the package's default
# (build_target_layer_ids: [15] for one layer, [1, 8, 14, 20, 27] for five)
cfg.dflash_config = {"mask_token_id": 16}
if taps is not None:
    cfg.dflash_config["target_layer_ids"] = taps
model = DFlashDraftModel(cfg).to(torch.bfloat16)
if a.weights:
    state = {}
    for f in sorted(glob.glob(os.path.join(a.weights, "*.safetensors"))):
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
model.save_pretrained(a.out, safe_serialization=True)
print(json.dumps({"out": a.out, "layers": layers, "target_layer_ids": model.target_layer_ids,
                  "parameters": sum(p.numel() for p in model.parameters())}))
