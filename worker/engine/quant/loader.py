"""Loading an FP8 (or `--quantization fp8`) checkpoint with its weights dequantized to the compute dtype:
the CPU path of issue 26, as transformers runs FP8 checkpoints on a CPU. Owns nothing after loading.

  checkpoint_tensors(path)    the checkpoint's tensors by name, read lazily from its safetensors shards
  iter_dequantized(...)       (name, tensor) for a plain model of the same architecture: every quantized
                              linear's weight dequantized (`linear_method(...).dequantize`), the rest cast
  dequantize_state_dict(...)  the same as one dict
  load_quantized_model(...)   the transformers model built from the config without its quantizer, these
                              weights set (or, `keep_fp8`, its quantized linears as `Fp8LinearModule`s holding
                              the FP8 weights and scales), generation_config.json read as from_pretrained does
  load_dequantized_model(...) the same with every weight dequantized (the CPU path)

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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..kv_cache import KV_SCALES_ATTR
from .config import Fp8Config
from .fp8 import FP8_DTYPE
from .linear import Fp8LinearModule, replace_module
from .methods import Fp8CheckpointError, linear_method

_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


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

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def checkpoint_tensors(name_or_path: str) -> CheckpointTensors:
    if not os.path.isdir(name_or_path):  # a hub name: its files, from the cache or the hub
        from huggingface_hub import snapshot_download

        name_or_path = snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"])
    return CheckpointTensors(name_or_path)


def iter_dequantized(
    tensors: Mapping[str, torch.Tensor],
    quant: Fp8Config,
    dtype: torch.dtype,
    linear_names: Iterable[str],
    kept_fp8: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict of the plain model, one tensor at a time. `linear_names`: the model's linear modules
    ("model.layers.0.self_attn.q_proj", ...); the config decides which of them are quantized. `kept_fp8`:
    modules loaded as FP8 by the caller, whose weight and scales are skipped here."""
    consumed: set[str] = set()
    for module in linear_names:
        method = linear_method(quant, module)
        if method is None or f"{module}.weight" not in tensors:  # not quantized, or tied to the embedding
            continue
        consumed.update(method.tensor_names(module))
        if module not in kept_fp8:
            yield f"{module}.weight", method.dequantize(method.load(tensors, module), dtype)
    for name in tensors:
        if name in consumed or name.endswith(_KV_SCALE_SUFFIXES):
            continue
        tensor = tensors[name]
        module = name.rsplit(".", 1)[0]
        if tensor.dtype == FP8_DTYPE or name.endswith(_SCALE_SUFFIXES):
            raise Fp8CheckpointError(
                f"the checkpoint has {name} ({tensor.dtype}), but its quantization_config leaves {module} "
                f"unquantized"
            )
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def dequantize_state_dict(
    tensors: Mapping[str, torch.Tensor], quant: Fp8Config, dtype: torch.dtype, linear_names: Iterable[str]
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


def load_dequantized_model(name_or_path: str, config: Any, quant: Fp8Config, dtype: torch.dtype) -> nn.Module:
    """The checkpoint as a plain transformers model in `dtype` (on the CPU; the caller moves it)."""
    return load_quantized_model(name_or_path, config, quant, dtype, keep_fp8=False)


def load_quantized_model(
    name_or_path: str, config: Any, quant: Fp8Config, dtype: torch.dtype, keep_fp8: bool, generation_config=None
) -> nn.Module:
    """The checkpoint as a transformers model on the CPU (the caller moves it). `keep_fp8`: each quantized
    linear becomes an `Fp8LinearModule` holding the checkpoint's FP8 weight and scales (what the owned decoder
    multiplies on sm89+); else its weight is dequantized to `dtype`. `generation_config`: the caller's (None:
    generation_config.json is read here, as from_pretrained does)."""
    from transformers import GenerationConfig

    model = plain_model(config, dtype)
    tensors = checkpoint_tensors(name_or_path)
    model_config: Any = model.config
    kv_scales = read_kv_scales(tensors, model_config.num_hidden_layers)
    if kv_scales:
        setattr(model, KV_SCALES_ATTR, kv_scales)
    linear_names = linear_module_names(model)
    kept_fp8 = _load_fp8_modules(model, linear_names, tensors, quant, dtype) if keep_fp8 else frozenset()
    loaded = {f"{module}.{name}" for module in kept_fp8 for name in ("weight", "weight_scale", "input_scale", "bias")}
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in iter_dequantized(tensors, quant, dtype, linear_names, kept_fp8):
            if name in loaded:
                continue
            if name not in params:
                raise Fp8CheckpointError(f"the checkpoint has {name}, which {type(model).__name__} does not")
            if params[name].shape != tensor.shape:
                raise Fp8CheckpointError(
                    f"{name} is {list(tensor.shape)} in the checkpoint, {list(params[name].shape)} in the model"
                )
            params[name].copy_(tensor)
            loaded.add(name)
    # A tied output head is the embedding itself: loading one loads both.
    loaded_ids = {id(params[name]) for name in loaded if name in params}
    missing = [name for name, p in params.items() if name not in loaded and id(p) not in loaded_ids]
    if missing:
        raise Fp8CheckpointError(f"the checkpoint has no {missing[0]} ({len(missing)} tensors missing)")
    if generation_config is not None:
        model.generation_config = generation_config
    elif os.path.exists(os.path.join(name_or_path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(name_or_path)
    return model.eval()


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


def _load_fp8_modules(
    model: nn.Module,
    linear_names: list[str],
    tensors: Mapping[str, torch.Tensor],
    quant: Fp8Config,
    dtype: torch.dtype,
) -> frozenset[str]:
    """Each linear the config quantizes (and the checkpoint holds) replaced by an `Fp8LinearModule` with its
    tensors and bias; returns their module names."""
    kept: set[str] = set()
    for module_name in linear_names:
        method = linear_method(quant, module_name)
        if method is None or f"{module_name}.weight" not in tensors:
            continue
        layer = method.load(tensors, module_name)
        bias = tensors.get(f"{module_name}.bias")
        bias = None if bias is None else bias.to(dtype)
        replace_module(model, module_name, Fp8LinearModule(method, layer, bias))
        kept.add(module_name)
    return frozenset(kept)
