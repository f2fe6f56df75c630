"""Which expert method (protocol.py) a layer of experts takes: read from the same config object that hands each
linear its method (quant/methods.py `LinearMethods`: the checkpoint's quantization_config and what the device
keeps), by the experts' prefix. Owns nothing.

Adding an expert format: its module with its `ExpertMethod`, and one line in `_EXPERT_METHODS` (the format's config
type -> its method, built from the linear method of the layer's first expert) or, for a format that only the
experts' tensors name, in `_STORED_EXPERT_METHODS`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checkpoint import Checkpoint
from ..quant.base import QuantConfig
from ..quant.config import BlockFp8Config, CompressedTensorsFp8Config, FbgemmFp8Config, Fp8Config
from ..quant.methods import Fp8LinearMethod, LinearMethods, fp8_linear_method
from .fp8 import Fp8ExpertFormat, Fp8ExpertMethod, OnlineFp8ExpertMethod, supported_scheme
from .mxfp4 import Mxfp4ExpertMethod
from .protocol import UNQUANTIZED_EXPERTS, DequantizedExperts, ExpertMethod

# One line a format kept as it ships: its config's type -> its expert method (given its experts' linear method).
_EXPERT_METHODS: dict[type[QuantConfig], Callable[[Fp8LinearMethod], ExpertMethod]] = {
    BlockFp8Config: Fp8ExpertMethod,
    CompressedTensorsFp8Config: Fp8ExpertMethod,
    FbgemmFp8Config: Fp8ExpertMethod,
}
# One line a format that only the experts' tensors name (its config quantizes no linear cbq reads): its method,
# which says whether a layer's tensors are in it (`stored`) and is built for the model dtype and the target device.
_STORED_EXPERT_METHODS: tuple[type[Mxfp4ExpertMethod], ...] = (Mxfp4ExpertMethod,)


def expert_method_for(
    methods: LinearMethods, experts: str, source: Checkpoint, dtype: torch.dtype, device: torch.device | str,
    kernel_layout: bool = True,
) -> ExpertMethod:  # fmt: skip
    """The method of the layer of experts at checkpoint prefix `experts` (e.g. "model.layers.1.mlp.experts"):
    a format its tensors name (gpt-oss's MXFP4); a quantized checkpoint's experts kept as shipped where `methods`
    keeps FP8 experts and `kept_fp8_format` gives their format, else dequantized to `dtype`; `--quantization fp8`
    with FP8 experts kept: read unquantized, then quantized per channel (`OnlineFp8ExpertMethod`); else unquantized."""
    stored = next((m for m in _STORED_EXPERT_METHODS if m.stored(source, experts)), None)
    if stored is not None:
        return stored(dtype, device)
    quant = methods.quant
    online = quant is not None and not quant.is_serialized
    if online and methods.keep_fp8_experts and kept_fp8_format(quant, experts, kernel_layout) is not None:
        return OnlineFp8ExpertMethod()  # `--quantization fp8`: quantized per channel once the layer is read
    if quant is None or not quant.is_serialized:
        return UNQUANTIZED_EXPERTS
    if methods.keep_fp8_experts and kept_fp8_format(quant, experts, kernel_layout) is not None:
        linear = fp8_linear_method(quant, f"{experts}.0.gate_proj")
        assert linear is not None, "kept_fp8_format found it quantized"
        return _EXPERT_METHODS[type(quant)](linear)
    return DequantizedExperts(quant, dtype)


def kept_fp8_format(
    quant: QuantConfig | None, experts: str, kernel_layout: bool = True
) -> Fp8ExpertFormat | None:
    """The format the experts at `experts` are kept in on FP8 tensor cores (None: they run in the model dtype): a
    checkpoint's own, as its first expert's gate is quantized, where a line above names its format and the grouped
    GEMMs compute its scheme (`supported_scheme`); `--quantization fp8`'s per-channel one. `kernel_layout` False:
    experts never kept FP8 (gpt-oss's biased ones, not transformers' stacked [E, 2I, H]); INT4 experts neither."""
    if not isinstance(quant, Fp8Config) or not kernel_layout:
        return None
    if not quant.is_serialized:
        return Fp8ExpertFormat()
    if type(quant) not in _EXPERT_METHODS:
        return None
    return supported_scheme(quant.scheme_for(f"{experts}.0.gate_proj"))
