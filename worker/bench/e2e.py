"""`cbq bench e2e`: end-to-end throughput through Redis and rq as a fraction of engine-only throughput.

Same process, same model, same requests: first `engine.generate` on the token ids (engine only), then
the requests are submitted as JSONL lines to Redis and a burst `CbqWorker` drains them through the
same engine. The ratio shows what the queue (Redis I/O, tokenization, bookkeeping in the worker's main
thread, competing with the engine thread for the GIL) costs the engine.

The engine runs with prefix caching off: both runs send the same prompts, and with caching on the second
run reused the first's KV (on the H200 that read as 1.189 "end-to-end / engine-only", 1.007 with caching
off), which measures the cache, not the queue.
"""

from __future__ import annotations

import json
import time

import click

from producer import settings
from worker.bench.common import WORKLOADS, make_workload, workload_lines
from worker.engine.config import EngineConfig

ENGINE_DEFAULTS = EngineConfig()


@click.command("e2e")
@click.option("--model", default="llama3-8b", show_default=True)
@click.option("--workload", type=click.Choice(list(WORKLOADS)), default="W2", show_default=True)
@click.option("--num-requests", type=int, default=None)
@click.option(
    "--redis-url",
    default="redis://127.0.0.1:6379/15",
    show_default=True,
    help="A database this benchmark may flush.",
)
@click.option("--chunk-size", type=int, default=settings.DEFAULT_CHUNK_SIZE, show_default=True)
@click.option("--max-num-seqs", type=int, default=ENGINE_DEFAULTS.max_num_seqs, show_default=True)
@click.option(
    "--max-num-batched-tokens", type=int, default=ENGINE_DEFAULTS.max_num_batched_tokens, show_default=True
)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
def e2e_bench(
    model, workload, num_requests, redis_url, chunk_size, max_num_seqs, max_num_batched_tokens, json_out
):
    """Engine-only vs through-Redis output tok/s on the same requests, in one process."""
    from producer.store import SubmitOptions, submit_batch, validate_lines
    from worker.engine.api import EngineRequest
    from worker.engine.engine import Engine
    from worker.queue_worker import CbqWorker

    engine = Engine.from_model(
        model,
        mode="async",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,  # the second run must not reuse the first's prompts (module docstring)
    )
    lines = workload_lines(workload, num_requests)
    parsed = [json.loads(line) for line in lines]
    reqs = [
        EngineRequest(p["custom_id"], engine.tokenizer.encode(p["prompt"]), sampling)
        for p, sampling in zip(parsed, (_sampling(p) for p in parsed), strict=True)
    ]
    engine.generate(make_workload("tiny", 256, seed=1))  # warm-up: kernels compiled, graphs used

    engine.reset_stats()
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    engine_seconds = time.perf_counter() - t0
    engine_tokens = sum(len(r.token_ids) for r in results)
    engine_prompt_tokens = engine.stats().prompt_tokens

    conn = settings.connect(redis_url)
    conn.flushdb()
    t0 = time.perf_counter()
    validated = validate_lines(lines)
    if validated.errors:
        raise click.ClickException(f"the workload has invalid lines: {validated.errors[:3]}")
    report = submit_batch(conn, validated.requests, SubmitOptions(queue="cbq-bench", chunk_size=chunk_size))
    submit_seconds = time.perf_counter() - t0
    engine.reset_stats()
    worker = CbqWorker(["cbq-bench"], engine, connection=conn, model_name=model, mode="async")
    t0 = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING")
    queue_seconds = time.perf_counter() - t0
    queue_stats = engine.stats()
    queue_tokens = queue_stats.output_tokens
    if worker.num_requests_finished != len(lines):
        raise click.ClickException(
            f"the worker finished {worker.num_requests_finished} of {len(lines)} requests"
        )

    engine_tok_s = engine_tokens / engine_seconds
    queue_tok_s = queue_tokens / queue_seconds
    out = {
        "workload": workload,
        "model": model,
        "num_requests": len(lines),
        "batch_id": report.batch_id,
        "engine_only": {
            "output_tokens": engine_tokens,
            "seconds": engine_seconds,
            "output_tok_s": engine_tok_s,
            "prompt_tokens_computed": engine_prompt_tokens,
        },
        "through_redis": {
            "output_tokens": queue_tokens,
            "seconds": queue_seconds,
            "output_tok_s": queue_tok_s,
            "submit_seconds": submit_seconds,
            "prompt_tokens_computed": queue_stats.prompt_tokens,
            "prefix_cache_hits": queue_stats.prefix_cache_hits,
        },
        "ratio": queue_tok_s / engine_tok_s,
        "prefix_caching": False,
        "date": time.strftime("%Y-%m-%d"),
    }
    click.echo(f"{'path':>14} | {'out tok/s':>10} | {'seconds':>8}")
    click.echo(f"{'engine only':>14} | {engine_tok_s:>10,.0f} | {engine_seconds:>8.1f}")
    click.echo(f"{'through redis':>14} | {queue_tok_s:>10,.0f} | {queue_seconds:>8.1f}")
    click.echo(
        f"end-to-end / engine-only: {out['ratio']:.3f} (submit took {submit_seconds:.2f} s, not counted)"
    )
    if json_out:
        with open(json_out, "w") as f:
            json.dump(out, f, indent=2)


def _sampling(line: dict):
    from worker.engine.api import SamplingParams

    return SamplingParams(max_new_tokens=line["max_new_tokens"], ignore_eos=True)
