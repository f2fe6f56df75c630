"""`Fp8Experts`: a sparse layer's routed experts kept in FP8 inside the transformers model, in the place of its
stacked experts module (Qwen3MoeExperts, Glm4MoeNaiveMoe, ...), as quant/linear.py's `Fp8LinearModule` takes an
`nn.Linear`'s. Owns the FP8 expert tensors (buffers, so `.to(device)` moves them); the owned decoder reads them as
views (`weights`, models/moe_from_model.py). transformers' forward (decoder "hf", latent attention on transformers'
layers, `model.generate`) runs them through the FP8 grouped GEMMs on CUDA with Triton (triton_moe.experts_triton, in a
workspace shared by every such layer and grown to the largest step: `shared_workspace`), and their emulation
(reference.experts_fp8_emulated) elsewhere.

Made at load, on CUDA with FP8 tensor cores (`models.load_model`'s `keep_fp8_experts`), from an FP8 checkpoint's
per-expert linears (the one expert loader, loader.py, through `fp8.Fp8ExpertMethod`; in the shard model or by
models/quant_loader.py); under `--quantization fp8`, from a checkpoint's experts quantized per output channel by
their expert method as the one loader reads them (fp8.py `OnlineFp8ExpertMethod`), or for a preset (random weights,
no checkpoint) by `quantize_model_experts` (each layer's experts quantized where they lie, one layer at a time, the
layer's bf16 experts freed as its FP8 ones take their place). Only the families whose
transformers module holds the kernels' layout (`MoeMlpSpec.kernel_layout`): gpt-oss's experts (MXFP4 in its
release, biased) stay in the model dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import triton_moe
from .fp8 import ExpertFp8Scales, Fp8ExpertFormat, quantize_experts_per_channel
from .reference import experts_ref
from .spec import MoeSpec
from .weights import ExpertWeights


class Fp8Experts(nn.Module):
    """transformers' stacked experts with e4m3 `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (the kernels'
    layout, transformers' names) and their fp32 scales `gate_up_proj_scale` / `down_proj_scale` (fp8.py)."""

    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate_up_proj_scale: torch.Tensor
    down_proj_scale: torch.Tensor

    def __init__(self, weights: ExpertWeights, spec: MoeSpec) -> None:
        super().__init__()
        assert weights.fp8 is not None, "Fp8Experts holds FP8 experts"
        assert weights.gate_up_bias is None and weights.down_bias is None, (
            "biased experts are not kept in FP8"
        )
        weights.check(spec.num_experts, spec.hidden_size, spec.expert_intermediate_size)
        self.spec, self.format = spec, weights.fp8.format
        self.register_buffer("gate_up_proj", weights.gate_up)
        self.register_buffer("down_proj", weights.down)
        self.register_buffer("gate_up_proj_scale", weights.fp8.gate_up)
        self.register_buffer("down_proj_scale", weights.fp8.down)

    @property
    def weights(self) -> ExpertWeights:
        """The experts as the decoder reads them (its tensors, not copies)."""
        scales = ExpertFp8Scales(self.gate_up_proj_scale, self.down_proj_scale, self.format)
        return ExpertWeights(self.gate_up_proj, self.down_proj, fp8=scales)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """transformers' experts call: (tokens [T, H], chosen experts [T, k], their weights [T, k]) -> [T, H]."""
        if hidden_states.is_cuda and triton_moe.HAVE_TRITON:
            return self.forward_triton(hidden_states, top_k_index, top_k_weights)
        return experts_ref(hidden_states, top_k_weights, top_k_index, self.weights, self.spec)

    def forward_triton(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The FP8 grouped GEMMs (on CUDA; in Triton's interpreter on the CPU, the tests')."""
        hidden = hidden_states.contiguous()
        workspace = shared_workspace(self.spec, hidden.shape[0], hidden.dtype, hidden.device)
        return triton_moe.experts_triton(hidden, top_k_weights, top_k_index, self.weights, self.spec, workspace)


# One MoE workspace a (device, dtype, layer shape), shared by every `Fp8Experts` that transformers' forward calls (its
# layers run one after another, as the owned decoder's MoE layers share theirs) and grown to the largest step seen
# (a power of two of tokens), or sized once for the engine's step budget by `reserve_workspaces` (the model runner's,
# so that decode steps can be captured in graphs); the owned decoder sizes its own once from the step budget.
_WORKSPACES: dict[tuple[Any, ...], triton_moe.MoeWorkspace] = {}


def shared_workspace(spec: MoeSpec, num_tokens: int, dtype: torch.dtype, device: torch.device) -> triton_moe.MoeWorkspace:
    key = (device, dtype, spec.num_experts, spec.top_k, spec.expert_intermediate_size, spec.hidden_size)
    workspace = _WORKSPACES.get(key)
    if workspace is None or workspace.max_tokens < num_tokens:
        size = 1 << max(num_tokens - 1, 63).bit_length()  # at least 64 tokens
        workspace = _WORKSPACES[key] = triton_moe.MoeWorkspace.allocate(spec, size, dtype, device)
    return workspace


def reserve_workspaces(model: nn.Module, num_tokens: int, dtype: torch.dtype) -> bool:
    """Size the shared workspace of every `Fp8Experts` in `model` (activations in `dtype`) for steps of up to
    `num_tokens` tokens now, so that no later step grows one (a CUDA graph captured before a growth would replay into
    freed memory). Returns whether the model's forward over them is then capturable: yes on CUDA with Triton, not
    with their emulation, whose per-expert loop reads device values on the host."""
    experts = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    if not experts or not triton_moe.HAVE_TRITON or not experts[0].gate_up_proj.is_cuda:
        return not experts
    for module in experts:
        shared_workspace(module.spec, num_tokens, dtype, module.gate_up_proj.device)
    return True


def expert_format_of(model: nn.Module) -> Fp8ExpertFormat | None:
    """The format of the FP8 experts `model` holds (None: its experts, if any, are in the model dtype)."""
    return next((m.format for m in model.modules() if isinstance(m, Fp8Experts)), None)


def replace_experts(layer: nn.Module, experts_path: str, weights: ExpertWeights, spec: MoeSpec) -> None:
    """Put `Fp8Experts(weights)` at `experts_path` under a transformers decoder layer; the old module (and its
    tensors, unless held elsewhere) goes."""
    parent, _, name = experts_path.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, name, Fp8Experts(weights, spec))


def quantize_model_experts(
    model: nn.Module, layer_prefixes: tuple[str, ...], experts_path: str, spec: MoeSpec
) -> None:
    """`--quantization fp8` on a loaded model's routed experts: each sparse layer's stacked `gate_up_proj` and
    `down_proj` quantized per output channel on their device, one layer at a time, its module replaced by an
    `Fp8Experts` (so the peak is the model plus one layer's FP8 experts and one expert's fp32 rows)."""
    for prefix in layer_prefixes:
        layer: Any = model.get_submodule(prefix)
        experts = layer.get_submodule(experts_path)
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        assert gate_up.shape == (spec.num_experts, 2 * spec.expert_intermediate_size, spec.hidden_size), (
            f"{prefix}.{experts_path}: not the kernels' stacked layout"
        )
        gate_up_w, down_w, scales = quantize_experts_per_channel(gate_up, down)
        del gate_up, down, experts
        replace_experts(layer, experts_path, ExpertWeights(gate_up_w, down_w, fp8=scales), spec)
