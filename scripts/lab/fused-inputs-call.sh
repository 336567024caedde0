#!/usr/bin/env bash
# Session 32's GPU calls (carry dist/cuda): the Gated DeltaNet layers' convolution and rule inputs
# fused into one kernel that reads the stacked input projection in place (`gdn_conv_rule_inputs`)
# and the gated attention's heads as one kernel after one stacked q/k/v GEMM — the fused inputs'
# bit test against the two kernels, the decode ops, the hybrid device step and the reference
# fixtures (f32, bf16) under the new defaults, then `bench decode` A/B (`unfusedinputs` =
# DFLASH_GDN_FUSED_INPUTS=0, `unfusedheads` = DFLASH_GATED_HEADS=0, `unfusedboth`) at
# Qwen3.6-27B and Qwen3.5-4B. First call: V27="graphs unfusedinputs graphs unfusedinputs",
# V4="graphs unfusedinputs".
# Knobs: PARTS (default "tests b27 b4"), ROUNDS (20), V27 / V4 (the variants).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
PARTS=${PARTS:-tests b27 b4}
. scripts/lab/call-lib.sh
if has tests; then
  echo "== fused inputs bits $(el)"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 fused_inputs 2>&1 | show "^test |result|panicked"
  echo "== decode ops, hybrid device step, fixtures $(el)"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "^test .*FAIL|result|panicked"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "^test .*FAIL|result|panicked"
  for dt in f32 bf16; do
    DFLASH_TEST_DTYPE=$dt DFLASH_FIXTURES=$PWD/fixtures DFLASH_TEST_DEVICE=cuda /tmp/bin/reference_fixtures --test-threads 1 2>&1 | show "^test .*FAIL|result|panicked"
  done
  echo "== tests done $(el)"
fi
has b27 && bench b27 "${V27:-graphs unfusedheads graphs unfusedheads unfusedboth}" "qwen3.6-27b:bf16:2048"
has b4 && bench b4 "${V4:-graphs unfusedheads unfusedboth}" "qwen3.5-4b:bf16:2048"
echo "== done $(el)"
