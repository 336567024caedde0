#!/usr/bin/env bash
# Session 31's GPU call (carry dist/cuda): the split streaming GEMM (stream_gemm_tiled.cu's
# `stream_gemm_split_x*`: the kw partial sums over blocks) — its bit test against the narrow
# kernel, the streamed calls' row invariance and the bit-exact verify under it, session 30's two
# unrun checks (the tree-row bit test under DFLASH_TREE_KEYS=position, the bit-exact test's
# 256-node trees), its probe beside the narrow, wide and cuBLAS kernels
# (scripts/probe-stream-gemm.py SPLIT=1), then `bench decode` A/B at Qwen3-8B and SmolLM2; and the
# state commit's replay with its keys read four floats at a time (DFLASH_GDN_REPLAY=vec): the rule
# kernels' bits test, the hybrid device step under it, the 27B A/B.
# Knobs: PARTS (default "tests probe bench8b smol commit"), ROUNDS (20), B8 / BS / BQ (the
# variants), SPLIT_STAGES / SPLIT_M / SPLIT_SHAPES (the probe's). Session 31's second call:
# PARTS="tests probe bench8b smol commit" SPLIT_M="17 33" SPLIT_SHAPES=qwen3-8b SPLIT_STAGES=3
# B8="exactnosplit exact graphs" BS="graphs exactmma" BQ="replayvec graphs".
set -uo pipefail
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
PARTS=${PARTS:-tests probe bench8b smol commit}
. scripts/lab/call-lib.sh
if has tests; then
  echo "== split bits; row invariance and decode ops under DFLASH_STREAM_SPLIT=2 $(el)"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 split_kernel 2>&1 | show "^test |result|panicked"
  DFLASH_STREAM_SPLIT=2 DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "^test .*FAIL|result|panicked"
  DFLASH_STREAM_SPLIT=2 DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "^test |result|panicked"
  DFLASH_STREAM_SPLIT=2 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "^test .*FAIL|result|panicked"
  echo "== session 30's unrun checks $(el)"
  DFLASH_TREE_KEYS=position DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 a_tree_row 2>&1 | show "^test |result|panicked"
  DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "^test |result|panicked"
  echo "== the rule kernels' bits (the replay's keys by lane group among them); hybrid step under it $(el)"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 the_rules_kernels 2>&1 | show "^test |result|panicked"
  DFLASH_GDN_REPLAY=vec DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ"
fi
if has probe; then
  echo "== split probe $(el)"
  SPLIT=1 SPLIT_STAGES="${SPLIT_STAGES:-3 4}" OUT=$R timeout 300 python3 scripts/probe-stream-gemm.py 2>&1 | grep -v "^$" | grep -v -i "deprecat\|  y = \|  t = \|  t_w = " | tee "$R/probe.log"
fi
has bench8b && bench b8 "${B8:-graphs splitfast exact split splitall}" "qwen3-8b:bf16:2048"
has commit && bench bq "${BQ:-graphs replayvec}" "qwen3.6-27b:bf16:2048"
has smol && bench bs "${BS:-graphs splittrees splitfast exactmma splitmma}" "smollm2-135m:bf16:512"
echo "== done $(el)"
