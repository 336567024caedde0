#!/usr/bin/env bash
# Runs on the GPU machine: `dflash eval` of SmolLM2-135M-Instruct with the shipped drafter (f32 and
# bf16; ar, dflash, ddtree-64 and auto), then `dflash generate` with the default mode (auto). Needs, from
# earlier calls on the same warm machine, /tmp/bin/dflash (scripts/gpu-decode-bench.sh unpacks it) and
# the GGUF's two parts in /tmp/keep (scripts/prepare-dev.sh makes .dev/gguf.part_a{a,b}; carry one per
# call and copy it to /tmp/keep: the GGUF and the drafter do not fit one call's 64 MiB together).
# Knobs: LIMIT (prompts per benchmark, default 10), DTYPES (default "f32 bf16"), STREAM="0 all" (also
# bf16 with each DFLASH_STREAM_GEMM value: 0 every projection on cuBLAS, all every call on the
# row-invariant streaming GEMM — what `--bit-exact` sets), GENERATE=0 to skip the generate lines.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=/tmp/keep; G=$K/SmolLM2-135M-Instruct.Q4_1.gguf  # the name `generate`/`eval` find the shipped drafter by
[ -f "$G" ] || cat $K/gguf.part_aa $K/gguf.part_ab > "$G"
ls -la "$G"
D=/tmp/bin/dflash
for dt in ${DTYPES:-f32 bf16}; do
  echo "== eval $dt"
  $D eval --target "$G" --device cuda --dtype "$dt" --bench gsm8k,humaneval,mt_bench --limit "${LIMIT:-10}" \
    --modes ar,dflash,ddtree,auto --out "$OUT/eval-$dt.json" 2>&1 | grep -v "^\s*$" | tail -24
done
for v in ${STREAM:-}; do
  echo "== eval bf16, DFLASH_STREAM_GEMM=$v"
  DFLASH_STREAM_GEMM=$v $D eval --target "$G" --device cuda --dtype bf16 --bench gsm8k,humaneval,mt_bench \
    --limit "${LIMIT:-10}" --modes ar,dflash,ddtree --out "$OUT/eval-bf16-stream-$v.json" 2>&1 | grep -v "^\s*$" | tail -3
done
[ "${GENERATE:-1}" = 1 ] || exit 0
echo "== generate (default mode)"
for p in "Write a haiku about Rust." "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"; do
  $D generate --target "$G" --device cuda --prompt "$p" --max-new-tokens 256 2>&1 >/dev/null | tail -1
done
