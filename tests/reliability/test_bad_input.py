"""Input that used to give tracebacks or leave an orphan hash behind (issue 10, item 6): each bad line is
reported as `line N: ...` and nothing is enqueued; Ctrl-C during a submit exits 130 and leaves nothing."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys

import pytest

import producer.store.submit as submit_module
from tests.reliability.conftest import REPO_ROOT, wait_until

GOOD = json.dumps({"prompt": "fine"}).encode()
BAD_LINES = {
    "invalid UTF-8": (b'{"prompt": "caf\xe9"}', "line 2: invalid UTF-8 at byte 16"),
    "5,000-digit integer": (
        b'{"prompt": "x", "max_new_tokens": ' + b"7" * 5000 + b"}",
        "line 2: invalid JSON: a number has too many digits",
    ),
    "100k-deep nesting": (
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "line 2: invalid JSON: nested too deeply",
    ),
    "lone surrogate": (
        b'{"prompt": "ok", "custom_id": "a\\ud800"}',
        "line 2: custom_id: contains a lone UTF-16 surrogate",
    ),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_is_reported_by_number_and_nothing_is_enqueued(case, redis_server, cbq, tmp_path):
    bad, message = BAD_LINES[case]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([GOOD, bad, GOOD]) + b"\n")
    out = cbq("submit", path)
    assert out.exit_code == 1, out.output
    assert message in out.stderr
    assert "Traceback" not in out.output
    assert "1 invalid line(s); nothing was enqueued" in out.stderr
    assert redis_server.connect().keys("*") == []


def test_a_lone_surrogate_inside_a_request_fails_that_request_alone(redis_server, cbq, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([GOOD, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', GOOD]) + b"\n")
    out = cbq("submit", path, "--json")
    assert out.exit_code == 0, out.output
    assert "line 2: messages[0].content: contains a lone UTF-16 surrogate" in out.stderr
    record = json.loads(out.stdout.splitlines()[-1])
    assert (record["num_requests"], record["num_invalid"]) == (3, 1)


@pytest.mark.parametrize("where", ["staging", "commit"])
def test_ctrl_c_during_submit_exits_130_and_leaves_nothing(where, redis_server, cbq, tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(json.dumps({"prompt": f"p{i}"}).encode() + b"\n" for i in range(50)))
    monkeypatch.setattr(submit_module, "STAGING_SLICE", 10)
    real_stage, real_commit = submit_module._stage_requests, submit_module._commit

    def stage_then_interrupt(conn, batch_id, requests, *args):
        real_stage(conn, batch_id, itertools.islice(requests, 30), *args)  # 3 of 5 slices written
        raise KeyboardInterrupt

    def commit_then_interrupt(*args):
        real_commit(*args)
        raise KeyboardInterrupt  # the reply is lost: the batch is complete, and says so

    if where == "staging":
        monkeypatch.setattr(submit_module, "_stage_requests", stage_then_interrupt)
    else:
        monkeypatch.setattr(submit_module, "_commit", commit_then_interrupt)
    out = cbq("submit", path)
    assert out.exit_code == 130, out.output
    conn = redis_server.connect()
    if where == "staging":
        assert "interrupted; nothing was enqueued" in out.stderr
        assert conn.keys("*") == []
    else:
        assert "interrupted after the batch was enqueued" in out.stderr
        assert conn.llen("rq:queue:cbq") == 1


def test_a_real_sigint_while_storing_a_big_file(redis_server, tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(
        b"".join(json.dumps({"prompt": f"prompt {i}" * 4}).encode() + b"\n" for i in range(20_000))
    )
    conn = redis_server.connect()
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "submit", str(path), "--redis-url", redis_server.url],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_until(
        lambda: conn.keys("cbq:batch:*:requests") or proc.poll() is not None, timeout=60, interval=0.005
    )
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr.decode()
    assert b"interrupted; nothing was enqueued" in stderr
    assert conn.keys("*") == []
