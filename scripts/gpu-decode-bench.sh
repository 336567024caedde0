#!/usr/bin/env bash
# Runs on the GPU machine (one device call; carry dist/cuda from scripts/build-cuda.sh): the
# decode-op parity tests and the reference fixtures on CUDA, then `dflash bench decode` at the
# SmolLM2-135M, Qwen3-0.6B and Qwen3-8B shapes (random weights), each with the decode fusions off
# (DFLASH_FUSED_DECODE=0, the plain candle path), on without CUDA graphs (DFLASH_CUDA_GRAPHS=0) and
# on with them (the default), beside transformers on the same shapes in
# the same call (scripts/peer_decode.py). Everything lands in $OUT/bench-decode.jsonl (one JSON per
# line, tagged) and $OUT/bench-decode.log; the last lines printed are a summary table.
# Knobs: SHAPES="smollm2-135m:f32:512 ..." (shape:dtype:context), ROUNDS, PEER=0 to skip peers,
# TESTS=0 to skip the tests, TESTS=new for the newest opt-ins' tests alone.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROUNDS=${ROUNDS:-30}
# plain: DFLASH_FUSED_DECODE=0; fused: fused kernels, no CUDA graphs; cublas: graphs with every
# projection on cuBLAS (DFLASH_STREAM_GEMM=0); exact: graphs with every projection of up to 288
# rows on the row-invariant streaming GEMM (DFLASH_STREAM_GEMM=all, what --bit-exact sets);
# nofew: graphs without streaming large weights for calls of ≤ 4 rows (DFLASH_STREAM_FEW_ROWS_MB=0);
# scalar: graphs with the attention's earlier element-by-element K/V staging (DFLASH_ATTN_STAGING=scalar);
# rebuilt: graphs rebuilt without their allocation/free nodes (DFLASH_GRAPH_REBUILD=1); pdl: rebuilt
# graphs with programmatic dependent launch, dependents launched at each kernel's exit
# (DFLASH_PDL=1); pdlearly: the same, launched right after each kernel's wait (DFLASH_PDL=early);
# (unrolledmerge, DFLASH_ATTN_MERGE=unrolled: removed in session 20 — the split merge is one warp a vector, its loads unrolled, always);
# tileprefetch: the attention's next K/V tile loaded while one is scored (DFLASH_ATTN_PREFETCH=1);
# attnnext: both (session 15's attention variants, built and not yet measured); addnorm: residual
# add + RMSNorm as the prologue of the projection after it (DFLASH_FUSED_ADD_NORM=1, likewise);
# topkone: the tree build's device top-k with each row in one block (DFLASH_TOPK_SPLIT=0; the split top-k is the default since session 19);
# gdnoff: hybrids with the Gated DeltaNet layer on candle's composite (DFLASH_GDN_KERNELS=0; A/B of session 16's kernels);
# scalarattn: bf16 attention on the CUDA-core kernel instead of the tensor-core one (DFLASH_TREE_ATTN=scalar, session 20);
# rowkeys / poskeys: a tree's keys by step row (DFLASH_TREE_KEYS=row: ancestor masks in place; bf16's default since session 20 unless --bit-exact) / by position (=position: bit-identical to AR steps, bent rows read their keys one by one);
# tiled: exact with calls of more than 16 rows on the tiled streaming GEMM (DFLASH_STREAM_TILED=1; bit-exact, far slower: session 21);
# pathtable: poskeys with each warp's tree paths in shared memory (DFLASH_ATTN_PATH_TABLE=1, session 21);
# tiledall: tiled from 2 rows (DFLASH_STREAM_TILED_FROM=2: 16-row verifies too);
# tiledpt: tiled with the tensor-core attention and the path table at every head width (the bit-exact candidate);
# gdnsep: hybrids with the Gated DeltaNet input projections as four GEMMs (DFLASH_GDN_IN_PROJ=separate; stacked into one since session 21);
# hybridstep: hybrids on their device step, replayed as CUDA graphs (DFLASH_HYBRID_STEP=1, the default since session 21);
# hybridhost: hybrids on the host path (DFLASH_HYBRID_STEP=0: every layer's ops launched from the host, as before session 21);
# rule4: hybrids with the gated delta rule four lanes a state column (DFLASH_GDN_RULE_LANES=4, session 22; the same bits; the default since);
# fewalltiles: few-row calls stream large weights whatever their block count (DFLASH_STREAM_FEW_MIN_TILES=0, the policy before session 22);
# rule1: one lane a column (DFLASH_GDN_RULE_LANES=1, the kernel before session 22);
# rulestage: four lanes with each chunk of tokens staged in shared memory (DFLASH_GDN_RULE_STAGE=1; built in session 22, not yet run);
# replaystaged / stagedboth: (session 23, before it became the default) the state commit's replays on the staged kernel sized for them (chunks of 8 tokens, 80 registers, 24 warps an SM) / and the forward's rule staged;
# replayrule: the state commit's replays on the forward's rule kernel (DFLASH_GDN_REPLAY=rule, the default before session 23);
# unfusedheads: the hybrids' gated attention heads op by op over three projections (DFLASH_GATED_HEADS=0; session 32 stacked q/k/v and made the heads one kernel); unfusedboth: that and unfusedinputs;
# unfusedinputs: the Gated DeltaNet layers' convolution and rule inputs as two kernels (DFLASH_GDN_FUSED_INPUTS=0; session 32 fused them, reading the stacked projection in place);
# replayvec: the state commit's replays with each key row stored by lane group in shared memory, read four floats at a time (DFLASH_GDN_REPLAY=vec; session 31; the same bits, no faster on an H100);
# replayprefetch: the state commit's replays with the state's loads first and each chunk's keys in two batches of loads (DFLASH_GDN_REPLAY=prefetch; session 29; the same bits, no faster on an H200 in session 30);
# splitvalues: hybrids' device-step attention with the value product split over 64-key chunks (DFLASH_ATTN_VALUES=split; session 23, opt-in: faster isolated AR/chain ops, no faster loops);
# treeattn1: bf16 attention on the general tensor-core kernel everywhere (DFLASH_DECODE_ATTN=tree; session 24 gave steps of up to 64 query vectors a kernel of their own, group_attn_mma);
# (groupcombine, DFLASH_GROUP_MERGE=0: session 24's A/B of the fused merge for group_attn_mma's steps of several rows — slower, removed);
# siluapart: (session 24's A/B, the default since session 25) the MLP's activation as its own kernel before the down projection;
# siluepilogue: the activation as the streaming down projection's epilogue (DFLASH_SILU_EPILOGUE=1; the same numbers; the default before session 25);
# hybridmma / hybridmask: hybrids' gated attention on the bf16 tensor-core attention (256-wide heads included) at every width (DFLASH_HYBRID_ATTN=mma) / never (=mask); by default up to 128 query vectors (session 25);
# treechunk64 / treechunk128 / treechunk512: trees of more than 16 rows with keys by step row on the tensor cores split their keys in chunks of N (DFLASH_TREE_CHUNK=N; by default since session 25 the widest of 256/128 giving each SM two blocks, 64 before);
# groupvecN: group_attn_mma for steps of at most N query vectors (DFLASH_GROUP_ATTN_VECTORS=N);
# groupall: group_attn_mma for every step without per-row key reads, whatever its width (DFLASH_GROUP_ATTN_VECTORS=100000);
# hostwindows: drafters with causal / sliding-window layers on the host path (DFLASH_DRAFT_STEP_WINDOWS=0; on the device step by default since session 26, windows included);
# pipeline: the general tensor-core attention's tiles by cp.async, values loading while keys are scored and the next keys while values are summed (DFLASH_ATTN_PIPELINE=1; session 26; the same bits; no faster on an H100, session 27);
# topksplitsN: the device top-k's rows over N blocks each (DFLASH_TOPK_SPLITS=N; session 28; measured slower in session 29);
# stepchunkN: the one-row step's attention on N-key splits instead of the rule's (DFLASH_STEP_CHUNK=N; session 28; never under --bit-exact; stepchunk64 = the splits before session 29's rule);
# rows0 / rows1 / rows2 / rowsb2 / rows1cN / rows2cN: the row kernel (tree_attn_rows.cu, session 28: cp.async double buffers, mask-free cached tiles, ldmatrix, three blocks an SM) for bf16 steps of 2+ rows of 128-wide heads with keys by step row (DFLASH_ATTN_ROWS=0: never, session 27's kernels; =1: the trees the general kernel would take; =2, the default: also the few-vector kernel's, a DFlash block, the drafter's; =3 (rows3, session 29, measured no faster): also the one-row AR step, splits merged in the kernel; b2: two blocks an SM, DFLASH_ATTN_ROWS_BLOCKS=2; cN: with DFLASH_TREE_CHUNK=N);
# wide / wideexact: calls of 17–80 rows on the wide streaming GEMM (one block per 16 outputs for all rows: each weight read once; DFLASH_STREAM_WIDE=1) — with the default policy (tree verifies' small weights stream too; measured slower, session 27) / with every call streamed (= exact since session 27: --bit-exact takes the wide kernel by default; `exactnarrow` keeps the narrow one);
# bulk / bulksSPAN_nNST / bulkexact: narrow streaming-GEMM calls with the weight's tiles brought in by the copy engine (DFLASH_STREAM_BULK=1 or sSPAN_nNST: the same bits, compute 9.0+; on, the fast policy streams every call of ≤ 16 rows, large weights and LM heads too) / with --bit-exact's policy (session 30);
# bulkdown: few-row calls of weights with K ≥ 8192 (Qwen3-8B's down projection) streamed on the bulk kernel (DFLASH_STREAM_BULK_LARGE_K=1; session 30's probe: 27.0 µs against cuBLAS's 30.2 at one row);
# treestreamN: the fast policy streams calls of up to N rows on small weights, narrow kernel, a block per 16-row group (DFLASH_STREAM_TREE_ROWS=N; session 30);
# exactmma: --bit-exact's policy with the bf16 attention on tensor cores at every head width (DFLASH_TREE_ATTN=mma: SmolLM2's 64-wide heads take the CUDA-core kernel under --bit-exact by default);
# exactnosplit: --bit-exact's policy without the split kernel (DFLASH_STREAM_SPLIT=0: its default since session 31 for 81+-row calls of large weights and 17+-row LM heads);
# split / splitall / splitmma / splittrees / splitfast: --bit-exact's policy with calls of 17+ rows (split) or 2+ rows (splitall; with tensor-core attention: splitmma) on the split streaming GEMM (DFLASH_STREAM_SPLIT=1|2: 64 weight rows × up to 80 x rows a block, the kw partial sums over blocks, the narrow kernel's bits; session 31) / the fast policy with every call of 17+ (splittrees) or 2+ rows (splitfast) on it, large weights and LM heads included;
# exactwideall: --bit-exact with every 17–80-row call on the wide kernel (DFLASH_STREAM_WIDE_MIN_TILES=0, the rule before session 33: since then weights of fewer 16-output tiles than SMs take one narrow block per 16-row group);
# exactrowsd64: --bit-exact without the row kernel (DFLASH_ATTN_ROWS=0: session 33 gave 64-wide heads the row kernel for --bit-exact's cached splits);
# rowsd64 / rowsd64off: the default path with 64-wide heads' steps of 2+ rows on the row kernel (DFLASH_ATTN_ROWS_D64=2; session 33) / none of them (=0; the default since session 33, =1, is the steps of more than 16 rows: DDTree trees);
# fold / nofold: hybrids with the state commit folded into the next step's rule kernels (DFLASH_GDN_FOLD=1; session 34; measured in session 35: ~0.04 ms a pending row at 27B, no loop faster — opt-in) / as its own launches before it (=0, the default); foldglobal: the fold walking its pending tokens from global memory (DFLASH_GDN_FOLD_STAGE=0; session 36 stages them in shared memory by default); foldchunk4: the fold staging 4 pending tokens at a time instead of 8 (DFLASH_GDN_FOLD_CHUNK=4; session 37);
# graphs: the default path (graphs, and the streaming GEMM where it measured faster)
# draftinplace: the drafter's device step with its q/k/v GEMM's input one buffer a step and q from the heads kernel (DFLASH_DRAFT_ROWS_IN_PLACE=1; session 37: 2 copies a step instead of 3 a layer);
# prev: the default path of an earlier build (dist/prev/dflash.xz, unpacked to /tmp/bin/dflash-prev; carry
# dist/prev): a code change against its parent in one run
VARIANTS=${VARIANTS:-"plain fused graphs"}
SHAPES=${SHAPES:-"smollm2-135m:f32:512 smollm2-135m:bf16:512 qwen3-0.6b:bf16:512 qwen3-8b:bf16:512 qwen3-8b:bf16:2048"}
J=$OUT/bench-decode.jsonl; LOG=$OUT/bench-decode.log
: > "$J"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$LOG"
mkdir -p /tmp/bin && [ -d "${DIST:-dist/cuda}" ] && for f in ${DIST:-dist/cuda}/*.xz; do xz -dc "$f" > "/tmp/bin/$(basename "$f" .xz)"; done
[ -f dist/prev/dflash.xz ] && xz -dc dist/prev/dflash.xz > /tmp/bin/dflash-prev
chmod +x /tmp/bin/*
D=/tmp/bin/dflash
# the test lines matching the pattern, and each panic with the line after it (its message)
show() { awk -v re="$1" '/panicked/ { print; if ((getline l) > 0) print l; next } $0 ~ re'; }
if [ "${TESTS:-1}" = new ]; then  # only the tests of the newest opt-ins
  echo "== the row kernel (tree_attn_rows, the default): decode ops and row invariance; then under DFLASH_ATTN_ROWS=0 (session 27's kernels)" | tee -a "$LOG"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  echo "== keys by position: the row kernel on the cached splits (row kernel test, tree rows, bit-exact verify = AR steps)" | tee -a "$LOG"
  DFLASH_TREE_KEYS=position DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 row_kernel 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_TREE_KEYS=position DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 a_tree_row 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_ATTN_ROWS=0 DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  DFLASH_ATTN_ROWS=0 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  for dt in f32 bf16; do
    DFLASH_FIXTURES=$PWD/fixtures DFLASH_TEST_DEVICE=cuda DFLASH_TEST_DTYPE=$dt /tmp/bin/reference_fixtures \
      --test-threads 1 --skip smollm2 2>&1 | show "result|FAILED|panicked" | tee -a "$LOG"
  done
fi
if [ "${TESTS:-1}" = 1 ]; then
  echo "== decode ops on cuda" | tee -a "$LOG"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  echo "== decode ops on cuda under DFLASH_PDL=early (graphs rebuilt, programmatic edges)" | tee -a "$LOG"
  DFLASH_PDL=early DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  DFLASH_PDL=early DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "result|panicked" | tee -a "$LOG"
  echo "== decode ops and bit-exact verify on cuda under session 15's opt-in kernels (fused add+norm, attention variants)" | tee -a "$LOG"
  DFLASH_TOPK_SPLIT=0 DFLASH_FUSED_ADD_NORM=1 DFLASH_ATTN_PREFETCH=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  DFLASH_TOPK_SPLIT=0 DFLASH_FUSED_ADD_NORM=1 DFLASH_ATTN_PREFETCH=1 DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "result|panicked" | tee -a "$LOG"
  echo "== drafters with causal sliding-window layers on the host path (DFLASH_DRAFT_STEP_WINDOWS=0; the device step is the default)" | tee -a "$LOG"
  DFLASH_DRAFT_STEP_WINDOWS=0 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 draft 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  echo "== decode ops, tree rows and bit-exact verify under the tile pipeline (DFLASH_ATTN_PIPELINE=1)" | tee -a "$LOG"
  DFLASH_ATTN_PIPELINE=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  DFLASH_ATTN_PIPELINE=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  DFLASH_ATTN_PIPELINE=1 DFLASH_TREE_KEYS=position DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 a_tree_row 2>&1 | show "result|panicked" | tee -a "$LOG"
  DFLASH_ATTN_PIPELINE=1 DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "result|panicked" | tee -a "$LOG"
  echo "== attention of trees wider than 16 rows on 256-key splits (DFLASH_TREE_CHUNK=256)" | tee -a "$LOG"
  DFLASH_TREE_CHUNK=256 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 attention 2>&1 | show "result|panicked" | tee -a "$LOG"
  DFLASH_TREE_CHUNK=256 DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 a_tree_row 2>&1 | show "result|panicked" | tee -a "$LOG"
  echo "== decode ops and row invariance under DFLASH_ATTN_ROWS=0 (no row kernel: session 27's attention kernels)" | tee -a "$LOG"
  DFLASH_ATTN_ROWS=0 DFLASH_TEST_DEVICE=cuda /tmp/bin/decode_ops_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  DFLASH_ATTN_ROWS=0 DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "result|panicked" | tee -a "$LOG"
  echo "== row invariance on cuda (then under DFLASH_STREAM_GEMM=all: verify rows against AR steps)" | tee -a "$LOG"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_TREE_KEYS=position DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 a_tree_row 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  echo "== tree rows by position with the path table (DFLASH_ATTN_PATH_TABLE=1), then bit-exact with it on the tensor cores" | tee -a "$LOG"
  DFLASH_ATTN_PATH_TABLE=1 DFLASH_TREE_KEYS=position DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 a_tree_row 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_ATTN_PATH_TABLE=1 DFLASH_TREE_ATTN=mma DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  echo "== row invariance under the tiled streaming GEMM (DFLASH_STREAM_TILED=1, with and without DFLASH_STREAM_GEMM=all)" | tee -a "$LOG"
  DFLASH_STREAM_TILED=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 stream 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_STREAM_TILED=1 DFLASH_STREAM_GEMM=all DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 bit_exact 2>&1 | show "^test |result|panicked" | tee -a "$LOG"
  DFLASH_STREAM_TILED=1 DFLASH_STREAM_TILED_FROM=2 DFLASH_TEST_DEVICE=cuda /tmp/bin/row_invariance_device --test-threads 1 stream 2>&1 | show "result|panicked" | tee -a "$LOG"
  echo "== the hybrids' device step against the CPU host path (f32) and the GPU host path (bf16)" | tee -a "$LOG"
  DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "^test |result|panicked|differ" | tee -a "$LOG"
  DFLASH_CUDA_GRAPHS=0 DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ" | tee -a "$LOG"
  echo "== the same, and the hybrid reference fixtures, with the rule one lane a column (DFLASH_GDN_RULE_LANES=1)" | tee -a "$LOG"
  DFLASH_GDN_RULE_LANES=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ" | tee -a "$LOG"
  DFLASH_GDN_RULE_STAGE=1 DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ" | tee -a "$LOG"
  DFLASH_GDN_REPLAY=rule DFLASH_ATTN_VALUES=split DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ" | tee -a "$LOG"
  DFLASH_HYBRID_ATTN=mma DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ" | tee -a "$LOG"
  DFLASH_HYBRID_ATTN=mask DFLASH_TEST_DEVICE=cuda /tmp/bin/hybrid_device_step --test-threads 1 2>&1 | show "result|panicked|differ" | tee -a "$LOG"
  for dt in f32 bf16; do
    DFLASH_GDN_RULE_LANES=1 DFLASH_FIXTURES=$PWD/fixtures DFLASH_TEST_DEVICE=cuda DFLASH_TEST_DTYPE=$dt /tmp/bin/reference_fixtures \
      --test-threads 1 --skip smollm2 2>&1 | show "result|FAILED|panicked" | tee -a "$LOG"
  done
  for dt in f32 bf16; do
    echo "== reference fixtures on cuda $dt (fused decode path)" | tee -a "$LOG"
    DFLASH_FIXTURES=$PWD/fixtures DFLASH_TEST_DEVICE=cuda DFLASH_TEST_DTYPE=$dt /tmp/bin/reference_fixtures \
      --test-threads 1 --skip smollm2 2>&1 | show "result|FAILED|panicked" | tee -a "$LOG"
  done
fi
tag() {  # tag KEY=VALUE... < one JSON document > one tagged line appended to $J
  python3 -c 'import json,sys
d=json.load(sys.stdin)
for kv in sys.argv[1:]:
    k,v=kv.split("=",1); d[k]=v
print(json.dumps(d))' "$@" >> "$J"
}
for spec in $SHAPES; do
  IFS=: read -r shape dtype ctx <<< "$spec"
  for variant in $VARIANTS; do
    bin=$D dinplace="" fchunk="" fstage="" gfold="" wtiles="" rd64="" gheads="" finputs="" split="" bulkk="" trows="" bulk="" arows="" ablocks="" schunk="" tsplits="" wide="" pipe="" dwin="" tchunk="" hattn="" silu="" gvec="" dattn="" rule="" rstage="" replay="" avalues="" fewtiles="" stream="" few="" staging="" rebuild="" pdl="" merge="" prefetch="" addnorm="" topk="" gdn="" attn="" keys="" tiled="" path="" gdnproj="" hstep="" tfrom=""  # DFLASH_STREAM_GEMM, _STREAM_FEW_ROWS_MB, _ATTN_STAGING, _GRAPH_REBUILD, _PDL: empty = default
    case $variant in plain) fused=0 graphs=0;; fused) fused=1 graphs=0;; cublas) fused=1 graphs=1 stream=0;;
      exact) fused=1 graphs=1 stream=all;;
      tiled) fused=1 graphs=1 stream=all tiled=1;;
      tiledall) fused=1 graphs=1 stream=all tiled=1 tfrom=2;;
      nofew) fused=1 graphs=1 few=0;;
      scalar) fused=1 graphs=1 staging=scalar;;
      rebuilt) fused=1 graphs=1 rebuild=1;;
      pdl) fused=1 graphs=1 pdl=1;;
      tileprefetch) fused=1 graphs=1 prefetch=1;;
      attnnext) fused=1 graphs=1 prefetch=1;;
      addnorm) fused=1 graphs=1 addnorm=1;;
      topkone) fused=1 graphs=1 topk=0;;
      gdnoff) fused=1 graphs=1 gdn=0;;
      scalarattn) fused=1 graphs=1 attn=scalar;;
      rowkeys) fused=1 graphs=1 keys=row;;
      poskeys) fused=1 graphs=1 keys=position;;
      pdlearly) fused=1 graphs=1 pdl=early;;
      gdnsep) fused=1 graphs=1 gdnproj=separate;;
      hybridstep) fused=1 graphs=1 hstep=1;;
      hybridhost) fused=1 graphs=1 hstep=0;;
      rule4) fused=1 graphs=1 rule=4;;
      rule1) fused=1 graphs=1 rule=1;;
      rulestage) fused=1 graphs=1 rstage=1;;
      replaystaged) fused=1 graphs=1 replay=staged;;
      stagedboth) fused=1 graphs=1 rstage=1 replay=staged;;
      replayrule) fused=1 graphs=1 replay=rule;;
      replayprefetch) fused=1 graphs=1 replay=prefetch;;
      replayvec) fused=1 graphs=1 replay=vec;;
      unfusedinputs) fused=1 graphs=1 finputs=0;;
      unfusedheads) fused=1 graphs=1 gheads=0;;
      unfusedboth) fused=1 graphs=1 gheads=0 finputs=0;;
      splitvalues) fused=1 graphs=1 avalues=split;;
      treeattn1) fused=1 graphs=1 dattn=tree;;
      groupall) fused=1 graphs=1 gvec=100000;;
      siluepilogue) fused=1 graphs=1 silu=1;;
      hybridmma) fused=1 graphs=1 hattn=mma;;
      hybridmask) fused=1 graphs=1 hattn=mask;;
      groupvec*) fused=1 graphs=1 gvec=${variant#groupvec};;
      hostwindows) fused=1 graphs=1 dwin=0;;
      pipeline) fused=1 graphs=1 pipe=1;;
      wide) fused=1 graphs=1 wide=1;;
      wideexact) fused=1 graphs=1 stream=all wide=1;;
      exactnarrow) fused=1 graphs=1 stream=all wide=0;;
      treechunk*) fused=1 graphs=1 tchunk=${variant#treechunk};;
      rows0) fused=1 graphs=1 arows=0;;
      stepchunk*) fused=1 graphs=1 schunk=${variant#stepchunk};;
      topksplits*) fused=1 graphs=1 tsplits=${variant#topksplits};;
      exactrows0) fused=1 graphs=1 stream=all arows=0;;
      rows1) fused=1 graphs=1 arows=1;;
      rows2) fused=1 graphs=1 arows=2;;
      rows3) fused=1 graphs=1 arows=3;;
      bulk) fused=1 graphs=1 bulk=1;;
      bulks*) fused=1 graphs=1 bulk=s${variant#bulks};;
      bulkexact) fused=1 graphs=1 bulk=1 stream=all;;
      bulkdown) fused=1 graphs=1 bulkk=1;;
      treestream*) fused=1 graphs=1 trows=${variant#treestream};;
      exactmma) fused=1 graphs=1 stream=all attn=mma;;
      split) fused=1 graphs=1 stream=all split=1;;
      splitall) fused=1 graphs=1 stream=all split=2;;
      splitmma) fused=1 graphs=1 stream=all split=2 attn=mma;;
      splittrees) fused=1 graphs=1 split=1;;
      splitfast) fused=1 graphs=1 split=2;;
      exactnosplit) fused=1 graphs=1 stream=all split=0;;
      rowsb2) fused=1 graphs=1 arows=1 ablocks=2;;
      rows1c*) fused=1 graphs=1 arows=1 tchunk=${variant#rows1c};;
      rows2c*) fused=1 graphs=1 arows=2 tchunk=${variant#rows2c};;
      fewalltiles) fused=1 graphs=1 fewtiles=0;;
      pathtable) fused=1 graphs=1 keys=position path=1;;
      tiledpt) fused=1 graphs=1 stream=all tiled=1 attn=mma path=1;;
      exactwideall) fused=1 graphs=1 stream=all wtiles=0;;
      exactrowsd64) fused=1 graphs=1 stream=all arows=0;;
      rowsd64) fused=1 graphs=1 rd64=2;;
      rowsd64off) fused=1 graphs=1 rd64=0;;
      nofold) fused=1 graphs=1 gfold=0;;
      fold) fused=1 graphs=1 gfold=1;;
      foldglobal) fused=1 graphs=1 gfold=1 fstage=0;;
      foldchunk4) fused=1 graphs=1 gfold=1 fchunk=4;;
      prev) fused=1 graphs=1 bin=/tmp/bin/dflash-prev;;
      draftinplace) fused=1 graphs=1 dinplace=1;;
      *) fused=1 graphs=1;; esac
    echo "== dflash bench decode $shape $dtype context $ctx $variant" | tee -a "$LOG"
    DFLASH_DRAFT_ROWS_IN_PLACE=$dinplace DFLASH_GDN_FOLD_CHUNK=$fchunk DFLASH_GDN_FOLD_STAGE=$fstage DFLASH_GDN_FOLD=$gfold DFLASH_STREAM_WIDE_MIN_TILES=$wtiles DFLASH_ATTN_ROWS_D64=$rd64 DFLASH_GATED_HEADS=$gheads DFLASH_GDN_FUSED_INPUTS=$finputs DFLASH_STREAM_SPLIT=$split DFLASH_STREAM_BULK_LARGE_K=$bulkk DFLASH_STREAM_TREE_ROWS=$trows DFLASH_STREAM_BULK=$bulk DFLASH_TOPK_SPLITS=$tsplits DFLASH_STEP_CHUNK=$schunk DFLASH_ATTN_ROWS=$arows DFLASH_ATTN_ROWS_BLOCKS=$ablocks DFLASH_STREAM_WIDE=$wide DFLASH_ATTN_PIPELINE=$pipe DFLASH_DRAFT_STEP_WINDOWS=$dwin DFLASH_TREE_CHUNK=$tchunk DFLASH_HYBRID_ATTN=$hattn DFLASH_SILU_EPILOGUE=$silu DFLASH_GROUP_ATTN_VECTORS=$gvec DFLASH_DECODE_ATTN=$dattn DFLASH_ATTN_VALUES=$avalues DFLASH_GDN_REPLAY=$replay DFLASH_GDN_RULE_STAGE=$rstage DFLASH_STREAM_FEW_MIN_TILES=$fewtiles DFLASH_GDN_RULE_LANES=$rule DFLASH_STREAM_TILED_FROM=$tfrom DFLASH_HYBRID_STEP=$hstep DFLASH_GDN_IN_PROJ=$gdnproj DFLASH_ATTN_PATH_TABLE=$path DFLASH_STREAM_TILED=$tiled DFLASH_TREE_KEYS=$keys DFLASH_TREE_ATTN=$attn DFLASH_GDN_KERNELS=$gdn DFLASH_TOPK_SPLIT=$topk DFLASH_FUSED_ADD_NORM=$addnorm DFLASH_ATTN_PREFETCH=$prefetch DFLASH_ATTN_MERGE=$merge DFLASH_PDL=$pdl DFLASH_GRAPH_REBUILD=$rebuild DFLASH_ATTN_STAGING=$staging DFLASH_STREAM_FEW_ROWS_MB=$few DFLASH_STREAM_GEMM=$stream DFLASH_FUSED_DECODE=$fused DFLASH_CUDA_GRAPHS=$graphs timeout 300 $bin bench decode --shape "$shape" \
      --context "$ctx" --device cuda --dtype "$dtype" --rounds "$ROUNDS" --out /tmp/bd.json 2>>"$LOG" >/dev/null \
      && tag engine=dflash fused=$fused graphs=$graphs variant=$variant < /tmp/bd.json \
      && { grep -h "^step graphs" "$LOG" | tail -1 || true; } || echo "FAILED ($?)" | tee -a "$LOG"
  done
  if [ "${PEER:-1}" = 1 ]; then
    echo "== transformers $shape $dtype context $ctx" | tee -a "$LOG"
    timeout 400 python3 scripts/peer_decode.py --shape "$shape" --context "$ctx" --dtype "$dtype" \
      --rounds "$ROUNDS" --out /tmp/peer.json 2>>"$LOG" >/dev/null \
      && tag engine=transformers < /tmp/peer.json || echo "FAILED ($?)" | tee -a "$LOG"
  fi
done
python3 - "$J" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def f(x):
    return "-" if x is None else f"{x:.3f}"
print(f"{'shape':14} {'dt':4} {'ctx':>5} {'engine':13} {'floor':>7} {'AR':>7} {'chain16':>8} {'tree64':>8} {'tree256':>8} {'draft':>7} {'tree-b':>7} {'sampled':>8} {'loopAR':>7} {'loopDF':>7} {'loopDT':>7} {'commit':>7} {'tcommit':>7}")
for r in rows:
    v = r.get("verify_ms") or {}
    lp = r.get("loop_step_ms") or {}
    eng = r["engine"] + ("" if r["engine"] != "dflash" else "+" + r.get("variant", "?"))
    print(f"{r.get('shape','?'):14} {r.get('dtype','?'):4} {r.get('context',0):>5} {eng:13} {f(r.get('floor_ms')):>7} "
          f"{f(r.get('ar_step_ms')):>7} {f(v.get('chain16')):>8} {f(v.get('tree64')):>8} {f(v.get('tree256')):>8} "
          f"{f(r.get('draft_block_ms')):>7} {f(r.get('tree_build_ms')):>7} {f(r.get('sampled_step_ms')):>8} "
          f"{f(lp.get('ar')):>7} {f(lp.get('dflash')):>7} {f(lp.get('ddtree64')):>7} "
          f"{f(r.get('state_commit_ms')):>7} {f(r.get('tree_commit_ms')):>7}")
PY
