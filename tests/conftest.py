"""Fixtures for the queue tests: a redis-server of the test session's own and an in-process fakeredis.

`conn` runs a test once against each: fakeredis always, and a real redis-server that this session starts on a
free port (skipped where `redis-server` is not installed). No test ever touches a server it did not start:
CBQ_TEST_REDIS_URL points the tests at another server only when a person sets it, and its db is flushed.
"""

from __future__ import annotations

import os
import shutil
import sys

import fakeredis
import pytest
import redis

from tests.reliability.harness import RedisServer


def pytest_configure(config):
    _share_the_cores_between_xdist_workers()
    _cap_the_gpu_share()


def _share_the_cores_between_xdist_workers() -> None:
    """Under pytest-xdist (`-n N`), each of the N worker processes would start one torch (OpenMP) thread per
    core, N times as many busy threads as cores; each worker, and the processes its tests start, get their
    share of the cores instead. OMP_NUM_THREADS set by hand wins."""
    num_workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not num_workers or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // int(num_workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by torch when it loads, here and in subprocesses
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def _cap_the_gpu_share() -> None:
    """CBQ_TEST_GPU_SHARE=f (0 < f <= 1): this test process takes at most that share of the GPU, so that several
    groups of the `gpu` suite run side by side on one device (benchmarks/run_gpu.sh's `suite` stage): PyTorch's
    allocator is capped at the share, and an engine sizes its KV cache from the share (of the device's total,
    less what this process holds) instead of from the device's free memory, which the other processes change."""
    share = os.environ.get("CBQ_TEST_GPU_SHARE")
    if not share:
        return
    import torch

    if not torch.cuda.is_available():
        return
    fraction = float(share)
    assert 0 < fraction <= 1, f"CBQ_TEST_GPU_SHARE must be in (0, 1], got {share}"
    torch.cuda.set_per_process_memory_fraction(fraction)
    from worker.engine import kv_cache

    def budget_in_share(total_bytes: int, free_bytes: int, gpu_memory_utilization: float) -> int:
        held = torch.cuda.memory_allocated()
        return int(total_bytes * fraction * gpu_memory_utilization) - held - kv_cache.ACTIVATION_RESERVE_BYTES

    kv_cache.kv_budget_bytes = budget_in_share


@pytest.fixture(scope="session")
def private_redis_url(tmp_path_factory):
    """The URL of a memory-only redis-server started for this test session (stopped at its end)."""
    if url := os.environ.get("CBQ_TEST_REDIS_URL"):
        yield url
        return
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis"), durable=False)
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture
def real_redis(private_redis_url):
    conn = redis.Redis.from_url(private_redis_url)
    conn.flushdb()
    yield conn
    conn.flushdb()


@pytest.fixture
def fake_redis():
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


@pytest.fixture(params=["fakeredis", pytest.param("redis_server", marks=pytest.mark.redis_server)])
def conn(request):
    return request.getfixturevalue("fake_redis" if request.param == "fakeredis" else "real_redis")
