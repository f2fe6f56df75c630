"""Mixture-of-experts layers (issue 25): what one computes (`spec`), its weights stacked per layer
(`weights`), the expert-method protocol (`protocol`: how a format's experts are created and loaded, `methods`: which a
layer takes, `loader`: the one loader of experts, every checkpoint layout), the MXFP4 format (`mxfp4`), the forward on
the CPU (`reference`) and on CUDA (`triton_moe`) behind `moe_forward`,
and what a step costs and a model weighs (`cost`). FP8 experts (issue 26): their format (`fp8`), the module that
holds them in the transformers model (`fp8_experts`) and their grouped GEMMs (`triton_fp8`). Owns nothing itself;
the decoder owns the layers' weights and one `MoeWorkspace`."""

from .forward import moe_forward
from .loader import load_moe_layer
from .spec import Activation, MoeSpec, RouterScoring, dense_intermediate_size, moe_layer_ids, spec_from_config
from .triton_moe import LaunchConfig, MoeWorkspace
from .weights import ExpertWeights, MoeLayerWeights, SharedExpertWeights

__all__ = [
    "Activation",
    "ExpertWeights",
    "LaunchConfig",
    "MoeLayerWeights",
    "MoeSpec",
    "MoeWorkspace",
    "RouterScoring",
    "SharedExpertWeights",
    "dense_intermediate_size",
    "load_moe_layer",
    "moe_forward",
    "moe_layer_ids",
    "spec_from_config",
]
