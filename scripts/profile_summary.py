#!/usr/bin/env python3
"""Summarises an ncu CSV of scripts/gpu-profile-step.sh: a device step starts with its
`tree_ancestors` launch, so the kernels from one such launch to the next are one step (the AR
steps come first after the prefill); prints that step's kernels grouped by name: launches, GPU time,
DRAM bytes read, achieved bandwidth, share of the step. ncu runs kernels one at a time with cold
caches and lets the clocks idle between them, so small kernels read slower than inside a graph.
Usage: profile_summary.py FILE.csv [STEP_INDEX (default 2: the second AR step)]"""
import csv
import sys
from collections import OrderedDict


def rows(path):
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:  # ncu wrote no kernel table (it failed, or profiled nothing): say what it wrote
        print(f"no kernel table in {path}; its last lines:")
        print("\n".join(lines[-8:]))
        sys.exit(1)
    kernels = OrderedDict()
    for r in csv.DictReader(lines[start:]):
        k = kernels.setdefault(r["ID"], {"name": r["Kernel Name"], "grid": r.get("Grid Size", ""),
                                         "block": r.get("Block Size", "")})
        v = float(r["Metric Value"].replace(",", "") or 0)
        unit = r["Metric Unit"]
        if r["Metric Name"] == "gpu__time_duration.sum":
            k["us"] = v / 1000 if unit in ("ns", "nsecond") else v if unit in ("us", "usecond") else v * 1000
        elif r["Metric Name"] == "dram__bytes_read.sum":
            scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1)
            k["bytes"] = v * scale
    return list(kernels.values())


def main():
    ks = rows(sys.argv[1])
    step = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    starts = [i for i, k in enumerate(ks) if k["name"].startswith("tree_ancestors")]
    print(f"{len(ks)} kernels profiled; device steps start at {starts[:8]}")
    if not starts:  # an op without a device step (PROFILE_OP=draft_block): the whole trace
        print("no device step in the trace: the whole trace (every profiled run of the op)")
        step, seg = 0, ks
    elif len(starts) == 1:  # one op's range (PROFILE_OP) cut by the launch count: to the end
        step = 1
        seg = ks[starts[0]:]
    else:  # the last whole step when the trace holds fewer than asked
        step = min(step, len(starts) - 1)
        seg = ks[starts[step - 1]: starts[step]]
    total = sum(k.get("us", 0) for k in seg)
    tb = sum(k.get("bytes", 0) for k in seg)
    print(f"step {step}: {len(seg)} kernels, {total:.1f} us of kernel time, {tb / 1e9:.3f} GB read "
          f"({tb / (total * 1e-6) / 1e12 if total else 0:.2f} TB/s over kernel time)")
    groups = OrderedDict()
    for k in seg:
        g = groups.setdefault((k["name"][:60], k["grid"], k["block"]), [0, 0.0, 0.0])
        g[0] += 1
        g[1] += k.get("us", 0)
        g[2] += k.get("bytes", 0)
    print(f"{'kernel':60} {'grid':>14} {'block':>12} {'n':>4} {'us':>9} {'us/launch':>9} {'GB/s':>7} {'share':>6}")
    for (name, grid, block), (n, us, b) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:60} {grid:>14} {block:>12} {n:>4} {us:9.1f} {us / n:9.2f} {b / (us * 1e-6) / 1e9 if us else 0:7.0f} "
              f"{us / total * 100:5.1f}%")


if __name__ == "__main__":
    main()
