"""Triton kernels of the CUDA path, each with a torch twin or reference elsewhere that the CPU runs. Owns nothing.

  common       HAVE_TRITON, block-size helpers, dot precision (shared by every kernel module)
  attention    paged KV write, split-K decode attention, varlen prefill attention
  fused        the owned decoder's element-wise kernels (add+RMSNorm, SiLU·mul, q/k norm + rotary + KV write)
  decode_gemm  weight GEMMs of small decode steps, with SiLU·mul or rotary + KV write in their epilogues
  w4a16        W4A16 GEMMs: packed INT4 weights dequantized in registers (small steps split over K, PDL; large
               steps tiled); the twin is quant/int4/linear.py's
  pdl          programmatic dependent launch: availability and the in-kernel handshake
"""
