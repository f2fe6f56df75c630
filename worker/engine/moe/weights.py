"""An MoE layer's weights, stacked, and how they are built from a checkpoint's tensors. Owns the stacked tensors.

Every family ends up in one layout, the one the kernels read (`nn.Linear`'s [out, in] per expert):
  experts.gate_up  [E, 2I, H]  rows 0..I-1 are the gate projection, rows I..2I-1 the up projection
  experts.down     [E, H, I]
  biases           [E, 2I] and [E, H] (gpt-oss only), split the same way
FP8 experts (`ExpertWeights.fp8`, CUDA only: fp8.py) keep the same layout in float8_e4m3fn with their scales beside.
No per-expert modules, no fp32 copy: the stacked tensors are allocated once in the model dtype on the device
and each expert's slice is copied (or dequantized) into place, so peak memory is the stack plus one expert.

Checkpoint names understood (`layer_prefix` is e.g. "model.layers.3"):
  - transformers 5.x's own modules (`save_pretrained` of the installed version): `mlp.experts.gate_up_proj`
    [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]; the router `mlp.gate.weight`. gpt-oss's are
    transposed, [E, H, 2I] with gate/up columns interleaved and [E, I, H], plus `*_bias`, router
    `mlp.router.weight`/`.bias`.
  - released Qwen2-MoE/Qwen3-MoE: `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`;
    released Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up, down), `block_sparse_moe.gate`.
  - released gpt-oss (MXFP4 experts) is not read here: the loader dequantizes it into transformers' gpt-oss
    parameters (layers/experts.py, the one MXFP4 reader), which this then reads as above.
  - Qwen2-MoE's shared expert: `mlp.shared_expert.{gate,up,down}_proj.weight`, `mlp.shared_expert_gate.weight`;
    GLM-4.5's: `mlp.shared_experts.{gate,up,down}_proj.weight` (ungated), its router's correction bias
    `mlp.gate.e_score_correction_bias` [E] (fp32 in the release).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


def _deinterleave_rows(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss rows (or bias entries) g0, u0, g1, u1, ... -> g0, g1, ..., u0, u1, ... along dim 0."""
    return torch.cat((x[0::2], x[1::2]))


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if src.shape != dst.shape:
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _mlp_prefix(tensors: Mapping[str, torch.Tensor], layer_prefix: str) -> str:
    for name in ("mlp", "block_sparse_moe"):
        prefix = f"{layer_prefix}.{name}" if layer_prefix else name
        if f"{prefix}.gate.weight" in tensors or f"{prefix}.router.weight" in tensors:
            return prefix
    raise ValueError(
        f"no MoE router at {layer_prefix!r} (looked for mlp.gate, mlp.router, block_sparse_moe.gate)"
    )


def _per_expert_names(tensors: Mapping[str, torch.Tensor], experts: str) -> tuple[str, str, str] | None:
    for gate, up, down in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        if f"{experts}.0.{gate}.weight" in tensors:
            return gate, up, down
    return None


def load_moe_layer(
    tensors: Mapping[str, torch.Tensor],
    layer_prefix: str,
    spec: MoeSpec,
    dtype: torch.dtype,
    device: torch.device | str,
) -> MoeLayerWeights:
    """One sparse layer's weights from a checkpoint's tensors (any mapping: a dict, a lazy safetensors view),
    in `dtype` on `device`, in the stacked layout above."""
    mlp = _mlp_prefix(tensors, layer_prefix)
    experts = f"{mlp}.experts"
    num_experts, hidden, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=device)
    down = torch.empty(num_experts, hidden, inter, dtype=dtype, device=device)
    interleaved = spec.model_type == "gpt_oss"
    fill: Callable[[int], None]
    if f"{experts}.gate_up_proj" in tensors:  # transformers 5.x stacked parameters
        stacked_gate_up, stacked_down = tensors[f"{experts}.gate_up_proj"], tensors[f"{experts}.down_proj"]

        def fill(e: int) -> None:
            if interleaved:  # GptOssExperts: x @ gate_up_proj[e], [H, 2I] with interleaved columns
                _copy(gate_up[e], _deinterleave_rows(stacked_gate_up[e].t()), f"{experts}.gate_up_proj")
                _copy(down[e], stacked_down[e].t(), f"{experts}.down_proj")
            else:
                _copy(gate_up[e], stacked_gate_up[e], f"{experts}.gate_up_proj")
                _copy(down[e], stacked_down[e], f"{experts}.down_proj")

    elif (names := _per_expert_names(tensors, experts)) is not None:  # released per-expert tensors
        gate_name, up_name, down_name = names

        def fill(e: int) -> None:
            for dst, name in (
                (gate_up[e, :inter], gate_name),
                (gate_up[e, inter:], up_name),
                (down[e], down_name),
            ):
                _copy(dst, tensors[f"{experts}.{e}.{name}.weight"], f"{experts}.{e}.{name}.weight")

    else:
        raise ValueError(f"no expert weights under {experts!r} (stacked or per-expert)")
    for e in range(num_experts):
        fill(e)

    gate_up_bias = down_bias = None
    if spec.has_expert_bias:
        bias = tensors[f"{experts}.gate_up_proj_bias"]
        gate_up_bias = to_device(torch.stack([_deinterleave_rows(b) for b in bias]) if interleaved else bias)
        down_bias = to_device(tensors[f"{experts}.down_proj_bias"])

    router = f"{mlp}.router" if f"{mlp}.router.weight" in tensors else f"{mlp}.gate"
    router_bias = to_device(tensors[f"{router}.bias"]) if spec.has_router_bias else None
    correction_bias = None
    if spec.has_score_correction_bias:
        correction_bias = tensors[f"{router}.e_score_correction_bias"].to(device=device, dtype=torch.float32)
    shared = None
    if spec.has_shared_expert:
        prefix = f"{mlp}.shared_experts" if f"{mlp}.shared_experts.gate_proj.weight" in tensors else f"{mlp}.shared_expert"
        shared_gate_up = torch.cat(
            (tensors[f"{prefix}.gate_proj.weight"], tensors[f"{prefix}.up_proj.weight"])
        )
        gate = to_device(tensors[f"{mlp}.shared_expert_gate.weight"]) if spec.has_shared_expert_gate else None
        shared = SharedExpertWeights(
            to_device(shared_gate_up), to_device(tensors[f"{prefix}.down_proj.weight"]), gate
        )
    layer = MoeLayerWeights(
        to_device(tensors[f"{router}.weight"]),
        router_bias,
        ExpertWeights(gate_up, down, gate_up_bias, down_bias),
        shared,
        correction_bias,
    )
    layer.check(spec)
    return layer
