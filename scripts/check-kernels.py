#!/usr/bin/env python3
"""Compiles the NVRTC kernel sources (crates/dflash-core/src/*.cu) with libnvrtc, as the CUDA binary
does at run time, so a compile error shows up here instead of on the GPU machine. Needs the CUDA 13
libraries of scripts/setup-cuda-build.sh (no GPU). Usage: scripts/check-kernels.py [LIBNVRTC]"""
import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
nvrtc = sys.argv[1] if len(sys.argv) > 1 else "/opt/cuda13/lib64/libnvrtc.so.13"
# NVRTC loads its builtins library by name at compile time: load it first, from the same folder
for builtins in sorted(glob.glob(os.path.join(os.path.dirname(nvrtc), "libnvrtc-builtins.so.*"))):
    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(nvrtc)


def compile_source(src, name, opts=()):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None):
        sys.exit(f"{name}: nvrtcCreateProgram failed")
    argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    result = lib.nvrtcCompileProgram(prog, len(opts), argv)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx))
    text = ctypes.create_string_buffer(ptx.value)
    if result == 0:
        lib.nvrtcGetPTX(prog, text)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    status = "ok" if result == 0 else f"FAILED ({result})"
    print(f"{name}: {status}, {ptx.value} bytes of PTX")
    if log.value.strip():
        print(log.value.decode())
    if result == 0 and PTXAS:  # assemble for the H100/H200: inline PTX errors, spills
        return assemble(text.value, name)
    return result == 0


PTXAS = shutil.which("ptxas") or ("/opt/cuda13/bin/ptxas" if os.path.exists("/opt/cuda13/bin/ptxas") else None)


def assemble(ptx, name):
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        open(src, "wb").write(ptx)
        r = subprocess.run([PTXAS, "-arch=sm_90", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{name}: ptxas FAILED\n{r.stderr}")
        return False
    spills = [l for l in r.stderr.splitlines() if "spill" in l and not " 0 bytes spill stores, 0 bytes spill loads" in l]
    if os.environ.get("PTXAS_VERBOSE"):
        print(r.stderr)
    for l in spills:
        print(f"  {name}: {l.strip()}")
    return True


ok = True
prelude = open(os.path.join(root, "crates/dflash-core/src/pdl.cuh")).read()
# files compiled as part of another module (step_cuda.rs: SOURCE), appended to it here too
APPENDED = {"step_kernels.cu": ["tree_attn_mma.cu", "tree_attn_rows.cu"], "stream_gemm.cu": ["stream_gemm_tiled.cu"],
            "decode_kernels.cu": ["decode_layer_kernels.cu"],
            "gated_delta_kernels.cu": ["gated_delta_layer_kernels.cu"]}
appended = {f for files in APPENDED.values() for f in files}
# modules of their own compiled after another file's source (stream_gemm_bulk.rs: stream_gemm.cu
# first), for compute 9.0 (the copy engine's bulk copies)
PREPENDED = {"stream_gemm_bulk.cu": "stream_gemm.cu"}
for path in sorted(glob.glob(os.path.join(root, "crates/dflash-core/src/*.cu"))):
    src = open(path).read()
    base = os.path.basename(path)
    if base in appended:
        continue
    for extra in APPENDED.get(base, []):
        src += open(os.path.join(os.path.dirname(path), extra)).read()
    if base in PREPENDED:
        src = prelude + "#define SG_HELPERS_ONLY\n" + open(os.path.join(os.path.dirname(path), PREPENDED[base])).read() + src
        ok &= compile_source(src, base, ["--gpu-architecture=compute_90"])
        ok &= compile_source(src, f"{base} (PDL)", ["--gpu-architecture=compute_90", "-DDFLASH_PDL"])
        continue
    arch = ["--gpu-architecture=compute_80"] if "mma.sync" in src else []
    if "PDL_ENTRY" in src:  # decode modules: the PDL prelude in front (crate::pdl::with_prelude)
        src = prelude + src
    if "#define DK" in src:  # compiled once per key head dim at run time
        for dk in (16, 64, 128, 256):
            ok &= compile_source(f"#define DK {dk}\n{src}", f"{base} (DK {dk})")
            if "RULE_LANES4" in src:  # the rule's four-lanes-a-column variant (DFLASH_GDN_RULE_LANES=4)
                ok &= compile_source(f"#define DK {dk}\n#define RULE_LANES4\n{src}", f"{base} (DK {dk}, 4 lanes)")
                for chunk in (4,):  # the fold's staging chunk (DFLASH_GDN_FOLD_CHUNK=4; 8 by default)
                    ok &= compile_source(f"#define DK {dk}\n#define RULE_LANES4\n#define FOLD_CHUNK {chunk}\n{src}",
                                         f"{base} (DK {dk}, 4 lanes, fold chunk {chunk})")
                ok &= compile_source(f"#define DK {dk}\n#define RULE_LANES4\n#define RULE_STAGED\n{src}",
                                     f"{base} (DK {dk}, 4 lanes, staged)")
                ok &= compile_source(f"#define DK {dk}\n#define RULE_LANES4\n#define RULE_STAGED\n#define RULE_REPLAY\n{src}",
                                     f"{base} (DK {dk}, 4 lanes, staged for replays)")
                ok &= compile_source(f"#define DK {dk}\n#define RULE_LANES4\n#define RULE_STAGED\n#define RULE_REPLAY\n#define RULE_PREFETCH\n{src}",
                                     f"{base} (DK {dk}, 4 lanes, staged for replays, loads batched)")
                ok &= compile_source(f"#define DK {dk}\n#define RULE_LANES4\n#define RULE_STAGED\n#define RULE_REPLAY\n#define RULE_KVEC\n{src}",
                                     f"{base} (DK {dk}, 4 lanes, staged for replays, keys by lane group)")
    elif "HD" in src:  # compiled once per head dim at run time
        for hd in (64, 128):
            ok &= compile_source(f"#define HD {hd}\n{src}", f"{base} (HD {hd})")
    elif "mma.sync" in src:  # tensor-core kernels: compiled for compute_80 at run time
        ok &= compile_source(src, base, ["--gpu-architecture=compute_80"])
    else:
        ok &= compile_source(src, base, arch)
    if "DFLASH_PATH_TABLE" in src:  # the opt-in tree path table (DFLASH_ATTN_PATH_TABLE=1)
        ok &= compile_source(src, f"{base} (path table)", arch + ["-DDFLASH_PATH_TABLE"])
    if "DFLASH_ATTN_PIPELINE" in src:  # the opt-in tile pipeline (DFLASH_ATTN_PIPELINE=1)
        ok &= compile_source(src, f"{base} (tile pipeline)", arch + ["-DDFLASH_ATTN_PIPELINE"])
    if "PDL_ENTRY" in src:  # and as DFLASH_PDL=1 / early compile them (compute 9.0)
        pdl = ["--gpu-architecture=compute_90", "-DDFLASH_PDL"]
        ok &= compile_source(src, f"{base} (PDL)", pdl)
        ok &= compile_source(src, f"{base} (PDL early)", pdl + ["-DDFLASH_PDL_EARLY"])
sys.exit(0 if ok else 1)
