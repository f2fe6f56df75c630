"""Prometheus metrics of one worker, served by `cbq worker --metrics-port N`. Owns the metric names.

A collector reads, at scrape time, what the worker and its engine already count (`EngineStats`, the worker's
finished-request counters) and the depth of its rq queues: the step loop does no extra work for metrics, and
the numbers are the same as `cbq stats` shows. Counters are cumulative since the worker started.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class WorkerCollector:
    """Collects from a running `CbqWorker` (anything with `engine`, `queues`, `num_*_finished`)."""

    def __init__(self, worker):
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self.worker
        stats = worker.engine.stats()
        labels = ["worker"]
        name = [worker.name]

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=labels)
            family.add_metric(name, value)
            return family

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=labels)
            family.add_metric(name, value)
            return family

        yield counter(
            "cbq_worker_requests_finished", "Requests written back to Redis.", worker.num_requests_finished
        )
        yield counter("cbq_worker_jobs_finished", "Chunk jobs finished (rq jobs).", worker.num_jobs_finished)
        if (replica_wait := worker.writer.replica_wait) is not None:  # --redis-wait-replicas
            yield counter(
                "cbq_worker_replica_wait_shortfalls",
                "Result writes that reached fewer Redis replicas than --redis-wait-replicas within its timeout.",
                replica_wait.shortfalls,
            )
        kind = GaugeMetricFamily(
            "cbq_worker_model_kind",
            "1 for the kind of model this worker serves: generate (completions, chat) or embed (embeddings).",
            labels=[*labels, "model_kind"],
        )
        served_kind = getattr(getattr(worker, "model_task", None), "kind", "generate")
        for model_kind in ("generate", "embed"):
            kind.add_metric([*name, model_kind], 1.0 if served_kind == model_kind else 0.0)
        yield kind
        tokens = CounterMetricFamily(
            "cbq_engine_tokens", "Tokens computed by the engine.", labels=[*labels, "kind"]
        )
        tokens.add_metric([*name, "prompt"], stats.prompt_tokens)
        tokens.add_metric([*name, "completion"], stats.output_tokens)
        yield tokens
        yield counter("cbq_engine_steps", "Engine steps run.", stats.steps)
        yield counter(
            "cbq_engine_busy_seconds",
            "Device time of all steps (step time = rate / steps rate).",
            stats.busy_seconds,
        )
        yield counter(
            "cbq_engine_cpu_prep_seconds",
            "CPU time preparing steps (scheduling, batch building).",
            stats.cpu_prep_seconds,
        )
        yield counter(
            "cbq_engine_preemptions",
            "Requests preempted for KV space (recomputed later).",
            stats.num_preemptions,
        )
        yield gauge(
            "cbq_engine_gpu_busy_ratio",
            "Device busy time / wall time since the engine started.",
            stats.busy_fraction,
        )
        yield gauge(
            "cbq_engine_step_seconds_mean",
            "Mean device time of one step since start.",
            stats.busy_seconds / stats.steps if stats.steps else 0.0,
        )
        in_flight = GaugeMetricFamily(
            "cbq_engine_requests", "Requests inside the engine.", labels=[*labels, "state"]
        )
        in_flight.add_metric([*name, "running"], stats.num_running)
        in_flight.add_metric([*name, "waiting"], stats.num_waiting)
        yield in_flight
        yield gauge(
            "cbq_engine_kv_blocks_used", "Paged KV blocks held by requests.", stats.num_kv_blocks_used
        )
        yield gauge("cbq_engine_kv_blocks_total", "Usable paged KV blocks.", stats.num_kv_blocks_total)
        yield counter(
            "cbq_engine_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield counter(
            "cbq_engine_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hits,
        )
        depth = GaugeMetricFamily("cbq_queue_depth", "Chunk jobs waiting in the rq queue.", labels=["queue"])
        for queue in worker.queues:
            depth.add_metric([queue.name], queue.count)
        yield depth


def serve_metrics(worker, port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics for `worker` on a daemon thread (prometheus_client's own HTTP server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker))
    start_http_server(port, addr=addr, registry=registry)
