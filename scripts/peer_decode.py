#!/usr/bin/env python3
"""The peer column for `dflash bench decode`: the same step parts timed in transformers.

Run on the GPU machine (torch + transformers 5.x; no network needed): each named shape is built
from its config with random weights directly on the GPU (`attn_implementation="sdpa"`), the
context is prefilled into a DynamicCache, and then, after warm-up, each op is timed between
`torch.cuda.synchronize()` calls and the median of `--rounds` runs is reported:

- `ar_step_ms`: one token over the cache (logits of that token only), its argmax read back, the
  cache cropped back to the context;
- `sampled_step_ms`: the same with T = 0.7, top-p 0.9 sampling on the GPU (torch ops);
- `verify_ms.chain16`: a block of `--block-size` tokens (causal), every row's argmax read back;
- `verify_ms.treeW`: a tree of W + 1 nodes (a binary-heap tree, `parents[i] = (i - 1) // 2`,
  positions context + depth) under a 4D ancestor mask; null (with `tree_error`) when this
  transformers refuses custom 4D masks. No KV compaction (dflash's includes it);
- `copy_gbps`: a 2 GiB `clone` (bytes read + written), and `floor_ms`: the bytes an AR step must
  read (weights once in the compute dtype, the embedding as one row unless tied, K and V at the
  context) over that bandwidth.

Prints JSON (and writes it with `--out`) with the keys `dflash bench decode` uses, plus
`peer: "transformers <version>"`. Importable without torch: torch is imported inside main.

    python3 scripts/peer_decode.py --shape qwen3-8b --context 512 --out peer.json
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

SHAPES = {
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
                 tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=40960,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False),
}

# Qwen3.5 / Qwen3.6 hybrids (Gated DeltaNet + gated attention; text_config of the hub configs, as
# `dflash bench decode`'s named shapes): three linear-attention layers for every full-attention one.
# Their recurrent states cannot be cropped, so each timed step starts from a copy of the prefilled
# cache made outside the timing; trees are not timed (transformers' linear-attention layers take
# no tree masks: null, with tree_error).
_HYBRID = dict(model_type="qwen3_5_text", num_attention_heads=None, num_key_value_heads=4,
               head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
               vocab_size=248320, max_position_embeddings=262144, attn_output_gate=True,
               rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                    partial_rotary_factor=0.25))
# the tiny hybrid of fixtures/tiny-qwen3.5 (for a CPU check of this script: --device cpu)
SHAPES["tiny-qwen3.5"] = dict(_HYBRID, vocab_size=512, hidden_size=64, intermediate_size=104,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=16, linear_value_head_dim=16,
                              max_position_embeddings=4096, tie_word_embeddings=False,
                              layer_types=["linear_attention"] * 3 + ["full_attention"])
SHAPES["qwen3.5-4b"] = dict(_HYBRID, hidden_size=2560, intermediate_size=9216,
                            num_hidden_layers=32, num_attention_heads=16,
                            linear_num_value_heads=32, tie_word_embeddings=True,
                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8)
SHAPES["qwen3.6-27b"] = dict(_HYBRID, hidden_size=5120, intermediate_size=17408,
                             num_hidden_layers=64, num_attention_heads=24,
                             linear_num_value_heads=48, tie_word_embeddings=False,
                             layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--widths", default="16,64,256")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args(argv)
    try:
        a.widths = sorted({int(w) for w in a.widths.split(",") if w.strip()})
    except ValueError:
        p.error(f"--widths: bad list {a.widths!r}")
    if not a.widths or min(a.widths) <= 0 or a.rounds <= 0 or a.context < 1 or a.block_size < 2:
        p.error("--widths, --rounds, --context must be positive and --block-size at least 2")
    return a


def crop(cache, ctx):
    """Drops the cache's rows past `ctx` (a negative count: positive lengths are deprecated)."""
    extra = cache.get_seq_length() - ctx
    if extra > 0:
        cache.crop(-extra)


