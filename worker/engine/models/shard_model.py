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

Multi-head latent attention (DeepSeek-V2/V3): its shard holds the rank's heads of the query projection and kv_b_proj
(rows) and of o_proj (columns), the latent's projection and norms whole (every rank caches the whole latent), the dense
first layers and the experts and shared experts split as for any family. `--decoder owned` runs it on the owned
decoder (latent_layer.py over the rank's heads) with `TensorParallel`'s collectives, as any family; "auto" still runs
transformers' forward with cbq's latent attention until the owned latent path has run on a GPU, the collectives put
into its modules at the end of loading (`put_collectives_in_modules`: layers/tensor_parallel.py's `ReducedOutput` and
`GatheredLogits`).

The config's `vocab_size` stays the full vocabulary (the engine validates ids and builds grammars with it).

A preset (random weights) has no files: each rank builds the whole model with the same seed on its device,
as `load_model` does, and keeps its shards. A checkpoint is read by slice (`SafetensorsCheckpoint`; a multimodal
one's language model through `RenamedCheckpoint`; gpt-oss's MXFP4 experts dequantized by slice; an FP8 mixture of
experts' experts dequantized by layers/experts.py).

Quantized linears: each parallel linear takes its method from `LinearMethods.method_for(prefix)` (quant/methods.py)
and reads its slices through it, the same code at every world size:
  per-channel  a column-parallel rank's rows keep their rows' scales; a row-parallel rank (o, down) holds every
               scale (a row's scale covers all its columns, on every rank)
  per-tensor   q/k/v's (or gate/up's) own scales, one each; fused per channel where they differ, as in one process
  block-wise   the rank's [128, 128] blocks: its slice must start and end on block boundaries, refused in one line
               where the shard boundary cuts a block (e.g. 64-dim KV heads split between ranks)
  input_scale  a static per-tensor activation scale, replicated
  `--quantization fp8`  per output channel after loading; a row-parallel rank's scale is the whole row's (the
               largest of the ranks' row absmaxes: one all-gather of [N] floats per linear, at load), so every rank
               holds exactly one process's FP8 weights
  INT4         GPTQ, AWQ gemm and compressed-tensors pack-quantized (quant/int4/): the rank's packed words and its
               groups' scales and zero points; a slice that cuts a word or a group is refused in one line (e.g. an
               intermediate size whose half is not a multiple of the group, for down_proj), as is an act-order
               (g_idx) linear split by columns (o, down), whose groups are spread over every rank's columns
Kept FP8 (sm89+), a linear is an `Fp8LinearModule` viewing its layer's rows, and kept INT4 (CBQ_INT4_PACKED=1 on
CUDA) an `Int4LinearModule`; elsewhere it is dequantized after loading. Not one process's bits: a row-parallel
linear's dynamic per-token activation scale is taken over the rank's slice of the input, as vLLM does (at least as
fine as one process's, at no collective per GEMM).
Mixtures of experts: every linear under a sparse MLP stays in the model dtype (read as shipped, then
dequantized), as in one process; the experts are read by layers/experts.py.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from ..checkpoint import Checkpoint, ModelSource
from ..config import EngineConfig
from ..families.spec import Family
from ..fused_weights import submodule
from ..layers.tensor_parallel import GatheredLogits, ReducedOutput, TensorParallel
from ..moe import moe_layer_ids
from ..parallel.group import ParallelState
from ..parallel.memory import DecoderShape, check_fits
from ..quant import Fp8Config, QuantConfig
from ..quant.int4.linear import keeps_int4
from ..quant.int4.method import Int4Config
from ..quant.linear import keeps_fp8, keeps_fp8_experts, replace_module
from ..quant.methods import LinearMethods
from ..quant.protocol import LinearLoadError
from . import PRESETS, ModelLoadError, family_for, load_model, loader, resolve_dtype
from .quant_loader import AccountedCheckpoint
from .shard_build import build_shard, local_folder, open_checkpoint, slice_reader_refuses

__all__ = ["TensorParallel", "load_shard", "unsupported_reason"]  # the runner's; building is shard_build.py's


# --- what is sharded, and what is refused ---------------------------------------------------------------

def unsupported_reason(family: Family, engine_config: EngineConfig) -> str | None:
    """Why this model or setting cannot run sharded yet (None: it can). Each is a layout or kernel the sharded
    path does not split correctly, refused rather than computed wrong."""
    if family.mla is not None and engine_config.deterministic:
        return f"{family.name}: multi-head latent attention runs no --deterministic yet"
    reason = slice_reader_refuses(family)
    if reason is not None and family.vision is None:
        return reason
    if engine_config.decoder == "hf":
        return "tensor parallelism runs the owned decoder only (not decoder 'hf')"
    return None



# --- loading (every rank) ----------------------------------------------------------------------------


def load_shard(
    name_or_path: str, state: ParallelState, engine_config: EngineConfig, keep_fp8: bool | None = None,
    keep_fp8_experts: bool | None = None,
):  # fmt: skip
    """(shard model, TensorParallel, tokenizer) of rank `state.rank`. The tokenizer is rank 0's only (None on
    the others). `keep_fp8`: FP8 linears stay FP8 (`Fp8LinearModule`) rather than dequantized;
    None: where FP8 tensor cores run them (sm89+ CUDA), as load_model decides. `keep_fp8_experts`: an FP8 mixture of
    experts' experts stay FP8 too (each rank its slice of every expert's columns, with their scales: `Fp8Experts`,
    the FP8 grouped GEMMs); None: with `keep_fp8` on CUDA, as load_model decides. Raises ModelLoadError (one line)
    for what the sharded path does not run."""
    device = state.device
    dtype = resolve_dtype(engine_config.dtype, device)
    keep_fp8 = keeps_fp8(device) if keep_fp8 is None else keep_fp8
    if keep_fp8_experts is None:
        keep_fp8_experts = keeps_fp8_experts(keep_fp8, device)
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
        if quant is not None and quant.is_serialized:  # a missing scale named as one process names it
            source = AccountedCheckpoint(source)
        config = text_config
    family, _ = family_for(config)
    keep_int4 = keeps_int4(device, dtype)
    # FP8 weights kept: their linears at 1 byte, INT4 ones kept packed at about half (each layer's, as it is loaded)
    linear_bytes: float | None = 1 if isinstance(quant, Fp8Config) and keep_fp8 else None
    if isinstance(quant, Int4Config) and keep_int4:
        linear_bytes = 0.5
    sparse = loader.sparse_layers(config, family)
    if quant is not None and not quant.is_serialized and state.world_size > 1:
        # `--quantization fp8` keeps a replica's experts in the model dtype: a rank would scale its down rows over
        # its own columns, not one process's rows (the dense row-parallel linears agree on theirs at load)
        keep_fp8_experts = False
    # experts kept FP8: an FP8 release's, or (one rank) quantized per channel as they are read
    kept_experts = keep_fp8_experts and sparse is not None and sparse.fp8_format(quant) is not None
    if device.type == "cuda":
        _check_fits(config, family, state, dtype, name_or_path, linear_bytes, expert_bytes=1 if kept_experts else None)
    methods = LinearMethods(
        quant, keep_fp8, loader.stays_dense(sparse), keep_fp8_experts=keep_fp8_experts, keep_int4=keep_int4
    )
    try:
        model, tp = build_shard(config, family, source, state, dtype, methods)
    except LinearLoadError as exc:  # a checkpoint tensor that does not fit its format or the rank's split
        raise ModelLoadError(str(exc)) from None
    if engine_config.deterministic:  # partial sums in rank order: a row's bits never follow the step's size
        tp = dataclasses.replace(tp, fixed_order=True)
    if family.mla is not None and engine_config.decoder != "owned":  # transformers' forward runs it (decoder.py
        put_collectives_in_modules(model, family, config, tp)  # `build_decoder`): the collectives go into its modules
    model.generation_config = generation_config
    del source
    if device.type == "cuda":
        torch.cuda.empty_cache()  # a preset's whole model is gone: its blocks are free for the KV cache
    return model, tp, tokenizer



def put_collectives_in_modules(model: Any, family: Family, config: Any, tp: TensorParallel) -> None:
    """A shard that runs transformers' own forward (multi-head latent attention under decoder "auto") with the collectives the owned decoder would run, as modules in the places of the ones whose outputs
    are partial (layers/tensor_parallel.py): the input embedding the vocabulary-parallel one (its all-reduce), each
    o_proj, each dense MLP's down_proj and each sparse MLP (its experts' and shared experts' partial sums, added
    first: one all-reduce) a `ReducedOutput`, the LM head a `GatheredLogits`. Run last: the FP8 and `--quantization
    fp8` paths swap linears by their names, which the wrapping changes (o_proj.weight -> o_proj.inner.weight)."""
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


def _check_fits(
    config: Any,
    family: Family,
    state: ParallelState,
    dtype: torch.dtype,
    model_name: str,
    linear_bytes_per_param: float | None = None,
    expert_bytes: float | None = None,
) -> None:
    """A ModelLoadError with the numbers when this rank's GPU cannot hold its shard (memory.py). `expert_bytes`: a
    routed expert weight's bytes where they differ from the model dtype's (1: kept FP8)."""
    shape = DecoderShape.from_config(config, qk_norm=family.layer.q_norm is not None)
    free_bytes = torch.cuda.mem_get_info(state.device)[0]
    try:
        # the other ranks check their own GPUs: only this rank's free bytes count here (its place names it)
        check_fits(
            shape, state.world_size, dtype.itemsize, [sys.maxsize] * state.rank + [free_bytes], model_name,
            linear_bytes_per_param, expert_bytes,
        )  # fmt: skip
    except ValueError as exc:
        raise ModelLoadError(f"{exc} ({state.device})") from None


def _check(config: Any, engine_config: EngineConfig) -> None:
    family, _ = family_for(config)
    reason = unsupported_reason(family, engine_config)
    if reason is not None:
        raise ModelLoadError(f"tensor parallelism: {reason}")
