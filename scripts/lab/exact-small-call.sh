#!/usr/bin/env bash
# Session 33's second GPU call (carry dist/cuda): `--bit-exact` at SmolLM2's shape — the wide
# kernel only for weights whose 16-output blocks fill the GPU (else the grouped narrow launch), the
# row kernel at 64-wide heads (`--bit-exact`'s cached splits; DFLASH_ATTN_ROWS_D64=1 for the default
# path's steps, opt-in). Tests: the row kernel's bits at d 64 against the general kernel, the bit-exact
# verify (= AR steps) under the new rule, the tree rows by position. Then `bench decode` A/B at
# SmolLM2 bf16 512, then (PARTS profile) ncu of the bit-exact DDTree-64 verify.
# Knobs: PARTS (default "tests bench profile"; also bench8b: Qwen3-8B at 2048), ROUNDS (20), VS / V8
# (the variants).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p "$R"
PARTS=${PARTS:-tests bench profile}
. scripts/lab/call-lib.sh
if has tests; then
  echo "== row kernel bits (d 128 and 64) $(el)"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "^test |result|panicked"
  echo "== bit-exact verify = AR steps, and the whole binary, under --bit-exact's policy $(el)"
  DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "^test .*FAIL|^test .*bit_exact|result|panicked"
  DFLASH_TREE_KEYS=position DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "^test .*FAIL|result|panicked"
  DFLASH_ATTN_ROWS_D64=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "^test .*FAIL|result|panicked"
  echo "== tests done $(el)"
fi
has bench && bench small "${VS:-graphs exact exactwideall exactrowsd64 rowsd64 graphs exact}" "smollm2-135m:bf16:512"
has bench8b && bench b8 "${V8:-graphs exact graphs exact}" "qwen3-8b:bf16:2048"
if has profile; then
  echo "== ncu: --bit-exact DDTree-64 verify $(el)"
  mkdir -p "$R/profile"
  OUT=$R/profile PROFILE_OP=verify.tree64 VARIANT_ENV="DFLASH_CUDA_GRAPHS=0 DFLASH_STREAM_GEMM=all" \
    SHAPES=smollm2-135m:bf16:512 timeout 200 bash scripts/gpu-profile-step.sh 2>&1 | tail -40
fi
echo "== done $(el)"
