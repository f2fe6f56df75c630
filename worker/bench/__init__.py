"""`cbq bench` (and `python -m worker.bench`): benchmarks, kept out of the runtime modules.

- `engine`: a workload through the engine, sync vs async, against the memory/compute floor and transformers
- `queue`: requests/s one worker process moves through Redis, with the instant FakeEngine
- `e2e`: engine-only vs through-Redis tok/s on the same requests
- `embed`: W7, bulk embedding, through the embedding engine vs sentence-transformers' `encode`
- `vision`: W6, a picture and a short prompt a request, through the engine vs transformers' `generate`, with the
  vision encoder's share of the run
- `vision-encoder`: the Qwen2.5-VL vision tower alone, transformers' sdpa vs cbq's packed attention, ms per image
- `quality`: teacher-forced logits of FP8 weights / FP8 KV vs the model dtype (mean KL, top-1 agreement)
- `common`: the workloads every benchmark draws from

Each subcommand's module is imported only when it runs, so `bench engine` needs no Redis and nothing imports
torch before a model is loaded. Benchmarks are not tests: run them on purpose and record the command with the
results (see benchmarks/).
"""

from __future__ import annotations

import click

from producer.lazy_group import LazyGroup


@click.group(
    "bench",
    cls=LazyGroup,
    lazy_commands={
        "engine": "worker.bench.engine:engine_bench",
        "queue": "worker.bench.queue:queue_bench",
        "e2e": "worker.bench.e2e:e2e_bench",
        "quality": "worker.bench.quality:quality_bench",
        "embed": "worker.bench.embed:embed_bench",
        "vision": "worker.bench.vision:vision_bench",
        "vision-encoder": "worker.bench.vision_encoder:vision_encoder_bench",
    },
)
def bench():
    """Benchmarks: engine throughput (GPU or CPU), queue throughput, end-to-end through Redis, FP8 quality,
    bulk embedding, images in bulk."""
