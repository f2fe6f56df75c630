"""Building one rank's shard model from a checkpoint read by slice (the tensor-parallel ranks', and at a world of one
the one-process loader's for gpt-oss's MXFP4 release). Owns nothing after building: returns the model.

Below both shard_model.py (the ranks' loading, refusals and collectives) and loader.py (one process): it
imports neither, so the loader can read a checkpoint the way the ranks do (`load_whole_model`) without a cycle.
What it builds is described in shard_model.py's docstring.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint import Checkpoint, RenamedCheckpoint, SafetensorsCheckpoint
from ..families.spec import Family, LayerSpec, MlaSpec, QKNormSpan
from ..fused_weights import submodule
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.experts import expert_tensors, load_experts, router_tensors
from ..layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ..layers.tensor_parallel import TensorParallel
from ..moe import moe_layer_ids, spec_from_config
from ..moe.fp8_experts import replace_experts
from ..parallel.group import ParallelState
from ..parallel.memory import head_shard, shard_for
from ..quant.int4 import Int4Linear
from ..quant.int4.linear import Int4LinearModule
from ..quant.linear import Fp8LinearModule, replace_module
from ..quant.methods import UNQUANTIZED_MODEL, Fp8LinearMethod, LinearMethods, fp8_linear_of, fp8_parts
from .errors import ModelLoadError, one_line


def shard_config(config: Any, state: ParallelState) -> Any:
    """The config of one rank's shard: its q heads, KV heads and MLP width; head_dim kept as the full model's."""
    heads = head_shard(config.num_attention_heads, config.num_key_value_heads, state.rank, state.world_size)
    mlp = shard_for(config.intermediate_size, state.rank, state.world_size, "intermediate_size")
    shard = copy.deepcopy(config)
    if hasattr(shard, "quantization_config"):  # the methods read the quantized tensors: transformers must not
        del shard.quantization_config  # see a quantizer (its model holds plain weights or cbq's FP8 modules)
    shard.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shard.num_attention_heads = heads.num_q_heads
    shard.num_key_value_heads = heads.num_kv_heads
    shard.intermediate_size = mlp.stop - mlp.start
    # MoE experts, shared expert (GLM-4.5's is n_shared_experts x moe_intermediate_size: split with it)
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        size = getattr(config, field, None)
        if size:
            part = shard_for(size, state.rank, state.world_size, field)
            setattr(shard, field, part.stop - part.start)
    return shard


# --- building the shard --------------------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init); buffers (rotary
    tables, Gemma's embedding scale) are made as usual, on the CPU."""
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _set_param(root: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    module_path, _, attr = name.rpartition(".")
    module = submodule(root, module_path) if module_path else root
    module._parameters[attr] = None if tensor is None else nn.Parameter(tensor, requires_grad=False)


def build_shard(
    config: Any,
    family: Family,
    source: Checkpoint,
    state: ParallelState,
    dtype: torch.dtype,
    methods: LinearMethods = UNQUANTIZED_MODEL,
) -> tuple[nn.Module, TensorParallel]:
    """This rank's shard model of `config`, loaded from `source` (checkpoint names = the model's own names). Each
    parallel linear takes its method from `methods` (`method_for(prefix)`: unquantized, an FP8 format kept FP8, or
    read FP8 and dequantized), which reads its slices of the checkpoint's tensors; a linear kept FP8 takes the
    transformers model's linears' place as `Fp8LinearModule`s viewing its rows, so a rank holds each FP8 weight
    once and never in the model dtype."""
    from transformers import AutoModelForCausalLM

    cfg = shard_config(config, state)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    device = state.device
    for module in model.modules():  # the buffers (rotary tables); the parameters are still on meta
        for buffer_name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[buffer_name] = buffer.to(device)
    # the model's own buffers the checkpoint stores (listed before FP8 linears take their modules' places)
    stored_buffers = [name for name, _ in model.named_buffers() if name in source]
    hidden = config.hidden_size
    layers = submodule(model, family.layers_path)
    sparse = set(moe_layer_ids(config)) if family.moe is not None else set()
    kw: dict[str, Any] = dict(dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        loader = _LayerLoader(model, layer, f"{family.layers_path}.{i}", source, state, kw, methods)
        if family.mla is not None:
            loader.latent_attention(family.mla, config)
        else:
            loader.attention(family, config, cfg.head_dim)
        if i in sparse:
            _load_moe(model, loader.prefix, family, source, state, config, kw, methods)
        else:
            loader.dense_mlp(family.layer, config)
    embed_name = f"{family.embed_path}.weight"
    embedding = VocabParallelEmbedding(config.vocab_size, hidden, state, **kw)
    embedding.load_from(source, family.embed_path)
    _set_param(model, embed_name, embedding.weight)
    head_name = _param_name(model, model.get_output_embeddings())
    if bool(getattr(config, "tie_word_embeddings", False)):
        model.get_output_embeddings().weight = submodule(model, family.embed_path).weight
    else:
        head = ParallelLMHead(config.vocab_size, hidden, state, **kw)
        head.load_from(source, head_name)
        _set_param(model, f"{head_name}.weight", head.weight)
    # What is left is replicated: the norms, routers. In the dtype transformers built each in (GLM-4.5's router
    # is fp32 whatever the model's dtype, as at TP=1).
    for param_name, param in list(model.named_parameters()):
        if param.is_meta:
            _set_param(model, param_name, source.get_slice(param_name)[:].to(device=device, dtype=param.dtype))
    for buffer_name in stored_buffers:  # GLM-4.5's correction bias: replicated
        model.get_buffer(buffer_name).copy_(source.get_slice(buffer_name)[:])
    model.eval().requires_grad_(False)
    return model, TensorParallel(state, embedding, config.vocab_size)


@dataclass(frozen=True)
class _LayerLoader:
    """Loads one decoder layer's attention and dense MLP into the meta-built shard `model`, the rank's slices only."""

    model: nn.Module
    layer: nn.Module
    prefix: str  # the layer's path in the model and the checkpoint, e.g. "model.layers.3"
    source: Checkpoint
    state: ParallelState
    kw: dict[str, Any]  # dtype and device
    methods: LinearMethods

    def name(self, part: str) -> str:
        return f"{self.prefix}.{part}"

    def has_bias(self, part: str) -> bool:
        return submodule(self.layer, part).bias is not None

    def attention(self, family: Family, config: Any, head_dim: int) -> None:
        """q/k/v by head (separate or shipped fused), the whole-projection q/k norms' and the sinks' entries of the
        rank's heads, o by columns."""
        spec, name = family.layer, self.name
        qkv = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads, self.state,
            bias=self.has_bias(spec.qkv.parts[0]), method=self.methods.method_for(name(spec.qkv.parts[0])), **self.kw,
        )  # fmt: skip
        if len(spec.qkv.parts) == 1:  # shipped fused (Phi-3): the rank's heads out of each block of rows
            qkv.load_fused_qkv(self.source, name(spec.qkv.parts[0]))
            sizes = [qkv.output_size_per_rank]
        else:
            qkv.load_qkv(self.source, *map(name, spec.qkv.parts))
            sizes = [qkv.q_size_per_rank, qkv.kv_size_per_rank, qkv.kv_size_per_rank]
        _bind_rows(self.model, [name(p) for p in spec.qkv.parts], qkv, sizes)
        if spec.q_norm is not None and spec.qk_norm_span == QKNormSpan.FULL:  # [H * D], [KVH * D]
            for norm, heads in ((spec.q_norm, qkv.heads.q_heads), (spec.k_norm, qkv.heads.kv_heads)):
                assert norm is not None, "a family with a q norm has a k norm"
                self.load_entries(f"{name(norm)}.weight", slice(heads.start * head_dim, heads.stop * head_dim))
        if family.attention_sinks is not None:  # one logit per q head (gpt-oss)
            self.load_entries(name(family.attention_sinks), qkv.heads.q_heads)
        self.row(spec.o.parts[0], config.num_attention_heads * head_dim, config.hidden_size)

    def latent_attention(self, mla: MlaSpec, config: Any) -> None:
        """Multi-head latent attention split by head: the query projection (q_proj, or q_b_proj after the low-rank
        q_a_proj) and kv_b_proj (each head's no-rotary key and value rows) by the rank's heads' rows, o_proj by their
        columns. The latent's projections (kv_a_proj_with_mqa, and q_a_proj) whole on every rank (each rank writes and
        reads the whole latent): a column layer of a world of one, so each is read through its method as the split ones
        are (an FP8 one kept FP8); their norms (kv_a_layernorm, q_a_layernorm) are left to the generic pass."""
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        query = mla.q_proj if config.q_lora_rank is None else mla.q_b_proj
        query_input = config.hidden_size if config.q_lora_rank is None else config.q_lora_rank
        kv_b_rows = config.qk_nope_head_dim + config.v_head_dim
        # an even split of heads x rows-per-head rows is the rank's heads' rows (`shard_config`'s head_shard has
        # refused a head count the ranks do not divide)
        split_by_head = ((query, query_input, config.num_attention_heads * qk_head_dim, self.state),
                         (mla.kv_b_proj, config.kv_lora_rank, config.num_attention_heads * kv_b_rows, self.state))
        whole = ParallelState.single(self.kw["device"])
        latent_rows = config.kv_lora_rank + config.qk_rope_head_dim
        replicated = [(mla.kv_a_proj, config.hidden_size, latent_rows, whole)]
        if config.q_lora_rank is not None:
            replicated.append((mla.q_a_proj, config.hidden_size, config.q_lora_rank, whole))
        for part, input_size, rows, state in (*split_by_head, *replicated):
            column = ColumnParallelLinear(
                input_size, rows, state, bias=self.has_bias(part), method=self.methods.method_for(self.name(part)), **self.kw
            )  # fmt: skip
            column.load_from(self.source, self.name(part))
            _bind_rows(self.model, [self.name(part)], column, [column.output_size_per_rank])
        self.row(mla.o_proj, config.num_attention_heads * config.v_head_dim, config.hidden_size)

    def dense_mlp(self, spec: LayerSpec, config: Any) -> None:
        """gate/up by rows of the intermediate size (separate or shipped fused), down by columns."""
        name, inter = self.name, config.intermediate_size
        gate_up = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], self.state, bias=self.has_bias(spec.gate_up.parts[0]),
            method=self.methods.method_for(name(spec.gate_up.parts[0])), **self.kw,
        )  # fmt: skip
        if len(spec.gate_up.parts) == 1:  # shipped fused (Phi-3, GLM-4): gate rows, then up rows
            gate_up.load_fused(self.source, name(spec.gate_up.parts[0]))
            sizes = [gate_up.output_size_per_rank]
        else:
            gate_up.load_merged(self.source, [name(p) for p in spec.gate_up.parts])
            sizes = gate_up.output_sizes_per_rank
        _bind_rows(self.model, [name(p) for p in spec.gate_up.parts], gate_up, sizes)
        self.row(spec.down.parts[0], inter, config.hidden_size)

    def row(self, part: str, input_size: int, output_size: int) -> None:
        """A row-parallel linear (o, down): the rank's columns; the bias on rank 0 only, so that the all-reduce
        after the GEMM adds it once."""
        method = self.methods.method_for(self.name(part))
        row = RowParallelLinear(input_size, output_size, self.state, bias=self.has_bias(part), method=method, **self.kw)
        row.load_from(self.source, self.name(part))
        _bind_row(self.model, self.name(part), row, self.state.is_first_rank)

    def load_entries(self, name: str, entries: slice) -> None:
        """A per-head vector (sinks, a whole-projection norm): the rank's entries, checked against the shard's size."""
        want = submodule(self.model, name.rpartition(".")[0])._parameters[name.rpartition(".")[2]].shape[0]
        values = self.source.get_slice(name)[entries]
        if values.shape[0] != want:
            raise ValueError(f"{name}: the checkpoint's entries {entries} hold {values.shape[0]} values, expected {want}")
        _set_param(self.model, name, values.to(**self.kw))


