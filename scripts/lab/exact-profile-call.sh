#!/usr/bin/env bash
# Session 33: where `--bit-exact` (DFLASH_STREAM_GEMM=all) loses time against the default at
# SmolLM2's shape (bf16, context 512): ncu of the 16-row verify and the DDTree-64 verify, default
# then bit-exact, one op's profiler range each (scripts/gpu-profile-step.sh, graphs off so that
# every kernel is its own launch). Carry dist/cuda.
set -uo pipefail
R=${OUT:-/tmp/out}; mkdir -p "$R"
PARTS=${PARTS:-}
. scripts/lab/call-lib.sh
for op in ${OPS:-verify.tree64 verify.chain16}; do
  for v in default exact; do
    env_v="DFLASH_CUDA_GRAPHS=0"; [ $v = exact ] && env_v="$env_v DFLASH_STREAM_GEMM=all"
    echo "== $op $v $(el)"
    mkdir -p "$R/$op-$v"
    OUT=$R/$op-$v PROFILE_OP=$op VARIANT_ENV="$env_v" SHAPES=smollm2-135m:bf16:512 \
      bash scripts/gpu-profile-step.sh 2>&1 | tail -40
  done
done
echo "== done $(el)"
