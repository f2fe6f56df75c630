"""`cbq wait`, `cbq status` and `cbq results` ride out a Redis outage as the workers do (issue 44, item 4): a
pause longer than the client's socket timeout and a kill -9 with a restart (AOF on) cost a one-line notice on
stderr and no traceback; past --redis-outage-limit the command stops with one line and exit status 3."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from producer.cli import EXIT_REDIS_UNREACHABLE
from tests.reliability.conftest import REPO_ROOT, SLOW_FAKE, assert_exactly_once, submit_prompts

N = 80


def _cbq(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CBQ_REDIS_URL"}
    cmd = [sys.executable, "-m", "producer.cli", *args]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_wait_rides_out_a_pause_and_a_restart(redis_server, start_worker, cbq, tmp_path):
    batch_id = submit_prompts(cbq, tmp_path, N, "--chunk-size", "10")
    worker = start_worker(*SLOW_FAKE, "--redis-outage-limit", "60")
    waiter = _cbq("wait", batch_id, "--redis-url", redis_server.url, "--interval", "0.2")
    time.sleep(1.0)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # longer than the reads' 5 s socket timeout
    time.sleep(6.5)
    redis_server.proc.send_signal(signal.SIGCONT)
    time.sleep(0.5)
    redis_server.kill()
    time.sleep(8)  # longer than redis-py's own retries last
    redis_server.start()
    try:  # the worker's recovery (requeue after --stale-after) took 76 s on a loaded 2-core CI machine, 22 s idle
        out, err = waiter.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        waiter.kill()
        out, err = waiter.communicate()
        raise AssertionError(("cbq wait did not finish", out, err, worker.output())) from None
    assert waiter.returncode == 0, (out, err, worker.output())
    assert "Traceback" not in err, err
    assert "Redis unreachable, retrying" in err and "Redis answers again" in err, err
    assert "completed 80" in out, out
    conn = redis_server.connect()
    assert_exactly_once(conn, batch_id, N)
    status = _cbq("status", batch_id, "--redis-url", redis_server.url)
    assert status.wait(20) == 0, status.communicate()


def test_wait_status_and_results_give_up_after_the_limit_with_one_line(redis_server, cbq, tmp_path):
    batch_id = submit_prompts(cbq, tmp_path, 3)
    redis_server.kill()
    for args in (["wait", batch_id], ["status", batch_id], ["results", batch_id, "-o", str(tmp_path / "o.jsonl")]):
        start = time.monotonic()
        proc = _cbq(*args, "--redis-url", redis_server.url, "--redis-outage-limit", "2")
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == EXIT_REDIS_UNREACHABLE, (args, out, err)
        assert time.monotonic() - start < 15, args
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 2 and lines[0].startswith("Redis unreachable, retrying"), lines
        assert lines[1].startswith(f"Error: cannot reach Redis at {redis_server.url}: Redis unreachable for"), lines
    assert not (tmp_path / "o.jsonl").exists()
