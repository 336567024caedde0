#!/usr/bin/env python3
"""Writes model.safetensors.index.json for a directory of safetensors shards (the GPU machine returns
at most 8 files, so a collected drafter may arrive without its index). Usage: drafter_index.py DIR"""
import json
import os
import struct
import sys

d = sys.argv[1]
weight_map, total = {}, 0
for f in sorted(os.listdir(d)):
    if not f.endswith(".safetensors"):
        continue
    with open(os.path.join(d, f), "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    for name, t in header.items():
        if name == "__metadata__":
            continue
        weight_map[name] = f
        total += t["data_offsets"][1] - t["data_offsets"][0]
if not weight_map:
    sys.exit(f"{d}: no safetensors shards")
tmp = os.path.join(d, "model.safetensors.index.json.tmp")
with open(tmp, "w") as fh:
    json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
os.replace(tmp, os.path.join(d, "model.safetensors.index.json"))
print(f"{len(weight_map)} tensors, {total} bytes")
