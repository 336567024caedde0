# ncu --set full on one launch of each of KERNELS (default: the decode attention and add+norm) inside
# the bench op OP (default ar_step) at SPECS (shape:context). Lab script: run from the repo root.
set -uo pipefail
mkdir -p /tmp/bin; for f in dist/cuda/dflash.xz; do [ -x /tmp/bin/dflash ] || xz -dc $f > /tmp/bin/dflash; done; chmod +x /tmp/bin/*
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for spec in ${SPECS:-qwen3-8b:512 smollm2-135m:512}; do IFS=: read -r shape ctx <<< "$spec"
for k in ${KERNELS:-tree_attn_mma_bf16 add_rms_norm_bf16}; do
echo "=== $shape $k"
DFLASH_PROFILE_OP=${OP:-ar_step} timeout 300 $NCU --profile-from-start off --clock-control none --kernel-name $k --launch-skip ${SKIP:-40} --launch-count 1 --set full --import-source no -f -o /tmp/rep-$shape-$k \
  /tmp/bin/dflash bench decode --shape $shape --context $ctx --device cuda --dtype bf16 --rounds 2 --warmup 1 --widths 64 > /dev/null 2>&1
$NCU -i /tmp/rep-$shape-$k.ncu-rep --page details --csv > $OUT/ncu-$shape-$k.csv 2>&1
$NCU -i /tmp/rep-$shape-$k.ncu-rep --page source --print-source sass --csv > /tmp/src-$shape-$k.csv 2>&1
python3 - /tmp/src-$shape-$k.csv <<'PY' > $OUT/ncu-src-$shape-$k.txt
# the SASS lines with the most stall samples, and the samples by opcode
import csv,sys
from collections import Counter
rows=list(csv.reader(open(sys.argv[1], errors="replace")))
hi=next((i for i,r in enumerate(rows) if any('Source' == c for c in r)), None)
if hi is None:
    print("no source table"); print("\n".join(",".join(r) for r in rows[:20])); sys.exit()
hdr=rows[hi]; print("columns:", hdr)
col=next((c for c in hdr if c.startswith('Warp Stall Sampling (All')), None)
src=hdr.index('Source'); k=hdr.index(col) if col else None
lines=[r for r in rows[hi+1:] if len(r)==len(hdr)]
def v(r):
    try: return float(r[k].replace(',',''))
    except: return 0.0
tot=sum(v(r) for r in lines) or 1
ops=Counter()
for r in lines: ops[r[src].split()[0] if r[src].split() else '?']+=v(r)
print(f"total samples {tot:.0f}")
for o,c in ops.most_common(25): print(f"{o:24} {c/tot*100:5.1f}%")
for r in sorted(lines,key=v,reverse=True)[:40]: print(f"{v(r)/tot*100:5.1f}%  " + "  ".join(r[:len(hdr)])[:220])
PY
python3 - $OUT/ncu-$shape-$k.csv <<'PY'
import csv,sys
rows=list(csv.reader(open(sys.argv[1], errors="replace")))
hdr=None
keep=('speed','light','launch','occupancy','warp','scheduler','memory','source','instruction','compute')
for r in rows:
    if 'Metric Name' in r: hdr=r; continue
    if hdr and len(r)==len(hdr):
        d=dict(zip(hdr,r))
        sec=d.get('Section Name',''); m=d.get('Metric Name','')
        if m and any(s in sec.lower().replace(' ','') for s in keep):
            print(f"{sec[:22]:22} {m[:56]:56} {d.get('Metric Unit',''):10} {d.get('Metric Value','')}")
PY
done; done
