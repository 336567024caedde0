#!/usr/bin/env bash
# Session 34's GPU call (carry dist/cuda): the folded state commit (issue 17: each hybrid device
# step replays the last verify's kept rows inside its rule kernels instead of a commit launched
# before it). Tests: the hybrid device step against the CPU host path with the fold on
# (DFLASH_GDN_FOLD=1), and fold on against fold off bit for bit (f32 and bf16); the rule kernels'
# bits. Then `bench decode` at Qwen3.6-27B bf16 2048 with the fold (`fold`) and without
# (`nofold`), alternating:
# the separate commit, the verify folding it against the verify alone, and the decode loops.
# Part smolchunk (session 35): SmolLM2 bf16 512's trees on the row kernel's key splits forced to
# 128 / 256 / 640 keys (DFLASH_TREE_CHUNK; the rule gives 64 there: ten splits and their combine).
# Session 36: the fold's pending tokens staged in shared memory (default; `foldglobal` walks them
# from global memory as before) — VS="fold foldglobal nofold …"; part launch: the host's time to
# queue two small kernels through PyTorch right after a synchronisation (is this machine's launch
# slow, or our commit's host work?).
# Session 37, part draft: the drafter's device step with q of the block's rows alone (no copy to
# narrow q a layer) and the q/k/v GEMM's input one buffer a step (no concatenation a layer),
# DFLASH_DRAFT_ROWS_IN_PLACE=1 (variant draftinplace), against the default, SmolLM2 at 512 and
# Qwen3-8B at 2048; its tests (the device drafts against the CPU draft, under the switch).
# VS may name foldchunk4 (4 pending rows staged).
# Knobs: PARTS (default "tests bench"; also small: Qwen3.5-4B at 2048; smolchunk; launch; draft), ROUNDS (10), VS (variants).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
PARTS=${PARTS:-tests bench}
. scripts/lab/call-lib.sh
if has tests; then
  echo "== hybrid device step: against the host path, fold on against fold off $(el)"
  DFLASH_GDN_FOLD=1 DFLASH_TEST_DEVICE=cuda timeout 120 /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "^test |result|panicked"
  echo "== rule kernels' bits $(el)"
  DFLASH_TEST_DEVICE=cuda timeout 90 /tmp/bin/decode_ops_device --test-threads 1 gated_delta 2>&1 | show "^test |result|panicked"
  echo "== tests done $(el)"
fi
if has launch; then
  echo "== host time to queue kernels after a synchronisation (PyTorch) $(el)"
  python3 - <<'PY'
import time, statistics, torch
x = torch.zeros(1 << 20, device="cuda")
for _ in range(20):
    x.add_(1)
torch.cuda.synchronize()
for n in (1, 2, 8):
    after_sync, busy = [], []
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        after_sync.append(time.perf_counter() - t0)
    for _ in range(200):  # queued behind earlier work (the GPU busy)
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1)
        busy.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    med = lambda v: 1e6 * statistics.median(v)
    print(f"{n} launches: {med(after_sync):.1f} us after a sync, {med(busy):.1f} us queued behind work")
PY
fi
if has draft; then
  echo "== device drafts against the CPU draft, rows in place $(el)"
  DFLASH_DRAFT_ROWS_IN_PLACE=1 DFLASH_TEST_DEVICE=cuda timeout 120 /tmp/bin/decode_ops_device --test-threads 1 draft 2>&1 | show "^test |result|panicked"
fi
ROUNDS=${ROUNDS:-10}
has bench && bench big "${VS:-fold nofold fold nofold}" "qwen3.6-27b:bf16:2048"
has draft && bench draft "graphs draftinplace graphs draftinplace" "smollm2-135m:bf16:512"
has draft && bench draft8b "graphs draftinplace" "qwen3-8b:bf16:2048"
has smolchunk && bench smolchunk "graphs treechunk128 treechunk256 treechunk640 graphs treechunk256" "smollm2-135m:bf16:512"
has small && bench small "${VS:-fold nofold fold nofold}" "qwen3.5-4b:bf16:2048"
for f in "$R"/*/bench-decode.jsonl; do
  [ -f "$f" ] && python3 - "$f" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r.get("engine") != "dflash":
        continue
    v, lp = r.get("verify_ms") or {}, r.get("loop_step_ms") or {}
    g = lambda k: r.get(k)
    print(r["shape"], r["variant"], "AR", g("ar_step_ms"), "chain16", v.get("chain16"), "tree64", v.get("tree64"),
          "draft", g("draft_block_ms"),
          "loops", lp, "commit", g("state_commit_ms"), "folded", g("state_commit_folded_ms"),
          "tree commit", g("tree_commit_ms"), "tree folded", g("tree_commit_folded_ms"),
          "submit/keep", g("state_commit_submit_ms"), g("state_commit_keep_ms"),
          "tree submit/keep", g("tree_commit_submit_ms"), g("tree_commit_keep_ms"))
    for s in r.get("stats", []) if isinstance(r.get("stats"), list) else []:
        pass
PY
done
echo "== done $(el)"
