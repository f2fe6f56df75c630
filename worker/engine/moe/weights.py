"""An MoE layer's weights, stacked. Owns the stacked tensors.

Every family ends up in one layout, the one the kernels read (`nn.Linear`'s [out, in] per expert):
  experts.gate_up  [E, 2I, H]  rows 0..I-1 are the gate projection, rows I..2I-1 the up projection
  experts.down     [E, H, I]
  biases           [E, 2I] and [E, H] (gpt-oss only), split the same way
FP8 experts (`ExpertWeights.fp8`, CUDA only: fp8.py) keep the same layout in float8_e4m3fn with their scales beside.
No per-expert modules, no fp32 copy: the stacked tensors are allocated once in the model dtype on the device
and each expert's slice is copied (or dequantized) into place, so peak memory is the stack plus one expert.

They are read from a checkpoint (any layout, any expert format) by loader.py, through the layer's expert method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.fp8 import FP8_DTYPE
from .fp8 import ExpertFp8Scales
from .spec import MoeSpec


@dataclass(frozen=True)
class ExpertWeights:
    """The routed experts of one layer, the one owner of their tensors (the decoder holds views of the model's)."""

    gate_up: torch.Tensor  # [E, 2I, H]: [gate; up]
    down: torch.Tensor  # [E, H, I]
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, H]
    # FP8 experts: gate_up and down are float8_e4m3fn and these are their scales (fp8.py); None: the model dtype
    fp8: ExpertFp8Scales | None = None

    def check(self, num_experts: int, hidden: int, inter: int) -> None:
        """The matrices' dtypes against `fp8` (and the scales' shapes); raises ValueError naming the tensor."""
        for name, tensor in (("gate_up", self.gate_up), ("down", self.down)):
            if (tensor.dtype == FP8_DTYPE) != (self.fp8 is not None):
                with_scales = "with" if self.fp8 is not None else "without"
                raise ValueError(f"MoE weight experts.{name} is {tensor.dtype} {with_scales} FP8 scales")
        if self.fp8 is not None:
            self.fp8.check(num_experts, hidden, inter)


@dataclass(frozen=True)
class SharedExpertWeights:
    gate_up: torch.Tensor  # [2 * Is, H]: [gate; up]
    down: torch.Tensor  # [H, Is]
    gate: torch.Tensor | None = None  # [1, H]: sigmoid(x @ gate^T) scales the output


@dataclass(frozen=True)
class MoeLayerWeights:
    router_weight: torch.Tensor  # [E, H]
    router_bias: torch.Tensor | None
    experts: ExpertWeights
    shared: SharedExpertWeights | None = None
    # [E], added to the sigmoid scores for choosing the experts only (GLM-4.5, DeepSeek-V3); kept as the
    # checkpoint stores it (fp32), since the routing is computed in fp32
    score_correction_bias: torch.Tensor | None = None

    def check(self, spec: MoeSpec) -> None:
        """Shapes against the spec; raises ValueError naming the tensor."""
        num_experts, hidden, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
        want: dict[str, tuple[torch.Tensor | None, tuple[int, ...]]] = {
            "router_weight": (self.router_weight, (num_experts, hidden)),
            "experts.gate_up": (self.experts.gate_up, (num_experts, 2 * inter, hidden)),
            "experts.down": (self.experts.down, (num_experts, hidden, inter)),
        }
        if spec.has_router_bias:
            want["router_bias"] = (self.router_bias, (num_experts,))
        if spec.has_score_correction_bias:
            want["score_correction_bias"] = (self.score_correction_bias, (num_experts,))
        if spec.has_expert_bias:
            want["experts.gate_up_bias"] = (self.experts.gate_up_bias, (num_experts, 2 * inter))
            want["experts.down_bias"] = (self.experts.down_bias, (num_experts, hidden))
        if spec.has_shared_expert:
            shared_inter = spec.shared_expert_intermediate_size
            if self.shared is None:
                raise ValueError("MoE layer has no shared expert weights but the spec has a shared expert")
            want["shared.gate_up"] = (self.shared.gate_up, (2 * shared_inter, hidden))
            want["shared.down"] = (self.shared.down, (hidden, shared_inter))
            if spec.has_shared_expert_gate:
                want["shared.gate"] = (self.shared.gate, (1, hidden))
        for name, (tensor, shape) in want.items():
            if tensor is None or tuple(tensor.shape) != shape:
                got = None if tensor is None else tuple(tensor.shape)
                raise ValueError(f"MoE weight {name} has shape {got}, expected {shape}")
        self.experts.check(num_experts, hidden, inter)
