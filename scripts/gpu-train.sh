#!/usr/bin/env bash
# The shipped SmolLM2 drafter, on the GPU machine, in back-to-back calls while it stays warm
# (files under /tmp/keep survive between calls; docs/benchmarks.md records the exact calls):
#   stage setup : keep the first GGUF part and the CUDA binaries (carry .dev/gguf.part_aa, dist/cuda)
#   stage regen : join the GGUF, regenerate answers for .dev/prompts.jsonl.xz for REGEN_SECONDS
#                 (carry .dev/gguf.part_ab, .dev/prompts.jsonl.xz; scripts/prepare_prompts.py)
#   stage train : probe the step time (falling back to smaller micro-batches if one fails), plan
#                 TRAIN_SECONDS of steps, train for at most CALL_SECONDS of this call
#   stage resume: continue the same plan (--resume) for at most CALL_SECONDS, then validate
#   stage eval  : f32 evaluation of the exported drafter on the benchmarks (T = 0)
#   stage ab    : for each arm of AB_ARMS (an init plus knobs, see the stage), a profiled run of
#                 AB_SECONDS from the same plan and seed (phase times and learning curves side by
#                 side in $L/ab-*.jsonl)
#   stage ncu   : Nsight Compute's kernel times over NCU_STEPS steps of one micro-batch, summed by
#                 kernel name against the wall time (is a step GPU-bound, and on which kernels?);
#                 NCU_SKIP / NCU_COUNT select a window of kernels (the backward starts after ~9.4 k)
#   stage stash : keep what this call carried of .dev/warm (a drafter to warm-start from, then
#                 INIT=/tmp/keep/warm), .dev/data.tar.xz (regen data from an earlier session) and
#                 .dev/prompts.jsonl.xz (so the call carrying .dev/gguf.part_ab stays under 64 MiB)
# A session with earlier data and weights: call 1 `setup` (carry .dev/gguf.part_aa,
# dist/cuda/dflash.xz); call 2 `stash` (carry .dev/warm, .dev/data.tar.xz, .dev/prompts.jsonl.xz);
# call 3 `data [bench] [regen] [ncu] [ab] train ...` (carry .dev/gguf.part_ab).
# A fresh checkout (no .dev/: nothing ignored survives between sessions' checkouts): run
# scripts/prepare-dev.sh and scripts/build-cuda.sh here, then call 1 `setup` (carry
# .dev/gguf.part_aa, dist/cuda/dflash.xz); call 2 `REGEN_SHARD=512 … regen` (carry
# .dev/gguf.part_ab, .dev/prompts.jsonl.xz; one process: three on one GPU were 0.88× as fast);
# call 3 `INIT=.dev/warm LR=3e-4 SPS=0.65 … train` (carry .dev/warm, a copy of the shipped
# drafter); call 4 `KEEP_DATA=1 … resume collect eval`. The tracked tree (≈ 48 MB with the
# drafter) counts against each call's 64 MiB: `scripts/device-tree.sh slim` before the calls,
# `scripts/device-tree.sh restore` before committing.
# A collected drafter arrives without its index (8-file limit): scripts/drafter_index.py DIR.
# Session 9 (`.dev/` kept from session 8): `setup`; `data` then `REGEN_NAME=code REGEN_SHARD=512
# REGEN_SECONDS=300 regen` (carry .dev/gguf.part_ab, .dev/data.tar.xz, .dev/prompts-code.jsonl.xz:
# 66 MB with the slim tree, just under the limit); `INIT=.dev/warm LR=3e-4 SPS=0.65 MICRO=4096
# TRAIN_SECONDS=950 CALL_SECONDS=560 train` (carry .dev/warm); `CALL_SECONDS=400 KEEP_DATA=1 resume
# collect`, then `EVAL_LIMIT=5 EVAL_BUDGET=64,256 eval`. A fresh checkout regenerates both prompt sets:
# `REGEN_SHARD=512 regen` for shards 0-21 of .dev/prompts.jsonl.xz, then the `REGEN_NAME=code` one.
#   stage data  : join the GGUF (carry .dev/gguf.part_ab) and unpack the stashed or carried regen
#                 data; a later `regen` then continues at the first prompt shard it lacks
#   stage bench : `dflash bench attention|causal-attention|cross-entropy` on the GPU (fused vs
#                 composite kernels, parity and seconds; attention with both backward variants);
#                 needs only the binary; `ab` arms (`INIT,DFLASH_FLASH_BWD=row`, ...) then measure
#                 a change in a training step
#   stage collect: drafter and a tarball of the logs (curves.png, validation.json, log.jsonl) and
#                 (KEEP_DATA=1) of the regen data into $OUT (at most 8 files, 16 MiB each)
# Stages chain in one call: `bash scripts/gpu-train.sh regen train eval collect`.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=/tmp/keep; L=$K/logs; mkdir -p $L; G=$K/smol.gguf; D=$K/bin/dflash
flags() {
  echo "--target $G --data $K/data --device cuda --layers 5 --block-size 16 --anchors ${ANCHORS:-128} \
  --batch-tokens ${BATCH_TOKENS:-16384} \
  --micro-batch-tokens ${MICRO_FORCE:-$(cat $K/micro 2>/dev/null || echo 16384)} \
  --lr ${LR:-6e-4} --epochs 40 --val-fraction ${VAL_FRACTION:-0.004} --checkpoint-every 100000 \
  --init ${INIT:-random} ${PROFILE:+--profile} --distill ${DISTILL:-0}"
}
unpack() {  # idempotent: the GGUF and the binaries once per machine
  [ -f $G ] || { cat $K/gguf.part_aa .dev/gguf.part_ab > $G && rm $K/gguf.part_aa; }
  [ -x $D ] || { mkdir -p $K/bin && for f in $K/cuda/*.xz; do xz -dc "$f" > $K/bin/$(basename "$f" .xz); done
    chmod +x $K/bin/*; }
}
# GPU utilisation once a second while a stage trains (summarised by `dmon_summary`)
dmon() { nvidia-smi dmon -s u -d 1 > $L/dmon-$1.log 2>&1 & echo $! > $K/dmon.pid; }
dmon_summary() {
  kill $(cat $K/dmon.pid) 2>/dev/null
  awk '!/^#/ && $2 ~ /^[0-9]+$/ {n++; sm+=$2; mem+=$3} END {if (n) printf "dmon %s: %d samples, mean SM busy %.0f%%, memory busy %.0f%%\n", "'$1'", n, sm/n, mem/n}' $L/dmon-$1.log
}
for STAGE in "$@"; do
case $STAGE in
setup)
  mkdir -p $K && cp .dev/gguf.part_aa $K/ && cp -r dist/cuda $K/cuda && ls -la $K $K/cuda
  ;;
regen)
  [ -f $K/gguf.part_aa ] || [ -f $G ] || { echo "no setup"; exit 1; }
  unpack
  # REGEN_NAME=x regenerates .dev/prompts-x.jsonl.xz into $K/regen-x (its own shard numbering, so
  # it resumes on its own) and links the shards into $K/data as shard-x-NNNNN.jsonl
  if [ -n "${REGEN_NAME:-}" ]; then
    P=.dev/prompts-$REGEN_NAME.jsonl.xz; RD=$K/regen-$REGEN_NAME; mkdir -p $RD
    # shards of this set unpacked by `data` (an earlier session's) count as done
    for f in $K/data/shard-$REGEN_NAME-*.jsonl; do
      [ -f "$f" ] && ln -f "$f" $RD/shard-${f##*/shard-$REGEN_NAME-}
    done
  else
    P=$K/prompts.jsonl.xz; [ -f $P ] || P=.dev/prompts.jsonl.xz; RD=$K/data
  fi
  xz -dc $P > $K/prompts.jsonl
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  # REGEN_PROCS processes share the GPU (`--part I/N`: process I writes the shards k mod N = I),
  # hiding each other's launch gaps and batch tails; REGEN_SHARD prompts a shard (keep it from
  # session to session for one data directory: it is the unit of resumption)
  regen() {
    N=${REGEN_PROCS:-1}
    for I in $(seq 0 $((N - 1))); do
      timeout $1 $D data regen --target $G --prompts $K/prompts.jsonl --out $RD --batch $2 \
        --max-new-tokens 512 --max-prompt-tokens 1024 --shard-size ${REGEN_SHARD:-1024} \
        --part $I/$N --device cuda > $L/regen-$I.log 2>&1 &
    done
    wait
    for I in $(seq 0 $((N - 1))); do
      tr '\r' '\n' < $L/regen-$I.log | tee -a $L/regen.log | tail -2
    done
  }
  T0=$(date +%s)
  regen ${REGEN_SECONDS:-270} ${REGEN_BATCH:-256}
  LEFT=$(( ${REGEN_SECONDS:-270} - ($(date +%s) - T0) ))
  if ! ls $RD/shard-*.jsonl >/dev/null 2>&1 && [ $LEFT -gt 30 ]; then
    echo "no shard at batch ${REGEN_BATCH:-256}: retrying at 256 for ${LEFT}s"; regen $LEFT 256
  fi
  if [ -n "${REGEN_NAME:-}" ]; then
    mkdir -p $K/data
    for f in $RD/shard-*.jsonl; do [ -f "$f" ] && ln -f "$f" $K/data/shard-$REGEN_NAME-${f##*/shard-}; done
  fi
  python3 - $K/data <<'PY' | tee $L/regen_summary.txt
import json, glob, sys
n = t = s = 0
for f in sorted(glob.glob(sys.argv[1] + "/shard-*.jsonl")):
    for l in open(f):
        e = json.loads(l); n += 1; t += len(e["tokens"]); s += sum(e["loss_mask"])
print(f"regen data: {n} examples, {t} tokens, {s} supervised")
PY
  ;;
stash)
  [ -d .dev/warm ] && cp -r .dev/warm $K/warm && ls $K/warm
  [ -f .dev/data.tar.xz ] && cp .dev/data.tar.xz $K/ && ls -la $K/data.tar.xz
  [ -f .dev/prompts.jsonl.xz ] && cp .dev/prompts.jsonl.xz $K/ && ls -la $K/prompts.jsonl.xz
  ;;
data)
  [ -f $K/gguf.part_aa ] || [ -f $G ] || { echo "no setup"; exit 1; }
  A=$K/data.tar.xz; [ -f $A ] || A=.dev/data.tar.xz
  unpack && mkdir -p $K/data && tar xJf $A -C $K && ls $K/data | head -3
  ;;
