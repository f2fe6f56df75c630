"""A tensor-parallel replica: the engine built over rank 0's model runner, and a helper rank's life.

Owns nothing after building: rank 0's `RankGroup` and control channel are its runner's `Replica`
(parallel/messages.py); each rank runs the one `ModelRunner`, told its rank by that data. The engine, its
scheduler, block manager, tokenizer and grammar matchers live on rank 0 only; the helpers hold a model shard, a
KV cache for their heads and a batch builder, nothing else.

Each step (rank 0, `ModelRunner.launch`): build the step into the next IO slot (a step that cannot be built is refused there, before any rank sees it), send its `StepDescription` to the helpers
(messages.py), then run the same forward as they do: every rank enters the layers' collectives
(layers/tensor_parallel.TensorParallel) in one order. Rank 0 alone samples, from the logits gathered on it. In async mode a
step's decode inputs are the previous step's sampled ids, read on the device (carry-over), so rank 0 broadcasts
each step's sampled ids to the helpers' own IO slots, and every rank fills the placeholders the same way.

A helper (`serve_rank`, spawned by group.launch_ranks) loads its shard, agrees with the others on the number of
KV blocks (the smallest any rank has room for: block ids are shared), and runs `serve_forever` over a
`ModelRunner` until rank 0 sends Shutdown; a helper exits when rank 0 does.

Failure: a step that fails on rank 0 after its description went out (a helper died, a collective timed out,
rank 0's own forward raised) leaves the ranks out of step, so it ends the group and is raised as a
`RankFailure`, which the engine's loop does not survive (the worker then exits 1).

NOTE: decode steps do not replay CUDA graphs at world size > 1 yet (capturing the NCCL all-reduce is untested
here); at world size 1 they do, as without tensor parallelism.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from .config import EngineConfig, context_len
from .engine import Engine
from .kv_cache import kv_cache_dtype, num_blocks_from_memory
from .model_runner import ModelRunner
from .models import PRESETS, ModelLoadError, family_for, loader, preset_config, resolve_device
from .models.shard_model import load_shard, unsupported_reason
from .parallel.group import (
    DEFAULT_TIMEOUT_S,
    ParallelState,
    RankFailure,
    launch_ranks,
    min_over_ranks,
)
from .parallel.messages import Replica, serve_forever

logger = logging.getLogger("cbq.parallel")


def agree_num_kv_blocks(state: ParallelState, model: Any, config: EngineConfig) -> int:
    """The KV blocks every rank has room for (the smallest rank's count): a block id names the same block on
    every rank, each holding its own heads' K and V."""
    num_blocks = config.num_kv_blocks or num_blocks_from_memory(
        model.config, kv_cache_dtype(config, model.dtype), state.device, config
    )
    return min_over_ranks(state, num_blocks)


def serve_rank(
    state: ParallelState, model_name: str, config: EngineConfig, keep_fp8: bool | None = None,
    keep_fp8_experts: bool | None = None,
) -> None:  # fmt: skip
    """A helper rank's whole life (launch_ranks' target): its shard, its runner, rank 0's steps."""

    torch.set_grad_enabled(False)
    model, tp, _ = load_shard(model_name, state, config, keep_fp8, keep_fp8_experts)
    num_blocks = agree_num_kv_blocks(state, model, config)
    max_model_len = context_len(config, model.config, num_blocks)
    replica = Replica(state, None, measured=not config.num_kv_blocks, shares_samples=config.is_async)
    runner = ModelRunner(model, config, state.device, num_blocks, max_model_len, tp=tp, replica=replica)
    with torch.inference_mode():
        serve_forever(state, runner)


def sharded_model_config(model_name: str) -> Any:
    """The transformers config of a preset or checkpoint, read without its weights."""
    return preset_config(model_name) if model_name in PRESETS else loader._load_config(model_name)


def check_supported(model_name: str, config: EngineConfig) -> None:
    """Refuse (ModelLoadError, one line) what the sharded path does not run, before any rank starts."""
    model_config = sharded_model_config(model_name)
    family, _ = family_for(model_config)
    reason = unsupported_reason(family, config)
    if reason is not None:
        raise ModelLoadError(f"tensor parallelism: {reason}")


def build_sharded_engine(
    model_name: str,
    config: EngineConfig,
    *,
    world_size: int | None = None,
    backend: str | None = None,
    device_ids: list[int] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    keep_fp8: bool | None = None,
    keep_fp8_experts: bool | None = None,
):
    """An Engine whose model is split over `world_size` ranks (default `config.tensor_parallel_size`): this
    process is rank 0, the others are spawned here. World size 1 runs the same sharded code in this process
    (the tests' way to run it on one GPU). `backend` / `device_ids`: group.launch_ranks'; gloo lets several
    ranks share one GPU (tests). `keep_fp8`, `keep_fp8_experts`: load_shard's (the tests keep FP8 on the CPU, its
    GEMMs emulated)."""
    world_size = world_size or config.tensor_parallel_size
    config = dataclasses.replace(config, tensor_parallel_size=world_size)
    check_supported(model_name, config)
    device = resolve_device(config.device)
    if device_ids is None and device.type == "cuda":
        first = device.index or 0
        device_ids = list(range(first, first + world_size))
    engines: list[Engine] = []  # the engine, once built: a helper's death ends its loop even while it idles

    def end_the_loop(failure: RankFailure) -> None:
        logger.error("%s", failure)
        for engine in engines:
            engine.fail(failure)

    group = launch_ranks(
        world_size, serve_rank, (model_name, config, keep_fp8, keep_fp8_experts), device_type=device.type, device_ids=device_ids,
        timeout_s=timeout_s, backend=backend, on_failure=end_the_loop,
    )  # fmt: skip
    try:
        model, tp, tokenizer = load_shard(model_name, group.state, config, keep_fp8, keep_fp8_experts)
        num_blocks = agree_num_kv_blocks(group.state, model, config)
    except RankFailure:
        group.close(timeout_s=0)
        raise
    except ModelLoadError:  # rank 0's own, clearer than a helper's exit for the same reason
        group.close(timeout_s=0)
        raise
    except Exception as error:
        raise group.failure_after(error) from error
    measured = not config.num_kv_blocks
    config = dataclasses.replace(config, num_kv_blocks=num_blocks)

    def make_runner(model, config, device, num_kv_blocks, max_model_len) -> ModelRunner:
        replica = Replica(group.state, group, measured=measured, shares_samples=config.is_async)
        return ModelRunner(model, config, device, num_kv_blocks, max_model_len, tp=tp, replica=replica)

    try:
        engines.append(Engine(model, tokenizer, config, make_runner=make_runner))
    except BaseException:
        group.close(timeout_s=0)
        raise
    return engines[0]
