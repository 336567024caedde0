#!/usr/bin/env bash
# Builds the CUDA `dflash` binary and the CUDA build of the reference-fixture tests, and packages
# what the GPU machine needs into dist/cuda/ (xz-compressed; carry that folder to the GPU machine).
# Needs scripts/setup-cuda-build.sh once. First build ~12 min on 2 cores; later ones relink.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /opt/cuda13/bin/nvcc ] || bash scripts/setup-cuda-build.sh
# keep these identical from build to build: they are rerun-if-env-changed triggers (9-minute rebuild)
export CUDA_HOME=/opt/cuda13 PATH=/opt/cuda13/bin:$PATH CUDA_COMPUTE_CAP=90
export LIBRARY_PATH=/opt/cuda13/lib64:/opt/cuda13/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
python3 scripts/check-kernels.py  # the NVRTC kernels compile (as at run time on the GPU)
cargo build --release --features cuda -p dflash-cli
# the GPU-side test binaries, from one cargo call (one feature set: no second kernel build)
cargo test --release --features cuda -p dflash-models --test reference_fixtures --test decode_ops_device \
  --test row_invariance_device --test hybrid_device_step \
  --no-run --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except Exception: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]:
        print(m["target"]["name"], m["executable"])' > "$CARGO_TARGET_DIR/gpu-tests.txt"
mkdir -p dist/cuda
cp "$CARGO_TARGET_DIR/release/dflash" dist/cuda/dflash
while read -r name exe; do cp "$exe" "dist/cuda/$name"; done < "$CARGO_TARGET_DIR/gpu-tests.txt"
strip dist/cuda/dflash dist/cuda/reference_fixtures dist/cuda/decode_ops_device dist/cuda/row_invariance_device \
  dist/cuda/hybrid_device_step
xz -T2 -6 -f dist/cuda/dflash dist/cuda/reference_fixtures dist/cuda/decode_ops_device \
  dist/cuda/row_invariance_device dist/cuda/hybrid_device_step
ls -la dist/cuda
