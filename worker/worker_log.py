"""What a worker says in its log: the startup description of its engine, and a periodic one-line summary in
place of rq's line per finished chunk job (782 lines for 50k requests). Owns those lines and nothing else;
it reads the engine's and the worker's public counters, from a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

RQ_LOGGER = "rq.worker"  # rq's worker logs here; `CbqWorker.work` sets its handler and level
DEFAULT_SUMMARY_INTERVAL_SECONDS = 60.0
_PER_CHUNK_PREFIX = "Successfully completed"  # rq's INFO line for every finished job


def describe_engine(engine: Any, model: str, served_name: str) -> str:
    """One line: model, served name, device, dtype, decoder path, KV capacity and the concurrency it allows at
    full context. `engine` is an `Engine` (anything else, e.g. the FakeEngine, gets a short line)."""
    describe = getattr(engine, "describe", None)  # the embedding engine says its own
    if describe is not None:
        return describe(model, served_name)
    runner = getattr(engine, "runner", None)
    if runner is None:
        return f"engine: {type(engine).__name__} (no model), served as {served_name}"
    config = engine.config
    decoder = runner.decoder
    if decoder is None:
        decoder_path = "transformers decoder"
    elif getattr(decoder, "small_step_ops", None) is not None:
        decoder_path = "owned decoder, Triton small-step GEMMs"
    else:
        decoder_path = "owned decoder, cuBLAS"
    num_blocks = engine.blocks.num_usable_blocks
    kv_tokens = num_blocks * config.block_size
    device = engine.device
    if device.type == "cuda":
        import torch

        device_text = f"{device} ({torch.cuda.get_device_name(device)})"
    else:
        device_text = str(device)
    tp = getattr(config, "tensor_parallel_size", 1)
    if tp > 1:
        device_text += f" and {tp - 1} more ranks (tensor parallel {tp}; KV blocks per rank)"
    return (
        f"engine: model {model}, served as {served_name}, {device_text}, {str(engine.model.dtype).removeprefix('torch.')}, "
        f"{decoder_path}, {config.mode} loop, {len(runner.graphs)} CUDA graphs; KV cache {num_blocks} blocks = "
        f"{kv_tokens} tokens; context {engine.max_model_len} tokens, "
        f"{kv_tokens / engine.max_model_len:.1f} requests at full context (max {config.max_num_seqs} running)"
    )


class _DemotePerChunkLines(logging.Filter):
    """rq logs every finished job at INFO; a cbq worker finishes hundreds of chunks, so those lines go to
    DEBUG (and are dropped unless the logger is at DEBUG). The periodic summary says the same in one line."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self._logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and str(record.msg).startswith(_PER_CHUNK_PREFIX):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return self._logger.isEnabledFor(logging.DEBUG)
        return True


def demote_per_chunk_lines() -> None:
    """Install the filter on rq's worker logger (once per process)."""
    logger = logging.getLogger(RQ_LOGGER)
    if not any(isinstance(f, _DemotePerChunkLines) for f in logger.filters):
        logger.addFilter(_DemotePerChunkLines(logger))


class PeriodicSummary:
    """Every `interval_seconds`, one INFO line on rq's worker logger: requests and chunks finished since the
    last line, output tok/s over that interval, requests running and waiting in the engine, KV blocks in use.
    Used as a context manager around `worker.work()`."""

    def __init__(self, worker: Any, interval_seconds: float = DEFAULT_SUMMARY_INTERVAL_SECONDS):
        self.worker = worker
        self.interval_seconds = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cbq-log-summary", daemon=True)
        self._last = (time.monotonic(), 0, 0, 0)  # (time, requests, jobs, output tokens)

    def __enter__(self) -> PeriodicSummary:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def line(self) -> str:
        """The summary since the previous call."""
        stats = self.worker.engine.stats()
        now = time.monotonic()
        then, requests, jobs, tokens = self._last
        self._last = (
            now,
            self.worker.num_requests_finished,
            self.worker.num_jobs_finished,
            stats.output_tokens,
        )
        seconds = max(now - then, 1e-9)
        kv = (
            f", KV {stats.num_kv_blocks_used / stats.num_kv_blocks_total:.0%} used"
            if stats.num_kv_blocks_total
            else ""
        )
        return (
            f"Worker {self.worker.name}: last {seconds:.0f} s: {self.worker.num_requests_finished - requests} "
            f"requests in {self.worker.num_jobs_finished - jobs} chunks finished, "
            f"{(stats.output_tokens - tokens) / seconds:.1f} output tok/s; {stats.num_running} running, "
            f"{stats.num_waiting} waiting{kv}"
        )

    def _run(self) -> None:
        logger = logging.getLogger(RQ_LOGGER)
        while not self._stop.wait(self.interval_seconds):
            try:
                logger.info(self.line())
            except Exception:  # a summary is informational: never let it end the thread noisily
                logger.debug("worker summary failed", exc_info=True)
