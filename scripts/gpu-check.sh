#!/usr/bin/env bash
# Runs on the GPU machine (see docs/benchmarks.md): SmolLM2 reference fixtures from transformers,
# the fixture tests on CUDA (f32 and bf16), and generate in every mode on SmolLM2, timings to $OUT.
# Expects: the GGUF at $GGUF, dist/cuda/*.xz (scripts/build-cuda.sh), .whl/gguf-*.whl.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GGUF=${GGUF:-/tmp/keep/smol.gguf}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
FX=/tmp/fixtures; mkdir -p $FX && cp -r fixtures/* $FX/
if [ "${SKIP_FIXTURES:-0}" != 1 ]; then
  python3 scripts/make_fixtures.py /tmp/fx --skip-tiny --gguf "$GGUF" 2>&1 | grep -v Warning | tail -3
  cp -r /tmp/fx/smollm2 $FX/ && (cd /tmp/fx && tar czf "$OUT/smollm2_fixtures.tgz" smollm2)
fi
echo "== z-lab reference (dflash 0.1.0)"
python3 scripts/zlab_reference.py . "$OUT/zlab_reference.safetensors" 2>&1 | grep -v Warning | tail -4
mkdir -p /tmp/bin && for f in dist/cuda/*.xz; do xz -dc "$f" > /tmp/bin/$(basename "$f" .xz); done; chmod +x /tmp/bin/*
export DFLASH_FIXTURES=$FX DFLASH_SMOLLM2_GGUF=$GGUF DFLASH_REQUIRE_SMOLLM2=1 DFLASH_TEST_DEVICE=cuda
for dt in f32 bf16; do
  echo "== reference_fixtures on cuda $dt"
  DFLASH_TEST_DTYPE=$dt /tmp/bin/reference_fixtures --test-threads 1 2>&1 | grep -E "test |err|result|panicked" | tee -a "$OUT/tests.log"
done
D=/tmp/bin/dflash
$D draft init --target "$GGUF" --layers 5 --out /tmp/rd --seed 1
for dt in f32 bf16; do
  for p in "What is the capital of France?" "Write a haiku about Rust." "Explain in two sentences why the sky is blue."; do
    for m in ar dflash ddtree; do
      $D generate --target "$GGUF" --device cuda --dtype $dt --mode $m --draft /tmp/rd --tree-budget 64 \
        --prompt "$p" --max-new-tokens 128 --json --ids >> "$OUT/generate_$dt.jsonl" 2>>"$OUT/stderr.log"
    done
  done
done
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
for dt in ("f32", "bf16"):
    rows = [json.loads(l) for l in open(os.path.join(out, f"generate_{dt}.jsonl"))]
    for i in range(0, len(rows), 3):
        ar, df, tr = rows[i:i+3]
        def same(r):
            if r["output_ids"] == ar["output_ids"]:
                return "same"
            k = next((j for j, (a, b) in enumerate(zip(r["output_ids"], ar["output_ids"])) if a != b), min(len(r["output_ids"]), len(ar["output_ids"])))
            m = ar["logit_margins"][k] if k < len(ar["logit_margins"]) else float("nan")
            return f"DIFFERS at token {k} (AR top1-top2 margin {m:.4f})"
        print(f"{dt} prompt{i//3}: ar {ar['tokens_per_second']:.1f} tok/s ({ar['output_tokens']} tok) | "
              f"dflash {df['tokens_per_second']:.1f} tok/s tau {df['acceptance_length_mean']:.2f} {same(df)} "
              f"draft {1e3*df['draft_seconds']/max(1,df['steps']-1):.2f} ms verify {1e3*df['verify_seconds']/df['steps']:.2f} ms | "
              f"ddtree {tr['tokens_per_second']:.1f} tok/s tau {tr['acceptance_length_mean']:.2f} {same(tr)} "
              f"tree {1e3*tr['tree_build_seconds']/tr['steps']:.2f} ms verify {1e3*tr['verify_seconds']/tr['steps']:.2f} ms")
    print(f"{dt} ar[0] text: {rows[0]['text'][:200]!r}")
PY
if [ "${SMOKE_TRAIN:-1}" = 1 ]; then
  echo "== regen + train smoke on cuda"
  head -32 data/benchmarks/gsm8k_train.jsonl > /tmp/p.jsonl
  t0=$(date +%s.%N)
  $D data regen --target "$GGUF" --prompts /tmp/p.jsonl --out /tmp/rg --max-new-tokens 128 --device cuda 2>&1 | tail -1
  t1=$(date +%s.%N)
  $D train --target "$GGUF" --data /tmp/rg --out /tmp/run --epochs 3 --device cuda --checkpoint-every 1000 2>&1 | tail -4
  t2=$(date +%s.%N)
  echo "regen 32 prompts: $(python3 -c "print(round($t1-$t0,1))") s; train 93 steps + validate: $(python3 -c "print(round($t2-$t1,1))") s"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
fi
