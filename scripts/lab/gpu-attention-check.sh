#!/usr/bin/env bash
# One device call (session 24): the GPU tests the attention kernels touch, then bench decode with
# the few-vector attention against the general kernel. Carry dist/cuda.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/bin
for f in dist/cuda/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)"; done; chmod +x /tmp/bin/*
{
echo "== row invariance (default keys), then keys by position, then bit-exact with the tensor cores"
DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | grep -E "^test |result|panicked|left|right"
DFLASH_TREE_KEYS=position DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | grep -E "^test |result|panicked"
DFLASH_TREE_ATTN=mma DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | grep -E "^test |result|panicked"
echo "== decode ops, bf16 fixtures"
DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | grep -E "result|panicked|FAILED"
DFLASH_FIXTURES=$PWD/fixtures DFLASH_TEST_DEVICE=cuda DFLASH_TEST_DTYPE=bf16 /tmp/bin/reference_fixtures --test-threads 1 --skip smollm2 2>&1 | grep -E "result|FAILED|panicked"
} > "$OUT/tests.log" 2>&1
grep -E "FAILED|panicked" "$OUT/tests.log" | head -5; echo "tests ok lines: $(grep -c 'test result: ok' "$OUT/tests.log")"
TESTS=0 PEER=0 ROUNDS=${ROUNDS:-20} bash scripts/gpu-decode-bench.sh 2>&1 | tail -${TAIL:-12}
