"""Quantized weights: FP8 (issue 26) and INT4 weight-only (issue 46); a linear layer's quantization is a property
of the layer, as in vLLM.

  base.py     `QuantConfig` (every format's config: `scheme_for(module_name)`), the module-name rules the formats
              share, `FormatRefused` and `QuantCheckpointError`
  int4/       the INT4 weight-only formats, one module each (GPTQ, AWQ gemm, compressed-tensors pack-quantized),
              methods of the protocol below read by slice into one form (`int4/packed.py` `Int4Linear`);
              dequantized after loading, or kept packed on CUDA

  config.py   `checkpoint_quantization(quantization_config, requested)`: the typed description of a
              checkpoint's format (block-wise "fp8", compressed-tensors float-quantized, fbgemm_fp8, the INT4
              formats of int4/) or of
              `--quantization fp8`; the one-line refusal of everything else (`UnsupportedQuantization`);
              `has_mxfp4_experts(config)`: gpt-oss's release, whose MXFP4 experts the loader dequantizes
  protocol.py the one linear-method protocol (`LinearMethod`: create_weights, load_tensor,
              process_after_loading, apply), how each parameter follows the layer's split (`ParamSplit`), the
              unquantized method and `load_parameter`, the one copy of a checkpoint slice into a parameter
  methods.py  the FP8 formats as methods (block-wise, compressed-tensors, fbgemm, `--quantization fp8`, and
              dequantized-at-load); `LinearMethods.method_for(prefix)`, the config object that hands each
              parallel linear its method; `linear_method(config, module_name)`: a format's method for one linear
              (None: unquantized). Adding a format: one module, one `_METHODS` line, its tests.
  fp8.py      plain-torch quantize/dequantize, `Fp8Linear`, and the emulation the kernels are checked against
  kernels.py  `fp8_linear`: Triton activation quantization, cuBLASLt `_scaled_mm`, the Triton block GEMM
  small_step.py  the small decode steps' FP8 GEMM (<= 32 rows): x quantized per token inside one PDL kernel,
              act·mul in the gate/up variant's epilogue, rotary + the KV write in the QKV variant's; the
              decoder's path with decode_gemm "triton"
  models/quant_loader.py the tests' reference: a quantized checkpoint read whole into a plain transformers model,
              every weight dequantized (`load_dequantized_model`); the one loader (models/shard_build.py) reads
              checkpoints by slice, each linear through its method, FP8 kept on sm89+ CUDA or dequantized
  linear.py   `Fp8LinearModule` (a quantized linear kept in FP8 with its scales; its forward is the method's
              apply), `Fp8Weight` (what the owned decoder multiplies), `quantize_linears` (--quantization
              fp8 on a model in memory), `keeps_fp8(device)` (sm89+ CUDA keeps FP8, elsewhere dequantized)

How it is wired: models/loader.py refuses GGUF and other quantizations in one line (`refuse_gguf`,
`checkpoint_quantization`) and reads a quantized checkpoint by slice, each linear through its method
(`--quantization fp8` quantizes each linear as it is read). On sm89+ CUDA each quantized linear is an `Fp8LinearModule`;
fused_weights.py stacks q/k/v and gate/up FP8 rows with their scales (`Fp8Linear.concat`) into an `Fp8Weight`,
and decoder.py multiplies it with `Fp8Weight.apply` (kernels.fp8_linear) where a plain weight takes F.linear.
Elsewhere the weights are dequantized to the compute dtype. On the large-step path the per-token and
per-token-group quantizations are separate kernels; small steps with decode_gemm "triton" quantize inside the
GEMM (small_step.py).

Under `--tensor-parallel-size` (dense models) the parallel layers read their slices of the FP8 weights with those
slices' scales through their methods, or quantize their slices with one process's per-channel scales
(`OnlineFp8LinearMethod`, the row's absmax over the ranks).

On the GPU, INT4 linears kept packed run `int4/linear.py` (`Int4LinearModule`, `Int4Weight`, `int4_linear`:
kernels/w4a16.py's W4A16 GEMMs on CUDA, the dequantizing twin elsewhere); `bench engine --precision int4` packs a
preset's linears that way, and a checkpoint's stay packed on CUDA bf16/fp16 where CBQ_INT4_PACKED=1
(`LinearMethods(keep_int4=...)`).

`--kv-cache-dtype fp8` is not here: it belongs to the attention (attention.py) and the KV cache (kv_cache.py).
"""

from __future__ import annotations

from .base import QuantCheckpointError, QuantConfig
from .config import (
    CBQ_RUNS,
    MOE_RUNS,
    QUANTIZATIONS,
    ActivationScale,
    BlockFp8Config,
    CompressedTensorsFp8Config,
    FbgemmFp8Config,
    Fp8Config,
    Fp8Scheme,
    OnlineFp8Config,
    UnsupportedQuantization,
    WeightScale,
    checkpoint_quantization,
    has_mxfp4_experts,
    moe_quantization,
    refuse_gguf,
)
from .fp8 import Fp8Linear, dequantize_weight, fp8_linear_emulated
from .kernels import fp8_linear
from .methods import Fp8CheckpointError, Fp8LinearMethod, LinearMethods, linear_method
from .protocol import UNQUANTIZED, LinearMethod, LinearSizes, ParamSplit

__all__ = [
    "CBQ_RUNS",
    "MOE_RUNS",
    "QUANTIZATIONS",
    "ActivationScale",
    "BlockFp8Config",
    "CompressedTensorsFp8Config",
    "FbgemmFp8Config",
    "Fp8CheckpointError",
    "Fp8Config",
    "Fp8Linear",
    "Fp8LinearMethod",
    "LinearMethod",
    "LinearMethods",
    "LinearSizes",
    "ParamSplit",
    "UNQUANTIZED",
    "Fp8Scheme",
    "OnlineFp8Config",
    "QuantCheckpointError",
    "QuantConfig",
    "UnsupportedQuantization",
    "WeightScale",
    "checkpoint_quantization",
    "dequantize_weight",
    "fp8_linear",
    "fp8_linear_emulated",
    "has_mxfp4_experts",
    "linear_method",
    "moe_quantization",
    "refuse_gguf",
]