def _load_moe(
    model: nn.Module, prefix: str, family: Family, source: Checkpoint, state: ParallelState, config: Any, kw: dict,
    methods: LinearMethods,
) -> None:  # fmt: skip
    """A sparse layer: the router (replicated) and every expert's slice of columns, through the layer's expert
    method (layers/experts.py; experts kept FP8 take the experts module's place as an `Fp8Experts`), and a shared
    expert split like a dense MLP, its gate replicated (left to the generic pass)."""
    assert family.moe is not None
    spec = spec_from_config(config)
    experts = load_experts(source, prefix, family.moe, spec, state, methods, **kw)
    params = router_tensors(source, prefix, family.moe, **kw)
    if experts.fp8 is not None:  # the rank's experts: its slice of the intermediate size (the shard's config)
        replace_experts(submodule(model, prefix), family.moe.experts, experts, spec_from_config(model.config))
    else:
        params |= expert_tensors(experts, prefix, family.moe)
    for name, tensor in params.items():
        module_path, _, attr = name.rpartition(".")
        want = submodule(model, module_path)._parameters[attr]
        if want is not None and want.shape != tensor.shape:  # a checkpoint of other sizes than its config.json's
            raise ValueError(f"{name}: the checkpoint's experts give {list(tensor.shape)}, the config {list(want.shape)}")
        if want is not None and want.dtype != tensor.dtype:  # GLM-4.5's fp32 router in a bf16 model: read as
            continue  # stored by the generic pass, in its parameter's own dtype, not through the model dtype
        _set_param(model, name, tensor)
    if family.moe.shared_expert is not None:
        shared = f"{prefix}.{family.moe.shared_expert}"
        size = spec.shared_expert_intermediate_size
        names = [f"{shared}.gate_proj", f"{shared}.up_proj"]
        gate_up_layer = MergedColumnParallelLinear(
            config.hidden_size, [size, size], state, method=methods.method_for(names[0]), **kw
        )
        gate_up_layer.load_merged(source, names)
        _bind_rows(model, names, gate_up_layer, gate_up_layer.output_sizes_per_rank)
        down = f"{shared}.down_proj"
        down_layer = RowParallelLinear(size, config.hidden_size, state, method=methods.method_for(down), **kw)
        down_layer.load_from(source, down)
        _bind_row(model, down, down_layer, bias=False)


