"""One rank's shard of a model (built by shard_build.py; loaded, checked and refused here): a transformers model built at the rank's sizes, its weights loaded through the
parallel layers (layers/), each reading only its slice of the checkpoint.

Owns nothing after building: returns the shard model (which owns its parameters) and its `TensorParallel`.

The shard model is the family's own transformers class built from a per-rank config (`shard_config`: the
rank's q heads, KV heads and intermediate size; head_dim written out so it does not change), so the owned
decoder (decoder.py) reads it as it reads any model and runs the existing kernels on the smaller shapes. Its
parameters are views of the parallel layers' weights: q/k/v rows of one `QKVParallelLinear`, gate/up rows of
one `MergedColumnParallelLinear` (so fused_weights.py finds them adjacent and copies nothing), o and down the
columns of a `RowParallelLinear` (their bias on rank 0 only: the all-reduce then adds it once), the embedding
and LM head a `VocabParallelEmbedding`'s padded vocabulary rows, attention sinks the rank's q heads' entries, a
sparse layer's experts their intermediate columns (layers/experts.py). Norms and per-head q/k norms are
replicated; q/k norms over the whole projection (OLMo 2) hold the rank's heads' entries. Its transformers
forward computes only this rank's part: only the owned decoder, with `TensorParallel`'s collectives, runs it.

Multi-head latent attention (DeepSeek-V2/V3), which no owned decoder runs yet, is the exception: its shard holds the
rank's heads of the query projection and kv_b_proj (rows) and of o_proj (columns), the latent's projection and norms
whole (every rank caches the whole latent), the dense first layers and the experts and shared experts split as for
any family, and runs transformers' forward with cbq's latent attention, the collectives put into its modules at the
end of loading (`put_collectives_in_modules`: layers/tensor_parallel.py's `ReducedOutput` and `GatheredLogits`).

The config's `vocab_size` stays the full vocabulary (the engine validates ids and builds grammars with it).

A preset (random weights) has no files: each rank builds the whole model with the same seed on its device,
as `load_model` does, and keeps its shards. A checkpoint is read by slice (`SafetensorsCheckpoint`; a multimodal
one's language model through `RenamedCheckpoint`; gpt-oss's MXFP4 experts dequantized by slice; a dense FP8
checkpoint's linears with their scales, and `--quantization fp8` on the rank's shard: shard_fp8.py; an FP8
mixture of experts' experts dequantized from the inner checkpoint by layers/experts.py).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from ..checkpoint import Checkpoint
from ..config import EngineConfig
from ..families.spec import Family
from ..fused_weights import submodule
from ..layers.tensor_parallel import GatheredLogits, ReducedOutput, TensorParallel
from ..moe import moe_layer_ids
from ..parallel.group import ParallelState
from ..parallel.memory import DecoderShape, check_fits
from ..quant import Fp8Config, QuantConfig
from ..quant.linear import keeps_fp8, replace_module
from . import PRESETS, ModelLoadError, family_for, load_model, loader, resolve_dtype
from .shard_build import ModelSource, build_shard, local_folder, open_checkpoint
from .shard_fp8 import Fp8ShardSource, keep_fp8_linears, quantize_shard

__all__ = ["TensorParallel", "load_shard", "unsupported_reason"]  # the runner's; building is shard_build.py's


# --- what is sharded, and what is refused ---------------------------------------------------------------

# Mixtures of experts whose experts are split by intermediate size (each rank holds every expert's slice of
# columns; the router, and GLM-4.5's correction bias, replicated, so every rank routes alike), in the checkpoint
# layouts layers/experts.py reads.
SHARDED_MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v2", "deepseek_v3")


def unsupported_reason(family: Family, engine_config: EngineConfig) -> str | None:
    """Why this model or setting cannot run sharded yet (None: it can). Each is a layout or kernel the sharded
    path does not split correctly, refused rather than computed wrong."""
    layer = family.layer
    if family.mla is not None and engine_config.deterministic:
        return f"{family.name}: multi-head latent attention runs no --deterministic yet"
    if family.moe is not None and family.name not in SHARDED_MOE_FAMILIES:
        return f"{family.name}: its mixture-of-experts layers are not sharded yet"
    if len(layer.qkv.parts) not in (1, 3) or len(layer.gate_up.parts) not in (1, 2):
        return f"{family.name}: q/k/v in {len(layer.qkv.parts)} or gate/up in {len(layer.gate_up.parts)} linears"
    if engine_config.decoder == "hf":
        return "tensor parallelism runs the owned decoder only (not decoder 'hf')"
    return None



# --- loading (every rank) ----------------------------------------------------------------------------


def load_shard(name_or_path: str, state: ParallelState, engine_config: EngineConfig, keep_fp8: bool | None = None):
    """(shard model, TensorParallel, tokenizer) of rank `state.rank`. The tokenizer is rank 0's only (None on
    the others). `keep_fp8`: FP8 linears stay FP8 (`Fp8LinearModule`, shard_fp8.py) rather than dequantized;
    None: where FP8 tensor cores run them (sm89+ CUDA), as load_model decides. Raises ModelLoadError (one line)
    for what the sharded path does not run."""
    device = state.device
    dtype = resolve_dtype(engine_config.dtype, device)
    keep_fp8 = keeps_fp8(device) if keep_fp8 is None else keep_fp8
    tokenizer = None
    quant: QuantConfig | None = None
    if name_or_path in PRESETS:
        # NOTE: every rank builds the whole random model (the same seed, as load_model does) and keeps its
        # shards; a checkpoint is read by slice instead.
        full, tokenizer = load_model(name_or_path, device, dtype, seed=engine_config.seed)
        config, generation_config = full.config, full.generation_config
        _check(config, engine_config)
        quant = loader._quantization(config, engine_config.quantization)
        source: Checkpoint = ModelSource(dict(full.state_dict()))
    else:
        config = loader._load_config(name_or_path)
        _check(config, engine_config)
        quant = loader._quantization(config, engine_config.quantization)  # None for gpt-oss's MXFP4 (read by slice)
        family, _ = family_for(config)
        # a multimodal checkpoint (Gemma 3 4B-27B): its language model's config, its weights under the text names
        text_config, renames = loader._text_model(config, family)
        path = local_folder(name_or_path)
        generation_config = loader._load_generation_config(path, config)
        if state.is_first_rank:
            eos = loader.checkpoint_eos_token_ids(config, generation_config)
            tokenizer = loader._load_tokenizer(path, eos)
        source = open_checkpoint(path, renames, name_or_path)
        if quant is not None and quant.is_serialized and not isinstance(quant, Fp8Config):
            raise ModelLoadError(
                f"{name_or_path}: {quant.quant_method} INT4 checkpoints run in one process (--tensor-parallel-size 1)"
            )
        if isinstance(quant, Fp8Config) and quant.is_serialized:  # FP8 weights read by slice with their scales
            source = Fp8ShardSource(source, quant, keep_fp8, _stays_dense(text_config, family))
        config = text_config
    family, _ = family_for(config)
    fp8_source = source if isinstance(source, Fp8ShardSource) and keep_fp8 else None
    if device.type == "cuda":  # FP8 weights kept: their linears at 1 byte (converted layer by layer at load)
        _check_fits(config, family, state, dtype, name_or_path, 1 if fp8_source is not None else None)
    after_layer = None if fp8_source is None else (lambda model: keep_fp8_linears(model, fp8_source))
    model, tp = build_shard(config, family, source, state, dtype, after_layer)
    if engine_config.deterministic:  # partial sums in rank order: a row's bits never follow the step's size
        tp = dataclasses.replace(tp, fixed_order=True)
    if isinstance(quant, Fp8Config) and not quant.is_serialized:  # --quantization fp8
        quantize_shard(
            model, quant, state, _row_parallel_linears(config, family), keep_fp8, _stays_dense(config, family)
        )
    if family.mla is not None:  # transformers' forward runs it: the collectives go into its modules
        put_collectives_in_modules(model, family, config, tp)
    model.generation_config = generation_config
    del source
    if device.type == "cuda":
        torch.cuda.empty_cache()  # a preset's whole model is gone: its blocks are free for the KV cache
    return model, tp, tokenizer



def put_collectives_in_modules(model: Any, family: Family, config: Any, tp: TensorParallel) -> None:
    """A shard that runs transformers' own forward (multi-head latent attention: no owned decoder yet) with the
    collectives the owned decoder would run, as modules in the places of the ones whose outputs are partial
    (layers/tensor_parallel.py): the input embedding the vocabulary-parallel one (its all-reduce), each o_proj, each
    dense MLP's down_proj and each sparse MLP (its experts' and shared experts' partial sums, added first: one
    all-reduce) a `ReducedOutput`, the LM head a `GatheredLogits`. Run last: the FP8 and `--quantization fp8` paths
    swap linears by their names, which the wrapping changes (o_proj.weight -> o_proj.inner.weight)."""
    sparse = set(moe_layer_ids(config)) if family.moe is not None else set()
    sparse_mlp = None if family.moe is None else family.moe.router.rpartition(".")[0]  # the router's parent
    for i, layer in enumerate(submodule(model, family.layers_path)):
        for path in (family.layer.o.parts[0], sparse_mlp if i in sparse else family.layer.down.parts[0]):
            assert path is not None, "a sparse layer is a family's with a sparse MLP"
            replace_module(layer, path, ReducedOutput(submodule(layer, path), tp))
    replace_module(model, family.embed_path, tp.embedding)
    head = model.get_output_embeddings()
    head_path = next(name for name, module in model.named_modules() if module is head)
    replace_module(model, head_path, GatheredLogits(head.weight, tp))


def _stays_dense(config: Any, family: Family):
    """Whether a module stays in the model dtype under FP8: those under a mixture of experts' sparse MLPs, which
    cbq's MoE kernels multiply unquantized (as one process loads them)."""
    sparse = loader.sparse_layers(config, family)
    return (lambda _: False) if sparse is None else sparse.holds


