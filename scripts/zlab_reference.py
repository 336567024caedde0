#!/usr/bin/env python3
"""z-lab reference check: runs z-lab's DFlash implementation (PyPI dflash==0.1.0) on a tiny random
target (fixtures/tiny-qwen3) and a tiny random drafter written by `dflash draft init`
(fixtures/zlab/drafter), float32 on CPU, and records
  - the drafter's logits for a fixed context and block (draft_logits [B-1, V]),
  - the token sequence of its greedy spec_generate (spec_ids).
Usage: zlab_reference.py REPO_ROOT OUT_FILE
"""
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from dflash.model import DFlashDraftModel, extract_context_feature

torch.backends.cuda.matmul.allow_tf32 = False
root, out = sys.argv[1], sys.argv[2]
target = AutoModelForCausalLM.from_pretrained(f"{root}/fixtures/tiny-qwen3", dtype=torch.float32).eval()
draft = DFlashDraftModel.from_pretrained(f"{root}/fixtures/zlab/drafter", dtype=torch.float32).eval()
print("target layers", draft.target_layer_ids, "block", draft.block_size, "mask", draft.mask_token_id)
g = torch.Generator().manual_seed(5)
prompt = torch.randint(0, 262, (1, 12), generator=g)
bonus = 17
with torch.no_grad():
    out_t = target(prompt, output_hidden_states=True)
    ctx = extract_context_feature(out_t.hidden_states, draft.target_layer_ids)
    B = draft.block_size
    block = torch.full((1, B), draft.mask_token_id, dtype=torch.long)
    block[0, 0] = bonus
    emb = target.get_input_embeddings()(block)
    pos = torch.arange(prompt.shape[1] + B).unsqueeze(0)
    hidden = draft(target_hidden=ctx, noise_embedding=emb, position_ids=pos, use_cache=False)
    logits = draft.compute_logits(hidden[:, 1:], target.lm_head)[0]
    ids = draft.spec_generate(target, prompt, max_new_tokens=40, stop_token_ids=None)
save_file(
    {
        "prompt": prompt[0].contiguous(),
        "bonus": torch.tensor([bonus]),
        "draft_logits": logits.float().contiguous(),
        "spec_ids": ids[0, prompt.shape[1]:].contiguous(),
    },
    out,
)
print("spec ids", ids[0, prompt.shape[1]:].tolist())