def _param_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _bind_rows(model: nn.Module, names: list[str], layer: ColumnParallelLinear, sizes: list[int]) -> None:
    """The linears `names` become views of consecutive row blocks of the column-parallel `layer`: their
    parameters, or where the layer keeps FP8 weights, `Fp8LinearModule`s in their place holding views of its
    rows and of their scales (fused_weights finds them adjacent and copies nothing); where it keeps INT4 packed,
    `Int4LinearModule`s holding each logical output's `Int4Linear` (one for a fused-shipped linear)."""
    parts = getattr(layer, "int4_parts", None)
    if parts is not None:
        parts = parts if len(parts) == len(names) else [Int4Linear.concat(parts)]
        offset = 0
        for linear, part in zip(names, parts, strict=True):
            size = part.out_features
            bias = None if layer.bias is None else layer.bias[offset : offset + size]
            replace_module(model, linear, Int4LinearModule(part, bias))
            offset += size
        return
    if isinstance(layer.method, Fp8LinearMethod):
        offset = 0
        for linear, part in zip(names, fp8_parts(layer, sizes), strict=True):
            size = part.out_features
            bias = None if layer.bias is None else layer.bias[offset : offset + size]
            replace_module(model, linear, Fp8LinearModule(layer.method, part, bias))
            offset += size
        return
    offset = 0
    for linear, size in zip(names, sizes, strict=True):
        _set_param(model, f"{linear}.weight", layer.get_parameter("weight")[offset : offset + size])
        if layer.bias is not None:
            _set_param(model, f"{linear}.bias", layer.bias[offset : offset + size])
        offset += size

