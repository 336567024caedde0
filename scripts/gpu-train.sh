#!/usr/bin/env bash
# The shipped SmolLM2 drafter, on the GPU machine, in back-to-back calls while it stays warm
# (files under /tmp/keep survive between calls; see docs/benchmarks.md for the exact calls):
#   stage regen : join the GGUF, regenerate answers for .dev/prompts.jsonl.xz (scripts/prepare_prompts.py)
#   stage train : probe the step time, then train for TRAIN_SECONDS with a plan sized to the budget
#   stage finish: resume to the end of the plan, export, validate, eval on the benchmarks
# Expects /tmp/keep/gguf.part_aa and /tmp/keep/cuda/*.xz from an earlier call.
set -uo pipefail
STAGE=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=/tmp/keep; G=$K/smol.gguf; D=$K/bin/dflash
TRAIN_FLAGS="--target $G --data $K/data --device cuda --layers 5 --block-size 16 --anchors 128 \
  --batch-tokens 16384 --lr 6e-4 --epochs 4 --val-fraction 0.01 --checkpoint-every 100000"
case $STAGE in
regen)
  cat $K/gguf.part_aa .dev/gguf.part_ab > $G && rm $K/gguf.part_aa
  mkdir -p $K/bin && for f in $K/cuda/*.xz; do xz -dc "$f" > $K/bin/$(basename "$f" .xz); done; chmod +x $K/bin/*
  xz -dc .dev/prompts.jsonl.xz > $K/prompts.jsonl
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  timeout ${REGEN_SECONDS:-300} $D data regen --target $G --prompts $K/prompts.jsonl --out $K/data \
    --batch ${REGEN_BATCH:-256} --max-new-tokens 512 --max-prompt-tokens 1024 --shard-size 512 \
    --device cuda 2>&1 | tee $OUT/regen.log | tail -4
  python3 - $K/data <<'PY'
import json, glob, sys
n = t = s = 0
for f in sorted(glob.glob(sys.argv[1] + "/shard-*.jsonl")):
    for l in open(f):
        e = json.loads(l); n += 1; t += len(e["tokens"]); s += sum(e["loss_mask"])
print(f"regen data: {n} examples, {t} tokens, {s} supervised")
PY
  ;;
train)
  rm -rf $K/probe
  $D train $TRAIN_FLAGS --out $K/probe --max-steps 6 --time-limit 60 2>&1 | tail -2
  SPS=$(python3 -c "
import json,statistics
r=[json.loads(l) for l in open('$K/probe/log.jsonl')]
print(statistics.median([x['seconds'] for x in r[1:]] or [r[0]['seconds']]))")
  STEPS=$(python3 -c "print(max(10,int(${TRAIN_SECONDS:-640}/$SPS)))")
  echo "probe: $SPS s/step -> plan of $STEPS steps"; echo $STEPS > $K/steps
  tail -1 $K/probe/log.jsonl
  $D train $TRAIN_FLAGS --out $K/run --max-steps $STEPS --time-limit ${FIRST_SECONDS:-450} 2>&1 | tail -4
  mkdir -p $OUT/drafter && cp $K/run/drafter/* $OUT/drafter/ && cp $K/run/log.jsonl $OUT/
  ;;
finish)
  STEPS=$(cat $K/steps)
  $D train $TRAIN_FLAGS --out $K/run --max-steps $STEPS --resume 2>&1 | tail -9
  mkdir -p $OUT/drafter && cp $K/run/drafter/* $OUT/drafter/
  (cd $K/run && tar czf $OUT/run_logs.tgz log.jsonl validation.json)
  $D eval --target $G --draft $K/run/drafter --bench gsm8k,humaneval,mt_bench --limit ${EVAL_LIMIT:-12} \
    --max-new-tokens 256 --tree-budget 64 --device cuda --out $OUT/eval.json 2>&1 | grep -v '^[{} ]' | head -20
  ;;
esac
