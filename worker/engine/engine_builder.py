"""Build an engine for a model name: in this process, or as rank 0 of a tensor-parallel replica. Owns nothing.

Above both the engine and the replica's runner (ranks.py builds an Engine over rank 0's ModelRunner and its Replica), so
that neither imports the other's builder: what callers with a `--tensor-parallel-size` (the worker, `cbq run`,
the offline LLM, the benchmarks) call.
"""

from __future__ import annotations

from typing import Any

from .config import EngineConfig
from .engine import Engine
from .ranks import build_sharded_engine


def build_engine(model: str = "tiny-llama", **config_overrides: Any) -> Engine:
    """`Engine.from_model`, or at `tensor_parallel_size` > 1 the replica's rank 0 (its helper ranks spawned); for
    a sentence-transformers checkpoint (a folder with modules.json), the embedding engine (worker/embedding)."""
    from worker.embedding.checkpoint import is_embedding_checkpoint

    if is_embedding_checkpoint(model):
        from worker.embedding.engine import build_embedding_engine

        return build_embedding_engine(model, **config_overrides)  # type: ignore[return-value]  # an EngineProtocol
    config = EngineConfig(**config_overrides)
    if config.tensor_parallel_size > 1:
        return build_sharded_engine(model, config)
    return Engine.from_model(model, **config_overrides)