def _bind_row(model: nn.Module, name: str, layer: RowParallelLinear, bias: bool) -> None:
    """Linear `name` becomes the row-parallel `layer`'s columns (an `Fp8LinearModule` where it keeps FP8, an
    `Int4LinearModule` where it keeps INT4 packed); its bias only where `bias` (rank 0: the all-reduce after the
    GEMM adds it once)."""
    bias_part = layer.bias if bias else None
    parts = getattr(layer, "int4_parts", None)
    if parts is not None:  # kept packed INT4
        replace_module(model, name, Int4LinearModule(parts[0], bias_part))
        return
    if isinstance(layer.method, Fp8LinearMethod):
        replace_module(model, name, Fp8LinearModule(layer.method, fp8_linear_of(layer), bias_part))
        return
    _set_param(model, f"{name}.weight", layer.get_parameter("weight"))
    if submodule(model, name).bias is not None or bias_part is not None:
        _set_param(model, f"{name}.bias", bias_part)


# Mixtures of experts whose experts the reader splits by intermediate size (each rank holds every expert's slice of
# columns; the router, and GLM-4.5's correction bias, replicated, so every rank routes alike), in the checkpoint
# layouts layers/experts.py reads.
SHARDED_MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v2", "deepseek_v3")


def slice_reader_refuses(family: Family) -> str | None:
    """Why `build_shard` cannot read this family's checkpoints (None: it can), at any world size (one process
    included): a layout it does not split."""
    layer = family.layer
    if family.moe is not None and family.name not in SHARDED_MOE_FAMILIES:
        return f"{family.name}: its mixture-of-experts layers are not sharded yet"
    if len(layer.qkv.parts) not in (1, 3) or len(layer.gate_up.parts) not in (1, 2):
        return f"{family.name}: q/k/v in {len(layer.qkv.parts)} or gate/up in {len(layer.gate_up.parts)} linears"
    if family.vision is not None:
        return f"{family.name}: a vision-language model loads whole (models/vision.py)"
    return None


