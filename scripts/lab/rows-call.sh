#!/usr/bin/env bash
# Session 33's first GPU call (carry dist/cuda): the issue rows with the defaults of session 32
# (`bench decode` at Qwen3.6-27B / Qwen3-8B / SmolLM2, transformers beside them) and the split
# streaming GEMM's taller weight tiles (issue 18: `--bit-exact`'s 17–257-row calls; the probe
# compiles stream_gemm_tiled.cu with SP_TALL_TILES, BN 64 / 128 / 256).
# Knobs: PARTS (default "rows probe"), ROUNDS (20), SHAPES (the rows' shapes).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
PARTS=${PARTS:-rows probe}
. scripts/lab/call-lib.sh
if has rows; then
  echo "== rows with peers $(el)"
  mkdir -p "$R/rows"
  OUT=$R/rows PEER=1 TESTS=0 ROUNDS=${ROUNDS:-20} VARIANTS=graphs \
    SHAPES="${SHAPES:-qwen3.6-27b:bf16:2048 qwen3-8b:bf16:512 qwen3-8b:bf16:2048 smollm2-135m:bf16:512}" \
    bash scripts/gpu-decode-bench.sh 2>&1 | tail -14
fi
if has probe; then
  echo "== split probe, tall tiles $(el)"
  OUT=$R SPLIT=1 SPLIT_M="${SPLIT_M:-17 65 257}" SPLIT_SHAPES=qwen3-8b SPLIT_STAGES=3 SPLIT_BN="64 128 256" \
    timeout 300 python3 scripts/probe-stream-gemm.py 2>&1 | tee "$R/split-probe.log" | grep -v "^qwen3-8b [a-z_]* *m= *[0-9]* floor" | tail -30
  grep "floor" "$R/split-probe.log" | cut -c1-250
fi
echo "== done $(el)"