def _row_parallel_linears(config: Any, family: Family) -> frozenset[str]:
    """The linears whose rows a rank holds part of (o and down: split by columns)."""
    layer = family.layer
    return frozenset(
        f"{family.layers_path}.{i}.{part}"
        for i in range(config.num_hidden_layers)
        for part in (layer.o.parts[0], layer.down.parts[0])
    )


def _check_fits(
    config: Any,
    family: Family,
    state: ParallelState,
    dtype: torch.dtype,
    model_name: str,
    linear_bytes_per_param: float | None = None,
) -> None:
    """A ModelLoadError with the numbers when this rank's GPU cannot hold its shard (memory.py)."""
    shape = DecoderShape.from_config(config, qk_norm=family.layer.q_norm is not None)
    free_bytes = torch.cuda.mem_get_info(state.device)[0]
    try:
        # the other ranks check their own GPUs: only this rank's free bytes count here (its place names it)
        check_fits(
            shape, state.world_size, dtype.itemsize, [sys.maxsize] * state.rank + [free_bytes], model_name,
            linear_bytes_per_param,
        )  # fmt: skip
    except ValueError as exc:
        raise ModelLoadError(f"{exc} ({state.device})") from None


def _check(config: Any, engine_config: EngineConfig) -> None:
    family, _ = family_for(config)
    reason = unsupported_reason(family, engine_config)
    if reason is not None:
        raise ModelLoadError(f"tensor parallelism: {reason}")
