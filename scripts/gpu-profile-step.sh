#!/usr/bin/env bash
# Runs on the GPU machine (carry dist/cuda, or have /tmp/bin from an earlier call): per-kernel GPU
# time of the decode ops of `dflash bench decode` under Nsight Compute (`--clock-control none`,
# `--cache-control none` unless CACHE_CONTROL=all: caches kept warm between kernels, as in a step;
# duration and DRAM bytes only: one pass, no replay), for each SHAPES entry (shape:dtype:context).
# Writes $OUT/profile-<shape>-<dtype>-<ctx>.csv (ncu's CSV, one row per kernel and metric) and
# prints, for the launches of the AR steps it can find (the repeating unit after the prefill), the
# kernels of one step with their time, achieved bandwidth and share. Knobs: SHAPES, COUNT (kernels
# profiled), SKIP (kernels run unprofiled first: weights and prefill — a hybrid needs ~2400 to reach
# its AR steps), VARIANT_ENV (extra environment for the binary, e.g. DFLASH_STREAM_GEMM=0), METRICS
# (more ncu metrics, comma-separated, e.g. launch__registers_per_thread), WIDTHS (tree sizes, default 64),
# PROFILE_OP (profile only that op's runs: ar_step, verify.chain16, state_commit, verify.tree64, draft_block, …
# — `bench decode` opens the profiler's range around it; SKIP then counts inside the range).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPES=${SHAPES:-"qwen3-8b:bf16:512 smollm2-135m:bf16:512"}
COUNT=${COUNT:-3000}
mkdir -p /tmp/bin && [ -d "${DIST:-dist/cuda}" ] && for f in ${DIST:-dist/cuda}/*.xz; do
  [ -x "/tmp/bin/$(basename "$f" .xz)" ] || xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)"; done
chmod +x /tmp/bin/*
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for spec in $SHAPES; do
  IFS=: read -r shape dtype ctx <<< "$spec"
  csv=$OUT/profile-$shape-$dtype-$ctx.csv
  echo "== ncu: bench decode $shape $dtype context $ctx"
  env ${VARIANT_ENV:-} ${PROFILE_OP:+DFLASH_PROFILE_OP=$PROFILE_OP} timeout 420 "$NCU" ${PROFILE_OP:+--profile-from-start off} --clock-control none --cache-control ${CACHE_CONTROL:-none} --metrics gpu__time_duration.sum,dram__bytes_read.sum${METRICS:+,$METRICS} \
    --launch-skip "${SKIP:-0}" --launch-count "$COUNT" --csv --log-file "$csv" /tmp/bin/dflash bench decode --shape "$shape" \
    --context "$ctx" --device cuda --dtype "$dtype" --rounds 2 --warmup 1 --widths ${WIDTHS:-64} > /dev/null 2> "$OUT/profile-$shape.err" \
    || { echo "ncu exit $?"; tail -5 "$OUT/profile-$shape.err"; }
  python3 scripts/profile_summary.py "$csv"
done
