// More shapes of the wide kernel of crates/dflash-core/src/stream_gemm.cu (issue 18: bit-exact
// tree verifies at the speed of the default path), kept out of the shipped source until one is
// measured better than the shipped n1t2 (NVRTC compiles the shipped file at run time: every
// variant lengthens that). scripts/probe-stream-gemm.py (WIDE=1) compiles stream_gemm.cu followed
// by this file, checks every row against the grouped narrow kernel bit for bit and times them.
STREAM_GEMM_WIDE(1, 4)
STREAM_GEMM_WIDE(2, 2)
STREAM_GEMM_WIDE(2, 4)
