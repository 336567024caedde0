# ncu --set full on one launch of each of KERNELS (default: the decode attention and add+norm) inside
# the bench op OP (default ar_step) at SPECS (shape:context). Lab script: run from the repo root.
set -uo pipefail
mkdir -p /tmp/bin; for f in dist/cuda/dflash.xz; do [ -x /tmp/bin/dflash ] || xz -dc $f > /tmp/bin/dflash; done; chmod +x /tmp/bin/*
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for spec in ${SPECS:-qwen3-8b:512 smollm2-135m:512}; do IFS=: read -r shape ctx <<< "$spec"
for k in ${KERNELS:-tree_attn_mma_bf16 add_rms_norm_bf16}; do
echo "=== $shape $k"
DFLASH_PROFILE_OP=${OP:-ar_step} timeout 300 $NCU --profile-from-start off --clock-control none --kernel-name $k --launch-skip ${SKIP:-40} --launch-count 1 --set full --page details --csv \
  /tmp/bin/dflash bench decode --shape $shape --context $ctx --device cuda --dtype bf16 --rounds 2 --warmup 1 --widths 64 2>/dev/null > $OUT/ncu-$shape-$k.csv
python3 - $OUT/ncu-$shape-$k.csv <<'PY'
import csv,sys
rows=list(csv.reader(open(sys.argv[1])))
hdr=None
for r in rows:
    if 'Metric Name' in r: hdr=r; continue
    if hdr and len(r)==len(hdr):
        d=dict(zip(hdr,r))
        sec=d.get('Section Name',''); m=d['Metric Name']
        if any(s in sec for s in ['Speed Of Light','Launch','Occupancy','Warp State','Scheduler','Memory Workload']) :
            print(f"{sec[:22]:22} {m[:48]:48} {d.get('Metric Unit',''):10} {d['Metric Value']}")
PY
done; done
