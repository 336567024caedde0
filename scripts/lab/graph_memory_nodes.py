#!/usr/bin/env python3
"""Do allocation and free nodes cost time in a replayed CUDA graph? (issue 15: a captured decode
step holds an allocation and a free node around nearly every kernel, because candle allocates each
op's output with cuMemAllocAsync; docs/benchmarks.md session 14.)

Captures the same chain of N small dependent kernels twice with CuPy: once with a pool whose blocks
are reused without stream-ordered allocation (no memory nodes), once with the stream-ordered pool
(cudaMallocAsync: one allocation and one free node per kernel, like our steps), and times graph
replays of each. Prints µs per kernel for both. Usage (GPU machine): python3 graph_memory_nodes.py"""
import cupy as cp

N = 300
REPLAYS = 50


def chain(x):
    y = x
    for _ in range(N):
        y = y * 1.0001 + 1.0  # fused by CuPy into one elementwise kernel; allocates its output
    return y


def timed(pool_name, malloc):
    cp.cuda.set_allocator(malloc)
    x = cp.zeros(4096, dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        chain(x)
        chain(x)
    s.synchronize()
    s.begin_capture()
    with s:
        y = chain(x)
    g = s.end_capture()
    g.upload(s)
    with s:
        for _ in range(3):
            g.launch(s)
    s.synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(s)
    for _ in range(REPLAYS):
        g.launch(s)
    stop.record(s)
    stop.synchronize()
    us = cp.cuda.get_elapsed_time(start, stop) * 1000 / REPLAYS
    print(f"{pool_name:28} {us:9.1f} us a replay, {us / N:6.2f} us a kernel", flush=True)
    del y
    return us


def main():
    try:
        a = timed("pool (no memory nodes)", cp.cuda.MemoryPool().malloc)
        b = timed("cudaMallocAsync (nodes)", cp.cuda.MemoryAsyncPool().malloc)
        print(f"memory nodes add {(b - a) / N:.2f} us a kernel ({b / a:.2f}x)")
    except Exception as e:  # a lab probe: say what failed, never hide it
        print(f"graph memory-node probe failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
