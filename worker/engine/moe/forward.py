"""`moe_forward`: one sparse layer on a step's tokens, on the path the device calls for. Owns nothing.

CPU (and CUDA without triton): the plain-PyTorch reference. CUDA: routing and the shared expert in torch
(`reference.route`, the CPU path's own: softmax or sigmoid, top-k and cuBLAS GEMMs, none of which syncs with
the host), the routed experts as the Triton grouped GEMMs of `triton_moe.py` in a caller-owned workspace, so a
decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from . import triton_moe
from .reference import experts_ref, route, shared_expert_forward
from .spec import MoeSpec
from .triton_moe import LaunchConfig, MoeWorkspace
from .weights import MoeLayerWeights


def moe_forward(
    hidden: torch.Tensor,
    layer: MoeLayerWeights,
    spec: MoeSpec,
    workspace: MoeWorkspace | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """[T, H] -> [T, H]: the routed experts' weighted sum, plus the (gated) shared expert where there is one.
    `workspace` (from `MoeWorkspace.allocate` at the largest step) is required on the Triton path; `config`
    overrides the launch configuration table (tests, tuning)."""
    topk_weights, topk_ids = route(
        hidden, layer.router_weight, layer.router_bias, spec, layer.score_correction_bias
    )
    # a workspace on the CPU means the Triton path too (the interpreter tests run it that way)
    if (hidden.is_cuda and triton_moe.HAVE_TRITON) or workspace is not None:
        if workspace is None:
            raise ValueError(
                "moe_forward on CUDA needs a MoeWorkspace (MoeWorkspace.allocate at the largest step)"
            )
        out = triton_moe.experts_triton(
            hidden, topk_weights, topk_ids, layer.experts, spec, workspace, config
        )
    else:
        out = experts_ref(hidden, topk_weights, topk_ids, layer.experts, spec)
    if layer.shared is not None:
        out = out + shared_expert_forward(hidden, layer.shared)
    return out