ab)
  [ -f $K/micro ] || echo ${MICRO:-4096} > $K/micro; dmon ab
  # an arm is INIT[,VAR=VALUE...][:SECONDS]: INIT is random, target-layers or a drafter dir (such as
  # /tmp/keep/warm); each VAR=VALUE sets one knob of `flags` (LR, DISTILL, ANCHORS, ...) or of the
  # runtime (DFLASH_CUDA_EVENT_TRACKING=1, DFLASH_CUDA_POOL_RELEASE=1) for that arm only
  for ARM in ${AB_ARMS:-random target-layers}; do
    A=${ARM%%:*}; SECS=${ARM#*:}; [ "$SECS" = "$ARM" ] && SECS=${AB_SECONDS:-60}
    IFS=',' read -r -a KV <<< "$A"
    A=$(echo "$A" | tr '/,=' '__-'); rm -rf $K/ab-$A
    (
      INIT=${KV[0]}; PROFILE=1
      for kv in "${KV[@]:1}"; do export "$kv"; done
      $D train $(flags) --out $K/ab-$A --max-steps ${AB_STEPS:-200} --time-limit $SECS \
        > $L/ab-$A.log 2>&1 || tail -5 $L/ab-$A.log
    )
    I=$A
    cp $K/ab-$I/log.jsonl $L/ab-$I.jsonl 2>/dev/null
  done
  dmon_summary ab
  python3 - $L <<'PY'
import json, sys, glob, statistics as st
for f in sorted(glob.glob(sys.argv[1] + "/ab-*.jsonl")):
    r = [json.loads(l) for l in open(f)]
    if not r: continue
    ph = {k: st.median([x["phases"].get(k, 0) for x in r[1:] or r]) for k in r[-1].get("phases", {})}
    last = r[-5:]
    print(f"{f.split('/')[-1]}: {len(r)} steps, median {st.median([x['seconds'] for x in r[1:] or r]):.3f} s/step")
    print("  phases (median s):", {k: round(v, 4) for k, v in sorted(ph.items(), key=lambda kv: -kv[1])})
    for s in (0, 9, 19, 49, 99, len(r) - 1):
        if s < len(r):
            x = r[s]; print(f"  step {x['step']}: loss {x['loss']:.3f} acc1 {x['accuracy'][0]:.3f} streak {x['streak']:.3f}")
PY
  ;;
train)
  [ -x $D ] && ls $K/data/shard-*.jsonl >/dev/null 2>&1 || { echo "no binary or no data"; exit 1; }
  T0=$(date +%s)
  SPS=${SPS:-}
  [ -n "$SPS" ] && echo ${MICRO:-4096} > $K/micro
  [ -n "$SPS" ] || for MB in ${MICRO_CANDIDATES:-16384 8192 4096}; do
    echo $MB > $K/micro; rm -rf $K/probe
    $D train $(flags) --out $K/probe --max-steps 5 --time-limit 60 > $L/probe.log 2>&1
    if [ -s $K/probe/log.jsonl ] && [ $(wc -l < $K/probe/log.jsonl) -ge 2 ]; then
      SPS=$(python3 -c "
import json,statistics
r=[json.loads(l) for l in open('$K/probe/log.jsonl')]
print(statistics.median([x['seconds'] for x in r[1:]]))"); break
    fi
    echo "probe at micro-batch $MB failed:"; tail -3 $L/probe.log
  done
  [ -n "$SPS" ] || exit 1
  STEPS=$(python3 -c "print(max(10,int(${TRAIN_SECONDS:-800}/$SPS)))")
  echo "probe: micro-batch $(cat $K/micro), $SPS s/step -> plan of $STEPS steps"; echo $STEPS > $K/steps
  tail -1 $K/probe/log.jsonl 2>/dev/null
  LEFT=$(( ${CALL_SECONDS:-560} - ($(date +%s) - T0) - 25 ))
  # the knobs of this run, for `resume` (train refuses a resume with another lr, seed, packing...)
  echo "LR=${LR:-6e-4} ANCHORS=${ANCHORS:-128} BATCH_TOKENS=${BATCH_TOKENS:-16384} DISTILL=${DISTILL:-0} VAL_FRACTION=${VAL_FRACTION:-0.004}" > $K/run.env
  dmon train
  $D train $(flags) --out $K/run --max-steps $STEPS --time-limit $LEFT 2>&1 | tee $L/train.log | tail -9
  dmon_summary train
  ;;
ncu)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  # a measurement, not a prerequisite: without ncu the later stages still run
  if [ -z "$NCU" ]; then echo "no ncu: stage skipped"; continue; fi
  rm -rf $K/ncu-run
  # NCU_SKIP / NCU_COUNT profile a window of kernels (--launch-skip / --launch-count): the last
  # session's ncu stopped after the forward's ~9.4 k kernels, so the backward needs a skip
  timeout ${NCU_SECONDS:-180} $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    ${NCU_SKIP:+--launch-skip $NCU_SKIP} ${NCU_COUNT:+--launch-count $NCU_COUNT} --log-file $L/ncu.csv \
    $D train $(BATCH_TOKENS=4096 MICRO_FORCE=4096 flags) --out $K/ncu-run \
    --max-steps ${NCU_STEPS:-2} > $L/ncu-train.log 2>&1 || tail -5 $L/ncu-train.log
  python3 - $L/ncu.csv $K/ncu-run/log.jsonl <<'PY' || echo "ncu summary failed (raw CSV in the logs)"
