#!/usr/bin/env bash
# Runs on the GPU machine: issue 16's H200 timing — `dflash diagnose` of the shipped SmolLM2 pair
# (the default diagnosis: one prompt of each benchmark, 96-token answers), timed end to end, in f32
# and bf16, then a planted block position (the shipped drafter's config declaring
# block_position_offset 1) that must exit 1 naming the fix. Needs, like scripts/gpu-eval-smollm2.sh,
# /tmp/bin/dflash (scripts/gpu-decode-bench.sh unpacks it) and the GGUF's two parts in /tmp/keep.
# Writes $OUT/diagnose-{f32,bf16,planted}.json and prints one timing line each.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=/tmp/keep; G=$K/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$G" ] || cat $K/gguf.part_aa $K/gguf.part_ab > "$G"
D=/tmp/bin/dflash
for dt in ${DTYPES:-f32 bf16}; do
  s=$(date +%s.%N)
  $D diagnose --target "$G" --draft drafters/smollm2-135m-instruct --device cuda --dtype "$dt" \
    > "$OUT/diagnose-$dt.json" 2> "$OUT/diagnose-$dt.log"
  rc=$?
  echo "diagnose $dt: exit $rc, $(python3 -c "import time; print(f'{time.time() - $s:.1f}')") s wall"
  tail -12 "$OUT/diagnose-$dt.log"
done
P=/tmp/planted-position; rm -rf $P; cp -r drafters/smollm2-135m-instruct $P
python3 - "$P/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["dflash_config"]["block_position_offset"] = 1
json.dump(c, open(sys.argv[1], "w"))
PY
s=$(date +%s.%N)
$D diagnose --target "$G" --draft $P --device cuda --dtype f32 > "$OUT/diagnose-planted.json" 2> "$OUT/diagnose-planted.log"
rc=$?
echo "diagnose planted position (f32): exit $rc (1 expected), $(python3 -c "import time; print(f'{time.time() - $s:.1f}')") s wall"
grep -E "^conventions|fix:" "$OUT/diagnose-planted.log" | head -3
