# Sourced by the lab's GPU-call scripts (scripts/lab/*-call.sh): unpacks dist/cuda's binaries into
# /tmp/bin, prints the GPU, and defines show (test lines matching a regex, panics with their next
# line), has (whether PARTS names a part), el (seconds since sourcing) and bench NAME VARIANTS
# SHAPES (`bench decode` through scripts/gpu-decode-bench.sh into $R/NAME, no peers, no tests).
# Needs PARTS and R set.
mkdir -p /tmp/bin; for f in dist/cuda/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)"; done; chmod +x /tmp/bin/*
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
show() { awk -v re="$1" '/panicked/ { print; if ((getline l) > 0) print l; next } $0 ~ re'; }
has() { [[ " $PARTS " == *" $1 "* ]]; }
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s]"; }
bench() {  # bench NAME VARIANTS SHAPES
  mkdir -p "$R/$1"; echo "== bench $1: $2 at $3 $(el)"
  OUT=$R/$1 PEER=0 TESTS=0 ROUNDS=${ROUNDS:-20} VARIANTS="$2" SHAPES="$3" bash scripts/gpu-decode-bench.sh 2>&1 | tail -8
  rm -f "$R/$1/bench-decode.log"
}