import csv, json, sys, collections
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
t = collections.defaultdict(float); n = collections.Counter()
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum": continue
    v = float(r["Metric Value"].replace(",", "")); unit = r.get("Metric Unit", "nsecond")
    v *= {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "second": 1.0, "s": 1.0}.get(unit, 1e-9)
    k = r["Kernel Name"].split("(")[0][:60]; t[k] += v; n[k] += 1
tot = sum(t.values()); steps = [json.loads(l) for l in open(sys.argv[2])]
import os
if os.environ.get("NCU_SKIP") or os.environ.get("NCU_COUNT"):
    print(f"ncu: {sum(n.values())} kernels after skipping {os.environ.get('NCU_SKIP', 0)}, "
          f"{tot:.3f} s of kernel time (a window, not whole steps)")
else:
    print(f"ncu: {sum(n.values())} kernels, {tot:.3f} s of kernel time over {len(steps)} steps "
          f"({tot / max(len(steps), 1):.3f} s and {sum(n.values()) // max(len(steps), 1)} kernels a step;"
          " compare with the unprofiled s/step)")
for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:25]:
    print(f"  {v:8.4f} s {100*v/tot:5.1f}% {n[k]:6d}x  {k}")
PY
  ;;
bench)
  # the fused block attention against the composite on the H200: parity and time (JSON), at a
  # 4,096-token micro-batch's shapes (9 sequences × 128 blocks, 512 context rows) and a longer one
  [ -x $D ] || { echo "no binary"; exit 1; }
  # (BWD=row: the one-thread-per-row backward kernels, DFLASH_FLASH_BWD=row; split: the default)
  for BWD in split row; do
  for DT in f32 bf16; do
    for CTX in 512 1024; do
      F=$L/bench-attention-$BWD-$DT-$CTX.json
      DFLASH_FLASH_BWD=$BWD $D bench attention --device cuda --dtype $DT --context $CTX --rounds 5 \
        --out $F > /dev/null 2> $F.err || { echo "bench $BWD $DT $CTX failed:"; tail -5 $F.err; }
      python3 -c "
