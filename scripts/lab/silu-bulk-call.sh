#!/usr/bin/env bash
# Session 35's GPU call (carry dist/cuda): the MLP's activation folded into the bulk kernel's
# long-K down projection (the few-row calls of Qwen3-8B's, Qwen3.5-4B's and Qwen3.6-27B's MLPs;
# DFLASH_SILU_BULK=1 turns it on, =0 keeps silu_mul as its own kernel). Tests: the row-invariance binary on CUDA
# (the new bulk silu test, the bit-exact verify rows = AR steps, the narrow silu test). Then
# `bench decode` with (`silubulk`) and without (`nosilubulk`) the fold, alternated, at the 8B's two
# contexts and the 27B. Knobs: PARTS (default "tests bench big"), ROUNDS (10), VS (variants).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
PARTS=${PARTS:-tests bench big}
. scripts/lab/call-lib.sh
if has tests; then
  echo "== row invariance on CUDA $(el)"
  DFLASH_SILU_BULK=1 DFLASH_TEST_DEVICE=cuda timeout 200 /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "^test |result|panicked"
fi
ROUNDS=${ROUNDS:-10}
has bench && bench b8 "${VS:-silubulk nosilubulk silubulk nosilubulk}" "qwen3-8b:bf16:512 qwen3-8b:bf16:2048"
has big && bench b27 "${VS:-silubulk nosilubulk}" "qwen3.6-27b:bf16:2048"
for f in "$R"/*/bench-decode.jsonl; do
  [ -f "$f" ] && python3 - "$f" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if r.get("engine") != "dflash":
        continue
    v, lp = r.get("verify_ms") or {}, r.get("loop_step_ms") or {}
    print(r["shape"], r["context"], r["variant"], "floor", r.get("floor_ms"), "AR", r.get("ar_step_ms"),
          "sampled", r.get("sampled_step_ms"), "chain16", v.get("chain16"), "draft", r.get("draft_block_ms"),
          "loops", {k: round(x, 3) for k, x in lp.items()})
PY
done
echo "== done $(el)"
