"""FP8 quantization (issue 26): a linear layer's quantization is a property of the layer, as in vLLM.

  config.py   `checkpoint_quantization(quantization_config, requested)`: the typed description of a
              checkpoint's format (block-wise "fp8", compressed-tensors float-quantized, fbgemm_fp8) or of
              `--quantization fp8`; the one-line refusal of everything else (`UnsupportedQuantization`)
  methods.py  `linear_method(config, module_name)`: the method object of one linear (None: unquantized);
              it loads the linear's tensors (`Fp8Linear`), dequantizes them, and applies the GEMM
  fp8.py      plain-torch quantize/dequantize, `Fp8Linear`, and the emulation the kernels are checked against
  kernels.py  `fp8_linear`: Triton activation quantization, cuBLASLt `_scaled_mm`, the Triton block GEMM
  loader.py   the CPU path: the checkpoint's weights dequantized into a plain transformers model

How the loader calls it (models.py today, the model-family loader later):

    refuse_gguf(name_or_path)                                  # before transformers reads the file
    quant = checkpoint_quantization(getattr(config, "quantization_config", None), requested=quantization)
    if quant is None: ...                                      # bf16/fp16/fp32 as before
    else: model = load_dequantized_model(name_or_path, config, quant, dtype)   # CPU, and CUDA until the
                                                               # decoder takes FP8 linears

`requested` is the future `--quantization fp8` value (`QUANTIZATIONS`); both raise `UnsupportedQuantization`,
which the loader turns into its one-line `ModelLoadError`.

How the owned decoder will run FP8 on CUDA: for each linear module name, `method = linear_method(quant, name)`;
where it is not None, `layer = method.load(tensors, name).to(device)` replaces the dense weight (q/k/v and
gate/up fused with `Fp8Linear.concat`, as fused_weights.py fuses dense ones), and the decoder's
`linear(x, weight, bias)` becomes `fp8_linear(x, layer, bias)` for those layers. The per-token and
per-token-group quantizations are separate kernels today; fusing them into the preceding RMSNorm/SiLU·mul
epilogues is the next step on the H200.

`--kv-cache-dtype fp8` is not here: it belongs to the attention kernels and the KV cache.
"""

from __future__ import annotations

from .config import (
    CBQ_RUNS,
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
    refuse_gguf,
)
from .fp8 import Fp8Linear, dequantize_weight, fp8_linear_emulated
from .kernels import fp8_linear
from .loader import dequantize_state_dict, load_dequantized_model
from .methods import Fp8CheckpointError, Fp8LinearMethod, linear_method

__all__ = [
    "CBQ_RUNS",
    "QUANTIZATIONS",
    "ActivationScale",
    "BlockFp8Config",
    "CompressedTensorsFp8Config",
    "FbgemmFp8Config",
    "Fp8CheckpointError",
    "Fp8Config",
    "Fp8Linear",
    "Fp8LinearMethod",
    "Fp8Scheme",
    "OnlineFp8Config",
    "UnsupportedQuantization",
    "WeightScale",
    "checkpoint_quantization",
    "dequantize_state_dict",
    "dequantize_weight",
    "fp8_linear",
    "fp8_linear_emulated",
    "linear_method",
    "load_dequantized_model",
    "refuse_gguf",
]