import json,sys
r=json.load(open(sys.argv[1])); s=r['seconds']
print(sys.argv[1].split('/')[-1], 'worst rel diff %.2e' % r['worst'],
      'fwd %.4f -> %.4f s' % (s['composite_forward'], s['fused_forward']),
      'fwd+bwd %.4f -> %.4f s' % (s['composite_forward_backward'], s['fused_forward_backward']))
" $F 2>/dev/null
    done
  done
  done
  # the target's causal attention: a training micro-batch's taps, and a 16-token verify over 512
  # (and, with PAD, regen's left-padded batches: sequence i hides its first i·PAD keys)
  for SPEC in "f32 4 1024 0 0" "bf16 4 1024 0 0" "bf16 1 16 512 0" "f32 8 200 0 23" "f32 8 1 300 37" \
      "bf16 1 128 0 0" "bf16 1 256 0 0"; do
    read -r DT B QN PAST PAD <<< "$SPEC"; F=$L/bench-causal-$DT-$B-$QN-$PAST-$PAD.json
    $D bench causal-attention --device cuda --dtype $DT --batch $B --queries $QN --past $PAST --left-pad $PAD \
      --rounds 5 --out $F > /dev/null 2> $F.err || { echo "bench causal $SPEC failed:"; tail -5 $F.err; }
    python3 -c "