def load_whole_model(
    source: Checkpoint, config: Any, family: Family, device: torch.device, dtype: torch.dtype,
    methods: LinearMethods = UNQUANTIZED_MODEL,
) -> nn.Module:  # fmt: skip
    """The whole model of a checkpoint as the one shard of a world of one (no process group): a plain transformers
    model (no quantizer: `shard_config` drops quantization_config) read by slice straight onto `device`, each linear
    through its method (`methods`), ready for `generate` and the owned decoder. The one-process loader's path for
    every family `slice_reader_refuses` accepts (gpt-oss's MXFP4 experts dequantized to `dtype` by
    layers/experts.py). `config`: the model's (a multimodal checkpoint's text config, `source` under its names)."""
    model, _ = build_shard(config, family, source, ParallelState.single(device), dtype, methods)
    return model


def local_folder(name_or_path: str) -> str:
    """A checkpoint's folder: the path itself, or a hub checkpoint's files downloaded (the hub cache)."""
    return name_or_path if os.path.isdir(name_or_path) else _download(name_or_path)


def open_checkpoint(path: str, renames: dict[str, str] | None, name_or_path: str) -> Checkpoint:
    """The safetensors files of folder `path` by tensor name; under the text model's names where `renames` maps
    them. A ModelLoadError (one line) when they cannot be opened."""
    try:
        checkpoint = SafetensorsCheckpoint.from_dir(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the checkpoint {name_or_path}: {exc}") from exc
    return checkpoint if renames is None else RenamedCheckpoint(checkpoint, renames)


# What reading a hub checkpoint by slice needs: its top-level files (SafetensorsCheckpoint.from_dir reads no
# subfolder; gpt-oss's repos keep another copy of the weights under `original/`, 13 GB for 20b).
DOWNLOAD_ALLOW = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
DOWNLOAD_IGNORE = ["*/*"]


def _download(name: str) -> str:
    """A hub checkpoint's local folder (the hub cache), for reading by slice."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=DOWNLOAD_ALLOW, ignore_patterns=DOWNLOAD_IGNORE)
    except Exception as exc:  # no network, no such repo
        raise ModelLoadError(f"cannot download {name!r}: {one_line(exc)}") from exc
