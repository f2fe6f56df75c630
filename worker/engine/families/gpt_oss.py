"""gpt-oss (20b, 120b): attention with a learned sink logit per head, q/k/v/o biases, sliding-window (128) and
full layers alternating, YaRN rotary; RMSNorm with the weight multiplied in fp32 (the norms stay fp32); a sparse
MLP in every layer: the top-4 router logits (with a bias) softmaxed over those four, experts with biases and the
clamped SwiGLU. Released checkpoints store the experts in MXFP4: cbq dequantizes them to the model dtype at load,
in one process as under tensor parallelism (layers/experts.py; models/loader.py reads the release as the one rank
of a world of one), into transformers' GptOssExperts parameters ([E, H, 2I], gate and up columns interleaved).
The owned decoder's build moves each layer's experts into the kernels' [gate; up] layout and puts
`ExpertsInKernelLayout` in transformers' module's place (models/moe_from_model.py), so the experts are held once."""

from __future__ import annotations

import torch
from torch import nn

from ..moe.weights import ExpertWeights
from .qwen3_moe import read
from .spec import Family, MoeMlpSpec, NormKind, llama_layer


class ExpertsInKernelLayout(nn.Module):
    """transformers' GptOssExperts computed from the kernels' layout (moe/weights.py: gate_up [E, 2I, H] with
    [gate; up] rows, down [E, H, I], biases split the same way), in transformers' place once the owned decoder
    holds the experts. A call puts the layer's experts back in transformers' layout for its length and runs
    transformers' own module on them (kept without its tensors): whichever expert implementation transformers
    dispatches to gets the same operands, so `model.generate` gives the bits it gave before the move, at the price
    of one layer's experts copied for the call. It is the reference path, not the hot one."""

    KERNEL_NAMES = ("gate_up", "down", "gate_up_bias", "down_bias")  # ExpertWeights' fields
    TRANSFORMERS_NAMES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    _transformers_module: nn.Module

    @property
    def weights(self) -> ExpertWeights:
        """The experts as the decoder reads them (its views: a second decoder build on this model takes them again)."""
        gate_up, down, gate_up_bias, down_bias = (self.get_parameter(name).detach() for name in self.KERNEL_NAMES)
        return ExpertWeights(gate_up, down, gate_up_bias, down_bias)

    def __init__(self, transformers_experts: nn.Module, weights: ExpertWeights) -> None:
        super().__init__()
        assert weights.gate_up_bias is not None and weights.down_bias is not None, "gpt-oss's experts are biased"
        for name in self.KERNEL_NAMES:
            self.register_parameter(name, nn.Parameter(getattr(weights, name), requires_grad=False))
        for name in self.TRANSFORMERS_NAMES:  # its old tensors go with it; its config and code stay
            delattr(transformers_experts, name)
        object.__setattr__(self, "_transformers_module", transformers_experts)  # not a submodule: holds no tensor

    def _transformers_layout(self) -> tuple[torch.Tensor, ...]:
        """gate_up_proj [E, H, 2I] (gate and up columns interleaved), its bias [E, 2I], down_proj [E, I, H], its bias."""
        w = self.weights
        assert w.gate_up_bias is not None and w.down_bias is not None
        num_experts, two_inter, hidden = w.gate_up.shape
        inter = two_inter // 2
        gate_up = w.gate_up.view(num_experts, 2, inter, hidden).permute(0, 3, 2, 1).reshape(num_experts, hidden, two_inter)
        bias = w.gate_up_bias.view(num_experts, 2, inter).permute(0, 2, 1).reshape(num_experts, two_inter)
        return gate_up, bias, w.down.transpose(1, 2).contiguous(), w.down_bias

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """`state_dict()` (and `save_pretrained`) in transformers' names and layout, as before the move."""
        for name, tensor in zip(self.TRANSFORMERS_NAMES, self._transformers_layout(), strict=True):
            destination[prefix + name] = tensor if keep_vars else tensor.detach()

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
        module = self._transformers_module
        for name, tensor in zip(self.TRANSFORMERS_NAMES, self._transformers_layout(), strict=True):
            setattr(module, name, tensor)
        try:
            return module(hidden_states, router_indices, routing_weights)
        finally:
            for name in self.TRANSFORMERS_NAMES:
                setattr(module, name, None)


FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    layer=llama_layer(),
    norm=NormKind.RMS_FP32_WEIGHT,
    read=read,
    moe=MoeMlpSpec(
        router="mlp.router", experts="mlp.experts", kernel_layout=False, experts_in_kernel_layout=ExpertsInKernelLayout
    ),
    attention_sinks="self_attn.sinks",
)