import json,sys
r=json.load(open(sys.argv[1])); s=r['seconds']
print(sys.argv[1].split('/')[-1], 'rel diff %.2e' % r['max_relative_difference'], '%.5f -> %.5f s' % (s['composite'], s['fused']))
" $F 2>/dev/null
  done
  $D bench cross-entropy --device cuda --rounds 5 --out $L/bench-cross-entropy.json > /dev/null \
    2> $L/bench-cross-entropy.err || { echo "bench cross-entropy failed:"; tail -5 $L/bench-cross-entropy.err; }
  python3 -c "
import json,sys
r=json.load(open(sys.argv[1])); s=r['seconds']
print('cross-entropy: loss rel diff %.2e, grad rel diff %.2e, argmax rows differing %d, %.4f -> %.4f s' % (
  r['loss']['relative_difference'], r['gradient_max_relative_difference'], r['argmax_rows_differing'],
  s['composite_forward_backward'], s['fused_forward_backward']))
" $L/bench-cross-entropy.json 2>/dev/null
  ;;
resume)
  [ -f $K/steps ] || { echo "no plan"; exit 1; }
  [ -f $K/run.env ] && { set -a; . $K/run.env; set +a; cat $K/run.env; }
  dmon resume
  $D train $(flags) --out $K/run --max-steps $(cat $K/steps) --resume --time-limit ${CALL_SECONDS:-400} 2>&1 \
    | tee $L/resume.log | tail -9
  dmon_summary resume
  ;;
eval)
  # EVAL_DRAFT (default: this run's drafter), EVAL_MODES, EVAL_BUDGET (DDTree nodes; several,
  # such as 64,128,256, give one ddtree-N row each against one AR run), EVAL_NAME
  $D eval --target $G --draft ${EVAL_DRAFT:-$K/run/drafter} --bench gsm8k,humaneval,mt_bench \
    --limit ${EVAL_LIMIT:-10} --modes ${EVAL_MODES:-ar,dflash,ddtree} --max-new-tokens 256 \
    --tree-budget ${EVAL_BUDGET:-64} --device cuda --dtype ${EVAL_DTYPE:-f32} \
    --out $OUT/${EVAL_NAME:-eval}.json 2>&1 | grep -v '^[{} ]' | tee $L/${EVAL_NAME:-eval}.log | head -30
  ;;
collect)
  # at most 8 files come back: the drafter's 5, the logs (curves, validation, log.jsonl inside),
  # the data (KEEP_DATA=1) and an eval.json of a later stage in the same call
  [ -d $K/run/drafter ] && mkdir -p $OUT/drafter && cp $K/run/drafter/* $OUT/drafter/
  cp $K/run/log.jsonl $K/run/validation.json $K/run/curves.png $L/ 2>/dev/null
  cp $K/probe/log.jsonl $L/probe_log.jsonl 2>/dev/null; tar czf $OUT/run_logs.tgz -C $L .
  [ -n "${KEEP_DATA:-}" ] && tar cJf $OUT/data.tar.xz -C $K data
  ls -la $OUT $OUT/drafter
  ;;
esac
done
