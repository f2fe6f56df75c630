"""INT4 weight-only (W4A16) checkpoints: each release layout read into one in-memory form (`packed.Int4Linear`).

  packed.py              `Int4Linear` (qweight int32 [N, K / 8], scales, zeros, group size, act-order perm):
                         packing, unpacking, dequantization, round-to-nearest quantization
  method.py              what the formats share: `Int4Scheme`, the `Int4Config` base, `Int4LinearMethod` (the
                         protocol's method: each format's tensors by slice, then dequantized or kept packed),
                         the unpacking of 32-bit words and act-order's g_idx as a column permutation
  compressed_tensors.py  compressed-tensors "pack-quantized" (llm-compressor W4A16): config and method
  gptq.py                GPTQ (gptq / gptq_v2 checkpoint formats, desc_act or not): config and method
  awq.py                 AWQ's GEMM layout: config and method
  linear.py              the packed form on the GPU: `int4_linear` (kernels/w4a16.py on CUDA, the twin elsewhere),
                         `Int4LinearModule`, `Int4Weight` (the owned decoder's), `quantize_linears` (round-to-nearest)

A format is one module: its typed config (parsed from quantization_config by quant/config.py, answering
`scheme_for(module_name)`) and its method (its tensors' table and `to_int4`; one line in quant/methods.py's
registry).
"""

from .packed import Int4Linear, dequantize, pack_int4, quantize_rtn, unpack_int4

__all__ = ["Int4Linear", "dequantize", "pack_int4", "quantize_rtn", "unpack_int4"]
