#!/usr/bin/env bash
# Session 30's GPU call (carry dist/cuda): the bulk-copy weight fetch of the streaming GEMM
# (crates/dflash-core/src/stream_gemm_bulk.cu) — its bit test against the narrow kernel, the
# streamed calls' row invariance under it, its probe beside cuBLAS (scripts/probe-stream-gemm.py
# BULK=1), then `bench decode` A/B (bulk, bulkexact) — and session 29's unrun replay variant
# (DFLASH_GDN_REPLAY=prefetch: its bits test, the hybrid device step under it, the 27B A/B).
# Knobs: PARTS (default "tests probe bench8b smol replay"; call E: "bulkdown smoltrees bulkdown27"),
# ROUNDS (20).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
PARTS=${PARTS:-tests probe bench8b smol replay}
. scripts/lab/call-lib.sh
if has tests; then
  echo "== bulk bits, row invariance (default, then under DFLASH_STREAM_BULK=1) $(el)"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bulk_weight stream_matmul 2>&1 | show "^test |result|panicked"
  DFLASH_STREAM_BULK=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "result|panicked"
  DFLASH_STREAM_BULK=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "result|panicked"
  echo "== replay prefetch: rule kernels' bits, hybrid device step $(el)"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 the_rules_kernels 2>&1 | show "^test |result|panicked"
  DFLASH_GDN_REPLAY=prefetch DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ"
fi
if has probe; then
  echo "== bulk probe $(el)"
  BULK=1 STAGES=2 OUT=$R timeout 240 python3 scripts/probe-stream-gemm.py 2>&1 | grep -v "^$" | tee "$R/probe.log"
fi
has bench8b && bench b8 "graphs bulk bulkexact exact" "qwen3-8b:bf16:2048"
has smol && bench bs "graphs bulk" "smollm2-135m:bf16:512"
has replay && bench br "graphs replayprefetch" "qwen3.6-27b:bf16:2048"
# call E: the bulk kernel on the long-K few-row calls alone, SmolLM2's trees streamed, --bit-exact
# with tensor-core attention at 64-wide heads
has bulkdown && bench bd "graphs bulkdown graphs bulkdown" "qwen3-8b:bf16:2048"
has smoltrees && bench st "graphs treestream80 treestream288 exact exactmma" "smollm2-135m:bf16:512"
has bulkdown27 && bench bq "graphs bulkdown" "qwen3.6-27b:bf16:2048"
echo "== done $(el)"
