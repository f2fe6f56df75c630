"""A quantized checkpoint (FP8, `--quantization fp8`, INT4) read whole into a plain transformers model with every
quantized weight dequantized: the tests' reference (the model `generate` runs), which shares none of the one
loader's code but the formats' own `dequantize` (quant/methods.py `linear_method(...).dequantize`). Also what
`AccountedCheckpoint` and the KV-cache scales are for the one loader (the slice reader, shard_build.py). Owns
nothing after loading.

  checkpoint_tensors(path)    the checkpoint's tensors by name, read lazily from its safetensors shards
  iter_dequantized(...)       (name, tensor) for a plain model of the same architecture: every quantized
                              linear's weight dequantized (`linear_method(...).dequantize`), the rest cast
  dequantize_state_dict(...)  the same as one dict
  load_dequantized_model(...) the transformers model built from the config without its quantizer, every weight
                              set dequantized, generation_config.json read as from_pretrained does

A mixture of experts (`SparseLayers`): its experts are read one linear an expert by layers/experts.py (the
reader the one loader uses) and dequantized to the compute dtype, as is every other linear under a sparse MLP
(GLM-4.5's shared expert). The router stays as stored (the releases leave it unquantized). Layers past
`num_hidden_layers` (GLM-4.5's and DeepSeek-V3's multi-token-prediction layers) are not built, as in
transformers, and their tensors are not read.

FP8 KV-cache scales a checkpoint may carry (`k_scale`, `v_scale`, `kv_scale`: a kv_cache_scheme's) are not
weights: `read_kv_scales` collects them per layer and the model carries them (kv_cache.KV_SCALES_ATTR) for
`--kv-cache-dtype fp8`. A tensor the quantization_config does not account for (an FP8 weight or a scale of a
linear it leaves unquantized) is an error that names it.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..families.spec import MoeMlpSpec
from ..kv_cache import KV_SCALES_ATTR
from ..layers.experts import expert_tensors, load_experts
from ..moe.fp8 import Fp8ExpertFormat
from ..moe.methods import kept_fp8_format
from ..moe.spec import MoeSpec
from ..parallel.group import ParallelState
from ..quant.base import QuantConfig
from ..quant.fp8 import FP8_DTYPE
from ..quant.methods import (
    Fp8CheckpointError,
    LinearMethods,
    linear_method,
    load_dequantized,
    stored_quantized,
)

_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
# the INT4 layouts' tensors (GPTQ, AWQ, compressed-tensors pack-quantized): never a plain model's
_INT4_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".weight_packed", ".weight_zero_point", ".weight_shape", ".weight_g_idx")
_SAFETENSORS_DTYPES = {"F8_E4M3": "torch.float8_e4m3fn", "F32": "torch.float32", "BF16": "torch.bfloat16", "F16": "torch.float16"}


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """A safetensors checkpoint's tensors by name; each is read from its shard when asked for."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise Fp8CheckpointError(f"{folder} has no safetensors files")
        self._handles = [safe_open(os.path.join(folder, f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def get_slice(self, name: str) -> Any:
        """Read by slice (parallel.checkpoint.Checkpoint's protocol), as the experts' reader does."""
        return self._where[name].get_slice(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def checkpoint_tensors(name_or_path: str) -> CheckpointTensors:
    if not os.path.isdir(name_or_path):  # a hub name: its files, from the cache or the hub
        from huggingface_hub import snapshot_download

        name_or_path = snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"])
    return CheckpointTensors(name_or_path)


@dataclass(frozen=True)
class SparseLayers:
    """A mixture of experts' sparse layers, as the loader reads them: where each sits, where its experts and
    router sit under it (the family's declaration), and their sizes."""

    layer_prefixes: tuple[str, ...]  # "model.layers.1", ...
    mlp: MoeMlpSpec
    spec: MoeSpec

    @property
    def mlp_prefixes(self) -> tuple[str, ...]:
        """The sparse MLPs ("model.layers.1.mlp"): every linear under one is dequantized."""
        parent = self.mlp.experts.rpartition(".")[0]
        return tuple(f"{prefix}.{parent}" if parent else prefix for prefix in self.layer_prefixes)

    def holds(self, module_name: str) -> bool:
        return any(module_name.startswith(f"{prefix}.") for prefix in self.mlp_prefixes)

    def fp8_format(self, quant: QuantConfig | None) -> Fp8ExpertFormat | None:
        """The format the experts are kept in on FP8 tensor cores (moe/methods.py `kept_fp8_format`, the expert
        methods' own choice), None where they run in the model dtype."""
        experts = f"{self.layer_prefixes[0]}.{self.mlp.experts}" if self.layer_prefixes else ""
        return kept_fp8_format(quant, experts, self.mlp.kernel_layout) if experts else None


def iter_dequantized(
    tensors: Mapping[str, torch.Tensor],
    quant: QuantConfig,
    dtype: torch.dtype,
    linear_names: Iterable[str],
    read_elsewhere: Callable[[str], bool] = lambda name: False,
    cast: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict of the plain model, one tensor at a time. `linear_names`: the model's linear modules
    ("model.layers.0.self_attn.q_proj", ...); the config decides which of them are quantized. The tensors
    `read_elsewhere` names (the experts') are skipped. `cast` False: the unquantized tensors as stored (the caller copies each
    into its parameter's own dtype: GLM-4.5's router is fp32 in a bf16 model)."""
    consumed: set[str] = set()
    for module in linear_names:
        method = linear_method(quant, module)
        if method is None or not stored_quantized(method, tensors, module):  # not quantized, or tied to the embedding
            continue
        consumed.update(method.tensor_names(module))
        yield f"{module}.weight", load_dequantized(method, tensors, module, dtype)
    for name in tensors:
        if name in consumed or name.endswith(_KV_SCALE_SUFFIXES) or read_elsewhere(name):
            continue
        tensor = tensors[name]
        module = name.rsplit(".", 1)[0]
        if tensor.dtype == FP8_DTYPE or name.endswith(_SCALE_SUFFIXES + _INT4_SUFFIXES):
            raise Fp8CheckpointError(
                f"the checkpoint has {name} ({tensor.dtype}), but its quantization_config leaves {module} "
                f"unquantized"
            )
        yield name, tensor.to(dtype) if cast and tensor.is_floating_point() else tensor


def dequantize_state_dict(
    tensors: Mapping[str, torch.Tensor], quant: QuantConfig, dtype: torch.dtype, linear_names: Iterable[str]
) -> dict[str, torch.Tensor]:
    return dict(iter_dequantized(tensors, quant, dtype, linear_names))


def linear_module_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def plain_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The architecture of `config` without its quantizer, weights left uninitialised (they are set next)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # no_init_weights skips the tying too
    return model


def load_dequantized_model(
    name_or_path: str, config: Any, quant: QuantConfig, dtype: torch.dtype, sparse: SparseLayers | None = None
) -> nn.Module:  # fmt: skip
    """The checkpoint as a plain transformers model on the CPU, every quantized weight dequantized to `dtype` (the
    tests' reference: the model `generate` runs, built by none of the one loader's code but the formats' own
    `dequantize`). `sparse`: a mixture of experts' sparse layers, whose experts are read by layers/experts.py's reader
    (dequantized) and whose other linears are dequantized too. generation_config.json is read as from_pretrained
    does."""
    from transformers import GenerationConfig

    model = plain_model(config, dtype)
    tensors = checkpoint_tensors(name_or_path)
    model_config: Any = model.config
    kv_scales = read_kv_scales(tensors, model_config.num_hidden_layers)
    if kv_scales:
        setattr(model, KV_SCALES_ATTR, kv_scales)
    linear_names = linear_module_names(model)
    loaded: set[str] = set()
    experts_read: set[str] = set()
    if sparse is not None:
        loaded |= _load_experts(model, tensors, sparse, LinearMethods(quant), dtype, experts_read)
    params = model.state_dict(keep_vars=True)
    unbuilt = _unbuilt_layers(model_config)
    with torch.no_grad():
        read_elsewhere = lambda name: name in experts_read or unbuilt(name)  # noqa: E731
        for name, tensor in iter_dequantized(tensors, quant, dtype, linear_names, read_elsewhere, cast=False):
            if name in loaded:
                continue
            _copy(params, name, tensor, model)
            loaded.add(name)
    # A tied output head is the embedding itself: loading one loads both.
    loaded_ids = {id(params[name]) for name in loaded if name in params}
    missing = [name for name, p in params.items() if name not in loaded and id(p) not in loaded_ids]
    if missing:
        raise Fp8CheckpointError(f"the checkpoint has no {missing[0]} ({len(missing)} tensors missing)")
    if os.path.exists(os.path.join(name_or_path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(name_or_path)
    return model.eval()


def _copy(params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, model: nn.Module) -> None:
    """Into the parameter's own dtype (`copy_` casts once)."""
    if name not in params:
        raise Fp8CheckpointError(f"the checkpoint has {name}, which {type(model).__name__} does not")
    if params[name].shape != tensor.shape:
        raise Fp8CheckpointError(
            f"{name} is {list(tensor.shape)} in the checkpoint, {list(params[name].shape)} in the model"
        )
    params[name].copy_(tensor)


class AccountedCheckpoint:
    """A quantized checkpoint (FP8, INT4) read by slice (the one reader, models/shard_build.py) that keeps this
    loader's checks: a tensor its quantization_config needs and the checkpoint lacks is named
    (`Fp8CheckpointError`), and once the model is read, `check_unread` names an FP8 weight, a scale or a packed INT4
    tensor nobody read (a linear the config leaves unquantized), KV-cache scales and the layers transformers does
    not build excepted."""

    def __init__(self, inner: Any, read: set[str] | None = None):
        self.inner, self.read = inner, set[str]() if read is None else read  # `read`: the caller's record

    def __contains__(self, name: str) -> bool:
        return name in self.inner

    def get_slice(self, name: str) -> Any:
        if name not in self.inner:
            raise Fp8CheckpointError(f"the checkpoint has no {name}, which its quantization_config needs")
        self.read.add(name)
        return self.inner.get_slice(name)

    def check_unread(self, names: Iterable[str], config: Any) -> None:
        unbuilt = _unbuilt_layers(config)
        for name in names:
            if name in self.read or name.endswith(_KV_SCALE_SUFFIXES) or unbuilt(name):
                continue
            tensor = self.inner.get_slice(name)
            dtype = str(tensor.get_dtype()) if hasattr(tensor, "get_dtype") else str(tensor[...].dtype)
            if dtype.startswith(("F8", "torch.float8")) or name.endswith(_SCALE_SUFFIXES + _INT4_SUFFIXES):
                shown = _SAFETENSORS_DTYPES.get(dtype, dtype)
                raise Fp8CheckpointError(
                    f"the checkpoint has {name} ({shown}), but its quantization_config leaves "
                    f"{name.rsplit('.', 1)[0]} unquantized"
                )


def _load_experts(
    model: nn.Module, tensors: CheckpointTensors, sparse: SparseLayers, methods: LinearMethods, dtype: torch.dtype,
    read: set[str],
) -> set[str]:  # fmt: skip
    """Each sparse layer's experts through its expert method, by layers/experts.py's reader at a world of one (on the
    CPU, one expert's linear at a time), in `dtype`, into the model's parameters. Returns the model names loaded."""
    whole = ParallelState.single(torch.device("cpu"))
    source = AccountedCheckpoint(tensors, read)  # what it reads, the loader does not read again
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    loaded: set[str] = set()
    for prefix in sparse.layer_prefixes:
        weights = load_experts(source, prefix, sparse.mlp, sparse.spec, whole, methods, dtype=dtype)
        with torch.no_grad():
            for name, tensor in expert_tensors(weights, prefix, sparse.mlp).items():
                _copy(params, name, tensor, model)
                loaded.add(name)
    return loaded


def _unbuilt_layers(config: Any) -> Callable[[str], bool]:
    """Whether a checkpoint tensor belongs to a layer past `num_hidden_layers` that transformers does not build:
    GLM-4.5's and DeepSeek-V3's multi-token-prediction layers (`num_nextn_predict_layers`), which generation
    does not use (transformers ignores them on load too)."""
    if not getattr(config, "num_nextn_predict_layers", 0):
        return lambda name: False
    num_layers = config.num_hidden_layers

    def unbuilt(name: str) -> bool:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        return match is not None and int(match.group(1)) >= num_layers

    return unbuilt


def read_kv_scales(tensors: Mapping[str, torch.Tensor], num_layers: int) -> tuple[tuple[float, float], ...]:
    """Each layer's (k_scale, v_scale) from the checkpoint's `layers.N.self_attn.{k,v}_scale` (compressed-tensors'
    kv_cache_scheme) or `kv_scale` (one for both, AutoFP8); a layer without them 1.0; () when there are none."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    found = False
    for name in tensors:
        if not name.endswith(_KV_SCALE_SUFFIXES):
            continue
        match = re.search(r"layers\.(\d+)\.", name)
        if match is None or int(match.group(1)) >= num_layers:
            raise Fp8CheckpointError(f"the checkpoint has {name}, a KV-cache scale of no layer cbq knows")
        value = float(tensors[name].float().reshape(-1).max())  # per tensor (a per-head one: its largest)
        if not value > 0:
            raise Fp8CheckpointError(f"the checkpoint's {name} is {value} (a positive scale expected)")
        layer, which = scales[int(match.group(1))], name.rsplit(".", 1)[1]
        if which in ("k_scale", "kv_scale"):
            layer[0] = value
        if which in ("v_scale", "kv_scale"):
            layer[1] = value
        found = True
    return tuple((k, v) for k, v in scales) if found else ()
