#!/usr/bin/env python3
"""Fixture for dflash-core's gated delta rule (crates/dflash-core/src/gated_delta.rs): random
inputs through transformers' own torch implementations of the rule (chunked and recurrent, the
functions its Qwen3.5 / Qwen3-Next Gated DeltaNet layers call), from a random initial state, with
q/k l2-normalised inside as those layers do. Runs on the GPU machine (transformers is there), on
its CPU in f32; writes fixtures/gated-delta/rule.safetensors and rule.json (a few KB)."""
import importlib, json, os, sys

import torch
from safetensors.torch import save_file

out_dir = sys.argv[1] if len(sys.argv) > 1 else "fixtures/gated-delta"
os.makedirs(out_dir, exist_ok=True)
mod, errors = None, {}
for name in ("transformers.models.qwen3_5.modeling_qwen3_5",
             "transformers.models.qwen3_next.modeling_qwen3_next"):
    try:
        m = importlib.import_module(name)
        chunk, recur = m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule
        mod = name
        break
    except Exception as e:  # noqa: BLE001 - report which module lacked what
        errors[name] = repr(e)
if mod is None:
    sys.exit(f"no gated delta rule in transformers: {errors}")

torch.manual_seed(0)
B, T, H, DK, DV = 1, 70, 2, 16, 8  # 70 tokens: one full chunk of 64 and a partial one
q = torch.randn(B, T, H, DK)
k = torch.randn(B, T, H, DK)
v = torch.randn(B, T, H, DV)
g = -torch.rand(B, T, H) * 1.5
beta = torch.rand(B, T, H)
s0 = torch.randn(B, H, DK, DV) * 0.3
o_chunk, s_chunk = chunk(q, k, v, g=g, beta=beta, chunk_size=64, initial_state=s0,
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
o_rec, s_rec = recur(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
t = {"q": q[0], "k": k[0], "v": v[0], "g": g[0], "beta": beta[0], "state0": s0[0],
     "out_chunked": o_chunk[0].float(), "state_chunked": s_chunk[0].float(),
     "out_recurrent": o_rec[0].float(), "state_recurrent": s_rec[0].float()}
save_file({n: x.contiguous() for n, x in t.items()}, os.path.join(out_dir, "rule.safetensors"))
import transformers
meta = {"module": mod, "transformers": transformers.__version__, "torch": torch.__version__,
        "shape": {"T": T, "H": H, "dk": DK, "dv": DV}, "chunk_size": 64,
        "use_qk_l2norm_in_kernel": True,
        "max_abs_chunked_vs_recurrent": float((o_chunk - o_rec).abs().max())}
json.dump(meta, open(os.path.join(out_dir, "rule.json"), "w"), indent=1)
print(json.dumps(meta))
