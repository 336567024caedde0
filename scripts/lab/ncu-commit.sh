# The hybrid state commit under ncu (lab script, run from the repo root on the GPU machine, with
# dist/cuda carried): every launch of the gated delta rule's kernel and of the convolution-window
# commit inside `bench decode`'s state_commit op (the verify's forward launches, grid z = 1, and
# the commit's replay of every layer at once, grid z = layers), with duration, DRAM throughput,
# occupancy and grid — to see how far the replay runs from the bandwidth it needs.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/bin; [ -x /tmp/bin/dflash ] || xz -dc dist/cuda/dflash.xz > /tmp/bin/dflash; chmod +x /tmp/bin/*
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for spec in ${SPECS:-qwen3.6-27b:2048}; do IFS=: read -r shape ctx <<< "$spec"
  echo "=== $shape context $ctx: state_commit op"
  DFLASH_PROFILE_OP=${OP:-state_commit} timeout 400 $NCU --profile-from-start off --clock-control none \
    --kernel-name regex:'gated_delta_tree_layers_f32|gdn_conv_window_layers|gdn_record_keep_rows' \
    --launch-count ${COUNT:-120} --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section MemoryWorkloadAnalysis --page details --csv \
    /tmp/bin/dflash bench decode --shape "$shape" --context "$ctx" --device cuda --dtype bf16 --rounds 2 \
    --warmup 1 --widths 64 2>/dev/null > "$OUT/ncu-commit-$shape.csv"
  python3 - "$OUT/ncu-commit-$shape.csv" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
launches = collections.OrderedDict()
for r in rows:
    if 'Metric Name' in r:
        hdr = r
        continue
    if hdr and len(r) == len(hdr):
        d = dict(zip(hdr, r))
        key = (d.get('ID'), d.get('Kernel Name', '')[:32], d.get('Grid Size', ''))
        launches.setdefault(key, {})[d['Metric Name']] = d['Metric Value'] + ' ' + d.get('Metric Unit', '')
want = ['Duration', 'DRAM Throughput', 'Memory Throughput', 'Achieved Occupancy', 'Registers Per Thread',
        'Theoretical Occupancy', 'Compute (SM) Throughput', 'L2 Hit Rate']
seen = collections.Counter()
for (i, name, grid), m in launches.items():
    tag = (name, grid)
    seen[tag] += 1
    if seen[tag] > 3:
        continue
    print(i, name, grid, ' | '.join(f"{w}: {m.get(w, '-')}" for w in want))
print({f"{n} {g}": c for (n, g), c in seen.items()})
PY
done
