"""`cbq serve`'s memory while it validates a hostile upload (issue 44, item 2): a file of nothing but duplicate
custom_ids used to cost about 1 KB of server memory per line (every error was kept until the cut to 1,000 when
recorded: 51 -> 1,133 MB RSS for 150 MB). Now the first errors are kept and the others counted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from producer.store.api_batches import MAX_REPORTED_ERRORS
from tests.producer.server.serving import ServeProcess

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.redis_server

KEY = "memory-key"
NUM_LINES = 40_000  # 26 MB; the errors of the unfixed server took about 55 MB more for it
MAX_GROWTH_MB = 25


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def _fail(client, data: bytes, timeout_s: float = 50.0):
    uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch.id)).status == "validating":
        assert time.monotonic() < deadline, "still validating"
        time.sleep(0.2)
    assert batch.status == "failed", batch
    return batch


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc")
def test_a_file_of_duplicate_custom_ids_does_not_grow_the_server(tmp_path, private_redis_url):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    line = {"custom_id": "d" * 500, "method": "POST", "url": "/v1/chat/completions", "body": body}
    data = (json.dumps(line) + "\n").encode()
    server = ServeProcess(private_redis_url, tmp_path, api_keys=KEY)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30)
        _fail(client, data * 3)  # every code path once, so that the baseline has its imports and caches
        before_mb = _peak_rss_mb(server.proc.pid)
        batch = _fail(client, data * NUM_LINES)
        growth_mb = _peak_rss_mb(server.proc.pid) - before_mb
        assert growth_mb < MAX_GROWTH_MB, f"peak RSS grew {growth_mb:.0f} MB validating {len(data) * NUM_LINES >> 20} MB"
        assert batch.errors is not None and len(batch.errors.data) == MAX_REPORTED_ERRORS
        assert batch.errors.data[-1].code == "too_many_errors"
    finally:
        server.stop()
