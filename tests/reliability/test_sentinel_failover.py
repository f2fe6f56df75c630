"""Redis high availability through Sentinel (issue 44): with a `redis+sentinel://` URL, `cbq submit`, a worker,
`cbq wait` and `cbq serve` follow the primary when it is killed with SIGKILL mid-batch and a replica is promoted.
Every request ends with exactly one result and the counters agree: what the old primary acknowledged but had not
replicated yet is put right by the worker's recovery (a lost result runs again, an orphaned chunk is requeued)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from producer import settings, store
from producer.cli import main
from tests.producer.server.serving import ServeProcess, request
from tests.reliability.conftest import REPO_ROOT, SLOW_FAKE, assert_exactly_once, submit_prompts, wait_until
from tests.reliability.harness import WorkerProcess
from tests.reliability.sentinel import SentinelDeployment

N = 120


@pytest.fixture
def deployment(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    d = SentinelDeployment(tmp_path)
    d.start()
    yield d
    d.stop()


def test_a_failover_mid_batch_loses_and_duplicates_nothing(deployment, tmp_path):
    url = deployment.url
    runner = CliRunner()

    def cbq(*args, input=None):
        return runner.invoke(main, [*map(str, args), "--redis-url", url], input=input)

    batch_id = submit_prompts(cbq, tmp_path, N, "--chunk-size", "10")
    worker = WorkerProcess(url, tmp_path / "worker.log", *SLOW_FAKE, "--redis-outage-limit", "60")
    env = {k: v for k, v in os.environ.items() if k != "CBQ_REDIS_URL"}
    waiter = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "wait", batch_id, "--redis-url", url, "--interval", "0.2"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    (tmp_path / "serve").mkdir()
    server = ServeProcess(url, tmp_path / "serve")
    try:
        conn = settings.connect(url, socket_timeout=2)
        wait_until(lambda: store.get_status(conn, batch_id).num_completed >= 40, timeout=30, context=worker.output)
        old_primary = deployment.kill_primary()
        wait_until(lambda: deployment.primary_port() != old_primary, timeout=20)
        out, err = waiter.communicate(timeout=90)
        assert waiter.returncode == 0, (out, err, worker.output())
        assert "Traceback" not in err and "Redis unreachable, retrying" in err, err
        assert worker.proc.poll() is None and "Redis is back" in worker.output(), worker.output()
        assert_exactly_once(deployment.connect_node(deployment.primary_port()), batch_id, N)
        wait_until(lambda: request(server, "GET", "/health", None).status == 200, timeout=10, context=server.log)
        assert request(server, "GET", "/v1/batches", None).json()["object"] == "list"
    finally:
        server.stop()
        worker.kill()
        worker.wait()
        if waiter.poll() is None:
            waiter.kill()
