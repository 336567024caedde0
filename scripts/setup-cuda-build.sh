#!/usr/bin/env bash
# One-time CUDA 13.0 build toolchain from PyPI (nvcc + link-time libraries + a libcuda stub), so the
# `cuda` feature builds on a machine with no GPU. Idempotent: skips work already done.
# After it: export CUDA_HOME=/opt/cuda13 PATH=/opt/cuda13/bin:$PATH CUDA_COMPUTE_CAP=90
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PIPDIR=${PIPDIR:-/opt/cuda-pip}
CH=${CH:-/opt/cuda13}
if [ ! -x "$PIPDIR/nvidia/cu13/bin/nvcc" ]; then
  # ONE pip command: a second `pip install --target` into the same folder installs nothing.
  python3 -m pip install -q --target "$PIPDIR" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 \
    nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 \
    nvidia-cublas==13.1.0.3 nvidia-cuda-nvrtc==13.0.88 nvidia-curand==10.4.0.35
fi
P=$PIPDIR/nvidia/cu13
mkdir -p "$CH/lib64/stubs"
for d in bin include nvvm; do ln -sfn "$P/$d" "$CH/$d"; done
for f in "$P"/lib/*.so.* "$P"/lib/*.a; do ln -sf "$f" "$CH/lib64/"; done
cd "$CH/lib64"
for l in cudart:13 cublas:13 cublasLt:13 curand:10 nvrtc:13; do
  ln -sf "lib${l%%:*}.so.${l##*:}" "lib${l%%:*}.so"
done
# libcuda stub (soname libcuda.so.1) exporting every driver symbol cudarc references; the real
# driver library is found on the GPU machine at run time.
SYS=$(ls ~/.cargo/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$SYS" ]; then
  (cd "$ROOT" && cargo fetch -q)
  SYS=$(ls ~/.cargo/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs | sort -V | tail -1)
fi
grep -ohE 'load::<_F>\("cu[A-Za-z0-9_]+"\)' "$SYS" | sed -E 's/.*\("(.*)"\)/\1/' | sort -u \
  | awk '{print "int "$1"(void){return 999;}"}' > "$CH/lib64/stubs/libcuda_stub.c"
gcc -shared -fPIC -o "$CH/lib64/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$CH/lib64/stubs/libcuda_stub.c"
"$CH/bin/nvcc" --version | tail -1
echo "OK: export CUDA_HOME=$CH PATH=$CH/bin:\$PATH CUDA_COMPUTE_CAP=90"
