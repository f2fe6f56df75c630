"""Which expert method (protocol.py) a layer of experts takes: read from the same config object that hands each
linear its method (quant/methods.py `LinearMethods`: the checkpoint's quantization_config and what the device
keeps), by the experts' prefix. Owns nothing.

Adding an expert format: its module with its `ExpertMethod`, and one line in `_EXPERT_METHODS` (the format's config
type -> its method, built from the linear method of the layer's first expert).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checkpoint import Checkpoint
from ..quant.base import QuantConfig
from ..quant.config import BlockFp8Config, CompressedTensorsFp8Config, FbgemmFp8Config
from ..quant.methods import Fp8LinearMethod, LinearMethods, linear_method
from .fp8 import Fp8ExpertMethod, supported_scheme
from .mxfp4 import Mxfp4ExpertMethod
from .protocol import UNQUANTIZED_EXPERTS, DequantizedExperts, ExpertMethod

# One line a format kept as it ships: its config's type -> its expert method (given its experts' linear method).
_EXPERT_METHODS: dict[type[QuantConfig], Callable[[Fp8LinearMethod], ExpertMethod]] = {
    BlockFp8Config: Fp8ExpertMethod,
    CompressedTensorsFp8Config: Fp8ExpertMethod,
    FbgemmFp8Config: Fp8ExpertMethod,
}


def expert_method_for(
    methods: LinearMethods, experts: str, source: Checkpoint, dtype: torch.dtype, device: torch.device | str,
    kernel_layout: bool = True,
) -> ExpertMethod:  # fmt: skip
    """The method of the layer of experts at checkpoint prefix `experts` (e.g. "model.layers.1.mlp.experts"):
    gpt-oss's MXFP4 where the checkpoint holds it; a quantized checkpoint's experts kept as shipped where `methods`
    keeps FP8 experts and the grouped GEMMs compute their scheme (its first expert's gate), else dequantized to
    `dtype`; else unquantized (`--quantization fp8` quantizes them after loading: fp8_experts.py). `kernel_layout`
    False: experts that are never kept FP8 (gpt-oss's biased ones)."""
    if Mxfp4ExpertMethod.stored(source, experts):
        return Mxfp4ExpertMethod(dtype, device)
    quant = methods.quant
    if quant is None or not quant.is_serialized:
        return UNQUANTIZED_EXPERTS
    linear = linear_method(quant, f"{experts}.0.gate_proj")
    make = _EXPERT_METHODS.get(type(quant))
    if (
        methods.keep_fp8_experts
        and kernel_layout
        and make is not None
        and isinstance(linear, Fp8LinearMethod)
    ):
        if supported_scheme(linear.scheme) is not None:
            return make(linear)
    return DequantizedExperts(quant, dtype)