def tree_parents(n):
    """A binary-heap tree of n nodes: node 0 the root, parents[i] = (i - 1) // 2."""
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def main(argv=None):
    a = parse_args(argv)
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    dev = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    spec = dict(SHAPES[a.shape])
    if a.context + max(max(a.widths) + 1, a.block_size) > spec["max_position_embeddings"]:
        sys.exit("context too long for the shape")
    torch.manual_seed(a.seed)
    mt = spec.pop("model_type")
    cfg = AutoConfig.for_model(mt, **spec)
    cfg._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    with torch.device(dev):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        except TypeError:
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype,
                                                     attn_implementation="sdpa")
    model = model.to(dev, dtype).eval()
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    sync()
    build_s = time.perf_counter() - t0

    hybrid = mt == "qwen3_5_text"

    def timed(f):
        for _ in range(max(a.warmup, 1)):
            restore()
            f()
        sync()
        v = []
        for _ in range(a.rounds):
            restore()
            sync()
            t = time.perf_counter()
            f()
            sync()
            v.append(time.perf_counter() - t)
        v.sort()
        return {"median_ms": statistics.median(v) * 1e3, "min_ms": v[0] * 1e3,
                "p90_ms": v[max(-(-len(v) * 9 // 10), 1) - 1] * 1e3}

    # a dense cache is cropped back to the context after each step; a hybrid's is replaced by a
    # copy of the prefilled one before each (outside the timing)
    state = {"snapshot": None}

    def restore():
        if state["snapshot"] is not None:
            nonlocal cache
            cache = copy.deepcopy(state["snapshot"])

    def crop_back(c):
        if not hybrid:
            crop(c, ctx)

    # copy bandwidth: a 2 GiB clone, bytes read + written
    n = 2 << 30 if dev.type == "cuda" else 256 << 20
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    copy_t = timed(lambda: x.clone())
    del x
    copy_gbps = 2 * n / (copy_t["median_ms"] / 1e3) / 1e9

    ctx = a.context
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    ids = torch.tensor([[(i * 7919 + 13) % vocab for i in range(ctx)]], device=dev)
    stats = {}
    with torch.inference_mode():
        if hybrid:  # the model makes the cache its layers need (attention and recurrent)
            cache = None
        elif "config" in DynamicCache.__init__.__code__.co_varnames:
            cache = DynamicCache(config=cfg)
        else:
            cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        if hybrid:
            state["snapshot"] = copy.deepcopy(cache)
        bonus = int(out.logits[0, -1].argmax())
        one = torch.tensor([[bonus]], device=dev)
        one_pos = torch.tensor([[ctx]], device=dev)

        def ar_step():
            o = model(input_ids=one, position_ids=one_pos, past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
            int(o.logits[0, -1].argmax())
            crop_back(cache)

        gen = torch.Generator(device=dev).manual_seed(1)

        def sampled_step():
            o = model(input_ids=one, position_ids=one_pos, past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
            p = torch.softmax(o.logits[0, -1].float() / 0.7, -1)
            sp, si = p.sort(descending=True)
            keep = sp.cumsum(-1) - sp < 0.9
            sp = sp * keep
            int(si[torch.multinomial(sp / sp.sum(), 1, generator=gen)])
            crop_back(cache)

        stats["ar_step"] = timed(ar_step)
        stats["sampled_step"] = timed(sampled_step)

        bs = a.block_size
        block = torch.tensor([[(bonus + 31 * i) % vocab for i in range(bs)]], device=dev)
        block_pos = torch.arange(ctx, ctx + bs, device=dev)[None]

        def verify_chain():
            o = model(input_ids=block, position_ids=block_pos, past_key_values=cache,
                      use_cache=True)
            o.logits[0].argmax(-1).tolist()
            crop_back(cache)

        stats[f"verify.chain{bs}"] = timed(verify_chain)

        tree_error = None
        tree_mask_kind = None
        for w in a.widths if not hybrid else []:
            nodes = w + 1
            parents = tree_parents(nodes)
            depth = [0] * nodes
            vis = torch.zeros(nodes, ctx + nodes, dtype=torch.bool)
            vis[:, :ctx] = True
            for i in range(nodes):
                if i:
                    depth[i] = depth[parents[i]] + 1
                j = i
                while j >= 0:
                    vis[i, ctx + j] = True
                    j = parents[j]
            tok = torch.tensor([[(bonus + 17 * i) % vocab for i in range(nodes)]], device=dev)
            pos = torch.tensor([[ctx + d for d in depth]], device=dev)
            masks = [("4d bool", vis[None, None].to(dev))]
            additive = torch.zeros(nodes, ctx + nodes, dtype=dtype)
            additive.masked_fill_(~vis, torch.finfo(dtype).min)
            masks.append(("4d additive", additive[None, None].to(dev)))
            key = f"verify.tree{w}"
            stats[key] = None
            for kind, m in masks if tree_mask_kind is None else \
                    [x for x in masks if x[0] == tree_mask_kind]:
                def verify_tree(m=m, tok=tok, pos=pos):
                    o = model(input_ids=tok, position_ids=pos, attention_mask=m,
                              past_key_values=cache, use_cache=True)
                    o.logits[0].argmax(-1).tolist()
                    crop(cache, ctx)
                try:
                    stats[key] = timed(verify_tree)
                    tree_mask_kind = kind
                    tree_error = None
                    break
                except Exception as e:  # this transformers refuses the mask: try the next kind
                    crop(cache, ctx)
                    tree_error = f"{kind}: {type(e).__name__}: {e}"[:500]

    if hybrid:
        tree_error = "a hybrid's linear-attention layers take no tree masks in transformers"
        for w in a.widths:
            stats[f"verify.tree{w}"] = None
    params = sum(p.numel() for p in model.parameters())
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    weights = params if tied else params - vocab * hidden + hidden
    hd = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    attn_layers = cfg.num_hidden_layers
    recurrent = 0
    if hybrid:  # K/V of the full-attention layers only; each linear layer reads + writes its state
        types = list(cfg.layer_types)
        attn_layers = types.count("full_attention")
        recurrent = 2 * types.count("linear_attention") * cfg.linear_num_value_heads * \
            cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4  # f32 state, bytes
    kv = 2 * attn_layers * cfg.num_key_value_heads * hd * ctx
    esize = torch.tensor([], dtype=dtype).element_size()
    bytes_per_step = (weights + kv) * esize + recurrent
    floor = bytes_per_step / (copy_gbps * 1e9)

    med = {k: (v["median_ms"] if v else None) for k, v in stats.items()}
    ar = med["ar_step"]
    report = {
        "peer": f"transformers {transformers.__version__}",
        "torch": torch.__version__,
        "shape": a.shape,
        "device": str(dev) if dev.index is not None or dev.type != "cuda" else "cuda:0",
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "dtype": a.dtype,
        "context": ctx,
        "rounds": a.rounds,
        "warmup": a.warmup,
        "attn_implementation": "sdpa",
        "params_target": params,
        "bytes_per_step": bytes_per_step,
        "copy_gbps": copy_gbps,
        "copy_method": f"torch clone ({n >> 20} MiB)",
        "floor_ms": floor * 1e3,
        "ar_step_ms": ar,
        "sampled_step_ms": med["sampled_step"],
        "verify_ms": {k.split(".", 1)[1]: v for k, v in med.items() if k.startswith("verify.")},
        "tree_shape": None if hybrid else "binary heap, parents[i] = (i - 1) // 2; no KV compaction",
        "tree_mask": tree_mask_kind,
        "tree_error": tree_error,
        "stats": stats,
        "ratio_to_ar_step": {k: (v / ar if v else None) for k, v in med.items()},
        "ratio_to_floor": {k: (v / (floor * 1e3) if v else None) for k, v in med.items()},
        "setup_seconds": build_s,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, a.out)
    w = max(len(k) for k in med)
    print(f"{'op':<{w}} {'ms':>10} {'x AR':>8} {'x floor':>8}", file=sys.stderr)
    for k, v in med.items():
        if v is None:
            print(f"{k:<{w}} {'-':>10}", file=sys.stderr)
        else:
            print(f"{k:<{w}} {v:>10.3f} {v / ar:>8.2f} {v / (floor * 1e3):>8.2f}",
                  file=sys.stderr)
    print(f"{'floor':<{w}} {floor * 1e3:>10.3f}  ({bytes_per_step / 1e6:.1f} MB at "
          f"{copy_gbps:.0f} GB/s)", file=sys.stderr)


if __name__ == "__main__":
    main()
